"""LoRA layers of one decode step (or mixed step: --prompts) when the adapters' ranks differ from the slots' rank.

    python benchmarks/bench_ranks.py [--out DIR] [--tokens 64] [--adapters 40] [--prompts 8x160 --pad-to 1536]
    ncu -k "regex:_shrink_kernel|_expand_kernel" python benchmarks/bench_ranks.py --launch-only "gate_up:8/16/32/64 in 64"

The executor's slot buffers have one rank (the largest an adapter may have); an adapter of a
smaller rank sits in them zero-padded, and the kernels read it only up to its own rank
(LoraMeta.slot_ranks). This times, for each LoRA layer of a Llama-3-8B-shaped model (q/k/v,
o, gate/up, down), shrink alone, expand alone and the two together inside CUDA graphs, with
the same tokens and adapters in slots of rank 64 holding adapters of rank 64, of ranks 8/16/32/64
in turn, of rank 16 and of rank 8, and beside them rank 16 and rank 8 in slots of their own
rank. Each row's floor is its bytes (x, each adapter's A and B up to its own rank, the float32
buffer, y read and written) at the copy bandwidth measured in the same run, plus two graph
launches. Prints one table (writes ranks.md under --out); asserts nothing on time.

--prompts NxL adds N prompt chunks of L tokens to the step (chunk i on adapter 5i mod --adapters, so
they join decode groups as a serving engine's mixed step does), and --pad-to pads the step with
no-adapter tokens up to a graph bucket: the LoRA layers of a mixed step (prefill chunks beside
decode rows), looked up and swept at the padded token count.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, replace

import torch
from bench_kernels import BENCH_MS, DEV, DTYPE, capture, env_info, measure_ceilings, offsets_of
from triton.testing import do_bench

from loraserve.kernels import lora_expand, lora_shrink, make_lora_meta, tuning

# Llama-3-8B: hidden 4096, intermediate 14336, 32 query heads and 8 KV heads of 128.
LAYERS = {
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}
CASES = (  # (name, slot rank, adapter ranks taken in turn)
    ("64 in 64", 64, (64,)),
    ("8/16/32/64 in 64", 64, (8, 16, 32, 64)),
    ("16 in 64", 64, (16,)),
    ("8 in 64", 64, (8,)),
    ("16 in 16", 16, (16,)),
    ("8 in 8", 8, (8,)),
)
COPIES = 8  # layers per replayed graph, each with its own weights and activations


def make_weights(in_features, widths, slot_rank, ranks, gen):
    """COPIES sets of A [L, S, R, in] and B [L, N, R], zero past each slot's adapter rank (as loaded)."""
    adapters = len(ranks)
    rank_pos = torch.arange(slot_rank, device=DEV)
    live = rank_pos[None, :] < torch.tensor(ranks, device=DEV)[:, None]  # [L, R]
    sets = []
    for _ in range(COPIES):
        a = torch.randn(adapters, len(widths), slot_rank, in_features, device=DEV, dtype=DTYPE, generator=gen)
        b = torch.randn(adapters, sum(widths), slot_rank, device=DEV, dtype=DTYPE, generator=gen)
        a.mul_(live[:, None, :, None].to(DTYPE) * in_features**-0.5)
        b.mul_(live[:, None, :].to(DTYPE) * slot_rank**-0.5)
        sets.append((a, b))
    return sets


def floor_us(in_features, widths, slot_rank, ranks, tokens, ceil) -> float:
    s, n = len(widths), sum(widths)
    moved = (
        tokens * in_features * 2
        + sum((s * r * in_features + n * r) * 2 for r in ranks)
        + 2 * s * tokens * slot_rank * 4
        + 2 * tokens * n * 2
    )
    return moved / ceil["copy_bytes_per_s"] * 1e6 + 2 * ceil["empty_launch_us"]


@dataclass(frozen=True)
class Layout:
    """A step's tokens: `decode` one-token rows over `adapters` adapters, prompt chunks of the given
    lengths (chunk i on adapter 5i mod adapters), then no-adapter padding up to `pad_to`."""

    decode: int
    adapters: int
    prompts: tuple[int, ...] = ()
    pad_to: int = 0

    @property
    def lora_tokens(self) -> int:
        return self.decode + sum(self.prompts)

    @property
    def total(self) -> int:
        return max(self.lora_tokens, self.pad_to)

    def slots(self, gen) -> torch.Tensor:
        parts = [torch.arange(self.decode, device=DEV) % self.adapters]
        parts += [torch.full((n,), (5 * i) % self.adapters, device=DEV) for i, n in enumerate(self.prompts)]
        parts.append(torch.full((self.total - self.lora_tokens,), -1, device=DEV))
        slots = torch.cat(parts).to(torch.int32)
        return slots[torch.randperm(slots.shape[0], device=DEV, generator=gen)]


