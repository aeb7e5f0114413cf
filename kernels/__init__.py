"""LoRA shrink/expand, paged attention, fused MoE, slot-load and DoRA-norm kernels: Triton on CUDA,
the plain-PyTorch reference elsewhere.

`import loraserve.kernels` works with no GPU and no Triton installed: Triton is imported
only when a CUDA tensor first asks for it.
"""

from __future__ import annotations

import importlib

import torch

from . import attention_reference, copy_reference, dora_reference, fp8_reference, moe_reference, ops_reference, reference
from .meta import LoraMeta, make_lora_meta

__all__ = [
    "LoraMeta",
    "make_lora_meta",
    "lora_shrink",
    "lora_expand",
    "lora_embedding_shrink",
    "moe_route",
    "fused_moe",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rope_and_cache",
    "silu_and_mul",
    "gelu_and_mul",
    "linear",
    "fp8_linear",
    "greedy",
    "slot_scatter",
    "dora_norm",
]

_CUDA_MODULES: dict[str, object] = {}  # fast-path module name -> the module (or its reference)


def _on_device(t: torch.Tensor, name: str, reference_module):
    """The module that implements `name`'s ops for tensors on t's device: the Triton module
    `name` on CUDA (imported on first use; the reference if Triton is missing), else the reference."""
    if t.device.type != "cuda":
        return reference_module
    module = _CUDA_MODULES.get(name)
    if module is None:
        try:
            module = importlib.import_module(f".{name}", __name__)
        except ImportError:  # no Triton: stay correct on the reference
            module = reference_module
        _CUDA_MODULES[name] = module
    return module


def _impl(t: torch.Tensor):
    return _on_device(t, "triton_lora", reference)


def lora_shrink(x, lora_a, meta: LoraMeta, out=None, ranked: bool = True, pdl: bool = False, scale=None):
    """pdl: launch as a programmatic dependent at decode on CUDA (kernels/triton_lora.py says what
    the caller promises); the reference ignores it. scale: FP8 slots' A scales (reference.py)."""
    impl = _impl(x)
    if pdl and impl is not reference:
        return impl.lora_shrink(x, lora_a, meta, out, ranked, pdl=True, scale=scale)
    return impl.lora_shrink(x, lora_a, meta, out, ranked, scale=scale)


def lora_expand(
    y, buf, lora_b, slice_offsets, meta: LoraMeta, ranked: bool = True, pdl: bool = False, packed: bool = False, scale=None
):
    """pdl: as in lora_shrink. packed: each slot's B packed at its rank (triton_lora.lora_expand).
    scale: FP8 slots' B scales (reference.py)."""
    impl = _impl(y)
    if pdl and impl is not reference:
        return impl.lora_expand(y, buf, lora_b, slice_offsets, meta, ranked, pdl=True, packed=packed, scale=scale)
    return impl.lora_expand(y, buf, lora_b, slice_offsets, meta, ranked, packed=packed, scale=scale)


def lora_embedding_shrink(token_ids, lora_a, meta: LoraMeta, out=None):
    return _impl(lora_a).lora_embedding_shrink(token_ids, lora_a, meta, out)


def dora_norm(weight, weight_scale, a, b, offsets, magnitude, scale_out=None, sq_out=None) -> None:
    """DoRA's per-slot output scale (or a row-parallel layer's partial sums) from a layer's weight and
    an adapter's A and B: see kernels/dora_reference.py for the math and shapes."""
    impl = _on_device(weight, "triton_dora", dora_reference)
    impl.dora_norm(weight, weight_scale, a, b, offsets, magnitude, scale_out, sq_out)


def moe_route(router_logits, top_k: int, renormalize: bool):
    """router_logits [T, E] -> (topk_weights [T, K] float32, topk_ids [T, K]): plain tensor ops everywhere."""
    return moe_reference.moe_route(router_logits, top_k, renormalize)


def fused_moe(x, topk_weights, topk_ids, w13, w2, lora13, lora2, meta: LoraMeta | None, w13_scale=None, w2_scale=None):
    """Routed experts with each token's expert LoRA: see kernels/moe_reference.py for the math and shapes
    (FP8 experts: w13_scale / w2_scale, one float32 scale per expert's output row)."""
    impl = _on_device(x, "triton_moe", moe_reference)
    return impl.fused_moe(x, topk_weights, topk_ids, w13, w2, lora13, lora2, meta, w13_scale, w2_scale)


def _attention_impl(t: torch.Tensor):
    return _on_device(t, "triton_attention", attention_reference)


def paged_decode_attention(
    q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window=None, out=None, softcap=None, k_scale=None, v_scale=None
):
    """One query per sequence over its paged K/V: see kernels/attention_reference.py for the shapes.
    sliding_window, softcap: the layer's (host constants: a captured graph bakes them in).
    k_scale, v_scale: [KVH] float32 device tensors of a float8_e4m3fn cache; None otherwise."""
    return _attention_impl(q).paged_decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, out, softcap=softcap, k_scale=k_scale, v_scale=v_scale
    )


