"""The executor's side of the store contract: declare the layout, stream shards into host tensors.

Every store call is bounded: a unary call by `timeout_s`, a shard stream by `timeout_s` between
two messages (a large shard may take longer in all, a stalled store may not). A shard stream the
store refuses as busy (RESOURCE_EXHAUSTED with a retry hint: its --max-streams streams all taken) is
asked again after the hint, backing off, for about BUSY_RETRY_S in all, and only while the caller's
STILL_WANTED (if set) says the adapter is still wanted. The channel
reconnects at most MAX_RECONNECT_BACKOFF_MS after the store answers again (gRPC's default backoff
grows to two minutes with the outage), and `watch` checks the store's health every second so
that work on adapters this executor already holds never waits on a store that does not answer.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import math
import mmap
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loraserve.client import ShardAssembler
from loraserve.errors import BUSY_RETRY_S, BusyBackoff, StatusError, precondition, retry_after_s, unavailable
from loraserve.serving import BULK_OPTIONS
from loraserve.tls import ClientTls, secure_or_insecure_channel
from loraserve.v1 import adapter_store_pb2 as spb
from loraserve.v1 import adapter_store_pb2_grpc as spb_grpc
from loraserve.v1 import common_pb2 as pb

from .pinned_arena import ArenaShard, PinnedArena
from .shard_tensors import SHARD_DTYPES, ShardTensors

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
FETCH_SHARD = "/loraserve.v1.AdapterStore/FetchShard"
CHUNK_BYTES = 1 << 20  # FetchShard's chunk size asked for
# Whether the adapter a fetch is for is still wanted, set by the caller around the fetch (the CPU
# cache: executor/cpu_cache.py): a fetch the store keeps refusing as busy stops asking once nobody
# waits for it (CANCELLED), instead of holding its load seat for up to BUSY_RETRY_S. Tensor- and
# expert-parallel ranks 1..N-1 set it from rank 0's "cancel" message (executor/ranks.py); a callable
# with a `why` (a string, once it says no) names the reason in the CANCELLED error and the log.
STILL_WANTED: contextvars.ContextVar[Callable[[], bool] | None] = contextvars.ContextVar("fetch_still_wanted", default=None)
HUGE_PAGE_MIN = 4 << 20


def host_buffer(nbytes: int, pin_memory: bool) -> torch.Tensor:
    """A uint8 host tensor for one shard. Pinned: torch's caching host allocator (reused once freed).
    Otherwise, past HUGE_PAGE_MIN bytes, anonymous memory marked for transparent huge pages: the
    stream writes every byte of it once, and faulting it in 4 KiB pages costs about as much as
    the stream itself."""
    if pin_memory:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    if nbytes < HUGE_PAGE_MIN or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(memory, dtype=torch.uint8)  # the tensor keeps the mapping alive


def pinned_blob(tensors: dict[str, torch.Tensor]) -> ShardTensors:
    """The tensors copied into one pinned host buffer, as contiguous views of it (as a fetched
    shard lands): a slot load then moves it with one host->device copy (executor/slot_load.py)."""
    offsets, total = {}, 0
    for name, t in tensors.items():
        total = -(-total // 16) * 16  # every view aligned for its dtype
        offsets[name] = total
        total += t.numel() * t.element_size()
    blob = host_buffer(total, pin_memory=True)
    out = ShardTensors()
    for name, t in tensors.items():
        view = blob[offsets[name] : offsets[name] + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t)
        out[name] = view
    return out


def shard_tensors(blob: torch.Tensor) -> ShardTensors:
    """The tensors of a safetensors blob held in a uint8 tensor, as views of it (no copy).

    Layout: 8-byte little-endian header length, the JSON header, then the data; each tensor's
    `data_offsets` are relative to the data's start (docs/SHARD_FORMAT.md).

    It runs on a helper thread beside the serving loop, and each torch call there gives the
    interpreter lock back and waits to retake it behind the loop (executor/diagnostics/gil_handoff.py):
    so a view is one call, `as_strided` of the blob viewed once per dtype, not slice + dtype view
    + shape view (two calls; slicing keeps the lock): ~450 waits for a Llama-3-8B-shaped shard,
    not ~900."""
    raw = blob.numpy()
    if len(raw) < 8:
        raise StatusError(grpc.StatusCode.DATA_LOSS, f"shard of {len(raw)} bytes has no safetensors header")
    n = int.from_bytes(raw[:8].tobytes(), "little")
    try:
        header = json.loads(raw[8 : 8 + n].tobytes())
    except ValueError as e:
        raise StatusError(grpc.StatusCode.DATA_LOSS, f"shard header is not JSON: {e}") from None
    base, out, typed = 8 + n, ShardTensors(), {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SHARD_DTYPES.get(info.get("dtype"))
        begin, end = (base + o for o in info["data_offsets"])
        if dtype is None or not base <= begin <= end <= len(raw):
            raise StatusError(
                grpc.StatusCode.DATA_LOSS, f"shard tensor {name!r}: dtype {info.get('dtype')} or offsets out of range"
            )
        shape, size = info.get("shape"), dtype.itemsize
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise StatusError(grpc.StatusCode.DATA_LOSS, f"shard tensor {name!r}: shape {shape!r} is not a list of sizes")
        numel = math.prod(shape)
        if end - begin != numel * size:
            raise StatusError(
                grpc.StatusCode.DATA_LOSS,
                f"shard tensor {name!r}: shape {shape} of {info['dtype']} is "
                f"{numel * size} bytes, its offsets span {end - begin}",
            )
        if dtype not in typed:  # the whole blob as dtype (None: its start is not aligned for dtype)
            whole = blob[: len(raw) - len(raw) % size]
            typed[dtype] = whole.view(dtype) if blob.storage_offset() % size == 0 else None
        if typed[dtype] is None or begin % size:
            out[name] = blob[begin:end].clone().view(dtype).view(shape)  # unaligned for its dtype: a copy
            continue
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        out[name] = typed[dtype].as_strided(shape, strides, typed[dtype].storage_offset() + begin // size)
    return out


def _header_bytes(message: bytes) -> int | None:
    """total_bytes of a raw FetchShard message that is the stream's header; None for any other."""
    chunk = spb.ShardChunk.FromString(message) if message[:1] != b"\x12" else None  # \x12: a data chunk
    return chunk.header.total_bytes if chunk is not None and chunk.HasField("header") else None


