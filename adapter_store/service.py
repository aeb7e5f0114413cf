"""The AdapterStore gRPC servicer: thin; the work is in sources, validate, pack, cache, registry.

Blocking work (downloads, validation, packing, cache I/O) runs in threads so one slow
register never stalls FetchShard streams to executors.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path

import grpc

from loraserve.auth import require_admin
from loraserve.errors import StatusError, busy, grpc_errors, invalid, precondition, unavailable
from loraserve.metrics import StoreMetrics, serve_metrics
from loraserve.serving import BULK_OPTIONS, RunningServer, start_server
from loraserve.v1 import adapter_store_pb2 as spb
from loraserve.v1 import adapter_store_pb2_grpc as spb_grpc
from loraserve.v1 import common_pb2 as pb

from . import base_model, pack, sources, trainable_tokens
from .cache import TieredCache
from .checksum import Checksums
from .config import StoreConfig
from .disk_cache import DiskCache
from .layout import check_layout, layout_hash
from .read_ahead import read_ahead
from .redis_cache import RedisCache
from .redis_registry import RedisRegistry
from .registry import FileRegistry

log = logging.getLogger(__name__)
SERVICE_NAME = "loraserve.v1.AdapterStore"
DEFAULT_CHUNK = 1 << 20
MAX_CHUNK = 3 << 20  # stays under gRPC's default 4 MiB message limit
BUSY_RETRY_AFTER_S = 0.2  # the retry hint of a stream refused for want of a turn (--max-stream-wait-s)
MAX_PAGE = 1000
LOADED_ADAPTERS = 2  # validated adapters kept in memory between packs
COMMIT_MARGIN_S = 2.0  # a drain stops registrations from committing this long before its grace ends


def load_spec(cfg: StoreConfig) -> base_model.BaseModelSpec | None:
    path = cfg.base_model_path
    if path is None:
        return None
    if Path(path).suffix == ".gguf":
        return base_model.from_gguf(path, cfg.base_model or Path(path).stem)
    return base_model.from_hf_dir(Path(path), cfg.base_model or None)


def build_cache(cfg: StoreConfig) -> TieredCache:
    tiers = [DiskCache(cfg.cache_dir, cfg.disk_cache_bytes)]
    if cfg.redis_url:
        tiers.insert(0, RedisCache(cfg.redis_url, cfg.redis_prefix, cfg.redis_cache_bytes))
    return TieredCache(tiers)


def build_registry(cfg: StoreConfig) -> FileRegistry | RedisRegistry:
    if cfg.registry == "redis":
        if not cfg.redis_url:
            raise ValueError("--registry redis needs --redis-url")
        return RedisRegistry(cfg.redis_url, cfg.redis_prefix, cfg.staging_dir)
    return FileRegistry(cfg.data_dir)


class AdapterStoreService(spb_grpc.AdapterStoreServicer):
    def __init__(self, cfg: StoreConfig):
        self.cfg = cfg
        clean_staging(cfg.staging_dir)
        self.registry = build_registry(cfg)
        self.cache = build_cache(cfg)
        self.spec = load_spec(cfg)
        self.metrics = StoreMetrics()
        self.metrics.attach(self.cache)
        self._inflight: dict[str, asyncio.Future] = {}
        # FetchShard streams at once: each holds up to three chunks and a reader thread (or a whole
        # packed shard) while it runs; more wait here, in order, at most cfg.max_stream_wait_s (0: no cap)
        self._streams = asyncio.Semaphore(cfg.max_streams) if cfg.max_streams > 0 else None
        self._adapters: OrderedDict[str, pack.PeftAdapter] = OrderedDict()  # digest -> validated adapter
        self._adapters_lock = threading.Lock()
        # Registrations commit (registry.put) under this lock, and only before the drain's
        # commit deadline: one that would finish after the server cancels its RPC does not
        # commit, so no client is told "failed" about an adapter that was in fact registered.
        self._commit_lock = threading.Lock()
        self._commit_deadline: float | None = None  # time.monotonic(); set by drain()

    def drain(self, grace_s: float) -> None:
        """Called when the server starts draining: registrations in flight may commit only
        during the first grace_s - COMMIT_MARGIN_S seconds (the rest is for their replies)."""
        with self._commit_lock:
            self._commit_deadline = time.monotonic() + max(0.0, grace_s - COMMIT_MARGIN_S)

    def _require_admin(self, context: grpc.aio.ServicerContext) -> None:
        require_admin(context, self.cfg.admin_token)

    # -- registration ----------------------------------------------------------------
    @grpc_errors
    async def RegisterAdapter(self, request, context):
        self._require_admin(context)
        try:
            pack.validate.check_name(request.name)
            if not request.uri:
                raise invalid("uri is required (file:///path, s3://bucket/prefix or hf://org/name[@revision])")
            manifest = await asyncio.to_thread(self._register, request.name, request.uri, request.revision or None)
        except StatusError as exc:
            self.metrics.rejections.labels(exc.code.name).inc()
            raise
        self.metrics.registrations.inc()
        return manifest

    def _register(self, name: str, uri: str, revision: str | None) -> pb.AdapterManifest:
        t0 = time.perf_counter()
        staging = Path(tempfile.mkdtemp(dir=self.cfg.staging_dir))
        try:
            fetched = sources.fetch(uri, revision, self.cfg.sources, staging)
            t_fetch = time.perf_counter() - t0
            adapter = pack.load_adapter(fetched.directory, self.spec, self.cfg.limits)
            manifest = self._manifest(name, fetched, adapter)
            # Redis registry: the files are uploaded here, outside the lock, so the commit stays short.
            staged = self.registry.stage(manifest.digest, sorted(p for p in fetched.directory.iterdir() if p.is_file()))
            with self._commit_lock:
                if self._commit_deadline is not None and time.monotonic() > self._commit_deadline:
                    self.registry.discard(staged, manifest.digest)
                    raise unavailable(f"the store is shutting down: adapter {name!r} was not registered; register it again")
                replaced = self.registry.put(manifest, staged)
            if replaced:
                self._forget(replaced)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        log.info(
            "registered %s from %s: digest %s, rank %d, %d modules, %d bytes%s%s (fetch %.2fs, total %.2fs)",
            name,
            fetched.uri,
            adapter.digest[:12],
            adapter.rank,
            len(adapter.modules),
            adapter.weight_bytes,
            f", weights cast {adapter.weights_cast}" if adapter.weights_cast else "",
            f", LoRA of {adapter.vision_dropped} vision-tower/projector modules dropped (text-only requests)"
            if adapter.vision_dropped
            else "",
            t_fetch,
            time.perf_counter() - t0,
        )
        return manifest

    def _manifest(self, name, fetched: sources.FetchedAdapter, adapter: pack.PeftAdapter) -> pb.AdapterManifest:
        s = adapter.settings
        return pb.AdapterManifest(
            name=name,
            revision=fetched.revision,
            uri=fetched.uri,
            digest=adapter.digest,
            rank=adapter.rank,
            lora_alpha=s.alpha,
            use_rslora=s.use_rslora,
            target_modules=adapter.target_modules,
            weight_bytes=adapter.weight_bytes,
            num_parameters=adapter.num_parameters,
            base_model=s.base_model,
            created_unix_ms=int(time.time() * 1000),
            weights_cast=adapter.weights_cast,
            kind=adapter.kind,
        )

    @grpc_errors
    async def GetAdapter(self, request, context):
        return self.registry.get(request.name)

    @grpc_errors
    async def ListAdapters(self, request, context):
        size = request.page_size or 100
        if size > MAX_PAGE:
            raise invalid(f"page_size {size} is above the maximum of {MAX_PAGE}")
        items, token = self.registry.page(size, request.page_token)
        return spb.ListAdaptersResponse(adapters=items, next_page_token=token)

    @grpc_errors
    async def DeleteAdapter(self, request, context):
        self._require_admin(context)
        manifest = self.registry.delete(request.name)
        if not self.registry.is_referenced(manifest.digest):
            await asyncio.to_thread(self._forget, manifest.digest)
        log.info("deleted %s (digest %s)", request.name, manifest.digest[:12])
        return spb.DeleteAdapterResponse(deleted=True)

    def _forget(self, digest: str) -> None:
        """Drops what the store keeps for a digest no name uses any more."""
        with self._adapters_lock:
            self._adapters.pop(digest, None)
        dropped = self.cache.delete_prefix(f"{digest}/")
        log.info("digest %s is no longer used: %d cached shards dropped", digest[:12], dropped)

    # -- shards ----------------------------------------------------------------------
    def _check_fetch(self, name: str, digest: str, layout: pb.Layout) -> pb.AdapterManifest:
        manifest = self.registry.get(name)
        if digest and digest != manifest.digest:
            raise precondition(f"adapter {name!r} now has digest {manifest.digest[:12]}, not the requested {digest[:12]}")
        check_layout(layout)
        if self.spec is not None and layout.base_model and not self.spec.matches(layout.base_model):
            raise precondition(f"executor serves base model {layout.base_model!r}, this store serves {self.spec.name!r}")
        if manifest.rank > layout.max_rank:
            raise precondition(f"adapter {name!r} has rank {manifest.rank}, above the executor's max_rank {layout.max_rank}")
        return manifest

    @grpc_errors
    async def FetchShard(self, request, context):
        """Header, data chunks, checksum trailer (xxh3-128; sha256 for a copy that stores only its
        sha256, when no xxh3 of it is known). A cached shard streams as it is read from the first
        cache tier (disk, or Redis chunk by chunk); a packed one, a back-filled one or any with
        `verify` (read whole and checked first) from memory.
        Data chunks go out already framed (`_frame_head`): no message object is built per chunk."""
        manifest = self._check_fetch(request.name, request.digest, request.layout)
        chunk = request.chunk_bytes or DEFAULT_CHUNK
        if chunk > MAX_CHUNK:
            raise invalid(f"chunk_bytes {chunk} is above the maximum of {MAX_CHUNK}")
        t0 = time.perf_counter()
        async with self._turn(request.name) as waited:
            if waited:  # the adapter may have been registered again or deleted meanwhile
                manifest = self._check_fetch(request.name, request.digest, request.layout)
            async with contextlib.aclosing(self._fetch(manifest, request, chunk, t0)) as stream:
                async for message in stream:  # closed with the stream, early too: its clean-up runs then
                    yield message

    @contextlib.asynccontextmanager
    async def _turn(self, name: str):
        """One of --max-streams: waits while that many streams are served (a client gone meanwhile
        stops waiting), then holds its place until the stream ends, on every path. Yields whether
        it waited. A waiting stream sends nothing, and an executor gives up on a store that sends no
        message within its --store-timeout-s: so the wait ends after --max-stream-wait-s (below that
        timeout) with RESOURCE_EXHAUSTED and a retry hint, which the executor's client follows."""
        waited = self._streams is not None and self._streams.locked()
        if self._streams is not None:
            if waited:
                log.debug("FetchShard %s waits its turn: %d streams are served (--max-streams)", name, self.cfg.max_streams)
            self.metrics.streams_waiting.inc()
            try:
                async with asyncio.timeout(self.cfg.max_stream_wait_s):
                    await self._streams.acquire()
            except TimeoutError:
                self.metrics.streams_busy.inc()
                raise busy(
                    f"adapter store busy: all {self.cfg.max_streams} of its shard streams (--max-streams) are "
                    f"taken and adapter {name!r} waited {self.cfg.max_stream_wait_s:g}s for one; ask again shortly",
                    retry_after_s=BUSY_RETRY_AFTER_S,
                ) from None
            finally:
                self.metrics.streams_waiting.dec()
        self.metrics.streams.inc()
        try:
            yield waited
        finally:
            self.metrics.streams.dec()
            if self._streams is not None:
                self._streams.release()

    async def _fetch(self, manifest: pb.AdapterManifest, request, chunk: int, t0: float):
        """FetchShard's messages, once it is the stream's turn."""
        key = pack.shard_key(manifest.digest, request.layout, request.rank)
        reader = None if request.verify else await asyncio.to_thread(self.cache.open, key)
        if reader is not None:
            self.metrics.cache_hits.labels(reader.tier).inc()
            chunks, size, tier, sums = _streamed(reader, chunk, request.name), reader.size, reader.tier, reader.checksums
        else:
            blob, tier, sums = await self._shard(manifest, request.layout, request.rank)
            chunks, size = _sliced(blob, chunk), len(blob)
        began = False  # chunks asked for: from then on the read-ahead closes the reader (read_ahead.py)
        try:
            yield spb.ShardChunk(
                header=spb.ShardHeader(
                    manifest=manifest, layout_hash=layout_hash(request.layout), total_bytes=size, cache_tier=tier
                )
            )
            began = True
            async with contextlib.aclosing(chunks):  # closed with the stream: the read-ahead ends then
                async for message in chunks:
                    yield message
            yield await _trailer(sums, request.xxh3, None if reader is not None else blob)
        finally:
            if reader is not None and not began:  # the client gone while the header went out
                reader.close()
        self.metrics.fetch_bytes.labels(tier).inc(size)
        self.metrics.fetch.labels(tier).observe(time.perf_counter() - t0)

    async def _shard(self, manifest: pb.AdapterManifest, layout: pb.Layout, rank: pb.ShardRank) -> tuple[bytes, str, Checksums]:
        """(blob, tier, checksums) from the first cache tier that has it, else packed once
        (concurrent callers share it). A tier's hit comes with the checksums it checked on read,
        so the stream's checksum trailer costs no second pass over the bytes."""
        key = pack.shard_key(manifest.digest, layout, rank)
        hit = await asyncio.to_thread(self.cache.read, key)
        if hit is not None:
            self.metrics.cache_hits.labels(hit[1]).inc()
            return hit
        self.metrics.cache_misses.inc()
        if key in self._inflight:
            return await asyncio.shield(self._inflight[key])
        future = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            result = await asyncio.to_thread(self._pack_one, manifest, layout, rank)
            future.set_result(result)
            return result
        except BaseException as e:
            future.set_exception(e)
            future.exception()  # retrieved: no "never retrieved" warning when nobody else waits
            raise
        finally:
            del self._inflight[key]

    def _pack_one(self, manifest: pb.AdapterManifest, layout: pb.Layout, rank: pb.ShardRank) -> tuple[bytes, str, Checksums]:
        """(blob, "packed", its checksums) of one rank's shard, packed and cached. Runs in a thread."""
        ((blob, sums),) = self._pack_ranks(manifest, layout, [rank])
        return blob, "packed", sums

    def _pack_ranks(
        self, manifest: pb.AdapterManifest, layout: pb.Layout, ranks: list[pb.ShardRank]
    ) -> list[tuple[bytes, Checksums]]:
        """Packs once, slices for each rank, caches each shard with its checksums (hashed once, here).
        Runs in a thread."""
        t0 = time.perf_counter()
        adapter = self._loaded(manifest)
        if adapter.digest != manifest.digest:
            with self._adapters_lock:  # not kept: registering again must find the repaired files
                self._adapters.pop(manifest.digest, None)
            raise StatusError(
                grpc.StatusCode.DATA_LOSS,
                f"stored files of adapter {manifest.name!r} no longer match digest {manifest.digest[:12]}: register it again",
            )
        full = pack.pack_full(adapter, layout)
        magnitudes = pack.pack_magnitudes(adapter, layout)
        blobs = []
        for rank in ranks:
            tensors = {**pack.shard(full, layout, rank, magnitudes), **trainable_tokens.shard_tensors(adapter.tokens)}
            blob = pack.shard_blob(adapter, tensors, layout, rank)
            sums = Checksums.of(blob)
            try:
                self.cache.put(pack.shard_key(manifest.digest, layout, rank), blob, sums)
            except StatusError as e:  # too large for the cache budget: still served, not kept
                log.warning("shard of %s not cached: %s", manifest.name, e.message)
            blobs.append((blob, sums))
        seconds = time.perf_counter() - t0
        self.metrics.pack.observe(seconds)
        log.info(
            "packed %s for packing %s, %d rank(s), %d bytes in %.2fs",
            manifest.name,
            pack.packing_hash(layout)[:12],
            len(ranks),
            sum(len(b) for b, _ in blobs),
            seconds,
        )
        return blobs

    def _loaded(self, manifest: pb.AdapterManifest) -> pack.PeftAdapter:
        """The validated adapter, kept for a few packs: one adapter is often packed for several layouts."""
        with self._adapters_lock:
            adapter = self._adapters.pop(manifest.digest, None)
        if adapter is None:
            with self.registry.files(manifest.digest) as folder:
                adapter = pack.load_adapter(folder, self.spec, self.cfg.limits)
        with self._adapters_lock:
            self._adapters[manifest.digest] = adapter
            while len(self._adapters) > LOADED_ADAPTERS:
                self._adapters.popitem(last=False)
        return adapter

    @grpc_errors
    async def Prefetch(self, request, context):
        self._require_admin(context)
        results = []
        for item in request.items:
            results.extend(await self._prefetch_item(item))
        return spb.PrefetchResponse(results=results)

    async def _prefetch_item(self, item: spb.PrefetchItem) -> list[spb.PrefetchResult]:
        ranks = list(item.ranks) or [
            pb.ShardRank(tp_rank=t, ep_rank=e) for t in range(item.layout.tp_size or 1) for e in range(item.layout.ep_size or 1)
        ]
        try:
            manifest = self._check_fetch(item.name, "", item.layout)
            keys = [pack.shard_key(manifest.digest, item.layout, r) for r in ranks]
            # (bytes, tier) of each rank already cached: a size lookup, no blob is read
            found = await asyncio.to_thread(lambda: [self.cache.size(k) for k in keys])
            todo = [r for r, f in zip(ranks, found) if f is None]
            packed = iter(await asyncio.to_thread(self._pack_ranks, manifest, item.layout, todo) if todo else [])
        except StatusError as e:
            return [spb.PrefetchResult(name=item.name, rank=r, ok=False, error=f"{e.code.name}: {e.message}") for r in ranks]
        results = []
        for r, f in zip(ranks, found):
            size, tier = f if f is not None else (len(next(packed)[0]), "packed")
            results.append(spb.PrefetchResult(name=item.name, rank=r, ok=True, bytes=size, cache_tier=tier))
        return results


