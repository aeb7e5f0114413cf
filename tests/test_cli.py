"""The `loraserve` command as a user runs it: a store process, adapters registered from disk and
S3 with the CLI, tp=2 shards fetched; and `loraserve up` on the embedded default."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest
from safetensors import safe_open

LORASERVE = str(Path(sys.executable).parent / "loraserve")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args, check=True, env=None) -> subprocess.CompletedProcess:
    proc = subprocess.run([LORASERVE, "--log-level", "WARNING", *args], capture_output=True, text=True, timeout=300, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"loraserve {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture
def store_process(tmp_path, tiny_llama_dir, s3_server):
    root = tmp_path / "adapters"
    root.mkdir()
    port = free_port()
    proc = subprocess.Popen(
        [LORASERVE, "store", "--listen", f"127.0.0.1:{port}", "--data-dir", str(tmp_path / "data"),
         "--base-model", "tiny", "--base-model-path", str(tiny_llama_dir), "--allow-local-root", str(root),
         "--s3-endpoint-url", s3_server, "--s3-region", "us-east-1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    address = f"127.0.0.1:{port}"
    for _ in range(200):
        if cli("adapters", "--store", address, "list", check=False).returncode == 0:
            break
        time.sleep(0.1)
    yield address, root
    proc.terminate()
    proc.wait(10)


def test_register_from_disk_and_s3_then_fetch_tp2_shards(store_process, peft_adapter, s3_server, tiny_llama_dir, tmp_path):
    address, root = store_process
    src = peft_adapter(r=8, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"))
    shutil.copytree(src, root / "mine")
    out = cli("adapters", "--store", address, "register", "from-disk", str(root / "mine")).stdout
    assert '"digest"' in out and '"rank": 8' in out

    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    s3.create_bucket(Bucket="cli-bucket")
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        s3.upload_file(str(src / f), "cli-bucket", f"loras/mine/{f}")
    cli("adapters", "--store", address, "register", "from-s3", "s3://cli-bucket/loras/mine")
    listing = cli("adapters", "--store", address, "list").stdout
    assert "from-disk" in listing and "from-s3" in listing

    out = cli("adapters", "--store", address, "fetch", "from-s3", "--model", str(tiny_llama_dir), "--tp-size", "2",
              "--dtype", "float32", "--out", str(tmp_path / "shards")).stdout
    assert out.count("checksum ok") == 2
    shapes = []
    for rank in range(2):
        with safe_open(tmp_path / "shards" / f"from-s3.tp{rank}-of-2.safetensors", "pt") as f:
            assert f.metadata()["tp_rank"] == str(rank)
            shapes.append(f.get_tensor("model.layers.0.mlp.gate_up_proj.lora_b").shape)
    assert shapes == [(2 * 64, 8), (2 * 64, 8)]  # gate and up (128 each) cut in half on each rank

    cli("adapters", "--store", address, "delete", "from-disk")
    bad = cli("adapters", "--store", address, "register", "x", "ftp://nowhere/adapter", check=False)
    assert bad.returncode == 1 and "error: INVALID_ARGUMENT: unsupported adapter URI scheme 'ftp'" in bad.stderr
    missing = cli("adapters", "--store", address, "show", "from-disk", check=False)
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr


def test_up_prints_one_mixed_batch_on_the_embedded_default(tmp_path):
    demo = Path(__file__).resolve().parent.parent / "deploy" / "demo-adapters"
    names = sorted(p.name for p in demo.iterdir() if (p / "adapter_config.json").is_file()) if demo.is_dir() else []
    if not names:
        pytest.skip("deploy/demo-adapters holds no adapters yet")
    http_port = free_port()
    out = cli("up", "--demo-only", "--data-dir", str(tmp_path / "data"), "--cache-dir", str(tmp_path / "cache"),
              "--listen", f"127.0.0.1:{free_port()}",
              "--executor-listen", f"127.0.0.1:{free_port()}", "--http-port", str(http_port), "--max-num-seqs", "32").stdout
    assert f"over {len(names) + 1} adapters" in out
    for name in names:
        assert f"registered demo adapter {name}" in out and f"[{name}" in out
    assert "[base model" in out and "loraserve is up" in out
    assert f"curl -s http://127.0.0.1:{http_port}/v1/chat/completions" in out and f'"model": "{names[0]}"' in out
