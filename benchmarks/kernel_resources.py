"""What each LoRA kernel launch of real layer shapes compiles to on an H100, built without a GPU.

For every (model layer, token count, slot rank) asked for, runs the LoRA wrappers
(kernels/triton_lora.py) as when serving, with the H100 table, but each launch builds its kernel
variant for sm90 instead of running (kernels/offline_build.py). Prints one row per launch: the
table's config, the grid, the compiled code's registers per thread, local memory (spills) and
shared memory per block, how many of its blocks an SM holds at once against the CTAs per SM the
table asks for, and the waves the grid takes (more than one: some programs start only when others
end). A summary counts the launches by waves. Times nothing: what the GPU does with the code is
for bench_kernels.py on a CUDA host.

Usage: python benchmarks/kernel_resources.py [--models llama-3-8b,qwen2.5-7b] [--tp 1]
       [--tokens 1,8,32,64,256,1031] [--ranks 16,64] [--only-waves]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from collections import Counter

from loraserve.kernels import model_shapes
from loraserve.kernels.offline_build import (
    H100_SMS,
    H100_TABLE,
    launch_lora_layer,
    lora_builds_for_h100,
    resident_ctas,
    resources,
)


def int_list(text: str) -> list[int]:
    """'1,8,32' -> [1, 8, 32], positive integers only (an argparse type)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama-3-8b,qwen2.5-7b", help="families of kernels/model_shapes.py")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size whose per-rank shapes are built")
    p.add_argument("--tokens", type=int_list, default=[1, 8, 32, 64, 256, 1031], help="token counts, e.g. 1,8,32")
    p.add_argument("--ranks", type=int_list, default=[16, 64], help="slot ranks, e.g. 16,64")
    p.add_argument("--only-waves", action="store_true", help="print only the launches of more than one wave")
    args = p.parse_args()
    models = set(args.models.split(","))
    shapes = [s for s in model_shapes.real_shapes(tp_sizes=(args.tp,)) if s.model in models and s.kind != "embedding"]
    if not shapes:
        p.error(f"no layer shapes for models {sorted(models)} at tp {args.tp} (known: "
                f"{', '.join(f.name for f in model_shapes.FAMILIES)})")
    tokens, ranks = args.tokens, args.ranks

    picked: dict = {}  # the config each op's last wrapper call picked ("shrink" / "expand")
    rows = []
    built: list = []
    total = len(shapes) * len(tokens) * len(ranks)
    with lora_builds_for_h100(built, on_config=picked.__setitem__):
        for i, (shape, t, r) in enumerate((s, t, r) for s in shapes for t in tokens for r in ranks):
            before = len(built)
            launch_lora_layer(shape, t, r, adapters=8)
            rows += [(shape, t, r, picked["shrink" if b.name == "_shrink_kernel" else "expand"], b)
                     for b in built[before:]]
            if (i + 1) % 20 == 0 or i + 1 == total:
                print(f"built {i + 1} / {total} layer launches ({len(built)} kernel launches)", file=sys.stderr)

    print(f"\nLoRA kernel launches built for an H100 (sm90) without one - {platform.node()}, "
          f"{datetime.date.today()}; table {H100_TABLE}, {H100_SMS} SMs, bf16, 8 adapters")
    print("| model | layer | tokens | rank | kernel | config (m, n, k / iters, split, warps, stages, CTAs/SM) "
          "| grid | regs | local B | shared B | SM holds | waves |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    waves_count: Counter = Counter()
    cache = {}
    for shape, t, r, cfg, b in rows:
        key = id(b.compiled)
        if key not in cache:
            cache[key] = resources(b.compiled)
        res = cache[key]
        holds = resident_ctas(res, b.compiled.metadata.num_warps)
        waves = -(-b.grid[0] // (holds * H100_SMS)) if holds else "cannot launch"
        waves_count[waves] += 1
        if args.only_waves and waves == 1:
            continue
        kind = "shrink" if b.name == "_shrink_kernel" else "expand"
        shape_cfg = (f"{cfg.block_m}, {cfg.block_n}, {cfg.block_k}, split {cfg.split_k}" if kind == "shrink"
                     else f"{cfg.block_m}, {cfg.block_n}, iters {cfg.n_iters}")
        print(f"| {shape.model} | {shape.kind} | {t} | {r} | {kind} | {shape_cfg}, {cfg.num_warps}w, "
              f"{cfg.num_stages}s, {cfg.ctas_per_sm} | {b.grid[0]} | {res.registers} | {res.local} | {res.shared} "
              f"| {holds} | {waves} |")
    spills = sum(1 for res in cache.values() if res.local)
    print(f"\n{len(rows)} kernel launches, {len(cache)} distinct variants; by waves: "
          + ", ".join(f"{w}: {n}" for w, n in sorted(waves_count.items(), key=str))
          + f"; variants with local memory (spills): {spills}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
