"""The base model's linear layers at decode batch sizes: a Triton skinny GEMM beside cuBLAS.

At 1-64 tokens a layer's GEMM is a weight read: y [M, N] = x [M, K] @ W[N, K].T moves N*K*2
bytes and does little arithmetic. In a decode graph on an H100, cuBLAS reads the wide gate/up
projection at ~95% of the copy bandwidth but q/k/v, o and down at ~82-85% (too few CTAs for the
shape, or a split K plus a reduce kernel); alone over cold weights it takes 1.09-1.64x the bytes'
time. Here each program owns BLOCK_N output columns for every token and streams their rows of W through the
whole reduction: N / BLOCK_N programs, each several stages of loads in flight, no second kernel.

Used only where this GPU's table (kernels/configs/<gpu>.json, op "skinny", written by
`benchmarks/bench_skinny.py --table-out`) holds an entry for the exact (N, K) where this kernel
beats cuBLAS (timed in bf16; fp16 layers of that shape take the same entries);
every other shape or token count, and float32, stays on F.linear (kernels/tuning.py
`skinny_config`). Nothing is tuned while serving.

FP8 weights (`weight_scale` given: float8_e4m3fn [N, K] with one float32 scale per output row) take
the same kernel's FP8 build: weight-only dequantization (W8A16), each tile of W upcast to x's dtype
(exact: e4m3 values are bf16 / fp16 values), float32 accumulation, the accumulator scaled per output
column, (x @ q.T) * s = x @ (q * s).T; x stays in its dtype, no quantization pass. Half the bytes
of a bf16 weight, which is what a decode GEMM costs. kernels/triton_fp8.py takes it where the
GPU's table has a "skinny_fp8" entry for the shape (`skinny_fp8_config`, the same rule). The
branch is a constexpr: the bf16 / fp16 build compiles as it does without it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .tuning import SkinnyConfig, skinny_config

MAX_TOKENS = 64  # at most this many rows of x, all in one program's tile (16, 32 or 64 rows: tl.dot's sizes)


@triton.jit(do_not_specialize=["M"])  # one build per row tile for every token count (the warm-up's ladder covers it)
def _skinny_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    FP8_W: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    if EVEN_N:
        rows = offs_n
    else:  # clamp instead of masking the weight loads: the extra columns are never stored
        rows = tl.minimum(offs_n, N - 1)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    if BLOCK_M == 1:
        # One token: products in registers, one sum over K at the end (no tensor-core tile to fill).
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        x_ptrs = x_ptr + offs_k
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs)
                x = tl.load(x_ptrs)
            else:
                k_mask = (k0 + offs_k) < K
                w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
                x = tl.load(x_ptrs, mask=k_mask, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        out = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]
    else:
        offs_m = tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs)
                x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            else:
                k_mask = (k0 + offs_k) < K
                w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
                x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            if FP8_W:
                w = w.to(x_ptr.dtype.element_ty)
            acc = tl.dot(x, tl.trans(w), acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        out = acc
    if FP8_W:  # one scale per row of W: per output column
        out = out * tl.load(s_ptr + rows)[None, :]
    if HAS_BIAS:
        out += tl.load(b_ptr + rows).to(tl.float32)[None, :]
    offs_m = tl.arange(0, BLOCK_M)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & n_mask[None, :])


FP8 = torch.float8_e4m3fn


def supported(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None
) -> bool:
    """Shapes and layouts the kernel takes: 2-D x of 1-64 rows, half-precision, unit column
    strides, a contiguous bias of x's dtype, and a weight of x's dtype, or (weight_scale given) an
    FP8 one with a contiguous float32 scale [N]. Anything else (a mismatched K included) goes to
    the caller's other path, which also raises its own errors."""
    if weight_scale is None:
        weight_ok = weight.dtype == x.dtype
    else:
        weight_ok = (
            weight.dtype == FP8
            and weight_scale.dtype == torch.float32
            and weight_scale.shape == weight.shape[:1]
            and weight_scale.is_contiguous()
        )
    return (
        x.dim() == 2
        and weight.dim() == 2
        and 0 < x.shape[0] <= MAX_TOKENS
        and x.shape[1] == weight.shape[1]
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight_ok
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and (bias is None or (bias.dtype == x.dtype and bias.dim() == 1 and bias.is_contiguous()))
    )


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cfg: SkinnyConfig,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M <= 64, K] through the skinny kernel with config cfg; with
    weight_scale [N] float32, weight is float8_e4m3fn and the product is F.linear(x, weight * scale)."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = 1 if m == 1 else max(16, triton.next_power_of_2(m))
    _skinny_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else weight, weight_scale, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, FP8_W=weight_scale is not None, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0, EVEN_N=n % cfg.block_n == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the skinny kernel where this GPU's table says it is faster."""
    if supported(x, weight, bias):
        cfg = skinny_config(x.device, x.shape[0], weight.shape[0], weight.shape[1])
        if cfg is not None:
            return skinny_linear(x, weight, bias, cfg)
    return F.linear(x, weight, bias)
