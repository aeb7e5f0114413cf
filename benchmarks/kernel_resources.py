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
from contextlib import ExitStack
from unittest import mock

import torch

from loraserve.kernels import make_lora_meta, model_shapes, triton_lora, tuning
from loraserve.kernels.offline_build import H100_SMS, building_for, launches_build, resident_ctas, resources

TABLE = "nvidia_h100_80gb_hbm3"


class Patches:
    """setattr / setitem undone together (the monkeypatch interface launches_build takes)."""

    def __init__(self):
        self.stack = ExitStack()

    def setattr(self, obj, name, value):
        self.stack.enter_context(mock.patch.object(obj, name, value))

    def setitem(self, mapping, key, value):
        self.stack.enter_context(mock.patch.dict(mapping, {key: value}))

    def undo(self):
        self.stack.close()


def launch(shape: model_shapes.LayerShape, tokens: int, rank: int) -> None:
    """One layer's shrink and expand as the engine calls them: 8 adapters, no-adapter tokens among them."""
    slots = torch.tensor([i % 9 - 1 for i in range(tokens)], dtype=torch.int32)
    meta = make_lora_meta(slots, 8)
    widths = shape.widths
    offsets = tuple(sum(widths[:i]) for i in range(len(widths) + 1))
    x = torch.empty(tokens, shape.in_features, dtype=torch.bfloat16)
    lora_a = torch.empty(8, len(widths), rank, shape.in_features, dtype=torch.bfloat16)
    lora_b = torch.empty(8, offsets[-1], rank, dtype=torch.bfloat16)
    buf = triton_lora.lora_shrink(x, lora_a, meta)
    triton_lora.lora_expand(torch.empty(tokens, offsets[-1], dtype=torch.bfloat16), buf, lora_b, offsets, meta)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama-3-8b,qwen2.5-7b", help="families of kernels/model_shapes.py")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size whose per-rank shapes are built")
    p.add_argument("--tokens", default="1,8,32,64,256,1031")
    p.add_argument("--ranks", default="16,64", help="slot ranks")
    p.add_argument("--only-waves", action="store_true", help="print only the launches of more than one wave")
    args = p.parse_args()
    models = set(args.models.split(","))
    shapes = [s for s in model_shapes.real_shapes(tp_sizes=(args.tp,)) if s.model in models and s.kind != "embedding"]
    if not shapes:
        p.error(f"no layer shapes for models {sorted(models)} at tp {args.tp} (known: "
                f"{', '.join(f.name for f in model_shapes.FAMILIES)})")
    tokens = [int(t) for t in args.tokens.split(",")]
    ranks = [int(r) for r in args.ranks.split(",")]

    configs: list = []  # the config of each launch, in launch order (one per wrapper call)

    def recording(pick):
        def pick_and_keep(*a):
            configs.append(pick(*a))
            return configs[-1]
        return pick_and_keep

    rows = []
    patch = Patches()
    try:
        patch.setitem(tuning._gpu_keys, None, TABLE)
        patch.setattr(triton_lora, "num_sms", lambda index: H100_SMS)
        patch.setattr(triton_lora, "shrink_config", recording(triton_lora.shrink_config))
        patch.setattr(triton_lora, "expand_config", recording(triton_lora.expand_config))
        built: list = []
        launches_build(patch, triton_lora, ("_shrink_kernel", "_expand_kernel"), built)
        total = len(shapes) * len(tokens) * len(ranks)
        with building_for():
            for i, (shape, t, r) in enumerate((s, t, r) for s in shapes for t in tokens for r in ranks):
                before = len(built)
                launch(shape, t, r)
                cfg = {"_shrink_kernel": configs[-2], "_expand_kernel": configs[-1]}
                rows += [(shape, t, r, cfg[b.name], b) for b in built[before:]]
                if (i + 1) % 20 == 0 or i + 1 == total:
                    print(f"built {i + 1} / {total} layer launches ({len(built)} kernel launches)", file=sys.stderr)
    finally:
        patch.undo()

    print(f"\nLoRA kernel launches built for an H100 (sm90) without one - {platform.node()}, "
          f"{datetime.date.today()}; table {TABLE}, {H100_SMS} SMs, bf16, 8 adapters")
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
        waves = -(-b.grid[0] // (holds * H100_SMS))
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
          + ", ".join(f"{w}: {n}" for w, n in sorted(waves_count.items()))
          + f"; variants with local memory (spills): {spills}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
