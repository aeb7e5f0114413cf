"""Paged KV cache: fixed-size blocks, a free-block allocator, and per-step attention metadata.

A sequence's keys and values live in the blocks of its block table; token p of the sequence is
cache slot `block_table[p // block_size] * block_size + p % block_size`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from loraserve.errors import exhausted


class KVCache:
    """k_cache[layer], v_cache[layer]: [num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
        """Memory of one block over all layers (k and v): for sizing num_blocks from free memory."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


class BlockAllocator:
    """Hands out free block ids; the scheduler owns which sequence holds which blocks."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n free blocks, or StatusError(RESOURCE_EXHAUSTED) leaving the allocator unchanged."""
        if n > len(self._free):
            raise exhausted(f"KV cache: {n} blocks wanted, {len(self._free)} free of {self.num_blocks}")
        blocks = [self._free.popleft() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks) -> None:
        for b in blocks:
            if b not in self._used:
                raise ValueError(f"block {b} freed but not allocated")
            self._used.remove(b)
            self._free.append(b)


@dataclass
class AttentionMetadata:
    """Where the flattened tokens of one step come from and go to in the paged cache.

    Sequences appear in the flattened batch in the order of these lists; sequence i owns tokens
    [query_starts[i], query_starts[i] + query_lens[i]) and they sit at positions
    context_lens[i] ... context_lens[i] + query_lens[i] - 1 of that sequence.
    """

    query_lens: list[int]  # new tokens of each sequence this step, in the flattened order
    context_lens: list[int]  # tokens of each sequence already in the cache before this step
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor  # [T] long: cache slot of each new token
    positions: torch.Tensor | None = None  # [T] long: position of each new token in its sequence
    query_starts: list[int] = field(default_factory=list)  # offset of each sequence in the T tokens
    # [ctx_i + q_i] long per sequence: cache slots of all its tokens (context then new), for the gather
    seq_slots: list[torch.Tensor] = field(default_factory=list)
    # Decode-only steps (every query_len 1): [B, Lmax] cache slots of each sequence's tokens, padded
    # with its own last slot, and [B] their counts; the attention of all B sequences is then one batched call.
    decode_slots: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    _decode_masks: dict = field(default_factory=dict, repr=False)

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[B, 1, 1, Lmax] bool: which padded key positions each decode query sees (built once per window)."""
        mask = self._decode_masks.get(window)
        if mask is None:
            lmax = self.decode_slots.shape[1]
            k_pos = torch.arange(lmax, device=self.decode_slots.device)[None, :]
            lens = self.decode_lens[:, None]
            mask = k_pos < lens  # the query is the last token, at position len - 1
            if window is not None:
                mask &= k_pos > lens - 1 - window
            mask = self._decode_masks[window] = mask[:, None, None, :]
        return mask

    @staticmethod
    def build(query_lens, context_lens, block_tables, block_size, device) -> "AttentionMetadata":
        """Computed on the host once per step, then one host->device copy per tensor."""
        if not (len(query_lens) == len(context_lens) == len(block_tables)):
            raise ValueError("query_lens, context_lens and block_tables must have one entry per sequence")
        offsets = torch.arange(block_size)
        seq_slots, new_slots, positions, query_starts = [], [], [], []
        start = 0
        for q_len, ctx, table in zip(query_lens, context_lens, block_tables):
            total = ctx + q_len
            if total > len(table) * block_size:
                raise ValueError(f"sequence of {total} tokens needs more than its {len(table)} blocks")
            table_t = torch.tensor(table, dtype=torch.long)
            all_slots = (table_t[:, None] * block_size + offsets).flatten()[:total]  # [total]
            seq_slots.append(all_slots)
            new_slots.append(all_slots[ctx:])
            positions.append(torch.arange(ctx, total))
            query_starts.append(start)
            start += q_len
        # One host->device copy for all per-sequence slot lists, then views of it.
        lens = [len(s) for s in seq_slots]
        decode_slots = decode_lens = None
        if seq_slots and all(q == 1 for q in query_lens):
            padded = torch.empty(len(seq_slots), max(lens), dtype=torch.long)
            for i, slots in enumerate(seq_slots):
                # Padding repeats the row's own last slot: masked, yet never another sequence's
                # memory (a NaN there would still reach this row through 0 * NaN).
                padded[i] = slots[-1]
                padded[i, : len(slots)] = slots
            decode_slots, decode_lens = padded.to(device), torch.tensor(lens, dtype=torch.long).to(device)
            views = [row[:n] for row, n in zip(decode_slots, lens)]  # the padded copy serves both paths
        else:
            views = list(torch.split(_cat(seq_slots, device), lens))
        return AttentionMetadata(
            query_lens=list(query_lens),
            context_lens=list(context_lens),
            block_tables=[list(t) for t in block_tables],
            slot_mapping=_cat(new_slots, device),
            positions=_cat(positions, device),
            query_starts=query_starts,
            seq_slots=views,
            decode_slots=decode_slots,
            decode_lens=decode_lens,
        )


def _cat(tensors: list[torch.Tensor], device) -> torch.Tensor:
    return (torch.cat(tensors) if tensors else torch.empty(0, dtype=torch.long)).to(device)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Writes the step's k/v into the cache, then attends each sequence's queries to its whole context.

    q: [T, H, D]; k, v: [T, KVH, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D] -> [T, H, D]
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    k_flat = k_cache.view(-1, num_kv_heads, k.shape[2])  # [num_blocks * block_size, KVH, D]
    v_flat = v_cache.view(-1, num_kv_heads, v.shape[2])
    k_flat.index_copy_(0, attn.slot_mapping, k)
    v_flat.index_copy_(0, attn.slot_mapping, v)

    group = num_heads // num_kv_heads
    if attn.decode_slots is not None:
        return _batched_decode(q, k_flat, v_flat, attn, group, scale, sliding_window)
    out = torch.empty_like(q)
    for start, q_len, ctx, slots in zip(attn.query_starts, attn.query_lens, attn.context_lens, attn.seq_slots):
        if q_len == 0:
            continue
        qs = q[start : start + q_len].transpose(0, 1)  # [H, q_len, D]
        ks = k_flat.index_select(0, slots).transpose(0, 1)  # [KVH, L, D], L = ctx + q_len
        vs = v_flat.index_select(0, slots).transpose(0, 1)
        if group > 1:
            ks = ks.repeat_interleave(group, dim=0)  # [H, L, D]
            vs = vs.repeat_interleave(group, dim=0)
        mask, causal = _mask(q_len, ctx, sliding_window, q.device)
        # 4-D inputs: on CPU, 3-D ones fall to a far slower path.
        o = torch.nn.functional.scaled_dot_product_attention(
            qs[None], ks[None], vs[None], attn_mask=mask, is_causal=causal, scale=scale
        )  # [1, H, q_len, D]
        out[start : start + q_len] = o[0].transpose(0, 1)
    return out


def _batched_decode(q, k_flat, v_flat, attn: AttentionMetadata, group: int, scale: float, window: int | None):
    """A decode-only step: each of the B sequences has one query; one SDPA call over padded keys.

    Same result as the per-sequence loop (padding is masked out), with a handful of launches per
    layer instead of several per sequence: the per-sequence loop is host-bound on a GPU.
    """
    idx, mask = attn.decode_slots, attn.decode_mask(window)  # [B, Lmax], [B, 1, 1, Lmax]
    num_seqs, lmax = idx.shape
    # The gathered keys and values (after the GQA repeat) of a chunk of sequences stay under
    # _DECODE_CHUNK_BYTES, so long contexts do not allocate B x Lmax x H x D at once.
    heads = q.shape[1] + (k_flat.shape[1] if group > 1 else 0)  # the gather, then its GQA repeat
    per_seq = 2 * lmax * heads * q.shape[2] * q.element_size()
    chunk = max(1, _DECODE_CHUNK_BYTES // per_seq)
    out = torch.empty_like(q) if chunk < num_seqs else None
    for first in range(0, num_seqs, chunk):
        rows = slice(first, first + chunk)
        ks = k_flat[idx[rows]].transpose(1, 2)  # [b, KVH, Lmax, D]
        vs = v_flat[idx[rows]].transpose(1, 2)
        if group > 1:
            ks = ks.repeat_interleave(group, dim=1)  # [b, H, Lmax, D]
            vs = vs.repeat_interleave(group, dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[rows, :, None, :], ks, vs, attn_mask=mask[rows], scale=scale
        )[:, :, 0, :]  # [b, H, D]
        if out is None:
            return o
        out[rows] = o
    return out


_DECODE_CHUNK_BYTES = 256 << 20


def _mask(q_len: int, ctx: int, window: int | None, device) -> tuple[torch.Tensor | None, bool]:
    """(bool mask [q_len, ctx + q_len] or None, is_causal). Query j sits at position ctx + j."""
    total = ctx + q_len
    if window is None or total <= window:
        if q_len == 1:
            return None, False  # a decode token sees everything before it
        if ctx == 0:
            return None, True
    q_pos = torch.arange(ctx, total, device=device)[:, None]
    k_pos = torch.arange(total, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask, False
