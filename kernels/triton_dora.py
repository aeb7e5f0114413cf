"""DoRA's per-slot output scale on CUDA: kernels/dora_reference.py's contract, one launch per slice.

A slot load of a DoRA adapter needs, for every output row of every layer it targets, the norm of
W + B A over the input dim: one pass over the base weight. Each program takes BLOCK_N rows of one
slice, keeps their B rows in registers and walks K: it loads a [BLOCK_N, BLOCK_K] tile of W (FP8
tiles times their rows' scales), adds B A's tile (tl.dot, float32 accumulation), squares and sums
into the rows' float32 sums; then writes m / sqrt(sum) (1 where m is NaN) in the scale's dtype, or
the sums themselves (a row-parallel layer's partial sums). W's bytes are read once; A's rows are
re-read by every program from L2. The rank is padded to 16 (tl.dot's least), masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _dora_norm_kernel(
    w_ptr, ws_ptr, a_ptr, b_ptr, m_ptr, out_ptr, N, K, R, stride_w, stride_a, stride_b,
    HAS_SCALE: tl.constexpr, FINAL: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_in = rows < N
    rr = tl.arange(0, BLOCK_R)
    r_in = rr < R
    b = tl.load(b_ptr + rows[:, None].to(tl.int64) * stride_b + rr[None, :], mask=row_in[:, None] & r_in[None, :], other=0.0)
    if HAS_SCALE:
        ws = tl.load(ws_ptr + rows, mask=row_in, other=0.0)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_in = ks < K
        w_mask = row_in[:, None] & k_in[None, :]
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + ks[None, :], mask=w_mask, other=0.0).to(tl.float32)
        if HAS_SCALE:
            w = w * ws[:, None]
        a = tl.load(a_ptr + rr[:, None] * stride_a + ks[None, :], mask=r_in[:, None] & k_in[None, :], other=0.0)
        x = w + tl.dot(b, a, input_precision=PRECISION)
        acc += tl.sum(x * x, axis=1)
    if FINAL:
        m = tl.load(m_ptr + rows, mask=row_in, other=1.0)
        g = tl.where(m != m, 1.0, tl.div_rn(m, tl.sqrt_rn(tl.where(row_in, acc, 1.0))))
        tl.store(out_ptr + rows, g.to(out_ptr.dtype.element_ty), mask=row_in)
    else:
        tl.store(out_ptr + rows, acc, mask=row_in)


def dora_norm(weight, weight_scale, a, b, offsets, magnitude, scale_out=None, sq_out=None) -> None:
    """See kernels/dora_reference.py. a and b: the adapter's dtype (one for both); weight, a's and b's
    last dims contiguous."""
    if a.dtype != b.dtype:
        raise ValueError(f"A is {a.dtype}, B is {b.dtype}: one dtype for both")
    if weight.stride(1) != 1 or a.stride(2) != 1 or b.stride(1) != 1:
        raise ValueError("the weight's, A's and B's last dims must be contiguous")
    r, k = a.shape[1], weight.shape[1]
    block_r = max(16, triton.next_power_of_2(r))
    block_n = 32 if block_r <= 64 else 16
    block_k = 64 if a.dtype == torch.float32 or block_r > 64 else 128
    out, final = (scale_out, True) if sq_out is None else (sq_out, False)
    for s in range(len(offsets) - 1):
        lo, hi = offsets[s], offsets[s + 1]
        if hi == lo:
            continue
        a_s = a[s]
        _dora_norm_kernel[(triton.cdiv(hi - lo, block_n),)](
            weight[lo:hi], weight_scale[lo:hi] if weight_scale is not None else weight, a_s, b[lo:hi],
            magnitude[lo:hi], out[lo:hi], hi - lo, k, r, weight.stride(0), a_s.stride(0), b.stride(0),
            HAS_SCALE=weight_scale is not None, FINAL=final,
            PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
            BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=block_r, num_warps=4,
        )  # fmt: skip
