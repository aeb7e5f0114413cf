"""The executor's automatic adapter memory: CPU cache bytes and GPU slots from what is free."""

from __future__ import annotations

import torch

from loraserve.executor import memory
from loraserve.executor.build import resolve_adapter_memory
from loraserve.executor.config import ExecutorConfig
from loraserve.executor.lora import lora_modules
from loraserve.executor.model.config import ModelConfig
from loraserve.executor.model.llama import LlamaForCausalLM
from loraserve.executor.slot_layout import LoraSpec

GIB = 2**30


def test_cpu_cache_default_is_half_the_available_host_memory():
    assert memory.default_cpu_cache_bytes(24 * GIB) == 12 * GIB


def test_max_loras_default_fills_a_share_of_free_gpu_memory_within_bounds():
    per_slot = 320 * 2**20  # Llama-3-8B shapes, rank 64, bf16, all linear layers
    assert memory.default_max_loras(10 * GIB, per_slot) == 16  # half of 10 GiB / 320 MiB
    assert memory.default_max_loras(60 * GIB, per_slot) == memory.MAX_AUTO_LORAS
    assert memory.default_max_loras(100 * 2**20, per_slot) == 1


def test_available_host_bytes_is_positive():
    assert memory.available_host_bytes() > 0


def test_automatic_max_loras_on_cpu_resizes_the_slot_buffers():
    cfg = ModelConfig(
        model_type="llama",
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        rope_scaling=None,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg, LoraSpec(1, 4, torch.float32), dtype=torch.float32, device="cpu")
    modules = lora_modules(model)
    ecfg = ExecutorConfig(max_loras=0, cpu_cache_bytes=0)
    resolve_adapter_memory(ecfg, model, modules)
    assert ecfg.max_loras == memory.CPU_MAX_LORAS and model.lora_spec.max_loras == memory.CPU_MAX_LORAS
    assert all(m.lora_a.shape[0] == memory.CPU_MAX_LORAS for m in modules.values() if m.lora_a is not None)
    assert ecfg.cpu_cache_bytes > 0
    given = ExecutorConfig(max_loras=3, cpu_cache_bytes=1234)
    resolve_adapter_memory(given, model, modules)  # given values stay
    assert (given.max_loras, given.cpu_cache_bytes) == (3, 1234)


def test_negative_adapter_memory_settings_are_refused():
    import pytest

    with pytest.raises(
        ValueError, match=r"^max_loras, cpu_cache_bytes and max_cpu_adapters must be 0 \(automatic / no limit\) or more$"
    ):
        ExecutorConfig(cpu_cache_bytes=-1)


def test_a_cgroup_limit_bounds_the_available_host_memory(tmp_path):
    (tmp_path / "memory.max").write_text("1073741824\n")
    (tmp_path / "memory.current").write_text("268435456\n")
    assert memory.cgroup_bytes_left(str(tmp_path)) == 768 * 2**20
    (tmp_path / "memory.max").write_text("max\n")
    assert memory.cgroup_bytes_left(str(tmp_path)) is None
    assert memory.cgroup_bytes_left(str(tmp_path / "absent")) is None


def test_reclaimable_page_cache_counts_as_available_in_a_cgroup(tmp_path):
    """memory.current counts the page cache of files the pod read (its model); the kernel drops the
    inactive part before it would OOM-kill, so it must not shrink the automatic cache and arena."""
    (tmp_path / "memory.max").write_text("1073741824\n")
    (tmp_path / "memory.current").write_text("805306368\n")  # 768 MiB, 512 MiB of it page cache
    (tmp_path / "memory.stat").write_text("anon 268435456\nfile 536870912\nactive_file 0\ninactive_file 536870912\n")
    assert memory.cgroup_bytes_left(str(tmp_path)) == 768 * 2**20
    (tmp_path / "memory.stat").write_text("anon 805306368\n")  # no inactive_file field: nothing subtracted
    assert memory.cgroup_bytes_left(str(tmp_path)) == 256 * 2**20
