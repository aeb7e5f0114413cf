"""FP8 checkpoints (compressed-tensors and block-wise), written here from tiny transformers models by
the tests' own quantizer, loaded by the executor: on the CPU dequantized, every parameter equal to
the dequantized weights' and the logits and greedy tokens those of transformers (+ PEFT) run on the
same dequantized weights, whole and at tp 2; every malformed or unsupported checkpoint refused
before any weight is loaded, naming what is wrong; the FP8 linear layer's math (the reference the
CUDA path is held to) with LoRA on its bf16 input; `--quantization fp8` refused without FP8 compute."""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
import subprocess

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from loraserve import kernels
from loraserve.executor.layout import declare_layout
from loraserve.executor.lora import LinearWithLoRA
from loraserve.executor.model import fp8, fp8_scheme
from loraserve.executor.model.loader import load_model
from loraserve.executor.parallel import TPGroup
from loraserve.executor.slot_layout import LoraSpec
from loraserve.executor.slot_load import load_shard_into_slot
from loraserve.kernels import fp8_reference

from .conftest import LORASERVE, _hf_classes
from .test_lora import ADAPTERS, pack_shard, random_peft
from .test_tp import expected_part

peft = pytest.importorskip("peft")

E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0
QUANTIZED = re.compile(r".*\.(q|k|v|o|gate|up|down)_proj\.weight$")  # every linear layer but lm_head and routers
# compressed-tensors' three strategies, block-wise fp8, per-tensor fp8 (AutoFP8's)
FORMATS = ("ct-channel", "ct-tensor", "ct-block", "block", "fp8-tensor")


# ---- the tests' own quantizer and checkpoint writer ----------------------------------------------


def quantize(w: torch.Tensor, strategy: str, block=(16, 16)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (or [E, N, K]) -> (FP8 values, scale) as the formats define them: w ~= q * scale,
    scale = max|w| / 448 over the tensor ([1]), a row ([N, 1]) or a block ([ceil(N/bn), ceil(K/bk)])."""
    w = w.float()
    if strategy == "tensor":
        scale = (w.abs().max() / FP8_MAX).reshape(1)
        return (w / scale).to(E4M3), scale
    if strategy == "channel":
        scale = w.abs().amax(dim=-1, keepdim=True) / FP8_MAX
        return (w / scale).to(E4M3), scale
    bn, bk = block
    n, k = w.shape[-2:]
    nb, kb = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.zeros(*w.shape[:-2], nb * bn, kb * bk)
    padded[..., :n, :k] = w
    blocks = padded.unflatten(-1, (kb, bk)).unflatten(-3, (nb, bn))  # [..., nb, bn, kb, bk]
    scale = blocks.abs().amax(dim=(-3, -1)) / FP8_MAX  # [..., nb, kb]
    q = (blocks / scale[..., :, None, :, None]).flatten(-4, -3).flatten(-2, -1)[..., :n, :k]
    return q.to(E4M3), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, strategy: str, block=(16, 16)) -> torch.Tensor:
    if strategy != "block":
        return q.float() * scale
    n, k = q.shape[-2:]
    full = scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)[..., :n, :k]
    return q.float() * full


def write_fp8(src, dst, fmt: str, block=(16, 16), fuse_experts=False, static_input=False, stored_scale=None, quantized=QUANTIZED):
    """Writes src (a save_pretrained dir) as an FP8 checkpoint in `fmt` at dst, and its dequantized
    weights as a float checkpoint at dst/reference; returns that reference dir. stored_scale(scale):
    the scale as the checkpoint stores it (another dtype or shape of the same values; the weights
    dequantize with the values stored). quantized: the names of the weights to quantize (and experts')."""
    strategy = {"block": "block", "fp8-tensor": "tensor"}.get(fmt) or fmt.removeprefix("ct-")
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    out, ref = {}, dict(tensors)
    if fuse_experts:  # transformers 5's [E, ...] experts: gate|up rows fused, as the block format ships them
        tensors = _fused_experts(tensors)
    for name, w in tensors.items():
        if not (quantized.fullmatch(name) or name.endswith(("experts.gate_up_proj", "experts.down_proj"))):
            out[name] = w
            continue
        q, scale = quantize(w, strategy, block)
        out[name] = q
        suffix = "_scale_inv" if fmt == "block" else "_scale"
        if stored_scale is not None:
            stored = stored_scale(scale)
            scale = stored.float().reshape(scale.shape)
        out[f"{name}{suffix}"] = scale if stored_scale is None else stored
        if static_input:
            out[f"{name.removesuffix('.weight')}.input_scale"] = torch.tensor([0.05])
        deq = dequantize(q, scale, strategy, block)
        if name.endswith(".weight"):
            ref[name] = deq
        else:  # back to the per-expert tensors the reference loads
            prefix, proj = name.rsplit(".", 1)
            for e, t in enumerate(deq):
                if proj == "down_proj":
                    ref[f"{prefix}.{e}.down_proj.weight"] = t
                else:
                    ref[f"{prefix}.{e}.gate_proj.weight"], ref[f"{prefix}.{e}.up_proj.weight"] = t.chunk(2)
    config = json.loads((src / "config.json").read_text())
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "reference").mkdir()
    save_file(ref, str(dst / "reference" / "model.safetensors"))
    (dst / "reference" / "config.json").write_text(json.dumps(config))
    config["quantization_config"] = quantization_config(fmt, block, static_input)
    save_file(out, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))
    return dst / "reference"


