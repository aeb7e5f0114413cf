#!/usr/bin/env bash
# The GPU tests and benchmarks, on a CUDA host with torch, triton, transformers, peft and pytest.
# Python packages the host lacks can sit as wheels in .whl/ (installed into /tmp/site; the executor
# tests need grpcio-health-checking, grpcio-reflection, pytest-asyncio, fastapi and uvicorn).
#
#   bash benchmarks/gpu.sh OUT_DIR [STAGES] [bench_engine.py flags]
#   (from the repo root; STAGES comma-separated, default: test; the flags go to the engine stage,
#   e.g. "--prefill= --streams 0" for the decode rows alone)
#
#   test:     every single-GPU test: kernel-tests and executor-tests (each alone for a shorter run)
#   kernel-tests:   -m gpu tests/kernels: LoRA, attention, ops, skinny GEMM, FP8, MoE kernels
#   executor-tests: graphs, slot loads, MoE, the families, Gemma, FP8 (linears, MoE, KV cache, slots), DoRA,
#             trainable tokens (-m gpu), and the CUDA cases of the service tests
#   parallel: the tensor- and expert-parallel tests (NCCL, one GPU per rank; tp 4 needs 4 GPUs)
#   engine:   bench_engine.py: decode / prefill / gRPC against the floors (Llama-3-8B shape); needs
#             var/cache/tokenizers/*/, the tokenizer `make up` converts from the embedded GGUF
#   serve:    serve.py: 1,000 adapters, Zipf 1.0, 64 slots, 64 clients, against the base model alone,
#             the bytes ceiling and transformers + PEFT, in-process and through gRPC; then serve.py
#             --probe: cold loads against their floor and the delay they put on other requests
#   families: bench_engine.py --shape NAME (decode and prefill, no gRPC streams) for each family's
#             target shape: qwen3-8b, gemma2-9b, gemma3-12b, mistral-7b, phi-3-mini, llama-3.2-3b, qwen2.5-14b
#   fp8:      bench_engine.py with FP8 linears (--quantization fp8, beside its bf16 engine), then with an
#             FP8 KV cache (--kv-cache-dtype fp8, context 4,096, beside bf16 KV) and FP8 adapter slots
#             (--lora-dtype fp8, beside bf16 slots),
#             and serve.py --probe's slot loads with bf16 and FP8 slots
#   dora:     bench_engine.py at B = 32 with 32 plain then 32 DoRA adapters, and serve.py --probe's cold
#             slot loads of plain and DoRA adapters
#   prefix:   bench_prefix.py: a chat workload of 100 adapters, 128 conversations (Llama-3-8B shape), prefix caching off and on,
#             and the time to first token of a cached 2,048-token prefix
#   kernels:  bench_kernels.py on the real layer shapes, bench_skinny.py (bf16, then --fp8: FP8 layers,
#             the table with their skinny_fp8 entries in OUT_DIR/skinny_fp8.json), bench_attention.py,
#             bench_moe.py (FP8 experts beside bf16; the FP8 runs need compute capability 8.9+)
#   tune:     tools/tune_kernels.py: a LoRA kernel table for this GPU (OUT_DIR/tuned.json; copy it into
#             kernels/configs/ to ship it)
# Everything a stage prints goes to OUT_DIR/<stage>.log; the header (GPU, versions, tree) to OUT_DIR/gpu.txt.
set -uo pipefail
OUT=$(realpath -m "${1:?usage: gpu.sh OUT_DIR [STAGES]}")
stages=${2:-test}
engine_flags=("${@:3}")
cd "$(dirname "$0")/.." || exit 1
has() { [[ ",$stages," == *",$1,"* ]]; }
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
# The installed package maps the repo's folders under `loraserve` (pyproject.toml); a tree of links does the same.
farm=/tmp/farm/loraserve
rm -rf /tmp/farm && mkdir -p "$farm"
for f in loraserve/*.py; do ln -s "$PWD/$f" "$farm/"; done
for d in adapter_store executor kernels; do ln -s "$PWD/$d" "$farm/$d"; done
ln -s "$PWD/protos/loraserve/v1" "$farm/v1"
# PYTHONSAFEPATH: child processes (the store that serve.py starts) import the linked package, not the repo's folders.
export PYTHONPATH=/tmp/farm:/tmp/site PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
# NVLink multicast stays off in NCCL and torch.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
tree_id() {  # the git tree of this copy as it is (tracked and new files), without touching the index
  local idx; idx=$(mktemp)
  cp .git/index "$idx" 2>/dev/null
  { GIT_INDEX_FILE=$idx git add -A && GIT_INDEX_FILE=$idx git rm -r -q --cached --ignore-unmatch .whl var \
    && GIT_INDEX_FILE=$idx git write-tree; } 2>/dev/null || echo unknown
  rm -f "$idx"
}
{
  date -u
  echo "tree $(tree_id) (git log --all --format='%h %T' names its commit)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
} 2>&1 | tee "$OUT/gpu.txt"
pytest_q() { python3 -m pytest -p no:cacheprovider -o addopts="" --import-mode=importlib -q -rs "$@"; }
tok=$(ls -d var/cache/tokenizers/*/ 2>/dev/null | head -1)
need_tok() { [ -n "$tok" ] || { echo "no var/cache/tokenizers/*/: run 'make up' once (it converts the GGUF's tokenizer)"; exit 1; }; }

has test && stages+=",kernel-tests,executor-tests"
if has kernel-tests; then
  pytest_q -m gpu tests/kernels >"$OUT/kernel-tests.log" 2>&1
  grep -E "passed|failed|error" "$OUT/kernel-tests.log" | tail -2
