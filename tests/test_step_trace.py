"""benchmarks/step_trace.py's summary of a profiler trace: steps matched to their kernels through
the runtime calls their thread made inside the step's label, device busy time as a union."""

import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import step_trace


def _x(name, cat, ts, dur, tid=1, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "args": args}


def test_summary_matches_kernels_to_their_step(tmp_path):
    events = [
        # a mixed step on thread 7: two launches; a 100 us gap between its kernels (busy 500 us of a 600 us span)
        _x("step mixed", "user_annotation", 1000, 500, tid=7),
        _x("cudaLaunchKernel", "cuda_runtime", 1100, 5, tid=7, correlation=1),
        _x("cudaLaunchKernel", "cuda_runtime", 1200, 5, tid=7, correlation=2),
        _x("_shrink_kernel", "kernel", 1500, 200, tid=99, correlation=1),
        _x("nvjet_gemm_bf16", "kernel", 1800, 300, tid=99, correlation=2),
        # a graph step on thread 3: one replay, one kernel of 100 us
        _x("step decode-graph", "user_annotation", 3000, 50, tid=3),
        _x("cudaGraphLaunch", "cuda_runtime", 3010, 20, tid=3, correlation=3),
        _x("_decode_kernel", "kernel", 3100, 100, tid=99, correlation=3),
        # the profiler's copy of a label on the GPU timeline (not a step), a launch on thread 7 outside
        # any step, and another thread's launch inside the step's time
        _x("step mixed", "gpu_user_annotation", 1400, 700, tid=7),
        _x("cudaLaunchKernel", "cuda_runtime", 2000, 5, tid=7, correlation=4),
        _x("_expand_kernel", "kernel", 2100, 50, tid=99, correlation=4),
        _x("cudaLaunchKernel", "cuda_runtime", 1300, 5, tid=8, correlation=5),
        _x("other_kernel", "kernel", 1300, 1000, tid=99, correlation=5),
        # work after the last step, inside the profiler's window only: not counted
        _x("cudaMemcpyAsync", "cuda_runtime", 4000, 5, tid=8, correlation=6),
        _x("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 4100, 500, tid=98, correlation=6),
    ]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    text = "\n".join(step_trace.summarize(path))
    assert "| mixed | 1 | 0.50 | 0.60 | 0.50 | 0.83 | 2 |" in text
    assert "| decode-graph | 1 | 0.05 | 0.10 | 0.10 | 1.00 | 1 |" in text
    assert "trace.json.gz: 2 labelled steps" in text
    assert "mixed steps: device time per step by group (ms): gemm 0.30, lora shrink 0.20" in text
    assert "| _shrink_kernel | 0.200 |" in text
    assert "| _decode_kernel | 0.100 |" in text  # a graph replay's kernels, under its step kind too
    # work launched outside the steps (thread 7 between steps, thread 8 during one), by group only
    assert "device work outside the steps: 2 kernels / copies, 1.05 ms over the 2 ms of labelled steps" in text
    assert "(other 1.00, lora expand 0.05)" in text
    assert "_expand_kernel" not in text and "other_kernel" not in text
    # the longest step (by device span) and what the device ran beside it, by whose it was: the other
    # thread's kernel overlaps all 0.60 ms of it; the expand starts as the step's last kernel ends
    assert (
        "longest step: mixed, device span 0.60 ms, its kernels busy 0.50 ms; beside it on the device: "
        "1 kernels / copies (no step's other 0.60 ms)"
    ) in text


def test_replay_breakdown_counts_overlap_once_in_busy_and_groups_kernels():
    # two replays of one graph: a GEMM beside a shrink on a side stream, then an expand after a 10 us gap
    events = []
    for r in range(2):
        t = 1000 * r
        events += [
            _x("nvjet_tst_gemm", "kernel", t, 100, tid=1),
            _x("_shrink_kernel", "kernel", t + 20, 50, tid=2),
            _x("_expand_kernel", "kernel", t + 110, 30, tid=1),
            _x("Memset (Device)", "gpu_memset", t + 140, 5, tid=1),
        ]
    events.append(_x("cudaGraphLaunch", "cuda_runtime", 0, 5))  # host side: not counted
    text = "\n".join(step_trace.breakdown_of(events, runs=2))
    # span per replay: (1145 - 0) / 2; busy: 100 + 30 + 5 per replay (the shrink hides under the GEMM)
    assert "span 572.5 us, kernels busy 135.0 us (24%), idle between kernels 437.5 us, 4 kernels" in text
    assert "| gemm | 100.0 |" in text and "| lora shrink | 50.0 |" in text
    assert "| lora expand | 30.0 |" in text and "| memset / copy | 5.0 |" in text
    assert step_trace.breakdown_of([], runs=1)[0].startswith("no device events")
