#!/usr/bin/env bash
# The serve benchmark under two copies of benchmarks/ on one CUDA host, alternating: the serve.py in
# BEFORE_DIR (an earlier benchmarks/ folder, e.g. `mkdir -p var/before && git archive REV benchmarks |
# tar -x -C var/before`) and the tree's own, ROUNDS times each (default 1). Each run is
# `gpu_executor.sh ... serve` with SERVE_ARGS (default: --peft-requests 0); the BEFORE runs with
# BEFORE_ARGS when given (so `BEFORE_ARGS="... --some-flag 0" serve_ab.sh OUT benchmarks` compares
# two settings of the tree's own serve.py).
# Usage (from the repo root): bash benchmarks/serve_ab.sh OUT_DIR BEFORE_DIR/benchmarks [ROUNDS]
# Writes OUT_DIR/serve_ab.log: per run its serve.py and the result rows.
set -uo pipefail
OUT=${1:?usage: serve_ab.sh OUT_DIR BEFORE_DIR/benchmarks [ROUNDS]}
before=${2:?usage: serve_ab.sh OUT_DIR BEFORE_DIR/benchmarks [ROUNDS]}
mkdir -p "$OUT"
work=$(mktemp -d)
for round in $(seq "${3:-1}"); do
  for side in before after; do
    bench=benchmarks args=${SERVE_ARGS:---peft-requests 0}
    [ $side = before ] && bench=$before args=${BEFORE_ARGS:-$args}
    run="$work/$round-$side"
    SERVE_PY=$bench/serve.py SERVE_ARGS="$args" bash benchmarks/gpu_executor.sh "$run" serve >/dev/null 2>&1
    { echo "== round $round, $side: serve.py from $bench, SERVE_ARGS=$args"; sed -n 2,2p "$run/gpu.txt"
      grep "^| " "$run/serve.log" || tail -20 "$run/serve.err"; } | tee -a "$OUT/serve_ab.log"
  done
done
rm -rf "$work"
