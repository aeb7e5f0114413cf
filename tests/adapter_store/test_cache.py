"""Cache tiers against real parts: a disk directory and the Redis server at 127.0.0.1:6379."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import threading
import time
from urllib.parse import urlsplit

import grpc
import pytest
import xxhash

from loraserve.adapter_store.cache import CacheUnavailable, Checksums, DiskCache, RedisCache, TieredCache
from loraserve.errors import StatusError

KIB = 1024


def shard_key(n: int, rank: int = 0) -> str:
    """A well-formed key: <adapter sha256>/<layout hash>/tp<rank>-ep0."""
    digest = hashlib.sha256(f"adapter-{n}".encode()).hexdigest()
    return f"{digest}/{'ab' * 8}/tp{rank}-ep0"


def blob_of(n_bytes: int, seed: int = 0) -> bytes:
    return hashlib.sha256(str(seed).encode()).digest() * (n_bytes // 32) + b"x" * (n_bytes % 32)


# ---------------------------------------------------------------------------------------
# Disk
# ---------------------------------------------------------------------------------------


def test_disk_put_get_roundtrip_leaves_no_temp_files(tmp_path):
    cache = DiskCache(tmp_path, budget_bytes=1 << 20)
    assert cache.get(shard_key(1)) is None
    cache.put(shard_key(1), blob_of(10 * KIB))
    assert cache.get(shard_key(1)) == blob_of(10 * KIB)
    assert cache.total_bytes() == 10 * KIB
    assert not list((tmp_path / ".tmp").iterdir())


def test_disk_evicts_least_recently_used_over_budget(tmp_path):
    cache = DiskCache(tmp_path, budget_bytes=30 * KIB)
    for n in range(3):
        cache.put(shard_key(n), blob_of(10 * KIB, n))
    cache.get(shard_key(0))  # 0 is now newer than 1
    cache.put(shard_key(3), blob_of(10 * KIB, 3))
    assert cache.get(shard_key(1)) is None
    assert all(cache.get(shard_key(n)) == blob_of(10 * KIB, n) for n in (0, 2, 3))
    assert cache.total_bytes() == 30 * KIB


def test_disk_blob_over_budget_is_resource_exhausted(tmp_path):
    cache = DiskCache(tmp_path, budget_bytes=KIB)
    with pytest.raises(StatusError) as excinfo:
        cache.put(shard_key(1), blob_of(2 * KIB))
    assert excinfo.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert shard_key(1) in excinfo.value.message and "budget of 1024 bytes" in excinfo.value.message


def test_disk_index_and_lru_order_survive_restart(tmp_path):
    cache = DiskCache(tmp_path, budget_bytes=30 * KIB)
    for n in range(3):
        cache.put(shard_key(n), blob_of(10 * KIB, n))
        time.sleep(0.01)  # distinct mtimes
    cache.get(shard_key(0))
    (tmp_path / ".tmp" / "dead.tmp").write_bytes(b"half a write")

    reopened = DiskCache(tmp_path, budget_bytes=30 * KIB)
    assert reopened.total_bytes() == 30 * KIB
    assert not list((tmp_path / ".tmp").iterdir())
    reopened.put(shard_key(3), blob_of(10 * KIB, 3))
    assert reopened.get(shard_key(1)) is None  # the oldest before the restart went first
    assert reopened.get(shard_key(0)) == blob_of(10 * KIB, 0)


def test_disk_corrupted_file_is_dropped(tmp_path, caplog):
    cache = DiskCache(tmp_path, budget_bytes=1 << 20)
    cache.put(shard_key(1), blob_of(4 * KIB))
    path = tmp_path / f"{shard_key(1)}.shard"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="loraserve.adapter_store.cache"):
        assert cache.get(shard_key(1)) is None
    assert f"shard {shard_key(1)} in {path} failed its xxh3-128 check" in caplog.text
    assert not path.exists() and cache.total_bytes() == 0


@pytest.mark.parametrize("key", ["../../etc/passwd", f"{'a' * 64}/../{'b' * 16}/tp0-ep0", "/abs/tp0-ep0",
                                 shard_key(1) + "\n", shard_key(1).upper()])
def test_disk_rejects_keys_that_could_escape_the_root(tmp_path, key):
    cache = DiskCache(tmp_path, budget_bytes=1 << 20)
    with pytest.raises(StatusError) as excinfo:
        cache.put(key, b"x")
    assert excinfo.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "is not of the form" in excinfo.value.message
    assert sorted(os.listdir(tmp_path)) == [".tmp"]


def test_disk_delete_prefix_removes_every_shard_of_a_digest(tmp_path):
    cache = DiskCache(tmp_path, budget_bytes=1 << 20)
    for rank in range(2):
        cache.put(shard_key(1, rank), b"a" * 100)
    cache.put(shard_key(2), b"b" * 100)
    assert cache.delete_prefix(shard_key(1).split("/")[0]) == 2
    assert cache.total_bytes() == 100 and cache.get(shard_key(2)) == b"b" * 100
    assert sorted(os.listdir(tmp_path)) == sorted([".tmp", shard_key(2).split("/")[0]])


# ---------------------------------------------------------------------------------------
# Redis
# ---------------------------------------------------------------------------------------


class RedisProxy:
    """A loopback TCP proxy in front of Redis that counts client requests (bursts of bytes
    sent before waiting for a reply) and can go down and come back on the same port."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.requests = 0
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.up()

    def up(self) -> None:
        if self._listener.fileno() == -1:
            self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def down(self) -> None:
        with self._lock:
            for sock in [self._listener, *self._sockets]:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self._sockets.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                if count:
                    with self._lock:
                        self.requests += 1
                dst.sendall(data)
        for sock in (src, dst):
            sock.close()


