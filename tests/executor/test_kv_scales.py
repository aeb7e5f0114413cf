"""The FP8 KV cache's scales from a checkpoint (executor/model/kv_scales.py): compressed-tensors'
kv_cache_scheme read beside FP8 weights or alone, cut to each tensor-parallel rank's kv heads; every
scheme and scale the cache cannot take refused before any weight is loaded, naming the field or the
tensor (ValueError, and the executor's exit at start); --kv-cache-dtype checked in the config and
against the device."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch

from loraserve.executor.config import ExecutorConfig
from loraserve.executor.model import kv_scales
from loraserve.executor.model.loader import load_model
from loraserve.executor.parallel import TPGroup

from .conftest import LORASERVE
from .test_kv_fp8 import FP8, write_kv_scales


def test_each_tp_rank_keeps_its_kv_heads_scales(hf_model, tmp_path):
    """Per-head scales cut with the heads: at tp 2 one kv head each; at tp 4 (more ranks than the
    2 kv heads) each rank's replicated head's. Per-tensor scales: every head's."""
    _, src = hf_model("qwen2")
    scales = torch.rand(2, 2, 2) / 100 + 0.001
    path = write_kv_scales(src, tmp_path / "head", scales, "attn_head")
    assert torch.equal(load_model(path).kv_scales, scales)
    per_tensor = load_model(write_kv_scales(src, tmp_path / "tensor", scales, "tensor")).kv_scales
    assert torch.equal(per_tensor, scales.amax(-1, keepdim=True).expand(2, 2, 2))
    for tp, head_of in ((2, [0, 1]), (4, [0, 0, 1, 1])):
        for rank in range(tp):
            got = load_model(path, tp=TPGroup(tp, rank)).kv_scales
            assert torch.equal(got, scales[:, :, head_of[rank] : head_of[rank] + 1]), (tp, rank)


K0 = "model.layers.0.self_attn.k_scale"
V1 = "model.layers.1.self_attn.v_scale"


def _set(name, value):
    return lambda t: t.__setitem__(name, value)


@pytest.mark.parametrize(
    "config_edit, tensors_edit, match",
    [
        (lambda q: q["kv_cache_scheme"].update(num_bits=4), None, "kv_cache_scheme: num_bits 4 type 'float' is not supported"),
        (lambda q: q["kv_cache_scheme"].update(type="int"), None, "kv_cache_scheme: num_bits 8 type 'int' is not supported"),
        (lambda q: q["kv_cache_scheme"].update(strategy="token"), None, "kv_cache_scheme: strategy 'token' is not supported"),
        (lambda q: q["kv_cache_scheme"].update(dynamic=True), None, "kv_cache_scheme: dynamic scales are not supported"),
        (lambda q: q["kv_cache_scheme"].update(symmetric=False), None, "kv_cache_scheme: asymmetric scales"),
        (
            lambda q: q.update(kv_cache_scheme="static"),
            None,
            re.escape(
                "quantization_config kv_cache_scheme 'static' is AutoFP8's and needs quant_method fp8, not "
                "'compressed-tensors'; compressed-tensors writes kv_cache_scheme as an object (num_bits, type, strategy, ...)"
            ),
        ),
        (
            None,
            lambda t: t.pop(K0),
            re.escape(
                f"checkpoint tensor '{K0}' (or 'model.layers.0.self_attn.k_proj.output_scale') is missing "
                "(kv_cache_scheme in quantization_config)"
            ),
        ),
        (None, _set(K0, torch.tensor([float("nan")])), f"'{K0}' holds NaN or infinite KV cache scales"),
        (None, _set(V1, torch.tensor([float("inf")])), f"'{V1}' holds NaN or infinite KV cache scales"),
        (None, _set(K0, torch.tensor([-0.5])), f"'{K0}' holds KV cache scales that are not positive"),
        (None, _set(V1, torch.tensor([0.0])), f"'{V1}' holds KV cache scales that are not positive"),
        (None, _set(K0, torch.ones(3)), rf"'{K0}' is \[3\]; a KV cache scale is one value or one per kv head \(2\)"),
        (None, _set(K0, torch.ones(1, dtype=torch.int32)), f"'{K0}' is I32; KV cache scales must be floating point"),
        (
            None,
            _set("model.layers.7.self_attn.k_scale", torch.ones(1)),
            "'model.layers.7.self_attn.k_scale' is a KV cache scale of a layer the model does not have",
        ),
    ],
    ids=[
        "num_bits",
        "type",
        "strategy",
        "dynamic",
        "asymmetric",
        "static-string",
        "missing",
        "nan",
        "inf",
        "negative",
        "zero",
        "shape",
        "int",
        "layer",
    ],
)
def test_a_kv_cache_scheme_the_cache_cannot_take_is_refused_naming_it(
    config_edit, tensors_edit, match, hf_model, refuses, tmp_path
):
    _, src = hf_model("llama")
    scales = torch.full((2, 2, 2), 0.01)
    refuses(write_kv_scales(src, tmp_path / "ckpt", scales, config_edit=config_edit, tensors_edit=tensors_edit), match)


