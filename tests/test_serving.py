"""loraserve/serving.py's helpers that are not a server: waiting out a thread's call."""

from __future__ import annotations

import asyncio
import threading
import time

from loraserve.serving import outlast_cancellation


def test_a_cancellation_during_outlast_cancellation_waits_for_the_call_and_is_raised_after_it():
    """A task cancelled while it waits out a thread's call (a clean-up: a reader closing) ends
    only once the call has, and ends cancelled: the cancellation is neither lost nor early, and
    keeps the message its canceller gave."""
    release, finished = threading.Event(), []

    def call():
        release.wait(10)
        time.sleep(0.05)
        finished.append(time.monotonic())

    async def main():
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(outlast_cancellation(loop.run_in_executor(None, call)))
        await asyncio.sleep(0.05)
        task.cancel("the client left")
        await asyncio.sleep(0.05)
        early = task.done()
        release.set()
        try:
            await task
        except asyncio.CancelledError as e:
            return early, f"cancelled: {e.args}", time.monotonic()
        return early, "returned", time.monotonic()

    early, how, ended = asyncio.run(main())
    assert (early, how) == (False, "cancelled: ('the client left',)")
    assert finished and finished[0] <= ended


def test_outlast_cancellation_returns_after_a_call_that_failed_without_raising_its_error():
    def call():
        raise ValueError("the reader's close failed")

    async def main():
        await outlast_cancellation(asyncio.get_running_loop().run_in_executor(None, call))
        return "returned"

    assert asyncio.run(main()) == "returned"
