"""DoRA adapters served beside plain LoRA: real store and executor on loopback (tp 1 and tp 2 on
CPU gloo), adapters made by peft with use_dora=True, every row of batches mixing DoRA, plain LoRA
and base rows checked against transformers + PEFT alone, through loads and evictions that move
each adapter between the two slots; the layers' DoRA scale applied only where a slot holds DoRA."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from loraserve.adapter_store import validate

from .conftest import Cluster, check_against_reference, check_bf16_rows, cpu_cluster, run_group

# (family, tp_size, config overrides): Llama with biases on every projection (o_proj and down_proj
# are row-parallel under tp 2: their bias is added after the DoRA scale, after the reduce), Qwen2
# with q/k/v biases and tied embeddings.
CASES = {
    "llama-tp1": ("llama", 1, dict(attention_bias=True, mlp_bias=True)),
    "llama-tp2": ("llama", 2, dict(attention_bias=True, mlp_bias=True)),
    "qwen2-tp2": ("qwen2", 2, dict(tie_word_embeddings=True)),
}
ATTN, MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
ADAPTERS = {  # name: (r, alpha, targets, rslora, dora)
    "dora4": (4, 8, ATTN + MLP, False, True),
    "dora16rs": (16, 16, ATTN + MLP, True, True),
    "dora32qv": (32, 16, ("q_proj", "v_proj", "down_proj"), False, True),
    "dora8mlp": (8, 8, MLP, True, True),
    "lora8": (8, 16, ("q_proj", "v_proj", "o_proj", "down_proj"), False, False),
}
# Two slots: every group loads and evicts, so each adapter lands in another slot than before.
GROUPS = (["dora4", "lora8", "", "dora16rs"], ["dora32qv", "", "dora4", "dora8mlp"], ["dora16rs", "lora8", "dora4", ""])


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    return CASES[request.param]


@pytest.fixture(scope="module")
def base(byte_model, case):
    family, _, overrides = case
    return byte_model(family, **overrides)


def make_adapter(model, directory, seed: int, r: int, alpha: float, targets, rslora: bool, use_dora: bool):
    """A peft adapter with random B and (DoRA) magnitudes moved off their init value ||W||."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft = get_peft_model(
        copy.deepcopy(model),
        LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora, use_dora=use_dora),
    )
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
            elif "lora_magnitude_vector" in n:
                p.mul_(0.5 + torch.rand_like(p))
    peft.save_pretrained(directory)


@pytest.fixture(scope="module")
def adapter_dirs(base, tmp_path_factory):
    model, _ = base
    root = tmp_path_factory.mktemp("adapters")
    for seed, (name, spec) in enumerate(ADAPTERS.items()):
        make_adapter(model, root / name, seed, *spec)
    return root


@pytest.fixture(scope="module")
def references(base, adapter_dirs):
    from peft import PeftModel

    model, _ = base
    refs = {"": model}
    for name in ADAPTERS:
        refs[name] = PeftModel.from_pretrained(copy.deepcopy(model), adapter_dirs / name).eval()
    return refs


def cluster_of(lt, base, adapter_dirs, data, tp: int, names=ADAPTERS, **overrides) -> Cluster:
    """A store and an executor started with DoRA on (enable_dora; overrides may turn it off)."""
    return cpu_cluster(lt, base[1], adapter_dirs, data, names, tp, max_rank=32, **{"enable_dora": True, **overrides})


def test_dora_rows_match_transformers_peft_in_mixed_batches_across_slots(
    case, references, base, adapter_dirs, module_loop_thread, tmp_path
):
    _, tp, _ = case
    c = cluster_of(module_loop_thread, base, adapter_dirs, tmp_path / "store", tp)
    try:
        kinds = {m.name: m.kind for m in c.store_client().list()}
        assert kinds == {n: "dora" if spec[4] else "lora" for n, spec in ADAPTERS.items()}
        client = c.client()
        assert client.info().tp_size == tp
        for group in GROUPS:
            jobs, resps = run_group(client, group)
            for (name, ids), resp in zip(jobs, resps):
                check_against_reference(references[name], ids, resp)
    finally:
        c.close()


