"""LoRA shrink/expand and paged attention kernels: Triton on CUDA, the plain-PyTorch reference elsewhere.

`import loraserve.kernels` works with no GPU and no Triton installed: Triton is imported
only when a CUDA tensor first asks for it.
"""

from __future__ import annotations

import torch

from . import attention_reference, reference
from .meta import LoraMeta, make_lora_meta

__all__ = [
    "LoraMeta",
    "make_lora_meta",
    "lora_shrink",
    "lora_expand",
    "lora_embedding_shrink",
    "paged_decode_attention",
    "paged_prefill_attention",
]

_triton = None
_triton_attention = None


def _impl(t: torch.Tensor):
    """The module that implements the ops for tensors on t's device."""
    global _triton
    if t.device.type != "cuda":
        return reference
    if _triton is None:
        try:
            from . import triton_lora
        except ImportError:  # no Triton: stay correct on the reference
            triton_lora = reference
        _triton = triton_lora
    return _triton


def lora_shrink(x, lora_a, meta: LoraMeta, out=None):
    return _impl(x).lora_shrink(x, lora_a, meta, out)


def lora_expand(y, buf, lora_b, slice_offsets, meta: LoraMeta):
    return _impl(y).lora_expand(y, buf, lora_b, slice_offsets, meta)


def lora_embedding_shrink(token_ids, lora_a, meta: LoraMeta, out=None):
    return _impl(lora_a).lora_embedding_shrink(token_ids, lora_a, meta, out)


def _attention_impl(t: torch.Tensor):
    """The module that implements paged attention for tensors on t's device."""
    global _triton_attention
    if t.device.type != "cuda":
        return attention_reference
    if _triton_attention is None:
        try:
            from . import triton_attention
        except ImportError:  # no Triton: stay correct on the reference
            triton_attention = attention_reference
        _triton_attention = triton_attention
    return _triton_attention


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window=None, out=None):
    """One query per sequence over its paged K/V: see kernels/attention_reference.py for the shapes."""
    return _attention_impl(q).paged_decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, out
    )


def paged_prefill_attention(
    q, k_cache, v_cache, block_tables, seq_lens, cu_query_lens, max_query_len, scale, sliding_window=None, out=None
):
    """Variable-length causal queries over paged K/V: see kernels/attention_reference.py for the shapes."""
    return _attention_impl(q).paged_prefill_attention(
        q, k_cache, v_cache, block_tables, seq_lens, cu_query_lens, max_query_len, scale, sliding_window, out
    )