_DATA_TAG = b"\x12"  # ShardChunk.data: field 2, length-delimited
_FRAME_ROOM = 11  # the tag and the longest varint


def _frame_head(n: int) -> bytes:
    """The wire prefix of a ShardChunk whose data is n bytes."""
    out = bytearray(_DATA_TAG)
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


async def _sliced(blob: bytes, chunk: int):
    """A blob in memory as framed data chunks (one copy each)."""
    view = memoryview(blob)
    for start in range(0, len(blob), chunk):
        part = view[start : start + chunk]
        yield b"".join((_frame_head(len(part)), part))


def _streamed(reader, chunk: int, name: str):
    """A cached shard as framed data chunks, as it is read ahead of the stream by a thread
    (read_ahead.py: up to DEPTH chunks ahead, hashed there for a copy not checked since it changed).
    A copy that fails its checksum (xxh3-128, or sha256 for a copy that stores only its sha256)
    is deleted from the cache and the stream fails DATA_LOSS before its trailer; the client asks
    again (with `verify`) and gets it packed anew."""
    buffer = bytearray(_FRAME_ROOM + chunk)  # read into, framed in place, copied once into the message

    def read(reader) -> bytes:
        n = reader.readinto(memoryview(buffer)[_FRAME_ROOM:])
        if n == 0:
            return b""
        head = _frame_head(n)
        start = _FRAME_ROOM - len(head)
        buffer[start:_FRAME_ROOM] = head
        return bytes(memoryview(buffer)[start : _FRAME_ROOM + n])

    def failed() -> StatusError:
        return StatusError(
            grpc.StatusCode.DATA_LOSS,
            f"the cached shard of adapter {name!r} failed its "
            f"{reader.checksums.kind} check in the store's {reader.tier} cache and was dropped: fetch it again",
        )

    return read_ahead(reader, read, failed)


