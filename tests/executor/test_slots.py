"""The slot manager's state machine: a real fetch over in-memory shards, slot copies into a dict."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
import torch

from loraserve.errors import StatusError, not_found, unavailable
from loraserve.executor.config import ExecutorConfig
from loraserve.executor.slot_reports import SlotObserver
from loraserve.executor.slots import SlotManager

NAMES = [f"adapter-{i}" for i in range(5)]


class Store:
    """An adapter store in memory: counts fetches, can be taken down, can be slowed."""

    def __init__(self, names=NAMES):
        self.shards = {n: {"layer.lora_a": torch.full((1, 2, 4), float(i + 1))} for i, n in enumerate(names)}
        self.labels = {float(i + 1): n for i, n in enumerate(names)}  # shard value -> what a slot holds
        self.versions = {n: 1 for n in names}
        self.fetches: dict[str, int] = {}
        self.down = False
        self.gate: asyncio.Event | None = None  # when set: fetches wait for it
        self.gates: dict[str, asyncio.Event] = {}  # fetches of one adapter wait for its own
        self.in_flight = self.most_in_flight = 0

    async def fetch(self, name: str):
        self.fetches[name] = self.fetches.get(name, 0) + 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.gate is not None:
                await self.gate.wait()
            if name in self.gates:
                await self.gates[name].wait()
            await asyncio.sleep(0)
        finally:
            self.in_flight -= 1
        if self.down:
            raise unavailable("adapter store at localhost:1 is unreachable")
        if name not in self.shards:
            raise not_found(f"adapter {name!r} is not registered")
        tensors = self.shards[name]
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return self.digest(name), 8, tensors, nbytes

    def digest(self, name: str) -> str:
        if name not in self.shards:
            return ""
        v = self.versions[name]
        return f"sha256:{name}" if v == 1 else f"sha256:{name}:v{v}"

    def register_again(self, name: str) -> str:
        """New weights under the same name (a new digest); returns the new digest."""
        self.versions[name] = self.versions.get(name, 0) + 1
        value = 100.0 * self.versions[name] + len(self.labels)
        self.shards[name] = {"layer.lora_a": torch.full((1, 2, 4), value)}
        self.labels[value] = f"{name}@v{self.versions[name]}"
        return self.digest(name)


class Slots:
    """The model's slot buffers, reduced to a dict: slot -> name of the adapter whose tensors it holds.

    queued: the manager is told every copy only queues device work (`queued_copy`), so copies run
    on the loop and a cold load from the CPU cache into a free slot is done on the spot
    (`SlotManager._load_now`), as on CUDA with pinned shards."""

    def __init__(self, store: Store, queued: bool = False):
        self.queued = queued
        self.by_value = store.labels
        self.content: dict[int, str | None] = {}
        self.writes: list[tuple[int, str]] = []

    def copy(self, slot, tensors):
        name = self.by_value[float(tensors["layer.lora_a"][0, 0, 0])]
        self.content[slot] = name
        self.writes.append((slot, name))

    def clear(self, slot):
        self.content[slot] = None


def queued_by(copy, when=lambda tensors: True):
    """A queued_copy for `copy`: where when(tensors), the copy begun (nothing to begin here) as the
    function that does it, as executor/slot_load.py `queued_load` returns one; else None."""
    return lambda slot, tensors: (lambda: copy(slot, tensors)) if when(tensors) else None


def _manager(store, slots, max_loras=2, max_cpu_adapters=8, timeout_s=5.0, max_concurrent_loads=None) -> SlotManager:
    return SlotManager(
        store.fetch,
        slots.copy,
        slots.clear,
        max_loras=max_loras,
        max_cpu_adapters=max_cpu_adapters,
        device=torch.device("cpu"),
        slot_wait_timeout_s=timeout_s,
        max_concurrent_loads=max_concurrent_loads,
        queued_copy=queued_by(slots.copy) if slots.queued else None,
    )


@pytest.fixture
def store():
    return Store()


@pytest.fixture(params=[False, True], ids=["thread-copies", "loop-copies"])
def slots(store, request):
    """Every test of the state machine runs with copies on a thread and with copies queued from the loop."""
    return Slots(store, queued=request.param)


def _status(info, code: grpc.StatusCode, message: str):
    assert info.value.code == code
    assert info.value.message == message


async def test_five_adapters_in_turn_through_two_slots(store, slots):
    mgr = _manager(store, slots)
    for round_ in range(2):
        for name in NAMES:
            lease = await mgr.acquire(name)
            assert slots.content[lease.slot] == name and lease.digest == f"sha256:{name}" and lease.is_ready()
            mgr.release(lease)
    # Each adapter was fetched once (the CPU cache holds all five) but copied into a slot each time.
    assert store.fetches == {n: 1 for n in NAMES}
    assert len(slots.writes) == 10
    in_slots = [s for s in mgr.states() if s.slot >= 0]
    assert sorted(s.name for s in in_slots) == NAMES[3:]  # the two most recently used
    assert all(s.in_cpu_cache and s.in_use == 0 and not s.loading for s in mgr.states())


async def test_five_adapters_concurrently_wait_for_slots_and_never_overwrite_in_use(store, slots):
    mgr = _manager(store, slots)

    async def request(name):
        lease = await mgr.acquire(name)
        for _ in range(3):  # a few "forward steps": the slot must still hold this adapter
            assert slots.content[lease.slot] == name
            await asyncio.sleep(0.001)
        mgr.release(lease)
        return name

    done = await asyncio.gather(*(request(n) for n in NAMES * 3))
    assert sorted(done) == sorted(NAMES * 3)
    assert sum(s.in_use for s in mgr.states()) == 0


async def test_lru_slot_is_evicted_first(store, slots):
    mgr = _manager(store, slots)
    for name in ["adapter-0", "adapter-1", "adapter-0"]:  # adapter-1 is now least recently used
        mgr.release(await mgr.acquire(name))
    lease = await mgr.acquire("adapter-2")
    assert {s.name: s.slot for s in mgr.states()}["adapter-1"] == -1
    assert slots.content[lease.slot] == "adapter-2"


async def test_pinned_adapter_is_never_evicted(store, slots):
    mgr = _manager(store, slots)
    state = await mgr.pin("adapter-0")
    assert state.pinned and state.slot >= 0
    for name in NAMES[1:]:
        mgr.release(await mgr.acquire(name))
    assert mgr.state("adapter-0").slot == state.slot
    assert slots.content[state.slot] == "adapter-0"
    assert slots.writes.count((state.slot, "adapter-0")) == 1
    with pytest.raises(StatusError) as info:
        await mgr.evict("adapter-0")
    _status(info, grpc.StatusCode.FAILED_PRECONDITION, "adapter 'adapter-0' is pinned; unpin it first")
    mgr.unpin("adapter-0")
    assert (await mgr.evict("adapter-0")).slot == -1
    assert slots.content[state.slot] is None
    assert "adapter-0" not in [s.name for s in mgr.states()]


async def test_all_slots_pinned_is_resource_exhausted(store, slots):
    mgr = _manager(store, slots)
    await mgr.pin("adapter-0")
    await mgr.pin("adapter-1")
    with pytest.raises(StatusError) as info:
        await mgr.acquire("adapter-2")
    _status(info, grpc.StatusCode.RESOURCE_EXHAUSTED, "all 2 slots are pinned; unpin an adapter to load 'adapter-2'")
    # Nothing of adapter-2 is in a slot, nobody uses it; it stays fetched in the CPU cache.
    state = mgr.state("adapter-2")
    assert state.slot == -1 and state.in_use == 0 and not state.loading and state.in_cpu_cache


async def test_all_slots_in_use_waits_then_times_out(store, slots):
    mgr = _manager(store, slots, timeout_s=0.2)
    held = [await mgr.acquire("adapter-0"), await mgr.acquire("adapter-1")]
    with pytest.raises(StatusError) as info:
        await mgr.acquire("adapter-2")
    _status(
        info,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "no free slot for adapter 'adapter-2': all 2 slots are pinned or in use by running requests (waited 0.2s)",
    )
    # A waiter gets the slot as soon as a running request releases it.
    mgr.slot_wait_timeout_s = 5.0
    waiter = asyncio.create_task(mgr.acquire("adapter-2"))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    mgr.release(held[0])
    lease = await asyncio.wait_for(waiter, 10.0)
    assert lease.slot == held[0].slot and slots.content[lease.slot] == "adapter-2"
    assert slots.content[held[1].slot] == "adapter-1"


async def test_evict_in_use_is_failed_precondition(store, slots):
    mgr = _manager(store, slots)
    a, b = await mgr.acquire("adapter-0"), await mgr.acquire("adapter-0")
    with pytest.raises(StatusError) as info:
        await mgr.evict("adapter-0")
    _status(info, grpc.StatusCode.FAILED_PRECONDITION, "adapter 'adapter-0' is in use by 2 running requests")
    mgr.release(a)
    mgr.release(b)
    mgr.release(b)  # a second release of one lease is a no-op
    assert (await mgr.evict("adapter-0")).in_cpu_cache is False
    assert mgr.states() == []


async def test_unknown_adapter_is_not_found(store, slots):
    mgr = _manager(store, slots)
    with pytest.raises(StatusError) as info:
        await mgr.evict("nope")
    _status(info, grpc.StatusCode.NOT_FOUND, "adapter 'nope' is not loaded on this executor")
    with pytest.raises(StatusError) as info:
        mgr.unpin("nope")
    _status(info, grpc.StatusCode.NOT_FOUND, "adapter 'nope' is not loaded on this executor")
    with pytest.raises(StatusError) as info:
        await mgr.acquire("nope")
    _status(info, grpc.StatusCode.NOT_FOUND, "adapter 'nope' is not registered")  # the store's error
    assert mgr.states() == []


async def test_concurrent_acquires_share_one_fetch_and_one_copy(store, slots):
    mgr = _manager(store, slots)
    store.gate = asyncio.Event()
    tasks = [asyncio.create_task(mgr.acquire("adapter-0")) for _ in range(10)]
    await asyncio.sleep(0.01)
    (state,) = mgr.states()
    assert state.loading and state.slot == -1
    store.gate.set()
    leases = await asyncio.gather(*tasks)
    assert store.fetches == {"adapter-0": 1}
    assert slots.writes == [(leases[0].slot, "adapter-0")]
    assert {lease.slot for lease in leases} == {leases[0].slot}
    assert mgr.state("adapter-0").in_use == 10


async def test_failed_fetch_leaves_nothing_and_every_waiter_gets_the_error(store, slots):
    mgr = _manager(store, slots)
    store.down = True
    store.gate = asyncio.Event()
    tasks = [asyncio.create_task(mgr.acquire("adapter-0")) for _ in range(3)]
    await asyncio.sleep(0.01)
    store.gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for exc in results:
        assert isinstance(exc, StatusError) and exc.code == grpc.StatusCode.UNAVAILABLE
        assert exc.message == "adapter store at localhost:1 is unreachable"
    assert store.fetches == {"adapter-0": 1}
    assert mgr.states() == [] and slots.writes == []
    # The store comes back: the next acquire retries and succeeds.
    store.down, store.gate = False, None
    lease = await mgr.acquire("adapter-0")
    assert slots.content[lease.slot] == "adapter-0" and store.fetches == {"adapter-0": 2}


async def test_store_down_still_serves_adapters_in_slots_and_cpu_cache(store, slots):
    mgr = _manager(store, slots)
    for name in NAMES[:3]:  # adapter-0 ends up in the CPU cache only, 1 and 2 in slots
        mgr.release(await mgr.acquire(name))
    assert mgr.state("adapter-0").slot == -1
    store.down = True
    for name in NAMES[:3]:
        lease = await mgr.acquire(name)
        assert slots.content[lease.slot] == name
        mgr.release(lease)
    with pytest.raises(StatusError) as info:
        await mgr.acquire("adapter-3")
    _status(info, grpc.StatusCode.UNAVAILABLE, "adapter store at localhost:1 is unreachable")
    assert store.fetches == {n: 1 for n in NAMES[:3]} | {"adapter-3": 1}


async def test_cpu_cache_is_lru_bounded_and_keeps_slotted_adapters(store, slots):
    mgr = _manager(store, slots, max_cpu_adapters=2)
    for name in NAMES:
        mgr.release(await mgr.acquire(name))
    states = {s.name: s for s in mgr.states()}
    # adapter-0..2 are in no tier any more: forgotten. 3 and 4 are in slots and in the CPU cache.
    assert sorted(states) == NAMES[3:]
    assert all(s.in_cpu_cache and s.slot >= 0 for s in states.values())
    mgr.release(await mgr.acquire("adapter-0"))  # refetched
    assert store.fetches["adapter-0"] == 2


async def test_load_into_cpu_only_then_into_slot(store, slots):
    mgr = _manager(store, slots)
    state = await mgr.load("adapter-0", into_slot=False)
    assert state.in_cpu_cache and state.slot == -1 and state.digest == "sha256:adapter-0" and state.rank == 8
    assert slots.writes == []
    state = await mgr.load("adapter-0", into_slot=True)
    assert state.slot >= 0 and slots.writes == [(state.slot, "adapter-0")]
    assert store.fetches == {"adapter-0": 1}
    assert state.bytes == 1 * 2 * 4 * 4


async def test_cancelled_waiter_does_not_cancel_the_shared_load(store, slots):
    mgr = _manager(store, slots)
    store.gate = asyncio.Event()
    first = asyncio.create_task(mgr.acquire("adapter-0"))
    second = asyncio.create_task(mgr.acquire("adapter-0"))
    await asyncio.sleep(0.01)
    first.cancel()
    store.gate.set()
    lease = await second
    assert first.cancelled()
    assert mgr.state("adapter-0").in_use == 1 and slots.content[lease.slot] == "adapter-0"


async def test_a_fetch_is_told_whether_its_adapter_is_still_wanted(store, slots):
    """The CPU cache's fetch runs with STILL_WANTED set (the store client stops asking a busy store
    once it says no): yes while a request waits for the adapter, no once the last one has left."""
    from loraserve.executor.store_client import STILL_WANTED

    asked, fetch = [], store.fetch

    async def watched(name):
        asked.append(STILL_WANTED.get())
        return await fetch(name)

    store.fetch, store.gate = watched, asyncio.Event()
    mgr = _manager(store, slots)
    request = asyncio.create_task(mgr.acquire("adapter-0"))
    await asyncio.sleep(0.01)
    assert len(asked) == 1 and asked[0] is not None and asked[0]() is True
    request.cancel()  # the only request for it leaves while its fetch is under way
    await asyncio.sleep(0.01)
    assert asked[0]() is False
    store.gate.set()
    for _ in range(100):  # the fetch ends (and lands in the CPU cache): nothing left pending
        if mgr.state("adapter-0").in_cpu_cache:
            break
        await asyncio.sleep(0.01)
    assert mgr.state("adapter-0").in_cpu_cache


@pytest.mark.parametrize("begun", [False, True], ids=["refused-by-the-copy", "refused-as-it-begins"])
@pytest.mark.parametrize("cached", [False, True], ids=["fetched", "cached"])
async def test_shard_the_model_refuses_is_invalid_argument_and_not_cached(store, slots, cached, begun):
    """Refused on a thread or on the loop, after a fetch or from the CPU cache (with loop copies: on
    the spot, `_load_now`), by the copy or (loop copies) as `queued_copy` begins it, before a slot is
    taken there: INVALID_ARGUMENT, the copy dropped and the slot free again."""

    def copy(slot, tensors):
        raise ValueError("layer.lora_a: shard tensor (1, 2, 4) does not fit slot (1, 8, 5)")

    queued = queued_by(copy)
    if begun:
        queued = lambda slot, tensors: copy(slot, tensors)  # noqa: E731
    mgr = SlotManager(
        store.fetch,
        copy,
        slots.clear,
        max_loras=1,
        max_cpu_adapters=8,
        device=torch.device("cpu"),
        queued_copy=queued if slots.queued else None,
    )
    if cached:
        await mgr.load("adapter-0", into_slot=False)
    with pytest.raises(StatusError) as info:
        await mgr.acquire("adapter-0")
    _status(
        info,
        grpc.StatusCode.INVALID_ARGUMENT,
        "adapter 'adapter-0' does not fit this executor's LoRA slots: "
        "layer.lora_a: shard tensor (1, 2, 4) does not fit slot (1, 8, 5)",
    )
    assert mgr.states() == [] and mgr._slots == [None]


async def test_a_cold_load_from_the_cpu_cache_into_a_free_slot_starts_no_task(store, slots):
    """With loop-queued copies, the common cold load (host copy cached, a slot free, nobody queued
    before it) is done inside the acquire: no task, no loop turns; otherwise a load task runs."""
    mgr = _manager(store, slots)
    await mgr.load("adapter-0", into_slot=False)
    spawned = []
    spawn = mgr._spawn
    mgr._spawn = lambda coro: spawned.append(coro) or spawn(coro)
    lease = await mgr.acquire("adapter-0")
    assert slots.content[lease.slot] == "adapter-0" and mgr.state("adapter-0").slot == lease.slot
    assert len(spawned) == (0 if slots.queued else 1)
    mgr.release(lease)
    lease = await mgr.acquire("adapter-1")  # not in the CPU cache: fetched by a task either way
    assert slots.content[lease.slot] == "adapter-1" and len(spawned) == (1 if slots.queued else 2)


# ---- new versions in the store ----------------------------------------------------------------


async def test_refresh_drops_an_idle_old_version_and_the_next_acquire_loads_the_new(store, slots):
    mgr = _manager(store, slots)
    mgr.release(await mgr.acquire("adapter-0"))
    assert mgr.known_digests() == {"adapter-0": "sha256:adapter-0"}
    assert not await mgr.refresh("adapter-0", "sha256:adapter-0")  # same version: nothing to do
    new = store.register_again("adapter-0")
    assert await mgr.refresh("adapter-0", new)
    assert mgr.states() == [] and set(slots.content.values()) == {None}  # slot zeroed, record gone
    lease = await mgr.acquire("adapter-0")
    assert lease.digest == new and slots.content[lease.slot] == "adapter-0@v2"
    assert store.fetches["adapter-0"] == 2


async def test_refresh_of_an_adapter_in_use_waits_for_its_requests(store, slots):
    mgr = _manager(store, slots)
    running = await mgr.acquire("adapter-0")
    new = store.register_again("adapter-0")
    assert await mgr.refresh("adapter-0", new)
    assert slots.content[running.slot] == "adapter-0" and mgr.state("adapter-0").digest == "sha256:adapter-0"
    waiter = asyncio.create_task(mgr.acquire("adapter-0"))  # arrives while the old version runs
    await asyncio.sleep(0.05)
    assert not waiter.done() and slots.content[running.slot] == "adapter-0"  # never swapped under it
    mgr.release(running)
    lease = await asyncio.wait_for(waiter, 10.0)
    assert lease.digest == new and slots.content[lease.slot] == "adapter-0@v2"


async def test_refresh_waiter_is_served_the_old_version_after_the_slot_wait(store, slots, until):
    mgr = _manager(store, slots, timeout_s=0.1)
    running = await mgr.acquire("adapter-0")
    await mgr.refresh("adapter-0", store.register_again("adapter-0"))
    lease = await asyncio.wait_for(mgr.acquire("adapter-0"), 10.0)  # still in use after 0.1 s
    assert lease.digest == "sha256:adapter-0" and lease.slot == running.slot
    mgr.release(running)
    mgr.release(lease)
    await until(lambda: mgr.states() == [], what="the last release dropping the old version")


async def test_refresh_reloads_a_pinned_adapter_and_keeps_the_pin(store, slots, until):
    mgr = _manager(store, slots)
    await mgr.pin("adapter-0")
    new = store.register_again("adapter-0")
    assert await mgr.refresh("adapter-0", new)

    def reloaded() -> bool:  # the new host copy's digest shows before its copy into the slot ends
        state = mgr.state("adapter-0")
        return state.slot >= 0 and state.digest == new and not state.loading

    await until(reloaded, what="the pinned adapter's reload")
    state = mgr.state("adapter-0")
    assert state.pinned and state.digest == new and slots.content[state.slot] == "adapter-0@v2"


async def test_refresh_of_an_adapter_deleted_in_the_store_makes_it_not_found(store, slots):
    mgr = _manager(store, slots)
    mgr.release(await mgr.acquire("adapter-1"))
    del store.shards["adapter-1"]
    assert await mgr.refresh("adapter-1", store.digest("adapter-1"))
    with pytest.raises(StatusError) as info:
        await mgr.acquire("adapter-1")
    _status(info, grpc.StatusCode.NOT_FOUND, "adapter 'adapter-1' is not registered")


async def test_refresh_sees_an_old_version_left_in_a_slot_after_a_newer_host_copy(store, slots):
    mgr = _manager(store, slots, max_loras=2, max_cpu_adapters=1)
    mgr.release(await mgr.acquire("adapter-0"))
    mgr.release(await mgr.acquire("adapter-1"))  # pushes adapter-0's host copy out of the CPU cache
    new = store.register_again("adapter-0")
    await mgr.load("adapter-0", into_slot=False)  # host copy: the new version; slot: still the old one
    assert mgr.known_digests()["adapter-0"] == "sha256:adapter-0"  # what the slot serves
    assert await mgr.refresh("adapter-0", new)
    lease = await mgr.acquire("adapter-0")
    assert lease.digest == new and slots.content[lease.slot] == "adapter-0@v2"


async def test_refresh_of_a_pinned_adapter_keeps_its_slot_under_slot_pressure(store, slots, until):
    mgr = _manager(store, slots, max_loras=2, timeout_s=0.3)
    pinned_slot = (await mgr.pin("adapter-0")).slot
    busy = await mgr.acquire("adapter-1")
    waiter = asyncio.create_task(mgr.acquire("adapter-2"))  # wants a slot; none may be taken
    await asyncio.sleep(0.05)
    new = store.register_again("adapter-0")
    assert await mgr.refresh("adapter-0", new)
    with pytest.raises(StatusError) as info:
        await waiter
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    await until(lambda: not mgr.state("adapter-0").loading, what="the pinned adapter's reload")
    state = mgr.state("adapter-0")
    assert (state.slot, state.pinned, state.digest) == (pinned_slot, True, new)
    assert slots.content[pinned_slot] == "adapter-0@v2" and slots.content[busy.slot] == "adapter-1"


async def test_refresh_of_a_pinned_adapter_with_the_store_down_keeps_the_old_version(store, slots):
    mgr = _manager(store, slots)
    slot = (await mgr.pin("adapter-0")).slot
    mgr.cpu.drop(mgr._adapters["adapter-0"].host)  # only the slot holds it now
    new = store.register_again("adapter-0")
    store.down = True
    assert await mgr.refresh("adapter-0", new)
    lease = await mgr.acquire("adapter-0")  # waits for the failed reload, then serves the old version
    assert lease.slot == slot and lease.digest == "sha256:adapter-0" and slots.content[slot] == "adapter-0"
    state = mgr.state("adapter-0")  # the version in the slot, not the one that failed
    assert (state.digest, state.rank, state.bytes, state.slot, state.in_cpu_cache) == ("sha256:adapter-0", 8, 32, slot, False)
    assert [r.rank for r in mgr.residency()] == [8]
    mgr.release(lease)
    store.down = False
    assert await mgr.refresh("adapter-0", new)  # the next round tries again
    lease = await mgr.acquire("adapter-0")
    assert lease.digest == new and slots.content[slot] == "adapter-0@v2"


async def test_a_request_cancelled_mid_switch_never_lets_the_clear_hit_another_adapter(store, slots):
    import time

    def slow_clear(slot):
        time.sleep(0.2)
        slots.clear(slot)

    mgr = SlotManager(
        store.fetch, slots.copy, slow_clear, max_loras=1, max_cpu_adapters=8, device=torch.device("cpu"), slot_wait_timeout_s=2.0
    )
    running = await mgr.acquire("adapter-0")
    await mgr.refresh("adapter-0", store.register_again("adapter-0"))
    other = asyncio.create_task(mgr.acquire("adapter-1"))  # waits for the only slot
    switching = asyncio.create_task(asyncio.wait_for(mgr.acquire("adapter-0"), 0.05))  # a short deadline
    await asyncio.sleep(0.01)
    mgr.release(running)  # the switch starts zeroing the slot; the deadline cancels its request
    with pytest.raises(asyncio.TimeoutError):
        await switching
    lease = await asyncio.wait_for(other, 10.0)
    await asyncio.sleep(0.3)  # any clear still running has finished by now
    assert slots.content[lease.slot] == "adapter-1"


async def test_slot_ranks_follow_what_the_copy_reports_and_clear_to_zero(store, slots):
    """SlotManager.slot_ranks: the rank the copy function returns for a slot (what the kernels read
    it to), the whole slot (FULL_RANK) when it returns none, 0 once the slot is cleared."""
    from loraserve.kernels.meta import FULL_RANK

    a, b = NAMES[:2]
    ranks = {a: 3, b: None}

    def copy(slot, tensors):
        slots.copy(slot, tensors)
        return ranks[slots.content[slot]]

    mgr = SlotManager(store.fetch, copy, slots.clear, max_loras=1, max_cpu_adapters=8, device=torch.device("cpu"))
    assert mgr.slot_ranks == [FULL_RANK]
    mgr.release(await mgr.acquire(a))
    assert mgr.slot_ranks == [3]
    mgr.release(await mgr.acquire(b))  # evicts a: cleared, then b's copy says nothing
    assert slots.content[0] == b and mgr.slot_ranks == [FULL_RANK]
    await mgr.evict(b)
    assert mgr.slot_ranks == [0]


async def test_refresh_loop_survives_an_unexpected_error(store, slots, caplog, until):
    from loraserve.executor.refresh import refresh_loop

    def broken_clear(slot):
        raise RuntimeError("CUDA error: device-side assert")

    mgr = SlotManager(
        store.fetch,
        slots.copy,
        broken_clear,
        max_loras=2,
        max_cpu_adapters=8,
        device=torch.device("cpu"),
        slot_wait_timeout_s=1.0,
    )
    mgr.release(await mgr.acquire("adapter-0"))

    class StoreAnswers:
        address = "127.0.0.1:1"

        async def current_digest(self, name):
            return "sha256:a-new-version"

    loop = asyncio.create_task(refresh_loop(mgr, StoreAnswers(), 0.01))
    await until(lambda: "adapter refresh round failed" in caplog.text, what="a failed refresh round's log line")
    await asyncio.sleep(0.05)  # more rounds: the loop goes on after the failure
    assert not loop.done()
    assert "adapter refresh round failed" in caplog.text and "device-side assert" in caplog.text
    loop.cancel()


# ---- scheduling for many adapters --------------------------------------------------------------


async def test_slot_waiters_are_served_in_arrival_order(store, slots):
    """No adapter starves: a slot freed while adapters wait goes to the one that waited longest,
    even when another asks for it in the same instant and could otherwise take it first."""
    mgr = _manager(store, slots, max_loras=1)
    for name in NAMES[:3]:
        await mgr.load(name, into_slot=False)  # every copy already in the CPU cache
    running = await mgr.acquire("adapter-0")
    first = asyncio.create_task(mgr.acquire("adapter-1"))
    await asyncio.sleep(0.01)  # adapter-1 is waiting for the slot
    mgr.release(running)
    late = asyncio.create_task(mgr.acquire("adapter-2"))  # asks in the same instant
    lease = await asyncio.wait_for(first, 10.0)
    assert slots.content[lease.slot] == "adapter-1" and not late.done()
    mgr.release(lease)
    mgr.release(await asyncio.wait_for(late, 10.0))


class Recorder(SlotObserver):
    """A SlotObserver that keeps what it is told."""

    def __init__(self):
        self.calls: list[tuple] = []

    def slot_hit(self) -> None:
        self.calls.append(("hit",))

    def slot_miss(self) -> None:
        self.calls.append(("miss",))

    def slot_eviction(self, name: str) -> None:
        self.calls.append(("eviction", name))

    def adapter_loaded(self, tier: str, seconds: float) -> None:
        self.calls.append(("loaded", tier))

    def load_phases(self, fetch_s: float, slot_wait_s: float, copy_s: float) -> None:
        self.calls.append(("phases", fetch_s >= 0 and slot_wait_s >= 0 and copy_s >= 0))


async def test_a_load_on_the_spot_evicts_the_idle_adapter_and_reports_as_the_task_path_does(store, slots):
    """Cached adapter-1 takes adapter-0's idle slot: one miss, one eviction, a CPU-tier load, on
    either path; adapter-0 keeps its host copy and loses its slot."""
    observer = Recorder()
    mgr = SlotManager(
        store.fetch,
        slots.copy,
        slots.clear,
        max_loras=1,
        max_cpu_adapters=8,
        device=torch.device("cpu"),
        observer=observer,
        queued_copy=queued_by(slots.copy) if slots.queued else None,
    )
    mgr.release(await mgr.acquire("adapter-0"))
    await mgr.load("adapter-1", into_slot=False)
    observer.calls.clear()
    mgr.release(await mgr.acquire("adapter-1"))
    assert observer.calls == [("miss",), ("eviction", "adapter-0"), ("loaded", "cpu"), ("phases", True)]
    assert slots.content == {0: "adapter-1"}
    states = {s.name: s for s in mgr.states()}
    assert states["adapter-1"].slot == 0 and states["adapter-0"].slot == -1 and states["adapter-0"].in_cpu_cache


async def test_a_copy_that_fails_otherwise_frees_the_slot_keeps_the_host_copy_and_raises_as_is(store, slots):
    def copy(slot, tensors):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    mgr = SlotManager(
        store.fetch,
        copy,
        slots.clear,
        max_loras=1,
        max_cpu_adapters=8,
        device=torch.device("cpu"),
        queued_copy=queued_by(copy) if slots.queued else None,
    )
    await mgr.load("adapter-0", into_slot=False)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        await mgr.acquire("adapter-0")
    assert mgr._slots == [None]
    (state,) = mgr.states()
    assert state.name == "adapter-0" and state.slot == -1 and state.in_cpu_cache


async def test_a_load_that_asked_first_keeps_its_turn_over_one_done_on_the_spot(store, slots):
    """adapter-0's copy cannot be queued from the loop (its load takes a task), adapter-1's can (on
    the spot, `_load_now`); both are cached and ask in the same instant for the one slot: the
    first to ask gets it, the other waits for it."""
    mgr = SlotManager(
        store.fetch,
        slots.copy,
        slots.clear,
        max_loras=1,
        max_cpu_adapters=8,
        device=torch.device("cpu"),
        slot_wait_timeout_s=5.0,
        queued_copy=queued_by(slots.copy, lambda tensors: slots.by_value[float(tensors["layer.lora_a"][0, 0, 0])] != "adapter-0"),
    )
    for name in NAMES[:2]:
        await mgr.load(name, into_slot=False)
    first = asyncio.create_task(mgr.acquire("adapter-0"))
    second = asyncio.create_task(mgr.acquire("adapter-1"))  # runs after the first spawns its load task,
    # before that task starts
    lease = await asyncio.wait_for(first, 10.0)
    assert slots.content[lease.slot] == "adapter-0" and not second.done()
    mgr.release(lease)
    mgr.release(await asyncio.wait_for(second, 10.0))
    assert slots.writes == [(0, "adapter-0"), (0, "adapter-1")]


async def test_slot_eviction_prefers_adapters_no_queued_request_wants(store, slots):
    mgr = _manager(store, slots, max_loras=2)
    for name in ["adapter-0", "adapter-1"]:  # adapter-0 is now the least recently used
        mgr.release(await mgr.acquire(name))
    unwant = mgr.want("adapter-0")  # a request for adapter-0 has arrived (tokenizing, queued)
    lease = await mgr.acquire("adapter-2")
    assert {s.name: s.slot >= 0 for s in mgr.states()} == {"adapter-0": True, "adapter-1": False, "adapter-2": True}
    unwant()
    mgr.release(lease)
    mgr.release(await mgr.acquire("adapter-3"))  # nobody wants adapter-0 now: LRU again
    assert {s.name for s in mgr.states() if s.slot >= 0} == {"adapter-2", "adapter-3"}


def _zipf(names: list[str], n: int, alpha: float = 1.0, seed: int = 0) -> list[str]:
    """n requests: names[k] asked with probability proportional to 1 / (k + 1)^alpha (benchmarks/serve.py's workload)."""
    return random.Random(seed).choices(names, [1.0 / (k + 1) ** alpha for k in range(len(names))], k=n)


async def test_the_hottest_adapters_keep_their_slots_under_a_zipf_workload(slots):
    """1,000 adapters under Zipf 1.0 through 8 slots, one request at a time: once each of the three
    hottest (~13%, ~7% and ~4% of requests) has been asked for a few times, none is evicted again."""
    names = [f"adapter-{i}" for i in range(1000)]
    store = Store(names)
    content, observer = Slots(store, slots.queued), Recorder()
    mgr = SlotManager(
        store.fetch,
        content.copy,
        content.clear,
        max_loras=8,
        device=torch.device("cpu"),
        observer=observer,
        queued_copy=queued_by(content.copy) if content.queued else None,
    )
    evicted_at: dict[str, list[int]] = {}
    for i, name in enumerate(_zipf(names, 600)):
        before = len(observer.calls)
        mgr.release(await mgr.acquire(name))
        for call in observer.calls[before:]:
            if call[0] == "eviction":
                evicted_at.setdefault(call[1], []).append(i)
    hottest = names[:3]
    assert {n: [i for i in evicted_at.get(n, []) if i >= 100] for n in hottest} == {n: [] for n in hottest}
    assert all(mgr.state(n).slot >= 0 for n in hottest)
    assert sum(len(v) for v in evicted_at.values()) > 300  # the cold tail churned the other slots meanwhile


async def test_a_burst_of_one_off_adapters_cannot_flush_the_hot_set(slots):
    names = [f"adapter-{i}" for i in range(40)]
    store = Store(names)
    content = Slots(store, slots.queued)
    mgr = _manager(store, content, max_loras=4, max_cpu_adapters=None)
    hot = names[:3]
    for _ in range(10):
        for name in hot:
            mgr.release(await mgr.acquire(name))
    for name in names[10:40]:  # 30 adapters asked for once each, in a row
        mgr.release(await mgr.acquire(name))
    assert all(mgr.state(n).slot >= 0 for n in hot)
    assert [w for w in content.writes if w[1] in hot] == [(i, n) for i, n in enumerate(hot)]  # each copied in once
    assert len(content.writes) == 3 + 30  # the one-offs took turns in the fourth slot


async def test_the_cpu_cache_keeps_a_hot_adapter_through_a_burst_of_one_offs(store, slots):
    """One slot, room for 3 host copies: adapter-0, asked 5 times, loses its slot to each one-off
    but keeps its host copy (the one-offs' copies go first), so it is never fetched again."""
    mgr = _manager(store, slots, max_loras=1, max_cpu_adapters=3)
    for _ in range(5):
        mgr.release(await mgr.acquire("adapter-0"))
    for name in NAMES[1:]:
        mgr.release(await mgr.acquire(name))
    assert mgr.state("adapter-0").in_cpu_cache and mgr.state("adapter-0").slot == -1
    mgr.release(await mgr.acquire("adapter-0"))
    assert store.fetches == {n: 1 for n in NAMES}


def _cached(mgr, *names) -> bool:
    """Every one of names has its host copy in the CPU cache (a fetch lands through a thread)."""
    return set(names) <= {s.name for s in mgr.states() if s.in_cpu_cache}


async def test_a_wanted_adapter_is_prefetched_into_the_cpu_cache_before_its_acquire(store, slots, until):
    mgr = _manager(store, slots)
    unwant = mgr.want("adapter-3")
    await until(lambda: _cached(mgr, "adapter-3"), what="the prefetch")
    assert store.fetches == {"adapter-3": 1}
    lease = await mgr.acquire("adapter-3")
    unwant()
    mgr.release(lease)
    assert store.fetches == {"adapter-3": 1}
    unwant = mgr.want("adapter-9")  # a failed prefetch leaves nothing behind; the acquire reports the error
    await until(lambda: "adapter-9" in store.fetches, what="the prefetch of adapter-9")
    await until(lambda: not mgr.state("adapter-9").loading, what="the failed prefetch")
    assert mgr.cpu_cache_state() == (1, 32)  # adapter-3's alone
    unwant()
    assert "adapter-9" not in {s.name for s in mgr.states()}
    with pytest.raises(StatusError) as e:
        await mgr.acquire("adapter-9")
    _status(e, grpc.StatusCode.NOT_FOUND, "adapter 'adapter-9' is not registered")


async def _cpu_cache_settled(mgr) -> None:
    """Waits until every CPU cache task (prefetches, fetches) has ended."""
    while mgr.cpu._tasks:
        await asyncio.wait(set(mgr.cpu._tasks))


@pytest.mark.parametrize("seats", [None, 1])
async def test_an_adapter_let_go_before_its_prefetch_begins_is_not_fetched(store, slots, seats):
    """want() then evict() before the prefetch task has run (evict of an adapter in no slot does
    not yield to the loop), or want() and its end at once: the prefetch fetches nothing, so no host
    copy outlives the record."""
    mgr = _manager(store, slots, max_concurrent_loads=seats)
    unwant = mgr.want("adapter-3")
    state = await mgr.evict("adapter-3")
    assert (state.slot, state.in_cpu_cache, state.loading) == (-1, False, False)
    unwant()
    await _cpu_cache_settled(mgr)
    assert store.fetches == {} and mgr.cpu_cache_state() == (0, 0) and mgr.states() == []
    mgr.release(await mgr.acquire("adapter-3"))  # a later request fetches it as usual
    assert store.fetches == {"adapter-3": 1} and mgr.cpu_cache_state() == (1, 32)
    mgr.want("adapter-4")()  # its request ended before the prefetch began: nothing fetched either
    await _cpu_cache_settled(mgr)
    assert "adapter-4" not in store.fetches and mgr.cpu_cache_state() == (1, 32)


async def test_an_adapter_waiting_for_a_slot_is_fetched_meanwhile(store, slots, until):
    mgr = _manager(store, slots, max_loras=1)
    running = await mgr.acquire("adapter-0")
    waiting = asyncio.create_task(mgr.acquire("adapter-1"))
    await until(lambda: _cached(mgr, "adapter-1"), what="the waiting adapter's fetch")
    assert store.fetches.get("adapter-1") == 1 and not waiting.done()
    mgr.release(running)
    mgr.release(await asyncio.wait_for(waiting, 10.0))


async def test_cpu_cache_is_bounded_in_bytes(store, slots):
    shard_bytes = 1 * 2 * 4 * 4  # Store's shards: one float32 tensor of [1, 2, 4]
    mgr = _manager(store, slots, max_cpu_adapters=None)
    mgr.cpu.budget_bytes = 2 * shard_bytes
    for name in NAMES:
        mgr.release(await mgr.acquire(name))
    assert mgr.cpu_cache_state() == (2, 2 * shard_bytes)
    assert sorted(s.name for s in mgr.states() if s.in_cpu_cache) == NAMES[3:]


async def test_cpu_cache_drops_copies_no_request_waits_on_first(store, slots, until):
    shard_bytes = 1 * 2 * 4 * 4
    mgr = _manager(store, slots, max_loras=1, max_cpu_adapters=None)
    mgr.cpu.budget_bytes = 2 * shard_bytes
    running = await mgr.acquire("adapter-0")
    waiting = asyncio.create_task(mgr.acquire("adapter-1"))  # fetched, then waits for the slot
    await until(lambda: _cached(mgr, "adapter-1"), what="the waiting adapter's fetch")
    for name in ["adapter-2", "adapter-3"]:  # newer copies: LRU alone would drop adapter-1's
        await mgr.load(name, into_slot=False)
    assert mgr.state("adapter-1").in_cpu_cache
    mgr.release(running)
    mgr.release(await asyncio.wait_for(waiting, 10.0))
    assert store.fetches["adapter-1"] == 1


async def test_store_fetches_run_at_most_max_concurrent_loads_at_once_in_the_order_asked(until):
    """Cold loads take seats in turn; an adapter already in the CPU cache or in a slot never waits
    for a seat, and a fetch whose request has ended before its turn is not started."""
    store = Store([*NAMES, "adapter-5"])
    slots = Slots(store)
    mgr = _manager(store, slots, max_loras=3, max_concurrent_loads=2)
    mgr.release(await mgr.acquire("adapter-0"))  # in a slot
    await mgr.load("adapter-5", into_slot=False)  # in the CPU cache only
    store.gates = {n: asyncio.Event() for n in NAMES[1:5]}
    unwants = {n: mgr.want(n) for n in NAMES[1:5]}  # four requests for cold adapters arrive in turn
    await until(lambda: store.in_flight == 2, what="two cold loads taking the seats")
    await asyncio.sleep(0.01)  # and no third one starting
    assert store.fetches.keys() == {"adapter-0", "adapter-5", "adapter-1", "adapter-2"} and store.in_flight == 2
    for name in ("adapter-0", "adapter-5"):  # served while every seat is taken by a cold load
        mgr.release(await asyncio.wait_for(mgr.acquire(name), 10.0))
    unwants["adapter-4"]()  # its request ends while its fetch waits for a seat
    store.gates["adapter-2"].set()
    await until(lambda: "adapter-3" in store.fetches, what="the next cold load taking the seat")
    assert store.in_flight == 2  # the next in turn took the seat
    for gate in store.gates.values():
        gate.set()
    await until(lambda: _cached(mgr, *NAMES[1:4]), what="the cold loads")
    await until(lambda: "adapter-4" not in {s.name for s in mgr.states()}, what="the ended request's cleanup")
    assert "adapter-4" not in store.fetches and store.most_in_flight == 2
    for name in NAMES[1:4]:
        unwants[name]()
    with pytest.raises(ValueError, match="max_concurrent_loads must be at least 1, got 0"):
        ExecutorConfig(max_concurrent_loads=0)


async def test_an_acquire_cancelled_while_its_fetch_waits_for_a_seat_fetches_nothing_and_takes_no_slot(until):
    """The slot load an acquire starts outlives the acquire (it is shared and shielded); once every
    request for the adapter has ended it must not take a load seat, nor a slot after a fetch."""
    store = Store([*NAMES])
    slots = Slots(store)
    mgr = _manager(store, slots, max_loras=2, max_concurrent_loads=1)
    store.gates = {"adapter-1": asyncio.Event(), "adapter-3": asyncio.Event()}
    first = asyncio.create_task(mgr.acquire("adapter-1"))  # takes the one seat, held at its gate
    await asyncio.sleep(0.01)
    waiting = asyncio.create_task(mgr.acquire("adapter-2"))  # queued for the seat
    await asyncio.sleep(0.01)
    waiting.cancel()  # its request ends (client gone, deadline) while it waits
    with pytest.raises(asyncio.CancelledError):
        await waiting
    fetching = asyncio.create_task(mgr.acquire("adapter-3"))  # gets the seat after adapter-1 ...
    store.gates["adapter-1"].set()
    mgr.release(await asyncio.wait_for(first, 10.0))
    await until(lambda: "adapter-3" in store.fetches, what="adapter-3's fetch starting")
    fetching.cancel()  # ... and ends while its fetch runs: the copy is kept, no slot taken for it
    with pytest.raises(asyncio.CancelledError):
        await fetching
    store.gates["adapter-3"].set()
    await until(lambda: _cached(mgr, "adapter-3"), what="adapter-3's fetch")
    assert "adapter-2" not in store.fetches, "a fetch started for a request that had ended"
    assert store.fetches.get("adapter-3") == 1
    assert "adapter-3" not in slots.content.values() and mgr.state("adapter-3").slot < 0


async def test_a_fetched_shard_lands_with_its_signature_worked_out(store, slots):
    """The CPU cache works a ShardTensors' signature out as it lands (off the serving loop): the
    slot copy then finds it kept and skips that work. It marks whether the shard is in page-locked
    memory too (only a CUDA executor's is: here, on the CPU, not)."""
    from loraserve.executor.shard_tensors import ShardTensors

    store.shards["adapter-0"] = ShardTensors(store.shards["adapter-0"])
    seen = []
    copy = slots.copy
    slots.copy = lambda slot, tensors: seen.append((getattr(tensors, "signature", None), tensors.pinned)) or copy(slot, tensors)
    mgr = _manager(store, slots)
    lease = await mgr.acquire("adapter-0")
    mgr.release(lease)
    assert seen and seen[0][0] is not None and seen[0][0][0].parts[0] == ("layer.lora_a",) and seen[0][1] is False


async def test_residency_says_where_each_adapter_is_and_what_requests_wait_for(store, slots):
    """/metrics' snapshot: gpu (ready in a slot), cpu (host copy only), store (being fetched, an
    acquire waiting on it); pinned; rank from the fetched shard (0 before it lands)."""
    mgr = _manager(store, slots)
    await mgr.pin("adapter-0")
    mgr.release(await mgr.acquire("adapter-1"))
    mgr.release(await mgr.acquire("adapter-2"))  # adapter-1 leaves its slot (adapter-0 is pinned)
    store.gates["adapter-3"] = asyncio.Event()
    unwant = mgr.want("adapter-3")
    waiting = asyncio.create_task(mgr.acquire("adapter-3"))
    await asyncio.sleep(0.01)
    where = {r.name: r for r in mgr.residency()}
    assert {n: (r.tier, r.pinned, r.rank, r.waited_for) for n, r in where.items()} == {
        "adapter-0": ("gpu", True, 8, False),
        "adapter-1": ("cpu", False, 8, False),
        "adapter-2": ("gpu", False, 8, False),
        "adapter-3": ("store", False, 0, True),
    }
    store.gates["adapter-3"].set()
    lease = await waiting
    unwant()
    assert {r.name: (r.tier, r.waited_for) for r in mgr.residency()}["adapter-3"] == ("gpu", False)
    mgr.release(lease)
