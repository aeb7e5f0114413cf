"""Launch plans of the paged attention kernels that the host computes without Triton: the prefill
kernel's tile (prefill_config) and its work list (prefill_work_list), which a captured step
(executor/engine/graphs.py, MixedGraphs) fills into its static buffers each step."""

from __future__ import annotations

import numpy as np
import torch


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def d_pad(head_dim: int) -> int:
    """The kernels' head-dim tile: the next power of two, at least 16."""
    return max(16, _next_pow2(head_dim))


def prefill_config(rows: int, group: int, d_pad: int, fp32: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the longest chunk's rows (queries x group).

    BLOCK_M shrinks to the rows there are, so a step of short chunks (decode tokens) wastes no
    tensor-core rows; it never drops below the group, whose heads share a tile.
    """
    block_m = min(max(16, _next_pow2(rows)), 128 if d_pad <= 128 else 64)
    block_m = max(block_m, _next_pow2(group))
    if fp32:  # exact fp32 dots (tests, not serving): large tiles spill and take ptxas minutes to build
        return max(min(block_m, 32), _next_pow2(group)), 32, 4, 2
    if d_pad > 128:
        return block_m, 32, 4, 2
    # On an H100 at D 128 (BLOCK_M 128): BLOCK_N 64 with 4 warps and 3 stages is fastest on chunks after
    # context; BLOCK_N 128 with 8 warps is 10% faster on one long causal prompt and 10% slower on chunks.
    return block_m, 64, 4, 3


def prefill_queries(max_query_len: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Queries per program of the prefill kernel for this launch shape (a work list's unit)."""
    group = num_heads // num_kv_heads
    block_m = prefill_config(max_query_len * group, group, d_pad(head_dim), dtype == torch.float32)[0]
    return block_m // group


def prefill_work_list(query_lens, queries: int, capacity: int) -> np.ndarray:
    """[capacity, 2] int32 (sequence, query block) pairs for the prefill kernel's WORK mode: every
    block of queries of every sequence, the sequences' last blocks (the most keys) first, then
    (-1, 0) entries. capacity >= sum of ceil(q_len / queries), e.g. T / queries + B for T tokens
    of B sequences."""
    q = np.asarray(query_lens, dtype=np.int64)
    blocks = -(-q // queries)
    total = int(blocks.sum())
    if total > capacity:
        raise ValueError(f"{total} query blocks exceed the work list's {capacity} entries")
    out = np.empty((capacity, 2), dtype=np.int32)
    out[:, 0], out[:, 1] = -1, 0
    seq = np.repeat(np.arange(len(q)), blocks)
    first = np.cumsum(blocks) - blocks  # each sequence's first entry
    within = np.arange(total) - np.repeat(first, blocks)
    order = np.lexsort((seq, within))  # by block index within its sequence, then sequence
    out[:total, 0] = seq[order]
    out[:total, 1] = (np.repeat(blocks, blocks) - 1 - within)[order]  # last blocks first
    return out
