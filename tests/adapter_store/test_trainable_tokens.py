"""Trainable tokens in the store, beside LoRA and alone (peft_type TRAINABLE_TOKENS): PEFT's
trainable_tokens_delta rows read with their token ids, shipped whole to every rank, and every
malformed or unserved form refused naming the fault."""

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
    config = {"target_modules": ["q_proj"], "trainable_token_indices": list(ids), **config}
    peft = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, **config))
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


@pytest.fixture(scope="module")
def tied_llama(tiny_llama_model):
    """(the tiny Llama with lm_head tied to its embedding, its spec)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**tiny_llama_model.config.to_dict(), "tie_word_embeddings": True})).eval()
    return model, base_model.from_hf_config("tiny", model.config.to_dict())


def test_a_tied_lm_head_with_rows_for_other_ids_keeps_its_own(tied_llama, tmp_path):
    """trainable_token_indices per module, the embedding's and the tied lm_head's ids unlike: PEFT ties
    neither and saves both, and so each keeps its own rows; for the same ids it saves the embedding's alone."""
    model, spec = tied_llama
    both = load(
        make(model, tmp_path / "a", ids=(), trainable_token_indices={"embed_tokens": [3, 7], "lm_head": [7, 9, 100]}), spec
    )
    saved = load_file(tmp_path / "a" / "adapter_model.safetensors")
    assert both.tokens["embed"][0] == [3, 7] and torch.equal(both.tokens["embed"][1], saved[DELTA])
    assert both.tokens["lm_head"][0] == [7, 9, 100]
    assert torch.equal(both.tokens["lm_head"][1], saved["base_model.model.lm_head.token_adapter.trainable_tokens_delta"])
    same = load(make(model, tmp_path / "b", ids=(), trainable_token_indices={"embed_tokens": [3, 7], "lm_head": [3, 7]}), spec)
    assert set(same.tokens) == {"embed"}  # the executor ties the lm_head's rows to these


@pytest.mark.parametrize("tied", [True, False])
def test_lora_on_an_lm_head_tied_to_trainable_token_rows_is_refused(tiny_llama_model, tied_llama, tmp_path, spec, tied):
    """PEFT applies an lm_head's LoRA on top of the embedding's token rows it ties the lm_head to
    (a served slot's lm_head rows replace those logits whole): refused naming the module on a tied
    model; untied, the lm_head keeps its base rows and the adapter is read."""
    model, spec = tied_llama if tied else (tiny_llama_model, spec)
    directory = make(model, tmp_path / "a", target_modules=["q_proj", "lm_head"])
    if not tied:
        assert load(directory, spec).kind == "lora+tokens"
        return
    with pytest.raises(StatusError) as e:
        load(directory, spec)
    assert e.value.code.name == "INVALID_ARGUMENT"
    assert e.value.message == (
        "module 'lm_head' has LoRA and base model 'tiny' ties it to the embedding, whose trainable token rows it would "
        "take: LoRA on a tied lm_head with trainable tokens is not served"
    )


ALONE_DELTA = "base_model.model.model.embed_tokens.trainable_tokens_delta"
HEAD_DELTA = "base_model.model.lm_head.trainable_tokens_delta"


def make_alone(model, directory, ids=(3, 7, 100), **config):
    """A TRAINABLE_TOKENS adapter (no LoRA) with random rows."""
    from peft import TrainableTokensConfig

    torch.manual_seed(5)
    peft = get_peft_model(copy.deepcopy(model), TrainableTokensConfig(token_indices=list(ids), **config))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "trainable_tokens_delta" in n:
                p.normal_()
    peft.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("targets", [None, ["embed_tokens", "lm_head"]])
def test_trainable_tokens_alone_are_read_as_rank_0_and_shipped_without_lora(tiny_llama_model, tmp_path, spec, targets):
    from loraserve.v1 import common_pb2 as pb

    from .test_pack import dense_layout

    directory = make_alone(tiny_llama_model, tmp_path / "a", target_modules=targets)
    adapter = load(directory, spec)
    assert (adapter.kind, adapter.rank, adapter.modules) == ("tokens", 0, {})
    saved = load_file(directory / "adapter_model.safetensors")
    assert adapter.tokens["embed"][0] == [3, 7, 100] and torch.equal(adapter.tokens["embed"][1], saved[ALONE_DELTA])
    if targets:  # the untied lm_head's own rows
        assert adapter.tokens["lm_head"][0] == [3, 7, 100] and torch.equal(adapter.tokens["lm_head"][1], saved[HEAD_DELTA])
    else:
        assert "lm_head" not in adapter.tokens
    assert adapter.num_parameters == sum(rows.numel() for _, rows in adapter.tokens.values())
    layout = dense_layout(2, False)
    full = pack.pack_full(adapter, layout)
    assert full == {} and pack.pack_magnitudes(adapter, layout) == {}
    for r in range(2):
        tensors = {**pack.shard(full, layout, pb.ShardRank(tp_rank=r)), **trainable_tokens.shard_tensors(adapter.tokens)}
        assert set(tensors) == {f"tokens.{t}.{p}" for t in adapter.tokens for p in ("ids", "rows")}
        blob = pack.shard_blob(adapter, tensors, layout, pb.ShardRank(tp_rank=r))
        assert safe_open_metadata(blob)["rank"] == "0"


def safe_open_metadata(blob: bytes) -> dict:
    n = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8 : 8 + n])["__metadata__"]


