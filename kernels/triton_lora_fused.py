"""The LoRA layer in one kernel: y += (x @ A.T) @ B.T per slice, no shrink output in between.

Shrink + expand (kernels/triton_lora.py) is two launches and, with the K split, a zeroed float32
buffer between them. Where a layer is small (a decode layer of a low-rank adapter, a small
model's prefill layer) those fixed costs are most of its time. Here each program takes one tile of
the expand (a block of one slot's tokens x a run of one slice's columns), recomputes that block's
x @ A[slot, slice].T over the whole input, rounds it as the expand would read it, and adds its
columns of y: one launch, no buffer, no atomics, no program waiting on another. The price is the
recomputation: every column tile of a block re-reads the block's x rows and A rows (from L2 after
the first), so kernels/tuning.py `fused_config` picks this path only where those reads stay small.

Same work list (LoraMeta.block_list), same persistent / one-tile grids and same PDL contract as
the expand: kernels/triton_lora.py says what each means.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference, triton_lora
from .meta import LoraMeta
from .triton_lora import (
    _add_cols,
    _b_cols,
    _block_r,
    _expand_launches,
    _locate_slice,
    _pdl,
    _shrink_part,
    _widths,
    lora_expand,
    lora_shrink,
)
from .tuning import fused_config

_DTYPES = (torch.float16, torch.bfloat16)


@triton.jit
def _fused_tile(
    tile, y_ptr, x_ptr, a_ptr, b_ptr, block_slots_ptr, block_ranks_ptr, block_tokens_ptr,
    num_slots, in_features, chunks, stride_xt, stride_yt, stride_al, stride_as, stride_aj, stride_bl, stride_bn,
    off0, off1, off2, off3, off4,
    NUM_SLICES: tl.constexpr, RANK: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, N_ITERS: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, RANKED: tl.constexpr, PDL: tl.constexpr,
):
    """One tile: y[rows, cols] += (x[rows] @ A[slot, s, :rank].T).to(y) @ B[slot, cols, :rank].T."""
    block = tile // chunks
    chunk = tile - block * chunks
    slot = tl.load(block_slots_ptr + block)
    tok = tl.load(block_tokens_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    rank = RANK
    if RANKED:  # read beside the slot: one dependent round trip less
        rank = tl.minimum(tl.load(block_ranks_ptr + block), RANK)
    if PDL:  # x and y are the predecessor's: every program waits (the grid ends after the predecessor's)
        tl.extra.cuda.gdc_wait()
    if (slot >= 0) & (slot < num_slots):  # skips unused entries and the no-adapter group
        s, lo, hi, local = _locate_slice(chunk, off0, off1, off2, off3, off4, NUM_SLICES, BLOCK_N * N_ITERS)
        m_mask = tok >= 0
        offs_r = tl.arange(0, BLOCK_R)
        # A's rows past the adapter's rank are zero: not read (masked loads fetch nothing)
        live = offs_r < rank
        x_rows = x_ptr + tl.maximum(tok, 0)[:, None].to(tl.int64) * stride_xt
        a_rows = a_ptr + slot.to(tl.int64) * stride_al + s * stride_as + offs_r[None, :] * stride_aj
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        acc = _shrink_part(acc, x_rows, m_mask, a_rows, live, 0, in_features, BLOCK_K, EVEN_K, None)
        lhs = acc.to(b_ptr.dtype.element_ty)  # as the expand reads the shrink's float32 output
        r_mask = offs_r < RANK
        if RANKED:  # B in runs of 8 rank columns, as the expand reads it
            r_mask = r_mask & (offs_r // 8 < (rank + 7) // 8)
        b_rows = b_ptr + slot.to(tl.int64) * stride_bl
        y_rows = y_ptr + tl.maximum(tok, 0)[:, None].to(tl.int64) * stride_yt
        n_start = lo + local * (BLOCK_N * N_ITERS)
        for i in range(N_ITERS):
            offs_n = n_start + i * BLOCK_N + tl.arange(0, BLOCK_N)
            b = _b_cols(b_rows, offs_n, offs_r, r_mask, hi, stride_bn, EVEN_N)
            _add_cols(y_rows, lhs, b, offs_n, m_mask, hi, EVEN_N)


@triton.jit(do_not_specialize=["num_tokens"], do_not_specialize_on_alignment=["block_ranks_ptr"])
def _fused_kernel(
    y_ptr, x_ptr, a_ptr, b_ptr, block_slots_ptr, block_ranks_ptr, block_tokens_ptr, num_blocks_ptr,
    num_tokens, num_slots, in_features, chunks,
    stride_xt, stride_yt, stride_al, stride_as, stride_aj, stride_bl, stride_bn,
    off0, off1, off2, off3, off4,
    NUM_SLICES: tl.constexpr, RANK: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, N_ITERS: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, RANKED: tl.constexpr, ONE_TILE: tl.constexpr,
    PDL: tl.constexpr,
):
    """y[t, n] += sum_r round(sum_k x[t, k] a[slot(t), s(n), r, k]) b[slot(t), n, r], slice s(n) of column n.

    Persistent over the blocks of real slots (num_blocks[0]) x column chunks, or (ONE_TILE) one
    tile per program. PDL (ONE_TILE only): a programmatic dependent of the stream's last kernel;
    each program lets the next kernel launch, reads its block list entry, then waits."""
    pid = tl.program_id(0)
    if ONE_TILE:
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        _fused_tile(
            pid, y_ptr, x_ptr, a_ptr, b_ptr, block_slots_ptr, block_ranks_ptr, block_tokens_ptr,
            num_slots, in_features, chunks, stride_xt, stride_yt, stride_al, stride_as, stride_aj, stride_bl,
            stride_bn, off0, off1, off2, off3, off4,
            NUM_SLICES, RANK, BLOCK_R, BLOCK_M, BLOCK_K, BLOCK_N, N_ITERS, EVEN_K, EVEN_N, RANKED, PDL,
        )
    else:
        num_programs = tl.num_programs(0)
        num_tiles = tl.load(num_blocks_ptr) * chunks
        for tile in range(pid, num_tiles, num_programs):
            _fused_tile(
                tile, y_ptr, x_ptr, a_ptr, b_ptr, block_slots_ptr, block_ranks_ptr, block_tokens_ptr,
                num_slots, in_features, chunks, stride_xt, stride_yt, stride_al, stride_as, stride_aj, stride_bl,
                stride_bn, off0, off1, off2, off3, off4,
                NUM_SLICES, RANK, BLOCK_R, BLOCK_M, BLOCK_K, BLOCK_N, N_ITERS, EVEN_K, EVEN_N, RANKED, False,
            )


def _supported(y, x, lora_a, lora_b) -> bool:
    return (
        y.dtype in _DTYPES
        and x.dtype == y.dtype
        and lora_a.dtype == y.dtype
        and lora_b.dtype == y.dtype
        and x.stride(1) == 1
        and y.stride(1) == 1
        and lora_a.stride(3) == 1
        and lora_b.stride(2) == 1
    )


def lora_shrink_expand(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slice_offsets: tuple[int, ...],
    meta: LoraMeta,
    ranked: bool = True,
    fused: bool | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """y[t, off_s:off_s+n_s] += (x[t] @ lora_a[slot(t), s].T) @ lora_b[slot(t), off_s:off_s+n_s].T, in place.

    x, y, lora_a, lora_b: as in lora_shrink and lora_expand; the rank dim of lora_a is one part
    (not a fully sharded layer's tp parts, whose shrink outputs are gathered between the two).
    fused:  None: one kernel where tuning.fused_config says it pays, else lora_shrink + lora_expand;
            True: one kernel always; False: never
    pdl:    at decode, launch as a programmatic dependent of the stream's last kernel (lora_shrink's
            promise: the block list, A and B were written before it launched)
    """
    num_tokens, in_features = x.shape
    rank = lora_a.shape[2]
    if num_tokens == 0:
        return y
    if fused is not False and not _supported(y, x, lora_a, lora_b):
        return reference.lora_shrink_expand(y, x, lora_a, lora_b, slice_offsets, meta)
    cfg = None
    if fused is not False:
        widths = _widths(tuple(slice_offsets))
        cfg = fused_config(num_tokens, in_features, widths, rank, meta.max_loras, force=fused is True)
    if cfg is None:
        buf = lora_shrink(x, lora_a, meta, ranked=ranked, pdl=pdl)
        return lora_expand(y, buf, lora_b, slice_offsets, meta, ranked, pdl)
    blocks = meta.block_list(cfg.block_m)
    programs = triton_lora.num_sms(y.device.index) * cfg.ctas_per_sm  # (one patch point for tests)
    for first_slice, num_slices, offsets, chunks, even_n in _expand_launches(
        tuple(slice_offsets), cfg.block_n * cfg.n_iters
    ):
        tiles = blocks.max_blocks * chunks
        follow = _pdl(pdl, y.device, tiles <= programs, num_tokens)
        _fused_kernel[(min(tiles, programs),)](
            y, x, lora_a[:, first_slice:], lora_b, blocks.blocks, blocks.blocks[3], blocks.tokens, blocks.num_blocks,
            num_tokens, lora_b.shape[0], in_features, chunks,
            x.stride(0), y.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), lora_b.stride(0),
            lora_b.stride(1), *offsets,
            NUM_SLICES=num_slices, RANK=rank, BLOCK_R=_block_r(rank), BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k,
            BLOCK_N=cfg.block_n, N_ITERS=cfg.n_iters, EVEN_K=in_features % cfg.block_k == 0, EVEN_N=even_n,
            RANKED=ranked, ONE_TILE=tiles <= programs, PDL=follow, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **({"launch_pdl": True} if follow else {}),
        )
    return y
