"""max_model_len follows the model: by default its max_position_embeddings (extended by RoPE scaling),
held to the KV cache; a larger one given at start is refused, naming both numbers."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loraserve.client import ExecutorClient
from loraserve.errors import StatusError
from loraserve.executor.build import resolve_max_model_len
from loraserve.executor.config import ExecutorConfig
from loraserve.executor.model.config import ModelConfig
from loraserve.executor.service import build_executor, serve, shutdown
from loraserve.v1 import executor_pb2 as epb

from .conftest import BYTE_BOS, BYTE_VOCAB

LORASERVE = str(Path(sys.executable).parent / "loraserve")


@pytest.fixture(scope="module")
def model_512(hf_model):
    """A tiny Llama trained (by its config) for 512 positions, without an EOS (every request runs to its length)."""
    _, path = hf_model("llama", vocab_size=BYTE_VOCAB, bos_token_id=BYTE_BOS, eos_token_id=None, max_position_embeddings=512)
    return path


def scaled_copy(model: Path, dest: Path, rope: dict, **config) -> Path:
    """`model`'s folder with its config.json given `rope` as rope_parameters (and `config`'s fields)."""
    shutil.copytree(model, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = {"rope_theta": cfg.get("rope_theta", 10000.0), **rope}
    cfg.update(config)
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def executor_config(model: Path, **overrides) -> ExecutorConfig:
    fields = dict(
        model=str(model),
        base_model="tiny",
        dtype="float32",
        max_loras=1,
        max_rank=8,
        num_blocks=1024,  # 4,096 tokens: the KV cache holds far more than the model's positions
        block_size=4,
        store_address="127.0.0.1:1",  # base-model requests only
        adapter_refresh_s=0,
    )
    return ExecutorConfig(**{**fields, **overrides})


class Executor:
    def __init__(self, lt, cfg: ExecutorConfig):
        self.lt, self.parts = lt, build_executor(cfg)
        self.server, port = lt.run(serve(self.parts, "127.0.0.1:0"))
        self.client = ExecutorClient(f"127.0.0.1:{port}", timeout_s=120)

    def generate(self, ids: list[int], max_tokens: int) -> epb.GenerateResponse:
        req = epb.GenerateRequest(token_ids=epb.TokenIds(ids=ids), sampling=epb.SamplingParams(max_tokens=max_tokens))
        return self.client._call(self.client.stub.Generate, req)

    def refusal(self, ids: list[int], max_tokens: int) -> StatusError:
        with pytest.raises(StatusError) as e:
            self.generate(ids, max_tokens)
        return e.value

    def close(self):
        self.lt.run(shutdown(self.server, self.parts))


def prompt(n: int) -> list[int]:
    return [BYTE_BOS] + [i % 250 for i in range(n - 1)]


def test_max_model_len_defaults_to_the_models_positions_and_longer_requests_are_refused(loop_thread, model_512):
    ex = Executor(loop_thread, executor_config(model_512))
    try:
        assert ex.parts.config.max_model_len == 512
        err = ex.refusal(prompt(512), 1)
        assert err.code.name == "INVALID_ARGUMENT"
        assert (
            err.message
            == "prompt of 512 tokens exceeds max_model_len 512 (prompt + output must fit, so at most 511 prompt tokens)"
        )
        err = ex.refusal(prompt(8), 513)
        assert err.code.name == "INVALID_ARGUMENT"
        assert err.message == "max_tokens must be in [1, max_model_len 512], got 513"
        # a generation stops at the model's last position
        out = ex.generate(prompt(500), 100)
        assert (len(out.token_ids), out.finish_reason) == (12, epb.LENGTH)
    finally:
        ex.close()


def test_the_default_is_held_to_the_kv_cache(loop_thread, model_512):
    ex = Executor(loop_thread, executor_config(model_512, num_blocks=64))  # 256 tokens of KV
    try:
        assert ex.parts.config.max_model_len == 256
        err = ex.refusal(prompt(256), 1)
        assert err.code.name == "INVALID_ARGUMENT" and err.message.startswith("prompt of 256 tokens exceeds max_model_len 256 ")
    finally:
        ex.close()


def test_a_larger_max_model_len_is_refused_at_start_naming_both(model_512, free_port):
    proc = subprocess.run(
        [LORASERVE, "--log-level", "WARNING", "executor", "--model", str(model_512), "--device", "cpu"]
        + ["--max-model-len", "1024", "--num-blocks", "1024", "--block-size", "4", "--http-port", "0"]
        + ["--executor-listen", f"127.0.0.1:{free_port()}", "--executor-metrics-port", "0", "--store", "127.0.0.1:1"]
        + ["--cache-dir", ""],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert (
        f"error: {model_512}: max_model_len 1024 (--max-model-len) is above the 512 positions the model covers "
        "(max_position_embeddings 512); give 512 or less, or 0 for the model's"
    ) in proc.stderr, proc.stderr
    assert "executor serving gRPC" not in proc.stdout


def test_rope_scaling_that_covers_it_lets_a_larger_max_model_len_serve(loop_thread, model_512, tmp_path):
    linear = scaled_copy(model_512, tmp_path / "linear", {"rope_type": "linear", "factor": 4.0})
    with pytest.raises(ValueError) as e:
        build_executor(executor_config(linear, max_model_len=2049))
    assert str(e.value) == (
        f"{linear}: max_model_len 2049 (--max-model-len) is above the 2048 positions the model covers "
        "(max_position_embeddings 512, rope_scaling linear factor 4); give 2048 or less, or 0 for the model's"
    )
    ex = Executor(loop_thread, executor_config(linear, max_model_len=2048))
    try:
        out = ex.generate(prompt(600), 2)  # past max_position_embeddings, within the scaled positions
        assert (len(out.token_ids), out.finish_reason) == (2, epb.LENGTH)
        assert ex.refusal(prompt(8), 2049).message == "max_tokens must be in [1, max_model_len 2048], got 2049"
    finally:
        ex.close()


HF = dict(vocab_size=BYTE_VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4)


@pytest.mark.parametrize(
    "max_pos, rope, covered",
    [
        (512, None, 512),
        (512, {"rope_type": "linear", "factor": 4.0}, 2048),
        (512, {"type": "dynamic", "factor": 2.0}, 1024),  # v4's rope_scaling key
        # llama3 states the scaled length (Llama 3.2's numbers): original x factor would be 262,144
        (
            131072,
            {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            131072,
        ),
    ],
)
def test_positions_the_model_covers_follow_its_rope_scaling(max_pos, rope, covered):
    mc = ModelConfig.from_hf_config({**HF, "max_position_embeddings": max_pos, "rope_scaling": rope})
    assert mc.max_context_len == covered
    cfg = ExecutorConfig(model="m", num_blocks=1 << 16, block_size=4)
    resolve_max_model_len(cfg, mc)
    assert cfg.max_model_len == covered
    resolve_max_model_len(cfg, mc)  # a resolved config passes again
    assert cfg.max_model_len == covered
    with pytest.raises(ValueError, match=f"max_model_len {covered + 1} .* above the {covered} positions"):
        resolve_max_model_len(ExecutorConfig(model="m", num_blocks=1 << 16, block_size=4, max_model_len=covered + 1), mc)


def test_a_yarn_config_stating_the_product_covers_it():
    """yarn is not served, but its rule is stated: original x factor, or max_position_embeddings if larger."""
    mc = ModelConfig.from_hf_config({**HF, "max_position_embeddings": 32768})
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert dataclasses.replace(mc, rope_scaling=yarn).max_context_len == 131072
    assert dataclasses.replace(mc, max_position_embeddings=163840, rope_scaling={**yarn, "factor": 40.0,
                               "original_max_position_embeddings": 4096}).max_context_len == 163840  # fmt: skip


def test_a_negative_max_model_len_is_refused():
    with pytest.raises(ValueError, match=r"max_model_len must be 0 \(the model's\) or more, got -1"):
        ExecutorConfig(max_model_len=-1)
