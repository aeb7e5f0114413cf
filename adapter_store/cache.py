"""CPU cache of packed shard blobs: a disk tier, a Redis tier, and the tiering in front.

Keys are content-addressed, `<adapter sha256>/<layout hash>/tp<R>-ep<E>`, so a blob under
a key never changes: any copy is as good as another, and a corrupted one is simply
dropped and rebuilt by the caller. Every method is synchronous (the service runs them
with asyncio.to_thread) and safe to call from several threads.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import grpc
import xxhash

from loraserve.errors import StatusError, exhausted, invalid

log = logging.getLogger(__name__)

_KEY_RE = re.compile(r"[0-9a-f]{64}/[0-9a-f]{16,64}/tp[0-9]+-ep[0-9]+")


class CacheUnavailable(Exception):
    """The backend is down (connection refused, timeouts); the caller may use another tier."""


def check_key(key: str) -> str:
    if not _KEY_RE.fullmatch(key):
        raise invalid(f"cache key {key!r} is not of the form <sha256 hex>/<layout hash hex>/tp<N>-ep<N>")
    return key


class Checksums(NamedTuple):
    """The checksums stored with a cached copy of a blob, as hex. A copy cached before xxh3-128 was
    kept has only its sha256 (xxh3_128 ""). xxh3 is the stream's checksum whenever it is known: it
    costs a twentieth of sha256's CPU (docs/BENCHMARKS.md); sha256 stays stored beside it."""

    sha256: str = ""
    xxh3_128: str = ""

    @classmethod
    def of(cls, blob) -> Checksums:
        return cls(hashlib.sha256(blob).hexdigest(), xxh3_128(blob))

    def hasher(self):
        """A fresh hash object of the checksum to check a copy with: xxh3-128 when known, else sha256."""
        return xxhash.xxh3_128() if self.xxh3_128 else hashlib.sha256()

    def expected(self) -> str:
        """The hex digest `hasher` must end with."""
        return self.xxh3_128 or self.sha256

    @property
    def kind(self) -> str:
        return "xxh3-128" if self.xxh3_128 else "sha256"


def xxh3_128(blob) -> str:
    """Hex xxh3-128 of bytes (or anything with the buffer protocol)."""
    return xxhash.xxh3_128_hexdigest(blob)


def _check_fits(key: str, size_bytes: int, budget_bytes: int, where: str) -> None:
    if size_bytes > budget_bytes:
        raise exhausted(f"shard {key} is {size_bytes} bytes, over the {where} cache budget of {budget_bytes} bytes")


# ---------------------------------------------------------------------------------------
# Disk
# ---------------------------------------------------------------------------------------

# File = magic (8 bytes) + sha256 of the blob (32 bytes) + xxh3-128 of the blob (16 bytes) + blob;
# one file, so one atomic rename. Files written before xxh3 was kept have magic LSSHARD1 and no
# xxh3 (header 40 bytes): they are still read, and checked with their sha256.
_MAGIC = b"LSSHARD2"
_MAGIC_V1 = b"LSSHARD1"
_MAGIC_BYTES = len(_MAGIC)
_HEADER_BYTES = {_MAGIC: _MAGIC_BYTES + 32 + 16, _MAGIC_V1: _MAGIC_BYTES + 32}  # by magic
_SUFFIX = ".shard"


def _file_head(sums: Checksums) -> bytes:
    return _MAGIC + bytes.fromhex(sums.sha256) + bytes.fromhex(sums.xxh3_128)


def _read_head(f) -> tuple[int, Checksums] | None:
    """(header bytes, the checksums stored in it) of an open shard file, read up to its blob; None
    when it is no shard file (unknown magic, or cut short)."""
    magic = f.read(_MAGIC_BYTES)
    n = _HEADER_BYTES.get(magic)
    if n is None:
        return None
    rest = f.read(n - _MAGIC_BYTES)
    if len(rest) != n - _MAGIC_BYTES:
        return None
    return n, Checksums(rest[:32].hex(), rest[32:].hex())


