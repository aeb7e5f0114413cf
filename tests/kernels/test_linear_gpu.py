"""The skinny GEMM (kernels/triton_linear.py) against F.linear, its table lookup, and the fused
greedy pick (kernels/triton_ops.greedy) against torch's argmax + logsumexp.

Runs on a CUDA GPU (skips elsewhere); with TRITON_INTERPRET=1 and no GPU, through Triton's
interpreter on CPU tensors. Run: pytest -m gpu tests/kernels/test_linear_gpu.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from .gpu_skip import DEV, INTERPRET, skip_unless_cuda_and_triton

skip_unless_cuda_and_triton(interpreter=INTERPRET)

from loraserve.kernels import ops_reference, triton_linear, triton_ops, tuning  # noqa: E402

pytestmark = pytest.mark.gpu

# The skinny GEMM's tile cases (its FP8 build's tests take them too)
TILES = pytest.mark.parametrize(
    "n, k, block_n, block_k",
    [
        (96, 256, 32, 128),  # even tiles
        (100, 200, 32, 128),  # N and K both off the tiles: clamped rows, masked K
        (48, 64, 64, 128),  # one program wider than N, one K block longer than K
    ],
)


@pytest.mark.parametrize("tokens", [1, 2, 3, 8, 13, 16, 17, 33, 64])
@TILES
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_skinny_linear_equals_f_linear(tokens, n, k, block_n, block_k, bias, dtype):
    if INTERPRET and dtype == torch.bfloat16 and tokens > 1:
        pytest.skip("the interpreter's tl.dot multiplies bfloat16 as its raw 16-bit integers")
    gen = torch.Generator().manual_seed(tokens * 1000 + n + k)
    x = torch.randn(tokens, k, generator=gen).to(DEV, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEV, dtype)
    b = torch.randn(n, generator=gen).to(DEV, dtype) if bias else None
    cfg = tuning.SkinnyConfig(block_n, block_k, 4, 2)
    got = triton_linear.skinny_linear(x, w, b, cfg)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.shape == (tokens, n) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_skinny_linear_reads_a_strided_x():
    dtype = torch.float16 if INTERPRET else torch.bfloat16  # see the skip above
    x_full = torch.randn(4, 300).to(DEV, dtype)
    x = x_full[:, :256]  # row stride 300
    w = (torch.randn(64, 256) / 16).to(DEV, dtype)
    got = triton_linear.skinny_linear(x, w, None, tuning.SkinnyConfig(16, 128, 4, 2))
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float()), atol=2e-2, rtol=2e-2)


def test_linear_takes_the_skinny_kernel_only_where_the_table_lists_the_shape(monkeypatch):
    dev = torch.device(DEV)
    key = "test-gpu"
    monkeypatch.setattr(tuning, "_device_key", lambda device: key)
    calls = []
    real = triton_linear.skinny_linear
    monkeypatch.setattr(triton_linear, "skinny_linear", lambda *a: calls.append(a[3]) or real(*a))
    cfg = dict(block_n=32, block_k=128, num_warps=4, num_stages=2)
    tuning.set_table(key, {"skinny": {"64x256": {"1": cfg, "4": None, "8": cfg}}})
    try:
        dtype = torch.float16 if INTERPRET else torch.bfloat16
        w = torch.randn(64, 256).to(dev, dtype)
        for tokens, skinny in [(1, True), (2, False), (4, False), (5, True), (8, True), (9, False), (65, False)]:
            calls.clear()
            x = torch.randn(tokens, 256).to(dev, dtype)
            y = triton_linear.linear(x, w)
            torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), atol=2e-2, rtol=2e-2)
            assert bool(calls) == skinny, (tokens, calls)
            if skinny:
                assert calls[0] == tuning.SkinnyConfig(**cfg)
        calls.clear()
        triton_linear.linear(torch.randn(1, 256).to(dev, dtype), torch.randn(96, 256).to(dev, dtype))
        triton_linear.linear(torch.randn(1, 256).to(dev, torch.float32), torch.randn(64, 256).to(dev, torch.float32))
        assert calls == []  # a shape the table does not list, and float32: F.linear
    finally:
        tuning.set_table(key, {})


@pytest.mark.parametrize("rows, vocab", [(1, 5), (1, 2048), (3, 2049), (8, 49152), (2, 151936)])
def test_fused_greedy_equals_torch(rows, vocab):
    gen = torch.Generator().manual_seed(rows * 7 + vocab)
    logits = (torch.randn(rows, vocab, generator=gen) * 5).to(DEV)
    ids, lp = triton_ops.greedy(logits)
    want_ids, want_lp = ops_reference.greedy(logits)
    assert ids.dtype == torch.int64 and lp.dtype == torch.float32
    assert ids.tolist() == want_ids.tolist()
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=1e-5)


def test_fused_greedy_takes_the_first_of_equal_maxima_and_skips_minus_inf():
    vocab = 5000
    logits = torch.full((4, vocab), float("-inf"))
    logits[0, [17, 2100, 4999]] = 3.0  # a tie across lanes and blocks: the first index wins
    logits[1, :] = 0.0  # every column equal: column 0, logprob -ln(vocab)
    logits[2, 4097] = -1e30  # one finite value among -inf
    logits[3, 2048 + 5] = 2.0
    logits[3, 5] = 2.0  # the same lane, an earlier block
    logits = logits.to(DEV)
    ids, lp = triton_ops.greedy(logits)
    assert ids.tolist() == [17, 0, 4097, 5]
    want_ids, want_lp = ops_reference.greedy(logits)
    assert ids.tolist() == want_ids.tolist()
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=1e-5)
    assert abs(lp[1].item() + torch.log(torch.tensor(float(vocab))).item()) < 1e-5


def test_fused_greedy_ranks_nan_first_like_torch():
    logits = torch.randn(3, 3000)
    logits[0, 2500] = float("nan")  # one NaN: torch.argmax picks it
    logits[1, [40, 2100]] = float("nan")  # two: the first
    logits[2, :] = float("nan")  # all NaN: column 0
    logits = logits.to(DEV)
    ids, lp = triton_ops.greedy(logits)
    want_ids, _ = ops_reference.greedy(logits)
    assert ids.tolist() == want_ids.tolist() == [2500, 40, 0]
    assert torch.isnan(lp).all()  # torch's logsumexp of a row with a NaN is NaN too


def test_linear_leaves_what_the_kernel_does_not_take_to_f_linear(monkeypatch):
    """A mismatched K, a bias of another dtype, float32: F.linear (and its own error), not the kernel."""
    monkeypatch.setattr(tuning, "_device_key", lambda device: "test-gpu")
    tuning.set_table("test-gpu", {"skinny": {"64x256": {"8": dict(block_n=32, block_k=128, num_warps=4, num_stages=2)}}})
    try:
        dtype = torch.float16 if INTERPRET else torch.bfloat16
        w = torch.randn(64, 256).to(DEV, dtype)
        with pytest.raises(RuntimeError):
            triton_linear.linear(torch.randn(4, 255).to(DEV, dtype), w)
        assert not triton_linear.supported(torch.randn(4, 256).to(DEV, dtype), w, torch.randn(64).to(DEV))
        assert not triton_linear.supported(torch.randn(4, 256).to(DEV), w.float())
        assert triton_linear.supported(torch.randn(4, 256).to(DEV, dtype), w, torch.randn(64).to(DEV, dtype))
    finally:
        tuning.set_table("test-gpu", {})