def quantization_config(fmt: str, block=(16, 16), static_input: bool = False) -> dict:
    if fmt == "block":
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": list(block),
            "modules_to_not_convert": ["lm_head"],
        }
    if fmt == "fp8-tensor":  # AutoFP8's
        return {
            "quant_method": "fp8",
            "activation_scheme": "static" if static_input else "dynamic",
            "ignored_layers": ["lm_head"],
        }
    inputs = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
    if static_input:
        inputs.update(dynamic=False, strategy="tensor")
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": fmt.removeprefix("ct-")}
    if fmt == "ct-block":
        weights["block_structure"] = list(block)
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs, "output_activations": None}
        },
        "ignore": ["lm_head", "re:.*mlp\\.gate$", "re:.*shared_expert_gate$"],
    }


def _fused_experts(tensors: dict) -> dict:
    out, experts = {}, {}
    for name, t in tensors.items():
        m = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name)
        if m is None:
            out[name] = t
        else:
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
    for prefix, parts in experts.items():
        n = 1 + max(e for e, _ in parts)
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([parts[(e, "gate")], parts[(e, "up")]]) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([parts[(e, "down")] for e in range(n)])
    return out


@pytest.fixture(scope="module")
def fp8_checkpoint(hf_model, tmp_path_factory):
    """fp8_checkpoint(family, fmt, **write_fp8 kwargs) -> (fp8 dir, dequantized reference dir)."""
    cache = {}

    def make(family: str, fmt: str, overrides=None, **kwargs):
        key = (family, fmt, json.dumps(overrides or {}, sort_keys=True), json.dumps(kwargs, sort_keys=True))
        if key not in cache:
            _, src = hf_model(family, **(overrides or {}))
            dst = tmp_path_factory.mktemp(f"{family}-{fmt}")
            cache[key] = (dst, write_fp8(src, dst, fmt, **kwargs))
        return cache[key]

    return make


def _reference_model(family: str, ref_dir):
    return _hf_classes(family)[1].from_pretrained(ref_dir, dtype=torch.float32).eval()


def _greedy(run, key, ids, steps, slot):
    """Greedy tokens of one sequence through our paged model, and each step's logits."""
    logits = [run.step([(key, ids)], slots=None if slot is None else [slot])[0]]
    tokens = [int(logits[-1][-1].argmax())]
    for _ in range(steps - 1):
        logits.append(run.step([(key, [tokens[-1]])], slots=None if slot is None else [slot])[0])
        tokens.append(int(logits[-1][-1].argmax()))
    return tokens, torch.cat(logits)


def _hf_greedy(model, ids, steps):
    seq = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([seq])).logits[0]
            seq.append(int(logits[-1].argmax()))
    return seq[len(ids) :], logits.float()


def _assert_same_params(ours, theirs):
    a, b = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


PROMPT = [5, 17, 99, 3, 42, 7, 200, 31, 64]


