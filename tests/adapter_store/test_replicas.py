"""Two store replicas on one real Redis (127.0.0.1:6379, a prefix of the test's own), each a
real gRPC server on loopback with its own data dir: what one registers the other lists,
fetches and deletes; concurrent registrations of one name end with one complete manifest."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import redis
from safetensors.torch import load as st_load

from loraserve.adapter_store import validate
from loraserve.adapter_store.config import StoreConfig
from loraserve.adapter_store.service import serve
from loraserve.adapter_store.sources import SourceConfig
from loraserve.client import StoreClient
from loraserve.errors import StatusError
from loraserve.v1 import common_pb2 as pb

QKV = ("q_proj", "k_proj", "v_proj")


def layout(tp: int = 1) -> pb.Layout:
    lay = pb.Layout(tp_size=tp, dtype="float32", max_rank=32, base_model="tiny-llama")
    for i in range(2):
        p = f"model.layers.{i}.self_attn"
        lay.modules.add(
            name=f"{p}.qkv_proj",
            kind=pb.QKV,
            input_size=64,
            output_sizes=[64, 32, 32],
            head_size=16,
            peft_modules=[f"{p}.{x}_proj" for x in "qkv"],
        )
    return lay


@pytest.fixture
def replicas(tmp_path, tiny_llama_dir, loop_thread, redis_url):
    """start() -> a StoreClient of a new replica (data dir of its own, the shared Redis registry)."""
    servers = []
    roots = tmp_path / "adapters"
    roots.mkdir()

    def start() -> StoreClient:
        cfg = StoreConfig(
            listen="127.0.0.1:0",
            data_dir=tmp_path / f"store{len(servers)}",
            base_model="tiny-llama",
            base_model_path=tiny_llama_dir,
            sources=SourceConfig(local_roots=(roots.resolve(),)),
            limits=validate.Limits(max_rank=32, max_adapter_bytes=4 << 20),
            redis_url=redis_url.url,
            redis_prefix=redis_url.prefix,
            registry="redis",
        )
        server, port = loop_thread.run(serve(cfg), 30)
        servers.append(server)
        return StoreClient(f"127.0.0.1:{port}", timeout_s=60)

    def place(adapter_dir: Path, name: str) -> str:
        shutil.copytree(adapter_dir, roots / name)
        return str(roots / name)

    start.place = place
    start.redis = redis.Redis.from_url(redis_url.url)
    start.prefix = f"{redis_url.prefix}:registry"
    yield start
    for server in servers:
        loop_thread.run(server.stop(0), 10)
    start.redis.close()


def registry_keys(replicas) -> set[str]:
    return {k.decode() for k in replicas.redis.scan_iter(match=f"{replicas.prefix}:*", count=1000)}


def assert_not_found(call, name: str):
    with pytest.raises(StatusError) as e:
        call()
    assert e.value.code.name == "NOT_FOUND" and e.value.message == f"adapter {name!r} is not registered"


def test_register_on_one_replica_list_fetch_delete_on_the_other(replicas, peft_adapter):
    a, b = replicas(), replicas()
    m = a.register("a1", replicas.place(peft_adapter(r=8, target_modules=QKV), "a1"))
    assert b.get("a1") == m and [x.name for x in b.list()] == ["a1"]
    header, blob = b.fetch_shard("a1", layout())  # b never saw the files: it packs from Redis
    assert header.cache_tier == "packed" and header.manifest == m
    header, blob_a = a.fetch_shard("a1", layout())
    assert header.cache_tier == "redis" and blob_a == blob  # the shard b packed, from the shared tier
    assert st_load(blob).keys()

    assert b.delete("a1") is True
    for client in (a, b):
        assert client.list() == []
        assert_not_found(lambda: client.get("a1"), "a1")
        assert_not_found(lambda: client.fetch_shard("a1", layout()), "a1")
        assert_not_found(lambda: client.delete("a1"), "a1")
    assert registry_keys(replicas) == set()  # manifest, name, refs, files and blobs all gone


def test_replaced_adapter_is_seen_by_the_other_replica_and_shared_files_stay(replicas, peft_adapter):
    a, b = replicas(), replicas()
    old = a.register("x", replicas.place(peft_adapter(r=4, seed=1, target_modules=QKV), "x1"))
    b.fetch_shard("x", layout())  # b loads and keeps the old adapter in memory
    new = b.register("x", replicas.place(peft_adapter(r=8, seed=2, target_modules=QKV), "x2"))
    assert new.digest != old.digest and a.get("x") == new
    with pytest.raises(StatusError) as e:
        a.fetch_shard("x", layout(), digest=old.digest)
    assert e.value.code.name == "FAILED_PRECONDITION"
    assert e.value.message == f"adapter 'x' now has digest {new.digest[:12]}, not the requested {old.digest[:12]}"
    assert a.fetch_shard("x", layout())[0].manifest.rank == 8
    assert not any(old.digest in k for k in registry_keys(replicas))  # no name uses the old files

    a.register("y", replicas.place(peft_adapter(r=8, seed=2, target_modules=QKV), "y"))  # same content as x: one copy
    b.delete("x")
    assert [m.name for m in a.list()] == ["y"]
    assert a.fetch_shard("y", layout())[0].manifest.digest == new.digest
    assert replicas.redis.hgetall(f"{replicas.prefix}:refs") == {new.digest.encode(): b"1"}


def test_concurrent_registrations_of_one_name_end_with_one_complete_manifest(replicas, peft_adapter):
    a, b = replicas(), replicas()
    uris = [replicas.place(peft_adapter(r=4, seed=s, target_modules=QKV), f"c{s}") for s in (1, 2)]
    for round_ in range(4):
        results, barrier = {}, threading.Barrier(2)

        def register(client, uri, key):
            barrier.wait()
            results[key] = client.register("same", uri)

        threads = [threading.Thread(target=register, args=(c, u, i)) for i, (c, u) in enumerate(zip((a, b), uris))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winner = a.get("same")
        assert b.get("same") == winner and winner in results.values()
        assert [m.name for m in b.list()] == ["same"]
        for client in (a, b):  # the winner's files are whole: both replicas can pack from them
            assert client.fetch_shard("same", layout())[0].manifest.digest == winner.digest
        keys = registry_keys(replicas)
        assert replicas.redis.hgetall(f"{replicas.prefix}:refs") == {winner.digest.encode(): b"1"}
        loser = {m.digest for m in results.values()} - {winner.digest}
        assert not any(d in k for d in loser for k in keys), f"round {round_}: the loser's files were left"
    a.delete("same")
    assert registry_keys(replicas) == set()


def test_registry_redis_needs_a_redis_url(capsys):
    from loraserve.cli import main

    assert main(["store", "--registry", "redis", "--listen", "127.0.0.1:0"]) == 1
    assert capsys.readouterr().err.strip() == "error: --registry redis needs --redis-url"


def test_registry_redis_down_fails_unavailable_naming_it(tmp_path, loop_thread, closed_port):
    url = f"redis://127.0.0.1:{closed_port}/0"
    cfg = StoreConfig(listen="127.0.0.1:0", data_dir=tmp_path / "store", redis_url=url, registry="redis")
    with pytest.raises(StatusError) as e:
        loop_thread.run(serve(cfg), 30)
    assert e.value.code.name == "UNAVAILABLE"
    assert e.value.message.startswith(
        f"the registry's redis at {url} is unavailable: Error 111 connecting to 127.0.0.1:{closed_port}"
    )


def test_an_upload_refused_at_the_drain_deadline_leaves_nothing(redis_url, tmp_path, peft_adapter):
    from loraserve.adapter_store.redis_registry import RedisRegistry

    reg = RedisRegistry(redis_url.url, redis_url.prefix, tmp_path / "staging", chunk_bytes=4096)
    files = sorted(peft_adapter(r=4, target_modules=QKV).iterdir())
    digest = "ab" * 32
    staged = reg.stage(digest, files)
    keys = lambda: {k.decode() for k in reg._redis.scan_iter(match=f"{redis_url.prefix}:registry:*")}  # noqa: E731
    chunks = sum(-(-p.stat().st_size // 4096) for p in files)
    assert chunks > len(files) and staged[1] is not None and len(keys()) == chunks  # no manifest, no files key
    reg.discard(staged, digest)
    assert keys() == set()
    reg.put(pb.AdapterManifest(name="kept", digest=digest), reg.stage(digest, files))
    again = reg.stage(digest, files)  # the digest's files are there: nothing uploaded twice
    assert again[1] is None and reg.put(pb.AdapterManifest(name="kept2", digest=digest), again) is None
    with reg.files(digest) as folder:
        assert sorted(p.read_bytes() for p in folder.iterdir()) == sorted(p.read_bytes() for p in files)
    assert not folder.exists()
