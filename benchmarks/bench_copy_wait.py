"""What a decode step's small host -> device input copy waits for while a slot load's copy runs (CUDA host).

A cold rank-64 Llama-3-8B-shaped load stages ~320 MiB from pinned memory on the slot manager's copy
stream; the step stages its inputs (a few KiB, `graphs.stage`) on the forward's stream. If both
copies share the device's host -> device copy engine, the step's copy can wait behind the load's.
Per way of queuing the load (one copy, or pieces of --pieces MiB) and per way of staging the
inputs (`copy`: `copy_(non_blocking=True)`, a copy-engine transfer, as the engine staged them
before kernel reads became its default; `kernel`: an elementwise kernel reading the pinned buffer
through its device mapping, no copy engine, as the engine's `graphs.INPUTS_BY_KERNEL` does), this
prints, median of --trials with the load queued first (and with no load beside it): when the input
stage ended, counted from an event recorded on the load's stream before the load
(the column that shows a wait), and its time between its own events on the forward's stream
(which a wait of the whole stream does not show: the events wait with it).

    python benchmarks/bench_copy_wait.py [--load-mib 320] [--pieces 0,16,4,1] [--trials 20]
    (or `bash benchmarks/gpu_executor.sh OUT_DIR copywait`, which puts the package on the path)
"""

from __future__ import annotations

import argparse
import statistics

import torch


def device_view(host: torch.Tensor) -> torch.Tensor | None:
    """Pinned int32 `host` as a CUDA tensor over the same memory (the engine's own mapping,
    executor/engine/graphs.py), or None, reported."""
    from loraserve.executor.engine.graphs import _device_view

    try:
        return _device_view(host, torch.device("cuda", torch.cuda.current_device()))
    except Exception as e:  # noqa: BLE001 - reported, the table goes on without this way
        print(f"(no device view of pinned memory: {e})")
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--load-mib", type=int, default=320)
    ap.add_argument("--pieces", default="0,16,4,1", help="MiB per piece of the load's copy (0: one copy)")
    ap.add_argument("--inputs-kib", type=int, default=16)
    ap.add_argument("--trials", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_copy_wait.py runs on a CUDA host")
    load_src = torch.empty(args.load_mib << 20, dtype=torch.uint8).pin_memory()
    load_dst = torch.empty_like(load_src, device="cuda")
    n = (args.inputs_kib << 10) // 4  # int32, as the engine's step inputs
    host = torch.arange(n, dtype=torch.int32).pin_memory()
    dst = torch.empty(n, dtype=torch.int32, device="cuda")
    mapped = device_view(host)
    copy_stream, fwd = torch.cuda.Stream(), torch.cuda.Stream()
    ways = {"copy": lambda: dst.copy_(host, non_blocking=True)}
    if mapped is not None:
        ways["kernel"] = lambda: torch.mul(mapped, 1, out=dst)

    def load(piece_mib: int) -> None:
        step = (piece_mib << 20) or load_src.numel()
        with torch.cuda.stream(copy_stream):
            for at in range(0, load_src.numel(), step):
                load_dst[at : at + step].copy_(load_src[at : at + step], non_blocking=True)

    def trial(way, piece: int | None) -> tuple[float, float]:
        torch.cuda.synchronize()
        host.add_(1)  # new inputs each trial: a stale copy of them would fail the check below
        t0 = torch.cuda.Event(enable_timing=True)
        t0.record(copy_stream)
        if piece is not None:
            load(piece)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(fwd):
            a.record()
            way()
            b.record()
        torch.cuda.synchronize()
        assert torch.equal(dst.cpu(), host), "the staged inputs differ from the host's"
        return a.elapsed_time(b), t0.elapsed_time(b)

    print(f"| inputs staged by | load beside ({args.load_mib} MiB) | stage between its own events, ms: median / largest "
          f"| stage ended after the load's start, ms: median |\n|---|---|---|---|")
    for way_name, way in ways.items():
        for piece in [None] + [int(p) for p in args.pieces.split(",")]:
            for _ in range(3):
                trial(way, piece)
            got = [trial(way, piece) for _ in range(args.trials)]
            stage = [g[0] for g in got]
            label = "none" if piece is None else ("one copy" if piece == 0 else f"{piece} MiB pieces")
            print(f"| {way_name} | {label} | {statistics.median(stage):.3f} / {max(stage):.3f} "
                  f"| {statistics.median(g[1] for g in got):.3f} |")
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