# ---- FP8 checkpoints load, dequantized, as transformers + PEFT run them -------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fp8_checkpoint_serves_like_transformers_and_peft_on_its_dequantized_weights(
    family, fmt, fp8_checkpoint, paged_runner, caplog
):
    """Every parameter is the dequantized weight exactly (one log line says so); a PEFT adapter's
    rows and the base rows give transformers' logits (1e-4) and its greedy tokens."""
    overrides = dict(attention_bias=True) if family == "llama" else {}
    path, ref_dir = fp8_checkpoint(family, fmt, overrides)
    spec = LoraSpec(max_loras=2, max_rank=8, dtype=torch.float32)
    with caplog.at_level("INFO", logger="loraserve.executor.model.fp8"):
        ours = load_model(path, lora=spec)
    said = [r.getMessage() for r in caplog.records if "dequantized to float32 at load" in r.getMessage()]
    assert len(said) == 1 and "cpu has no FP8 compute" in said[0] and str(path) in said[0]
    _assert_same_params(ours, load_model(ref_dir, lora=spec))
    assert not ours.cfg.fp8_linears  # the CPU computes in float32: nothing is held in FP8

    base = _reference_model(family, ref_dir)
    ref = random_peft(base, "r4")
    load_shard_into_slot(ours, 1, pack_shard(ref, "r4", declare_layout(ours.cfg, spec, "tiny")))
    run = paged_runner(ours, block_size=4)
    for key, slot in (("lora", 1), ("base", -1)):
        tokens, logits = _greedy(run, key, PROMPT, 4, slot)
        if slot < 0:
            with ref.disable_adapter():
                want_tokens, want_logits = _hf_greedy(ref, PROMPT, 4)
        else:
            want_tokens, want_logits = _hf_greedy(ref, PROMPT, 4)
        assert tokens == want_tokens
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "fmt, fused", [("ct-channel", False), ("ct-tensor", False), ("block", True)], ids=["ct-channel", "ct-tensor", "block-fused"]
)
@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_fp8_moe_checkpoint_matches_transformers_on_its_dequantized_weights(family, fmt, fused, fp8_checkpoint, paged_runner):
    """Experts per expert (compressed-tensors) and fused [E, ...] with [E, ...] block scales, the
    routers (in the ignore list) left in float: parameters exact, logits and greedy tokens transformers'."""
    from .conftest import TINY_MOE

    path, ref_dir = fp8_checkpoint(family, fmt, TINY_MOE[family], fuse_experts=fused)
    serves_as_dequantized(path, ref_dir, family, paged_runner)


def serves_as_dequantized(path, ref_dir, family, paged_runner):
    """The FP8 checkpoint at `path` loads to exactly the parameters of its dequantized copy `ref_dir`,
    and serves its greedy tokens and logits as transformers runs that copy."""
    ours = load_model(path)
    _assert_same_params(ours, load_model(ref_dir))
    tokens, logits = _greedy(paged_runner(ours, block_size=4), "s", PROMPT, 4, None)
    want_tokens, want_logits = _hf_greedy(_reference_model(family, ref_dir), PROMPT, 4)
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_tp_rank_dequantizes_its_own_cut_with_its_scales(fmt, fp8_checkpoint):
    """tp 2: per-row scales cut with column-parallel rows and whole for row-parallel layers, blocks
    cut by blocks: each rank's parameters are its cut of the one-rank dequantized model's."""
    path, _ = fp8_checkpoint("llama", fmt, dict(intermediate_size=128, attention_bias=True))
    whole = load_model(path)
    params = dict(whole.named_parameters())
    for rank in range(2):
        tp = TPGroup(2, rank)  # no process group: loading makes no collective
        part = dict(load_model(path, tp=tp).named_parameters())
        assert part.keys() == params.keys()
        for name, p in part.items():
            torch.testing.assert_close(p, expected_part(name, params[name], tp, whole.cfg), rtol=0, atol=0, msg=name)


def test_a_sharded_fp8_checkpoint_finds_each_scale_in_another_file(fp8_checkpoint, tmp_path):
    """Weights and their scales in different files of a model.safetensors.index.json."""
    path, ref_dir = fp8_checkpoint("llama", "block")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(path / "config.json", sharded)
    weight_map = {n: f"model-0000{1 + n.endswith('_scale_inv')}-of-00002.safetensors" for n in tensors}
    for file in set(weight_map.values()):
        save_file({n: t for n, t in tensors.items() if weight_map[n] == file}, str(sharded / file))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _assert_same_params(load_model(sharded), load_model(ref_dir))


@pytest.mark.parametrize("fmt", ["ct-tensor", "fp8-tensor"])
def test_a_checkpoint_with_static_input_scales_loads(fmt, fp8_checkpoint):
    """Static per-tensor input_scale (checked, one value, finite): the weights load as the dequantized ones."""
    path, ref_dir = fp8_checkpoint("llama", fmt, static_input=True)
    _assert_same_params(load_model(path), load_model(ref_dir))


# ---- refusals, each before any weight is loaded ---------------------------------------------------


