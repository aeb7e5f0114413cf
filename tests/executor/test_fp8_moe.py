"""FP8 experts of MoE models. Where the linear layers compute in FP8 (the hardware check forced here on
the CPU, which then runs the reference math) an FP8 checkpoint's experts stay float8_e4m3fn with one
scale per (expert, output row): per-tensor and per-channel scales as the checkpoint has them, block
scales and `--quantization fp8`'s float experts quantized per row at load, an expert-parallel rank's
experts with their own scales; the model's logits are transformers' with its dense layers on the FP8
math and its experts on the dequantized rows. Served from a store and an executor: on the CPU
(dequantized) every row is its adapter's transformers + PEFT one on the dequantized weights; on a
CUDA GPU with FP8 (compute capability 8.9+) the fused MoE kernel reads the FP8 experts and every row
of a mixed batch of expert, attention and base rows lies within the FP8 tolerance of its reference."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

from loraserve.executor.model import fp8
from loraserve.executor.model.loader import load_model
from loraserve.executor.parallel import TPGroup
from loraserve.kernels import fp8_reference

from .conftest import (
    TINY_MOE,
    Cluster,
    _hf_classes,
    check_against_reference,
    check_bf16_rows,
    generate,
    prompt_ids,
    run_group,
)
from .test_fp8 import QUANTIZED, write_fp8
from .test_fp8_service import FP8_LOGPROB_TOL

peft = pytest.importorskip("peft")

E4M3 = torch.float8_e4m3fn
PROMPT = [5, 17, 99, 3, 42, 7, 200, 31, 64]
# (family, format, experts fused [E, ...] in the checkpoint, the experts' FP8 values kept as they are).
# The tests' writer quantizes transformers' expert names only: Mixtral's w1/w3/w2 stay float (quantized at load).
CHECKPOINTS = {
    "qwen2_moe-ct-channel": ("qwen2_moe", "ct-channel", False, True),
    "qwen2_moe-ct-tensor": ("qwen2_moe", "ct-tensor", False, True),
    "qwen3_moe-ct-channel-fused": ("qwen3_moe", "ct-channel", True, True),
    "qwen2_moe-block-fused": ("qwen2_moe", "block", True, False),
    "mixtral-block": ("mixtral", "block", False, False),
    "mixtral-float-experts": ("mixtral", "ct-tensor", False, False),
}


@pytest.fixture
def fp8_compute(monkeypatch):
    """The FP8 hardware check passed on the CPU: the loader holds FP8 where a CUDA GPU would."""
    monkeypatch.setattr(fp8, "fp8_compute_error", lambda device, dtype: None)


def _experts(model):
    """{module path: the ExpertsWithLoRA} of every sparse layer."""
    return {n: m for n, m in model.named_modules() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}


@pytest.mark.parametrize("case", list(CHECKPOINTS))
def test_fp8_checkpoint_experts_stay_fp8_with_per_row_scales(case, hf_model, tmp_path, fp8_compute):
    """Per-tensor / per-channel FP8 experts: the checkpoint's FP8 values, each row's scale its own (per
    tensor broadcast to its rows), so q * scale is the dequantized weight exactly; block scales and float
    experts: the (dequantized) weight quantized per row. An expert-parallel rank (ep 2, rank 1) holds
    experts 2, 3 with their scales."""
    family, fmt, fused, kept = CHECKPOINTS[case]
    _, src = hf_model(family, **TINY_MOE[family])
    ref_dir = write_fp8(src, tmp_path / "fp8", fmt, fuse_experts=fused)
    ours = load_model(tmp_path / "fp8")
    assert ours.cfg.fp8_linears
    want = _experts(load_model(ref_dir))  # float32 experts: the dequantized weights
    rank1 = _experts(load_model(tmp_path / "fp8", ep=TPGroup(2, 1)))  # no process group: loading makes no collective
    assert want and _experts(ours).keys() == want.keys() == rank1.keys()
    for name, m in _experts(ours).items():
        e, n = m.weight.shape[:2]
        assert m.weight.dtype == E4M3 and m.weight_scale.shape == (e, n) and m.weight_scale.dtype == torch.float32
        w = want[name].weight
        if kept:
            torch.testing.assert_close(m.weight.float() * m.weight_scale[..., None], w, rtol=0, atol=0, msg=name)
        else:
            q, s = fp8.quantize_rows(w)
            assert torch.equal(m.weight.view(torch.uint8), q.view(torch.uint8)), name
            torch.testing.assert_close(m.weight_scale, s, rtol=0, atol=0, msg=name)
        if fmt == "ct-tensor" and kept:  # one scale per checkpoint tensor (expert's gate, up, down), on each of its rows
            per_tensor = m.weight_scale.view(e, len(m.output_sizes), -1)
            assert (per_tensor == per_tensor[..., :1]).all(), name
        part = rank1[name]
        assert torch.equal(part.weight.view(torch.uint8), m.weight[2:].view(torch.uint8)), name
        torch.testing.assert_close(part.weight_scale, m.weight_scale[2:], rtol=0, atol=0, msg=name)
        assert part.lora_a is None or part.lora_a.dtype != E4M3


def test_without_fp8_compute_the_experts_are_dequantized(hf_model, tmp_path):
    """The CPU as it is: nothing held in FP8, the experts the dequantized weights."""
    _, src = hf_model("mixtral", **TINY_MOE["mixtral"])
    ref_dir = write_fp8(src, tmp_path / "fp8", "ct-channel")
    ours, want = _experts(load_model(tmp_path / "fp8")), _experts(load_model(ref_dir))
    for name, m in ours.items():
        assert m.weight.dtype == torch.float32 and m.weight_scale is None
        torch.testing.assert_close(m.weight, want[name].weight, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_quantization_fp8_runs_fp8_experts_like_transformers_on_their_dequantized_rows(
    family, hf_model, paged_runner, fp8_compute
):
    """--quantization fp8 on a float MoE checkpoint: the experts are each row's quantization of the
    checkpoint's, and the logits are transformers' with every dense linear layer that holds FP8 on the
    FP8 math (per-row weight, per-token activation scales) and its experts on q * scale (weight-only:
    the activations stay float); the router stays float."""
    model, path = hf_model(family, **TINY_MOE[family])
    ours = load_model(path, quantization="fp8")
    held = {n: m for n, m in ours.named_modules() if getattr(m, "weight_scale", None) is not None}
    ref = copy.deepcopy(model)
    for name, m in ref.named_modules():
        if name.endswith("mlp.experts"):
            for proj in ("gate_up_proj", "down_proj"):
                mine = held[f"{name}.{proj}"]
                q, s = fp8.quantize_rows(getattr(m, proj))
                assert torch.equal(mine.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(mine.weight_scale, s)
                getattr(m, proj).data.copy_(q.float() * s[..., None])
        elif isinstance(m, torch.nn.Linear) and QUANTIZED.fullmatch(f"{name}.weight"):
            fused = re.sub(r"\.[qkv]_proj$", ".qkv_proj", re.sub(r"\.(gate|up)_proj$", ".gate_up_proj", name))
            if fused not in held:  # a layer the FP8 GEMM does not take (a size not a multiple of 16) stays float
                continue
            wq, ws = fp8.quantize_rows(m.weight)
            m.forward = lambda x, wq=wq, ws=ws, b=m.bias: fp8_reference.fp8_linear(x.flatten(0, -2), wq, ws, b).view(
                *x.shape[:-1], -1
            )
    assert ours.model.layers[0].mlp.gate.weight.dtype == torch.float32
    logits = paged_runner(ours, block_size=4).step([("s", PROMPT)])[0]
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]
        plain = model(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
    assert (logits - plain).abs().max() > 1e-3  # FP8 is not float: the check can fail


# ---- served ----------------------------------------------------------------------------------------

ADAPTERS = ("experts8", "attn4")  # conftest.MOE_ADAPTERS: experts only, attention only


@pytest.fixture(scope="module")
def served_base(byte_model, save_byte_tokenizer, moe_adapter, tmp_path_factory):
    """(FP8 Qwen2-MoE dir (per-channel experts, shared expert, a dense layer) with the byte tokenizer,
    adapters dir, {adapter: transformers + PEFT on the dequantized weights})."""
    model, src = byte_model("qwen2_moe", **TINY_MOE["qwen2_moe"])
    dst = tmp_path_factory.mktemp("fp8-qwen2-moe")
    ref_dir = write_fp8(src, dst, "ct-channel")
    save_byte_tokenizer(dst)
    base = _hf_classes("qwen2_moe")[1].from_pretrained(ref_dir, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("fp8-moe-adapters")
    refs = {"": base}
    for name in ADAPTERS:
        d = moe_adapter("qwen2_moe", model, root / name, name)
        config = d / "adapter_config.json"  # made on the float model, served on the FP8 one
        config.write_text(json.dumps({**json.loads(config.read_text()), "base_model_name_or_path": None}))
        refs[name] = peft.PeftModel.from_pretrained(copy.deepcopy(base), d).eval()
    return dst, root, refs


def test_fp8_moe_checkpoint_served_on_the_cpu_is_dequantized_and_matches_each_rows_adapter(
    module_loop_thread, served_base, tmp_path
):
    path, root, refs = served_base
    c = Cluster(module_loop_thread, path, root, tmp_path / "store", ADAPTERS, cpu_threads=1)
    try:
        client = c.client()
        for i, name in enumerate(["experts8", "", "attn4"]):
            check_against_reference(refs[name], prompt_ids(i), generate(client, name, prompt_ids(i)))
        assert client.info().weight_dtype == "float32"
    finally:
        c.close()


@pytest.mark.gpu
def test_fp8_experts_on_cuda_serve_each_rows_adapter_within_fp8_tolerance(loop_thread, served_base, tmp_path):
    """bf16 activations; dense layers on FP8 weights and activations, experts in the fused MoE kernel on
    FP8 weights (weight-only), expert and attention LoRA in bf16; decode through the CUDA graphs."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU with FP8 (compute capability 8.9+)")
    path, root, refs = served_base
    c = Cluster(loop_thread, path, root, tmp_path / "store", ADAPTERS, device="cuda", dtype="bfloat16")
    try:
        client = c.client()
        assert client.info().weight_dtype == "float8_e4m3fn"
        experts = _experts(c.parts.engine.model)
        assert experts and all(m.weight.dtype == E4M3 for m in experts.values())
        check_bf16_rows(refs, *run_group(client, ["experts8", "attn4", ""], max_tokens=12), tol=FP8_LOGPROB_TOL)
    finally:
        c.close()