async def _trailer(sums: Checksums, xxh3: bool, blob: bytes | None) -> spb.ShardChunk:
    """The stream's checksum trailer: xxh3-128 when the client checks it (FetchShardRequest.xxh3)
    and it is known; else sha256, the one a client without xxh3 checks: stored with every cached copy,
    computed (in a thread) for a freshly packed `blob`. Never both: the client checks one."""
    if xxh3 and sums.xxh3_128:
        return spb.ShardChunk(trailer=spb.ShardTrailer(xxh3_128=sums.xxh3_128))
    sha256 = sums.sha256
    if not sha256 and blob is not None:
        sha256 = await asyncio.to_thread(lambda: hashlib.sha256(blob).hexdigest())
    return spb.ShardChunk(trailer=spb.ShardTrailer(sha256=sha256))


def _pass_bytes(message) -> bytes:
    """FetchShard's serializer: a data chunk is yielded already framed (`_frame_head`), the rest as messages."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def add_servicer(servicer: AdapterStoreService, server: grpc.aio.Server) -> None:
    """The generated registration, with FetchShard's serializer swapped for `_pass_bytes`."""

    class Capture:
        def add_generic_rpc_handlers(self, handlers):
            self.handlers = handlers

        def add_registered_method_handlers(self, service, handlers):
            handlers["FetchShard"] = grpc.unary_stream_rpc_method_handler(
                servicer.FetchShard, request_deserializer=spb.FetchShardRequest.FromString, response_serializer=_pass_bytes
            )
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
            server.add_registered_method_handlers(service, handlers)

    spb_grpc.add_AdapterStoreServicer_to_server(servicer, Capture())


