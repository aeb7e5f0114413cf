"""Slot copies (executor/slot_copies.py): where a copy into a slot runs, and a caller cancelled
while a copy or clear runs on the copy thread."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from loraserve.executor.slot_copies import SlotCopier


async def test_a_cancelled_wait_for_the_copy_thread_ends_only_after_the_threads_call():
    """A thread's call cannot be stopped: a caller cancelled while waiting for a copy or clear there
    (a shutdown), even twice, gets its cancellation only once the call has ended, so what it then
    frees (a slot) is not being written any more."""
    copier = SlotCopier(lambda slot, tensors: None, lambda slot: None, max_loras=1, device=torch.device("cpu"))
    started, release, ended = threading.Event(), threading.Event(), []

    def slow_clear():
        started.set()
        release.wait(10)
        ended.append(True)

    waiting = asyncio.ensure_future(copier.on_thread(slow_clear))
    await asyncio.to_thread(started.wait, 10)
    threading.Timer(0.3, release.set).start()
    waiting.cancel()
    await asyncio.sleep(0.05)
    waiting.cancel()  # again (a shutdown after a client's cancel): still after the call only
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert ended == [True]


async def test_a_copy_sets_the_slots_rank_and_a_clear_zeroes_it():
    """The rank the copy function returns is what the kernels read for the slot; None reads as the
    full rank; a cleared slot reads 0."""
    from loraserve.kernels.meta import FULL_RANK

    cleared, ranks = [], iter([8, None])
    copier = SlotCopier(lambda slot, tensors: next(ranks), cleared.append, max_loras=2, device=torch.device("cpu"))
    assert await copier.copy_in(1, {}) is None and copier.slot_ranks == [FULL_RANK, 8]  # no event on the CPU
    await copier.copy_in(0, {})
    assert copier.slot_ranks == [FULL_RANK, 8]
    await copier.clear(1)
    assert copier.slot_ranks == [FULL_RANK, 0] and cleared == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the slot copy stream")
def test_a_loop_queued_copy_runs_on_the_copy_stream_and_puts_back_every_devices_stream_and_the_device():
    """A copy queued from the loop is begun (`queued_copy`: its staging copy queued) and finished on
    the copy stream; after it the loop thread's current device and each device's current stream are
    as they were: with slots on the last GPU while device 0 is current (a multi-GPU host), and on the
    current device itself. A copy that is not queued leaves them too, and runs on the copy thread."""
    seen = []

    def queued(slot, tensors):
        seen.append(("begun", torch.cuda.current_device(), torch.cuda.current_stream()))
        if tensors.get("host work"):
            return None

        def finish():
            seen.append(("finished", torch.cuda.current_device(), torch.cuda.current_stream()))
            return 8

        return finish

    def copy(slot, tensors):
        seen.append(("thread", torch.cuda.current_device(), torch.cuda.current_stream()))
        return 4

    for index in sorted({0, torch.cuda.device_count() - 1}):
        torch.cuda.set_device(0)
        copier = SlotCopier(copy, lambda slot: None, max_loras=1, device=torch.device("cuda", index), queued_copy=queued)
        before = [torch.cuda.current_stream(d) for d in range(torch.cuda.device_count())]
        for tensors, rank, steps in (({}, 8, ("begun", "finished")), ({"host work": True}, 4, ("begun", "thread"))):
            seen.clear()
            event = asyncio.run(copier.copy_in(0, tensors))
            assert seen == [(step, index, copier.stream) for step in steps]
            assert torch.cuda.current_device() == 0
            assert [torch.cuda.current_stream(d) for d in range(torch.cuda.device_count())] == before
            assert copier.slot_ranks[0] == rank and event is not None
            event.synchronize()
        copier.close()
