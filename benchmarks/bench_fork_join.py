"""What a side stream's fork and join cost inside a CUDA graph (CUDA host).

Each LoRA layer of a decode step forks the step's stream to a side stream for its shrink, beside
the base GEMM, and joins it before its expand (executor/lora.py); the captured decode graph keeps
those forks and joins. The engine's ablations (docs/BENCHMARKS.md, "Thirteenth pass") put ~0.43 ms
of a step on the fork and join themselves, with the shrinks and expands taken out. This times the
pattern alone: a CUDA graph of --layers layers, each distinct weights (no layer reads another's from
the L2 cache), replayed; per layer, one of

  none        gemm                                 (one stream)
  serial      gemm, shrink, expand                 (one stream)
  side        fork; shrink on the side stream; gemm; join; expand   (the executor's form)
  side-empty  fork; gemm; join                     (nothing on the side stream)
  side-tiny   fork; a one-element add on the side stream; gemm; join

with gemm a bf16 [tokens, K] @ [K, N] linear (cuBLAS), shrink x @ A.T to [tokens, rank] for one
adapter (A is rank x K: a small read, unlike a decode step's dozens of adapters), expand y +=
shrink @ B.T. Prints us per layer (median of --replays replays, after warm-ups) and the
differences that answer: what the fork and join cost with nothing, or next to nothing, on the side
(side-empty - none, side-tiny - none), and what the side stream nets against serial (side - serial).

    python benchmarks/bench_fork_join.py [--layers 128] [--tokens 64] [--n 4096] [--k 4096] [--rank 64]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

FORMS = ("none", "serial", "side", "side-empty", "side-tiny")


def build(args):
    dev = torch.device("cuda")
    dt = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=dev, dtype=dt, generator=g) * 0.02

    x = rand(args.tokens, args.k)
    layers = [(rand(args.n, args.k), rand(args.rank, args.k), rand(args.n, args.rank)) for _ in range(args.layers)]
    tiny = torch.zeros(1, device=dev)
    return x, layers, tiny


def layer(form: str, x, w, a, b, tiny, side: torch.cuda.Stream):
    main = torch.cuda.current_stream()
    if form in ("none", "serial"):
        y = F.linear(x, w)
        if form == "serial":
            y.addmm_(F.linear(x, a), b.t())
        return y
    side.wait_stream(main)
    with torch.cuda.stream(side):
        if form == "side":
            buf = F.linear(x, a)
        elif form == "side-tiny":
            tiny.add_(1.0)
    y = F.linear(x, w)
    main.wait_stream(side)
    if form == "side":
        y.addmm_(buf, b.t())
    return y


def time_form(form: str, args, x, layers, tiny, side) -> float:
    """us per layer: the graph of every layer in this form, replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture (cuBLAS picks and allocates its handles)
        for w, a, b in layers[:2]:
            layer(form, x, w, a, b, tiny, side)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w, a, b in layers:
            layer(form, x, w, a, b, tiny, side)
    for _ in range(args.warmups):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(layers))
    del graph
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=128, help="layers in the graph (a Llama-3-8B decode step has 128 LoRA layers)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--n", type=int, default=4096, help="the base GEMM's output columns")
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--warmups", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2, help="each form timed this many times, in turn")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fork_join.py needs a CUDA device")
    x, layers, tiny = build(args)
    side = torch.cuda.Stream()
    results = {f: [] for f in FORMS}
    for _ in range(args.rounds):
        for form in FORMS:
            results[form].append(time_form(form, args, x, layers, tiny, side))
    us = {f: statistics.median(v) for f, v in results.items()}
    print(f"\nfork and join in a CUDA graph - {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"{args.layers} layers of [{args.tokens}, {args.k}] @ [{args.k}, {args.n}], rank {args.rank}")
    print("| form | us per layer (each round) | median |")
    print("|---|---|---|")
    for form in FORMS:
        print(f"| {form} | {' / '.join(f'{t:.2f}' for t in results[form])} | {us[form]:.2f} |")
    print(f"\nfork and join, nothing on the side: {us['side-empty'] - us['none']:+.2f} us per layer; "
          f"with a one-element add there: {us['side-tiny'] - us['none']:+.2f}; "
          f"the side stream against serial: {us['side'] - us['serial']:+.2f} "
          f"(x {args.layers} layers: {(us['side'] - us['serial']) * args.layers / 1e3:+.3f} ms a step)")


if __name__ == "__main__":
    main()
