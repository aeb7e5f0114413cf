"""The fused decoder ops (kernels/triton_ops.py) against the reference (kernels/ops_reference.py).

Needs CUDA + Triton; the module skips with a reason elsewhere. (With TRITON_INTERPRET=1 and
LORASERVE_TEST_DEVICE=cpu the same checks run through Triton's interpreter on the CPU.)
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = os.environ.get("LORASERVE_TEST_DEVICE", "cuda")
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip(
        "needs CUDA + Triton: no CUDA device here (run benchmarks/gpu.sh OUT test on a CUDA host)", allow_module_level=True
    )
try:
    from loraserve.kernels import ops_reference, triton_ops
except ImportError:
    pytest.skip("needs CUDA + Triton: triton is not installed", allow_module_level=True)

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _poisoned_like(t):
    return torch.full_like(t, float("nan"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 4096])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, hidden, with_residual):
    torch.manual_seed(0)
    x = torch.randn(7, hidden, device=DEVICE, dtype=dtype)
    res = torch.randn(7, hidden, device=DEVICE, dtype=dtype) if with_residual else None
    w = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    out, h = triton_ops.rms_norm(x, w, 1e-5, res)
    ref_out, ref_h = ops_reference.rms_norm(x, w, 1e-5, res)
    assert _rel(out, ref_out) < TOL[dtype]
    assert _rel(h, ref_h) < TOL[dtype]  # the residual sum: at most rounding apart from x + r


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (9, 3, 64), (32, 8, 128)])
def test_rope_and_cache_matches_reference(dtype, heads, kv_heads, head_dim):
    """q/k/v as views of one fused qkv output; tokens scattered over a shuffled slot mapping."""
    torch.manual_seed(1)
    tokens, num_blocks, block_size = 11, 6, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=DEVICE, dtype=dtype)
    q, k, v = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    q, k, v = q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim), v.view(-1, kv_heads, head_dim)
    pos = torch.randint(0, 500, (tokens,), device=DEVICE).float()
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim))
    emb = torch.cat([pos[:, None] * inv] * 2, dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    caches = [torch.randn(num_blocks, block_size, kv_heads, head_dim, device=DEVICE, dtype=dtype) for _ in range(4)]
    kc, vc, ref_kc, ref_vc = caches[0], caches[1], caches[0].clone(), caches[1].clone()
    out = triton_ops.rope_and_cache(q, k, v, cos, sin, kc, vc, slots)
    ref = ops_reference.rope_and_cache(q, k, v, cos, sin, ref_kc, ref_vc, slots)
    assert _rel(out, ref) < TOL[dtype]
    assert _rel(kc, ref_kc) < TOL[dtype]
    torch.testing.assert_close(vc, ref_vc, atol=0, rtol=0)  # v is copied, untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [112, 1536, 14336])
def test_silu_and_mul_matches_reference(dtype, inter):
    torch.manual_seed(2)
    x = torch.randn(5, 2 * inter, device=DEVICE, dtype=dtype)
    out = triton_ops.silu_and_mul(x)
    assert torch.isfinite(out).all()
    assert _rel(out, ops_reference.silu_and_mul(x)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 256, 3584])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemma_rms_norm_matches_reference_and_transformers(dtype, hidden, with_residual):
    """unit_offset: norm(h) * (1 + weight) in float32, rounded once (Gemma's RMSNorm in transformers);
    hidden 256 is also Gemma 3's per-head q/k norm."""
    torch.manual_seed(3)
    x = torch.randn(7, hidden, device=DEVICE, dtype=dtype)
    res = torch.randn(7, hidden, device=DEVICE, dtype=dtype) if with_residual else None
    w = (0.3 * torch.randn(hidden, device=DEVICE)).to(dtype)
    out, h = triton_ops.rms_norm(x, w, 1e-6, res, unit_offset=True)
    ref_out, ref_h = ops_reference.rms_norm(x, w, 1e-6, res, unit_offset=True)
    assert _rel(out, ref_out) < TOL[dtype] and _rel(h, ref_h) < TOL[dtype]
    hf = ref_h.float()  # transformers' Gemma2RMSNorm.forward, inline
    want = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w.float())).to(dtype)
    assert _rel(out, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [112, 14336, 15360])
def test_gelu_and_mul_matches_reference(dtype, inter):
    """GeGLU (gelu tanh approximation); large gates saturate the tanh without NaN."""
    torch.manual_seed(4)
    x = torch.randn(5, 2 * inter, device=DEVICE, dtype=dtype) * 3
    x[0, :8] = torch.tensor([-80.0, -20.0, -5.0, 0.0, 1e-3, 5.0, 20.0, 80.0], dtype=dtype)
    out = triton_ops.gelu_and_mul(x)
    assert torch.isfinite(out).all()
    assert _rel(out, ops_reference.gelu_and_mul(x)) < TOL[dtype]