@pytest.mark.gpu
def test_dora_rows_on_cuda_through_the_graphs_in_bf16(case, references, base, adapter_dirs, loop_thread, tmp_path):
    """The same batches on CUDA in bf16 (the Triton kernels; decode steps replay the CUDA graphs,
    whose DoRA scale reads the slots' device buffers): every row within bf16 tolerance of its own
    adapter's float32 PEFT reference."""
    from .conftest import need_cuda_devices

    _, tp, _ = case
    need_cuda_devices(tp)
    c = cluster_of(loop_thread, base, adapter_dirs, tmp_path / "store", tp, device="cuda", dtype="bfloat16")
    try:
        for group in GROUPS:
            jobs, resps = run_group(c.client(), group)
            check_bf16_rows(references, jobs, resps)
    finally:
        c.close()


PAIR = {"dora4": ADAPTERS["dora4"], "lora8": ADAPTERS["lora8"]}


@pytest.fixture(scope="module")
def pair(byte_model, tmp_path_factory):
    """(base, adapters dir, lora8's PeftModel reference): a plain Llama with a DoRA and a plain adapter."""
    from peft import PeftModel

    model, path = byte_model()
    root = tmp_path_factory.mktemp("pair-adapters")
    for seed, (name, spec) in enumerate(PAIR.items()):
        make_adapter(model, root / name, seed, *spec)
    return (model, path), root, PeftModel.from_pretrained(copy.deepcopy(model), root / "lora8").eval()


def test_dora_with_fully_sharded_lora_is_refused_through_the_executor(pair, module_loop_thread, tmp_path):
    """Fully sharded LoRA cuts a column layer's A over the ranks, so no rank could work out the norm:
    --enable-dora with it under tp 2 is refused at start (the config), and on an executor without
    --enable-dora the store refuses the DoRA adapter's shards with FAILED_PRECONDITION, which Generate
    returns; plain LoRA rows are served."""
    from loraserve.errors import StatusError

    from .conftest import generate, prompt_ids

    base, adapters, ref = pair
    with pytest.raises(ValueError, match="--enable-dora is not served with --fully-sharded-loras under --tp-size > 1"):
        cluster_of(module_loop_thread, base, adapters, tmp_path / "refused", 2, PAIR, fully_sharded_loras=True)
    c = cluster_of(module_loop_thread, base, adapters, tmp_path / "store", 2, PAIR, fully_sharded_loras=True, enable_dora=False)
    try:
        client = c.client()
        with pytest.raises(StatusError) as e:
            generate(client, "dora4", prompt_ids(0))
        assert e.value.code.name == "FAILED_PRECONDITION", e.value
        assert "DoRA adapters are not served with fully sharded LoRA" in e.value.message
        check_against_reference(ref, prompt_ids(1), generate(client, "lora8", prompt_ids(1)))
    finally:
        c.close()


def test_without_enable_dora_dora_adapters_are_refused_and_no_layer_holds_a_scale(pair, module_loop_thread, tmp_path):
    """An executor started without --enable-dora makes no DoRA buffers (no layer's step applies a
    scale, a captured graph's included) and refuses a DoRA adapter through LoadAdapter and Generate
    with FAILED_PRECONDITION naming the flag, keeping nothing of it; plain LoRA rows are served."""
    from loraserve.errors import StatusError
    from loraserve.executor import dora
    from loraserve.executor.lora import LinearWithLoRA, lora_modules
    from loraserve.kernels import make_lora_meta

    from .conftest import generate, prompt_ids

    base, adapters, ref = pair
    c = cluster_of(module_loop_thread, base, adapters, tmp_path / "store", 1, PAIR, enable_dora=False)
    try:
        model = c.parts.engine.model
        dense = [m for m in lora_modules(model).values() if isinstance(m, LinearWithLoRA)]
        assert dense and not any(hasattr(m, "dora_scale") or m.serves_dora for m in dense)
        graph_meta = make_lora_meta(torch.tensor([0, -1], dtype=torch.int32), 2, None)  # no host slots, as in a graph
        assert not any(dora.applies(m, graph_meta) for m in dense)

        client = c.client()
        want = "adapter 'dora4' is a DoRA adapter (use_dora): this executor was started without --enable-dora"
        for call in (lambda: client.load("dora4"), lambda: generate(client, "dora4", prompt_ids(0))):
            with pytest.raises(StatusError) as e:
                call()
            assert e.value.code.name == "FAILED_PRECONDITION", e.value
            assert e.value.message == want
        check_against_reference(ref, prompt_ids(1), generate(client, "lora8", prompt_ids(1)))
        held = {a.name: a for a in client.list()}
        assert "dora4" not in held or (held["dora4"].slot < 0 and not held["dora4"].in_cpu_cache), held
    finally:
        c.close()


