"""The Redis tier of the shard cache: blobs in chunks with a meta hash, an LRU sorted set and a
running total, shared by every store on one Redis.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from urllib.parse import urlsplit, urlunsplit

import grpc

from loraserve.errors import StatusError

from .cache_tier import CacheUnavailable, check_fits, check_key
from .checksum import Checksums, ShardReader, checked

log = logging.getLogger(__name__)


class RedisCache:
    """Blobs in chunks under `<prefix>:shard:<key>` (a meta hash) and `...:c<i>` (the chunks).

    The LRU is a sorted set `<prefix>:lru` (key -> last access, ms) and the running total
    `<prefix>:total` (bytes). Writes and removals are WATCH/MULTI/EXEC transactions, so
    several stores can share one Redis. Run Redis with `maxmemory-policy noeviction`:
    this cache enforces its own budget.
    """

    name = "redis"

    def __init__(self, url: str, prefix: str, budget_bytes: int, chunk_bytes: int = 4 * 2**20, socket_timeout_s: float = 2.0):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url = redact_url(url)
        self.prefix = prefix
        self.budget_bytes = budget_bytes
        self.chunk_bytes = chunk_bytes
        self._lru_key, self._total_key = f"{prefix}:lru", f"{prefix}:total"
        # One quick retry (a pooled connection gone stale after a Redis restart), no backoff:
        # a down Redis must fail fast so the tiering can serve from disk.
        self._redis = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), retries=1),
        )

    def _meta_key(self, key: str) -> str:
        return f"{self.prefix}:shard:{check_key(key)}"

    def get(self, key: str) -> bytes | None:
        hit = self.read(key)
        return hit and hit[0]

    def open(self, key: str) -> ShardReader | None:
        """The shard as a stream of chunks, or None: one GET per stored chunk as the reader gets to
        it, so the first bytes go out before the last are read and no whole copy is joined. Always
        hashed on the way (another store may have written the copy; this one cannot tell whether it
        changed): `ShardReader.finish` deletes a copy that no longer matches its stored checksum
        (xxh3-128; sha256 for a copy whose meta hash has no xxh3_128). A chunk gone meanwhile
        (evicted or replaced by another store) or Redis failing mid-stream fails the read with
        DATA_LOSS, which a client answers by asking again with `verify`."""
        meta_key = self._meta_key(key)
        with self._errors():
            pipe = self._redis.pipeline(transaction=False)
            pipe.hgetall(meta_key)
            pipe.zadd(self._lru_key, {key: _now_ms()}, xx=True)
            meta, _ = pipe.execute()
        if not meta:
            return None
        chunks = _RedisChunks(self, key, int(meta[b"n_chunks"]))
        sums = _meta_sums(meta)
        return ShardReader(
            chunks,
            int(meta[b"size"]),
            sums,
            self.name,
            verify=True,
            on_checked=lambda ok: ok or self._drop_corrupt(key, sums.sha256, sums.kind),
        )

    def _drop_corrupt(self, key: str, sha: str, kind: str) -> None:
        """Deletes the copy that failed its check, unless another store replaced it meanwhile (its
        stored sha256 is no longer `sha`: the read mixed two copies, and the new one is good)."""
        try:
            with self._errors():
                removed = self._remove(key, only_sha=sha)
        except CacheUnavailable as exc:  # it stays; the next whole read checks it again
            log.warning("redis cache: could not delete shard %s: %s", key, exc)
            return
        if removed:
            log.warning(
                "redis cache: shard %s (%s at %s) failed its %s check; deleting it", key, self._meta_key(key), self.url, kind
            )
        else:
            log.info("redis cache: shard %s was replaced while it was read; the new copy stays", key)

    def read(self, key: str) -> tuple[bytes, Checksums] | None:
        """(blob, its checksums, checked on this read) or None."""
        meta_key = self._meta_key(key)
        with self._errors():
            meta = self._redis.hgetall(meta_key)
            if not meta:
                return None
            pipe = self._redis.pipeline(transaction=False)  # one round trip for every chunk
            for i in range(int(meta[b"n_chunks"])):
                pipe.get(f"{meta_key}:c{i}")
            pipe.zadd(self._lru_key, {key: _now_ms()}, xx=True)
            *chunks, _ = pipe.execute()
            if any(c is None for c in chunks):
                log.info("redis cache: shard %s lost chunks (removed meanwhile?); a miss", key)
                return None
            blob = b"".join(chunks)
            stored = _meta_sums(meta)
            sums = checked(stored, blob) if len(blob) == int(meta[b"size"]) else None
            if sums is None:
                self._drop_corrupt(key, stored.sha256, stored.kind)
                return None
            return blob, sums

    def put(self, key: str, blob: bytes, sums: Checksums | None = None) -> None:
        """sums: the blob's checksums when the caller has both (else computed here)."""
        meta_key = self._meta_key(key)
        check_fits(key, len(blob), self.budget_bytes, f"redis ({self.url})")
        if sums is None or not (sums.sha256 and sums.xxh3_128):
            sums = Checksums.of(blob)
        chunks = [blob[i : i + self.chunk_bytes] for i in range(0, len(blob), self.chunk_bytes)]
        # sha256 stays the copy's identity (`_remove(only_sha=)`); xxh3_128 is what it is checked with
        meta = {"size": len(blob), "n_chunks": len(chunks), "sha256": sums.sha256, "xxh3_128": sums.xxh3_128}

        def write(pipe) -> None:
            old = pipe.hgetall(meta_key)
            pipe.multi()
            for i, chunk in enumerate(chunks):
                pipe.set(f"{meta_key}:c{i}", chunk)
            for i in range(len(chunks), int(old.get(b"n_chunks", 0))):
                pipe.delete(f"{meta_key}:c{i}")
            pipe.delete(meta_key)  # no field of an older copy's meta (a stale xxh3_128) outlives it
            pipe.hset(meta_key, mapping=meta)
            pipe.zadd(self._lru_key, {key: _now_ms()})
            pipe.incrby(self._total_key, len(blob) - int(old.get(b"size", 0)))

        with self._errors():
            self._redis.transaction(write, meta_key)
            self._evict_over_budget(keep=key)

    def size(self, key: str) -> int | None:
        """Bytes of the blob under key, or None; one HGET, no chunk read."""
        with self._errors():
            value = self._redis.hget(self._meta_key(key), "size")
        return None if value is None else int(value)

    def delete_prefix(self, prefix: str) -> int:
        with self._errors():
            keys = [k.decode() for k in self._redis.zrange(self._lru_key, 0, -1)]
            return sum(self._remove(k) for k in keys if k.startswith(prefix))

    def total_bytes(self) -> int:
        with self._errors():
            return int(self._redis.get(self._total_key) or 0)

    def _evict_over_budget(self, keep: str) -> None:
        while int(self._redis.get(self._total_key) or 0) > self.budget_bytes:
            oldest = [k.decode() for k in self._redis.zrange(self._lru_key, 0, 1)]
            victim = next((k for k in oldest if k != keep), None)
            if victim is None:
                return
            log.info("redis cache: evicting %s to stay under %d bytes", victim, self.budget_bytes)
            self._remove(victim)

    def _remove(self, key: str, only_sha: str | None = None) -> bool:
        """Deletes a shard, its chunks and its LRU entry in one transaction; True if it existed.
        only_sha: only the copy whose stored sha256 is this one (another store may have replaced it)."""
        meta_key = self._meta_key(key)

        def remove(pipe) -> bool:
            meta = pipe.hgetall(meta_key)
            if only_sha is not None and meta.get(b"sha256", b"").decode() != only_sha:
                return False
            pipe.multi()
            pipe.delete(meta_key, *(f"{meta_key}:c{i}" for i in range(int(meta.get(b"n_chunks", 0)))))
            pipe.zrem(self._lru_key, key)
            pipe.decrby(self._total_key, int(meta.get(b"size", 0)))
            return bool(meta)

        return self._redis.transaction(remove, meta_key, value_from_callable=True)

    @contextmanager
    def _errors(self):
        import redis

        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise CacheUnavailable(f"redis at {self.url} unavailable: {exc}") from exc


