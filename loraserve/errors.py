"""One error type that carries its gRPC status, mapped to the wire at the service edge only."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import random
import time

import grpc

log = logging.getLogger(__name__)


RETRY_AFTER_KEY = "loraserve-retry-after-ms"  # trailing metadata: busy now, ask again after this many ms
BUSY_RETRY_S = 30.0  # how long a store client asks a busy store again by default (BusyBackoff's budget)
BUSY_PAUSE_MIN_S = 0.05  # a client's shortest pause between two asks (a hint of 0 would make a tight loop)
BUSY_BACKOFF_MAX_S = 2.0  # its longest pause between two asks, before its jitter (+0-25%)


class StatusError(Exception):
    """A failure a client can act on: a gRPC status code and a message naming the fault, and any
    trailing metadata for the client (e.g. RETRY_AFTER_KEY)."""

    def __init__(self, code: grpc.StatusCode, message: str, trailers: tuple[tuple[str, str], ...] = ()):
        super().__init__(message)
        self.code = code
        self.message = message
        self.trailers = trailers

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


def invalid(message: str) -> StatusError:
    return StatusError(grpc.StatusCode.INVALID_ARGUMENT, message)


def not_found(message: str) -> StatusError:
    return StatusError(grpc.StatusCode.NOT_FOUND, message)


def precondition(message: str) -> StatusError:
    return StatusError(grpc.StatusCode.FAILED_PRECONDITION, message)


def exhausted(message: str) -> StatusError:
    return StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


def unavailable(message: str) -> StatusError:
    return StatusError(grpc.StatusCode.UNAVAILABLE, message)


def busy(message: str, retry_after_s: float) -> StatusError:
    """RESOURCE_EXHAUSTED for a server that is busy now and expects to have room soon: the
    trailer RETRY_AFTER_KEY tells a client when to ask again (other RESOURCE_EXHAUSTED errors,
    e.g. every slot pinned, carry none and are not worth asking again at once)."""
    return StatusError(
        grpc.StatusCode.RESOURCE_EXHAUSTED, message, trailers=((RETRY_AFTER_KEY, str(max(1, round(retry_after_s * 1000)))),)
    )


def retry_after_s(e: grpc.RpcError) -> float | None:
    """The retry hint of a `busy` error received by a client (grpc.aio's or the blocking API's), in
    seconds; None for any other error."""
    if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    for key, value in e.trailing_metadata() or ():
        if key == RETRY_AFTER_KEY:
            try:
                return max(0.0, int(value) / 1000)
            except ValueError:
                return None
    return None


class BusyBackoff:
    """When a client of the adapter store asks again after `busy` refusals (both the executor's
    store client and the Python client's): after the store's hint, then twice the last pause
    (BUSY_PAUSE_MIN_S to BUSY_BACKOFF_MAX_S, or the hint where it is longer; each lengthened by a
    random 0-25% so that clients refused together do not ask together), until budget_s have passed
    since the first refused ask began. One per fetch: a retry of the same fetch for another reason
    (DATA_LOSS) shares it, and time the store spent serving is not counted."""

    def __init__(self, budget_s: float):
        self.budget_s = budget_s
        self.started: float | None = None  # when the first refused ask began (time.monotonic)
        self.asks = 0  # refusals so far
        self._pause = 0.0

    def busy_for(self) -> float:
        return 0.0 if self.started is None else time.monotonic() - self.started

    def next_pause(self, hint: float, asked_at: float) -> float | None:
        """Counts one refusal of an ask begun at `asked_at` (time.monotonic): the seconds to wait
        before asking again, None once the budget is spent."""
        self.asks += 1
        if self.started is None:
            self.started = asked_at
        busy_for = self.busy_for()
        if busy_for >= self.budget_s:
            return None
        self._pause = max(hint, min(max(2 * self._pause, BUSY_PAUSE_MIN_S), BUSY_BACKOFF_MAX_S))  # the hint is never cut
        return min(self._pause * random.uniform(1.0, 1.25), self.budget_s - busy_for)

    def gave_up(self, store: str, what: str, last: str) -> StatusError:
        """RESOURCE_EXHAUSTED once the budget is spent: `store` (e.g. "adapter store at HOST:PORT")
        stayed busy, so `what` (e.g. "adapter 'a' cannot be loaded now"); `last`, its last answer."""
        asks = f"{self.asks} ask" + ("s" if self.asks != 1 else "")
        return exhausted(f"{store} stayed busy for {self.busy_for():.1f}s ({asks}); {what} (the store's last answer: {last})")


DEADLINE_SLACK_S = 0.1  # an engine deadline and gRPC's, set from one time_remaining(), differ by this much at most


def _client_gone(context, exc: BaseException) -> bool:
    if context.cancelled():
        return True
    if isinstance(exc, StatusError) and exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        remaining = context.time_remaining()
        return remaining is not None and remaining <= DEADLINE_SLACK_S
    return False


def grpc_errors(method):
    """Maps StatusError (and unexpected exceptions) of an async servicer method to gRPC aborts.

    Works for unary methods (coroutines) and server-streaming ones (async generators).
    """

    async def _abort(context, exc: BaseException):
        if _client_gone(context, exc):
            # The client's deadline has passed (or it cancelled): gRPC has ended the call and
            # the client has its status. Aborting now would fail in gRPC's core and be logged
            # there as an ERROR ("ExecuteBatchError raised in core"); end as a cancelled RPC.
            log.info("%s -> %s after the client left: %s", method.__name__, getattr(exc, "code", exc), exc)
            raise asyncio.CancelledError()
        if isinstance(exc, StatusError):
            log.info("%s -> %s: %s", method.__name__, exc.code.name, exc.message)
            await context.abort(exc.code, exc.message, trailing_metadata=exc.trailers)
        log.exception("%s failed unexpectedly", method.__name__)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")

    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream_wrapper(self, request, context):
            stream = method(self, request, context)
            try:
                async for item in stream:
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await _abort(context, exc)
            finally:  # closed early (the client gone at a yield): the method's own clean-up runs now,
                await stream.aclose()  # not whenever the garbage collector finds its generator

        return stream_wrapper

    @functools.wraps(method)
    async def unary_wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, exc)

    return unary_wrapper
