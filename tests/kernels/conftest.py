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
