"""The decoder's small per-layer ops fused into one Triton kernel each: same signatures as
kernels/ops_reference.py.

Eagerly each of these is several launches of tiny kernels (RMSNorm alone: cast, square, mean,
rsqrt, two products, cast); inside a CUDA graph each launch still costs GPU time, and there are
a few of these per layer. One program per token row; intermediates stay
in registers in float32, results are rounded once to the activation dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import fp8_reference, ops_reference
from .fp8_reference import FP8, FP8_MAX, MIN_AMAX


@triton.jit
def _store_fp8_row(q_row, s_ptr, y, mask, MIN_AMAX: tl.constexpr, FP8_MAX: tl.constexpr):
    """One row's per-token FP8 quantization (fp8_reference.quantize_per_token) of y (its float32
    values, 0 where masked), whole in this program: scale = max(amax, MIN_AMAX) / 448 to s_ptr,
    y / scale rounded to nearest and clamped to +-448 to q_row."""
    scale = tl.maximum(tl.max(tl.abs(y), axis=0), MIN_AMAX) / FP8_MAX
    tl.store(s_ptr, scale)
    q = tl.clamp(tl.math.div_rn(y, scale), -FP8_MAX, FP8_MAX)
    tl.store(q_row, q.to(q_row.dtype.element_ty), mask=mask)


def _fp8_outputs(rows: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [rows, n] float8_e4m3fn, scale [rows, 1] float32) to be written: an FP8 layer's pre-quantized input."""
    return torch.empty((rows, n), dtype=FP8, device=device), torch.empty((rows, 1), dtype=torch.float32, device=device)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    h_ptr,
    q_ptr,
    s_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_h,
    stride_q,
    n,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    QUANT: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """QUANT: also the output's per-token FP8 quantization (q_ptr, s_ptr: _store_fp8_row); without it
    q_ptr, s_ptr and stride_q are None (not kernel arguments)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)  # h, rounded like `x + residual`
        tl.store(h_ptr + row * stride_h + offs, x, mask=mask)
    hf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / n + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:  # Gemma: norm * (1 + w) in float32, rounded once
        y = hf * rstd * (1.0 + w)
    else:
        y = w * (hf * rstd).to(x.dtype).to(tl.float32)  # cast back before the weight, as transformers does
    tl.store(out_ptr + row * stride_out + offs, y.to(x.dtype), mask=mask)
    if QUANT:  # of the output as stored (rounded to x's dtype), as quantize_per_token would read it
        _store_fp8_row(q_ptr + row * stride_q + offs, s_ptr + row, y.to(x.dtype).to(tl.float32), mask, MIN_AMAX, FP8_MAX)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    unit_offset: bool = False,
    quantize: bool = False,
):
    """(norm(h) * weight, h), h = x + residual: see ops_reference.rms_norm. quantize: also the
    output's per-token FP8 quantization (q, scale) (fp8_reference.quantize_per_token), written in the
    same pass and returned third."""
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1) or x.dim() != 2:
        out, h = ops_reference.rms_norm(x, weight, eps, residual, unit_offset)
        return (out, h, fp8_reference.quantize_per_token(out)) if quantize else (out, h)
    rows, n = x.shape
    out = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else x
    q, s = _fp8_outputs(rows, n, x.device) if quantize else (None, None)
    if rows:
        res = residual if residual is not None else x
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows,)](
            x, res, weight, out, h, q, s, x.stride(0), res.stride(0), out.stride(0), h.stride(0),
            q.stride(0) if quantize else None, n, eps, HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset,
            QUANT=quantize, MIN_AMAX=MIN_AMAX, FP8_MAX=FP8_MAX, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        )  # fmt: skip
    return (out, h, (q, s)) if quantize else (out, h)


@triton.jit
def _rotate_rows(
    src,
    dst,
    stride_src_h,
    stride_dst_h,
    cos1,
    sin1,
    cos2,
    sin2,
    heads,
    scale_ptr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    FP8_DST: tl.constexpr,
):
    """dst[h] = RoPE(src[h]) for the heads of one token: [heads, 2 * HALF] through two halves.
    FP8_DST: dst is an FP8 cache row, stored as RoPE(src[h]) / scale[h] (_quantize); else in src's dtype."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h < heads)[:, None] & (offs_d < HALF)[None, :]
    src_rows = src + offs_h[:, None] * stride_src_h + offs_d[None, :]
    x1 = tl.load(src_rows, mask=mask, other=0.0)
    x2 = tl.load(src_rows + HALF, mask=mask, other=0.0)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    dst_rows = dst + offs_h[:, None] * stride_dst_h + offs_d[None, :]
    if FP8_DST:
        scale = tl.load(scale_ptr + offs_h, mask=offs_h < heads, other=1.0)
        r1 = f1 * cos1[None, :] - f2 * sin1[None, :]
        r2 = f2 * cos2[None, :] + f1 * sin2[None, :]
        tl.store(dst_rows, _quantize(r1, scale, dst.dtype.element_ty), mask=mask)
        tl.store(dst_rows + HALF, _quantize(r2, scale, dst.dtype.element_ty), mask=mask)
    else:
        tl.store(dst_rows, (f1 * cos1[None, :] - f2 * sin1[None, :]).to(x1.dtype), mask=mask)
        tl.store(dst_rows + HALF, (f2 * cos2[None, :] + f1 * sin2[None, :]).to(x1.dtype), mask=mask)


