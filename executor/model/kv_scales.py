"""FP8 KV cache (`--kv-cache-dtype fp8`): the checkpoint's K and V scales, and where the cache can hold FP8.

The cache holds float8_e4m3fn keys and values with one float32 scale per (layer, kv head) for K and
one for V: the real value is fp8 * scale. A write stores x / scale rounded to nearest and clamped to
±448 (values beyond ±448 * scale saturate, never inf or NaN); a read multiplies by the scale inside
the attention kernels (kernels/attention_reference.py, kernels/triton_attention.py).

Scales come from the checkpoint where it carries them: compressed-tensors' `kv_cache_scheme` in
config.json's quantization_config (llm-compressor writes `model.layers.N.self_attn.k_scale` and
`v_scale` per attention layer, one value per tensor, broadcast over the heads, or one per kv head;
its older releases named the same scales `k_proj.output_scale` / `v_proj.output_scale`, the K / V
projections' outputs' scale, read alike), or AutoFP8's `"kv_cache_scheme": "static"` (quant_method
fp8 only; it stores each layer's scales as `k_proj.output_scale` / `v_proj.output_scale`, one value
per tensor); a multimodal checkpoint's language-model prefix is the loader's,
checkpoint_names.text_model_name. Without them every scale is 1.0.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from .checkpoint_names import text_model_name

FP8 = torch.float8_e4m3fn
KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the model's compute dtype
# a layer's K or V cache scale, as a text model's name: `k_scale`, or `k_proj.output_scale` (AutoFP8's, llm-compressor's older releases')
_KV_SCALE = re.compile(r"model\.layers\.(\d+)\.self_attn\.(?:([kv])_scale|([kv])_proj\.output_scale)")
_STRATEGIES = ("tensor", "attn_head")  # one scale per tensor, or one per kv head


def cache_dtype(kv_cache_dtype: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The KV cache tensors' dtype for --kv-cache-dtype."""
    return FP8 if kv_cache_dtype == "fp8" else compute_dtype


def kv_cache_dtype_error(kv_cache_dtype: str, device) -> str | None:
    """Why the KV cache cannot hold `kv_cache_dtype` on `device`; None where it can. The CPU converts
    to and from float8_e4m3fn (torch), CUDA GPUs of compute capability 8.9+ in the Triton kernels."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        return f"kv_cache_dtype {kv_cache_dtype!r} is not supported; supported: {KV_CACHE_DTYPES}"
    device = torch.device(device)
    if kv_cache_dtype == "fp8" and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            return (
                f"--kv-cache-dtype fp8 needs a GPU with FP8 conversions: {device} is compute capability "
                f"{capability[0]}.{capability[1]} (8.9+ has them)"
            )
    return None


def kv_cache_scheme(quantization_config: dict[str, Any] | None) -> bool:
    """Whether a quantization_config carries a kv_cache_scheme (K/V scales in the checkpoint):
    compressed-tensors' object, or AutoFP8's "static" (quant_method fp8 only: FP8, one scale per
    tensor); ValueError naming any field of it the FP8 cache cannot take."""
    q = quantization_config or {}
    scheme = q.get("kv_cache_scheme")
    if not scheme:
        return False
    where = "quantization_config kv_cache_scheme"
    if scheme == "static":
        if q.get("quant_method") != "fp8":
            raise ValueError(
                f"{where} 'static' is AutoFP8's and needs quant_method fp8, not {q.get('quant_method')!r}; "
                "compressed-tensors writes kv_cache_scheme as an object (num_bits, type, strategy, ...)"
            )
        return True
    if not isinstance(scheme, dict):
        raise ValueError(f"{where} {scheme!r}: expected an object (num_bits, type, strategy, ...)")
    if (scheme.get("num_bits"), scheme.get("type")) != (8, "float"):
        raise ValueError(
            f"{where}: num_bits {scheme.get('num_bits')!r} type {scheme.get('type')!r} is not supported; "
            "only num_bits 8 type float (FP8)"
        )
    if scheme.get("strategy", "tensor") not in _STRATEGIES:
        raise ValueError(f"{where}: strategy {scheme.get('strategy')!r} is not supported; supported: {_STRATEGIES}")
    if scheme.get("dynamic"):
        raise ValueError(f"{where}: dynamic scales are not supported (the cache's scales are static)")
    if not scheme.get("symmetric", True):
        raise ValueError(f"{where}: asymmetric scales (zero points) are not supported")
    return True


def kv_scale_of(name: str) -> tuple[int, int] | None:
    """(layer, 0 for K / 1 for V) of a checkpoint tensor that is an attention layer's K or V cache
    scale (`model.layers.N.self_attn.k_scale` or `...k_proj.output_scale`, under any language-model
    prefix the loader takes); None for any other tensor."""
    m = _KV_SCALE.fullmatch(text_model_name(name))
    return None if m is None else (int(m.group(1)), "kv".index(m.group(2) or m.group(3)))


def is_kv_scale(name: str) -> bool:
    """A checkpoint tensor that is an attention layer's K or V cache scale (`kv_scale_of`)."""
    return kv_scale_of(name) is not None


def read_kv_scales(meta: dict[str, tuple[str, list[int]]], read_tensor, num_layers: int, num_kv_heads: int, heads: slice):
    """[num_layers, 2 (K, V), this rank's kv heads] float32 from the checkpoint's k_scale / v_scale
    (or k_proj / v_proj.output_scale):
    each one value (broadcast over the heads) or one per kv head, cut to `heads`. ValueError naming
    the tensor that is missing, not floating point, shaped otherwise, not finite or not positive, or
    given twice (under two names, `kv_scale_of`)."""
    found: dict[tuple[int, int], str] = {}
    for n in meta:
        if (key := kv_scale_of(n)) is None:
            continue
        if key[0] >= num_layers:
            raise ValueError(f"checkpoint tensor {n!r} is a KV cache scale of a layer the model does not have")
        if key in found:
            first, second = sorted((found[key], n))
            raise ValueError(f"checkpoint tensors {first!r} and {second!r} are both layer {key[0]}'s {'KV'[key[1]]} cache scale")
        found[key] = n
    out = torch.empty(num_layers, 2, heads.stop - heads.start, dtype=torch.float32)
    for layer in range(num_layers):
        for i, kind in enumerate("kv"):
            name = found.get((layer, i))
            if name is None:
                names = (
                    f"model.layers.{layer}.self_attn.{kind}_scale",
                    f"model.layers.{layer}.self_attn.{kind}_proj.output_scale",
                )
                raise ValueError(
                    f"checkpoint tensor {names[0]!r} (or {names[1]!r}) is missing (kv_cache_scheme in quantization_config)"
                )
            dtype, shape = meta[name]
            if dtype not in ("F32", "F16", "BF16", "F64"):
                raise ValueError(f"checkpoint tensor {name!r} is {dtype}; KV cache scales must be floating point")
            if math.prod(shape) not in (1, num_kv_heads):
                raise ValueError(
                    f"checkpoint tensor {name!r} is {list(shape)}; a KV cache scale is one value or one per kv head "
                    f"({num_kv_heads})"
                )
            value = read_tensor(name).float().reshape(-1)
            if not torch.isfinite(value).all():
                raise ValueError(f"checkpoint tensor {name!r} holds NaN or infinite KV cache scales")
            if (value <= 0).any():
                raise ValueError(f"checkpoint tensor {name!r} holds KV cache scales that are not positive")
            out[layer, i] = value.expand(num_kv_heads)[heads]
    return out
