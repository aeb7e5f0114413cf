"""An FP8 layer's input quantized by the kernel that writes it (kernels/triton_ops.py's `quantize`): the
RMSNorm (with and without the residual add, Llama's and Gemma's unit offset) and the SiLU / GeLU
and-muls also write their output's per-token FP8 quantization, which equals
fp8_reference.quantize_per_token of that output (scales exactly, values within one FP8 step: a
division rounding the other way lands one step off), and the output itself is the unquantized
call's, bit for bit. On a CUDA GPU (bf16), the FP8 GEMM from the fused quantization equals the one
that quantizes its input itself, eagerly and replayed from a captured CUDA graph.

Under Triton's interpreter (TRITON_INTERPRET=1, no GPU: `make test`'s second pass) in float32 and
bf16, its float32 -> FP8 conversion rounded to nearest even as the GPU's (conftest's
interpreter_fp8_rounding).
"""

from __future__ import annotations

import pytest
import torch

from .gpu_skip import DEV, INTERPRET, skip_unless_cuda_and_triton

skip_unless_cuda_and_triton(interpreter=True)

from loraserve.kernels import fp8_reference, triton_ops  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("interpreter_fp8_rounding")]

FP8 = torch.float8_e4m3fn
DTYPES = [torch.float32, torch.bfloat16] if INTERPRET else [torch.bfloat16]


def _rows(rows: int, n: int, dtype, seed: int) -> torch.Tensor:
    """Rows of very different ranges, row 2 all zero (scale MIN_AMAX / 448, values 0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * 10.0 ** torch.randint(-3, 3, (rows, 1), generator=g).float()
    x[2] = 0
    return x.to(DEV, dtype)


def _check_quantization(out: torch.Tensor, x_fp8) -> None:
    """x_fp8 = (q, scale) is quantize_per_token(out): scales exactly, values within one FP8 step."""
    q, s = x_fp8
    rq, rs = fp8_reference.quantize_per_token(out)
    assert q.dtype == FP8 and q.shape == out.shape and s.dtype == torch.float32 and s.shape == (out.shape[0], 1)
    torch.testing.assert_close(s, rs, rtol=0, atol=0)
    diff = (q.float() - rq.float()).abs()
    assert (diff <= rq.float().abs() * 2**-3 + 2**-9).all()
    assert (diff > 0).float().mean() < 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 200, 4096])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_writes_its_outputs_fp8_quantization(dtype, n, with_residual, unit_offset):
    x = _rows(5, n, dtype, n)
    res = _rows(5, n, dtype, n + 1) if with_residual else None
    w = (1 + 0.1 * torch.randn(n, generator=torch.Generator().manual_seed(2))).to(DEV, dtype)
    out, h, x_fp8 = triton_ops.rms_norm(x, w, 1e-5, res, unit_offset, quantize=True)
    plain_out, plain_h = triton_ops.rms_norm(x, w, 1e-5, res, unit_offset)
    assert torch.equal(out, plain_out) and torch.equal(h, plain_h)
    _check_quantization(out, x_fp8)
    assert (x_fp8[0][2].float() == 0).all()  # the all-zero row (zero residual there too)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [112, 2500])  # one block of columns, several (and a partial last one)
@pytest.mark.parametrize("act", ["silu_and_mul", "gelu_and_mul"])
def test_act_and_mul_writes_its_outputs_fp8_quantization(dtype, n, act):
    gate_up = _rows(4, 2 * n, dtype, n) * 3
    out, x_fp8 = getattr(triton_ops, act)(gate_up, quantize=True)
    assert torch.equal(out, getattr(triton_ops, act)(gate_up))
    _check_quantization(out, x_fp8)


def test_inputs_the_kernels_do_not_take_are_quantized_by_the_reference():
    """Strided columns go to ops_reference, then fp8_reference.quantize_per_token."""
    x = _rows(4, 128, DTYPES[0], 7)[:, ::2]
    w = torch.ones(64, device=DEV, dtype=x.dtype)
    out, _, (q, s) = triton_ops.rms_norm(x, w, 1e-5, quantize=True)
    rq, rs = fp8_reference.quantize_per_token(out)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    out, (q, s) = triton_ops.silu_and_mul(_rows(4, 256, DTYPES[0], 8)[:, ::2], quantize=True)
    rq, rs = fp8_reference.quantize_per_token(out)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


def _needs_fp8_gemm():
    if INTERPRET or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the FP8 GEMM needs a CUDA GPU of compute capability 8.9+")


def test_the_fp8_gemm_from_the_fused_quantization_equals_the_quantizing_one():
    """The norm's and SiLU-and-mul's (q, scale) as fp8_linear's x_fp8: the same product as
    fp8_linear quantizing the bf16 output itself (its kernel's math is the fused one's)."""
    _needs_fp8_gemm()
    from loraserve.executor.model import fp8
    from loraserve.kernels import triton_fp8

    g = torch.Generator().manual_seed(3)
    x, res = _rows(33, 256, torch.bfloat16, 3), _rows(33, 256, torch.bfloat16, 4)
    wq, ws = (t.to(DEV) for t in fp8.quantize_rows(torch.randn(96, 256, generator=g)))
    out, _, x_fp8 = triton_ops.rms_norm(x, torch.ones(256, device=DEV, dtype=torch.bfloat16), 1e-5, res, quantize=True)
    assert torch.equal(triton_fp8.fp8_linear(out, wq, ws, x_fp8=x_fp8), triton_fp8.fp8_linear(out, wq, ws))
    act, act_fp8 = triton_ops.silu_and_mul(torch.cat([out, out], dim=1), quantize=True)
    assert torch.equal(triton_fp8.fp8_linear(act, wq, ws, x_fp8=act_fp8), triton_fp8.fp8_linear(act, wq, ws))


def test_the_fused_quantization_replays_from_a_captured_cuda_graph():
    _needs_fp8_gemm()
    from loraserve.executor.model import fp8
    from loraserve.kernels import triton_fp8

    g = torch.Generator().manual_seed(5)
    wq, ws = (t.to(DEV) for t in fp8.quantize_rows(torch.randn(64, 128, generator=g)))
    w = torch.ones(128, device=DEV, dtype=torch.bfloat16)
    x = torch.empty(8, 128, device=DEV, dtype=torch.bfloat16)

    def step():
        out, _, x_fp8 = triton_ops.rms_norm(x, w, 1e-5, quantize=True)
        act, act_fp8 = triton_ops.gelu_and_mul(triton_fp8.fp8_linear(out, wq, ws, x_fp8=x_fp8), quantize=True)
        return triton_fp8.fp8_linear(act, wq[:, :32].contiguous(), ws, x_fp8=act_fp8)

    x.copy_(_rows(8, 128, torch.bfloat16, 6))
    step()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step()
    for seed in (7, 8):
        x.copy_(_rows(8, 128, torch.bfloat16, seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, step())
