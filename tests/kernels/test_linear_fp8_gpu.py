"""The skinny GEMM's FP8 build (kernels/triton_linear.py, W8A16) against float64 over the same
dequantized weights, and kernels/triton_fp8.fp8_linear's choice between it and per-token
quantization + torch._scaled_mm by the GPU's "skinny_fp8" table.

Runs on a CUDA GPU of compute capability 8.9+ (skips elsewhere); with
TRITON_INTERPRET=1 and no GPU, through Triton's interpreter on CPU tensors (where the
interpreter's tl.dot cannot multiply bfloat16, multi-token tiles take float16 activations).
Run: pytest -m gpu tests/kernels/test_linear_fp8_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from .gpu_skip import DEV, INTERPRET, skip_unless_cuda_and_triton

skip_unless_cuda_and_triton(interpreter=INTERPRET)
if not INTERPRET and torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("FP8 (Triton's float8e4nv, torch._scaled_mm) needs compute capability 8.9+", allow_module_level=True)

from loraserve.executor.model import fp8  # noqa: E402
from loraserve.kernels import triton_fp8, triton_linear, tuning  # noqa: E402

from .test_linear_gpu import TILES  # noqa: E402

pytestmark = pytest.mark.gpu

# Either path of fp8_linear, against float64 of x @ (W * scale).T: each row within this share of its
# norm. W8A8 rounds every activation to FP8 (up to 2^-4 of the value), ~3% of a row's norm on random
# rows; W8A16 only rounds its bf16 output. Tests of callers that hold either path use this bound.
FP8_LINEAR_ROW_TOL = 5e-2


def _dtype(tokens: int) -> torch.dtype:
    return torch.float16 if INTERPRET and tokens > 1 else torch.bfloat16


def _operands(tokens: int, n: int, k: int, seed: int, bias: bool, dtype=None):
    gen = torch.Generator().manual_seed(seed)
    dtype = dtype or _dtype(tokens)
    x = torch.randn(tokens, k, generator=gen).to(DEV, dtype)
    wq, ws = fp8.quantize_rows(torch.randn(n, k, generator=gen) / k**0.5)
    b = torch.randn(n, generator=gen).to(DEV, dtype) if bias else None
    return x, wq.to(DEV), ws.to(DEV), b


def _exact(x, wq, ws, b):
    """float64 x @ (wq * ws).T + b, and the sum of the terms' magnitudes per element."""
    w = wq.double() * ws.double()[:, None]
    want = x.double() @ w.T + (0 if b is None else b.double())
    terms = x.double().abs() @ w.abs().T + (0 if b is None else b.double().abs())
    return want, terms


def _assert_w8a16(y, x, wq, ws, b):
    """The kernel's error: its output's rounding (within one bf16 step, 2^-7 of the value: the
    interpreter's float32 -> bf16 conversion truncates) and float32 sums."""
    want, terms = _exact(x, wq, ws, b)
    assert y.shape == want.shape and y.dtype == x.dtype
    excess = (y.double() - want).abs() - (2**-7 * want.abs() + 2**-16 * terms)
    assert excess.max().item() <= 0, f"worst element over the bound by {excess.max().item():.3e}"


def _row_error(y, x, wq, ws, b) -> float:
    want, _ = _exact(x, wq, ws, b)
    return ((y.double() - want).norm(dim=1) / want.norm(dim=1).clamp(min=1e-30)).max().item()


@pytest.mark.parametrize("tokens", [1, 2, 7, 16, 17, 33, 64])
@TILES
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_skinny_linear_equals_float64_of_the_dequantized_weight(tokens, n, k, block_n, block_k, bias):
    x, wq, ws, b = _operands(tokens, n, k, tokens * 1000 + n + k, bias)
    y = triton_linear.skinny_linear(x, wq, b, tuning.SkinnyConfig(block_n, block_k, 4, 2), ws)
    _assert_w8a16(y, x, wq, ws, b)


@pytest.mark.parametrize("tokens", [1, 5])
def test_fp8_skinny_linear_reads_a_strided_x(tokens):
    x_wide, _, _, _ = _operands(tokens, 64, 300, 7, False)
    x = x_wide[:, :256]  # row stride 300
    _, wq, ws, b = _operands(tokens, 64, 256, 8, True)
    y = triton_linear.skinny_linear(x, wq, b, tuning.SkinnyConfig(16, 128, 4, 2), ws)
    _assert_w8a16(y, x, wq, ws, b)


def test_fp8_skinny_kernel_is_taken_only_for_what_it_supports():
    x, wq, ws, b = _operands(4, 64, 256, 1, True, torch.bfloat16)
    assert triton_linear.supported(x, wq, b, ws)
    assert not triton_linear.supported(x, wq, b)  # FP8 without its scales
    assert not triton_linear.supported(x, wq.to(torch.bfloat16), b, ws)  # a scale for a bf16 weight
    assert not triton_linear.supported(x, wq, b, ws.double())
    assert not triton_linear.supported(x, wq, b, ws[:32])
    assert not triton_linear.supported(x, wq, b, ws.view(64, 1))
    assert not triton_linear.supported(x, wq, b.float(), ws)
    assert not triton_linear.supported(x.float(), wq, None, ws)
    assert not triton_linear.supported(x.new_empty(65, 256), wq, None, ws)


