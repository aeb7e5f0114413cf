"""One MoE layer's experts with expert LoRA (kernels.fused_moe on CUDA) against its floor.

    python benchmarks/bench_moe.py [--out DIR] [--quick] [--fp8]

Grid: expert shapes of real models (hidden, expert intermediate, experts, top-k) x tokens x
adapters (0: no LoRA in the step; else every token has one, spread over that many slots, rank
16 on w13 and w2 of every expert). Each case is timed eagerly (do_bench, L2 emptied before each
call) and, up to 256 tokens, replayed in a CUDA graph (the decode path); before timing, each
shape's output is checked against the PyTorch reference. --fp8: the same cases with FP8 experts
too (float8_e4m3fn, one scale per expert row; the kernel dequantizes in its tiles, W8A16), timed
beside bf16 against their own floor.

Floor, measured in the same run: max(bytes / copy bandwidth, FLOPs / bf16 matmul rate).
Bytes: w13 and w2 of every expert the step routes to, A and B of every (slot, expert) pair it
uses, x read, h [T*K, 2I] and act [T*K, I] and y [T*K, H] written and read once each, out written;
FP8 experts: their weights at one byte and a float32 scale per row.
Prints one table (and writes it as markdown + JSON under --out); asserts nothing on time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import capture, measure_ceilings

from loraserve.executor.model.fp8 import quantize_rows
from loraserve.kernels import make_lora_meta, moe_reference, moe_route, triton_moe

DEV, DTYPE, RANK, SLOTS = "cuda", torch.bfloat16, 16, 8
SHAPES = {  # name: (hidden, expert intermediate, experts, top-k)
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "olmoe-1b-7b": (2048, 1024, 64, 8),
}
TOKENS = (1, 16, 64, 256, 1024, 4096)
ADAPTERS = (0, 1, 8)
GRAPH_MAX_TOKENS = 256


def make_layer(hidden, inter, experts, gen):
    def rnd(*shape, scale):
        return (torch.randn(*shape, device=DEV, generator=gen) * scale).to(DTYPE)

    w13, w2 = rnd(experts, 2 * inter, hidden, scale=hidden**-0.5), rnd(experts, hidden, inter, scale=inter**-0.5)
    lora13 = (rnd(SLOTS, experts, 2, RANK, hidden, scale=hidden**-0.5), rnd(SLOTS, experts, 2 * inter, RANK, scale=0.1))
    lora2 = (rnd(SLOTS, experts, 1, RANK, inter, scale=inter**-0.5), rnd(SLOTS, experts, hidden, RANK, scale=0.1))
    router = rnd(experts, hidden, scale=hidden**-0.5)
    return w13, w2, lora13, lora2, router


def step_inputs(tokens, adapters, hidden, router, top_k, gen):
    x = torch.randn(tokens, hidden, device=DEV, generator=gen).to(DTYPE)
    weights, ids = moe_route(x @ router.T, top_k, True)
    slots = torch.arange(tokens, device=DEV) % adapters if adapters else torch.full((tokens,), -1, device=DEV)
    meta = make_lora_meta(slots, SLOTS, frozenset(range(min(adapters, tokens))))
    return x, weights, ids, meta if adapters else None


def floor_us(shape, tokens, ids, meta, ceil, fp8: bool = False) -> tuple[float, float]:
    """(floor, bytes term alone) in microseconds; expert and (slot, expert) counts from the step's routing.
    fp8: the experts' weights at one byte, plus a float32 scale per row."""
    hidden, inter, experts, top_k = shape
    pairs = tokens * top_k
    hit = ids.unique().numel()
    weights = hit * (3 * hidden * inter + (2 * inter + hidden) * 4) if fp8 else hit * 3 * hidden * inter * 2
    moved = weights + tokens * hidden * 2 * 2 + pairs * (2 * inter + inter + hidden) * 2 * 2
    flops = pairs * 2 * 3 * hidden * inter
    if meta is not None:
        used = (meta.token_slots.long()[:, None] * experts + ids).unique().numel()
        moved += used * (2 * RANK * hidden + 2 * inter * RANK + RANK * inter + hidden * RANK) * 2
        flops += pairs * 2 * (2 * RANK * hidden + 2 * inter * RANK + RANK * inter + hidden * RANK)
    bytes_us = moved / ceil["copy_bytes_per_s"] * 1e6
    return max(bytes_us, flops / ceil["bf16_flops_per_s"] * 1e6), bytes_us


def check(layer, shape, gen, fp8=None) -> float:
    """Relative error of the Triton path against the reference on a 16-token mixed step; fp8: the FP8
    experts (q13, s13, q2, s2) instead, the reference on the same operands."""
    w13, w2, l13, l2, router = layer
    x, w, ids, meta = step_inputs(16, 4, shape[0], router, shape[3], gen)
    if fp8 is None:
        got = triton_moe.fused_moe(x, w, ids, w13, w2, l13, l2, meta).double()
        want = moe_reference.fused_moe(x.float(), w, ids, w13.float(), w2.float(), _f32(l13), _f32(l2), meta).double()
    else:
        q13, s13, q2, s2 = fp8
        got = triton_moe.fused_moe(x, w, ids, q13, q2, l13, l2, meta, s13, s2).double()
        want = moe_reference.fused_moe(x.float(), w, ids, q13, q2, _f32(l13), _f32(l2), meta, s13, s2).double()
    return ((got - want).norm() / want.norm()).item()


