"""Paged KV cache: fixed-size blocks, a free-block allocator, and per-step attention metadata.

A sequence's keys and values live in the blocks of its block table; token p of the sequence is
cache slot `block_table[p // block_size] * block_size + p % block_size`.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from loraserve import kernels
from loraserve.errors import exhausted


class LayerKV(NamedTuple):
    """One layer's cache tensors, as the attention layer passes them to the kernels."""

    k_cache: torch.Tensor  # [num_blocks + 1, block_size, KVH, D]
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None  # [KVH] float32 on the cache's device: an FP8 cache's K scales; None otherwise
    v_scale: torch.Tensor | None


class KVCache:
    """k_cache[layer], v_cache[layer]: [num_blocks + 1, block_size, num_kv_heads, head_dim].

    Blocks 0 .. num_blocks - 1 belong to sequences (through the BlockAllocator); the last one,
    `scratch_block`, is nobody's: the padding rows of a CUDA-graph batch write their keys there.
    dtype float8_e4m3fn (--kv-cache-dtype fp8, executor/model/kv_scales.py): k_scale[layer] and
    v_scale[layer] are [num_kv_heads] float32 on the device (real value = fp8 * scale), from `scales`
    ([num_layers, 2, num_kv_heads], the checkpoint's: model.kv_scales) or 1.0; device tensors, so a
    captured graph reads them without a host sync. Other dtypes: no scales (None).
    """

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device, scales=None):
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.scratch_block = num_blocks
        shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.k_scale: list[torch.Tensor | None] = [None] * num_layers
        self.v_scale: list[torch.Tensor | None] = [None] * num_layers
        if dtype == torch.float8_e4m3fn:
            if scales is None:
                scales = torch.ones(num_layers, 2, num_kv_heads)
            if tuple(scales.shape) != (num_layers, 2, num_kv_heads):
                raise ValueError(f"KV cache scales are {list(scales.shape)}, expected {[num_layers, 2, num_kv_heads]}")
            scales = scales.to(device=device, dtype=torch.float32)
            self.k_scale = [scales[i, 0].contiguous() for i in range(num_layers)]
            self.v_scale = [scales[i, 1].contiguous() for i in range(num_layers)]
        # built once: the eager forward passes one per layer every step
        self._layers = [LayerKV(*parts) for parts in zip(self.k_cache, self.v_cache, self.k_scale, self.v_scale)]

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int, dtype, device) -> KVCache:
        """The cache of `model`'s layers and (this rank's) kv heads; an FP8 one with the checkpoint's
        scales (model.kv_scales) where it has them."""
        c = model.cfg
        return cls(c.num_layers, num_blocks, block_size, model.num_kv_heads, c.head_dim, dtype, device, model.kv_scales)

    def layer(self, i: int) -> LayerKV:
        """Layer i's caches and scales."""
        return self._layers[i]

    @staticmethod
    def bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
        """Memory of one block over all layers (k and v): for sizing num_blocks from free memory
        (an FP8 cache's blocks are half a bf16 one's: twice the blocks in the same memory)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


class BlockAllocator:
    """Hands out block ids by reference count; the scheduler owns which sequence holds which blocks.

    Prefix caching (executor/engine/prefix_cache.py): a full block whose keys and values are
    computed may carry a key (`cache`); sequences with the same prefix then hold it together
    (`share`), and once nobody holds it, it stays findable (`lookup`) until `allocate` needs it for
    something else: blocks that carry no key go first, then cached ones, least recently freed first.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # held by nobody, no key
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # held by nobody, with a key: LRU first
        self._refs = [0] * num_blocks  # sequences holding each block
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.evictions = 0  # cached blocks taken for another use (their keys dropped)
        self.on_evict: Callable[[bytes], None] | None = None  # told each dropped key (kv_events.py); None: nobody

    @property
    def num_free(self) -> int:
        """Blocks held by no sequence (cached ones included: `allocate` takes them when it must)."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached(self) -> int:
        """Blocks that carry a key, held or not."""
        return len(self._key_of)

    @property
    def num_held(self) -> int:
        """Blocks some sequence holds (a reference count above 0)."""
        return self.num_blocks - self.num_free

    def allocate(self, n: int) -> list[int]:
        """n blocks held once each, or StatusError(RESOURCE_EXHAUSTED) leaving the allocator unchanged."""
        if n > self.num_free:
            raise exhausted(f"KV cache: {n} blocks wanted, {self.num_free} free of {self.num_blocks}")
        blocks = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:  # evict the least recently freed cached block
                b, _ = self._cached_free.popitem(last=False)
                key = self._key_of.pop(b)
                del self._block_of[key]
                self.evictions += 1
                if self.on_evict is not None:
                    self.on_evict(key)
            self._refs[b] = 1
            blocks.append(b)
        return blocks

    def free(self, blocks) -> None:
        """Drops one hold on each block. A chain's later blocks are freed first, so they are
        evicted before the earlier ones their keys depend on."""
        for b in reversed(blocks):
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} freed but not allocated")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._key_of:
                    self._cached_free[b] = None
                else:
                    self._free.append(b)

    def lookup(self, key: bytes) -> int | None:
        """The block cached under key, held or not; None if none is."""
        return self._block_of.get(key)

    def num_unheld(self, blocks) -> int:
        """How many of these (cached) blocks nobody holds: `share` takes them out of `num_free`."""
        return sum(self._refs[b] == 0 for b in blocks)

    def share(self, blocks) -> None:
        """One more hold on each of these cached blocks (found by `lookup`)."""
        for b in blocks:
            if self._refs[b] == 0:
                del self._cached_free[b]
            self._refs[b] += 1

    def cache(self, block: int, key: bytes) -> bool:
        """Files a held block, whose keys and values are computed, under key; True if it was filed.
        A key already filed (another block computed the same prefix meanwhile) keeps its block:
        this one stays unkeyed (False), as does a block already filed (False)."""
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} cached but not allocated")
        if key in self._block_of or block in self._key_of:
            return False
        self._key_of[block] = key
        self._block_of[key] = block
        return True

    def filed_keys(self) -> set[bytes]:
        """Every key filed now (held blocks' and free cached blocks')."""
        return set(self._block_of)

    def refs(self, block: int) -> int:
        """Sequences holding the block now."""
        return self._refs[block]


def place_tokens(q_lens: np.ndarray, ctx: np.ndarray, block_tables, tables: np.ndarray, block_size: int):
    """Writes each sequence's blocks into the rows of `tables` ([>= B, W] numpy) and returns
    (cu_query_lens [B + 1], positions [T], cache slots [T]) of the step's tokens, int64.
    ValueError if a sequence's tokens need more blocks than its table holds."""
    seq_lens = ctx + q_lens
    for i, table in enumerate(block_tables):
        if seq_lens[i] > len(table) * block_size:
            raise ValueError(f"sequence of {seq_lens[i]} tokens needs more than its {len(table)} blocks")
        tables[i, : len(table)] = table
    cu = np.zeros(len(q_lens) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    seq_of_token = np.repeat(np.arange(len(q_lens)), q_lens)  # [T]
    positions = ctx[seq_of_token] + np.arange(int(cu[-1])) - cu[:-1][seq_of_token]
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    return cu, positions, slots


@dataclass
class AttentionMetadata:
    """Where the flattened tokens of one step come from and go to in the paged cache.

    Sequence b owns query rows [cu_query_lens[b], cu_query_lens[b + 1]) of the T tokens; they sit
    at positions seq_lens[b] - q_len_b ... seq_lens[b] - 1 of that sequence. Only tensors reach
    the attention kernels (plus two host values that fix the launch shape), so a decode step built
    from static buffers can be captured in a CUDA graph (executor/engine/graphs.py).
    """

    slot_mapping: torch.Tensor  # [T] long: cache slot of each new token
    positions: torch.Tensor  # [T] long: position of each new token in its sequence
    block_tables: torch.Tensor  # [B, W] int32: each sequence's blocks; entries past its last block hold
    # any valid block id (0 from build(), earlier steps' ids in the graphs): never read past seq_len
    seq_lens: torch.Tensor  # [B] int32: tokens of each sequence after this step (cached + new)
    cu_query_lens: torch.Tensor | None  # [B + 1] int32; None for decode-only steps
    max_query_len: int  # host: the longest query chunk (launch shape of the prefill kernel)
    is_decode: bool  # host: every sequence has exactly one query token
    # [N, 2] int32 (sequence, query block) pairs for the prefill kernel (kernels/attention_plan.py):
    # set by captured mixed steps, whose grid is fixed by the bucket, not by max_query_len
    prefill_work: torch.Tensor | None = None
    # [T] bool: the token takes LongRoPE's long factors whatever its position (one of a sequence
    # longer than the original length, batch.long_rope_seqs); None: none does
    rope_long: torch.Tensor | None = None

    @staticmethod
    def build(
        query_lens, context_lens, block_tables, block_size, device, width: int | None = None, long_rope: list[bool] | None = None
    ) -> "AttentionMetadata":
        """Computed on the host with numpy once per step, then one host->device copy for everything.

        width: columns of the block table tensor (default: the longest table of the step).
        long_rope: [B] whether each sequence's tokens take LongRoPE's long factors (-> rope_long); None: none.
        """
        num_seqs = len(query_lens)
        if not (num_seqs == len(context_lens) == len(block_tables)):
            raise ValueError("query_lens, context_lens and block_tables must have one entry per sequence")
        q_lens = np.asarray(query_lens, dtype=np.int64)
        ctx = np.asarray(context_lens, dtype=np.int64)
        seq_lens = ctx + q_lens
        width = max(1, width or max((len(t) for t in block_tables), default=1))
        tables = np.zeros((num_seqs, width), dtype=np.int64)
        cu, positions, slots = place_tokens(q_lens, ctx, block_tables, tables, block_size)
        num_tokens = int(cu[-1])
        # One copy: [slots T | positions T | seq_lens B | cu B + 1 | tables B * W | rope_long T], then views.
        parts = [slots, positions, seq_lens, cu, tables.ravel()]
        if long_rope is not None:
            parts.append(np.repeat(np.asarray(long_rope, dtype=np.int64), q_lens))
        packed = torch.from_numpy(np.concatenate(parts)).to(device)
        t, b = num_tokens, num_seqs
        tables_end = 2 * b + 1 + b * width  # rope_long, if any, follows the tables
        as_int = packed[2 * t :].to(torch.int32)
        return AttentionMetadata(
            slot_mapping=packed[:t],
            positions=packed[t : 2 * t],
            block_tables=as_int[2 * b + 1 : tables_end].view(b, width),
            seq_lens=as_int[:b],
            cu_query_lens=as_int[b : 2 * b + 1],
            max_query_len=int(q_lens.max(initial=0)),
            is_decode=bool(num_seqs) and bool((q_lens == 1).all()),
            rope_long=None if long_rope is None else as_int[tables_end:] != 0,
        )


def paged_attention(
    q: torch.Tensor,
    kv: LayerKV,
    attn: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attends each sequence's queries to its whole context in the cache (the step's keys included:
    `kernels.rope_and_cache` wrote them).

    q: [T, H, D]; kv: the layer's cache, [num_blocks, block_size, KVH, D] each (FP8 with its scales,
    dequantized as they are read) -> [T, H, D]
    sliding_window, softcap: the layer's (None: off), host constants that a captured graph bakes in.
    A decode-only step is one paged decode call per layer; any other step (prefill chunks, mixed
    with decode tokens or not) one variable-length prefill call. Triton on CUDA, the plain-PyTorch
    reference elsewhere (kernels/attention_reference.py).
    """
    k_cache, v_cache, k_scale, v_scale = kv
    if attn.is_decode:
        return kernels.paged_decode_attention(
            q, k_cache, v_cache, attn.block_tables, attn.seq_lens, scale, sliding_window, softcap=softcap,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    return kernels.paged_prefill_attention(
        q, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.cu_query_lens, attn.max_query_len,
        scale, sliding_window, work=attn.prefill_work, softcap=softcap, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
