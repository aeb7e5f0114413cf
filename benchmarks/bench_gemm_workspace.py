"""The base model's GEMMs with and without cuBLAS's workspace (CUDA host).

In a CUDA graph, cuBLAS puts a 4-byte memset before some of its GEMMs (the ones whose kernel
needs a zeroed counter in the workspace). In the serve benchmark such a memset was seen to wait
for slot loads' host -> device copies queued on another stream, stalling a prefill-size step by
up to the queued copies' time (docs/BENCHMARKS.md). Without a workspace cuBLAS picks kernels that
need none, and no memset. This prints, for Llama-3-8B's linear layers (bf16, x @ W.T as the
executor's base linears, F.linear) at decode and prefill token counts, the GEMM's device time inside a
CUDA graph and the memsets one replay runs, under the cuBLAS workspace settings of this process:
run it once per setting, e.g. as is and with the executor's (executor/cublas.py)

    CUBLAS_WORKSPACE_CONFIG=:0:0 python benchmarks/bench_gemm_workspace.py

(torch reads CUBLAS_WORKSPACE_CONFIG and CUBLASLT_WORKSPACE_SIZE once, at its first GEMM; the
second alone leaves the memsets). One process per setting: compare settings over alternating
runs, as two runs of one setting differ by a few percent per GEMM.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.nn.functional as F
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

SHAPES = {"q/k/v": (6144, 4096), "o": (4096, 4096), "gate/up": (28672, 4096), "down": (4096, 14336)}


def graph_of(fn, reps: int) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # cuBLAS's handle and workspace set up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return graph


def memsets(graph: torch.cuda.CUDAGraph) -> int:
    """Memsets one replay runs (the profiler's device events)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type == DeviceType.CUDA and "memset" in e.key.lower())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="16,55,64,256,1024,1354,2048")
    ap.add_argument("--reps", type=int, default=20, help="GEMMs per graph")
    ap.add_argument("--repeat", type=int, default=10, help="timed replays (median)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemm_workspace.py runs on a CUDA host")
    settings = ", ".join(f"{k}={os.environ.get(k, '(unset)')}" for k in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE"))
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
        for t in (int(v) for v in args.tokens.split(",")):
            x = torch.randn(t, k, dtype=torch.bfloat16, device="cuda")
            graph = graph_of(lambda: F.linear(x, w), args.reps)
            count = memsets(graph)
            times = []
            for _ in range(args.repeat + 2):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3 / args.reps)
            us = statistics.median(times[2:])
            rows.append((name, n, k, t, us, 2 * t * n * k / us / 1e6, count / args.reps))
    print(f"\nbase GEMMs in a CUDA graph - {torch.cuda.get_device_name()}, torch {torch.__version__}; {settings}")
    print("| layer | N x K | tokens | us per GEMM | TFLOP/s | memsets per GEMM |\n|---|---|---|---|---|---|")
    for name, n, k, t, us, tflops, count in rows:
        print(f"| {name} | {n} x {k} | {t} | {us:.1f} | {tflops:.0f} | {count:g} |")


if __name__ == "__main__":
    main()
