"""The start-up warm-up's steps (executor/engine/warmup.py): the token counts they cover, that they
fit the KV cache and max_model_len, and that serving after them gives what serving without them does
(what they leave in the cache is never read)."""

from __future__ import annotations

import pytest
import torch

from loraserve import kernels
from loraserve.executor.engine.kv_cache import KVCache
from loraserve.executor.engine.step import StepInputs, forward_step
from loraserve.executor.engine.warmup import token_ladder, warm_up, warm_up_steps
from loraserve.executor.lora import lora_modules
from loraserve.executor.model.loader import load_model
from loraserve.executor.slot_layout import LoraSpec

from .conftest import b_packed


def test_the_ladder_has_two_token_counts_per_octave_the_tuned_ones_and_the_largest():
    assert token_ladder(100) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 100]
    assert token_ladder(40, tuned=(17, 255, 0)) == [1, 2, 3, 4, 6, 8, 12, 16, 17, 24, 32, 40]
    assert token_ladder(1) == [1]


def test_every_step_fits_the_cache_and_max_model_len_and_holds_its_token_count():
    steps = warm_up_steps(
        max_tokens=300, max_model_len=128, block_size=16, num_blocks=20, max_loras=2, vocab_size=50, tuned=(17,)
    )
    first, ladder = steps[0], steps[1:]
    assert first.query_lens == [32] and first.context_lens == [0] and first.sample_rows == [31]
    counts = [len(s.input_ids) for s in ladder]
    # 300 tokens need 3 prefill sequences (128 + 128 + 43) = 1 + 8 + 8 + 3 blocks + the first's 3: too many
    # for 20 blocks; the rest fit.
    assert counts == [t for t in token_ladder(300, (17,)) if t <= 256]
    for step in ladder:
        assert sum(step.query_lens) == len(step.input_ids) == len(step.token_slots)
        assert step.query_lens[0] == 1 and step.context_lens[0] == 32  # the first sequence's decode row
        assert max(step.query_lens) <= 128 and all(c == 0 for c in step.context_lens[1:])
        blocks = [b for table in step.block_tables for b in table]
        assert (
            max(step.input_ids) < 50 and max(blocks) < 20 and len(set(blocks[3:])) == len(blocks) - 3
        )  # only the first's are shared
        for q, c, table in zip(step.query_lens, step.context_lens, step.block_tables):
            assert len(table) * 16 >= q + c
        assert step.sample_rows == [sum(step.query_lens[: i + 1]) - 1 for i in range(len(step.query_lens))]
        assert set(step.token_slots) == ({0, -1} if len(step.input_ids) > 1 else {0})
    no_lora = warm_up_steps(max_tokens=8, max_model_len=128, block_size=16, num_blocks=20, max_loras=0, vocab_size=50)
    assert all(set(s.token_slots) == {-1} for s in no_lora)