def test_kv_cache_dtype_is_checked_in_the_config_and_on_the_device(monkeypatch):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8'\), got 'fp16'"):
        ExecutorConfig(kv_cache_dtype="fp16")
    assert ExecutorConfig(kv_cache_dtype="fp8").torch_kv_dtype == FP8
    assert ExecutorConfig(dtype="bfloat16").torch_kv_dtype == torch.bfloat16
    assert kv_scales.kv_cache_dtype_error("fp8", "cpu") is None  # torch converts float8_e4m3fn on the CPU
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    assert kv_scales.kv_cache_dtype_error("fp8", "cuda:0") == (
        "--kv-cache-dtype fp8 needs a GPU with FP8 conversions: cuda:0 is compute capability 8.0 (8.9+ has them)"
    )
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert kv_scales.kv_cache_dtype_error("fp8", "cuda:0") is None


def test_fp8_kv_on_a_gpu_without_fp8_is_refused_at_start(hf_model, monkeypatch):
    """build_executor refuses before the model is loaded (or any rank spawned)."""
    from loraserve.executor import service

    _, path = hf_model("llama")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    monkeypatch.setattr(service, "load_served_model", lambda *a, **k: pytest.fail("the model was loaded before the refusal"))
    cfg = ExecutorConfig(model=str(path), device="cuda", dtype="bfloat16", kv_cache_dtype="fp8", max_model_len=64)
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8 needs a GPU with FP8 conversions: cuda is compute capability 8.0"):
        service.build_executor(cfg)