def _edited(path, tmp_path, config=None, tensors=None):
    """A copy of checkpoint `path` with config.json's quantization_config edited by config(dict) and
    its tensors by tensors(dict)."""
    dst = tmp_path / f"edited{len(list(tmp_path.iterdir()))}"
    shutil.copytree(path, dst, ignore=shutil.ignore_patterns("reference"))
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg["quantization_config"])
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors:
        with safe_open(str(dst / "model.safetensors"), "pt") as f:
            t = {n: f.get_tensor(n) for n in f.keys()}
        tensors(t)
        save_file(t, str(dst / "model.safetensors"))
    return dst


Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda q: q.update(quant_method="gptq"),
            re.escape(
                "quantization_config quant_method 'gptq' is not supported; supported: compressed-tensors (format "
                "float-quantized, or naive-quantized, with FP8 weights) and fp8 (block-wise with weight_block_size, or per tensor)"
            ),
        ),
        (lambda q: q.update(format="pack-quantized"), "format 'pack-quantized' of config group 'group_0' is not supported"),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=4), "num_bits 4 type 'float' is not supported"),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(type="int"), "num_bits 8 type 'int' is not supported"),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="group"), "weight strategy 'group' is not supported"),
        (lambda q: q.update(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme: num_bits 8 type None is not supported"),
        (
            lambda q: q["config_groups"]["group_0"]["input_activations"].update(strategy="tensor"),
            "input_activations dynamic=True strategy 'tensor' is not supported",
        ),
        (
            lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}),
            "sparsity_config format 'sparse-24-bitmask' is not supported; only dense weights",
        ),
        (
            lambda q: q.update(transform_config={"config_groups": {"R1": {"type": "hadamard"}}}),
            r"transform_config \(weight and activation transforms\) is not supported",
        ),
    ],
    ids=["method", "format", "num_bits", "type", "strategy", "kv-cache", "activations", "sparse", "transforms"],
)
def test_unsupported_compressed_tensors_configs_are_refused_naming_them(edit, match, fp8_checkpoint, refuses, tmp_path):
    path, _ = fp8_checkpoint("llama", "ct-channel")
    refuses(_edited(path, tmp_path, config=edit), match)


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda q: q.update(activation_scheme="static"),
            r"^quantization_config \(fp8\): activation_scheme 'static' is not supported; only dynamic$",
        ),
        (lambda q: q.update(weight_block_size=[128]), r"weight_block_size \[128\]: expected two positive integers"),
        (lambda q: q.update(scale_fmt="ue8m0"), "scale_fmt 'ue8m0' is not supported"),
    ],
    ids=["activations", "block-size", "scale-fmt"],
)
def test_unsupported_block_fp8_configs_are_refused_naming_them(edit, match, fp8_checkpoint, refuses, tmp_path):
    path, _ = fp8_checkpoint("llama", "block")
    refuses(_edited(path, tmp_path, config=edit), match)


def test_unsupported_per_tensor_fp8_activations_are_refused_naming_them(fp8_checkpoint, refuses, tmp_path):
    path, _ = fp8_checkpoint("llama", "fp8-tensor")
    refuses(
        _edited(path, tmp_path, config=lambda q: q.update(activation_scheme="dynamic_per_token")),
        r"^quantization_config \(fp8\): activation_scheme 'dynamic_per_token' is not supported; only dynamic or static$",
    )


def _set(name, value):
    return lambda t: t.__setitem__(name, value)


