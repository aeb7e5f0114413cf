"""Paged attention in Triton: the CUDA path, same signatures and math as kernels/attention_reference.py.

Decode (one query per sequence) is memory bound: a program owns one (sequence, kv head, KV
split) and serves all H / KVH query heads of that kv head from each K/V tile it loads (the
group padded to 16 rows for tl.dot), walking the sequence's keys in tiles of BLOCK_N tokens
gathered through the block table (a tile spans several cache blocks when block_size < BLOCK_N).
When B * KVH programs cannot fill the GPU, the keys are split over programs (flash-decoding)
and a second kernel merges the splits' partial (max, sum, unnormalised output).

Prefill (variable-length chunks, decode tokens mixed in) is flash attention over the paged
keys: a program owns BLOCK_M rows of (query, head of the group) pairs of one sequence and kv
head, so each K/V tile serves the whole group, as in decode (a chunk of one token still
fills G rows, not 1), and tiles that no row needs masked skip the mask.

Launch grids and scratch depend only on shapes, max_query_len and the SM count: no host
synchronisation, so both capture in a CUDA graph. Softmax runs in base 2 with the scale
folded in; accumulation is fp32, output in q's dtype. A layer's sliding window and score
soft-cap (Gemma 2) are host constants: each (window or not, soft-cap or not) is a variant of
the kernel, the values are scalar arguments.

An FP8 cache (float8_e4m3fn, KV_FP8: a variant of each kernel, so the other dtypes compile as
without it) holds k / k_scale and v / v_scale with one float32 scale per kv head, read from device
memory (graph-safe). A program serves one kv head, so its K scale folds into the score scale and its V
scale into the output; the FP8 values convert exactly to q's dtype for tl.dot. That is
q.(fp8 * k_scale) and p.(fp8 * v_scale) computed in float32, the reference's dequantized cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import attention_reference as reference
from .attention_plan import d_pad as _d_pad
from .attention_plan import prefill_config
from .ops_reference import kv_scale_error
from .tuning import num_sms

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FP8 = torch.float8_e4m3fn  # the cache's, with per-kv-head scales
_LOG2E = 1.4426950408889634
_MIN_PARTITION = 64  # tokens per split at least (one BLOCK_N tile at D 128; H100 sweep, B 1 x ctx 1024: 11.3 us vs 13.5 at 128)
_MAX_SPLITS = 64
_PROGRAMS_PER_SM = 2  # decode splits until B * KVH * splits reaches this many programs per SM


@triton.jit
def _soft_cap(s, cap):
    """cap * tanh(s / cap): scores in base 2 with the cap in base 2 too (cap * log2 e), which is
    the natural-base soft-cap scaled by log2 e. tanh as 1 - 2 / (e^2x + 1): exact at both ends."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * s / cap) + 1.0))


