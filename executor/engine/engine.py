"""The async engine: requests in, a background step loop, token streams out.

    generate(req) --size check, tokenize (thread), validate, acquire adapter slot--> Scheduler.waiting
    step loop:  plan (scheduler.py) -> flatten (batch.py: input_ids, positions, block tables, token slots)
                -> launch: decode steps replay a CUDA graph per batch bucket and steps with a prefill
                   chunk one per token bucket (graphs.py), from the loop; steps no graph takes run
                   model.forward + compute_logits eagerly in a worker thread; then sampling on the
                   device and one copy of the sampled tokens and logprobs into pinned host memory
                -> while the device computes: the next decode step is launched ahead where it can be,
                   and the previous step's outputs are delivered
                -> wait (in a thread) for the copy; append tokens, then deliver (delivery.py):
                   detokenize (thread), stop strings -> each request's queue

With tensor parallelism (`ranks`: executor/ranks.py) this is rank 0: each eager step's inputs go
to ranks 1..N-1 first, then every rank runs the same `forward_step` on its shard of the model
(no decode graphs, so no step is launched ahead).

The device wait and the eager forward run in threads, so the event loop keeps serving gRPC and
adapter loads while the model computes; tokenizing and detokenizing run in their own threads too (a long
prompt never stalls other streams), and text prompts above `max_prompt_bytes` are refused
before they are tokenized (requests.py). A sequence's lease is released only when no step in flight
uses it, so its slot is never overwritten under a running forward.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import grpc
import torch

from loraserve.errors import StatusError, exhausted, unavailable

from .. import cublas, lora_fp8
from ..config import ExecutorConfig
from ..diagnostics import gc_pauses, gil_handoff
from ..diagnostics.builds import watch_builds
from ..diagnostics.slow_steps import SlowSteps
from ..model import fp8
from ..slots import SlotLease, SlotManager
from .batch import PENDING, Batch, flatten, long_rope_length, step_kind
from .capture import capture_decode_graphs, capture_mixed_graphs
from .delivery import Delivery, NewToken, Run
from .kv_cache import BlockAllocator, KVCache
from .kv_events import KVEventPublisher, lora_id
from .prefix_cache import KVFormat, chain_seed
from .requests import GenerationOutput, GenerationRequest, check_prompt_size, prompt_ids, resolve_sampling, within
from .runner import Launched, StepRunner
from .sampler import make_generator, validate_request
from .scheduler import SchedulePlan, Scheduler, Sequence
from .step_stats import STEP_KINDS, StepTime, StepTotals
from .warmup import warm_up_engine

log = logging.getLogger(__name__)


def _nothing() -> None:
    pass


def _not_landed() -> bool:
    return False  # a queued sequence's readiness until its adapter's slot lease exists


@dataclass
class _InFlight:
    plan: SchedulePlan
    launched: Launched | None


class EngineLoad(NamedTuple):
    running: int  # sequences in the running batch
    waiting: int  # sequences queued (for their adapter, for blocks, or preempted)
    kv_blocks_used: int
    kv_blocks_total: int
    block_size: int


def kv_events_publisher(config: ExecutorConfig, kv_cache: KVCache) -> KVEventPublisher | None:
    """The KV-event publisher config.kv_events_endpoint asks for (None: off); ValueError if it cannot bind."""
    if not config.kv_events_endpoint:
        return None
    return KVEventPublisher(
        config.kv_events_endpoint,
        block_size=kv_cache.block_size,
        medium="GPU" if kv_cache.k_cache[0].device.type == "cuda" else "CPU",
        topic=config.kv_events_topic,
        replay_endpoint=config.kv_events_replay_endpoint,
    )


def kv_format(model, config: ExecutorConfig, kv_cache: KVCache) -> KVFormat:
    """The prefix cache's executor-wide key fields (prefix_cache.KVFormat), from what the loaded model
    and its cache hold. An FP8 cache names its scales: the checkpoint's, or 1.0 where it has none."""
    kv_dtype = fp8.dtype_name(kv_cache.dtype)
    if kv_cache.dtype == fp8.FP8:
        kv_dtype += " with the checkpoint's scales" if model.kv_scales is not None else " with scales 1.0"
    return KVFormat(
        model=config.model,
        base_model=config.base_model,
        dtype=fp8.dtype_name(model.dtype),
        weights=fp8.weight_format(model),
        lora_dtype=lora_fp8.slot_dtype(model),
        kv_dtype=kv_dtype,
        block_size=kv_cache.block_size,
    )


