"""Packing and slicing: shards of all ranks reassemble to the unsliced packed tensors, and
B @ A of the packed tensors equals the scaled delta read straight from the PEFT file."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file

from loraserve.adapter_store import pack, validate
from loraserve.adapter_store.layout import layout_hash
from loraserve.v1 import common_pb2 as pb

H, I, HEADS, KV, HD, V, LAYERS = 64, 128, 4, 2, 16, 128, 2


def dense_layout(tp: int, fully: bool, variant: str = "fused") -> pb.Layout:
    """The tiny Llama's modules declared as every dense kind: fused (QKV, MERGED_COLUMN, ROW,
    EMBEDDING, LM_HEAD) or split (COLUMN for q/k/gate/up, REPLICATED for v)."""
    lay = pb.Layout(tp_size=tp, fully_sharded=fully, ep_size=1, dtype="float32", max_rank=32, base_model="tiny")
    lay.modules.add(
        name="model.embed_tokens", kind=pb.EMBEDDING, input_size=V, output_sizes=[H], peft_modules=["model.embed_tokens"]
    )
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        if variant == "fused":
            lay.modules.add(
                name=f"{p}.self_attn.qkv_proj",
                kind=pb.QKV,
                input_size=H,
                output_sizes=[HEADS * HD, KV * HD, KV * HD],
                head_size=HD,
                peft_modules=[f"{p}.self_attn.{x}_proj" for x in "qkv"],
            )
            lay.modules.add(
                name=f"{p}.mlp.gate_up_proj",
                kind=pb.MERGED_COLUMN,
                input_size=H,
                output_sizes=[I, I],
                peft_modules=[f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"],
            )
        else:
            for x, kind, n in (("q", pb.COLUMN, HEADS * HD), ("k", pb.COLUMN, KV * HD), ("v", pb.REPLICATED, KV * HD)):
                lay.modules.add(
                    name=f"{p}.self_attn.{x}_proj",
                    kind=kind,
                    input_size=H,
                    output_sizes=[n],
                    peft_modules=[f"{p}.self_attn.{x}_proj"],
                )
            for x in ("gate", "up"):
                lay.modules.add(
                    name=f"{p}.mlp.{x}_proj", kind=pb.COLUMN, input_size=H, output_sizes=[I], peft_modules=[f"{p}.mlp.{x}_proj"]
                )
        lay.modules.add(
            name=f"{p}.self_attn.o_proj",
            kind=pb.ROW,
            input_size=HEADS * HD,
            output_sizes=[H],
            peft_modules=[f"{p}.self_attn.o_proj"],
        )
        lay.modules.add(
            name=f"{p}.mlp.down_proj", kind=pb.ROW, input_size=I, output_sizes=[H], peft_modules=[f"{p}.mlp.down_proj"]
        )
    lay.modules.add(name="lm_head", kind=pb.LM_HEAD, input_size=H, output_sizes=[V], peft_modules=["lm_head"])
    return lay


ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head"]


@pytest.fixture(scope="module")
def full_adapter(tiny_llama_model, tmp_path_factory):
    """A real PEFT adapter on every module kind, rank 6 (not a multiple of 4: exercises padding), rsLoRA."""
    torch.manual_seed(1)
    model = get_peft_model(
        copy.deepcopy(tiny_llama_model), LoraConfig(r=6, lora_alpha=12, target_modules=ALL_TARGETS, use_rslora=True)
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                param.normal_()
    directory = tmp_path_factory.mktemp("full-adapter")
    model.save_pretrained(directory)
    return directory


# -- an MoE model made of per-expert Linears, adapted by the peft library itself ------------
E = 4


class TinyMoE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        experts = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                {
                    "gate_proj": torch.nn.Linear(H, I, bias=False),
                    "up_proj": torch.nn.Linear(H, I, bias=False),
                    "down_proj": torch.nn.Linear(I, H, bias=False),
                }
            )
            for _ in range(E)
        )
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.model.layers[0].mlp = torch.nn.Module()
        self.model.layers[0].mlp.experts = experts


def moe_layout(tp: int, ep: int, fully: bool) -> pb.Layout:
    lay = pb.Layout(tp_size=tp, ep_size=ep, fully_sharded=fully, dtype="float32", max_rank=16)
    e = "model.layers.0.mlp.experts.{e}"
    lay.modules.add(
        name="model.layers.0.mlp.w13",
        kind=pb.MOE_W13,
        input_size=H,
        output_sizes=[I, I],
        num_experts=E,
        peft_modules=[f"{e}.gate_proj", f"{e}.up_proj"],
    )
    lay.modules.add(
        name="model.layers.0.mlp.w2",
        kind=pb.MOE_W2,
        input_size=I,
        output_sizes=[H],
        num_experts=E,
        peft_modules=[f"{e}.down_proj"],
    )
    return lay


@pytest.fixture(scope="module")
def moe_adapter(tmp_path_factory):
    torch.manual_seed(2)
    model = get_peft_model(TinyMoE(), LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    directory = tmp_path_factory.mktemp("moe-adapter")
    model.save_pretrained(directory)
    return directory


# -- reassembly: the inverse of slicing, written independently of adapter_store/layout.py ----
def _cat_or_same(parts, dim, cut):
    if cut:
        return torch.cat(parts, dim=dim)
    for p in parts[1:]:
        assert torch.equal(p, parts[0]), "a dimension that is not cut must be identical on every rank"
    return parts[0]


def reassemble(m: pb.ModuleLayout, parts: list[tuple[torch.Tensor, torch.Tensor]], tp: int, fully: bool):
    """parts[t] = (a, b) of TP rank t (after EP reassembly). Returns the unsliced (a, b)."""
    kind = m.kind
    column = kind in (pb.COLUMN, pb.LM_HEAD, pb.MERGED_COLUMN, pb.QKV, pb.MOE_W13)
    row = kind in (pb.ROW, pb.MOE_W2)
    a = _cat_or_same([p[0] for p in parts], -2 if column else -1, (column and fully) or row)
    if not (column or (row and fully)):
        return a, _cat_or_same([p[1] for p in parts], -2, False)
    local = [n // tp for n in m.output_sizes]
    if kind == pb.QKV and m.output_sizes[1] // m.head_size < tp:
        local[1] = local[2] = m.head_size  # one kv head per rank, replicated
    slices = []
    for s, n in enumerate(m.output_sizes):
        off = sum(local[:s])
        pieces = [p[1][..., off : off + local[s], :] for p in parts]
        if local[s] * tp != n:  # replicated kv heads: keep one copy of each head
            group = tp // (n // local[s])
            for t in range(tp):
                assert torch.equal(pieces[t], pieces[t - t % group])
            pieces = pieces[::group]
        slices.append(torch.cat(pieces, dim=-2))
    return a, torch.cat(slices, dim=-2)


def shards_for(adapter, layout):
    full = pack.pack_full(adapter, layout)
    tp, ep = layout.tp_size, layout.ep_size or 1
    shards = {(t, e): pack.shard(full, layout, pb.ShardRank(tp_rank=t, ep_rank=e)) for t in range(tp) for e in range(ep)}
    return full, shards


def check_reassembly(layout, full, shards):
    tp, ep = layout.tp_size, layout.ep_size or 1
    for m in layout.modules:
        if m.name not in full:
            continue
        per_tp = []
        for t in range(tp):
            a = (
                torch.cat([shards[(t, e)][f"{m.name}.lora_a"] for e in range(ep)], dim=0)
                if ep > 1
                else shards[(t, 0)][f"{m.name}.lora_a"]
            )
            b = (
                torch.cat([shards[(t, e)][f"{m.name}.lora_b"] for e in range(ep)], dim=0)
                if ep > 1
                else shards[(t, 0)][f"{m.name}.lora_b"]
            )
            per_tp.append((a, b))
        a, b = reassemble(m, per_tp, tp, layout.fully_sharded)
        assert torch.equal(a, full[m.name][0]), m.name
        assert torch.equal(b, full[m.name][1]), m.name


def peft_delta(directory, module: str, scale: float) -> torch.Tensor:
    """The scaled delta W = s * B @ A straight from the PEFT file ([out, in]; embeddings [dim, vocab])."""
    t = load_file(directory / "adapter_model.safetensors")
    key = f"base_model.model.{module}"
    a = t.get(f"{key}.lora_A.weight", t.get(f"{key}.lora_embedding_A"))
    b = t.get(f"{key}.lora_B.weight", t.get(f"{key}.lora_embedding_B"))
    return scale * (b.double() @ a.double())


@pytest.mark.parametrize("variant", ["fused", "split"])
@pytest.mark.parametrize("fully", [False, True])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_dense_shards_reassemble_to_packed_tensors(full_adapter, tp, fully, variant):
    adapter = pack.load_adapter(full_adapter, None, validate.Limits())
    layout = dense_layout(tp, fully, variant)
    full, shards = shards_for(adapter, layout)
    assert len(full) == len(layout.modules)
    check_reassembly(layout, full, shards)


def test_packed_b_times_a_equals_scaled_peft_delta(full_adapter):
    adapter = pack.load_adapter(full_adapter, None, validate.Limits())
    layout = dense_layout(1, False)
    full = pack.pack_full(adapter, layout)
    scale = 12 / math.sqrt(6)  # rsLoRA: alpha / sqrt(r)
    for m in layout.modules:
        a, b = (x.double() for x in full[m.name])
        if m.kind == pb.EMBEDDING:
            assert torch.allclose(b @ a.T, peft_delta(full_adapter, m.peft_modules[0], scale), atol=1e-5)
            continue
        off = 0
        for s, (name, n) in enumerate(zip(m.peft_modules, m.output_sizes)):
            assert torch.allclose(b[off : off + n] @ a[s], peft_delta(full_adapter, name, scale), atol=1e-5), name
            off += n


@pytest.mark.parametrize("tp,ep,fully", [(1, 1, False), (2, 1, False), (4, 1, True), (1, 2, False), (2, 2, True), (4, 4, False)])
def test_moe_shards_keep_local_experts_and_reassemble(moe_adapter, tp, ep, fully):
    adapter = pack.load_adapter(moe_adapter, None, validate.Limits())
    layout = moe_layout(tp, ep, fully)
    full, shards = shards_for(adapter, layout)
    assert full["model.layers.0.mlp.w13"][0].shape == (E, 2, 4, H)
    assert shards[(0, ep - 1)]["model.layers.0.mlp.w2.lora_a"].shape[0] == E // ep
    check_reassembly(layout, full, shards)
    a, b = (x.double() for x in full["model.layers.0.mlp.w2"])
    for e in range(E):
        want = peft_delta(moe_adapter, f"model.layers.0.mlp.experts.{e}.down_proj", 8 / 4)
        assert torch.allclose(b[e] @ a[e, 0], want, atol=1e-5)


def test_untargeted_slice_is_zero_and_untargeted_module_absent(peft_adapter):
    directory = peft_adapter(r=4, target_modules=("q_proj", "v_proj"))
    adapter = pack.load_adapter(directory, None, validate.Limits())
    full = pack.pack_full(adapter, dense_layout(1, False))
    a, b = full["model.layers.0.self_attn.qkv_proj"]
    assert a[1].abs().sum() == 0 and b[HEADS * HD : HEADS * HD + KV * HD].abs().sum() == 0  # k slice
    assert a[0].abs().sum() > 0 and a[2].abs().sum() > 0
    assert "model.layers.0.mlp.down_proj" not in full


def test_shard_blob_is_cast_and_self_describing(peft_adapter):
    from safetensors import safe_open

    directory = peft_adapter(r=8, target_modules=("q_proj", "o_proj"))
    adapter = pack.load_adapter(directory, None, validate.Limits())
    layout = dense_layout(2, True)
    layout.dtype = "bfloat16"
    rank = pb.ShardRank(tp_rank=1)
    blob = pack.shard_blob(adapter, pack.shard(pack.pack_full(adapter, layout), layout, rank), layout, rank)
    path = directory / "shard.safetensors"
    path.write_bytes(blob)
    with safe_open(path, "pt") as f:
        meta = f.metadata()
        qkv_a = f.get_tensor("model.layers.0.self_attn.qkv_proj.lora_a")
    assert meta["format"] == "loraserve.shard.v1" and meta["adapter_digest"] == adapter.digest
    assert meta["layout_hash"] == layout_hash(layout) and meta["tp_rank"] == "1" and meta["rank_padded"] == "8"
    assert qkv_a.dtype == torch.bfloat16 and qkv_a.shape == (3, 4, H)  # fully sharded: rank 8 cut in 2


def test_rank_pattern_modules_get_their_own_rank_and_scale(tiny_llama_model, tmp_path):
    torch.manual_seed(3)
    cfg = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 8}, alpha_pattern={"v_proj": 32}
    )
    model = get_peft_model(copy.deepcopy(tiny_llama_model), cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    model.save_pretrained(tmp_path)
    adapter = pack.load_adapter(tmp_path, None, validate.Limits())
    assert adapter.rank == 8
    a, b = (x.double() for x in pack.pack_full(adapter, dense_layout(1, False))["model.layers.1.self_attn.qkv_proj"])
    v0 = HEADS * HD + KV * HD
    assert torch.allclose(b[v0:] @ a[2], peft_delta(tmp_path, "model.layers.1.self_attn.v_proj", 32 / 8), atol=1e-5)
    assert torch.allclose(b[: HEADS * HD] @ a[0], peft_delta(tmp_path, "model.layers.1.self_attn.q_proj", 8 / 4), atol=1e-5)


def test_adapter_rank_above_layout_max_rank_is_failed_precondition(peft_adapter):
    from loraserve.errors import StatusError

    adapter = pack.load_adapter(peft_adapter(r=16), None, validate.Limits())
    layout = dense_layout(1, False)
    layout.max_rank = 8
    with pytest.raises(StatusError) as e:
        pack.pack_full(adapter, layout)
    assert e.value.code.name == "FAILED_PRECONDITION" and "rank 16" in e.value.message


def test_shard_keys_change_with_the_packer_version_and_the_layout(monkeypatch):
    """A shard an older packer left in a cache is never found by a newer store (it repacks): the
    key's middle part covers the packer's version beside the layout, in the cache's key form."""
    from loraserve.adapter_store.cache_tier import KEY_RE

    digest, rank = "ab" * 32, pb.ShardRank(tp_rank=1, ep_rank=0)
    key = pack.shard_key(digest, dense_layout(2, False), rank)
    assert KEY_RE.fullmatch(key) and key.startswith(f"{digest}/") and key.endswith("/tp1-ep0")
    assert pack.shard_key(digest, dense_layout(2, True), rank) != key
    monkeypatch.setattr(pack, "PACKER_VERSION", pack.PACKER_VERSION - 1)
    older = pack.shard_key(digest, dense_layout(2, False), rank)
    assert KEY_RE.fullmatch(older) and older != key