# ---- the slots' DoRA scale, loaded from the store's own shards into a model on the CPU ----


@pytest.fixture(scope="module")
def slot_setup(hf_model, tmp_path_factory):
    """(base dir, {name: (PeftModel reference, the store's tp-1 shard)}) for a DoRA, an rsLoRA DoRA
    and a plain adapter of a Llama with biases."""
    from peft import PeftModel

    from loraserve.adapter_store import pack
    from loraserve.executor.layout import declare_layout, model_config
    from loraserve.executor.slot_layout import LoraSpec
    from loraserve.v1 import common_pb2 as pb

    model, path = hf_model("llama", attention_bias=True, mlp_bias=True)
    root = tmp_path_factory.mktemp("slot-adapters")
    spec = LoraSpec(max_loras=3, max_rank=16, dtype=torch.float32, dora=True)
    layout = declare_layout(model_config(path), spec, "tiny")
    out = {}
    for seed, name in enumerate(("dora4", "dora16rs", "lora8")):
        make_adapter(model, root / name, seed, *ADAPTERS[name])
        adapter = pack.load_adapter(root / name, None, validate.Limits())
        shard = pack.shard(pack.pack_full(adapter, layout), layout, pb.ShardRank(), pack.pack_magnitudes(adapter, layout))
        out[name] = (PeftModel.from_pretrained(copy.deepcopy(model), root / name).eval(), shard)
    return path, spec, out


def _served(path, spec, packed_b: bool):
    from loraserve.executor.model.loader import load_hf_checkpoint

    from .conftest import b_packed

    with b_packed(packed_b):
        return load_hf_checkpoint(path, lora=spec)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("packed_b", [False, True], ids=["b-rows", "b-packed"])
