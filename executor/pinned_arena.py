"""A page-locked host arena, pinned once at start, that fetched shards are carved out of.

Why: page-locking host memory holds the CUDA driver for as long as it takes (~0.55 ms per MiB on
an H100 host: ~180 ms for a rank-64 Llama-3-8B adapter), and every other CUDA call of the process
waits meanwhile: kernel launches, copies, event records. A shard landing in a fresh pinned buffer
therefore stalls the decode steps of every other request (tens of steps for 4 cold rank-64 loads,
about one step with the arena). Carving shards out of memory pinned before serving costs no driver
call while serving. The executor makes one (executor/build.py `pinned_arena`); a CPU executor's is
never page-locked: its pages are faulted in once and reused by later shards.

Lifetime: a block is handed out as a uint8 view of the arena; `adopt` ties it to the shard's
tensor dict (`ArenaShard`), and the block is released when that dict is garbage (the CPU cache
dropped it and no load still holds it). A slot copy may still be reading the block then (it is
asynchronous), so a release takes a fence from `fence()` (an event recorded on the streams that
copy out of host shards: the slot manager's copy stream) and the block is reused only once that
event has completed.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

import torch

from .memory import ARENA_CACHE_SHARE as CACHE_SHARE  # of the arena, what the CPU cache may hold
from .shard_tensors import ShardTensors

log = logging.getLogger(__name__)

ALIGN = 4096  # block alignment: page-aligned, and more than any tensor's dtype needs


class ArenaShard(ShardTensors):
    """A shard's tensors (name -> view of one arena block), whose finalizer releases the block.
    Keep passing this dict itself along; a copy of it (`dict(shard)`) does not keep the block."""

    __slots__ = ()


class PinnedArena:
    def __init__(self, nbytes: int, pin_memory: bool = True, fence: Callable[[], object] | None = None, prefault: bool = True):
        """nbytes of host memory, page-locked now when pin_memory (the only driver call it makes).
        fence: returns an object with `query() -> bool` (a CUDA event) that completes once every
        copy already issued out of host shards has; None: blocks are reusable at once (CPU).
        prefault: touch every page first (torch's intra-op threads) so that page-locking, which
        holds the driver, finds them in place rather than faulting them in one by one."""
        if nbytes <= 0:
            raise ValueError(f"pinned arena of {nbytes} bytes: must be > 0")
        t0 = time.perf_counter()
        # Anonymous pages, page-aligned (what page-locking wants), huge pages where the kernel gives them
        self._memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self._memory.madvise(mmap.MADV_HUGEPAGE)
        self.base = torch.frombuffer(self._memory, dtype=torch.uint8)
        if prefault:
            self.base.zero_()
        t1 = time.perf_counter()
        if pin_memory:  # registered, not torch.empty(pin_memory=True): that rounds up to a power of two
            err = torch.cuda.cudart().cudaHostRegister(self.base.data_ptr(), nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(
                    f"page-locking the pinned arena's {nbytes} bytes of host memory failed (cudaHostRegister error {int(err)})"
                )
        # page-locked until closed or garbage (an executor built and dropped, as in tests, gives it back)
        self._unpin = weakref.finalize(self, _unregister, self.base.data_ptr()) if pin_memory else None
        if self._unpin is not None:
            self._unpin.atexit = False  # at exit the process's memory goes anyway
        self.closed = False
        self.fault_seconds = t1 - t0  # touching the pages (prefault)
        self.pin_seconds = time.perf_counter() - t0  # all of it; the driver is held for pin_seconds - fault_seconds
        self.nbytes = nbytes
        self.fence = fence
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, size), sorted, coalesced
        self._live: dict[int, int] = {}  # offset -> size of the blocks handed out
        self._fenced: list[tuple[int, int, object]] = []  # released, waiting for their fence
        # Releases land here without the lock: a release runs from a finalizer, which the garbage
        # collector may call in any thread at any allocation, the lock's holder included.
        self._released: deque[tuple[int, object]] = deque()
        self.misses = 0  # allocations that found no room

    def close(self) -> None:
        """Unlocks the pages now (benchmarks; an executor keeps its arena until it exits). No block
        may be in use."""
        with self._lock:
            self._reclaim()
            if self._live:
                raise RuntimeError(f"pinned arena closed with {len(self._live)} blocks in use")
            for _, _, fence in self._fenced:  # copies still reading released blocks end first
                while not fence.query():
                    time.sleep(0.001)
            self.closed = True
        if self._unpin is not None:
            self._unpin()

    # ---- allocation ---------------------------------------------------------------------------

    def allocate(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 view of nbytes (an ALIGN-aligned block), or None when no free block fits."""
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        with self._lock:
            if self.closed:
                return None
            self._reclaim()
            fits = [(s, i) for i, (_, s) in enumerate(self._free) if s >= size]
            if not fits:
                self.misses += 1
                return None
            _, i = min(fits)  # best fit: the smallest block that holds it
            offset, free = self._free[i]
            if free == size:
                del self._free[i]
            else:
                self._free[i] = (offset + size, free - size)
            self._live[offset] = size
        return self.base[offset : offset + nbytes]

    def adopt(self, block: torch.Tensor, shard: ArenaShard) -> ArenaShard:
        """Releases `block` (from allocate) once `shard`, whose tensors are views of it, is garbage."""
        finalizer = weakref.finalize(shard, self.release, self.offset_of(block))
        finalizer.atexit = False  # at exit the process's memory goes anyway (and CUDA may be gone)
        return shard

    def offset_of(self, block: torch.Tensor) -> int:
        return block.data_ptr() - self.base.data_ptr()

    def holds(self, t: torch.Tensor) -> bool:
        """Whether t's memory lies in this arena."""
        return self.base.data_ptr() <= t.data_ptr() < self.base.data_ptr() + self.nbytes

    def cache_budget(self, asked: int) -> int:
        """The CPU cache's byte budget with this arena: `asked`, at most CACHE_SHARE of the arena."""
        return min(asked, int(self.nbytes * CACHE_SHARE))

    def give_back(self, block: torch.Tensor) -> None:
        """Releases `block` now if it is one of this arena's (a buffer that never became a shard)."""
        if self.holds(block):
            self.release(self.offset_of(block))

    def release(self, offset: int) -> None:
        """Gives the block at `offset` back: reusable once the fence taken now has completed."""
        self._released.append((offset, self.fence() if self.fence is not None else None))

    # ---- state --------------------------------------------------------------------------------

    def free_bytes(self) -> int:
        """Bytes in free blocks (released blocks whose fence has not completed are not counted)."""
        with self._lock:
            self._reclaim()
            return sum(s for _, s in self._free)

    def largest_free(self) -> int:
        with self._lock:
            self._reclaim()
            return max((s for _, s in self._free), default=0)

    def live_blocks(self) -> int:
        with self._lock:
            self._reclaim()
            return len(self._live)

    # ---- inside the lock ----------------------------------------------------------------------

    def _reclaim(self) -> None:
        while self._released:
            offset, fence = self._released.popleft()
            self._fenced.append((offset, self._live.pop(offset), fence))
        if not self._fenced:
            return
        waiting = []
        for offset, size, fence in self._fenced:
            if fence is None or fence.query():
                self._give_back(offset, size)
            else:
                waiting.append((offset, size, fence))
        self._fenced = waiting

    def _give_back(self, offset: int, size: int) -> None:
        i = bisect.bisect(self._free, (offset, size))
        if i > 0 and sum(self._free[i - 1]) == offset:  # joins the block before
            offset, size = self._free[i - 1][0], self._free[i - 1][1] + size
            del self._free[i - 1]
            i -= 1
        if i < len(self._free) and offset + size == self._free[i][0]:  # and the one after
            size += self._free[i][1]
            del self._free[i]
        self._free.insert(i, (offset, size))


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def stream_fence(*streams: torch.cuda.Stream) -> Callable[[], object]:
    """A fence for PinnedArena: events recorded at release time on each of `streams` (the ones
    that copy out of host shards), complete when all of them are."""

    class Fence:
        def __init__(self):
            self.events = []
            for stream in streams:
                event = torch.cuda.Event()
                event.record(stream)
                self.events.append(event)

        def query(self) -> bool:
            return all(e.query() for e in self.events)

    return Fence
