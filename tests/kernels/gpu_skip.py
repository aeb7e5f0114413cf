"""The skip every Triton GPU test module starts with."""

from __future__ import annotations

import os

import pytest
import torch

# Modules that also run under Triton's interpreter: with TRITON_INTERPRET=1 and no GPU, their
# kernels run on CPU tensors.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()
DEV = "cpu" if INTERPRET else "cuda"


def fix_interpreter_scalars() -> None:
    """Lets Triton 3.6's interpreter run on NumPy >= 2.4. It hands a kernel's scalars around as
    one-element arrays and turns them into Python ints with int(array), which NumPy 2.4 refuses for
    arrays of one dimension (triton-lang/triton#9171): every `tl.range` over a loaded bound failed.
    Wraps the interpreter's patching of tl.tensor so that conversion squeezes first; once per process,
    a no-op without triton or without the interpreter."""
    if not INTERPRET:
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = interpreter._patch_lang_tensor
    if getattr(patch, "squeezes_scalars", False):
        return

    def patch_lang_tensor(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor.squeezes_scalars = True
    interpreter._patch_lang_tensor = patch_lang_tensor


def skip_unless_cuda_and_triton(interpreter: bool = False) -> None:
    """Skips the calling test module, with the reason, unless CUDA and Triton are here.
    interpreter: the module runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1)."""
    if not interpreter and not torch.cuda.is_available():
        pytest.skip("needs CUDA + Triton: no CUDA device here", allow_module_level=True)
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("needs CUDA + Triton: triton is not installed", allow_module_level=True)
    fix_interpreter_scalars()
