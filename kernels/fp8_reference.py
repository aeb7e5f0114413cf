"""The FP8 linear layer's math in plain PyTorch: activations quantized per token, products of the FP8
operands summed in float32, then scaled. kernels/triton_fp8.py computes the same on CUDA.

x [T, K] (bf16), weight [N, K] float8_e4m3fn with weight_scale [N] float32 (one per output row):
    s_x[t] = max(max_k |x[t, k]|, MIN_AMAX) / 448,   q_x = round_fp8(x / s_x)
    y[t, n] = (sum_k q_x[t, k] * weight[n, k]) * s_x[t] * weight_scale[n]  (+ bias[n]), in x's dtype
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MIN_AMAX = 1e-12  # an all-zero row gets a tiny scale (its values quantize to 0), never a division by zero


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (q [T, K] float8_e4m3fn, scale [T, 1] float32) with x ~= q * scale."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def scaled_mm(q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, dtype) -> torch.Tensor:
    """(q [T, K] @ weight [N, K].T) * x_scale [T, 1] * weight_scale [N], summed in float32, out in dtype."""
    return ((q.float() @ weight.float().T) * x_scale * weight_scale.float()[None, :]).to(dtype)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x_fp8: quantize_per_token(x) made already, used as given."""
    q, s = x_fp8 if x_fp8 is not None else quantize_per_token(x)
    y = scaled_mm(q, s, weight, weight_scale, x.dtype)
    return y if bias is None else y + bias