class Engine:
    def __init__(self, model, tokenizer, kv_cache: KVCache, slot_manager: SlotManager, config: ExecutorConfig, ranks=None):
        self.kv_events: KVEventPublisher | None = None
        try:
            self._init(model, tokenizer, kv_cache, slot_manager, config, ranks)
        except BaseException:
            # a start that fails past the publisher (warm-up, graph capture: CUDA OOM) leaves its
            # port free, so that a retry in this process can bind it again
            if self.kv_events is not None:
                self.kv_events.close()
            raise

    def _init(self, model, tokenizer, kv_cache: KVCache, slot_manager: SlotManager, config: ExecutorConfig, ranks) -> None:
        self.model = model
        self.ranks = ranks  # executor/ranks.py's TPRanks under tensor parallelism, else None
        self.tokenizer = tokenizer
        self.kv_cache = kv_cache
        self.slots = slot_manager
        self.config = config
        self.device = config.torch_device
        cublas.without_workspace(str(self.device))  # in-process engines too (benchmarks), before the warm-up's GEMMs
        self.vocab_size = model.cfg.vocab_size
        self._long_rope = long_rope_length(model.cfg)  # LongRoPE: sequences longer than this take the long factors
        spec = getattr(model, "lora_spec", None)
        self.max_loras = spec.max_loras if spec is not None else 0  # slot buffers' leading dim
        self.allocator = BlockAllocator(kv_cache.num_blocks)
        self.scheduler = Scheduler(
            self.allocator,
            kv_cache.block_size,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            max_admit_delay=config.max_admit_delay_steps,
            long_rope=self._long_rope,
            dynamic_rope=model.cfg.max_position_embeddings if model.cfg.rope_type == "dynamic" else None,
        )
        # KV-block events for prefix-aware routing (kv_events.py): bound before the warm-up, so a
        # bad endpoint fails the start at once
        self.kv_events = kv_events_publisher(config, kv_cache)
        if self.kv_events is not None:
            self.allocator.on_evict = self.kv_events.removed
            self.scheduler.kv_events = self.kv_events
        self.kv_format = kv_format(model, config, kv_cache)  # every prefix-cache seed's executor-wide fields
        self.delivery = Delivery(self.scheduler, tokenizer, config.max_model_len)
        self._runs: dict[int, Run] = self.delivery.runs  # seq_id -> run
        self._seq_ids = itertools.count()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stepping: dict[Sequence, int] = {}  # sequences of the steps in flight -> how many
        self._deferred_releases: list[tuple[Sequence, SlotLease]] = []  # held until their steps end
        self._prev_rows: dict[Sequence, int] = {}  # the last launched step's sample row of each sequence
        self._acquiring = 0  # queued requests whose adapter has no slot lease yet
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        # Triton builds (diagnostics/builds.py, CUDA): the warm-up's and the captures' are expected,
        # later ones hold a serving step and are logged and counted (the counter is the process's:
        # disarmed here so a second engine's warm-up does not count)
        self.kernel_builds = watch_builds() if self.device.type == "cuda" else None
        if self.kernel_builds is not None:
            self.kernel_builds.armed = False
        self.warm_up_seconds = warm_up_engine(model, kv_cache, config, self.max_loras, self.device, ranks)
        self.graphs = capture_decode_graphs(model, kv_cache, config, self.max_loras, self.device, ranks)
        self.mixed_graphs = capture_mixed_graphs(model, kv_cache, config, self.max_loras, self.device, self.graphs)
        if self.kernel_builds is not None:
            self.kernel_builds.armed = True
        self.gc_pauses = gc_pauses.watch_gc()  # every collection timed; start() freezes start-up's objects
        self._serving = False  # counted among the process's serving engines (gc_pauses, gil_handoff)
        # admission pacing only where it pays: with graphs a decode step is cheap, and an admitting
        # step is a prefill (eager or from a mixed graph: still a larger step)
        self.scheduler.admit_ratio = config.admit_ratio if self.graphs is not None else 0.0
        if self.graphs is not None:
            self.scheduler.pace_max_running = self.graphs.max_batch  # larger batches decode eagerly
        self.step_times: list[StepTime] = []  # the collected steps, latest last (benchmarks and tests read them)
        # every collected step since start, by kind (metrics, serve.py)
        self.step_totals: dict[str, StepTotals] = {k: StepTotals() for k in STEP_KINDS}
        self.slow_steps = SlowSteps(STEP_KINDS)  # steps far slower than their kind's recent ones: logged, counted
        self.steps_ahead = 0  # steps launched before the previous step's tokens reached the host
        self.runner = StepRunner(model, kv_cache, self.max_loras, self.device, config.max_num_seqs, ranks)

    def load(self) -> EngineLoad:
        """The queue and KV cache now: lengths and counters only, so another thread (/metrics) may read it."""
        total = self.allocator.num_blocks
        return EngineLoad(
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            total - self.allocator.num_free,
            total,
            self.kv_cache.block_size,
        )

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="engine-step-loop")
            self._task.add_done_callback(self._on_loop_exit)
        if not self._serving:
            # start-up's objects (imports, model, warm-up, graphs) out of the garbage collector's walks
            # (a full walk of them holds the event loop for 0.1-0.4 s), and the interpreter's switch
            # interval short while serving (diagnostics/gc_pauses.py, gil_handoff.py)
            self._serving = True
            gil_handoff.engine_started()
            frozen = gc_pauses.engine_started()
            if frozen is not None:
                log.info("engine serving: %d objects of start-up frozen out of the garbage collector's walks", frozen)

    def _on_loop_exit(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        log.error("engine step loop died", exc_info=exc)
        error = StatusError(grpc.StatusCode.INTERNAL, f"engine stopped: {type(exc).__name__}: {exc}")
        for run in list(self._runs.values()):
            self.delivery.fail(run.seq, error)

    async def stop(self) -> None:
        """Stops the step loop; every live request ends with finish_reason "cancelled"."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception:
                pass
            self._task = None
        self._release_deferred()
        for run in list(self._runs.values()):
            self.delivery.finish(run, "cancelled")
        if self.kv_events is not None:  # joins the socket thread (up to seconds): off the event loop
            await asyncio.to_thread(self.kv_events.close)
        if self._serving:  # the last serving engine puts start-up's objects and the interval back
            self._serving = False
            gc_pauses.engine_stopped()
            gil_handoff.engine_stopped()

    # ---- requests -------------------------------------------------------------------------

    async def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """Streams the outputs of one request. Raises StatusError (before or during the stream)."""
        request_id = req.request_id or uuid.uuid4().hex
        if self._task is None or self._task.done():
            raise unavailable("the engine is not running")
        params = resolve_sampling(req.sampling, self.config.default_max_tokens)
        check_prompt_size(req, self.config, self.tokenizer)
        # From arrival on: the adapter's CPU copy is fetched (while tokenizing) and its slot kept.
        unwant = self.slots.want(req.adapter) if req.adapter else _nothing
        try:
            if req.prompt_token_ids is not None:
                ids = prompt_ids(req, self.tokenizer, self.vocab_size)
            else:
                ids = await asyncio.get_running_loop().run_in_executor(
                    self._tokenizer_thread, prompt_ids, req, self.tokenizer, self.vocab_size
                )
            validate_request(
                params,
                len(ids),
                vocab_size=self.vocab_size,
                max_model_len=self.config.max_model_len,
                max_stop_strings=self.config.max_stop_strings,
                max_stop_string_chars=self.config.max_stop_string_chars,
            )
        except BaseException:
            unwant()
            raise
        started = time.monotonic()
        log.info(
            "request %s: start, adapter=%r, %d prompt tokens, max_tokens=%d, temperature=%g",
            request_id, req.adapter, len(ids), params.max_tokens, params.temperature,
        )  # fmt: skip
        run: Run | None = None
        lease: SlotLease | None = None
        reason = "error"
        try:
            # Queued at arrival, admitted once its adapter has landed in a slot: the queue keeps
            # arrival order, so a cold adapter's request goes before later ones once it lands.
            seq = Sequence(next(self._seq_ids), list(ids), len(ids))
            if req.adapter:
                seq.is_ready = _not_landed
            else:
                seq.cache_seed = self._cache_seed("", "")
            run = Run(
                request_id=request_id,
                seq=seq,
                params=params,
                return_logprobs=req.return_logprobs,
                lease=lease,
                generator=make_generator(params.seed, self.device),
                decoder=self.tokenizer.incremental_decoder(),
            )
            self._runs[seq.seq_id] = run
            self.scheduler.add(seq)
            if req.adapter:
                self._acquiring += 1
                try:
                    lease = await within(self.slots.acquire(req.adapter), req.deadline, request_id)
                finally:
                    self._acquiring -= 1
                    unwant()
                seq.cache_seed = self._cache_seed(lease.name, lease.digest)  # before it can be admitted
                seq.adapter = (lease.name, lora_id(lease.name, lease.digest))
                run.lease, seq.slot, seq.is_ready = lease, lease.slot, lease.is_ready
            self._wakeup.set()
            while True:
                item = await within(run.queue.get(), req.deadline, request_id)
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    reason = item.finish_reason
                    return
        except (asyncio.CancelledError, GeneratorExit):
            reason = "cancelled"
            raise
        except StatusError as exc:
            reason = exc.code.name
            raise
        finally:
            unwant()
            self._close(run, lease)
            log.info(
                "request %s: finished (%s), %d output tokens in %.3fs",
                request_id, reason, run.emitted_tokens if run else 0, time.monotonic() - started,
            )  # fmt: skip

    def _cache_seed(self, adapter: str, digest: str) -> bytes | None:
        """The prefix cache's key chain seed of a sequence of this adapter version ("", "": the base
        model); None, never cached: caching off (config.prefix_caching, read as each request
        arrives), or an adapter version without a content digest."""
        if not self.config.prefix_caching or (adapter and not digest):
            return None
        return chain_seed(self.kv_format, adapter, digest)

    def _close(self, run: Run | None, lease: SlotLease | None) -> None:
        """Frees what a request holds, however it ended. The lease waits for the step in flight."""
        if run is not None:
            run.done = True
            self._runs.pop(run.seq.seq_id, None)
            self.scheduler.finish(run.seq)  # its blocks are reused only by a later schedule()
        if lease is not None:
            if run is not None and run.seq in self._stepping:
                self._deferred_releases.append((run.seq, lease))
            else:
                self.slots.release(lease)

    # ---- the step loop --------------------------------------------------------------------

    async def _loop(self) -> None:
        """Keeps the device busy: while step N computes, step N+1 is planned and launched (when it
        can be: see `_launch_ahead`) and step N-1's outputs are delivered (detokenizing, stop
        strings, the streams' queues and their consumers' work on this loop); then step N's
        sampled tokens are collected.

        Step N+1 launched before step N's tokens are known feeds them from the device: the
        scheduler sees a placeholder token (PENDING) per sequence, the graph reads the real ids
        that step N's sampling left in the graphs' buffer, and `Delivery.append` puts them in place. A
        sequence that step N ends computes one step more (eos) or up to two (a stop string, found
        while delivering), whose tokens are dropped; length ends are known beforehand and planned for."""
        pending: asyncio.Future | None = None  # the delivery of collected outputs
        inflight: _InFlight | None = None  # launched, not yet collected
        following: _InFlight | None = None  # launched behind it
        try:
            while True:
                if inflight is None:
                    if not self.scheduler.has_work() or not (plan := self._plan()).seqs:
                        if pending is not None:
                            await pending
                            pending = None
                            continue
                        # Nothing to run now: wait for a request, or for an adapter to land (its
                        # acquire wakes the loop); a slot copy in flight (a CUDA event) is looked at
                        # again shortly.
                        self._wakeup.clear()
                        copying = len(self.scheduler.waiting) > self._acquiring
                        try:
                            await asyncio.wait_for(self._wakeup.wait(), 0.002 if copying else None)
                        except asyncio.TimeoutError:
                            pass
                        continue
                    inflight = await self._start(plan)
                    if inflight is None:
                        continue
                following = await self._launch_ahead(inflight)
                if pending is not None:  # earlier outputs go out while the device computes
                    await pending
                    pending = None
                new = await self._finish_step(inflight)
                inflight, following = following, None
                if new is not None:
                    pending = asyncio.ensure_future(self.delivery.deliver(new))
        finally:
            if pending is not None:
                pending.cancel()
            for step in (inflight, following):  # stopped mid-step: the device ends it before slots move
                if step is not None and step.launched.event is not None:
                    step.launched.event.synchronize()
            self._release_deferred()  # no step runs any more: held-back leases go back (also after a crash)

    def _plan(self, admit: bool = True) -> SchedulePlan:
        plan = self.scheduler.schedule(admit)
        for seq in plan.failed:
            self.delivery.fail(seq, exhausted(f"sequence of {len(seq.token_ids)} tokens does not fit in the KV cache"))
        return plan

    async def _start(self, plan: SchedulePlan) -> _InFlight | None:
        """Flattens and launches a planned step: a graph step from the loop itself (staging and
        replay take 0.5-2 ms of host time; from a worker thread it would wait for the GIL while the
        loop delivers outputs, and the device would idle), an eager one, which launches hundreds of
        kernels from Python, in a worker thread. None if the launch failed (its requests have failed)."""
        for s in plan.seqs:
            self._stepping[s.seq] = self._stepping.get(s.seq, 0) + 1
        step = _InFlight(plan, None)
        try:
            batch = self._flatten(plan)
            kind = step_kind(batch, self.graphs, self.mixed_graphs)  # decided once: the launch runs what was decided here
            if kind.endswith("graph"):
                step.launched = self._launch(batch, kind)
            else:
                task = asyncio.ensure_future(asyncio.to_thread(self._launch, batch, kind))
                try:
                    step.launched = await asyncio.shield(task)  # a cancel must not orphan the thread's launch
                except asyncio.CancelledError:  # stopping: the launch and its device work end before the slots move
                    await asyncio.wait([task])
                    if task.exception() is None and task.result().event is not None:
                        task.result().event.synchronize()
                    raise
        except Exception as exc:
            self._step_failed(step, exc)
            return None
        self._prev_rows = {s.seq: i for i, s in enumerate(x for x in plan.seqs if x.needs_sample)}
        return step

    async def _finish_step(self, step: _InFlight) -> list[NewToken] | None:
        """Waits (off the loop) for a launched step, appends its tokens -> the outputs to deliver."""
        try:
            if step.launched.event is not None:
                await asyncio.to_thread(step.launched.event.synchronize)
            token_ids, logprobs = self._collect(step.launched)
        except Exception as exc:
            self._step_failed(step, exc)
            return None
        self.scheduler.cache_computed(step.plan)  # its blocks' KV is written; before its tokens extend the sequences
        self._done_stepping(step.plan)
        return self.delivery.append(step.plan, token_ids, logprobs)

    def _step_failed(self, step: _InFlight, exc: Exception) -> None:
        log.error("step of %d sequences failed", len(step.plan.seqs), exc_info=exc)
        error = StatusError(grpc.StatusCode.INTERNAL, f"forward step failed: {type(exc).__name__}: {exc}")
        for s in step.plan.seqs:
            self.delivery.fail(s.seq, error)
        self._done_stepping(step.plan)

    def _done_stepping(self, plan: SchedulePlan) -> None:
        """The step's device work is over: leases of requests closed meanwhile go back, unless a
        step still in flight uses them."""
        if self.kv_events is not None:
            self.kv_events.flush()  # the blocks filed and evicted since the last step ended: one batch
        for s in plan.seqs:
            left = self._stepping.pop(s.seq, 1) - 1
            if left > 0:
                self._stepping[s.seq] = left
        keep = []
        for seq, lease in self._deferred_releases:
            if seq in self._stepping:
                keep.append((seq, lease))
            else:
                self.slots.release(lease)
        self._deferred_releases = keep

    async def _launch_ahead(self, step: _InFlight) -> _InFlight | None:
        """Launches the next step before `step`'s sampled tokens reach the host, where that step is
        sure to be a graph decode step that reads them on the device: no waiting request could be
        admitted, every running sequence decodes (at most one token to compute, its last one sampled
        by `step` unless its id is on the host; none passes LongRoPE's original length, which
        recomputes it: Scheduler), and they fit the largest graph. Each sampled
        sequence that goes on gets a placeholder token (PENDING) for the graph to replace. The step
        admits nobody (`schedule(admit=False)`): a request whose adapter lands meanwhile waits one
        step. Returns the launched step; None where none was launched."""
        graphs, running = self.graphs, self.scheduler.running
        if graphs is None or not step.launched.kept or not 0 < len(running) <= graphs.max_batch:
            return None
        if self.scheduler.admits_now():
            return None  # one will be admitted: the next step is planned with it, on real ids
        sampled = {s.seq: s for s in step.plan.seqs if s.needs_sample}
        goes_on = []
        for seq in running:
            s = sampled.get(seq)
            if s is None:
                if seq.num_uncomputed > 1 or (seq.num_uncomputed == 1 and seq.token_ids[-1] == PENDING):
                    return None
                continue
            run = self._runs.get(seq.seq_id)
            if run is None or run.done or len(seq.token_ids) != s.context_len + s.num_tokens:
                continue
            if seq.num_output_tokens + 1 < run.params.max_tokens and len(seq.token_ids) + 1 < self.config.max_model_len:
                if self._long_rope is not None and not seq.long_rope and len(seq.token_ids) + 1 > self._long_rope:
                    return None  # the scheduler recomputes it with LongRoPE's long factors: a prefill, on real ids
                goes_on.append(seq)
        if not goes_on:
            return None
        for seq in goes_on:
            self.scheduler.append_token(seq, PENDING)
        self.steps_ahead += 1
        plan = self._plan(admit=False)
        if not plan.seqs:
            return None
        following = await self._start(plan)
        if following is not None:
            following.launched.ahead = True
        return following

    def _flatten(self, plan: SchedulePlan) -> Batch:
        b = flatten(plan, self._runs, self._prev_rows, self.slots, self.ranks is not None, self._long_rope)
        num_decode = sum(s.num_tokens == 1 for s in plan.seqs)
        log.debug(
            "step: %d seqs (%d prefill, %d decode), %d tokens, slots %s, %d waiting, %d free KV blocks",
            len(plan.seqs), len(plan.seqs) - num_decode, num_decode, len(b.input_ids),
            sorted({s.seq.slot for s in plan.seqs}), len(self.scheduler.waiting), self.allocator.num_free,
        )  # fmt: skip
        return b

    def _launch(self, b: Batch, kind: str) -> Launched:
        """Queues the step's work on the device: forward, logits of the sampled rows, sampling,
        and a copy of the sampled tokens and logprobs into pinned host memory."""
        if self.ranks is not None:
            try:
                return self._launch_on_device(b, kind)
            except Exception as exc:  # the other ranks are in this step's collectives: no way to go on
                self.ranks.fail(f"rank 0's forward step failed: {type(exc).__name__}: {exc}")
                raise
        if self.device.type != "cuda":
            return self._launch_on_device(b, kind)
        with torch.cuda.device(self.device):  # a worker thread starts on GPU 0; Triton launches on the current GPU
            return self._launch_on_device(b, kind)

    def _launch_on_device(self, b: Batch, kind: str) -> Launched:
        """The step's work queued (runner.py) with the engine's graphs as they are now."""
        return self.runner.launch(b, kind, self.graphs, self.mixed_graphs)

    def _collect(self, launched: Launched) -> tuple[list[int], list[float]]:
        """The step's sampled tokens and logprobs (its device work is done); records its time."""
        token_ids, logprobs, step = self.runner.collect(launched)
        self.step_times.append(step)
        self.step_totals[launched.kind].add(step)
        self.slow_steps.observe(
            step,
            self.kernel_builds.count if self.kernel_builds is not None else None,
            (self.gc_pauses.count, self.gc_pauses.seconds),
        )
        if len(self.step_times) > 2000:
            del self.step_times[:1000]
        return token_ids, logprobs

    def _release_deferred(self) -> None:
        """After the loop stopped (and its steps ended): every lease held for a step goes back."""
        for _, lease in self._deferred_releases:
            self.slots.release(lease)
        self._deferred_releases.clear()
        self._stepping.clear()
