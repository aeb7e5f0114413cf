"""One LoRA kernel on one real-shape case, run eagerly a few times: a target for a profiler.

    ncu --kernel-name regex:_expand_kernel --launch-skip 2 --launch-count 1 --set full \
        python benchmarks/profile_lora_kernel.py --op expand --widths 14784,14784 --rank 128 --tokens 4096

Builds the case as `bench_kernels.py --real` does (benchmarks/real_grid.py: weights in slots, one
grouping for the step), optionally with a config of its own (--config '{"block_m": 128, ...}'
replaces the table's entry for this shape and token count), launches the op --repeat times and
prints a rough eager time per launch (CUDA events over back-to-back launches, launch cost
included; the benchmarks' graph-replayed times and a profiler's kernel times are the ones to quote).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import real_grid
from bench_kernels import DEV, DTYPE, offsets_of, token_slots
from loraserve.kernels import lora_expand, lora_shrink, make_lora_meta, tuning


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", choices=("shrink", "expand"), required=True)
    p.add_argument("--in-features", type=int, default=4096, help="the shrink's input size")
    p.add_argument("--widths", default="4096", help="output slice widths, comma list")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--adapters", type=int, default=1)
    p.add_argument("--config", default=None, help="JSON of a ShrinkConfig / ExpandConfig to use instead of the table's")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    widths = tuple(int(w) for w in args.widths.split(","))
    gen = torch.Generator(device=DEV).manual_seed(0)
    pool = real_grid.RealPool.make(False, args.in_features, widths, args.rank, args.adapters, copies=1)
    lora_a, lora_b = pool.weights[0]
    key = tuning.gpu_key(torch.device(DEV))
    if args.config:
        entry = json.loads(args.config)
        cls = tuning.ShrinkConfig if args.op == "shrink" else tuning.ExpandConfig
        shape = (tuning.shrink_key(args.in_features, len(widths), args.rank) if args.op == "shrink"
                 else tuning.expand_key(widths, args.rank))
        table = json.loads(json.dumps(tuning._table(key)))
        table.setdefault(args.op, {}).setdefault(shape, {})[str(args.tokens)] = tuning.as_dict(cls(**entry))
        tuning.set_table(key, table)
    meta = make_lora_meta(token_slots(args.tokens, args.tokens, args.adapters, gen), args.adapters)
    x = torch.randn(args.tokens, args.in_features, device=DEV, dtype=DTYPE, generator=gen)
    y = torch.randn(args.tokens, sum(widths), device=DEV, dtype=DTYPE, generator=gen)
    buf = lora_shrink(x, lora_a, meta)
    config = real_grid.configs(pool, args.tokens)[f"{args.op}_cfg"]

    def run():
        if args.op == "shrink":
            lora_shrink(x, lora_a, meta, out=buf)
        else:
            lora_expand(y, buf, lora_b, offsets_of(widths), meta)

    for _ in range(args.repeat):
        run()
    times = []
    for _ in range(5):  # 20 launches back to back per sample: a lone launch meets the GPU's idle clocks
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / 20)
    print(f"{args.op} in {args.in_features} widths {widths} rank {args.rank} T={args.tokens} adapters {args.adapters}: "
          f"{config}; eager, per launch: median {statistics.median(times):.1f} us (launch cost included; "
          "a profiler's kernel time is the figure to quote)")


if __name__ == "__main__":
    main()
