#!/usr/bin/env bash
# Runs on the device machine (GPU image: torch 2.11, triton 3.6, transformers, peft, pytest).
# Carried wheels (.whl): grpcio-health-checking, pytest-asyncio. Logs go to $OUT.
# Usage (from the repo root there): bash benchmarks/device_executor.sh
set -uo pipefail
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
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "${OUT:-/tmp}/gpu.txt"
python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "${OUT:-/tmp}/gpu.txt"
python3 -P -m pytest -p no:cacheprovider -o addopts="" --import-mode=importlib -q -rs \
  tests/executor/test_service.py -k "cuda or bf16" \
  2>&1 | tee "${OUT:-/tmp}/executor_gpu_tests.log" | tail -30