def test_slot_rows_match_peft_and_the_scale_follows_what_each_slot_holds(slot_setup, paged_runner, packed_b):
    from loraserve.executor.lora import LinearWithLoRA, lora_modules
    from loraserve.executor.slot_load import clear_slot, load_shard_into_slot

    path, spec, adapters = slot_setup
    model = _served(path, spec, packed_b)
    for slot, name in enumerate(("dora4", "lora8", "dora16rs")):
        load_shard_into_slot(model, slot, adapters[name][1])
    run = paged_runner(model, block_size=4)
    prompts = [_ids(7 + i, i) for i in range(4)]
    outs = run.step([(i, p) for i, p in enumerate(prompts)], slots=[0, 1, -1, 2])
    for out, name, ids in zip(outs, ("dora4", "lora8", "", "dora16rs"), prompts):
        ref = adapters[name][0] if name else adapters["lora8"][0].get_base_model()
        with torch.no_grad(), adapters["lora8"][0].disable_adapter() if not name else contextlib.nullcontext():
            want = ref(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(out, want, atol=2e-4, rtol=1e-4)

    dense = [m for m in lora_modules(model).values() if isinstance(m, LinearWithLoRA)]
    assert all(m.dora_slots == [True, False, True] for m in dense)  # both DoRA adapters target every dense layer
    assert all((m.dora_scale[1] == 1).all() and (m.dora_scale[-1] == 1).all() for m in dense)
    assert any((m.dora_scale[0] != 1).any() for m in dense)
    load_shard_into_slot(model, 0, adapters["lora8"][1])  # a plain adapter over a DoRA one: scale 1 again
    clear_slot(lora_modules(model).values(), 2)
    assert all(m.dora_slots == [False] * 3 and (m.dora_scale == 1).all() for m in dense)


def test_the_scale_applies_alike_with_and_without_the_step_slots_on_the_host(slot_setup):
    """A captured graph's LoraMeta has no host_slots: every dense layer then applies the scale
    (1 for plain LoRA and base rows), which gives what the eager step gives."""
    from loraserve.executor.slot_load import load_shard_into_slot
    from loraserve.kernels import make_lora_meta

    path, spec, adapters = slot_setup
    model = _served(path, spec, False)
    load_shard_into_slot(model, 0, adapters["dora4"][1])
    load_shard_into_slot(model, 1, adapters["lora8"][1])
    for layer in (model.model.layers[0].self_attn.qkv_proj, model.model.layers[1].mlp.down_proj):
        x = torch.randn(5, layer.in_features, generator=torch.Generator().manual_seed(0))
        slots = torch.tensor([0, 1, -1, 0, 1], dtype=torch.int32)
        eager = layer(x, make_lora_meta(slots, spec.max_loras, frozenset({0, 1})))
        graph = layer(x, make_lora_meta(slots, spec.max_loras, None))
        torch.testing.assert_close(eager, graph, atol=1e-6, rtol=1e-6)
        plain = layer(x[1:3], make_lora_meta(slots[1:3], spec.max_loras, frozenset({1})))  # no DoRA slot: no scale
        torch.testing.assert_close(plain, eager[1:3], atol=1e-6, rtol=1e-6)


def test_bad_dora_shards_are_refused_before_any_slot_changes(slot_setup):
    from loraserve.executor.slot_load import load_shard_into_slot

    path, spec, adapters = slot_setup
    model = _served(path, spec, False)
    shard = adapters["dora4"][1]
    qkv = model.model.layers[0].self_attn.qkv_proj
    bad = {
        "for no dense LoRA layer": {**shard, "model.embed_tokens.dora_m": torch.ones(64)},
        "but no model.layers.0.self_attn.qkv_proj.lora_a": {
            k: v for k, v in shard.items() if not k.startswith("model.layers.0.self_attn.qkv_proj.lora_")
        },
        r"shape \(3,\), the layer has": {**shard, "model.layers.0.mlp.down_proj.dora_m": torch.ones(3)},
    }
    for message, tensors in bad.items():
        with pytest.raises(ValueError, match=message):
            load_shard_into_slot(model, 0, tensors)
    assert not qkv.lora_a.any() and not qkv.dora_slots[0] and (qkv.dora_scale == 1).all()


def test_slots_made_without_dora_hold_no_scale_and_refuse_a_dora_shard(slot_setup):
    """LoraSpec.dora off: no dense layer has DoRA buffers or applies a scale (a graph-style meta
    included); a DoRA shard loaded straight into the model is refused before any slot changes,
    and a plain one loads."""
    import dataclasses

    from loraserve.executor import dora
    from loraserve.executor.lora import LinearWithLoRA, lora_modules
    from loraserve.executor.slot_load import load_shard_into_slot
    from loraserve.kernels import make_lora_meta

    path, spec, adapters = slot_setup
    model = _served(path, dataclasses.replace(spec, dora=False), False)
    dense = [m for m in lora_modules(model).values() if isinstance(m, LinearWithLoRA)]
    assert dense and not any(hasattr(m, "dora_scale") or hasattr(m, "dora_slots") for m in dense)
    meta = make_lora_meta(torch.tensor([0, 1, -1], dtype=torch.int32), spec.max_loras, None)
    assert not any(dora.applies(m, meta) for m in dense)
    with pytest.raises(ValueError, match=r"dora_m, but this model's slots were made without DoRA \(LoraSpec.dora\)"):
        load_shard_into_slot(model, 0, adapters["dora4"][1])
    assert all(not m.lora_a[0].any() and m.slot_ranks[0] == 0 for m in dense)
    assert load_shard_into_slot(model, 0, adapters["lora8"][1]) == 8


def test_the_norm_worked_out_in_row_blocks_equals_one_pass(slot_setup, monkeypatch):
    """The load's norm pass bounds its float32 temporary by working on blocks of rows."""
    from loraserve.executor.slot_load import load_shard_into_slot
    from loraserve.kernels import dora_reference

    path, spec, adapters = slot_setup
    whole = _served(path, spec, False)
    load_shard_into_slot(whole, 0, adapters["dora16rs"][1])
    monkeypatch.setattr(dora_reference, "_BLOCK", 3 * 64)  # a few rows at a time
    blocks = _served(path, spec, False)
    load_shard_into_slot(blocks, 0, adapters["dora16rs"][1])
    fresh = _served(path, spec, False)
    for a, b, c in zip(whole.modules(), blocks.modules(), fresh.modules()):
        if getattr(a, "dora_scale", None) is not None:
            torch.testing.assert_close(a.dora_scale, b.dora_scale, atol=1e-6, rtol=1e-6)
            assert (a.dora_scale[0] != 1).any()
            assert torch.equal(a.weight, c.weight) and torch.equal(b.weight, c.weight)  # the pass leaves W as it was


def test_dora_on_a_moe_models_shared_expert_is_served_and_on_routed_experts_refused(byte_model, module_loop_thread, tmp_path):
    """Qwen2-MoE: PEFT writes DoRA for the shared expert's (dense) Linear layers, served exactly beside
    plain LoRA and base rows. It writes none for the routed experts (transformers holds them as fused
    parameters and PEFT's ParamWrapper refuses use_dora); the per-expert form PEFT wrote while experts
    were nn.Linear is refused at registration naming the module."""
    import json

    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file, save_file

    from loraserve.errors import StatusError

    from .conftest import TINY_MOE, _per_expert_adapter

    model, path = byte_model("qwen2_moe", **TINY_MOE["qwen2_moe"])
    with pytest.raises(ValueError, match="does not work with use_dora=True"):
        get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"], use_dora=True))
    root = tmp_path / "adapters"
    shared = ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj")
    make_adapter(model, root / "dshared", 0, 8, 16, ("q_proj", "v_proj", *shared), True, True)
    make_adapter(model, root / "lora8", 1, 8, 16, ("q_proj", "o_proj"), False, False)
    assert any(
        "shared_expert.down_proj.lora_magnitude_vector" in k for k in load_file(root / "dshared" / "adapter_model.safetensors")
    )
    per_expert = _per_expert_adapter("qwen2_moe", model, root / "dexperts", r=4, alpha=8)
    tensors = load_file(per_expert / "adapter_model.safetensors")
    for k, t in list(tensors.items()):
        if k.endswith(".lora_B.weight"):
            tensors[k.replace(".lora_B.weight", ".lora_magnitude_vector")] = torch.rand(t.shape[0]) + 0.5
    save_file(tensors, per_expert / "adapter_model.safetensors")
    config = json.loads((per_expert / "adapter_config.json").read_text())
    (per_expert / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    refs = {"": model, **{n: PeftModel.from_pretrained(copy.deepcopy(model), root / n).eval() for n in ("dshared", "lora8")}}
    c = cluster_of(module_loop_thread, (model, path), root, tmp_path / "store", 1, names=["dshared", "lora8"])
    try:
        assert {m.name: m.kind for m in c.store_client().list()} == {"dshared": "dora", "lora8": "lora"}
        for group in (["dshared", "", "lora8"], ["lora8", "dshared"]):
            jobs, resps = run_group(c.client(), group)
            for (name, ids), resp in zip(jobs, resps):
                check_against_reference(refs[name], ids, resp)
        with pytest.raises(StatusError) as e:
            c.store_client().register("dexperts", str(per_expert))
        assert e.value.code.name == "INVALID_ARGUMENT"
        assert "DoRA on MoE expert module 'model.layers.0.mlp.experts.0.down_proj' is not served" in e.value.message
    finally:
        c.close()


@pytest.mark.parametrize(
    "device, dtype",
    [("cpu", torch.float32), ("cpu", torch.bfloat16), pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)],
    ids=["cpu-float32", "cpu-bf16", "cuda-bf16"],
)
def test_dora_on_an_fp8_layer_scales_in_its_compute_dtype_by_the_dequantized_norm(device, dtype):
    """An FP8 LinearWithLoRA (float8 weight, per-row weight_scale) with DoRA slots: the scale is held
    in the layer's compute dtype (its output's, not float8), g is m over the row norm of the
    dequantized W + s B A (weight.float() * weight_scale), and the layer's output is PEFT's
    bias + g * (W x + s B A x) with W x the layer's own FP8 GEMM; base rows are the FP8 GEMM alone.
    On CUDA (FP8 GPUs) the same through torch._scaled_mm and the Triton LoRA kernels."""
    from loraserve import kernels
    from loraserve.executor.lora import LinearWithLoRA
    from loraserve.executor.model import fp8
    from loraserve.executor.slot_layout import LoraSpec
    from loraserve.executor.slot_load import load_shard_into_slot
    from loraserve.kernels import make_lora_meta

    if device == "cuda":
        from .conftest import need_cuda_devices

        need_cuda_devices(1)
        if fp8.fp8_compute_error("cuda", dtype) is not None:
            pytest.skip(f"needs FP8 compute: {fp8.fp8_compute_error('cuda', dtype)}")
    torch.manual_seed(0)
    spec = LoraSpec(max_loras=2, max_rank=8, dtype=dtype, dora=True)
    holder = torch.nn.Module()
    holder.proj = layer = LinearWithLoRA(64, (32, 16), True, spec, dtype, device, fp8=True)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.serves_dora
    assert layer.dora_scale.dtype == dtype  # not float8: y * g runs
    w = torch.randn(48, 64) * torch.linspace(0.1, 3.0, 48)[:, None]  # rows of unlike scales
    q, s = fp8.quantize_rows(w)
    layer.weight.copy_(q.to(device))
    layer.weight_scale.copy_(s.to(device))
    layer.bias.copy_(torch.randn(48).to(dtype))
    a, b = torch.randn(2, 4, 64) * 0.3, torch.randn(48, 4) * 0.3  # two slices' A; B scaled (s folded in)
    real = q.float() * s[:, None]  # the dequantized W
    delta = torch.cat([b[:32] @ a[0], b[32:] @ a[1]])  # s B A [48, 64]
    m = (real + delta).norm(dim=1) * (0.5 + torch.rand(48))  # PEFT's magnitude, moved off its init
    load_shard_into_slot(holder, 1, {"proj.lora_a": a.to(dtype), "proj.lora_b": b.to(dtype), "proj.dora_m": m})

    want_g = m / (real + delta.to(dtype).float()).norm(dim=1)  # the norm of the dequantized weight
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(layer.dora_scale[1].float().cpu(), want_g, **tol)
    assert (layer.dora_scale[0] == 1).all() and (layer.dora_scale[2] == 1).all()
    raw = m / (q.float() + delta).norm(dim=1)  # the norm of the float8 values alone: far off
    assert (raw - want_g).abs().max() > 0.1

    x = torch.randn(3, 64).to(device, dtype)
    slots, ranks = torch.tensor([1, -1, 1], device=device), torch.tensor([0, 4], dtype=torch.int32, device=device)
    meta = make_lora_meta(slots, 2, frozenset({1}), ranks)
    y = layer(x, meta)
    assert y.dtype == dtype
    base = kernels.fp8_linear(x, layer.weight, layer.weight_scale, None).float().cpu()  # W x: the same FP8 GEMM
    y, x = y.cpu(), x.cpu()
    xa = x.float()
    lora = torch.cat(
        [xa @ a[0].to(dtype).float().T @ b[:32].to(dtype).float().T, xa @ a[1].to(dtype).float().T @ b[32:].to(dtype).float().T],
        1,
    )
    bias = layer.bias.float().cpu()
    want = torch.stack([bias + want_g * (base[0] + lora[0]), bias + base[1], bias + want_g * (base[2] + lora[2])])
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2**-6, atol=5e-2)
    torch.testing.assert_close(y.float(), want, **tol)


