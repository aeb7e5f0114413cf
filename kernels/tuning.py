"""Block sizes for the Triton kernels, looked up by GPU and shape: nothing is autotuned at serve time.

Tables live in kernels/configs/<gpu>.json, written by the tuners (`benchmarks/bench_kernels.py
--tune-out` on the hidden-size grid, `tools/tune_kernels.py` on the real layer shapes of
kernels/model_shapes.py). They are keyed by what each kernel sees:

  shrink  "<in>x<slices>x<rank>"          -> tokens -> ShrinkConfig
  expand  "<w0>+<w1>+...x<rank>"          -> tokens -> ExpandConfig   (the output slice widths)
  skinny  "<N>x<K>"                        -> tokens -> SkinnyConfig   (the base model's linear layers at
          1-64 tokens, kernels/triton_linear.py; written by `benchmarks/bench_skinny.py --table-out`)
  skinny_fp8  "<N>x<K>"                    -> tokens -> SkinnyConfig   (the same kernel's FP8 build: FP8
          layers at 1-64 tokens, kernels/triton_fp8.py; `bench_skinny.py --fp8 --table-out`)

A lookup for T tokens and a shape (the nearest-entry rule), among the entries tuned at decode
token counts (<= DECODE_MAX_TOKENS) when T is itself a decode token count and that op's table has
such entries, else among all:
1. the same shape, tuned at the token count nearest to T on a log scale, if that one is within
   4x of T (so the tuned grid's own shapes get exactly the entries they were tuned with);
2. else the entry nearest in log space over every key at once: |ln T/T'| + |ln in/in'| +
   |ln SR/SR'| for the shrink (SR = slices * rank), |ln T/T'| + |ln N/N'| + |ln R/R'| + 0.5 per
   slice-count mismatch for the expand, and the shrink's K split rescaled so each program
   reduces about as many input columns as in the tuned entry (a 4x longer reduction gets 4x
   the splits, not 4x longer programs; rounded to a power of two), block_n cut to the output;
3. an empty table: the rule in `_default_shrink` / `_default_expand` (decode tiles at every decode
   token count there too).

The skinny GEMM has no nearest-entry rule: it replaces cuBLAS only for the exact (N, K) the
table lists, at token counts up to the largest one measured there (the entry of the smallest
tuned count >= T; a null entry: cuBLAS won there); anything else stays on cuBLAS. Its FP8 build
takes the same rule over "skinny_fp8" (a null entry there: torch._scaled_mm won).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs"
SAME_SHAPE_TOKENS_RATIO = 4.0  # rule 1 takes the same shape's entry if tuned within this factor of T
# Decode token counts take decode entries only: otherwise a shape with no decode entry of its own
# would take a 1,024-token prefill entry (tiles of 64 token rows) from ~47 tokens up by rule 2
DECODE_MAX_TOKENS = 256


@dataclass(frozen=True)
class ShrinkConfig:
    block_m: int  # token rows per tile (one slot's tokens only)
    block_n: int  # columns of the flattened [S * R] output per tile
    block_k: int
    split_k: int  # > 1: K split over programs, partial sums added atomically into a zeroed buf
    num_warps: int
    num_stages: int
    ctas_per_sm: int  # persistent grid: programs = SMs * ctas_per_sm (at most the tile count)
    maxnreg: int = 0  # > 0: registers per thread capped there (more programs resident per SM)


@dataclass(frozen=True)
class ExpandConfig:
    block_m: int
    block_n: int  # output columns per step
    n_iters: int  # steps per tile: a tile covers block_n * n_iters columns of one slice
    num_warps: int
    num_stages: int
    ctas_per_sm: int
    maxnreg: int = 0  # as ShrinkConfig.maxnreg


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int  # output columns per program (programs = N / block_n)
    block_k: int
    num_warps: int
    num_stages: int


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, (n - 1).bit_length()))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _default_shrink(num_tokens: int, in_features: int, sr: int) -> ShrinkConfig:
    """No table: split K so each program reduces ~256 (decode) or ~1024 (mid, prefill) input columns.

    Decode is every decode token count (<= DECODE_MAX_TOKENS), as the tables' rule has it: a batch of
    128-256 sequences over a few dozen adapters is a few tokens per adapter, and 64-row tiles there
    make an H200's decode step with 40 adapters 12-20% slower than the decode tiles do.

    Prefill too: its tiles are (token blocks x column blocks), a few dozen to a few hundred for
    1,000-4,000 tokens over a few adapters, and unsplit each would loop over the whole input (64
    steps for 4,096, 224 for a down projection's 14,336): 48-113 us per layer on an H200 where its
    bytes and FLOPs allow ~10; split, 18% less. The split's partial sums add atomically: the last
    bits can vary from run to run."""
    if num_tokens <= DECODE_MAX_TOKENS:  # decode: few rows per slot; split K so one adapter still fills the GPU
        return ShrinkConfig(16, min(_pow2(sr), 64), 64, pow2_split(in_features, 64, 256), 4, 4, 8)
    if num_tokens <= 512:
        return ShrinkConfig(64, min(_pow2(sr), 64), 128, pow2_split(in_features, 128, 1024), 4, 3, 2)
    return ShrinkConfig(64, min(_pow2(sr), 128), 64, pow2_split(in_features, 64, 1024), 4, 4, 2)


def _default_expand(num_tokens: int, n: int, rank: int) -> ExpandConfig:
    """No table: at decode (<= DECODE_MAX_TOKENS, as _default_shrink), 16-row tiles of 128 columns
    (on an H200, Llama-3-8B layers at 64 tokens / 40 adapters: 12-29% faster than 64 columns)."""
    if num_tokens <= DECODE_MAX_TOKENS:
        return ExpandConfig(16, 128, 1, 4, 1, 8)
    if num_tokens <= 512:
        return ExpandConfig(64, 64, 1, 4, 2, 4)
    return ExpandConfig(64, 128, 2, 4, 2, 2)


def shrink_key(in_features: int, num_slices: int, rank: int) -> str:
    return f"{in_features}x{num_slices}x{rank}"


def expand_key(widths: tuple[int, ...], rank: int) -> str:
    return "+".join(str(w) for w in widths) + f"x{rank}"


def parse_shrink_key(key: str) -> tuple[int, int, int]:
    in_features, num_slices, rank = (int(v) for v in key.split("x"))
    return in_features, num_slices, rank


def parse_expand_key(key: str) -> tuple[tuple[int, ...], int]:
    widths, rank = key.split("x")
    return tuple(int(w) for w in widths.split("+")), int(rank)


def gpu_key(device: torch.device) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia_h100_80gb_hbm3': the table file's name."""
    return re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(device).lower()).strip("_")


@lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_tables: dict[str, dict] = {}


def _table(key: str) -> dict:
    if key not in _tables:
        path = CONFIG_DIR / f"{key}.json"
        _tables[key] = json.loads(path.read_text()) if path.exists() else {}
    return _tables[key]


def set_table(key: str, table: dict) -> None:
    """Replaces a GPU's table in memory (the tuners use this to benchmark what they just tuned)."""
    _tables[key] = table
    for cached in (_entries, _shrink_config, _expand_config, _skinny_config):
        cached.cache_clear()


@lru_cache(maxsize=64)
def _entries(key: str, op: str) -> tuple[tuple[str, int, dict], ...]:
    """Every (shape key, tokens, config dict) of one op's table, sorted for deterministic ties."""
    return tuple(
        sorted((shape, int(t), entry) for shape, by_tokens in _table(key).get(op, {}).items() for t, entry in by_tokens.items())
    )


def _log_gap(a: float, b: float) -> float:
    return abs(math.log(max(a, 1) / max(b, 1)))


def _nearest(entries, shape: str, num_tokens: int, distance):
    """(shape key, tokens, config) by rules 1 and 2 of the module docstring, or None if empty."""
    if not entries:
        return None
    if num_tokens <= DECODE_MAX_TOKENS:
        entries = [e for e in entries if e[1] <= DECODE_MAX_TOKENS] or entries
    same = [e for e in entries if e[0] == shape]
    if same:
        best = min(same, key=lambda e: (_log_gap(e[1], num_tokens), e[1]))
        if _log_gap(best[1], num_tokens) <= math.log(SAME_SHAPE_TOKENS_RATIO) + 1e-9:
            return best
    return min(entries, key=lambda e: (_log_gap(e[1], num_tokens) + distance(e[0]), e[0], e[1]))


def _device_key(device: torch.device) -> str:
    return _gpu_keys.get(device.index) or _gpu_keys.setdefault(device.index, gpu_key(device))


_gpu_keys: dict[int | None, str] = {}


def tuned_token_counts(device: torch.device) -> tuple[int, ...]:
    """Every token count this GPU's tables hold an entry for (the warm-up builds each one's kernels)."""
    if device.type != "cuda":
        return ()
    key = _device_key(device)
    return tuple(sorted({t for op in ("shrink", "expand") for _, t, _ in _entries(key, op)}))


