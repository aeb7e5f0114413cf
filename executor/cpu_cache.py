"""The CPU cache: adapters' packed shards in host memory (pinned on CUDA), fetched from the store.

    store client --fetch, at most `max_concurrent_loads` at once--> CPU cache --> GPU slots (slots.py)

Each adapter's entry is a `HostCopy` record: the version last fetched and its host tensors. Its
holder (the slot manager) makes it and passes it to every call; only this module writes it, and it
knows nothing of slots. What it needs from above it asks through callbacks given at
construction: `waited_on(copy)`, whether anyone still waits for that adapter, `heat(copy)`, how hot
the adapter is (executor/eviction.py: its holder's decayed count of requests for it), and
`released(copy)`, told when the adapter's fetch has ended or its host copy was dropped here.

Rules this module guarantees:
- Concurrent `ensure`s of one adapter share one fetch.
- At most `max_concurrent_loads` store fetches run at once, started in the order they were asked
  for; a fetch nobody waits on any more by its turn (its request ended) is not started, and one the
  store refuses as busy stops asking once nobody waits on it (the store client's STILL_WANTED). An
  adapter already held here never waits for a seat: a hot adapter's request is not queued behind
  cold loads. A prefetch whose adapter nobody waits on by the time it begins (evicted, or its
  request ended) fetches nothing, with or without a seat limit: no host copy outlives its holder's record.
- A failed fetch leaves nothing behind (the caller's waiters get the error; the next call retries).
- The cache is bounded in bytes (and optionally in adapters); over budget it drops copies by
  executor/eviction.py's rule: first those no request waits on, the coldest first (the lowest
  `heat`; the least recently used of equals), never the one just fetched.
- One host copy per load: a shard lands where the store client streamed it (pinned on CUDA); only
  tensors that arrive unpinned are copied into pinned memory, so the slot copy is a true async DMA.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import torch

from loraserve.errors import StatusError

from .shard_tensors import ShardTensors, shard_signature
from .store_client import STILL_WANTED, pinned_blob

log = logging.getLogger(__name__)

# fetch_shard(name) -> (digest, rank, tensors, nbytes); raises StatusError.
FetchShard = Callable[[str], Awaitable[tuple[str, int, dict[str, torch.Tensor], int]]]


@dataclass(eq=False)
class HostCopy:
    """One adapter's entry in the CPU cache. The version fields stay when the tensors are dropped
    (a GPU slot may still hold that version) until `CpuCache.forget`."""

    name: str
    digest: str = ""  # the version last fetched; "": none yet
    rank: int = 0  # its LoRA rank
    nbytes: int = 0  # its shard's bytes
    tensors: dict[str, torch.Tensor] | None = None  # the host copy; None: not held here
    fetch_task: asyncio.Task | None = None  # the fetch in flight, shared by every `ensure`


class CpuCache:
    def __init__(
        self,
        fetch_shard: FetchShard,
        device: torch.device,
        *,
        budget_bytes: int | None,
        max_adapters: int | None,
        max_concurrent_loads: int | None,
        waited_on: Callable[[HostCopy], bool],
        heat: Callable[[HostCopy], float],
        released: Callable[[HostCopy], None],
    ):
        self._fetch_shard = fetch_shard
        self.device = device
        self.budget_bytes = budget_bytes  # None: no byte limit
        self.max_adapters = max_adapters  # None: no count limit
        self.nbytes = 0  # shard bytes of the host copies held
        self._lru: OrderedDict[str, HostCopy] = OrderedDict()  # entries with host tensors, oldest first
        # Store fetches in flight at once (None: no limit). Many cold loads at once share the host's
        # cores and memory bandwidth, so each ends later; in turn, the first asked land first.
        self._seats = asyncio.Semaphore(max_concurrent_loads) if max_concurrent_loads else None
        self._waited_on, self._heat, self._released = waited_on, heat, released
        self._tasks: set[asyncio.Task] = set()

    def state(self) -> tuple[int, int]:
        """(adapters, bytes) held."""
        return len(self._lru), self.nbytes

    def prefetch(self, c: HostCopy) -> None:
        """Starts fetching the adapter's host copy in the background, if it has none and none is
        coming (a failure here is not reported: the next `ensure` fetches again and reports it)."""
        if c.tensors is None and c.fetch_task is None:
            self._spawn(self._prefetch(c))

    async def _prefetch(self, c: HostCopy) -> None:
        if not self._waited_on(c):  # let go before this task began (evicted, or its request ended)
            return
        try:
            await self.ensure(c)
        except Exception:
            pass

    def cached(self, c: HostCopy) -> tuple[str, dict[str, torch.Tensor]] | None:
        """(digest, tensors) of the adapter's host copy if it is here (marked used), else None."""
        if c.tensors is None:
            return None
        self._lru.move_to_end(c.name)
        return c.digest, c.tensors

    async def ensure(self, c: HostCopy) -> tuple[str, dict[str, torch.Tensor]]:
        """(digest, tensors) of the adapter's host copy, fetching it if needed."""
        if (held := self.cached(c)) is not None:
            return held
        if c.fetch_task is None:
            c.fetch_task = self._spawn(self._fetch(c))
        return await asyncio.shield(c.fetch_task)

    async def _fetch(self, c: HostCopy) -> tuple[str, dict[str, torch.Tensor]]:
        wanted = STILL_WANTED.set(lambda: self._waited_on(c))  # a busy store is asked again only while so
        try:
            if self._seats is None:
                digest, rank, tensors, nbytes = await self._fetch_shard(c.name)
            else:
                async with self._seats:
                    if not self._waited_on(c):  # its requests ended while it waited for a seat
                        raise StatusError(
                            grpc.StatusCode.CANCELLED, f"adapter {c.name!r}: no request waits for it any more; not fetched"
                        )
                    digest, rank, tensors, nbytes = await self._fetch_shard(c.name)
            # Pinned host memory makes the slot copy a true async DMA. The store client's shards
            # land pinned already (one copy per load: the stream's); others are copied here into
            # one pinned buffer, so a slot load moves them with one host->device copy too. And the
            # shard's signature is worked out now, off the serving loop, not in every slot load.
            tensors = await asyncio.to_thread(_landed, tensors, self.device.type == "cuda")
            c.digest, c.rank, c.nbytes, c.tensors = digest, rank, nbytes, tensors
            self._lru[c.name] = c
            self.nbytes += nbytes
            self._shrink(keep=c)
            return digest, tensors
        except Exception as exc:
            log.info("fetching adapter %s failed: %s", c.name, exc)
            raise
        finally:
            STILL_WANTED.reset(wanted)
            c.fetch_task = None
            self._released(c)

    def drop(self, c: HostCopy) -> None:
        """Forgets the adapter's host copy (the record keeps its version fields)."""
        if c.tensors is not None:
            self.nbytes -= c.nbytes
        c.tensors = None
        if self._lru.get(c.name) is c:
            del self._lru[c.name]

    def forget(self, c: HostCopy, digest: str = "") -> None:
        """Forgets the adapter's host copy and its version: its next `ensure` fetches whatever the
        store has. digest: the version the record reports meanwhile ("": none)."""
        self.drop(c)
        c.digest, c.rank, c.nbytes = digest, 0, 0

    def _shrink(self, keep: HostCopy) -> None:
        """Drops host copies while over the byte (or adapter) budget, by executor/eviction.py's rule:
        first those no request waits on, the coldest first, then the others; never `keep`, just fetched."""

        def over() -> bool:
            return (self.budget_bytes is not None and self.nbytes > self.budget_bytes) or (
                self.max_adapters is not None and len(self._lru) > self.max_adapters
            )

        if not over():
            return
        # stable: the least recently used first of equal heats
        for c in sorted(self._lru.values(), key=lambda c: (self._waited_on(c), self._heat(c))):
            if not over():
                break
            if c is keep:
                continue
            self.drop(c)
            self._released(c)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)  # a reference, so the task is not garbage-collected mid-flight
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # mark errors as seen
        return task


def _all_pinned(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether every tensor is in pinned memory, asked once per storage they live in (a landed
    shard's views share one): each ask gives the interpreter lock back and waits to retake it behind
    the serving loop (executor/diagnostics/gil_handoff.py), ~450 waits for a Llama-3-8B shard asked per tensor."""
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
