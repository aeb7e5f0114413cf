"""KV-block events (executor/engine/kv_events.py) end to end: a real engine on CPU (tiny Llama, two
adapters and the base model) publishes on loopback; a real ZMQ SUB socket receives the stream and
decodes it with its own definition of vLLM's wire format (msgspec array-like tagged structs, as a
vLLM-compatible consumer declares them), and the stream is checked against the allocator's state."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import subprocess
import sys
import threading
from pathlib import Path

import msgspec
import pytest
import torch
import zmq

from loraserve.executor.config import ExecutorConfig
from loraserve.executor.engine import engine as engine_module
from loraserve.executor.engine.graphs import DecodeGraphs
from loraserve.executor.engine.kv_events import REPLAY_BATCHES, KVEventPublisher
from loraserve.executor.engine.prefix_cache import extend_keys
from loraserve.executor.model.loader import load_model
from loraserve.executor.slot_layout import LoraSpec

from .test_engine import Store, _collect, _engine, _greedy, _idle, _prompt
from .test_fp8 import write_fp8

BLOCK = 4
TOPIC = "kv@pod-a@tiny-llama"


# ---- the consumer's side of the format (vLLM's kv_events.py, written from its field list) ----------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODE = msgspec.msgpack.Decoder(KVEventBatch).decode


@pytest.fixture(scope="module")
def model(hf_model):
    """A tiny random Llama loaded by our loader with 2 LoRA slots."""
    return load_model(hf_model("llama")[1], lora=LoraSpec(max_loras=2, max_rank=8, dtype=torch.float32))


def _drain(sub: zmq.Socket, got: dict[int, bytes]) -> None:
    while sub.poll(0):
        topic, seq, payload = sub.recv_multipart()
        assert topic == TOPIC.encode() and len(seq) == 8
        got[int.from_bytes(seq, "big")] = payload


def _replay(ctx: zmq.Context, endpoint: str, start: int) -> dict[int, bytes]:
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.setsockopt(zmq.RCVTIMEO, 5000)
    req.connect(endpoint)
    req.send_multipart((b"", start.to_bytes(8, "big")))  # the ROUTER adds our identity in front
    out = {}
    try:
        while True:
            empty, seq, payload = req.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                return out
            out[int.from_bytes(seq, "big")] = payload
    finally:
        req.close()


def _chain_ok(parent: bytes | None, seed: bytes, hashes: list[bytes], tokens: list[int]) -> bool:
    """The hashes are the prefix cache's chain over `tokens` from `parent` (or from the seed)."""
    keys = [parent] if parent is not None else []
    pad = [0] * (BLOCK * len(keys))  # extend_keys continues after the blocks `keys` already covers
    extend_keys(keys, seed, pad + tokens, BLOCK, len(keys) + len(hashes))
    return keys[len(keys) - len(hashes) :] == hashes