class StoreClient:
    """Fetches this rank's shard of an adapter for the executor's layout (grpc.aio)."""

    def __init__(
        self,
        address: str,
        layout: pb.Layout,
        rank: pb.ShardRank | None = None,
        timeout_s: float = 5.0,
        tls: ClientTls | None = None,
        pin_memory: bool = False,
        chunk_bytes: int = CHUNK_BYTES,
        arena: PinnedArena | None = None,
        busy_retry_s: float = BUSY_RETRY_S,
        dora: bool = False,
        tokens: bool = False,
    ):
        self.address = address
        self.dora = dora  # DoRA adapters served (the executor's --enable-dora); False: their fetch is refused
        self.tokens = tokens  # trainable tokens served (--enable-trainable-tokens); False: their fetch is refused
        self.tls = tls
        self.layout = layout
        self.rank = rank or pb.ShardRank()
        self.timeout_s = timeout_s
        self.busy_retry_s = busy_retry_s
        self.pin_memory = pin_memory  # shards land in pinned host memory (CUDA: the slot copy is a true async DMA)
        # Shards land in this pre-pinned arena when it has room (a fresh pinned buffer stalls every
        # CUDA call of the process while it is page-locked: executor/pinned_arena.py)
        self.arena = arena
        self._arena_full_logged = 0.0
        self.chunk_bytes = chunk_bytes
        self._hash_thread = ThreadPoolExecutor(1, thread_name_prefix="shard-hash")
        self.channel: grpc.aio.Channel | None = None  # opened on first use, on the serving loop
        self.answering = True  # the last health check's answer (watch); True until one fails

    def _stub(self) -> spb_grpc.AdapterStoreStub:
        return spb_grpc.AdapterStoreStub(self._channel())

    def _channel(self) -> grpc.aio.Channel:
        if self.channel is None:
            self.channel = secure_or_insecure_channel(self.address, self.tls, CHANNEL_OPTIONS + BULK_OPTIONS, aio=True)
        return self.channel

    async def fetch_shard(self, name: str, digest: str = "") -> tuple[str, int, dict[str, torch.Tensor], int]:
        """(digest, rank, tensors, bytes) of one adapter; the SlotManager's fetch function.
        digest: that version only (FAILED_PRECONDITION if the store now has another).

        The stream is written as it arrives into one host buffer (pinned when `pin_memory`) and
        the tensors are views of it: no copy after the stream's. A stream that breaks after its
        header with DATA_LOSS (a cached copy the store found corrupt and dropped) is asked again once."""
        t0 = time.perf_counter()
        backoff = BusyBackoff(self.busy_retry_s)  # one budget for both asks below
        try:
            header, buffer = await self._stream_when_served(name, digest, False, backoff)
        except StatusError as e:
            if e.code != grpc.StatusCode.DATA_LOSS or not getattr(e, "after_header", False):
                raise
            log.warning(
                "fetching %s from store %s: %s; asking again, with the store checking its copy", name, self.address, e.message
            )
            header, buffer = await self._stream_when_served(name, digest, True, backoff)
        try:
            tensors = await asyncio.to_thread(shard_tensors, buffer)  # parsing a large header: off the serving loop
        except BaseException:
            if self.arena is not None:
                self.arena.give_back(buffer)
            raise
        if self.arena is not None and self.arena.holds(buffer):  # back to the arena once the tensors are dropped
            tensors = self.arena.adopt(buffer, ArenaShard(tensors))
        log.info(
            "fetched %s (%s%s) from store %s: %d bytes (%s) in %.3fs",
            name,
            header.manifest.digest[:12],
            f", tp rank {self.rank.tp_rank}"
            if self.layout.tp_size > 1
            else f", ep rank {self.rank.ep_rank}"
            if self.layout.ep_size > 1
            else "",
            self.address,
            header.total_bytes,
            header.cache_tier,
            time.perf_counter() - t0,
        )
        return header.manifest.digest, header.manifest.rank, tensors, header.total_bytes

    async def _stream_when_served(
        self, name: str, digest: str, verify: bool, backoff: BusyBackoff
    ) -> tuple[spb.ShardHeader, torch.Tensor]:
        """_stream, asked again while the store answers busy, as `backoff` paces it (the store's
        retry hint, then doubling pauses with jitter, for busy_retry_s from the first refused ask):
        then RESOURCE_EXHAUSTED naming the store and the adapter. CANCELLED instead once the
        caller's STILL_WANTED says nobody waits for the adapter any more."""
        while True:
            asked_at = time.monotonic()
            try:
                return await self._stream(name, digest, verify)
            except StatusError as e:
                hint = getattr(e, "retry_after_s", None)
                if hint is None:
                    raise
                pause = backoff.next_pause(hint, asked_at)
                if pause is None:
                    error = backoff.gave_up(
                        f"adapter store at {self.address}", f"adapter {name!r} cannot be loaded now", e.message
                    )
                    log.warning("%s", error.message)
                    raise error from None
                self._unless_unwanted(name)
                if backoff.asks == 1:
                    log.info("adapter store at %s is busy (%s); asking for %r again shortly", self.address, e.message, name)
                await asyncio.sleep(pause)
                self._unless_unwanted(name)  # (its request may have left during the pause)

    def _unless_unwanted(self, name: str) -> None:
        """CANCELLED when the caller's STILL_WANTED says nobody waits for the adapter any more (or
        its `why` gives another reason, e.g. another rank's fetch of it failed)."""
        if (wanted := STILL_WANTED.get()) is not None and not wanted():
            why = getattr(wanted, "why", None) or "no request waits for it any more"
            log.info("%r: %s; not asking the busy store at %s again", name, why, self.address)
            raise StatusError(
                grpc.StatusCode.CANCELLED, f"adapter {name!r}: {why}; not fetched (the store at {self.address} was busy)"
            )

    async def _stream(self, name: str, digest: str, verify: bool) -> tuple[spb.ShardHeader, torch.Tensor]:
        req = spb.FetchShardRequest(
            name=name, layout=self.layout, rank=self.rank, digest=digest, chunk_bytes=self.chunk_bytes, verify=verify, xxh3=True
        )
        buffers: list[torch.Tensor] = []
        asm = ShardAssembler(lambda n: buffers[-1].numpy(), self._hash_thread)
        call = self._fetch_method()(req)  # raw messages: data chunks are read in place
        done = False
        try:
            while (message := await self._next(call, name)) is not grpc.aio.EOF:
                first = asm.header is None
                if first and not buffers and (n := _header_bytes(message)) is not None:
                    buffers.append(await self._landing(n, name))
                if not first and message[:1] != b"\x12":
                    # the trailer, checked off the serving loop: a sha256-only one (a copy the store
                    # cached before xxh3-128 was kept) costs a sha256 pass over the whole shard
                    await asyncio.to_thread(asm.add_raw, message)
                else:
                    asm.add_raw(message)
                if first and asm.header is not None:
                    self._check_kind(name, asm.header.manifest)  # before the shard's bytes are streamed
            header, _ = asm.result()
            done = True
        except grpc.aio.AioRpcError as e:
            error = self._error(e, f"; adapter {name!r} cannot be loaded now")
            error.after_header = asm.header is not None
            error.retry_after_s = retry_after_s(e)  # busy: asked again (_stream_when_served)
            raise error from None
        except StatusError as e:  # the stream itself was wrong (checksum, sizes)
            e.after_header = asm.header is not None
            raise
        finally:
            call.cancel()  # a no-op once the stream has ended
            if not done and buffers and self.arena is not None:
                self.arena.give_back(buffers[-1])  # a broken stream's block
        return header, buffers[-1]

    def _check_kind(self, name: str, manifest: pb.AdapterManifest) -> None:
        """FAILED_PRECONDITION for an adapter this executor does not serve the kind of (manifest.kind):
        a DoRA adapter where DoRA is off, one with trainable tokens ("tokens", "<lora|dora>+tokens") where they are."""
        if manifest.kind.startswith("dora") and not self.dora:
            raise precondition(f"adapter {name!r} is a DoRA adapter (use_dora): this executor was started without --enable-dora")
        if "tokens" in manifest.kind.split("+") and not self.tokens:
            raise precondition(
                f"adapter {name!r} has trainable tokens (trainable_token_indices): "
                "this executor was started without --enable-trainable-tokens"
            )

    async def _landing(self, nbytes: int, name: str) -> torch.Tensor:
        """Where a shard of nbytes lands: a block of the pinned arena, else a fresh host buffer."""
        if self.arena is not None:  # in a thread: reclaiming queries CUDA events, which wait while anyone pins
            block = await asyncio.to_thread(self.arena.allocate, nbytes)
            if block is not None:
                return block
            if time.monotonic() - self._arena_full_logged > 60:
                self._arena_full_logged = time.monotonic()
                log.warning(
                    "%s arena has no room for adapter %s (%d bytes; %d of %d bytes free, largest block %d): "
                    "it lands in a fresh %s (fetches in flight have the arena's room beyond the CPU cache's, an eighth of "
                    "it: lower --max-concurrent-loads)",
                    "pinned" if self.pin_memory else "host",
                    name,
                    nbytes,
                    self.arena.free_bytes(),
                    self.arena.nbytes,
                    self.arena.largest_free(),
                    "pinned buffer, and the CUDA calls of the running steps wait while that is page-locked"
                    if self.pin_memory
                    else "host buffer",
                )
        # Allocated in a thread: a cold pinned allocation of a large shard takes milliseconds, which the
        # serving loop must not wait for (the engine's steps still do: the driver is held meanwhile).
        return await asyncio.to_thread(host_buffer, nbytes, self.pin_memory)

    def _fetch_method(self):
        return self._channel().unary_stream(
            FETCH_SHARD, request_serializer=spb.FetchShardRequest.SerializeToString, response_deserializer=None
        )

    async def _next(self, call, name: str):
        """The stream's next message (or EOF), waiting at most timeout_s for it (a timer, not a
        task per message as `asyncio.wait_for` makes: a shard is ~100 messages)."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await call.read()
        except TimeoutError:
            raise unavailable(
                f"adapter store at {self.address} did not answer within {self.timeout_s:g}s "
                f"(store_timeout_s); adapter {name!r} cannot be loaded now"
            ) from None

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
                page = await self._stub().ListAdapters(
                    spb.ListAdaptersRequest(page_size=1000, page_token=token), timeout=min(self.timeout_s, 10.0)
                )
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
                    log.warning(
                        "adapter store at %s does not answer its health check (%s); held adapters serve without asking it",
                        self.address,
                        why,
                    )
            self.answering = answering
            await asyncio.sleep(interval_s)

    async def close(self) -> None:
        self._hash_thread.shutdown(wait=False)
        if self.channel is not None:
            await self.channel.close()
