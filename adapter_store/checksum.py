"""The checksums stored with a cached shard, and their checks: a whole copy (`checked`) or a copy
as it streams (`ShardReader`).

Every copy written stores both sha256 and xxh3-128. A copy that stores only its sha256 (a disk file
with magic LSSHARD1, a Redis meta hash without `xxh3_128`) is still read, and checked with its
sha256. xxh3-128 is the check whenever it is stored: it costs ~0.09 CPU s/GB on one core, sha256
0.56-0.88; sha256 stays stored beside it, the trailer for clients that check only sha256.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import NamedTuple

import xxhash


class Checksums(NamedTuple):
    """The checksums stored with a cached copy of a blob, as hex; xxh3_128 "" for a copy that
    stores only its sha256."""

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


def checked(sums: Checksums, blob) -> Checksums | None:
    """The checksums of a copy whose bytes match the stored ones (xxh3-128 when stored, else sha256),
    or None: only checksums this check confirmed. A copy with only a sha256 gets its xxh3-128 too, so
    its stream's trailer carries it; a copy checked by its xxh3-128 reports no sha256 (the stored
    one was not checked: a back-fill recomputes it, and a sha256 trailer is computed from the bytes)."""
    if sums.xxh3_128:
        return Checksums("", sums.xxh3_128) if xxh3_128(blob) == sums.xxh3_128 else None
    return Checksums(sums.sha256, xxh3_128(blob)) if hashlib.sha256(blob).hexdigest() == sums.sha256 else None


class ShardReader:
    """One cached shard read chunk by chunk (DiskCache.open, RedisCache.open) from `f` (a file, or
    anything with readinto and close). `readinto` runs in a worker thread (file reads, Redis replies
    and the hashes release the GIL), `finish` once the last chunk is read."""

    def __init__(self, f, size: int, checksums: Checksums, tier: str, verify: bool, on_checked: Callable[[bool], None]):
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
