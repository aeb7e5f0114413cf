"""Automatic prefix caching: the keys under which full KV blocks are filed and found again.

A block's keys and values depend on every token up to its end, on the weights that computed them
and how they are held (the base model, its weights' numeric format, the compute dtype, the request's
adapter version and the dtype of its LoRA slots), on how they are stored (the KV dtype and its
scales, the block size) and, for a LongRoPE model, on the factor set its sequence's keys took
(long_rope_seed). Under dynamic (NTK) RoPE they also depend on the longest sequence of the step that
wrote them, past max_position_embeddings: such blocks are never filed (scheduler.py's `dynamic_rope`).
So a block's key is a hash chain:

    seed      = H(KVFormat's fields, adapter name, adapter content digest)  ("", "": the base model)
    key[0]    = H(seed, token ids of block 0)
    key[i]    = H(key[i - 1], token ids of block i)

KVFormat names every executor-wide field (one process's constants); they are in the seed because
the keys also leave the process as KV events (kv_events.py): two executors of the same model whose
weights, LoRA slots or caches differ in format never publish the same key for a block.

Two requests share block i only if everything before its end is the same, under the same adapter
version: the store's digest is a sha256 over the adapter's config and weights, so a re-registered
adapter (new content) starts a new chain and never meets the old version's blocks; a deleted
one's blocks are never looked up again and age out of the allocator (kv_cache.BlockAllocator).
Under tensor parallelism rank 0 alone schedules: every rank holds its own heads' keys and values
in the same block ids, so one key stands for the block on every rank.

Only full blocks are filed, once a step that computed them has completed (Scheduler.cache_computed),
and a sequence's prefill starts after its longest cached run of them, never past its next-to-last
token: the last one is always computed, so the step has its logits, and a sequence never writes
into a block it shares.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

KEY_BYTES = 16


def _hash(parent: bytes, payload: bytes) -> bytes:
    return hashlib.blake2b(parent + payload, digest_size=KEY_BYTES).digest()


@dataclasses.dataclass(frozen=True)
class KVFormat:
    """What, besides the tokens and the adapter version, decides the KV a block holds: one executor's
    constants (engine.py `kv_format` fills them from the loaded model and its cache)."""

    model: str  # --model: the checkpoint's path (or file)
    base_model: str  # the name adapters are trained on
    dtype: str  # the compute dtype ("bfloat16"): activations, and K/V before the cache stores them
    weights: str  # the base linear layers' numeric format (model/fp8.py `weight_format`)
    lora_dtype: str  # the dense LoRA slots' dtype (lora_fp8.slot_dtype); in adapters' seeds only
    kv_dtype: str  # the KV cache's dtype, and for FP8 whose scales (engine.py `kv_format`)
    block_size: int  # tokens per block


def chain_seed(fmt: KVFormat, adapter: str = "", digest: str = "") -> bytes:
    """The chain's seed for one executor's KV format and one adapter version ("", "": the base model,
    whose KV never passes through a LoRA slot: its seed leaves the slots' dtype out)."""
    fields = dataclasses.replace(fmt, lora_dtype=fmt.lora_dtype if adapter else "")
    names = [str(v) for v in dataclasses.astuple(fields)] + [adapter, digest]
    return _hash(b"loraserve-kv-v2", "\0".join(names).encode("utf-8", "surrogatepass"))


def long_rope_seed(seed: bytes) -> bytes:
    """The chain seed of a LongRoPE sequence whose keys take the long factors at every position
    (Sequence.long_rope), from its seed: their blocks never meet those of short-factor keys."""
    return _hash(seed, b"longrope-long")


def extend_keys(keys: list[bytes], seed: bytes, token_ids: list[int], block_size: int, num_blocks: int) -> None:
    """Appends to `keys` (those of a sequence's first len(keys) blocks) the keys of its blocks up
    to `num_blocks`, stopping early at a block not yet full or holding a placeholder (a negative id:
    a token still being sampled on the device)."""
    start = len(keys)
    num_blocks = min(num_blocks, len(token_ids) // block_size)
    if num_blocks <= start:
        return
    ids = np.asarray(token_ids[start * block_size : num_blocks * block_size], dtype=np.int64)
    placeholders = np.flatnonzero(ids < 0)
    if len(placeholders):
        num_blocks = start + int(placeholders[0]) // block_size
    data, width = ids.tobytes(), 8 * block_size
    parent = keys[-1] if keys else seed
    for i in range(num_blocks - start):
        parent = _hash(parent, data[i * width : (i + 1) * width])
        keys.append(parent)
