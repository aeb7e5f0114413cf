#!/usr/bin/env bash
# The LoRA kernels on a CUDA host: GPU tests, then (optionally) tuning and the benchmarks.
#   bash benchmarks/gpu_kernels.sh OUT_DIR STAGES [bench_kernels.py args...]
# STAGES: comma list of smoke,tune,tune-real,test,quick,bench,real,decode,decode-pdl,ranks,attn-sweep,tma-shrink,tma-expand
# (default: test,bench), run in that order. decode: the real shapes at decode token counts only (into
# OUT/decode); decode-pdl: the same with the layers' kernels launched as programmatic dependents
# (into OUT/decode-pdl); ranks: bench_ranks.py (adapters of smaller ranks than their slots, ~2 min; RANKS_ARGS=--sweep
# adds a sweep of launch settings, ~4 min more); attn-sweep: decode attention launch settings at small batches; tma-shrink: bench_tma_shrink.py
# (an experiment: prefill shrink tiles loaded by TMA against the shipped shrink; TMA_ARGS adds flags); tma-expand:
# bench_tma_expand.py (the same for the expand: y, B and the shrink output moved by TMA; TMA_ARGS too). tune: the hidden-size grid (bench_kernels.py --tune-out); tune-real: representative
# real layer shapes (tune_kernels.py, ~6 min); real: the real-shape benchmark (bench_kernels.py
# --real, ~3 min; TUNE_REAL_BUDGET_S shortens the tuning; TUNE_REAL_ARGS adds flags, e.g. "--phases 5,6,7"). Writes under OUT_DIR: run.log (everything), and tuned.json, bench.json,
# bench.md, real.json, real.md, ranks.md when made.
set -uo pipefail
OUT=$(realpath -m "${1:?usage: gpu_kernels.sh OUT_DIR [STAGES] [bench_kernels.py args...]}")
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
LOG="$OUT/run.log"
export PYTHONUNBUFFERED=1
stages=${2:-test,bench}
shift 2 || shift || true
has() { [[ ",$stages," == *",$1,"* ]]; }
stage() { echo "=== $1 $(date -u +%H:%M:%S)" | tee -a "$LOG"; }

stage env
{
  date -u
  echo "tree $(bash benchmarks/tree_id.sh) (git log --all --format='%h %T' names its commit)"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit --format=csv
  python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} 2>&1 | tee -a "$LOG"

# loraserve.kernels without its dependencies: an editable install of this checkout.
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/install.log 2>&1 || { tee -a "$LOG" </tmp/install.log; exit 1; }
python3 -c "import loraserve.kernels as k; print('loraserve.kernels from', k.__file__)" 2>&1 | tee -a "$LOG"

pytest_gpu() {
  python3 -P -m pytest tests/kernels/test_triton_gpu.py tests/kernels/test_split_k_gpu.py tests/kernels/test_pdl_gpu.py -m gpu -q -s \
    -p no:cacheprovider -o addopts="--import-mode=importlib -ra" "$@"
}
use_table() {  # a tuned table replaces this checkout's shipped one, so later stages run on it
  key=$(python3 -c "import torch; from loraserve.kernels.tuning import gpu_key; print(gpu_key(torch.device('cuda')))")
  cp "$1" "kernels/configs/$key.json"
  TABLE=(--table "$1")
}
TABLE=()
if has smoke; then
  stage smoke
  timeout 200 bash -c "$(declare -f pytest_gpu); pytest_gpu -x -k 'odd_shapes or graph or sync or embedding or dispatch'" 2>&1 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" = 0 ] || exit 1
fi
if has tune; then
  stage tune
  timeout "${TUNE_TIMEOUT:-240}" python3 benchmarks/bench_kernels.py --skip-bench --tune-out "$OUT/tuned.json" "$@" 2>&1 | tee -a "$LOG"
  # (copy tuned.json into kernels/configs/ of the repository to keep it)
  [ -f "$OUT/tuned.json" ] && use_table "$OUT/tuned.json"
fi
if has tune-real; then
  stage tune-real
  timeout "${TUNE_REAL_TIMEOUT:-480}" python3 benchmarks/tune_kernels.py --out "$OUT/tuned_real.json" \
    --budget-s "${TUNE_REAL_BUDGET_S:-250}" "${TABLE[@]}" ${TUNE_REAL_ARGS:-} 2>&1 | tee -a "$LOG"
  [ -f "$OUT/tuned_real.json" ] && cp "$OUT/tuned_real.json" "$OUT/tuned.json" && use_table "$OUT/tuned.json"
fi
if has test; then
  stage test
  timeout "${TEST_TIMEOUT:-480}" bash -c "$(declare -f pytest_gpu); pytest_gpu" 2>&1 | tee -a "$LOG"
fi
if has quick; then
  stage quick
  timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/bench_kernels.py --quick --no-baseline --out "$OUT" "${TABLE[@]}" "$@" 2>&1 | tee -a "$LOG"
fi
if has bench; then
  stage bench
  timeout "${BENCH_TIMEOUT:-420}" python3 benchmarks/bench_kernels.py --out "$OUT" "${TABLE[@]}" "$@" 2>&1 | tee -a "$LOG"
fi
if has real; then
  stage real
  timeout "${REAL_TIMEOUT:-360}" python3 benchmarks/bench_kernels.py --real --out "$OUT" "${TABLE[@]}" "$@" 2>&1 | tee -a "$LOG"
fi
decode_stage() {  # decode_stage NAME [extra bench_kernels.py args]: the real shapes at decode token counts
  local name=$1
  shift
  stage "$name"
  timeout "${DECODE_TIMEOUT:-200}" python3 benchmarks/bench_kernels.py --real --out "$OUT/$name" \
    --real-tokens "${DECODE_TOKENS:-1,3,17,64,255}" --real-tp "${DECODE_TP:-1,2}" --real-kinds qkv,o,gate_up,down \
    --warm-s "${DECODE_WARM_S:-45}" --budget-s "${DECODE_BUDGET_S:-70}" "${TABLE[@]}" "$@" 2>&1 | tee -a "$LOG" | tail -30
}
if has decode; then
  decode_stage decode "$@"
fi
if has decode-pdl; then  # the same, each layer's shrink and expand launched as programmatic dependents
  decode_stage decode-pdl --pdl "$@"
fi
if has ranks; then
  stage ranks
  timeout "${RANKS_TIMEOUT:-300}" python3 benchmarks/bench_ranks.py --out "$OUT" ${RANKS_ARGS:-} 2>&1 | tee -a "$LOG"
fi
if has attn-sweep; then
  stage attn-sweep
  timeout "${SWEEP_TIMEOUT:-150}" python3 benchmarks/bench_attention.py --decode-sweep 2>&1 | tee -a "$LOG"
fi
if has tma-shrink; then
  stage tma-shrink
  timeout "${TMA_TIMEOUT:-400}" python3 benchmarks/bench_tma_shrink.py ${TMA_ARGS:-} 2>&1 | tee -a "$LOG" "$OUT/tma_shrink.md"
fi
if has tma-expand; then
  stage tma-expand
  timeout "${TMA_TIMEOUT:-400}" python3 benchmarks/bench_tma_expand.py ${TMA_ARGS:-} 2>&1 | tee -a "$LOG" "$OUT/tma_expand.md"
fi
stage done