def parse_prompts(text: str) -> tuple[int, ...]:
    """'8x160' -> eight chunks of 160 tokens; '2x256,4x64' -> both; '' -> none."""
    out = []
    for part in filter(None, text.split(",")):
        count, _, length = part.partition("x")
        out += [int(length)] * int(count)
    return tuple(out)


@dataclass
class Setup:
    """One layer's weights, activations and per-step grouping for one case."""

    layer: str
    case: tuple
    ranks: list[int]
    weights: list
    acts: list
    meta: object
    offsets: tuple[int, ...]

    @staticmethod
    def make(layer, case, layout: "Layout", gen) -> "Setup":
        in_features, widths = LAYERS[layer]
        _, slot_rank, cycle = case
        adapters = layout.adapters
        ranks = [cycle[i % len(cycle)] for i in range(adapters)]
        slots = layout.slots(gen)
        tokens = slots.shape[0]
        meta = make_lora_meta(slots, adapters, slot_ranks=torch.tensor(ranks, device=DEV, dtype=torch.int32))
        offsets = offsets_of(widths)
        acts = [
            (
                torch.randn(tokens, in_features, device=DEV, dtype=DTYPE, generator=gen),
                torch.randn(tokens, offsets[-1], device=DEV, dtype=DTYPE, generator=gen),
                torch.zeros(len(widths), tokens, slot_rank, device=DEV),
            )
            for _ in range(COPIES)
        ]
        weights = make_weights(in_features, widths, slot_rank, ranks, gen)
        return Setup(layer, case, ranks, weights, acts, meta, offsets)

    def time_us(self, op) -> float:
        """One layer's op ("shrink", "expand" or "layer": both), per layer of a replayed graph."""

        def step():
            for (x, y, buf), (a, b) in zip(self.acts, self.weights):
                if op != "expand":
                    lora_shrink(x, a, self.meta, out=buf)
                if op != "shrink":
                    lora_expand(y, buf, b, self.offsets, self.meta)

        graph = capture(step)
        us = do_bench(graph.replay, return_mode="median", **BENCH_MS) * 1e3 / COPIES
        del graph
        return us


def run(layer, case, layout, ceil, gen):
    in_features, widths = LAYERS[layer]
    setup = Setup.make(layer, case, layout, gen)
    times = {op: setup.time_us(op) for op in ("shrink", "expand", "layer")}
    slot_rank = case[1]
    cfg = tuning.shrink_config(torch.device(DEV), layout.total, in_features, len(widths), slot_rank)
    ecfg = tuning.expand_config(torch.device(DEV), layout.total, tuple(widths), slot_rank)
    floor = floor_us(in_features, widths, slot_rank, setup.ranks, layout.lora_tokens, ceil)
    del setup
    torch.cuda.empty_cache()
    return dict(
        layer=layer,
        case=case[0],
        floor_us=floor,
        **{f"{k}_us": v for k, v in times.items()},
        shrink_cfg=f"m{cfg.block_m} n{cfg.block_n} k{cfg.block_k} s{cfg.split_k}",
        expand_cfg=f"m{ecfg.block_m} n{ecfg.block_n}x{ecfg.n_iters}",
    )


