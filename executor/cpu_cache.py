"""The CPU cache: adapters' packed shards in host memory (pinned on CUDA), fetched from the store.

    store (gRPC) --fetch, at most `max_concurrent_loads` at once--> CPU cache --> GPU slots (slots.py)

Rules this module guarantees (the slot manager, which owns the adapter records, relies on them):
- Concurrent `ensure`s of one adapter share one fetch.
- At most `max_concurrent_loads` store fetches run at once, started in the order they were asked
  for; a fetch nobody waits on any more by its turn (its request ended) is not started, and one the
  store refuses as busy stops asking once nobody waits on it (the store client's STILL_WANTED). An
  adapter already held here never waits for a seat: a hot adapter's request is not queued behind
  cold loads.
- A failed fetch leaves nothing behind (the caller's waiters get the error; the next call retries).
- The cache is bounded in bytes (and optionally in adapters); over budget it drops first the copies
  no request waits on, least recently used first, never the one just fetched.
- One host copy per load: a shard lands where the store client streamed it (pinned on CUDA); only
  tensors that arrive unpinned are copied into pinned memory, so the slot copy is a true async DMA.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import grpc
import torch

from loraserve.errors import StatusError

from .lora import shard_signature
from .shard_tensors import ShardTensors
from .store_client import STILL_WANTED, pinned_blob

if TYPE_CHECKING:
    from .slots import _Adapter

log = logging.getLogger(__name__)

# fetch_shard(name) -> (digest, rank, tensors, nbytes); raises StatusError.
FetchShard = Callable[[str], Awaitable[tuple[str, int, dict[str, torch.Tensor], int]]]


class CpuCache:
    """Fills and drops the `tensors` of the slot manager's adapter records. `spawn` starts a task the
    manager keeps a reference to; `forget(a)` drops a record nobody needs any more; `notify()` wakes
    whoever waits for loads to end."""

    def __init__(self, fetch_shard: FetchShard, device: torch.device, *, budget_bytes: int | None,
                 max_adapters: int | None, max_concurrent_loads: int | None, spawn: Callable[..., asyncio.Task],
                 forget: Callable[[_Adapter], None], notify: Callable[[], None]):
        self._fetch_shard = fetch_shard
        self.device = device
        self.budget_bytes = budget_bytes  # None: no byte limit
        self.max_adapters = max_adapters  # None: no count limit
        self.nbytes = 0  # shard bytes of the host copies held
        self._lru: OrderedDict[str, _Adapter] = OrderedDict()  # adapters with host tensors, oldest first
        # Store fetches in flight at once (None: no limit). Many cold loads at once share the host's
        # cores and memory bandwidth, so each ends later; in turn, the first asked land first.
        self._seats = asyncio.Semaphore(max_concurrent_loads) if max_concurrent_loads else None
        self._spawn, self._forget, self._notify = spawn, forget, notify

    def state(self) -> tuple[int, int]:
        """(adapters, bytes) held."""
        return len(self._lru), self.nbytes

    def prefetch(self, a: _Adapter) -> None:
        """Starts fetching the adapter's host copy in the background, if it has none and none is
        coming (a failure here is not reported: the next `ensure` fetches again and reports it)."""
        if a.tensors is None and a.fetch_task is None:
            self._spawn(self._prefetch(a))

    async def _prefetch(self, a: _Adapter) -> None:
        try:
            await self.ensure(a)
        except Exception:  # noqa: BLE001 - logged by _fetch; the request's acquire fetches again
            pass

    def cached(self, a: _Adapter) -> tuple[str, dict[str, torch.Tensor]] | None:
        """(digest, tensors) of the adapter's host copy if it is here (marked used), else None."""
        if a.tensors is None:
            return None
        self._lru.move_to_end(a.name)
        return a.digest, a.tensors

    async def ensure(self, a: _Adapter) -> tuple[str, dict[str, torch.Tensor]]:
        """(digest, tensors) of the adapter's host copy, fetching it if needed."""
        if (held := self.cached(a)) is not None:
            return held
        if a.fetch_task is None:
            a.fetch_task = self._spawn(self._fetch(a))
        return await asyncio.shield(a.fetch_task)

    async def _fetch(self, a: _Adapter) -> tuple[str, dict[str, torch.Tensor]]:
        wanted = STILL_WANTED.set(lambda: waited_on(a))  # a busy store is asked again only while so
        try:
            if self._seats is None:
                digest, rank, tensors, nbytes = await self._fetch_shard(a.name)
            else:
                async with self._seats:
                    if not waited_on(a):  # its requests ended while it waited for a seat
                        raise StatusError(grpc.StatusCode.CANCELLED,
                                          f"adapter {a.name!r}: no request waits for it any more; not fetched")
                    digest, rank, tensors, nbytes = await self._fetch_shard(a.name)
            # Pinned host memory makes the slot copy a true async DMA. The store client's shards
            # land pinned already (one copy per load: the stream's); others are copied here into
            # one pinned buffer, so a slot load moves them with one host->device copy too. And the
            # shard's signature is worked out now, off the serving loop, not in every slot load.
            tensors = await asyncio.to_thread(_landed, tensors, self.device.type == "cuda")
            a.digest, a.rank, a.nbytes, a.tensors = digest, rank, nbytes, tensors
            self._lru[a.name] = a
            self.nbytes += nbytes
            self._shrink(keep=a.name)
            return digest, tensors
        except Exception as exc:
            log.info("fetching adapter %s failed: %s", a.name, exc)
            raise
        finally:
            STILL_WANTED.reset(wanted)
            a.fetch_task = None
            self._forget(a)
            self._notify()  # a version switch may be waiting for this load to end

    def drop(self, a: _Adapter) -> None:
        """Forgets the adapter's host copy (its record stays)."""
        if a.tensors is not None:
            self.nbytes -= a.nbytes
        a.tensors = None
        self._lru.pop(a.name, None)

    def _shrink(self, keep: str) -> None:
        """Drops host copies while over the byte (or adapter) budget: first those no request
        waits on, least recently used first, then the others; never `keep`, just fetched."""
        def over() -> bool:
            return ((self.budget_bytes is not None and self.nbytes > self.budget_bytes)
                    or (self.max_adapters is not None and len(self._lru) > self.max_adapters))

        if not over():
            return
        for a in sorted(self._lru.values(), key=waited_on):  # stable: LRU within
            if not over():
                break
            if a.name == keep:
                continue
            self.drop(a)
            self._forget(a)


