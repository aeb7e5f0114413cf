"""The async engine: requests in, a background step loop, token streams out.

    generate(req) --size check, tokenize (thread), validate, acquire adapter slot--> Scheduler.waiting
    step loop:  schedule -> flatten (input_ids, positions, block tables, token slots)
                -> launch: decode steps replay a CUDA graph per batch bucket and steps with a prefill
                   chunk one per token bucket (executor/engine/graphs.py), from the loop; steps no
                   graph takes run model.forward + compute_logits eagerly in a worker thread;
                   then sampling on the device and one copy of the sampled tokens and logprobs
                   into pinned host memory
                -> while the device computes: the previous step's outputs are delivered
                -> wait (in a thread) for the copy; append tokens, then deliver: detokenize (thread),
                   stop strings -> each request's queue

With tensor parallelism (`ranks`: executor/ranks.py) this is rank 0: each eager step's inputs go
to ranks 1..N-1 first, then every rank runs the same `forward_step` on its shard of the model
(no decode graphs, so no step is launched ahead).

The device wait and the eager forward run in threads, so the event loop keeps serving gRPC and
adapter loads while the model computes; tokenizing and detokenizing run in their own threads too (a long
prompt never stalls other streams), and text prompts above `max_prompt_bytes` are refused
before they are tokenized. A sequence's lease is released only when no step in flight uses it,
so its slot is never overwritten under a running forward.
"""

from __future__ import annotations

import asyncio
import itertools
from concurrent.futures import ThreadPoolExecutor
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, fields
from typing import NamedTuple

import grpc
import torch

from loraserve.errors import StatusError, exhausted, invalid, precondition, unavailable
from loraserve.kernels.reference import GATHER_MAX_TOKENS
from loraserve.kernels.tuning import tuned_token_counts

from .. import cublas
from ..config import ExecutorConfig
from ..lora import lora_modules, warm_slot_scatter
from ..slots import SlotLease, SlotManager
from .graphs import DecodeBatch, DecodeGraphs, MixedBatch, MixedGraphs, SamplingInputs
from .kv_cache import BlockAllocator, KVCache
from .sampler import SamplingParams, find_stop, greedy, make_generator, sample, validate_request
from .scheduler import SchedulePlan, Scheduler, Sequence
from .step import StepInputs, forward_step
from .builds import watch_builds
from . import gil_handoff
from .gc_pauses import engine_started, engine_stopped, watch_gc
from .slow_steps import SlowSteps
from .warmup import token_ladder, warm_up, warm_up_steps

log = logging.getLogger(__name__)

FINISH_REASONS = ("length", "stop", "eos", "cancelled")


def _nothing() -> None:
    pass


def _not_landed() -> bool:
    return False  # a queued sequence's readiness until its adapter's slot lease exists


@dataclass
class GenerationRequest:
    """Exactly one of prompt (raw text), messages (chat) or prompt_token_ids."""

    request_id: str = ""
    adapter: str = ""  # "": the base model alone
    prompt: str | None = None
    messages: list[dict] | None = None  # [{"role": ..., "content": ...}]
    prompt_token_ids: list[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)  # max_tokens None: the default
    return_logprobs: bool = False
    deadline: float | None = None  # time.monotonic() seconds; None: no deadline


@dataclass
class GenerationOutput:
    """What one step produced for one request; the last one carries finish_reason."""

    request_id: str
    token_ids: list[int]
    text: str  # new text since the previous output
    logprobs: list[float]  # one per token id when return_logprobs, else empty
    finish_reason: str | None  # one of FINISH_REASONS, on the last output only
    prompt_tokens: int
    adapter_digest: str


@dataclass(eq=False)
class _Run:
    """Engine-side state of one request while its sequence lives."""

    request_id: str
    seq: Sequence
    params: SamplingParams
    return_logprobs: bool
    lease: SlotLease | None
    generator: torch.Generator | None
    decoder: object  # the tokenizer's IncrementalDecoder
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    text: str = ""  # output text decoded so far
    emitted: int = 0  # chars of text delivered
    searched: int = 0  # chars of text already searched for stop strings
    emitted_tokens: int = 0  # tokens delivered to the stream (a step launched ahead may have added more)
    done: bool = False


@dataclass
class _Batch:
    """One step's host-side inputs, copied out of the scheduler's state for the worker thread."""

    input_ids: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    token_slots: list[int]
    sample_rows: list[int]  # index of the last token of each sequence that samples
    sample_slots: list[int]
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    generators: list[torch.Generator | None]
    leases: list[SlotLease]
    sources: list[int]  # per token: -1, or the previous step's sample row its id comes from (PENDING)
    slot_adapters: dict[int, tuple[str, str]] = field(default_factory=dict)  # TP only: slot -> (adapter, digest)
    slot_ranks: list[int] | None = None  # each slot's adapter rank (SlotManager.slot_ranks), None: no LoRA in the step

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)


