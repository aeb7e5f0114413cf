"""FP8 checkpoints as their publishers' tools write them, beyond the tests' writer's defaults: scales
stored as bf16, per-tensor scales as [] and per-channel as [N]; llm-compressor's earlier
`naive-quantized` format and `frozen` status, several config groups, ignore entries that match
nothing, a kv_cache_scheme beside the weights', AutoFP8's static activations and KV cache, a dense sparsity_config;
block-wise fp8 with both ignore lists; an FP8 lm_head, tied or not; Qwen3 dense and Qwen3-MoE with 128x128 blocks over dims that are not multiples of 128 (ceil-div scale grids). Each
loads, dequantized on the CPU, as the dequantized weights: every parameter exact, the logits and
greedy tokens those of transformers on them."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from loraserve.executor.model.loader import load_model

from .conftest import TINY_MOE
from .test_fp8 import QUANTIZED, serves_as_dequantized, write_fp8

# Qwen3 with hidden 96, head_dim 24, intermediate 200 and tied embeddings: no dim a multiple of 128
ODD_QWEN3 = dict(hidden_size=96, intermediate_size=200, head_dim=24, tie_word_embeddings=True)


def _edit_config(path, edit):
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg["quantization_config"])
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "fmt, stored",
    [
        ("ct-tensor", lambda s: s.reshape(())),
        ("fp8-tensor", lambda s: s.reshape(())),
        ("ct-channel", lambda s: s.reshape(-1)),
        ("ct-channel", lambda s: s.to(torch.bfloat16)),
        ("block", lambda s: s.to(torch.bfloat16)),
    ],
    ids=["tensor-0d", "fp8-tensor-0d", "channel-1d", "channel-bf16", "block-bf16"],
)
def test_scales_stored_in_another_shape_or_dtype_load(fmt, stored, hf_model, tmp_path, paged_runner):
    _, src = hf_model("llama")
    ref_dir = write_fp8(src, tmp_path / "fp8", fmt, stored_scale=stored)
    serves_as_dequantized(tmp_path / "fp8", ref_dir, "llama", paged_runner)


def _groups(q):
    group = q["config_groups"]["group_0"]
    q["config_groups"] = {
        "group_0": dict(group, targets=["re:.*self_attn\\..*_proj$"]),
        "group_1": dict(group, targets=["re:.*mlp\\..*_proj$"]),
    }


def _kv_cache_scheme(q):
    q["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


@pytest.mark.parametrize(
    "fmt, edit",
    [
        ("ct-tensor", lambda q: q.update(format="naive-quantized", quantization_status="frozen")),
        ("ct-channel", _groups),
        ("ct-channel", lambda q: q.update(ignore=["lm_head", "model.layers.7.mlp.gate", "re:.*vision_tower.*"])),
        ("ct-channel", _kv_cache_scheme),
        ("ct-channel", lambda q: q.update(sparsity_config={"format": "dense", "sparsity_structure": "unstructured"})),
        ("block", lambda q: q.update(modules_to_not_convert=["model.layers.0.mlp.gate"], ignored_layers=["lm_head"])),
    ],
    ids=[
        "naive-quantized-frozen",
        "two-groups",
        "ignore-matching-nothing",
        "kv-cache-scheme",
        "dense-sparsity",
        "both-ignore-lists",
    ],
)
def test_published_config_variants_load(fmt, edit, hf_model, tmp_path, paged_runner):
    _, src = hf_model("llama")
    ref_dir = write_fp8(src, tmp_path / "fp8", fmt)
    _edit_config(tmp_path / "fp8", edit)
    if edit is _kv_cache_scheme:  # llm-compressor's per-layer K / V scales beside the weights'
        _add_kv_scales(tmp_path / "fp8", "{}_scale")
    serves_as_dequantized(tmp_path / "fp8", ref_dir, "llama", paged_runner)


def _add_kv_scales(path, name: str):
    """Adds K scales 0.02 and V scales 0.03 to both layers of the checkpoint at path, as
    `model.layers.N.self_attn.` + name.format("k" | "v"); checks the loaded model's [layers, K/V, kv heads]."""
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.{name.format('k')}"] = torch.tensor(0.02)
        tensors[f"model.layers.{i}.self_attn.{name.format('v')}"] = torch.tensor(0.03)
    save_file(tensors, str(path / "model.safetensors"))
    assert torch.equal(load_model(path).kv_scales, torch.tensor([0.02, 0.03])[None, :, None].expand(2, 2, 2))


