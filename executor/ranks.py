"""Ranks 1..N-1 of a tensor- or expert-parallel executor, and rank 0's handle on them (`TPRanks`).

Rank 0 is the executor process: it serves gRPC and runs the scheduler and the slot manager. For
every step it sends the step's inputs (StepInputs: host lists) to the other ranks, then runs the
forward itself; every rank runs the same `forward_step` on its shard of the weights and meets the
others in the layers' collectives (executor/parallel.py). Ranks 1..N-1 are processes that rank 0
spawns, each with a duplex pipe to it:

    rank 0 -> rank i:  ("step", StepInputs) | ("fetch", id, name, digest) | ("cancel", id, why) | ("state", id) | ("stop",)
    rank i -> rank 0:  ("ready",) | ("reply", id, result, error)

A "cancel" tells a rank that its fetch is no longer needed, and why: nobody waits for the adapter
any more (rank 0's STILL_WANTED said so), another rank's fetch of it failed, or the load was called
off. The rank's store client stops asking a store that refuses it as busy and the fetch replies
CANCELLED with that reason, as rank 0's own fetch would (store_client.py).

Slot state is decided on rank 0 alone: a step names, for every slot it uses, the adapter version
in it (`StepInputs.slot_adapters`), and a rank whose slot holds another copies that version's shard
(its own tp_rank's or ep_rank's, fetched from the store by itself) into the slot before the forward. Rank 0's
fetch of an adapter completes only once every rank holds its shard in host memory (`fetching`), so
that copy does not wait on the store.

Failure: a rank that exits, or whose step raises, takes the executor down. Rank 0's watchdog logs
which rank ended and how, kills the others and exits with status 1 (a rank blocked in a collective
cannot be interrupted, so there is no orderly way to go on). A rank whose pipe to rank 0 closes
exits too, and every collective fails after `tp_timeout_s`, so a rank that hangs is found as well.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import gc
import hashlib
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import signal
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import grpc
import torch

from loraserve.errors import StatusError
from loraserve.v1 import common_pb2 as pb

from .build import kv_cache, load_served_model, store_client
from .config import ExecutorConfig
from .diagnostics import gc_pauses, gil_handoff
from .engine.step import StepInputs, forward_step
from .lora import lora_modules
from .model.moe import Experts
from .parallel import TPGroup, make_group, open_store, roles
from .slot_load import clear_slot, load_shard_into_slot
from .store_client import STILL_WANTED

log = logging.getLogger(__name__)
STORE_HOST = "127.0.0.1"  # the ranks of one executor share a host
STOP_GRACE_S = 10.0
WANTED_POLL_S = 0.1  # how often rank 0 asks STILL_WANTED while ranks 1..N-1 fetch


def role(cfg: ExecutorConfig) -> str:
    """What the ranks split, for logs and errors."""
    return "expert-parallel" if cfg.ep_size > 1 else "tensor-parallel"


def local_experts(model) -> tuple[int, int] | None:
    """(first expert, experts) this rank holds in each sparse layer; None for a dense model."""
    experts = next((m for m in model.modules() if isinstance(m, Experts)), None)
    return None if experts is None else (experts.first, experts.gate_up_proj.num_experts)


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r's device: "cuda" or "cuda:k" -> cuda:(k + r); cpu stays cpu."""
    d = torch.device(device)
    return torch.device("cuda", (d.index or 0) + rank) if d.type == "cuda" else d


