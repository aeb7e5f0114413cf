"""The FP8 KV cache in the Triton kernels: float8_e4m3fn keys and values with one float32 scale per kv
head, read by the paged decode and prefill kernels (the Gemma window and soft-cap variants too) and
written by rope_and_cache.

Under Triton's interpreter (TRITON_INTERPRET=1, no GPU: `make test`'s second pass) with float32
queries, against the float64 reference on the dequantized cache (fp8 * scale): relative error below
1e-5, the float32 kernels' own bound (test_attention_interpreter.py). On a CUDA GPU with bf16 queries,
against the bf16 kernel on the same dequantized values (rounded to bf16, 2^-9 relative): below 1e-2,
the bf16 kernels' bound against float64 (test_attention_gpu.py). Under the interpreter its float32 ->
FP8 conversion is torch's round to nearest even, as the GPU's (conftest's interpreter_fp8_rounding:
Triton 3.6's own loses the carry into the next power of two).
"""

from __future__ import annotations

import pytest
import torch

from .gpu_skip import DEV, INTERPRET, skip_unless_cuda_and_triton
from .test_attention_reference import build_case

skip_unless_cuda_and_triton(interpreter=True)

from loraserve.kernels import attention_reference, ops_reference, triton_attention, triton_ops  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("interpreter_attention", "interpreter_fp8_rounding")]

FP8 = torch.float8_e4m3fn
DTYPE = torch.float32 if INTERPRET else torch.bfloat16
TOL = 1e-5 if INTERPRET else 1e-2