def waited_on(a: _Adapter) -> bool:
    """Someone waits for this adapter's copy: a queued request (`wanted`), an acquire or admin load
    in flight (`holds`), or its pin (a pinned adapter's slot is reloaded when its version changes).
    A slot load alone is not a reason: it goes on after every request that started it has ended."""
    return a.wanted > 0 or a.holds > 0 or a.pinned


def _all_pinned(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether every tensor is in pinned memory, asked once per storage they live in (a landed
    shard's views share one): each ask gives the interpreter lock back and waits to retake it behind
    the serving loop (engine/gil_handoff.py), ~450 waits for a Llama-3-8B shard asked per tensor."""
    one_per_storage = {t.untyped_storage().data_ptr(): t for t in tensors.values()}
    return all(t.is_pinned() for t in one_per_storage.values())


def _landed(tensors: dict[str, torch.Tensor], cuda: bool) -> dict[str, torch.Tensor]:
    """A fetched shard as the CPU cache keeps it: on CUDA in pinned memory (copied into one pinned
    buffer unless every tensor is pinned already), its signature and pinnedness kept on it. In a
    thread: asking the driver whether memory is pinned waits while another thread page-locks."""
    if cuda and not _all_pinned(tensors):
        tensors = pinned_blob(tensors)
    if isinstance(tensors, ShardTensors):
        shard_signature(tensors)
        tensors.pinned = cuda
    return tensors
