"""The real-shape grid: one LoRA layer of a real model's rank (kernels/model_shapes.py), timed in CUDA graphs.

Shared by `bench_kernels.py --real` (the benchmark) and `tune_kernels.py` (the tuner).

Floor of a case = max(bytes / copy bandwidth, FLOPs / bf16 rate), no launches in it; the
launches-adjusted ratio is (time - 2 x an empty graph-replayed launch) / floor, i.e. a case
meets "time <= 1.5 x floor + two launches" when it is <= 1.5. Bytes: x rows of adapter tokens
(embedding: the gathered A rows and the ids), A and B of each active adapter once, buf (fp32)
written for all rows and read for adapter rows, y rows of adapter tokens read and written.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
from bench_kernels import DEV, DTYPE, capture, offsets_of, token_slots
from triton.testing import do_bench

from loraserve.kernels import lora_embedding_shrink, lora_expand, lora_shrink, make_lora_meta, model_shapes, tuning
from loraserve.kernels.meta import ShrinkWorkspace

DECODE_MAX_TOKENS = tuning.DECODE_MAX_TOKENS
PREFILL_MIN_TOKENS = 1024
POOL_BYTES = 8 << 30  # weights of one (shape, rank) pool, all copies together
DECODE_MS = dict(warmup=3, rep=12)
PREFILL_MS = dict(warmup=5, rep=20)


@dataclass
class RealPool:
    """Slot buffers of one kernel shape and rank, in several copies (one per layer of a graph replay).

    linear:    A [L, S, R, in], B [L, N, R]
    embedding: A [L, vocab, R], B [L, N, R] (in_features is the vocab)
    """

    embedding: bool
    in_features: int
    widths: tuple[int, ...]
    rank: int
    weights: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def slots(self) -> int:
        return self.weights[0][0].shape[0]

    @staticmethod
    def make(embedding, in_features, widths, rank, slots, copies=8):
        per_copy = slots * (len(widths) * rank * in_features + sum(widths) * rank) * 2
        copies = max(1, min(copies, POOL_BYTES // max(per_copy, 1)))

        def one():
            if embedding:
                a = torch.randn(slots, in_features, rank, device=DEV, dtype=DTYPE)
            else:
                a = torch.randn(slots, len(widths), rank, in_features, device=DEV, dtype=DTYPE) * in_features**-0.5
            b = torch.randn(slots, sum(widths), rank, device=DEV, dtype=DTYPE) * rank**-0.5
            return a, b

        return RealPool(embedding, in_features, tuple(widths), rank, [one() for _ in range(copies)])


def floor_us(pool: RealPool, tokens, lora_tokens, adapters, ceil) -> float:
    s, r, k, n = len(pool.widths), pool.rank, pool.in_features, sum(pool.widths)
    if pool.embedding:
        reads = tokens * 8 + lora_tokens * r * 2 + adapters * n * r * 2
        flops = 2 * lora_tokens * n * r
    else:
        reads = lora_tokens * k * 2 + adapters * (s * r * k + n * r) * 2
        flops = 2 * lora_tokens * k * s * r + 2 * lora_tokens * n * r
    moved = reads + s * tokens * r * 4 + s * lora_tokens * r * 4 + 2 * lora_tokens * n * 2
    return max(moved / ceil["copy_bytes_per_s"], flops / ceil["bf16_flops_per_s"]) * 1e6


DENSE_OPS = ("dense", "dense_shrink")  # the cuBLAS reference (measure's dense): one adapter, linear layers


def graph_sets(tokens) -> int:
    return 8 if tokens <= DECODE_MAX_TOKENS else 4 if tokens <= 1024 else 2


def measure(pool: RealPool, tokens, adapters, ceil, gen, ops=("layer",), warm=False, pdl=False) -> dict:
    """Graph time per layer (us) of each op in ops ("layer", "shrink", "expand", "dense",
    "dense_shrink") and the floor. The dense ops are the cuBLAS reference of one adapter's linear
    layer (whole layer / shrink alone), timed only in such cases.

    warm: run each op once, eagerly, and time nothing (a compile-only pass, see warm_in_workers).
    pdl: decode shrinks and expands launched as programmatic dependents (each layer's expand starts
    during its shrink, the next layer's shrink during the expand: the graph's layers in a chain)."""
    follow = dict(pdl=True) if pdl else {}  # (no keyword at all without it: older trees take none)
    distinct = max(1, min(adapters, tokens, pool.slots))
    slots = token_slots(tokens, tokens, distinct, gen)
    meta = make_lora_meta(slots, pool.slots)
    offsets = offsets_of(pool.widths)
    sets = []
    for i in range(1 if warm else min(graph_sets(tokens), len(pool.weights))):
        if pool.embedding:
            x = torch.randint(0, pool.in_features, (tokens,), device=DEV, generator=gen)
        else:
            x = torch.randn(tokens, pool.in_features, device=DEV, dtype=DTYPE, generator=gen)
        y = torch.randn(tokens, offsets[-1], device=DEV, dtype=DTYPE, generator=gen)
        buf = torch.zeros(len(pool.widths), tokens, pool.rank, device=DEV)
        sets.append((x, y, buf, *pool.weights[i]))

    # Decode layers take their shrink outputs from one workspace zeroed once per replay, as the
    # engine's decode graphs do (executor/engine/graphs.py: one memset per step, not one per split-K
    # layer); prefill layers zero their own, as the engine's prefill steps do.
    workspace = None
    if tokens <= DECODE_MAX_TOKENS and not pool.embedding:
        workspace = torch.zeros(len(sets) * len(pool.widths) * tokens * pool.rank, dtype=torch.float32, device=DEV)

    def layer(i, op):
        x, y, buf, lora_a, lora_b = sets[i]
        if op != "expand":
            if pool.embedding:
                lora_embedding_shrink(x, lora_a, meta, out=buf)
            else:
                buf = lora_shrink(x, lora_a, meta, out=None if workspace is not None else buf, **follow)
        if op != "shrink":
            lora_expand(y, buf, lora_b, offsets, meta, **follow)

    def dense(i, op):
        """The same layer of one adapter as plain cuBLAS GEMMs (torch.mm / addmm_): no gather, no
        block list, a bf16 shrink output; one expand GEMM per slice."""
        x, y, _, lora_a, lora_b = sets[i]
        s, r = len(pool.widths), pool.rank
        h = torch.mm(x, lora_a[0].reshape(s * r, pool.in_features).t())
        if op == "dense":
            for j in range(s):
                y[:, offsets[j] : offsets[j + 1]].addmm_(h[:, j * r : (j + 1) * r], lora_b[0][offsets[j] : offsets[j + 1]].t())

    def step(op):
        if op in DENSE_OPS:
            for i in range(len(sets)):
                dense(i, op)
            return
        if workspace is not None and op != "expand":
            workspace.zero_()
            meta.shrink_workspace = ShrinkWorkspace(workspace)
        for i in range(len(sets)):
            layer(i, op)
        meta.shrink_workspace = None

    if warm:
        for op in ops:
            if op not in DENSE_OPS:  # (cuBLAS compiles nothing)
                step(op)
        return {}
    result = dict(distinct=distinct, sets=len(sets), floor_us=floor_us(pool, tokens, tokens, distinct, ceil))
    timing = DECODE_MS if tokens <= DECODE_MAX_TOKENS else PREFILL_MS
    for op in ops:
        if op in DENSE_OPS and (pool.embedding or distinct != 1):
            continue  # the dense reference exists for one adapter's linear layer only
        graph = capture(lambda: step(op))
        result[f"{op}_us"] = do_bench(graph.replay, return_mode="median", **timing) * 1e3 / len(sets)
        del graph
    return result


def attributions(shapes):
    """kernel shape -> the (model, kind, tp) layers that have it."""
    return {k: [(s.model, s.kind, s.tp) for s in v] for k, v in model_shapes.kernel_shapes(shapes).items()}


def ordered_shapes(shapes):
    """Kernel shapes, tp 1 layers first, then row-parallel (o, down) per-rank shapes, then the rest:
    a run cut off by its time budget has covered every model at tp 1 and the long reductions first."""
    groups = model_shapes.kernel_shapes(shapes)

    def priority(key):
        layers = groups[key]
        if any(s.tp == 1 for s in layers):
            return 0
        if any(s.kind in ("o", "down") for s in layers):
            return 1
        return 2

    return sorted(groups, key=lambda k: (priority(k), k[1], k[2]))


def summarize(rows, launch_us) -> list[str]:
    """Target lines and the summary by layer kind and by model (a row counts for every layer of its shape)."""

    def stats(values):
        if not values:
            return "no cases"
        return f"median {statistics.median(values):.2f}x, max {max(values):.2f}x over {len(values)}"

    decode = [r for r in rows if r["tokens"] <= DECODE_MAX_TOKENS]
    prefill = [r for r in rows if r["tokens"] >= PREFILL_MIN_TOKENS]
    dec_miss = [r for r in decode if r["adj"] > 1.5]
    pre_miss = [r for r in prefill if r["ratio"] > 1.6]
    pre_ratios = [r["ratio"] for r in prefill]
    lines = [
        f"empty graph-replayed launch: {launch_us:.2f} us; adj = (time - 2 launches) / floor",
        *dense_lines(rows),
        f"decode (<= {DECODE_MAX_TOKENS} tokens), adj: {stats([r['adj'] for r in decode])}; "
        f"over 1.5 (target: none): {len(dec_miss)}",
        f"decode, time / floor: {stats([r['ratio'] for r in decode])}",
        f"decode, time / (floor + 2 launches): {stats([r['with_launches'] for r in decode])}; "
        f"over 1.5: {sum(r['with_launches'] > 1.5 for r in decode)}",
        f"prefill (>= {PREFILL_MIN_TOKENS} tokens), time / floor: {stats(pre_ratios)}; "
        f"target median <= 1.3: {'met' if pre_ratios and statistics.median(pre_ratios) <= 1.3 else 'not met'}; "
        f"over 1.6 (target: none): {len(pre_miss)}",
        "",
        "| layer kind | decode adj | decode time/floor | prefill time/floor |",
        "|---|---|---|---|",
    ]
    for kind in model_shapes.KINDS:
        sel = [r for r in rows if any(a[1] == kind for a in r["layers"])]
        lines.append(row_of(kind, sel))
    lines += ["", "| model | decode adj | decode time/floor | prefill time/floor |", "|---|---|---|---|"]
    for fam in model_shapes.FAMILIES:
        sel = [r for r in rows if any(a[0] == fam.name for a in r["layers"])]
        lines.append(row_of(fam.name, sel))
    return lines


def dense_lines(rows) -> list[str]:
    """The cuBLAS reference beside the kernels, over the cases that have it (one adapter, linear)."""
    lines = []
    for name, sel in (
        ("decode", [r for r in rows if "dense_us" in r and r["tokens"] <= DECODE_MAX_TOKENS]),
        ("prefill", [r for r in rows if "dense_us" in r and r["tokens"] >= PREFILL_MIN_TOKENS]),
    ):
        if not sel:
            continue
        ours = [r["ratio"] for r in sel]
        dense = [r["dense_us"] / r["floor_us"] for r in sel]
        line = (
            f"{name}, one adapter, {len(sel)} linear cases: time / floor median {statistics.median(ours):.2f}x "
            f"(over 1.6: {sum(v > 1.6 for v in ours)}), cuBLAS dense layer {statistics.median(dense):.2f}x "
            f"(over 1.6: {sum(v > 1.6 for v in dense)}); kernels / cuBLAS median "
            f"{statistics.median(r['time_us'] / r['dense_us'] for r in sel):.2f}, "
            f"kernels faster in {sum(r['time_us'] < r['dense_us'] for r in sel)}"
        )
        both = [r for r in sel if "shrink_us" in r and "dense_shrink_us" in r]
        if both:
            line += (
                f"; shrink / cuBLAS shrink median {statistics.median(r['shrink_us'] / r['dense_shrink_us'] for r in both):.2f}"
            )
        by_kind = []
        for kind in model_shapes.KINDS:
            of_kind = [r for r in sel if any(a[1] == kind for a in r.get("layers", ()))]
            if of_kind:
                by_kind.append(
                    f"{kind} {statistics.median(r['ratio'] for r in of_kind):.2f} / "
                    f"{statistics.median(r['dense_us'] / r['floor_us'] for r in of_kind):.2f}"
                )
        if by_kind:
            line += "; by kind, kernels / cuBLAS time over floor: " + ", ".join(by_kind)
        lines.append(line)
    return lines


def row_of(name, rows) -> str:
    def stats(values):
        return f"{statistics.median(values):.2f} / {max(values):.2f} ({len(values)})" if values else "-"

    dec = [r for r in rows if r["tokens"] <= DECODE_MAX_TOKENS]
    pre = [r for r in rows if r["tokens"] >= PREFILL_MIN_TOKENS]
    return (
        f"| {name} | {stats([r['adj'] for r in dec])} | {stats([r['ratio'] for r in dec])} | {stats([r['ratio'] for r in pre])} |"
    )


HEADER = "| in | widths | rank | tokens | adapters | floor us | time us | time/floor | adj | time/(floor+2L) | layers |"
SEPARATOR = "|" + "---|" * (HEADER.count("|") - 1)


def row_text(r) -> str:
    layers = ", ".join(f"{m} {k} tp{tp}" for m, k, tp in r["layers"][:3]) + (
        f" +{len(r['layers']) - 3}" if len(r["layers"]) > 3 else ""
    )
    widths = "+".join(str(w) for w in r["widths"])
    return (
        f"| {r['in']} | {widths} | {r['rank']} | {r['tokens']} | {r['adapters']} | {r['floor_us']:.2f} "
        f"| {r['time_us']:.1f} | {r['ratio']:.2f} | {r['adj']:.2f} | {r['with_launches']:.2f} | {layers} |"
    )


def cases(tokens_list, adapters_list, kinds):
    """(tokens, adapters) of one (shape, rank): each adapter count capped at T, duplicates dropped;
    lm_head-only shapes skip prefill token counts (logits are computed for sampled rows only)."""
    out = []
    for tokens in tokens_list:
        if kinds == {"lm_head"} and tokens > DECODE_MAX_TOKENS:
            continue
        for adapters in adapters_list:
            case = (tokens, min(adapters, tokens))
            if case not in out:
                out.append(case)
    return out


def bench(ceil, tps, ranks, tokens_list, adapters_list, kinds, budget_s, on_row=print, part=None, pdl=False, ops=("layer",)):
    """Every kernel shape of the real layers (ordered_shapes), each rank and case, until budget_s.

    part (i, n): the compile-only pass of worker i of n (every n-th shape, nothing timed).
    pdl: as in measure. ops: as in measure; "layer" always (the rows' time), "shrink" and "expand"
    add each kernel alone (shrink_us, expand_us: the shrink's includes zeroing its output when its
    K split adds into it) and the configs the lookup gave (shrink_cfg, expand_cfg).
    Returns (rows, shapes not measured for lack of time)."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    shapes = [s for s in model_shapes.real_shapes(tp_sizes=tps) if s.kind in kinds]
    layers = attributions(shapes)
    started = time.time()
    rows, left = [], []
    for index, key in enumerate(ordered_shapes(shapes)):
        if part is not None and index % part[1] != part[0]:
            continue
        if time.time() - started > budget_s:
            left.append(key)
            continue
        cls, in_features, widths = key
        for rank in ranks:
            todo = cases(tokens_list, adapters_list, {k for _, k, _ in layers[key]})
            if not todo:  # an lm_head-only shape in a run of prefill token counts only
                continue
            slots = max(a for _, a in todo)
            pool = RealPool.make(cls == "embedding", in_features, widths, rank, slots, copies=1 if part else 8)
            for tokens, adapters in todo:
                try:
                    res = measure(pool, tokens, adapters, ceil, gen, ops=ops, warm=part is not None, pdl=pdl)
                except Exception as exc:  # one failing case (memory, a config over a limit) ends no run
                    on_row(f"failed: in {in_features} widths {widths} rank {rank} T={tokens}: {str(exc)[:160]}")
                    continue
                if part is not None:
                    continue
                t, floor = res["layer_us"], res["floor_us"]
                row = dict(
                    kind=cls, layers=layers[key], widths=widths, rank=rank, tokens=tokens, adapters=res["distinct"],
                    floor_us=floor, time_us=t, ratio=t / floor, adj=(t - 2 * ceil["empty_launch_us"]) / floor,
                    with_launches=t / (floor + 2 * ceil["empty_launch_us"]),
                    sets=res["sets"], **{"in": in_features},
                )  # fmt: skip
                if len(ops) > 1:
                    row.update(
                        {f"{op}_us": res[f"{op}_us"] for op in ops if f"{op}_us" in res and op != "layer"},
                        **configs(pool, tokens),
                    )
                rows.append(row)
                on_row(row_text(row))
            del pool
            torch.cuda.empty_cache()
    return rows, left


def configs(pool: RealPool, tokens) -> dict:
    """The kernel configs the tables give a case (what the rows of a per-kernel run are read with)."""
    widths = pool.widths
    device = torch.device(DEV)
    expand = tuning.expand_config(device, tokens, widths, pool.rank)
    out = dict(expand_cfg=tuning.as_dict(expand))
    if not pool.embedding:
        out["shrink_cfg"] = tuning.as_dict(tuning.shrink_config(device, tokens, pool.in_features, len(widths), pool.rank))
    return out


def warm_in_workers(script: str, argv: list[str], timeout_s: float, log=print) -> None:
    """Compiles the kernels a run will launch before it times anything: the same command, with
    --warm-part i/N, in N processes that each launch every n-th shape's kernels once. Triton's
    on-disk cache then serves the timed pass (compiling is single-threaded per process and, over
    hundreds of specialisations, would otherwise take longer than the measuring). A worker
    that fails or runs out of time costs nothing but the time: the timed pass compiles the rest."""
    workers = max(1, min(12, (os.cpu_count() or 2) - 2))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the workers allocate their own pools on the same GPU
    started = time.time()
    logs = [tempfile.TemporaryFile() for _ in range(workers)]
    procs = [
        subprocess.Popen([sys.executable, script, *argv, "--warm-part", f"{i}/{workers}"], stdout=logs[i], stderr=logs[i])
        for i in range(workers)
    ]
    for i, proc in enumerate(procs):
        try:
            proc.wait(timeout=max(0.01, timeout_s - (time.time() - started)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.returncode != 0:
            logs[i].seek(0)
            tail = logs[i].read()[-600:].decode(errors="replace")
            log(f"warm worker {i} exited {proc.returncode}: {tail}")
        logs[i].close()
    log(f"warm: {workers} compile workers, {time.time() - started:.0f} s")