@pytest.fixture
def redis_proxy(redis_url):
    proxy = RedisProxy(urlsplit(redis_url.url).port)
    yield proxy
    proxy.down()



def redis_cache(target, budget_bytes: int = 1 << 20, chunk_bytes: int = 4 * KIB) -> RedisCache:
    return RedisCache(target.url, target.prefix, budget_bytes=budget_bytes, chunk_bytes=chunk_bytes)


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
    with caplog.at_level(logging.WARNING, logger="loraserve.adapter_store.cache"):
        assert cache.get(shard_key(1)) is None
    assert f"shard {shard_key(1)}" in caplog.text and "failed its xxh3-128 check" in caplog.text
    assert cache.total_bytes() == 0
    assert not list(redis.Redis.from_url(redis_url.url).scan_iter(match=f"{redis_url.prefix}:shard:*"))


def _read_all(reader, piece: int) -> bytes:
    out = bytearray()
    buf = bytearray(piece)
    while n := reader.readinto(memoryview(buf)):
        out += buf[:n]
    return bytes(out)


def test_redis_open_streams_the_chunks_one_get_each_and_checks_them(redis_url, redis_proxy):
    cache = RedisCache(f"redis://127.0.0.1:{redis_proxy.port}/0", redis_url.prefix, 1 << 20, chunk_bytes=4 * KIB)
    blob = bytes(range(256)) * 40  # 10 KiB: three chunks
    cache.put(shard_key(1), blob)
    reader = cache.open(shard_key(1))
    assert (reader.size, reader.checksums, reader.tier) == (len(blob), Checksums.of(blob), "redis")
    requests_before = redis_proxy.requests
    assert _read_all(reader, 3 * KIB) == blob and reader.finish()
    assert redis_proxy.requests - requests_before == 3  # one GET per chunk, as the reader reaches it
    assert cache.open(shard_key(2)) is None


def test_redis_open_drops_a_corrupted_copy_when_it_finishes(redis_url, caplog):
    import redis

    cache = redis_cache(redis_url)
    cache.put(shard_key(1), b"a" * 10 * KIB)
    redis.Redis.from_url(redis_url.url).set(f"{redis_url.prefix}:shard:{shard_key(1)}:c1", b"\0" * 4 * KIB)
    reader = cache.open(shard_key(1))
    with caplog.at_level(logging.WARNING, logger="loraserve.adapter_store.cache"):
        assert len(_read_all(reader, 4 * KIB)) == 10 * KIB and not reader.finish()
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
    assert excinfo.value.message == (f"shard {shard_key(1)} in the store's redis cache at {redis_url.url}: chunk 1 is "
                                     "gone (evicted or replaced meanwhile): fetch it again")


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
    assert excinfo.value.message.startswith(f"shard {shard_key(1)} in the store's redis cache at {url}: redis failed "
                                            "mid-stream (")
    assert excinfo.value.message.endswith("): fetch it again")


def test_tiered_open_streams_from_the_first_tier_up_and_leaves_back_fills_to_read(redis_url, tmp_path, closed_port):
    redis_tier, disk_tier = redis_cache(redis_url), DiskCache(tmp_path, 1 << 20)
    cache = TieredCache([redis_tier, disk_tier])
    disk_tier.put(shard_key(1), b"x" * 300)
    assert cache.open(shard_key(1)) is None  # redis misses it: read() back-fills it whole
    assert cache.read(shard_key(1))[1] == "disk" and redis_tier.size(shard_key(1)) == 300
    reader = cache.open(shard_key(1))
    assert reader.tier == "redis" and _read_all(reader, 128) == b"x" * 300 and reader.finish()
    down = TieredCache([RedisCache(f"redis://127.0.0.1:{closed_port}/0", "p", 1 << 20), disk_tier], retry_after_s=60)
    for _ in range(2):  # found down, then passed over: nothing to back-fill into it, disk streams
        reader = down.open(shard_key(1))
        assert reader.tier == "disk" and _read_all(reader, 128) == b"x" * 300
        reader.finish()


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


