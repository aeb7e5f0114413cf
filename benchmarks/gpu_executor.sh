#!/usr/bin/env bash
# The executor's GPU tests and benchmarks, on a CUDA host with torch, triton, transformers, peft
# and pytest installed. Python packages the host lacks can sit as wheels in .whl/ (installed into
# /tmp/site; the executor tests need grpcio-health-checking and pytest-asyncio).
# Usage (from the repo root): bash benchmarks/gpu_executor.sh OUT_DIR [STAGES]
#   STAGES, comma-separated, run in this order (default: test):
#   test:    the executor's and the attention kernels' CUDA tests (graphs, paged attention, the step's
#            token grouping, cuBLAS's setting, service)
#   svc:     the engine's part of them only: graphs, cuBLAS's setting, service and MoE tests (after an engine-only change)
#   graphs:  the graph and cuBLAS tests alone (svc's first part)
#   parallel: the tensor- and expert-parallel GPU tests (NCCL, one GPU per rank; tp 4 needs 4 GPUs)
#   load:    the slot-load GPU tests (tests/executor/test_lora.py, test_slot_scatter.py)
#   lora:    the LoRA kernels' GPU tests (tests/kernels/test_triton_gpu.py, test_split_k_gpu.py, test_pdl_gpu.py;
#            LORA_TESTS replaces the list)
#   pdl:     the programmatic-dependent LoRA launches' GPU tests alone (tests/kernels/test_pdl_gpu.py)
#   ranks:   benchmarks/bench_ranks.py (each LoRA layer of a decode step alone, adapters of ranks 8-64
#            in slots of rank 64 and of their own rank; RANKS_ARGS adds flags, e.g. "--tokens 16", or
#            "--prompts 8x160 --pad-to 1536" for a mixed step)
#   moe:     benchmarks/bench_moe.py (fused MoE + expert LoRA against its floor)
#   attn:    benchmarks/bench_attention.py (paged attention kernels against their floors)
#   skinny:  benchmarks/bench_skinny.py --greedy (the base linears at 1-64 tokens, cuBLAS against the
#            skinny GEMM; the fused greedy pick); writes OUT_DIR/skinny_table.json (SKINNY_ARGS adds flags)
#   engine:  benchmarks/bench_engine.py (decode / prefill / gRPC against the floors; needs
#            var/cache/tokenizers/*/, the tokenizer `make up` converts from the embedded GGUF;
#            ENGINE_ARGS adds flags here and to `mixed`, e.g. "--streams 0 --profile-decode OUT_DIR/prof")
#   prefill: bench_engine.py --prefill 16x256,8x160,1x1024 (PREFILL_CASES replaces the list; PREFILL_ARGS
#            adds flags, e.g. "--batches 32" for cases of more than 8 sequences) over 40 adapters of mixed ranks: prefill steps with and without adapters, and a torch.profiler
#            table of each (OUT_DIR/prof/);
#            PREFILL_TABLES (comma list of JSON files, "shipped" = this GPU's own) runs them once per
#            table in turn, ROUNDS times (default 2, as for tables), without the profile; the log
#            then holds the prefill rows only
#   eager:   bench_engine.py --enforce-eager --streams 0 (the same decode steps without graphs)
#   mixed:   bench_engine.py --ranks 8,16,32,64 --adapters 40 --batches 32,64 --streams 0 (decode with
#            adapters of mixed ranks in slots of the largest)
#   tables:  the decode step's time under several kernel tables, on one host: the mixed case (B=64,
#            40 adapters of ranks 8-64; TABLES_ARGS replaces "--batches 64") once per table of TABLES
#            (comma list of JSON files, "shipped" = this GPU's own) in turn, ROUNDS times (default 2)
#   ablate:  the same mixed case once per entry of ABLATE (comma list, default
#            "none,expand,stream-expand,shrink,lora,none"; ABLATE_ARGS replaces "--batches 64"):
#            bench_engine.py --ablate, what each LoRA kernel holds of the step (benchmarks/lora_ablation.py)
#            (tables, ablate: the executor's default layout, B packed on CUDA since the thirtieth pass of
#            docs/BENCHMARKS.md; add "--packed-b off" to TABLES_ARGS / ABLATE_ARGS for the rows layout)
#   packed:  the same mixed case once per entry of PACKED (comma list of bench_engine.py --packed-b values,
#            default "off,on,off,on"; PACKED_ARGS replaces "--batches 64"): each slot's B in [N, R] rows
#            against packed at its adapter's rank (the executor's --packed-lora-b)
#   bench:   bench_executor.py on random-weight SmolLM2 and Llama-3-8B shapes (SHAPES="smollm2")
#   profile: profile_executor.py on the random SmolLM2-shaped model
#   serve:   benchmarks/serve.py: 1,000 adapters, Zipf 1.0, max_loras 64, 64 clients, Llama-3-8B shape
#            (SERVE_ARGS adds flags, e.g. SERVE_ARGS="--pinned-arena-bytes 0" for no pinned arena),
#            against base alone, the bytes ceiling and transformers + PEFT, in-process and via gRPC;
#            SERVE_PY=FILE runs another copy of serve.py (an earlier one beside its own bench_engine.py)
#   probe:   benchmarks/serve.py --probe: bytes per adapter, pinned H2D bandwidth, cold loads vs the floor
#            (PROBE_ARGS adds flags, e.g. PROBE_ARGS="--trace-load OUT_DIR/trace.txt")
#   pieces:  the probe once per entry of PIECES (comma list of serve.py --stage-piece-mib values, default
#            "0,16,4,0,16,4": a cold load's staged copy whole, in 16 MiB and in 4 MiB pieces; PIECES_ARGS
#            replaces "--probe-loads 5"): the cold-delay trials and the rank-64 cold load, per piece size
#   copywait: benchmarks/bench_copy_wait.py: a step's small input copy beside a slot load's copy (one copy
#            or pieces), copied or read by a kernel
#   h2d:     benchmarks/bench_h2d_call.py: the host time of queuing one host -> device copy, by source memory
#   forkjoin: benchmarks/bench_fork_join.py: a side stream's fork and join inside a CUDA graph, at the o
#            (4096 x 4096) and gate/up (28672 x 4096) shapes
#   arena:   the pinning stalls and the pinned arena's set-up time (bench_pinning.py), and the probe
#            with no pinned arena (--pinned-arena-bytes 0): the cold-load delay the arena removes
# Logs and tables go to OUT_DIR. KERNELS_FROM=DIR runs everything on the kernels in DIR instead of
# kernels/ (a before/after comparison on one host: DIR holds an earlier kernels/ folder);
# EXECUTOR_FROM=DIR likewise for executor/.
set -uo pipefail
OUT=${1:?usage: gpu_executor.sh OUT_DIR [STAGES]}
stages=${2:-test}
has() { [[ ",$stages," == *",$1,"* ]]; }
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
# The installed package maps repo folders under `loraserve`; build that tree from symlinks.
farm=/tmp/farm/loraserve
rm -rf /tmp/farm && mkdir -p "$farm"
for f in loraserve/*.py; do ln -s "$PWD/$f" "$farm/"; done
ln -s "$PWD/adapter_store" "$farm/adapter_store"
[ -d "${EXECUTOR_FROM:-executor}" ] || { echo "EXECUTOR_FROM=$EXECUTOR_FROM: no such folder"; exit 1; }
ln -s "$(realpath "${EXECUTOR_FROM:-executor}")" "$farm/executor"
[ -d "${KERNELS_FROM:-kernels}" ] || { echo "KERNELS_FROM=$KERNELS_FROM: no such folder"; exit 1; }
ln -s "$(realpath "${KERNELS_FROM:-kernels}")" "$farm/kernels"
ln -s "$PWD/protos/loraserve/v1" "$farm/v1"
export PYTHONPATH=/tmp/farm:/tmp/site PYTHONUNBUFFERED=1
{
  date -u; echo "tree $(bash benchmarks/tree_id.sh) (git log --all --format='%h %T' names its commit)"
  echo "kernels from ${KERNELS_FROM:-kernels}, executor from ${EXECUTOR_FROM:-executor}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -P -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
} 2>&1 | tee "$OUT/gpu.txt"
tok=$(ls -d var/cache/tokenizers/*/ 2>/dev/null | head -1)
mixed_decode() {  # the mixed decode case (40 adapters of ranks 8-64 in rank-64 slots, no prefill), its decode rows
  # appended to OUT/$1.log; $2: its batch flags (word-split), the rest: more bench_engine.py flags
  local log=$1 batches=$2; shift 2
  python3 -P benchmarks/bench_engine.py --tokenizer "$tok" --adapters 40 --streams 0 --ranks 8,16,32,64 --no-mixed-graphs \
    --prefill= $batches "$@" 2>>"$OUT/$log.err" | grep "^| decode" | tee -a "$OUT/$log.log" || tail -30 "$OUT/$log.err"
}
if has test; then
  python3 -P -m pytest -p no:cacheprovider -o addopts="" --import-mode=importlib -q -rs \
    tests/kernels/test_attention_gpu.py tests/kernels/test_ops_gpu.py tests/kernels/test_meta_gpu.py \
    tests/kernels/test_linear_gpu.py tests/executor/test_graphs.py tests/executor/test_cublas.py \
    2>&1 | tee "$OUT/kernel_gpu_tests.log" | tail -8