@dataclass
class _Launched:
    """A step queued on the device: `out` ([2, rows] float64, token ids and logprobs; pinned host
    memory on CUDA) is readable once `event` (recorded after the step's work on CUDA, None elsewhere)
    has completed."""

    kind: str
    num_seqs: int
    num_tokens: int
    t0: float  # perf_counter at launch
    out: torch.Tensor | None
    event: torch.cuda.Event | None = None
    kept: bool = False  # its sampled tokens are in the graphs' buffer (a next step may read them)
    ahead: bool = False  # launched before the previous step's tokens reached the host
    host: torch.Tensor | None = None  # the pinned buffer `out` is a view of (back to the engine's pool once read)
    launch_seconds: float = 0.0  # host time `_launch_on_device` took
    start: torch.cuda.Event | None = None  # recorded before the step's work (CUDA; timing)


class StepTime(NamedTuple):
    """One collected step, as the engine records it (times are time.perf_counter())."""

    kind: str  # one of STEP_KINDS
    num_seqs: int
    num_tokens: int
    seconds: float  # from its launch to its sampled tokens on the host
    end: float  # when its tokens were on the host
    launched: float  # when it was launched
    ahead: bool  # launched before the previous step's tokens reached the host
    launch_seconds: float = 0.0  # host time queuing its work (Python launches, graph staging)
    device_seconds: float | None = None  # CUDA: from the device starting its work to ending it


@dataclass
class StepTotals:
    """Every collected step of one kind since start (metrics, serve.py).

    launch_seconds near seconds says the host set the steps' pace (the device waited for
    launches); device_seconds is the device's span from each step's first queued work to its
    last, gaps included (CUDA only), so seconds - device_seconds is the time the step was not on
    the device at all (waiting behind the previous step, or its tokens' trip to the host)."""

    steps: int = 0
    seconds: float = 0.0
    sequences: int = 0
    tokens: int = 0
    launch_seconds: float = 0.0
    device_seconds: float = 0.0

    def add(self, t: StepTime) -> None:
        self.steps += 1
        self.seconds += t.seconds
        self.sequences += t.num_seqs
        self.tokens += t.num_tokens
        self.launch_seconds += t.launch_seconds
        self.device_seconds += t.device_seconds or 0.0

    def minus(self, before: "StepTotals") -> "StepTotals":
        return StepTotals(*(getattr(self, f.name) - getattr(before, f.name) for f in fields(StepTotals)))


@dataclass
class _InFlight:
    plan: SchedulePlan
    launched: _Launched | None


PENDING = -1  # a token id the previous step is still sampling (on the device)
# A step's kind: a decode step replayed from a captured graph, or run eagerly (a batch larger than the
# largest graph, or no graphs); a step with a prefill chunk ("mixed") replayed, or run eagerly.
STEP_KINDS = ("decode-graph", "decode", "mixed-graph", "mixed")


