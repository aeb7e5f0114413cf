"""The slot manager: which adapter sits in which GPU slot, and getting it there.

Adapters live in three tiers:

    store (gRPC) --fetch--> CPU cache (executor/cpu_cache.py: packed shards in host memory, pinned
                            on CUDA, bounded in bytes; at most `max_concurrent_loads` fetches at once)
                 --copy---> GPU slot (this module: LRU over `max_loras` slots, pins, in-use counts)

Rules this module guarantees:
- A slot is never overwritten while a running request uses it (`in_use`), while an
  acquire or load of its adapter is still in flight (`holds`), or while it is pinned.
- Concurrent acquires of one adapter share one fetch (cpu_cache.py) and one copy.
- When no slot can be freed, a request waits up to `slot_wait_timeout_s` for one; if every
  slot is pinned it fails at once. Both fail with RESOURCE_EXHAUSTED. Waiters get slots in the
  order they started waiting: an adapter never waits behind one that asked after it.
- A request announces its adapter as soon as it arrives (`want`): the adapter's CPU copy is
  fetched from then on (prefetch), and slot eviction picks an idle adapter that no queued
  request wants before one that some request does (then the least recently used). The CPU
  cache's own rules (bounded bytes, fetch seats in turn) are in cpu_cache.py; an adapter in a
  slot or in the CPU cache never waits for a fetch seat.
- A failed fetch leaves nothing behind; every waiter gets the error; the next acquire retries.
- Adapters already in a slot or in the CPU cache keep serving when the store is down.
- Loading never blocks the forward passes of other adapters: on CUDA the copy runs on a side
  stream (queued from the loop when that is all it does: a pinned shard of a layout planned
  before; else from a copy thread), on the CPU in a thread; the lease carries an event recorded
  after the copy.
- A new version in the store (`refresh`: the adapter was registered again, or deleted) drops
  the cached one as soon as no running request uses it; requests that arrive meanwhile wait
  for that (up to `slot_wait_timeout_s`, then they are served the old version) and get the
  new one. A pinned adapter is reloaded at once, in place: it keeps its slot and its pin, and
  its old version serves on if the new one cannot be fetched.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from loraserve.errors import exhausted, invalid, not_found, precondition
from loraserve.serving import outlast_cancellation
from loraserve.kernels.meta import FULL_RANK

from .cpu_cache import CpuCache, FetchShard, waited_on

log = logging.getLogger(__name__)


class SlotObserver:
    """Told of slot hits, misses, evictions and load times (loraserve/metrics.py's ExecutorMetrics
    is one); on the event loop, so each call must be cheap. This one ignores them."""

    def slot_hit(self) -> None: ...
    def slot_miss(self) -> None: ...
    def slot_eviction(self) -> None: ...
    def adapter_loaded(self, tier: str, seconds: float) -> None: ...
    def load_phases(self, fetch_s: float, slot_wait_s: float, copy_s: float) -> None:
        """A slot load's seconds split: in the CPU cache (the fetch and its wait for a seat; ~0 when
        cached), waiting for a slot to free, the copy into it (host side: until the copy is queued)."""


def _use_stream(stream: torch.cuda.Stream) -> None:
    """The copy thread's start: its device and current stream are the copy stream's from then on."""
    torch.cuda.set_device(stream.device)
    torch.cuda.set_stream(stream)


@dataclass(eq=False)
class SlotLease:
    """A running request's hold on an adapter's slot; give it back with SlotManager.release."""

    name: str
    slot: int
    digest: str
    ready: torch.cuda.Event | None = None  # CUDA: recorded on the copy stream after the copy
    released: bool = field(default=False, repr=False)

    def is_ready(self) -> bool:
        """True once the slot's weights are in place (never blocks). Once the copy is seen done,
        the event is dropped: steps need not wait for it any more (`wait` becomes free)."""
        if self.ready is not None and self.ready.query():
            self.ready = None
        return self.ready is None

    def wait(self) -> None:
        """Makes the current CUDA stream wait for the copy (a GPU-side wait, the host goes on)."""
        if self.ready is not None:
            torch.cuda.current_stream().wait_event(self.ready)


@dataclass
class AdapterState:
    name: str
    digest: str
    rank: int
    slot: int  # -1: not in a GPU slot
    pinned: bool
    in_use: int
    in_cpu_cache: bool
    last_used_unix_ms: int
    bytes: int
    loading: bool


@dataclass(eq=False)
class _Adapter:
    name: str
    digest: str = ""
    rank: int = 0
    nbytes: int = 0
    tensors: dict[str, torch.Tensor] | None = None  # the CPU-cache copy (cpu_cache.py fills and drops it)
    slot: int = -1
    slot_digest: str = ""  # the version in the slot (a later refetch may have brought a newer one)
    event: torch.cuda.Event | None = None
    pinned: bool = False
    wanted: int = 0  # requests queued for it that hold no lease yet (`want`)
    in_use: int = 0  # leases held by running requests
    holds: int = 0  # acquire/load calls in flight: keep the adapter in place meanwhile
    lru_tick: int = 0
    last_used_unix_ms: int = 0
    fetch_task: asyncio.Task | None = None
    slot_task: asyncio.Task | None = None
    stale: bool = False  # the store has another version: drop this one once nobody uses it

    @property
    def loading(self) -> bool:
        return self.fetch_task is not None or self.slot_task is not None

    @property
    def evictable_from_slot(self) -> bool:
        return not self.pinned and self.in_use == 0 and self.holds == 0 and self.slot_task is None


class SlotManager:
    def __init__(
        self,
        fetch_shard: FetchShard,
        copy_into_slot: Callable[[int, dict[str, torch.Tensor]], int | None],
        clear_slot: Callable[[int], None],
        *,
        max_loras: int,
        max_cpu_adapters: int | None = None,
        device: torch.device,
        cpu_cache_bytes: int | None = None,
        slot_wait_timeout_s: float = 30.0,
        max_concurrent_loads: int | None = None,
        observer: SlotObserver | None = None,
        queued_copy: Callable[[int, dict[str, torch.Tensor]], Callable[[], int | None] | None] | None = None,
    ):
        """queued_copy(slot, tensors), called with the copy stream current: where copying these into
        that slot only queues device work (CUDA; executor/lora.py `queued_load`), the copy begun, as
        a function that finishes it and returns what copy_into_slot would; else None, having queued
        nothing. Such copies run on the loop itself, the rest on the copy thread (copy_into_slot).
        Either raises ValueError for a shard the model refuses (INVALID_ARGUMENT to the caller)."""
        self._copy_into_slot = copy_into_slot
        self._queued_copy = queued_copy
        self._clear_slot = clear_slot
        self.max_loras = max_loras
        self._slot_queue: list[_Adapter] = []  # adapters waiting for a slot, first come first served
        self.device = torch.device(device)
        self.slot_wait_timeout_s = slot_wait_timeout_s
        self.observer = observer or SlotObserver()
        self._adapters: dict[str, _Adapter] = {}
        self._slots: list[_Adapter | None] = [None] * max_loras
        # Each slot's adapter rank as the LoRA kernels may read it (LoraMeta.slot_ranks): what the
        # copy function returns (executor/lora.py: the largest rank the shard holds), FULL_RANK when
        # it says nothing, 0 once cleared. Written when a load is issued, before any step uses the slot.
        self.slot_ranks: list[int] = [FULL_RANK] * max_loras
        self._clearing: set[int] = set()  # slots being zeroed after an evict
        self._ticks = itertools.count(1)
        self._changed = asyncio.Event()  # set (and replaced) whenever a slot may have become free
        self._tasks: set[asyncio.Task] = set()
        # Load tasks spawned that have not started yet: one of a cached adapter reaches its place in
        # the slot queue in its first step, so until then no acquire may take a slot on the spot
        # (`_load_now`) ahead of it
        self._unstarted: set[asyncio.Task] = set()
        self.cpu = CpuCache(fetch_shard, self.device, budget_bytes=cpu_cache_bytes, max_adapters=max_cpu_adapters,
                            max_concurrent_loads=max_concurrent_loads, spawn=self._spawn,
                            forget=self._forget_if_unused, notify=self._notify)
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # CUDA: a copy that only queues device work (`queued_copy`: pinned host memory, a layout
        # planned and its tables built before; ~0.5-0.8 ms of host time) is queued right here, on the loop (`_copy_in`):
        # with a copy thread, its hand-offs of the interpreter lock lengthened the steps' gaps while
        # cold loads ran (docs/BENCHMARKS.md, "Sixteenth pass"). Clears, a layout's first load (its
        # checks) and copies out of pageable memory (whose "async" copy waits for the bytes) run, in
        # turn, on one thread whose current stream is the copy stream, set once when it starts. On
        # the CPU: the loop's default executor (copies run side by side).
        self._copy_thread = None
        if self._copy_stream is not None:
            self._copy_thread = ThreadPoolExecutor(1, thread_name_prefix="slot-copy", initializer=_use_stream,
                                                   initargs=(self._copy_stream,))

    # ---- requests -------------------------------------------------------------------------

    def want(self, name: str) -> Callable[[], None]:
        """A request for `name` has arrived and will acquire it: fetch its CPU copy now, in the
        background (a failure here is not reported; the acquire fetches again and reports it),
        and keep it off slot eviction while other idle slots exist. Call the returned function
        once the request holds its lease or has ended."""
        a = self._record(name)
        a.wanted += 1
        if not a.stale:
            self.cpu.prefetch(a)
        done = False

        def unwant() -> None:
            nonlocal done
            if not done:
                done = True
                a.wanted -= 1
                self._forget_if_unused(a)

        return unwant

    async def acquire(self, name: str) -> SlotLease:
        """Puts the adapter in a slot (if it is not there) and counts one more running request on it."""
        a = self._record(name)
        a.holds += 1
        try:
            if a.stale:
                await self._switch_version(a)
            if a.slot >= 0 and a.slot_task is None:
                self.observer.slot_hit()
            else:
                self.observer.slot_miss()
            await self._ensure_slot(a)
            a.in_use += 1
        finally:
            a.holds -= 1
            self._forget_if_unused(a)
            self._notify()
        self._touch(a)
        return SlotLease(name=name, slot=a.slot, digest=a.slot_digest, ready=a.event)

    def release(self, lease: SlotLease) -> None:
        if lease.released:
            return
        lease.released = True
        a = self._adapters[lease.name]  # in_use > 0 kept the record and its slot
        a.in_use -= 1
        self._touch(a)
        if a.in_use == 0:
            self._notify()
            if a.stale and a.holds == 0:
                self._spawn(self._drop_version(a))

    # ---- admin ----------------------------------------------------------------------------

    async def load(self, name: str, into_slot: bool = True, pin: bool = False) -> AdapterState:
        a = self._record(name)
        a.holds += 1
        try:
            if a.stale:
                await self._switch_version(a)
            if into_slot or pin:
                await self._ensure_slot(a)
            else:
                await self.cpu.ensure(a)
            if pin:
                a.pinned = True
        finally:
            a.holds -= 1
            self._forget_if_unused(a)
            self._notify()
        self._touch(a)
        return self._state(a)

    async def pin(self, name: str) -> AdapterState:
        return await self.load(name, into_slot=True, pin=True)

    def unpin(self, name: str) -> AdapterState:
        a = self._known(name)
        a.pinned = False
        self._notify()
        return self._state(a)

    async def evict(self, name: str) -> AdapterState:
        """Drops the adapter from its slot and from the CPU cache."""
        a = self._known(name)
        if a.in_use:
            raise precondition(f"adapter {name!r} is in use by {a.in_use} running requests")
        if a.pinned:
            raise precondition(f"adapter {name!r} is pinned; unpin it first")
        if a.loading or a.holds:
            raise precondition(f"adapter {name!r} is loading; evict it once it is loaded")
        del self._adapters[name]
        self.cpu.drop(a)
        slot = await self._free_slot(a)
        log.info("evicted adapter %s (slot %d)", name, slot)
        return self._state(a)

    async def refresh(self, name: str, digest: str) -> bool:
        """The store now holds `digest` for `name` ("": the store no longer has it). A cached
        older version is dropped now if unused, else once its running requests finish (see
        the module's rules). Returns True when this executor held another version."""
        a = self._adapters.get(name)
        held = self._held_versions(a) if a is not None else set()
        if not held or held == {digest}:
            return False
        if not a.stale:
            log.info("adapter %s: the store has %s, this executor holds %s; switching once it is idle",
                     name, digest[:12] or "no version (deleted)", ", ".join(sorted(d[:12] for d in held)))
        a.stale = True
        if a.in_use == 0 and a.holds == 0 and not a.loading:
            await self._drop_version(a)
        return True

    def known_digests(self) -> dict[str, str]:
        """name -> digest of every adapter this executor holds in a slot (that version) or in the CPU cache."""
        out = {}
        for n, a in self._adapters.items():
            held = self._held_versions(a)
            if held:
                out[n] = a.slot_digest if a.slot >= 0 and a.slot_digest else a.digest
        return out

    @staticmethod
    def _held_versions(a: _Adapter) -> set[str]:
        """The digests the adapter's slot and host copy hold (a refetch may have left them apart)."""
        held = set()
        if a.tensors is not None and a.digest:
            held.add(a.digest)
        if a.slot >= 0 and a.slot_digest:
            held.add(a.slot_digest)
        return held

    def slot_version(self, slot: int) -> tuple[str, str]:
        """(adapter name, digest) of the version in `slot`, ("", "") if none: what the other
        tensor-parallel ranks load into their own slot (executor/ranks.py)."""
        a = self._slots[slot]
        return (a.name, a.slot_digest) if a is not None else ("", "")

    def states(self) -> list[AdapterState]:
        return [self._state(a) for _, a in sorted(self._adapters.items())]

    def state(self, name: str) -> AdapterState:
        return self._state(self._known(name))

    # ---- versions ---------------------------------------------------------------------------

    async def _switch_version(self, a: _Adapter) -> None:
        """Called by an acquire/load of a stale adapter (holding it): waits for the running
        requests on the old version to finish, then drops it so the caller loads the new one."""
        deadline = asyncio.get_running_loop().time() + self.slot_wait_timeout_s
        while a.stale and (a.in_use or a.loading):
            if not await self._wait_for_change(deadline):
                log.warning("adapter %s: still in use by %d requests after %gs; serving its old version %s meanwhile",
                            a.name, a.in_use, self.slot_wait_timeout_s, a.digest[:12])
                return
        if a.stale:
            await self._drop_version(a)

    async def _drop_version(self, a: _Adapter) -> None:
        """Forgets the adapter's cached version (host tensors and slot); keeps the record and its pin.

        A pinned adapter keeps its slot: the new version is fetched and copied over the old one
        in place, as the adapter's slot task, so its requests wait for that (the slot is never
        given to another adapter meanwhile) and a failed fetch leaves the old version serving.
        """
        if not a.stale or a.in_use or a.loading:
            return  # a concurrent switch did it already, or a request took it meanwhile
        old = a.slot_digest if a.slot >= 0 else a.digest
        self.cpu.drop(a)
        a.stale, a.digest, a.rank, a.nbytes = False, "", 0, 0
        if a.pinned and a.slot >= 0:
            a.slot_task = self._spawn(self._reload_in_place(a, old))
            return
        a.slot_digest = ""
        slot = await self._free_slot(a)
        log.info("adapter %s: dropped version %s (slot %d) for the store's new one", a.name, old[:12], slot)
        self._forget_if_unused(a)

    async def _reload_in_place(self, a: _Adapter, old: str) -> None:
        """The slot task of a pinned adapter whose version changed in the store."""
        try:
            digest, tensors = await self.cpu.ensure(a)
            a.event = await self._copy_in(a.slot, tensors)
            a.slot_digest = digest
            log.info("adapter %s (pinned): version %s replaced %s in slot %d", a.name, digest[:12], old[:12], a.slot)
        except Exception as exc:  # noqa: BLE001 - the slot still holds the old version, which serves on
            self.cpu.drop(a)
            a.digest = old  # the next refresh round sees the difference and tries again
            log.warning("adapter %s (pinned): loading its new version failed (%s); version %s keeps serving",
                        a.name, exc, old[:12])
        finally:
            a.slot_task = None
            self._notify()

    async def _free_slot(self, a: _Adapter) -> int:
        """Takes the adapter out of its slot and zeroes the slot; returns the slot (-1: had none).

        The slot stays out of reach (`_clearing`) until the zeroing has finished, even if the
        caller is cancelled meanwhile (a request's deadline): otherwise another adapter could be
        copied into it and then zeroed by the clear still running."""
        slot, a.slot, a.event = a.slot, -1, None
        if slot >= 0:
            self._slots[slot] = None
            self._clearing.add(slot)
            await asyncio.shield(self._spawn(self._clear_slot_task(slot)))
        return slot

    async def _clear_slot_task(self, slot: int) -> None:
        try:
            await self._on_copy_thread(self._clear, slot)
        finally:
            self._clearing.discard(slot)
            self._notify()

    # ---- tiers ----------------------------------------------------------------------------

    async def _ensure_slot(self, a: _Adapter) -> None:
        if a.slot < 0 and a.slot_task is None and self._load_now(a):
            return
        while a.slot < 0 or a.slot_task is not None:
            if a.slot_task is None:
                a.slot_task = task = self._spawn(self._load_slot(a))
                self._unstarted.add(task)
                task.add_done_callback(self._unstarted.discard)  # (also if cancelled before it starts)
            # Shielded: one waiter being cancelled must not cancel the load the others share.
            await asyncio.shield(a.slot_task)

    def _load_now(self, a: _Adapter) -> bool:
        """The common cold load, done on the spot with no task and no await (so none of the loop
        turns a task's start and its waiter's wake-up take): the adapter's host copy is in the CPU
        cache, a slot is free or idle with no adapter queued before this one, and the copy only
        queues device work (`queued_copy`). False, having changed nothing but the CPU cache's
        order, when any of that is not so, or while a load task that asked earlier has not started
        (it would have queued for a slot before this one): the caller takes the task path (`_load_slot`)."""
        if self._queued_copy is None or a.stale or self._unstarted or (held := self.cpu.cached(a)) is None:
            return False
        digest, tensors = held
        slot = self._pick_slot(a)
        if slot is None:
            return False
        t0 = time.perf_counter()
        with self._copy_stream_current():
            try:
                finish = self._queued_copy(slot, tensors)  # (its host -> device copy queued already)
            except BaseException as exc:
                self._copy_failed(a, None, exc)
            if finish is None:
                return False
            self._take_slot(a, slot)
            try:
                try:
                    a.event = self._copied(slot, finish())
                    a.slot_digest = digest
                except BaseException as exc:
                    self._copy_failed(a, slot, exc)
            finally:
                self._notify()
        self._loaded(a, slot, "cpu", t0, t0, t0)
        return True

    async def _load_slot(self, a: _Adapter) -> None:
        self._unstarted.discard(asyncio.current_task())  # a cached copy: in the slot queue within this step
        t0, tier = time.perf_counter(), "cpu" if a.tensors is not None else "store"
        try:
            digest, tensors = await self.cpu.ensure(a)
            t_fetched = time.perf_counter()
            if not waited_on(a):  # every request for it ended during the fetch: keep the copy, take no slot
                log.info("adapter %s: fetched for requests that have ended; kept in the CPU cache, no slot taken", a.name)
                return
            slot = await self._claim_slot(a)
            t_slot = time.perf_counter()
            try:
                a.event = await self._copy_in(slot, tensors)
                a.slot_digest = digest
            except BaseException as exc:
                self._copy_failed(a, slot, exc)
            self._loaded(a, slot, tier, t0, t_fetched, t_slot)
        finally:
            a.slot_task = None
            self._forget_if_unused(a)
            self._notify()

    def _copy_failed(self, a: _Adapter, slot: int | None, exc: BaseException) -> None:
        """A copy into a just-claimed slot (None: before one was taken) failed: the slot is freed, a
        shard the model refuses (ValueError) is dropped from the CPU cache and reported as
        INVALID_ARGUMENT; raises."""
        if slot is not None:
            self._slots[slot], a.slot = None, -1
        if isinstance(exc, ValueError):  # the model refused the shard's shapes or dtypes
            self.cpu.drop(a)  # a shard that cannot be used is not worth caching
            raise invalid(f"adapter {a.name!r} does not fit this executor's LoRA slots: {exc}") from exc
        raise exc

    def _loaded(self, a: _Adapter, slot: int, tier: str, t0: float, t_fetched: float, t_slot: float) -> None:
        log.info("adapter %s (digest %s, rank %d) -> slot %d", a.name, a.digest[:12], a.rank, slot)
        t_end = time.perf_counter()
        self.observer.adapter_loaded(tier, t_end - t0)
        self.observer.load_phases(t_fetched - t0, t_slot - t_fetched, t_end - t_slot)

    async def _claim_slot(self, a: _Adapter) -> int:
        """Takes a free slot or evicts an idle one (`_pick_slot`); waits, in turn, if all are busy."""
        deadline = asyncio.get_running_loop().time() + self.slot_wait_timeout_s
        self._slot_queue.append(a)
        try:
            while (slot := self._pick_slot(a)) is None:
                n = self.max_loras
                if n == 0:
                    raise precondition("this executor has no LoRA slots (max_loras = 0)")
                if all(s is not None and s.pinned for s in self._slots):
                    raise exhausted(f"all {n} slots are pinned; unpin an adapter to load {a.name!r}")
                if not await self._wait_for_change(deadline):
                    raise exhausted(
                        f"no free slot for adapter {a.name!r}: all {n} slots are pinned or in use by "
                        f"running requests (waited {self.slot_wait_timeout_s:g}s)"
                    )
        finally:
            self._slot_queue.remove(a)
            self._notify()  # the next waiter's turn
        self._take_slot(a, slot)
        return slot

    def _take_slot(self, a: _Adapter, slot: int) -> None:
        """a takes the slot `_pick_slot` chose, evicting the idle adapter in it."""
        old = self._slots[slot]
        if old is not None:
            log.info("slot %d: evicting adapter %s (idle%s) for %s", slot, old.name,
                     ", wanted by a queued request" if old.wanted else "", a.name)
            self.observer.slot_eviction()
            old.slot, old.event = -1, None
            self._forget_if_unused(old)
        self._slots[slot], a.slot = a, slot

    async def _wait_for_change(self, deadline: float) -> bool:
        """Waits until slots or loads may have changed (`_notify`), or until the loop time
        `deadline`; False, without waiting, once the deadline has passed."""
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            return False
        # asyncio.wait, not wait_for: before Python 3.12 a wait_for whose inner wait completes as
        # the caller is cancelled (a request's deadline) can swallow that cancellation, and the
        # cancelled request would go on waiting for a slot.
        waiter = asyncio.ensure_future(self._changed.wait())
        try:
            await asyncio.wait({waiter}, timeout=remaining)
        finally:
            waiter.cancel()
        return True

    def _pick_slot(self, a: _Adapter) -> int | None:
        """For the first adapter waiting (FIFO: later ones wait their turn): a free slot, else an
        idle one, preferring adapters no queued request wants, then the least recently used."""
        if self._slot_queue and self._slot_queue[0] is not a:
            return None
        idle = []
        for i, s in enumerate(self._slots):
            if i in self._clearing:
                continue
            if s is None:
                return i
            if s.evictable_from_slot:
                idle.append((s.wanted > 0, s.lru_tick, i))
        return min(idle)[2] if idle else None

    @property
    def copy_stream(self) -> torch.cuda.Stream | None:
        """The stream slot copies run on (CUDA), None on the CPU."""
        return self._copy_stream

    async def _copy_in(self, slot: int, tensors: dict[str, torch.Tensor]) -> torch.cuda.Event | None:
        """Copies the shard into the slot: from the loop itself when that only queues device work
        (`queued_copy`), else on the copy thread; returns the copy's event (None on the CPU)."""
        if self._queued_copy is not None:
            with self._copy_stream_current():
                finish = self._queued_copy(slot, tensors)
                if finish is not None:
                    return self._copied(slot, finish())
        return await self._on_copy_thread(self._copy, slot, tensors)

    @contextlib.contextmanager
    def _copy_stream_current(self):
        """On CUDA, the copy stream current on this thread (the loop's) inside, and after it the
        thread's current device and each device's current stream as they were; nothing on the CPU."""
        if self._copy_stream is None:
            yield
            return
        # This switch is on a cold load's path before its host -> device copy is queued: streams are
        # looked up by device index (a torch.device without one takes a slower lookup), and the
        # loop's device is set back only where it is not the copy stream's. Each device has its own
        # current stream: what is put back is the copy stream's device's, whatever device is current.
        device, copy_device = torch.cuda.current_device(), self._copy_stream.device_index
        main = torch.cuda.current_stream(copy_device)
        torch.cuda.set_stream(self._copy_stream)  # (and its device)
        try:
            yield
        finally:
            torch.cuda.set_stream(main)  # (and its device: the copy stream's)
            if device != copy_device:
                torch.cuda.set_device(device)

    async def _on_copy_thread(self, fn: Callable, *args):
        """fn(*args) where slot copies run (see __init__). If the caller is cancelled meanwhile, the
        call still runs to its end (a thread cannot be stopped): the caller's cancellation is
        raised only after it, so whatever the caller then frees (a slot) is no longer being written."""
        future = asyncio.get_running_loop().run_in_executor(self._copy_thread, fn, *args)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            await outlast_cancellation(future)
            raise

    def close(self) -> None:
        """Lets the copy thread end once its queued work is done (the executor's shutdown)."""
        if self._copy_thread is not None:
            self._copy_thread.shutdown(wait=False)

    def _copy(self, slot: int, tensors: dict[str, torch.Tensor]) -> torch.cuda.Event | None:
        """Copies the shard into the slot, on CUDA with the copy stream current (the copy thread's)."""
        return self._copied(slot, self._copy_into_slot(slot, tensors))

    def _copied(self, slot: int, rank: int | None) -> torch.cuda.Event | None:
        """After a copy into the slot was queued: the slot's rank as its copy function returned it,
        and on CUDA an event recorded after the copy, on the copy stream (current here)."""
        event = None
        if self._copy_stream is not None:
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        self.slot_ranks[slot] = rank if isinstance(rank, int) else FULL_RANK
        return event

    def _clear(self, slot: int) -> None:
        self.slot_ranks[slot] = 0
        self._clear_slot(slot)

    def cpu_cache_state(self) -> tuple[int, int]:
        """(adapters, bytes) held in the CPU cache."""
        return self.cpu.state()

    @property
    def cpu_cache_bytes(self) -> int | None:
        return self.cpu.budget_bytes

    @cpu_cache_bytes.setter
    def cpu_cache_bytes(self, value: int | None) -> None:
        self.cpu.budget_bytes = value

    # ---- bookkeeping ----------------------------------------------------------------------

    def _record(self, name: str) -> _Adapter:
        if name not in self._adapters:
            self._adapters[name] = _Adapter(name=name)
        return self._adapters[name]

    def _known(self, name: str) -> _Adapter:
        a = self._adapters.get(name)
        if a is None:
            raise not_found(f"adapter {name!r} is not loaded on this executor")
        return a

    def _forget_if_unused(self, a: _Adapter) -> None:
        """Drops the record of an adapter that is in no tier and that nobody waits on."""
        idle = (a.slot < 0 and a.tensors is None and not a.loading and a.holds == 0 and a.in_use == 0
                and a.wanted == 0)
        if idle and not a.pinned and self._adapters.get(a.name) is a:
            del self._adapters[a.name]

    def _touch(self, a: _Adapter) -> None:
        a.lru_tick = next(self._ticks)
        a.last_used_unix_ms = int(time.time() * 1000)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)  # a reference, so the task is not garbage-collected mid-flight
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # mark errors as seen
        return task

    def _state(self, a: _Adapter) -> AdapterState:
        return AdapterState(
            name=a.name,
            digest=a.digest,
            rank=a.rank,
            slot=a.slot,
            pinned=a.pinned,
            in_use=a.in_use,
            in_cpu_cache=a.tensors is not None,
            last_used_unix_ms=a.last_used_unix_ms,
            bytes=a.nbytes,
            loading=a.loading,
        )