def _checked(sums: Checksums, blob) -> Checksums | None:
    """The checksums of a copy whose bytes match the stored ones (xxh3-128 when stored, else sha256),
    or None: only checksums this check confirmed. A copy with only a sha256 gets its xxh3-128 too, so
    its stream's trailer carries it; a copy checked by its xxh3-128 reports no sha256 (the stored
    one was not checked: a back-fill recomputes it, and an older client's trailer is computed)."""
    if sums.xxh3_128:
        return Checksums("", sums.xxh3_128) if xxh3_128(blob) == sums.xxh3_128 else None
    return Checksums(sums.sha256, xxh3_128(blob)) if hashlib.sha256(blob).hexdigest() == sums.sha256 else None


class DiskCache:
    """Blobs as files `<root>/<digest>/<layout>/<tp-ep>.shard`; LRU by mtime, bounded by bytes.

    One process owns a root: the LRU index lives in memory and is rebuilt from the files'
    mtimes on start (get() touches them, so the order survives restarts).
    """

    name = "disk"

    def __init__(self, root: Path, budget_bytes: int):
        self.root = Path(root)
        self.budget_bytes = budget_bytes
        self._tmp_dir = self.root / ".tmp"  # same filesystem as the shards, so os.replace is atomic
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> blob bytes, oldest first
        self._total_bytes = 0
        self._checked: dict[str, tuple[int, int, int]] = {}  # key -> _file_id of the file when last checked
        self._tmp_dir.mkdir(parents=True, exist_ok=True)
        self._rebuild_index()

    def _rebuild_index(self) -> None:
        for stale in self._tmp_dir.iterdir():
            stale.unlink(missing_ok=True)  # a put that died mid-write
        found = []
        for path in self.root.glob(f"*/*/*{_SUFFIX}"):
            key = str(path.relative_to(self.root))[: -len(_SUFFIX)]
            if not _KEY_RE.fullmatch(key):
                log.warning("disk cache: ignoring %s, not a shard file name", path)
                continue
            try:
                with open(path, "rb") as f:
                    head = _read_head(f)
                    st = os.fstat(f.fileno())
            except FileNotFoundError:
                continue
            # not a shard file: counted whole, and dropped on its first read
            found.append((st.st_mtime_ns, key, st.st_size - (head[0] if head else 0)))
        for _, key, size_bytes in sorted(found):
            self._index[key] = size_bytes
            self._total_bytes += size_bytes
        log.info("disk cache at %s: %d shards, %d bytes", self.root, len(self._index), self._total_bytes)
        with self._lock:
            self._evict_over_budget(keep=None)  # the budget may have shrunk since the last run

    def _path(self, key: str) -> Path:
        return self.root / (check_key(key) + _SUFFIX)

    def get(self, key: str) -> bytes | None:
        hit = self.read(key)
        return hit and hit[0]

    def read(self, key: str) -> tuple[bytes, Checksums] | None:
        """(blob, its checksums, checked on this read) or None."""
        path = self._path(key)
        try:
            with open(path, "rb") as f:  # header and blob read apart: no copy of the blob
                head, blob, inode = _read_head(f), f.read(), os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            return None
        sums = head and _checked(head[1], blob)
        if not sums:
            log.warning("disk cache: shard %s in %s failed its %s check; deleting it", key, path,
                        head[1].kind if head else "checksum")
            with self._lock:
                if _inode(path) == inode:  # not already replaced by a fresh put
                    self._remove(key)
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                with _ignore_missing():
                    os.utime(path)  # the LRU order on disk, for the next start
                    if _inode(path) == inode:
                        self._checked[key] = _file_id(os.stat(path))
        return blob, sums

    def open(self, key: str) -> ShardReader | None:
        """The shard as a stream of chunks, or None: the first bytes can go out before the last are
        read. A file this cache has checked since it last changed (same inode, size and mtime as
        at that check: written by `put`, or read whole and checked) is read as is, the reader's
        client checking the stream's checksum (`read` checks it here); any other file is hashed as
        it is read and `ShardReader.finish` deletes it when it no longer matches its stored checksum
        (xxh3-128; sha256 for a file written before xxh3 was kept)."""
        path = self._path(key)
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            return None
        try:
            head = _read_head(f)
            st = os.fstat(f.fileno())
        except BaseException:
            f.close()
            raise
        if head is None:
            f.close()
            self._drop_corrupt(key, path, st.st_ino, "checksum")
            return None
        size, sums = st.st_size - head[0], head[1]
        with self._lock:
            trusted = self._checked.get(key) == _file_id(st)
            if key in self._index:
                self._index.move_to_end(key)
                with _ignore_missing():
                    os.utime(path)  # the LRU order on disk, for the next start
                    st = os.stat(path)
                    if trusted:
                        self._checked[key] = _file_id(st)
        checked = _file_id(st)
        return ShardReader(f, size, sums, self.name, verify=not trusted,
                           on_checked=lambda ok: self._after_check(key, path, checked, ok, sums.kind))

    def _after_check(self, key: str, path: Path, checked: tuple[int, int, int], ok: bool, kind: str) -> None:
        if ok:
            with self._lock:
                self._checked[key] = checked
        else:
            self._drop_corrupt(key, path, checked[0], kind)

    def _drop_corrupt(self, key: str, path: Path, inode: int, kind: str) -> None:
        self._checked.pop(key, None)
        log.warning("disk cache: shard %s in %s failed its %s check; deleting it", key, path, kind)
        with self._lock:
            if _inode(path) == inode:  # not already replaced by a fresh put
                self._remove(key)

    def put(self, key: str, blob: bytes, sums: Checksums | None = None) -> None:
        """sums: the blob's checksums when the caller has both (else computed here)."""
        path = self._path(key)
        _check_fits(key, len(blob), self.budget_bytes, f"disk ({self.root})")
        if sums is None or not (sums.sha256 and sums.xxh3_128):
            sums = Checksums.of(blob)
        tmp = self._tmp_dir / f"{uuid.uuid4().hex}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(_file_head(sums))
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            with self._lock:
                path.parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp, path)
                self._checked[key] = _file_id(os.stat(path))
                self._total_bytes += len(blob) - self._index.pop(key, 0)
                self._index[key] = len(blob)
                self._evict_over_budget(keep=key)
            _fsync_dir(path.parent)
        finally:
            tmp.unlink(missing_ok=True)

    def size(self, key: str) -> int | None:
        """Bytes of the blob under key, or None; reads nothing (a corrupt file shows on get)."""
        with self._lock:
            return self._index.get(check_key(key))

    def delete_prefix(self, prefix: str) -> int:
        with self._lock:
            keys = [k for k in self._index if k.startswith(prefix)]
            for key in keys:
                self._remove(key)
        return len(keys)

    def total_bytes(self) -> int:
        with self._lock:
            return self._total_bytes

    def _evict_over_budget(self, keep: str | None) -> None:
        while self._total_bytes > self.budget_bytes:
            oldest = next(iter(self._index))
            if oldest == keep:
                return
            log.info("disk cache: evicting %s (%d bytes) to stay under %d bytes",
                     oldest, self._index[oldest], self.budget_bytes)
            self._remove(oldest)

    def _remove(self, key: str) -> None:
        """Deletes a shard and its empty folders; the lock is held."""
        self._checked.pop(key, None)
        path = self.root / (key + _SUFFIX)
        path.unlink(missing_ok=True)
        self._total_bytes -= self._index.pop(key, 0)
        for folder in (path.parent, path.parent.parent):
            with _ignore_missing(OSError):  # not empty: another shard lives there
                folder.rmdir()


