#!/usr/bin/env bash
# Cold loads (CPU cache -> slot) under two executors on one CUDA host, alternating: the executor in
# BEFORE_DIR (an earlier executor/ folder, e.g. `mkdir -p var/before && git archive REV executor |
# tar -x -C var/before`) and the tree's own, ROUNDS times each (default 2). Each run is
# `gpu_executor.sh ... probe` with PROBE_ARGS (default: 20 loads per rank, the loads only).
# Usage (from the repo root): bash benchmarks/probe_ab.sh OUT_DIR BEFORE_DIR/executor [ROUNDS]
# Writes OUT_DIR/probe_ab.log: per run its executor and the rank rows.
set -uo pipefail
OUT=${1:?usage: probe_ab.sh OUT_DIR BEFORE_DIR/executor [ROUNDS]}
before=${2:?usage: probe_ab.sh OUT_DIR BEFORE_DIR/executor [ROUNDS]}
mkdir -p "$OUT"
work=$(mktemp -d)
for round in $(seq "${3:-2}"); do
  for executor in "$before" executor; do
    run="$work/$round-${executor//\//_}"
    EXECUTOR_FROM=$executor PROBE_ARGS="${PROBE_ARGS:---probe-loads 20 --probe-loads-only}" \
      bash benchmarks/gpu_executor.sh "$run" probe >/dev/null 2>&1
    { echo "== round $round, executor from $executor"; sed -n 2,2p "$run/gpu.txt"; grep "^| rank\|bandwidth" "$run/probe.log" \
        || tail -20 "$run/probe.err"; } | tee -a "$OUT/probe_ab.log"
  done
done