class _RedisChunks:
    """A Redis-held shard's chunks as a file for ShardReader: the next chunk is fetched (one GET)
    when the previous one is used up."""

    def __init__(self, cache: RedisCache, key: str, n_chunks: int):
        self._cache, self._key, self._n = cache, key, n_chunks
        self._next = 0
        self._chunk = memoryview(b"")

    def readinto(self, view: memoryview) -> int:
        filled = 0
        while filled < len(view):
            if not self._chunk:
                if self._next == self._n:
                    break
                self._chunk = memoryview(self._get(self._next))
                self._next += 1
            n = min(len(view) - filled, len(self._chunk))
            view[filled : filled + n] = self._chunk[:n]
            self._chunk, filled = self._chunk[n:], filled + n
        return filled

    def _get(self, i: int) -> bytes:
        where = f"shard {self._key} in the store's redis cache at {self._cache.url}"
        try:
            with self._cache._errors():
                chunk = self._cache._redis.get(f"{self._cache._meta_key(self._key)}:c{i}")
        except CacheUnavailable as exc:
            raise StatusError(
                grpc.StatusCode.DATA_LOSS, f"{where}: redis failed mid-stream ({exc.__cause__}): fetch it again"
            ) from None
        if chunk is None:
            raise StatusError(
                grpc.StatusCode.DATA_LOSS, f"{where}: chunk {i} is gone (evicted or replaced meanwhile): fetch it again"
            )
        return chunk

    def close(self) -> None:
        self._chunk = memoryview(b"")


def _meta_sums(meta: dict) -> Checksums:
    """The checksums in a Redis copy's meta hash (xxh3_128 "" when the hash has no such field)."""
    return Checksums(meta[b"sha256"].decode(), meta.get(b"xxh3_128", b"").decode())


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def redact_url(url: str) -> str:
    """The URL with its password, if any, shown as ***: fit for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))