class ShardReader:
    """One cached shard read chunk by chunk (DiskCache.open, RedisCache.open) from `f` (a file, or
    anything with readinto and close). `readinto` runs in a worker thread (file reads, Redis replies
    and the hashes release the GIL), `finish` once the last chunk is read."""

    def __init__(self, f, size: int, checksums: Checksums, tier: str, verify: bool,
                 on_checked: Callable[[bool], None]):
        self.size, self.checksums, self.tier = size, checksums, tier  # checksums: as stored with the blob
        self.verify = verify  # hash the bytes as they are read (xxh3-128 when stored, else sha256), compare at `finish`
        self._f, self._left, self._on_checked = f, size, on_checked
        self._hash = checksums.hasher() if verify else None

    def readinto(self, view: memoryview) -> int:
        """Fills view with the next bytes (fewer at the end); returns how many (0: done)."""
        n = self._f.readinto(view[: min(len(view), self._left)])
        self._left -= n
        if self._hash is not None:
            self._hash.update(view[:n])
        return n

    def finish(self) -> bool:
        """False when verifying and the bytes no longer match the stored checksum (the copy is then
        dropped from the cache); True otherwise."""
        self.close()
        if self._hash is None:
            return True
        ok = self._left == 0 and self._hash.hexdigest() == self.checksums.expected()
        self._on_checked(ok)
        return ok

    def close(self) -> None:
        self._f.close()