fi
if has svc || has graphs; then
  python3 -P -m pytest -p no:cacheprovider -o addopts="" --import-mode=importlib -q -rs tests/executor/test_graphs.py \
    tests/executor/test_cublas.py 2>&1 | tee "$OUT/graph_gpu_tests.log" | tail -4
fi
if has test || has svc; then
  python3 -P -m pytest -p no:cacheprovider -o addopts="" --import-mode=importlib -q -rs \
    tests/executor/test_service.py tests/executor/test_moe_service.py -k "cuda or bf16" \
    2>&1 | tee "$OUT/executor_gpu_tests.log" | tail -8
  python3 -P -m pytest -p no:cacheprovider -o addopts="" --import-mode=importlib -q -rs -m gpu \
    tests/executor/test_moe.py tests/kernels/test_moe_gpu.py \
    2>&1 | tee "$OUT/moe_gpu_tests.log" | tail -4
fi
if has parallel; then
  # NVLink multicast stays off (NCCL_NVLS_ENABLE=0). Output to a file as it comes: rank 0 ends its
  # process when a rank dies (executor/ranks.py), which would take pytest's summary with it.
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 python3 -P -m pytest -p no:cacheprovider -o addopts="" \
    --import-mode=importlib -q -rs -m gpu tests/executor/test_tp.py tests/executor/test_ep.py \
    > "$OUT/parallel_gpu_tests.log" 2>&1; tail -12 "$OUT/parallel_gpu_tests.log"
