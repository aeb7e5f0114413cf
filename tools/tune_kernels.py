"""Tunes the LoRA kernels on representative real layer shapes and writes the GPU's table.

    python tools/tune_kernels.py --out FILE [--budget-s 330] [--table BASE.json]

The real layers (kernels/model_shapes.py) have ~170 distinct kernel shapes per rank; tuning
each at every token count would take hours. The tables' nearest-entry rule (kernels/tuning.py)
moves an entry to a nearby shape in log space and rescales its K split to the reduction
length, so this tunes representatives only, in priority order, and stops starting new ones
when the budget is spent (what it did not reach keeps the nearest existing entry):

1. decode shrink of the long reductions (down projections: in 14336 and 28672; rank 8 and 128)
2. decode shrink of short reductions (small models, row layers at tp 4/8: in 1024, 2048) and
   of the output widths the hidden-size grid lacks (rank 128, fused slices)
3. decode expand of the output widths the hidden-size grid lacks (896 to 128256 columns)
4. prefill (1024 and 4096 tokens) shrink and expand of the long and short shapes
5. prefill (4096 tokens) of every distinct tp-1 q/k/v, o, gate/up and down shape, ranks 8 and 128
6. (with --phases) the same shapes at 1024 tokens
7. (with --phases) prefill (1024 and 4096 tokens) of the tensor-parallel per-rank shapes (tp 2/4/8) not in 5

Phases 1-5 run by default. `--phases 5,6,7` tunes prefill only and keeps the base table's decode
entries (all seven take ~4 minutes on an H100). Phase 7 leaves out the shapes phase 5 has, so run it with
6 as well (5,7 alone leaves those shapes without a 1024-token entry). Prefill entries also serve other
token counts by the lookup's rules (kernels/tuning.py), though never a decode token count
(<= tuning.DECODE_MAX_TOKENS) while the table has decode entries: from 257 tokens up.

`--ops expand --ranks 128` keeps the phases' entries of those ops and ranks only; `--only
"expand:14784+14784x128@4096;..."` tunes the named shapes alone, and `--wide` adds candidates at
prefill token counts: together, a sweep that prints every candidate's times.

Token buckets: 1, 17, 255 at decode (every decode T is within 4x of one), 1024 and 4096 at
prefill. Each candidate is timed alone in CUDA graphs for two mixes (1 adapter, and
min(T, 64) adapters); the pick has the smallest worst ratio to the fastest candidate of each
mix. The hidden-size grid's own entries (in 4096 / 8192, slices 1 / 3, rank 8 / 16 / 64) are
not retuned: the result is the base table with entries added.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton

# The tuner times candidates with the kernel benchmark's own harness (benchmarks/).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import real_grid
from bench_kernels import CAPPED_EXPAND, DEV, expand_candidates, measure_ceilings
from bench_kernels import shrink_candidates as grid_shrink_candidates

from loraserve.kernels import tuning

DECODE_TOKENS = (1, 17, 255)
PREFILL_TOKENS = (1024, 4096)
MANY_ADAPTERS = 64

# (phase, op, shape, token counts); shape: (in, slices, rank) for the shrink, (widths, rank) for the expand
PLAN = (
    [(1, "shrink", (k, 1, r), DECODE_TOKENS) for k in (14336, 28672) for r in (8, 128)]
    + [(2, "shrink", s, DECODE_TOKENS) for s in ((2048, 1, 8), (2048, 1, 128), (2048, 3, 8), (2048, 3, 128),
                                                 (1024, 1, 16), (4096, 1, 128), (4096, 3, 128), (4096, 2, 16))]
    + [(3, "expand", (w, r), (1, 255)) for w in ((896,), (2048,), (2048, 512, 512), (14336, 14336), (128256,))
       for r in (8, 128)]
    + [(3, "expand", ((4096,), 128), (1, 255)), (3, "expand", ((4096, 1024, 1024), 128), (1, 255))]
    + [(4, "shrink", (k, 1, r), PREFILL_TOKENS) for k in (14336, 2048) for r in (8, 128)]
    + [(4, "expand", (w, r), PREFILL_TOKENS) for w in ((14336, 14336), (2048,)) for r in (8, 128)]
)  # fmt: skip


def _prefill_plan(phase: int, tp_sizes: tuple[int, ...], tokens: tuple[int, ...], skip=()) -> list:
    """Prefill entries at `tokens` of every distinct shrink and expand shape of the served families'
    q/k/v, o, gate/up and down at `tp_sizes` (per-rank shapes), ranks 8 and 128, the most served
    sizes first; shapes of phase 4 and of `skip` (an earlier phase's plan) left out."""
    from loraserve.kernels import model_shapes

    shapes = [s for s in model_shapes.real_shapes(tp_sizes=tp_sizes) if s.kind in ("qkv", "o", "gate_up", "down")]
    first = ("llama-3-8b", "qwen2.5-7b", "llama-3.2-3b", "llama-3.2-1b", "qwen2.5-14b", "qwen2.5-0.5b")
    shapes.sort(key=lambda s: first.index(s.model) if s.model in first else len(first))
    plan, seen = [], {(op, shape) for _, op, shape, _ in skip}
    for s in shapes:
        for r in (8, 128):
            for op, shape in (("shrink", (s.in_features, len(s.widths), r)), ("expand", (s.widths, r))):
                if (op, shape) not in seen and (4, op, shape, PREFILL_TOKENS) not in PLAN:
                    seen.add((op, shape))
                    plan.append((phase, op, shape, tokens))
    return plan


_PHASE5 = _prefill_plan(5, (1,), (4096,))
PLAN = PLAN + _PHASE5 + _prefill_plan(6, (1,), (1024,)) + _prefill_plan(7, (2, 4, 8), PREFILL_TOKENS, skip=_PHASE5)
DEFAULT_PHASES = (1, 2, 3, 4, 5)


def _split(in_features: int, block_k: int, per_split: int) -> int:
    return tuning.pow2_split(in_features, block_k, per_split)


def shrink_candidates(tokens: int, in_features: int, sr: int) -> list[tuning.ShrinkConfig]:
    """Decode: K splits of 128 to 1024 input columns per program; prefill: the grid tuner's
    candidates with their splits rescaled from in 4096 to this reduction (as the lookup rule does)."""
    n = min(max(16, triton.next_power_of_2(sr)), 64)
    if tokens <= 64:
        rows = [
            (16, n, 64, _split(in_features, 64, 128), 4, 4, 8),
            (16, n, 128, _split(in_features, 128, 256), 4, 4, 16),
            (16, n, 64, _split(in_features, 64, 256), 4, 4, 8),
            (16, n, 128, _split(in_features, 128, 512), 4, 4, 8),
            (16, n, 128, _split(in_features, 128, 128), 4, 4, 16),
        ]
    elif tokens <= 256:
        rows = [
            (16, n, 128, _split(in_features, 128, 512), 4, 4, 16),
            (16, n, 128, _split(in_features, 128, 1024), 4, 4, 8),
            (16, n, 256, _split(in_features, 256, 1024), 4, 3, 4),
            (32, n, 128, _split(in_features, 128, 512), 4, 4, 4),
            (16, n, 64, _split(in_features, 64, 256), 4, 4, 8),
        ]
    else:
        rows = []
        for c in grid_shrink_candidates(tokens, sr):
            split = c.split_k if c.split_k == 1 else _split(in_features, c.block_k, 4096 // c.split_k)
            rows.append((c.block_m, c.block_n, c.block_k, split, c.num_warps, c.num_stages, c.ctas_per_sm))
    return [tuning.ShrinkConfig(*row) for row in dict.fromkeys(rows)]  # fmt: skip


# --wide: more prefill candidates (more warps per tile, larger and smaller tiles, more or fewer
# programs per SM): a sweep of what the default lists leave out, to find which of them earn a place
WIDE_EXPAND = (
    (64, 128, 2, 8, 2, 2),
    (64, 128, 2, 8, 3, 2),
    (64, 128, 4, 8, 3, 2),
    (128, 128, 2, 8, 2, 1),
    (128, 128, 2, 8, 3, 2),
    (64, 256, 1, 8, 2, 2),
    (64, 64, 8, 4, 3, 4),
    (32, 128, 2, 4, 3, 8),
    (32, 64, 4, 4, 3, 8),
    (16, 128, 8, 4, 3, 8),
    (64, 128, 1, 4, 2, 4),
    (64, 128, 1, 4, 2, 8),
    (32, 256, 2, 8, 3, 4),
    (128, 64, 4, 8, 3, 2),
    (64, 64, 2, 4, 2, 8),
    (32, 128, 1, 4, 2, 8),
    # register caps and fewer stages beyond the prefill lists' own (bench_kernels.CAPPED_EXPAND):
    # more blocks resident per SM
    (64, 128, 2, 4, 2, 3, 168),
    (64, 128, 2, 4, 1, 4, 128),
    (32, 128, 2, 4, 1, 4, 128),
    (32, 128, 2, 4, 1, 6, 80),
    (32, 64, 4, 4, 1, 8, 64),
)
WIDE_SHRINK = (  # (block_m, block_n, block_k, columns per K split (0: no split), warps, stages, CTAs per SM[, maxnreg])
    (128, 128, 64, 0, 8, 3, 1),
    (128, 256, 64, 0, 8, 3, 1),
    (64, 256, 64, 0, 8, 3, 1),
    (128, 128, 64, 2048, 8, 3, 1),
    (128, 64, 64, 0, 4, 4, 1),
    (64, 128, 64, 0, 8, 4, 2),
    (64, 64, 64, 0, 4, 4, 3),
    (32, 64, 128, 0, 4, 4, 4),
    (64, 64, 128, 1024, 4, 4, 2),
    (64, 64, 128, 512, 4, 4, 2),
    (32, 64, 128, 1024, 4, 4, 4),
    (128, 64, 64, 2048, 8, 4, 1),
    (64, 128, 128, 0, 8, 3, 2),
    (32, 128, 64, 0, 4, 4, 4),
    # (Tiles over every slice of a q/k/v or gate/up (block_n 256-512, x read once per row block)
    # with 4-8 K splits were timed on an H100 too and won no shape.)
    # (Shared-memory-lean tiles of 2-3 stages, which leave room for the CTAs per SM the table's
    # rank-128 prefill shrinks ask for, were timed on an H100 and scored 1.1-3.8x worse (the
    # worse of the two mixes) than the deeper pipelines: not kept.)
)
_wide = False


def wide_candidates(op: str, tokens: int, shape) -> list:
    """The --wide additions at prefill token counts (none at decode); shape as in PLAN."""
    if not _wide or tokens <= tuning.DECODE_MAX_TOKENS:
        return []
    if op == "expand":
        return [tuning.ExpandConfig(*row) for row in WIDE_EXPAND + tuple(CAPPED_EXPAND)]
    in_features, slices, rank = shape
    full = max(16, triton.next_power_of_2(slices * rank))
    rows = []
    for bm, bn, bk, per_split, warps, stages, ctas, *maxnreg in WIDE_SHRINK:
        split = _split(in_features, bk, per_split) if per_split else 1
        rows.append(tuning.ShrinkConfig(bm, min(bn, full), bk, split, warps, stages, ctas, *maxnreg))
    return rows


def parse_only(text: str) -> list:
    """--only "expand:14784+14784x128@1024,4096;shrink:8192x2x128@4096" -> plan entries (phase 0)."""
    plan = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        try:
            op, rest = item.split(":")
            shape_text, tokens_text = rest.split("@")
            tokens = tuple(int(t) for t in tokens_text.split(","))
            if op == "shrink":
                shape = tuning.parse_shrink_key(shape_text)
            elif op == "expand":
                shape = tuning.parse_expand_key(shape_text)
            else:
                raise ValueError(op)
        except ValueError as exc:
            raise ValueError(
                f"--only entry {item!r}: want op:shape@tokens, e.g. expand:4096+1024+1024x128@4096 "
                f"or shrink:14336x1x8@1024,4096 ({exc})"
            ) from None
        plan.append((0, op, shape, tokens))
    return plan


def pools_for(op, shape, mixes, copies):
    if op == "shrink":
        in_features, slices, rank = shape
        widths = (16,) * slices  # the shrink never reads B: narrow outputs keep the pool small
    else:
        widths, rank = shape
        in_features = 16  # the expand never reads A
    return real_grid.RealPool.make(False, in_features, widths, rank, max(mixes), copies)


def tune_one(key, table, op, shape, tokens, ceil, gen, pool, log, warm=False) -> None:
    """Times each candidate for the two mixes and writes the pick into table[op][shape key][tokens].
    warm: launch each candidate once per mix and time nothing (a compile worker)."""
    if op == "shrink":
        shape_key = tuning.shrink_key(*shape)
        cands = shrink_candidates(tokens, shape[0], shape[1] * shape[2]) + wide_candidates(op, tokens, shape)
    else:
        shape_key = tuning.expand_key(*shape)
        cands = expand_candidates(tokens) + wide_candidates(op, tokens, shape)
    cands = list(dict.fromkeys(cands))
    mixes = (1, min(tokens, MANY_ADAPTERS))
    times = []
    for cand in cands:
        tuning.set_table(key, {op: {shape_key: {str(tokens): tuning.as_dict(cand)}}})
        try:
            if warm:
                for a in mixes:
                    real_grid.measure(pool, tokens, a, ceil, gen, ops=(op,), warm=True)
                continue
            times.append([real_grid.measure(pool, tokens, a, ceil, gen, ops=(op,))[f"{op}_us"] for a in mixes])
        except Exception as exc:  # a candidate that does not fit (shared memory) is skipped
            log(f"tune {op} {shape_key} T={tokens} {cand} failed: {str(exc)[:120]}")
            times.append([float("inf")] * len(mixes))
    if warm:
        return
    if not any(all(v < float("inf") for v in t) for t in times):
        log(f"tune {op} {shape_key} T={tokens}: every candidate failed, no entry written")
        return
    best = [min(t[i] for t in times) for i in range(len(mixes))]
    scores = [max(t[i] / best[i] for i in range(len(mixes))) for t in times]
    pick = min(range(len(cands)), key=scores.__getitem__)
    table[op].setdefault(shape_key, {})[str(tokens)] = tuning.as_dict(cands[pick])
    for cand, t, score in zip(cands, times, scores):
        mark = "*" if cand == cands[pick] else " "
        log(f"tune {op} {shape_key} T={tokens} {mark} {cand} 1 adapter {t[0]:.1f} us, "
            f"{mixes[1]} adapters {t[1]:.1f} us, score {score:.2f}")  # fmt: skip


def tune(base: dict, budget_s: float, out: str, ceil, log=print, part=None, phases=DEFAULT_PHASES, only=None) -> dict:
    """Tunes PLAN's `phases` in order until budget_s; part (i, n): compile worker i of n (every n-th
    shape, untimed). Entries of the other phases stay as the base table has them. only: a plan of
    its own (parse_only) instead of PLAN's phases."""
    gen = torch.Generator(device=DEV).manual_seed(1)
    key = tuning.gpu_key(torch.device(DEV))
    table = json.loads(json.dumps(base))
    for op in ("shrink", "expand"):
        table.setdefault(op, {})
    started = time.time()
    done, left = 0, []
    plan = only if only is not None else [p for p in PLAN if p[0] in phases]
    for index, (phase, op, shape, tokens_list) in enumerate(sorted(plan, key=lambda p: p[0])):
        if part is not None and index % part[1] != part[0]:
            continue
        if part is None and time.time() - started > budget_s:
            left.append((op, shape))
            continue
        pool = pools_for(op, shape, (1, MANY_ADAPTERS), copies=1 if part else 8)
        for tokens in tokens_list:
            tune_one(key, table, op, shape, tokens, ceil, gen, pool, log, warm=part is not None)
            done += 1
        del pool
        torch.cuda.empty_cache()
        if part is not None:
            continue
        with open(out, "w") as f:  # after each shape: a cut-off run keeps what it tuned
            json.dump(table, f, indent=1, sort_keys=True)
            f.write("\n")
        log(f"tune phase {phase} {op} {shape} done at {time.time() - started:.0f} s")
    tuning.set_table(key, table)
    log(f"tuned {done} (shape, tokens) pairs in {time.time() - started:.0f} s; "
        f"not reached (budget {budget_s:.0f} s): {len(left)} shapes {left[:6]}")  # fmt: skip
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the table to write (the base table plus the tuned entries)")
    parser.add_argument("--table", default=None, help="base table (default: this GPU's shipped kernels/configs/ one)")
    parser.add_argument("--budget-s", type=float, default=250.0, help="stop starting new shapes after this")
    parser.add_argument("--warm-s", type=float, default=70.0, help="compile in parallel first, at most this long")
    parser.add_argument("--warm-part", default=None, help=argparse.SUPPRESS)  # i/N: one compile worker
    parser.add_argument(
        "--phases",
        default=",".join(map(str, DEFAULT_PHASES)),
        help="the plan's phases to tune, comma list of 1-7 (see above); the others keep the base table's entries",
    )
    parser.add_argument(
        "--only",
        default=None,
        help='tune these shapes only, e.g. "expand:14784+14784x128@1024,4096;shrink:8192x2x128@4096" '
        "(every candidate's times are printed: with --wide, a sweep)",
    )
    parser.add_argument("--ops", default="shrink,expand", help="tune these ops only (of the plan's phases)")
    parser.add_argument("--ranks", default=None, help="tune these ranks only, comma list (default: every rank of the plan)")
    parser.add_argument(
        "--wide", action="store_true", help="try the WIDE_EXPAND / WIDE_SHRINK candidates too at prefill token counts"
    )
    args = parser.parse_args()
    global _wide
    _wide = args.wide
    try:
        only = parse_only(args.only) if args.only else None
    except ValueError as exc:
        parser.error(str(exc))
    ops = set(args.ops.split(","))
    try:
        ranks = {int(r) for r in args.ranks.split(",")} if args.ranks else None
    except ValueError:
        parser.error(f"--ranks {args.ranks!r}: a comma list of ranks, e.g. 8,128")
    if not ops or ops - {"shrink", "expand"}:
        parser.error(f"--ops {args.ops!r}: shrink and/or expand")
    try:
        phases = tuple(int(p) for p in args.phases.split(","))
    except ValueError:
        phases = ()
    if not phases or any(p not in range(1, 8) for p in phases):
        parser.error(f"--phases {args.phases!r}: a comma list of phases 1-7")
    filtered = ops != {"shrink", "expand"} or ranks is not None
    if only is not None and (filtered or args.phases != parser.get_default("phases")):
        parser.error("--only names its shapes itself: no --phases, --ops or --ranks with it")
    if filtered:
        only = [p for p in PLAN if p[0] in phases and p[1] in ops and (ranks is None or p[2][-1] in ranks)]
        if not only:
            parser.error(f"nothing in phases {args.phases} has ops {args.ops} and ranks {args.ranks}")
    torch.backends.cuda.matmul.allow_tf32 = False
    key = tuning.gpu_key(torch.device(DEV))
    base = json.load(open(args.table)) if args.table else tuning._table(key)
    if args.warm_part:
        part = tuple(int(v) for v in args.warm_part.split("/"))
        tune(base, float("inf"), args.out, None, log=lambda line: None, part=part, phases=phases, only=only)
        return
    if args.warm_s > 0:
        real_grid.warm_in_workers(__file__, sys.argv[1:], args.warm_s)
    ceil = measure_ceilings()
    print(json.dumps({k: round(v, 3) for k, v in ceil.items()}))
    tune(base, args.budget_s, args.out, ceil, log=lambda line: print(line, flush=True), phases=phases, only=only)
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