def time_us(fn, tokens) -> tuple[float, float | None]:
    """(eager, CUDA-graph replay or None past GRAPH_MAX_TOKENS) median microseconds."""
    eager_us = do_bench(fn, warmup=5, rep=30, return_mode="median") * 1e3
    if tokens > GRAPH_MAX_TOKENS:
        return eager_us, None
    graph = capture(fn)
    return eager_us, do_bench(graph.replay, warmup=5, rep=30, return_mode="median") * 1e3


def _f32(lora):
    return tuple(t.float() for t in lora)


def run(args):
    ceil = measure_ceilings()
    gen = torch.Generator(device=DEV).manual_seed(0)
    tokens_list = (1, 64, 1024) if args.quick else TOKENS
    rows = []
    for name, shape in SHAPES.items():
        hidden, inter, experts, top_k = shape
        layer = make_layer(hidden, inter, experts, gen)
        w13, w2, l13, l2, router = layer
        err = check(layer, shape, gen)
        print(f"{name}: triton vs reference relative error {err:.2e}", flush=True)
        fp8 = None
        if args.fp8:
            (q13, s13), (q2, s2) = quantize_rows(w13), quantize_rows(w2)
            fp8 = (q13.contiguous(), s13, q2.contiguous(), s2)
            print(f"{name}: FP8 experts, triton vs reference relative error {check(layer, shape, gen, fp8):.2e}", flush=True)
        for tokens in tokens_list:
            for adapters in ADAPTERS:
                x, w, ids, meta = step_inputs(tokens, adapters, hidden, router, top_k, gen)
                lora13, lora2 = (l13, l2) if adapters else (None, None)

                def layer_fn():
                    return triton_moe.fused_moe(x, w, ids, w13, w2, lora13, lora2, meta)

                eager_us, graph_us = time_us(layer_fn, tokens)
                floor, bytes_us = floor_us(shape, tokens, ids, meta, ceil)
                best = min(t for t in (eager_us, graph_us) if t is not None)
                row = dict(
                    shape=name,
                    tokens=tokens,
                    adapters=adapters,
                    eager_us=eager_us,
                    graph_us=graph_us,
                    floor_us=floor,
                    bytes_us=bytes_us,
                    x_floor=best / floor,
                    check_rel_err=err,
                )
                if fp8 is not None:

                    def fp8_fn():
                        return triton_moe.fused_moe(x, w, ids, q13, q2, lora13, lora2, meta, s13, s2)

                    fp8_times = time_us(fp8_fn, tokens)
                    fp8_floor, _ = floor_us(shape, tokens, ids, meta, ceil, fp8=True)
                    fp8_best = min(t for t in fp8_times if t is not None)
                    row.update(fp8_eager_us=fp8_times[0], fp8_graph_us=fp8_times[1], fp8_floor_us=fp8_floor)
                    row.update(fp8_x_floor=fp8_best / fp8_floor, fp8_vs_bf16=fp8_best / best)
                rows.append(row)
                print(row_text(rows[-1]), flush=True)
        layer = w13 = w2 = l13 = l2 = router = fp8 = q13 = q2 = None  # frees this shape's weights (closures hold the names)
        torch.cuda.empty_cache()
    return ceil, rows


def row_text(r) -> str:
    graph = f"{r['graph_us']:9.1f}" if r["graph_us"] is not None else f"{'-':>9}"
    text = (
        f"| {r['shape']:<14} | {r['tokens']:>5} | {r['adapters']:>2} | {r['eager_us']:9.1f} | {graph} "
        f"| {r['floor_us']:9.1f} | {r['x_floor']:6.2f} |"
    )
    if "fp8_eager_us" in r:
        best = min(t for t in (r["fp8_eager_us"], r["fp8_graph_us"]) if t is not None)
        text += f" {best:9.1f} | {r['fp8_floor_us']:9.1f} | {r['fp8_x_floor']:6.2f} | {r['fp8_vs_bf16']:6.2f} |"
    return text


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="folder for bench_moe.md / bench_moe.json")
    parser.add_argument("--quick", action="store_true", help="tokens 1, 64, 1024 only")
    parser.add_argument("--fp8", action="store_true", help="FP8 experts too, timed beside bf16 (best of eager and graph)")
    args = parser.parse_args()
    if args.fp8 and torch.cuda.get_device_capability() < (8, 9):
        parser.error("--fp8: FP8 experts need a GPU of compute capability 8.9+")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {DTYPE}, rank {RANK}, {SLOTS} slots")
    header = [
        "| shape          | T     | A  | eager us  | graph us  | floor us  | x floor |",
        "|----------------|-------|----|-----------|-----------|-----------|---------|",
    ]
    if args.fp8:
        header[0] += " fp8 us    | fp8 floor | x floor | x bf16 |"
        header[1] += "-----------|-----------|---------|--------|"
    print("\n".join(header), flush=True)
    ceil, rows = run(args)
    lines = header + [row_text(r) for r in rows]
    print("\n" + "\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_moe.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.join(args.out, "bench_moe.json"), "w") as f:
            json.dump(dict(ceilings=ceil, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
