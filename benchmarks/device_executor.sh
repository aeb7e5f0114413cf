#!/usr/bin/env bash
# Runs on the device machine (GPU image: torch 2.11, triton 3.6, transformers, peft, pytest).
# Carried: .whl/ (grpcio-health-checking, pytest-asyncio wheels) and, for the bench stage,
# var/cache/ (the SmolLM2 tokenizer the executor converted from the GGUF; `make up` writes it).
# Usage (from the repo root there): bash benchmarks/device_executor.sh [test,bench]
#   test:  the executor's CUDA integration tests
#   bench: bench_executor.py on random-weight models of SmolLM2-135M and Llama-3-8B shapes
#          (SHAPES="smollm2" to run one)
#   profile: profile_executor.py (8 and 32 prompts) on the random SmolLM2-shaped model
# Logs and tables go to $OUT.
set -uo pipefail
stages=${1:-test}
has() { [[ ",$stages," == *",$1,"* ]]; }
OUT=${OUT:-/tmp/executor-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
# The installed package maps repo folders under `loraserve`; build that tree from symlinks.
farm=/tmp/farm/loraserve
rm -rf /tmp/farm && mkdir -p "$farm"
for f in loraserve/*.py; do ln -s "$PWD/$f" "$farm/"; done
ln -s "$PWD/adapter_store" "$farm/adapter_store"
ln -s "$PWD/executor" "$farm/executor"
ln -s "$PWD/kernels" "$farm/kernels"
ln -s "$PWD/protos/loraserve/v1" "$farm/v1"
export PYTHONPATH=/tmp/farm:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$OUT/gpu.txt"
if has test; then
  python3 -P -m pytest -p no:cacheprovider -o addopts="" --import-mode=importlib -q -rs \
    tests/executor/test_service.py -k "cuda or bf16" \
    2>&1 | tee "$OUT/executor_gpu_tests.log" | tail -30
fi
if has bench; then
  tok=$(ls -d var/cache/tokenizers/*/ | head -1)
  [ -n "$tok" ] || { echo "no var/cache/tokenizers/*: run the executor once on the GGUF here first"; exit 1; }
  for shape in ${SHAPES:-smollm2 llama3-8b}; do
    python3 -P benchmarks/make_random_model.py --shape "$shape" --tokenizer "$tok" --out "/tmp/rnd-$shape" 2>&1 | tail -1 | tee -a "$OUT/bench.log"
    for n in 8 32; do
      echo "=== $shape, $n prompts $(date -u +%H:%M:%S)" | tee -a "$OUT/bench.log"
      python3 -P benchmarks/bench_executor.py --model-dir "/tmp/rnd-$shape" --device cuda --max-tokens 64 --repeat 3 \
        --prompts "$n" 2>>"$OUT/bench.err" | tee -a "$OUT/bench.log" | tail -8
    done
    rm -rf "/tmp/rnd-$shape"
  done
fi
if has profile; then
  tok=$(ls -d var/cache/tokenizers/*/ | head -1)
  python3 -P benchmarks/make_random_model.py --shape smollm2 --tokenizer "$tok" --out /tmp/rnd-profile 2>&1 | tail -1
  for n in ${PROFILE_PROMPTS:-8 32}; do
    python3 benchmarks/profile_executor.py --model-dir /tmp/rnd-profile --device cuda --prompts "$n" --max-tokens 32 --cprofile \
      2>>"$OUT/profile.err" | tee -a "$OUT/profile.log" | head -80
  done
fi
