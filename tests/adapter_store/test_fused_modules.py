"""PEFT adapters on Phi-3's fused modules (self_attn.qkv_proj, mlp.gate_up_proj): checked against the
base model's fused shapes, packed over the q/k/v and gate/up slices of the executor's layout with
their own scaling (rank_pattern / alpha_pattern keyed by the fused name, rsLoRA), and cut per TP
rank so that each rank's B @ A is its rows of PEFT's scaled delta; malformed ones refused."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraserve.adapter_store import base_model, pack, validate
from loraserve.adapter_store.config import StoreConfig
from loraserve.adapter_store.layout import check_layout
from loraserve.adapter_store.service import serve
from loraserve.adapter_store.sources import SourceConfig
from loraserve.client import StoreClient
from loraserve.errors import StatusError
from loraserve.executor.layout import declare_layout
from loraserve.executor.model.config import ModelConfig
from loraserve.executor.slot_layout import LoraSpec
from loraserve.v1 import common_pb2 as pb

H, I, HEADS, KV, V = 64, 96, 4, 2, 128
HD = H // HEADS
Q, KVS = HEADS * HD, KV * HD


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """(transformers Phi3ForCausalLM, its save_pretrained dir)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    cfg = Phi3Config(
        vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=2, num_attention_heads=HEADS,
        num_key_value_heads=KV, pad_token_id=None, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = Phi3ForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("phi3")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def fused_adapter(phi3, tmp_path_factory):
    """(adapter dir, its PEFT model): rank 6 rsLoRA on every linear kind and the embeddings, with
    qkv_proj at rank 4 and gate_up_proj at alpha 24 through PEFT's patterns."""
    from peft import LoraConfig, get_peft_model

    model, _ = phi3
    torch.manual_seed(1)
    cfg = LoraConfig(
        r=6, lora_alpha=12, use_rslora=True, rank_pattern={"qkv_proj": 4}, alpha_pattern={"gate_up_proj": 24},
        target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed_tokens", "lm_head"],
    )  # fmt: skip
    peft = get_peft_model(copy.deepcopy(model), cfg)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n or "lora_embedding_B" in n:
                p.normal_(0, 0.2)
    path = tmp_path_factory.mktemp("fused") / "adapter"
    peft.save_pretrained(path)
    return path, peft


def _spec(phi3):
    return base_model.from_hf_dir(phi3[1], "tiny-phi3")


def _layout(phi3, tp: int, fully: bool) -> pb.Layout:
    cfg = ModelConfig.from_hf_config(json.loads((phi3[1] / "config.json").read_text()))
    layout = declare_layout(cfg, LoraSpec(2, 16, torch.float32, targets_embeddings=True, fully_sharded=fully), "tiny-phi3", tp)
    check_layout(layout)
    return layout


def test_phi3_base_model_has_fused_module_shapes(phi3):
    spec = _spec(phi3)
    p = "model.layers.1"
    assert spec.module_shape(f"{p}.self_attn.qkv_proj") == (H, Q + 2 * KVS)
    assert spec.module_shape(f"{p}.mlp.gate_up_proj") == (H, 2 * I)
    assert spec.module_shape(f"{p}.self_attn.o_proj") == (Q, H) and spec.module_shape(f"{p}.mlp.down_proj") == (I, H)
    assert spec.module_shape(f"{p}.self_attn.q_proj") is None and spec.module_shape(f"{p}.mlp.gate_proj") is None


@pytest.mark.parametrize("tp, fully", [(1, False), (2, False), (2, True), (4, False)])
def test_each_ranks_shard_is_its_rows_of_the_peft_delta(phi3, fused_adapter, tp, fully):
    """Every slice s of a fused module at every rank: b_s @ a_s equals rows of PEFT's own
    scaling x B @ A (its q, k, v or gate, up part cut for the rank; kv heads replicated at tp 4)."""
    path, peft = fused_adapter
    adapter = pack.load_adapter(path, _spec(phi3), validate.Limits())
    assert {"model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj"} <= set(adapter.modules)
    layout = _layout(phi3, tp, fully)
    full = pack.pack_full(adapter, layout)
    layers = peft.base_model.model.model.layers
    shards = [pack.shard(full, layout, pb.ShardRank(tp_rank=rank)) for rank in range(tp)]
    for rank, shard in enumerate(shards):
        for i, layer in enumerate(layers):
            for name, module, parts in (
                ("self_attn.qkv_proj", layer.self_attn.qkv_proj, [(0, Q), (Q, KVS), (Q + KVS, KVS)]),
                ("mlp.gate_up_proj", layer.mlp.gate_up_proj, [(0, I), (I, I)]),
            ):
                delta = module.scaling["default"] * module.lora_B["default"].weight @ module.lora_A["default"].weight
                key = f"model.layers.{i}.{name}"
                b = shard[f"{key}.lora_b"]
                # fully sharded: each rank holds 1/tp of A's rank dim; the executor gathers them
                a = torch.cat([sh[f"{key}.lora_a"] for sh in shards], dim=1) if fully else shard[f"{key}.lora_a"]
                assert a.shape[0] == len(parts)
                row = 0
                for s, (start, n) in enumerate(parts):
                    keep = _rows(n, tp, rank, kv=name.startswith("self_attn") and s > 0)
                    got = b[row : row + len(keep)] @ a[s]
                    torch.testing.assert_close(got, delta[start:][keep], atol=1e-6, rtol=1e-5)
                    row += len(keep)
                assert row == b.shape[0]


def _rows(n: int, tp: int, rank: int, kv: bool) -> list[int]:
    """The rows of a slice of n rows rank keeps: 1/tp of them, or (kv heads fewer than tp) its head."""
    if kv and n // HD < tp:
        head = rank // (tp // (n // HD))
        return list(range(head * HD, (head + 1) * HD))
    part = n // tp
    return list(range(rank * part, (rank + 1) * part))


def test_fused_scaling_follows_the_fused_names_patterns(phi3, fused_adapter):
    adapter = pack.load_adapter(fused_adapter[0], _spec(phi3), validate.Limits())
    s = adapter.settings
    assert s.module_rank("model.layers.0.self_attn.qkv_proj") == 4 and s.module_rank("model.layers.0.mlp.gate_up_proj") == 6
    assert s.module_scale("model.layers.0.mlp.gate_up_proj") == pytest.approx(24 / 6**0.5)
    assert s.module_scale("model.layers.0.self_attn.qkv_proj") == pytest.approx(12 / 4**0.5)


def _edit(src, dst, edit_tensors=None, edit_config=None):
    shutil.copytree(src, dst)
    if edit_tensors:
        tensors = load_file(str(dst / "adapter_model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(dst / "adapter_model.safetensors"))
    if edit_config:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        edit_config(cfg)
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


QKV_B = "base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight"


def _grow_qkv_b(t):
    t[QKV_B] = torch.cat([t[QKV_B], t[QKV_B][:2]])  # two rows too many


def _as_q_proj(t):
    for part in ("lora_A", "lora_B"):
        t[f"base_model.model.model.layers.0.self_attn.q_proj.{part}.weight"] = t.pop(QKV_B.replace("lora_B", part))
    t["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"] = t[
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    ][:Q]


def test_malformed_fused_adapters_are_refused_by_validation(phi3, fused_adapter, tmp_path):
    spec, limits = _spec(phi3), validate.Limits()
    bad = _edit(fused_adapter[0], tmp_path / "rows", _grow_qkv_b)
    with pytest.raises(StatusError) as e:
        pack.load_adapter(bad, spec, limits)
    assert e.value.code.name == "INVALID_ARGUMENT"
    assert f"adapter maps {H} -> {Q + 2 * KVS + 2} features, base model 'tiny-phi3' has {H} -> {Q + 2 * KVS}" in e.value.message
    # q/k/v names (a Llama-style adapter) against the fused base model: refused, naming the fused module
    unfused = _edit(fused_adapter[0], tmp_path / "q", _as_q_proj, lambda c: c.update(rank_pattern={"qkv_proj": 4, "q_proj": 4}))
    with pytest.raises(StatusError, match="fuses q_proj into 'model.layers.0.self_attn.qkv_proj'"):
        pack.load_adapter(unfused, spec, limits)


def test_without_a_base_model_the_layout_refuses_wrong_fused_rows(phi3, fused_adapter, tmp_path):
    """A store started without the base model checks shapes at packing, against the executor's layout."""
    bad = pack.load_adapter(_edit(fused_adapter[0], tmp_path / "rows", _grow_qkv_b), None, validate.Limits())
    with pytest.raises(StatusError) as e:
        pack.pack_full(bad, _layout(phi3, 2, False))
    assert e.value.code.name == "FAILED_PRECONDITION"
    assert "layout module 'model.layers.0.self_attn.qkv_proj' expects 64 -> 128" in e.value.message
    # q/k/v names: the phi3 executor's layout serves only the fused module
    edit = lambda c: c.update(rank_pattern={"qkv_proj": 4, "q_proj": 4})  # noqa: E731
    unfused = pack.load_adapter(_edit(fused_adapter[0], tmp_path / "q", _as_q_proj, edit), None, validate.Limits())
    with pytest.raises(StatusError, match=r"the executor's layout does not serve: \['model.layers.0.self_attn.q_proj'\]"):
        pack.pack_full(unfused, _layout(phi3, 1, False))


def test_layout_refuses_a_fused_name_on_slices_apart(phi3):
    layout = _layout(phi3, 1, False)
    m = layout.modules[1]
    assert m.kind == pb.QKV and list(m.peft_modules) == ["model.layers.0.self_attn.qkv_proj"] * 3
    m.peft_modules[1] = "model.layers.0.self_attn.k_proj"
    with pytest.raises(StatusError, match="must name consecutive ones"):
        check_layout(layout)


def test_store_over_grpc_serves_fused_adapters_and_refuses_bad_rows(phi3, fused_adapter, tmp_path, loop_thread):
    root = tmp_path / "adapters"
    root.mkdir()
    shutil.copytree(fused_adapter[0], root / "good")
    _edit(fused_adapter[0], root / "bad", _grow_qkv_b)
    cfg = StoreConfig(
        listen="127.0.0.1:0", data_dir=tmp_path / "store", base_model="tiny-phi3", base_model_path=phi3[1],
        sources=SourceConfig(local_roots=(root.resolve(),)), limits=validate.Limits(max_rank=16),
    )  # fmt: skip
    server, port = loop_thread.run(serve(cfg), 30)
    try:
        client = StoreClient(f"127.0.0.1:{port}", timeout_s=60)
        client.register("good", str(root / "good"))
        layout = _layout(phi3, 2, False)
        _, blob = client.fetch_shard("good", layout, tp_rank=1)
        adapter = pack.load_adapter(root / "good", _spec(phi3), validate.Limits())
        want = pack.shard(pack.pack_full(adapter, layout), layout, pb.ShardRank(tp_rank=1))
        from safetensors.torch import load as st_load

        got = st_load(blob)
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
        with pytest.raises(StatusError) as e:
            client.register("bad", str(root / "bad"))
        assert e.value.code.name == "INVALID_ARGUMENT" and "self_attn.qkv_proj" in e.value.message
    finally:
        loop_thread.run(server.stop(0), 10)


@pytest.fixture(scope="module")
def fused_dora(phi3, tmp_path_factory):
    """(adapter dir, its PEFT model): DoRA (use_dora) on every fused and plain linear module, its
    magnitudes moved off their init value."""
    from peft import LoraConfig, get_peft_model

    model, _ = phi3
    torch.manual_seed(2)
    cfg = LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    peft = get_peft_model(copy.deepcopy(model), cfg)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
            elif "lora_magnitude_vector" in n:
                p.mul_(0.5 + torch.rand_like(p))
    path = tmp_path_factory.mktemp("fused-dora") / "adapter"
    peft.save_pretrained(path)
    return path, peft


@pytest.mark.parametrize("tp", [1, 2])
def test_a_dora_adapter_on_fused_modules_registers_and_each_rank_gets_its_rows_of_m(phi3, fused_dora, tmp_path, loop_thread, tp):
    """A fused PEFT module's one magnitude vector spans its slices: registered through the store,
    each rank's fetched shard holds, for every slice of qkv_proj / gate_up_proj, that rank's rows of
    PEFT's m (as B's rows are cut), and o_proj / down_proj (row-parallel) keep m whole."""
    from safetensors.torch import load as st_load

    root = tmp_path / "adapters"
    root.mkdir()
    shutil.copytree(fused_dora[0], root / "dora")
    cfg = StoreConfig(
        listen="127.0.0.1:0", data_dir=tmp_path / "store", base_model="tiny-phi3", base_model_path=phi3[1],
        sources=SourceConfig(local_roots=(root.resolve(),)), limits=validate.Limits(max_rank=16),
    )  # fmt: skip
    server, port = loop_thread.run(serve(cfg), 30)
    try:
        client = StoreClient(f"127.0.0.1:{port}", timeout_s=60)
        client.register("dora", str(root / "dora"))
        layout = _layout(phi3, tp, False)
        layers = fused_dora[1].base_model.model.model.layers
        for rank in range(tp):
            shard = st_load(client.fetch_shard("dora", layout, tp_rank=rank)[1])
            for i, layer in enumerate(layers):
                for name, module, parts in (
                    ("self_attn.qkv_proj", layer.self_attn.qkv_proj, [(0, Q), (Q, KVS), (Q + KVS, KVS)]),
                    ("mlp.gate_up_proj", layer.mlp.gate_up_proj, [(0, I), (I, I)]),
                ):
                    m = module.lora_magnitude_vector["default"].weight.detach().float()
                    want = torch.cat(
                        [
                            m[start:][_rows(n, tp, rank, kv=name.startswith("self_attn") and s > 0)]
                            for s, (start, n) in enumerate(parts)
                        ]
                    )
                    got = shard[f"model.layers.{i}.{name}.dora_m"]
                    assert got.dtype == torch.float32 and torch.equal(got, want), (rank, i, name)
                    assert got.shape[0] == shard[f"model.layers.{i}.{name}.lora_b"].shape[0]
                for name, module in (("self_attn.o_proj", layer.self_attn.o_proj), ("mlp.down_proj", layer.mlp.down_proj)):
                    m = module.lora_magnitude_vector["default"].weight.detach().float()
                    assert torch.equal(shard[f"model.layers.{i}.{name}.dora_m"], m)
    finally:
        loop_thread.run(server.stop(0), 10)
