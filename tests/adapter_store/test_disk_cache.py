"""The disk tier against a real directory."""

from __future__ import annotations

import hashlib
import logging
import os
import time

import grpc
import pytest
import xxhash

from loraserve.adapter_store.checksum import Checksums
from loraserve.adapter_store.disk_cache import DiskCache
from loraserve.errors import StatusError

from .cache_parts import KIB, blob_of, read_all, shard_key


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
    with caplog.at_level(logging.WARNING, logger="loraserve.adapter_store.disk_cache"):
        assert cache.get(shard_key(1)) is None
    assert f"shard {shard_key(1)} in {path} failed its xxh3-128 check" in caplog.text
    assert not path.exists() and cache.total_bytes() == 0


@pytest.mark.parametrize(
    "key", ["../../etc/passwd", f"{'a' * 64}/../{'b' * 16}/tp0-ep0", "/abs/tp0-ep0", shard_key(1) + "\n", shard_key(1).upper()]
)
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
    assert read_all(reader, 3 * KIB) == blob and reader.finish()
    assert cache.read(shard_key(1)) == (blob, Checksums.of(blob))  # sha256 checked, xxh3 computed
    assert path.read_bytes()[:8] == b"LSSHARD1"  # left as it was

    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    time.sleep(0.02)
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="loraserve.adapter_store.disk_cache"):
        reader = cache.open(shard_key(1))
        assert read_all(reader, 3 * KIB) == bytes(data[40:]) and not reader.finish()
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
