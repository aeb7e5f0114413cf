"""Gemma 1, 2 and 3 (text) from GGUF: tiny random models of transformers' own classes written the way
llama.cpp's converter lays them out (F32 tensors, every norm weight stored as 1 + weight, no lm_head,
no q/k permutation, its metadata keys), loaded by the executor and checked against transformers on the
original model and against the executor's safetensors load; the defaults llama.cpp assumes where a key
is missing; the store's module shapes from the GGUF; a PEFT adapter served on a GGUF base; malformed
GGUFs refused with their reasons."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from loraserve.adapter_store import base_model
from loraserve.executor.model.loader import gguf_config, load_hf_checkpoint, load_model

from .conftest import Cluster, check_against_reference, run_group
from .test_gemma import ATOL, _chunked, _hf, _hf_logits, _prompt

gguf = pytest.importorskip("gguf")
peft = pytest.importorskip("peft")

ARCH = {"gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3"}
_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip
_NORMS = {  # Gemma 1 has llama's two norms a layer; Gemma 2/3 four
    "gemma": {"post_attention_layernorm": "ffn_norm"},
    "sandwich": {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                 "post_feedforward_layernorm": "post_ffw_norm"},
}  # fmt: skip
# GGUF-expressible variants: the attention scalar is head_dim (what llama.cpp assumes below 27B)
VARIANTS = {
    "gemma": ("gemma", {}, {}),
    "gemma2": ("gemma2", dict(query_pre_attn_scalar=64), {}),
    # the newer converter writes the local RoPE base (rope.freq_base_swa); the period as llama.cpp reads it
    "gemma3": ("gemma3", dict(query_pre_attn_scalar=32), dict(pattern=2)),
    # an older converter's file: neither key, so llama.cpp's period 6 and local base 10000, as the model has
    "gemma3-defaults": ("gemma3", dict(query_pre_attn_scalar=32, num_hidden_layers=6, sliding_window_pattern=6,
                                       rope_local_base_freq=10000.0), dict(swa_base=False)),
}  # fmt: skip


def _gguf_name(hf_name: str, sandwich: bool) -> str:
    if hf_name.startswith("model.layers."):
        _, _, i, rest = hf_name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        names = {**_LAYER, **_NORMS["sandwich" if sandwich else "gemma"]}
        return f"blk.{i}.{names[module]}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[hf_name]


def write_gemma_gguf(hf, path, pattern=None, swa_base=True, omit_keys=(), drop=(), tokenizer=False):
    """hf's weights and config as llama.cpp's Gemma converters write them. pattern: an
    attention.sliding_window_pattern to write (an int or per-layer bools); swa_base: write
    rope.freq_base_swa (gemma3); omit_keys: `<arch>.` keys left out; drop: tensors left out;
    tokenizer: a byte-level sentencepiece vocabulary (bytes, then <bos> <eos> <pad> <unk>)."""
    c = hf.config
    arch = ARCH[c.model_type]
    w = gguf.GGUFWriter(str(path), arch)
    keys = {
        "context_length": (w.add_context_length, c.max_position_embeddings),
        "embedding_length": (w.add_embedding_length, c.hidden_size),
        "block_count": (w.add_block_count, c.num_hidden_layers),
        "feed_forward_length": (w.add_feed_forward_length, c.intermediate_size),
        "attention.head_count": (w.add_head_count, c.num_attention_heads),
        "attention.head_count_kv": (w.add_head_count_kv, c.num_key_value_heads),
        "attention.layer_norm_rms_epsilon": (w.add_layer_norm_rms_eps, c.rms_norm_eps),
        "attention.key_length": (w.add_key_length, c.head_dim),
        "attention.value_length": (w.add_value_length, c.head_dim),
    }
    if arch == "gemma2":
        keys["attn_logit_softcapping"] = (w.add_attn_logit_softcapping, c.attn_logit_softcapping)
        keys["final_logit_softcapping"] = (w.add_final_logit_softcapping, c.final_logit_softcapping)
        keys["attention.sliding_window"] = (w.add_sliding_window, c.sliding_window)
    if arch == "gemma3":
        rope = c.rope_parameters
        keys["rope.freq_base"] = (w.add_rope_freq_base, rope["full_attention"]["rope_theta"])
        keys["attention.sliding_window"] = (w.add_sliding_window, c.sliding_window)
        if rope["full_attention"].get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["full_attention"]["factor"])
        if swa_base:
            keys["rope.freq_base_swa"] = (w.add_rope_freq_base_swa, rope["sliding_attention"]["rope_theta"])
        if pattern is not None:
            keys["attention.sliding_window_pattern"] = (w.add_sliding_window_pattern, pattern)
    if tokenizer:
        specials = ["<bos>", "<eos>", "<pad>", "<unk>"]
        w.add_tokenizer_model("llama")
        w.add_token_list([f"<0x{b:02X}>" for b in range(256)] + specials)
        w.add_token_scores([0.0] * c.vocab_size)
        w.add_token_types([int(gguf.TokenType.BYTE)] * 256 + [int(gguf.TokenType.CONTROL)] * 4)
        w.add_bos_token_id(c.bos_token_id)
        w.add_eos_token_id(c.eos_token_id)
        w.add_pad_token_id(c.pad_token_id)
        w.add_unk_token_id(259)
    else:
        w.add_eos_token_id(c.eos_token_id)
        keys["vocab_size"] = (w.add_vocab_size, c.vocab_size)
    for key, (add, value) in keys.items():
        if key not in omit_keys:
            add(value)
    sandwich = arch != "gemma"
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":
            continue  # the converter skips it: the embeddings are tied
        a = t.float().numpy()
        if name.endswith("norm.weight"):
            a = a + np.float32(1.0)  # the converter stores Gemma's (1 + weight)
        gname = _gguf_name(name, sandwich)
        if gname not in drop:
            w.add_tensor(gname, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    """variant(name) -> (transformers model, its safetensors dir, its GGUF), built once per module."""
    cache = {}

    def make(name: str):
        if name not in cache:
            family, overrides, write = VARIANTS[name]
            model = _hf(family, **overrides)
            root = tmp_path_factory.mktemp(name)
            model.save_pretrained(root / "hf")
            cache[name] = (model, root / "hf", write_gemma_gguf(model, root / f"{name}.gguf", **write))
        return cache[name]

    return make


_CONFIG_FIELDS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
    "rms_norm_eps", "rope_theta", "rope_scaling", "tie_word_embeddings", "qk_norm", "hidden_act", "norm_unit_offset",
    "scale_embeddings", "sandwich_norms", "attn_logit_softcap", "final_logit_softcap", "layer_windows", "attention_scale",
)  # fmt: skip


@pytest.mark.parametrize("name", list(VARIANTS))
def test_gguf_serves_as_transformers_and_the_safetensors_load(name, variant, paged_runner):
    """The GGUF's config is the safetensors load's; chunked prefill is transformers' logits; greedy decode
    gives transformers' tokens and logprobs; the logits equal the safetensors load's (the stored
    1 + weight less 1, plus 1 again in our norm, is the (1 + weight) transformers computes)."""
    ref, hf_dir, path = variant(name)
    ours, st = load_model(path), load_hf_checkpoint(hf_dir)
    for field in _CONFIG_FIELDS:
        assert getattr(ours.cfg, field) == pytest.approx(getattr(st.cfg, field)), field
    assert ours.cfg.local_rope(0) == st.cfg.local_rope(0) and ours.cfg.rope_local_theta == st.cfg.rope_local_theta
    if name == "gemma3-defaults":
        assert ours.cfg.layer_windows == (5,) * 5 + (None,) and ours.cfg.rope_local_theta == 10000.0
    prompts = {"a": _prompt(13, 1), "b": _prompt(13, 2)}
    outs, outs_st = _chunked(paged_runner(ours, block_size=4), prompts), _chunked(paged_runner(st, block_size=4), prompts)
    for key, ids in prompts.items():
        torch.testing.assert_close(outs[key], _hf_logits(ref, ids), atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(outs[key], outs_st[key], atol=1e-6, rtol=1e-6)
    ids = _prompt(6, 3)
    run = paged_runner(ours, block_size=4)
    (logits,) = run.step([("g", ids)])
    for _ in range(8):  # past every window
        want = _hf_logits(ref, ids)[-1]
        token = int(logits[-1].argmax())
        assert token == int(want.argmax())
        torch.testing.assert_close(
            torch.log_softmax(logits[-1], -1)[token], torch.log_softmax(want, -1)[token], atol=ATOL, rtol=0
        )
        ids.append(token)
        (logits,) = run.step([("g", [token])])


def _config(tmp_path, hf, **write) -> object:
    path = write_gemma_gguf(hf, tmp_path / f"meta{len(list(tmp_path.iterdir()))}.gguf", **write)
    return gguf_config(gguf.GGUFReader(str(path)))


def test_llama_cpp_defaults_where_a_key_is_missing(variant, tmp_path):
    """gemma2 without window and soft-cap keys: window 4096 on layers 0, 2, ..., soft-caps 50 and 30;
    gemma3 without sliding_window: every layer global; a per-layer pattern array is read as written."""
    g2 = _config(tmp_path, variant("gemma2")[0], omit_keys=("attention.sliding_window", "attn_logit_softcapping",
                                                            "final_logit_softcapping"))  # fmt: skip
    assert (g2.layer_windows, g2.attn_logit_softcap, g2.final_logit_softcap) == ((4096, None, 4096, None), 50.0, 30.0)
    g3 = variant("gemma3")[0]
    assert _config(tmp_path, g3, pattern=2, omit_keys=("attention.sliding_window",)).layer_windows == (None,) * 4
    assert _config(tmp_path, g3, pattern=[False, True, True, False]).layer_windows == (None, 5, 5, None)
    no_base = _config(tmp_path, g3, pattern=2, swa_base=False)
    assert no_base.rope_local_theta == 10000.0 and no_base.rope_theta == 1e6 and no_base.rope_scaling["factor"] == 2.0


@pytest.mark.parametrize("family, layers, hidden, heads, head_dim, scalar", [
    ("gemma2", 46, 4608, 32, 128, 144),  # Gemma-2-27B: query_pre_attn_scalar 144 = hidden / heads
    ("gemma3", 62, 5376, 32, 128, 168),  # Gemma-3-27B: 168
    ("gemma2", 42, 3584, 16, 256, 256),  # Gemma-2-9B: head_dim
])  # fmt: skip
def test_attention_scale_follows_llama_cpp_by_layer_count(family, layers, hidden, heads, head_dim, scalar, tmp_path):
    """No GGUF key holds query_pre_attn_scalar: llama.cpp takes hidden / heads for the 27B layer counts."""
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), family)
    for add, value in ((w.add_block_count, layers), (w.add_embedding_length, hidden), (w.add_feed_forward_length, 64),
                       (w.add_head_count, heads), (w.add_key_length, head_dim), (w.add_layer_norm_rms_eps, 1e-6),
                       (w.add_vocab_size, 16), (w.add_sliding_window, 8)):  # fmt: skip
        add(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cfg = gguf_config(gguf.GGUFReader(str(tmp_path / "m.gguf")))
    assert cfg.query_pre_attn_scalar == scalar and cfg.head_dim == head_dim and cfg.num_layers == layers


REFUSED = {
    # name: (variant, writer arguments, words of the message)
    "no-head-count": ("gemma2", dict(omit_keys=("attention.head_count",)), "lacks metadata the model needs: gemma2.attention.head_count"),
    "no-rms-eps": ("gemma", dict(omit_keys=("attention.layer_norm_rms_epsilon",)), "gemma.attention.layer_norm_rms_epsilon"),
    "no-post-ffw-norm": ("gemma2", dict(drop=("blk.1.post_ffw_norm.weight",)),
                         r"unfilled .*model\.layers\.1\.post_feedforward_layernorm\.weight"),
    "no-q-norm": ("gemma3", dict(pattern=2, drop=("blk.0.attn_q_norm.weight",)), r"unfilled .*layers\.0\.self_attn\.q_norm"),
    "no-vocab": ("gemma", dict(omit_keys=("vocab_size",)), "neither gemma.vocab_size nor tokenizer.ggml.tokens"),
    "pattern-period": ("gemma3", dict(pattern=0), "sliding_window_pattern 0: a positive period or one bool per layer"),
    "pattern-length": ("gemma3", dict(pattern=[True, False]), "sliding_window_pattern names 2 layers, the model has 4"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED))
def test_malformed_gemma_gguf_is_refused(case, variant, tmp_path):
    name, write, words = REFUSED[case]
    path = write_gemma_gguf(variant(name)[0], tmp_path / f"{case}.gguf", **write)
    with pytest.raises(ValueError, match=words):
        load_model(path)


@pytest.mark.parametrize("name", ["gemma", "gemma2", "gemma3"])
def test_store_spec_from_the_gguf_is_the_hf_models(name, variant):
    """The store's module shapes from the GGUF metadata are those of the HF config: a PEFT adapter
    made on the HF model validates against a GGUF-served base."""
    _, hf_dir, path = variant(name)
    spec, hf_spec = base_model.from_gguf(path, "tiny"), base_model.from_hf_dir(hf_dir, "tiny")
    assert spec.modules == hf_spec.modules and (spec.vocab_size, spec.hidden_size) == (hf_spec.vocab_size, hf_spec.hidden_size)


def test_peft_adapter_served_on_a_gguf_gemma_base(variant, module_loop_thread, tmp_path):
    """Store and executor both given the Gemma 3 GGUF (with its tokenizer): a PEFT adapter made on the
    HF model registers against the GGUF's module shapes and decodes greedily as PEFT does, beside base rows."""
    model, _, _ = variant("gemma3")
    path = write_gemma_gguf(model, tmp_path / "gemma3.gguf", pattern=2, tokenizer=True)
    adapters = tmp_path / "adapters"
    torch.manual_seed(3)
    p = peft.get_peft_model(
        copy.deepcopy(model), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    )
    with torch.no_grad():
        for n, t in p.named_parameters():
            if "lora_B" in n:
                t.normal_(0, 0.2)
    p.save_pretrained(adapters / "qvd4")
    refs = {"": model, "qvd4": peft.PeftModel.from_pretrained(copy.deepcopy(model), adapters / "qvd4").eval()}
    c = Cluster(module_loop_thread, path, adapters, tmp_path / "store", ["qvd4"], cpu_threads=1)
    try:
        jobs, resps = run_group(c.client(), ["qvd4", "", "qvd4"], max_tokens=8)
        for (name, ids), resp in zip(jobs, resps):
            check_against_reference(refs[name], ids, resp)
    finally:
        c.close()


