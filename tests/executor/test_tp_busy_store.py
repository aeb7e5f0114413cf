"""Ranks 1..N-1 of a tensor-parallel executor and a busy store: a rank refused as busy asks again
only while rank 0's caller still wants the adapter (rank 0 sends it a "cancel"), as rank 0's own
fetch does. Real store and executor on loopback (gloo on CPU), rank 1 a spawned process."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time

import grpc
import pytest
import torch

from loraserve.errors import BUSY_BACKOFF_MAX_S, StatusError
from loraserve.executor.store_client import STILL_WANTED
from loraserve.v1 import adapter_store_pb2 as spb
from loraserve.v1 import adapter_store_pb2_grpc as spb_grpc

from .conftest import Cluster

BUSY_WAIT_S = 0.3  # the store's --max-stream-wait-s here: a refused ask takes this long


@pytest.fixture
def busy_cluster(request, loop_thread, byte_model, tmp_path, monkeypatch):
    """tp 2 (or the tp size a test's indirect parameter gives) over a store that serves one stream
    at a time; while `held` is clear, a stream holds its turn before its trailer (a shard this small
    is otherwise sent whole at once)."""
    from peft import LoraConfig, get_peft_model

    from loraserve.adapter_store import service

    model, path = byte_model()
    adapters = tmp_path / "adapters"
    for seed, name in enumerate(("a", "b")):
        torch.manual_seed(seed)
        peft = get_peft_model(copy.deepcopy(model), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
        peft.save_pretrained(adapters / name)
    held = asyncio.Event()
    held.set()
    trailer = service._trailer

    async def held_trailer(*args):
        await held.wait()
        return await trailer(*args)

    monkeypatch.setattr(service, "_trailer", held_trailer)
    c = Cluster(
        loop_thread,
        path,
        adapters,
        tmp_path / "store",
        ["a", "b"],
        tp_size=getattr(request, "param", 2),
        cpu_threads=1,
        tp_timeout_s=60.0,
        store_overrides=dict(max_streams=1, max_stream_wait_s=BUSY_WAIT_S),
    )
    c.held = held
    yield c
    loop_thread.loop.call_soon_threadsafe(held.set)
    c.close()


@contextlib.asynccontextmanager
async def fetching_while_held(c, wanted: list[bool]):
    """Rank 0 fetches adapter "a" (served), then a stream of "b" takes the store's one turn and holds
    it, so ranks 1..N-1 are refused as busy: yields the fetch task (its STILL_WANTED reads wanted[0]);
    the turn is given back on the way out."""
    parts = c.parts
    req = spb.FetchShardRequest(name="b", layout=parts.store.layout, xxh3=True)
    async with grpc.aio.insecure_channel(c.store_address) as channel:
        holder = None

        async def rank0_then_hold(name):
            nonlocal holder
            got = await parts.store.fetch_shard(name)  # rank 0's own, served
            c.held.clear()
            holder = spb_grpc.AdapterStoreStub(channel).FetchShard(req, timeout=60)
            assert (await holder.read()).HasField("header")  # the one turn, held
            return got

        async def fetch():
            STILL_WANTED.set(lambda: wanted[0])
            return await parts.ranks.fetching(rank0_then_hold)("a")

        try:
            yield asyncio.ensure_future(fetch())
        finally:
            c.held.set()
            if holder is not None:
                holder.cancel()


def test_a_rank_refused_by_a_busy_store_stops_asking_once_nobody_wants_the_adapter(busy_cluster):
    """Rank 0 has its shard; the store's one turn is then taken, so rank 1 is refused and asks
    again. Once rank 0's STILL_WANTED says nobody waits, rank 1 is told and its fetch ends CANCELLED
    at its next ask (not after the 30 s a busy store is otherwise asked); rank 1 keeps nothing of
    it, and the store serves the next stream."""
    c = busy_cluster
    parts, wanted = c.parts, [True]
    digest = c.store_client().get("a").digest

    async def run():
        async with fetching_while_held(c, wanted) as task:
            await asyncio.sleep(1.5)  # rank 1 refused after 0.3 s waits, asking again after 0.2-0.5 s pauses
            assert not task.done()
            wanted[0] = False
            t0 = time.monotonic()
            with pytest.raises(StatusError) as e:
                await asyncio.wait_for(task, 10)
            return e.value, time.monotonic() - t0

    error, took = c.lt.run(run(), 60)
    assert error.code == grpc.StatusCode.CANCELLED
    assert error.message == (
        f"tensor-parallel rank 1: adapter 'a': no request waits for it any more; not fetched "
        f"(the store at {c.store_address} was busy)"
    )
    assert took < BUSY_BACKOFF_MAX_S * 1.25 + BUSY_WAIT_S + 1  # its longest pause, one more refused ask, the poll
    states = c.lt.run(parts.ranks.states())
    assert ("a", digest) not in states[0]["shards"]
    # The store's turn is free again: rank 1 fetches it when it is wanted.
    c.lt.run(parts.ranks.fetching(parts.store.fetch_shard)("a"), 30)
    assert ("a", digest) in c.lt.run(parts.ranks.states())[0]["shards"]


def test_a_rank_told_to_stop_is_asked_again_when_the_adapter_is_wanted_again(busy_cluster, caplog, monkeypatch):
    """Nobody waits, so rank 1 is told to stop; then a request waits again (it joined the same fetch)
    before rank 1 acted on it: rank 1's CANCELLED does not fail the fetch, rank 0 asks it again, and
    once the store has room the fetch ends with the shard on rank 1."""
    c = busy_cluster
    parts, wanted = c.parts, [True]
    send = parts.ranks._send

    def send_then_wanted_again(rank, message):  # wanted again as soon as the "cancel" is on its way
        send(rank, message)
        if message[0] == "cancel":
            wanted[0] = True

    monkeypatch.setattr(parts.ranks, "_send", send_then_wanted_again)
    digest = c.store_client().get("a").digest

    def said_again() -> bool:
        return any("is wanted again" in r.getMessage() for r in caplog.records)

    async def run():
        async with fetching_while_held(c, wanted) as task:
            await asyncio.sleep(1.0)
            wanted[0] = False  # until rank 0 (asking every 0.1 s) has told rank 1 to stop
            deadline = time.monotonic() + 15
            while not said_again():  # rank 1 stopped (CANCELLED) and rank 0 asked it again
                assert time.monotonic() < deadline and not task.done(), "rank 0 did not ask rank 1 again"
                await asyncio.sleep(0.05)
        return await asyncio.wait_for(task, 30)  # the store's turn given back

    with caplog.at_level(logging.INFO, logger="loraserve.executor.ranks"):
        got = c.lt.run(run(), 90)
    assert got[0] == digest
    assert ("a", digest) in c.lt.run(parts.ranks.states())[0]["shards"]


@pytest.fixture
def store_fails_tp_rank_2(monkeypatch):
    """The store fails every fetch of adapter "a" for tp rank 2's shard at once (FAILED_PRECONDITION)."""
    from loraserve.adapter_store import service

    fetch = service.AdapterStoreService.FetchShard

    async def failing_for_rank_2(self, request, context):
        if request.name == "a" and request.rank.tp_rank == 2:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "tp rank 2's shard of 'a' is broken here")
        async for message in fetch(self, request, context):
            yield message

    monkeypatch.setattr(service.AdapterStoreService, "FetchShard", failing_for_rank_2)


