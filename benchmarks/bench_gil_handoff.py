"""How long a helper thread's shard work takes beside a thread that runs Python: prints one table.

The executor's event loop runs Python (a step's launch, the scheduler, gRPC handlers) while helper
threads land fetched shards: `store_client.shard_tensors` makes 448 tensor views of a
Llama-3-8B-shaped shard (one torch call each, two before), each torch call giving the interpreter lock back and taking it again. While
another thread runs Python, each retake waits up to the interpreter's switch interval (Python's
default: 5 ms). This script stands a thread spinning Python in bursts (`--busy` BUSY/IDLE ms; 1/0:
always busy) in for the loop and times, in a second thread, three kinds of shard work for a
rank-`--rank` all-linear Llama-3-8B-shaped shard:

- `shard_tensors`: the executor's views of a landed shard (executor/store_client.py);
- `copy per tensor`: the shard's tensors copied one by one into a buffer (~450 copies);
- `one copy + views`: the whole shard copied at once, then views of the copy (as serve.py lands it);

at each switch interval of `--intervals-us`, beside the time alone (no busy thread), with the busy
thread's Python rate as a share of its rate with no helper working (what the loop pays).
Usage: python benchmarks/bench_gil_handoff.py [--busy 1/0] [--intervals-us 5000,1000,500,200,100] [--repeat 5]
       [--work shard_tensors,...]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import threading
import time

import torch
from safetensors.torch import save

from loraserve.executor.store_client import shard_tensors

LAYERS, HIDDEN, INTER, KV = 32, 4096, 14336, 1024
SHAPES = {"q_proj": (HIDDEN, HIDDEN), "k_proj": (HIDDEN, KV), "v_proj": (HIDDEN, KV), "o_proj": (HIDDEN, HIDDEN),
          "gate_proj": (HIDDEN, INTER), "up_proj": (HIDDEN, INTER), "down_proj": (INTER, HIDDEN)}


def shard(rank: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A Llama-3-8B-shaped rank-r all-linear shard as a safetensors blob in a uint8 tensor, and its tensors."""
    tensors = {}
    for layer in range(LAYERS):
        for name, (fin, fout) in SHAPES.items():
            key = f"layers.{layer}.{name}"
            tensors[f"{key}.lora_A"] = torch.zeros(rank, fin, dtype=torch.bfloat16)
            tensors[f"{key}.lora_B"] = torch.zeros(fout, rank, dtype=torch.bfloat16)
    return torch.frombuffer(bytearray(save(tensors)), dtype=torch.uint8), tensors


def copy_per_tensor(tensors: dict[str, torch.Tensor], buffer: torch.Tensor) -> None:
    at = 0
    for t in tensors.values():
        buffer[at : at + t.nbytes].copy_(t.view(-1).view(torch.uint8))
        at += t.nbytes


def one_copy_and_views(flat: torch.Tensor, tensors: dict[str, torch.Tensor], buffer: torch.Tensor) -> None:
    buffer.copy_(flat)
    at = 0
    for t in tensors.values():
        buffer[at : at + t.nbytes].view(t.dtype).view(t.shape)
        at += t.nbytes


class Busy:
    """A thread that spins Python for busy_ms, then sleeps idle_ms (the GIL free), until stopped;
    counts its loop iterations (its Python rate)."""

    def __init__(self, busy_ms: float, idle_ms: float):
        self.busy_s, self.idle_s, self.count = busy_ms / 1e3, idle_ms / 1e3, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            end = time.perf_counter() + self.busy_s
            while time.perf_counter() < end:
                self.count += 1
            if self.idle_s:
                time.sleep(self.idle_s)

    def rate(self, seconds: float) -> float:
        """Iterations per second over the next `seconds`."""
        before, t0 = self.count, time.perf_counter()
        time.sleep(seconds)
        return (self.count - before) / (time.perf_counter() - t0)


def timed_in_thread(work) -> float:
    """Seconds `work()` takes in a thread of its own (as the executor's helpers run it)."""
    took = []

    def run():
        t0 = time.perf_counter()
        work()
        took.append(time.perf_counter() - t0)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return took[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--busy", default="1/0", metavar="BUSY/IDLE", help="ms the busy thread spins, then sleeps")
    ap.add_argument("--intervals-us", default="5000,1000,500,200,100", help="switch intervals to run at (us)")
    ap.add_argument("--repeat", type=int, default=5, help="timings per cell (median and max reported)")
    ap.add_argument("--work", default="", help="comma list of the rows' work to run (default: all three)")
    args = ap.parse_args()
    busy_ms, idle_ms = (float(v) for v in args.busy.split("/"))
    intervals = [int(v) for v in args.intervals_us.split(",")]

    blob, tensors = shard(args.rank)
    flat = torch.cat([t.view(-1).view(torch.uint8) for t in tensors.values()])
    buffer = torch.empty_like(flat)
    work = {
        "shard_tensors": lambda: shard_tensors(blob),
        "copy per tensor": lambda: copy_per_tensor(tensors, buffer),
        "one copy + views": lambda: one_copy_and_views(flat, tensors, buffer),
    }
    if args.work:
        unknown = set(args.work.split(",")) - set(work)
        if unknown:
            ap.error(f"--work: no such work {sorted(unknown)}; choose from {sorted(work)}")
        work = {k: v for k, v in work.items() if k in args.work.split(",")}
    found = sys.getswitchinterval()
    print(f"# {platform.machine()}, {os.cpu_count()} CPUs ({torch.get_num_threads()} torch threads), torch {torch.__version__}, "
          f"Python {platform.python_version()}; rank {args.rank} Llama-3-8B-shaped shard: {len(tensors)} tensors, "
          f"{flat.numel() / 2**20:.0f} MiB; busy thread {busy_ms:g}/{idle_ms:g} ms; {args.repeat} timings per cell")
    print("| switch interval | work | alone ms (median) | beside the busy thread ms (median / max) | x alone | busy thread's rate while it runs |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    try:
        for us in intervals:
            sys.setswitchinterval(us / 1e6)
            for what, fn in work.items():
                fn()  # warm
                alone = statistics.median(timed_in_thread(fn) for _ in range(args.repeat))
                busy = Busy(busy_ms, idle_ms)
                busy.thread.start()
                base_rate = busy.rate(0.2)
                beside, rates = [], []
                for _ in range(args.repeat):
                    before, t0 = busy.count, time.perf_counter()
                    beside.append(timed_in_thread(fn))
                    rates.append((busy.count - before) / (time.perf_counter() - t0))
                busy.stop.set()
                busy.thread.join()
                med = statistics.median(beside)
                # the rate is the busy thread's while the helper ran over its rate alone: with idle
                # gaps (BUSY/IDLE) a few ms of either say nothing, so it is printed for 1/0 only
                rate = f"{statistics.median(rates) / base_rate:.2f}" if not idle_ms else "-"
                print(f"| {us:,} us | {what} | {alone * 1e3:.1f} | {med * 1e3:,.1f} / {max(beside) * 1e3:,.1f} | "
                      f"{med / alone:,.1f} | {rate} |", flush=True)
    finally:
        sys.setswitchinterval(found)


if __name__ == "__main__":
    main()