@pytest.mark.parametrize(
    "fmt, edit, match",
    [
        (
            "ct-channel",
            _set(f"{Q}.weight_scale", torch.ones(64)[:32, None]),
            rf"'{Q}.weight_scale' is \[32, 1\]; .* take \[64, 1\]",
        ),
        ("ct-tensor", _set(f"{Q}.weight_scale", torch.ones(2)), rf"'{Q}.weight_scale' is \[2\]"),
        ("block", _set(f"{Q}.weight_scale_inv", torch.ones(4, 3)), rf"'{Q}.weight_scale_inv' is \[4, 3\]; .* take \[4, 4\]"),
        ("ct-channel", _set(f"{Q}.weight_scale", torch.full((64, 1), float("nan"))), f"'{Q}.weight_scale' holds NaN or infinite"),
        (
            "block",
            _set(f"{Q}.weight_scale_inv", torch.full((4, 4), float("inf"))),
            f"'{Q}.weight_scale_inv' holds NaN or infinite",
        ),
        ("ct-channel", lambda t: t.pop(f"{Q}.weight_scale"), f"'{Q}.weight' is FP8 but its scale '{Q}.weight_scale' is missing"),
        (
            "ct-channel",
            _set("lm_head.weight_scale", torch.ones(256, 1)),
            "'lm_head.weight_scale' is a scale for module 'lm_head', which",
        ),
        ("ct-channel", _set(f"{Q}.weight_scale", torch.ones(64, 1, dtype=torch.int32)), "scales must be floating point"),
        ("ct-channel", _set(f"{Q}.weight", torch.zeros(64, 64).to(torch.float8_e5m2)), "float8_e5m2; only float8_e4m3fn"),
        (
            "block",
            _set(f"{Q}.weight_scale", torch.ones(64, 1)),
            f"'{Q}.weight_scale' is a scale, but no FP8 weight of this format",
        ),
    ],
    ids=["channel-shape", "tensor-shape", "block-shape", "nan", "inf", "missing", "ignored", "int-scale", "e5m2", "other-format"],
)
def test_malformed_scales_are_refused_naming_the_tensor(fmt, edit, match, fp8_checkpoint, refuses, tmp_path):
    path, _ = fp8_checkpoint("llama", fmt)
    refuses(_edited(path, tmp_path, tensors=edit), match)


def test_missing_or_malformed_input_scales_and_fp8_without_a_config_are_refused(fp8_checkpoint, refuses, tmp_path):
    path, _ = fp8_checkpoint("llama", "ct-tensor", static_input=True)
    refuses(
        _edited(path, tmp_path, tensors=lambda t: t.pop(f"{Q}.input_scale")),
        f"'{Q}.input_scale' is missing: quantization_config config group 'group_0' quantizes",
    )
    path, _ = fp8_checkpoint("llama", "fp8-tensor", static_input=True)
    refuses(
        _edited(path, tmp_path, tensors=lambda t: t.pop(f"{Q}.input_scale")),
        f"'{Q}.input_scale' is missing: quantization_config activation_scheme 'static' quantizes",
    )
    path, _ = fp8_checkpoint("llama", "ct-tensor", static_input=True)
    refuses(
        _edited(path, tmp_path, tensors=_set(f"{Q}.input_scale", torch.tensor([float("nan")]))), f"'{Q}.input_scale' holds NaN"
    )
    refuses(
        _edited(path, tmp_path, tensors=_set(f"{Q}.input_scale", torch.ones(2))),
        rf"'{Q}.input_scale' is \[2\]; expected one value",
    )
    path, _ = fp8_checkpoint("llama", "ct-channel")
    no_config = tmp_path / "no-config"
    shutil.copytree(path, no_config, ignore=shutil.ignore_patterns("reference"))
    cfg = json.loads((no_config / "config.json").read_text())
    del cfg["quantization_config"]
    (no_config / "config.json").write_text(json.dumps(cfg))
    refuses(no_config, "is F8_E4M3 but config.json's quantization_config is missing")
    kv_scales = {f"model.layers.{i}.self_attn.{kv}_scale": torch.tensor(0.01) for i in range(2) for kv in "kv"}
    kv_only = _edited(  # compressed-tensors with the KV cache's scheme alone
        path,
        tmp_path,
        config=lambda q: [q.pop("config_groups"), q.update(kv_cache_scheme={"num_bits": 8, "type": "float"})],
        tensors=lambda t: t.update(kv_scales),
    )
    refuses(kv_only, "is F8_E4M3 but config.json's quantization_config quantizes no weights")


@pytest.mark.parametrize("fmt", ["block", "ct-block"])
def test_a_tp_cut_inside_the_scale_blocks_dequantizes_with_the_blocks_it_touches(fmt, fp8_checkpoint):
    """32-wide blocks at tp 2: a rank's 56 of gate/up's 112 rows and of down_proj's 112 input columns,
    and its 16 of k/v's 32 rows, start or end inside a block; each rank's parameters are still its cut
    of the one-rank dequantized model's."""
    path, _ = fp8_checkpoint("llama", fmt, block=(32, 32))
    whole = load_model(path)
    params = dict(whole.named_parameters())
    for rank in range(2):
        tp = TPGroup(2, rank)
        for name, p in load_model(path, tp=tp).named_parameters():
            torch.testing.assert_close(p, expected_part(name, params[name], tp, whole.cfg), rtol=0, atol=0, msg=name)