fi
if has load; then
  python3 -P -m pytest -p no:cacheprovider -o addopts="" --import-mode=importlib -q -rs -m gpu tests/executor/test_lora.py tests/executor/test_slot_scatter.py \
    2>&1 | tee "$OUT/load_gpu_tests.log" | tail -4
fi
if has lora; then
  python3 -P -m pytest -p no:cacheprovider -o addopts="" --import-mode=importlib -q -rs -m gpu \
    ${LORA_TESTS:-tests/kernels/test_triton_gpu.py tests/kernels/test_split_k_gpu.py tests/kernels/test_pdl_gpu.py} 2>&1 | tee "$OUT/lora_gpu_tests.log" | tail -4
fi
if has pdl; then
  python3 -P -m pytest -p no:cacheprovider -o addopts="" --import-mode=importlib -q -rs -m gpu \
    tests/kernels/test_pdl_gpu.py 2>&1 | tee "$OUT/pdl_gpu_tests.log" | tail -4
fi
if has ranks; then
  python3 benchmarks/bench_ranks.py --out "$OUT" ${RANKS_ARGS:-} 2>&1 | tee "$OUT/bench_ranks.log" | tail -12
fi
if has moe; then
  python3 -P benchmarks/bench_moe.py --out "$OUT/bench-moe" 2>&1 | tee "$OUT/bench_moe.log" | tail -40
fi
if has attn; then
  python3 -P benchmarks/bench_attention.py 2>&1 | tee "$OUT/bench_attention.log" | tail -40
fi
if has skinny; then
  python3 -P benchmarks/bench_skinny.py --greedy --extra 49152x4096 --table-out "$OUT/skinny_table.json" ${SKINNY_ARGS:-} \
    2>"$OUT/bench_skinny.err" | tee "$OUT/bench_skinny.log" | tail -40 || tail -30 "$OUT/bench_skinny.err"
