"""A cached shard read ahead of its stream by a thread of its own.

FetchShard's disk and Redis tiers stream a shard as it is read. Each chunk's read (a file read or a
Redis GET, and its hash when the copy is checked) runs off the event loop. Handing every 1 MiB
chunk to an executor thread and back costs the store ~0.16 CPU s/GB of its ~0.7: a future, a queue
put, a thread wake-up and a wake-up of the loop per chunk.
Here one thread per stream reads up to `depth` chunks ahead into a deque; the loop takes ready
chunks without a hand-off and is woken only when it has caught up with the reader, and the reader
waits on a semaphore the loop releases once per chunk it takes.

Cancellation (a client gone): the reader thread ends after the read in flight, before any other
read, and closes the shard's reader itself, so the reader is closed only after the last read and no
read starts after the close; the stream's end waits for that, through any cancellation.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable

from loraserve.serving import outlast_cancellation

DEPTH = 2  # chunks read ahead of the stream (each one chunk of memory while queued; 2 and 4 measured alike)


def _start_thread(run: Callable[[], None]) -> None:
    threading.Thread(target=run, name="shard-read-ahead", daemon=True).start()


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


async def read_ahead(
    reader, read: Callable[[object], bytes], failed: Callable[[], BaseException], depth: int = DEPTH
) -> AsyncIterator[bytes]:
    """read(reader) -> the next message (b"" at the end), called in a thread of its own up to
    `depth` messages ahead of what is taken; yields them in order. After the last read the thread
    runs reader.finish() (the copy's check): False raises failed() in the stream. Once the stream
    has begun (its first item asked for), reader.close() runs as the thread ends, on every path; an
    exception of read or finish is raised in the stream. Each stream holds up to depth + 1 messages
    (those queued and the one being sent) and a thread while it runs."""
    loop = asyncio.get_running_loop()
    ready: deque = deque()  # ("data", message) | ("end", finish's result) | ("error", exception)
    lock = threading.Lock()  # guards `ready` and `waiting` between the thread and the loop
    space = threading.Semaphore(depth)
    waiting: list[asyncio.Future] = []  # the loop's future while it waits for the reader
    stop = threading.Event()
    ended = loop.create_future()

    def wake(future: asyncio.Future) -> None:
        try:
            loop.call_soon_threadsafe(_resolve, future)
        except RuntimeError:  # the loop is closed (the process is going down): nobody waits
            pass

    def put(item: tuple) -> None:
        with lock:
            ready.append(item)
            waiter = waiting.pop() if waiting else None
        if waiter is not None:
            wake(waiter)

    def run() -> None:
        try:
            while True:
                space.acquire()
                if stop.is_set():
                    return
                message = read(reader)
                if not message:
                    put(("end", reader.finish()))
                    return
                put(("data", message))
        except BaseException as exc:
            put(("error", exc))
        finally:
            try:
                reader.close()
            finally:
                wake(ended)

    started = False
    try:
        _start_thread(run)
        started = True
        while True:
            with lock:
                item = ready.popleft() if ready else None
                if item is None:
                    waiter = loop.create_future()
                    waiting.append(waiter)
            if item is None:
                await waiter
                with lock:
                    item = ready.popleft()
            kind, value = item
            if kind == "error":
                raise value
            if kind == "end":
                if not value:
                    raise failed()
                return
            space.release()
            yield value
    finally:  # through a cancellation too: the read in flight ends, then the thread closes the reader
        stop.set()
        space.release()  # a thread waiting for room sees the stop
        if started:
            await outlast_cancellation(ended)
        else:  # no thread (e.g. the process is out of threads): nothing reads, close it here
            await outlast_cancellation(loop.run_in_executor(None, reader.close))
