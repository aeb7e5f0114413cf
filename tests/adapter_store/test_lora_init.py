"""LoRA inits that change the base weight (PiSSA, OLoRA, ...): refused naming init_lora_weights and
PEFT's conversion; converted to plain LoRA, or made by inits that leave the base alone, they load."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from loraserve.adapter_store import base_model, pack, validate
from loraserve.errors import StatusError

TARGETS = ["q_proj", "v_proj"]


@pytest.fixture
def spec(tiny_llama_model):
    return base_model.from_hf_config("tiny", tiny_llama_model.config.to_dict())


def _train(peft) -> None:
    """Stands in for training: moves every LoRA weight off its init."""
    torch.manual_seed(5)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_" in n:
                p.add_(0.05 * torch.randn_like(p))


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora"])
def test_an_adapter_whose_init_changed_the_base_weight_is_refused(tiny_llama_model, tmp_path, spec, init):
    peft = get_peft_model(copy.deepcopy(tiny_llama_model), LoraConfig(r=4, target_modules=TARGETS, init_lora_weights=init))
    _train(peft)
    peft.save_pretrained(tmp_path / "a")
    with pytest.raises(StatusError) as e:
        pack.load_adapter(tmp_path / "a", spec, validate.Limits())
    assert e.value.code.name == "INVALID_ARGUMENT"
    assert e.value.message == (
        f"adapter_config.json: init_lora_weights {init!r} is not served: its init changed the base weights the adapter "
        "applies to; convert it to a plain LoRA adapter of the original base with PEFT's "
        "save_pretrained(..., path_initial_model_for_weight_conversion=<the initial adapter>) and register that"
    )


@pytest.mark.parametrize("init", ["corda", "astra", "lora_ga", "OLoRA"])
def test_every_base_changing_init_is_refused(init):
    with pytest.raises(StatusError) as e:
        validate.check_init(init)
    assert e.value.code.name == "INVALID_ARGUMENT"
    assert f"init_lora_weights {init!r} is not served" in e.value.message


def test_a_loftq_adapter_is_refused_naming_its_quantized_base():
    with pytest.raises(StatusError) as e:
        validate.check_init("loftq")
    assert e.value.code.name == "INVALID_ARGUMENT"
    assert "init_lora_weights 'loftq' is not served: the adapter applies to LoftQ's quantized base weights" in e.value.message


@pytest.mark.parametrize("init", [True, False, "gaussian", "orthogonal", "eva", "mica", "nora"])
def test_inits_that_leave_the_base_weight_alone_load(init):
    validate.check_init(init)


def test_a_converted_pissa_adapter_loads_as_plain_lora_equal_to_the_trained_one(tiny_llama_model, tmp_path, spec):
    """PEFT's conversion: the trained PiSSA adapter on its residual base weight equals the converted
    plain LoRA (rank 2r) on the original base; the store reads that LoRA's delta."""
    peft = get_peft_model(copy.deepcopy(tiny_llama_model), LoraConfig(r=4, target_modules=TARGETS, init_lora_weights="pissa"))
    peft.peft_config["default"].init_lora_weights = True
    peft.save_pretrained(tmp_path / "init")
    peft.peft_config["default"].init_lora_weights = "pissa"
    _train(peft)
    peft.save_pretrained(tmp_path / "lora", path_initial_model_for_weight_conversion=str(tmp_path / "init"))
    adapter = pack.load_adapter(tmp_path / "lora", spec, validate.Limits())
    assert adapter.rank == 8
    for module in ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj"):
        trained = peft.get_submodule(f"base_model.model.{module}")
        served = trained.get_base_layer().weight + trained.get_delta_weight("default")
        a, b = adapter.modules[module]
        original = tiny_llama_model.get_submodule(module).weight
        converted = original + adapter.settings.module_scale(module) * b.float() @ a.float()
        torch.testing.assert_close(converted, served.detach(), atol=1e-5, rtol=1e-4)