def test_an_autofp8_checkpoint_with_static_activations_and_kv_cache_loads(hf_model, tmp_path, paged_runner):
    """AutoFP8's save_quantized_model with static activations and KV cache: activation_scheme "static"
    (each module's input_scale beside its weight_scale), kv_cache_scheme "static" and the K / V
    scales as the K / V projections' output_scale."""
    _, src = hf_model("llama")
    ref_dir = write_fp8(src, tmp_path / "fp8", "fp8-tensor", static_input=True)
    _edit_config(tmp_path / "fp8", lambda q: q.update(kv_cache_scheme="static"))
    with safe_open(str(tmp_path / "fp8" / "model.safetensors"), "pt") as f:
        assert "model.layers.0.self_attn.q_proj.input_scale" in f.keys()
    _add_kv_scales(tmp_path / "fp8", "{}_proj.output_scale")
    serves_as_dequantized(tmp_path / "fp8", ref_dir, "llama", paged_runner)


@pytest.mark.parametrize("fmt", ["block", "ct-block"])
def test_qwen3_with_dims_off_the_128_blocks_loads(fmt, hf_model, tmp_path, paged_runner):
    _, src = hf_model("qwen3", **ODD_QWEN3)
    ref_dir = write_fp8(src, tmp_path / "fp8", fmt, block=(128, 128))
    serves_as_dequantized(tmp_path / "fp8", ref_dir, "qwen3", paged_runner)


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
def test_qwen3_moe_block_wise_with_128_blocks_loads(fused, hf_model, tmp_path, paged_runner):
    _, src = hf_model("qwen3_moe", **TINY_MOE["qwen3_moe"])
    ref_dir = write_fp8(src, tmp_path / "fp8", "block", block=(128, 128), fuse_experts=fused)
    serves_as_dequantized(tmp_path / "fp8", ref_dir, "qwen3_moe", paged_runner)


