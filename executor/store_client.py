"""The executor's side of the store contract: declare the layout, stream shards into host tensors."""

from __future__ import annotations

import logging
import time

import grpc
import torch
from safetensors.torch import load as st_load

from loraserve.client import ShardAssembler
from loraserve.errors import StatusError, unavailable
from loraserve.v1 import adapter_store_pb2 as spb
from loraserve.v1 import adapter_store_pb2_grpc as spb_grpc
from loraserve.v1 import common_pb2 as pb

log = logging.getLogger(__name__)
DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class StoreClient:
    """Fetches this rank's shard of an adapter for the executor's layout (grpc.aio)."""

    def __init__(self, address: str, layout: pb.Layout, rank: pb.ShardRank | None = None, timeout_s: float = 120.0):
        self.address = address
        self.layout = layout
        self.rank = rank or pb.ShardRank()
        self.timeout_s = timeout_s
        self.channel: grpc.aio.Channel | None = None  # opened on first use, on the serving loop

    def _stub(self) -> spb_grpc.AdapterStoreStub:
        if self.channel is None:
            self.channel = grpc.aio.insecure_channel(self.address)
        return spb_grpc.AdapterStoreStub(self.channel)

    async def fetch_shard(self, name: str) -> tuple[str, int, dict[str, torch.Tensor], int]:
        """(digest, rank, tensors, bytes) of one adapter; the SlotManager's fetch function."""
        t0 = time.perf_counter()
        req = spb.FetchShardRequest(name=name, layout=self.layout, rank=self.rank)
        asm = ShardAssembler()
        try:
            async for chunk in self._stub().FetchShard(req, timeout=self.timeout_s):
                asm.add(chunk)
        except grpc.aio.AioRpcError as e:
            raise self._error(e, f"; adapter {name!r} cannot be loaded now") from None
        header, blob = asm.result()
        tensors = st_load(blob)
        log.info("fetched %s (%s) from store %s: %d bytes (%s) in %.3fs", name, header.manifest.digest[:12],
                 self.address, len(blob), header.cache_tier, time.perf_counter() - t0)
        return header.manifest.digest, header.manifest.rank, tensors, len(blob)

    async def current_digest(self, name: str) -> str:
        """The digest the store now has for `name`; "" if it has none. UNAVAILABLE when it is down."""
        try:
            manifest = await self._stub().GetAdapter(spb.GetAdapterRequest(name=name), timeout=min(self.timeout_s, 10.0))
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

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()
