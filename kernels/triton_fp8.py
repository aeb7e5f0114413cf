"""The FP8 linear layer on CUDA (compute capability 8.9+), two paths:

- per-token activation quantization in one Triton kernel, then cuBLASLt's FP8 GEMM through
  torch._scaled_mm with row-wise scales (float32 accumulation, bf16 out): kernels/fp8_reference.py's
  math (W8A8);
- at 1-64 tokens, for the exact (N, K) where this GPU's table (kernels/configs/<gpu>.json, op
  "skinny_fp8", `benchmarks/bench_skinny.py --fp8 --table-out`) says it beats the first: the skinny
  GEMM's FP8 build (kernels/triton_linear.py), weight-only (W8A16): x stays bf16, each weight tile
  is upcast, float32 accumulation, scaled per output column. One launch, no quantization pass.

The two differ in numerics: W8A16 leaves out the activations' FP8 rounding (2^-4 relative per value),
so it is the closer of the two to x @ (W * scale).T. Rows at decode token counts may take either
path, by the table: a shape's result at T tokens depends on the GPU's table, not only on x and W.
Nothing here syncs with the host, so captured CUDA graphs hold either path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_linear
from .fp8_reference import FP8, FP8_MAX, MIN_AMAX
from .tuning import skinny_fp8_config

BLOCK_K = 1024  # columns of a row per pass (two passes: the row's max, then the quantized values)


@triton.jit
def _quantize_per_token_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, MIN_AMAX: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0), MIN_AMAX) / FP8_MAX
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * stride_q + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (unit column stride) -> (q [T, K] float8_e4m3fn, scale [T, 1] float32)."""
    t, k = x.shape
    q = torch.empty((t, k), dtype=FP8, device=x.device)
    scale = torch.empty((t, 1), dtype=torch.float32, device=x.device)
    if t:
        _quantize_per_token_kernel[(t,)](
            x,
            q,
            scale,
            k,
            x.stride(0),
            q.stride(0),
            MIN_AMAX=MIN_AMAX,
            FP8_MAX=FP8_MAX,
            BLOCK=min(BLOCK_K, triton.next_power_of_2(k)),
        )
    return q, scale


def scaled_mm(q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, dtype) -> torch.Tensor:
    """(q [T, K] @ weight [N, K].T) * x_scale [T, 1] * weight_scale [N]: cuBLASLt FP8, float32 accumulation."""
    return torch._scaled_mm(q, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1), out_dtype=dtype)


def quantizes_input(tokens: int, dtype: torch.dtype, weight, weight_scale, bias=None) -> bool:
    """Whether fp8_linear of a contiguous x [tokens, K] of `dtype` quantizes x (torch._scaled_mm), not
    the skinny GEMM's W8A16 build (which reads x as it is): where the kernel that writes x should also
    write its quantization (x_fp8). Fixed per token count, so a captured graph's choice holds."""
    if tokens > triton_linear.MAX_TOKENS:  # prefill steps: never the skinny build (asked per layer and step)
        return True
    x = torch.empty((tokens, weight.shape[1]), dtype=dtype, device="meta")  # a contiguous x's shape and layout
    if not triton_linear.supported(x, weight, bias, weight_scale):
        return True
    return skinny_fp8_config(weight.device, tokens, weight.shape[0], weight.shape[1]) is None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [T, K] bf16 -> [T, N] bf16 (row-wise scaled FP8 GEMMs take bf16 out only): the skinny GEMM's
    FP8 build (W8A16) where the GPU's "skinny_fp8" table lists (N, K) at T, else per-token
    quantization + torch._scaled_mm (W8A8). See the module docstring for how the two differ. x_fp8:
    x's quantize_per_token (q, scale), made by the kernel that wrote x; x is quantized here without it."""
    if triton_linear.supported(x, weight, bias, weight_scale):
        cfg = skinny_fp8_config(x.device, x.shape[0], weight.shape[0], weight.shape[1])
        if cfg is not None:
            return triton_linear.skinny_linear(x, weight, bias, cfg, weight_scale)
    if x_fp8 is not None:
        q, s = x_fp8
    else:
        q, s = quantize_per_token(x if x.stride(-1) == 1 else x.contiguous())
    y = scaled_mm(q, s, weight, weight_scale, x.dtype)
    return y if bias is None else y.add_(bias)
