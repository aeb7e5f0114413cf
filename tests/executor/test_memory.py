"""The executor's automatic adapter memory: CPU cache bytes and GPU slots from what is free."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from loraserve.executor import memory, slot_layout
from loraserve.executor.build import resolve_adapter_memory
from loraserve.executor.config import ExecutorConfig
from loraserve.executor.lora import ExpertsWithLoRA, lora_modules
from loraserve.executor.model.config import ModelConfig
from loraserve.executor.model.llama import LlamaForCausalLM
from loraserve.executor.model.moe import build_causal_lm
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


TINY = ModelConfig(
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


TINY_MOE = dataclasses.replace(
    TINY, model_type="mixtral", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, moe_layers=(0,)
)


def tiny_model(dtype=torch.float32, cfg: ModelConfig = TINY, **spec) -> LlamaForCausalLM:
    return build_causal_lm(cfg, LoraSpec(1, 4, dtype, **spec), dtype=dtype, device="cpu")


def test_automatic_max_loras_on_cpu_resizes_the_slot_buffers():
    model = tiny_model()
    modules = lora_modules(model)
    ecfg = ExecutorConfig(max_loras=0, cpu_cache_bytes=0)
    resolve_adapter_memory(ecfg, model, modules)
    assert ecfg.max_loras == memory.CPU_MAX_LORAS and model.lora_spec.max_loras == memory.CPU_MAX_LORAS
    assert all(m.lora_a.shape[0] == memory.CPU_MAX_LORAS for m in modules.values() if m.lora_a is not None)
    assert ecfg.cpu_cache_bytes > 0
    given = ExecutorConfig(max_loras=3, cpu_cache_bytes=1234)
    resolve_adapter_memory(given, model, modules)  # given values stay
    assert (given.max_loras, given.cpu_cache_bytes) == (3, 1234)


def allocated_bytes(model) -> int:
    """Every tensor the model holds (parameters and buffers), whatever allocated it."""
    return sum(t.nbytes for t in (*model.parameters(), *model.buffers()))


SLOT_KINDS = {
    "lora": {},
    "dora": {"dora": True},
    "tokens": {"trainable_tokens": True},
    "dora+tokens": {"dora": True, "trainable_tokens": True},
    "fp8": {"fp8": True},
    "fp8+dora+tokens+embeddings": {"fp8": True, "dora": True, "trainable_tokens": True, "targets_embeddings": True},
    "moe+fp8+dora+tokens": {"cfg": TINY_MOE, "fp8": True, "dora": True, "trainable_tokens": True},
}


@pytest.mark.parametrize("kind", SLOT_KINDS)
def test_slot_bytes_are_the_bytes_each_slot_allocates(kind):
    """memory.slot_bytes, what --max-loras 0 divides by, is what one more slot allocates on the
    model's device: DoRA scales, trainable-token rows and FP8 scales included (the base model's
    row of the [max_loras + 1, ...] buffers is allocated once, not per slot)."""
    model = tiny_model(torch.bfloat16, **SLOT_KINDS[kind])
    modules = lora_modules(model)
    assert any(isinstance(m, ExpertsWithLoRA) for m in modules.values()) == ("moe" in kind)
    per_slot, one = memory.slot_bytes(model), allocated_bytes(model)
    memory.resize_slots(model, modules, 5)
    assert allocated_bytes(model) - one == 4 * per_slot
    assert memory.slot_bytes(model) == per_slot
    parts = memory.slot_parts(model)
    spec = SLOT_KINDS[kind]
    assert (slot_layout.DORA_SCALES in parts) == spec.get("dora", False)
    assert (slot_layout.TOKEN_ROWS in parts) == spec.get("trainable_tokens", False)
    assert (slot_layout.FP8_SCALES in parts) == spec.get("fp8", False)
    assert memory.lora_bytes_per_slot(modules) == per_slot - parts.get(slot_layout.DORA_SCALES, 0) - parts.get(
        slot_layout.TOKEN_ROWS, 0
    )
    if spec.get("trainable_tokens"):  # an int32 table row over the vocab, 64 embedding and 64 lm_head rows (+ ids)
        rows = model.token_rows
        assert parts[slot_layout.TOKEN_ROWS] == 4 * TINY.vocab_size + rows.max_tokens * (2 * 2 * TINY.hidden_size + 8)


def test_dora_and_token_rows_lower_the_automatic_slot_count(monkeypatch, caplog):
    """On CUDA (its free-memory probe stood in for: no GPU here) --max-loras 0 fits fewer slots once
    DoRA scales and token rows are counted, and the log line says what a slot costs, by part."""
    plain = memory.slot_bytes(tiny_model())
    free = 2 * 10 * plain  # SLOT_SHARE 0.5: room for 10 plain LoRA slots
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    counts = {}
    for kind in ("lora", "dora+tokens"):
        model = tiny_model(**SLOT_KINDS[kind])
        cfg = ExecutorConfig(device="cuda", max_loras=0, cpu_cache_bytes=1 << 20)
        with caplog.at_level(logging.INFO, logger="loraserve.executor.build"):
            caplog.clear()
            resolve_adapter_memory(cfg, model, lora_modules(model))
        counts[kind] = cfg.max_loras
        assert model.lora_spec.max_loras == cfg.max_loras
        assert memory.slot_bytes(model) * (cfg.max_loras - 1) <= free * memory.SLOT_SHARE
        assert f"adapters: {cfg.max_loras} GPU slots of {memory.describe_slot(memory.slot_parts(model))} each" in caplog.text
    both = memory.slot_bytes(tiny_model(**SLOT_KINDS["dora+tokens"]))
    assert counts == {"lora": 10, "dora+tokens": 10 * plain // both} and both > plain
    assert "DoRA scales" in caplog.text and "token rows" in caplog.text


def test_negative_adapter_memory_settings_are_refused():
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
