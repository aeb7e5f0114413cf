"""The one-kernel LoRA layer's launch settings at decode, against shrink + expand (on a CUDA host).

    python benchmarks/bench_fused.py [--tokens 1,17] [--ranks 8,16]

Each program of kernels/triton_lora_fused.py reduces its block's x rows and the slot's A rows over
the whole input before it adds its columns of y: at decode that serial read is its critical path.
This times, per real decode layer shape (benchmarks/real_grid.py's graphs and floor), shrink +
expand and the one-kernel layer under each (block_k, num_warps, num_stages) of --configs, the
other settings as tuning.fused_estimate picks them. Prints one table; asserts nothing on time.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from bench_kernels import measure_ceilings
from loraserve.kernels import tuning
from real_grid import RealPool, measure

SHAPES = (  # (in, output slice widths): decode layers from small to long reductions
    (576, (576,)),
    (2048, (2048,)),
    (4096, (4096,)),
    (4096, (4096, 1024, 1024)),
    (4096, (14336, 14336)),
    (8192, (8192,)),
    (14336, (4096,)),
)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,17")
    parser.add_argument("--ranks", default="8,16")
    parser.add_argument("--configs", default="256:4:3,512:4:3,1024:4:2,1024:8:3,2048:8:2,512:4:4",
                        help="block_k:num_warps:num_stages of the one-kernel layer, comma separated")
    args = parser.parse_args()
    configs = [tuple(int(v) for v in c.split(":")) for c in args.configs.split(",")]
    ceil = measure_ceilings()
    launch = ceil["empty_launch_us"]
    print(f"{torch.cuda.get_device_name()}, empty graph-replayed launch {launch:.2f} us")
    print("| in | widths | rank | tokens | floor + 2 launches us | shrink + expand us | "
          + " | ".join(f"k{k} w{w} s{s}" for k, w, s in configs) + " |")
    print("|" + "---|" * (6 + len(configs)))
    gen = torch.Generator(device="cuda").manual_seed(0)
    estimate = tuning.fused_estimate
    started = time.time()
    for in_features, widths in SHAPES:
        for rank in (int(r) for r in args.ranks.split(",")):
            pool = RealPool.make(False, in_features, widths, rank, slots=4)
            for tokens in (int(t) for t in args.tokens.split(",")):
                two = measure(pool, tokens, 1, ceil, gen, ops=("layer",))
                cells = []
                for block_k, warps, stages in configs:
                    def pick(*a, _k=block_k, _w=warps, _s=stages):
                        cfg, program_bytes, total_bytes = estimate(*a)
                        return dataclasses.replace(cfg, block_k=_k, num_warps=_w, num_stages=_s), program_bytes, total_bytes

                    tuning.fused_estimate = pick
                    try:
                        cells.append(f"{measure(pool, tokens, 1, ceil, gen, ops=('fused',))['fused_us']:.1f}")
                    except Exception as exc:  # a config over a limit (shared memory) ends no run
                        cells.append(f"failed ({str(exc)[:40]})")
                    finally:
                        tuning.fused_estimate = estimate
                print(f"| {in_features} | {'+'.join(map(str, widths))} | {rank} | {tokens} "
                      f"| {two['floor_us'] + 2 * launch:.2f} | {two['layer_us']:.1f} | " + " | ".join(cells) + " |",
                      flush=True)
            del pool
    print(f"{time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
