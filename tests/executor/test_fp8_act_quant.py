"""An FP8 layer's input quantized by the kernel that writes it: the norms before q/k/v and before the
feed-forward block, and the act-and-mul before down, also write their output's per-token FP8
quantization where the layers reading it run the FP8 GEMM on CUDA (LinearWithLoRA.takes_fp8_input),
and those layers take it instead of quantizing again.

On the CPU (FP8 computed by the reference math from the bf16 input) nothing is quantized ahead:
every layer's flag is off, no norm or act-and-mul is asked to quantize, and the reference path's
`quantize` and `x_fp8` are quantize_per_token's. On a CUDA GPU with FP8 (compute capability 8.9+):
the flags are on exactly where the layer holds FP8 weights, and a step of a Llama, a Qwen2-MoE (its
shared expert's gate/up FP8, its down too narrow for the FP8 GEMM) and a Gemma 2 model gives the
logits the same model gives quantizing in each layer instead, bit for bit; on the CPU the same with
those flags forced on, the reference math then quantizing ahead (the plumbing's check without a GPU).
"""

from __future__ import annotations

import pytest
import torch

from loraserve import kernels
from loraserve.executor.lora import LinearWithLoRA
from loraserve.executor.model import fp8
from loraserve.executor.model.loader import load_model
from loraserve.kernels import fp8_reference

from .conftest import TINY_MOE
from .test_gemma import _hf as gemma_hf

PROMPT = [5, 17, 99, 3, 42, 7, 200, 31, 64]
FAMILIES = ["llama", "qwen2_moe", "gemma2"]


def _quantize_calls(monkeypatch) -> list:
    """Each kernels.rms_norm / silu_and_mul / gelu_and_mul call's `quantize`, and "x_fp8 taken" for each
    kernels.fp8_linear given its input quantized (checked to be quantize_per_token's), from here on
    (patched before a model is built: the MLP binds its act-and-mul then)."""
    calls: list = []
    for name in ("rms_norm", "silu_and_mul", "gelu_and_mul"):
        op = getattr(kernels, name)

        def recorded(*args, _op=op, quantize=False, **kwargs):
            calls.append(quantize)
            return _op(*args, quantize=quantize, **kwargs) if quantize else _op(*args, **kwargs)

        monkeypatch.setattr(kernels, name, recorded)
    fp8_linear = kernels.fp8_linear

    def checked(x, weight, weight_scale, bias=None, x_fp8=None):
        """A pre-quantized input is quantize_per_token of the layer's input x: scales exactly, values
        within one FP8 step (a division rounding the other way; none on the CPU's reference math)."""
        if x_fp8 is not None:
            q, s = fp8_reference.quantize_per_token(x)
            assert x_fp8[0].shape == q.shape and torch.equal(x_fp8[1], s)
            diff = (x_fp8[0].float() - q.float()).abs()
            assert (diff <= q.float().abs() * 2**-3 + 2**-9).all()
            assert x.is_cuda or (diff == 0).all()
            calls.append("x_fp8 taken")
        return fp8_linear(x, weight, weight_scale, bias, x_fp8)

    monkeypatch.setattr(kernels, "fp8_linear", checked)
    return calls


def test_on_the_cpu_an_fp8_model_quantizes_no_input_ahead(hf_model, paged_runner, monkeypatch):
    """--quantization fp8 with the FP8 hardware check passed (the CPU then runs the reference math)."""
    monkeypatch.setattr(fp8, "fp8_compute_error", lambda device, dtype: None)
    calls = _quantize_calls(monkeypatch)
    _, path = hf_model("llama")
    ours = load_model(path, quantization="fp8")
    assert ours.cfg.fp8_linears and ours.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert not any(m.takes_fp8_input(t) for m in ours.modules() if isinstance(m, LinearWithLoRA) for t in (1, 64, 300))
    assert not any(layer.self_attn.takes_fp8_input(1) or layer.mlp.takes_fp8_input(1) for layer in ours.model.layers)
    paged_runner(ours).step([("a", PROMPT)])
    assert calls and not any(calls)


