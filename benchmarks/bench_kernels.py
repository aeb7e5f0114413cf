"""One LoRA layer (shrink + expand) on the kernels grid: time against the floor, eager and in a CUDA graph.

    python benchmarks/bench_kernels.py [--out DIR] [--quick] [--tune-out FILE]
    python benchmarks/bench_kernels.py --real [--out DIR] [--budget-s 170]   (real layer shapes)

--real: every LoRA layer of the served model families at tp 1/2/4/8 (kernels/model_shapes.py),
in CUDA graphs only, printing time, floor, ratio and the launches-adjusted ratio per case and a
summary by layer kind and model (benchmarks/real_grid.py); writes real.md / real.json.

Floor, measured in the same run: max(bytes / copy bandwidth, FLOPs / bf16 matmul rate)
+ 2 x (an empty Triton kernel replayed in a graph). Bytes: x rows of adapter tokens, each
active adapter's A and B once, buf written (all rows) and read (adapter rows) in float32,
y rows of adapter tokens read and written. Every timing reads cold weights: do_bench empties
L2 before each call, and a graph replays K layers, each with its own weights and activations
and one shared per-step grouping (LoraMeta), as the layers of a forward pass do.
Prints one table (and writes it as markdown + JSON under --out); asserts nothing on time.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import triton
from triton.testing import do_bench

from loraserve.kernels import lora_expand, lora_shrink, make_lora_meta, tuning

DEV = "cuda"
DTYPE = torch.bfloat16
HIDDEN = (4096, 8192)
RANKS = (8, 16, 64)
SLICES = (1, 3)
TOKENS = (1, 16, 64, 256, 1024, 4096, 8192)
ADAPTERS = (1, 8, 32, 128)
NONE = (0.0, 0.2)
BENCH_MS = dict(warmup=5, rep=20)


@triton.jit
def _empty_kernel(ptr):
    pass


def widths_of(hidden: int, num_slices: int) -> tuple[int, ...]:
    return (hidden,) if num_slices == 1 else (hidden, 1024, 1024)  # QKV with GQA: q, k, v


def offsets_of(widths):
    offs = [0]
    for w in widths:
        offs.append(offs[-1] + w)
    return tuple(offs)


def measure_ceilings() -> dict:
    """Copy bandwidth (bytes read + written), bf16 matmul rate, one graph-replayed empty launch."""
    n = 1 << 31
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median")
    src = dst = None  # frees the buffers (the timed closure holds the names)
    m = 8192
    p, q = (torch.randn(m, m, device=DEV, dtype=DTYPE) for _ in range(2))
    r = torch.empty_like(p)
    mm_ms = do_bench(lambda: torch.mm(p, q, out=r), warmup=20, rep=200, return_mode="median")
    p = q = r = None
    dummy = torch.empty(1, device=DEV)
    _empty_kernel[(1,)](dummy)
    launches = 200
    graph = capture(lambda: [_empty_kernel[(1,)](dummy) for _ in range(launches)])
    empty_ms = do_bench(graph.replay, warmup=10, rep=100, return_mode="median") / launches
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(launches):
        _empty_kernel[(1,)](dummy)
    host_launch_s = (time.perf_counter() - started) / launches
    torch.cuda.synchronize()
    return dict(
        copy_bytes_per_s=2 * n / (copy_ms * 1e-3),
        bf16_flops_per_s=2 * m**3 / (mm_ms * 1e-3),
        empty_launch_us=empty_ms * 1e3,
        host_empty_launch_us=host_launch_s * 1e6,  # Python cost of one eager Triton launch
    )


def capture(fn) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm: compiles and per-step work lists stay out of the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


@dataclass
class Pool:
    """Slot buffers of one layer shape, in `copies` separate sets (one per layer of a graph replay)."""

    hidden: int
    widths: tuple[int, ...]
    rank: int
    weights: list[tuple[torch.Tensor, torch.Tensor]]  # per copy: A [L, S, R, hidden], B [L, N, R]

    @property
    def slots(self) -> int:
        return self.weights[0][0].shape[0]

    @staticmethod
    def make(hidden, widths, rank, copies=8, slots=max(ADAPTERS)):
        def one():
            a = torch.randn(slots, len(widths), rank, hidden, device=DEV, dtype=DTYPE) * hidden**-0.5
            b = torch.randn(slots, sum(widths), rank, device=DEV, dtype=DTYPE) * rank**-0.5
            return a, b

        return Pool(hidden, widths, rank, [one() for _ in range(copies)])


def token_slots(tokens, lora_tokens, adapters, gen):
    ids = torch.arange(lora_tokens, device=DEV) % adapters
    slots = torch.cat([ids, torch.full((tokens - lora_tokens,), -1, device=DEV, dtype=ids.dtype)])
    return slots[torch.randperm(tokens, device=DEV, generator=gen)].to(torch.int32)


def floor_us(pool: Pool, tokens, lora_tokens, adapters, ceil) -> tuple[float, float]:
    """(floor, bytes term alone) in microseconds."""
    s, r, hidden, n = len(pool.widths), pool.rank, pool.hidden, sum(pool.widths)
    moved = (
        lora_tokens * hidden * 2
        + adapters * (s * r * hidden + n * r) * 2
        + s * tokens * r * 4
        + s * lora_tokens * r * 4
        + 2 * lora_tokens * n * 2
    )
    flops = 2 * lora_tokens * hidden * s * r + 2 * lora_tokens * n * r
    work_us = max(moved / ceil["copy_bytes_per_s"], flops / ceil["bf16_flops_per_s"]) * 1e6
    return work_us + 2 * ceil["empty_launch_us"], moved / ceil["copy_bytes_per_s"] * 1e6


def gathered_bmm(x, y, pool: Pool, slots, offsets):
    """The plain-PyTorch baseline: gather each token's A and B, then batched matmuls (chunked)."""
    s, r = len(pool.widths), pool.rank
    lora_a, lora_b = pool.weights[0]
    a_flat = lora_a.view(pool.slots, s * r, pool.hidden)
    per_token = (s * r * pool.hidden + offsets[-1] * r) * 2
    chunk = max(1, int(2e9 // per_token))
    for c0 in range(0, x.shape[0], chunk):
        sl = slots[c0 : c0 + chunk]
        idx = sl.clamp(min=0).long()
        keep = (sl >= 0).to(x.dtype)[:, None]
        buf = torch.bmm(a_flat[idx], x[c0 : c0 + chunk, :, None])[..., 0] * keep  # [c, S*R]
        b = lora_b[idx]  # [c, N, R]
        delta = torch.cat(
            [torch.bmm(b[:, offsets[i] : offsets[i + 1]], buf[:, i * r : (i + 1) * r, None])[..., 0] for i in range(s)],
            dim=1,
        )
        y[c0 : c0 + chunk] += delta


def time_events(fn, runs=3) -> float:
    """Median ms of a few runs, for the slow baseline (do_bench would take seconds on it)."""
    fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


GRAPH_SETS = None  # --graph-sets: a diagnostic override (layers per replayed graph)


def graph_sets(tokens):
    if GRAPH_SETS:
        return GRAPH_SETS
    return 8 if tokens <= 256 else 4 if tokens <= 1024 else 2


def run_case(pool: Pool, tokens, adapters, none, ceil, gen, baseline=True, ops=("layer",)):
    lora_tokens = tokens - int(round(none * tokens))
    distinct = max(1, min(adapters, lora_tokens))
    offsets = offsets_of(pool.widths)
    # One step's grouping, shared by every layer as in a forward pass; each layer its own weights
    # and activations, so nothing but the per-step metadata can be served from L2.
    slots = token_slots(tokens, lora_tokens, distinct, gen)
    meta = make_lora_meta(slots, pool.slots)
    sets = []
    for i in range(min(graph_sets(tokens), len(pool.weights))):
        x = torch.randn(tokens, pool.hidden, device=DEV, dtype=DTYPE, generator=gen)
        y = torch.randn(tokens, offsets[-1], device=DEV, dtype=DTYPE, generator=gen)
        buf = torch.empty(len(pool.widths), tokens, pool.rank, device=DEV)
        sets.append((x, y, buf, *pool.weights[i]))

    def layer(i, op="layer"):
        x, y, buf, lora_a, lora_b = sets[i]
        if op != "expand":
            lora_shrink(x, lora_a, meta, out=buf)
        if op != "shrink":
            lora_expand(y, buf, lora_b, offsets, meta)

    result = dict(distinct=distinct, lora_tokens=lora_tokens, sets=len(sets))
    result["floor_us"], result["bytes_us"] = floor_us(pool, tokens, lora_tokens, distinct, ceil)
    for op in ops:
        graph = capture(lambda: [layer(i, op) for i in range(len(sets))])
        result[f"{op}_graph_us"] = do_bench(graph.replay, return_mode="median", **BENCH_MS) * 1e3 / len(sets)
        del graph
    if "layer" in ops:
        result["eager_us"] = do_bench(lambda: layer(0), return_mode="median", **BENCH_MS) * 1e3
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(20):
            layer(0)
        result["host_us"] = (time.perf_counter() - started) / 20 * 1e6  # Python + launch cost per call
        torch.cuda.synchronize()
    if baseline:
        x, y = sets[0][:2]
        result["torch_us"] = time_events(lambda: gathered_bmm(x, y, pool, slots, offsets)) * 1e3
    return result


def grid_cases(tokens_list=TOKENS):
    """(tokens, adapters, none) without duplicates: a case whose distinct adapters equal an earlier one's is skipped."""
    seen = set()
    for tokens, adapters, none in itertools.product(tokens_list, ADAPTERS, NONE):
        lora_tokens = tokens - int(round(none * tokens))
        key = (tokens, lora_tokens, max(1, min(adapters, lora_tokens)))
        if key not in seen:
            seen.add(key)
            yield tokens, adapters, none


def env_info(ceil) -> dict:
    props = torch.cuda.get_device_properties(0)
    return dict(
        device=torch.cuda.get_device_name(0),
        sms=props.multi_processor_count,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        triton=triton.__version__,
        python=sys.version.split()[0],
        command=" ".join(["python"] + sys.argv),
        config_table=tuning.gpu_key(torch.device(DEV)),
        **{k: round(v, 3) for k, v in ceil.items()},
    )


def summarize(rows) -> list[str]:
    def stats(name, values):
        if not values:
            return f"{name}: no cases"
        return f"{name}: median {statistics.median(values):.2f}x, max {max(values):.2f}x over {len(values)} cases"

    decode = [r for r in rows if r["tokens"] <= 256]
    prefill = [r for r in rows if r["tokens"] >= 4096]
    lines = [
        stats("decode (<= 256 tokens), graph time / floor", [r["graph_us"] / r["floor_us"] for r in decode]),
        stats("decode (<= 256 tokens), eager time / floor", [r["eager_us"] / r["floor_us"] for r in decode]),
        stats("prefill (>= 4096 tokens), eager time / floor", [r["eager_us"] / r["floor_us"] for r in prefill]),
        stats("prefill (>= 4096 tokens), graph time / floor", [r["graph_us"] / r["floor_us"] for r in prefill]),
        stats("1024 tokens, eager time / floor", [r["eager_us"] / r["floor_us"] for r in rows if r["tokens"] == 1024]),
        stats("all cases, torch gathered bmm / floor", [r["torch_us"] / r["floor_us"] for r in rows if "torch_us" in r]),
        f"host time per eager layer call (Python + launches): median {statistics.median(r['host_us'] for r in rows):.1f} us",
    ]
    misses = [r for r in decode if r["graph_us"] / r["floor_us"] > 4] + [
        r for r in prefill if r["eager_us"] / r["floor_us"] > 1.5
    ]
    lines.append(f"cases over target (decode graph > 4x, prefill eager > 1.5x): {len(misses)}")
    for r in misses:
        lines.append("  miss: " + row_text(r))
    return lines


HEADER = "| hidden | slices | rank | tokens | adapters | no-adapter | floor us | eager us | eager/floor | graph us | graph/floor | torch bmm us |"


SEPARATOR = "|" + "---|" * (HEADER.count("|") - 1)


def row_text(r) -> str:
    torch_us = f"{r['torch_us']:.1f}" if "torch_us" in r else "-"
    adapters = f"{r['adapters']}" if r["distinct"] == r["adapters"] else f"{r['adapters']} ({r['distinct']})"
    return (
        f"| {r['hidden']} | {r['slices']} | {r['rank']} | {r['tokens']} | {adapters} | {int(r['none'] * 100)}% "
        f"| {r['floor_us']:.1f} | {r['eager_us']:.1f} | {r['eager_us'] / r['floor_us']:.2f} "
        f"| {r['graph_us']:.1f} | {r['graph_us'] / r['floor_us']:.2f} | {torch_us} |"
    )


def write_results(out, info, rows, lines):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump(dict(env=info, rows=rows, summary=lines), f, indent=1)
    with open(os.path.join(out, "bench.md"), "w") as f:
        f.write("\n".join([HEADER, SEPARATOR] + [row_text(r) for r in rows]))
        f.write("\n\n" + "\n".join(f"- {line}" for line in lines) + "\n")


def benchmark(args, ceil, info):
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows = []
    shapes = list(itertools.product(HIDDEN, SLICES, RANKS))
    tokens = (1, 64, 256, 8192) if args.quick else TOKENS
    if args.tokens:
        tokens = tuple(int(t) for t in args.tokens)
    print(HEADER)
    print(SEPARATOR)
    for hidden, num_slices, rank in shapes:
        pool = Pool.make(hidden, widths_of(hidden, num_slices), rank)
        for t, adapters, none in grid_cases(tokens):
            res = run_case(pool, t, adapters, none, ceil, gen, baseline=not args.no_baseline)
            res["graph_us"] = res.pop("layer_graph_us")
            row = dict(hidden=hidden, slices=num_slices, rank=rank, tokens=t, adapters=adapters, none=none, **res)
            rows.append(row)
            print(row_text(row), flush=True)
        del pool
        torch.cuda.empty_cache()
        if args.out:  # after each shape: a cut-off run keeps what it measured
            write_results(args.out, info, rows, ["(partial)"])
    return rows


def shrink_candidates(tokens, sr):
    """(block_m, block_n, block_k, split_k, num_warps, num_stages, ctas_per_sm) to try, by regime."""
    full = max(16, triton.next_power_of_2(sr))
    n64, n128, n256 = min(full, 64), min(full, 128), min(full, 256)
    if tokens <= 64:
        rows = [
            (16, n64, 128, 16, 4, 4, 8),
            (16, n64, 64, 32, 4, 4, 8),
            (16, min(full, 32), 128, 16, 4, 4, 8),
            (16, n64, 128, 8, 4, 4, 8),
            (16, n64, 128, 16, 4, 4, 16),
        ]
    elif tokens <= 256:
        rows = [
            (16, n64, 128, 8, 4, 4, 8),
            (16, n64, 256, 4, 4, 3, 4),
            (16, n64, 128, 8, 4, 4, 16),
            (32, n64, 128, 8, 4, 4, 4),
            (16, n64, 128, 4, 4, 4, 8),
        ]
    elif tokens <= 2048:
        rows = [
            (64, n64, 128, 1, 4, 3, 2),
            (64, n64, 128, 2, 4, 3, 2),
            (32, n64, 128, 2, 4, 4, 4),
            (64, n128, 128, 1, 4, 3, 2),
            (64, n64, 256, 1, 4, 3, 2),
        ]
    else:
        rows = [
            (64, n128, 64, 1, 4, 4, 2),
            (64, n64, 128, 1, 4, 4, 2),
            (64, n64, 64, 1, 4, 4, 2),
            (128, n64, 64, 1, 8, 4, 1),
            (128, n64, 128, 1, 8, 3, 1),
            (64, n256, 64, 1, 4, 3, 1),
            (32, n64, 128, 1, 4, 4, 4),
            # K split over programs (buf zeroed first): fills the SMs when the token blocks
            # x column blocks are fewer than the programs (e.g. 64 tiles at 4096 tokens, rank 8)
            (64, n64, 128, 2, 4, 4, 2),
            (32, n64, 128, 2, 4, 4, 4),
            (64, n64, 128, 4, 4, 4, 2),
            (64, n64, 64, 2, 4, 4, 3),
            (64, n128, 64, 2, 4, 4, 2),
            (128, n64, 128, 2, 8, 3, 1),
            (32, n64, 256, 2, 4, 3, 4),
            (64, n64, 256, 2, 4, 3, 2),
        ]
    return [tuning.ShrinkConfig(*row) for row in dict.fromkeys(rows)]


def expand_candidates(tokens):
    """(block_m, block_n, n_iters, num_warps, num_stages, ctas_per_sm[, maxnreg]) to try, by regime."""
    if tokens <= 64:
        rows = [(16, 64, 1, 4, 1, 8), (16, 128, 1, 4, 1, 4), (16, 32, 1, 4, 1, 8), (16, 64, 1, 4, 1, 16), (16, 128, 1, 4, 1, 16)]
    elif tokens <= 256:
        rows = [(16, 64, 1, 4, 1, 8), (16, 128, 1, 4, 1, 8), (16, 128, 1, 4, 1, 16), (16, 256, 1, 4, 1, 8), (16, 64, 2, 4, 2, 8)]
    elif tokens <= 2048:
        rows = [
            (64, 128, 1, 4, 1, 4),
            (64, 128, 2, 4, 2, 2),
            (32, 128, 2, 4, 2, 4),
            (64, 64, 2, 4, 2, 4),
            (64, 128, 4, 4, 3, 2),
            (32, 64, 4, 4, 2, 4),
        ] + CAPPED_EXPAND
    else:
        rows = [
            (64, 128, 2, 4, 2, 2),
            (64, 128, 4, 4, 3, 2),
            (64, 128, 2, 4, 3, 3),
            (64, 64, 4, 4, 3, 4),
            (32, 128, 4, 4, 3, 4),
            (64, 256, 2, 8, 2, 2),
            # more programs than resident CTAs, one tile each (ONE_TILE at 4096 tokens)
            (32, 128, 4, 4, 3, 8),
            (32, 128, 8, 4, 3, 4),
            (16, 128, 4, 4, 3, 8),
        ] + CAPPED_EXPAND
    return [tuning.ExpandConfig(*row) for row in rows]


# Prefill expand tiles with registers capped (128 a thread, 4 blocks resident per SM; 168, 3) and
# one stage, where the uncapped rank-128 tiles held 2 blocks (12.5% occupancy, latency-bound under a
# profiler); in a sweep they took rank-128 expands at 1,024-4,096 tokens 10-18% faster with one
# adapter.
CAPPED_EXPAND = [(64, 64, 4, 4, 1, 4, 128), (64, 64, 2, 4, 1, 4, 128), (64, 128, 1, 4, 1, 4, 128), (64, 128, 2, 4, 1, 3, 168)]


def tune(args, ceil):
    """Each op alone, in graphs, for each candidate, over two adapter mixes (1 adapter, and
    min(tokens, 128) adapters). The pick minimises the worst estimated layer ratio over the mixes,
    (this op's time + the other op's time) / the mix's layer floor, with the other op at its best
    (for the shrink) or at the shrink just picked (for the expand): the target is time / floor,
    and a many-adapter layer's floor is larger, so a microsecond weighs more in the small one.
    The score printed is that estimate. The result is the shipped table (kernels/configs/) with
    the tuned entries replaced or added."""
    gen = torch.Generator(device=DEV).manual_seed(1)
    key = tuning.gpu_key(torch.device(DEV))
    table = json.loads(json.dumps(tuning._table(key)))  # the shipped table: new entries are added to it
    for op in ("shrink", "expand"):
        table.setdefault(op, {})
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.tune_shapes]
    tokens_list = [int(t) for t in args.tune_tokens]
    for hidden, num_slices, rank in shapes:
        pool = Pool.make(hidden, widths_of(hidden, num_slices), rank)
        sr = num_slices * rank
        for tokens in tokens_list:
            measured = {}
            floors = {}
            for op, cands in (("shrink", shrink_candidates(tokens, sr)), ("expand", expand_candidates(tokens))):
                shape_key = (
                    tuning.shrink_key(hidden, num_slices, rank)
                    if op == "shrink"
                    else tuning.expand_key(widths_of(hidden, num_slices), rank)
                )
                times = []
                for cand in cands:
                    entry = {op: {shape_key: {str(tokens): tuning.as_dict(cand)}}}
                    tuning.set_table(key, entry)
                    try:
                        per_mix = []
                        for adapters in (1, 128):
                            res = run_case(pool, tokens, adapters, 0.0, ceil, gen, baseline=False, ops=(op,))
                            per_mix.append(res[f"{op}_graph_us"])
                            floors[adapters] = res["floor_us"]
                    except Exception as exc:  # a candidate that does not fit (shared memory) is skipped
                        print(f"tune {op} {shape_key} T={tokens} {cand} failed: {str(exc)[:120]}")
                        per_mix = [float("inf")] * 2
                    times.append(per_mix)
                measured[op] = (shape_key, cands, times)
            floor = [floors.get(1, 1.0), floors.get(128, 1.0)]
            other = [min(t[i] for t in measured["expand"][2]) for i in range(2)]  # the expand at its best
            for op in ("shrink", "expand"):
                shape_key, cands, times = measured[op]
                scores = [max((t[i] + other[i]) / floor[i] for i in range(2)) for t in times]
                pick = min(range(len(cands)), key=scores.__getitem__)
                table[op].setdefault(shape_key, {})[str(tokens)] = tuning.as_dict(cands[pick])
                for cand, t, sc in zip(cands, times, scores):
                    mark = "*" if cand == cands[pick] else " "
                    print(
                        f"tune {op} {shape_key} T={tokens} {mark} {cand} 1 adapter {t[0]:.1f} us, "
                        f"many {t[1]:.1f} us, score {sc:.2f}",
                        flush=True,
                    )
                other = times[pick]  # the expand is scored with the shrink just picked
        del pool
        torch.cuda.empty_cache()
        with open(args.tune_out, "w") as f:  # after each shape: a cut-off run keeps what it tuned
            json.dump(table, f, indent=1, sort_keys=True)
    tuning.set_table(key, table)
    return table


def real_benchmark(args, ceil, info):
    import real_grid  # imports this module: loaded only here

    part = tuple(int(v) for v in args.warm_part.split("/")) if args.warm_part else None
    if part is None and args.warm_s > 0:
        real_grid.warm_in_workers(__file__, sys.argv[1:], args.warm_s)
    started = time.time()
    print(real_grid.HEADER)
    print(real_grid.SEPARATOR)
    rows, left = real_grid.bench(
        ceil,
        tps=tuple(int(v) for v in args.real_tp.split(",")),
        ranks=tuple(int(v) for v in args.real_ranks.split(",")),
        tokens_list=tuple(int(v) for v in args.real_tokens.split(",")),
        adapters_list=tuple(int(v) for v in args.real_adapters.split(",")),
        kinds=set(args.real_kinds.split(",")),
        budget_s=float("inf") if part else args.budget_s,
        on_row=lambda line: print(line, flush=True),
        part=part,
        pdl=args.pdl,
        ops=("layer", *(op for op in args.real_ops.split(",") if op and op != "layer")),
    )
    if part:
        return
    lines = real_grid.summarize(rows, ceil["empty_launch_us"])
    if left:
        lines.append(
            f"not measured (time budget {args.budget_s:.0f} s spent): {len(left)} kernel shapes, e.g. "
            + "; ".join(f"{k[1]} -> {'+'.join(map(str, k[2]))}" for k in left[:5])
        )
    lines.append(f"real-shape benchmark: {len(rows)} cases in {time.time() - started:.0f} s")
    print("\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "real.json"), "w") as f:
            json.dump(dict(env=info, rows=rows, summary=lines, not_measured=left), f, indent=1)
        with open(os.path.join(args.out, "real.md"), "w") as f:
            f.write("\n".join(lines) + "\n\n")
            f.write("\n".join([real_grid.HEADER, real_grid.SEPARATOR] + [real_grid.row_text(r) for r in rows]) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="folder for bench.md / bench.json")
    parser.add_argument("--quick", action="store_true", help="tokens 1, 64, 256, 8192 only")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--tune-out", default=None, help="tune first, write the table here, then benchmark with it")
    parser.add_argument("--tune-shapes", nargs="*", default=[f"{h},{s},{r}" for h in HIDDEN for s in SLICES for r in RANKS])
    parser.add_argument("--tune-tokens", nargs="*", default=[str(t) for t in TOKENS])
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--tokens", nargs="*", default=None, help="benchmark only these token counts")
    parser.add_argument("--graph-sets", type=int, default=None, help="diagnostic: layers per graph for every T")
    parser.add_argument("--table", default=None, help="a tuned table (JSON) to use instead of kernels/configs/")
    parser.add_argument("--real", action="store_true", help="the real layer shapes instead of the hidden-size grid")
    parser.add_argument("--real-tp", default="1,2,4,8")
    parser.add_argument("--real-ranks", default="8,128")
    parser.add_argument("--real-tokens", default="1,3,17,255,1024,4096")
    parser.add_argument("--real-adapters", default="1,64")
    parser.add_argument("--real-kinds", default="qkv,o,gate_up,down,embedding,lm_head")
    parser.add_argument(
        "--real-ops",
        default="layer",
        help="--real: also time the shrink and the expand alone ('layer,shrink,expand'): real.json "
        "rows then hold shrink_us, expand_us and the configs the tables gave; 'dense' and "
        "'dense_shrink' time the cuBLAS reference (torch.mm / addmm_, no gather) of one "
        "adapter's linear layer and of its shrink alone (dense_us, dense_shrink_us)",
    )
    parser.add_argument("--budget-s", type=float, default=110.0, help="--real: stop starting new shapes after this")
    parser.add_argument("--warm-s", type=float, default=60.0, help="--real: compile in parallel first, at most this long")
    parser.add_argument(
        "--pdl", action="store_true", help="--real: decode shrinks and expands launched as programmatic dependents (sm90+)"
    )
    parser.add_argument("--warm-part", default=None, help=argparse.SUPPRESS)  # i/N: one compile worker
    args = parser.parse_args()
    if set(args.real_ops.split(",")) - {"layer", "shrink", "expand", "dense", "dense_shrink", ""}:
        parser.error(f"--real-ops takes layer, shrink, expand, dense and dense_shrink, not {args.real_ops!r}")
    if args.real_ops != "layer" and not args.real:
        parser.error("--real-ops applies to the real-shape benchmark only: add --real")
    if args.pdl and not args.real:
        parser.error("--pdl applies to the real-shape benchmark only: add --real")

    global GRAPH_SETS
    GRAPH_SETS = args.graph_sets
    torch.backends.cuda.matmul.allow_tf32 = False
    started = time.time()
    if args.table:
        with open(args.table) as f:
            tuning.set_table(tuning.gpu_key(torch.device(DEV)), json.load(f))
    if args.warm_part:  # a compile worker: no ceilings, no timing
        real_benchmark(args, None, None)
        return
    ceil = measure_ceilings()
    info = env_info(ceil)
    print(json.dumps(info, indent=1))
    if args.tune_out:
        tune(args, ceil)
        print(f"tuned in {time.time() - started:.0f} s -> {args.tune_out}")
    if args.skip_bench:
        return
    if args.real:
        real_benchmark(args, ceil, info)
        print(f"total {time.time() - started:.0f} s")
        return
    rows = benchmark(args, ceil, info)
    lines = summarize(rows)
    print("\n".join(lines))
    print(f"total {time.time() - started:.0f} s")
    if args.out:
        write_results(args.out, info, rows, lines)


if __name__ == "__main__":
    main()
