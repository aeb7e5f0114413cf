"""A flattened step on the device: its forward (a decode or mixed graph replayed, or the eager
forward, on every rank under tensor parallelism), sampling, and one copy of the sampled tokens and
logprobs into pinned host memory, all queued without waiting (`StepRunner.launch`); once the device
is done, the tokens on the host and the step's times (`StepRunner.collect`)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .. import dora
from .batch import Batch
from .graphs import DecodeBatch, DecodeGraphs, MixedBatch, MixedGraphs
from .kv_cache import KVCache
from .sampler import greedy, sample
from .staging import SampledOutputs, SamplingInputs
from .step import StepInputs, forward_step
from .step_stats import StepTime


@dataclass
class Launched:
    """A step queued on the device: `out` ([2, rows] float64, token ids and logprobs; pinned host
    memory on CUDA) is readable once `event` (recorded after the step's work on CUDA, None elsewhere)
    has completed."""

    kind: str  # one of STEP_KINDS
    num_seqs: int
    num_tokens: int
    t0: float  # perf_counter at launch
    out: torch.Tensor | None
    event: torch.cuda.Event | None = None
    kept: bool = False  # its sampled tokens are in the decode graphs' buffer (a next step may read them)
    ahead: bool = False  # launched before the previous step's tokens reached the host
    host: torch.Tensor | None = None  # the pinned buffer `out` is a view of (back to the pool once read)
    launch_seconds: float = 0.0  # host time `launch` took
    start: torch.cuda.Event | None = None  # recorded before the step's work (CUDA; timing)


class StepRunner:
    """Runs flattened steps of one model and KV cache on `device` (rank 0's part under tensor
    parallelism: `ranks`, executor/ranks.py's TPRanks, gets each eager step's inputs first)."""

    def __init__(self, model, kv_cache: KVCache, max_loras: int, device: torch.device, max_num_seqs: int, ranks=None):
        self.model, self.kv_cache, self.max_loras, self.device, self.ranks = model, kv_cache, max_loras, device, ranks
        # the sampling steps' temperature / top-k / top-p, staged as the graphs' inputs are (see _sample)
        self.sampling_inputs = SamplingInputs(max_num_seqs, device)
        # pinned buffers for the steps' sampled tokens, allocated before serving
        self._outputs = SampledOutputs(max_num_seqs) if device.type == "cuda" else None

    @torch.inference_mode()
    def launch(self, b: Batch, kind: str, graphs: DecodeGraphs | None, mixed_graphs: MixedGraphs | None) -> Launched:
        """Queues `b`'s work as `kind` (batch.step_kind: a "-graph" kind replays `graphs` or
        `mixed_graphs`) after its slot copies, on the current stream; keeps the sampled tokens in
        `graphs` for a next step launched on them where they fit."""
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
            logits = graphs.run(DecodeBatch(b.input_ids, b.context_lens, b.block_tables, b.token_slots, b.sources, b.slot_ranks))
            if len(b.sample_rows) != num_seqs:  # a 1-token chunk in the middle of a prefill samples nothing
                logits = logits[torch.tensor(b.sample_rows, dtype=torch.long, device=dev)]
        elif kind == "mixed-graph":
            logits = mixed_graphs.run(
                MixedBatch(
                    b.input_ids,
                    b.query_lens,
                    b.context_lens,
                    b.block_tables,
                    b.token_slots,
                    b.sample_rows,
                    b.sample_slots,
                    b.slot_ranks,
                    b.long_rope,
                )
            )
            if not b.sample_rows:  # prefill chunks only: nothing samples
                logits = None
        else:
            if max(b.sources, default=-1) >= 0:
                raise RuntimeError("an eager step got placeholder tokens: only graph steps read ids from the device")
            if self.ranks is not None:  # ranks 1..N-1 run the same step on their shards
                b.dora_reduce = dora.take_pending(self.model, b.slot_adapters)
                self.ranks.step(StepInputs.of(b))
            logits = forward_step(self.model, self.kv_cache, b, self.max_loras, dev)
        launched = Launched(kind, num_seqs, len(b.input_ids), t0, None, start=start)
        sampled = self._sample(b, logits)
        if sampled is not None:
            token_ids, logprobs = sampled
            if graphs is not None and len(token_ids) <= graphs.max_batch:
                graphs.keep_sampled(token_ids)  # the next step may be launched on them (PENDING)
                launched.kept = True
            launched.out = torch.stack((token_ids.double(), logprobs.double()))
        if dev.type == "cuda":  # every step, prefill chunks only too: its end is what frees leases
            if launched.out is not None:
                launched.host = self._outputs.take(launched.out.numel())
                launched.out = (
                    launched.host[: launched.out.numel()].view(launched.out.shape).copy_(launched.out, non_blocking=True)
                )
            launched.event = torch.cuda.Event(enable_timing=True)
            launched.event.record()
        launched.launch_seconds = time.perf_counter() - t0
        return launched

    def _sample(self, b: Batch, logits: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Samples every row on the device -> (token ids [rows] int64, logprobs [rows] float32),
        still on the device; None for a step of prefill chunks only."""
        if logits is None:
            return None
        if any(t > 0 for t in b.temperature):
            # staged through pinned memory (staging.py: on CUDA read by a kernel, not a copy that would
            # queue behind a slot load's); more rows than max_num_seqs (none expected): copied
            params = self.sampling_inputs.stage(b.temperature, b.top_k, b.top_p) or (
                torch.tensor(b.temperature, dtype=torch.float32, device=self.device),
                torch.tensor(b.top_k, dtype=torch.long, device=self.device),
                torch.tensor(b.top_p, dtype=torch.float32, device=self.device),
            )
            return sample(logits, *params, b.generators, any_sample=True)
        return greedy(logits)

    def collect(self, launched: Launched) -> tuple[list[int], list[float], StepTime]:
        """The step's sampled tokens and logprobs, and its times (its device work is done: `event`
        has completed); its pinned buffer goes back to the pool."""
        token_ids, logprobs = [], []
        if launched.out is not None:
            ids, logprobs = launched.out.tolist()
            token_ids = [int(t) for t in ids]
        if launched.host is not None:
            self._outputs.give_back(launched.host)
            launched.host = None
        device_seconds = None
        if launched.start is not None:  # both events have completed: the step's tokens are here
            device_seconds = launched.start.elapsed_time(launched.event) / 1e3
        end = time.perf_counter()
        step = StepTime(
            launched.kind,
            launched.num_seqs,
            launched.num_tokens,
            end - launched.t0,
            end,
            launched.t0,
            launched.ahead,
            launched.launch_seconds,
            device_seconds,
        )
        return token_ids, logprobs, step