@pytest.mark.parametrize("steps", ["eager", "graph-steps"])
async def test_the_event_stream_matches_the_prefix_cache_under_two_adapters_the_base_model_and_eviction(model, until, steps):
    store = Store(model, ["a1", "a2"])
    # 20 blocks of 4: the requests below cannot all stay cached, so cached blocks are evicted.
    engine = _engine(
        model, store=store, num_blocks=20, max_model_len=48,
        kv_events_endpoint="tcp://127.0.0.1:*", kv_events_topic=TOPIC, kv_events_replay_endpoint="tcp://127.0.0.1:*",
    )  # fmt: skip
    if steps == "graph-steps":  # decode steps launched ahead: a step is planned before the previous one is filed
        cfg = engine.config
        engine.graphs = DecodeGraphs(
            model, engine.kv_cache, cfg.max_num_seqs, cfg.max_model_len, engine.max_loras, cfg.torch_device
        )
    pub = engine.kv_events
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")  # the llm-d indexer's topic filter
    sub.connect(pub.endpoint)
    got: dict[int, bytes] = {}
    engine.start()
    try:
        systems = [_prompt(9, 200 + i) for i in range(3)]  # 2 full blocks each, shared by the prompts below
        cases = [(s + _prompt(n, 300 + 7 * i + n), a) for i, s in enumerate(systems) for n in (2, 5) for a in ("", "a1", "a2")]
        for _ in range(2):
            await asyncio.gather(*(_collect(engine, _greedy(p, 4, adapter=a)) for p, a in cases))
            _drain(sub, got)
        await until(lambda: _idle(engine))
        await until(lambda: pub.published == pub.flushed, what="every batch sent")
        sent = pub.published

        def last_received() -> bool:
            _drain(sub, got)
            return sent - 1 in got

        await until(last_received, what="the last batch on the SUB socket")
        # A consumer that joined late (its first batches dropped while its subscription travelled)
        # fetches what it missed from the replay socket; replayed batches are byte-identical.
        replayed = await asyncio.to_thread(_replay, ctx, pub.replay_endpoint, 0)
        assert sorted(replayed) == list(range(sent))
        assert sorted(await asyncio.to_thread(_replay, ctx, pub.replay_endpoint, sent - 2)) == [sent - 2, sent - 1]
    finally:
        await engine.stop()
    alloc = engine.allocator
    assert alloc.evictions > 0
    assert all(replayed[s] == payload for s, payload in got.items())
    sub.close()
    ctx.term()

    seeds = {a: engine._cache_seed(a, f"sha256:{a}" if a else "") for a in ("", "a1", "a2")}
    filed: dict[bytes, str | None] = {}  # key -> adapter, replayed from the stream in order
    lora_ids: dict[str | None, set] = {}
    removed = 0
    for seq in range(sent):
        batch = DECODE(replayed[seq])
        assert isinstance(batch.ts, float) and batch.data_parallel_rank == 0 and batch.events
        for ev in batch.events:
            assert ev.medium == "CPU"
            if isinstance(ev, BlockStored):
                assert ev.block_size == BLOCK and len(ev.token_ids) == BLOCK * len(ev.block_hashes)
                assert all(isinstance(h, bytes) and len(h) == 16 for h in ev.block_hashes)
                assert _chain_ok(ev.parent_block_hash, seeds[ev.lora_name or ""], ev.block_hashes, ev.token_ids)
                lora_ids.setdefault(ev.lora_name, set()).add(ev.lora_id)
                for h in ev.block_hashes:
                    assert h not in filed, "a key is stored again before its removal"
                    filed[h] = ev.lora_name
            else:
                assert isinstance(ev, BlockRemoved)
                for h in ev.block_hashes:
                    assert h in filed, "a key is removed that was never stored"
                    del filed[h]
                removed += len(ev.block_hashes)
    # The stream's stored-minus-removed set is exactly what the allocator holds filed now.
    assert set(filed) == alloc.filed_keys() and len(filed) == alloc.num_cached
    assert removed == alloc.evictions
    # Every adapter's blocks carry its name and one id of its version; the base model's neither.
    assert lora_ids.keys() == {None, "a1", "a2"}
    assert lora_ids[None] == {None}
    assert len(lora_ids["a1"]) == len(lora_ids["a2"]) == 1 and lora_ids["a1"] != lora_ids["a2"]
    assert None not in lora_ids["a1"] | lora_ids["a2"]
    # The same prompts under the three identities never share a key: the adapter digest is in the hash.
    assert len({a for a in filed.values()}) == 3


async def _published_blocks(model, prompts, until, **flags) -> dict[str | None, dict[bytes, list[int]]]:
    """Runs `prompts` ((tokens, adapter) pairs; one new token each, so only prompt blocks are filed)
    through an engine of `model` publishing KV events; returns, from the replayed stream, each
    lora_name's stored keys and their blocks' tokens."""
    engine = _engine(
        model, store=Store(model, ["a1"]), kv_events_endpoint="tcp://127.0.0.1:*", kv_events_topic=TOPIC,
        kv_events_replay_endpoint="tcp://127.0.0.1:*", **flags,
    )  # fmt: skip
    pub, ctx = engine.kv_events, zmq.Context()
    engine.start()
    try:
        for tokens, adapter in prompts:
            await _collect(engine, _greedy(tokens, 1, adapter=adapter))
        await until(lambda: _idle(engine))
        await until(lambda: pub.published == pub.flushed, what="every batch sent")
        replayed = await asyncio.to_thread(_replay, ctx, pub.replay_endpoint, 0)
    finally:
        await engine.stop()
        ctx.term()
    blocks: dict[str | None, dict[bytes, list[int]]] = {}
    for seq in sorted(replayed):
        for ev in DECODE(replayed[seq]).events:
            assert isinstance(ev, BlockStored)  # 64 blocks: nothing is evicted
            for i, h in enumerate(ev.block_hashes):
                blocks.setdefault(ev.lora_name, {})[h] = ev.token_ids[i * BLOCK : (i + 1) * BLOCK]
    return blocks


