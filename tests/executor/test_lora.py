"""LoRA slots against transformers + PEFT: every row of a mixed batch matches its own adapter."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from loraserve.executor.layout import declare_layout
from loraserve.executor.lora import lora_modules
from loraserve.executor.model.loader import load_hf_checkpoint
from loraserve.executor.shard_tensors import shard_signature
from loraserve.executor.slot_layout import LoraSpec, packs_b_on
from loraserve.executor.slot_load import _slot_targets, load_shard_into_slot, queued_load
from loraserve.v1 import common_pb2

from .conftest import b_packed

peft = pytest.importorskip("peft")

ATOL = 1e-4
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "r4": dict(r=4, lora_alpha=8, target_modules=ALL_LINEAR),
    # k_proj, o_proj, up_proj untargeted: their slices are zeros in the shard
    "r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"], use_rslora=True),
    "emb": dict(r=6, lora_alpha=6, target_modules=["embed_tokens", "lm_head", "q_proj"]),
}


def pack_shard(peft_model, name: str, layout, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Stand-in for the store's packer, following docs/SHARD_FORMAT.md: A per slice, B scaled by
    alpha/r (alpha/sqrt(r) with rsLoRA) and concatenated over slices; untargeted slices are zeros."""
    cfg = peft_model.peft_config[name]
    scale = cfg.lora_alpha / (math.sqrt(cfg.r) if cfg.use_rslora else cfg.r)
    state = peft.get_peft_model_state_dict(peft_model, adapter_name=name, save_embedding_layers=False)
    state = {k.removeprefix("base_model.model."): v for k, v in state.items()}
    shard = {}
    for m in layout.modules:
        if m.kind == common_pb2.EMBEDDING:
            pm = m.peft_modules[0]
            if f"{pm}.lora_embedding_A" in state:
                shard[f"{m.name}.lora_a"] = state[f"{pm}.lora_embedding_A"].T.to(dtype).contiguous()  # [vocab, r]
                shard[f"{m.name}.lora_b"] = (state[f"{pm}.lora_embedding_B"] * scale).to(dtype)  # [dim, r]
            continue
        a_parts, b_parts, targeted = [], [], False
        for pm, n_out in zip(m.peft_modules, m.output_sizes):
            a = state.get(f"{pm}.lora_A.weight")
            if a is None:
                a_parts.append(torch.zeros(cfg.r, m.input_size))
                b_parts.append(torch.zeros(n_out, cfg.r))
            else:
                targeted = True
                a_parts.append(a)
                b_parts.append(state[f"{pm}.lora_B.weight"] * scale)
        if targeted:
            shard[f"{m.name}.lora_a"] = torch.stack(a_parts).to(dtype).contiguous()  # [S, r, in]
            shard[f"{m.name}.lora_b"] = torch.cat(b_parts).to(dtype).contiguous()  # [N, r]
    return shard


def random_peft(base, name: str, seed: int = 3):
    """A copy of `base` with ADAPTERS[name] as a peft adapter of that name, its B drawn with std 0.2
    (peft inits it to 0) under torch.manual_seed(seed); in eval mode."""
    torch.manual_seed(seed)
    ref = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**ADAPTERS[name]), adapter_name=name)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    return ref.eval()