class Engine:
    def __init__(self, model, tokenizer, kv_cache: KVCache, slot_manager: SlotManager, config: ExecutorConfig,
                 ranks=None):
        self.model = model
        self.ranks = ranks  # executor/ranks.py's TPRanks under tensor parallelism, else None
        self.tokenizer = tokenizer
        self.kv_cache = kv_cache
        self.slots = slot_manager
        self.config = config
        self.device = config.torch_device
        cublas.without_workspace(str(self.device))  # in-process engines too (benchmarks), before the warm-up's GEMMs
        self.vocab_size = model.cfg.vocab_size
        spec = getattr(model, "lora_spec", None)
        self.max_loras = spec.max_loras if spec is not None else 0  # slot buffers' leading dim
        self.allocator = BlockAllocator(kv_cache.num_blocks)
        self.scheduler = Scheduler(
            self.allocator, kv_cache.block_size, config.max_num_seqs, config.max_num_batched_tokens,
            max_admit_delay=config.max_admit_delay_steps,
        )
        self._runs: dict[int, _Run] = {}  # seq_id -> run
        self._seq_ids = itertools.count()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stepping: dict[Sequence, int] = {}  # sequences of the steps in flight -> how many
        self._deferred_releases: list[tuple[Sequence, SlotLease]] = []  # held until their steps end
        self._prev_rows: dict[Sequence, int] = {}  # the last launched step's sample row of each sequence
        self._acquiring = 0  # queued requests whose adapter has no slot lease yet
        # One thread each: a prompt being tokenized never holds up the streams' detokenizing.
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._detokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="detokenize")
        # Triton builds (builds.py, CUDA): the warm-up's and the captures' are expected, later ones
        # hold a serving step and are logged and counted (the counter is the process's: disarmed here
        # so a second engine's warm-up does not count)
        self.kernel_builds = watch_builds() if self.device.type == "cuda" else None
        if self.kernel_builds is not None:
            self.kernel_builds.armed = False
        self.warm_up_seconds = self._warm_up()
        self.graphs = self._capture_graphs()
        self.mixed_graphs = self._capture_mixed_graphs()
        if self.kernel_builds is not None:
            self.kernel_builds.armed = True
        self.gc_pauses = watch_gc()  # every collection timed (gc_pauses.py); start() freezes start-up's objects
        self._frozen = False
        self._switch_set = False  # this engine counts among gil_handoff's engines that set the switch interval
        # admission pacing only where it pays: with graphs a decode step is cheap, and an admitting
        # step is a prefill (eager or from a mixed graph: still a larger step)
        self.scheduler.admit_ratio = config.admit_ratio if self.graphs is not None else 0.0
        if self.graphs is not None:
            self.scheduler.pace_max_running = self.graphs.max_batch  # larger batches decode eagerly
        self.step_times: list[StepTime] = []  # the collected steps, latest last (benchmarks and tests read them)
        # every collected step since start, by kind (metrics, serve.py)
        self.step_totals: dict[str, StepTotals] = {k: StepTotals() for k in STEP_KINDS}
        self.slow_steps = SlowSteps(STEP_KINDS)  # steps far slower than their kind's recent ones: logged, counted
        self.steps_ahead = 0  # steps planned before the previous step's tokens reached the host
        # the sampling steps' temperature / top-k / top-p, staged as the graphs' inputs are (see _sample)
        self.sampling_inputs = SamplingInputs(config.max_num_seqs, self.device)
        # pinned buffers for the steps' sampled tokens, allocated before serving (see _pinned_out)
        self._out_pool: list[torch.Tensor] = [
            torch.empty(2 * config.max_num_seqs, dtype=torch.float64, pin_memory=True) for _ in range(4)
        ] if self.device.type == "cuda" else []

    def _warm_up(self) -> float | None:
        """Builds the eager steps' Triton kernels before the first request (executor/engine/warmup.py):
        on CUDA, on every rank; the seconds it took, None off CUDA."""
        if self.device.type != "cuda":
            return None
        cfg, kv = self.config, self.kv_cache
        spec = getattr(self.model, "lora_spec", None)
        steps = warm_up_steps(cfg.max_num_batched_tokens, cfg.max_model_len, kv.block_size, kv.num_blocks,
                              self.max_loras, self.model.cfg.vocab_size, tuned_token_counts(self.device),
                              packed_rank=spec.max_rank if spec is not None and spec.packed_b else 0)

        def run(step: StepInputs) -> None:
            if self.ranks is not None:
                self.ranks.step(step)
            with torch.cuda.device(self.device):
                logits = forward_step(self.model, kv, step, self.max_loras, self.device)
                if logits is not None:
                    greedy(logits)  # the sampler's fused greedy kernel (kernels.greedy) too

        seconds = warm_up(run, steps, self.device)
        if self.ranks is None:  # (under TP, compute_logits gathers across ranks: their steps warm it)
            # the lm_head (a skinny GEMM at up to 64 rows, kernels/triton_linear.py) at every
            # sampled-row count an eager step may bring: the ladder's steps sample 1-2 rows (the
            # greedy kernel above is built once for any row count)
            rows = token_ladder(cfg.max_num_seqs)
            hidden = torch.zeros(rows[-1], self.model.cfg.hidden_size, dtype=self.model.dtype, device=self.device)
            with torch.cuda.device(self.device):
                for n in rows:
                    self.model.compute_logits(hidden[:n], None)
                torch.cuda.synchronize(self.device)
        modules = lora_modules(self.model).values()
        if self.max_loras and modules:  # the slot-load kernel too, each word width (slot 0 holds nothing yet:
            # zeroing it changes nothing)
            with torch.cuda.device(self.device):
                warm_slot_scatter(modules, 0)
                torch.cuda.synchronize(self.device)
        return seconds

    def _capture_graphs(self) -> DecodeGraphs | None:
        """Decode-step CUDA graphs, on CUDA unless config.enforce_eager or the RoPE is dynamic.
        A failed capture (e.g. out of memory) stops the start, with its error."""
        if self.device.type != "cuda" or self.config.enforce_eager:
            return None
        if self.ranks is not None:
            log.warning("CUDA graphs off: %s steps run eagerly", self.ranks.role)
            return None
        if self.model.cfg.rope_type == "dynamic":
            log.warning("CUDA graphs off: dynamic RoPE scaling depends on each step's longest sequence")
            return None
        moe = bool(self.model.cfg.num_experts)
        if moe and self.model.dtype == torch.float32:
            # Measured on a CUDA host: capture fails with expert LoRA in float32 (the reference
            # shrink groups tokens on the host past GATHER_MAX_TOKENS pairs).
            log.warning("CUDA graphs off: float32 mixture-of-experts decode steps run eagerly")
            return None
        max_batch = self.config.max_num_seqs
        if self.max_loras and self.model.dtype == torch.float32:
            # The Triton LoRA kernels take fp16/bf16; the float32 reference path is free of host
            # syncs (capturable) only up to GATHER_MAX_TOKENS tokens. Larger batches run eagerly.
            max_batch = min(max_batch, GATHER_MAX_TOKENS)
        graphs = DecodeGraphs(
            self.model, self.kv_cache, max_batch, self.config.max_model_len, self.max_loras, self.device
        )
        if not moe:
            graphs.capture()
            return graphs
        # bf16 / fp16 MoE: the fused MoE kernels replay in CUDA graphs (benchmarks/bench_moe.py) and
        # the static-buffer step equals the eager one (tests/executor/test_graphs.py), but the
        # engine's capture of a MoE model has not run on a CUDA host yet: if it fails, serve eagerly.
        try:
            graphs.capture()
        except Exception as exc:  # noqa: BLE001 - any capture error: the eager path still serves
            log.warning("CUDA graphs off: capturing the mixture-of-experts decode step failed (%s: %s); "
                        "decode steps run eagerly", type(exc).__name__, exc)
            torch.cuda.synchronize(self.device)
            return None
        return graphs

    # ---- lifecycle ------------------------------------------------------------------------

    def _capture_mixed_graphs(self) -> MixedGraphs | None:
        """Graphs of mixed steps (executor/engine/graphs.py, MixedGraphs) wherever decode steps have
        graphs, for fp16 / bf16 dense models (float32 LoRA groups tokens on the host past a few
        hundred: not capturable; mixture-of-experts prefill steps have not been captured on a CUDA
        host yet). Their own memory pool: a failed capture (e.g. out of memory for the activations of
        its largest bucket) is logged, gives its memory back, and mixed steps run eagerly."""
        if (self.graphs is None or not self.config.mixed_graphs or self.model.cfg.num_experts
                or self.model.dtype == torch.float32):
            return None
        cfg = self.config
        mixed = MixedGraphs(self.model, self.kv_cache, cfg.max_num_batched_tokens, cfg.max_num_seqs,
                            cfg.max_model_len, self.max_loras, self.device)
        try:
            mixed.capture()
            return mixed
        except Exception as exc:  # noqa: BLE001 - the eager path still serves every step
            log.warning("CUDA graphs of mixed steps off: their capture failed (%s: %s); steps with a prefill "
                        "chunk run eagerly", type(exc).__name__, exc)
        # past the handler: its traceback no longer holds the graphs, so their pool can go back
        mixed = None
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="engine-step-loop")
            self._task.add_done_callback(self._on_loop_exit)
        if not self._frozen:
            # start-up's objects (imports, model, warm-up, graphs) out of the garbage collector's walks:
            # a full walk of them held the event loop for a few hundred ms (gc_pauses.py)
            self._frozen = True
            self._switch_set = gil_handoff.engine_started(self.config.switch_interval_us) is not None
            frozen = engine_started()
            if frozen is not None:
                log.info("engine serving: %d objects of start-up frozen out of the garbage collector's walks", frozen)

    def _on_loop_exit(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        log.error("engine step loop died", exc_info=exc)
        error = StatusError(grpc.StatusCode.INTERNAL, f"engine stopped: {type(exc).__name__}: {exc}")
        for run in list(self._runs.values()):
            self._fail(run.seq, error)

    async def stop(self) -> None:
        """Stops the step loop; every live request ends with finish_reason "cancelled"."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception:  # noqa: BLE001 - the loop had died already: logged, its requests failed
                pass
            self._task = None
        self._release_deferred()
        for run in list(self._runs.values()):
            self._finish(run, "cancelled")
        if self._frozen:  # the last running engine puts start-up's objects back: this one may be dropped now
            self._frozen = False
            engine_stopped()
        if self._switch_set:
            self._switch_set = False
            gil_handoff.engine_stopped(self.config.switch_interval_us)

    # ---- requests -------------------------------------------------------------------------

    async def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """Streams the outputs of one request. Raises StatusError (before or during the stream)."""
        request_id = req.request_id or uuid.uuid4().hex
        if self._task is None or self._task.done():
            raise unavailable("the engine is not running")
        params = self._resolve(req.sampling)
        self._check_prompt_size(req)
        # From arrival on: the adapter's CPU copy is fetched (while tokenizing) and its slot kept.
        unwant = self.slots.want(req.adapter) if req.adapter else _nothing
        try:
            if req.prompt_token_ids is not None:
                prompt_ids = self._prompt_ids(req)
            else:
                prompt_ids = await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, self._prompt_ids, req)
            validate_request(
                params,
                len(prompt_ids),
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
            request_id, req.adapter, len(prompt_ids), params.max_tokens, params.temperature,
        )  # fmt: skip
        run: _Run | None = None
        lease: SlotLease | None = None
        reason = "error"
        try:
            # Queued at arrival, admitted once its adapter has landed in a slot: the queue keeps
            # arrival order, so a cold adapter's request goes before later ones once it lands.
            seq = Sequence(next(self._seq_ids), list(prompt_ids), len(prompt_ids))
            if req.adapter:
                seq.is_ready = _not_landed
            run = _Run(
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
                    lease = await self._within(self.slots.acquire(req.adapter), req.deadline, request_id)
                finally:
                    self._acquiring -= 1
                    unwant()
                run.lease, seq.slot, seq.is_ready = lease, lease.slot, lease.is_ready
            self._wakeup.set()
            while True:
                item = await self._within(run.queue.get(), req.deadline, request_id)
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

    def _resolve(self, p: SamplingParams) -> SamplingParams:
        max_tokens = self.config.default_max_tokens if p.max_tokens is None else p.max_tokens
        return SamplingParams(p.temperature, p.top_k, p.top_p, max_tokens, tuple(p.stop), p.seed)

    def _check_prompt_size(self, req: GenerationRequest) -> None:
        """Refuses what would cost too much to tokenize (or to copy), before any of it is done."""
        cfg = self.config
        if req.prompt_token_ids is not None and len(req.prompt_token_ids) > cfg.max_model_len:
            raise invalid(f"token_ids: {len(req.prompt_token_ids)} tokens, above max_model_len {cfg.max_model_len}")
        texts = [req.prompt] if req.prompt is not None else [m["content"] for m in req.messages or ()]
        size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        if size > cfg.prompt_byte_limit:
            what = "prompt" if req.prompt is not None else "chat messages"
            raise invalid(f"{what}: {size} bytes, above this executor's limit of {cfg.prompt_byte_limit} bytes "
                          f"(max_prompt_bytes; max_model_len is {cfg.max_model_len} tokens)")
        if (req.prompt or req.messages) and not getattr(self.tokenizer, "can_encode", True):
            raise precondition("this executor's model has no tokenizer: send token_ids, not text or chat")

    def _prompt_ids(self, req: GenerationRequest) -> list[int]:
        """Runs in the tokenizer thread for text and chat."""
        given = [x is not None for x in (req.prompt, req.messages, req.prompt_token_ids)]
        if sum(given) != 1:
            raise invalid("exactly one of prompt, chat messages or token_ids is required")
        if req.prompt is not None:
            if not req.prompt:
                raise invalid("prompt is empty")
            return self.tokenizer.encode(req.prompt)
        if req.messages is not None:
            if not req.messages:
                raise invalid("chat has no messages")
            try:
                return self.tokenizer.apply_chat_template(req.messages)
            except Exception as exc:  # no template in the model, or messages its template rejects
                raise invalid(f"chat: {exc}") from exc
        ids = list(req.prompt_token_ids)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise invalid(f"token_ids: {bad[0]} is outside the vocabulary of {self.vocab_size} tokens")
        return ids

    @staticmethod
    async def _within(awaitable, deadline: float | None, request_id: str):
        if deadline is None:
            return await awaitable
        try:
            return await asyncio.wait_for(awaitable, max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise StatusError(grpc.StatusCode.DEADLINE_EXCEEDED, f"request {request_id}: deadline exceeded") from None

    def _close(self, run: _Run | None, lease: SlotLease | None) -> None:
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
        can be: see `_speculate`) and step N-1's outputs are delivered (detokenizing, stop
        strings, the streams' queues and their consumers' work on this loop); then step N's
        sampled tokens are collected.

        Step N+1 launched before step N's tokens are known feeds them from the device: the
        scheduler sees a placeholder token (PENDING) per sequence, the graph reads the real ids
        that step N's sampling left in the graphs' buffer, and `_append` puts them in place. A
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
                if self._speculate(inflight):
                    plan = self._plan(admit=False)
                    if plan.seqs:
                        following = await self._start(plan)
                        if following is not None:
                            following.launched.ahead = True
                if pending is not None:  # earlier outputs go out while the device computes
                    await pending
                    pending = None
                new = await self._finish_step(inflight)
                inflight, following = following, None
                if new is not None:
                    pending = asyncio.ensure_future(self._deliver(new))
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
            self._fail(seq, exhausted(f"sequence of {len(seq.token_ids)} tokens does not fit in the KV cache"))
        return plan

    async def _start(self, plan: SchedulePlan) -> _InFlight | None:
        """Flattens and launches a planned step: a graph step from the loop itself (staging and
        replay take 0.5-2 ms of host time, serve.py's "launch"; from a worker thread it would wait for
        the GIL while the loop delivers outputs, and the device would idle), an eager one, which launches
        hundreds of kernels from Python, in a worker thread. None if the launch failed (its
        requests have failed)."""
        for s in plan.seqs:
            self._stepping[s.seq] = self._stepping.get(s.seq, 0) + 1
        step = _InFlight(plan, None)
        try:
            batch = self._flatten(plan)
            kind = self._step_kind(batch)  # decided once: the launch runs what was decided here
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
        except Exception as exc:  # noqa: BLE001 - the step's requests fail, the engine goes on
            self._step_failed(step, exc)
            return None
        self._prev_rows = {s.seq: i for i, s in enumerate(x for x in plan.seqs if x.needs_sample)}
        return step

    async def _finish_step(self, step: _InFlight) -> list[tuple] | None:
        """Waits (off the loop) for a launched step, appends its tokens -> the outputs to deliver."""
        try:
            if step.launched.event is not None:
                await asyncio.to_thread(step.launched.event.synchronize)
            token_ids, logprobs = self._collect(step.launched)
        except Exception as exc:  # noqa: BLE001 - the step's requests fail, the engine goes on
            self._step_failed(step, exc)
            return None
        self._done_stepping(step.plan)
        return self._append(step.plan, token_ids, logprobs)

    def _step_failed(self, step: _InFlight, exc: Exception) -> None:
        log.error("step of %d sequences failed", len(step.plan.seqs), exc_info=exc)
        error = StatusError(grpc.StatusCode.INTERNAL, f"forward step failed: {type(exc).__name__}: {exc}")
        for s in step.plan.seqs:
            self._fail(s.seq, error)
        self._done_stepping(step.plan)

    def _done_stepping(self, plan: SchedulePlan) -> None:
        """The step's device work is over: leases of requests closed meanwhile go back, unless a
        step still in flight uses them."""
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

    def _speculate(self, step: _InFlight) -> bool:
        """Whether the next step can be planned before `plan`'s tokens are known, and if so gives
        each of its sampled sequences that goes on a placeholder token. Only when that step
        is sure to be a graph step fed from the device: no waiting request could be admitted, every
        running sequence decodes (at most one token to compute, its last one sampled by `plan`
        unless its id is on the host), and they fit the largest graph. That step admits nobody
        (`schedule(admit=False)`): a request whose adapter lands meanwhile waits one step."""
        graphs, running = self.graphs, self.scheduler.running
        if graphs is None or not step.launched.kept or not 0 < len(running) <= graphs.max_batch:
            return False
        if self.scheduler.admits_now():
            return False  # one will be admitted: the next step is planned with it, on real ids
        sampled = {s.seq: s for s in step.plan.seqs if s.needs_sample}
        goes_on = []
        for seq in running:
            s = sampled.get(seq)
            if s is None:
                if seq.num_uncomputed > 1 or (seq.num_uncomputed == 1 and seq.token_ids[-1] == PENDING):
                    return False
                continue
            run = self._runs.get(seq.seq_id)
            if run is None or run.done or len(seq.token_ids) != s.context_len + s.num_tokens:
                continue
            if seq.num_output_tokens + 1 < run.params.max_tokens and len(seq.token_ids) + 1 < self.config.max_model_len:
                goes_on.append(seq)
        for seq in goes_on:
            self.scheduler.append_token(seq, PENDING)
        self.steps_ahead += bool(goes_on)
        return bool(goes_on)

    def _flatten(self, plan: SchedulePlan) -> _Batch:
        b = _Batch([], [], [], [], [], [], [], [], [], [], [], [], [])
        for s in plan.seqs:
            seq = s.seq
            ids = s.query_token_ids
            b.input_ids += ids
            # A placeholder (only ever a sequence's last token) is what the previous step sampled
            # in row `_prev_rows[seq]`.
            b.sources += [-1] * (len(ids) - 1) + [self._prev_rows[seq] if ids[-1] == PENDING else -1]
            b.query_lens.append(s.num_tokens)
            b.context_lens.append(s.context_len)
            b.block_tables.append(list(seq.block_table))
            b.token_slots += [seq.slot] * s.num_tokens
            run = self._runs[seq.seq_id]
            if run.lease is not None and run.lease.ready is not None:
                b.leases.append(run.lease)
            if s.needs_sample:
                b.sample_rows.append(len(b.input_ids) - 1)
                b.sample_slots.append(seq.slot)
                b.temperature.append(run.params.temperature)
                b.top_k.append(run.params.top_k)
                b.top_p.append(run.params.top_p)
                b.generators.append(run.generator)
        if max(b.token_slots, default=-1) >= 0:  # the kernels read each slot up to its adapter's rank
            b.slot_ranks = list(self.slots.slot_ranks)
        if self.ranks is not None:  # the other ranks load what rank 0 has in each slot of the step
            b.slot_adapters = {slot: self.slots.slot_version(slot) for slot in set(b.token_slots) if slot >= 0}
        num_decode = sum(s.num_tokens == 1 for s in plan.seqs)
        log.debug(
            "step: %d seqs (%d prefill, %d decode), %d tokens, slots %s, %d waiting, %d free KV blocks",
            len(plan.seqs), len(plan.seqs) - num_decode, num_decode, len(b.input_ids),
            sorted({s.seq.slot for s in plan.seqs}), len(self.scheduler.waiting), self.allocator.num_free,
        )  # fmt: skip
        return b

    def _step_kind(self, b: _Batch) -> str:
        """Which of STEP_KINDS the batch runs as."""
        if b.is_decode:
            return "decode-graph" if self.graphs is not None and len(b.query_lens) <= self.graphs.max_batch else "decode"
        graphed = self.mixed_graphs is not None and self.mixed_graphs.fits(len(b.input_ids), len(b.query_lens))
        return "mixed-graph" if graphed and max(b.sources, default=-1) < 0 else "mixed"

    def _launch(self, b: _Batch, kind: str) -> "_Launched":
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

    @torch.inference_mode()
    def _launch_on_device(self, b: _Batch, kind: str) -> "_Launched":
        t0 = time.perf_counter()
        dev = self.device
        start = None
        if dev.type == "cuda":  # the step's device span starts here: its slot copies' waits are in it
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        for lease in b.leases:
            lease.wait()  # the forward's stream waits for the slot copy (CUDA only)
        num_seqs = len(b.query_lens)
        if kind == "decode-graph":
            logits = self.graphs.run(
                DecodeBatch(b.input_ids, b.context_lens, b.block_tables, b.token_slots, b.sources, b.slot_ranks)
            )
            if len(b.sample_rows) != num_seqs:  # a 1-token chunk in the middle of a prefill samples nothing
                logits = logits[torch.tensor(b.sample_rows, dtype=torch.long, device=dev)]
        elif kind == "mixed-graph":
            logits = self.mixed_graphs.run(MixedBatch(b.input_ids, b.query_lens, b.context_lens, b.block_tables,
                                                      b.token_slots, b.sample_rows, b.sample_slots, b.slot_ranks))
            if not b.sample_rows:  # prefill chunks only: nothing samples
                logits = None
        else:
            if max(b.sources, default=-1) >= 0:
                raise RuntimeError("an eager step got placeholder tokens: only graph steps read ids from the device")
            if self.ranks is not None:  # ranks 1..N-1 run the same step on their shards
                self.ranks.step(StepInputs.of(b))
            logits = forward_step(self.model, self.kv_cache, b, self.max_loras, dev)
        launched = _Launched(kind, num_seqs, len(b.input_ids), t0, None, start=start)
        sampled = self._sample(b, logits)
        if sampled is not None:
            token_ids, logprobs = sampled
            if self.graphs is not None and len(token_ids) <= self.graphs.max_batch:
                self.graphs.keep_sampled(token_ids)  # the next step may be planned on them (PENDING)
                launched.kept = True
            launched.out = torch.stack((token_ids.double(), logprobs.double()))
        if dev.type == "cuda":  # every step, prefill chunks only too: its end is what frees leases
            if launched.out is not None:
                launched.host = self._pinned_out(launched.out.numel())
                launched.out = launched.host[: launched.out.numel()].view(launched.out.shape).copy_(
                    launched.out, non_blocking=True)
            launched.event = torch.cuda.Event(enable_timing=True)
            launched.event.record()
        launched.launch_seconds = time.perf_counter() - t0
        return launched

    def _pinned_out(self, numel: int) -> torch.Tensor:
        """A pinned float64 host buffer for a step's tokens and logprobs, from the engine's pool.

        Allocated once and reused: a page-locking allocation takes torch's host allocator (and the
        driver), which another thread may be holding for seconds while it pins a fetched adapter
        (docs/BENCHMARKS.md, pinning stalls); a step must not wait for that."""
        while True:
            try:
                buf = self._out_pool.pop()
            except IndexError:  # more steps in flight than ever before: one more buffer
                return torch.empty(max(numel, 2 * self.config.max_num_seqs), dtype=torch.float64, pin_memory=True)
            if buf.numel() >= numel:
                return buf

    def _collect(self, launched: "_Launched") -> tuple[list[int], list[float]]:
        """The step's sampled tokens and logprobs (its device work is done); records its time."""
        token_ids, logprobs = [], []
        if launched.out is not None:
            ids, logprobs = launched.out.tolist()
            token_ids = [int(t) for t in ids]
        if launched.host is not None:
            self._out_pool.append(launched.host)
            launched.host = None
        device_seconds = None
        if launched.start is not None:  # both events have completed: the step's tokens are here
            device_seconds = launched.start.elapsed_time(launched.event) / 1e3
        end = time.perf_counter()
        step = StepTime(launched.kind, launched.num_seqs, launched.num_tokens, end - launched.t0, end, launched.t0,
                        launched.ahead, launched.launch_seconds, device_seconds)
        self.step_times.append(step)
        self.step_totals[launched.kind].add(step)
        self.slow_steps.observe(step, self.kernel_builds.count if self.kernel_builds is not None else None,
                                (self.gc_pauses.count, self.gc_pauses.seconds))
        if len(self.step_times) > 2000:
            del self.step_times[:1000]
        return token_ids, logprobs

    def _sample(self, b: _Batch, logits: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Samples every row on the device -> (token ids [rows] int64, logprobs [rows] float32),
        still on the device; None for a step of prefill chunks only."""
        if logits is None:
            return None
        if any(t > 0 for t in b.temperature):
            # staged through pinned memory (on CUDA read by a kernel, not a copy that would queue
            # behind a slot load's); more rows than max_num_seqs (none expected): copied
            params = self.sampling_inputs.stage(b.temperature, b.top_k, b.top_p) or (
                torch.tensor(b.temperature, dtype=torch.float32, device=self.device),
                torch.tensor(b.top_k, dtype=torch.long, device=self.device),
                torch.tensor(b.top_p, dtype=torch.float32, device=self.device))
            token_ids, logprobs = sample(logits, *params, b.generators, any_sample=True)
        else:
            token_ids, logprobs = greedy(logits)
        return token_ids, logprobs

    def _append(self, plan: SchedulePlan, token_ids: list[int], logprobs: list[float]) -> list[tuple]:
        """Adds each sampled token to its sequence (the next step's input) and ends the sequences
        that reached eos or their length, so no later step schedules them. Returns, per new
        token, (run, token id, logprob, "eos" / "length" / None) for `_deliver`."""
        sampled = iter(zip(token_ids, logprobs))
        eos = self.tokenizer.eos_token_ids
        new = []
        for s in plan.seqs:
            if not s.needs_sample:
                continue
            token_id, logprob = next(sampled)
            run = self._runs.get(s.seq.seq_id)
            if run is None or run.done:  # cancelled while the step ran, or ended by a stop string
                continue
            seq = run.seq
            at = s.context_len + s.num_tokens  # the new token's index in the sequence
            if at < len(seq.token_ids):  # the placeholder the next step was planned with
                seq.token_ids[at] = token_id
            else:
                self.scheduler.append_token(seq, token_id)
            finish = None
            if token_id in eos:
                finish = "eos"
            elif at + 1 - seq.num_prompt_tokens >= run.params.max_tokens or at + 1 >= self.config.max_model_len:
                finish = "length"
            if finish is not None:
                self.scheduler.finish(seq)
            new.append((run, token_id, logprob, finish))
        return new

    async def _deliver(self, new: list[tuple]) -> None:
        """Detokenizes the new tokens off the loop that serves the streams, then emits them."""
        if not new:
            return
        pieces = await asyncio.get_running_loop().run_in_executor(  # off the loop that serves the streams
            self._detokenizer_thread, lambda: ["" if f == "eos" else r.decoder.push(t) for r, t, _, f in new])
        for (run, token_id, logprob, finish), piece in zip(new, pieces):
            if not run.done:  # not cancelled meanwhile
                self._emit(run, token_id, logprob, piece, finish)

    def _emit(self, run: _Run, token_id: int, logprob: float, piece: str, finish: str | None) -> None:
        """Applies stop strings to one new token's text `piece` (eos and length were decided by
        `_append`: `finish`), queues the output."""
        seq, params = run.seq, run.params
        if finish != "eos":
            run.text += piece
            cut, safe = find_stop(run.text, params.stop, run.searched)
            run.searched = safe
            if cut is not None:
                finish, run.text = "stop", run.text[:cut]
        end = len(run.text) if finish is not None else run.searched  # at the end, flush held-back text
        out = GenerationOutput(
            request_id=run.request_id,
            token_ids=[token_id],
            text=run.text[run.emitted : end],
            logprobs=[logprob] if run.return_logprobs else [],
            finish_reason=finish,
            prompt_tokens=seq.num_prompt_tokens,
            adapter_digest=run.lease.digest if run.lease else "",
        )
        run.emitted = end
        run.emitted_tokens += 1
        run.queue.put_nowait(out)
        if finish is not None:
            run.done = True
            self.scheduler.finish(seq)

    def _finish(self, run: _Run, reason: str) -> None:
        """Ends a live request with a last, empty output (e.g. on shutdown)."""
        if run.done:
            return
        run.done = True
        self.scheduler.finish(run.seq)
        run.queue.put_nowait(
            GenerationOutput(
                run.request_id, [], run.text[run.emitted :], [], reason, run.seq.num_prompt_tokens,
                run.lease.digest if run.lease else "",
            )  # fmt: skip
        )

    def _fail(self, seq: Sequence, error: StatusError) -> None:
        self.scheduler.finish(seq)
        run = self._runs.get(seq.seq_id)
        if run is not None and not run.done:
            run.done = True
            run.queue.put_nowait(error)

    def _release_deferred(self) -> None:
        """After the loop stopped (and its steps ended): every lease held for a step goes back."""
        for _, lease in self._deferred_releases:
            self.slots.release(lease)
        self._deferred_releases.clear()
        self._stepping.clear()
