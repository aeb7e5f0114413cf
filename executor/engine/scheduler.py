"""Continuous batching: which tokens of which sequences run in the next forward step.

Each step first serves the running sequences (one decode token each, or the next chunk of an
unfinished prefill), then admits waiting ones (FCFS, chunked prefill) while the token budget
(`max_num_batched_tokens`), the sequence budget (`max_num_seqs`) and the KV blocks last.
When a running sequence needs a block and none is free, the most recently admitted running
sequence is preempted: its blocks are freed and it goes back to the front of the waiting
queue to be recomputed later (prompt + tokens generated so far). A sequence that cannot get
a block even when it runs alone is failed rather than left to wait forever.

Admission pacing (`admit_ratio` > 0, for engines whose decode-only steps replay CUDA graphs): a
step that admits a request runs eagerly (its prefill), and with many running sequences one finishes
nearly every step, so admitting each at once makes nearly every step an eager one. While every
running sequence decodes, ready requests wait until those that fit (ready, and seats free) number
`admit_ratio` x the running ones, or the hold has lasted `max_admit_delay` steps (the clock starts
when a hold starts and stops at every admission, so a backlog does not use it up); then they are
admitted together, one eager step for all of them. Decode steps run a little smaller meanwhile (decode is bound by reading the
weights, so a step of 56 costs about what one of 64 does). A request whose prompt is cached but for
its last token (prefix caching, below) is admitted even while a hold lasts, where the batch stays
within the largest graph: it adds one decode row, so the step stays a decode step (`_decode_row`);
its admission leaves the hold's clock running.

Prefix caching (prefix_cache.py), for sequences that carry a key chain seed: an admitted
sequence first takes the longest run of its full blocks that the allocator has cached (held by
reference, never written) and computes only the rest; the token budget counts only what it
computes. Blocks a completed step filled are filed under their keys (`cache_computed`); a
preempted or finished sequence's blocks keep them until the allocator needs the blocks, so a
preempted sequence usually finds its own prefix again when it comes back. With `kv_events` set
(kv_events.py), each run of blocks it files is told to it with the run's tokens and adapter.

LongRoPE (`long_rope`: the original length): as transformers' generate picks one factor set per
forward from the sequence's length, a sequence longer than the original length takes the long
factors at every position (`Sequence.long_rope`; batch.long_rope_seqs carries it to the model). A
prompt that long is admitted so; a shorter sequence whose next token passes the length drops its
blocks and is recomputed from its first token (one prefill of about the original length, once),
under a prefix-cache key chain of its own (prefix_cache.long_rope_seed).

Dynamic (NTK) RoPE (`dynamic_rope`: max_position_embeddings): a step whose longest sequence passes
that length rotates every key it writes with a base grown for that length, and every later key of
those sequences attends to them. So a sequence in such a step never files a block from the one that
step wrote on (`Sequence.num_fileable_blocks`, until it is recomputed), and a sequence longer than
the length takes no cached blocks. That rule is conservative: a cached block holds keys rotated with
the original base, while recomputing the prefix gives keys of whatever base each prefill step has (under
chunked prefill the early chunks run in steps that do not grow it), so refusing the cache never
serves keys a recomputation could not have.

The scheduler only decides; it never runs the model. The engine turns a `SchedulePlan`
into input_ids / positions / attention metadata and reports sampled tokens back through
`append_token`.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .prefix_cache import extend_keys, long_rope_seed

if TYPE_CHECKING:
    from .kv_cache import BlockAllocator
    from .kv_events import KVEventPublisher

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Sequence:
    seq_id: int
    token_ids: list[int]  # prompt, then generated tokens
    num_prompt_tokens: int
    slot: int = -1  # LoRA slot of its adapter, -1 = base model
    is_ready: Callable[[], bool] = lambda: True  # adapter copy finished (CUDA event)
    num_computed: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    finished: bool = False
    preemptions: int = 0
    # Prefix caching (prefix_cache.py): the key chain's seed, None: never cached nor looked up
    cache_seed: bytes | None = None
    adapter: tuple[str | None, int | None] = (None, None)  # its adapter's (name, kv_events.lora_id); base: (None, None)
    block_keys: list[bytes] = field(default_factory=list)  # keys of its first full blocks
    num_keyed_blocks: int = 0  # leading blocks of block_table found in or filed into the cache
    num_cached_tokens: int | None = None  # prompt tokens found cached at its first admission; None: not admitted yet
    long_rope: bool = False  # LongRoPE: its keys take the long factors at every position (Scheduler's long_rope)
    # dynamic RoPE: leading blocks it may file; those after took a grown base (Scheduler's dynamic_rope). None: all
    num_fileable_blocks: int | None = None

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class ScheduledSeq:
    seq: Sequence
    context_len: int  # tokens already in the cache = position of the first query token
    num_tokens: int  # query tokens this step
    needs_sample: bool  # the chunk reaches the end: sample the next token from its last row
    preemptions: int = 0  # the sequence's count when planned (a later preemption voids the plan's blocks)

    @property
    def query_token_ids(self) -> list[int]:
        return self.seq.token_ids[self.context_len : self.context_len + self.num_tokens]


@dataclass
class SchedulePlan:
    seqs: list[ScheduledSeq]
    failed: list[Sequence]  # cannot fit in the KV cache even alone: the engine fails them
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        admit_ratio: float = 0.0,
        max_admit_delay: int = 0,
        long_rope: int | None = None,
        dynamic_rope: int | None = None,
    ):
        """long_rope: a LongRoPE model's original_max_position_embeddings (batch.long_rope_length), else None.
        dynamic_rope: a dynamic-RoPE model's max_position_embeddings (its base grows past it), else None."""
        self.allocator = allocator
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.admit_ratio = admit_ratio  # admission pacing (module doc); 0: admit at once
        self.max_admit_delay = max_admit_delay  # steps a hold lasts at most
        self.pace_max_running = max_num_seqs  # pace only while the running batch fits a graph (the engine sets it)
        self._hold_since: int | None = None  # step at which the current hold started
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.steps = 0  # schedule() calls
        self.deferred_steps = 0  # steps planned while pacing held ready requests back (planned-ahead ones too)
        self.kv_events: KVEventPublisher | None = None  # told of each run of filed blocks; None: nobody
        self.long_rope = long_rope
        self.dynamic_rope = dynamic_rope

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def append_token(self, seq: Sequence, token_id: int) -> None:
        seq.token_ids.append(token_id)

    def finish(self, seq: Sequence) -> None:
        """Removes a finished, cancelled or failed sequence and frees its blocks. Idempotent."""
        seq.finished = True
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)

    def schedule(self, admit: bool = True) -> SchedulePlan:
        """The next step: running sequences first, then (if admit) waiting ones, unless admission
        pacing holds them back (`admits_now`)."""
        self.steps += 1
        holding = self.admit_ratio > 0 and self._pacing_holds()  # (a step planned ahead counts too)
        if holding:
            self.deferred_steps += 1
        plan = SchedulePlan(seqs=[], failed=[], preempted=[])
        budget = self.max_num_batched_tokens
        # 1. Running sequences, oldest first.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self._passes_long_rope(seq):  # its short-factor keys are recomputed with the long factors
                self._free(seq)
                seq.num_computed = 0
                seq.preemptions += 1  # a step in flight files none of the freed blocks
                self._go_long(seq)
            n = min(seq.num_uncomputed, budget)
            if n == 0:  # nothing new to compute (its sampled token was never appended)
                i += 1
                continue
            while not self._grow(seq, seq.num_computed + n):
                victim = self.running[-1]
                if victim is seq and len(self.running) == 1:
                    self.running.pop()
                    self._free(seq)
                    seq.finished = True
                    plan.failed.append(seq)
                    break
                self._preempt(victim, plan)
                if victim is seq:
                    break
            else:
                plan.seqs.append(self._plan_one(seq, n))
                budget -= n
                i += 1
        # 2. Admit waiting sequences (FCFS; an adapter still loading does not block others).
        for seq in list(self.waiting) if admit else ():
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            if seq in plan.preempted or not seq.is_ready() or (holding and not self._decode_row(seq)):
                continue
            n = self._take_blocks(seq, budget)
            if n is None:
                break  # out of blocks: admit later, when running sequences free some
            self.waiting.remove(seq)
            self.running.append(seq)
            plan.seqs.append(self._plan_one(seq, n))
            budget -= n
            if not holding:
                self._hold_since = None  # an admission ends the hold
        return plan

    def admits_now(self) -> bool:
        """Whether the next step would admit a request (one is ready, there is room, no pacing holds it)."""
        if len(self.running) >= self.max_num_seqs or not any(seq.is_ready() for seq in self.waiting):
            return False
        if not (self.admit_ratio > 0 and self._pacing_holds(peek=True)):
            return True
        return any(seq.is_ready() and self._decode_row(seq) for seq in self.waiting)

    def _decode_row(self, seq: Sequence) -> bool:
        """Admitting waiting `seq` now adds one decode row to a batch of decoding sequences that stays
        within the largest graph (`pace_max_running`): its prompt is cached but for its last token."""
        if len(self.running) >= self.pace_max_running or (len(seq.token_ids) - 1) % self.block_size:
            return False  # (only a sequence one token past a block boundary can be one: no keys made for others)
        if self._passes_long_rope(seq):  # its admission changes its key chain (`_go_long`): not looked up before
            return False
        return len(self._cached_prefix(seq)) * self.block_size == len(seq.token_ids) - 1

    def _pacing_holds(self, peek: bool = False) -> bool:
        """Admission pacing (module doc) holds the ready requests back this step. Starts the hold's
        clock unless peek; an admission stops it (`schedule`)."""
        free = self.max_num_seqs - len(self.running)
        if not (0 < len(self.running) <= self.pace_max_running and free > 0) or any(
            seq.num_uncomputed > 1 for seq in self.running
        ):
            return False  # an idle batch, one too large for a graph, or a prefill step anyway: admit
        fit = 0  # ready requests the batch has seats for, but those admitted as decode rows (`_decode_row`)
        for seq in self.waiting:
            if fit >= free:
                break
            fit += bool(seq.is_ready() and not self._decode_row(seq))
        if fit == 0:
            if not peek:
                self._hold_since = None  # nobody held
            return False
        since = self._hold_since if self._hold_since is not None else self.steps
        holds = fit < self.admit_ratio * len(self.running) and self.steps - since < self.max_admit_delay
        if holds and not peek and self._hold_since is None:
            self._hold_since = self.steps
        return holds

    def cache_computed(self, plan: SchedulePlan) -> None:
        """Files the full blocks that `plan`'s completed step computed under their keys (prefix
        caching), for sequences still holding the blocks it was planned with. Call it after the
        step's device work is done and before its sampled tokens are appended."""
        bs = self.block_size
        grown = (
            self.dynamic_rope is not None
            and max((s.context_len + s.num_tokens for s in plan.seqs), default=0) > self.dynamic_rope
        )
        for s in plan.seqs:
            seq = s.seq
            if seq.cache_seed is None or seq.finished or seq.preemptions != s.preemptions:
                continue
            if grown:  # the step's keys took a base grown past dynamic_rope: from its first block on, none is filed
                first = s.context_len // bs
                seq.num_fileable_blocks = first if seq.num_fileable_blocks is None else min(seq.num_fileable_blocks, first)
            full = min((s.context_len + s.num_tokens) // bs, len(seq.block_table))
            if seq.num_fileable_blocks is not None:
                full = min(full, seq.num_fileable_blocks)
            if full <= seq.num_keyed_blocks:
                continue
            extend_keys(seq.block_keys, seq.cache_seed, seq.token_ids, bs, full)
            full = min(full, len(seq.block_keys))
            filed = [i for i in range(seq.num_keyed_blocks, full) if self.allocator.cache(seq.block_table[i], seq.block_keys[i])]
            if self.kv_events is not None and filed:
                self._tell_filed(seq, filed)
            seq.num_keyed_blocks = max(seq.num_keyed_blocks, full)

    def _tell_filed(self, seq: Sequence, filed: list[int]) -> None:
        """One event per run of consecutive filed blocks (a block whose key another block holds breaks a run)."""
        bs, keys, (name, lora) = self.block_size, seq.block_keys, seq.adapter
        start = filed[0]
        for j, i in enumerate(filed):
            if j + 1 == len(filed) or filed[j + 1] != i + 1:
                parent = keys[start - 1] if start else None
                self.kv_events.stored(keys[start : i + 1], parent, seq.token_ids[start * bs : (i + 1) * bs], name, lora)
                if j + 1 < len(filed):
                    start = filed[j + 1]

    def _plan_one(self, seq: Sequence, n: int) -> ScheduledSeq:
        context_len = seq.num_computed
        seq.num_computed += n
        return ScheduledSeq(seq, context_len, n, seq.num_computed == len(seq.token_ids), seq.preemptions)

    def _take_blocks(self, seq: Sequence, budget: int) -> int | None:
        """Gives a waiting sequence (no blocks, nothing computed) its cached prefix and the blocks
        for its next chunk; the chunk's token count, or None (nothing changed) if the blocks are not there."""
        if self._passes_long_rope(seq):
            self._go_long(seq)
        hits = self._cached_prefix(seq)
        reused = len(hits) * self.block_size
        n = min(len(seq.token_ids) - reused, budget)
        needed = -(-(reused + n) // self.block_size) - len(hits)
        if self.allocator.num_free - self.allocator.num_unheld(hits) < needed:
            return None
        self.allocator.share(hits)
        seq.block_table = hits + self.allocator.allocate(needed)
        seq.num_computed = reused
        seq.num_keyed_blocks = len(hits)
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = min(reused, seq.num_prompt_tokens)
        return n

    def _passes_long_rope(self, seq: Sequence) -> bool:
        """LongRoPE: seq has outgrown the original length with short-factor keys (or none yet)."""
        return self.long_rope is not None and not seq.long_rope and len(seq.token_ids) > self.long_rope

    def _go_long(self, seq: Sequence) -> None:
        """From now on seq's keys take the long factors everywhere, under a key chain of their own."""
        seq.long_rope = True
        if seq.cache_seed is not None:
            seq.cache_seed = long_rope_seed(seq.cache_seed)
        seq.block_keys = []

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks of seq's longest cached run of full blocks, short of its last token."""
        if seq.cache_seed is None or (self.dynamic_rope is not None and len(seq.token_ids) > self.dynamic_rope):
            return []
        limit = (len(seq.token_ids) - 1) // self.block_size
        extend_keys(seq.block_keys, seq.cache_seed, seq.token_ids, self.block_size, limit)
        hits = []
        for key in seq.block_keys[:limit]:
            block = self.allocator.lookup(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Makes seq's block table cover num_tokens tokens; False if the blocks are not there."""
        needed = -(-num_tokens // self.block_size) - len(seq.block_table)
        if needed <= 0:
            return True
        if self.allocator.num_free < needed:
            return False
        seq.block_table.extend(self.allocator.allocate(needed))
        return True

    def _preempt(self, seq: Sequence, plan: SchedulePlan) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.num_computed = 0
        seq.preemptions += 1
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)
        log.info("preempted seq %d (%d tokens) for lack of KV blocks", seq.seq_id, len(seq.token_ids))

    def _free(self, seq: Sequence) -> None:
        if seq.block_table:
            self.allocator.free(seq.block_table)
            seq.block_table = []
        seq.num_keyed_blocks = 0
        seq.num_fileable_blocks = None  # what it computes again is judged afresh
