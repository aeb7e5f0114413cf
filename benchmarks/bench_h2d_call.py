"""What queuing one host -> device copy costs the host, by source memory and size (CUDA host).

A slot load queues one copy of the shard's bytes from the pinned CPU cache (memory page-locked with
cudaHostRegister: executor/pinned_arena.py) and returns; the copy's own time is the device's. This
prints, per size, the host time of `dst.copy_(src, non_blocking=True)` on a side stream and the
copy's device time (events), from: memory of torch's pinned allocator (cudaHostAlloc), a region
page-locked with cudaHostRegister (as the arena), the executor's pinned arena itself, and the
region issued as 8 MiB pieces (`--copies-only`: this table alone).
Medians of 20, after 3 warm-ups.

Then a slot load's two ways from that region, per adapter rank (a Llama-3-8B-sized adapter's bytes,
laid out as its A and B copies into rank-64 slots): staged (the one copy above, then the scatter
kernel from device memory), as the executor loads, and the scatter kernel reading the page-locked
region itself over the bus (no staging copy). Host time of the calls, device time by events, and a
check that both ways wrote the same bytes.

Last, what a step's 4-byte memset waits for when slot loads are queued: four rank-64 loads' copies
(320 MiB each, from the region) queued on a side stream as one copy each or in pieces, then a CUDA
graph of [kernel, memset, kernel] (a memset like those cuBLAS puts before some GEMMs) replayed on
another stream: the replay's device time, and when it ended counted from the loads' start, against
the same graph without the memset and the loads' own time. Then the same graph (with its memset)
replayed on each of 16 streams in turn while one 320 MiB copy is queued on the load stream:
streams share the device's hardware queues (CUDA_DEVICE_MAX_CONNECTIONS of them, 8 unless set),
and the question is whether a stream that shares one with the load stream waits behind its copy.
A wait of the whole stream would hide from the replay's own events, so both tables also print
when the replay began and ended, counted from an event recorded on the load stream before its
copies (the start includes the host's time queuing them).

    python benchmarks/bench_h2d_call.py [--region-gib 4] [--copies-only]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

import torch

SIZES_MIB = (40, 80, 160, 320)
SLOT_RANK, MODULES, WIDTH = 64, 320, 4096  # rank-r adapter: MODULES x (A [r, WIDTH] + B [WIDTH, r]) bf16


def timed(fn, stream: torch.cuda.Stream, repeat: int = 20) -> tuple[float, float]:
    """(host seconds of fn's call, device seconds between events around it), medians."""
    host, dev = [], []
    for i in range(repeat + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            start.record()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            end.record()
        end.synchronize()
        if i >= 3:
            host.append(t1 - t0)
            dev.append(start.elapsed_time(end) / 1e3)
    return statistics.median(host), statistics.median(dev)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--region-gib", type=float, default=4.0, help="size of the cudaHostRegister'd region")
    ap.add_argument("--copies-only", action="store_true", help="the first table only (one copy by source and size)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_h2d_call.py runs on a CUDA host")
    stream = torch.cuda.Stream()
    top = max(SIZES_MIB) << 20
    alloc = torch.empty(top, dtype=torch.uint8, pin_memory=True)
    region_bytes = int(args.region_gib * 2**30)
    region = torch.empty(region_bytes, dtype=torch.uint8)
    region.fill_(1)  # pages touched before they are locked, as the arena does
    err = torch.cuda.cudart().cudaHostRegister(region.data_ptr(), region_bytes, 0)
    if int(err) != 0:
        raise SystemExit(f"cudaHostRegister error {int(err)}")
    from loraserve.executor.pinned_arena import PinnedArena

    arena = PinnedArena(region_bytes)  # the executor's own: anonymous pages, huge pages where given, touched, registered
    dst = torch.empty(top, dtype=torch.uint8, device="cuda")
    rows = []
    for mib in SIZES_MIB:
        n = mib << 20
        at = region_bytes // 2  # a slice from the middle of the registered region
        src_reg, src_arena = region[at : at + n], arena.base[at : at + n]
        cases = {
            "cudaHostAlloc (torch pinned)": lambda: dst[:n].copy_(alloc[:n], non_blocking=True),
            "cudaHostRegister region": lambda: dst[:n].copy_(src_reg, non_blocking=True),
            "the pinned arena (executor/pinned_arena.py)": lambda: dst[:n].copy_(src_arena, non_blocking=True),
            "region, 8 MiB pieces": lambda: [dst[o : o + (8 << 20)].copy_(src_reg[o : o + (8 << 20)], non_blocking=True)
                                             for o in range(0, n, 8 << 20)],
        }
        for name, fn in cases.items():
            h, d = timed(fn, stream)
            rows.append((mib, name, h * 1e6, d * 1e3, n / d / 1e9))
    print(f"\nhost -> device copy, host time of the call - {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}")
    print("| MiB | source | host us of the call | device ms | GB/s |\n|---|---|---|---|---|")
    for mib, name, h, d, bw in rows:
        print(f"| {mib} | {name} | {h:.1f} | {d:.3f} | {bw:.1f} |")
    if args.copies_only:
        return
    scatter_rows(region, region_bytes // 2, stream)
    memset_rows(region, stream)
    torch.cuda.cudart().cudaHostUnregister(region.data_ptr())


def scatter_rows(region: torch.Tensor, at: int, stream: torch.cuda.Stream) -> None:
    """The slot-load table: staged copy + scatter against the scatter reading `region` directly."""
    from loraserve.kernels import triton_copy
    from loraserve.kernels.copy_reference import ScatterPlan, SlotCopy

    a_slots = torch.zeros(2, MODULES, SLOT_RANK, WIDTH, dtype=torch.bfloat16, device="cuda")
    b_slots = torch.zeros(2, MODULES, WIDTH, SLOT_RANK, dtype=torch.bfloat16, device="cuda")
    rows = []
    for rank in (8, 16, 32, 64):
        per = rank * WIDTH  # elements of one A, and of one B
        copies = []
        for m in range(MODULES):
            copies.append(SlotCopy(a_slots[:, m], 1, per, per, per, 2 * m * per))
            copies.append(SlotCopy(b_slots[:, m], WIDTH, rank, SLOT_RANK, rank, (2 * m + 1) * per))
        plan = ScatterPlan(tuple(copies))
        n = 2 * MODULES * per * 2  # bytes
        host = region[at : at + n].view(torch.bfloat16)
        host.copy_(torch.randn(n // 2, dtype=torch.bfloat16))
        dev = torch.empty(n // 2, dtype=torch.bfloat16, device="cuda")

        def staged():
            dev.copy_(host, non_blocking=True)
            triton_copy.slot_scatter(plan, dev, 1)

        h, d = timed(staged, stream)
        rows.append((rank, n >> 20, "staged: copy + scatter", h * 1e6, d * 1e3, n / d / 1e9, "reference"))
        torch.cuda.synchronize()
        want = (a_slots[1].clone(), b_slots[1].clone())
        a_slots[1].zero_(), b_slots[1].zero_()
        h, d = timed(lambda: triton_copy.slot_scatter(plan, host, 1), stream)
        same = torch.equal(a_slots[1], want[0]) and torch.equal(b_slots[1], want[1])
        rows.append((rank, n >> 20, "the scatter reads host memory", h * 1e6, d * 1e3, n / d / 1e9,
                     "same" if same else "DIFFERENT"))
    print(f"\nslot load, staged against read from host memory (rank-{SLOT_RANK} slots, {MODULES} modules of width {WIDTH})")
    print("| rank | MiB | way | host us of the calls | device ms | GB/s | bytes written |\n|---|---|---|---|---|---|---|")
    for rank, mib, name, h, d, bw, same in rows:
        print(f"| {rank} | {mib} | {name} | {h:.1f} | {d:.3f} | {bw:.1f} | {same} |")


def _graph(memset: bool) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]:
    """A captured [add, (4-byte memset through the driver, like cuBLAS's), add] and the tensors it
    writes (keep them alive while it replays: the driver's memset holds no reference)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    x = torch.zeros(1024, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    capture = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture):
        x.add_(1)
        if memset:
            err = cuda.cuMemsetD32Async(ctypes.c_uint64(flag.data_ptr()), ctypes.c_uint(0), ctypes.c_size_t(1),
                                        ctypes.c_void_p(capture.cuda_stream))
            if err:
                raise SystemExit(f"cuMemsetD32Async error {err}")
        x.add_(1)
    return graph, (x, flag)


def _replay_behind(graph, load_stream, stream, queue_loads) -> tuple[float, float, float, float]:
    """(replay ms by its own events, ms from the loads' start to the replay's start, and to its
    end, loads' ms): the loads queued on `load_stream`, then the graph replayed on `stream`. The
    replay's start counts the host's time queuing the loads too (many small pieces: ms)."""
    torch.cuda.synchronize()
    l0, l1, s0, s1 = (torch.cuda.Event(enable_timing=True) for _ in range(4))
    with torch.cuda.stream(load_stream):
        l0.record()
        queue_loads()
        l1.record()
    with torch.cuda.stream(stream):
        s0.record()
        graph.replay()
        s1.record()
    torch.cuda.synchronize()
    return s0.elapsed_time(s1), l0.elapsed_time(s0), l0.elapsed_time(s1), l0.elapsed_time(l1)


def _warm(graph: torch.cuda.CUDAGraph) -> torch.cuda.CUDAGraph:
    """A first replay (its upload) outside the timed ones."""
    graph.replay()
    torch.cuda.synchronize()
    return graph


def memset_rows(region: torch.Tensor, load_stream: torch.cuda.Stream, loads: int = 4, repeat: int = 7) -> None:
    """The memset tables: a graph's replay while `loads` 320 MiB copies are queued, by piece size;
    then on each of 16 streams behind one."""
    n = 320 << 20
    dst = torch.empty(loads * n, dtype=torch.uint8, device="cuda")
    replay_stream = torch.cuda.Stream()
    rows = []
    for memset in (False, True):
        graph, _tensors = _graph(memset)
        _warm(graph)
        for piece_mib in (0, 64, 32, 8, 2):
            piece = (piece_mib << 20) or n

            def queue_loads():
                for i in range(loads):
                    for o in range(0, n, piece):
                        dst[i * n + o : i * n + o + piece].copy_(region[o : o + piece], non_blocking=True)

            runs = [_replay_behind(graph, load_stream, replay_stream, queue_loads) for _ in range(repeat)]
            rows.append(("with" if memset else "without", piece_mib or 320,
                         *(statistics.median(r[i] for r in runs) for i in range(4)), max(r[0] for r in runs)))
    print(f"\na graph of [kernel, memset, kernel] replayed while {loads} loads of 320 MiB are queued on another stream"
          f" (medians of {repeat})")
    print("| memset | loads' copies of MiB | replay device ms (median) | (max) | replay began / ended, ms after the "
          "loads began | loads' device ms |\n|---|---|---|---|---|---|")
    for memset, piece, wait, began, ended, span, worst in rows:
        print(f"| {memset} | {piece} | {wait:.3f} | {worst:.3f} | {began:.2f} / {ended:.2f} | {span:.2f} |")
    graph, _tensors = _graph(True)
    _warm(graph)

    def one_load():
        dst[:n].copy_(region[:n], non_blocking=True)

    found = []
    for stream in [torch.cuda.Stream() for _ in range(16)]:
        # torch hands out streams from a pool, round robin: none of these may be the load stream itself
        assert stream.cuda_stream not in (load_stream.cuda_stream, replay_stream.cuda_stream), "the stream pool wrapped"
        runs = [_replay_behind(graph, load_stream, stream, one_load) for _ in range(3)]
        found.append(tuple(statistics.median(r[i] for r in runs) for i in range(4)))
    connections = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "unset (8)")
    print(f"\nthe graph replayed on each of 16 new streams while one 320 MiB copy is queued on the load stream "
          f"(CUDA_DEVICE_MAX_CONNECTIONS {connections}; medians of 3), ms:")
    print("| stream | " + " | ".join(str(i) for i in range(16)) + " |\n|---|" + "---|" * 16)
    print("| replay | " + " | ".join(f"{w:.2f}" for w, _, _, _ in found) + " |")
    print("| replay began, after the load began | " + " | ".join(f"{b:.2f}" for _, b, _, _ in found) + " |")
    print("| replay ended, after the load began | " + " | ".join(f"{e:.2f}" for _, _, e, _ in found) + " |")
    print("| the load | " + " | ".join(f"{s:.2f}" for _, _, _, s in found) + " |")


if __name__ == "__main__":
    main()