def _quantize(cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[N, bs, KVH, D] float (NaN rows stay NaN) -> FP8 cache / scale[head], saturated at ±448."""
    return (cache / scale[:, None]).clamp(-448, 448).to(FP8)


def _fp8_case(gen, seq_lens, q_lens, heads, kv_heads, head_dim, window):
    """build_case's paged inputs with an FP8 cache (per-head scales from each head's max |value|,
    one head's halved so that it saturates), and the dequantized float32 cache."""
    case = build_case(gen, seq_lens, q_lens, heads, kv_heads, head_dim, 16, window)
    out = {"q": case["q"].to(DEV, DTYPE), "block_tables": case["block_tables"].to(DEV), "seq_lens": case["seq_lens"].to(DEV)}
    out["cu_query_lens"], out["max_query_len"] = case["cu_query_lens"].to(DEV), case["max_query_len"]
    for kind in ("k", "v"):
        cache = case[f"{kind}_cache"]
        amax = cache.nan_to_num(0).abs().amax(dim=(0, 1, 3))  # [KVH]
        scale = amax / 448 * torch.linspace(0.5, 1.5, kv_heads)
        fp8 = _quantize(cache, scale)
        out[f"{kind}_fp8"], out[f"{kind}_scale"] = fp8.to(DEV), scale.to(DEV)
        out[f"{kind}_deq"] = (fp8.float() * scale[:, None]).to(DEV)
    return out


def _rel(got, want) -> float:
    assert not got.isnan().any(), "NaN: a masked cache row was read or an element left unwritten"
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _want(fn, c, **kw):
    """The same call on the dequantized cache: float64 reference (interpreter) or the bf16 kernel (CUDA)."""
    if INTERPRET:
        q, k, v = c["q"].double(), c["k_deq"].double(), c["v_deq"].double()
        return getattr(attention_reference, fn)(q, k, v, **kw)
    return getattr(triton_attention, fn)(c["q"], c["k_deq"].to(DTYPE), c["v_deq"].to(DTYPE), **kw)


@pytest.mark.parametrize("heads, head_dim", [((4, 2), 128), ((8, 2), 32), ((4, 4), 256)])
@pytest.mark.parametrize("window, softcap", [(None, None), (5, 1.0), (100, 50.0)])
def test_fp8_cache_attention_is_the_attention_on_its_dequantized_values(heads, head_dim, window, softcap):
    gen = torch.Generator().manual_seed(head_dim + (window or 0))
    scale = 4 * head_dim**-0.5
    kw = dict(scale=scale, sliding_window=window, softcap=softcap)
    c = _fp8_case(gen, [3, 40, 9, 70], [3, 5, 1, 33], *heads, head_dim, window)
    paged = dict(block_tables=c["block_tables"], seq_lens=c["seq_lens"])
    prefill = dict(paged, cu_query_lens=c["cu_query_lens"], max_query_len=c["max_query_len"])
    got = triton_attention.paged_prefill_attention(
        c["q"], c["k_fp8"], c["v_fp8"], **prefill, **kw, k_scale=c["k_scale"], v_scale=c["v_scale"]
    )
    assert _rel(got, _want("paged_prefill_attention", c, **prefill, **kw)) < TOL

    d = _fp8_case(gen, [3, 17, 9, 200], [1] * 4, *heads, head_dim, window)
    paged = dict(block_tables=d["block_tables"], seq_lens=d["seq_lens"])
    got = triton_attention.paged_decode_attention(
        d["q"], d["k_fp8"], d["v_fp8"], **paged, **kw, k_scale=d["k_scale"], v_scale=d["v_scale"]
    )
    assert _rel(got, _want("paged_decode_attention", d, **paged, **kw)) < TOL


def test_the_fp8_kernels_run_in_triton_not_on_the_reference(monkeypatch):
    """An FP8 cache with its scales is a shape the kernels take: a fallback to the reference fails."""
    for name in ("paged_decode_attention", "paged_prefill_attention"):
        monkeypatch.setattr(attention_reference, name, lambda *a, _n=name, **k: pytest.fail(f"{_n} fell back"))
    gen = torch.Generator().manual_seed(0)
    c = _fp8_case(gen, [20, 33], [1, 1], 4, 2, 64, None)
    args = (c["q"], c["k_fp8"], c["v_fp8"], c["block_tables"], c["seq_lens"])
    triton_attention.paged_decode_attention(*args, 0.125, k_scale=c["k_scale"], v_scale=c["v_scale"])
    triton_attention.paged_prefill_attention(
        *args, c["cu_query_lens"], c["max_query_len"], 0.125, k_scale=c["k_scale"], v_scale=c["v_scale"]
    )


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (32, 8, 128)])
def test_rope_and_cache_quantizes_keys_and_values_into_an_fp8_cache(heads, kv_heads, head_dim):
    """k: RoPE in float32, then / scale, rounded to nearest: one FP8 step at most from the reference
    run on float32 operands; v: the reference's exactly under the
    interpreter, within one FP8 step on a GPU (its float32 division may differ in the last bit). A
    value past ±448 * scale saturates to ±448, never inf or NaN."""
    torch.manual_seed(1)
    tokens, num_blocks, block_size = 11, 6, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=DEV, dtype=DTYPE)
    qkv[3, (heads + kv_heads) * head_dim] = 1e4  # a v element far past its head's range
    q, k, v = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    q, k, v = q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim), v.view(-1, kv_heads, head_dim)
    pos = torch.randint(0, 500, (tokens,), device=DEV).float()
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=DEV).float() / head_dim))
    emb = torch.cat([pos[:, None] * inv] * 2, dim=-1)
    cos, sin = emb.cos().to(DTYPE), emb.sin().to(DTYPE)
    slots = torch.randperm(num_blocks * block_size, device=DEV)[:tokens]
    k_scale = torch.linspace(0.005, 0.02, kv_heads, device=DEV)
    v_scale = torch.linspace(0.01, 0.03, kv_heads, device=DEV)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    kc, vc = torch.zeros(shape, device=DEV, dtype=FP8), torch.zeros(shape, device=DEV, dtype=FP8)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    out = triton_ops.rope_and_cache(q, k, v, cos, sin, kc, vc, slots, k_scale, v_scale)
    ref = ops_reference.rope_and_cache(q, k, v, cos, sin, kc.clone(), vc.clone(), slots, k_scale, v_scale)
    # the cache against the kernel's arithmetic: RoPE in float32 (the reference rotates in k's dtype, whose
    # rounding of each product, where they cancel, can move the key by more than an FP8 step)
    f32 = (t.float() for t in (q, k, v, cos, sin))
    ops_reference.rope_and_cache(*f32, ref_kc, ref_vc, slots, k_scale, v_scale)
    assert _rel(out, ref) < (1e-6 if INTERPRET else 1e-2)
    for name, got, want in (("k", kc, ref_kc), ("v", vc, ref_vc)):
        step = want.float().abs().clamp(min=2**-6) / 8  # one e4m3 step (3 mantissa bits; subnormals 2^-9)
        off = ((got.float() - want.float()).abs() > step).nonzero().tolist()
        assert not off, f"{name}: {len(off)} cache elements more than one FP8 step from the reference, " + ", ".join(
            f"at {tuple(i)} {got[tuple(i)].item()} (reference {want[tuple(i)].item()})" for i in off[:6]
        )
    if INTERPRET:
        torch.testing.assert_close(vc.float(), ref_vc.float(), atol=0, rtol=0)
    assert torch.isfinite(vc.float()).all() and vc.float().abs().max() == 448


