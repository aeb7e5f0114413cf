"""The small per-layer ops of the decoder in plain PyTorch: the CPU path and the test oracle.

kernels/triton_ops.py fuses each into one kernel with the same signature (eagerly, these ops
are most of a decode step's launches per layer). The arithmetic here is transformers'
(RMSNorm in float32, cast back before the weight; RoPE on the two halves of each head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def kv_scale_error(k_cache: torch.Tensor, k_scale, v_scale) -> str | None:
    """Why an FP8 cache's k_scale / v_scale cannot be what the Triton kernels read (each float32,
    contiguous, [KVH] on the cache's device); None where they can, or the cache is not FP8."""
    if k_cache.dtype != FP8:
        return None
    kvh = k_cache.shape[2]
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            return f"an FP8 KV cache needs {name} ([{kvh}] float32), got None"
        if s.dtype != torch.float32 or tuple(s.shape) != (kvh,) or not s.is_contiguous() or s.device != k_cache.device:
            return (
                f"{name} is {s.dtype} {list(s.shape)} on {s.device}{'' if s.is_contiguous() else ' (not contiguous)'}; "
                f"an FP8 KV cache's scales are contiguous float32 [{kvh}] (one per kv head) on {k_cache.device}"
            )
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, unit_offset: bool = False):
    """(norm(h) * weight, h) with h = x + residual (or x alone when residual is None).

    x, residual: [T, hidden]; weight: [hidden]. The returned h is the next residual stream.
    unit_offset (Gemma): norm(h) * (1 + weight), all in float32 and rounded once, as transformers'
    Gemma RMSNorm does; otherwise norm(h) is rounded to h's dtype before the weight (Llama's).
    """
    h = x if residual is None else x + residual
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (hf * (1.0 + weight.float())).to(h.dtype), h
    return weight * hf.to(h.dtype), h


def rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> torch.Tensor:
    """Rotates q and k (RoPE) and writes k, v to the paged cache. Returns the rotated q [T, H, D].

    q: [T, H, D]; k, v: [T, KVH, D] (views of the fused qkv output are fine); cos, sin: [T, D];
    k_cache, v_cache: [num_blocks, block_size, KVH, D]; slot_mapping: [T] long cache slots.
    A float8_e4m3fn cache with k_scale, v_scale [KVH] float32 gets quantize_kv(k, k_scale) and
    quantize_kv(v, v_scale).
    """
    q = _rotate(q, cos, sin)
    k = _rotate(k, cos, sin)
    if k_cache.dtype == FP8:  # copied as bytes: torch's index_copy_ has no float8 kernel on the CPU
        k, v = quantize_kv(k, k_scale).view(torch.uint8), quantize_kv(v, v_scale).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)
    return q


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, KVH, D] -> float8_e4m3fn x / scale[head] in float32, clamped to ±448 (saturating, never
    inf or NaN for finite x), rounded to nearest."""
    return (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] (gate | up) -> silu(gate) * up, [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] (gate | up) -> gelu(gate, tanh approximation) * up, [T, I] (GeGLU)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T + bias (the base model's projections)."""
    return F.linear(x, weight, bias)


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] float32 -> the argmax of each row [B] int64 (the first of equal maxima) and
    its logprob [B] float32 (the max minus the row's logsumexp)."""
    token_ids = logits.argmax(dim=-1)
    logprobs = logits.gather(1, token_ids[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
    return token_ids, logprobs
