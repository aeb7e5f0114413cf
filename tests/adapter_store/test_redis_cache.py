"""The Redis tier against the Redis server at 127.0.0.1:6379."""

from __future__ import annotations

import hashlib
import logging
import time

import grpc
import pytest

from loraserve.adapter_store.cache_tier import CacheUnavailable
from loraserve.adapter_store.checksum import Checksums
from loraserve.adapter_store.redis_cache import RedisCache
from loraserve.errors import StatusError

from .cache_parts import KIB, blob_of, read_all, redis_cache, shard_key


def test_redis_roundtrip_in_chunks(redis_url):
    import redis

    cache = redis_cache(redis_url)
    blob = blob_of(10 * KIB + 5)  # 3 chunks of 4 KiB
    cache.put(shard_key(1), blob)
    assert cache.get(shard_key(1)) == blob
    assert cache.total_bytes() == len(blob)
    chunk_keys = list(redis.Redis.from_url(redis_url.url).scan_iter(match=f"{redis_url.prefix}:shard:*:c*"))
    assert len(chunk_keys) == 3
    cache.put(shard_key(1), b"short")  # fewer chunks: the extra ones go
    assert cache.get(shard_key(1)) == b"short" and cache.total_bytes() == 5
    assert len(list(redis.Redis.from_url(redis_url.url).scan_iter(match=f"{redis_url.prefix}:shard:*:c*"))) == 1


def test_redis_get_reads_all_chunks_in_one_round_trip(redis_url, redis_proxy):
    cache = RedisCache(f"redis://127.0.0.1:{redis_proxy.port}/0", redis_url.prefix, 1 << 20, chunk_bytes=4 * KIB)
    cache.put(shard_key(1), blob_of(40 * KIB))  # 10 chunks
    requests_before = redis_proxy.requests
    assert cache.get(shard_key(1)) == blob_of(40 * KIB)
    assert redis_proxy.requests - requests_before == 2  # the meta, then every chunk at once


def test_redis_evicts_least_recently_used_over_budget(redis_url):
    cache = redis_cache(redis_url, budget_bytes=30 * KIB)
    for n in range(3):
        cache.put(shard_key(n), blob_of(10 * KIB, n))
        time.sleep(0.002)  # distinct access times in ms
    cache.get(shard_key(0))
    cache.put(shard_key(3), blob_of(10 * KIB, 3))
    assert cache.get(shard_key(1)) is None
    assert all(cache.get(shard_key(n)) == blob_of(10 * KIB, n) for n in (0, 2, 3))
    assert cache.total_bytes() == 30 * KIB
    with pytest.raises(StatusError) as excinfo:
        cache.put(shard_key(4), blob_of(31 * KIB))
    assert excinfo.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "redis" in excinfo.value.message


def test_redis_corrupted_chunk_is_dropped(redis_url, caplog):
    import redis

    cache = redis_cache(redis_url)
    cache.put(shard_key(1), blob_of(10 * KIB))
    redis.Redis.from_url(redis_url.url).set(f"{redis_url.prefix}:shard:{shard_key(1)}:c1", b"\0" * 4 * KIB)
    with caplog.at_level(logging.WARNING, logger="loraserve.adapter_store.redis_cache"):
        assert cache.get(shard_key(1)) is None
    assert f"shard {shard_key(1)}" in caplog.text and "failed its xxh3-128 check" in caplog.text
    assert cache.total_bytes() == 0
    assert not list(redis.Redis.from_url(redis_url.url).scan_iter(match=f"{redis_url.prefix}:shard:*"))


def test_redis_open_streams_the_chunks_one_get_each_and_checks_them(redis_url, redis_proxy):
    cache = RedisCache(f"redis://127.0.0.1:{redis_proxy.port}/0", redis_url.prefix, 1 << 20, chunk_bytes=4 * KIB)
    blob = bytes(range(256)) * 40  # 10 KiB: three chunks
    cache.put(shard_key(1), blob)
    reader = cache.open(shard_key(1))
    assert (reader.size, reader.checksums, reader.tier) == (len(blob), Checksums.of(blob), "redis")
    requests_before = redis_proxy.requests
    assert read_all(reader, 3 * KIB) == blob and reader.finish()
    assert redis_proxy.requests - requests_before == 3  # one GET per chunk, as the reader reaches it
    assert cache.open(shard_key(2)) is None


def test_redis_open_drops_a_corrupted_copy_when_it_finishes(redis_url, caplog):
    import redis

    cache = redis_cache(redis_url)
    cache.put(shard_key(1), b"a" * 10 * KIB)
    redis.Redis.from_url(redis_url.url).set(f"{redis_url.prefix}:shard:{shard_key(1)}:c1", b"\0" * 4 * KIB)
    reader = cache.open(shard_key(1))
    with caplog.at_level(logging.WARNING, logger="loraserve.adapter_store.redis_cache"):
        assert len(read_all(reader, 4 * KIB)) == 10 * KIB and not reader.finish()
    assert "failed its xxh3-128 check; deleting it" in caplog.text and cache.size(shard_key(1)) is None