@pytest.mark.parametrize("busy_cluster", [4], indirect=True, ids=["tp4"])
def test_a_rank_that_fails_stops_the_others_asking_a_busy_store(store_fails_tp_rank_2, busy_cluster, caplog, monkeypatch):
    """tp 4: rank 2's fetch fails at once while ranks 1 and 3 are refused by the busy store. The
    load has failed, so rank 0 tells ranks 1 and 3 to stop, and the fetch fails with rank 2's error
    within a refused ask and a pause, not when the others' 30 s busy budget runs out (and not with
    their busy answer), each told why; the store serves the next stream."""
    c = busy_cluster
    parts = c.parts
    sent, send = [], parts.ranks._send
    monkeypatch.setattr(parts.ranks, "_send", lambda rank, message: sent.append((rank, message)) or send(rank, message))

    async def run():
        async with fetching_while_held(c, [True]) as task:
            t0 = time.monotonic()
            with pytest.raises(StatusError) as e:
                await asyncio.wait_for(asyncio.shield(task), 15)
            return e.value, time.monotonic() - t0

    with caplog.at_level(logging.INFO, logger="loraserve.executor.ranks"):
        error, took = c.lt.run(run(), 60)
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert error.message == "tensor-parallel rank 2: tp rank 2's shard of 'a' is broken here"
    assert took < BUSY_BACKOFF_MAX_S * 1.25 + BUSY_WAIT_S + 2  # ranks 1 and 3 stopped at their next ask
    assert "fetch of 'a': tensor-parallel rank 2 failed; rank(s) 1, 3 told to stop" in caplog.messages
    cancels = [(rank, m[2]) for rank, m in sent if m[0] == "cancel"]
    assert cancels == [(1, "tensor-parallel rank 2's fetch of it failed"), (3, "tensor-parallel rank 2's fetch of it failed")]
    states = c.lt.run(parts.ranks.states())
    assert all(not s["shards"] for s in states)  # no rank kept a shard of the failed fetch
    assert c.lt.run(parts.ranks.fetching(parts.store.fetch_shard)("b"), 30)[0] == c.store_client().get("b").digest