PHI3 = {  # DoRA on Phi-3's fused modules (one magnitude vector over qkv_proj's q|k|v, gate_up_proj's gate|up)
    "phidora": (4, 8, ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), False, True),
    "phimlp": (8, 8, ("gate_up_proj",), True, True),
}


@pytest.mark.parametrize("tp", [1, 2])
def test_dora_on_phi3_fused_modules_matches_transformers_peft(byte_model, module_loop_thread, tmp_path, tp):
    """Phi-3 DoRA adapters (fused qkv_proj / gate_up_proj: the store cuts each one's m over its
    slices as B's rows) served with --enable-dora, alone and beside a base row: greedy tokens and
    logprobs equal transformers + PEFT."""
    from peft import PeftModel

    from .conftest import generate, prompt_ids

    model, path = byte_model("phi3")
    root = tmp_path / "adapters"
    for seed, (name, spec) in enumerate(PHI3.items()):
        make_adapter(model, root / name, seed, *spec)
    refs = {"": model, **{n: PeftModel.from_pretrained(copy.deepcopy(model), root / n).eval() for n in PHI3}}
    c = cluster_of(module_loop_thread, (model, path), root, tmp_path / "store", tp, PHI3)
    try:
        assert {m.name: m.kind for m in c.store_client().list()} == {n: "dora" for n in PHI3}
        client = c.client()
        check_against_reference(refs["phidora"], prompt_ids(0), generate(client, "phidora", prompt_ids(0)))
        jobs, resps = run_group(client, ["phimlp", "", "phidora"])
        for (name, ids), resp in zip(jobs, resps):
            check_against_reference(refs[name], ids, resp)
    finally:
        c.close()


