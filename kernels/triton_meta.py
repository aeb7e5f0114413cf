"""A decode step's token grouping (kernels/meta.py) in one Triton program instead of ~35 small
torch ops: in a captured decode graph those are ~30 kernel nodes, ~75 us of every step with
adapters on an H100, ahead of the first layer.

One program sees the whole step: tokens are sorted by (slot, index) with tl.sort, the groups'
counts and starts come from a [groups, tokens] comparison, and the block list of one tile height
from a [blocks, groups] one; the sorted ids go through global memory once, so each block's rows
can be gathered. The outputs equal make_lora_meta's and _make_block_list's exactly (the tests
compare them); steps too large for one program's registers return None and take the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .meta import FULL_RANK, BlockList, block_bound

MAX_ELEMENTS = 32768  # the largest [groups, tokens] or [blocks, groups] comparison one program takes


@triton.jit
def _group_kernel(
    slots_ptr,
    ranks_ptr,
    sorted_ptr,
    counts_ptr,
    starts_ptr,
    blocks_ptr,
    tokens_ptr,
    num_blocks_ptr,
    num_tokens,
    num_slots,
    max_blocks,
    T_PAD: tl.constexpr,
    G_PAD: tl.constexpr,
    B_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_RANKS: tl.constexpr,
    FULL: tl.constexpr,
):
    t = tl.arange(0, T_PAD)
    slot = tl.load(slots_ptr + t, mask=t < num_tokens, other=0)
    key = tl.where(slot < 0, num_slots, slot)  # no adapter: the group after every slot
    key = tl.where(t < num_tokens, key, num_slots + 1)  # padding sorts last of all
    # sorted ids: the token indices ordered by (group, index), i.e. a stable sort by group
    order = tl.sort(key * T_PAD + t)
    tl.store(sorted_ptr + t, (order % T_PAD).to(tl.int32), mask=t < num_tokens)

    g = tl.arange(0, G_PAD)  # groups 0..num_slots (num_slots: no adapter)
    in_group = key[None, :] == g[:, None]  # [G_PAD, T_PAD]
    counts = tl.sum(in_group.to(tl.int32), 1)
    starts = tl.cumsum(counts, 0) - counts
    tl.store(counts_ptr + g, counts, mask=g < num_slots)
    tl.store(starts_ptr + g, starts, mask=g < num_slots)

    group_blocks = tl.where(g <= num_slots, (counts + BLOCK_M - 1) // BLOCK_M, 0)
    ends = tl.cumsum(group_blocks, 0)  # one past each group's last block
    if HAS_RANKS:
        rank_g = tl.load(ranks_ptr + g, mask=g < num_slots, other=0)
    else:
        rank_g = tl.where(g < num_slots, FULL, 0)
    i = tl.arange(0, B_PAD)
    group = tl.sum((ends[None, :] <= i[:, None]).to(tl.int32), 1)  # searchsorted(ends, i, right=True)
    used = group <= num_slots
    group = tl.minimum(group, num_slots)
    pick = g[None, :] == group[:, None]  # [B_PAD, G_PAD] one-hot of each block's group
    start_b = tl.sum(tl.where(pick, starts[None, :], 0), 1)
    count_b = tl.sum(tl.where(pick, counts[None, :], 0), 1)
    first_block = tl.sum(tl.where(pick, (ends - group_blocks)[None, :], 0), 1)
    first_row = start_b + (i - first_block) * BLOCK_M
    end_row = start_b + count_b
    rank_b = tl.sum(tl.where(pick, rank_g[None, :], 0), 1)
    in_list = i < max_blocks
    tl.store(blocks_ptr + i, tl.where(used, group, -1), mask=in_list)
    tl.store(blocks_ptr + max_blocks + i, first_row, mask=in_list)
    tl.store(blocks_ptr + 2 * max_blocks + i, end_row, mask=in_list)
    tl.store(blocks_ptr + 3 * max_blocks + i, rank_b, mask=in_list)
    last_slot = tl.sum(tl.where(g == num_slots - 1, ends, 0), 0)
    last = tl.sum(tl.where(g == num_slots, ends, 0), 0)
    tl.store(num_blocks_ptr, last_slot)
    tl.store(num_blocks_ptr + 1, last)

    tl.debug_barrier()  # the sorted ids above are this program's own stores: visible after the barrier
    j = tl.arange(0, BLOCK_M)
    rows = first_row[:, None] + j[None, :]  # [B_PAD, BLOCK_M]
    inside = (rows < end_row[:, None]) & used[:, None]
    gathered = tl.load(sorted_ptr + tl.minimum(tl.maximum(rows, 0), num_tokens - 1), mask=inside & in_list[:, None], other=-1)
    tl.store(tokens_ptr + i[:, None] * BLOCK_M + j[None, :], tl.where(inside, gathered, -1), mask=in_list[:, None])


def group_tokens(token_slots: torch.Tensor, max_loras: int, slot_ranks: torch.Tensor | None, block_m: int):
    """(sorted ids [T], counts [L], starts [L], the BlockList of block_m rows), all int32 on the
    device, or None when the step is too large for one program (the caller groups with torch)."""
    num_tokens = int(token_slots.shape[0])
    if num_tokens == 0 or max_loras < 1 or block_m & (block_m - 1):  # tl.arange wants powers of two
        return None
    t_pad = max(16, triton.next_power_of_2(num_tokens))
    g_pad = max(16, triton.next_power_of_2(max_loras + 1))
    max_blocks = block_bound(num_tokens, max_loras, block_m)
    b_pad = max(16, triton.next_power_of_2(max_blocks))
    if t_pad * g_pad > MAX_ELEMENTS or b_pad * g_pad > MAX_ELEMENTS or b_pad * block_m > MAX_ELEMENTS:
        return None
    dev = token_slots.device
    slots = token_slots.to(torch.int32).contiguous()  # the program reads slots[t] at slots_ptr + t
    out = torch.empty(num_tokens + 2 * max_loras + 2, dtype=torch.int32, device=dev)
    sorted_ids, counts, starts = out[:num_tokens], out[num_tokens : num_tokens + max_loras], out[num_tokens + max_loras : -2]
    num_blocks = out[-2:]
    blocks = torch.empty(4, max_blocks, dtype=torch.int32, device=dev)
    tokens = torch.empty(max_blocks, block_m, dtype=torch.int32, device=dev)
    ranks = slot_ranks.to(torch.int32).contiguous() if slot_ranks is not None else slots
    _group_kernel[(1,)](
        slots,
        ranks,
        sorted_ids,
        counts,
        starts,
        blocks,
        tokens,
        num_blocks,
        num_tokens,
        max_loras,
        max_blocks,
        T_PAD=t_pad,
        G_PAD=g_pad,
        B_PAD=b_pad,
        BLOCK_M=block_m,
        HAS_RANKS=slot_ranks is not None,
        FULL=FULL_RANK,
        num_warps=4,
    )
    return sorted_ids, counts, starts, BlockList(block_m, blocks, tokens, num_blocks, max_blocks)