@pytest.fixture(scope="module")
def setup(hf_model):
    """(reference PeftModel with adapters r4, r8, emb; base checkpoint dir)."""
    base, path = hf_model("llama")
    ref = None
    for name, kwargs in ADAPTERS.items():
        cfg = peft.LoraConfig(**kwargs)
        if ref is None:
            ref = peft.get_peft_model(copy.deepcopy(base), cfg, adapter_name=name)
        else:
            ref.add_adapter(name, cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for pname, p in ref.named_parameters():
            if "lora_" in pname:  # PEFT inits B (and embedding A) to zero: make every adapter matter
                p.normal_(0, 0.2)
    return ref.eval(), path


def _reference(ref, adapter, ids):
    with torch.no_grad():
        if adapter is None:
            with ref.disable_adapter():
                return ref(torch.tensor([ids])).logits[0]
        ref.set_adapter(adapter)
        return ref(torch.tensor([ids])).logits[0]


def _model(path, targets_embeddings=False, max_loras=3, max_rank=8, packed_b=False):
    """packed_b: the dense layers' B packed at each slot's rank, CUDA's layout, here on the CPU."""
    spec = LoraSpec(max_loras=max_loras, max_rank=max_rank, dtype=torch.float32, targets_embeddings=targets_embeddings)
    with b_packed(packed_b):
        return load_hf_checkpoint(path, lora=spec), spec


def _prompt(n, seed):
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("packed_b", [False, True], ids=["b-rows", "b-packed"])
def test_mixed_batch_rows_match_their_own_adapter(setup, paged_runner, packed_b):
    """packed_b: the dense layers' B packed at each slot's rank (CUDA's layout)."""
    ref, path = setup
    model, spec = _model(path, max_rank=16, packed_b=packed_b)  # slots wider than r8: packed rows differ from [N, R]
    from loraserve.executor.lora import LinearWithLoRA

    dense = [m.packed_b for m in model.modules() if isinstance(m, LinearWithLoRA) and m.lora_a is not None]
    assert dense and dense == [packed_b] * len(dense)
    layout = declare_layout(model.cfg, spec, "tiny-llama")
    load_shard_into_slot(model, 0, pack_shard(ref, "r4", layout))
    load_shard_into_slot(model, 2, pack_shard(ref, "r8", layout))

    pa, pb, pbase, pa2 = _prompt(9, 10), _prompt(6, 11), _prompt(7, 12), _prompt(5, 13)
    run = paged_runner(model, block_size=4)
    # one step: adapter r4, adapter r8, the base model, and a second sequence of adapter r4
    outs = run.step([("a", pa), ("b", pb), ("base", pbase), ("a2", pa2)], slots=[0, 2, -1, 0])
    for out, adapter, ids in zip(outs, ["r4", "r8", None, "r4"], [pa, pb, pbase, pa2]):
        torch.testing.assert_close(out, _reference(ref, adapter, ids), atol=ATOL, rtol=1e-4)

    # then decode: one new token each, in a different order
    nxt = {k: int(o[-1].argmax()) for k, o in zip(["a", "b", "base", "a2"], outs)}
    outs = run.step([("base", [nxt["base"]]), ("b", [nxt["b"]]), ("a", [nxt["a"]])], slots=[-1, 2, 0])
    for out, adapter, ids in zip(outs, [None, "r8", "r4"], [pbase + [nxt["base"]], pb + [nxt["b"]], pa + [nxt["a"]]]):
        torch.testing.assert_close(out, _reference(ref, adapter, ids)[-1:], atol=ATOL, rtol=1e-4)


def test_dense_layers_pack_b_on_cuda_only(hf_model):
    """The executor packs each dense layer's B at the slot's rank where the slot buffers are on CUDA
    (the Triton expand reads a low-rank adapter's B in whole sectors), never on the CPU (the reference
    would unpack every slot each step); where it packs, only the dense layers whose rank dim is whole
    and a multiple of 8 do."""
    from loraserve.executor.lora import LinearWithLoRA

    assert packs_b_on(torch.device("cuda")) and packs_b_on(torch.device("cuda", 1))
    assert not packs_b_on(torch.device("cpu"))
    _, path = hf_model("llama")
    cpu, _ = _model(path, max_rank=16)
    assert not any(m.packed_b for m in lora_modules(cpu).values())
    packed, _ = _model(path, max_rank=16, packed_b=True)
    assert all(m.packed_b for m in lora_modules(packed).values() if isinstance(m, LinearWithLoRA))
    odd, _ = _model(path, max_rank=12, packed_b=True)
    assert not any(m.packed_b for m in lora_modules(odd).values())


def test_base_rows_equal_the_model_without_lora(setup, paged_runner):
    ref, path = setup
    model, spec = _model(path)
    load_shard_into_slot(model, 1, pack_shard(ref, "r4", declare_layout(model.cfg, spec, "tiny")))
    ids = _prompt(8, 14)
    with_slots, _ = paged_runner(model).step([("x", ids), ("y", ids)], slots=[-1, 1])
    (without_lora,) = paged_runner(model).step([("x", ids)])
    torch.testing.assert_close(with_slots, without_lora, atol=0, rtol=0)


def test_embedding_and_lm_head_lora_match_peft(setup, paged_runner):
    ref, path = setup
    model, spec = _model(path, targets_embeddings=True)
    layout = declare_layout(model.cfg, spec, "tiny")
    shard = pack_shard(ref, "emb", layout)
    assert {"model.embed_tokens.lora_a", "lm_head.lora_b"} <= set(shard)
    load_shard_into_slot(model, 1, shard)
    load_shard_into_slot(model, 0, pack_shard(ref, "r4", layout))
    pe, pa = _prompt(7, 15), _prompt(4, 16)
    out_e, out_a = paged_runner(model).step([("e", pe), ("a", pa)], slots=[1, 0])
    torch.testing.assert_close(out_e, _reference(ref, "emb", pe), atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(out_a, _reference(ref, "r4", pa), atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("packed_b", [False, True], ids=["b-rows", "b-packed"])
def test_reloading_a_slot_with_a_lower_rank_adapter_clears_the_old_tail(setup, paged_runner, packed_b):
    ref, path = setup
    model, spec = _model(path, max_loras=1, max_rank=16, packed_b=packed_b)
    layout = declare_layout(model.cfg, spec, "tiny")
    load_shard_into_slot(model, 0, pack_shard(ref, "r8", layout))  # rank 8 fills the slot
    load_shard_into_slot(model, 0, pack_shard(ref, "r4", layout))  # rank 4 must zero ranks 4..7
    ids = _prompt(6, 17)
    (out,) = paged_runner(model).step([("s", ids)], slots=[0])
    torch.testing.assert_close(out, _reference(ref, "r4", ids), atol=ATOL, rtol=1e-4)

    for module in lora_modules(model).values():
        module.reset_lora(0)
    (out,) = paged_runner(model).step([("s", ids)], slots=[0])
    torch.testing.assert_close(out, _reference(ref, None, ids), atol=ATOL, rtol=1e-4)


def test_rank_cut_and_module_skip_equal_the_full_slot_rank(setup):
    """Layers cut the rank to the step's largest and skip modules no active adapter targets:
    the result must be what the full max_rank computes (buffers are zero past each rank)."""
    from loraserve.kernels import make_lora_meta

    ref, path = setup
    model, spec = _model(path, max_loras=3, max_rank=16)
    layout = declare_layout(model.cfg, spec, "tiny")
    # the slot's rank as the kernels may read it: the largest among the shard's modules
    assert load_shard_into_slot(model, 0, pack_shard(ref, "r4", layout)) == 4
    assert load_shard_into_slot(model, 1, pack_shard(ref, "r8", layout)) == 8  # targets no o_proj, no up_proj
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.qkv_proj.slot_ranks == [4, 8, 0] and attn.o_proj.slot_ranks == [4, 0, 0]
    assert mlp.gate_up_proj.slot_ranks == [4, 8, 0] and mlp.down_proj.slot_ranks == [4, 8, 0]
    x = torch.randn(40, model.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    # 5 tokens: the gathered (decode) path; 40: the slot-group (prefill) path
    for slots in ([0, 1, -1, 1, 0], [1, 1, -1, 1, 1], [-1, 1, 0, 0, 0], [1, 0, -1, 1] * 10):
        full = make_lora_meta(torch.tensor(slots), 3)  # no host_slots: the full slot rank
        cut = make_lora_meta(torch.tensor(slots), 3, frozenset(s for s in slots if s >= 0))
        for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj):
            xs = x[: len(slots)]
            torch.testing.assert_close(m(xs, cut), m(xs, full), atol=1e-6, rtol=1e-6)
    only_r8 = make_lora_meta(torch.tensor([1, 1]), 3, frozenset({1}))
    torch.testing.assert_close(attn.o_proj(x[:2], only_r8), attn.o_proj(x[:2]), atol=0, rtol=0)  # skipped
    assert not torch.equal(attn.qkv_proj(x[:2], only_r8), attn.qkv_proj(x[:2]))  # r8 targets q and v
    attn.qkv_proj.reset_lora(1)
    assert attn.qkv_proj.slot_ranks == [4, 0, 0]


def test_bad_shards_are_refused_before_any_slot_changes(setup):
    ref, path = setup
    model, spec = _model(path)
    shard = pack_shard(ref, "r4", declare_layout(model.cfg, spec, "tiny"))
    qkv = model.model.layers[0].self_attn.qkv_proj

    with pytest.raises(ValueError, match="model.layers.9.mlp.up_proj.lora_a"):
        load_shard_into_slot(model, 0, {**shard, "model.layers.9.mlp.up_proj.lora_a": torch.zeros(1)})
    too_big = {**shard, "model.layers.1.mlp.down_proj.lora_b": torch.zeros(64, 16)}  # rank 16 > max_rank 8
    with pytest.raises(ValueError, match="down_proj.lora_b"):
        load_shard_into_slot(model, 0, too_big)
    wrong_dtype = {**shard, "model.layers.1.mlp.down_proj.lora_a": shard["model.layers.1.mlp.down_proj.lora_a"].half()}
    with pytest.raises(ValueError, match="float16"):
        load_shard_into_slot(model, 0, wrong_dtype)
    only_a = {k: v for k, v in shard.items() if k != "model.layers.0.mlp.down_proj.lora_b"}
    with pytest.raises(ValueError, match="only one of"):
        load_shard_into_slot(model, 0, only_a)
    assert not qkv.lora_a.any() and not qkv.lora_b.any()  # nothing was written


def test_layout_declares_every_lora_module_with_its_peft_names(hf_model):
    _, path = hf_model("llama")
    model, spec = _model(path, targets_embeddings=True)
    layout = declare_layout(model.cfg, spec, "tiny-llama")
    assert set(m.name for m in layout.modules) == set(lora_modules(model))
    by_name = {m.name: m for m in layout.modules}
    c = model.cfg
    qkv = by_name["model.layers.1.self_attn.qkv_proj"]
    assert qkv.kind == common_pb2.QKV and qkv.head_size == c.head_dim
    assert list(qkv.output_sizes) == [c.q_size, c.kv_size, c.kv_size]
    assert list(qkv.peft_modules) == [f"model.layers.1.self_attn.{p}_proj" for p in "qkv"]
    gate_up = by_name["model.layers.0.mlp.gate_up_proj"]
    assert gate_up.kind == common_pb2.MERGED_COLUMN
    assert list(gate_up.peft_modules) == ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
    assert by_name["model.layers.0.self_attn.o_proj"].kind == common_pb2.ROW
    assert by_name["model.layers.0.mlp.down_proj"].input_size == c.intermediate_size
    assert by_name["model.embed_tokens"].kind == common_pb2.EMBEDDING
    assert list(by_name["lm_head"].peft_modules) == ["lm_head"] and by_name["lm_head"].kind == common_pb2.LM_HEAD
    assert (layout.dtype, layout.max_rank, layout.tp_size, layout.ep_size) == ("float32", 8, 1, 1)
    # every module's slot buffers have the layout's sizes
    for m in layout.modules:
        mod = lora_modules(model)[m.name]
        if m.kind != common_pb2.EMBEDDING:
            assert mod.lora_a.shape == (spec.max_loras, len(m.output_sizes), spec.max_rank, m.input_size)
            assert mod.lora_b.shape == (spec.max_loras, sum(m.output_sizes), spec.max_rank)

    no_emb, no_emb_spec = _model(path)
    assert "lm_head" not in lora_modules(no_emb)
    assert len(declare_layout(no_emb.cfg, no_emb_spec, "x").modules) == 4 * c.num_layers


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: pinned memory and a GPU slot")
def test_a_shard_in_one_pinned_buffer_loads_with_one_copy_and_equals_per_tensor_copies(setup):
    """The slot load's staged path (one host->device copy of the pinned blob, then a device scatter)
    writes exactly what per-tensor copies write, tails zeroed, on a slot that held a higher rank."""
    from loraserve.executor.store_client import pinned_blob

    ref, path = setup
    staged, spec = _model(path, max_loras=1)
    plain, _ = _model(path, max_loras=1)
    staged, plain = staged.cuda(), plain.cuda()
    layout = declare_layout(staged.cfg, spec, "tiny")
    high, low = pack_shard(ref, "r8", layout), pack_shard(ref, "r4", layout)
    load_shard_into_slot(staged, 0, pinned_blob(high))
    load_shard_into_slot(staged, 0, pinned_blob(low))  # one storage: the staged path
    load_shard_into_slot(plain, 0, {k: v.clone() for k, v in low.items()})  # separate tensors: per-tensor copies
    torch.cuda.synchronize()
    for (name, a), b in zip(lora_modules(staged).items(), lora_modules(plain).values()):
        assert torch.equal(a.lora_a, b.lora_a) and torch.equal(a.lora_b, b.lora_b), name

    # a layout planned before: its bytes are staged before the slot-buffer check; the slot manager
    # may queue a load from its loop once the plan's tables for what the slot holds are built too
    def marked(shard):  # as the CPU cache keeps a CUDA executor's shard
        shard = pinned_blob(shard)
        shard_signature(shard)
        shard.pinned = True
        return shard

    again = marked(high)
    assert not queued_load(staged, 0, again)  # high's tables over a slot holding rank 4: not built yet
    load_shard_into_slot(staged, 0, again)
    load_shard_into_slot(plain, 0, {k: v.clone() for k, v in high.items()})
    torch.cuda.synchronize()
    for (name, a), b in zip(lora_modules(staged).items(), lora_modules(plain).values()):
        assert torch.equal(a.lora_a, b.lora_a) and torch.equal(a.lora_b, b.lora_b), name
    low_again = marked(low)
    assert queued_load(plain, 0, low_again) is None and queued_load(staged, 0, dict(low_again)) is None
    finish = queued_load(staged, 0, low_again)  # low over rank 8: planned and built by the second load
    assert finish is not None  # its bytes staged: the load begun
    assert finish() == 4
    load_shard_into_slot(plain, 0, {k: v.clone() for k, v in low.items()})
    torch.cuda.synchronize()
    for (name, a), b in zip(lora_modules(staged).items(), lora_modules(plain).values()):
        assert torch.equal(a.lora_a, b.lora_a) and torch.equal(a.lora_b, b.lora_b), name


def test_a_packed_b_is_written_alike_by_the_scatter_plan_and_by_per_tensor_copies(setup, paged_runner, monkeypatch):
    """A packed B (CUDA's layout): a slot's B holds [N, r8] rows from its start, r8 the adapter's rank rounded
    up to 8. A shard in one storage takes the scatter plan (here its PyTorch oracle, the Triton
    kernel's test reference), separate tensors take per-tensor copies: both write the same rows,
    zeros past each module's own rank, over a slot that held a higher rank; the rows read back as
    PEFT's B, and the layer's output is the adapter's."""
    from loraserve.executor import store_client
    from loraserve.executor.slot_layout import packed_rows
    from loraserve.kernels.copy_reference import slot_scatter

    monkeypatch.setattr(store_client, "host_buffer", lambda n, pin_memory: torch.empty(n, dtype=torch.uint8))
    ref, path = setup
    planned, spec = _model(path, max_loras=1, max_rank=16, packed_b=True)  # r8 8 in rank-16 slots
    plain, _ = _model(path, max_loras=1, max_rank=16, packed_b=True)
    layout = declare_layout(planned.cfg, spec, "tiny")
    high, low = pack_shard(ref, "r8", layout), pack_shard(ref, "r4", layout)
    for model, shard in ((planned, store_client.pinned_blob(high)), (plain, high)):
        assert load_shard_into_slot(model, 0, shard, scatter=slot_scatter) == 8
    for model, shard in ((planned, store_client.pinned_blob(low)), (plain, dict(low))):
        assert load_shard_into_slot(model, 0, shard, scatter=slot_scatter) == 4
    assert _slot_targets(planned).layouts and all(v.plan is not None for v in _slot_targets(planned).layouts.values())
    assert all(v.plan is None for v in _slot_targets(plain).layouts.values())  # separate tensors: per-tensor copies

    def check(shard, adapter):
        for (name, a), b in zip(lora_modules(planned).items(), lora_modules(plain).values()):
            assert torch.equal(a.lora_a, b.lora_a), name
            rows = packed_rows(a.lora_b, 0, 8)  # [N, 8]: ranks 4 and 8 both
            assert torch.equal(rows, packed_rows(b.lora_b, 0, 8)), name
            src = shard.get(f"{name}.lora_b")
            if src is None:
                assert not rows.any(), name  # a module the adapter does not target: zeros
            else:
                assert torch.equal(rows[:, : src.shape[1]], src) and not rows[:, src.shape[1] :].any(), name
        ids = _prompt(6, 18)
        (out,) = paged_runner(planned).step([("s", ids)], slots=[0])
        torch.testing.assert_close(out, _reference(ref, adapter, ids), atol=ATOL, rtol=1e-4)

    check(low, "r4")
    assert set(high) < {f"{n}.{p}" for n in lora_modules(planned) for p in ("lora_a", "lora_b")}  # r8 skips a module
    for model, shard in ((planned, store_client.pinned_blob(high)), (plain, dict(high))):  # and again over rank 4
        assert load_shard_into_slot(model, 0, shard, scatter=slot_scatter) == 8
    check(high, "r8")