def test_dora_on_a_tied_lm_head_and_with_dropout_and_patterns_matches_transformers_peft(byte_model, module_loop_thread, tmp_path):
    """Qwen2 with tied embeddings at tp 2 (--lora-embeddings): DoRA on the lm_head (a column-parallel
    layer over the vocabulary, its weight the embedding's), and DoRA with lora_dropout (not applied
    at inference, as PEFT in eval) and rank / alpha patterns (each module's own scale in its norm):
    each row of one batch beside plain LoRA and base rows is PEFT's."""
    from peft import LoraConfig, PeftModel

    from .conftest import save_lora_adapters

    model, path = byte_model("qwen2", tie_word_embeddings=True)
    configs = {
        "dhead": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], use_dora=True),
        "dpattern": LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"], use_dora=True, lora_dropout=0.1,
            rank_pattern={"v_proj": 4}, alpha_pattern={"down_proj": 3}, use_rslora=True,
        ),
        "lora8": LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "o_proj"]),
    }  # fmt: skip
    root = save_lora_adapters(model, tmp_path / "adapters", configs, b_std=0.2)
    refs = {"": model, **{n: PeftModel.from_pretrained(copy.deepcopy(model), root / n).eval() for n in configs}}
    c = cluster_of(module_loop_thread, (model, path), root, tmp_path / "store", 2, configs, lora_embeddings=True, max_loras=3)
    try:
        assert {m.name: m.kind for m in c.store_client().list()} == {"dhead": "dora", "dpattern": "dora", "lora8": "lora"}
        jobs, resps = run_group(c.client(), ["dhead", "", "dpattern", "lora8"])
        for (name, ids), resp in zip(jobs, resps):
            check_against_reference(refs[name], ids, resp)
    finally:
        c.close()