def test_gemma_gguf_is_cut_per_tp_rank(variant):
    """Each of 2 ranks reads its heads' q|k|v rows, its MLP rows and vocabulary rows from the GGUF, and
    the whole norms (1 taken off them as on one rank)."""
    from loraserve.executor.model.loader import load_gguf
    from loraserve.executor.parallel import TPGroup

    _, _, path = variant("gemma2")
    whole = load_gguf(path)
    c = whole.cfg
    for rank in range(2):
        part = load_gguf(path, tp=TPGroup(2, rank))
        qkv, mine = whole.model.layers[1].self_attn.qkv_proj.weight, part.model.layers[1].self_attn.qkv_proj.weight
        q, kv = slice(rank * c.q_size // 2, (rank + 1) * c.q_size // 2), slice(rank * c.kv_size // 2, (rank + 1) * c.kv_size // 2)
        assert torch.equal(
            mine, torch.cat([qkv[: c.q_size][q], qkv[c.q_size : c.q_size + c.kv_size][kv], qkv[c.q_size + c.kv_size :][kv]])
        )
        for norm in ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            assert torch.equal(getattr(part.model.layers[1], norm).weight, getattr(whole.model.layers[1], norm).weight)
        vocab = slice(rank * c.vocab_size // 2, (rank + 1) * c.vocab_size // 2)
        assert torch.equal(part.model.embed_tokens.weight, whole.model.embed_tokens.weight[vocab])
