"""Keys, blobs and a chunked read shared by the shard cache's tests."""

from __future__ import annotations

import hashlib

from loraserve.adapter_store.redis_cache import RedisCache

KIB = 1024


def shard_key(n: int, rank: int = 0) -> str:
    """A well-formed key: <adapter sha256>/<layout hash>/tp<rank>-ep0."""
    digest = hashlib.sha256(f"adapter-{n}".encode()).hexdigest()
    return f"{digest}/{'ab' * 8}/tp{rank}-ep0"


def blob_of(n_bytes: int, seed: int = 0) -> bytes:
    return hashlib.sha256(str(seed).encode()).digest() * (n_bytes // 32) + b"x" * (n_bytes % 32)


def redis_cache(target, budget_bytes: int = 1 << 20, chunk_bytes: int = 4 * KIB) -> RedisCache:
    return RedisCache(target.url, target.prefix, budget_bytes=budget_bytes, chunk_bytes=chunk_bytes)


def read_all(reader, piece: int) -> bytes:
    out = bytearray()
    buf = bytearray(piece)
    while n := reader.readinto(memoryview(buf)):
        out += buf[:n]
    return bytes(out)
