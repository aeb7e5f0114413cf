"""The pinned arena fetched shards land in (executor/pinned_arena.py): blocks carved out of one
allocation, given back when the shard's tensors are dropped and once the copies out of them have
run. CPU tensors here (page-locking needs CUDA; the bookkeeping is the same)."""

from __future__ import annotations

import gc

import pytest
import torch

from loraserve.executor.config import ExecutorConfig
from loraserve.executor.pinned_arena import ALIGN, ArenaShard, PinnedArena


class Fence:
    """A CUDA event's `query`, switched by hand."""

    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done


def arena(nbytes=16 * ALIGN, fence=None) -> PinnedArena:
    return PinnedArena(nbytes, pin_memory=False, fence=fence)


def test_blocks_are_aligned_disjoint_views_and_come_back_coalesced():
    a = arena()
    x, y, z = a.allocate(100), a.allocate(3 * ALIGN), a.allocate(ALIGN + 1)
    assert [b.numel() for b in (x, y, z)] == [100, 3 * ALIGN, ALIGN + 1]
    offsets = [a.offset_of(b) for b in (x, y, z)]
    assert offsets == [0, ALIGN, 4 * ALIGN] and all(a.holds(b) for b in (x, y, z))
    assert a.free_bytes() == 10 * ALIGN and a.live_blocks() == 3
    a.release(offsets[1])
    a.release(offsets[0])  # joins the block after it
    assert a.largest_free() == 10 * ALIGN and a.free_bytes() == 14 * ALIGN
    a.release(offsets[2])  # joins both sides: one block again
    assert a.largest_free() == 16 * ALIGN and a.live_blocks() == 0


def test_best_fit_and_no_room_is_none():
    a = arena()
    blocks = [a.allocate(ALIGN) for _ in range(16)]
    assert a.allocate(1) is None and a.misses == 1
    for i in (2, 3, 4, 8, 9):  # a hole of 3 blocks, then one of 2
        a.release(a.offset_of(blocks[i]))
    two = a.allocate(2 * ALIGN)
    assert a.offset_of(two) == 8 * ALIGN  # the 2-block hole, not the first fit (the 3-block one)
    assert a.allocate(4 * ALIGN) is None and a.misses == 2


def test_a_released_block_waits_for_its_fence():
    fences = []

    def fence():
        fences.append(Fence())
        return fences[-1]

    a = arena(4 * ALIGN, fence)
    block = a.allocate(4 * ALIGN)
    a.release(a.offset_of(block))  # a slot copy out of it may still be running
    assert a.free_bytes() == 0 and a.allocate(1) is None
    fences[0].done = True
    assert a.free_bytes() == 4 * ALIGN and a.allocate(4 * ALIGN) is not None


def test_an_adopted_block_comes_back_when_the_shard_is_dropped():
    a = arena()
    block = a.allocate(2 * ALIGN)
    block.fill_(7)
    shard = a.adopt(block, ArenaShard({"m.lora_a": block[:ALIGN].view(torch.int32)}))
    held = shard["m.lora_a"]
    assert a.live_blocks() == 1
    del shard
    gc.collect()
    assert a.live_blocks() == 0 and a.free_bytes() == 16 * ALIGN
    assert int(held[0]) == 0x07070707  # a view kept past the shard reads the arena (its bytes now unowned)


def test_an_arena_of_no_bytes_is_refused():
    with pytest.raises(ValueError, match="pinned arena of 0 bytes: must be > 0"):
        PinnedArena(0, pin_memory=False)


def test_the_arena_holds_the_cpu_cache_and_leaves_a_quarter_of_the_host():
    from loraserve.executor.memory import ARENA_CACHE_SHARE, arena_bytes

    gib = 1 << 30
    arena = arena_bytes(14 * gib, 100 * gib)
    assert arena == 16 * gib and int(arena * ARENA_CACHE_SHARE) == 14 * gib  # the cache keeps its whole budget
    assert arena_bytes(60 * gib, 64 * gib) == 48 * gib  # at most 3/4 of what is available
    assert arena_bytes(gib + 12345, 100 * gib) % (2 << 20) == 0  # whole huge pages
    assert arena_bytes(gib, 0) == 0  # nothing available: none


def test_a_prefaulted_arena_hands_out_zeroed_memory_and_times_its_set_up():
    a = PinnedArena(8 * ALIGN, pin_memory=False, prefault=True)
    assert 0 <= a.fault_seconds <= a.pin_seconds
    assert int(a.allocate(8 * ALIGN).sum()) == 0