ALONE_REFUSALS = {
    "beyond_vocab": (dict(config={"token_indices": [3, 7, 128]}), "token_indices: token id 128 is beyond base model 'tiny''s"),
    "no_indices": (dict(config={"token_indices": None}), "token_indices of a TRAINABLE_TOKENS adapter must be a non-empty list"),
    "empty_indices": (dict(config={"token_indices": []}), "token_indices of a TRAINABLE_TOKENS adapter must be a non-empty list"),
    "dict_indices": (
        dict(config={"token_indices": {"embed_tokens": [3, 7, 100]}}),
        "token_indices of a TRAINABLE_TOKENS adapter must be a non-empty list",
    ),
    "count_mismatch": (dict(config={"token_indices": [3, 7]}), "token_indices lists 2 ids"),
    "duplicate_id": (
        dict(config={"token_indices": [3, 3, 7]}),
        "token_indices of module 'model.embed_tokens' lists a token id twice",
    ),
    "bool_id": (dict(config={"token_indices": [3, True, 7]}), "must be a non-empty list of token ids >= 0"),
    "nan_rows": (dict(tensors=lambda t: t.update({ALONE_DELTA: t[ALONE_DELTA] * float("nan")})), "holds NaN or Inf"),
    "wide_rows": (dict(tensors=lambda t: t.update({ALONE_DELTA: torch.zeros(3, 65)})), "trainable token rows of 65 features"),
    "no_rows": (
        dict(tensors=lambda t: t.pop(ALONE_DELTA)),
        "token_indices is set but the weights hold no trainable_tokens_delta",
    ),
    "other_module": (
        dict(tensors=lambda t: t.update({"base_model.model.model.norm.trainable_tokens_delta": t.pop(ALONE_DELTA)})),
        "trainable tokens on module 'model.norm' are not served",
    ),
    "lora_tensor": (
        dict(tensors=lambda t: t.update({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64)})),
        "tensor 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight': "
        "a TRAINABLE_TOKENS adapter holds only trainable_tokens_delta rows",
    ),
    "lora_style_name": (  # rows named as beside LoRA: not the embedding module PEFT's TRAINABLE_TOKENS writes
        dict(tensors=lambda t: t.update({DELTA: t.pop(ALONE_DELTA)})),
        "trainable tokens on module 'model.embed_tokens.token_adapter' are not served",
    ),
}


@pytest.mark.parametrize("case", list(ALONE_REFUSALS))
def test_bad_trainable_tokens_alone_are_invalid_argument_naming_the_fault(tiny_llama_model, tmp_path, spec, case):
    edit, message = ALONE_REFUSALS[case]
    directory = make_alone(tiny_llama_model, tmp_path / "a")
    _edit(directory, **edit)
    with pytest.raises(StatusError) as e:
        load(directory, spec)
    assert e.value.code.name == "INVALID_ARGUMENT" and message in e.value.message, e.value.message


def test_other_peft_types_are_refused_naming_what_is_served(tiny_llama_model, tmp_path, spec):
    from peft import IA3Config

    get_peft_model(copy.deepcopy(tiny_llama_model), IA3Config(target_modules=["q_proj"], feedforward_modules=[])).save_pretrained(
        tmp_path / "a"
    )
    with pytest.raises(StatusError) as e:
        load(tmp_path / "a", spec)
    assert e.value.code.name == "INVALID_ARGUMENT"
    assert "peft_type is 'IA3', only 'LORA' and 'TRAINABLE_TOKENS' adapters are served" in e.value.message


def _variants():
    from peft.tuners.lora.config import BdLoraConfig, KasaConfig, MontecloraConfig, VeloraConfig

    return {
        "use_bdlora": dict(use_bdlora=BdLoraConfig(target_modules_bd_b=["q_proj", "v_proj"], nblocks=2)),
        "kasa_config": dict(kasa_config=KasaConfig()),
        "monteclora_config": dict(monteclora_config=MontecloraConfig()),
        "velora_config": dict(velora_config=VeloraConfig(num_groups=4)),
        "lora_bias": dict(lora_bias=True),
        "alora_invocation_tokens": dict(alora_invocation_tokens=[3, 5]),
    }


@pytest.mark.parametrize(
    "key", ["use_bdlora", "kasa_config", "monteclora_config", "velora_config", "lora_bias", "alora_invocation_tokens"]
)
def test_lora_variants_are_refused_naming_the_config_field(tiny_llama_model, tmp_path, spec, key):
    """LoRA adapters PEFT writes whose forward or tensors differ from plain LoRA's (BD-LoRA's
    block-diagonal factors, KaSA's truncated base weight, MonteCLoRA's and VeLoRA's extra tensors,
    LoRA biases, aLoRA's invocation tokens): refused naming the adapter_config.json field."""
    get_peft_model(
        copy.deepcopy(tiny_llama_model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], **_variants()[key])
    ).save_pretrained(tmp_path / "a")
    with pytest.raises(StatusError) as e:
        load(tmp_path / "a", spec)
    assert e.value.code.name == "INVALID_ARGUMENT"
    assert e.value.message == f"adapter_config.json: {key} is not supported"


def test_an_arrow_adapter_is_refused_naming_arrow_config(tiny_llama_model, tmp_path, spec):
    """Arrow routes each token over several task adapters (PEFT builds it with create_arrow_model):
    its config, as PEFT writes it beside LoRA weights, is refused naming arrow_config."""
    from peft.tuners.lora.config import ArrowConfig

    config = dict(r=4, target_modules=["q_proj", "v_proj"])
    get_peft_model(copy.deepcopy(tiny_llama_model), LoraConfig(**config)).save_pretrained(tmp_path / "a")
    LoraConfig(**config, arrow_config=ArrowConfig(top_k=2)).save_pretrained(tmp_path / "a")
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["arrow_config"]["top_k"] == 2
    with pytest.raises(StatusError) as e:
        load(tmp_path / "a", spec)
    assert e.value.code.name == "INVALID_ARGUMENT"
    assert e.value.message == "adapter_config.json: arrow_config is not supported"
