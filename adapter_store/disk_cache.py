"""The disk tier of the shard cache: one file per blob under a root, LRU by mtime, bounded by bytes.

A file is magic (8 bytes) + sha256 of the blob (32 bytes) + xxh3-128 of the blob (16 bytes) + blob
(magic LSSHARD2); one file, so one atomic rename. A file with magic LSSHARD1 has no xxh3 (header
40 bytes): it is read, and checked with its sha256.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path

from .cache_tier import KEY_RE, check_fits, check_key
from .checksum import Checksums, ShardReader, checked

log = logging.getLogger(__name__)

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


class DiskCache:
    """Blobs as files `<root>/<digest>/<packing>/<tp-ep>.shard` (pack.shard_key); LRU by mtime, bounded by bytes.

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
            if not KEY_RE.fullmatch(key):
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
        sums = head and checked(head[1], blob)
        if not sums:
            log.warning(
                "disk cache: shard %s in %s failed its %s check; deleting it", key, path, head[1].kind if head else "checksum"
            )
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
        (xxh3-128; sha256 for an LSSHARD1 file)."""
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
        opened = _file_id(st)
        return ShardReader(
            f,
            size,
            sums,
            self.name,
            verify=not trusted,
            on_checked=lambda ok: self._after_check(key, path, opened, ok, sums.kind),
        )

    def _after_check(self, key: str, path: Path, opened: tuple[int, int, int], ok: bool, kind: str) -> None:
        """opened: the _file_id of the file the reader read."""
        if ok:
            with self._lock:
                self._checked[key] = opened
        else:
            self._drop_corrupt(key, path, opened[0], kind)

    def _drop_corrupt(self, key: str, path: Path, inode: int, kind: str) -> None:
        self._checked.pop(key, None)
        log.warning("disk cache: shard %s in %s failed its %s check; deleting it", key, path, kind)
        with self._lock:
            if _inode(path) == inode:  # not already replaced by a fresh put
                self._remove(key)

    def put(self, key: str, blob: bytes, sums: Checksums | None = None) -> None:
        """sums: the blob's checksums when the caller has both (else computed here)."""
        path = self._path(key)
        check_fits(key, len(blob), self.budget_bytes, f"disk ({self.root})")
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
            log.info("disk cache: evicting %s (%d bytes) to stay under %d bytes", oldest, self._index[oldest], self.budget_bytes)
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
