"""What the store promises about the shards it streams, through real gRPC on loopback: a
shard crosses several chunks intact, concurrent FetchShards share one pack, a cached copy
that fails its sha256 (on disk or in Redis) is dropped and rebuilt, and stored adapter files
that no longer match their digest are DATA_LOSS (never packed) until registered again."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import re
import shutil
import threading
import time
from pathlib import Path

import grpc
import pytest
import redis
import torch
import xxhash

from loraserve.adapter_store import pack, validate
from loraserve.adapter_store.config import StoreConfig
from loraserve.adapter_store.service import MAX_CHUNK, serve
from loraserve.adapter_store.sources import SourceConfig
from loraserve.client import ShardAssembler, StoreClient
from loraserve.errors import StatusError
from loraserve.v1 import adapter_store_pb2 as spb
from loraserve.v1 import adapter_store_pb2_grpc as spb_grpc
from loraserve.v1 import common_pb2 as pb

H = 64


def layout(tp: int = 1) -> pb.Layout:
    lay = pb.Layout(tp_size=tp, dtype="float32", max_rank=32, base_model="tiny-llama")
    for i in range(2):
        p = f"model.layers.{i}.self_attn"
        lay.modules.add(
            name=f"{p}.qkv_proj",
            kind=pb.QKV,
            input_size=H,
            output_sizes=[64, 32, 32],
            head_size=16,
            peft_modules=[f"{p}.{x}_proj" for x in "qkv"],
        )
        lay.modules.add(name=f"{p}.o_proj", kind=pb.ROW, input_size=64, output_sizes=[H], peft_modules=[f"{p}.o_proj"])
    return lay


class Store:
    """A real store on a free loopback port, with one adapter registered from a PEFT folder."""

    def __init__(self, loop_thread, tmp_path: Path, tiny_llama_dir: Path, adapter_dir: Path, **overrides):
        self.root = tmp_path / "adapters"
        shutil.copytree(adapter_dir, self.root / "a")
        self.cfg = StoreConfig(
            listen="127.0.0.1:0",
            data_dir=tmp_path / "store",
            base_model="tiny-llama",
            base_model_path=tiny_llama_dir,
            sources=SourceConfig(local_roots=(self.root,)),
            limits=validate.Limits(max_rank=32),
            **overrides,
        )
        self.lt = loop_thread
        self.server, port = loop_thread.run(serve(self.cfg), 30)
        self.address = f"127.0.0.1:{port}"
        self.client = StoreClient(self.address, timeout_s=60)
        self.manifest = self.client.register("a", str(self.root / "a"))

    def stop(self):
        self.client.close()
        self.lt.run(self.server.stop(0), 10)


@pytest.fixture
def store(loop_thread, tmp_path, tiny_llama_dir, peft_adapter):
    s = Store(loop_thread, tmp_path, tiny_llama_dir, peft_adapter(r=8))
    yield s
    s.stop()


def raw_chunks(address: str, chunk_bytes: int, lay: pb.Layout | None = None, xxh3: bool = True) -> list[spb.ShardChunk]:
    """The stream's messages; xxh3 False: as a client from before xxh3 trailers asks."""
    with grpc.insecure_channel(address) as channel:
        req = spb.FetchShardRequest(name="a", layout=lay or layout(), chunk_bytes=chunk_bytes, xxh3=xxh3)
        return list(spb_grpc.AdapterStoreStub(channel).FetchShard(req, timeout=60))


# -- multi-chunk streams ----------------------------------------------------------------------
def test_a_shard_streams_over_many_chunks_and_reassembles_exactly(store):
    header, whole = store.client.fetch_shard("a", layout())  # default chunk (1 MiB): one data message
    assert len(whole) > 3000
    for chunk_bytes in (1000, len(whole) - 1, len(whole)):
        chunks = raw_chunks(store.address, chunk_bytes)
        kinds = [c.WhichOneof("part") for c in chunks]
        n_data = math.ceil(len(whole) / chunk_bytes)
        assert kinds == ["header"] + ["data"] * n_data + ["trailer"], (chunk_bytes, kinds)
        assert [len(c.data) for c in chunks[1:-1]] == [chunk_bytes] * (n_data - 1) + [len(whole) - chunk_bytes * (n_data - 1)]
        asm = ShardAssembler()
        for c in chunks:
            asm.add(c)
        got_header, blob = asm.result()
        assert blob == whole and got_header.total_bytes == len(whole) and got_header.cache_tier == "disk"
        assert chunks[-1].trailer == spb.ShardTrailer(xxh3_128=xxhash.xxh3_128_hexdigest(whole))  # no sha256
    with pytest.raises(grpc.RpcError) as e:
        raw_chunks(store.address, MAX_CHUNK + 1)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == f"chunk_bytes {MAX_CHUNK + 1} is above the maximum of {MAX_CHUNK}"


