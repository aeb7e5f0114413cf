"""A collected step's tokens to the requests: appended to their sequences (ending those at eos or
their length), detokenized off the event loop, cut at stop strings and queued on each request's
stream; and the other ends of a request (cancelled at shutdown, failed with a StatusError).

A request's stream gets one GenerationOutput per token, the last one with its finish_reason, or
one StatusError in its place. A request already ended (done) gets nothing more: tokens of steps
launched before its end are dropped.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from loraserve.errors import StatusError

from ..slots import SlotLease
from .requests import GenerationOutput
from .sampler import SamplingParams, find_stop
from .scheduler import SchedulePlan, Scheduler, Sequence


@dataclass(eq=False)
class Run:
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


class NewToken(NamedTuple):
    """A sampled token of a live request, to deliver."""

    run: Run
    token_id: int
    logprob: float
    finish: str | None  # "eos" / "length" (decided when appended) or None


class Delivery:
    """The live requests (`runs`, by seq_id) and the way out to their streams. Everything but the
    detokenizing runs on the engine's event loop."""

    def __init__(self, scheduler: Scheduler, tokenizer, max_model_len: int):
        self.runs: dict[int, Run] = {}
        self._scheduler = scheduler
        self._tokenizer = tokenizer
        self._max_model_len = max_model_len
        # its own thread: a prompt being tokenized never holds up the streams' detokenizing
        self._detokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="detokenize")

    def append(self, plan: SchedulePlan, token_ids: list[int], logprobs: list[float]) -> list[NewToken]:
        """Adds each sampled token of `plan`'s step to its sequence (the next step's input) and ends
        the sequences that reached eos or their length, so no later step schedules them. A token in
        place of a placeholder (a step launched ahead was planned on it) replaces it. Returns the
        tokens of live requests, for `deliver`."""
        sampled = iter(zip(token_ids, logprobs))
        eos = self._tokenizer.eos_token_ids
        new = []
        for s in plan.seqs:
            if not s.needs_sample:
                continue
            token_id, logprob = next(sampled)
            run = self.runs.get(s.seq.seq_id)
            if run is None or run.done:  # cancelled while the step ran, or ended by a stop string
                continue
            seq = run.seq
            at = s.context_len + s.num_tokens  # the new token's index in the sequence
            if at < len(seq.token_ids):  # the placeholder the next step was planned with
                seq.token_ids[at] = token_id
            else:
                self._scheduler.append_token(seq, token_id)
            finish = None
            if token_id in eos:
                finish = "eos"
            elif at + 1 - seq.num_prompt_tokens >= run.params.max_tokens or at + 1 >= self._max_model_len:
                finish = "length"
            if finish is not None:
                self._scheduler.finish(seq)
            new.append(NewToken(run, token_id, logprob, finish))
        return new

    async def deliver(self, new: list[NewToken]) -> None:
        """Detokenizes the new tokens off the loop that serves the streams, then emits them."""
        if not new:
            return
        pieces = await asyncio.get_running_loop().run_in_executor(  # off the loop that serves the streams
            self._detokenizer_thread, lambda: ["" if f == "eos" else r.decoder.push(t) for r, t, _, f in new]
        )
        for (run, token_id, logprob, finish), piece in zip(new, pieces):
            if not run.done:  # not cancelled meanwhile
                self._emit(run, token_id, logprob, piece, finish)

    def _emit(self, run: Run, token_id: int, logprob: float, piece: str, finish: str | None) -> None:
        """Applies stop strings to one new token's text `piece` (eos and length were decided by
        `append`: `finish`), queues the output."""
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
            cached_tokens=seq.num_cached_tokens or 0,
            prefix_cacheable=seq.cache_seed is not None,
        )
        run.emitted = end
        run.emitted_tokens += 1
        run.queue.put_nowait(out)
        if finish is not None:
            run.done = True
            self._scheduler.finish(seq)

    def finish(self, run: Run, reason: str) -> None:
        """Ends a live request with a last, empty output (e.g. on shutdown)."""
        if run.done:
            return
        run.done = True
        self._scheduler.finish(run.seq)
        run.queue.put_nowait(
            GenerationOutput(
                run.request_id,
                [],
                run.text[run.emitted :],
                [],
                reason,
                run.seq.num_prompt_tokens,
                run.lease.digest if run.lease else "",
                run.seq.num_cached_tokens or 0,
                run.seq.cache_seed is not None,
            )  # fmt: skip
        )

    def fail(self, seq: Sequence, error: StatusError) -> None:
        """Ends `seq` and its request, if live, with `error` (raised in its stream)."""
        self._scheduler.finish(seq)
        run = self.runs.get(seq.seq_id)
        if run is not None and not run.done:
            run.done = True
            run.queue.put_nowait(error)
