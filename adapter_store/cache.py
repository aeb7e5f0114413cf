"""The shard cache: its tiers, fastest first, behind the one interface of a tier (`CacheTier`).

A hit in a lower tier is back-filled into the ones above it; a tier that is down is skipped until
it answers again.
"""

from __future__ import annotations

import logging
import threading
import time

from loraserve.errors import StatusError

from .cache_tier import CacheTier, CacheUnavailable
from .checksum import Checksums, ShardReader

log = logging.getLogger(__name__)


class TieredCache:
    """Tiers fastest first (e.g. [RedisCache, DiskCache]). A tier that is down is skipped,
    logged once per outage, and retried after `retry_after_s`."""

    def __init__(self, tiers: list[CacheTier], retry_after_s: float = 5.0):
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