async def test_executors_alike_but_for_weight_format_or_lora_dtype_publish_different_keys(until, hf_model, tmp_path):
    """Three executors of one model under one set of flags but for its LoRA slots in FP8 (--lora-dtype
    fp8: dequantized on the CPU) or its weights from an FP8 checkpoint of it (compressed-tensors,
    dequantized on the CPU) file the same prompt blocks under the base model and one adapter version,
    and publish them under keys of their own: an indexer never takes one's blocks for another's. The
    base model's KV never passes a LoRA slot, so FP8 slots keep the float executor's base-model keys."""
    _, src = hf_model("llama")
    write_fp8(src, tmp_path / "fp8", "ct-channel")
    spec = LoraSpec(max_loras=2, max_rank=8, dtype=torch.float32)
    texts = [_prompt(9, 500 + i) for i in range(2)]
    prompts = [(tokens, adapter) for tokens in texts for adapter in ("", "a1")]
    float_model = load_model(src, lora=spec)
    published = {
        "float": await _published_blocks(float_model, prompts, until),
        "fp8 slots": await _published_blocks(
            load_model(src, lora=dataclasses.replace(spec, fp8=True)), prompts, until, lora_dtype="fp8"
        ),
        "fp8 checkpoint": await _published_blocks(load_model(tmp_path / "fp8", lora=spec), prompts, until),
    }
    for blocks in published.values():  # the same blocks filed by each: both full blocks of each prompt, per identity
        assert blocks.keys() == {None, "a1"}
        for name in (None, "a1"):
            assert sorted(blocks[name].values()) == sorted(tokens[i : i + BLOCK] for tokens in texts for i in (0, BLOCK))
    plain, slots, checkpoint = published.values()
    assert not plain["a1"].keys() & slots["a1"].keys()
    assert plain[None] == slots[None]
    for name in (None, "a1"):
        assert not plain[name].keys() & checkpoint[name].keys()
        assert not slots[name].keys() & checkpoint[name].keys()


async def test_without_the_flag_nothing_listens(model):
    engine = _engine(model)
    assert engine.kv_events is None and engine.allocator.on_evict is None and engine.scheduler.kv_events is None


