"""Shared fixtures of the executor tests: tiny random HF models saved as safetensors, and a paged runner."""

from __future__ import annotations

import json

import pytest
import torch

from loraserve.executor.engine.kv_cache import AttentionMetadata, BlockAllocator, KVCache
from loraserve.kernels import make_lora_meta

# Small enough for milliseconds per forward on 2 CPU cores; GQA (4 q heads over 2 kv heads).
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    initializer_range=0.1,
)


def _hf_classes(family: str):
    import transformers as tf

    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    }[family]


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory):
    """make(family, **config_overrides) -> (transformers model in eval mode, its save_pretrained dir).

    Biases and norm weights are randomised too (transformers inits them to 0 and 1), so a loader
    that drops or misplaces them fails the comparison.
    """
    cache = {}

    def make(family: str = "llama", **overrides):
        key = (family, json.dumps(overrides, sort_keys=True))
        if key not in cache:
            config_cls, model_cls = _hf_classes(family)
            torch.manual_seed(0)
            model = model_cls(config_cls(**{**TINY, **overrides})).eval()
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith("bias"):
                        p.normal_(0, 0.1)
                    elif "norm" in name:
                        p.copy_(1 + 0.1 * torch.randn_like(p))
            path = tmp_path_factory.mktemp(family)
            model.save_pretrained(path)  # safetensors
            cache[key] = (model, path)
        return cache[key]

    return make


class PagedRunner:
    """Drives our model the way the engine does: flattened steps over a paged KV cache.

    step([(seq_key, new_ids), ...], slots) runs one step where each sequence adds new_ids (a
    prefill chunk or one decode token); slots gives each sequence's LoRA slot (-1 = base), or
    None for no LoRA at all. Returns the logits [len(new_ids), vocab] of each sequence.
    """

    def __init__(self, model, block_size: int = 4, num_blocks: int = 64):
        cfg = model.cfg
        self.model, self.block_size = model, block_size
        self.kv = KVCache(
            cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, model.dtype, "cpu"
        )
        self.alloc = BlockAllocator(num_blocks)
        self.tables: dict = {}
        self.lens: dict = {}

    def step(self, chunks, slots=None):
        query_lens, context_lens, tables, ids, token_slots = [], [], [], [], []
        for i, (key, new_ids) in enumerate(chunks):
            ctx = self.lens.get(key, 0)
            table = self.tables.setdefault(key, [])
            need = -(-(ctx + len(new_ids)) // self.block_size) - len(table)
            table += self.alloc.allocate(max(need, 0))
            query_lens.append(len(new_ids))
            context_lens.append(ctx)
            tables.append(table)
            ids += list(new_ids)
            token_slots += [slots[i] if slots else -1] * len(new_ids)
            self.lens[key] = ctx + len(new_ids)
        attn = AttentionMetadata.build(query_lens, context_lens, tables, self.block_size, "cpu")
        meta = None
        if slots is not None:
            # As the engine builds it: with the active slots on the host, so layers cut rank and skip.
            active = frozenset(s for s in token_slots if s >= 0)
            meta = make_lora_meta(torch.tensor(token_slots), self.model.lora_spec.max_loras, active)
        hidden = self.model(torch.tensor(ids), attn.positions, attn, self.kv, meta)
        logits = self.model.compute_logits(hidden, meta)
        return list(logits.split(query_lens))

    def release(self, key):
        self.alloc.free(self.tables.pop(key))
        self.lens.pop(key)


@pytest.fixture
def paged_runner():
    return PagedRunner


@pytest.fixture(scope="session")
def hf_logits():
    """hf_logits(hf_model, ids) -> [len(ids), vocab] float32 of one sequence, no cache."""

    def run(model, ids, **kwargs):
        with torch.no_grad():
            return model(torch.tensor([ids]), **kwargs).logits[0].float()

    return run
