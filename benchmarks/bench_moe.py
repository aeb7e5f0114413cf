"""One MoE layer's experts with expert LoRA (kernels.fused_moe on CUDA) against its floor.

    python benchmarks/bench_moe.py [--out DIR] [--quick]

Grid: expert shapes of real models (hidden, expert intermediate, experts, top-k) x tokens x
adapters (0: no LoRA in the step; else every token has one, spread over that many slots, rank
16 on w13 and w2 of every expert). Each case is timed eagerly (do_bench, L2 emptied before each
call) and, up to 256 tokens, replayed in a CUDA graph (the decode path); before timing, each
shape's output is checked against the PyTorch reference.

Floor, measured in the same run: max(bytes / copy bandwidth, FLOPs / bf16 matmul rate).
Bytes: w13 and w2 of every expert the step routes to, A and B of every (slot, expert) pair it
uses, x read, h [T*K, 2I] and act [T*K, I] and y [T*K, H] written and read once each, out written.
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


def floor_us(shape, tokens, ids, meta, ceil) -> tuple[float, float]:
    """(floor, bytes term alone) in microseconds; expert and (slot, expert) counts from the step's routing."""
    hidden, inter, experts, top_k = shape
    pairs = tokens * top_k
    hit = ids.unique().numel()
    moved = hit * 3 * hidden * inter * 2 + tokens * hidden * 2 * 2 + pairs * (2 * inter + inter + hidden) * 2 * 2
    flops = pairs * 2 * 3 * hidden * inter
    if meta is not None:
        used = (meta.token_slots.long()[:, None] * experts + ids).unique().numel()
        moved += used * (2 * RANK * hidden + 2 * inter * RANK + RANK * inter + hidden * RANK) * 2
        flops += pairs * 2 * (2 * RANK * hidden + 2 * inter * RANK + RANK * inter + hidden * RANK)
    bytes_us = moved / ceil["copy_bytes_per_s"] * 1e6
    return max(bytes_us, flops / ceil["bf16_flops_per_s"] * 1e6), bytes_us


def check(layer, shape, gen) -> float:
    """Relative error of the Triton path against the reference on a 16-token mixed step."""
    w13, w2, l13, l2, router = layer
    x, w, ids, meta = step_inputs(16, 4, shape[0], router, shape[3], gen)
    got = triton_moe.fused_moe(x, w, ids, w13, w2, l13, l2, meta).double()
    want = moe_reference.fused_moe(x.float(), w, ids, w13.float(), w2.float(), _f32(l13), _f32(l2), meta).double()
    return ((got - want).norm() / want.norm()).item()


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
        for tokens in tokens_list:
            for adapters in ADAPTERS:
                x, w, ids, meta = step_inputs(tokens, adapters, hidden, router, top_k, gen)
                lora13, lora2 = (l13, l2) if adapters else (None, None)

                def layer_fn():
                    return triton_moe.fused_moe(x, w, ids, w13, w2, lora13, lora2, meta)

                eager_us = do_bench(layer_fn, warmup=5, rep=30, return_mode="median") * 1e3
                graph_us = None
                if tokens <= GRAPH_MAX_TOKENS:
                    graph = capture(layer_fn)
                    graph_us = do_bench(graph.replay, warmup=5, rep=30, return_mode="median") * 1e3
                floor, bytes_us = floor_us(shape, tokens, ids, meta, ceil)
                best = min(t for t in (eager_us, graph_us) if t is not None)
                rows.append(
                    dict(
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
                )
                print(row_text(rows[-1]), flush=True)
        layer = w13 = w2 = l13 = l2 = router = None  # frees this shape's weights (closures hold the names)
        torch.cuda.empty_cache()
    return ceil, rows


def row_text(r) -> str:
    graph = f"{r['graph_us']:9.1f}" if r["graph_us"] is not None else f"{'-':>9}"
    return (
        f"| {r['shape']:<14} | {r['tokens']:>5} | {r['adapters']:>2} | {r['eager_us']:9.1f} | {graph} "
        f"| {r['floor_us']:9.1f} | {r['x_floor']:6.2f} |"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="folder for bench_moe.md / bench_moe.json")
    parser.add_argument("--quick", action="store_true", help="tokens 1, 64, 1024 only")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {DTYPE}, rank {RANK}, {SLOTS} slots")
    header = [
        "| shape          | T     | A  | eager us  | graph us  | floor us  | x floor |",
        "|----------------|-------|----|-----------|-----------|-----------|---------|",
    ]
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
