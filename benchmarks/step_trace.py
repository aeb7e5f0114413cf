"""Where a serving engine's steps spend their time: a torch.profiler window over a running engine,
and a summary of its trace by step kind (host launch window, device span and busy time, kernels).

Used by serve.py (`--profile DIR`): the engine's steps are labelled `step <kind>` while the window
is open, the trace goes to DIR/trace.json.gz, and `summarize` prints, per step kind, how long the
host took to queue a step's work, how long the device took from its first kernel to its last, how
much of that it was busy, each kind's kernels by time (a graph replay's kernels carry its launch's
correlation), and the device work no step launched (slot loads, clears).

    python benchmarks/step_trace.py DIR/trace.json.gz     # the summary again, from a saved trace
    python benchmarks/step_trace.py DIR/trace.json.gz --longest   # the longest step, event by event

`replay_breakdown` does the same for one captured graph replayed back to back (bench_engine.py
`--profile-decode`): per replay, the device span, the kernels' busy time (their union: the LoRA
shrink runs beside the base GEMM on a side stream), the idle gaps between kernels, and the kernels'
time by group and by name.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

LABEL = "step "  # record_function names: "step " + the step's kind (engine/step_stats.py, STEP_KINDS)
_RUNTIME = {"cuda_runtime", "cuda_driver"}
_DEVICE = {"kernel", "gpu_memset", "gpu_memcpy"}


@contextlib.contextmanager
def labelled_steps(engine):
    """Wraps the engine's step launch in a record_function named after the step's kind."""
    import torch

    launch = engine._launch_on_device

    def labelled(b, kind):
        with torch.profiler.record_function(LABEL + kind):
            return launch(b, kind)

    engine._launch_on_device = labelled
    try:
        yield
    finally:
        engine._launch_on_device = launch


async def profile_window(folder: Path, after: float, seconds: float) -> Path:
    """Profiles CPU and CUDA activity for `seconds`, `after` seconds from now; the trace's path."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    await asyncio.sleep(after)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    try:  # eager steps launch from worker threads: record every thread's ops, not only this one's
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # an older torch: the labels of steps launched from other threads are missing
        config = None
    prof = profile(activities=activities, experimental_config=config)
    prof.start()
    await asyncio.sleep(seconds)
    prof.stop()
    folder.mkdir(parents=True, exist_ok=True)
    raw = folder / "trace.json"
    prof.export_chrome_trace(str(raw))
    path = folder / "trace.json.gz"
    with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
        dst.write(src.read())
    raw.unlink()
    return path


_GROUPS = (  # (group, substrings of the kernel name), first match wins; names lower-cased
    ("lora shrink", ("_shrink",)),
    ("lora expand", ("_expand",)),
    ("lora other", ("_lora", "_slot", "_group_kernel")),  # LoraMeta's torch ops land in "other"
    ("attention", ("attention", "_prefill_kernel", "_decode_kernel", "_merge_splits", "_reduce_kernel")),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90_", "sm80_", "cublas", "gemv")),
    ("norm", ("rms_norm",)),
    ("rope + cache", ("_rope",)),
    ("silu-mul", ("_silu",)),
    ("memset / copy", ("memset", "memcpy", "fill", "copy")),
)


def kernel_group(name: str) -> str:
    n = name.lower()
    return next((g for g, keys in _GROUPS if any(k in n for k in keys)), "other")