TEST_GPU = "test-gpu"
CFG = dict(block_n=32, block_k=128, num_warps=4, num_stages=2)


def _with_skinny_fp8_table(monkeypatch, entries: dict) -> None:
    """The device's table: these "skinny_fp8" entries only (emptied by the skinny_calls fixture)."""
    monkeypatch.setattr(tuning, "_device_key", lambda device: TEST_GPU)
    tuning.set_table(TEST_GPU, {"skinny_fp8": entries})


@pytest.fixture
def skinny_calls(monkeypatch):
    """The configs of fp8_linear's skinny kernel launches (each call still runs); the test GPU's
    table emptied after the test."""
    calls = []
    real = triton_linear.skinny_linear
    monkeypatch.setattr(triton_linear, "skinny_linear", lambda *a: calls.append(a[3]) or real(*a))
    yield calls
    tuning.set_table(TEST_GPU, {})


def test_fp8_linear_takes_the_skinny_kernel_only_where_the_table_lists_the_shape(
    monkeypatch, skinny_calls, interpreter_fp8_rounding
):
    """The "skinny_fp8" entries, with the bf16 skinny GEMM's rule: the exact (N, K), the entry of the
    smallest tuned count >= T, a null entry or a larger T: quantization + _scaled_mm. Both paths hold
    FP8_LINEAR_ROW_TOL; the kernel's own, tighter bound too."""
    _with_skinny_fp8_table(monkeypatch, {"64x256": {"1": CFG, "4": None, "8": CFG}})
    assert tuning.skinny_config(torch.device(DEV), 1, 64, 256) is None  # the bf16 op's table: not this one
    for tokens, skinny in [(1, True), (2, False), (4, False), (5, True), (8, True), (9, False), (65, False)]:
        skinny_calls.clear()
        x, wq, ws, b = _operands(tokens, 64, 256, tokens, True, _dtype(tokens) if skinny else torch.bfloat16)
        y = triton_fp8.fp8_linear(x, wq, ws, b)
        assert skinny_calls == ([tuning.SkinnyConfig(**CFG)] if skinny else []), tokens
        assert _row_error(y, x, wq, ws, b) < FP8_LINEAR_ROW_TOL, tokens
        if skinny:
            _assert_w8a16(y, x, wq, ws, b)
    skinny_calls.clear()
    x, wq, ws, b = _operands(1, 96, 256, 3, True, torch.bfloat16)  # a shape the table does not list
    y = triton_fp8.fp8_linear(x, wq, ws, b)
    x16, wq16, ws16, _ = _operands(1, 64, 256, 3, False, torch.bfloat16)
    triton_fp8.fp8_linear(x16, wq16, ws16, b[:64].float())  # a float32 bias: the kernel does not take it
    assert skinny_calls == []
    assert _row_error(y, x, wq, ws, b) < FP8_LINEAR_ROW_TOL


def test_an_input_is_quantized_ahead_only_where_the_gemm_quantizes_it(monkeypatch, skinny_calls):
    """quantizes_input (what the norms and act-and-muls ask before writing an FP8 layer's input) agrees
    with fp8_linear's own choice at every token count: False exactly where the table gives the call to
    the W8A16 kernel, which reads x unquantized."""
    _with_skinny_fp8_table(monkeypatch, {"64x256": {"1": CFG, "4": None, "8": CFG}})
    for tokens, dtype in [
        (1, torch.bfloat16),
        (2, torch.bfloat16),
        (4, torch.bfloat16),
        (8, torch.bfloat16),
        (9, torch.bfloat16),
        (65, torch.bfloat16),
        (8, torch.float32),
    ]:
        skinny_calls.clear()
        x, wq, ws, b = _operands(tokens, 64, 256, tokens, True, dtype)
        triton_fp8.fp8_linear(x, wq, ws, b if dtype != torch.float32 else None)
        assert triton_fp8.quantizes_input(tokens, dtype, wq, ws, b if dtype != torch.float32 else None) == (not skinny_calls), (
            tokens
        )
    _, wq, ws, b = _operands(1, 96, 256, 3, True, torch.bfloat16)  # a shape the table does not list
    assert triton_fp8.quantizes_input(1, torch.bfloat16, wq, ws, b)


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs: a CUDA host")
def test_fp8_skinny_linear_replays_from_a_captured_cuda_graph(monkeypatch, skinny_calls):
    """No host sync in the W8A16 path: captured once, replayed on new inputs, equal to eager."""
    _with_skinny_fp8_table(monkeypatch, {"256x512": {"8": CFG}})
    x, wq, ws, b = _operands(8, 256, 512, 2, True)
    triton_fp8.fp8_linear(x, wq, ws, b)  # compiled before capture
    assert skinny_calls
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = triton_fp8.fp8_linear(x, wq, ws, b)
    for seed in (3, 4):
        x.copy_(_operands(8, 256, 512, seed, False)[0])
        graph.replay()
        torch.testing.assert_close(y, triton_fp8.fp8_linear(x, wq, ws, b), rtol=0, atol=0)
        _assert_w8a16(y, x, wq, ws, b)
