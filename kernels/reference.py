"""Plain-PyTorch shrink/expand: the test oracle and the CPU path.

Signatures are shared with kernels/triton_lora.py. Slot buffers are zero beyond each
adapter's rank, so computing over the full slot rank R is exact for mixed ranks (a packed B,
lora_expand's `packed`, is unpacked at each slot's rank first).
LoRA scaling is already folded into B by the adapter store.

FP8 slots (`scale` given): lora_a / lora_b hold float8_e4m3fn values and the scales hold what each
row is worth: A's weight is lora_a * scale[..., None] (one float32 per rank row of each slice), B's
lora_b * scale[..., None] (one per output channel). Here they are dequantized to float32 before
the products; the Triton kernels multiply the scales into their sums instead.
"""

from __future__ import annotations

import torch

from .meta import LoraMeta, shrink_output

# Up to this many tokens, gather each token's weights and run one batched op per layer
# (BGMV-style: few tokens per adapter, as in decode); above it, loop over slot groups
# (SGMV-style: the gathered B would be [T, N, R], too large for prefill).
GATHER_MAX_TOKENS = 32


def _gathered(meta: LoraMeta):
    """(slot index per token, clamped, and a [T] mask of tokens with an adapter) or None."""
    if meta.num_tokens > GATHER_MAX_TOKENS:
        return None
    slots = meta.token_slots.long()
    return slots.clamp(min=0), (slots >= 0)


def _slot_groups(meta: LoraMeta):
    """Yields (slot, token index tensor) for every slot with tokens this step (host sync: CPU path)."""
    counts = meta.tokens_per_slot.tolist()
    starts = meta.slot_start.tolist()
    for slot, (n, start) in enumerate(zip(counts, starts)):
        if n:
            yield slot, meta.sorted_token_ids[start : start + n].long()


def dequantized(w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """w as float32, times its per-row scale where it is FP8 (scale: w's shape less its last dim)."""
    return w.float() if scale is None else w.float() * scale.unsqueeze(-1)


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    meta: LoraMeta,
    out: torch.Tensor | None = None,
    ranked: bool = True,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """buf[s, t, :] = x[t] @ lora_a[slot(t), s].T for every slice s; rows of no-adapter tokens are 0.

    x:      [T, in]
    lora_a: [max_loras, S, R, in]
    out:    [S, T, R] float32 (allocated if None)
    ranked: unused here (see lora_expand)
    scale:  FP8 slots: [max_loras, S, R] float32, one per rank row of each slice (module docstring)
    """
    num_slices, rank = lora_a.shape[1], lora_a.shape[2]
    out, _ = shrink_output(meta, out, num_slices, x.shape[0], rank, x.device)  # every element is written below
    gathered = _gathered(meta)
    if gathered is not None:
        slots, valid = gathered
        a = dequantized(lora_a.index_select(0, slots), None if scale is None else scale.index_select(0, slots))  # [T, S, R, in]
        out.copy_(torch.einsum("ti,tsri->str", x.float(), a) * valid[None, :, None])
        return out
    out.zero_()
    for slot, idx in _slot_groups(meta):
        xs = x.index_select(0, idx).float()  # [n, in]
        a = dequantized(lora_a[slot], None if scale is None else scale[slot])  # [S, R, in]
        out[:, idx] = torch.einsum("ti,sri->str", xs, a)
    return out


def unpacked(lora_b: torch.Tensor, meta: LoraMeta, rank: int) -> torch.Tensor:
    """[max_loras, N, rank] from slot buffers holding B packed at each slot's rank rounded up to 8
    (its first N x r8 elements as [N, r8] rows, r8 at most the slot buffer's R; meta.slot_ranks
    gives the ranks), zeros past it. Tensor ops only: no wait on the device (a CUDA graph may
    capture it)."""
    if meta.slot_ranks is None:
        raise ValueError("a packed B needs the slots' ranks (LoraMeta.slot_ranks)")
    slots, n, full = lora_b.shape
    width = torch.clamp((meta.slot_ranks.to(torch.int64) + 7) // 8 * 8, max=full)[:, None, None]  # [L, 1, 1]
    cols = torch.arange(min(rank, full), device=lora_b.device)[None, None, :]
    index = torch.arange(n, device=lora_b.device)[None, :, None] * width + cols  # [L, N, rank]
    inside = cols < width  # (columns past `rank` are zero: the caller's rank covers every module's own)
    got = lora_b.reshape(slots, n * full).gather(1, (index * inside).reshape(slots, -1)).view(slots, n, -1)
    out = torch.where(inside, got, torch.zeros((), dtype=got.dtype, device=got.device))
    return out if rank <= full else torch.nn.functional.pad(out, (0, rank - full))


def lora_expand(
    y: torch.Tensor,
    buf: torch.Tensor,
    lora_b: torch.Tensor,
    slice_offsets: tuple[int, ...],
    meta: LoraMeta,
    ranked: bool = True,
    packed: bool = False,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[t, off_s:off_s+n_s] += buf[s, t] @ lora_b[slot(t), off_s:off_s+n_s].T, in place.

    y:             [T, N] with N = slice_offsets[-1]
    buf:           [S, T, R] (from lora_shrink, or lora_embedding_shrink with S = 1)
    lora_b:        [max_loras, N, R]
    slice_offsets: S + 1 output offsets, e.g. (0, q, q + k, q + k + v)
    ranked:        unused here: slot buffers are zero past each adapter's rank (see triton_lora)
    packed:        each slot's B packed at its rank (triton_lora.lora_expand): unpacked here first
    scale:         FP8 slots: [max_loras, N] float32, one per output channel (module docstring)
    """
    if packed:  # (FP8 values widened first: the scales are per row of the unpacked [N, R])
        lora_b = unpacked(lora_b if scale is None else lora_b.float(), meta, buf.shape[2])
    gathered = _gathered(meta)
    if gathered is not None:
        slots, valid = gathered
        b = dequantized(lora_b.index_select(0, slots), None if scale is None else scale.index_select(0, slots))  # [T, N, R]
        delta = torch.cat(
            [
                torch.einsum("tr,tnr->tn", buf[s], b[:, slice_offsets[s] : slice_offsets[s + 1]])
                for s in range(len(slice_offsets) - 1)
            ],
            dim=1,
        )  # [T, N]
        y += (delta * valid[:, None]).to(y.dtype)
        return y
    for slot, idx in _slot_groups(meta):
        b = dequantized(lora_b[slot], None if scale is None else scale[slot])  # [N, R]
        delta = torch.cat(
            [buf[s].index_select(0, idx) @ b[slice_offsets[s] : slice_offsets[s + 1]].T for s in range(len(slice_offsets) - 1)],
            dim=1,
        )  # [n, N]
        y.index_add_(0, idx, delta.to(y.dtype))
    return y


def lora_embedding_shrink(
    token_ids: torch.Tensor, lora_a: torch.Tensor, meta: LoraMeta, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Embedding LoRA has no matmul before expand: buf[0, t, :] = lora_a[slot(t), token_ids[t], :].

    token_ids: [T]
    lora_a:    [max_loras, vocab, R] (the PEFT lora_embedding_A, transposed)
    out:       [1, T, R] float32
    """
    rank = lora_a.shape[2]
    if out is None:
        out = torch.empty(1, token_ids.shape[0], rank, dtype=torch.float32, device=token_ids.device)
    out.zero_()
    for slot, idx in _slot_groups(meta):
        out[0, idx] = lora_a[slot].index_select(0, token_ids.index_select(0, idx).long()).float()
    return out