def test_executor_cli_exits_at_start_naming_a_malformed_scale(hf_model, tmp_path):
    """`loraserve executor --kv-cache-dtype fp8` on a checkpoint with a NaN k_scale: exit 1, the tensor named."""
    _, src = hf_model("llama")
    path = write_kv_scales(
        src, tmp_path / "ckpt", torch.full((2, 2, 2), 0.01), tensors_edit=_set(K0, torch.tensor([float("nan")]))
    )
    out = subprocess.run(
        [LORASERVE, "executor", "--model", str(path), "--device", "cpu", "--kv-cache-dtype", "fp8",
         "--executor-listen", "127.0.0.1:0", "--http-port", "0", "--executor-metrics-port", "0",
         "--cache-dir", str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert f"error: checkpoint tensor '{K0}' holds NaN or infinite KV cache scales" in out.stderr, out.stderr


def test_an_fp8_weight_checkpoint_with_a_kv_cache_scheme_loads_both(hf_model, tmp_path):
    """llm-compressor's FP8 weights and FP8 KV in one checkpoint: the weights dequantized as without
    the scheme, the K/V scales read beside them (not taken for weight scales)."""
    from .test_fp8 import quantization_config, write_fp8

    _, src = hf_model("llama")
    ref_dir = write_fp8(src, tmp_path / "w8", "ct-channel")
    scales = torch.rand(2, 2, 2) / 100 + 0.001
    path = write_kv_scales(
        tmp_path / "w8", tmp_path / "w8kv", scales, "attn_head",
        config_edit=lambda q: q.update({k: v for k, v in quantization_config("ct-channel").items()}),
    )  # fmt: skip
    model = load_model(path)
    assert torch.equal(model.kv_scales, scales)
    for name, p in load_model(ref_dir).named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[name], p, rtol=0, atol=0)


def _renamed(rename):
    """A tensors_edit that renames every checkpoint tensor with `rename`."""

    def edit(tensors):
        for name in list(tensors):
            tensors[rename(name)] = tensors.pop(name)

    return edit


def _multimodal(prefix):
    """A multimodal checkpoint's language-model names (Gemma 3's): transformers 5's `model.language_model.`,
    4's `language_model.model.` (and `language_model.lm_head.`)."""
    if prefix == "model.language_model.":
        return lambda n: prefix + n.removeprefix("model.") if n.startswith("model.") else n
    return lambda n: "language_model." + n


_OLD_NAMES = {"k_scale": "k_proj.output_scale", "v_scale": "v_proj.output_scale"}


def _output_scale(name):
    """compressed-tensors' older name of a K / V cache scale: the K / V projection's output scale."""
    head, _, last = name.rpartition(".")
    return f"{head}.{_OLD_NAMES[last]}" if last in _OLD_NAMES else name


@pytest.mark.parametrize(
    "rename",
    [_multimodal("model.language_model."), _multimodal("language_model.model."), _output_scale],
    ids=["model.language_model", "language_model.model", "output_scale"],
)
def test_kv_scales_are_read_under_the_names_the_loader_takes(rename, hf_model, tmp_path):
    """A multimodal checkpoint's language-model prefixes (the loader's renames, Gemma 3's) and the older
    compressed-tensors name of the same scales (`k_proj.output_scale` / `v_proj.output_scale`) give the
    scales as `model.layers.N.self_attn.k_scale` / `v_scale` do."""
    _, src = hf_model("llama")
    scales = torch.rand(2, 2, 2) / 100 + 0.001
    path = write_kv_scales(src, tmp_path / "ckpt", scales, "attn_head", tensors_edit=_renamed(rename))
    assert torch.equal(load_model(path).kv_scales, scales)


def test_fp8_weights_and_kv_scales_under_a_multimodal_prefix_load_both(hf_model, tmp_path):
    """FP8 weights and FP8 KV under Gemma 3's `model.language_model.` names: the FP8 checkpoint's
    scale check does not take k_scale / v_scale for weight scales, and both load as without the prefix."""
    from .test_fp8 import quantization_config, write_fp8

    _, src = hf_model("llama")
    ref_dir = write_fp8(src, tmp_path / "w8", "ct-channel")
    scales = torch.rand(2, 2, 2) / 100 + 0.001
    path = write_kv_scales(
        tmp_path / "w8", tmp_path / "w8kv", scales, "attn_head",
        config_edit=lambda q: q.update(quantization_config("ct-channel")),
        tensors_edit=_renamed(_multimodal("model.language_model.")),
    )  # fmt: skip
    model = load_model(path)
    assert torch.equal(model.kv_scales, scales)
    for name, p in load_model(ref_dir).named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[name], p, rtol=0, atol=0)


def test_a_kv_scale_under_two_names_is_refused_naming_both(hf_model, refuses, tmp_path):
    """A checkpoint with both `k_scale` and the older `k_proj.output_scale` for one layer is ambiguous:
    refused before any weight is loaded, naming both tensors."""
    _, src = hf_model("llama")
    old = "model.layers.0.self_attn.k_proj.output_scale"
    path = write_kv_scales(src, tmp_path / "ckpt", torch.full((2, 2, 2), 0.01), tensors_edit=_set(old, torch.ones(1)))
    refuses(path, rf"checkpoint tensors '{old}' and '{K0}' are both layer 0's K cache scale")


def test_kv_scale_names_are_the_loaders():
    """kv_scale_of: (layer, K 0 / V 1) under every name the loader takes; None for the weights' scales."""
    for name, want in (
        ("model.layers.3.self_attn.k_scale", (3, 0)),
        ("model.layers.3.self_attn.v_proj.output_scale", (3, 1)),
        ("model.language_model.layers.1.self_attn.v_scale", (1, 1)),
        ("language_model.model.layers.0.self_attn.k_proj.output_scale", (0, 0)),
        ("model.layers.0.self_attn.k_proj.weight_scale", None),
        ("model.layers.0.self_attn.q_proj.output_scale", None),
        ("model.layers.0.mlp.k_scale", None),
    ):
        assert kv_scales.kv_scale_of(name) == want, name