def test_a_dora_adapter_re_registered_under_its_name_is_served_with_the_new_versions_norm(
    byte_model, module_loop_thread, tmp_path
):
    """One name re-registered with other DoRA weights (other B and magnitudes), then a plain LoRA,
    then the first again, at tp 2 (row-parallel norms summed over the ranks): each version, loaded
    into a slot another version held, is served with its own scale, as transformers + PEFT computes it."""
    from peft import PeftModel

    from .conftest import generate, prompt_ids

    model, path = byte_model()
    root = tmp_path / "adapters"
    versions = {"dora4": ADAPTERS["dora4"], "dora4b": ADAPTERS["dora4"], "lora8": ADAPTERS["lora8"]}
    for seed, (name, spec) in enumerate(versions.items()):
        make_adapter(model, root / name, seed, *spec)
    refs = {n: PeftModel.from_pretrained(copy.deepcopy(model), root / n).eval() for n in versions}
    c = cluster_of(module_loop_thread, (model, path), root, tmp_path / "store", 2, names=[], adapter_refresh_s=0)
    try:
        client, store = c.client(), c.store_client()
        for i, version in enumerate(["dora4", "dora4b", "lora8", "dora4"]):
            digest = store.register("v", str(root / version)).digest
            assert client.load("v").digest == digest
            resp = generate(client, "v", prompt_ids(i))
            assert resp.adapter_digest == digest
            check_against_reference(refs[version], prompt_ids(i), resp)
    finally:
        c.close()