def backend(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def shard_checksum(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over a shard's tensor names, shapes and bytes: which shard a rank holds, comparably."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous().cpu()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class TPRanks:
    """Rank 0's side: spawns ranks 1..N-1, sends them steps and fetches, watches them."""

    def __init__(self, cfg: ExecutorConfig):
        self.cfg = cfg
        self.size = cfg.world_size
        self.role = role(cfg)
        self._procs: list[multiprocessing.Process] = []
        self._conns: list = []  # pipe to rank i at index i - 1
        self._ready: list[threading.Event] = []
        self._send_lock = threading.Lock()
        self._pending: dict[int, cf.Future] = {}
        self._ids = itertools.count()
        self._closing = False
        self._failed = threading.Lock()  # the first failure reports; the others wait for the exit
        self._join_lock = threading.Lock()  # one thread reaps a process at a time (a second waitpid fails)
        self._store = None

    # ---- start and stop --------------------------------------------------------------------

    def start(self) -> TPGroup:
        """Spawns ranks 1..N-1 and joins the process group with them (blocks until all have joined)."""
        cfg = self.cfg
        self._store = open_store(STORE_HOST, 0, self.size, True, cfg.tp_timeout_s)
        ctx = multiprocessing.get_context("spawn")
        level = logging.getLogger().getEffectiveLevel()
        for rank in range(1, self.size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main,
                args=(cfg, rank, self._store.port, child, level),
                name=f"loraserve-{self.role[:1]}p-rank-{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
            self._ready.append(threading.Event())
            log.info("%s rank %d of %d: pid %d", self.role, rank, self.size, proc.pid)
            threading.Thread(target=self._read, args=(rank, parent), name=f"rank-{rank}-reader", daemon=True).start()
        threading.Thread(target=self._watch, name="tp-watchdog", daemon=True).start()
        return make_group(self._store, 0, self.size, backend(cfg.device), cfg.tp_timeout_s)

    def wait_ready(self) -> None:
        """Blocks until every rank has loaded its shard of the model (a rank that dies meanwhile
        ends the process through the watchdog)."""
        for event in self._ready:
            event.wait()
        log.info("all %d %s ranks are ready", self.size, self.role)

    def close(self) -> None:
        """Stops ranks 1..N-1 (each exits 0 after its step in flight); kills any that do not within STOP_GRACE_S."""
        if self._closing:
            return
        self._closing = True
        for rank in range(1, self.size):
            try:
                self._send(rank, ("stop",))
            except OSError:
                pass
        for proc in self._procs:
            multiprocessing.connection.wait([proc.sentinel], STOP_GRACE_S)
            with self._join_lock:
                proc.join(0.5)
            if proc.exitcode is None:
                log.warning(
                    "%s rank %s (pid %d) did not stop within %gs; killing it", self.role, proc.name, proc.pid, STOP_GRACE_S
                )
                proc.kill()
                with self._join_lock:
                    proc.join()
        log.info("%s ranks 1..%d stopped", self.role, self.size - 1)

    # ---- failure ---------------------------------------------------------------------------

    def fail(self, message: str) -> None:
        """Ends the executor: logs why, kills ranks 1..N-1, exits with status 1. Never returns.
        When a rank has died, that is the cause reported (rank 0's step then fails too, by
        the broken connection, often before the watchdog wakes)."""
        self._failed.acquire()  # a second failure waits here for the exit
        dead = multiprocessing.connection.wait([p.sentinel for p in self._procs], timeout=1.0)
        for rank, proc in enumerate(self._procs, start=1):
            if proc.sentinel in dead and not message.startswith(f"{self.role} rank"):
                message = f"{self._death(rank, proc)} ({message})"
                break
        log.critical("%s; stopping the %s executor", message, self.role)
        self._closing = True
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(1)

    def _watch(self) -> None:
        """Waits for any rank to exit; outside close() that is fatal."""
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self._procs, start=1)}
        while sentinels:
            for s in multiprocessing.connection.wait(list(sentinels)):
                rank, proc = sentinels.pop(s)
                if not self._closing:
                    self.fail(self._death(rank, proc))

    def _death(self, rank: int, proc: multiprocessing.Process) -> str:
        with self._join_lock:
            proc.join()
        code = proc.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with status {code}"
        return f"{self.role} rank {rank} (pid {proc.pid}) {how}"

    # ---- messages --------------------------------------------------------------------------

    def _send(self, rank: int, message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self._conns[rank - 1].send_bytes(data)

    def _read(self, rank: int, conn) -> None:
        while True:
            try:
                message = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return  # the rank has gone: the watchdog reports it
            if message[0] == "ready":
                self._ready[rank - 1].set()
            elif message[0] == "reply":
                _, op_id, result, error = message
                future = self._pending.pop(op_id, None)
                if future is not None and not future.cancelled():  # cancelled: its asker gave up
                    try:
                        future.set_result((result, error))
                    except cf.InvalidStateError:  # cancelled since the check
                        pass

    def step(self, inputs: StepInputs) -> None:
        """Sends one step to ranks 1..N-1 (from the thread that then runs rank 0's forward)."""
        data = pickle.dumps(("step", inputs), protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            for conn in self._conns:
                conn.send_bytes(data)

    async def _ask(self, message: tuple, wanted: Callable[[], bool] | None = None) -> list:
        """Sends (kind, id, *args) to every other rank; their results in rank order. Raises a rank's
        error as a StatusError naming the rank (its told_to_stop: this ask sent a "cancel"): the
        first to fail while others still worked (they are sent a "cancel" then: the ask has failed,
        so they need not go on, e.g. asking a busy store for up to its budget), else the first in
        rank order. wanted: asked every WANTED_POLL_S until every rank has replied; once it says no,
        each rank still working is sent a "cancel", as it is when this ask is cancelled."""
        futures, ops = [], []
        for rank in range(1, self.size):
            op_id = next(self._ids)
            future = self._pending[op_id] = cf.Future()
            self._send(rank, (message[0], op_id, *message[1:]))
            futures.append(asyncio.wrap_future(future))
            ops.append((rank, op_id))
        told_to_stop, first_failed = False, None
        try:
            waiting = set(futures)
            while waiting:
                done, waiting = await asyncio.wait(
                    waiting, timeout=WANTED_POLL_S if wanted is not None else None, return_when=asyncio.FIRST_COMPLETED
                )
                failed = [f for f in futures if f in done and f.result()[1] is not None]
                if failed and waiting:
                    first_failed = futures.index(failed[0])
                    log.info(
                        "%s of %r: %s rank %d failed; rank(s) %s told to stop",
                        message[0],
                        message[1],
                        self.role,
                        first_failed + 1,
                        ", ".join(str(r) for (r, _), f in zip(ops, futures) if f in waiting),
                    )
                    self._cancel(ops, futures, f"{self.role} rank {first_failed + 1}'s fetch of it failed")
                    break
                if waiting and wanted is not None and not wanted():
                    log.info(
                        "%s of %r: nobody waits for it any more; %s rank(s) %s told to stop if the store refuses them as busy",
                        message[0],
                        message[1],
                        self.role,
                        ", ".join(str(r) for (r, _), f in zip(ops, futures) if f in waiting),
                    )
                    self._cancel(ops, futures, "no request waits for it any more")
                    told_to_stop = True
                    break
            replies = await asyncio.gather(*futures)
        except asyncio.CancelledError:  # the caller gave up: so do the ranks still at it
            self._cancel(ops, futures, "its load was called off")
            raise
        order = list(enumerate(replies, start=1))
        if first_failed is not None:  # the rank whose error ended the ask, before the others told to stop
            order.insert(0, order[first_failed])
        for rank, (_, error) in order:
            if error is not None:
                code, text = error
                failed = StatusError(grpc.StatusCode[code], f"{self.role} rank {rank}: {text}")
                failed.told_to_stop = told_to_stop  # this ask sent the ranks a "cancel"
                raise failed
        return [result for result, _ in replies]

    def _cancel(self, ops: list[tuple[int, int]], futures: list[asyncio.Future], why: str) -> None:
        """Sends "cancel" (and why) to each rank whose op has not replied (a late one finds nothing
        to cancel)."""
        for (rank, op_id), future in zip(ops, futures):
            if not future.done() or future.cancelled():
                try:
                    self._send(rank, ("cancel", op_id, why))
                except OSError:  # the rank has gone: the watchdog reports it
                    pass

    def fetching(self, fetch_shard: Callable[[str], Awaitable[tuple]]) -> Callable[[str], Awaitable[tuple]]:
        """The slot manager's fetch function for rank 0: rank 0's shard from the store, then every
        other rank's shard of that same version (by digest), each rank fetching its own."""

        async def fetch_on_every_rank(name: str):
            digest, rank, tensors, nbytes = await fetch_shard(name)
            wanted = STILL_WANTED.get()  # the caller's, as rank 0's own fetch had
            while True:
                try:
                    await self._ask(("fetch", name, digest), wanted)
                    return digest, rank, tensors, nbytes
                except StatusError as e:
                    # A rank told to stop because nobody waited, when someone waits again now (a new
                    # request joined this fetch meanwhile): ask the ranks again rather than fail it.
                    if not (e.code == grpc.StatusCode.CANCELLED and getattr(e, "told_to_stop", False) and wanted()):
                        raise
                    log.info("%r is wanted again after its %s ranks were told to stop; asking them again", name, self.role)

        return fetch_on_every_rank

    async def states(self) -> list[dict]:
        """What ranks 1..N-1 hold, for tests and diagnostics:
        {"rank", "device", "tp_rank", "ep_rank", "experts": (first, count) per sparse layer's block or None,
        "slots": {slot: (name, digest)}, "shards": {(name, digest): checksum}}."""
        return await self._ask(("state",))


# ---- ranks 1..N-1 ----------------------------------------------------------------------------


def worker_main(cfg: ExecutorConfig, rank: int, store_port: int, conn, log_level: int) -> None:
    """The process of rank `rank` (>= 1): loads its shard of the model, then runs steps until told to stop."""
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s %(name)s [{role(cfg)[0]}p rank {rank}]: %(message)s")
    # Ctrl-C in a terminal reaches the whole process group: rank 0 alone drains, then stops this rank.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _Rank(cfg, rank, store_port, conn).run()
    except BaseException:
        log.critical("%s rank %d failed", role(cfg), rank, exc_info=True)
        logging.shutdown()
        os._exit(1)
    logging.shutdown()
    os._exit(0)  # nothing left to clean up; a normal exit could wait on the process group's threads


class _StillWanted:
    """A rank's STILL_WANTED for one fetch: true until rank 0's "cancel", whose reason is then `why`
    (the store client names it in its CANCELLED error and its log line)."""

    def __init__(self) -> None:
        self._stopped = threading.Event()
        self.why: str | None = None

    def __call__(self) -> bool:
        return not self._stopped.is_set()

    def stop(self, why: str) -> None:
        self.why = why  # before the event: whoever sees it set reads the reason
        self._stopped.set()


class _Rank:
    def __init__(self, cfg: ExecutorConfig, rank: int, store_port: int, conn):
        if cfg.cpu_threads > 0:
            torch.set_num_threads(cfg.cpu_threads)
        self.cfg, self.rank, self.conn = cfg, rank, conn
        self.device = rank_device(cfg.device, rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.role = role(cfg)
        store = open_store(STORE_HOST, store_port, cfg.world_size, False, cfg.tp_timeout_s)
        group = make_group(store, rank, cfg.world_size, backend(cfg.device), cfg.tp_timeout_s)
        self.tp, self.ep = roles(group, cfg.ep_size)
        # The parts rank 0 builds too (executor/build.py); max_loras and max_model_len come resolved
        # from rank 0's cfg. No host arena: the slot copy reads the stream's own buffer.
        self.model = load_served_model(cfg, self.device, self.tp, self.ep)
        mc = self.model.cfg
        self.kv = kv_cache(cfg, self.model, self.device)
        self.modules = lora_modules(self.model)
        self.packed = any(m.packed_b for m in self.modules.values())
        self.store = store_client(cfg, self.model, self.device, rank=pb.ShardRank(tp_rank=self.tp.rank, ep_rank=self.ep.rank))
        self.slots: list[tuple[str, str]] = [("", "")] * cfg.max_loras  # (adapter, digest) in each slot
        self.shards: OrderedDict[tuple[str, str], dict[str, torch.Tensor]] = OrderedDict()  # host copies, LRU
        self.shards_lock = threading.Lock()
        self.steps: queue.Queue = queue.Queue()
        self.cancels: dict[int, _StillWanted] = {}  # fetches in flight by op id: stopped once rank 0 says "cancel"
        self.send_lock = threading.Lock()
        self.loop = asyncio.new_event_loop()  # the store client's
        threading.Thread(target=self.loop.run_forever, name="store-client", daemon=True).start()
        threading.Thread(target=self._read, name="rank-0-reader", daemon=True).start()
        # Start-up's objects out of the garbage collector's walks (diagnostics/gc_pauses.py): a full
        # collection here would hold this rank's step, and every rank waits for it in the collectives.
        # The process serves until it exits, so nothing thaws them.
        self.gc = gc_pauses.watch_gc()
        frozen = gc_pauses.freeze_startup()
        # Its store client's views of a fetched shard run on threads beside this rank's steps: the
        # switch interval the engine of rank 0 sets (diagnostics/gil_handoff.py), for this process's life.
        gil_handoff.engine_started()
        self._send(("ready",))
        log.info(
            "%s rank %d ready: %s, %d layers, %d kv heads here; %d start-up objects frozen out of the garbage collector's walks",
            self.role,
            rank,
            cfg.model,
            mc.num_layers,
            self.model.num_kv_heads,
            frozen,
        )

    def run(self) -> None:
        while (inputs := self.steps.get()) is not None:
            for slot, version in inputs.slot_adapters.items():
                if self.slots[slot] != version:
                    self._load_slot(slot, version, inputs.slot_ranks[slot] if inputs.slot_ranks else None)
            if self.device.type == "cuda":
                with torch.cuda.device(self.device):
                    forward_step(self.model, self.kv, inputs, self.cfg.max_loras, self.device)
            else:
                forward_step(self.model, self.kv, inputs, self.cfg.max_loras, self.device)
        log.info("%s rank %d stopping", self.role, self.rank)

    def _send(self, message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self.send_lock:
            self.conn.send_bytes(data)

    def _read(self) -> None:
        """Steps go to the main thread in order; fetches run on the store client's loop meanwhile."""
        while True:
            try:
                message = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                log.critical("%s rank %d: the pipe to rank 0 closed (rank 0 is gone); exiting", self.role, self.rank)
                logging.shutdown()
                os._exit(1)
            kind = message[0]
            if kind == "step":
                self.steps.put(message[1])
            elif kind == "stop":
                self.steps.put(None)
            elif kind == "fetch":
                cancelled = self.cancels[message[1]] = _StillWanted()  # before any "cancel" of it is read
                asyncio.run_coroutine_threadsafe(self._fetch_op(*message[1:], cancelled), self.loop)
            elif kind == "cancel":
                if (cancelled := self.cancels.get(message[1])) is not None:  # else: that fetch has replied
                    cancelled.stop(message[2])
            elif kind == "state":
                self._send(("reply", message[1], self._state(), None))

    async def _fetch_op(self, op_id: int, name: str, digest: str, cancelled: "_StillWanted") -> None:
        STILL_WANTED.set(cancelled)  # this task's own context: a busy store is asked again only while so
        try:
            await self._fetch(name, digest)
            self._send(("reply", op_id, None, None))
        except StatusError as exc:
            self._send(("reply", op_id, None, (exc.code.name, exc.message)))
        except Exception as exc:
            self._send(("reply", op_id, None, ("INTERNAL", f"{type(exc).__name__}: {exc}")))
        finally:
            self.cancels.pop(op_id, None)

    async def _fetch(self, name: str, digest: str) -> dict[str, torch.Tensor]:
        """This rank's shard of that version, kept in host memory (the LRU never drops a shard in a slot)."""
        with self.shards_lock:
            tensors = self.shards.get((name, digest))
            if tensors is not None:
                self.shards.move_to_end((name, digest))
                return tensors
        got, _, tensors, _ = await self.store.fetch_shard(name, digest)
        if got != digest:
            raise StatusError(
                grpc.StatusCode.FAILED_PRECONDITION, f"adapter {name!r}: the store sent {got[:12]}, not {digest[:12]}"
            )
        with self.shards_lock:
            self.shards[(name, digest)] = tensors
            excess = len(self.shards) - self.cfg.max_cpu_adapters - self.cfg.max_loras
            for key in [k for k in self.shards if k not in self.slots][: max(0, excess)]:  # oldest first
                del self.shards[key]
        return tensors

    def _load_slot(self, slot: int, version: tuple[str, str], rank0_rank: int | None = None) -> None:
        """Copies this rank's shard of `version` into `slot` (("", ""): empties it). rank0_rank: the
        slot's rank as rank 0 loaded it, which this rank's kernels read its slot at: a packed B
        (slot_layout.packs_b_on) laid out at another rank here would be read wrong, so that fails."""
        if version == ("", ""):
            clear_slot(self.modules.values(), slot)
        else:  # fetched already when rank 0 loaded it, unless dropped since: then fetched now
            future = asyncio.run_coroutine_threadsafe(self._fetch(*version), self.loop)
            tensors = future.result()
            rank = load_shard_into_slot(self.model, slot, tensors)
            if self.packed and rank0_rank is not None and rank != rank0_rank:
                raise RuntimeError(
                    f"slot {slot}: this rank's shard of {version[0]!r} ({version[1][:12]}) has rank {rank}, "
                    f"rank 0's {rank0_rank}: its packed B would be read at the wrong rank"
                )
        self.slots[slot] = version
        log.info("slot %d: %s (%s)", slot, version[0] or "empty", version[1][:12])

    def _state(self) -> dict:
        with self.shards_lock:
            shards = {key: shard_checksum(t) for key, t in self.shards.items()}
        return {
            "rank": self.rank,
            "device": str(self.device),
            "tp_rank": self.tp.rank,
            "ep_rank": self.ep.rank,
            "experts": local_experts(self.model),
            "slots": dict(enumerate(self.slots)),
            "shards": shards,
            "gc_frozen": gc.get_freeze_count(),
            "gc_collections": self.gc.count,
            "gc_seconds": self.gc.seconds,
        }
