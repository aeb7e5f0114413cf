"""The FP8 linear layer's CUDA path (kernels/triton_fp8.py): the per-token quantization kernel against
kernels/fp8_reference.py, the FP8 GEMM (torch._scaled_mm, row-wise scales) against float64 over the
same quantized operands (within the FP8 tensor cores' accumulation error), and the whole layer
replayed from a captured CUDA graph.

Runs on a CUDA GPU (the GEMM on compute capability 8.9+; skips elsewhere). Not under Triton's
interpreter: its float32 -> float8e4nv conversion rounds some values a binade low (-124.7 to -64).
Run: pytest -m gpu tests/kernels/test_fp8_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from .gpu_skip import skip_unless_cuda_and_triton

skip_unless_cuda_and_triton()

from loraserve.executor.model import fp8  # noqa: E402
from loraserve.kernels import fp8_reference, triton_fp8  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = "cuda"


def _needs_fp8_gemm():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the FP8 GEMM needs a CUDA GPU of compute capability 8.9+")


def _activations(t: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    row_scale = 10.0 ** torch.randint(-3, 3, (t, 1), generator=g).float()  # rows of very different ranges
    x = torch.randn(t, k, generator=g) * row_scale
    if t > 2:
        x[2] = 0  # an all-zero row: scale MIN_AMAX / 448, values 0
    return x.to(DEV, torch.bfloat16)


@pytest.mark.parametrize("t", [1, 3, 64, 300])
@pytest.mark.parametrize("k", [64, 1000, 4096])
def test_per_token_quantization_kernel_matches_the_reference(t, k):
    x = _activations(t, k, t * 7 + k)
    q, s = triton_fp8.quantize_per_token(x)
    rq, rs = fp8_reference.quantize_per_token(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (t, 1)
    torch.testing.assert_close(s, rs, rtol=0, atol=0)
    # x / s rounds to the same FP8 value (a division rounding differently may land one FP8 step away)
    diff = (q.float() - rq.float()).abs()
    assert (diff <= rq.float().abs() * 2**-3 + 2**-9).all()
    assert (diff > 0).float().mean() < 1e-3


# The FP8 tensor cores accumulate a few K-steps at a time in less than float32 before the sum is
# promoted, so a product differs from float32's by up to a small share of the sum of its terms'
# magnitudes (sum_k |q_tk * w_nk| * scales), not of the product itself: with rows that cancel, the
# product can be far smaller than its terms. Bound: bf16 rounding of the result plus 2^-10 of that
# sum; a wrong scale, row or column is off by the size of the product and fails it.
ACCUMULATION_ERROR = 2**-10


@pytest.mark.parametrize("t", [1, 8, 33, 256])
@pytest.mark.parametrize("n, k", [(64, 64), (1536, 1024), (1024, 2816)])
def test_fp8_gemm_matches_float32_on_the_same_quantized_operands(t, n, k):
    _needs_fp8_gemm()
    x = _activations(t, k, t + n + k)
    w = torch.randn(n, k, device=DEV) / k**0.5
    wq, ws = fp8.quantize_rows(w)
    q, s = triton_fp8.quantize_per_token(x)
    y = triton_fp8.scaled_mm(q, s, wq, ws, torch.bfloat16)
    want = (q.double() @ wq.double().T) * s.double() * ws.double()[None, :]
    terms = (q.double().abs() @ wq.double().abs().T) * s.double() * ws.double()[None, :]
    assert y.dtype == torch.bfloat16 and y.isfinite().all()
    excess = (y.double() - want).abs() - (2**-8 * want.abs() + ACCUMULATION_ERROR * terms)
    assert excess.max().item() <= 0, f"worst element over the bound by {excess.max().item():.3e}"
    # and the whole: each row within 1% of its float32 value
    rel = (y.double() - want).norm(dim=1) / want.norm(dim=1).clamp(min=1e-30)
    assert rel.max().item() < 1e-2


def test_fp8_linear_adds_the_bias_and_takes_a_strided_input():
    _needs_fp8_gemm()
    x = _activations(16, 256, 1)
    wide = torch.cat([x, x], dim=1)[:, :256]  # rows 512 apart
    w, b = torch.randn(128, 256, device=DEV) / 16, torch.randn(128, device=DEV).to(torch.bfloat16)
    wq, ws = fp8.quantize_rows(w)
    y = triton_fp8.fp8_linear(wide, wq, ws, b)
    want = fp8_reference.fp8_linear(x.float(), wq, ws) + b.float()
    torch.testing.assert_close(y.float(), want, rtol=2**-7, atol=1e-3 * want.abs().max().item())


def test_fp8_linear_replays_from_a_captured_cuda_graph():
    """No host sync in the path: captured once, replayed on new inputs, equal to eager."""
    _needs_fp8_gemm()
    w = torch.randn(256, 512, device=DEV) / 512**0.5
    wq, ws = fp8.quantize_rows(w)
    x = _activations(8, 512, 2)
    triton_fp8.fp8_linear(x, wq, ws)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = triton_fp8.fp8_linear(x, wq, ws)
    for seed in (3, 4):
        x.copy_(_activations(8, 512, seed))
        graph.replay()
        torch.testing.assert_close(y, triton_fp8.fp8_linear(x, wq, ws), rtol=0, atol=0)