@triton.jit(do_not_specialize=["stride_tb"])  # eager decode steps' table widths vary (see _prefill_kernel)
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale_log2,
    window,
    softcap_log2,
    partition,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_tb,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Program (b, kv head, split): the GROUP query heads of one kv head over keys of one partition.

    Not SPLIT (one partition): writes out[b, heads] normalised. Otherwise writes the unnormalised fp32
    accumulator and (m, l) of the partition to the scratch; a partition with no visible key
    (past seq_len, or before the window) runs no tile and so writes the neutral (-inf, 0, 0).
    """
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    # The splits share this sequence's own keys: the grid is fixed by the shapes (a CUDA graph
    # serves every context length), so the partition is cut here, from seq_len, never shorter
    # than `partition` (the minimum, a multiple of BLOCK_N); splits past the end stay empty.
    part = tl.maximum(tl.cdiv(tl.cdiv(seq_len, tl.num_programs(2)), BLOCK_N) * BLOCK_N, partition)
    lo = split * part
    hi = tl.minimum(lo + part, seq_len)
    if HAS_WINDOW:
        lo = tl.maximum(lo, seq_len - window)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    table = tables_ptr + b.to(tl.int64) * stride_tb
    k_head = k_ptr + kvh * stride_kh
    v_head = v_ptr + kvh * stride_kh
    if KV_FP8:
        scale_log2 = scale_log2 * tl.load(k_scale_ptr + kvh)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    # Tiles start on BLOCK_N boundaries (partitions are multiples of it), so a tile covers whole
    # cache blocks; every tile holds at least one visible key, so m_i is finite after the first.
    for start in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = (pos >= lo) & (pos < hi)  # masked loads: rows past seq_len may hold anything
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0)
        rows = block.to(tl.int64) * stride_kb + (pos % BLOCK_SIZE) * stride_ks
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_head + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [GROUP_PAD, BLOCK_N]
        if SOFTCAP:
            s = _soft_cap(s, softcap_log2)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr + kvh)

    if not SPLIT:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # seq_len 0 (a batch's padding row): zeros
        tl.store(
            out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )
    else:
        # scratch [B, H, splits] (m, l) and [B, H, splits, HEAD_DIM] (acc)
        num_heads = tl.num_programs(1) * GROUP
        part = (b.to(tl.int64) * num_heads + heads) * tl.num_programs(2) + split  # [GROUP_PAD]
        tl.store(part_m_ptr + part, m_i, mask=g_mask)
        tl.store(part_l_ptr + part, l_i, mask=g_mask)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    out_ptr,
    num_splits,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """Program (b, h): out[b, h] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, M = max_s m_s."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    part = (b.to(tl.int64) * tl.num_programs(1) + h) * num_splits + offs_s
    m = tl.load(part_m_ptr + part, mask=s_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + part, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # 0 for neutral partitions
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    l_sum = tl.sum(w * l, 0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(l_sum > 0, l_sum, 1.0)  # all neutral (seq_len 0): zeros
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _prefill_tiles(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    k_head,
    v_head,
    table,
    start_lo,
    start_hi,
    lo,
    hi,
    scale_log2,
    window,
    softcap_log2,
    stride_kb,
    stride_ks,
    offs_d,
    d_mask,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Online softmax over key tiles starting in [start_lo, start_hi). MASKED: apply causal / window /
    [lo, hi) masks; otherwise every row sees every key of these tiles (the caller chose them so)."""
    for start in range(start_lo, start_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        if MASKED:
            valid = (pos >= lo) & (pos < hi)
            block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0)
            kv_mask = valid[:, None] & d_mask[None, :]
        else:
            block = tl.load(table + pos // BLOCK_SIZE)
            kv_mask = d_mask[None, :]
        rows = block.to(tl.int64) * stride_kb + (pos % BLOCK_SIZE) * stride_ks
        k = tl.load(k_head + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        if SOFTCAP:
            s = _soft_cap(s, softcap_log2)
        if MASKED:
            visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                visible = visible & (pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


# A step's block table width and sequence count vary: specialised on them (a width a multiple of 16,
# cu_query_lens 16-byte aligned when the count is a multiple of 4: kv_cache.AttentionMetadata packs
# it after seq_lens), each new combination would be a build while serving; the warm-up's steps meet
# only some. They cost nothing measurable unspecialised: a program reads a few scalars of each.
@triton.jit(do_not_specialize=["stride_tb"], do_not_specialize_on_alignment=["cu_ptr", "tables_ptr", "seq_lens_ptr", "work_ptr"])
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    seq_lens_ptr,
    cu_ptr,
    out_ptr,
    work_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale_log2,
    window,
    softcap_log2,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_tb,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QUERIES: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    WORK: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Program (query block, kv head, b): rows r = (query j0 + r // GROUP, head kvh * GROUP + r % GROUP).

    Query blocks run last-first: they see the most keys, so the long programs start early.
    WORK: program (p, kv head) takes (b, query block) from entry p of a work list (prefill_work_list;
    b < 0: nothing), so a captured grid sized for a bucket's tokens launches no program per
    (sequence, query block) pair that has no queries.
    """
    kvh = tl.program_id(1)
    if WORK:
        b = tl.load(work_ptr + 2 * tl.program_id(0))
        q_block = tl.load(work_ptr + 2 * tl.program_id(0) + 1)
    else:
        q_block = tl.num_programs(0) - 1 - tl.program_id(0)
        b = tl.program_id(2)
    q_start = tl.load(cu_ptr + tl.maximum(b, 0))
    q_len = tl.load(cu_ptr + tl.maximum(b, 0) + 1) - q_start
    j0 = q_block * QUERIES
    if (b >= 0) & (j0 < q_len):
        seq_len = tl.load(seq_lens_ptr + b)
        ctx = seq_len - q_len
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        d_mask = offs_d < HEAD_DIM
        j = j0 + offs_m // GROUP
        row_mask = (offs_m < QUERIES * GROUP) & (j < q_len)
        q_pos = ctx + j
        q_rows = (q_start + j).to(tl.int64) * stride_qt + (kvh * GROUP + offs_m % GROUP) * stride_qh
        q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)

        j_last = tl.minimum(j0 + QUERIES, q_len) - 1
        hi = ctx + j_last + 1  # causal limit of the last row
        lo = 0
        full_lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(ctx + j0 - window + 1, 0)  # the first row's window
            full_lo = tl.cdiv(tl.maximum(ctx + j_last - window + 1, 0), BLOCK_N) * BLOCK_N  # every row's
        full_hi = (ctx + j0 + 1) // BLOCK_N * BLOCK_N  # keys every row sees causally
        # Tiles [first, mid_lo) and [mid_hi, hi) are masked, [mid_lo, mid_hi) are not.
        first = lo // BLOCK_N * BLOCK_N
        mid_lo = tl.minimum(tl.maximum(full_lo, first), hi)
        mid_hi = tl.maximum(full_hi, mid_lo)

        table = tables_ptr + b.to(tl.int64) * stride_tb
        k_head = k_ptr + kvh * stride_kh
        v_head = v_ptr + kvh * stride_kh
        if KV_FP8:
            scale_log2 = scale_log2 * tl.load(k_scale_ptr + kvh)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        acc, m_i, l_i = _prefill_tiles(
            acc,
            m_i,
            l_i,
            q,
            q_pos,
            k_head,
            v_head,
            table,
            first,
            mid_lo,
            lo,
            hi,
            scale_log2,
            window,
            softcap_log2,
            stride_kb,
            stride_ks,
            offs_d,
            d_mask,
            BLOCK_SIZE,
            BLOCK_N,
            True,
            HAS_WINDOW,
            SOFTCAP,
            PRECISION,
            KV_FP8,
        )
        acc, m_i, l_i = _prefill_tiles(
            acc,
            m_i,
            l_i,
            q,
            q_pos,
            k_head,
            v_head,
            table,
            mid_lo,
            mid_hi,
            lo,
            hi,
            scale_log2,
            window,
            softcap_log2,
            stride_kb,
            stride_ks,
            offs_d,
            d_mask,
            BLOCK_SIZE,
            BLOCK_N,
            False,
            HAS_WINDOW,
            SOFTCAP,
            PRECISION,
            KV_FP8,
        )
        acc, m_i, l_i = _prefill_tiles(
            acc,
            m_i,
            l_i,
            q,
            q_pos,
            k_head,
            v_head,
            table,
            mid_hi,
            hi,
            lo,
            hi,
            scale_log2,
            window,
            softcap_log2,
            stride_kb,
            stride_ks,
            offs_d,
            d_mask,
            BLOCK_SIZE,
            BLOCK_N,
            True,
            HAS_WINDOW,
            SOFTCAP,
            PRECISION,
            KV_FP8,
        )
        if KV_FP8:
            acc = acc * tl.load(v_scale_ptr + kvh)
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out_rows = (q_start + j).to(tl.int64) * stride_ot + (kvh * GROUP + offs_m % GROUP) * stride_oh
        tl.store(
            out_ptr + out_rows[:, None] + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & d_mask[None, :],
        )


def paged_decode_attention(
    q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window=None, out=None, softcap=None, k_scale=None, v_scale=None
) -> torch.Tensor:
    """One query token per sequence over its paged keys/values (see attention_reference for the math).

    q:               [B, H, D] fp16 / bf16 / fp32, D contiguous
    k_cache/v_cache: [num_blocks, block_size, KVH, D], same dtype and strides, D contiguous: q's dtype,
                     or float8_e4m3fn with k_scale/v_scale [KVH] float32 (dequantized as read)
    block_tables:    [B, max_blocks] int32
    seq_lens:        [B] int32, the current token's k/v already cached (0: a padding row, gets zeros)
    out:             optional [B, H, D], dtype of q
    sliding_window, softcap: host constants of the layer (None: off), compiled into the kernel's variant
    """
    if out is None:
        out = torch.empty_like(q)
    if not _supported(q, k_cache, v_cache, out, k_scale, v_scale):
        return reference.paged_decode_attention(
            q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, out, softcap=softcap,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    fp8 = k_cache.dtype == _FP8
    d_pad = _d_pad(head_dim)
    block_n, num_warps, num_stages = decode_config(d_pad)
    splits, partition = decode_splits(
        num_seqs, num_kv_heads, block_tables.shape[1] * block_size, num_sms(q.device.index), block_n
    )
    part_acc = part_m = part_l = out  # unused by the kernel when there is one split
    if splits > 1:
        part_acc = torch.empty(num_seqs, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(2, num_seqs, num_heads, splits, dtype=torch.float32, device=q.device)
        part_m, part_l = part_ml[0], part_ml[1]
    _decode_kernel[(num_seqs, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens.contiguous(),
        out,
        part_acc,
        part_m,
        part_l,
        k_scale if fp8 else out,  # unread without FP8
        v_scale if fp8 else out,
        scale * _LOG2E,
        sliding_window or 0,
        (softcap or 0.0) * _LOG2E,
        partition,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        SPLIT=splits > 1,
        HAS_WINDOW=sliding_window is not None,
        SOFTCAP=softcap is not None,
        PRECISION=_precision(q),
        KV_FP8=fp8,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            part_acc,
            part_m,
            part_l,
            out,
            splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            SPLITS_PAD=triton.next_power_of_2(splits),
            num_warps=4 if d_pad * splits >= 4096 else 2,
        )
    return out


def decode_splits(num_seqs: int, num_kv_heads: int, max_len: int, sms: int, block_n: int) -> tuple[int, int]:
    """(splits, minimum partition tokens) from shapes only: split the keys until B * KVH * splits
    reaches _PROGRAMS_PER_SM programs per SM (two waves), at most _MAX_SPLITS and no more than
    max_len holds partitions of _MIN_PARTITION tokens. The kernel cuts each sequence's own keys
    into the splits (at least the minimum partition each), so a graph captured for max_len still
    spreads a short context over programs."""
    max_len = max(max_len, 1)
    splits = min(_cdiv(_PROGRAMS_PER_SM * sms, num_seqs * num_kv_heads), _cdiv(max_len, _MIN_PARTITION), _MAX_SPLITS)
    return max(splits, 1), _cdiv(_MIN_PARTITION, block_n) * block_n


def decode_config(d_pad: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the decode kernel (H100 sweep at D 128: BLOCK_N 64, 3 stages)."""
    return (64, 4, 3) if d_pad <= 128 else (32, 4, 2)


def paged_prefill_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    cu_query_lens,
    max_query_len,
    scale,
    sliding_window=None,
    out=None,
    work=None,
    softcap=None,
    k_scale=None,
    v_scale=None,
) -> torch.Tensor:
    """Variable-length causal queries over cached + new keys (see attention_reference for the math).

    q:             [T, H, D] fp16 / bf16 / fp32, D contiguous
    k_cache/v_cache, block_tables, seq_lens: as in paged_decode_attention
    cu_query_lens: [B + 1] int32, sequence b owns q rows [cu[b], cu[b + 1])
    max_query_len: host int >= every q_len (sizes the grid)
    work:          optional [N, 2] int32 work list (prefill_work_list, with prefill_queries of this
                   launch): N programs per kv head instead of one per (query block, sequence)
    softcap, k_scale, v_scale: as in paged_decode_attention
    """
    if out is None:
        out = torch.empty_like(q)
    if not _supported(q, k_cache, v_cache, out, k_scale, v_scale):
        return reference.paged_prefill_attention(
            q, k_cache, v_cache, block_tables, seq_lens, cu_query_lens, max_query_len, scale, sliding_window, out,
            softcap=softcap, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or max_query_len == 0 or q.shape[0] == 0:
        return out
    group = num_heads // num_kv_heads
    d_pad = _d_pad(head_dim)
    block_m, block_n, num_warps, num_stages = prefill_config(max_query_len * group, group, d_pad, q.dtype == torch.float32)
    queries = block_m // group  # rows are (query, head of the group) pairs
    grid = (_cdiv(max_query_len, queries), num_kv_heads, num_seqs)
    fp8 = k_cache.dtype == _FP8
    if work is not None:
        grid = (work.shape[0], num_kv_heads, 1)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens.contiguous(),
        cu_query_lens.contiguous(),
        out,
        work if work is not None else cu_query_lens,
        k_scale if fp8 else out,  # unread without FP8
        v_scale if fp8 else out,
        scale * _LOG2E,
        sliding_window or 0,
        (softcap or 0.0) * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        QUERIES=queries,
        HAS_WINDOW=sliding_window is not None,
        SOFTCAP=softcap is not None,
        PRECISION=_precision(q),
        WORK=work is not None,
        KV_FP8=fp8,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _precision(q) -> str:
    return "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 stays exact; tf32 is unused for fp16/bf16


def _supported(q, k_cache, v_cache, out, k_scale=None, v_scale=None) -> bool:
    """Shapes and layouts the kernels take; anything else runs on the reference (correct, not graph-safe).
    ValueError for an FP8 cache's scales the kernels cannot read (ops_reference.kv_scale_error)."""
    if (error := kv_scale_error(k_cache, k_scale, v_scale)) is not None:
        raise ValueError(error)
    fp8 = k_cache.dtype == _FP8
    return (
        q.dtype in _DTYPES
        and (k_cache.dtype == q.dtype or fp8)
        and v_cache.dtype == k_cache.dtype
        and out.dtype == q.dtype
        and q.shape[-1] <= 256
        and q.shape[1] % k_cache.shape[2] == 0
        and q.stride(-1) == 1
        and out.stride(-1) == 1
        and k_cache.stride(-1) == 1
        and v_cache.stride() == k_cache.stride()
    )