def paged_prefill_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    cu_query_lens,
    max_query_len,
    scale,
    sliding_window=None,
    out=None,
    work=None,
    softcap=None,
    k_scale=None,
    v_scale=None,
):
    """Variable-length causal queries over paged K/V: see kernels/attention_reference.py for the shapes.
    work: the Triton kernel's work list (kernels/attention_plan.py), for captured steps.
    k_scale, v_scale: as in paged_decode_attention."""
    return _attention_impl(q).paged_prefill_attention(
        q, k_cache, v_cache, block_tables, seq_lens, cu_query_lens, max_query_len, scale, sliding_window, out, work,
        softcap=softcap, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip


# ---- the decoder's small fused ops (kernels/ops_reference.py, kernels/triton_ops.py) ----------


def _ops_impl(t: torch.Tensor):
    return _on_device(t, "triton_ops", ops_reference)


def rms_norm(x, weight, eps: float, residual=None, unit_offset: bool = False, quantize: bool = False):
    """(norm(x + residual) * weight, x + residual): see kernels/ops_reference.py.
    unit_offset: Gemma's norm, norm(h) * (1 + weight) in float32, rounded once.
    quantize: also the output's per-token FP8 quantization (q, scale) (fp8_reference.quantize_per_token),
    returned third: an FP8 layer's pre-quantized input (fp8_linear's x_fp8); on CUDA in the norm's kernel."""
    impl = _ops_impl(x)
    if quantize:
        if impl is ops_reference:
            out, h = ops_reference.rms_norm(x, weight, eps, residual, unit_offset)
            return out, h, fp8_reference.quantize_per_token(out)
        return impl.rms_norm(x, weight, eps, residual, unit_offset, quantize=True)
    if unit_offset:
        return impl.rms_norm(x, weight, eps, residual, unit_offset=True)
    return impl.rms_norm(x, weight, eps, residual)


def rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    """RoPE on q and k; k and v written to the paged cache (an FP8 cache's quantized with its k_scale,
    v_scale [KVH]: kernels/ops_reference.py); returns the rotated q."""
    return _ops_impl(q).rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def silu_and_mul(gate_up, quantize: bool = False):
    """[T, 2I] gate | up -> silu(gate) * up [T, I]; quantize: (that, its per-token FP8 quantization
    (q, scale)), as rms_norm's."""
    return _act_and_mul(gate_up, "silu_and_mul", quantize)


def gelu_and_mul(gate_up, quantize: bool = False):
    """[T, 2I] gate | up -> gelu_tanh(gate) * up [T, I] (Gemma's GeGLU); quantize as silu_and_mul's."""
    return _act_and_mul(gate_up, "gelu_and_mul", quantize)


def _act_and_mul(gate_up, name: str, quantize: bool):
    impl = _ops_impl(gate_up)
    if not quantize:
        return getattr(impl, name)(gate_up)
    if impl is ops_reference:
        out = getattr(ops_reference, name)(gate_up)
        return out, fp8_reference.quantize_per_token(out)
    return getattr(impl, name)(gate_up, quantize=True)


def linear(x, weight, bias=None):
    """F.linear; on CUDA at 1-64 tokens the skinny GEMM where the GPU's table lists the shape
    (kernels/triton_linear.py)."""
    return _on_device(x, "triton_linear", ops_reference).linear(x, weight, bias)


def fp8_quantizes_input(tokens: int, dtype: torch.dtype, weight, weight_scale, bias=None) -> bool:
    """Whether fp8_linear quantizes a contiguous x [tokens, K] of `dtype` per token (so the kernel that
    writes x should hand it x_fp8): on CUDA unless the GPU's table gives that call to the skinny GEMM's
    W8A16 build (kernels/triton_fp8.py); elsewhere the reference quantizes x itself (True)."""
    module = _on_device(weight, "triton_fp8", fp8_reference)
    if module is fp8_reference:
        return True
    return module.quantizes_input(tokens, dtype, weight, weight_scale, bias)


def fp8_linear(x, weight, weight_scale, bias=None, x_fp8=None):
    """x [T, K] @ an FP8 weight [N, K].T with per-row weight_scale [N] float32 (+ bias), in x's dtype: x
    quantized per token, float32 accumulation (kernels/fp8_reference.py); on CUDA torch._scaled_mm, or
    at 1-64 tokens where the GPU's table lists the shape the skinny GEMM's W8A16 build (x unquantized:
    closer to x @ (W * scale).T; kernels/triton_fp8.py). x_fp8: x's per-token quantization (q [T, K]
    float8_e4m3fn, scale [T, 1] float32) made already (rms_norm's or an act-and-mul's `quantize`):
    used instead of quantizing x again (unused where the skinny build runs)."""
    return _on_device(x, "triton_fp8", fp8_reference).fp8_linear(x, weight, weight_scale, bias, x_fp8)


def greedy(logits):
    """logits [B, V] float32 -> (argmax [B] int64, its logprob [B] float32): one kernel on CUDA."""
    return _ops_impl(logits).greedy(logits)


# ---- slot loads (kernels/copy_reference.py, kernels/triton_copy.py) ----------------------------


def slot_scatter(plan: copy_reference.ScatterPlan, src, slot: int) -> None:
    """A slot load's copies and zero-fills from the staged shard `src`: one launch on CUDA."""
    if plan.copies:
        _on_device(plan.copies[0].dst, "triton_copy", copy_reference).slot_scatter(plan, src, slot)