@pytest.mark.parametrize("fmt", ["ct-channel", "block"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_an_fp8_lm_head_not_in_the_ignore_list_loads(tied, fmt, hf_model, tmp_path, paged_runner):
    """Untied: lm_head's FP8 weight dequantized like the others'. Tied: the checkpoint's FP8 copy of the
    embeddings as lm_head is dropped (the model's lm_head is its embeddings)."""
    _, src = hf_model("llama", tie_word_embeddings=tied)
    if tied:  # a tied checkpoint that stores lm_head too
        with safe_open(str(src / "model.safetensors"), "pt") as f:
            tensors = {n: f.get_tensor(n) for n in f.keys()}
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        shutil.copytree(src, tmp_path / "src")
        save_file(tensors, str(tmp_path / "src" / "model.safetensors"))
        src = tmp_path / "src"
    with_head = re.compile(f"{QUANTIZED.pattern}|lm_head\\.weight")
    ref_dir = write_fp8(src, tmp_path / "fp8", fmt, quantized=with_head)
    with safe_open(str(tmp_path / "fp8" / "model.safetensors"), "pt") as f:
        assert f.get_slice("lm_head.weight").get_dtype() == "F8_E4M3"
    _edit_config(tmp_path / "fp8", lambda q: q.update(ignore=[], modules_to_not_convert=[]))
    if tied:  # the reference keeps the embeddings: drop its dequantized lm_head copy
        with safe_open(str(ref_dir / "model.safetensors"), "pt") as f:
            tensors = {n: f.get_tensor(n) for n in f.keys() if n != "lm_head.weight"}
        save_file(tensors, str(ref_dir / "model.safetensors"))
    serves_as_dequantized(tmp_path / "fp8", ref_dir, "llama", paged_runner)


def _mixed(src, dst, attention_fmt: str, mlp_fmt: str, block=(16, 16), static_mlp=False):
    """An FP8 checkpoint at dst whose attention layers are quantized as attention_fmt and MLP layers as
    mlp_fmt (compressed-tensors strategies), one config group each (static_mlp: the MLP group's
    activations static per tensor, each MLP module with its input_scale); returns its reference dir."""
    parts = {
        fmt: write_fp8(src, dst.parent / f"{dst.name}-{fmt}", fmt, block=block, static_input=static_mlp and fmt == mlp_fmt)
        for fmt in (attention_fmt, mlp_fmt)
    }
    tensors, ref = {}, {}
    for fmt, ref_dir in parts.items():
        keep = "self_attn." if fmt == attention_fmt else "mlp."
        with (
            safe_open(str(ref_dir.parent / "model.safetensors"), "pt") as f,
            safe_open(str(ref_dir / "model.safetensors"), "pt") as r,
        ):
            for n in f.keys():  # an input_scale only for the modules its part quantizes
                if keep in n or (n not in tensors and not n.endswith(".input_scale")):
                    tensors[n] = f.get_tensor(n)
            for n in r.keys():
                if keep in n or n not in ref:
                    ref[n] = r.get_tensor(n)
    shutil.copytree(parts[attention_fmt], dst / "reference")
    save_file(ref, str(dst / "reference" / "model.safetensors"))
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((parts[attention_fmt].parent / "config.json").read_text())
    groups = {}
    for fmt, targets in ((attention_fmt, "re:.*self_attn\\..*_proj$"), (mlp_fmt, "re:.*mlp\\..*_proj$")):
        group = json.loads((parts[fmt].parent / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
        groups[f"group_{len(groups)}"] = dict(group, targets=[targets])
    cfg["quantization_config"]["config_groups"] = groups
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst / "reference"


@pytest.mark.parametrize("attention_fmt, mlp_fmt", [("ct-tensor", "ct-channel"), ("ct-channel", "ct-block")])
def test_config_groups_of_different_strategies_load(attention_fmt, mlp_fmt, hf_model, tmp_path, paged_runner):
    """llm-compressor's config groups, each with its own weight strategy: every weight dequantizes with
    the layout its scale's shape has."""
    _, src = hf_model("llama")
    ref_dir = _mixed(src, tmp_path / "fp8", attention_fmt, mlp_fmt)
    serves_as_dequantized(tmp_path / "fp8", ref_dir, "llama", paged_runner)


def test_a_static_group_with_a_dynamic_one_loads_its_input_scales_required_alone(hf_model, tmp_path, paged_runner):
    """Attention per tensor with dynamic activations (no input_scale), MLP per channel with static ones."""
    _, src = hf_model("llama")
    ref_dir = _mixed(src, tmp_path / "fp8", "ct-tensor", "ct-channel", static_mlp=True)
    with safe_open(str(tmp_path / "fp8" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.down_proj.input_scale" in names
    assert not any(n.endswith("input_scale") and "self_attn" in n for n in names)
    serves_as_dequantized(tmp_path / "fp8", ref_dir, "llama", paged_runner)


def _refused_without_an_input_scale(path, tensors: dict, group: str, refuses) -> None:
    """The checkpoint at path written with `tensors` less layer 0's down_proj.input_scale: refused naming
    the tensor and its static config group."""
    down = "model.layers.0.mlp.down_proj"
    del tensors[f"{down}.input_scale"]
    save_file(tensors, str(path / "model.safetensors"))
    refuses(
        path,
        re.escape(
            f"checkpoint tensor '{down}.input_scale' is missing: quantization_config config group {group!r} "
            f"quantizes the input activations of '{down}' statically (per tensor, by this scale)"
        ),
    )


def test_a_static_group_s_module_without_its_input_scale_is_refused_beside_a_dynamic_group(hf_model, tmp_path, refuses):
    """As above, less one MLP module's input_scale: required, as its config group is static."""
    _, src = hf_model("llama")
    _mixed(src, tmp_path / "fp8", "ct-tensor", "ct-channel", static_mlp=True)
    with safe_open(str(tmp_path / "fp8" / "model.safetensors"), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    _refused_without_an_input_scale(tmp_path / "fp8", tensors, "group_1", refuses)


ATTENTION = "re:.*self_attn\\..*_proj$"
# the static group's targets: the MLP by a regex; every layer by class, attention's regex outranking it
STATIC_TARGETS = [["re:.*mlp\\..*_proj$"], ["Linear"]]


def _one_layout_static_and_dynamic(path, static_targets, dynamic_targets=(ATTENTION,)):
    """Splits the per-channel static checkpoint at path into two config groups of its one layout: group
    "static" (targets static_targets, listed first) and "dynamic" (dynamic_targets: attention,
    activations per token, its input_scales dropped); returns its tensors."""
    group = json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    activations = dict(group["input_activations"], dynamic=True, strategy="token")
    dynamic = dict(group, targets=list(dynamic_targets), input_activations=activations)
    _edit_config(path, lambda q: q.update(config_groups={"static": dict(group, targets=static_targets), "dynamic": dynamic}))
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys() if not (n.endswith(".input_scale") and "self_attn" in n)}
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


@pytest.mark.parametrize("static_targets", STATIC_TARGETS, ids=["regex", "class-name"])
def test_a_static_and_a_dynamic_group_of_one_layout_load_input_scales_required_by_target(
    static_targets, hf_model, tmp_path, paged_runner
):
    """Both groups per channel: each module's group is the one its targets name (a name or regex
    before a class name), so attention needs no input_scale even where "Linear" is the static group's."""
    _, src = hf_model("llama")
    ref_dir = write_fp8(src, tmp_path / "fp8", "ct-channel", static_input=True)
    names = _one_layout_static_and_dynamic(tmp_path / "fp8", static_targets)
    assert "model.layers.0.mlp.down_proj.input_scale" in names
    assert not any(n.endswith("input_scale") and "self_attn" in n for n in names)
    serves_as_dequantized(tmp_path / "fp8", ref_dir, "llama", paged_runner)


@pytest.mark.parametrize("static_targets", STATIC_TARGETS, ids=["regex", "class-name"])
def test_a_static_group_s_module_without_its_input_scale_is_refused_beside_a_dynamic_group_of_its_layout(
    static_targets, hf_model, tmp_path, refuses
):
    """As above, less one MLP module's input_scale: its group (by target) is static, though its layout's
    other group is not."""
    _, src = hf_model("llama")
    write_fp8(src, tmp_path / "fp8", "ct-channel", static_input=True)
    tensors = _one_layout_static_and_dynamic(tmp_path / "fp8", static_targets)
    _refused_without_an_input_scale(tmp_path / "fp8", tensors, "static", refuses)


def test_a_module_named_by_its_dynamic_group_takes_it_before_a_static_group_s_regex(hf_model, tmp_path, paged_runner):
    """compressed-tensors (which writes the checkpoint) matches exact names before `re:` patterns, whatever
    the groups' order: attention named one by one in the dynamic group has no input_scale, though the
    static group listed first matches every projection by a regex."""
    _, src = hf_model("llama")
    ref_dir = write_fp8(src, tmp_path / "fp8", "ct-channel", static_input=True)
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    attention = [f"model.layers.{i}.self_attn.{p}_proj" for i in range(layers) for p in "qkvo"]
    names = _one_layout_static_and_dynamic(tmp_path / "fp8", ["re:.*_proj$"], attention)
    assert not any(n.endswith("input_scale") and "self_attn" in n for n in names)
    serves_as_dequantized(tmp_path / "fp8", ref_dir, "llama", paged_runner)


def test_competing_regexes_pick_the_group_in_compressed_tensors_order_and_bad_ones_are_refused():
    """Two `re:` targets naming one module: the first in string order wins (compressed-tensors sorts
    them), not the first group listed. A target or ignore entry that is no regular expression is
    refused naming it, before any weight is read."""
    from loraserve.executor.model.fp8_scheme import checkpoint_scheme

    def config(static_targets, dynamic_targets, ignore=()):
        weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
        acts = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True}
        groups = {
            "static": {"targets": static_targets, "weights": weights, "input_activations": dict(acts, dynamic=False)},
            "dynamic": {"targets": dynamic_targets, "weights": weights, "input_activations": dict(acts, dynamic=True, strategy="token")},
        }  # fmt: skip
        q = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": groups, "ignore": list(ignore)}
        return {"quantization_config": q}

    scheme = checkpoint_scheme(config(["re:.*self_attn.*"], ["re:.*layers\\.0\\..*"]))
    layout = ("channel", None)
    assert scheme.static_group("model.layers.0.self_attn.q_proj", layout) is None  # "re:.*l" sorts before "re:.*s"
    assert scheme.static_group("model.layers.1.self_attn.q_proj", layout).where == "quantization_config config group 'static'"
    where = "quantization_config (compressed-tensors)"
    with pytest.raises(
        ValueError, match=re.escape(f"{where} group 'dynamic' targets: 're:.*(mlp' is not a valid regular expression")
    ):
        checkpoint_scheme(config(["Linear"], ["re:.*(mlp"]))
    with pytest.raises(ValueError, match=re.escape(f"{where} ignore: 're:lm_head[' is not a valid regular expression")):
        checkpoint_scheme(config(["Linear"], ["re:.*mlp.*"], ignore=["re:lm_head["]))


def test_mixed_strategies_refuse_a_scale_that_fits_none_and_two_block_sizes(hf_model, tmp_path, refuses):
    """Before the model is built: a scale of no group's layout, naming each; two block sizes (a grid
    could fit both)."""
    _, src = hf_model("llama")
    _mixed(src, tmp_path / "fp8", "ct-tensor", "ct-channel")
    down = "model.layers.0.mlp.down_proj.weight_scale"
    with safe_open(str(tmp_path / "fp8" / "model.safetensors"), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    tensors[down] = torch.ones(3, 1)
    save_file(tensors, str(tmp_path / "fp8" / "model.safetensors"))
    refuses(tmp_path / "fp8", rf"'{down}' is \[3, 1\]; .*per-channel and per-tensor .* take \[64, 1\] or \[1, 1\]")
    _edit_config(
        tmp_path / "fp8",
        lambda q: q["config_groups"].update(
            group_2={
                "targets": ["re:.*lm_head$"],
                "weights": dict(q["config_groups"]["group_1"]["weights"], strategy="block", block_structure=[32, 32]),
            },
            group_3={
                "targets": ["re:.*embed.*"],
                "weights": dict(q["config_groups"]["group_1"]["weights"], strategy="block", block_structure=[64, 64]),
            },
        ),
    )
    refuses(tmp_path / "fp8", r"config groups with different block sizes are not supported: \[\(32, 32\), \(64, 64\)\]")


@pytest.mark.parametrize("fmt", ["block", "ct-block"])
def test_phi3_fused_projections_with_blocks_across_their_parts_load(fmt, hf_model, tmp_path, paged_runner):
    """Phi-3's fused qkv_proj (64 | 32 | 32 rows) and gate_up_proj (112 | 112) under 128x128 blocks: k, v
    and up start inside a block, read with the blocks they touch."""
    _, src = hf_model("phi3", pad_token_id=0)
    fused = re.compile(r".*\.(qkv|o|gate_up|down)_proj\.weight$")
    ref_dir = write_fp8(src, tmp_path / "fp8", fmt, block=(128, 128), quantized=fused)
    serves_as_dequantized(tmp_path / "fp8", ref_dir, "phi3", paged_runner)
