"""cuBLAS without a workspace on CUDA (executor/cublas.py): the setting itself on every host, and
on a CUDA host that a captured prefill-size GEMM then runs no memset."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from loraserve.executor import cublas


@pytest.fixture
def unset(monkeypatch):
    """CUBLAS_WORKSPACE_CONFIG absent for the test, and as it was afterwards."""
    monkeypatch.setenv(cublas.VARIABLE, "recorded")  # so the undo restores the original state
    monkeypatch.delenv(cublas.VARIABLE)


def test_cuda_devices_get_no_workspace(unset):
    assert cublas.without_workspace("cuda:1") is True
    assert os.environ[cublas.VARIABLE] == ":0:0"
    assert cublas.without_workspace("cuda") is False  # set already: left as it is
    assert os.environ[cublas.VARIABLE] == ":0:0"


def test_the_cpu_leaves_the_environment_alone(unset):
    assert cublas.without_workspace("cpu") is False
    assert cublas.VARIABLE not in os.environ


def test_a_value_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv(cublas.VARIABLE, ":4096:8")
    assert cublas.without_workspace("cuda") is False
    assert os.environ[cublas.VARIABLE] == ":4096:8"


_MEMSETS = """
import torch
from torch.profiler import ProfilerActivity, profile
from loraserve.executor import cublas
cublas.without_workspace("cuda")
# Llama-3-8B's gate/up at 2,048 tokens: with torch's default workspace, a memset before it (H100)
x = torch.randn(2048, 4096, dtype=torch.bfloat16, device="cuda")
w = torch.randn(28672, 4096, dtype=torch.bfloat16, device="cuda")
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    torch.nn.functional.linear(x, w)
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    torch.nn.functional.linear(x, w)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    graph.replay()
    torch.cuda.synchronize()
print("memsets", sum(e.count for e in prof.key_averages() if "memset" in e.key.lower()))
"""


@pytest.mark.gpu
def test_a_captured_prefill_gemm_runs_no_memset():
    """In a fresh process (torch reads the setting at its first GEMM)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    env = {k: v for k, v in os.environ.items() if k != cublas.VARIABLE}
    out = subprocess.run([sys.executable, "-P", "-c", _MEMSETS], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "memsets 0" in out.stdout, out.stdout
