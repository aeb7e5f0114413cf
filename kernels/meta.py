"""Per-step token grouping, computed once per forward step and reused by every LoRA layer.

Everything here is tensor ops on the device of `token_slots`: no host synchronisation, no
data-dependent shapes, so it is safe inside a captured CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

FULL_RANK = 1 << 30  # a block's rank when the slots' ranks are not known: read the whole slot


@dataclass
class BlockList:
    """The work list of the Triton kernels: each slot's token group cut into blocks of block_m rows.

    blocks:     [4, max_blocks] int32; per block: slot (max_loras = the no-adapter group,
                -1 = unused entry), first row and end row of its group in sorted_token_ids, and
                the rank of the slot's adapter (LoraMeta.slot_ranks; FULL_RANK when unknown, 0
                for the no-adapter group): the kernels read A and B only that far
    tokens:     [max_blocks, block_m] int32; the block's token indices, -1 past its end, so a
                kernel reads a tile's slot and rows in one step
    num_blocks: [2] int32; blocks of real slots, and blocks including the no-adapter group
                (real slots come first, the no-adapter group's blocks after them)
    max_blocks: host int, an upper bound on num_blocks[1] that depends only on T and max_loras,
                so a launch shape sized from it is fixed for a captured batch size
    """

    block_m: int
    blocks: torch.Tensor
    tokens: torch.Tensor
    num_blocks: torch.Tensor
    max_blocks: int


class ShrinkWorkspace:
    """A zeroed float32 buffer that one step's shrink outputs are carved from, in call order.

    A split-K shrink adds its partial sums into a zeroed output: without a workspace every LoRA
    layer zeroes its own (a memset node per layer, 128 per Llama-3-8B step); the decode graphs
    zero one workspace for the whole step instead and pass it in LoraMeta.shrink_workspace.
    """

    def __init__(self, buffer: torch.Tensor):
        self.buffer, self.used = buffer, 0

    def take(self, num_slices: int, num_tokens: int, rank: int) -> torch.Tensor | None:
        """The next zeroed [S, T, R] float32 view, or None when the buffer has no room left."""
        n = num_slices * num_tokens * rank
        if self.used + n > self.buffer.numel():
            return None
        view = self.buffer[self.used : self.used + n].view(num_slices, num_tokens, rank)
        self.used += n
        return view


def shrink_output(meta, out, num_slices: int, num_tokens: int, rank: int, device) -> tuple[torch.Tensor, bool]:
    """A shrink's [S, T, R] float32 output: `out` if given, else a view of the step's workspace
    (known zeroed: True), else a new tensor (False)."""
    if out is None and meta.shrink_workspace is not None:
        out = meta.shrink_workspace.take(num_slices, num_tokens, rank)
        if out is not None:
            return out, True
    if out is None:
        out = torch.empty(num_slices, num_tokens, rank, dtype=torch.float32, device=device)
    return out, False


@dataclass
class LoraMeta:
    """Tokens grouped by GPU slot.

    token_slots:       [T] int32, slot of each token, -1 for no adapter
    sorted_token_ids:  [T] int32, token indices grouped by slot (slot 0 first), no-adapter tokens last
    tokens_per_slot:   [max_loras] int32, how many tokens each slot has this step
    slot_start:        [max_loras] int32, offset of each slot's group in sorted_token_ids
    num_tokens:        T (host int; the launch shape)
    max_loras:         number of slots (host int)
    host_slots:        the slots with tokens this step as a host frozenset, when the caller knows
                       them without a sync (the engine does); None otherwise. LoRA layers use it
                       to skip work no active adapter needs (see executor/lora.py)
    slot_ranks:        [max_loras] int32 on the device, the largest rank of the adapter in each slot
                       (slot buffers are zero past it), or None: the kernels then read every slot
                       at its full buffer rank. With it, a rank-8 adapter in a rank-64 slot moves
                       rank-8 bytes through shrink and expand.
    shrink_workspace:  a ShrinkWorkspace the step zeroed once, or None: each shrink then allocates
                       (and, when it splits K, zeroes) its own output
    active_slots, num_active (properties, computed when read: no kernel reads them): the slots
    with tokens this step first (ascending), then -1 ([max_loras] int32), and how many ([1] int32)
    """

    token_slots: torch.Tensor
    sorted_token_ids: torch.Tensor
    tokens_per_slot: torch.Tensor
    slot_start: torch.Tensor
    num_tokens: int
    max_loras: int
    host_slots: frozenset[int] | None = None
    slot_ranks: torch.Tensor | None = None
    shrink_workspace: ShrinkWorkspace | None = None
    _block_lists: dict[int, BlockList] = field(default_factory=dict, repr=False)

    @property
    def active_slots(self) -> torch.Tensor:
        active = self.tokens_per_slot > 0
        # Stable sort of "is idle" puts the active slots first, in ascending order.
        order = torch.argsort((~active).to(torch.int8), stable=True).to(torch.int32)
        return torch.where(active[order.long()], order, torch.full_like(order, -1))

    @property
    def num_active(self) -> torch.Tensor:
        return (self.tokens_per_slot > 0).sum(dtype=torch.int32).reshape(1)

    def block_list(self, block_m: int) -> BlockList:
        """The work list for tiles of block_m rows; built on first use, then shared by every layer."""
        blocks = self._block_lists.get(block_m)
        if blocks is None:
            blocks = self._block_lists[block_m] = _make_block_list(self, block_m)
        return blocks


def make_lora_meta(
    token_slots: torch.Tensor,
    max_loras: int,
    host_slots: frozenset[int] | None = None,
    slot_ranks: torch.Tensor | None = None,
    block_m: int | None = None,
) -> LoraMeta:
    """Groups tokens by slot. token_slots: [T] integer tensor, -1 = no adapter.
    host_slots: the set of slots >= 0 in token_slots, if the caller has it on the host.
    slot_ranks: [max_loras] integer tensor on token_slots' device, each slot's adapter rank (see LoraMeta).
    block_m: on CUDA, build the block list of these tile rows now too (the Triton kernels' work list;
    the CPU reference needs none): a small step's whole grouping is then one Triton program
    (kernels/triton_meta.py) instead of ~35 torch ops."""
    if token_slots.device.type != "cuda":
        block_m = None
    slots = token_slots.to(torch.int32)
    fused = _fused_grouping(slots, max_loras, slot_ranks, block_m) if block_m is not None else None
    if fused is not None:
        sorted_ids, counts, starts, blocks = fused
    else:
        # No-adapter tokens sort after every real slot.
        keys = torch.where(slots < 0, torch.full_like(slots, max_loras), slots)
        sorted_ids = torch.argsort(keys, stable=True).to(torch.int32)
        # scatter_add, not bincount: CUDA bincount reads the maximum back to the host.
        counts = torch.zeros(max_loras + 1, dtype=torch.int64, device=slots.device)
        counts.scatter_add_(0, keys.to(torch.int64), torch.ones_like(keys, dtype=torch.int64))
        counts = counts[:max_loras]
        starts = torch.cumsum(counts, 0) - counts
    meta = LoraMeta(
        token_slots=slots,
        sorted_token_ids=sorted_ids,
        tokens_per_slot=counts.to(torch.int32),
        slot_start=starts.to(torch.int32),
        num_tokens=int(slots.shape[0]),
        max_loras=max_loras,
        host_slots=host_slots,
        slot_ranks=None if slot_ranks is None else slot_ranks.to(torch.int32),
    )
    if fused is not None:
        meta._block_lists[block_m] = blocks
    elif block_m is not None:
        meta.block_list(block_m)
    return meta


def _fused_grouping(token_slots, max_loras, slot_ranks, block_m):
    try:
        from . import triton_meta
    except ImportError:  # no Triton: the torch ops
        return None
    return triton_meta.group_tokens(token_slots, max_loras, slot_ranks, block_m)


def block_bound(num_tokens: int, max_loras: int, block_m: int) -> int:
    """The most blocks T tokens can make over max_loras slots and the no-adapter group: BlockList.max_blocks.

    G non-empty groups of n_1 + ... + n_G = T tokens make sum ceil(n_g / block_m) <= G + (T - G) // block_m
    blocks (each group's first token opens a block; the other T - G tokens open one more per
    block_m), which grows with G, so the bound is that at G = min(T, max_loras + 1), and is
    reached (G - 1 groups of one token, the rest in one). A tight bound matters: the decode
    kernels cover it with one program per tile (ONE_TILE in kernels/triton_lora.py) only while it fits
    the programs the GPU holds at once; the looser ceil(T / block_m) + G, at 64 tokens over 64
    slots, would tip the o and down projections' expand and the down shrink into the looping
    grid (+0.17 ms a decode step on an H100).
    """
    groups = min(num_tokens, max_loras + 1)
    return groups + (num_tokens - groups) // block_m


def _make_block_list(meta: LoraMeta, block_m: int) -> BlockList:
    """Cuts each slot's group (and the no-adapter group, as slot max_loras) into blocks of block_m rows.

    A group of n tokens gives ceil(n / block_m) blocks; `block_bound` bounds the total.
    """
    num_tokens, num_slots = meta.num_tokens, meta.max_loras
    device = meta.tokens_per_slot.device
    counts = meta.tokens_per_slot.to(torch.int64)
    lora_total = counts.sum().reshape(1)
    counts = torch.cat([counts, num_tokens - lora_total])  # [L + 1], last: no-adapter group
    starts = torch.cat([meta.slot_start.to(torch.int64), lora_total])
    group_blocks = (counts + block_m - 1) // block_m
    ends = torch.cumsum(group_blocks, 0)  # block index one past each group's last block
    max_blocks = block_bound(num_tokens, num_slots, block_m)
    block = torch.arange(max_blocks, device=device)
    group = torch.searchsorted(ends, block, right=True)  # == L + 1 past the last block
    used = group <= num_slots
    group = group.clamp(max=num_slots)
    first_row = starts[group] + (block - (ends[group] - group_blocks[group])) * block_m
    end_row = starts[group] + counts[group]
    if meta.slot_ranks is None:
        rank = torch.where(group < num_slots, FULL_RANK, 0)
    else:
        padded = torch.cat([meta.slot_ranks.to(torch.int64), torch.zeros(1, dtype=torch.int64, device=device)])
        rank = padded[group]  # group == num_slots (the no-adapter group): 0
    blocks = torch.stack([torch.where(used, group, -1), first_row, end_row, rank]).to(torch.int32)
    rows = first_row[:, None] + torch.arange(block_m, device=device)  # [max_blocks, block_m]
    in_block = (rows < end_row[:, None]) & used[:, None]
    gathered = meta.sorted_token_ids[rows.clamp(0, max(num_tokens - 1, 0))]
    tokens = torch.where(in_block, gathered, -1).to(torch.int32)
    num_blocks = torch.stack([ends[num_slots - 1], ends[num_slots]]).to(torch.int32)
    return BlockList(block_m, blocks.contiguous(), tokens, num_blocks, max_blocks)
