"""The skip every Triton GPU test module starts with."""

from __future__ import annotations

import os

import pytest
import torch

# Modules that also run under Triton's interpreter: with TRITON_INTERPRET=1 and no GPU, their
# kernels run on CPU tensors.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()
DEV = "cpu" if INTERPRET else "cuda"


def skip_unless_cuda_and_triton(interpreter: bool = False) -> None:
    """Skips the calling test module, with the reason, unless CUDA and Triton are here.
    interpreter: the module runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1)."""
    if not torch.cuda.is_available() and not (interpreter and INTERPRET):
        reason = " (or TRITON_INTERPRET=1 for Triton's interpreter)" if interpreter else ""
        pytest.skip(f"needs CUDA + Triton{reason}: no CUDA device here", allow_module_level=True)
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("needs CUDA + Triton: triton is not installed", allow_module_level=True)
