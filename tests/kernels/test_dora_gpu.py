"""DoRA's norm pass (kernels/triton_dora.py) against float64 over the same operands and against
kernels/dora_reference.py: per slice, sum_k (W + B A_s)^2 per output row, then m / sqrt(.) in the
scale's dtype (1 where m is NaN), or the sums themselves (a row-parallel layer's partial sums); FP8
weights times their rows' scales. Ranks below tl.dot's 16 and rows / columns off the blocks are masked.

Runs on a CUDA GPU, and under Triton's interpreter (TRITON_INTERPRET=1, no GPU: `make test`'s second
pass) without the FP8 cases.
"""

from __future__ import annotations

import pytest
import torch

from .gpu_skip import DEV, INTERPRET, skip_unless_cuda_and_triton

skip_unless_cuda_and_triton(interpreter=True)

from loraserve.kernels import dora_reference, triton_dora  # noqa: E402

pytestmark = pytest.mark.gpu

# the interpreter's tl.dot takes no bfloat16: float16 stands in for it there
WEIGHT_DTYPES = ["float32", "float16"] if INTERPRET else ["float32", "bfloat16", "float8"]


def _operands(sizes, k, r, weight_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    w = torch.randn(n, k, generator=g) / k**0.5
    scale = None
    adapter_dtype = {"float32": torch.float32, "float16": torch.float16}.get(weight_dtype, torch.bfloat16)
    if weight_dtype == "float8":
        scale = w.abs().amax(1) / 448
        w = (w / scale[:, None]).to(torch.float8_e4m3fn)
        scale = scale.to(DEV)
    else:
        w = w.to(getattr(torch, weight_dtype))
    a = (torch.randn(len(sizes), r, k, generator=g) / k**0.5).to(adapter_dtype)
    b = (torch.randn(n, r, generator=g) * 0.5).to(adapter_dtype)
    m = torch.rand(n, generator=g) + 0.5
    m[offsets[1] : offsets[2]] = float("nan")  # slice 1: not targeted, g = 1
    return w.to(DEV), scale, a.to(DEV), b.to(DEV), offsets, m.to(DEV)


def _exact_squares(w, scale, a, b, offsets):
    w64 = w.double() * (scale.double()[:, None] if scale is not None else 1)
    rows = [w64[lo:hi] + b.double()[lo:hi] @ a.double()[s] for s, (lo, hi) in enumerate(zip(offsets, offsets[1:]))]
    return torch.cat(rows).square().sum(1)


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("sizes, k, r", [([48, 16, 16], 200, 4), ([100, 37], 64, 16), ([64, 8], 300, 40)])
def test_the_scale_and_the_partial_sums_equal_float64_and_the_reference(weight_dtype, sizes, k, r):
    w, scale, a, b, offsets, m = _operands(sizes, k, r, weight_dtype, sum(sizes) + k + r)
    sq = _exact_squares(w, scale, a, b, offsets)
    want = torch.where(m.isnan(), torch.ones_like(sq), m.double() / sq.sqrt())
    for out_dtype in (torch.float32, torch.bfloat16):
        got = torch.full((w.shape[0],), -7.0, device=DEV, dtype=out_dtype)
        triton_dora.dora_norm(w, scale, a, b, offsets, m, scale_out=got)
        ref = torch.full_like(got, -7.0)
        dora_reference.dora_norm(w, scale, a, b, offsets, m, scale_out=ref)
        tol = 2e-6 if out_dtype == torch.float32 else 2**-7  # one step of the output's dtype
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=0)
        torch.testing.assert_close(got, ref, rtol=tol, atol=0)
        assert (got[offsets[1] : offsets[2]] == 1).all()
    partial = torch.full((w.shape[0],), -7.0, device=DEV)
    triton_dora.dora_norm(w, scale, a, b, offsets, m, sq_out=partial)
    torch.testing.assert_close(partial.double(), sq, rtol=2e-6, atol=0)


def test_a_strided_weight_and_a_and_b_of_different_dtypes():
    """The rows of a wider weight (a view whose row stride is not its width) read as the view; A and
    B in different dtypes are refused naming both."""
    w, scale, a, b, offsets, m = _operands([32, 32], 128, 8, WEIGHT_DTYPES[1], 3)
    wide = torch.cat([w, w], dim=1)[:, :128]
    got, want = torch.empty(64, device=DEV), torch.empty(64, device=DEV)
    triton_dora.dora_norm(wide, None, a, b, offsets, m, scale_out=got)
    triton_dora.dora_norm(w.contiguous(), None, a, b, offsets, m, scale_out=want)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match=f"A is {a.dtype}, B is torch.float32: one dtype for both"):
        triton_dora.dora_norm(w, None, a, b.float(), offsets, m, scale_out=got)