def test_the_reference_paths_quantize_and_x_fp8_are_quantize_per_token():
    torch.manual_seed(0)
    x, res, w = torch.randn(3, 64), torch.randn(3, 64), 1 + 0.1 * torch.randn(64)
    out, h, (q, s) = kernels.rms_norm(x, w, 1e-5, res, unit_offset=True, quantize=True)
    want_out, want_h = kernels.rms_norm(x, w, 1e-5, res, unit_offset=True)
    rq, rs = fp8_reference.quantize_per_token(want_out)
    assert torch.equal(out, want_out) and torch.equal(h, want_h)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    gate_up = torch.randn(3, 96)
    for act in (kernels.silu_and_mul, kernels.gelu_and_mul):
        out, (q, s) = act(gate_up, quantize=True)
        rq, rs = fp8_reference.quantize_per_token(act(gate_up))
        assert torch.equal(out, act(gate_up)) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    wq, ws = fp8.quantize_rows(torch.randn(32, 48))
    given = (rq[:, :48].contiguous(), rs)  # any (q, scale): used as given
    torch.testing.assert_close(
        kernels.fp8_linear(out[:, :48], wq, ws, x_fp8=given), fp8_reference.scaled_mm(*given, wq, ws, out.dtype)
    )


def _model_dir(family: str, hf_model, tmp_path) -> object:
    if family == "gemma2":
        path = tmp_path / family
        gemma_hf(family).save_pretrained(path)
        return path
    return hf_model(family, **TINY_MOE.get(family, {}))[1]


def _fused_and_unfused(ours, paged_runner, calls, monkeypatch):
    """The logits of a prefill and a decode step (eager) as built, then with every layer's
    takes_fp8_input off (each FP8 layer quantizing its input itself); checks that the first run
    quantized ahead and the second did not."""

    def run():
        runner = paged_runner(ours)
        prefill = runner.step([("a", PROMPT), ("b", PROMPT[:5])])
        decode = runner.step([("a", [11]), ("b", [12])])
        return [*prefill, *decode]

    calls.clear()
    fused = run()
    assert True in calls and "x_fp8 taken" in calls
    monkeypatch.setattr(LinearWithLoRA, "takes_fp8_input", lambda self, tokens: False)
    calls.clear()
    unfused = run()
    assert calls and not any(calls)  # neither quantize nor "x_fp8 taken"
    return fused, unfused


def _check_flags(ours, family):
    linears = [m for m in ours.modules() if isinstance(m, LinearWithLoRA)]
    assert all(m.takes_fp8_input(1) == (m.weight.dtype == torch.float8_e4m3fn) for m in linears)
    assert any(m.takes_fp8_input(1) for m in linears) and not ours.lm_head.takes_fp8_input(1)
    layer = ours.model.layers[0]
    assert layer.self_attn.takes_fp8_input(1) and layer.mlp.takes_fp8_input(1)
    if family == "qwen2_moe":  # the shared expert's down (56 inputs) is not FP8: its act-and-mul quantizes nothing
        assert not layer.mlp.shared_expert.down_proj.takes_fp8_input(1)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_plumbing_on_the_cpus_reference_math_gives_the_unfused_logits(family, hf_model, paged_runner, monkeypatch, tmp_path):
    """The CUDA flags forced on the CPU (an FP8 layer takes its input quantized ahead): the norms' and
    act-and-muls' reference quantization reaches each FP8 layer, which computes what it computes
    quantizing its float32 input itself."""
    monkeypatch.setattr(fp8, "fp8_compute_error", lambda device, dtype: None)
    monkeypatch.setattr(LinearWithLoRA, "takes_fp8_input", lambda self, tokens: self.weight_scale is not None)
    calls = _quantize_calls(monkeypatch)
    ours = load_model(_model_dir(family, hf_model, tmp_path), quantization="fp8")
    _check_flags(ours, family)
    for got, want in zip(*_fused_and_unfused(ours, paged_runner, calls, monkeypatch)):
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_on_cuda_the_fused_quantization_gives_the_logits_of_quantizing_in_each_layer(
    family, hf_model, paged_runner, monkeypatch, tmp_path
):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU with FP8 (compute capability 8.9+)")
    calls = _quantize_calls(monkeypatch)
    ours = load_model(_model_dir(family, hf_model, tmp_path), dtype=torch.bfloat16, device="cuda", quantization="fp8")
    _check_flags(ours, family)
    for got, want in zip(*_fused_and_unfused(ours, paged_runner, calls, monkeypatch)):
        assert torch.equal(got, want)