# ---------------------------------------------------------------------------------------
# Tiered
# ---------------------------------------------------------------------------------------


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
    assert [r.levelname for r in caplog.records if "redis" in r.getMessage() and "avail" in r.getMessage()] == [
        "WARNING", "INFO"]


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


def test_redis_copy_replaced_mid_stream_fails_the_stream_and_keeps_the_new_copy(redis_url, caplog):
    """Another store re-puts the shard (other bytes: packing is not byte-for-byte deterministic)
    while this one streams it: the read mixes two copies and fails its check, but the new copy,
    which is good, must stay."""
    cache, other = redis_cache(redis_url), redis_cache(redis_url)
    cache.put(shard_key(1), b"a" * 10 * KIB)
    reader = cache.open(shard_key(1))
    assert reader.readinto(memoryview(bytearray(4 * KIB))) == 4 * KIB
    other.put(shard_key(1), b"b" * 10 * KIB)
    with caplog.at_level(logging.INFO, logger="loraserve.adapter_store.cache"):
        assert len(_read_all(reader, 4 * KIB)) == 6 * KIB and not reader.finish()
    assert "was replaced while it was read; the new copy stays" in caplog.text
    assert "deleting it" not in caplog.text
    assert cache.get(shard_key(1)) == b"b" * 10 * KIB


# ---------------------------------------------------------------------------------------
# Copies cached before xxh3-128 was kept (sha256 only)
# ---------------------------------------------------------------------------------------


def _write_old_disk_file(root, key: str, blob: bytes):
    path = root / f"{key}.shard"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"LSSHARD1" + hashlib.sha256(blob).digest() + blob)
    return path


def test_disk_reads_and_streams_an_old_format_file_checking_its_sha256(tmp_path, caplog):
    blob = blob_of(10 * KIB)
    path = _write_old_disk_file(tmp_path, shard_key(1), blob)
    cache = DiskCache(tmp_path, budget_bytes=1 << 20)
    assert cache.total_bytes() == 10 * KIB and cache.size(shard_key(1)) == 10 * KIB  # its 40-byte header
    reader = cache.open(shard_key(1))  # not checked since it was written: hashed as read, with sha256
    assert reader.verify and reader.checksums == Checksums(hashlib.sha256(blob).hexdigest(), "")
    assert _read_all(reader, 3 * KIB) == blob and reader.finish()
    assert cache.read(shard_key(1)) == (blob, Checksums.of(blob))  # sha256 checked, xxh3 computed
    assert path.read_bytes()[:8] == b"LSSHARD1"  # left as it was

    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    time.sleep(0.02)
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="loraserve.adapter_store.cache"):
        reader = cache.open(shard_key(1))
        assert _read_all(reader, 3 * KIB) == bytes(data[40:]) and not reader.finish()
    assert f"shard {shard_key(1)} in {path} failed its sha256 check" in caplog.text
    assert not path.exists() and cache.total_bytes() == 0


def test_disk_new_files_keep_both_checksums(tmp_path):
    cache = DiskCache(tmp_path, budget_bytes=1 << 20)
    blob = blob_of(5 * KIB)
    cache.put(shard_key(1), blob)
    data = (tmp_path / f"{shard_key(1)}.shard").read_bytes()
    assert data[:8] == b"LSSHARD2" and data[8:40] == hashlib.sha256(blob).digest()
    assert data[40:56].hex() == xxhash.xxh3_128_hexdigest(blob) and data[56:] == blob
    assert cache.read(shard_key(1)) == (blob, Checksums("", xxhash.xxh3_128_hexdigest(blob)))  # what it checked


def test_redis_reads_and_streams_an_old_format_copy_checking_its_sha256(redis_url, caplog):
    cache = redis_cache(redis_url)
    blob = bytes(range(256)) * 40
    cache.put(shard_key(1), blob)
    meta_key = f"{redis_url.prefix}:shard:{shard_key(1)}"
    cache._redis.hdel(meta_key, "xxh3_128")
    reader = cache.open(shard_key(1))
    assert reader.checksums == Checksums(hashlib.sha256(blob).hexdigest(), "")
    assert _read_all(reader, 3 * KIB) == blob and reader.finish()
    assert cache.read(shard_key(1)) == (blob, Checksums.of(blob))

    chunk = bytearray(cache._redis.get(f"{meta_key}:c1"))
    chunk[0] ^= 0x01
    cache._redis.set(f"{meta_key}:c1", bytes(chunk))
    with caplog.at_level(logging.WARNING, logger="loraserve.adapter_store.cache"):
        reader = cache.open(shard_key(1))
        _read_all(reader, 3 * KIB)
        assert not reader.finish()
    assert "failed its sha256 check; deleting it" in caplog.text and cache.size(shard_key(1)) is None
