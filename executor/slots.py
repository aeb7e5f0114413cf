"""The slot manager: which adapter sits in which GPU slot, and getting it there.

Adapters live in three tiers, each calling only the one below:

    GPU slot (this module: `max_loras` slots, the coldest idle one evicted, pins, in-use counts, versions)
      -> CPU cache (executor/cpu_cache.py: packed shards in host memory, pinned on CUDA, bounded in
         bytes; at most `max_concurrent_loads` fetches at once)
      -> store client (executor/store_client.py)

Rules this module guarantees:
- A slot is never overwritten while a running request uses it (`in_use`), while an
  acquire or load of its adapter is still in flight (`holds`), or while it is pinned.
- Concurrent acquires of one adapter share one fetch (cpu_cache.py) and one copy.
- When no slot can be freed, a request waits up to `slot_wait_timeout_s` for one; if every
  slot is pinned it fails at once. Both fail with RESOURCE_EXHAUSTED. Waiters get slots in the
  order they started waiting: an adapter never waits behind one that asked after it.
- A request announces its adapter as soon as it arrives (`want`): the adapter's CPU copy is
  fetched from then on (prefetch), and slot eviction picks an idle adapter that no queued
  request wants before one that some request does, then the coldest: the lowest count of
  references (acquires and admin loads), each halved every 16 x max_loras references since
  (executor/eviction.py). So a hot adapter keeps its slot through a burst of one-off adapters.
  The CPU cache drops copies by the same rule, asking this module for each adapter's heat; its
  own rules (bounded bytes, fetch seats in turn) are in cpu_cache.py; an adapter in a slot or in
  the CPU cache never waits for a fetch seat. An adapter's count lives on its record, so it is
  lost once the adapter is in no tier.
- A failed fetch leaves nothing behind; every waiter gets the error; the next acquire retries.
- Adapters already in a slot or in the CPU cache keep serving when the store is down.
- Loading never blocks the forward passes of other adapters (executor/slot_copies.py): the
  lease carries the copy's event.
- A new version in the store (`refresh`: the adapter was registered again, or deleted) drops
  the cached one as soon as no running request uses it; requests that arrive meanwhile wait
  for that (up to `slot_wait_timeout_s`, then they are served the old version) and get the
  new one. A pinned adapter is reloaded at once, in place: it keeps its slot and its pin, and
  its old version serves on if the new one cannot be fetched.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from loraserve.errors import exhausted, invalid, not_found, precondition

from .cpu_cache import CpuCache, FetchShard, HostCopy
from .eviction import COLD, HALF_LIFE_PER_SLOT, bumped, coldest
from .slot_copies import CopyIntoSlot, QueuedCopy, SlotCopier
from .slot_reports import AdapterState, Residency, SlotObserver

log = logging.getLogger(__name__)


def _untraced(step: str) -> None:
    pass


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


NO_VERSION = ("", 0, 0)


@dataclass(eq=False)
class _Adapter:
    name: str
    host: HostCopy  # the CPU cache's record: the version last fetched and its host copy
    slot: int = -1
    # the version in the slot: (digest, LoRA rank, shard bytes), one tuple assigned whole so a reader on
    # another thread (/metrics) sees one version; ("", 0, 0): none (a later refetch may bring a newer one)
    in_slot: tuple[str, int, int] = NO_VERSION
    event: torch.cuda.Event | None = None
    pinned: bool = False
    wanted: int = 0  # requests queued for it that hold no lease yet (`want`)
    in_use: int = 0  # leases held by running requests
    holds: int = 0  # acquire/load calls in flight: keep the adapter in place meanwhile
    heat: float = COLD  # its decayed count of references (executor/eviction.py)
    last_used_unix_ms: int = 0
    slot_task: asyncio.Task | None = None
    stale: bool = False  # the store has another version: drop this one once nobody uses it

    @property
    def loading(self) -> bool:
        return self.host.fetch_task is not None or self.slot_task is not None

    @property
    def evictable_from_slot(self) -> bool:
        return not self.pinned and self.in_use == 0 and self.holds == 0 and self.slot_task is None

    @property
    def waited_on(self) -> bool:
        """Someone waits for this adapter's copy: a queued request (`wanted`), an acquire or admin
        load in flight (`holds`), or its pin (a pinned adapter's slot is reloaded when its version
        changes). A slot load alone is not a reason: it goes on after every request that started it
        has ended."""
        return self.wanted > 0 or self.holds > 0 or self.pinned


class SlotManager:
    def __init__(
        self,
        fetch_shard: FetchShard,
        copy_into_slot: CopyIntoSlot,
        clear_slot: Callable[[int], None],
        *,
        max_loras: int,
        max_cpu_adapters: int | None = None,
        device: torch.device,
        cpu_cache_bytes: int | None = None,
        slot_wait_timeout_s: float = 30.0,
        max_concurrent_loads: int | None = None,
        observer: SlotObserver | None = None,
        queued_copy: QueuedCopy | None = None,
        trace: Callable[[str], None] | None = None,
    ):
        """copy_into_slot, clear_slot, queued_copy: how shards reach the slots (executor/slot_copies.py).
        trace(step), where given, is told as a load passes each step, for a timeline of its parts
        (the fast path's claim, the copy): on the spot (`_load_now`) "fast path", "cpu cache" (its host
        copy looked up), "slot picked", "copy stream" (about to switch to it) and "slot taken" (the
        copy queued: the load is done on the spot); for every copy "copied" (its event recorded)."""
        self.max_loras = max_loras
        self._slot_queue: list[_Adapter] = []  # adapters waiting for a slot, first come first served
        self.device = torch.device(device)
        self.slot_wait_timeout_s = slot_wait_timeout_s
        self.observer = observer or SlotObserver()
        self._trace = trace or _untraced
        self._adapters: dict[str, _Adapter] = {}
        self._slots: list[_Adapter | None] = [None] * max_loras
        self._clearing: set[int] = set()  # slots being zeroed after an evict
        self._references = itertools.count(1)  # the eviction clock: acquires and admin loads
        self._half_life = HALF_LIFE_PER_SLOT * max(1, max_loras)  # in references
        self._changed = asyncio.Event()  # set (and replaced) whenever a slot may have become free
        self._tasks: set[asyncio.Task] = set()
        # Load tasks spawned that have not started yet: one of a cached adapter reaches its place in
        # the slot queue in its first step, so until then no acquire may take a slot on the spot
        # (`_load_now`) ahead of it
        self._unstarted: set[asyncio.Task] = set()
        self.cpu = CpuCache(
            fetch_shard,
            self.device,
            budget_bytes=cpu_cache_bytes,
            max_adapters=max_cpu_adapters,
            max_concurrent_loads=max_concurrent_loads,
            waited_on=self._host_waited_on,
            heat=self._host_heat,
            released=self._host_released,
        )
        self.copier = SlotCopier(
            copy_into_slot, clear_slot, max_loras=max_loras, device=self.device, queued_copy=queued_copy, trace=self._trace
        )
        # Each slot's adapter rank as the LoRA kernels may read it (LoraMeta.slot_ranks; the copier keeps it)
        self.slot_ranks: list[int] = self.copier.slot_ranks

    @property
    def copy_stream(self) -> torch.cuda.Stream | None:
        """The stream slot copies run on (CUDA), None on the CPU."""
        return self.copier.stream

    def close(self) -> None:
        """Lets the copy thread end once its queued work is done (the executor's shutdown)."""
        self.copier.close()

    # ---- requests -------------------------------------------------------------------------

    def want(self, name: str) -> Callable[[], None]:
        """A request for `name` has arrived and will acquire it: fetch its CPU copy now, in the
        background (a failure here is not reported; the acquire fetches again and reports it),
        and keep it off slot eviction while other idle slots exist. Call the returned function
        once the request holds its lease or has ended."""
        a = self._record(name)
        a.wanted += 1
        if not a.stale:
            self.cpu.prefetch(a.host)
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
        return SlotLease(name=name, slot=a.slot, digest=a.in_slot[0], ready=a.event)

    def release(self, lease: SlotLease) -> None:
        if lease.released:
            return
        lease.released = True
        a = self._adapters[lease.name]  # in_use > 0 kept the record and its slot
        a.in_use -= 1
        a.last_used_unix_ms = int(time.time() * 1000)
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
                await self.cpu.ensure(a.host)
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
        self.cpu.drop(a.host)
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
            log.info(
                "adapter %s: the store has %s, this executor holds %s; switching once it is idle",
                name,
                digest[:12] or "no version (deleted)",
                ", ".join(sorted(d[:12] for d in held)),
            )
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
                out[n] = self._version(a, a.slot)[0]
        return out

    @staticmethod
    def _held_versions(a: _Adapter) -> set[str]:
        """The digests the adapter's slot and host copy hold (a refetch may have left them apart)."""
        held = set()
        if a.host.tensors is not None and a.host.digest:
            held.add(a.host.digest)
        if a.slot >= 0 and a.in_slot[0]:
            held.add(a.in_slot[0])
        return held

    def slot_version(self, slot: int) -> tuple[str, str]:
        """(adapter name, digest) of the version in `slot`, ("", "") if none: what the other
        tensor-parallel ranks load into their own slot (executor/ranks.py)."""
        a = self._slots[slot]
        return (a.name, a.in_slot[0]) if a is not None else ("", "")

    def states(self) -> list[AdapterState]:
        return [self._state(a) for _, a in sorted(self._adapters.items())]

    def state(self, name: str) -> AdapterState:
        return self._state(self._known(name))

    def residency(self) -> list[Residency]:
        """Every adapter this executor knows and where it is: a snapshot another thread may take
        (/metrics; the record dict is copied first, each field read once)."""
        out = []
        for a in list(self._adapters.values()):
            slot = a.slot
            ready = slot >= 0 and a.slot_task is None
            tier = "gpu" if ready else "cpu" if a.host.tensors is not None else "store"
            rank = self._version(a, slot)[1]
            out.append(Residency(a.name, tier, a.pinned, rank, (a.wanted > 0 or a.holds > 0) and not ready))
        return out

    def cpu_cache_state(self) -> tuple[int, int]:
        """(adapters, bytes) held in the CPU cache."""
        return self.cpu.state()

    # ---- versions ---------------------------------------------------------------------------

    async def _switch_version(self, a: _Adapter) -> None:
        """Called by an acquire/load of a stale adapter (holding it): waits for the running
        requests on the old version to finish, then drops it so the caller loads the new one."""
        deadline = asyncio.get_running_loop().time() + self.slot_wait_timeout_s
        while a.stale and (a.in_use or a.loading):
            if not await self._wait_for_change(deadline):
                log.warning(
                    "adapter %s: still in use by %d requests after %gs; serving its old version %s meanwhile",
                    a.name,
                    a.in_use,
                    self.slot_wait_timeout_s,
                    a.host.digest[:12],
                )
                return
        if a.stale:
            await self._drop_version(a)

    async def _drop_version(self, a: _Adapter) -> None:
        """Forgets the adapter's cached version (host copy and slot); keeps the record and its pin.

        A pinned adapter keeps its slot: the new version is fetched and copied over the old one
        in place, as the adapter's slot task, so its requests wait for that (the slot is never
        given to another adapter meanwhile) and a failed fetch leaves the old version serving.
        """
        if not a.stale or a.in_use or a.loading:
            return  # a concurrent switch did it already, or a request took it meanwhile
        old = a.in_slot[0] if a.slot >= 0 else a.host.digest
        self.cpu.forget(a.host)
        a.stale = False
        if a.pinned and a.slot >= 0:
            a.slot_task = self._spawn(self._reload_in_place(a, old))
            return
        slot = await self._free_slot(a)
        log.info("adapter %s: dropped version %s (slot %d) for the store's new one", a.name, old[:12], slot)
        self._forget_if_unused(a)

    async def _reload_in_place(self, a: _Adapter, old: str) -> None:
        """The slot task of a pinned adapter whose version changed in the store."""
        try:
            digest, tensors = await self.cpu.ensure(a.host)
            rank, nbytes = a.host.rank, a.host.nbytes
            a.event = await self.copier.copy_in(a.slot, tensors)
            a.in_slot = (digest, rank, nbytes)
            log.info("adapter %s (pinned): version %s replaced %s in slot %d", a.name, digest[:12], old[:12], a.slot)
        except Exception as exc:
            self.cpu.forget(a.host, digest=old)  # the next refresh round sees the difference and tries again
            log.warning(
                "adapter %s (pinned): loading its new version failed (%s); version %s keeps serving", a.name, exc, old[:12]
            )
        finally:
            a.slot_task = None
            self._notify()

    async def _free_slot(self, a: _Adapter) -> int:
        """Takes the adapter out of its slot and zeroes the slot; returns the slot (-1: had none).

        The slot stays out of reach (`_clearing`) until the zeroing has finished, even if the
        caller is cancelled meanwhile (a request's deadline): otherwise another adapter could be
        copied into it and then zeroed by the clear still running."""
        slot, a.slot, a.event, a.in_slot = a.slot, -1, None, NO_VERSION
        if slot >= 0:
            self._slots[slot] = None
            self._clearing.add(slot)
            await asyncio.shield(self._spawn(self._clear_slot_task(slot)))
        return slot

    async def _clear_slot_task(self, slot: int) -> None:
        try:
            await self.copier.clear(slot)
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
        copier, trace = self.copier, self._trace
        if copier.queued_copy is None or a.stale or self._unstarted:
            return False
        trace("fast path")
        held = self.cpu.cached(a.host)
        trace("cpu cache")
        if held is None:
            return False
        digest, tensors = held
        slot = self._pick_slot(a)
        trace("slot picked")
        if slot is None:
            return False
        t0 = time.perf_counter()
        trace("copy stream")
        with copier.stream_current():
            try:
                finish = copier.queued_copy(slot, tensors)  # (its host -> device copy queued already)
            except BaseException as exc:
                self._copy_failed(a, None, exc)
            if finish is None:
                return False
            self._take_slot(a, slot)
            trace("slot taken")
            try:
                try:
                    a.event = copier.copied(slot, finish())
                    a.in_slot = (digest, a.host.rank, a.host.nbytes)
                except BaseException as exc:
                    self._copy_failed(a, slot, exc)
            finally:
                self._notify()
        self._loaded(a, slot, "cpu", t0, t0, t0)
        return True

    async def _load_slot(self, a: _Adapter) -> None:
        self._unstarted.discard(asyncio.current_task())  # a cached copy: in the slot queue within this step
        t0, tier = time.perf_counter(), "cpu" if a.host.tensors is not None else "store"
        try:
            digest, tensors = await self.cpu.ensure(a.host)
            rank, nbytes = a.host.rank, a.host.nbytes
            t_fetched = time.perf_counter()
            if not a.waited_on:  # every request for it ended during the fetch: keep the copy, take no slot
                log.info("adapter %s: fetched for requests that have ended; kept in the CPU cache, no slot taken", a.name)
                return
            slot = await self._claim_slot(a)
            t_slot = time.perf_counter()
            try:
                a.event = await self.copier.copy_in(slot, tensors)
                a.in_slot = (digest, rank, nbytes)
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
            self.cpu.drop(a.host)  # a shard that cannot be used is not worth caching
            raise invalid(f"adapter {a.name!r} does not fit this executor's LoRA slots: {exc}") from exc
        raise exc

    def _loaded(self, a: _Adapter, slot: int, tier: str, t0: float, t_fetched: float, t_slot: float) -> None:
        log.info("adapter %s (digest %s, rank %d) -> slot %d", a.name, a.host.digest[:12], a.host.rank, slot)
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
            log.info(
                "slot %d: evicting adapter %s (idle%s) for %s",
                slot,
                old.name,
                ", wanted by a queued request" if old.wanted else "",
                a.name,
            )
            self.observer.slot_eviction(old.name)
            old.slot, old.event, old.in_slot = -1, None, NO_VERSION
            self._forget_if_unused(old)
        a.in_slot = NO_VERSION  # until its copy is done: the slot holds no version of it yet
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
        """For the first adapter waiting (FIFO: later ones wait their turn): a free slot, else the
        idle one to evict by executor/eviction.py's rule (not wanted by a queued request first, then
        the coldest); None when every slot is pinned, in use, loading or being cleared."""
        if self._slot_queue and self._slot_queue[0] is not a:
            return None
        idle = []
        for i, s in enumerate(self._slots):
            if i in self._clearing:
                continue
            if s is None:
                return i
            if s.evictable_from_slot:
                idle.append((i, s.wanted > 0, s.heat))
        return coldest(idle)

    # ---- bookkeeping ----------------------------------------------------------------------

    def _record(self, name: str) -> _Adapter:
        if name not in self._adapters:
            self._adapters[name] = _Adapter(name=name, host=HostCopy(name))
        return self._adapters[name]

    def _known(self, name: str) -> _Adapter:
        a = self._adapters.get(name)
        if a is None:
            raise not_found(f"adapter {name!r} is not loaded on this executor")
        return a

    def _host_waited_on(self, host: HostCopy) -> bool:
        """The CPU cache's question: does anyone wait for this host copy's adapter?"""
        a = self._adapters.get(host.name)
        return a is not None and a.host is host and a.waited_on

    def _host_heat(self, host: HostCopy) -> float:
        """The CPU cache's question: how hot is this host copy's adapter (executor/eviction.py)?"""
        a = self._adapters.get(host.name)
        return a.heat if a is not None and a.host is host else COLD

    def _host_released(self, host: HostCopy) -> None:
        """The CPU cache's report: the adapter's fetch has ended or its host copy was dropped."""
        a = self._adapters.get(host.name)
        if a is not None and a.host is host:
            self._forget_if_unused(a)
        self._notify()  # a version switch may be waiting for this load to end

    def _forget_if_unused(self, a: _Adapter) -> None:
        """Drops the record of an adapter that is in no tier and that nobody waits on."""
        idle = a.slot < 0 and a.host.tensors is None and not a.loading and a.holds == 0 and a.in_use == 0 and a.wanted == 0
        if idle and not a.pinned and self._adapters.get(a.name) is a:
            del self._adapters[a.name]

    def _touch(self, a: _Adapter) -> None:
        """One reference to the adapter (an acquire or an admin load): its heat goes up by one."""
        a.heat = bumped(a.heat, next(self._references), self._half_life)
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

    @staticmethod
    def _version(a: _Adapter, slot: int) -> tuple[str, int, int]:
        """(digest, rank, shard bytes) of the version a serves, given a.slot as read once (`slot`): its
        slot's where it is in one (also while a pinned adapter's new version is fetched, or after that
        failed), else its host copy's."""
        in_slot = a.in_slot
        if slot >= 0 and in_slot[0]:
            return in_slot
        return a.host.digest, a.host.rank, a.host.nbytes

    def _state(self, a: _Adapter) -> AdapterState:
        digest, rank, nbytes = self._version(a, a.slot)
        return AdapterState(
            name=a.name,
            digest=digest,
            rank=rank,
            slot=a.slot,
            pinned=a.pinned,
            in_use=a.in_use,
            in_cpu_cache=a.host.tensors is not None and a.host.digest == digest,  # the version reported
            last_used_unix_ms=a.last_used_unix_ms,
            bytes=nbytes,
            loading=a.loading,
        )
