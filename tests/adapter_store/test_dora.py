"""DoRA adapters in the store: magnitude vectors read from PEFT's files, packed per layout module
(NaN on untargeted slices) and cut per rank like B's rows (row-parallel layers keep them whole);
every DoRA feature not served refused with its status and a message naming it."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

from loraserve.adapter_store import pack, validate
from loraserve.errors import StatusError
from loraserve.v1 import common_pb2 as pb

from .test_pack import TinyMoE, dense_layout

TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
MAGNITUDE = "lora_magnitude_vector"


def make_dora(model, directory, targets=TARGETS, r: int = 4, **config):
    torch.manual_seed(3)
    peft = get_peft_model(copy.deepcopy(model), LoraConfig(r=r, lora_alpha=8, target_modules=targets, use_dora=True, **config))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_()
            elif MAGNITUDE in n:
                p.mul_(0.5 + torch.rand_like(p))
    peft.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def dora_dir(tiny_llama_model, tmp_path_factory):
    return make_dora(tiny_llama_model, tmp_path_factory.mktemp("dora"))


def load(directory):
    return pack.load_adapter(directory, None, validate.Limits())


def magnitudes_in_file(directory) -> dict[str, torch.Tensor]:
    tensors = load_file(directory / "adapter_model.safetensors")
    prefix, suffix = "base_model.model.", "." + MAGNITUDE
    return {k[len(prefix) : -len(suffix)]: v for k, v in tensors.items() if k.endswith(suffix)}


def test_dora_adapter_is_read_with_its_magnitudes_and_reported_as_dora(dora_dir, peft_adapter):
    adapter = load(dora_dir)
    assert adapter.kind == "dora" and adapter.settings.use_dora
    want = magnitudes_in_file(dora_dir)
    assert set(adapter.magnitudes) == set(adapter.modules) == set(want)
    for name, m in want.items():
        assert torch.equal(adapter.magnitudes[name], m.float())
    assert load(peft_adapter()).kind == "lora"


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_magnitudes_are_packed_per_module_and_cut_like_b_rows(dora_dir, tp):
    adapter, layout = load(dora_dir), dense_layout(tp, False)
    want = magnitudes_in_file(dora_dir)
    full = pack.pack_magnitudes(adapter, layout)
    kinds = {m.name: m for m in layout.modules}
    assert set(full) == {n for n, m in kinds.items() if any(p in want for p in m.peft_modules)}
    qkv = full["model.layers.0.self_attn.qkv_proj"]
    q, k = HEADS_HD, KV_HD
    assert torch.equal(qkv[:q], want["model.layers.0.self_attn.q_proj"])
    assert qkv[q : q + k].isnan().all()  # k_proj is not targeted: its rows keep scale 1
    assert torch.equal(qkv[q + k :], want["model.layers.0.self_attn.v_proj"])
    for r in range(tp):
        shard = pack.shard(pack.pack_full(adapter, layout), layout, pb.ShardRank(tp_rank=r), full)
        for name, vec in full.items():
            got, b = shard[f"{name}.dora_m"], shard[f"{name}.lora_b"]
            assert got.dtype == torch.float32 and got.shape[0] == b.shape[0]  # one per B row this rank holds
            if kinds[name].kind == pb.ROW:
                torch.testing.assert_close(got, vec, rtol=0, atol=0, equal_nan=True)
        o = shard["model.layers.1.self_attn.o_proj.dora_m"]
        assert torch.equal(o, want["model.layers.1.self_attn.o_proj"])  # row-parallel: whole on every rank
        gate = shard["model.layers.1.mlp.gate_up_proj.dora_m"]
        i = gate.shape[0] // 2
        g = want["model.layers.1.mlp.gate_proj"]
        assert torch.equal(gate[:i], g[r * i : (r + 1) * i]) and gate[i:].isnan().all()


HEADS_HD, KV_HD = 4 * 16, 2 * 16


def _edit(directory, *, config=None, tensors=None):
    if config:
        cfg = json.loads((directory / "adapter_config.json").read_text())
        cfg.update(config)
        (directory / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors:
        t = load_file(directory / "adapter_model.safetensors")
        tensors(t)
        save_file(t, directory / "adapter_model.safetensors")


def _one(t):
    return next(k for k in sorted(t) if k.endswith(MAGNITUDE))


REFUSALS = {
    "no_magnitude": (dict(tensors=lambda t: t.pop(_one(t))), "INVALID_ARGUMENT", "has no lora_magnitude_vector"),
    "magnitude_shape": (
        dict(tensors=lambda t: t.update({_one(t): torch.ones(3)})),
        "INVALID_ARGUMENT",
        "lora_magnitude_vector has shape [3]",
    ),
    "magnitude_nan": (
        dict(tensors=lambda t: t.update({_one(t): t[_one(t)] * math.nan})),
        "INVALID_ARGUMENT",
        "lora_magnitude_vector holds NaN or Inf",
    ),
    "magnitude_without_use_dora": (dict(config={"use_dora": False}), "INVALID_ARGUMENT", "does not set use_dora"),
    "magnitude_of_no_module": (
        dict(tensors=lambda t: t.update({"base_model.model.model.layers.0.mlp.up_proj." + MAGNITUDE: torch.ones(128)})),
        "INVALID_ARGUMENT",
        "lora_magnitude_vector of module 'model.layers.0.mlp.up_proj', which has no lora_A / lora_B",
    ),
    "dora_on_target_parameters": (
        dict(config={"target_parameters": ["experts.gate_up_proj"]}),
        "INVALID_ARGUMENT",
        "DoRA (use_dora: true) on target_parameters",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_bad_dora_adapters_are_refused_naming_the_fault(tiny_llama_model, tmp_path, case):
    edit, code, message = REFUSALS[case]
    directory = make_dora(tiny_llama_model, tmp_path / "a")
    _edit(directory, **edit)
    with pytest.raises(StatusError) as e:
        load(directory)
    assert e.value.code.name == code and message in e.value.message, e.value.message


def test_dora_on_moe_experts_is_refused_naming_the_module(tmp_path):
    torch.manual_seed(0)
    peft = get_peft_model(TinyMoE(), LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"], use_dora=True))
    peft.save_pretrained(tmp_path / "moe")
    with pytest.raises(StatusError) as e:
        load(tmp_path / "moe")
    assert e.value.code.name == "INVALID_ARGUMENT"
    assert "DoRA on MoE expert module 'model.layers.0.mlp.experts." in e.value.message


def test_dora_with_fully_sharded_lora_is_failed_precondition(tiny_llama_model, tmp_path):
    adapter = load(make_dora(tiny_llama_model, tmp_path / "a"))
    with pytest.raises(StatusError) as e:
        pack.pack_magnitudes(adapter, dense_layout(2, True))
    assert e.value.code.name == "FAILED_PRECONDITION" and "not served with fully sharded LoRA" in e.value.message
    assert pack.pack_magnitudes(adapter, dense_layout(1, True))  # tp 1: nothing is sharded


def test_dora_on_embeddings_is_refused_when_read_naming_the_module(tiny_llama_model, tmp_path):
    """PEFT writes DoRA for an embedding (a magnitude beside lora_embedding_A / B): no layout serves
    it, so it is refused as the adapter is read (at registration), not at its first load; DoRA on
    the lm_head (a linear layer) is read."""
    with pytest.raises(StatusError) as e:
        load(make_dora(tiny_llama_model, tmp_path / "b", targets=["embed_tokens", "q_proj"]))
    assert e.value.code.name == "INVALID_ARGUMENT"
    assert e.value.message == "DoRA on embedding module 'model.embed_tokens' is not served (only dense linear layers)"
    head = load(make_dora(tiny_llama_model, tmp_path / "c", targets=["lm_head", "q_proj"]))
    assert head.kind == "dora" and set(head.magnitudes) == {
        "lm_head",
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.self_attn.q_proj",
    }