def clean_staging(staging: Path) -> None:
    """Removes what registrations of an earlier process left in staging (a crash, kill -9)."""
    staging.mkdir(parents=True, exist_ok=True)
    left = [p for p in staging.iterdir()]
    for p in left:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    if left:
        log.info("staging: removed %d folder(s) left by an earlier run in %s", len(left), staging)


async def serve(cfg: StoreConfig) -> tuple[RunningServer, int]:
    """Starts the store on cfg.listen (with the standard health service and reflection; TLS when
    cfg.tls; /metrics when cfg.metrics_listen); returns (server, port).
    `server.drain(grace_s)` stops it: see loraserve/serving.py."""
    services = []

    def add(server: grpc.aio.Server) -> None:  # once the port is ours: the data dir is ours too
        services.append(AdapterStoreService(cfg))
        add_servicer(services[0], server)

    server = await start_server(cfg.listen, add, (SERVICE_NAME,), tls=cfg.tls, options=BULK_OPTIONS, name="adapter store")
    server.on_drain.append(services[0].drain)
    metrics_server = serve_metrics(services[0].metrics.registry, cfg.metrics_listen)
    if metrics_server is not None:
        server.on_drain.append(lambda grace_s: metrics_server.stop())
        server.metrics_port = metrics_server.port
    log.info("adapter store listening on %s (data %s, redis %s)", cfg.listen, cfg.data_dir, cfg.redis_url or "off")
    return server, server.port
