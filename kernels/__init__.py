"""LoRA shrink/expand kernels: Triton on CUDA, the plain-PyTorch reference elsewhere.

`import loraserve.kernels` works with no GPU and no Triton installed: Triton is imported
only when a CUDA tensor first asks for it.
"""

from __future__ import annotations

import torch

from . import reference
from .meta import LoraMeta, make_lora_meta

__all__ = ["LoraMeta", "make_lora_meta", "lora_shrink", "lora_expand", "lora_embedding_shrink"]

_triton = None


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
