"""Triton shrink/expand: the CUDA path, same signatures and math as kernels/reference.py.

Both kernels walk a work list of (slot, token rows) blocks built once per step
(`LoraMeta.block_list`): each block holds block_m tokens of one slot, so each adapter's
weights are read once per block of its own tokens, never once per token, and tokens with no
adapter cost nothing in expand. The grid is persistent (a fixed number of programs that loop
over the tiles the device-side list holds), so its size depends only on T, max_loras and the
shapes: no host synchronisation, no allocation, one launch shape per captured batch size.

Decode (a few tokens per slot) and prefill (thousands) run the same kernels with different
tiles: small token blocks and K split over programs for decode, large tensor-core tiles for
prefill. Block sizes come from kernels/tuning.py by GPU and shape.

`num_tokens` is not specialised (`do_not_specialize`): Triton would otherwise build a kernel
apart for T == 1 and for T a multiple of 16, on top of the tables' configs, and a serving process
would meet those builds on its first steps of each kind (executor/engine/warmup.py warms the rest).
Nor is the block ranks' pointer on its alignment: it is row 3 of the [4, max_blocks] block list,
16-byte aligned only when max_blocks (which follows T and max_loras) is a multiple of 4.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import triton
import triton.language as tl

from . import reference
from .meta import LoraMeta, shrink_output
from .tuning import DECODE_MAX_TOKENS, expand_config, num_sms, shrink_config

_DTYPES = (torch.float16, torch.bfloat16)
FP8 = torch.float8_e4m3fn  # FP8 slots' values (their scales: float32)
_MAX_SLICES_PER_LAUNCH = 4


@triton.jit
def _shrink_part(
    acc,
    x_rows,
    m_mask,
    a_rows,
    live,
    k_lo,
    k_hi,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    STAGES: tl.constexpr,
    SCALED: tl.constexpr,
):
    """acc += x[rows, k_lo:k_hi] @ A[offs_j, k_lo:k_hi].T, BLOCK_K input columns per step.

    STAGES: the loop's software-pipeline depth (None: the launch's num_stages). SCALED: A is FP8,
    widened to x's dtype (exactly) before the product; its scales are the caller's."""
    for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        offs_k = k + tl.arange(0, BLOCK_K)
        if EVEN_K:
            xa = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
            a = tl.load(a_rows + offs_k[:, None], mask=live[None, :], other=0.0)
        else:
            k_mask = offs_k < k_hi
            xa = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            a = tl.load(a_rows + offs_k[:, None], mask=live[None, :] & k_mask[:, None], other=0.0)
        if SCALED:
            a = a.to(xa.dtype)
        acc = tl.dot(xa, a, acc)
    return acc


@triton.jit
def _shrink_narrow(
    x_rows,
    a_ptr,
    out_ptr,
    tok,
    m_mask,
    col0,
    rank,
    k_lo,
    k_hi,
    num_tokens,
    stride_aj,
    s_row,
    RANK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SCALED: tl.constexpr,
):
    """A tile whose adapter's rank fits BN columns: those columns only, BK input columns per step.

    The same bytes per step as the whole tile's BLOCK_N x BLOCK_K, in fewer steps: a low-rank
    adapter in a high-rank slot takes as few loop trips as its bytes need, not the slot's.
    Only with the K split (out zeroed first): the tile's other columns are left as they are."""
    offs_j = col0 + tl.arange(0, BN)
    live = offs_j % RANK < rank
    acc = tl.zeros((BLOCK_M, BN), dtype=tl.float32)
    # one buffer, no pipelining: the steps are few (often one), and num_stages copies of a 4x
    # longer x tile would take the shared memory every other tile's occupancy needs
    acc = _shrink_part(acc, x_rows, m_mask, a_ptr + offs_j[None, :] * stride_aj, live, k_lo, k_hi, BK, False, 1, SCALED)
    if SCALED:  # FP8 A: one scale per rank row (s_row: the slot's [S * RANK] scales)
        acc = acc * tl.load(s_row + offs_j, mask=live, other=0.0)[None, :]
    out_ptrs = out_ptr + ((offs_j[None, :] // RANK) * num_tokens + tok[:, None]) * RANK + offs_j[None, :] % RANK
    tl.atomic_add(out_ptrs, acc, mask=m_mask[:, None] & live[None, :], sem="relaxed")


@triton.jit
def _shrink_whole(
    x_rows,
    a_slot,
    out_ptr,
    tok,
    m_mask,
    offs_j,
    j_mask,
    live,
    k_lo,
    k_hi,
    num_tokens,
    stride_aj,
    s_row,
    RANK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    SCALED: tl.constexpr,
):
    """The tile's BLOCK_N columns, BLOCK_K input columns per step, stored (or added, K split) into buf."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _shrink_part(acc, x_rows, m_mask, a_slot + offs_j[None, :] * stride_aj, live, k_lo, k_hi, BLOCK_K, EVEN_K, None, SCALED)
    if SCALED:  # FP8 A: one scale per rank row (s_row: the slot's [S * RANK] scales)
        acc = acc * tl.load(s_row + offs_j, mask=live, other=0.0)[None, :]
    # buf is [S, T, RANK]: column j lands in slice j // RANK, rank position j % RANK.
    out_ptrs = out_ptr + ((offs_j[None, :] // RANK) * num_tokens + tok[:, None]) * RANK + offs_j[None, :] % RANK
    mask = m_mask[:, None] & j_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc, mask=mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=mask, sem="relaxed")


@triton.jit
def _shrink_tile(
    tile,
    x_ptr,
    a_ptr,
    out_ptr,
    block_slots_ptr,
    block_ranks_ptr,
    block_tokens_ptr,
    num_tokens,
    num_slots,
    in_features,
    k_per_split,
    stride_xt,
    stride_al,
    stride_aj,
    scale_ptr,
    stride_sl,
    RANK: tl.constexpr,
    SR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    N_BLOCKS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    RANKED: tl.constexpr,
    NARROW: tl.constexpr,
    PDL: tl.constexpr,
    SCALED: tl.constexpr,
):
    """One tile: a block of one slot's tokens x BLOCK_N of the S * RANK columns x one K split.

    NARROW (ranked, K split, and column blocks inside one slice): a block whose adapter's rank
    is at most BLOCK_N / 4 (or / 2) computes only the first BLOCK_N / 4 (/ 2) columns, with a
    K step 4x (2x) as long (_shrink_narrow)."""
    tiles_per_block = N_BLOCKS * SPLIT_K
    block = tile // tiles_per_block
    rest = tile - block * tiles_per_block
    split = rest // N_BLOCKS
    col_block = rest - split * N_BLOCKS
    slot = tl.load(block_slots_ptr + block)
    tok = tl.load(block_tokens_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    rank = RANK
    if RANKED:
        rank = tl.load(block_ranks_ptr + block)
    if PDL:  # the block list is the step's, written before the stream's last non-PDL kernel; x is
        # the predecessor's: wait for it (and so for everything before it) in every program
        tl.extra.cuda.gdc_wait()
    if slot >= 0:  # -1: an unused entry of the list
        m_mask = tok >= 0
        offs_j = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
        j_mask = offs_j < SR
        if RANKED:  # columns past the slot adapter's rank are zero in A: not read
            live = j_mask & (offs_j % RANK < rank)
        else:
            live = j_mask
        k_lo = split * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, in_features)
        # the no-adapter group, and tiles wholly past the adapter's rank: no products, zeros out
        k_hi = tl.where((slot < num_slots) & (tl.max(live.to(tl.int32), 0) > 0), k_hi, k_lo)

        x_rows = x_ptr + tl.maximum(tok, 0)[:, None].to(tl.int64) * stride_xt
        a_slot = a_ptr + slot.to(tl.int64) * stride_al
        if SCALED:  # the slot's A scales (the no-adapter group's slot, num_slots, reads the last slot's: its sums are 0)
            s_row = scale_ptr + tl.minimum(slot, num_slots - 1).to(tl.int64) * stride_sl
        else:
            s_row = a_slot  # (unused)
        col0 = col_block * BLOCK_N
        if NARROW:
            # the host's rule (_narrow_shrink): atomic adds into a zeroed buf, one slice per column block
            tl.static_assert((SPLIT_K > 1) & (RANK % BLOCK_N == 0) & (BLOCK_N >= 32))
            if BLOCK_N >= 64:  # a quarter of the columns is still >= 16 (tl.dot's least)
                if rank <= BLOCK_N // 4:
                    _shrink_narrow(
                        x_rows,
                        a_slot,
                        out_ptr,
                        tok,
                        m_mask,
                        col0,
                        rank,
                        k_lo,
                        k_hi,
                        num_tokens,
                        stride_aj,
                        s_row,
                        RANK,
                        BLOCK_M,
                        BLOCK_N // 4,
                        BLOCK_K * 4,
                        SCALED,
                    )
                elif rank <= BLOCK_N // 2:
                    _shrink_narrow(
                        x_rows,
                        a_slot,
                        out_ptr,
                        tok,
                        m_mask,
                        col0,
                        rank,
                        k_lo,
                        k_hi,
                        num_tokens,
                        stride_aj,
                        s_row,
                        RANK,
                        BLOCK_M,
                        BLOCK_N // 2,
                        BLOCK_K * 2,
                        SCALED,
                    )
                else:
                    _shrink_whole(
                        x_rows,
                        a_slot,
                        out_ptr,
                        tok,
                        m_mask,
                        offs_j,
                        j_mask,
                        live,
                        k_lo,
                        k_hi,
                        num_tokens,
                        stride_aj,
                        s_row,
                        RANK,
                        BLOCK_M,
                        BLOCK_N,
                        BLOCK_K,
                        SPLIT_K,
                        EVEN_K,
                        SCALED,
                    )
            else:
                if rank <= BLOCK_N // 2:
                    _shrink_narrow(
                        x_rows,
                        a_slot,
                        out_ptr,
                        tok,
                        m_mask,
                        col0,
                        rank,
                        k_lo,
                        k_hi,
                        num_tokens,
                        stride_aj,
                        s_row,
                        RANK,
                        BLOCK_M,
                        BLOCK_N // 2,
                        BLOCK_K * 2,
                        SCALED,
                    )
                else:
                    _shrink_whole(
                        x_rows,
                        a_slot,
                        out_ptr,
                        tok,
                        m_mask,
                        offs_j,
                        j_mask,
                        live,
                        k_lo,
                        k_hi,
                        num_tokens,
                        stride_aj,
                        s_row,
                        RANK,
                        BLOCK_M,
                        BLOCK_N,
                        BLOCK_K,
                        SPLIT_K,
                        EVEN_K,
                        SCALED,
                    )
        else:
            _shrink_whole(
                x_rows,
                a_slot,
                out_ptr,
                tok,
                m_mask,
                offs_j,
                j_mask,
                live,
                k_lo,
                k_hi,
                num_tokens,
                stride_aj,
                s_row,
                RANK,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                SPLIT_K,
                EVEN_K,
                SCALED,
            )


@triton.jit(do_not_specialize=["num_tokens"], do_not_specialize_on_alignment=["block_ranks_ptr"])
def _shrink_kernel(
    x_ptr,
    a_ptr,
    out_ptr,
    block_slots_ptr,
    block_ranks_ptr,
    block_tokens_ptr,
    num_blocks_ptr,
    num_tokens,
    num_slots,
    in_features,
    k_per_split,
    stride_xt,
    stride_al,
    stride_aj,
    scale_ptr,
    stride_sl,
    RANK: tl.constexpr,
    SR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    N_BLOCKS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    RANKED: tl.constexpr,
    NARROW: tl.constexpr,
    ONE_TILE: tl.constexpr,
    PDL: tl.constexpr,
    SCALED: tl.constexpr,
):
    """out[s, t, r] = sum_k x[t, k] * a[slot(t), s * RANK + r, k], over the flattened j = s * RANK + r.

    Persistent: program p takes tiles p, p + P, ... of the device-side block list, up to the
    tile count the list holds. ONE_TILE (the grid covers the list's upper bound, as in decode):
    each program takes tile p without reading the count (unused entries say slot -1), one
    dependent memory round trip less. Blocks of the no-adapter group (slot == num_slots)
    write zeros. K split over programs: the splits add into a zeroed out.

    PDL (ONE_TILE only; launched with launch_pdl): a programmatic dependent of the stream's last
    kernel. Each program first lets the next kernel (the expand) start launching, reads its block
    list entry, then waits for the predecessor's grid before it reads x or writes out.

    SCALED: a holds float8_e4m3fn and scale_ptr [max_loras, S * RANK] float32 (slot stride
    stride_sl) one scale per rank row: out[s, t, r] is then multiplied by scale[slot(t), s * RANK + r].
    Off, scale_ptr is None and the kernel is the bf16 / fp16 one.
    """
    pid = tl.program_id(0)
    if ONE_TILE:
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        _shrink_tile(
            pid,
            x_ptr,
            a_ptr,
            out_ptr,
            block_slots_ptr,
            block_ranks_ptr,
            block_tokens_ptr,
            num_tokens,
            num_slots,
            in_features,
            k_per_split,
            stride_xt,
            stride_al,
            stride_aj,
            scale_ptr,
            stride_sl,
            RANK,
            SR,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            N_BLOCKS,
            SPLIT_K,
            EVEN_K,
            RANKED,
            NARROW,
            PDL,
            SCALED,
        )
    else:
        num_programs = tl.num_programs(0)
        num_tiles = tl.load(num_blocks_ptr + 1) * (N_BLOCKS * SPLIT_K)
        for tile in range(pid, num_tiles, num_programs):
            _shrink_tile(
                tile,
                x_ptr,
                a_ptr,
                out_ptr,
                block_slots_ptr,
                block_ranks_ptr,
                block_tokens_ptr,
                num_tokens,
                num_slots,
                in_features,
                k_per_split,
                stride_xt,
                stride_al,
                stride_aj,
                scale_ptr,
                stride_sl,
                RANK,
                SR,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                N_BLOCKS,
                SPLIT_K,
                EVEN_K,
                RANKED,
                NARROW,
                False,
                SCALED,
            )


@triton.jit
def _locate_slice(chunk, off0, off1, off2, off3, off4, NUM_SLICES: tl.constexpr, CHUNK: tl.constexpr):
    """Flat column-chunk index -> (slice, first column, end column, chunk index inside the slice)."""
    s = chunk * 0
    lo = s + off0
    hi = s + off1
    first = s
    if NUM_SLICES > 1:
        c = tl.cdiv(off1 - off0, CHUNK)
        at = chunk >= c
        s = tl.where(at, 1, s)
        lo = tl.where(at, off1, lo)
        hi = tl.where(at, off2, hi)
        first = tl.where(at, c, first)
        if NUM_SLICES > 2:
            c = c + tl.cdiv(off2 - off1, CHUNK)
            at = chunk >= c
            s = tl.where(at, 2, s)
            lo = tl.where(at, off2, lo)
            hi = tl.where(at, off3, hi)
            first = tl.where(at, c, first)
            if NUM_SLICES > 3:
                c = c + tl.cdiv(off3 - off2, CHUNK)
                at = chunk >= c
                s = tl.where(at, 3, s)
                lo = tl.where(at, off3, lo)
                hi = tl.where(at, off4, hi)
                first = tl.where(at, c, first)
    return s, lo, hi, chunk - first


@triton.jit
def _b_cols(b_rows, offs_n, offs_r, r_mask, hi, stride_bn, EVEN_N: tl.constexpr):
    """B[offs_n, offs_r] as a [BLOCK_R, BLOCK_N] tile (columns from hi on read as 0)."""
    if EVEN_N:
        return tl.load(b_rows + offs_n[None, :] * stride_bn + offs_r[:, None], mask=r_mask[:, None], other=0.0)
    return tl.load(
        b_rows + offs_n[None, :] * stride_bn + offs_r[:, None],
        mask=r_mask[:, None] & (offs_n < hi)[None, :],
        other=0.0,
    )


@triton.jit
def _add_cols(y_rows, lhs, b, offs_n, m_mask, hi, s_row, EVEN_N: tl.constexpr, SCALED: tl.constexpr):
    """y[rows, offs_n] += lhs @ b. SCALED: b is FP8, widened to lhs's dtype (exactly), and each
    column's product is multiplied by its scale (s_row: the slot's [N] scales)."""
    if EVEN_N:
        mask = m_mask[:, None]
    else:
        mask = m_mask[:, None] & (offs_n < hi)[None, :]
    y_tile = y_rows + offs_n[None, :]
    old = tl.load(y_tile, mask=mask, other=0.0)
    if SCALED:
        b = b.to(lhs.dtype)
    delta = tl.dot(lhs, b)
    if SCALED:
        if EVEN_N:
            delta = delta * tl.load(s_row + offs_n)[None, :]
        else:
            delta = delta * tl.load(s_row + offs_n, mask=offs_n < hi, other=0.0)[None, :]
    tl.store(y_tile, (old.to(tl.float32) + delta).to(y_tile.dtype.element_ty), mask=mask)


@triton.jit
def _expand_cols(
    y_rows,
    b_rows,
    buf_ptr,
    s,
    tok,
    m_mask,
    rank,
    n_start,
    hi,
    num_tokens,
    stride_bn,
    s_row,
    RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    N_ITERS: tl.constexpr,
    EVEN_N: tl.constexpr,
    RANKED: tl.constexpr,
    PDL: tl.constexpr,
    SCALED: tl.constexpr,
):
    """y[rows, n_start : n_start + BLOCK_N * N_ITERS] += buf[s, rows, :BLOCK_R] @ B[cols, :BLOCK_R].T.

    PDL: the first step's B columns are read before the wait for the shrink's grid (B is the
    slot's, written before the step), buf and y after it."""
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < RANK
    if RANKED:  # B's columns past the slot adapter's rank are zero: not read. In runs of 8 (16
        # bytes): a mask constant over 8 lanes keeps B's loads 16-byte vectors (the tail is zero)
        r_mask = r_mask & (offs_r // 8 < (rank + 7) // 8)
    if PDL:
        first = _b_cols(b_rows, n_start + tl.arange(0, BLOCK_N), offs_r, r_mask, hi, stride_bn, EVEN_N)
        tl.extra.cuda.gdc_wait()
    lhs = tl.load(
        buf_ptr + (s * num_tokens + tok[:, None]) * RANK + offs_r[None, :],
        mask=m_mask[:, None] & r_mask[None, :],
        other=0.0,
    )
    if SCALED:  # FP8 B: the products in y's dtype
        lhs = lhs.to(y_rows.dtype.element_ty)
    else:
        lhs = lhs.to(b_rows.dtype.element_ty)
    if PDL:
        _add_cols(y_rows, lhs, first, n_start + tl.arange(0, BLOCK_N), m_mask, hi, s_row, EVEN_N, SCALED)
    for i in range(1 if PDL else 0, N_ITERS):  # (a constexpr start: the first step is done under PDL)
        offs_n = n_start + i * BLOCK_N + tl.arange(0, BLOCK_N)
        b = _b_cols(b_rows, offs_n, offs_r, r_mask, hi, stride_bn, EVEN_N)
        _add_cols(y_rows, lhs, b, offs_n, m_mask, hi, s_row, EVEN_N, SCALED)


@triton.jit
def _expand_tile(
    tile,
    y_ptr,
    buf_ptr,
    b_ptr,
    block_slots_ptr,
    block_ranks_ptr,
    block_tokens_ptr,
    num_tokens,
    num_slots,
    chunks,
    stride_yt,
    stride_bl,
    stride_bn,
    off0,
    off1,
    off2,
    off3,
    off4,
    scale_ptr,
    stride_sl,
    NUM_SLICES: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    N_ITERS: tl.constexpr,
    EVEN_N: tl.constexpr,
    RANKED: tl.constexpr,
    NARROW: tl.constexpr,
    WIDE2: tl.constexpr,
    WIDE4: tl.constexpr,
    PDL: tl.constexpr,
    PACKED: tl.constexpr,
    SCALED: tl.constexpr,
):
    """One tile: a block of one slot's tokens x BLOCK_N * N_ITERS columns of one slice.

    NARROW (ranked, BLOCK_R >= 32): a block whose adapter's rank is at most BLOCK_R / 2 (or / 4,
    BLOCK_R >= 64) reads and multiplies only that many rank columns, and takes WIDE2 (WIDE4)
    times the columns per step: a low-rank adapter in a high-rank slot costs what its bytes do.
    PACKED (ranked): the slot holds B as [N, r8] from its start, r8 its rank rounded up to 8 and
    at most RANK (row stride r8, not stride_bn): each row's bytes are contiguous with the next row's."""
    block = tile // chunks
    chunk = tile - block * chunks
    slot = tl.load(block_slots_ptr + block)
    tok = tl.load(block_tokens_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    rank = RANK
    if NARROW or RANKED:  # read beside the slot, not after it: one dependent round trip less
        rank = tl.load(block_ranks_ptr + block)
    if PACKED:  # (at most the slot's RANK: FULL_RANK, a rank not known, reads the whole slot)
        stride_bn = tl.minimum((rank + 7) // 8 * 8, RANK)
    if (slot >= 0) & (slot < num_slots):  # skips unused entries and the no-adapter group
        s, lo, hi, local = _locate_slice(chunk, off0, off1, off2, off3, off4, NUM_SLICES, BLOCK_N * N_ITERS)
        m_mask = tok >= 0
        b_rows = b_ptr + slot.to(tl.int64) * stride_bl
        if SCALED:  # the slot's B scales, one per output column
            s_row = scale_ptr + slot.to(tl.int64) * stride_sl
        else:
            s_row = b_rows  # (unused)
        y_rows = y_ptr + tl.maximum(tok, 0)[:, None].to(tl.int64) * stride_yt
        n_start = lo + local * (BLOCK_N * N_ITERS)
        if NARROW:
            if BLOCK_R >= 64:
                if rank <= BLOCK_R // 4:
                    _expand_cols(
                        y_rows,
                        b_rows,
                        buf_ptr,
                        s,
                        tok,
                        m_mask,
                        rank,
                        n_start,
                        hi,
                        num_tokens,
                        stride_bn,
                        s_row,
                        RANK,
                        BLOCK_R // 4,
                        BLOCK_N * WIDE4,
                        N_ITERS // WIDE4,
                        EVEN_N,
                        RANKED,
                        PDL,
                        SCALED,
                    )
                elif rank <= BLOCK_R // 2:
                    _expand_cols(
                        y_rows,
                        b_rows,
                        buf_ptr,
                        s,
                        tok,
                        m_mask,
                        rank,
                        n_start,
                        hi,
                        num_tokens,
                        stride_bn,
                        s_row,
                        RANK,
                        BLOCK_R // 2,
                        BLOCK_N * WIDE2,
                        N_ITERS // WIDE2,
                        EVEN_N,
                        RANKED,
                        PDL,
                        SCALED,
                    )
                else:
                    _expand_cols(
                        y_rows,
                        b_rows,
                        buf_ptr,
                        s,
                        tok,
                        m_mask,
                        rank,
                        n_start,
                        hi,
                        num_tokens,
                        stride_bn,
                        s_row,
                        RANK,
                        BLOCK_R,
                        BLOCK_N,
                        N_ITERS,
                        EVEN_N,
                        RANKED,
                        PDL,
                        SCALED,
                    )
            elif BLOCK_R >= 32:
                if rank <= BLOCK_R // 2:
                    _expand_cols(
                        y_rows,
                        b_rows,
                        buf_ptr,
                        s,
                        tok,
                        m_mask,
                        rank,
                        n_start,
                        hi,
                        num_tokens,
                        stride_bn,
                        s_row,
                        RANK,
                        BLOCK_R // 2,
                        BLOCK_N * WIDE2,
                        N_ITERS // WIDE2,
                        EVEN_N,
                        RANKED,
                        PDL,
                        SCALED,
                    )
                else:
                    _expand_cols(
                        y_rows,
                        b_rows,
                        buf_ptr,
                        s,
                        tok,
                        m_mask,
                        rank,
                        n_start,
                        hi,
                        num_tokens,
                        stride_bn,
                        s_row,
                        RANK,
                        BLOCK_R,
                        BLOCK_N,
                        N_ITERS,
                        EVEN_N,
                        RANKED,
                        PDL,
                        SCALED,
                    )
            else:
                _expand_cols(
                    y_rows,
                    b_rows,
                    buf_ptr,
                    s,
                    tok,
                    m_mask,
                    rank,
                    n_start,
                    hi,
                    num_tokens,
                    stride_bn,
                    s_row,
                    RANK,
                    BLOCK_R,
                    BLOCK_N,
                    N_ITERS,
                    EVEN_N,
                    RANKED,
                    PDL,
                    SCALED,
                )
        elif RANKED:
            _expand_cols(
                y_rows,
                b_rows,
                buf_ptr,
                s,
                tok,
                m_mask,
                rank,
                n_start,
                hi,
                num_tokens,
                stride_bn,
                s_row,
                RANK,
                BLOCK_R,
                BLOCK_N,
                N_ITERS,
                EVEN_N,
                RANKED,
                PDL,
                SCALED,
            )
        else:
            _expand_cols(
                y_rows,
                b_rows,
                buf_ptr,
                s,
                tok,
                m_mask,
                RANK,
                n_start,
                hi,
                num_tokens,
                stride_bn,
                s_row,
                RANK,
                BLOCK_R,
                BLOCK_N,
                N_ITERS,
                EVEN_N,
                RANKED,
                PDL,
                SCALED,
            )
    elif PDL:  # every program waits: the grid ends only after the shrink's (and what it waited for)
        tl.extra.cuda.gdc_wait()


@triton.jit(do_not_specialize=["num_tokens"], do_not_specialize_on_alignment=["block_ranks_ptr"])
def _expand_kernel(
    y_ptr,
    buf_ptr,
    b_ptr,
    block_slots_ptr,
    block_ranks_ptr,
    block_tokens_ptr,
    num_blocks_ptr,
    num_tokens,
    num_slots,
    chunks,
    stride_yt,
    stride_bl,
    stride_bn,
    off0,
    off1,
    off2,
    off3,
    off4,
    scale_ptr,
    stride_sl,
    NUM_SLICES: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    N_ITERS: tl.constexpr,
    EVEN_N: tl.constexpr,
    RANKED: tl.constexpr,
    NARROW: tl.constexpr,
    WIDE2: tl.constexpr,
    WIDE4: tl.constexpr,
    ONE_TILE: tl.constexpr,
    PDL: tl.constexpr,
    PACKED: tl.constexpr,
    SCALED: tl.constexpr,
):
    """y[t, n] += sum_r buf[s(n), t, r] * b[slot(t), n, r] for the columns n of slice s(n).

    Persistent like _shrink_kernel, over the blocks of real slots only (num_blocks[0]):
    no-adapter tokens are never touched.

    PDL (ONE_TILE only; launched with launch_pdl): a programmatic dependent of the shrink before
    it. Each program reads its block list entry and its first B columns while the shrink runs,
    then waits for the shrink's grid before it reads buf and y.

    SCALED: b holds float8_e4m3fn and scale_ptr [max_loras, N] float32 (slot stride stride_sl) one
    scale per output column: each column's sum is multiplied by scale[slot(t), n] before it is added.
    Off, scale_ptr is None and the kernel is the bf16 / fp16 one.
    """
    pid = tl.program_id(0)
    if ONE_TILE:
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        _expand_tile(
            pid,
            y_ptr,
            buf_ptr,
            b_ptr,
            block_slots_ptr,
            block_ranks_ptr,
            block_tokens_ptr,
            num_tokens,
            num_slots,
            chunks,
            stride_yt,
            stride_bl,
            stride_bn,
            off0,
            off1,
            off2,
            off3,
            off4,
            scale_ptr,
            stride_sl,
            NUM_SLICES,
            RANK,
            BLOCK_R,
            BLOCK_M,
            BLOCK_N,
            N_ITERS,
            EVEN_N,
            RANKED,
            NARROW,
            WIDE2,
            WIDE4,
            PDL,
            PACKED,
            SCALED,
        )
    else:
        num_programs = tl.num_programs(0)
        num_tiles = tl.load(num_blocks_ptr) * chunks
        for tile in range(pid, num_tiles, num_programs):
            _expand_tile(
                tile,
                y_ptr,
                buf_ptr,
                b_ptr,
                block_slots_ptr,
                block_ranks_ptr,
                block_tokens_ptr,
                num_tokens,
                num_slots,
                chunks,
                stride_yt,
                stride_bl,
                stride_bn,
                off0,
                off1,
                off2,
                off3,
                off4,
                scale_ptr,
                stride_sl,
                NUM_SLICES,
                RANK,
                BLOCK_R,
                BLOCK_M,
                BLOCK_N,
                N_ITERS,
                EVEN_N,
                RANKED,
                NARROW,
                WIDE2,
                WIDE4,
                False,
                PACKED,
                SCALED,
            )


@triton.jit(do_not_specialize=["num_tokens"])
def _embedding_shrink_kernel(
    ids_ptr,
    slots_ptr,
    a_ptr,
    out_ptr,
    num_tokens,
    stride_al,
    stride_av,
    RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """out[0, t, :] = a[slot(t), ids[t], :] (zeros for no-adapter tokens): a per-token gather."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < num_tokens
    slot = tl.load(slots_ptr + offs_t, mask=t_mask, other=-1)
    has = slot >= 0
    ids = tl.load(ids_ptr + offs_t, mask=t_mask & has, other=0)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < RANK
    rows = a_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_al + ids.to(tl.int64) * stride_av
    vals = tl.load(rows[:, None] + offs_r[None, :], mask=has[:, None] & r_mask[None, :], other=0.0)
    tl.store(out_ptr + offs_t[:, None] * RANK + offs_r[None, :], vals.to(tl.float32), mask=t_mask[:, None] & r_mask[None, :])


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _narrow_shrink(cfg, rank: int) -> bool:
    """Narrow tiles for low-rank blocks (_shrink_tile): with the K split (buf zeroed first),
    column blocks inside one slice, at least 32 of them, and decode tiles (16 token rows: a
    prefill tile's 4x longer x rows would cost shared memory; prefill is not tuned for them)."""
    return cfg.split_k > 1 and cfg.block_n >= 32 and rank % cfg.block_n == 0 and cfg.block_m <= 16


def _narrow_expand(cfg, rank: int) -> bool:
    """Narrow tiles for low-rank blocks (_expand_tile): a slot rank of 32 or more, decode tiles
    (16 token rows: a prefill tile's widened steps would hold 4x the accumulator), and at most
    1,024 threads per SM asked for. The narrow variants' code raises the kernel's registers per
    thread; a config that packs 16 CTAs of 4 warps per SM (32 registers each at most) would then
    hold fewer CTAs resident, which costs more than the narrow tiles save (o and down projections
    on an H100)."""
    return _block_r(rank) >= 32 and cfg.ctas_per_sm * cfg.num_warps <= 32 and cfg.block_m <= 16


def _regs(cfg) -> dict:
    """The launch's register cap (Triton's maxnreg), where the table sets one."""
    return {"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}


def _block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


@lru_cache(maxsize=16)
def _pdl_capable(device: torch.device) -> bool:
    """Programmatic dependent launch: a CUDA device of compute capability 9.0 and newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _pdl(pdl: bool, device: torch.device, one_tile: bool, num_tokens: int) -> bool:
    """Launch as a programmatic dependent: asked for, at decode token counts (what it is tuned
    for), one tile per program (no loop over the list: a grid that leaves room on the SMs for the
    next kernel's programs), and a GPU that has it."""
    return pdl and one_tile and num_tokens <= DECODE_MAX_TOKENS and _pdl_capable(device)


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    meta: LoraMeta,
    out: torch.Tensor | None = None,
    ranked: bool = True,
    pdl: bool = False,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """buf[s, t, :] = x[t] @ lora_a[slot(t), s].T for every slice s; rows of no-adapter tokens are 0.

    x:      [T, in] fp16 / bf16
    lora_a: [max_loras, S, R, in], same dtype (float8_e4m3fn where `scale` is given)
    out:    [S, T, R] float32 (allocated if None)
    ranked: read each slot only up to its adapter's rank (meta.slot_ranks; rank positions past it
            come out 0); False where the rank dim holds several parts (fully sharded TP layers)
    pdl:    at decode, launch as a programmatic dependent of the stream's last kernel (its block
            list read before x is ready). The caller's promise: the block list, lora_a and, when the
            K split adds into it, a zeroed out were written before the stream's last kernel launched
            without PDL; an expand launched with pdl=True after it then starts during this shrink
    scale:  FP8 slots: [max_loras, S, R] float32, one per rank row of each slice (reference.py)
    """
    num_tokens, in_features = x.shape
    num_slots, num_slices, rank, _ = lora_a.shape
    out, zeroed = shrink_output(meta, out, num_slices, num_tokens, rank, x.device)  # zeroed: the step's workspace
    if not _shrink_supported(x, lora_a, out, scale):
        if scale is not None:  # the reference's host reads and float8 gathers are no CUDA path
            raise ValueError(_scaled_error(x, lora_a, scale, "lora_a"))
        return reference.lora_shrink(x, lora_a, meta, out, scale=scale)
    if num_tokens == 0:
        return out
    sr = num_slices * rank
    cfg = shrink_config(x.device, num_tokens, in_features, num_slices, rank)
    blocks = meta.block_list(cfg.block_m)
    col_blocks = _cdiv(sr, cfg.block_n)
    k_per_split = _cdiv(_cdiv(in_features, cfg.block_k), cfg.split_k) * cfg.block_k
    if cfg.split_k > 1 and not zeroed:
        out.zero_()  # the K splits add into it
    tiles = blocks.max_blocks * col_blocks * cfg.split_k  # upper bound: the list's length
    programs = num_sms(x.device.index) * cfg.ctas_per_sm
    follow = _pdl(pdl, x.device, tiles <= programs, num_tokens)
    _shrink_kernel[(min(tiles, programs),)](
        x,
        lora_a,
        out,
        blocks.blocks,
        blocks.blocks[3],
        blocks.tokens,
        blocks.num_blocks,
        num_tokens,
        num_slots,
        in_features,
        k_per_split,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(2),
        scale,
        0 if scale is None else scale.stride(0),
        RANK=rank,
        SR=sr,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        N_BLOCKS=col_blocks,
        SPLIT_K=cfg.split_k,
        EVEN_K=in_features % cfg.block_k == 0,
        RANKED=ranked,
        NARROW=ranked and _narrow_shrink(cfg, rank),
        ONE_TILE=tiles <= programs,
        PDL=follow,
        SCALED=scale is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **_regs(cfg),
        **({"launch_pdl": True} if follow else {}),
    )
    return out


def lora_expand(
    y: torch.Tensor,
    buf: torch.Tensor,
    lora_b: torch.Tensor,
    slice_offsets: tuple[int, ...],
    meta: LoraMeta,
    ranked: bool = True,
    pdl: bool = False,
    packed: bool = False,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[t, off_s:off_s+n_s] += buf[s, t] @ lora_b[slot(t), off_s:off_s+n_s].T, in place.

    y:             [T, N] fp16 / bf16, N = slice_offsets[-1]
    buf:           [S, T, R] float32
    lora_b:        [max_loras, N, R], dtype of y (float8_e4m3fn where `scale` is given)
    slice_offsets: S + 1 output offsets, e.g. (0, q, q + k, q + k + v)
    ranked:        as in lora_shrink
    pdl:           at decode, launch as a programmatic dependent of the stream's last kernel (the
                   shrink that wrote buf): its block list and first B columns are read before buf
                   and y are ready, on the promise of lora_shrink's pdl; a slice group's second
                   launch follows the first the same way
    packed:        (ranked) each slot holds its B packed at its own rank: the slot's
                   first N * r8 elements are B [N, r8], r8 = meta.slot_ranks[slot] rounded up to 8,
                   rows contiguous (a low-rank adapter's rows are then not short pieces of the
                   slot's R-wide rows): the dense layers' slots of a CUDA executor
                   (executor/slot_layout.py's layout).
    scale:         FP8 slots: [max_loras, N] float32, one per output channel (reference.py)
    """
    if packed and (not ranked or meta.slot_ranks is None):
        raise ValueError("a packed B is read at each slot's rank: ranked, with LoraMeta.slot_ranks")
    if not _expand_supported(y, buf, lora_b, scale):
        if scale is not None:  # the reference's host reads and float8 gathers are no CUDA path
            raise ValueError(_scaled_error(y, lora_b, scale, "lora_b"))
        return reference.lora_expand(y, buf, lora_b, slice_offsets, meta, packed=packed, scale=scale)
    num_tokens = y.shape[0]
    rank = buf.shape[2]
    if num_tokens == 0:
        return y
    cfg = expand_config(y.device, num_tokens, _widths(tuple(slice_offsets)), rank)
    blocks = meta.block_list(cfg.block_m)
    programs = num_sms(y.device.index) * cfg.ctas_per_sm
    for first_slice, num_slices, offsets, chunks, even_n in _expand_launches(tuple(slice_offsets), cfg.block_n * cfg.n_iters):
        tiles = blocks.max_blocks * chunks
        follow = _pdl(pdl, y.device, tiles <= programs, num_tokens)
        _expand_kernel[(min(tiles, programs),)](
            y,
            buf[first_slice:],
            lora_b,
            blocks.blocks,
            blocks.blocks[3],
            blocks.tokens,
            blocks.num_blocks,
            num_tokens,
            lora_b.shape[0],
            chunks,
            y.stride(0),
            lora_b.stride(0),
            lora_b.stride(1),
            *offsets,
            scale,
            0 if scale is None else scale.stride(0),
            NUM_SLICES=num_slices,
            RANK=rank,
            BLOCK_R=_block_r(rank),
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            N_ITERS=cfg.n_iters,
            EVEN_N=even_n,
            RANKED=ranked,
            NARROW=ranked and _narrow_expand(cfg, rank),
            WIDE2=math.gcd(2, cfg.n_iters),
            WIDE4=math.gcd(4, cfg.n_iters),
            ONE_TILE=tiles <= programs,
            PDL=follow,
            PACKED=packed,
            SCALED=scale is not None,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **_regs(cfg),
            **({"launch_pdl": True} if follow else {}),
        )
    return y


@lru_cache(maxsize=1024)
def _widths(slice_offsets: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(b - a for a, b in zip(slice_offsets, slice_offsets[1:]))


@lru_cache(maxsize=1024)
def _expand_launches(slice_offsets: tuple[int, ...], chunk: int):
    """One launch per group of up to 4 slices.

    Each: (first slice, slices in it, 5 column offsets, column chunks, every width divides chunk).
    """
    launches = []
    num_slices = len(slice_offsets) - 1
    for first in range(0, num_slices, _MAX_SLICES_PER_LAUNCH):
        offs = slice_offsets[first : first + _MAX_SLICES_PER_LAUNCH + 1]
        widths = [b - a for a, b in zip(offs, offs[1:])]
        padded = tuple(offs) + (offs[-1],) * (_MAX_SLICES_PER_LAUNCH + 1 - len(offs))
        chunks = sum(_cdiv(w, chunk) for w in widths)
        launches.append((first, len(widths), padded, chunks, all(w % chunk == 0 for w in widths)))
    return tuple(launches)


def lora_embedding_shrink(
    token_ids: torch.Tensor, lora_a: torch.Tensor, meta: LoraMeta, out: torch.Tensor | None = None
) -> torch.Tensor:
    """buf[0, t, :] = lora_a[slot(t), token_ids[t], :]; embedding LoRA needs only expand's matmul.

    token_ids: [T]
    lora_a:    [max_loras, vocab, R]
    out:       [1, T, R] float32
    """
    num_tokens = token_ids.shape[0]
    rank = lora_a.shape[2]
    if out is None:
        out = torch.empty(1, num_tokens, rank, dtype=torch.float32, device=lora_a.device)
    if lora_a.stride(2) != 1 or not out.is_contiguous() or out.dtype != torch.float32:
        return reference.lora_embedding_shrink(token_ids, lora_a, meta, out)
    if num_tokens == 0:
        return out
    block_t = 16
    _embedding_shrink_kernel[(_cdiv(num_tokens, block_t),)](
        token_ids,
        meta.token_slots,
        lora_a,
        out,
        num_tokens,
        lora_a.stride(0),
        lora_a.stride(1),
        RANK=rank,
        BLOCK_R=triton.next_power_of_2(rank),
        BLOCK_T=block_t,
    )
    return out


def _scales_fit(w: torch.Tensor, scale: torch.Tensor) -> bool:
    """w holds FP8 and `scale` float32 one per row of w (w's shape less its last dim), each slot's
    rows contiguous (the kernels index a slot's scales as one flat row)."""
    return w.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == w.shape[:-1] and scale[0].is_contiguous()


def _scaled_error(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, name: str) -> str:
    """Why FP8 slots `w` (`name`) with `scale` are not read by the kernel beside x: FP8 slots have no
    fallback (the reference reads the host and gathers float8, neither graph-safe on CUDA)."""
    want = f"float32 {list(w.shape[:-1])}, each slot's contiguous"
    if w.dtype != FP8:
        return f"{name} is {w.dtype} but a scale was given: scaled slots hold float8_e4m3fn"
    if not _scales_fit(w, scale):
        return f"{name}'s scale is {scale.dtype} {list(scale.shape)} (stride {scale.stride()}); FP8 slots' scales are {want}"
    if x.dtype not in _DTYPES:
        return f"FP8 LoRA slots take float16 / bfloat16 activations, got {x.dtype}"
    return (
        f"FP8 LoRA slots: {name} {list(w.shape)} stride {w.stride()}, the activations or the float32 buffer "
        "laid out as the kernel does not take"
    )


def _shrink_supported(x, lora_a, out, scale=None) -> bool:
    rank = lora_a.shape[2]
    return (
        x.dtype in _DTYPES
        and (lora_a.dtype == x.dtype if scale is None else _scales_fit(lora_a, scale))
        and x.stride(1) == 1
        and lora_a.stride(3) == 1
        and lora_a.stride(1) == rank * lora_a.stride(2)
        and out.dtype == torch.float32
        and out.is_contiguous()
    )


def _expand_supported(y, buf, lora_b, scale=None) -> bool:
    return (
        y.dtype in _DTYPES
        and (lora_b.dtype == y.dtype if scale is None else _scales_fit(lora_b, scale))
        and y.stride(1) == 1
        and lora_b.stride(2) == 1
        and buf.dtype == torch.float32
        and buf.is_contiguous()
    )
