"""Fixtures of the Triton kernel tests."""

from __future__ import annotations

import pytest

from .gpu_skip import INTERPRET

INTERPRETER_SMS = 4  # few programs: the persistent loops take several tiles each


@pytest.fixture
def interpreter_device(request, monkeypatch):
    """Under Triton's interpreter (CPU tensors, no CUDA to ask): the shipped H100 table for the
    configs and an SM count for the grid sizes (the test module's INTERPRETER_SMS, else 4).
    Nothing on a GPU."""
    if INTERPRET:
        from loraserve.kernels import triton_lora, tuning
        from loraserve.kernels.offline_build import H100_TABLE

        sms = getattr(request.module, "INTERPRETER_SMS", INTERPRETER_SMS)
        monkeypatch.setitem(tuning._gpu_keys, None, H100_TABLE)
        monkeypatch.setattr(triton_lora, "num_sms", lambda index: sms)


@pytest.fixture
def interpreter_attention(monkeypatch):
    """Under Triton's interpreter, for the paged attention kernels: a few programs (no GPU to ask for
    its SM count), and loop bounds loaded from memory converted through their single element (the
    interpreter of Triton 3.6 converts them with int() of a one-element array, which numpy 2 refuses)."""
    if INTERPRET:
        import triton.runtime.interpreter as interpreter

        from loraserve.kernels import triton_attention

        patch = interpreter._patch_lang_tensor

        def patched(tensor, scope):
            patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched)
        monkeypatch.setattr(triton_attention, "num_sms", lambda index: 4)


@pytest.fixture
def interpreter_fp8_rounding(monkeypatch):
    """Under Triton's interpreter: float32 -> float8e4nv conversions rounded to nearest even as the GPU
    does (cvt.rn), through torch. The interpreter's own (Triton 3.6) loses the carry of a mantissa that
    rounds up into the next power of two (124 -> 64) and flushes FP8 subnormals to zero."""
    if INTERPRET:
        import numpy as np
        import torch
        import triton.language as tl
        import triton.runtime.interpreter as interpreter

        convert = interpreter._convert_float

        def to_fp8(input, input_dtype, output_dtype, rounding_mode):
            if input_dtype == tl.float32 and output_dtype == tl.float8e4nv:
                values = torch.from_numpy(np.ascontiguousarray(input, dtype=np.float32))
                return values.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
            return convert(input, input_dtype, output_dtype, rounding_mode)

        monkeypatch.setattr(interpreter, "_convert_float", to_fp8)


@pytest.fixture
def interpreter_pdl(monkeypatch):
    """Under Triton's interpreter: programmatic dependent launches taken as on an sm90 GPU, their
    grid dependency controls (gdc_wait, gdc_launch_dependents) run as no-ops: a program runs at a
    time there, so the kernels' numbers and the launches' choices are checked, not the ordering."""
    if INTERPRET:
        import triton.language.extra.cuda as cuda_extra

        from loraserve.kernels import triton_lora

        monkeypatch.setattr(triton_lora, "_pdl_capable", lambda device: True)
        monkeypatch.setattr(cuda_extra, "gdc_wait", lambda: None)
        monkeypatch.setattr(cuda_extra, "gdc_launch_dependents", lambda: None)


@pytest.fixture
def no_reference_fallback(monkeypatch):
    """For checks of the Triton LoRA kernels: a call that falls back to the reference fails."""
    from loraserve.kernels import triton_lora

    for name in ("lora_shrink", "lora_expand", "lora_embedding_shrink"):

        def refuse(*args, _name=name, **kwargs):
            raise AssertionError(f"triton_lora.{_name} fell back to the reference")

        monkeypatch.setattr(triton_lora.reference, name, refuse)