@triton.jit
def _quantize(x, scale, dtype: tl.constexpr):
    """x [heads, n] float32 / scale [heads] -> FP8, clamped to ±448 and rounded to nearest (ops_reference.quantize_kv)."""
    return tl.clamp(x / scale[:, None], -448.0, 448.0).to(dtype)


@triton.jit
def _rope_cache_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    q_out_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_ct,
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KVH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """KV_FP8: the cache is float8_e4m3fn, k and v quantized with their [KVH] scales."""
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    cs = cos_ptr + t * stride_ct + offs_d
    sn = sin_ptr + t * stride_ct + offs_d
    cos1 = tl.load(cs, mask=d_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cs + HALF, mask=d_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sn, mask=d_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sn + HALF, mask=d_mask, other=0.0).to(tl.float32)
    _rotate_rows(
        q_ptr + t * stride_qt,
        q_out_ptr + t * stride_ot,
        stride_qh,
        stride_oh,
        cos1,
        sin1,
        cos2,
        sin2,
        num_heads,
        q_out_ptr,
        HALF,
        BLOCK_H,
        BLOCK_HALF,
        False,
    )
    # The cache row of this token: [KVH, D] contiguous at slot * KVH * D.
    slot = tl.load(slot_ptr + t).to(tl.int64)
    head_dim = 2 * HALF
    row = slot * num_kv_heads * head_dim
    _rotate_rows(
        k_ptr + t * stride_kt,
        kc_ptr + row,
        stride_kh,
        head_dim,
        cos1,
        sin1,
        cos2,
        sin2,
        num_kv_heads,
        k_scale_ptr,
        HALF,
        BLOCK_KVH,
        BLOCK_HALF,
        KV_FP8,
    )
    offs_h = tl.arange(0, BLOCK_KVH)
    offs_full = tl.arange(0, 2 * BLOCK_HALF)
    v_mask = (offs_h < num_kv_heads)[:, None] & (offs_full < head_dim)[None, :]
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_full[None, :], mask=v_mask, other=0.0)
    if KV_FP8:
        v_scale = tl.load(v_scale_ptr + offs_h, mask=offs_h < num_kv_heads, other=1.0)
        v = _quantize(v.to(tl.float32), v_scale, vc_ptr.dtype.element_ty)
    tl.store(vc_ptr + row + offs_h[:, None] * head_dim + offs_full[None, :], v, mask=v_mask)


def rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> torch.Tensor:
    """RoPE on q and k, k and v into the paged cache: see ops_reference.rope_and_cache (an FP8 cache's
    keys are quantized from the rotated float32 values, before any rounding to k's dtype). ValueError
    for an FP8 cache's scales the kernel cannot read (ops_reference.kv_scale_error)."""
    if (error := ops_reference.kv_scale_error(k_cache, k_scale, v_scale)) is not None:
        raise ValueError(error)
    num_tokens, num_heads, head_dim = q.shape
    fp8 = k_cache.dtype == ops_reference.FP8
    if (
        head_dim % 2
        or q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1
        or not (k_cache.is_contiguous() and v_cache.is_contiguous() and cos.is_contiguous() and sin.is_contiguous())
        or (k_cache.dtype != k.dtype and not fp8)
    ):  # fmt: skip
        return ops_reference.rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens:
        num_kv_heads = k.shape[1]
        half = head_dim // 2
        _rope_cache_kernel[(num_tokens,)](
            q, k, v, cos, sin, k_cache, v_cache, slot_mapping, out,
            k_scale if fp8 else out, v_scale if fp8 else out,  # unread without FP8
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), cos.stride(0), num_heads, num_kv_heads,
            HALF=half, BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_KVH=triton.next_power_of_2(num_kv_heads),
            BLOCK_HALF=triton.next_power_of_2(half), KV_FP8=fp8, num_warps=4,
        )  # fmt: skip
    return out


@triton.jit
def _silu_mul(gate, up):
    """silu(gate) * up in float32."""
    g = gate.to(tl.float32)
    return g / (1.0 + tl.exp(-g)) * up.to(tl.float32)


@triton.jit
def _gelu_mul(gate, up):
    """gelu_tanh(gate) * up in float32."""
    g = gate.to(tl.float32)
    inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi) (g + 0.044715 g^3)
    tanh = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)  # saturates to +-1 (exp's inf / 0) without NaN
    return 0.5 * g * (1.0 + tanh) * up.to(tl.float32)


