"""CUDA graphs of the decode step: the whole forward and the logits, one graph per batch bucket.

A decode step launches dozens of kernels per layer; eagerly, the host's launch time per
kernel exceeds the GPU's time at small batches, so the step is host-bound. Replaying a captured
graph launches them all at once.

Every per-step input lives in one static int32 device buffer that the graphs read, staged from
a pinned host buffer each step (staging.py: read by a kernel through the buffer's device mapping):

    [ids | positions | slot mapping | seq_lens | LoRA slots | sources]  each max_batch long, then
    [slot ranks]                                                        max_loras, then
    [block tables]                                                      max_batch x width

The slot ranks (each slot's adapter rank, LoraMeta.slot_ranks) let the LoRA kernels read a
rank-8 adapter's rank-8 bytes from a rank-64 slot.

A row whose source is >= 0 takes its input id not from `ids` but from the token the previous
step sampled in that row (`keep_sampled` leaves them in a device buffer): so the engine can launch
a step before the previous one's tokens reach the host.

A batch of B sequences replays the graph of the smallest bucket >= B; rows B.. of the bucket are
padding: they read and write only the KV cache's scratch block and use no adapter. Each bucket
has two graphs: the base model alone (no LoRA kernels at all) and with LoRA (LoraMeta and the
shrink/expand kernels of every layer; all slots' full-rank buffers, nothing skipped on the host).
The LoRA graph's step builds its LoraMeta with the block list of 16-row decode tiles (one Triton
program on CUDA, kernels/triton_meta.py) and zeroes one workspace for every layer's shrink output
(a split-K shrink adds into zeros; one memset for all layers, not one node per layer).

Mixed steps (prefill chunks, with or without decode rows) replay graphs too (MixedGraphs): one per
token bucket (64, 128, 256, then every 256 up to max_num_batched_tokens), base and LoRA, in a memory
pool of their own. Eagerly such a step is host-bound: ~2,700 Python-level operations (~420 kernel
launches for an 8B model with LoRA, ~1,350 tokens) take longer on the host than the step on the
device. A mixed graph reads its tokens, sequences,
block tables and the prefill attention's work list (kernels/attention_plan.py: the grid is fixed by
the bucket, each program takes its sequence and query block from the list) from one static buffer;
padding tokens write only the scratch block (their attention rows are never written: whatever
they hold flows only through their own rows, every op past attention being row-wise), padding
sequences have no queries, and the logits are those of up to min(max_num_seqs, bucket) sampled rows.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from loraserve.kernels import make_lora_meta
from loraserve.kernels.attention_plan import prefill_queries, prefill_work_list
from loraserve.kernels.meta import FULL_RANK, ShrinkWorkspace

from ..lora import LinearWithLoRA, lora_modules
from .kv_cache import AttentionMetadata, KVCache, place_tokens
from .staging import StagedInputs

log = logging.getLogger(__name__)

_FIELDS = 6  # ids, positions, slot mapping, seq_lens, LoRA slots, sources
# The decode tiles' token rows (all but one decode entry of the H100 table, and the defaults up to
# tuning.DECODE_MAX_TOKENS): a decode step's LoraMeta builds that block list up front, in one
# program on CUDA; a kernel whose config asks other rows builds its list from the meta's torch ops
# in the graph.
DECODE_BLOCK_M = 16


def _ladder(small: tuple[int, ...], step: int, largest: int) -> list[int]:
    """The `small` sizes below `largest`, then every `step` from the next multiple past them, then `largest`."""
    buckets = [b for b in small if b < largest]
    buckets += list(range(max(small) // step * step + step, largest, step))
    return buckets + [largest]


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_batch (which is always the last bucket)."""
    return _ladder((1, 2, 4), 8, max_batch)


@dataclass
class DecodeBatch:
    """The host-side inputs of a decode step of B sequences (one query token each)."""

    input_ids: list[int]  # [B] the token each sequence feeds in
    positions: list[int]  # [B] its position (= tokens already cached)
    block_tables: list[list[int]]
    lora_slots: list[int]  # [B] -1 = base model
    sources: list[int] | None = None  # [B] -1: input_ids[i]; r >= 0: the previous step's sampled row r
    slot_ranks: list[int] | None = None  # [max_loras] each slot's adapter rank; None: read slots whole


