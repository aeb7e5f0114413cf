"""Does page-locking host memory on one thread stall another thread's CUDA calls?

An adapter that lands in the executor's CPU cache lands in freshly pinned host memory (the store
client's stream, executor/store_client.py `host_buffer`). `serve.py --probe` saw a decode step
wait ~250 ms while rank-64 adapters were fetched: this script tells which of a serving thread's
per-step calls wait while another thread pins memory. The main thread times each call kind
(host time per call, median and max) while idle and while a second thread allocates `--pins`
pinned buffers of `--mib` MiB each (kept alive, so each one is a new page-locking allocation).

A second table times setting up the executor's pinned arena (executor/pinned_arena.py) of
`--arena-gib`: page-locking the fresh pages as they are (the driver faults them in, and is held
meanwhile) or after touching every page first (torch's threads; the driver then only locks them).

Usage (on a CUDA host): python benchmarks/bench_pinning.py [--pins 4] [--mib 320] [--arena-gib 8]
Prints two tables; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from loraserve.executor.pinned_arena import PinnedArena


def calls(dev: torch.device) -> dict:
    """The per-step CUDA calls of a serving thread, each one small."""
    x = torch.zeros(1024, device=dev)
    host = torch.zeros(1024, pin_memory=True)
    pageable = torch.zeros(1024)
    event = torch.cuda.Event()

    def launch():
        x.add_(1)
        event.record()

    return {
        "kernel launch + event record": launch,
        "small pinned allocation (torch.empty pin_memory=True)": lambda: torch.empty(16, dtype=torch.float64, pin_memory=True),
        "host->device copy from pinned (non_blocking)": lambda: x.copy_(host, non_blocking=True),
        "host->device copy from pageable": lambda: x.copy_(pageable),
        "device->host copy into pinned (non_blocking) + event": lambda: (host.copy_(x, non_blocking=True), event.record()),
    }


def timed(fn, until: threading.Event | None, seconds: float) -> list[float]:
    out, end = [], time.perf_counter() + seconds
    while (until is None and time.perf_counter() < end) or (until is not None and not until.is_set()):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
        time.sleep(0.0005)  # a step's other work
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pins", type=int, default=4, help="pinned allocations made by the second thread per call kind")
    ap.add_argument("--mib", type=int, default=320, help="size of each (320 MiB: a rank-64 Llama-3-8B adapter)")
    ap.add_argument("--arena-gib", type=int, default=8, help="pinned arena size for the set-up table (0: skip)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.cuda.init()
    rows, kept = [], []
    for name, fn in calls(dev).items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        quiet = timed(fn, None, 0.3)
        done, pin_times = threading.Event(), []

        def pin():
            for _ in range(args.pins):
                t0 = time.perf_counter()
                kept.append(torch.empty(args.mib << 20, dtype=torch.uint8, pin_memory=True))
                pin_times.append(time.perf_counter() - t0)
            done.set()

        worker = threading.Thread(target=pin)
        worker.start()
        busy = timed(fn, done, 0)
        worker.join()
        torch.cuda.synchronize()
        rows.append((name, quiet, busy, pin_times))  # `kept` stays alive: every pin is a new allocation
    print(f"\npinning stalls - {torch.cuda.get_device_name(dev)}, torch {torch.__version__}; "
          f"a second thread pins {args.pins} x {args.mib} MiB per row")
    print("| call on the serving thread | quiet: median / max us | while pinning: median / max us | calls | pinning ms each |")
    print("|---|---|---|---|---|")
    for name, quiet, busy, pin_times in rows:
        print(f"| {name} | {statistics.median(quiet) * 1e6:.1f} / {max(quiet) * 1e6:.1f} "
              f"| {statistics.median(busy or [0]) * 1e6:.1f} / {max(busy or [0]) * 1e6:.1f} | {len(busy)} "
              f"| {statistics.median(pin_times) * 1e3:.1f} |")
    if args.arena_gib:
        arena_setup(args.arena_gib)


def arena_setup(gib: int) -> None:
    print(f"\npinned arena set-up - {gib} GiB, {torch.get_num_threads()} torch threads")
    print("| pages | touched s | page-locked s | total s | s per GiB |\n|---|---|---|---|---|")
    for prefault in (False, True, False, True):
        arena = PinnedArena(gib << 30, prefault=prefault)
        locked = arena.pin_seconds - arena.fault_seconds
        print(f"| {'touched first' if prefault else 'as mapped'} | {arena.fault_seconds:.2f} | {locked:.2f} "
              f"| {arena.pin_seconds:.2f} | {arena.pin_seconds / gib:.3f} |", flush=True)
        arena.close()
        del arena  # unmapped before the next one is built


if __name__ == "__main__":
    main()
