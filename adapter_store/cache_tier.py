"""What every tier of the shard cache keeps: the key format, the budget check, the outage error,
and the methods the tiering calls (`CacheTier`).

Keys are content-addressed, `<adapter sha256>/<packing hash>/tp<R>-ep<E>` (pack.shard_key), so a blob under
a key never changes: any copy is as good as another, and a corrupted one is simply
dropped and rebuilt by the caller. Every method of a tier is synchronous (the service runs
them with asyncio.to_thread) and safe to call from several threads.
"""

from __future__ import annotations

import re
from typing import Protocol

from loraserve.errors import exhausted, invalid

from .checksum import Checksums, ShardReader

KEY_RE = re.compile(r"[0-9a-f]{64}/[0-9a-f]{16,64}/tp[0-9]+-ep[0-9]+")


class CacheUnavailable(Exception):
    """The backend is down (connection refused, timeouts); the caller may use another tier."""


def check_key(key: str) -> str:
    if not KEY_RE.fullmatch(key):
        raise invalid(f"cache key {key!r} is not of the form <sha256 hex>/<packing hash hex>/tp<N>-ep<N>")
    return key


def check_fits(key: str, size_bytes: int, budget_bytes: int, where: str) -> None:
    """RESOURCE_EXHAUSTED when one blob is larger than the tier's whole budget."""
    if size_bytes > budget_bytes:
        raise exhausted(f"shard {key} is {size_bytes} bytes, over the {where} cache budget of {budget_bytes} bytes")


class CacheTier(Protocol):
    """One tier (DiskCache, RedisCache). Any method may raise CacheUnavailable while the backend is
    down; `put` raises RESOURCE_EXHAUSTED for a blob over the tier's budget."""

    name: str

    def read(self, key: str) -> tuple[bytes, Checksums] | None:
        """(blob, its checksums, checked on this read) or None; a copy failing its check is dropped."""

    def open(self, key: str) -> ShardReader | None:
        """The shard as a stream of chunks, or None."""

    def put(self, key: str, blob: bytes, sums: Checksums | None = None) -> None:
        """sums: the blob's checksums when the caller has both (else computed by the tier)."""

    def size(self, key: str) -> int | None:
        """Bytes of the blob under key, or None; reads no blob."""

    def delete_prefix(self, prefix: str) -> int:
        """Deletes every key starting with prefix; returns how many."""

    def total_bytes(self) -> int:
        """Bytes of the blobs held."""