async def test_an_endpoint_in_use_fails_the_engine_start_naming_the_flag(model):
    ctx = zmq.Context()
    holder = ctx.socket(zmq.PUB)
    holder.setsockopt(zmq.LINGER, 0)
    holder.bind("tcp://127.0.0.1:*")
    port = holder.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
    try:
        with pytest.raises(ValueError, match=rf"--kv-events-endpoint 'tcp://\*:{port}': Address already in use"):
            _engine(model, kv_events_endpoint=f"tcp://*:{port}")
        with pytest.raises(ValueError, match=rf"--kv-events-replay-endpoint 'tcp://\*:{port}': Address already in use"):
            _engine(model, kv_events_endpoint="tcp://127.0.0.1:*", kv_events_replay_endpoint=f"tcp://*:{port}")
    finally:
        holder.close()
        ctx.term()


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"kv_events_endpoint": "localhost:5557"}, "--kv-events-endpoint 'localhost:5557': want a ZMQ endpoint"),
        ({"kv_events_endpoint": "tcp://"}, "--kv-events-endpoint 'tcp://': want a ZMQ endpoint"),
        ({"kv_events_endpoint": "tcp://*:5557", "kv_events_replay_endpoint": "5558"}, "--kv-events-replay-endpoint '5558'"),
        ({"kv_events_replay_endpoint": "tcp://*:5558"}, "--kv-events-replay-endpoint needs --kv-events-endpoint"),
        ({"kv_events_endpoint": "tcp://*:5557", "prefix_caching": False}, "--kv-events-endpoint needs prefix caching"),
    ],
)
def test_bad_endpoints_are_refused_by_the_config(fields, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*")):
        ExecutorConfig(**fields)


def test_the_executor_command_refuses_a_bad_endpoint_before_loading_anything():
    loraserve = str(Path(sys.executable).parent / "loraserve")
    args = [
        loraserve,
        "--log-level",
        "WARNING",
        "executor",
        "--kv-events-endpoint",
        "localhost:5557",
        "--executor-listen",
        "127.0.0.1:0",
    ]
    bad = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "error: --kv-events-endpoint 'localhost:5557': want a ZMQ endpoint" in bad.stderr, bad.stderr


def _publish(pub: KVEventPublisher, n: int) -> None:
    for i in range(n):
        pub.stored([i.to_bytes(16, "big")], None, [1, 2, 3, 4], None, None)
        pub.flush()


def _wait(condition, what: str, timeout_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not hold within {timeout_s:g}s"
        time.sleep(0.001)


def test_once_the_socket_thread_dies_batches_are_dropped_not_queued(caplog):
    """A batch the thread cannot encode ends the thread (logged); the next flush drops its batch
    and closes the publisher (logged once), and no later event is queued for a thread that is gone."""
    pub = KVEventPublisher("tcp://127.0.0.1:*", block_size=4, medium="CPU")
    with caplog.at_level(logging.ERROR, logger="loraserve.executor.engine.kv_events"):
        _publish(pub, 3)
        _wait(lambda: pub.published == 3, "three batches sent")
        pub.stored([b"k" * 16], None, [object()], None, None)  # msgspec cannot encode an object()
        pub.flush()
        pub._thread.join(5.0)
        assert not pub._thread.is_alive()
        _publish(pub, 1000)
    assert pub._batches.empty() and not pub._events and pub.flushed == 4 and pub.published == 3
    assert [r.getMessage() for r in caplog.records] == [
        "KV-event publisher stopped",
        "KV-event publisher thread is gone: KV events are dropped from now on",
    ]
    pub.close()  # the sockets are already closed: nothing left to do


def test_batches_are_kept_for_replay_only_with_a_replay_socket():
    plain = KVEventPublisher("tcp://127.0.0.1:*", block_size=4, medium="CPU")
    with_replay = KVEventPublisher("tcp://127.0.0.1:*", block_size=4, medium="GPU", replay_endpoint="tcp://127.0.0.1:*")
    try:
        for pub in (plain, with_replay):
            _publish(pub, 50)
            _wait(lambda: pub.published == 50, "every batch sent")
        assert not plain._kept
        assert [seq for seq, _ in with_replay._kept] == list(range(50))
        # a whole replay (REPLAY_BATCHES batches and the end marker) fits under the ROUTER's high-water mark
        assert with_replay._replay.getsockopt(zmq.SNDHWM) == REPLAY_BATCHES + 1
    finally:
        plain.close()
        with_replay.close()


async def test_an_engine_start_that_fails_after_binding_frees_the_port(model, monkeypatch, free_port):
    """The publisher binds before the warm-up; a warm-up that raises (CUDA OOM on a GPU) closes it,
    so a retry in the same process binds the same ports again."""
    pub_port, replay_port = free_port(), free_port()
    endpoints = {
        "kv_events_endpoint": f"tcp://127.0.0.1:{pub_port}",
        "kv_events_replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
    }

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (the test's)")

    with monkeypatch.context() as m:
        m.setattr(engine_module, "warm_up_engine", out_of_memory)
        with pytest.raises(RuntimeError, match="CUDA out of memory"):
            _engine(model, **endpoints)
    assert not [t for t in threading.enumerate() if t.name == "kv-events"]
    engine = _engine(model, **endpoints)  # the retry
    try:
        assert engine.kv_events.endpoint == endpoints["kv_events_endpoint"]
        assert engine.kv_events.replay_endpoint == endpoints["kv_events_replay_endpoint"]
    finally:
        await engine.stop()


async def test_stop_closes_the_publisher_off_the_event_loop(model):
    """close() joins the socket thread (up to seconds): stop() runs it in a worker thread, so the
    event loop keeps serving meanwhile."""
    engine = _engine(model, kv_events_endpoint="tcp://127.0.0.1:*")
    pub = engine.kv_events
    close, closed_on = pub.close, []

    def recording_close():
        closed_on.append(threading.current_thread())
        close()

    pub.close = recording_close
    engine.start()
    await engine.stop()
    assert closed_on and closed_on[0] is not threading.main_thread() and not pub._thread.is_alive()