# --sweep: launch settings to try at decode (block_m, block_n, n_iters / block_k + input columns
# per K split, num_warps, num_stages, ctas_per_sm)
EXPAND_SWEEP = [
    (16, 64, 1, 4, 1, 8),
    (16, 128, 1, 4, 1, 8),
    (16, 64, 2, 4, 2, 8),
    (16, 64, 4, 4, 2, 4),
    (16, 128, 2, 4, 2, 4),
    (16, 256, 1, 4, 1, 4),
    (16, 64, 1, 4, 1, 16),
    (16, 64, 1, 2, 1, 16),
    (16, 128, 1, 2, 1, 8),
    (16, 32, 4, 4, 2, 8),
    (16, 128, 4, 4, 3, 4),
    (16, 256, 2, 8, 2, 2),
    (16, 128, 1, 4, 1, 4),
    (16, 128, 1, 4, 1, 16),
    (16, 128, 2, 4, 2, 8),
    (16, 256, 1, 4, 1, 8),
    (16, 128, 1, 8, 1, 4),
    (16, 64, 2, 4, 2, 4),
]
SHRINK_SWEEP = [  # (block_m, block_n, block_k, columns per split, num_warps, num_stages, ctas_per_sm)
    (16, 64, 64, 256, 4, 4, 8),
    (16, 64, 128, 256, 4, 4, 8),
    (16, 64, 64, 128, 4, 4, 8),
    (16, 32, 64, 256, 4, 4, 8),
    (16, 64, 64, 512, 4, 2, 8),
    (16, 64, 64, 256, 4, 4, 16),
    (16, 64, 64, 256, 2, 4, 16),
]
# Past decode token counts (a mixed step: prompt chunks beside one-token groups): taller tiles and
# wider column blocks (fewer re-reads of x and A) against the decode-style short splits
SHRINK_SWEEP_PREFILL = [
    (64, 64, 256, 4096, 4, 3, 2),
    (64, 128, 128, 4096, 4, 3, 2),
    (64, 256, 64, 4096, 8, 3, 1),
    (64, 128, 64, 1024, 4, 4, 2),
    (64, 64, 128, 1024, 4, 3, 4),
    (64, 128, 128, 1024, 8, 3, 2),
    (32, 64, 128, 1024, 4, 4, 4),
    (32, 128, 64, 1024, 4, 4, 4),
    (32, 64, 128, 512, 4, 4, 4),
    (16, 64, 128, 512, 4, 4, 8),
    (16, 64, 64, 256, 4, 4, 8),
    (128, 128, 64, 4096, 8, 3, 1),
    (128, 64, 64, 1024, 8, 3, 2),
]
EXPAND_SWEEP_PREFILL = [
    (64, 64, 2, 4, 1, 4),
    (32, 128, 2, 4, 2, 4),
    (64, 128, 1, 4, 2, 2),
    (64, 128, 2, 8, 2, 2),
    (32, 64, 2, 4, 2, 4),
    (16, 128, 1, 4, 1, 8),
    (128, 64, 2, 8, 2, 2),
    (64, 256, 1, 8, 2, 2),
]
REGS_SWEEP = (128, 96, 80, 64)  # register caps tried on the table's own setting (maxnreg)
SWEEP_CASES = ("8/16/32/64 in 64", "16 in 16", "64 in 64")


def _candidates(op, in_features, widths, rank, current, regs_only=False, tokens=0):
    """(label, config) of each setting to time for one layer: the table's own first, then the list
    (unless regs_only; the prefill list past decode token counts), then the table's own with its
    registers capped."""
    out = [(f"table: {_label(op, current, in_features)}", current)]
    rows = EXPAND_SWEEP if op == "expand" else SHRINK_SWEEP
    if tokens > tuning.DECODE_MAX_TOKENS:
        rows = EXPAND_SWEEP_PREFILL if op == "expand" else SHRINK_SWEEP_PREFILL
    for row in () if regs_only else rows:
        if op == "expand":
            cfg = tuning.ExpandConfig(*row)
        else:
            block_m, block_n, block_k, per_split, warps, stages, ctas = row
            split = tuning.pow2_split(in_features, block_k, per_split)
            cfg = tuning.ShrinkConfig(
                block_m, min(block_n, tuning._pow2(len(widths) * rank)), block_k, split, warps, stages, ctas
            )
        if all(cfg != seen for _, seen in out):
            out.append((_label(op, cfg, in_features), cfg))
    for regs in REGS_SWEEP:  # the table's own setting with its registers capped, at 1x and 2x the programs
        for ctas in (current.ctas_per_sm, current.ctas_per_sm * 2):
            cfg = replace(current, maxnreg=regs, ctas_per_sm=ctas)
            if all(cfg != seen for _, seen in out):
                out.append((_label(op, cfg, in_features), cfg))
    return out