def replay_breakdown(replay, runs: int = 20) -> list[str]:
    """Profiles `runs` back-to-back calls of `replay` (a CUDA graph's replay); lines of text (us per replay)."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return breakdown_of(json.loads(path.read_text())["traceEvents"], runs)


def breakdown_of(events: list[dict], runs: int, top: int = 12) -> list[str]:
    """The device events of `runs` replays (a trace's events): per replay span, busy, gaps, groups."""
    work = [e for e in events if e.get("ph") == "X" and e.get("cat") in _DEVICE]
    if not work:
        return ["no device events in the trace (is the profiler's CUDA activity available?)"]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in work]
    span = (max(b for _, b in spans) - min(a for a, _ in spans)) / runs
    busy = _union(spans) / runs
    groups, names = defaultdict(float), defaultdict(float)
    for e in work:
        groups[kernel_group(e["name"])] += e["dur"] / runs
        names[e["name"]] += e["dur"] / runs
    out = [
        f"per replay: span {span:.1f} us, kernels busy {busy:.1f} us ({busy / span:.0%}), idle between "
        f"kernels {span - busy:.1f} us, {len(work) / runs:.0f} kernels; kernel time (overlapping streams "
        "counted twice) by group:",
        "| group | us per replay |",
        "|---|---|",
    ]
    out += [f"| {g} | {t:.1f} |" for g, t in sorted(groups.items(), key=lambda x: -x[1])]
    out += ["| kernel | us per replay |", "|---|---|"]
    out += [f"| {n[:90]} | {t:.1f} |" for n, t in sorted(names.items(), key=lambda x: -x[1])[:top]]
    return out


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _read_trace(path: Path):
    """(the host's step labels, device work with a correlation, correlation -> its device work,
    thread -> its runtime calls as sorted (ts, correlation)) of a saved trace."""
    with gzip.open(path, "rt") if str(path).endswith(".gz") else open(path) as f:
        events = json.load(f)["traceEvents"]
    steps = [
        e
        for e in events  # the host's labels (the profiler repeats them on the GPU's timeline)
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(LABEL)
    ]
    runtime = [e for e in events if e.get("ph") == "X" and e.get("cat") in _RUNTIME and "correlation" in e.get("args", {})]
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in _DEVICE and "correlation" in e.get("args", {})]
    by_corr = defaultdict(list)
    for e in device:
        by_corr[e["args"]["correlation"]].append(e)
    by_thread = defaultdict(list)
    for e in runtime:
        by_thread[e["tid"]].append((e["ts"], e["args"]["correlation"]))
    for calls in by_thread.values():
        calls.sort()
    return steps, device, by_corr, by_thread


def _step_calls(step, by_thread) -> list[tuple[float, int]]:
    """The (ts, correlation) of the runtime calls the step's thread made inside its label."""
    calls = by_thread.get(step["tid"], [])
    return calls[
        bisect.bisect_left(calls, (step["ts"], -1)) : bisect.bisect_right(calls, (step["ts"] + step["dur"], float("inf")))
    ]


