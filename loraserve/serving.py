"""What both services share about running a gRPC server: listening, TLS, health, reflection, a clean stop.

- `start_server` binds without SO_REUSEPORT (gRPC's default turns it on, which lets a second
  server share a busy port and split its connections) and fails with "could not listen on
  HOST:PORT: address in use" instead.
- `start_server(..., tls=ServerTls(...))` serves TLS (mutual TLS with a client CA) instead of
  plaintext; every server also serves gRPC server reflection (so `grpcurl` works) for its
  services and the health service.
- Health reports NOT_SERVING until `RunningServer.set_serving()` when the server is started
  with `serving=False` (the executor, while its model loads), and again from the drain on.
- `RunningServer.drain(grace_s)` is the one way to stop: health goes NOT_SERVING, new RPCs are
  refused, in-flight ones get `grace_s` to finish; those still running then end UNAVAILABLE with a
  message that names the service, the grace and what to do ("the executor is shutting down: this
  stream was cut at the end of its 30 s drain grace; retry on another replica"), not with gRPC's
  bare "Cancelling all calls".
- `wait_for_stop_signal` turns SIGTERM (Kubernetes) and SIGINT (Ctrl-C) into that same drain.
- `outlast_cancellation(future)`: cleanup that must wait for a thread's call (which cannot be
  stopped) even while the task doing it is cancelled (a client gone, a shutdown); the
  cancellation is raised once the call is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import inspect
import logging
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from loraserve.tls import ServerTls

log = logging.getLogger(__name__)

SERVER_OPTIONS = [("grpc.so_reuseport", 0)]
# For connections that carry shards (store server, the executor's store channel): HTTP/2 frames,
# socket reads and write batches of up to 4 MiB instead of gRPC's 16 KiB frames and small reads,
# so a 1 MiB chunk costs a few syscalls and frame headers rather than dozens: it roughly doubles a
# bare gRPC stream's throughput on loopback.
BULK_OPTIONS = [
    ("grpc.http2.max_frame_size", 4 << 20),
    ("grpc.http2.write_buffer_size", 4 << 20),
    ("grpc.experimental.tcp_read_chunk_size", 4 << 20),
    ("grpc.experimental.tcp_min_read_chunk_size", 1 << 20),
    ("grpc.experimental.tcp_max_read_chunk_size", 4 << 20),
]
DEFAULT_DRAIN_GRACE_S = 20.0  # deploy/helm's terminationGracePeriodSeconds leaves room beyond it
# A call cut at the end of a drain's grace has this long to end (its handler's clean-up, and its
# status reaching the client behind any responses the client has not read yet) before gRPC's own
# stop cancels whatever still runs ("Cancelling all calls").
CUT_MARGIN_S = 1.0


class ListenError(RuntimeError):
    """The service could not bind its address (in use, not an address of this host, ...)."""


def check_listen(listen: str) -> None:
    """Fails early (before loading a model) when `listen` cannot be bound; the real bind follows."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not "in use"
            s.bind((host, int(port)))
    except OSError as e:
        reason = "address in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
        raise ListenError(f"could not listen on {listen}: {reason}") from None
    except ValueError:
        raise ListenError(f"could not listen on {listen}: not a host:port address") from None


@dataclass(eq=False)
class _Call:
    task: asyncio.Task  # the one gRPC runs the call's handler in
    kind: str  # "call" (a unary response) or "stream"
    cut: str = ""  # the UNAVAILABLE message, once a drain has cut the call