fi
if has executor-tests; then
  { pytest_q -m gpu tests/executor/test_graphs.py tests/executor/test_cublas.py tests/executor/test_lora.py \
      tests/executor/test_slot_scatter.py tests/executor/test_slot_copies.py tests/executor/test_moe.py tests/executor/test_families.py tests/executor/test_gemma.py \
      tests/executor/test_fp8_service.py tests/executor/test_fp8_moe.py tests/executor/test_dora.py tests/executor/test_trainable_tokens.py \
      tests/executor/test_kv_fp8.py tests/executor/test_lora_fp8.py tests/executor/test_fp8_act_quant.py
    pytest_q tests/executor/test_service.py tests/executor/test_moe_service.py -k "cuda or bf16"
  } >"$OUT/executor-tests.log" 2>&1
  grep -E "passed|failed|error" "$OUT/executor-tests.log" | tail -4
fi
if has parallel; then
  # To a file as it comes: rank 0 ends its process when a rank dies, which would take pytest's summary with it.
  { pytest_q -m gpu tests/executor/test_tp.py tests/executor/test_ep.py tests/executor/test_dora.py tests/executor/test_trainable_tokens.py
    pytest_q -m gpu tests/executor/test_families.py -k tp2
    pytest_q -m gpu tests/executor/test_gemma.py -k nccl
  } >"$OUT/parallel.log" 2>&1
  tail -12 "$OUT/parallel.log"
fi
if has engine; then
  need_tok
  python3 benchmarks/bench_engine.py --tokenizer "$tok" "${engine_flags[@]}" 2>"$OUT/engine.err" | tee "$OUT/engine.log" | tail -30 \
    || tail -30 "$OUT/engine.err"
fi
if has serve; then
  python3 benchmarks/serve.py ${tok:+--tokenizer $tok} --shape llama3-8b --adapters 1000 --alpha 1.0 --max-loras 64 \
    --concurrency 64 --requests 500 --prompt-len 64,256 --output-len 64,128 --peft-requests 8 --grpc \
    2>"$OUT/serve.err" | tee "$OUT/serve.log" | tail -14 || tail -30 "$OUT/serve.err"
  python3 benchmarks/serve.py ${tok:+--tokenizer $tok} --shape llama3-8b --max-loras 64 --probe --cpu-cache-bytes $((16 << 30)) \
    2>"$OUT/probe.err" | tee "$OUT/probe.log" | tail -12 || tail -30 "$OUT/probe.err"
fi
fresh() { : >"$OUT/$1.log"; : >"$OUT/$1.err"; }  # a stage's logs, emptied once before its runs append
engine() {  # engine LOG_NAME FLAGS...: one bench_engine.py run, its table appended to OUT/LOG_NAME.log
  local name=$1; shift
  python3 benchmarks/bench_engine.py --tokenizer "$tok" "$@" 2>>"$OUT/$name.err" | tee -a "$OUT/$name.log" | tail -14 \
    || tail -20 "$OUT/$name.err"
}
if has families; then
  need_tok; fresh families
  for shape in qwen3-8b gemma2-9b gemma3-12b mistral-7b phi-3-mini llama-3.2-3b qwen2.5-14b; do
    engine families --shape "$shape" --streams 0
  done
fi
if has fp8; then
  need_tok; fresh fp8
  engine fp8 --quantization fp8 --streams 0
  engine fp8 --kv-cache-dtype fp8 --context 4096 --streams 0 --prefill= --adapters 0
  engine fp8 --context 4096 --streams 0 --prefill= --adapters 0
  engine fp8 --streams 0 --prefill=
  engine fp8 --lora-dtype fp8 --streams 0 --prefill=
  for d in auto fp8; do  # slot loads: bf16 slots, then FP8 slots (quantized on the device)
    python3 benchmarks/serve.py --tokenizer "$tok" --shape llama3-8b --max-loras 64 --probe --probe-loads-only --lora-dtype $d \
      2>>"$OUT/fp8.err" | tee -a "$OUT/fp8.log" | tail -8 || tail -20 "$OUT/fp8.err"
  done
fi
if has dora; then
  need_tok; fresh dora
  engine dora --batches 32 --adapters 32 --streams 0 --prefill=
  engine dora --batches 32 --adapters 32 --streams 0 --prefill= --dora
  for d in "" --dora; do
    python3 benchmarks/serve.py --tokenizer "$tok" --shape llama3-8b --max-loras 64 --probe --probe-loads-only $d \
      2>>"$OUT/dora.err" | tee -a "$OUT/dora.log" | tail -8 || tail -20 "$OUT/dora.err"
  done
fi
if has prefix; then
  python3 benchmarks/bench_prefix.py --shape llama3-8b --conversations 128 2>"$OUT/prefix.err" | tee "$OUT/prefix.log" | tail -12 \
    || tail -30 "$OUT/prefix.err"
fi
if has kernels; then
  { python3 benchmarks/bench_kernels.py --real --out "$OUT/kernels"
    python3 benchmarks/bench_skinny.py --greedy
    python3 benchmarks/bench_skinny.py --fp8 --table-out "$OUT/skinny_fp8.json"
    python3 benchmarks/bench_attention.py
    python3 benchmarks/bench_moe.py --fp8 --out "$OUT/moe"
  } >"$OUT/kernels.log" 2>&1
  tail -40 "$OUT/kernels.log"
fi
if has tune; then
  python3 tools/tune_kernels.py --out "$OUT/tuned.json" 2>&1 | tee "$OUT/tune.log" | tail -20
fi