def summarize(path: Path, top: int = 15) -> list[str]:
    """The trace's steps by kind, each kind's kernels by group and by name, and the device work
    outside the steps: lines of text (times in ms)."""
    steps, device, by_corr, by_thread = _read_trace(path)
    rows = defaultdict(list)  # kind -> [(host ms, span ms, busy ms, launches)]
    kernels = defaultdict(lambda: defaultdict(float))  # kind -> kernel name -> total us
    groups = defaultdict(lambda: defaultdict(float))
    mine = set()  # correlations of the labelled steps' device work
    longest = None  # (device span us, kind, first, last, its correlations, runtime calls) of the longest step
    for s in steps:
        kind = s["name"][len(LABEL) :]
        calls = _step_calls(s, by_thread)
        work = [k for _, c in calls for k in by_corr.get(c, [])]  # a graph's kernels: its launch's
        mine.update(c for _, c in calls)
        spans = [(k["ts"], k["ts"] + k["dur"]) for k in work]
        span = max(b for _, b in spans) - min(a for a, _ in spans) if spans else 0.0
        rows[kind].append((s["dur"] / 1e3, span / 1e3, _union(spans) / 1e3, len(calls)))
        if spans and (longest is None or span > longest[0]):
            longest = (span, kind, min(a for a, _ in spans), max(b for _, b in spans), {c for _, c in calls}, _union(spans))
        for k in work:
            kernels[kind][k["name"]] += k["dur"]
            groups[kind][kernel_group(k["name"])] += k["dur"]
    out = [
        f"trace {path}: {len(steps)} labelled steps",
        "| step kind | steps | host launch ms | device span ms | device busy ms | busy / span | runtime calls |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind, rs in sorted(rows.items()):
        n = len(rs)
        host, span, busy, calls = (sum(r[i] for r in rs) / n for i in range(4))
        out.append(f"| {kind} | {n} | {host:.2f} | {span:.2f} | {busy:.2f} | {busy / max(span, 1e-9):.2f} | {calls:.0f} |")
    # device work no labelled step launched (slot loads' copies and scatters, slot clears), which
    # shares the GPU with the steps it overlaps: only what overlaps the labelled steps' window counts
    # (the profiler's window also holds work before the first step and after the last)
    lo_ts = min((s["ts"] for s in steps), default=0.0)
    hi_ts = max((s["ts"] + s["dur"] for s in steps), default=0.0)
    other = [e for e in device if e["args"]["correlation"] not in mine and e["ts"] < hi_ts and e["ts"] + e["dur"] > lo_ts]
    if other and steps:
        window = (hi_ts - lo_ts) / 1e3
        by_group = defaultdict(float)
        for e in other:
            by_group[kernel_group(e["name"])] += e["dur"] / 1e3
        out.append(
            f"device work outside the steps: {len(other)} kernels / copies, {sum(by_group.values()):.2f} ms "
            f"over the {window:.0f} ms of labelled steps ("
            + ", ".join(f"{g} {t:.2f}" for g, t in sorted(by_group.items(), key=lambda x: -x[1]))
            + ")"
        )
    if longest is not None:  # what else the device ran while the longest step ran: another step's
        # kernels (steps launched ahead), or work no step launched (slot loads and clears)
        span, kind, first, last, own, busy = longest
        beside = [e for e in device if e["args"]["correlation"] not in own and e["ts"] < last and e["ts"] + e["dur"] > first]
        by_group = defaultdict(float)
        for e in beside:
            by_group[("a step's " if e["args"]["correlation"] in mine else "no step's ") + kernel_group(e["name"])] += (
                min(last, e["ts"] + e["dur"]) - max(first, e["ts"])
            ) / 1e3
        out.append(
            f"longest step: {kind}, device span {span / 1e3:.2f} ms, its kernels busy {busy / 1e3:.2f} ms; "
            f"beside it on the device: {len(beside)} kernels / copies"
            + (
                " (" + ", ".join(f"{g} {t:.2f} ms" for g, t in sorted(by_group.items(), key=lambda x: -x[1])) + ")"
                if beside
                else ""
            )
        )
    for kind in sorted(kernels):
        n = len(rows[kind])
        out.append(
            f"{kind} steps: device time per step by group (ms): "
            + ", ".join(f"{g} {t / n / 1e3:.2f}" for g, t in sorted(groups[kind].items(), key=lambda x: -x[1]))
        )
        out += [f"| kernel ({kind} steps) | ms per step |", "|---|---|"]
        for name, t in sorted(kernels[kind].items(), key=lambda x: -x[1])[:top]:
            out.append(f"| {name[:90]} | {t / n / 1e3:.3f} |")
    return out


def longest_detail(path: Path, gaps: int = 5) -> list[str]:
    """The longest labelled step (by device span) event by event: its own device work in time order
    (the first few items), its longest idle gaps, and the device work of no step that ran in each."""
    steps, device, by_corr, by_thread = _read_trace(path)
    stepped = set()
    best = None  # (span, step, its device events, its runtime calls)
    for s in steps:
        calls = _step_calls(s, by_thread)
        stepped.update(c for _, c in calls)
        work = sorted((k for _, c in calls for k in by_corr.get(c, [])), key=lambda k: k["ts"])
        if work:
            span = max(k["ts"] + k["dur"] for k in work) - work[0]["ts"]
            if best is None or span > best[0]:
                best = (span, s, work, calls)
    if best is None:
        return ["no labelled step with device work in the trace"]
    span, s, work, calls = best
    t0 = s["ts"]
    out = [
        f"longest step: {s['name'][len(LABEL) :]}, host label {s['dur'] / 1e3:.2f} ms from {t0}, device span "
        f"{span / 1e3:.2f} ms, {len(work)} device items from {len(calls)} runtime calls; times in ms from the label's start"
    ]
    out += [
        f"  {k['ts'] - t0 >= 0 and '+' or ''}{(k['ts'] - t0) / 1e3:.3f} {k['cat']} {k['name'][:60]} "
        f"({k['dur'] / 1e3:.3f} ms, stream {k.get('args', {}).get('stream', k['tid'])})"
        for k in work[:6]
    ]
    holes = sorted(((b["ts"] - (a["ts"] + a["dur"]), a, b) for a, b in zip(work, work[1:])), key=lambda h: -h[0])[:gaps]
    others = [e for e in device if e["args"]["correlation"] not in stepped]
    for hole, a, b in holes:
        lo, hi = a["ts"] + a["dur"], b["ts"]
        inside = [e for e in others if e["ts"] < hi and e["ts"] + e["dur"] > lo]
        names = defaultdict(lambda: [0, 0.0])
        for e in inside:
            names[f"{e['cat']} {e['name'][:50]} (stream {e.get('args', {}).get('stream', e['tid'])})"][0] += 1
            names[f"{e['cat']} {e['name'][:50]} (stream {e.get('args', {}).get('stream', e['tid'])})"][1] += e["dur"] / 1e3
        out.append(
            f"gap {hole / 1e3:.3f} ms at +{(lo - t0) / 1e3:.3f}, after {a['name'][:40]}, before {b['cat']} "
            f"{b['name'][:40]}; beside it: "
            + ("; ".join(f"{n} x{c} {d:.2f} ms" for n, (c, d) in names.items()) or "nothing of another stream")
        )
    return out


if __name__ == "__main__":
    lines = longest_detail(Path(sys.argv[1])) if "--longest" in sys.argv[2:] else summarize(Path(sys.argv[1]))
    print("\n".join(lines))