def test_a_cpu_executor_makes_an_untouched_host_arena_sized_for_its_cache(caplog, monkeypatch):
    """On the CPU the arena is never page-locked: sized as on CUDA, nothing of it is touched until
    shards land in it, the cache keeps its budget, and a refused mapping or no memory left means none."""
    from loraserve.executor import build, memory

    mib = 1 << 20
    made = []
    monkeypatch.setattr(build, "PinnedArena", lambda *a, **kw: made.append(kw) or PinnedArena(*a, **kw))
    cfg = ExecutorConfig(model="m", device="cpu", cpu_cache_bytes=7 * mib)
    with caplog.at_level("INFO", logger="loraserve.executor.build"):
        arena = build.pinned_arena(cfg)
    assert made == [{"pin_memory": False, "prefault": False}]  # nothing touched at start
    assert arena.nbytes == 8 * mib and cfg.cpu_cache_bytes == 7 * mib  # sized for the cache, which keeps its budget
    assert "host arena: 0.0 GiB of address space (on cpu: not page-locked, pages touched as fetched shards land" in caplog.text
    big = ExecutorConfig(model="m", device="cpu", cpu_cache_bytes=1 << 30)
    monkeypatch.setattr(memory, "available_host_bytes", lambda: 1 << 30)
    assert build.pinned_arena(big).nbytes == 3 << 28 and big.cpu_cache_bytes == 1 << 30  # 3/4 of what is free; cache not cut
    caplog.clear()

    def refused(*a, **kw):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(build, "PinnedArena", refused)
    with caplog.at_level("INFO", logger="loraserve.executor.build"):
        assert build.pinned_arena(ExecutorConfig(model="m", device="cpu", cpu_cache_bytes=mib)) is None
    assert (
        "host arena off: mapping 0.0 GiB failed ([Errno 12] Cannot allocate memory); fetched shards land in fresh host buffers"
        in caplog.text
    )
    caplog.clear()
    monkeypatch.setattr(memory, "available_host_bytes", lambda: 0)
    with caplog.at_level("INFO", logger="loraserve.executor.build"):
        assert build.pinned_arena(ExecutorConfig(model="m", device="cpu", cpu_cache_bytes=mib)) is None
    assert "no host memory left for a host arena: fetched shards land in fresh host buffers" in caplog.text


def test_a_release_from_inside_the_arenas_own_lock_does_not_deadlock():
    """A release runs from a finalizer, which the garbage collector may call at any allocation,
    also while this thread holds the arena's lock: it must only queue the block."""
    import threading

    a = arena()
    first, pending = a.allocate(ALIGN), [a.allocate(ALIGN)]
    give_back = a._give_back

    def give_back_and_collect(offset, size):  # as if the collector ran the second block's finalizer here
        give_back(offset, size)
        if pending:
            a.release(a.offset_of(pending.pop()))

    a._give_back = give_back_and_collect
    a.release(a.offset_of(first))
    done = threading.Event()
    threading.Thread(target=lambda: (a.free_bytes(), done.set()), daemon=True).start()
    assert done.wait(5), "release inside the lock deadlocked"
    a._give_back = give_back
    assert a.live_blocks() == 0 and a.free_bytes() == 16 * ALIGN


def test_a_cuda_executors_arena_is_sized_for_its_cache_holds_it_and_falls_back_when_pinning_fails(monkeypatch, caplog):
    """build.pinned_arena on a CUDA config, with page-locking stubbed (no GPU here)."""
    from loraserve.executor import build

    mib = 1 << 20
    made = []
    monkeypatch.setattr(build.memory, "available_host_bytes", lambda: 1 << 30)
    monkeypatch.setattr(build, "PinnedArena", lambda n, **kw: made.append(kw) or PinnedArena(n, pin_memory=False))
    cfg = ExecutorConfig(model="m", device="cuda", cpu_cache_bytes=7 * mib)
    arena = build.pinned_arena(cfg, adapter_bytes=mib)
    assert made == [{"pin_memory": True, "prefault": True}]  # page-locked at start, its pages touched first
    assert arena.nbytes == 8 * mib and cfg.cpu_cache_bytes == 7 * mib  # cache kept whole
    # at most max_cpu_adapters (+ the fetches in flight) adapters: the arena is not sized for 700 MiB
    cfg = ExecutorConfig(model="m", device="cuda", cpu_cache_bytes=700 * mib, max_cpu_adapters=2, max_concurrent_loads=4)
    assert build.pinned_arena(cfg, adapter_bytes=mib).nbytes == 8 * mib  # 6 MiB / (7/8), whole huge pages
    cfg = ExecutorConfig(model="m", device="cuda", cpu_cache_bytes=1 << 30)
    with caplog.at_level("WARNING", logger="loraserve.executor.build"):
        arena = build.pinned_arena(cfg)  # at most 3/4 of the host memory: the cache is held to 7/8 of that
    assert arena.nbytes == 768 * mib and cfg.cpu_cache_bytes == 672 * mib
    assert "CPU cache held to 7/8 of the arena" in caplog.text

    def refuse(n, **kw):
        raise RuntimeError("page-locking the pinned arena's bytes failed (cudaHostRegister error 2)")

    monkeypatch.setattr(build, "PinnedArena", refuse)
    cfg = ExecutorConfig(model="m", device="cuda", cpu_cache_bytes=7 * mib)
    with caplog.at_level("WARNING", logger="loraserve.executor.build"):
        assert build.pinned_arena(cfg) is None and cfg.cpu_cache_bytes == 7 * mib
    assert "pinned arena off: page-locking the pinned arena's bytes failed" in caplog.text


def test_a_closed_arena_hands_out_nothing_and_refuses_to_close_under_live_blocks():
    a = arena()
    block = a.allocate(ALIGN)
    with pytest.raises(RuntimeError, match="pinned arena closed with 1 blocks in use"):
        a.close()
    a.give_back(block)
    a.close()
    assert a.closed and a.allocate(ALIGN) is None
