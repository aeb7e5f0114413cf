"""One error type that carries its gRPC status, mapped to the wire at the service edge only."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging

import grpc

log = logging.getLogger(__name__)


RETRY_AFTER_KEY = "loraserve-retry-after-ms"  # trailing metadata: busy now, ask again after this many ms


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
    return StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, message,
                       trailers=((RETRY_AFTER_KEY, str(max(1, round(retry_after_s * 1000)))),))


def retry_after_s(e: grpc.aio.AioRpcError) -> float | None:
    """The retry hint of a `busy` error received by a client, in seconds; None for any other error."""
    if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    for key, value in e.trailing_metadata() or ():
        if key == RETRY_AFTER_KEY:
            try:
                return max(0.0, int(value) / 1000)
            except ValueError:
                return None
    return None


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
            except Exception as exc:  # noqa: BLE001 - mapped to a status, never swallowed
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
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc)

    return unary_wrapper
