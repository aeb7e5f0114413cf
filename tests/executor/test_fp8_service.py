"""An FP8 (compressed-tensors, per-channel) Llama checkpoint served by a real store and executor on
loopback: at tp 2 over gloo on the CPU (dequantized) every row's greedy tokens and logprobs are its own
adapter's transformers + PEFT ones on the dequantized weights, and GetServerInfo and /metrics name the
weight and KV dtypes; on a CUDA GPU with FP8 (compute capability 8.9+) the linear layers run in FP8
and every row of a mixed batch lies within the stated tolerance of its adapter's float32 reference."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from .conftest import (
    Cluster,
    check_against_reference,
    check_bf16_rows,
    generate,
    prompt_ids,
    run_group,
)
from .test_fp8 import write_fp8

peft = pytest.importorskip("peft")

ADAPTERS = {  # name: (r, alpha, targets)
    "qv8": (8, 16, ("q_proj", "v_proj")),
    "all4": (4, 8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
}
# FP8 activations (per-token scales, 3 mantissa bits) on top of bf16: each row's logprobs within this
# of its adapter's float32 reference on the same dequantized weights. The FP8 activations alone (the
# reference math in float32 on the CPU) move this model's greedy logprobs on prompt_ids(0..2) by up to
# 0.12; bf16 alone is held to 0.1.
FP8_LOGPROB_TOL = 0.3


@pytest.fixture(scope="module")
def fp8_base(byte_model, save_byte_tokenizer, tmp_path_factory):
    """(FP8 checkpoint dir with the byte tokenizer, the transformers model on its dequantized weights)."""
    from transformers import LlamaForCausalLM

    _, src = byte_model("llama", intermediate_size=128)
    dst = tmp_path_factory.mktemp("fp8-llama")
    ref_dir = write_fp8(src, dst, "ct-channel")
    save_byte_tokenizer(dst)
    return dst, LlamaForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapter_dirs(fp8_base, tmp_path_factory):
    _, model = fp8_base
    root = tmp_path_factory.mktemp("fp8-adapters")
    for seed, (name, (r, alpha, targets)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        m = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets)))
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.2)
        m.save_pretrained(root / name)
        config = root / name / "adapter_config.json"  # made on the served model, not the reference dir's path
        config.write_text(json.dumps({**json.loads(config.read_text()), "base_model_name_or_path": None}))
    return root


@pytest.fixture(scope="module")
def references(fp8_base, adapter_dirs):
    _, model = fp8_base
    refs = {"": model}
    for name in ADAPTERS:
        refs[name] = peft.PeftModel.from_pretrained(copy.deepcopy(model), adapter_dirs / name).eval()
    return refs


def test_fp8_checkpoint_at_tp2_serves_each_rows_adapter_and_reports_its_dtypes(
    module_loop_thread, fp8_base, adapter_dirs, references, tmp_path
):
    c = Cluster(
        module_loop_thread, fp8_base[0], adapter_dirs, tmp_path / "store", ADAPTERS, tp_size=2, cpu_threads=1, tp_timeout_s=60.0
    )
    try:
        client = c.client()
        for i, name in enumerate(["qv8", "", "all4"]):
            check_against_reference(references[name], prompt_ids(i), generate(client, name, prompt_ids(i)))
        info = client.info()
        assert (info.tp_size, info.weight_dtype, info.kv_cache_dtype, info.lora_dtype) == (2, "float32", "float32", "float32")
        labels = {"weight_dtype": "float32", "kv_cache_dtype": "float32", "lora_dtype": "float32"}
        assert c.parts.metrics.registry.get_sample_value("loraserve_executor_dtype_info", labels) == 1
    finally:
        c.close()
    assert [p.exitcode for p in c.parts.ranks._procs] == [0]


@pytest.mark.gpu
def test_fp8_linear_layers_on_cuda_serve_each_rows_adapter_within_fp8_tolerance(
    loop_thread, fp8_base, adapter_dirs, references, tmp_path
):
    """bf16 activations, FP8 weights and per-token FP8 activations in every linear layer but lm_head,
    LoRA in bf16 on the layer's input; decode through the CUDA graphs."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU with FP8 (compute capability 8.9+)")
    c = Cluster(loop_thread, fp8_base[0], adapter_dirs, tmp_path / "store", ADAPTERS, device="cuda", dtype="bfloat16")
    try:
        client = c.client()
        info = client.info()
        assert (info.weight_dtype, info.kv_cache_dtype) == ("float8_e4m3fn", "bfloat16")
        check_bf16_rows(references, *run_group(client, ["qv8", "all4", ""], max_tokens=12), tol=FP8_LOGPROB_TOL)
    finally:
        c.close()