def shrink_floats_per_token(model) -> int:
    """Float32 values one token's shrink outputs take over every LoRA linear layer of a step
    (slices x slot rank each; the embedding's LoRA gathers instead and takes none)."""
    return sum(m.lora_a.shape[1] * m.lora_a.shape[2] for m in lora_modules(model).values() if isinstance(m, LinearWithLoRA))


class _StepGraphs(StagedInputs):
    """What decode and mixed graphs share: replaying a captured (bucket, LoRA) graph, and their
    staged inputs."""

    _graphs: dict

    def _replay(self, bucket: int, lora: bool) -> None:
        if self.device.type != "cuda":  # nothing captured: the same step, run directly (tests use it)
            self._forward(bucket, lora)
        else:
            with torch.cuda.device(self.device):
                self._graphs[(bucket, lora)].replay()


class DecodeGraphs(_StepGraphs):
    def __init__(self, model, kv: KVCache, max_batch: int, max_model_len: int, max_loras: int, device):
        self.model, self.kv, self.max_loras = model, kv, max_loras
        self.device = torch.device(device)
        self.buckets = batch_buckets(max_batch)
        self.max_batch = max_batch
        self.width = -(-max_model_len // kv.block_size)  # block-table columns
        self._tables_at = _FIELDS * max_batch + max_loras  # the slot ranks sit between fields and tables
        size = self._tables_at + max_batch * self.width
        self._stage_buffers(size)
        # One logits buffer that every graph writes: a graph's own output would stay allocated
        # for its lifetime, and the buckets' rows of vocab floats grow with max_batch squared.
        self._logits = torch.empty(max_batch, model.cfg.vocab_size, dtype=torch.float32, device=self.device)
        self._sampled = torch.zeros(max_batch, dtype=torch.int32, device=self.device)  # the last step's tokens
        # Every LoRA layer's shrink output of a step, zeroed once per step (not one memset per layer).
        self._shrink_per_token = shrink_floats_per_token(model) if max_loras else 0
        self._shrink_ws = torch.zeros(max_batch * self._shrink_per_token, dtype=torch.float32, device=self.device)
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self._pool = None

    # ---- capture --------------------------------------------------------------------------

    def capture(self) -> None:
        """Captures every (bucket, LoRA or not) graph, largest first so they share one memory pool."""
        t0 = time.perf_counter()
        self._fill_padding(self.max_batch, 0)
        self._host_np[_FIELDS * self.max_batch : self._tables_at] = FULL_RANK
        self._dev.copy_(self._host)
        variants = (False, True) if self.max_loras else (False,)
        with torch.cuda.device(self.device):  # Triton launches and the capture stream follow it
            for bucket in reversed(self.buckets):
                for lora in variants:
                    self._graphs[(bucket, lora)] = self._capture_one(bucket, lora)
            torch.cuda.synchronize(self.device)
        log.info(
            "captured %d CUDA graphs of the decode step (batch buckets %s%s) in %.1fs",
            len(self._graphs), self.buckets, ", base and LoRA" if self.max_loras else "", time.perf_counter() - t0,
        )  # fmt: skip

    def _capture_one(self, bucket: int, lora: bool):
        graph = _capture(lambda: self._forward(bucket, lora), self._pool, self.device)
        self._pool = graph.pool()
        return graph

    @torch.inference_mode()
    def _forward(self, bucket: int, lora: bool) -> None:
        """The captured step, reading only views of the static buffer: logits [bucket, vocab]
        float32 into the shared logits buffer."""
        n, dev = self.max_batch, self._dev
        ids, positions, slot_mapping, seq_lens, lora_slots, sources = (dev[i * n : i * n + bucket] for i in range(_FIELDS))
        tables = dev[self._tables_at :].view(n, self.width)[:bucket]
        ids = torch.where(sources >= 0, self._sampled[sources.clamp(min=0).long()], ids)
        positions = positions.long()
        attn = AttentionMetadata(
            slot_mapping=slot_mapping.long(), positions=positions, block_tables=tables, seq_lens=seq_lens,
            cu_query_lens=None, max_query_len=1, is_decode=True,
        )  # fmt: skip
        meta = None
        if lora:
            meta = make_lora_meta(
                lora_slots, self.max_loras, slot_ranks=dev[_FIELDS * n : self._tables_at], block_m=DECODE_BLOCK_M
            )
            workspace = self._shrink_ws[: bucket * self._shrink_per_token]
            workspace.zero_()
            meta.shrink_workspace = ShrinkWorkspace(workspace)
        hidden = self.model.forward(ids, positions, attn, self.kv, meta)
        self._logits[:bucket].copy_(self.model.compute_logits(hidden, meta))

    # ---- replay ---------------------------------------------------------------------------

    def bucket_for(self, num_seqs: int) -> int | None:
        for b in self.buckets:
            if b >= num_seqs:
                return b
        return None

    def graph(self, num_seqs: int, lora: bool) -> torch.cuda.CUDAGraph:
        """The graph a batch of num_seqs replays (benchmarks time its replay alone)."""
        return self._graphs[(self.bucket_for(num_seqs), lora and self.max_loras > 0)]

    def run(self, batch: DecodeBatch) -> torch.Tensor:
        """Fills the static inputs, replays the bucket's graph -> logits [B, vocab] float32 (a view
        of the shared logits buffer).

        The view is valid until the next run; the caller reads it (sampling) before then. Rows of
        the block tables past a sequence's blocks keep ids of earlier steps: the attention kernels
        never read a table entry at or past seq_len.
        """
        self._replay(*self.stage(batch))
        return self._logits[: len(batch.input_ids)]

    def keep_sampled(self, token_ids: torch.Tensor) -> None:
        """Keeps a step's sampled tokens [rows] on the device for the next step's sources."""
        self._sampled[: len(token_ids)].copy_(token_ids)

    def stage(self, batch: DecodeBatch) -> tuple[int, bool]:
        """Fills the static inputs for batch: -> (its bucket, whether it needs the LoRA graph).
        `run` does it before each replay; benchmarks call it to replay a given batch alone."""
        num_seqs = len(batch.input_ids)
        bucket = self.bucket_for(num_seqs)
        if bucket is None:
            raise ValueError(f"{num_seqs} sequences exceed the largest captured batch {self.max_batch}")
        lora = self.max_loras > 0 and max(batch.lora_slots) >= 0
        self._swap_hosts()
        self._fill(batch, bucket)
        used = self._tables_at + bucket * self.width  # the block tables come last
        self._upload(used)
        return bucket, lora

    def _fill(self, batch: DecodeBatch, bucket: int) -> None:
        n, bs, h = self.max_batch, self.kv.block_size, self._host_np
        b = len(batch.input_ids)
        pos = np.asarray(batch.positions, dtype=np.int64)
        tables = h[self._tables_at :].reshape(n, self.width)
        for i, table in enumerate(batch.block_tables):
            tables[i, : len(table)] = table
        h[0:b] = batch.input_ids
        h[n : n + b] = pos
        h[2 * n : 2 * n + b] = tables[np.arange(b), pos // bs] * bs + pos % bs
        h[3 * n : 3 * n + b] = pos + 1
        h[4 * n : 4 * n + b] = batch.lora_slots
        h[5 * n : 5 * n + b] = -1 if batch.sources is None else batch.sources
        h[_FIELDS * n : self._tables_at] = FULL_RANK if batch.slot_ranks is None else batch.slot_ranks
        self._fill_padding(bucket, b)

    def _fill_padding(self, bucket: int, first: int) -> None:
        """Rows first..bucket-1: token 0 at position 0 in the scratch block, no adapter."""
        if first >= bucket:
            return
        n, h, scratch = self.max_batch, self._host_np, self.kv.scratch_block
        rows = slice(first, bucket)
        h[rows] = 0
        h[n + first : n + bucket] = 0
        h[2 * n + first : 2 * n + bucket] = scratch * self.kv.block_size
        h[3 * n + first : 3 * n + bucket] = 1
        h[4 * n + first : 4 * n + bucket] = -1
        h[5 * n + first : 5 * n + bucket] = -1
        h[self._tables_at :].reshape(n, self.width)[rows] = scratch


def _capture(forward, pool, device: torch.device) -> torch.cuda.CUDAGraph:
    """forward() captured in a graph that allocates from `pool` (None: a new pool)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):  # compiles the Triton kernels, creates cuBLAS handles and workspaces
            forward()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: only this thread's calls are checked during the capture. Another thread's
    # device work (a slot load of an executor being shut down, in tests; an allocation) would
    # otherwise invalidate the capture ("operation failed due to a previous error during capture").
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        forward()
    return graph


def token_buckets(max_tokens: int) -> list[int]:
    """Mixed-step buckets: 64, 128, 256, then every 256 up to max_tokens (always the last)."""
    return _ladder((64, 128, 256), 256, max_tokens)


@dataclass
class MixedBatch:
    """The host-side inputs of a mixed step: B sequences of any query lengths (T tokens in all)."""

    input_ids: list[int]  # [T]
    query_lens: list[int]  # [B]
    context_lens: list[int]  # [B] tokens already cached before the step
    block_tables: list[list[int]]
    token_slots: list[int]  # [T] LoRA slot of each token, -1 = base model
    sample_rows: list[int]  # index of the last token of each sequence that samples
    sample_slots: list[int]
    slot_ranks: list[int] | None = None  # [max_loras]; None: read slots whole
    long_rope: list[bool] | None = None  # [B] LongRoPE's long factors at every token (batch.long_rope_seqs); None: none


class MixedGraphs(_StepGraphs):
    """Graphs of mixed steps of up to max_tokens tokens of up to max_seqs sequences (see the module
    docstring). Static int32 buffer, T = max_tokens, S = max_seqs:

        [ids | positions | slot mapping | LoRA slots]   each T long, then [rope_long] T (LongRoPE models only)
        [seq_lens | sample rows | sample slots]        each S long, then [cu_query_lens] S + 1
        [work list]                                    2 x the largest bucket's capacity
        [slot ranks]                                   max_loras
        [block tables]                                 S x width
    """

    def __init__(self, model, kv: KVCache, max_tokens: int, max_seqs: int, max_model_len: int, max_loras: int, device, pool=None):
        self.model, self.kv, self.max_loras = model, kv, max_loras
        self.device = torch.device(device)
        self.buckets = token_buckets(max_tokens)
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        self.width = -(-max_model_len // kv.block_size)
        c = model.cfg
        heads, kv_heads = model.model.layers[0].self_attn.num_heads, model.model.layers[0].self_attn.num_kv_heads
        # queries per prefill program at each bucket's launch shape, and the work list's entries:
        # every sequence's query blocks fit in tokens / queries + sequences
        self.queries = {b: prefill_queries(b, heads, kv_heads, c.head_dim, model.dtype) for b in self.buckets}
        self.capacity = {b: -(-b // self.queries[b]) + min(max_seqs, b) for b in self.buckets}
        t, s_ = max_tokens, max_seqs
        self._token_fields = 5 if c.rope_type == "longrope" else 4  # AttentionMetadata.rope_long: LongRoPE only
        self._seqs_at = self._token_fields * t
        self._work_at = self._seqs_at + 4 * s_ + 1
        self._ranks_at = self._work_at + 2 * max(self.capacity.values())
        self._tables_at = self._ranks_at + max_loras
        size = self._tables_at + s_ * self.width
        self._stage_buffers(size)
        self._logits = torch.empty(max_seqs, c.vocab_size, dtype=torch.float32, device=self.device)
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self._pool = pool

    def capture(self) -> None:
        """Every (bucket, LoRA or not) graph, largest first, in one pool (`pool`, or a new one)."""
        t0 = time.perf_counter()
        self._fill(MixedBatch([], [], [], [], [], [], []), self.max_tokens)
        self._host_np[self._ranks_at : self._tables_at] = FULL_RANK
        self._dev.copy_(self._host)
        variants = (False, True) if self.max_loras else (False,)
        with torch.cuda.device(self.device):
            for bucket in reversed(self.buckets):
                for lora in variants:
                    graph = _capture(lambda: self._forward(bucket, lora), self._pool, self.device)
                    self._pool = graph.pool()
                    self._graphs[(bucket, lora)] = graph
            torch.cuda.synchronize(self.device)
        log.info(
            "captured %d CUDA graphs of mixed steps (token buckets %s, up to %d sequences) in %.1fs",
            len(self._graphs),
            self.buckets,
            self.max_seqs,
            time.perf_counter() - t0,
        )

    def fits(self, num_tokens: int, num_seqs: int) -> bool:
        return 0 < num_tokens <= self.max_tokens and num_seqs <= self.max_seqs

    @torch.inference_mode()
    def _forward(self, bucket: int, lora: bool) -> None:
        """The captured step: logits [min(max_seqs, bucket), vocab] float32 of the sample rows (a step has
        at most as many sequences as tokens) into the shared buffer."""
        t, s_, dev = self.max_tokens, self.max_seqs, self._dev
        ids, positions, slot_mapping, token_slots = (dev[i * t : i * t + bucket] for i in range(4))
        rope_long = dev[4 * t : 4 * t + bucket] != 0 if self._token_fields == 5 else None
        seq_lens, sample_rows, sample_slots = (dev[self._seqs_at + i * s_ : self._seqs_at + (i + 1) * s_] for i in range(3))
        cu = dev[self._seqs_at + 3 * s_ : self._work_at]
        work = dev[self._work_at : self._work_at + 2 * self.capacity[bucket]].view(-1, 2)
        ranks = dev[self._ranks_at : self._tables_at]
        attn = AttentionMetadata(
            slot_mapping=slot_mapping.long(), positions=positions.long(), block_tables=dev[self._tables_at :].view(s_, self.width),
            seq_lens=seq_lens, cu_query_lens=cu, max_query_len=bucket, is_decode=False, prefill_work=work,
            rope_long=rope_long,
        )  # fmt: skip
        meta = make_lora_meta(token_slots, self.max_loras, slot_ranks=ranks) if lora else None
        hidden = self.model.forward(ids, attn.positions, attn, self.kv, meta)
        k = min(s_, bucket)
        rows = hidden.index_select(0, sample_rows[:k].long())
        row_meta = make_lora_meta(sample_slots[:k], self.max_loras, slot_ranks=ranks) if lora else None
        self._logits[:k].copy_(self.model.compute_logits(rows, row_meta))

    def run(self, batch: MixedBatch) -> torch.Tensor:
        """Stages the batch, replays its bucket's graph -> logits [len(sample_rows), vocab] float32 (a
        view of the shared buffer, valid until the next run)."""
        self._replay(*self.stage(batch))
        return self._logits[: len(batch.sample_rows)]

    def stage(self, batch: MixedBatch) -> tuple[int, bool]:
        """Fills the static inputs -> (the bucket, whether it needs the LoRA graph)."""
        num_tokens = len(batch.input_ids)
        if not self.fits(num_tokens, len(batch.query_lens)):
            raise ValueError(
                f"a step of {num_tokens} tokens of {len(batch.query_lens)} sequences exceeds the mixed "
                f"graphs' {self.max_tokens} tokens of {self.max_seqs} sequences"
            )
        bucket = next(b for b in self.buckets if b >= num_tokens)
        lora = self.max_loras > 0 and max(batch.token_slots) >= 0
        self._swap_hosts()
        self._fill(batch, bucket)
        used = self._tables_at + len(batch.query_lens) * self.width  # the block tables come last
        self._upload(used)
        return bucket, lora

    def _fill(self, batch: MixedBatch, bucket: int) -> None:
        t, s_, bs, h = self.max_tokens, self.max_seqs, self.kv.block_size, self._host_np
        n, b = len(batch.input_ids), len(batch.query_lens)
        q = np.asarray(batch.query_lens, dtype=np.int64)
        ctx = np.asarray(batch.context_lens, dtype=np.int64)
        tables = h[self._tables_at :].reshape(s_, self.width)
        cu, pos, slot_mapping = place_tokens(q, ctx, batch.block_tables, tables, bs)
        scratch = self.kv.scratch_block * bs
        h[0:n] = batch.input_ids
        h[n:bucket] = 0
        h[t : t + n] = pos
        h[t + n : t + bucket] = 0
        h[2 * t : 2 * t + n] = slot_mapping
        h[2 * t + n : 2 * t + bucket] = scratch  # padding tokens write only the scratch block
        h[3 * t : 3 * t + n] = batch.token_slots
        h[3 * t + n : 3 * t + bucket] = -1
        if self._token_fields == 5:
            h[4 * t : 4 * t + n] = 0 if batch.long_rope is None else np.repeat(np.asarray(batch.long_rope, dtype=np.int64), q)
            h[4 * t + n : 4 * t + bucket] = 0
        o = self._seqs_at
        h[o : o + b] = ctx + q
        h[o + b : o + s_] = 0
        k = len(batch.sample_rows)
        h[o + s_ : o + s_ + k] = batch.sample_rows
        h[o + s_ + k : o + 2 * s_] = 0
        h[o + 2 * s_ : o + 2 * s_ + k] = batch.sample_slots
        h[o + 2 * s_ + k : o + 3 * s_] = -1
        h[o + 3 * s_ : o + 3 * s_ + b + 1] = cu
        h[o + 3 * s_ + b + 1 : self._work_at] = n  # padding sequences: no queries
        cap = self.capacity[bucket]
        h[self._work_at : self._work_at + 2 * cap] = prefill_work_list(q, self.queries[bucket], cap).ravel()
        h[self._ranks_at : self._tables_at] = FULL_RANK if batch.slot_ranks is None else batch.slot_ranks