class InFlight(grpc.aio.ServerInterceptor):
    """The calls a server is running (every method of every service), so that a drain can end
    those still running at the end of its grace with UNAVAILABLE and a message of its own."""

    def __init__(self):
        self.calls: set[_Call] = set()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        kind = "stream" if handler.response_streaming else "call"
        for field_name in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            behavior = getattr(handler, field_name)
            if inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior):
                return handler._replace(**{field_name: self._tracked(behavior, kind)})
        return handler  # a method run in a thread (none here): gRPC's stop cancels it

    def cut(self, message: Callable[[str], str]) -> int:
        """Ends every call in flight with UNAVAILABLE and message(kind), kind "call" or "stream"
        (the handler is cancelled at the await it is at; its clean-up runs); returns how many."""
        calls = [c for c in self.calls if not c.cut]
        for call in calls:
            call.cut = message(call.kind)
            call.task.cancel(call.cut)
        return len(calls)

    def _tracked(self, behavior, kind: str):
        """`behavior` as a coroutine that registers its call while it runs and turns a drain's cut
        into its status. A streamed response's generator is written out here (context.write), not
        by gRPC: so a cut that finds the call waiting to send (flow control) lands in this frame too."""
        streamed = inspect.isasyncgenfunction(behavior)

        async def tracked(request, context):
            call = _Call(asyncio.current_task(), kind)
            self.calls.add(call)
            try:
                if not streamed:
                    return await behavior(request, context)
                async with contextlib.aclosing(behavior(request, context)) as responses:
                    async for response in responses:
                        await context.write(response)
            except asyncio.CancelledError:
                if not call.cut or context.cancelled():  # the client left, or a cancellation not ours
                    raise
                call.task.uncancel()
                await context.abort(grpc.StatusCode.UNAVAILABLE, call.cut)
            finally:
                self.calls.discard(call)

        return tracked


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    services: tuple[str, ...] = ()
    metrics_port: int = 0  # the /metrics port, when the service serves one
    on_drain: list[Callable[[float], None]] = field(default_factory=list)  # told the grace first
    name: str = "server"  # what a client is told is shutting down ("executor", "adapter store")
    in_flight: InFlight = field(default_factory=InFlight)  # the interceptor of `server`

    async def set_serving(self) -> None:
        for name in ("", *self.services):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def drain(self, grace_s: float) -> None:
        """Stops accepting RPCs and gives the in-flight ones `grace_s` seconds; those still running
        then end UNAVAILABLE ("the NAME is shutting down: this stream was cut at the end of its
        GRACE s drain grace; retry on another replica"). Returns once every call has ended."""
        await self.health.enter_graceful_shutdown()
        for hook in self.on_drain:
            hook(grace_s)
        stopping = asyncio.ensure_future(self.server.stop(grace_s + CUT_MARGIN_S))
        await asyncio.wait([stopping], timeout=grace_s)
        if not stopping.done():
            cut = self.in_flight.cut(
                lambda kind: (
                    f"the {self.name} is shutting down: this {kind} was cut at the end of its "
                    f"{grace_s:g} s drain grace; retry on another replica"
                )
            )
            if cut:
                log.info(
                    "%s: %d call(s) still running at the end of the %g s drain grace: cut (UNAVAILABLE)", self.name, cut, grace_s
                )
        await stopping

    # The grpc.aio.Server calls tests and callers use.
    async def stop(self, grace_s: float | None) -> None:
        await self.drain(grace_s or 0.0)

    async def wait_for_termination(self) -> bool:
        return await self.server.wait_for_termination()


async def start_server(
    listen: str,
    add_servicers: Callable[[grpc.aio.Server], None],
    services: tuple[str, ...],
    tls: ServerTls | None = None,
    serving: bool = True,
    options: list[tuple[str, int]] = (),
    name: str = "server",
) -> RunningServer:
    """A started gRPC server on `listen` with the standard health service SERVING for `services`
    (NOT_SERVING until `set_serving()` when `serving` is False) and server reflection; `name` is
    what its drain tells the clients it cuts is shutting down.
    `add_servicers` runs once the address is bound, so a service that fails to listen has not
    touched its data yet (the store cleans its staging folder when it is built)."""
    in_flight = InFlight()
    server = grpc.aio.server(options=SERVER_OPTIONS + list(options), interceptors=[in_flight])
    credentials = tls.credentials() if tls is not None else None  # a bad file fails before the bind
    try:
        port = server.add_secure_port(listen, credentials) if credentials else server.add_insecure_port(listen)
    except RuntimeError:
        port = 0
    if port == 0:
        check_listen(listen)  # says why, if the OS does
        raise ListenError(f"could not listen on {listen}")
    add_servicers(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*services, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    await server.start()
    running = RunningServer(server, port, health_servicer, tuple(services), name=name, in_flight=in_flight)
    if serving:
        await running.set_serving()
    else:
        for name in ("", *services):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    return running


async def wait_for_stop_signal() -> str:
    """Waits for SIGTERM or SIGINT and returns its name. While it waits, neither kills the
    process; after it returns, a second Ctrl-C does (the default handlers are back)."""
    loop = asyncio.get_running_loop()
    got: asyncio.Future[str] = loop.create_future()
    sigs = (signal.SIGTERM, signal.SIGINT)
    for sig in sigs:
        loop.add_signal_handler(sig, lambda s=sig: got.done() or got.set_result(s.name))
    try:
        return await got
    finally:
        for sig in sigs:
            loop.remove_signal_handler(sig)


async def outlast_cancellation(future: asyncio.Future) -> None:
    """Waits until `future` (a thread's call, e.g. from `run_in_executor`) is done, through any
    cancellation of the waiting task meanwhile, and retrieves its exception so that none goes
    unreported as "never retrieved". A cancellation that arrives during the wait is raised once the
    call is done (it was swallowed before: a clean-up cancelled midway went on as if it had not
    been); a caller cancelled before it called this re-raises its own once this returns."""
    cancelled: asyncio.CancelledError | None = None
    while not future.done():
        try:
            await asyncio.wait([future])
        except asyncio.CancelledError as e:  # kept whole: its message says who cancelled
            cancelled = cancelled or e
    if not future.cancelled():
        future.exception()
    if cancelled is not None:
        raise cancelled