def test_serving_after_the_warm_up_equals_serving_without_it(hf_model):
    _, path = hf_model("llama")
    model = load_model(path, lora=LoraSpec(max_loras=2, max_rank=8, dtype=torch.float32))
    cfg = model.cfg
    prompt = list(range(5, 45))  # 40 tokens: 3 blocks of 16, the warm-up's blocks 0-2 reused

    def serve(kv: KVCache) -> torch.Tensor:
        step = StepInputs(prompt, [40], [0], [[0, 1, 2]], [-1] * 40, [39], [-1])
        first = forward_step(model, kv, step, 2, torch.device("cpu"))
        step = StepInputs([int(first.argmax())], [1], [40], [[0, 1, 2]], [-1], [0], [-1])
        return torch.cat([first, forward_step(model, kv, step, 2, torch.device("cpu"))])

    def cache() -> KVCache:
        return KVCache(cfg.num_layers, 24, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")

    want = serve(cache())
    used = cache()
    steps = warm_up_steps(max_tokens=96, max_model_len=64, block_size=16, num_blocks=24, max_loras=2, vocab_size=cfg.vocab_size)
    ran = []
    seconds = warm_up(lambda s: ran.append(forward_step(model, used, s, 2, torch.device("cpu"))), steps, torch.device("cpu"))
    assert len(ran) == len(steps) and seconds >= 0
    assert any(c.abs().sum() > 0 for c in used.k_cache)  # the warm-up wrote into the cache
    torch.testing.assert_close(serve(used), want, rtol=0, atol=0)


def test_the_warm_up_runs_every_lora_module_s_kernels_though_no_slot_holds_an_adapter(hf_model, monkeypatch):
    """At start no slot targets any module, so a normal step would skip every LoRA kernel: the
    warm-up's steps run them over whole slots (as a captured graph does), and change no slot."""
    _, path = hf_model("llama")
    model = load_model(path, lora=LoraSpec(max_loras=2, max_rank=8, dtype=torch.float32))
    cfg, modules = model.cfg, lora_modules(model)
    kv = KVCache(cfg.num_layers, 24, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    calls = {"shrink": 0, "expand": 0}
    for op in calls:
        real = getattr(kernels, f"lora_{op}")
        monkeypatch.setattr(
            kernels, f"lora_{op}", lambda *a, _real=real, _op=op, **k: calls.__setitem__(_op, calls[_op] + 1) or _real(*a, **k)
        )
    steps = warm_up_steps(max_tokens=8, max_model_len=64, block_size=16, num_blocks=24, max_loras=2, vocab_size=cfg.vocab_size)
    assert all(s.every_slot for s in steps)
    forward_step(model, kv, steps[1], 2, torch.device("cpu"))  # the ladder's first step: 1 token on slot 0
    per_step = len(modules)  # every module: qkv, o, gate_up, down of each layer
    assert calls == {"shrink": per_step, "expand": per_step}
    warm_up(lambda s: forward_step(model, kv, s, 2, torch.device("cpu")), steps, torch.device("cpu"))
    assert all(m.slot_ranks == [0, 0] for m in modules.values())
    # the same step as the engine's own batches make it (no every_slot): every module skipped
    calls.update(shrink=0, expand=0)
    steps[1].every_slot = False
    forward_step(model, kv, steps[1], 2, torch.device("cpu"))
    assert calls == {"shrink": 0, "expand": 0}


def test_the_warm_up_reads_packed_b_slots_at_the_slot_rank(hf_model, monkeypatch):
    """With B packed (CUDA's layout) the expand reads each slot at the rank the step gives it: the warm-up's
    steps give every slot the slot rank (packed_rank), so the packed expand runs (and on CUDA is
    built) before serving; without the ranks it would have none to read at."""
    _, path = hf_model("llama")
    with b_packed():
        model = load_model(path, lora=LoraSpec(max_loras=2, max_rank=16, dtype=torch.float32))
    cfg = model.cfg
    kv = KVCache(cfg.num_layers, 24, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    packed = []
    real = kernels.lora_expand
    monkeypatch.setattr(kernels, "lora_expand", lambda *a, **k: packed.append(k.get("packed")) or real(*a, **k))
    steps = warm_up_steps(
        max_tokens=8, max_model_len=64, block_size=16, num_blocks=24, max_loras=2, vocab_size=cfg.vocab_size, packed_rank=16
    )
    assert all(s.slot_ranks == [16, 16] for s in steps)
    warm_up(lambda s: forward_step(model, kv, s, 2, torch.device("cpu")), steps, torch.device("cpu"))
    assert packed and all(packed)
    steps = warm_up_steps(
        max_tokens=8, max_model_len=64, block_size=16, num_blocks=24, max_loras=2, vocab_size=cfg.vocab_size
    )  # no slot ranks
    with pytest.raises(ValueError, match="slot_ranks"):
        forward_step(model, kv, steps[1], 2, torch.device("cpu"))