def test_quantization_fp8_is_refused_without_fp8_compute(hf_model, refuses):
    _, path = hf_model("llama")
    refuses(path, r"--quantization fp8 needs FP8 compute: cpu has no FP8 compute", quantization="fp8")
    refuses(path, r"quantization 'int4' is not supported", quantization="int4")


def _static_mlp_group_without_down_proj_input_scale(path, tmp_path):
    """A copy of the per-channel static checkpoint at path with a second config group of the same layout,
    attention's, dynamic (its input_scales dropped), and layer 0's down_proj input_scale missing."""

    def groups(q):
        static = q["config_groups"]["group_0"]
        dynamic = dict(static["input_activations"], dynamic=True, strategy="token")
        q["config_groups"]["group_1"] = dict(static, targets=["re:.*self_attn\\."], input_activations=dynamic)

    def tensors(t):
        for n in [n for n in t if n.endswith(".input_scale") and ("self_attn" in n or "layers.0.mlp.down_proj" in n)]:
            del t[n]

    return _edited(path, tmp_path, config=groups, tensors=tensors)


@pytest.mark.parametrize("case", ["quantization-on-cpu", "gptq-checkpoint", "static-group-input-scale"])
def test_executor_cli_exits_at_start_naming_the_refusal(case, hf_model, fp8_checkpoint, tmp_path):
    if case == "quantization-on-cpu":
        model, flags, message = (
            hf_model("llama")[1],
            ["--quantization", "fp8"],
            "--quantization fp8 needs FP8 compute: cpu has no",
        )
    elif case == "static-group-input-scale":  # the static "Linear" group's, beside a dynamic one of its layout
        model = _static_mlp_group_without_down_proj_input_scale(
            fp8_checkpoint("llama", "ct-channel", static_input=True)[0], tmp_path
        )
        flags, message = [], "'model.layers.0.mlp.down_proj.input_scale' is missing: quantization_config config group 'group_0'"
    else:
        model = _edited(fp8_checkpoint("llama", "ct-channel")[0], tmp_path, config=lambda q: q.update(quant_method="gptq"))
        flags, message = [], "quantization_config quant_method 'gptq' is not supported"
    out = subprocess.run(
        [LORASERVE, "executor", "--model", str(model), "--device", "cpu", *flags, "--executor-listen", "127.0.0.1:0",
         "--http-port", "0", "--executor-metrics-port", "0", "--cache-dir", str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert "error: " in out.stderr and message in out.stderr


# ---- the FP8 linear layer (the reference math the CUDA path is held to) --------------------------


def test_per_token_quantization_and_the_fp8_gemm_reference():
    torch.manual_seed(0)
    x = torch.randn(5, 64) * torch.tensor([1.0, 10.0, 0.01, 1.0, 0.0])[:, None]  # the last row all zero
    q, s = fp8_reference.quantize_per_token(x)
    assert q.dtype == E4M3 and s.shape == (5, 1)
    assert (q.float().abs().amax(dim=1)[:4] == FP8_MAX).all() and (q[4].float() == 0).all()
    torch.testing.assert_close(q.float() * s, x, rtol=2**-4, atol=1e-6)  # e4m3 keeps 3 mantissa bits
    w = torch.randn(48, 64)
    wq, ws = fp8.quantize_rows(w)
    y = fp8_reference.fp8_linear(x, wq, ws)
    torch.testing.assert_close(y, (q.float() * s) @ (wq.float() * ws[:, None]).T, rtol=1e-5, atol=1e-5)
    # within e4m3's rounding (2^-4 of each operand) of the float product: |error| <= 2^-3 |x_t| |w_n|
    assert ((y - x @ w.T).abs() <= 2**-3 * x.norm(dim=1)[:, None] * w.norm(dim=1)[None, :] + 1e-6).all()


def test_fp8_layer_runs_lora_on_its_unquantized_input(paged_runner):
    """An FP8 LinearWithLoRA: the base GEMM is kernels.fp8_linear over its FP8 weight and row scales,
    LoRA's shrink reads the layer's input unquantized and its expand adds into the GEMM's output."""
    from loraserve.kernels import make_lora_meta

    torch.manual_seed(0)
    spec = LoraSpec(max_loras=2, max_rank=4, dtype=torch.float32)
    layer = LinearWithLoRA(64, (32, 16), True, spec, torch.float32, "cpu", fp8=True)
    assert layer.weight.dtype == E4M3 and layer.weight_scale.shape == (48,) and layer.lora_a.dtype == torch.float32
    w = torch.randn(48, 64)
    q, s = fp8.quantize_rows(w)
    layer.weight.copy_(q)
    layer.weight_scale.copy_(s)
    layer.bias.copy_(torch.randn(48))
    a, b = torch.randn(2, 4, 64), torch.randn(48, 4)
    layer.set_lora(1, a, b)
    x = torch.randn(3, 64)
    meta = make_lora_meta(torch.tensor([1, -1, 1]), 2, frozenset({1}), torch.tensor([0, 4], dtype=torch.int32))
    y = layer(x, meta)
    base = kernels.fp8_linear(x, layer.weight, layer.weight_scale, layer.bias)
    delta = torch.cat([x @ a[0].T @ b[:32].T, x @ a[1].T @ b[32:].T], dim=1) * torch.tensor([1.0, 0.0, 1.0])[:, None]
    torch.testing.assert_close(y, base + delta, rtol=1e-5, atol=1e-4)
    assert not LinearWithLoRA(64, (40,), False, None, torch.float32, "cpu", fp8=True).weight.dtype == E4M3  # N % 16 != 0


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_quantization_fp8_quantizes_linear_layers_per_row_and_runs_lora_beside_them(family, hf_model, paged_runner, monkeypatch):
    """--quantization fp8 with the FP8 hardware check passed (the CPU then runs the reference math):
    each linear layer's weight is the per-row quantization of the checkpoint's, lm_head and
    embeddings stay float; a mixed batch (a PEFT adapter's row, a base row) gives the logits of
    transformers + PEFT with each of those layers' base replaced by the same FP8 math (per-row weight
    scales, per-token activation scales) and the adapter's LoRA on the layer's unquantized input."""
    monkeypatch.setattr(fp8, "fp8_compute_error", lambda device, dtype: None)
    model, path = hf_model(family)
    spec = LoraSpec(max_loras=2, max_rank=8, dtype=torch.float32)
    ours = load_model(path, lora=spec, quantization="fp8")
    assert ours.cfg.fp8_linears
    down = ours.model.layers[1].mlp.down_proj
    q, s = fp8.quantize_rows(model.model.layers[1].mlp.down_proj.weight)
    assert down.weight.dtype == E4M3 and torch.equal(down.weight.view(torch.uint8), q.view(torch.uint8))
    torch.testing.assert_close(down.weight_scale, s, rtol=0, atol=0)
    assert ours.lm_head.weight.dtype == torch.float32 and ours.lm_head.weight_scale is None

    ref = copy.deepcopy(model)
    for name, m in ref.named_modules():
        if isinstance(m, torch.nn.Linear) and QUANTIZED.fullmatch(f"{name}.weight"):
            wq, ws = fp8.quantize_rows(m.weight)
            m.forward = lambda x, wq=wq, ws=ws, b=m.bias: fp8_reference.fp8_linear(x.flatten(0, -2), wq, ws, b).view(
                *x.shape[:-1], -1
            )
    torch.manual_seed(5)
    ref = peft.get_peft_model(ref, peft.LoraConfig(**ADAPTERS["r4"]), adapter_name="r4")  # its base layers: the FP8 math
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    ref.eval()
    load_shard_into_slot(ours, 1, pack_shard(ref, "r4", declare_layout(ours.cfg, spec, "tiny")))
    lora_out, base_out = paged_runner(ours, block_size=4).step([("a", PROMPT), ("b", PROMPT[:5])], slots=[1, -1])
    with torch.no_grad():
        want_lora = ref(torch.tensor([PROMPT])).logits[0]
        with ref.disable_adapter():
            want_base = ref(torch.tensor([PROMPT[:5]])).logits[0]
            plain = model(torch.tensor([PROMPT[:5]])).logits[0]
    torch.testing.assert_close(lora_out, want_lora, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(base_out, want_base, atol=1e-4, rtol=1e-4)
    assert (base_out - plain).abs().max() > 1e-3  # and FP8 is not float: the check can fail
    assert (lora_out[:5] - base_out).abs().max() > 1e-2  # nor is the adapter's row the base row


def test_the_weight_format_names_fp8_layers_and_the_fp8_checkpoint_they_came_from(hf_model, fp8_checkpoint, monkeypatch):
    """fp8.weight_format, the prefix cache's name for the base weights (engine.py `kv_format`): the
    weights' dtype, and the FP8 checkpoint's scheme whether its layers hold FP8 or were dequantized."""
    _, path = hf_model("llama")
    fp8_dir, _ = fp8_checkpoint("llama", "ct-channel")
    scheme = "compressed-tensors FP8 (per-channel weight scales)"
    assert fp8.weight_format(load_model(path)) == "float32"
    assert fp8.weight_format(load_model(fp8_dir)) == f"float32 of {scheme}"  # the CPU dequantizes it
    monkeypatch.setattr(fp8, "fp8_compute_error", lambda device, dtype: None)  # FP8 compute passed, as above
    assert fp8.weight_format(load_model(path, quantization="fp8")) == "float8_e4m3fn"
    assert fp8.weight_format(load_model(fp8_dir)) == f"float8_e4m3fn of {scheme}"


def test_the_cuda_paths_scaled_mm_call_on_the_cpu_matches_float32():
    """kernels/triton_fp8.scaled_mm's torch._scaled_mm call (row-wise scales, the weight's transpose as
    the column-major operand), run where torch has it on the CPU: the float32 result rounded to bf16."""
    pytest.importorskip("triton")
    from loraserve.kernels import triton_fp8

    torch.manual_seed(0)
    x, w = torch.randn(5, 64, dtype=torch.bfloat16), torch.randn(48, 64)
    wq, ws = fp8.quantize_rows(w)
    q, s = fp8_reference.quantize_per_token(x)
    try:
        y = triton_fp8.scaled_mm(q, s, wq, ws, torch.bfloat16)
    except (NotImplementedError, RuntimeError) as exc:
        pytest.skip(f"this torch has no row-wise FP8 _scaled_mm on the CPU: {exc}")
    want = fp8_reference.scaled_mm(q, s, wq, ws, torch.float32)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), want, rtol=2**-7, atol=1e-5 * want.abs().max().item())


def test_fp8_compute_needs_compute_capability_8_9_and_bfloat16(monkeypatch):
    """Where the linear layers may run in FP8 (the GPU's capability as CUDA reports it, patched here)."""
    capability = {"cuda:0": (8, 0), "cuda:1": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability[str(device)])
    assert fp8.fp8_compute_error("cuda:0", torch.bfloat16) == "cuda:0 is compute capability 8.0, without FP8 (8.9+ has it)"
    assert fp8.fp8_compute_error("cuda:1", torch.float16) == "FP8 linear layers compute in bfloat16, not float16"
    assert fp8.fp8_compute_error("cuda:1", torch.bfloat16) is None
    with pytest.raises(ValueError, match="--quantization fp8 needs FP8 compute: cuda:0 is compute capability 8.0"):
        fp8.plan(None, "fp8", "cuda:0", torch.bfloat16, "model")
    scheme = fp8_scheme.checkpoint_scheme({"quantization_config": quantization_config("block")})
    assert fp8.plan(scheme, "", "cuda:1", torch.bfloat16, "model") and not fp8.plan(scheme, "", "cuda:0", torch.bfloat16, "model")


def test_the_fp8_plan_names_moe_experts_only_where_the_model_has_them(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    with caplog.at_level("INFO", logger="loraserve.executor.model.fp8"):
        fp8.plan(None, "fp8", "cuda:0", torch.bfloat16, "dense")
        fp8.plan(None, "fp8", "cuda:0", torch.bfloat16, "moe", experts=True)
    said = [r.getMessage() for r in caplog.records]
    assert said[0] == "dense: linear layers in FP8 (weights quantized per output channel at load where not already)"
    assert said[1] == "moe: linear layers and MoE experts in FP8 (weights quantized per output channel at load where not already)"


def test_quantization_fp8_or_an_unsupported_checkpoint_is_refused_before_tp_ranks_are_spawned(
    hf_model, fp8_checkpoint, tmp_path, monkeypatch
):
    from loraserve.executor import service
    from loraserve.executor.config import ExecutorConfig

    def never(*a, **k):
        raise AssertionError("ranks were spawned before the refusal")

    monkeypatch.setattr(service, "TPRanks", never)
    cfg = ExecutorConfig(model=str(hf_model("llama")[1]), tp_size=2, quantization="fp8")
    with pytest.raises(ValueError, match="--quantization fp8 needs FP8 compute: cpu has no FP8 compute"):
        service.build_executor(cfg)
    gptq = _edited(fp8_checkpoint("llama", "ct-channel")[0], tmp_path, config=lambda q: q.update(quant_method="gptq"))
    with pytest.raises(ValueError, match="quantization_config quant_method 'gptq' is not supported"):
        service.build_executor(ExecutorConfig(model=str(gptq), tp_size=2))
