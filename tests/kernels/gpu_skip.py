"""The skip every Triton GPU test module starts with."""

from __future__ import annotations

import pytest
import torch


def skip_unless_cuda_and_triton(interpreter: bool = False) -> None:
    """Skips the calling test module, with the reason, unless CUDA and Triton are here.
    interpreter: the module runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1)."""
    if not interpreter and not torch.cuda.is_available():
        pytest.skip("needs CUDA + Triton: no CUDA device here", allow_module_level=True)
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("needs CUDA + Triton: triton is not installed", allow_module_level=True)