def _label(op, cfg, in_features) -> str:
    if op == "expand":
        return (
            f"m{cfg.block_m} n{cfg.block_n}x{cfg.n_iters} w{cfg.num_warps} st{cfg.num_stages} c{cfg.ctas_per_sm}"
            + _regs_label(cfg)
        )
    per_split = -(-in_features // cfg.split_k)
    return (
        f"m{cfg.block_m} n{cfg.block_n} k{cfg.block_k}/{per_split} w{cfg.num_warps} st{cfg.num_stages} c{cfg.ctas_per_sm}"
        + _regs_label(cfg)
    )


def _regs_label(cfg) -> str:
    return f" r{cfg.maxnreg}" if cfg.maxnreg else ""


def sweep(layout, gen, out_lines, save, ops=("expand", "shrink"), case_names=SWEEP_CASES, regs_only=False):
    """Each launch setting of each op, forced through the device's table, on each layer and case
    (the step's tokens as `layout` lays them out; the table entry set at its padded token count).

    Returns {(op, table key): {config: [us per case, summed over the layers sharing the key]}}."""
    key = tuning.gpu_key(torch.device(DEV))
    saved = tuning._table(key)
    tokens = layout.total
    by_name = {c[0]: c for c in CASES}
    cases = [by_name[n] for n in case_names]  # in the order given: pick() optimizes the first
    rank = cases[0][1]
    if any(c[1] != rank for c in cases):
        raise SystemExit("--sweep-cases: every case must have the same slot rank (one table key per layer)")
    header = "| layer | op | setting | " + " | ".join(f"{c[0]} us" for c in cases) + " |"
    out_lines += ["", header, "|" + "---|" * (header.count("|") - 1)]
    print("\n".join(out_lines[-2:]), flush=True)
    measured: dict = {}
    for layer, (in_features, widths) in LAYERS.items():
        setups = [Setup.make(layer, case, layout, gen) for case in cases]
        for op in ops:
            if op == "expand":
                shape, current = (
                    tuning.expand_key(tuple(widths), rank),
                    tuning.expand_config(torch.device(DEV), tokens, tuple(widths), rank),
                )
            else:
                shape = tuning.shrink_key(in_features, len(widths), rank)
                current = tuning.shrink_config(torch.device(DEV), tokens, in_features, len(widths), rank)
            for label, cfg in _candidates(op, in_features, widths, rank, current, regs_only, tokens):
                times = []
                tuning.set_table(key, {op: {shape: {str(tokens): tuning.as_dict(cfg)}}})
                for setup in setups:
                    try:
                        times.append(setup.time_us(op))
                    except Exception:  # a setting that does not fit (shared memory) is skipped
                        times.append(float("inf"))
                tuning.set_table(key, saved)
                sums = measured.setdefault((op, shape), {}).setdefault(cfg, [0.0] * len(cases))
                for i, t in enumerate(times):
                    sums[i] += t
                out_lines.append(f"| {layer} | {op} | {label} | " + " | ".join(f"{t:.1f}" for t in times) + " |")
                print(out_lines[-1], flush=True)
        del setups
        torch.cuda.empty_cache()
        save()  # after each layer: a cut-off run keeps what it measured
    tuning.set_table(key, saved)
    return measured


def pick(measured, slack: float = 1.03):
    """Per table key, the setting fastest on the first case whose time on every other case stays within
    `slack` of the table's own setting (the first one timed); {(op, key): (config, old, new times)}
    for the keys where that is not the table's own."""
    chosen = {}
    for (op, shape), by_cfg in measured.items():
        (current, base), *_ = by_cfg.items()
        ok = [(t[0], cfg) for cfg, t in by_cfg.items() if all(x <= b * slack for x, b in zip(t[1:], base[1:]))]
        best_time, best = min(ok, key=lambda x: x[0])
        if best != current and best_time < base[0] / slack:
            chosen[(op, shape)] = (best, base, by_cfg[best])
    return chosen


HEADER = "| layer | adapters' ranks in slots of | shrink us | expand us | layer us | floor us | layer / floor | shrink cfg | expand cfg |"


def row_text(r) -> str:
    return (
        f"| {r['layer']} | {r['case']} | {r['shrink_us']:.1f} | {r['expand_us']:.1f} | {r['layer_us']:.1f} "
        f"| {r['floor_us']:.1f} | {r['layer_us'] / r['floor_us']:.2f} | {r['shrink_cfg']} | {r['expand_cfg']} |"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="folder for ranks.md")
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens in the step (one per sequence)")
    parser.add_argument("--adapters", type=int, default=40, help="distinct adapters among them")
    parser.add_argument(
        "--prompts", default="", metavar="NxL[,NxL]", help="prompt chunks beside the decode rows (a mixed step), e.g. 8x160"
    )
    parser.add_argument("--pad-to", type=int, default=0, help="no-adapter tokens up to this many (a graph bucket)")
    parser.add_argument("--sweep", action="store_true", help="also time each launch setting of a short list per op")
    parser.add_argument("--sweep-ops", default="expand,shrink", help="the ops --sweep times (comma list)")
    parser.add_argument(
        "--sweep-cases",
        default=";".join(SWEEP_CASES),
        help="the cases --sweep times, by name, ';'-separated (e.g. '8/16/32/64 in 64;64 in 64')",
    )
    parser.add_argument("--sweep-only", action="store_true", help="skip the table of every case (the sweep alone)")
    parser.add_argument(
        "--sweep-regs-only",
        action="store_true",
        help="--sweep tries only the table's own setting with its registers capped (maxnreg)",
    )
    parser.add_argument(
        "--sweep-table",
        default=None,
        help="write this GPU's table plus, per layer key, the swept setting fastest on the first "
        "--sweep-cases case that is no more than 3%% slower on the others and at least 3%% faster "
        "on the first than the table's own (at --tokens); the new entry also serves nearby shapes "
        "and token counts by the table's nearest-entry rule (kernels/tuning.py)",
    )
    parser.add_argument(
        "--launch-only",
        default=None,
        metavar="LAYER:CASE",
        help="launch that layer's shrink and expand eagerly 3 times each and time nothing (a target for "
        "a profiler, e.g. ncu -k regex:_shrink_kernel|_expand_kernel), e.g. 'gate_up:8/16/32/64 in 64'",
    )
    args = parser.parse_args()
    layout = Layout(args.tokens, args.adapters, parse_prompts(args.prompts), args.pad_to)
    if args.pad_to and args.pad_to < layout.lora_tokens:
        parser.error(f"--pad-to {args.pad_to} is below the step's {layout.lora_tokens} adapter tokens")
    if not torch.cuda.is_available():
        sys.exit("bench_ranks.py needs a CUDA device")
    if args.launch_only:
        layer, _, name = args.launch_only.partition(":")
        cases = {c[0]: c for c in CASES}
        if layer not in LAYERS or name not in cases:
            parser.error(
                f"--launch-only {args.launch_only!r}: LAYER:CASE with LAYER one of {', '.join(LAYERS)} "
                f"and CASE one of {'; '.join(cases)}"
            )
        setup = Setup.make(layer, cases[name], layout, torch.Generator(device=DEV).manual_seed(0))
        (x, y, buf), (a, b) = setup.acts[0], setup.weights[0]
        for _ in range(3):
            lora_shrink(x, a, setup.meta, out=buf)
            lora_expand(y, buf, b, setup.offsets, setup.meta)
        torch.cuda.synchronize()
        return
    ceil = measure_ceilings()
    info = env_info(ceil)
    gen = torch.Generator(device=DEV).manual_seed(0)
    lines = [f"{k}: {v}" for k, v in info.items()]
    lines += [
        f"decode tokens {args.tokens}, adapters {args.adapters}, prompt chunks {list(layout.prompts) or 'none'}, "
        f"{layout.total} tokens in all, {COPIES} layers per graph",
        "",
        HEADER,
        "|" + "---|" * 9,
    ]
    print("\n".join(lines), flush=True)
    totals = {}
    for case in () if args.sweep_only else CASES:
        for layer in LAYERS:
            r = run(layer, case, layout, ceil, gen)
            totals.setdefault(case[0], [0.0, 0.0])
            totals[case[0]][0] += r["layer_us"]
            totals[case[0]][1] += r["floor_us"]
            lines.append(row_text(r))
            print(lines[-1], flush=True)
    lines += ["", "| adapters' ranks in slots of | 4 layers us | floor us | ratio | x 32 layers ms |", "|---|---|---|---|---|"]
    for name, (t, f) in totals.items():
        lines.append(f"| {name} | {t:.1f} | {f:.1f} | {t / f:.2f} | {t * 32 / 1e3:.2f} |")
    print("\n".join(lines[-len(totals) - 2 :]))

    def save():
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "ranks.md"), "w") as f:
                f.write("\n".join(lines) + "\n")

    save()
    if args.sweep:
        measured = sweep(
            layout, gen, lines, save, tuple(args.sweep_ops.split(",")), tuple(args.sweep_cases.split(";")), args.sweep_regs_only
        )
        if args.sweep_table:
            key = tuning.gpu_key(torch.device(DEV))
            table = json.loads(json.dumps(tuning._table(key)))  # a deep copy
            lines += ["", f"chosen for {args.sweep_table} (us per case, summed over the layers of a key):"]
            for (op, shape), (cfg, old, new) in sorted(pick(measured).items()):
                table.setdefault(op, {}).setdefault(shape, {})[str(layout.total)] = tuning.as_dict(cfg)
                lines.append(
                    f"- {op} {shape} @ {layout.total} tokens: {cfg} "
                    f"({' / '.join(f'{t:.1f}' for t in old)} -> {' / '.join(f'{t:.1f}' for t in new)})"
                )
            with open(args.sweep_table, "w") as f:
                json.dump(table, f, indent=1, sort_keys=True)
            print(
                "\n".join(lines[lines.index(f"chosen for {args.sweep_table} (us per case, summed over the layers of a key):") :])
            )
        save()


if __name__ == "__main__":
    main()
