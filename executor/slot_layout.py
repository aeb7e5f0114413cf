"""What the LoRA slot buffers hold and how: the slot spec, the rank invariant, and a packed B's rows.

A module's slot buffers hold up to `max_loras` adapters at once, each zero-padded to `max_rank`:
a slot holds zeros past its adapter's rank in every module (wholly zeros in a module the adapter
does not target). Every writer of slot buffers keeps that invariant (the layers' set_lora /
reset_lora, slot loads and clears), and every reader relies on it: the kernels may compute over
the full `max_rank` and stay exact, and a load or clear zeroes only the rank positions the slot's
previous adapter wrote (a rank-8 load over a rank-8 one moves a rank-8 adapter's bytes, not the
slot's whole `max_rank`).

The exception: where the slot buffers are on CUDA (`packs_b_on`), a dense layer's B slot holds
[N, r8] rows from its start (r8: the slot's adapter rank rounded up to 8, at most max_rank),
written at each load and never zeroed past them or by a clear; it is read only as such rows
(`packed_rows`), never as [N, R].

Every per-slot buffer (LoRA A and B, FP8 scales, DoRA scales, trainable-token rows) is allocated
through `register_slot_buffer`, so `slot_parts`, what one slot costs and what `--max-loras 0`
divides the free memory by (executor/memory.py), counts exactly the buffers there are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# what each per-slot buffer holds, as the start-up log names it (the parts of a slot's bytes)
LORA_AB, FP8_SCALES, DORA_SCALES, TOKEN_ROWS = SLOT_PARTS = ("LoRA A/B", "FP8 scales", "DoRA scales", "token rows")
_SLOT_PARTS_ATTR = "slot_buffer_parts"  # a module's per-slot buffer names -> their part


@dataclass(frozen=True)
class LoraSpec:
    max_loras: int  # GPU slots
    max_rank: int  # slot rank; adapters of lower rank are zero-padded
    dtype: torch.dtype
    targets_embeddings: bool = False  # also allocate slots for embed_tokens and lm_head (vocab-sized: costly)
    fully_sharded: bool = False  # under TP, also cut the adapter rank (column layers) / B's outputs (row layers)
    dora: bool = False  # dense layers also hold each slot's DoRA scale (executor/dora.py); off: no DoRA buffers, no step work
    trainable_tokens: bool = False  # each slot's token rows (executor/token_rows.py); off: no tables, no step work
    fp8: bool = False  # dense layers' slots hold A and B as FP8 with float32 scales (executor/lora_fp8.py); shards stay in dtype


def register_slot_buffer(m: nn.Module, name: str, tensor: torch.Tensor | None, part: str) -> None:
    """Registers `tensor` as m's non-persistent buffer `name` whose leading dim is the slot:
    [max_loras, ...], or [max_loras + 1, ...] whose last row is the base model's (slot -1). Every
    per-slot buffer is allocated through here, so what a slot costs (`slot_parts`) counts them all."""
    m.register_buffer(name, tensor, persistent=False)
    m.__dict__.setdefault(_SLOT_PARTS_ATTR, {})[name] = part


def slot_buffer_names(m: nn.Module) -> tuple[str, ...]:
    """The names of m's per-slot buffers (registered by `register_slot_buffer`; some may be None)."""
    return tuple(m.__dict__.get(_SLOT_PARTS_ATTR, ()))


def slot_parts(modules) -> dict[str, int]:
    """Bytes one more slot takes, by part (SLOT_PARTS, in that order; none of 0 bytes), across
    the per-slot buffers of `modules` (an iterable: a model's `modules()` for all of them): one
    leading-dim row of each, so the base model's row of a [max_loras + 1, ...] buffer is not counted."""
    parts = dict.fromkeys(SLOT_PARTS, 0)
    for m in modules:
        for name, part in m.__dict__.get(_SLOT_PARTS_ATTR, {}).items():
            buf = m._buffers.get(name)
            if buf is not None:
                parts[part] += buf[0].nbytes
    return {part: n for part, n in parts.items() if n}


def packs_b_on(device: torch.device) -> bool:
    """Whether dense layers whose slot buffers are on `device` keep each slot's B packed at the
    slot's rank (its first N x r8 elements as [N, r8] rows, `packed_rows`) rather than as [N, R]
    rows: on CUDA, where the expand then reads a low-rank adapter's B in whole sectors
    (kernels/triton_lora.py lora_expand's `packed`); not on the CPU, whose reference path would
    unpack every slot each step (nearly twice a small model's decode step)."""
    return device.type == "cuda"


def packed_rank(rank: int, slot_width: int) -> int:
    """The row width of a B packed at slot rank `rank` in slots of rank `slot_width` (a multiple of
    8): rounded up to 8, at most the slot's (kernels/triton_lora.py reads it so; FULL_RANK, a rank
    not known, reads the whole slot)."""
    return min(-(-rank // 8) * 8, slot_width)


def packed_rows(lora_b: torch.Tensor, slot: int, rank: int) -> torch.Tensor:
    """Slot `slot` of a packed B buffer ([max_loras, N, R]) as the [N, packed_rank(rank, R)] rows it holds."""
    n, width = lora_b.shape[1], packed_rank(rank, lora_b.shape[2])
    return lora_b[slot].view(-1)[: n * width].view(n, width)


def slot_fit_error(slot_buf: torch.Tensor, src: torch.Tensor, rank_dim: int = 1, dtype: torch.dtype | None = None) -> str | None:
    """Why src cannot be copied into slot_buf's first r entries of rank_dim (1 for dense modules'
    per-slot buffers, 2 for experts': their leading dim is the expert); None when it can. dtype: the
    one src must have (default slot_buf's; an FP8 slot's shard comes in the adapter dtype)."""
    if src.dim() != slot_buf.dim() or src.dtype != (dtype or slot_buf.dtype):
        return f"shard tensor {tuple(src.shape)} {src.dtype} vs slot {tuple(slot_buf.shape)} {dtype or slot_buf.dtype}"
    r = src.shape[rank_dim]
    want = (*slot_buf.shape[:rank_dim], r, *slot_buf.shape[rank_dim + 1 :])
    if r > slot_buf.shape[rank_dim] or tuple(src.shape) != want:
        return f"shard tensor {tuple(src.shape)} does not fit slot {tuple(slot_buf.shape)} (rank is dim {rank_dim})"
    return None


def written_rank(modules, slot: int) -> int:
    """The adapter rank past which `slot` holds zeros in every one of `modules`: the largest of their
    slot_ranks (set by every load and clear; a fully sharded layer's counts 1 / rank_parts of it)."""
    return max((m.slot_ranks[slot] * m.rank_parts for m in modules), default=0)
