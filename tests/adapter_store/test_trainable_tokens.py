"""Trainable tokens in the store: PEFT's trainable_tokens_delta rows read with their token ids,
shipped whole to every rank, and every malformed or unserved form refused naming the fault."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

from loraserve.adapter_store import base_model, pack, trainable_tokens, validate
from loraserve.errors import StatusError

DELTA = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"


def make(model, directory, ids=(3, 7, 100), **config):
    torch.manual_seed(4)
    peft = get_peft_model(
        copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=list(ids), **config)
    )
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "trainable_tokens_delta" in n or "lora_B" in n:
                p.normal_()
    peft.save_pretrained(directory)
    return directory


@pytest.fixture
def spec(tiny_llama_model):
    return base_model.from_hf_config("tiny", tiny_llama_model.config.to_dict())


def load(directory, spec=None):
    return pack.load_adapter(directory, spec, validate.Limits())


def test_token_rows_are_read_with_their_ids_and_shipped_whole(tiny_llama_model, tmp_path, spec):
    adapter = load(make(tiny_llama_model, tmp_path / "a"), spec)
    assert adapter.kind == "lora+tokens"
    ids, rows = adapter.tokens["embed"]
    assert ids == [3, 7, 100]
    assert torch.equal(rows, load_file(tmp_path / "a" / "adapter_model.safetensors")[DELTA])
    shard = trainable_tokens.shard_tensors(adapter.tokens)
    assert shard["tokens.embed.ids"].dtype == torch.int32 and shard["tokens.embed.ids"].tolist() == ids
    assert torch.equal(shard["tokens.embed.rows"], rows)


def _edit(directory, config=None, tensors=None):
    if config is not None:
        path = directory / "adapter_config.json"
        cfg = json.loads(path.read_text())
        cfg.update(config)
        path.write_text(json.dumps(cfg))
    if tensors is not None:
        t = load_file(directory / "adapter_model.safetensors")
        tensors(t)
        save_file(t, directory / "adapter_model.safetensors")


REFUSALS = {
    "beyond_vocab": (
        dict(config={"trainable_token_indices": [3, 7, 128]}),
        "token id 128 is beyond base model 'tiny''s vocabulary of 128",
    ),
    "rows_without_config": (dict(config={"trainable_token_indices": None}), "sets no trainable_token_indices"),
    "count_mismatch": (dict(config={"trainable_token_indices": [3, 7]}), "lists 2 ids"),
    "duplicate_id": (dict(config={"trainable_token_indices": [3, 3, 7]}), "lists a token id twice"),
    "negative_id": (dict(config={"trainable_token_indices": [3, -1, 7]}), "must be a non-empty list of token ids >= 0"),
    "dict_without_entry": (dict(config={"trainable_token_indices": {"lm_head": [3, 7, 100]}}), "has no single entry for module"),
    "nan_rows": (dict(tensors=lambda t: t.update({DELTA: t[DELTA] * float("nan")})), "holds NaN or Inf"),
    "other_module": (
        dict(tensors=lambda t: t.update({"base_model.model.model.norm.token_adapter.trainable_tokens_delta": t.pop(DELTA)})),
        "trainable tokens on module 'model.norm' are not served",
    ),
    "no_rows": (dict(tensors=lambda t: t.pop(DELTA)), "the weights hold no trainable_tokens_delta"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_bad_trainable_tokens_are_invalid_argument_naming_the_fault(tiny_llama_model, tmp_path, spec, case):
    edit, message = REFUSALS[case]
    directory = make(tiny_llama_model, tmp_path / "a")
    _edit(directory, **edit)
    with pytest.raises(StatusError) as e:
        load(directory, spec)
    assert e.value.code.name == "INVALID_ARGUMENT" and message in e.value.message, e.value.message


def test_lora_and_trainable_tokens_on_one_embedding_are_refused(tiny_llama_model, tmp_path, spec):
    directory = make(tiny_llama_model, tmp_path / "a")
    _edit(
        directory,
        tensors=lambda t: t.update(
            {
                "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 128),
                "base_model.model.model.embed_tokens.lora_embedding_B": torch.zeros(64, 4),
            }
        ),
    )
    with pytest.raises(StatusError) as e:
        load(directory, spec)
    assert e.value.code.name == "INVALID_ARGUMENT"
    assert "module 'model.embed_tokens' has both LoRA and trainable tokens: not served" in e.value.message


def test_trainable_tokens_alone_are_refused_naming_what_is_served(tiny_llama_model, tmp_path, spec):
    from peft import TrainableTokensConfig

    get_peft_model(copy.deepcopy(tiny_llama_model), TrainableTokensConfig(token_indices=[3, 7])).save_pretrained(tmp_path / "a")
    with pytest.raises(StatusError) as e:
        load(tmp_path / "a", spec)
    assert e.value.code.name == "INVALID_ARGUMENT"
    assert "trainable tokens alone (peft_type 'TRAINABLE_TOKENS') are not served" in e.value.message
