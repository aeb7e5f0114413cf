"""Fixtures of the Triton kernel tests."""

from __future__ import annotations

import pytest

from .gpu_skip import INTERPRET

INTERPRETER_SMS = 4  # few programs: the persistent loops take several tiles each


@pytest.fixture
def interpreter_device(monkeypatch):
    """Under Triton's interpreter (CPU tensors, no CUDA to ask): the shipped H100 table for the
    configs and a small SM count for the grid sizes. Nothing on a GPU."""
    if INTERPRET:
        from loraserve.kernels import triton_lora, tuning

        monkeypatch.setitem(tuning._gpu_keys, None, "nvidia_h100_80gb_hbm3")
        monkeypatch.setattr(triton_lora, "num_sms", lambda index: INTERPRETER_SMS)


@pytest.fixture
def no_reference_fallback(monkeypatch):
    """For checks of the Triton LoRA kernels: a call that falls back to the reference fails."""
    from loraserve.kernels import triton_lora

    for name in ("lora_shrink", "lora_expand", "lora_embedding_shrink"):
        def refuse(*args, _name=name, **kwargs):
            raise AssertionError(f"triton_lora.{_name} fell back to the reference")

        monkeypatch.setattr(triton_lora.reference, name, refuse)