# -- single-flight packing --------------------------------------------------------------------
def test_concurrent_fetches_of_an_uncached_shard_share_one_pack(store, monkeypatch):
    packs = []
    real_pack_full = pack.pack_full

    def slow_pack_full(*args, **kwargs):  # the real pack, slowed so every request arrives during it
        packs.append(threading.get_ident())
        time.sleep(0.5)
        return real_pack_full(*args, **kwargs)

    monkeypatch.setattr(pack, "pack_full", slow_pack_full)
    n = 6
    barrier = threading.Barrier(n)
    results: list = [None] * n

    def fetch(i):
        client = StoreClient(store.address, timeout_s=60)
        barrier.wait()
        results[i] = client.fetch_shard("a", layout(2), tp_rank=1)
        client.close()

    threads = [threading.Thread(target=fetch, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(packs) == 1, f"{len(packs)} packs for {n} concurrent requests"
    assert [h.cache_tier for h, _ in results] == ["packed"] * n  # every one was served by that pack
    assert len({blob for _, blob in results}) == 1
    assert store.client.fetch_shard("a", layout(2), tp_rank=1)[0].cache_tier == "disk" and len(packs) == 1


# -- cached copies that fail their checksum -----------------------------------------------------
@pytest.fixture
def redis_store(loop_thread, tmp_path, tiny_llama_dir, peft_adapter, redis_url):
    s = Store(loop_thread, tmp_path, tiny_llama_dir, peft_adapter(r=8), redis_url=redis_url.url, redis_prefix=redis_url.prefix)
    s.redis = redis.Redis.from_url(redis_url.url)
    s.prefix = redis_url.prefix
    yield s
    s.redis.close()
    s.stop()


def test_a_corrupted_redis_copy_is_dropped_and_served_from_disk_then_repacked(redis_store, caplog):
    s = redis_store
    header, good = s.client.fetch_shard("a", layout())
    assert header.cache_tier == "packed"
    key = pack.shard_key(s.manifest.digest, layout(), pb.ShardRank())
    meta_key = f"{s.prefix}:shard:{key}"
    chunk0 = bytearray(s.redis.get(f"{meta_key}:c0"))
    chunk0[-5] ^= 0x01  # one bit of the last tensor's data: still a loadable safetensors blob
    s.redis.set(f"{meta_key}:c0", bytes(chunk0))

    caplog.set_level(logging.WARNING, logger="loraserve.adapter_store.redis_cache")
    header, blob = s.client.fetch_shard("a", layout())
    assert (header.cache_tier, blob) == ("disk", good)  # the bad Redis copy was not served
    assert f"redis cache: shard {key}" in caplog.text and "failed its xxh3-128 check; deleting it" in caplog.text
    assert s.redis.get(f"{meta_key}:c0") == good  # back-filled from disk with the good bytes
    assert s.client.fetch_shard("a", layout())[0].cache_tier == "redis"

    # Both copies bad: neither is served; the shard is packed again and both tiers hold it again.
    s.redis.set(f"{meta_key}:c0", bytes(chunk0))
    (shard_file,) = (s.cfg.data_dir / "cache").rglob("*.shard")
    data = bytearray(shard_file.read_bytes())
    data[-5] ^= 0x01
    shard_file.write_bytes(bytes(data))
    header, blob = s.client.fetch_shard("a", layout())
    assert header.cache_tier == "packed" and pack_equal(blob, good)
    assert s.client.fetch_shard("a", layout())[0].cache_tier == "redis"
    assert pack_equal(shard_file.read_bytes()[56:], good)  # after the 56-byte header: magic, sha256, xxh3-128


def _raw_stream_error(address: str) -> grpc.RpcError:
    """The error of a FetchShard stream read with the bare stub (no retry), which must come before a trailer."""
    with grpc.insecure_channel(address) as channel:
        stream = spb_grpc.AdapterStoreStub(channel).FetchShard(spb.FetchShardRequest(name="a", layout=layout()), timeout=60)
        with pytest.raises(grpc.RpcError) as e:
            for chunk in stream:
                assert chunk.WhichOneof("part") != "trailer"
    return e.value


def _corrupt_redis_copy_and_expect_data_loss(s, meta_key: str, kind: str, caplog) -> None:
    """One bit of the Redis copy's first chunk flipped: its stream fails DATA_LOSS before the trailer,
    naming the checksum (`kind`) it failed, and the copy is dropped."""
    chunk0 = bytearray(s.redis.get(f"{meta_key}:c0"))
    chunk0[-5] ^= 0x01
    s.redis.set(f"{meta_key}:c0", bytes(chunk0))
    caplog.set_level(logging.WARNING, logger="loraserve.adapter_store.redis_cache")
    error = _raw_stream_error(s.address)
    assert error.code() == grpc.StatusCode.DATA_LOSS
    assert error.details() == (
        f"the cached shard of adapter 'a' failed its {kind} check in the store's redis cache and was dropped: fetch it again"
    )
    assert f"failed its {kind} check; deleting it" in caplog.text and not s.redis.exists(meta_key)


def test_a_redis_copy_streams_as_it_is_read_and_a_bad_one_fails_before_its_trailer(redis_store, caplog):
    s = redis_store
    _, good = s.client.fetch_shard("a", layout())  # packed, then put in both tiers
    chunks = raw_chunks(s.address, 1 << 12)
    assert chunks[0].header.cache_tier == "redis" and b"".join(c.data for c in chunks[1:-1]) == good
    assert chunks[-1].trailer == spb.ShardTrailer(xxh3_128=xxhash.xxh3_128_hexdigest(good))
    key = pack.shard_key(s.manifest.digest, layout(), pb.ShardRank())
    meta_key = f"{s.prefix}:shard:{key}"
    _corrupt_redis_copy_and_expect_data_loss(s, meta_key, "xxh3-128", caplog)
    header, blob = s.client.fetch_shard("a", layout())
    assert header.cache_tier == "disk" and blob == good  # Redis missed it: read whole from disk, back-filled
    header, blob = s.client.fetch_shard("a", layout())
    assert header.cache_tier == "redis" and blob == good


def test_a_redis_chunk_gone_mid_stream_is_data_loss_and_the_client_asks_again(redis_store):
    s = redis_store
    _, good = s.client.fetch_shard("a", layout())
    key = pack.shard_key(s.manifest.digest, layout(), pb.ShardRank())
    s.redis.delete(f"{s.prefix}:shard:{key}:c0")  # evicted by another store after the header went out
    error = _raw_stream_error(s.address)
    assert error.code() == grpc.StatusCode.DATA_LOSS
    assert error.details() == (
        f"shard {key} in the store's redis cache at {s.cfg.redis_url}: chunk 0 is gone "
        "(evicted or replaced meanwhile): fetch it again"
    )
    header, blob = s.client.fetch_shard("a", layout())  # DATA_LOSS, then verify=True: a whole read, from disk
    assert header.cache_tier == "disk" and blob == good


def pack_equal(blob1: bytes, blob2: bytes) -> bool:
    """Equal tensors (safetensors writes its metadata map in no fixed order, so bytes may differ)."""
    import torch
    from safetensors.torch import load as st_load

    t1, t2 = st_load(blob1), st_load(blob2)
    return t1.keys() == t2.keys() and all(torch.equal(t1[k], t2[k]) for k in t1)


def test_stored_files_not_matching_their_digest_are_data_loss_until_registered_again(store):
    stored = store.cfg.data_dir / "adapters" / store.manifest.digest / "adapter_model.safetensors"
    data = bytearray(stored.read_bytes())
    data[-3] ^= 0x01  # a low mantissa bit of the last weight: valid, finite, but not what was registered
    stored.write_bytes(bytes(data))
    for _ in range(2):  # and again: the damaged adapter is not kept in memory either
        with pytest.raises(StatusError) as e:
            store.client.fetch_shard("a", layout())
        assert e.value.code == grpc.StatusCode.DATA_LOSS
        assert e.value.message == (
            f"stored files of adapter 'a' no longer match digest {store.manifest.digest[:12]}: register it again"
        )
    assert list((store.cfg.data_dir / "cache").rglob("*.shard")) == []  # nothing packed from it
    # What the message says works: the same source registered again repairs the stored copy.
    assert store.client.register("a", str(store.root / "a")).digest == store.manifest.digest
    header, blob = store.client.fetch_shard("a", layout())
    expected = pack.shard_blob(*_expected_shard(store.root / "a"))
    assert header.cache_tier == "packed" and pack_equal(blob, expected)


def _expected_shard(adapter_dir: Path):
    adapter = pack.load_adapter(adapter_dir, None, validate.Limits())
    lay, rank = layout(), pb.ShardRank()
    return adapter, pack.shard(pack.pack_full(adapter, lay), lay, rank), lay, rank


# -- disk copies streamed as they are read ------------------------------------------------------
def _disk_file(s) -> Path:
    (path,) = (s.cfg.data_dir / "cache").rglob("*.shard")
    return path


def test_a_disk_copy_changed_since_its_check_is_hashed_while_streamed_and_dropped_if_bad(store, caplog):
    header, good = store.client.fetch_shard("a", layout())  # packed and cached: the store checked it
    path = _disk_file(store)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # still a loadable blob: only the checksum knows
    time.sleep(0.02)  # a later mtime than the check's, even on coarse file clocks
    path.write_bytes(bytes(data))
    caplog.set_level(logging.WARNING, logger="loraserve.adapter_store.disk_cache")
    with grpc.insecure_channel(store.address) as channel:
        stream = spb_grpc.AdapterStoreStub(channel).FetchShard(spb.FetchShardRequest(name="a", layout=layout()), timeout=60)
        with pytest.raises(grpc.RpcError) as e:
            for chunk in stream:
                assert chunk.WhichOneof("part") != "trailer"  # the bad copy never gets its trailer
    assert e.value.code() == grpc.StatusCode.DATA_LOSS
    assert e.value.details() == (
        "the cached shard of adapter 'a' failed its xxh3-128 check in the store's disk cache and was dropped: fetch it again"
    )
    assert "failed its xxh3-128 check; deleting it" in caplog.text and not path.exists()
    header, blob = store.client.fetch_shard("a", layout())
    assert header.cache_tier == "packed" and pack_equal(blob, good)


def test_the_python_client_asks_again_with_verify_when_a_stream_fails_after_its_header(store):
    _, good = store.client.fetch_shard("a", layout())
    path = _disk_file(store)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    time.sleep(0.02)
    path.write_bytes(bytes(data))
    header, blob = store.client.fetch_shard("a", layout())  # one call: DATA_LOSS, then verify=True
    assert header.cache_tier == "packed" and pack_equal(blob, good)


def test_a_checked_disk_copy_streams_with_the_xxh3_stored_beside_it(store):
    _, good = store.client.fetch_shard("a", layout())
    chunks = raw_chunks(store.address, 1 << 12)
    assert chunks[0].header.cache_tier == "disk"
    assert b"".join(c.data for c in chunks[1:-1]) == good
    assert chunks[-1].trailer == spb.ShardTrailer(xxh3_128=xxhash.xxh3_128_hexdigest(good))
    # verify=True: read whole and checked before the first byte goes out, same bytes
    with grpc.insecure_channel(store.address) as channel:
        req = spb.FetchShardRequest(name="a", layout=layout(), verify=True, xxh3=True)
        verified = list(spb_grpc.AdapterStoreStub(channel).FetchShard(req, timeout=60))
    assert verified[0].header.cache_tier == "disk" and b"".join(c.data for c in verified[1:-1]) == good


def test_assembler_refuses_more_bytes_than_the_header_said():
    asm = ShardAssembler(allocate=bytearray)
    asm.add(spb.ShardChunk(header=spb.ShardHeader(total_bytes=4)))
    asm.add_raw(spb.ShardChunk(data=b"abc").SerializeToString())
    with pytest.raises(StatusError) as e:
        asm.add_raw(spb.ShardChunk(data=b"de").SerializeToString())
    assert e.value.code == grpc.StatusCode.DATA_LOSS
    assert e.value.message == "shard stream sent more than the 4 bytes its header said"


# -- the stream checksum: xxh3-128, sha256 for copies cached before it was kept -----------------
def _assemble(chunks: list[spb.ShardChunk], threaded: bool):
    """(header, blob) through ShardAssembler, as the executor (buffer + hash thread) or the CLI does."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        asm = ShardAssembler(bytearray, pool) if threaded else ShardAssembler()
        for c in chunks:
            asm.add_raw(c.SerializeToString())
        header, blob = asm.result()
        return header, bytes(blob)


@pytest.mark.parametrize("threaded", [False, True])
def test_a_stream_whose_xxh3_trailer_does_not_match_a_corrupted_chunk_is_data_loss(store, threaded):
    _, good = store.client.fetch_shard("a", layout())
    chunks = raw_chunks(store.address, 1 << 12)
    assert chunks[-1].trailer.xxh3_128 and not chunks[-1].trailer.sha256
    assert _assemble(chunks, threaded)[1] == good
    bad = bytearray(chunks[2].data)
    bad[7] ^= 0x10  # one bit in a middle chunk
    with pytest.raises(StatusError) as e:
        _assemble([*chunks[:2], spb.ShardChunk(data=bytes(bad)), *chunks[3:]], threaded)
    assert e.value.code == grpc.StatusCode.DATA_LOSS
    assert e.value.message == "shard checksum mismatch: the stream was corrupted"


@pytest.mark.parametrize("threaded", [False, True])
def test_a_sha256_only_trailer_is_still_checked(store, threaded):
    """A trailer from an older store, or for a copy cached before xxh3 was kept: sha256 only."""
    _, good = store.client.fetch_shard("a", layout())
    chunks = raw_chunks(store.address, 1 << 12)
    old = [*chunks[:-1], spb.ShardChunk(trailer=spb.ShardTrailer(sha256=hashlib.sha256(good).hexdigest()))]
    assert _assemble(old, threaded)[1] == good
    bad = bytearray(old[1].data)
    bad[0] ^= 0x01
    for chunks in (
        [old[0], spb.ShardChunk(data=bytes(bad)), *old[2:]],  # corrupted data
        [*old[:-1], spb.ShardChunk(trailer=spb.ShardTrailer())],
    ):  # no checksum at all
        with pytest.raises(StatusError) as e:
            _assemble(chunks, threaded)
        assert e.value.message == "shard checksum mismatch: the stream was corrupted"


def _as_old_disk_file(path: Path) -> bytes:
    """Rewrites a shard file in the format of before xxh3 (LSSHARD1 + sha256 + blob); the blob."""
    data = path.read_bytes()
    assert data[:8] == b"LSSHARD2"
    blob = data[56:]
    time.sleep(0.02)  # a later mtime than the store's check
    path.write_bytes(b"LSSHARD1" + hashlib.sha256(blob).digest() + blob)
    return blob


def test_an_old_format_disk_copy_streams_with_its_sha256_and_a_bad_one_is_data_loss(store, caplog):
    _, good = store.client.fetch_shard("a", layout())
    path = _disk_file(store)
    assert _as_old_disk_file(path) == good
    chunks = raw_chunks(store.address, 1 << 12)  # streamed as read, hashed (sha256) on the way
    assert chunks[0].header.cache_tier == "disk" and b"".join(c.data for c in chunks[1:-1]) == good
    assert chunks[-1].trailer == spb.ShardTrailer(sha256=hashlib.sha256(good).hexdigest())
    header, blob = store.client.fetch_shard("a", layout())  # the client checks that sha256
    assert header.cache_tier == "disk" and blob == good
    # verify=True reads it whole: its sha256 is checked, and the trailer carries xxh3 computed then
    with grpc.insecure_channel(store.address) as channel:
        req = spb.FetchShardRequest(name="a", layout=layout(), verify=True, xxh3=True)
        verified = list(spb_grpc.AdapterStoreStub(channel).FetchShard(req, timeout=60))
    assert verified[-1].trailer == spb.ShardTrailer(xxh3_128=xxhash.xxh3_128_hexdigest(good))
    assert _assemble(verified, threaded=True)[1] == good

    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    time.sleep(0.02)
    path.write_bytes(bytes(data))
    caplog.set_level(logging.WARNING, logger="loraserve.adapter_store.disk_cache")
    error = _raw_stream_error(store.address)
    assert error.code() == grpc.StatusCode.DATA_LOSS
    assert error.details() == (
        "the cached shard of adapter 'a' failed its sha256 check in the store's disk cache and was dropped: fetch it again"
    )
    assert "failed its sha256 check; deleting it" in caplog.text and not path.exists()
    header, blob = store.client.fetch_shard("a", layout())
    assert header.cache_tier == "packed" and pack_equal(blob, good)
    assert _disk_file(store).read_bytes()[:8] == b"LSSHARD2"  # cached anew in the new format


def test_an_old_format_redis_copy_streams_with_its_sha256_and_a_bad_one_is_data_loss(redis_store, caplog):
    s = redis_store
    _, good = s.client.fetch_shard("a", layout())
    key = pack.shard_key(s.manifest.digest, layout(), pb.ShardRank())
    meta_key = f"{s.prefix}:shard:{key}"
    assert s.redis.hget(meta_key, "xxh3_128").decode() == xxhash.xxh3_128_hexdigest(good)
    s.redis.hdel(meta_key, "xxh3_128")  # as written before xxh3 was kept: size, n_chunks, sha256
    chunks = raw_chunks(s.address, 1 << 12)
    assert chunks[0].header.cache_tier == "redis" and b"".join(c.data for c in chunks[1:-1]) == good
    assert chunks[-1].trailer == spb.ShardTrailer(sha256=hashlib.sha256(good).hexdigest())
    header, blob = s.client.fetch_shard("a", layout())
    assert header.cache_tier == "redis" and blob == good

    _corrupt_redis_copy_and_expect_data_loss(s, meta_key, "sha256", caplog)
    header, blob = s.client.fetch_shard("a", layout())
    assert header.cache_tier == "disk" and blob == good  # back-filled into Redis with both checksums
    assert s.redis.hget(meta_key, "xxh3_128").decode() == xxhash.xxh3_128_hexdigest(good)


@pytest.mark.parametrize("tiers", ["disk", "redis"])
def test_a_client_from_before_xxh3_gets_sha256_trailers_from_every_tier(tiers, request):
    """A request without `xxh3` (an executor older than the store, in a rolling upgrade) gets the
    sha256 trailer it checks: computed for the freshly packed shard, stored with cached copies."""
    s = request.getfixturevalue("store" if tiers == "disk" else "redis_store")
    first = raw_chunks(s.address, 1 << 12, xxh3=False)
    blob = b"".join(c.data for c in first[1:-1])
    want = spb.ShardTrailer(sha256=hashlib.sha256(blob).hexdigest())
    assert first[0].header.cache_tier == "packed" and first[-1].trailer == want
    again = raw_chunks(s.address, 1 << 12, xxh3=False)
    assert again[0].header.cache_tier == tiers and again[-1].trailer == want
    asm = ShardAssembler()
    for c in again:
        asm.add(c)
    assert asm.result()[1] == blob  # the checksum a pre-xxh3 client checks: it passes
    new = raw_chunks(s.address, 1 << 12)  # a current client: xxh3 from the same copy
    assert new[-1].trailer == spb.ShardTrailer(xxh3_128=xxhash.xxh3_128_hexdigest(blob))


def shard_key(digest: str) -> str:
    return pack.shard_key(digest, layout(), pb.ShardRank())


def test_a_wrong_stored_sha256_is_not_passed_on_and_an_older_client_s_retry_gets_a_computed_one(redis_store):
    """A copy is checked by its xxh3-128; its stored sha256 was not checked, so a read reports none:
    a back-fill recomputes it (the bad one does not spread to the Redis tier), and the trailer an
    older client's verify retry gets is computed from the bytes."""
    s = redis_store
    blob = b"".join(c.data for c in raw_chunks(s.address, 1 << 12)[1:-1])  # packed, in Redis and on disk
    good = hashlib.sha256(blob).hexdigest()
    (path,) = (s.cfg.data_dir / "cache").rglob("*.shard")
    head = bytearray(path.read_bytes())
    assert head[8:40].hex() == good  # LSSHARD2: magic, sha256, xxh3-128, blob
    head[8:40] = bytes(32)  # the stored sha256 goes bad, the bytes do not
    path.write_bytes(bytes(head))
    meta_key = f"{s.prefix}:shard:{shard_key(s.manifest.digest)}"
    s.redis.delete(meta_key, *s.redis.keys(f"{meta_key}:c*"))  # the Redis copy gone: the disk one back-fills it
    with grpc.insecure_channel(s.address) as channel:
        req = spb.FetchShardRequest(name="a", layout=layout(), verify=True)  # an older client's retry: no xxh3
        retry = list(spb_grpc.AdapterStoreStub(channel).FetchShard(req, timeout=60))
    assert retry[0].header.cache_tier == "disk" and retry[-1].trailer == spb.ShardTrailer(sha256=good)
    assert s.redis.hget(meta_key, "sha256").decode() == good  # back-filled with the sha256 of its bytes


def test_a_cancelled_stream_closes_its_reader_only_after_the_read_in_flight_ends():
    """A client gone while the store reads the next chunk in a thread (the stream awaits it and is
    cancelled there): the read runs on, and the reader is closed only after it, never under it."""
    from loraserve.adapter_store.service import _streamed

    events, started, release = [], threading.Event(), threading.Event()

    class Reader:
        tier = "disk"

        def readinto(self, view) -> int:
            events.append("read")
            if events.count("read") == 2:  # the read the cancelled stream waits for
                started.set()
                release.wait(10)
            view[:4] = b"abcd"
            events.append("read done")
            return 4

        def finish(self) -> bool:
            return True

        def close(self) -> None:
            events.append("close")

    async def run():
        stream = _streamed(Reader(), 16, "a")
        assert (await stream.__anext__()).endswith(b"abcd")
        waiting = asyncio.ensure_future(stream.__anext__())
        await asyncio.to_thread(started.wait, 10)
        waiting.cancel()
        threading.Timer(0.2, release.set).start()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(run())
    assert events == ["read", "read done", "read", "read done", "close"]


def test_a_stream_closed_after_its_header_closes_the_shard_reader_at_once(store, monkeypatch):
    """A client gone while the header is on its way, before the first data chunk is asked for: the
    cached shard's reader (an open file) is closed then, not when the garbage collector gets to it."""
    from loraserve.adapter_store import checksum
    from loraserve.adapter_store.service import AdapterStoreService

    raw_chunks(store.address, 1 << 20)  # packed and cached: the next fetch streams from a reader
    closed, close = [], checksum.ShardReader.close
    monkeypatch.setattr(checksum.ShardReader, "close", lambda self: (closed.append(self.tier), close(self))[1])

    async def run():
        service = AdapterStoreService(store.cfg)  # the store's servicer, driven as gRPC drives it
        stream = service.FetchShard(spb.FetchShardRequest(name="a", layout=layout(), xxh3=True), None)
        first = await stream.__anext__()
        assert first.header.cache_tier == "disk" and closed == []
        await stream.aclose()
        return list(closed)

    assert store.lt.run(run(), 30) == ["disk"]


def test_streams_over_max_streams_wait_their_turn_and_give_it_back_on_every_path(store):
    """--max-streams 1: a second stream waits (counted in loraserve_store_streams_waiting) until the
    first ends; a waiting stream whose client left gives its place up, and a stream closed early
    gives its turn back, so the next one is served at once."""
    import dataclasses

    from loraserve.adapter_store.service import AdapterStoreService

    raw_chunks(store.address, 1 << 20)  # packed and cached: later fetches stream from a reader

    async def run():
        service = AdapterStoreService(dataclasses.replace(store.cfg, max_streams=1, max_stream_wait_s=60))
        metric = service.metrics.registry.get_sample_value
        req = spb.FetchShardRequest(name="a", layout=layout(), xxh3=True)
        first = service.FetchShard(req, None)
        assert (await first.__anext__()).HasField("header")
        second = service.FetchShard(req, None)
        waiting = asyncio.ensure_future(second.__anext__())
        await asyncio.sleep(0.3)
        assert not waiting.done()
        assert (metric("loraserve_store_streams"), metric("loraserve_store_streams_waiting")) == (1, 1)
        rest = [m async for m in first]  # the first ends: the second's turn
        assert rest[-1].HasField("trailer")
        assert (await asyncio.wait_for(waiting, 10)).HasField("header")

        third = service.FetchShard(req, None)
        gone = asyncio.ensure_future(third.__anext__())
        await asyncio.sleep(0.1)
        gone.cancel()  # its client left while it waited
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert metric("loraserve_store_streams_waiting") == 0
        await second.aclose()  # closed early, after its header
        fourth = service.FetchShard(req, None)
        assert (await asyncio.wait_for(fourth.__anext__(), 10)).HasField("header")
        await fourth.aclose()
        return metric("loraserve_store_streams"), metric("loraserve_store_streams_waiting")

    assert store.lt.run(run(), 60) == (0, 0)


def test_a_stream_that_waited_its_turn_finds_an_adapter_deleted_meanwhile_not_found(store):
    """The adapter is looked up again once a waiting stream's turn comes: deleted while it waited,
    the stream ends NOT_FOUND instead of streaming (or packing) what the store has let go of."""
    import dataclasses

    from loraserve.adapter_store.service import AdapterStoreService

    class Aborted(Exception):
        pass

    class Context:  # what the servicer asks of grpc.aio's context on these paths
        code = message = None

        def cancelled(self):
            return False

        def invocation_metadata(self):
            return ()

        async def abort(self, code, message, trailing_metadata=()):
            self.code, self.message = code, message
            raise Aborted

    raw_chunks(store.address, 1 << 20)

    async def run():
        service = AdapterStoreService(dataclasses.replace(store.cfg, max_streams=1, max_stream_wait_s=60))
        req = spb.FetchShardRequest(name="a", layout=layout(), xxh3=True)
        first = service.FetchShard(req, Context())
        assert (await first.__anext__()).HasField("header")
        ctx = Context()
        waiting = asyncio.ensure_future(service.FetchShard(req, ctx).__anext__())
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await service.DeleteAdapter(spb.DeleteAdapterRequest(name="a"), Context())
        await first.aclose()
        with pytest.raises(Aborted):
            await asyncio.wait_for(waiting, 10)
        return ctx.code, ctx.message

    assert store.lt.run(run(), 30) == (grpc.StatusCode.NOT_FOUND, "adapter 'a' is not registered")


def test_the_store_reads_a_shard_at_most_a_few_chunks_ahead_of_its_stream():
    """The read-ahead thread keeps at most DEPTH chunks queued beyond what the stream has taken (a slow
    client holds that much of the shard in memory, not all of it), and the stream gets every chunk
    in order, then ends once the reader's check passed."""
    from loraserve.adapter_store.read_ahead import DEPTH
    from loraserve.adapter_store.service import _streamed

    reads, chunks = [], 3 * DEPTH

    class Reader:
        tier, checksums = "disk", None

        def readinto(self, view) -> int:
            if len(reads) == chunks:
                return 0
            reads.append(len(reads))
            view[:4] = len(reads).to_bytes(4, "big")
            return 4

        def finish(self) -> bool:
            return True

        def close(self) -> None:
            pass

    async def run():
        stream = _streamed(Reader(), 16, "a")
        got = [await stream.__anext__()]
        seen, still = len(reads), 0
        for _ in range(100):  # the reader runs ahead meanwhile, as far as it may: until reads stop
            await asyncio.sleep(0.05)
            seen, still = len(reads), still + 1 if len(reads) == seen else 0
            if still == 4:
                break
        assert len(reads) == 1 + DEPTH
        got += [message async for message in stream]
        return got

    got = asyncio.run(run())
    assert [int.from_bytes(m[-4:], "big") for m in got] == list(range(1, chunks + 1))


def test_a_stream_whose_read_ahead_thread_cannot_start_fails_and_closes_its_reader(monkeypatch):
    """Out of threads (the process's limit): the stream fails with the start's error, and the
    shard's reader is closed anyway, with nothing read."""
    from loraserve.adapter_store import read_ahead
    from loraserve.adapter_store.service import _streamed

    events = []

    class Reader:
        tier, checksums = "disk", None

        def readinto(self, view) -> int:
            events.append("read")
            return 0

        def finish(self) -> bool:
            return True

        def close(self) -> None:
            events.append("close")

    def no_thread(run):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(read_ahead, "_start_thread", no_thread)

    async def run():
        with pytest.raises(RuntimeError, match="can't start new thread"):
            await _streamed(Reader(), 16, "a").__anext__()

    asyncio.run(run())
    assert events == ["close"]


def _metric(port: int, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        lines = reply.read().decode().splitlines()
    return float(next(line.split()[-1] for line in lines if line.startswith(name + " ")))


BUSY = (
    "adapter store busy: all 1 of its shard streams (--max-streams) are taken and adapter 'a' waited 0.3s for "
    "one; ask again shortly"
)


@pytest.fixture
def capped_store(loop_thread, tmp_path, tiny_llama_dir, peft_adapter, monkeypatch):
    """One stream at a time, a waiting one refused after 0.3 s; /metrics served. While `s.held` is
    clear, a stream holds its turn before its trailer (a shard this small is otherwise sent whole
    into gRPC's buffers at once, its turn given back before the client reads it)."""
    from loraserve.adapter_store import service

    s = Store(
        loop_thread,
        tmp_path,
        tiny_llama_dir,
        peft_adapter(r=8),
        max_streams=1,
        max_stream_wait_s=0.3,
        metrics_listen="127.0.0.1:0",
    )
    raw_chunks(s.address, 1 << 20)  # packed and cached: later fetches stream from a reader
    s.held = asyncio.Event()
    s.held.set()
    trailer = service._trailer

    async def held_trailer(*args):
        await s.held.wait()
        return await trailer(*args)

    monkeypatch.setattr(service, "_trailer", held_trailer)
    yield s
    loop_thread.loop.call_soon_threadsafe(s.held.set)
    s.stop()


def test_a_stream_that_waits_past_max_stream_wait_s_is_refused_busy_with_a_retry_hint(capped_store):
    """Over real gRPC: with the one turn held, a second stream waits --max-stream-wait-s, then ends
    RESOURCE_EXHAUSTED with the store's reason and the retry hint in its trailers (an executor
    would otherwise wait in silence and give up on the store); counted on /metrics."""
    s = capped_store
    req = spb.FetchShardRequest(name="a", layout=layout(), xxh3=True)
    s.lt.loop.call_soon_threadsafe(s.held.clear)
    with grpc.insecure_channel(s.address) as channel:
        stub = spb_grpc.AdapterStoreStub(channel)
        first = stub.FetchShard(req, timeout=60)
        assert next(first).HasField("header")  # it holds the one turn
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            list(stub.FetchShard(req, timeout=60))
        waited = time.monotonic() - t0
        assert (e.value.code(), e.value.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, BUSY)
        assert ("loraserve-retry-after-ms", "200") in tuple(e.value.trailing_metadata())
        assert 0.3 <= waited < 10
        s.lt.loop.call_soon_threadsafe(s.held.set)
        rest = list(first)  # the held stream is unharmed
        assert rest[-1].HasField("trailer")
        # The refused stream took no turn with it, nor left one behind: the next stream is served at
        # once, and while it holds the one turn another is refused again.
        s.lt.loop.call_soon_threadsafe(s.held.clear)
        again = stub.FetchShard(req, timeout=60)
        assert next(again).HasField("header")
        with pytest.raises(grpc.RpcError) as e:
            list(stub.FetchShard(req, timeout=60))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        s.lt.loop.call_soon_threadsafe(s.held.set)
        assert list(again)[-1].HasField("trailer")
    server = s.server
    assert _metric(server.metrics_port, "loraserve_store_streams_busy_total") == 2
    assert _metric(server.metrics_port, "loraserve_store_streams_waiting") == 0


def test_a_stream_still_running_at_the_end_of_the_drain_grace_ends_unavailable_saying_why(capped_store):
    """Over real gRPC: a drain gives the streams in flight its grace; one still running then ends
    UNAVAILABLE naming the store's shutdown, the grace and what to do (not with gRPC's bare
    "Cancelling all calls", which says neither why nor what to do)."""
    s = capped_store
    s.lt.loop.call_soon_threadsafe(s.held.clear)
    with grpc.insecure_channel(s.address) as channel:
        req = spb.FetchShardRequest(name="a", layout=layout(), xxh3=True)
        stream = spb_grpc.AdapterStoreStub(channel).FetchShard(req, timeout=60)
        assert next(stream).HasField("header")  # running: held before its trailer
        t0 = time.monotonic()
        s.lt.run(s.server.drain(0.5), 30)
        drained_s = time.monotonic() - t0
        with pytest.raises(grpc.RpcError) as e:
            list(stream)
    assert (e.value.code(), e.value.details()) == (
        grpc.StatusCode.UNAVAILABLE,
        "the adapter store is shutting down: this stream was cut at the end of its 0.5 s drain grace; retry on another replica",
    )
    assert 0.5 <= drained_s < 5


def _refused(s, times: int, within_s: float = 30.0) -> None:
    """Waits until the store has refused `times` streams as busy (its /metrics), for at most within_s."""
    deadline = time.monotonic() + within_s
    while _metric(s.server.metrics_port, "loraserve_store_streams_busy_total") < times:
        assert time.monotonic() < deadline, f"the store refused fewer than {times} streams in {within_s:g}s"
        time.sleep(0.05)


def _executor_client(address: str, **kw):
    from loraserve.executor.store_client import StoreClient as ExecutorStoreClient

    return ExecutorStoreClient(address, layout(), timeout_s=5, **kw)


def test_the_executors_client_asks_a_busy_store_again_until_it_is_served(capped_store, caplog):
    """The executor's store client follows the busy answer's retry hint: while another stream holds
    the store's one turn it is refused (more than once), and once that stream ends its fetch lands the
    same shard as an unhindered fetch, having said once in its log that the store was busy."""
    s = capped_store
    req = spb.FetchShardRequest(name="a", layout=layout(), xxh3=True)

    async def run():
        client = _executor_client(s.address)
        try:
            alone = await client.fetch_shard("a")
            s.held.clear()
            async with grpc.aio.insecure_channel(s.address) as channel:
                holder = spb_grpc.AdapterStoreStub(channel).FetchShard(req, timeout=60)
                assert (await holder.read()).HasField("header")  # the one turn, held
                fetch = asyncio.ensure_future(client.fetch_shard("a"))
                await asyncio.to_thread(_refused, s, 2)  # asked again after its first refusal
                assert not fetch.done()
                s.held.set()
                holder.cancel()
                got = await asyncio.wait_for(fetch, 20)
            return alone, got
        finally:
            await client.close()

    with caplog.at_level(logging.INFO, logger="loraserve.executor.store_client"):
        alone, got = s.lt.run(run(), 60)
    assert got[:2] == alone[:2] and got[3] == alone[3]
    assert got[2].keys() == alone[2].keys() and all(torch.equal(got[2][k], alone[2][k]) for k in alone[2])
    assert _metric(s.server.metrics_port, "loraserve_store_streams_busy_total") >= 2
    said = [r.getMessage() for r in caplog.records if "is busy" in r.getMessage()]
    assert said == [f"adapter store at {s.address} is busy ({BUSY}); asking for 'a' again shortly"]


def test_the_executors_client_gives_up_on_a_store_busy_past_its_retry_budget(capped_store):
    """Past busy_retry_s the executor's client stops asking: RESOURCE_EXHAUSTED naming the store,
    how long it stayed busy, the store's own reason and the adapter."""
    s = capped_store
    req = spb.FetchShardRequest(name="a", layout=layout(), xxh3=True)

    async def run():
        client = _executor_client(s.address, busy_retry_s=0.8)
        s.held.clear()
        try:
            async with grpc.aio.insecure_channel(s.address) as channel:
                holder = spb_grpc.AdapterStoreStub(channel).FetchShard(req, timeout=60)
                assert (await holder.read()).HasField("header")
                with pytest.raises(StatusError) as e:
                    await client.fetch_shard("a")
                s.held.set()
                holder.cancel()
            return e.value
        finally:
            await client.close()

    error = s.lt.run(run(), 60)
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert re.fullmatch(
        rf"adapter store at {re.escape(s.address)} stayed busy for (\d+\.\d)s \((\d+) asks\); adapter "
        rf"'a' cannot be loaded now \(the store's last answer: {re.escape(BUSY)}\)",
        error.message,
    ), error.message
    assert 0.8 <= float(re.search(r"busy for (\d+\.\d)s", error.message).group(1)) < 5


@pytest.mark.parametrize("why", [None, "tensor-parallel rank 2's fetch of it failed"], ids=["left", "rank-0-says-why"])
def test_the_executors_client_stops_asking_a_busy_store_once_nobody_wants_the_adapter(capped_store, why):
    """A fetch the store keeps refusing as busy ends CANCELLED at its next ask once its caller's
    STILL_WANTED says no (the CPU cache: every request for the adapter has left), instead of asking
    for up to 30 s while it holds a load seat. why: a tensor-parallel rank's STILL_WANTED, stopped
    by rank 0's "cancel" with its reason, which the error then names."""
    from loraserve.executor.ranks import _StillWanted
    from loraserve.executor.store_client import STILL_WANTED

    s = capped_store
    req = spb.FetchShardRequest(name="a", layout=layout(), xxh3=True)
    wanted, rank_wanted = [True], _StillWanted()

    async def run():
        client = _executor_client(s.address)
        s.held.clear()
        try:
            async with grpc.aio.insecure_channel(s.address) as channel:
                holder = spb_grpc.AdapterStoreStub(channel).FetchShard(req, timeout=60)
                assert (await holder.read()).HasField("header")

                async def fetch():
                    STILL_WANTED.set(rank_wanted if why else lambda: wanted[0])
                    return await client.fetch_shard("a")

                task = asyncio.ensure_future(fetch())
                await asyncio.sleep(0.8)
                assert not task.done()  # refused, asking again
                wanted[0] = False
                rank_wanted.stop(why)
                t0 = time.monotonic()
                with pytest.raises(StatusError) as e:
                    await asyncio.wait_for(task, 10)
                took = time.monotonic() - t0
                s.held.set()
                holder.cancel()
            return e.value, took
        finally:
            await client.close()

    error, took = s.lt.run(run(), 60)
    assert (error.code, error.message) == (
        grpc.StatusCode.CANCELLED,
        f"adapter 'a': {why or 'no request waits for it any more'}; not fetched (the store at {s.address} was busy)",
    )
    assert took < 3  # at its next ask (one 0.3 s wait and a pause), not after the 30 s budget


def test_the_python_client_asks_a_busy_store_again_until_it_is_served(capped_store, caplog):
    """The blocking Python client (and `loraserve adapters fetch`) follows the busy answer too: while
    another stream holds the store's one turn its fetch_shard is refused and asks again, and once
    that stream ends it gets the same shard as an unhindered fetch, having said once that the store
    was busy."""
    s = capped_store
    req = spb.FetchShardRequest(name="a", layout=layout(), xxh3=True)
    client = StoreClient(s.address, timeout_s=60)
    alone = client.fetch_shard("a", layout())
    s.lt.loop.call_soon_threadsafe(s.held.clear)
    with grpc.insecure_channel(s.address) as channel, caplog.at_level(logging.INFO, logger="loraserve.client"):
        holder = spb_grpc.AdapterStoreStub(channel).FetchShard(req, timeout=60)
        assert next(holder).HasField("header")  # the one turn, held
        got = []
        fetch = threading.Thread(target=lambda: got.append(client.fetch_shard("a", layout())))
        fetch.start()
        _refused(s, 2)  # asked again after its first refusal
        assert fetch.is_alive()
        s.lt.loop.call_soon_threadsafe(s.held.set)
        holder.cancel()
        fetch.join(20)
    assert got and got[0][1] == alone[1] and got[0][0].manifest.digest == alone[0].manifest.digest
    assert _metric(s.server.metrics_port, "loraserve_store_streams_busy_total") >= 2
    said = [r.getMessage() for r in caplog.records if "is busy" in r.getMessage()]
    assert said == [f"adapter store at {s.address} is busy ({BUSY}); asking for 'a' again shortly"]
    client.close()


@pytest.mark.parametrize("budget_s", [0.0, 0.8])
def test_the_python_client_gives_up_on_a_store_busy_past_its_retry_budget(capped_store, budget_s):
    """Past busy_retry_s the Python client stops asking: RESOURCE_EXHAUSTED naming the store, how
    long it stayed busy and its last answer; with a budget of 0, the store's own refusal at once."""
    s = capped_store
    req = spb.FetchShardRequest(name="a", layout=layout(), xxh3=True)
    client = StoreClient(s.address, timeout_s=60, busy_retry_s=budget_s)
    s.lt.loop.call_soon_threadsafe(s.held.clear)
    with grpc.insecure_channel(s.address) as channel:
        holder = spb_grpc.AdapterStoreStub(channel).FetchShard(req, timeout=60)
        assert next(holder).HasField("header")
        t0 = time.monotonic()
        with pytest.raises(StatusError) as e:
            client.fetch_shard("a", layout())
        took = time.monotonic() - t0
        s.lt.loop.call_soon_threadsafe(s.held.set)
        holder.cancel()
    client.close()
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    if budget_s == 0:
        assert e.value.message == BUSY and took < 5
        return
    assert re.fullmatch(
        rf"adapter store at {re.escape(s.address)} stayed busy for (\d+\.\d)s \((\d+) asks\); adapter "
        rf"'a' was not fetched \(the store's last answer: {re.escape(BUSY)}\)",
        e.value.message,
    ), e.value.message
    assert 0.8 <= took < 5


def test_busy_backoff_follows_the_hint_then_doubles_up_to_its_cap_within_one_budget(monkeypatch):
    """The pauses both clients take between busy asks: never sooner than the store's hint, twice
    the last one after (with up to 25% jitter), at most BUSY_BACKOFF_MAX_S, and none once the budget
    is spent, counted from the first refused ask's start (time the store spent serving the fetch
    before, e.g. a stream that then broke with DATA_LOSS, is not counted)."""
    from loraserve import errors

    now = [100.0]
    monkeypatch.setattr(errors.time, "monotonic", lambda: now[0])
    backoff = errors.BusyBackoff(10.0)
    assert backoff.busy_for() == 0.0  # nothing refused yet, however long the fetch has run
    pauses = [backoff.next_pause(0.2, asked_at=99.7) for _ in range(7)]
    assert backoff.busy_for() == pytest.approx(0.3)  # from the first refused ask's start
    floors = [0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0]
    assert all(f <= p <= f * 1.25 for p, f in zip(pauses, floors)), pauses
    assert backoff.next_pause(3.0, now[0]) >= 3.0  # a longer hint is followed, past the doubling's cap
    assert errors.BusyBackoff(10.0).next_pause(0.0, now[0]) >= errors.BUSY_PAUSE_MIN_S  # a 0 hint: no tight loop
    now[0] += 9.2
    assert backoff.next_pause(0.2, now[0]) <= 0.5 + 1e-9  # never past the budget's end
    now[0] += 0.5
    assert backoff.next_pause(0.2, now[0]) is None and backoff.asks == 10
    assert backoff.gave_up("adapter store at X", "adapter 'a' was not fetched", "busy").message == (
        "adapter store at X stayed busy for 10.0s (10 asks); adapter 'a' was not fetched (the store's last answer: busy)"
    )
    once = errors.BusyBackoff(0.1)
    assert once.next_pause(0.2, asked_at=now[0] - 0.3) is None  # one refused ask outlasted the budget
    assert once.gave_up("S", "w", "busy").message == "S stayed busy for 0.3s (1 ask); w (the store's last answer: busy)"