def _file_id(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def _ignore_missing(*errors: type[BaseException]):
    try:
        yield
    except (FileNotFoundError, *errors):
        pass


# ---------------------------------------------------------------------------------------
# Redis
# ---------------------------------------------------------------------------------------


class RedisCache:
    """Blobs in chunks under `<prefix>:shard:<key>` (a meta hash) and `...:c<i>` (the chunks).

    The LRU is a sorted set `<prefix>:lru` (key -> last access, ms) and the running total
    `<prefix>:total` (bytes). Writes and removals are WATCH/MULTI/EXEC transactions, so
    several stores can share one Redis. Run Redis with `maxmemory-policy noeviction`:
    this cache enforces its own budget.
    """

    name = "redis"

    def __init__(self, url: str, prefix: str, budget_bytes: int, chunk_bytes: int = 4 * 2**20,
                 socket_timeout_s: float = 2.0):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url = _redact(url)
        self.prefix = prefix
        self.budget_bytes = budget_bytes
        self.chunk_bytes = chunk_bytes
        self._lru_key, self._total_key = f"{prefix}:lru", f"{prefix}:total"
        # One quick retry (a pooled connection gone stale after a Redis restart), no backoff:
        # a down Redis must fail fast so the tiering can serve from disk.
        self._redis = redis.Redis.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
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
        (xxh3-128; sha256 for a copy written before xxh3 was kept). A
        chunk gone meanwhile (evicted or replaced by another store) or Redis failing mid-stream
        fails the read with DATA_LOSS, which a client answers by asking again with `verify`."""
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
        return ShardReader(chunks, int(meta[b"size"]), sums, self.name, verify=True,
                           on_checked=lambda ok: ok or self._drop_corrupt(key, sums.sha256, sums.kind))

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
            log.warning("redis cache: shard %s (%s at %s) failed its %s check; deleting it",
                        key, self._meta_key(key), self.url, kind)
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
            sums = _checked(stored, blob) if len(blob) == int(meta[b"size"]) else None
            if sums is None:
                self._drop_corrupt(key, stored.sha256, stored.kind)
                return None
            return blob, sums

    def put(self, key: str, blob: bytes, sums: Checksums | None = None) -> None:
        """sums: the blob's checksums when the caller has both (else computed here)."""
        meta_key = self._meta_key(key)
        _check_fits(key, len(blob), self.budget_bytes, f"redis ({self.url})")
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
            raise StatusError(grpc.StatusCode.DATA_LOSS, f"{where}: redis failed mid-stream ({exc.__cause__}): "
                              f"fetch it again") from None
        if chunk is None:
            raise StatusError(grpc.StatusCode.DATA_LOSS, f"{where}: chunk {i} is gone (evicted or replaced "
                              f"meanwhile): fetch it again")
        return chunk

    def close(self) -> None:
        self._chunk = memoryview(b"")


def _meta_sums(meta: dict) -> Checksums:
    """The checksums in a Redis copy's meta hash (no xxh3_128 in a copy written before it was kept)."""
    return Checksums(meta[b"sha256"].decode(), meta.get(b"xxh3_128", b"").decode())


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


# ---------------------------------------------------------------------------------------
# Tiers
# ---------------------------------------------------------------------------------------


class TieredCache:
    """Tiers fastest first (e.g. [RedisCache, DiskCache]). A tier that is down is skipped,
    logged once per outage, and retried after `retry_after_s`."""

    def __init__(self, tiers: list, retry_after_s: float = 5.0):
        self.tiers = list(tiers)
        self.retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._down_until: dict[int, float] = {}  # tier index -> monotonic time of the next try

    def get(self, key: str) -> tuple[bytes, str] | None:
        """(blob, name of the tier it came from) or None."""
        hit = self.read(key)
        return hit and hit[:2]

    def read(self, key: str) -> tuple[bytes, str, Checksums] | None:
        """(blob, tier name, the blob's checksums as checked by that tier) or None."""
        for i, tier in enumerate(self.tiers):
            hit = self._call(i, tier.read, key)
            if hit is not None:
                blob, sums = hit
                for upper in range(i):
                    self._backfill(upper, key, blob, sums)
                return blob, tier.name, sums
        return None

    def open(self, key: str) -> ShardReader | None:
        """A chunked reader of the shard from the first tier that is up, when that tier holds it;
        else None (a miss there: the caller's `read` back-fills it with the whole blob). A tier
        that is down is passed over: there is nothing to back-fill into it."""
        for i, tier in enumerate(self.tiers):
            if self._is_down(i):
                continue
            reader = self._call(i, tier.open, key)
            if reader is not None or not self._is_down(i):
                return reader
        return None

    def put(self, key: str, blob: bytes, sums: Checksums | None = None) -> None:
        """Into every available tier; raises RESOURCE_EXHAUSTED only if no tier can hold it.
        sums: the blob's checksums when the caller has both (else each tier computes them)."""
        if sums is None and len(self.tiers) > 1:
            sums = Checksums.of(blob)  # once, not per tier
        too_big: list[StatusError] = []
        for i, tier in enumerate(self.tiers):
            try:
                self._call(i, tier.put, key, blob, sums)
            except StatusError as exc:
                too_big.append(exc)
        if len(too_big) == len(self.tiers):
            raise too_big[0]

    def size(self, key: str) -> tuple[int, str] | None:
        """(bytes, tier name) from the first tier holding key, or None; reads no blob."""
        for i, tier in enumerate(self.tiers):
            n = self._call(i, tier.size, key)
            if n is not None:
                return n, tier.name
        return None

    def delete_prefix(self, prefix: str) -> int:
        return sum(self._call(i, tier.delete_prefix, prefix) or 0 for i, tier in enumerate(self.tiers))

    def total_bytes(self) -> dict[str, int | None]:
        """Bytes held per tier name (None while a tier is down)."""
        return {tier.name: self._call(i, tier.total_bytes) for i, tier in enumerate(self.tiers)}

    def _backfill(self, i: int, key: str, blob: bytes, sums: Checksums | None = None) -> None:
        try:
            self._call(i, self.tiers[i].put, key, blob, sums)
        except StatusError as exc:  # too big for that tier: it stays in the lower one
            log.debug("not back-filling %s into %s: %s", key, self.tiers[i].name, exc.message)

    def _is_down(self, i: int) -> bool:
        with self._lock:
            return time.monotonic() < self._down_until.get(i, 0.0)

    def _call(self, i: int, method, *args):
        """method(*args), or None while tier i is down."""
        with self._lock:
            if time.monotonic() < self._down_until.get(i, 0.0):
                return None
        try:
            result = method(*args)
        except CacheUnavailable as exc:
            self._mark_down(i, exc)
            return None
        self._mark_up(i)
        return result

    def _mark_down(self, i: int, exc: CacheUnavailable) -> None:
        with self._lock:
            first = i not in self._down_until
            self._down_until[i] = time.monotonic() + self.retry_after_s
        if first:
            others = [t.name for j, t in enumerate(self.tiers) if j != i] or ["no cache"]
            log.warning("%s unavailable (%s); serving from %s", self.tiers[i].name, exc, ", ".join(others))

    def _mark_up(self, i: int) -> None:
        with self._lock:
            was_down = self._down_until.pop(i, None) is not None
        if was_down:
            log.info("%s is available again", self.tiers[i].name)
