"""Small Python clients for both services (blocking), used by the CLI and by users' scripts.

store = StoreClient("127.0.0.1:50061", token=None)
store.register("pirate", "s3://bucket/adapters/pirate")
header, blob = store.fetch_shard("pirate", layout, tp_rank=1)

ex = ExecutorClient("127.0.0.1:50051")
print(ex.generate("Hello", adapter="pirate").text)

# TLS: check the server against a CA; with a client certificate for mutual TLS
store = StoreClient("store.example:50061", tls=ClientTls("ca.pem", "client.pem", "client-key.pem"))
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future

import grpc
import xxhash

from loraserve.errors import BUSY_RETRY_S, BusyBackoff, StatusError, retry_after_s
from loraserve.serving import BULK_OPTIONS
from loraserve.tls import ClientTls, secure_or_insecure_channel
from loraserve.v1 import adapter_store_pb2 as spb
from loraserve.v1 import adapter_store_pb2_grpc as spb_grpc
from loraserve.v1 import common_pb2 as pb
from loraserve.v1 import executor_pb2 as epb
from loraserve.v1 import executor_pb2_grpc as epb_grpc

log = logging.getLogger(__name__)

_DATA_TAG = 0x12  # ShardChunk.data: field 2, length-delimited


class ShardAssembler:
    """Puts a FetchShard stream back together: header, data chunks, then a checksum trailer.

    The data is hashed with xxh3-128 as it arrives and checked against the trailer's `xxh3_128`.
    A trailer with only a `sha256` (a copy the store cached before xxh3-128 was kept, or an older
    store) is checked with a sha256 pass over the whole blob at the end instead.

    `allocate(total_bytes)`, when given, returns the writable buffer (anything memoryview takes)
    that the data is copied into as it arrives, e.g. pinned host memory; otherwise the chunks are
    joined into one bytes object at the end. `add_raw` takes a message's wire bytes (a stub whose
    response_deserializer is None), so a data chunk is read in place, never parsed into a message.
    """

    def __init__(self, allocate: Callable[[int], object] | None = None, hash_thread: Executor | None = None) -> None:
        self.header: spb.ShardHeader | None = None
        self._allocate = allocate
        self._hash_thread = hash_thread  # one worker: hashes each chunk of the buffer as it lands, in order
        self._hashed: Future | None = None
        self._buffer: memoryview | None = None
        self._parts: list[bytes] = []
        self._xxh = xxhash.xxh3_128()
        self._size = 0
        self.blob: object | None = None

    def add(self, chunk: spb.ShardChunk) -> None:
        part = chunk.WhichOneof("part")
        if part == "header":
            self._header(chunk.header)
        elif part == "data":
            self._data(chunk.data)  # each access of a bytes field builds a new bytes object: read it once
        elif part == "trailer":
            self._finish(chunk.trailer)

    def add_raw(self, message: bytes) -> None:
        if message[:1] == bytes((_DATA_TAG,)):
            n, start = _varint(message, 1)
            self._data(memoryview(message)[start : start + n])
        else:
            self.add(spb.ShardChunk.FromString(message))

    def _header(self, header: spb.ShardHeader) -> None:
        self.header = header
        if self._allocate is not None:
            self._buffer = memoryview(self._allocate(header.total_bytes)).cast("B")

    def _data(self, data) -> None:
        if self.header is None:
            raise StatusError(grpc.StatusCode.DATA_LOSS, "shard stream sent data before its header")
        n = len(data)
        if self._buffer is not None:
            if self._size + n > len(self._buffer):
                raise StatusError(
                    grpc.StatusCode.DATA_LOSS, f"shard stream sent more than the {len(self._buffer)} bytes its header said"
                )
            self._buffer[self._size : self._size + n] = data
            if self._hash_thread is not None:  # xxh3 releases the GIL: it overlaps the next receive
                self._hashed = self._hash_thread.submit(self._xxh.update, self._buffer[self._size : self._size + n])
        else:
            self._parts.append(data)
        if self._hashed is None:
            self._xxh.update(data)
        self._size += n

    def _finish(self, trailer: spb.ShardTrailer) -> None:
        if self.header is None or self._size != self.header.total_bytes:
            raise StatusError(
                grpc.StatusCode.DATA_LOSS,
                f"shard stream ended after {self._size} bytes, header said {self.header and self.header.total_bytes}",
            )
        if self._hashed is not None:
            self._hashed.result()  # the worker runs in order: the last chunk's hash ends it
        blob = self._buffer.obj if self._buffer is not None else b"".join(self._parts)
        if trailer.xxh3_128:
            ok = self._xxh.hexdigest() == trailer.xxh3_128
        else:  # only a sha256: one pass over the whole blob (the buffer, or the joined bytes)
            whole = self._buffer if self._buffer is not None else blob
            ok = bool(trailer.sha256) and hashlib.sha256(whole).hexdigest() == trailer.sha256
        if not ok:
            raise StatusError(grpc.StatusCode.DATA_LOSS, "shard checksum mismatch: the stream was corrupted")
        self.blob = blob

    def result(self) -> tuple[spb.ShardHeader, object]:
        """(header, blob): bytes, or the buffer `allocate` returned."""
        if self.blob is None:
            raise StatusError(grpc.StatusCode.DATA_LOSS, "shard stream ended without its checksum trailer")
        return self.header, self.blob


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """(value, position after it) of the protobuf varint at data[pos]."""
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise StatusError(grpc.StatusCode.DATA_LOSS, "shard stream sent a malformed message")
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos


def _metadata(token: str | None):
    return (("authorization", f"Bearer {token}"),) if token else None


def _raise(e: grpc.RpcError):
    error = StatusError(e.code(), e.details())
    error.retry_after_s = retry_after_s(e)  # a busy server's hint (None for any other error)
    raise error from None


class _Client:
    """A blocking channel, a stub, and the admin token sent on mutating calls."""

    def __init__(self, address: str, stub_class, token: str | None, timeout_s: float, tls: ClientTls | None = None, options=None):
        self.address = address
        self.channel = secure_or_insecure_channel(address, tls, options)
        self.stub = stub_class(self.channel)
        self.md = _metadata(token)
        self.timeout_s = timeout_s

    def _call(self, method, request, admin: bool = False):
        try:
            return method(request, metadata=self.md if admin else None, timeout=self.timeout_s)
        except grpc.RpcError as e:
            _raise(e)

    def close(self) -> None:
        self.channel.close()


class StoreClient(_Client):
    """busy_retry_s: how long fetch_shard asks again while the store refuses it as busy (all its
    --max-streams taken); 0 reports the first refusal."""

    def __init__(
        self,
        address: str,
        token: str | None = None,
        timeout_s: float = 300.0,
        tls: ClientTls | None = None,
        busy_retry_s: float = BUSY_RETRY_S,
    ):
        super().__init__(address, spb_grpc.AdapterStoreStub, token, timeout_s, tls, options=BULK_OPTIONS)
        self.busy_retry_s = busy_retry_s

    def register(self, name: str, uri: str, revision: str = "") -> pb.AdapterManifest:
        return self._call(
            self.stub.RegisterAdapter, spb.RegisterAdapterRequest(name=name, uri=uri, revision=revision), admin=True
        )

    def get(self, name: str) -> pb.AdapterManifest:
        return self._call(self.stub.GetAdapter, spb.GetAdapterRequest(name=name))

    def list(self, page_size: int = 100) -> list[pb.AdapterManifest]:
        out, token = [], ""
        while True:
            resp = self._call(self.stub.ListAdapters, spb.ListAdaptersRequest(page_size=page_size, page_token=token))
            out.extend(resp.adapters)
            token = resp.next_page_token
            if not token:
                return out

    def delete(self, name: str) -> bool:
        return self._call(self.stub.DeleteAdapter, spb.DeleteAdapterRequest(name=name), admin=True).deleted

    def prefetch(self, items: list[spb.PrefetchItem]) -> list[spb.PrefetchResult]:
        return list(self._call(self.stub.Prefetch, spb.PrefetchRequest(items=items), admin=True).results)

    def fetch_shard(
        self, name: str, layout: pb.Layout, tp_rank: int = 0, ep_rank: int = 0, digest: str = ""
    ) -> tuple[spb.ShardHeader, bytes]:
        """(header, blob), the stream's checksum checked. A stream that breaks after its header
        with DATA_LOSS (a copy that failed its checksum, here or in the store) is asked again once,
        with the store checking its copy before it sends it. A stream the store refuses as busy is
        asked again after its retry hint, backing off (errors.BusyBackoff), for busy_retry_s from
        the first refusal: then RESOURCE_EXHAUSTED naming the store and its last answer."""
        backoff = BusyBackoff(self.busy_retry_s)  # one budget for both asks below
        try:
            return self._when_served(name, layout, tp_rank, ep_rank, digest, False, backoff)
        except _BrokenStream:
            return self._when_served(name, layout, tp_rank, ep_rank, digest, True, backoff)

    def _when_served(self, name, layout, tp_rank, ep_rank, digest, verify, backoff) -> tuple[spb.ShardHeader, bytes]:
        while True:
            asked_at = time.monotonic()
            try:
                return self._fetch_shard(name, layout, tp_rank, ep_rank, digest, verify)
            except StatusError as e:
                hint = getattr(e, "retry_after_s", None)
                if hint is None:
                    raise
                if self.busy_retry_s <= 0:  # asked not to ask again: the store's own answer
                    raise
                pause = backoff.next_pause(hint, asked_at)
                if pause is None:
                    raise backoff.gave_up(
                        f"adapter store at {self.address}", f"adapter {name!r} was not fetched", e.message
                    ) from None
                if backoff.asks == 1:
                    log.info("adapter store at %s is busy (%s); asking for %r again shortly", self.address, e.message, name)
                time.sleep(pause)

    def _fetch_shard(self, name, layout, tp_rank, ep_rank, digest, verify) -> tuple[spb.ShardHeader, bytes]:
        req = spb.FetchShardRequest(
            name=name, layout=layout, rank=pb.ShardRank(tp_rank=tp_rank, ep_rank=ep_rank), digest=digest, verify=verify, xxh3=True
        )
        asm = ShardAssembler()
        method = self.channel.unary_stream(
            "/loraserve.v1.AdapterStore/FetchShard", request_serializer=spb.FetchShardRequest.SerializeToString
        )
        try:
            for message in method(req, timeout=self.timeout_s):
                asm.add_raw(message)
            return asm.result()
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DATA_LOSS and asm.header is not None and not verify:
                raise _BrokenStream() from None
            _raise(e)
        except StatusError as e:
            if e.code == grpc.StatusCode.DATA_LOSS and asm.header is not None and not verify:
                raise _BrokenStream() from None
            raise


class _BrokenStream(Exception):
    """A shard stream that failed after its header with DATA_LOSS: worth one more try."""


class ExecutorClient(_Client):
    def __init__(self, address: str, token: str | None = None, timeout_s: float = 600.0, tls: ClientTls | None = None):
        super().__init__(address, epb_grpc.ExecutorStub, token, timeout_s, tls)

    def generate(self, prompt: str = "", adapter: str = "", chat: bool = True, **sampling) -> epb.GenerateResponse:
        return self._call(self.stub.Generate, make_request(prompt, adapter, chat, **sampling))

    def generate_stream(self, prompt: str = "", adapter: str = "", chat: bool = True, **sampling):
        try:
            yield from self.stub.GenerateStream(make_request(prompt, adapter, chat, **sampling), timeout=self.timeout_s)
        except grpc.RpcError as e:
            _raise(e)

    def load(self, name: str, into_slot: bool = True, pin: bool = False) -> epb.AdapterState:
        return self._call(self.stub.LoadAdapter, epb.LoadAdapterRequest(name=name, into_slot=into_slot, pin=pin), admin=True)

    def pin(self, name: str) -> epb.AdapterState:
        return self._call(self.stub.PinAdapter, epb.AdapterRef(name=name), admin=True)

    def unpin(self, name: str) -> epb.AdapterState:
        return self._call(self.stub.UnpinAdapter, epb.AdapterRef(name=name), admin=True)

    def evict(self, name: str) -> epb.AdapterState:
        return self._call(self.stub.EvictAdapter, epb.AdapterRef(name=name), admin=True)

    def list(self) -> list[epb.AdapterState]:
        return list(self._call(self.stub.ListAdapters, epb.ListLoadedRequest()).adapters)

    def info(self) -> epb.ServerInfo:
        return self._call(self.stub.GetServerInfo, epb.ServerInfoRequest())


def make_request(prompt: str, adapter: str = "", chat: bool = True, **sampling) -> epb.GenerateRequest:
    """A GenerateRequest for one prompt: as a one-turn chat (default) or as raw text."""
    req = epb.GenerateRequest(adapter=adapter, sampling=epb.SamplingParams(**sampling))
    if chat:
        req.chat.messages.add(role="user", content=prompt)
    else:
        req.prompt = prompt
    return req
