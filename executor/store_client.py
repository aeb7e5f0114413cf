"""The executor's side of the store contract: declare the layout, stream shards into host tensors.

Every store call is bounded: a unary call by `timeout_s`, a shard stream by `timeout_s` between
two messages (a large shard may take longer in all, a stalled store may not). The channel
reconnects at most MAX_RECONNECT_BACKOFF_MS after the store answers again (gRPC's default backoff
grows to two minutes with the outage), and `watch` checks the store's health every second so
that work on adapters this executor already holds never waits on a store that does not answer.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safetensors.torch import load as st_load

from loraserve.client import ShardAssembler
from loraserve.errors import StatusError, unavailable
from loraserve.tls import ClientTls, secure_or_insecure_channel
from loraserve.v1 import adapter_store_pb2 as spb
from loraserve.v1 import adapter_store_pb2_grpc as spb_grpc
from loraserve.v1 import common_pb2 as pb

log = logging.getLogger(__name__)
DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
STORE_SERVICE = "loraserve.v1.AdapterStore"
MAX_RECONNECT_BACKOFF_MS = 1000
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
]
HEALTH_INTERVAL_S = 1.0


class StoreClient:
    """Fetches this rank's shard of an adapter for the executor's layout (grpc.aio)."""

    def __init__(self, address: str, layout: pb.Layout, rank: pb.ShardRank | None = None, timeout_s: float = 5.0,
                 tls: ClientTls | None = None):
        self.address = address
        self.tls = tls
        self.layout = layout
        self.rank = rank or pb.ShardRank()
        self.timeout_s = timeout_s
        self.channel: grpc.aio.Channel | None = None  # opened on first use, on the serving loop
        self.answering = True  # the last health check's answer (watch); True until one fails

    def _stub(self) -> spb_grpc.AdapterStoreStub:
        return spb_grpc.AdapterStoreStub(self._channel())

    def _channel(self) -> grpc.aio.Channel:
        if self.channel is None:
            self.channel = secure_or_insecure_channel(self.address, self.tls, CHANNEL_OPTIONS, aio=True)
        return self.channel

    async def fetch_shard(self, name: str, digest: str = "") -> tuple[str, int, dict[str, torch.Tensor], int]:
        """(digest, rank, tensors, bytes) of one adapter; the SlotManager's fetch function.
        digest: that version only (FAILED_PRECONDITION if the store now has another)."""
        t0 = time.perf_counter()
        req = spb.FetchShardRequest(name=name, layout=self.layout, rank=self.rank, digest=digest)
        asm = ShardAssembler()
        call = self._stub().FetchShard(req)
        try:
            while (chunk := await self._next(call, name)) is not grpc.aio.EOF:
                asm.add(chunk)
        except grpc.aio.AioRpcError as e:
            raise self._error(e, f"; adapter {name!r} cannot be loaded now") from None
        finally:
            call.cancel()  # a no-op once the stream has ended
        header, blob = asm.result()
        tensors = st_load(blob)
        log.info("fetched %s (%s%s) from store %s: %d bytes (%s) in %.3fs", name, header.manifest.digest[:12],
                 f", tp rank {self.rank.tp_rank}" if self.layout.tp_size > 1 else "", self.address, len(blob),
                 header.cache_tier, time.perf_counter() - t0)
        return header.manifest.digest, header.manifest.rank, tensors, len(blob)

    async def _next(self, call, name: str):
        """The stream's next message (or EOF), waiting at most timeout_s for it."""
        try:
            return await asyncio.wait_for(call.read(), self.timeout_s)
        except asyncio.TimeoutError:
            raise unavailable(f"adapter store at {self.address} did not answer within {self.timeout_s:g}s "
                              f"(store_timeout_s); adapter {name!r} cannot be loaded now") from None

    async def current_digest(self, name: str) -> str:
        """The digest the store now has for `name`; "" if it has none. UNAVAILABLE when it is down."""
        try:
            manifest = await self._stub().GetAdapter(spb.GetAdapterRequest(name=name), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return ""
            raise self._error(e) from None
        return manifest.digest

    async def list_adapters(self) -> list[pb.AdapterManifest]:
        """Every adapter the store has, page by page (for the HTTP front's GET /v1/models)."""
        manifests, token = [], ""
        while True:
            try:
                page = await self._stub().ListAdapters(spb.ListAdaptersRequest(page_size=1000, page_token=token),
                                                       timeout=min(self.timeout_s, 10.0))
            except grpc.aio.AioRpcError as e:
                raise self._error(e) from None
            manifests += page.adapters
            token = page.next_page_token
            if not token:
                return manifests

    def _error(self, e: grpc.aio.AioRpcError, unavailable_detail: str = "") -> StatusError:
        """The store's error as ours: UNAVAILABLE (naming the store) when it is down or too slow."""
        if e.code() in DOWN:
            return unavailable(f"adapter store at {self.address} is unavailable ({e.details()}){unavailable_detail}")
        return StatusError(e.code(), e.details())

    async def watch(self, interval_s: float = HEALTH_INTERVAL_S) -> None:
        """Checks the store's health every interval_s (until cancelled) and keeps `answering`.
        The steady calls also keep the channel reconnecting while the store is away."""
        stub = health_pb2_grpc.HealthStub(self._channel())
        request = health_pb2.HealthCheckRequest(service=STORE_SERVICE)
        while True:
            try:
                reply = await stub.Check(request, timeout=max(interval_s, 1.0))
                answering, why = reply.status == health_pb2.HealthCheckResponse.SERVING, "not serving"
            except grpc.aio.AioRpcError as e:
                answering, why = False, f"{e.code().name}: {e.details()}"
            if answering != self.answering:
                if answering:
                    log.info("adapter store at %s answers again", self.address)
                else:
                    log.warning("adapter store at %s does not answer its health check (%s); held adapters "
                                "serve without asking it", self.address, why)
            self.answering = answering
            await asyncio.sleep(interval_s)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()
