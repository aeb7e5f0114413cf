"""Slot copies: an adapter's host shard copied into a GPU slot, and a slot cleared, without blocking
the forward passes of other adapters.

On CUDA every copy runs on one side stream, the copy stream. A copy that only queues device work
(`queued_copy`: pinned host memory, a layout planned and its tables built before; ~0.5-0.8 ms of host
time) is queued from the event loop itself: handing it to a thread costs interpreter-lock hand-offs
that lengthen the steps' gaps while cold loads run. Clears, a layout's first load (its checks) and
copies out of pageable memory (whose "async" copy waits for the bytes) run in turn on one thread
whose current stream is the copy stream, set once when it starts. On the CPU copies run on the
loop's default executor, side by side. A copy's event, recorded after it on the copy stream, tells
the steps when the slot may be read (None on the CPU).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from loraserve.kernels.meta import FULL_RANK
from loraserve.serving import outlast_cancellation

# copy_into_slot(slot, tensors) -> the slot's rank as its kernels may read it (None: FULL_RANK)
CopyIntoSlot = Callable[[int, dict[str, torch.Tensor]], int | None]
# queued_copy(slot, tensors) -> a function that finishes the copy begun and returns what copy_into_slot would; None
QueuedCopy = Callable[[int, dict[str, torch.Tensor]], Callable[[], int | None] | None]


def _use_stream(stream: torch.cuda.Stream) -> None:
    """The copy thread's start: its device and current stream are the copy stream's from then on."""
    torch.cuda.set_device(stream.device)
    torch.cuda.set_stream(stream)


class SlotCopier:
    def __init__(
        self,
        copy_into_slot: CopyIntoSlot,
        clear_slot: Callable[[int], None],
        *,
        max_loras: int,
        device: torch.device,
        queued_copy: QueuedCopy | None = None,
        trace: Callable[[str], None] | None = None,
    ):
        """copy_into_slot copies on the copy thread (CUDA, with the copy stream current) or in the
        loop's executor (CPU). queued_copy(slot, tensors), called with the copy stream current: where
        copying these into that slot only queues device work (CUDA; executor/slot_load.py
        `queued_load`), the copy begun, as a function that finishes it; else None, having queued
        nothing. Either raises ValueError for a shard the model refuses. trace("copied") is told
        after each copy's event is recorded (SlotManager's `trace`)."""
        self._copy_into_slot, self._clear_slot, self.queued_copy = copy_into_slot, clear_slot, queued_copy
        self._trace = trace
        # Each slot's adapter rank as the LoRA kernels may read it (LoraMeta.slot_ranks): what the
        # copy function returns (the largest rank the shard holds), FULL_RANK when it says nothing,
        # 0 once cleared. Written when a copy is issued, before any step uses the slot.
        self.slot_ranks: list[int] = [FULL_RANK] * max_loras
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._thread = None  # None: the loop's default executor
        if self.stream is not None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="slot-copy", initializer=_use_stream, initargs=(self.stream,))

    async def copy_in(self, slot: int, tensors: dict[str, torch.Tensor]) -> torch.cuda.Event | None:
        """Copies the shard into the slot: from the loop itself when that only queues device work
        (`queued_copy`), else on the copy thread; returns the copy's event (None on the CPU)."""
        if self.queued_copy is not None:
            with self.stream_current():
                finish = self.queued_copy(slot, tensors)
                if finish is not None:
                    return self.copied(slot, finish())
        return await self.on_thread(self._copy, slot, tensors)

    async def clear(self, slot: int) -> None:
        """Zeroes the slot where copies run; its rank reads 0 from now on."""
        await self.on_thread(self._clear, slot)

    @contextlib.contextmanager
    def stream_current(self):
        """On CUDA, the copy stream current on this thread (the loop's) inside, and after it the
        thread's current device and each device's current stream as they were; nothing on the CPU."""
        if self.stream is None:
            yield
            return
        # This switch is on a cold load's path before its host -> device copy is queued: streams are
        # looked up by device index (a torch.device without one takes a slower lookup), and the
        # loop's device is set back only where it is not the copy stream's. Each device has its own
        # current stream: what is put back is the copy stream's device's, whatever device is current.
        device, copy_device = torch.cuda.current_device(), self.stream.device_index
        main = torch.cuda.current_stream(copy_device)
        torch.cuda.set_stream(self.stream)  # (and its device)
        try:
            yield
        finally:
            torch.cuda.set_stream(main)  # (and its device: the copy stream's)
            if device != copy_device:
                torch.cuda.set_device(device)

    async def on_thread(self, fn: Callable, *args):
        """fn(*args) where slot copies run. If the caller is cancelled meanwhile, the call still
        runs to its end (a thread cannot be stopped): the caller's cancellation is raised only
        after it, so whatever the caller then frees (a slot) is no longer being written."""
        future = asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            await outlast_cancellation(future)
            raise

    def copied(self, slot: int, rank: int | None) -> torch.cuda.Event | None:
        """After a copy into the slot was queued: the slot's rank as its copy function returned it,
        and on CUDA an event recorded after the copy, on the copy stream (current here)."""
        event = None
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(self.stream)
        self.slot_ranks[slot] = rank if isinstance(rank, int) else FULL_RANK
        if self._trace is not None:
            self._trace("copied")
        return event

    def close(self) -> None:
        """Lets the copy thread end once its queued work is done (the executor's shutdown)."""
        if self._thread is not None:
            self._thread.shutdown(wait=False)

    def _copy(self, slot: int, tensors: dict[str, torch.Tensor]) -> torch.cuda.Event | None:
        return self.copied(slot, self._copy_into_slot(slot, tensors))

    def _clear(self, slot: int) -> None:
        self.slot_ranks[slot] = 0
        self._clear_slot(slot)