def test_redis_chunk_gone_mid_stream_is_data_loss(redis_url):
    import redis

    cache = redis_cache(redis_url)
    cache.put(shard_key(1), b"a" * 10 * KIB)
    reader = cache.open(shard_key(1))
    assert reader.readinto(memoryview(bytearray(4 * KIB))) == 4 * KIB
    redis.Redis.from_url(redis_url.url).delete(f"{redis_url.prefix}:shard:{shard_key(1)}:c1")  # another store evicts it
    with pytest.raises(StatusError) as excinfo:
        reader.readinto(memoryview(bytearray(4 * KIB)))
    assert excinfo.value.code == grpc.StatusCode.DATA_LOSS
    assert excinfo.value.message == (
        f"shard {shard_key(1)} in the store's redis cache at {redis_url.url}: chunk 1 is "
        "gone (evicted or replaced meanwhile): fetch it again"
    )


def test_redis_down_mid_stream_is_data_loss(redis_url, redis_proxy):
    url = f"redis://127.0.0.1:{redis_proxy.port}/0"
    cache = RedisCache(url, redis_url.prefix, 1 << 20, chunk_bytes=4 * KIB, socket_timeout_s=0.5)
    cache.put(shard_key(1), b"a" * 10 * KIB)
    reader = cache.open(shard_key(1))
    assert reader.readinto(memoryview(bytearray(4 * KIB))) == 4 * KIB
    redis_proxy.down()
    with pytest.raises(StatusError) as excinfo:
        reader.readinto(memoryview(bytearray(4 * KIB)))
    assert excinfo.value.code == grpc.StatusCode.DATA_LOSS
    assert excinfo.value.message.startswith(
        f"shard {shard_key(1)} in the store's redis cache at {url}: redis failed mid-stream ("
    )
    assert excinfo.value.message.endswith("): fetch it again")


def test_redis_delete_prefix(redis_url):
    cache = redis_cache(redis_url)
    for rank in range(3):
        cache.put(shard_key(1, rank), b"a" * 100)
    cache.put(shard_key(2), b"b" * 100)
    assert cache.delete_prefix(shard_key(1).split("/")[0]) == 3
    assert cache.total_bytes() == 100 and cache.get(shard_key(2)) == b"b" * 100


def test_redis_down_raises_cache_unavailable(closed_port):
    cache = RedisCache(f"redis://:secret@127.0.0.1:{closed_port}/0", "p", budget_bytes=1 << 20)
    with pytest.raises(CacheUnavailable, match=f"redis at redis://:\\*\\*\\*@127.0.0.1:{closed_port}/0 unavailable"):
        cache.get(shard_key(1))


def test_redis_copy_replaced_mid_stream_fails_the_stream_and_keeps_the_new_copy(redis_url, caplog):
    """Another store re-puts the shard (other bytes: packing is not byte-for-byte deterministic)
    while this one streams it: the read mixes two copies and fails its check, but the new copy,
    which is good, must stay."""
    cache, other = redis_cache(redis_url), redis_cache(redis_url)
    cache.put(shard_key(1), b"a" * 10 * KIB)
    reader = cache.open(shard_key(1))
    assert reader.readinto(memoryview(bytearray(4 * KIB))) == 4 * KIB
    other.put(shard_key(1), b"b" * 10 * KIB)
    with caplog.at_level(logging.INFO, logger="loraserve.adapter_store.redis_cache"):
        assert len(read_all(reader, 4 * KIB)) == 6 * KIB and not reader.finish()
    assert "was replaced while it was read; the new copy stays" in caplog.text
    assert "deleting it" not in caplog.text
    assert cache.get(shard_key(1)) == b"b" * 10 * KIB


def test_redis_reads_and_streams_an_old_format_copy_checking_its_sha256(redis_url, caplog):
    cache = redis_cache(redis_url)
    blob = bytes(range(256)) * 40
    cache.put(shard_key(1), blob)
    meta_key = f"{redis_url.prefix}:shard:{shard_key(1)}"
    cache._redis.hdel(meta_key, "xxh3_128")
    reader = cache.open(shard_key(1))
    assert reader.checksums == Checksums(hashlib.sha256(blob).hexdigest(), "")
    assert read_all(reader, 3 * KIB) == blob and reader.finish()
    assert cache.read(shard_key(1)) == (blob, Checksums.of(blob))

    chunk = bytearray(cache._redis.get(f"{meta_key}:c1"))
    chunk[0] ^= 0x01
    cache._redis.set(f"{meta_key}:c1", bytes(chunk))
    with caplog.at_level(logging.WARNING, logger="loraserve.adapter_store.redis_cache"):
        reader = cache.open(shard_key(1))
        read_all(reader, 3 * KIB)
        assert not reader.finish()
    assert "failed its sha256 check; deleting it" in caplog.text and cache.size(shard_key(1)) is None
