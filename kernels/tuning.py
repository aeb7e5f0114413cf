"""Block sizes for the Triton kernels, looked up by GPU and shape: nothing is autotuned at serve time.

Tables live in kernels/configs/<gpu>.json (written by `benchmarks/bench_kernels.py --tune`).
A lookup takes the entry for the same feature sizes and the tuned token count nearest to T
(on a log scale); a shape with no entry falls back to the rule in `_default_shrink` /
`_default_expand`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass(frozen=True)
class ShrinkConfig:
    block_m: int  # token rows per tile (one slot's tokens only)
    block_n: int  # columns of the flattened [S * R] output per tile
    block_k: int
    split_k: int  # > 1: K split over programs, partial sums added atomically into a zeroed buf
    num_warps: int
    num_stages: int
    ctas_per_sm: int  # persistent grid: programs = SMs * ctas_per_sm (at most the tile count)


@dataclass(frozen=True)
class ExpandConfig:
    block_m: int
    block_n: int  # output columns per step
    n_iters: int  # steps per tile: a tile covers block_n * n_iters columns of one slice
    num_warps: int
    num_stages: int
    ctas_per_sm: int


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, (n - 1).bit_length()))


def _default_shrink(num_tokens: int, in_features: int, sr: int) -> ShrinkConfig:
    if num_tokens <= 64:  # decode: few rows per slot; split K so one adapter still fills the GPU
        return ShrinkConfig(16, min(_pow2(sr), 64), 256, 4, 4, 3, 4)
    if num_tokens <= 512:
        return ShrinkConfig(64, min(_pow2(sr), 64), 128, 2, 4, 3, 2)
    return ShrinkConfig(64, min(_pow2(sr), 128), 64, 1, 4, 4, 2)


def _default_expand(num_tokens: int, n: int, rank: int) -> ExpandConfig:
    if num_tokens <= 64:
        return ExpandConfig(16, 64, 1, 4, 1, 8)
    if num_tokens <= 512:
        return ExpandConfig(64, 64, 1, 4, 2, 4)
    return ExpandConfig(64, 128, 2, 4, 2, 2)


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
    """Replaces a GPU's table in memory (the tuner uses this to benchmark what it just tuned)."""
    _tables[key] = table
    for cached in (_lookup, _shrink_config, _expand_config):
        cached.cache_clear()


@lru_cache(maxsize=4096)
def _lookup(key: str, op: str, shape: str, num_tokens: int):
    entries = _table(key).get(op, {}).get(shape)
    if not entries:
        return None
    nearest = min((int(t) for t in entries), key=lambda t: (abs(math.log(t / max(num_tokens, 1))), t))
    return entries[str(nearest)]


def _device_key(device: torch.device) -> str:
    return _gpu_keys.get(device.index) or _gpu_keys.setdefault(device.index, gpu_key(device))


_gpu_keys: dict[int | None, str] = {}


def shrink_config(device: torch.device, num_tokens: int, in_features: int, sr: int) -> ShrinkConfig:
    """sr: the flattened output width, slices * rank."""
    return _shrink_config(_device_key(device), num_tokens, in_features, sr)


def expand_config(device: torch.device, num_tokens: int, n: int, rank: int) -> ExpandConfig:
    """n: the total output width over all slices."""
    return _expand_config(_device_key(device), num_tokens, n, rank)


@lru_cache(maxsize=4096)
def _shrink_config(key: str, num_tokens: int, in_features: int, sr: int) -> ShrinkConfig:
    found = _lookup(key, "shrink", f"{in_features}x{sr}", num_tokens)
    return ShrinkConfig(**found) if found else _default_shrink(num_tokens, in_features, sr)


@lru_cache(maxsize=4096)
def _expand_config(key: str, num_tokens: int, n: int, rank: int) -> ExpandConfig:
    found = _lookup(key, "expand", f"{n}x{rank}", num_tokens)
    return ExpandConfig(**found) if found else _default_expand(num_tokens, n, rank)


def as_dict(config) -> dict:
    return asdict(config)
