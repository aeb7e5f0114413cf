"""The tiering over real tiers: a disk directory and the Redis server at 127.0.0.1:6379."""

from __future__ import annotations

import logging

import grpc
import pytest
import xxhash

from loraserve.adapter_store.cache import TieredCache
from loraserve.adapter_store.checksum import Checksums
from loraserve.adapter_store.disk_cache import DiskCache
from loraserve.adapter_store.redis_cache import RedisCache
from loraserve.errors import StatusError

from .cache_parts import KIB, blob_of, read_all, redis_cache, shard_key


def test_tiered_open_streams_from_the_first_tier_up_and_leaves_back_fills_to_read(redis_url, tmp_path, closed_port):
    redis_tier, disk_tier = redis_cache(redis_url), DiskCache(tmp_path, 1 << 20)
    cache = TieredCache([redis_tier, disk_tier])
    disk_tier.put(shard_key(1), b"x" * 300)
    assert cache.open(shard_key(1)) is None  # redis misses it: read() back-fills it whole
    assert cache.read(shard_key(1))[1] == "disk" and redis_tier.size(shard_key(1)) == 300
    reader = cache.open(shard_key(1))
    assert reader.tier == "redis" and read_all(reader, 128) == b"x" * 300 and reader.finish()
    down = TieredCache([RedisCache(f"redis://127.0.0.1:{closed_port}/0", "p", 1 << 20), disk_tier], retry_after_s=60)
    for _ in range(2):  # found down, then passed over: nothing to back-fill into it, disk streams
        reader = down.open(shard_key(1))
        assert reader.tier == "disk" and read_all(reader, 128) == b"x" * 300
        reader.finish()


def test_tiered_hit_in_lower_tier_backfills_upper(redis_url, tmp_path):
    redis_tier, disk_tier = redis_cache(redis_url), DiskCache(tmp_path, 1 << 20)
    disk_tier.put(shard_key(1), b"shard bytes")
    cache = TieredCache([redis_tier, disk_tier])
    assert cache.get(shard_key(1)) == (b"shard bytes", "disk")
    assert redis_tier.get(shard_key(1)) == b"shard bytes"
    assert cache.get(shard_key(1)) == (b"shard bytes", "redis")
    assert cache.get(shard_key(2)) is None


def test_tiered_read_returns_the_checksums_each_tier_checked(redis_url, tmp_path):
    """FetchShard's checksum trailer is the hash a tier checked on read: it must be the blob's, and
    only what was checked (xxh3-128; the stored sha256 is not reported, so a back-fill recomputes it)."""
    redis_tier, disk_tier = redis_cache(redis_url), DiskCache(tmp_path, 1 << 20)
    blob = blob_of(40 * KIB)
    disk_tier.put(shard_key(1), blob)
    cache = TieredCache([redis_tier, disk_tier])
    checked = Checksums("", xxhash.xxh3_128_hexdigest(blob))
    assert cache.read(shard_key(1)) == (blob, "disk", checked)
    assert cache.read(shard_key(1)) == (blob, "redis", checked)
    meta = redis_tier._redis.hgetall(f"{redis_url.prefix}:shard:{shard_key(1)}")  # back-filled with both
    assert (meta[b"sha256"].decode(), meta[b"xxh3_128"].decode()) == Checksums.of(blob)
    assert cache.read(shard_key(2)) is None


def test_tiered_put_and_delete_reach_every_tier(redis_url, tmp_path):
    redis_tier, disk_tier = redis_cache(redis_url), DiskCache(tmp_path, 1 << 20)
    cache = TieredCache([redis_tier, disk_tier])
    cache.put(shard_key(1), b"abc")
    assert redis_tier.get(shard_key(1)) == disk_tier.get(shard_key(1)) == b"abc"
    assert cache.delete_prefix(shard_key(1)[:64]) == 2
    assert cache.get(shard_key(1)) is None


def test_tiered_redis_down_serves_from_disk_and_warns_once(tmp_path, closed_port, caplog):
    disk_tier = DiskCache(tmp_path, 1 << 20)
    cache = TieredCache([RedisCache(f"redis://127.0.0.1:{closed_port}/0", "p", 1 << 20), disk_tier], retry_after_s=0)
    with caplog.at_level(logging.INFO, logger="loraserve.adapter_store.cache"):
        cache.put(shard_key(1), b"abc")
        for _ in range(3):
            assert cache.get(shard_key(1)) == (b"abc", "disk")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "redis unavailable (redis at" in warnings[0].getMessage()
    assert warnings[0].getMessage().endswith("; serving from disk")
    assert "available again" not in caplog.text


def test_tiered_put_too_big_for_every_tier_is_exhausted(tmp_path):
    cache = TieredCache([DiskCache(tmp_path / "a", 100), DiskCache(tmp_path / "b", 1000)])
    cache.put(shard_key(1), b"x" * 500)  # fits the second tier only
    assert cache.get(shard_key(1)) == (b"x" * 500, "disk")
    with pytest.raises(StatusError) as excinfo:
        cache.put(shard_key(2), b"x" * 5000)
    assert excinfo.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_tiered_logs_once_when_redis_comes_back(redis_url, redis_proxy, tmp_path, caplog):
    redis_tier = RedisCache(f"redis://127.0.0.1:{redis_proxy.port}/0", redis_url.prefix, 1 << 20)
    cache = TieredCache([redis_tier, DiskCache(tmp_path, 1 << 20)], retry_after_s=0)
    with caplog.at_level(logging.INFO, logger="loraserve.adapter_store.cache"):
        cache.put(shard_key(1), b"abc")
        redis_proxy.down()
        cache.put(shard_key(2), b"def")  # reaches disk only
        assert cache.get(shard_key(2)) == (b"def", "disk")
        redis_proxy.up()
        assert cache.get(shard_key(2)) == (b"def", "disk")  # redis missed it; back-filled now
        assert cache.get(shard_key(2)) == (b"def", "redis")
    assert [r.levelname for r in caplog.records if "redis" in r.getMessage() and "avail" in r.getMessage()] == ["WARNING", "INFO"]


def test_size_looks_up_without_reading_and_follows_the_tiers(redis_url, tmp_path):
    redis_tier, disk_tier = redis_cache(redis_url), DiskCache(tmp_path, 1 << 20)
    cache = TieredCache([redis_tier, disk_tier])
    assert cache.size(shard_key(1)) is None and disk_tier.size(shard_key(1)) is None and redis_tier.size(shard_key(1)) is None
    disk_tier.put(shard_key(1), b"x" * 300)
    assert cache.size(shard_key(1)) == (300, "disk")
    redis_tier.put(shard_key(1), b"x" * 300)
    assert cache.size(shard_key(1)) == (300, "redis") and redis_tier.size(shard_key(1)) == 300
    redis_tier.delete_prefix("")
    assert cache.size(shard_key(1)) == (300, "disk")