@triton.jit
def _act_mul_fp8_row(
    x_ptr, out_ptr, q_ptr, s_ptr, stride_x, stride_out, stride_q, n, GELU: tl.constexpr,
    MIN_AMAX: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The whole row of program (row,): out = act(gate) * up rounded to the input dtype, its maximum
    |value| kept on the way, then the row's per-token FP8 quantization (fp8_reference.quantize_per_token)
    from out as stored."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, n, BLOCK):
        mask = k0 + offs < n
        gate = tl.load(x_ptr + row * stride_x + k0 + offs, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * stride_x + n + k0 + offs, mask=mask, other=0.0)
        y = (_gelu_mul(gate, up) if GELU else _silu_mul(gate, up)).to(gate.dtype)
        tl.store(out_ptr + row * stride_out + k0 + offs, y, mask=mask)
        amax = tl.maximum(amax, tl.abs(y.to(tl.float32)))  # masked columns: act(0) * 0 = 0
    scale = tl.maximum(tl.max(amax, axis=0), MIN_AMAX) / FP8_MAX
    tl.store(s_ptr + row, scale)
    tl.debug_barrier()  # the row's out, written by every thread of the program, read back below
    for k0 in range(0, n, BLOCK):
        mask = k0 + offs < n
        y = tl.load(out_ptr + row * stride_out + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(y, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * stride_q + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _act_mul_kernel(
    x_ptr, out_ptr, q_ptr, s_ptr, stride_x, stride_out, stride_q, n, GELU: tl.constexpr,
    QUANT: tl.constexpr, MIN_AMAX: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """act(gate) * up, act gelu_tanh (GELU) or silu. QUANT: one program per row, the output's FP8
    quantization too (_act_mul_fp8_row); else a program per (row, column block), q_ptr, s_ptr and
    stride_q None (not kernel arguments)."""
    if QUANT:
        _act_mul_fp8_row(x_ptr, out_ptr, q_ptr, s_ptr, stride_x, stride_out, stride_q, n, GELU, MIN_AMAX, FP8_MAX, BLOCK)
    else:
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * stride_x + n + offs, mask=mask, other=0.0)
        y = _gelu_mul(gate, up) if GELU else _silu_mul(gate, up)
        tl.store(out_ptr + row * stride_out + offs, y.to(gate.dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, quantize: bool = False):
    """silu(gate) * up: see ops_reference.silu_and_mul. quantize: (out, its per-token FP8
    quantization (q, scale)) from the same kernel (fp8_reference.quantize_per_token)."""
    return _act_and_mul(False, ops_reference.silu_and_mul, gate_up, quantize)


def gelu_and_mul(gate_up: torch.Tensor, quantize: bool = False):
    """gelu_tanh(gate) * up: see ops_reference.gelu_and_mul; quantize as in silu_and_mul."""
    return _act_and_mul(True, ops_reference.gelu_and_mul, gate_up, quantize)


def _act_and_mul(gelu: bool, reference, gate_up: torch.Tensor, quantize: bool):
    """[rows, 2n] (gate | up) -> [rows, n] by _act_mul_kernel, one program per row and 1,024 columns (with
    quantize: per row, returning (out, (q, scale))); a tensor the kernel cannot take (not 2-D, or
    strided columns) goes to `reference`."""
    if gate_up.dim() != 2 or gate_up.stride(1) != 1:
        out = reference(gate_up)
        return (out, fp8_reference.quantize_per_token(out)) if quantize else out
    rows, n2 = gate_up.shape
    n = n2 // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    q, s = _fp8_outputs(rows, n, gate_up.device) if quantize else (None, None)
    if rows:
        block = 1024
        grid = (rows,) if quantize else (rows, triton.cdiv(n, block))
        _act_mul_kernel[grid](
            gate_up, out, q, s, gate_up.stride(0), out.stride(0), q.stride(0) if quantize else None, n,
            GELU=gelu, QUANT=quantize, MIN_AMAX=MIN_AMAX, FP8_MAX=FP8_MAX, BLOCK=block,
        )  # fmt: skip
    return (out, (q, s)) if quantize else out


@triton.jit
def _greedy_kernel(logits_ptr, ids_ptr, logprob_ptr, stride_row, vocab, BLOCK: tl.constexpr):
    """One row: its argmax (the first of equal maxima; a NaN counts as the largest, as in
    torch.argmax, and the logprob is then NaN) and max - logsumexp, in one pass over it.

    Each lane keeps a running max, the first column that reached it, and the sum of exp(x - max)
    of its columns; the lanes are merged at the end."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    run_max = tl.full([BLOCK], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK], tl.float32)
    run_idx = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("inf"), x)  # NaN ranks above everything, as in torch.argmax
        run_idx = tl.where(x > run_max, cols, run_idx)
        new_max = tl.maximum(run_max, x)
        scaled = run_sum * tl.exp(run_max - new_max) + tl.exp(x - new_max)
        run_sum = tl.where(new_max == float("-inf"), 0.0, scaled)  # an all -inf lane: nothing yet
        run_max = new_max
    row_max = tl.max(run_max, axis=0)
    total = tl.sum(tl.where(run_max == float("-inf"), 0.0, run_sum * tl.exp(run_max - row_max)), axis=0)
    token = tl.minimum(tl.min(tl.where(run_max == row_max, run_idx, vocab), axis=0), vocab - 1)
    tl.store(ids_ptr + row, token.to(tl.int64))
    tl.store(logprob_ptr + row, row_max - (row_max + tl.log(total)))  # as logits[argmax] - logsumexp


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax [B] int64, its logprob [B] float32) of logits [B, V]: see ops_reference.greedy.

    One program per row in one launch, where torch's argmax, gather and logsumexp are several."""
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.dtype != torch.float32 or logits.shape[1] == 0:
        return ops_reference.greedy(logits)
    rows, vocab = logits.shape
    token_ids = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _greedy_kernel[(rows,)](logits, token_ids, logprobs, logits.stride(0), vocab, BLOCK=2048, num_warps=8)
    return token_ids, logprobs
