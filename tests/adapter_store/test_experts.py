"""The store's reading of expert LoRA (adapter_store/experts.py) against PEFT's own delta weights."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from loraserve.adapter_store import pack, validate
from loraserve.adapter_store.base_model import from_hf_dir
from loraserve.errors import StatusError

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=1, num_attention_heads=4,
           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)  # fmt: skip


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(**CFG)).eval()
    path = tmp_path_factory.mktemp("mixtral")
    model.save_pretrained(path)
    return model, path


def _adapter(model, directory, **lora):
    torch.manual_seed(1)
    peft = get_peft_model(copy.deepcopy(model), LoraConfig(**lora))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    peft.save_pretrained(directory)
    return peft


def _store_delta(adapter, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert e's (gate|up delta [2I, H], down delta [H, I]) as the store packs them, scale folded in."""

    def delta(proj):
        name = f"model.layers.0.mlp.experts.{e}.{proj}"
        a, b = adapter.modules[name]
        return b @ a * adapter.settings.module_scale(name)

    return torch.cat([delta("gate_proj"), delta("up_proj")]), delta("down_proj")


@pytest.mark.parametrize("with_spec", [True, False])
@pytest.mark.parametrize("lora", [
    dict(r=4, lora_alpha=8, target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    # transformers-4 names: PEFT turns them into target_parameters with r and alpha doubled for gate_up
    dict(r=4, lora_alpha=8, target_modules=["w1", "w2", "w3"], use_rslora=True),
])  # fmt: skip
def test_fused_expert_wrappers_unpack_to_peft_delta_weights(mixtral, tmp_path, lora, with_spec):
    model, path = mixtral
    peft = _adapter(model, tmp_path / "a", **lora)
    spec = from_hf_dir(path, "tiny") if with_spec else None
    adapter = pack.load_adapter(tmp_path / "a", spec, validate.Limits())
    outer = peft.base_model.model.model.layers[0].mlp.experts  # down_proj wraps gate_up_proj
    want_gate_up, want_down = outer.base_layer.get_delta_weight("default"), outer.get_delta_weight("default")
    for e in range(CFG["num_local_experts"]):
        gate_up, down = _store_delta(adapter, e)
        torch.testing.assert_close(gate_up, want_gate_up[e], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(down, want_down[e], atol=1e-6, rtol=1e-5)


def test_only_down_proj_targeted_is_the_single_wrapper(mixtral, tmp_path):
    model, path = mixtral
    peft = _adapter(model, tmp_path / "a", r=2, lora_alpha=2, target_parameters=["mlp.experts.down_proj"])
    adapter = pack.load_adapter(tmp_path / "a", from_hf_dir(path, "tiny"), validate.Limits())
    assert {m.rsplit(".", 1)[1] for m in adapter.modules} == {"down_proj"}
    want = peft.base_model.model.model.layers[0].mlp.experts.get_delta_weight("default")
    torch.testing.assert_close(_store_delta_down(adapter, 3), want[3], atol=1e-6, rtol=1e-5)


def _store_delta_down(adapter, e):
    a, b = adapter.modules[f"model.layers.0.mlp.experts.{e}.down_proj"]
    return b @ a * adapter.settings.module_scale(f"model.layers.0.mlp.experts.{e}.down_proj")


def test_router_lora_is_refused_naming_the_router(mixtral, tmp_path):
    """Routers carry no LoRA in the executor: an adapter on `mlp.gate.weight` is refused at registration."""
    model, path = mixtral
    _adapter(model, tmp_path / "a", r=2, lora_alpha=2, target_parameters=["mlp.gate.weight", "mlp.experts.down_proj"])
    with pytest.raises(StatusError) as e:
        pack.load_adapter(tmp_path / "a", from_hf_dir(path, "tiny"), validate.Limits())
    assert e.value.code.name == "INVALID_ARGUMENT"
    assert "'model.layers.0.mlp.gate'" in e.value.message and "does not exist" in e.value.message