fi
if has engine; then
  [ -n "$tok" ] || { echo "no var/cache/tokenizers/*/: run the executor once on the GGUF first"; exit 1; }
  python3 -P benchmarks/bench_engine.py --tokenizer "$tok" ${ENGINE_ARGS:-} 2>"$OUT/bench_engine.err" | tee "$OUT/bench_engine.log" | tail -30 \
    || tail -30 "$OUT/bench_engine.err"
fi
if has mixed; then
  [ -n "$tok" ] || { echo "no var/cache/tokenizers/*/: run the executor once on the GGUF first"; exit 1; }
  python3 -P benchmarks/bench_engine.py --tokenizer "$tok" --batches 32,64 --adapters 40 --streams 0 --ranks 8,16,32,64 \
    ${ENGINE_ARGS:-} 2>"$OUT/bench_mixed.err" | tee "$OUT/bench_mixed.log" | tail -12 || tail -30 "$OUT/bench_mixed.err"
fi
if has tables; then
  [ -n "$tok" ] || { echo "no var/cache/tokenizers/*/: run the executor once on the GGUF first"; exit 1; }
  tables=${TABLES:-shipped}
  for round in $(seq "${ROUNDS:-2}"); do
    for t in ${tables//,/ }; do
      table_flag=(); [ "$t" = shipped ] || table_flag=(--table "$t")
      echo "== table $t, round $round" | tee -a "$OUT/tables.log"
      mixed_decode tables "${TABLES_ARGS:---batches 64}" "${table_flag[@]}"
    done
  done
fi
if has ablate; then
  [ -n "$tok" ] || { echo "no var/cache/tokenizers/*/: run the executor once on the GGUF first"; exit 1; }
  ablate=${ABLATE:-none,expand,stream-expand,shrink,lora,none}
  for a in ${ablate//,/ }; do
    ablate_flag=(); [ "$a" = none ] || ablate_flag=(--ablate "$a")
    echo "== ablate $a" | tee -a "$OUT/ablate.log"
    mixed_decode ablate "${ABLATE_ARGS:---batches 64}" "${ablate_flag[@]}"
  done
fi
if has packed; then
  [ -n "$tok" ] || { echo "no var/cache/tokenizers/*/: run the executor once on the GGUF first"; exit 1; }
  packed=${PACKED:-off,on,off,on}
  for p in ${packed//,/ }; do
    echo "== packed B $p" | tee -a "$OUT/packed.log"
    mixed_decode packed "${PACKED_ARGS:---batches 64}" --packed-b "$p"
  done
fi
if has prefill; then
  [ -n "$tok" ] || { echo "no var/cache/tokenizers/*/: run the executor once on the GGUF first"; exit 1; }
  prefill_steps() {  # the prefill cases over 40 adapters of mixed ranks; "$@": more bench_engine.py flags
    python3 -P benchmarks/bench_engine.py --tokenizer "$tok" --batches 8 --adapters 40 --streams 0 --ranks 8,16,32,64 \
      --prefill "${PREFILL_CASES:-16x256,8x160,1x1024}" ${PREFILL_ARGS:-} "$@"
  }
  if [ -z "${PREFILL_TABLES:-}" ]; then
    prefill_steps --profile-prefill "$OUT/prof" 2>"$OUT/bench_prefill.err" | tee "$OUT/bench_prefill.log" \
      | grep prefill || tail -30 "$OUT/bench_prefill.err"
  else  # the same prefill steps once per table of PREFILL_TABLES ("shipped" = this GPU's own), ROUNDS times, no profile
    : >"$OUT/bench_prefill.log"; : >"$OUT/bench_prefill.err"
    for round in $(seq "${ROUNDS:-2}"); do
      for t in ${PREFILL_TABLES//,/ }; do
        table_flag=(); [ "$t" = shipped ] || table_flag=(--table "$t")
        echo "== table $t, round $round" | tee -a "$OUT/bench_prefill.log"
        prefill_steps "${table_flag[@]}" 2>>"$OUT/bench_prefill.err" | grep prefill | tee -a "$OUT/bench_prefill.log" \
          || tail -30 "$OUT/bench_prefill.err"
      done
    done
  fi
fi
if has eager; then
  python3 -P benchmarks/bench_engine.py --tokenizer "$tok" --enforce-eager --streams 0 2>"$OUT/bench_eager.err" | tee "$OUT/bench_eager.log" | tail -30 \
    || tail -30 "$OUT/bench_eager.err"
fi
if has bench; then
  [ -n "$tok" ] || { echo "no var/cache/tokenizers/*/: run the executor once on the GGUF first"; exit 1; }
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
tok_flag=${tok:+--tokenizer $tok}  # none: serve.py makes a word-level tokenizer of --vocab ids
# serve / probe: PYTHONSAFEPATH=1 so that their child processes (`python -m loraserve.cli`: the store
# the probe starts) import the symlinked package above, not the repo root's own loraserve/ folder.
if has serve; then
  PYTHONSAFEPATH=1 python3 -P ${SERVE_PY:-benchmarks/serve.py} $tok_flag --shape llama3-8b --adapters 1000 --alpha 1.0 --max-loras 64 --concurrency 64 \
    --requests 500 --prompt-len 64,256 --output-len 64,128 --peft-requests 8 --grpc ${SERVE_ARGS:-} \
    2>"$OUT/serve.err" | tee "$OUT/serve.log" | tail -14 || tail -30 "$OUT/serve.err"
fi
if has probe; then
  PYTHONSAFEPATH=1 python3 -P benchmarks/serve.py $tok_flag --shape llama3-8b --max-loras 64 --probe --cpu-cache-bytes $((16 << 30)) ${PROBE_ARGS:-} \
    2>"$OUT/probe.err" | tee "$OUT/probe.log" | tail -12 || tail -30 "$OUT/probe.err"
fi
if has pieces; then
  for p in $(echo "${PIECES:-0,16,4,0,16,4}" | tr , ' '); do
    echo "== staged copy in pieces of $p MiB (0: whole)" | tee -a "$OUT/pieces.log"
    PYTHONSAFEPATH=1 python3 -P benchmarks/serve.py $tok_flag --shape llama3-8b --max-loras 64 --probe --cpu-cache-bytes $((16 << 30)) \
      --stage-piece-mib "$p" ${PIECES_ARGS:---probe-loads 5} 2>>"$OUT/pieces.err" \
      | grep "^serve benchmark\|^| rank 64\|^| 4 cold\|pinned" | tee -a "$OUT/pieces.log" || tail -30 "$OUT/pieces.err"
  done
fi
if has copywait; then
  python3 -P benchmarks/bench_copy_wait.py 2>&1 | tee "$OUT/copy_wait.log" | tail -14
fi
if has h2d; then
  python3 -P benchmarks/bench_h2d_call.py 2>&1 | tee "$OUT/h2d.log" | tail -40
fi
if has forkjoin; then
  { python3 -P benchmarks/bench_fork_join.py && python3 -P benchmarks/bench_fork_join.py --n 28672 --layers 64; } \
    2>&1 | tee "$OUT/forkjoin.log" | grep -v "^$" | tail -20
fi
if has arena; then
  python3 -P benchmarks/bench_pinning.py 2>&1 | tee "$OUT/pinning.log" | tail -8
  PYTHONSAFEPATH=1 python3 -P benchmarks/serve.py $tok_flag --shape llama3-8b --max-loras 64 --probe --cpu-cache-bytes $((16 << 30)) \
    --pinned-arena-bytes 0 2>"$OUT/probe_no_arena.err" | tee "$OUT/probe_no_arena.log" | tail -12 || tail -30 "$OUT/probe_no_arena.err"
fi
if has profile; then
  python3 -P benchmarks/make_random_model.py --shape smollm2 --tokenizer "$tok" --out /tmp/rnd-profile 2>&1 | tail -1
  for n in ${PROFILE_PROMPTS:-8 32}; do
    python3 benchmarks/profile_executor.py --model-dir /tmp/rnd-profile --device cuda --prompts "$n" --max-tokens 32 --cprofile \
      2>>"$OUT/profile.err" | tee -a "$OUT/profile.log" | head -80
  done
fi
