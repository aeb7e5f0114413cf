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
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from loraserve.executor import cublas
cublas.without_workspace("cuda")  # leaves a value already set (the control's) as it is
with profile(activities=[ProfilerActivity.CUDA]):  # the tracer up before the capture: it then sees the graph's work
    torch.zeros(1, device="cuda").add_(1)
# Llama-3-8B's gate/up at 2,048 tokens: with a workspace, cuBLAS puts a memset before it (H100)
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
device = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]  # not the runtime calls
memsets = sum(e.count for e in device if "memset" in e.key.lower())
print("memsets", memsets, "kernels", sum(e.count for e in device if "memset" not in e.key.lower() and "memcpy" not in e.key.lower()))
"""


def _memsets(workspace: str | None) -> tuple[int, int]:
    """(memsets, kernels) the device ran in one replay, in a fresh process (torch reads the setting
    at its first GEMM) with CUBLAS_WORKSPACE_CONFIG as given (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != cublas.VARIABLE}
    if workspace is not None:
        env[cublas.VARIABLE] = workspace
    out = subprocess.run([sys.executable, "-P", "-c", _MEMSETS], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next((line.split() for line in out.stdout.splitlines() if line.startswith("memsets ")), None)
    assert line is not None and len(line) == 4, f"no count in the snippet's output: {out.stdout[-2000:]!r}"
    return int(line[1]), int(line[3])


@pytest.mark.gpu
def test_a_captured_prefill_gemm_runs_no_memset():
    """Without the setting (a workspace cuBLAS may use) the GEMM's replay runs a memset; with it, none."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    with_workspace, kernels = _memsets(":4096:8")
    assert kernels > 0, "the profiler saw no kernel of the replay: nothing to count memsets in"
    if with_workspace == 0:
        pytest.skip(f"{torch.cuda.get_device_name()}'s cuBLAS puts no memset before this GEMM even with a workspace")
    memsets, kernels = _memsets(None)
    assert kernels > 0, "the profiler saw no kernel of the replay: nothing to count memsets in"
    assert memsets == 0, f"{memsets} memsets with the executor's setting ({with_workspace} with a workspace)"