def shrink_config(device: torch.device, num_tokens: int, in_features: int, num_slices: int, rank: int) -> ShrinkConfig:
    return _shrink_config(_device_key(device), num_tokens, in_features, num_slices, rank)


def expand_config(device: torch.device, num_tokens: int, widths: tuple[int, ...], rank: int) -> ExpandConfig:
    """widths: the output slice widths (sum = the output row)."""
    return _expand_config(_device_key(device), num_tokens, tuple(widths), rank)


@lru_cache(maxsize=4096)
def _shrink_config(key: str, num_tokens: int, in_features: int, num_slices: int, rank: int) -> ShrinkConfig:
    sr = num_slices * rank

    def distance(shape: str) -> float:
        k, s, r = parse_shrink_key(shape)
        return _log_gap(k, in_features) + _log_gap(s * r, sr)

    found = _nearest(_entries(key, "shrink"), shrink_key(in_features, num_slices, rank), num_tokens, distance)
    if found is None:
        return _default_shrink(num_tokens, in_features, sr)
    shape, _, entry = found
    return adapt_shrink(ShrinkConfig(**entry), parse_shrink_key(shape)[0], in_features, sr)


def pow2_split(in_features: int, block_k: int, per_split: float) -> int:
    """The power of two nearest (in log space) to in_features / per_split, at most the K blocks.

    Powers of two only: SPLIT_K is a compile-time constant, so every distinct value is one
    more compiled kernel; rounding in log space keeps the columns per split within 1.42x."""
    blocks = _cdiv(in_features, block_k)
    want = max(1.0, in_features / per_split)
    split = 1 << round(math.log2(want))
    while split > 1 and split > blocks:
        split //= 2
    return split


def adapt_shrink(cfg: ShrinkConfig, tuned_in: int, in_features: int, sr: int) -> ShrinkConfig:
    """A config tuned for input size tuned_in, moved to in_features: the same input columns per K split."""
    block_n = min(cfg.block_n, _pow2(sr))
    split_k = cfg.split_k
    if split_k > 1 and tuned_in != in_features:
        per_split = _cdiv(_cdiv(tuned_in, cfg.block_k), split_k) * cfg.block_k
        split_k = pow2_split(in_features, cfg.block_k, per_split)
    return replace(cfg, block_n=block_n, split_k=split_k)


@lru_cache(maxsize=4096)
def _expand_config(key: str, num_tokens: int, widths: tuple[int, ...], rank: int) -> ExpandConfig:
    n = sum(widths)

    def distance(shape: str) -> float:
        w, r = parse_expand_key(shape)
        return _log_gap(sum(w), n) + _log_gap(r, rank) + 0.5 * (len(w) != len(widths))

    found = _nearest(_entries(key, "expand"), expand_key(widths, rank), num_tokens, distance)
    return ExpandConfig(**found[2]) if found else _default_expand(num_tokens, n, rank)


def skinny_key(n: int, k: int) -> str:
    return f"{n}x{k}"


def skinny_config(device: torch.device, num_tokens: int, n: int, k: int) -> SkinnyConfig | None:
    """The skinny GEMM's config for y [T, n] = x [T, k] @ W.T on this GPU, or None: use cuBLAS."""
    return _skinny_config(_device_key(device), num_tokens, n, k)


def skinny_fp8_config(device: torch.device, num_tokens: int, n: int, k: int) -> SkinnyConfig | None:
    """The skinny GEMM's FP8 build's config for y [T, n] = x [T, k] @ (W [n, k] FP8 * scale).T on
    this GPU, or None: use torch._scaled_mm (kernels/triton_fp8.py)."""
    return _skinny_config(_device_key(device), num_tokens, n, k, "skinny_fp8")


@lru_cache(maxsize=1024)
def _skinny_config(key: str, num_tokens: int, n: int, k: int, op: str = "skinny") -> SkinnyConfig | None:
    by_tokens = _table(key).get(op, {}).get(skinny_key(n, k), {})
    tuned = sorted(int(t) for t in by_tokens if int(t) >= num_tokens)
    entry = by_tokens[str(tuned[0])] if tuned else None  # null: the vendor GEMM is faster there
    return SkinnyConfig(**entry) if entry else None


def as_dict(config) -> dict:
    """A config as a table entry (no register cap: the key left out, as tables without caps have it)."""
    entry = asdict(config)
    if not entry.get("maxnreg", 1):
        del entry["maxnreg"]
    return entry