def _scale_cases(kv_heads):
    """(label, bad k_scale, message) for an FP8 cache of kv_heads heads: scales the kernels cannot read."""
    good = torch.full((kv_heads,), 0.01, device=DEV)
    want = rf"an FP8 KV cache's scales are contiguous float32 \[{kv_heads}\]"
    return [
        ("none", None, rf"an FP8 KV cache needs k_scale \(\[{kv_heads}\] float32\), got None"),
        ("dtype", good.half(), rf"k_scale is torch.float16 \[{kv_heads}\] .*; {want}"),
        ("shape", torch.full((1,), 0.01, device=DEV), rf"k_scale is torch.float32 \[1\] .*; {want}"),
        ("strided", torch.full((2 * kv_heads,), 0.01, device=DEV)[::2], rf"\(not contiguous\); {want}"),
    ]


@pytest.mark.parametrize("case", range(4), ids=["none", "dtype", "shape", "strided"])
def test_fp8_cache_scales_the_kernels_cannot_read_are_refused_naming_them(case):
    """k_scale / v_scale of an FP8 cache must be float32, contiguous, [KVH]: anything else is a
    ValueError from the attention kernels and rope_and_cache, never a silent reference fallback."""
    gen = torch.Generator().manual_seed(0)
    c = _fp8_case(gen, [20, 33], [1, 1], 4, 2, 64, None)
    _, bad, match = _scale_cases(2)[case]
    args = (c["q"], c["k_fp8"], c["v_fp8"], c["block_tables"], c["seq_lens"])
    with pytest.raises(ValueError, match=match):
        triton_attention.paged_decode_attention(*args, 0.125, k_scale=bad, v_scale=c["v_scale"])
    with pytest.raises(ValueError, match=match):
        triton_attention.paged_prefill_attention(
            *args, c["cu_query_lens"], c["max_query_len"], 0.125, k_scale=bad, v_scale=c["v_scale"]
        )
    q = torch.randn(3, 4, 64, device=DEV, dtype=DTYPE)
    k = v = torch.randn(3, 2, 64, device=DEV, dtype=DTYPE)
    cos = sin = torch.ones(3, 64, device=DEV, dtype=DTYPE)
    slots = torch.arange(3, device=DEV)
    kc, vc = torch.zeros(2, 4, 2, 64, device=DEV, dtype=FP8), torch.zeros(2, 4, 2, 64, device=DEV, dtype=FP8)
    with pytest.raises(ValueError, match=match):
        triton_ops.rope_and_cache(q, k, v, cos, sin, kc, vc, slots, bad, c["v_scale"])
