"""The base model and its loader against transformers, through the paged KV cache."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from loraserve.errors import StatusError
from loraserve.executor.engine.kv_cache import AttentionMetadata, BlockAllocator
from loraserve.executor.model.config import ModelConfig
from loraserve.executor.model.loader import load_hf_checkpoint, load_model

ATOL = 1e-4  # float32, logits of magnitude ~1-10


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (n,), generator=g).tolist()


def _assert_close(ours, ref):
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_prefill_logits_match_transformers(family, hf_model, hf_logits, paged_runner):
    ref_model, path = hf_model(family)
    model = load_hf_checkpoint(path)
    if family == "qwen2":
        assert model.cfg.attention_bias and model.model.layers[0].self_attn.qkv_proj.bias is not None
    ids = _prompt(11, 0)
    (logits,) = paged_runner(model).step([("a", ids)])
    _assert_close(logits, hf_logits(ref_model, ids))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_mixed_prefill_chunks_and_decode_in_one_step_match_transformers(family, hf_model, hf_logits, paged_runner):
    """Two prompts of different lengths in one step, then a step mixing a decode token, a prefill
    chunk on top of cached context, and a new prompt; block_size 4 so every sequence spans blocks."""
    ref_model, path = hf_model(family)
    model = load_hf_checkpoint(path)
    a, b, c = _prompt(12, 1), _prompt(13, 2), _prompt(6, 3)
    run = paged_runner(model, block_size=4)

    la, lb = run.step([("a", a[:7]), ("b", b[:5])])
    _assert_close(la, hf_logits(ref_model, a[:7]))
    _assert_close(lb, hf_logits(ref_model, b[:5]))

    la, lb, lc = run.step([("a", a[7:8]), ("b", b[5:10]), ("c", c)])
    _assert_close(la, hf_logits(ref_model, a[:8])[7:])
    _assert_close(lb, hf_logits(ref_model, b[:10])[5:])
    _assert_close(lc, hf_logits(ref_model, c))

    run.release("c")  # its blocks go back and get reused by "d" below
    d = _prompt(9, 4)
    outs = run.step([("b", b[10:11]), ("d", d), ("a", a[8:9])])
    _assert_close(outs[0], hf_logits(ref_model, b[:11])[10:])
    _assert_close(outs[1], hf_logits(ref_model, d))
    _assert_close(outs[2], hf_logits(ref_model, a[:9])[8:])


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
        # max_position_embeddings 16 < 20 tokens, so the dynamic base really grows
        {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500.0},
        {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
        },
    ],
    ids=lambda r: r["rope_type"],
)  # fmt: skip
def test_rope_scaling_matches_transformers(rope, hf_model, hf_logits, paged_runner):
    overrides = {"rope_parameters": rope}
    if rope["rope_type"] == "dynamic":
        overrides["max_position_embeddings"] = 16
    ref_model, path = hf_model("llama", **overrides)
    model = load_hf_checkpoint(path)
    assert model.cfg.rope_type == rope["rope_type"]
    ids = _prompt(20, 5)
    (logits,) = paged_runner(model).step([("a", ids)])
    _assert_close(logits, hf_logits(ref_model, ids))


def test_mistral_sliding_window_matches_transformers(hf_model, hf_logits, paged_runner):
    ref_model, path = hf_model("mistral", sliding_window=5)
    model = load_hf_checkpoint(path)
    assert model.cfg.sliding_window == 5
    ids = _prompt(14, 6)
    run = paged_runner(model, block_size=4)
    (first,) = run.step([("a", ids[:9])])
    (second,) = run.step([("a", ids[9:12])])
    (third,) = run.step([("a", ids[12:13])])
    ref = hf_logits(ref_model, ids[:13])
    _assert_close(torch.cat([first, second, third]), ref)


def test_tied_embeddings_share_one_weight(hf_model, hf_logits, paged_runner):
    ref_model, path = hf_model("llama", tie_word_embeddings=True)
    model = load_hf_checkpoint(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = _prompt(8, 7)
    (logits,) = paged_runner(model).step([("a", ids)])
    _assert_close(logits, hf_logits(ref_model, ids))


def test_sharded_checkpoint_loads_through_its_index(hf_model, hf_logits, paged_runner, tmp_path):
    ref_model, _ = hf_model("qwen2")
    ref_model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model = load_model(tmp_path)
    ids = _prompt(6, 8)
    (logits,) = paged_runner(model).step([("a", ids)])
    _assert_close(logits, hf_logits(ref_model, ids))


def test_loader_refuses_pickled_weights_and_escaping_index(tmp_path, hf_model):
    _, path = hf_model("llama")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ValueError, match="pickled"):
        load_hf_checkpoint(tmp_path)
    index = {"weight_map": {"model.embed_tokens.weight": "../elsewhere.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="outside"):
        load_hf_checkpoint(tmp_path)


def test_config_reads_v4_rope_scaling_and_eos_lists():
    raw = {
        "model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 5e5,
        "rope_scaling": {"type": "linear", "factor": 4.0}, "eos_token_id": [5, 6],
    }  # fmt: skip
    cfg = ModelConfig.from_hf_config(raw)
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert cfg.num_kv_heads == 2 and cfg.head_dim == 4 and cfg.eos_token_ids == (5, 6)
    with pytest.raises(ValueError, match="rope_type"):
        ModelConfig.from_hf_config({**raw, "rope_scaling": {"rope_type": "su"}})
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf_config({**raw, "model_type": "gpt2"})


def test_block_allocator_hands_out_and_takes_back_blocks():
    alloc = BlockAllocator(4)
    first = alloc.allocate(3)
    assert len(set(first)) == 3 and alloc.num_free == 1
    with pytest.raises(StatusError):
        alloc.allocate(2)
    assert alloc.num_free == 1  # a failed allocation takes nothing
    alloc.free(first[:2])
    assert alloc.num_free == 3
    with pytest.raises(ValueError):
        alloc.free(first[:1])  # double free


def test_attention_metadata_maps_new_tokens_to_their_cache_slots():
    attn = AttentionMetadata.build([3, 1], [2, 5], [[7, 2], [4, 9]], block_size=4, device="cpu")
    # seq 0: positions 2,3,4 -> block 7 offsets 2,3 then block 2 offset 0; seq 1: position 5 -> block 9 offset 1
    assert attn.slot_mapping.tolist() == [30, 31, 8, 37]
    assert attn.positions.tolist() == [2, 3, 4, 5]
    assert attn.cu_query_lens.tolist() == [0, 3, 4]
    assert attn.seq_lens.tolist() == [5, 6]
    assert attn.block_tables.tolist() == [[7, 2], [4, 9]]
    assert (attn.max_query_len, attn.is_decode) == (3, False)
    decode = AttentionMetadata.build([1, 1], [2, 0], [[7], [4, 9]], block_size=4, device="cpu")
    assert decode.is_decode and decode.block_tables.tolist() == [[7, 0], [4, 9]]  # padded with block 0
    with pytest.raises(ValueError):
        AttentionMetadata.build([9], [0], [[0, 1]], block_size=4, device="cpu")


@pytest.mark.parametrize("family, extra", [("llama", {}), ("mistral", {"sliding_window": 5})])
def test_batched_decode_of_ragged_sequences_matches_transformers(family, extra, hf_model, hf_logits, paged_runner):
    """A decode-only step attends all sequences in one padded call: every row must equal its own sequence."""
    ref_model, path = hf_model(family, **extra)
    model = load_hf_checkpoint(path)
    prompts = {"a": _prompt(7, 21), "b": _prompt(12, 22), "c": _prompt(3, 23)}
    run = paged_runner(model, block_size=4)
    run.step(list(prompts.items()))  # prefill all three
    nxt = {"a": [5], "b": [9], "c": [11]}
    rows = run.step(list(nxt.items()))  # decode only: the batched path
    for (name, ids), row in zip(prompts.items(), rows):
        _assert_close(row, hf_logits(ref_model, ids + nxt[name])[-1:])


def test_decode_path_equals_the_varlen_path(hf_model, paged_runner, monkeypatch):
    """A decode-only step goes through the paged decode kernel; the same step through the
    variable-length prefill kernel gives the same logits."""
    from loraserve.executor.engine import kv_cache

    _, path = hf_model("llama")
    model = load_hf_checkpoint(path)
    prompts = {"a": _prompt(7, 31), "b": _prompt(12, 32), "c": _prompt(3, 33)}
    results = []
    for force_varlen in (False, True):
        build = kv_cache.AttentionMetadata.build
        if force_varlen:
            monkeypatch.setattr(
                kv_cache.AttentionMetadata, "build",
                staticmethod(lambda *a, **k: dataclasses.replace(build(*a, **k), is_decode=False)),
            )  # fmt: skip
        run = paged_runner(model, block_size=4)
        run.step(list(prompts.items()))
        results.append(torch.cat(run.step([("a", [5]), ("b", [9]), ("c", [11])])))
    torch.testing.assert_close(results[1], results[0], atol=1e-5, rtol=1e-5)


def test_batched_decode_never_reads_another_sequences_cache():
    """Padding must not pull other sequences' cache rows into a row: a NaN there would leak through."""
    from loraserve.executor.engine.kv_cache import LayerKV, paged_attention

    torch.manual_seed(0)
    block_size, kvh, heads, dim = 4, 2, 4, 8
    k_cache = torch.randn(6, block_size, kvh, dim)
    v_cache = torch.randn(6, block_size, kvh, dim)
    k_cache[0], v_cache[0] = float("nan"), float("nan")  # block 0: nobody's in this step
    tables, ctx = [[1, 2], [3]], [6, 1]
    attn = AttentionMetadata.build([1, 1], ctx, tables, block_size, "cpu")
    assert attn.is_decode
    q = torch.randn(2, heads, dim)
    kv = LayerKV(k_cache, v_cache, None, None)
    out = paged_attention(q, kv, attn, dim**-0.5)
    assert torch.isfinite(out).all()
    varlen = dataclasses.replace(attn, is_decode=False)  # the prefill kernel's path
    torch.testing.assert_close(out, paged_attention(q, kv, varlen, dim**-0.5))
