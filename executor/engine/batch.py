"""A planned step flattened into the host-side lists its launch takes (Batch), and which of
STEP_KINDS it runs as (step_kind)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..slots import SlotLease, SlotManager
from .scheduler import SchedulePlan

PENDING = -1  # a token id the previous step is still sampling (on the device)


@dataclass
class Batch:
    """One step's host-side inputs, copied out of the scheduler's state (the launch may run in a
    worker thread). Has StepInputs' fields (step.py), so eager steps pass it to `forward_step`."""

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
    leases: list[SlotLease]  # those whose slot copy the step waits for
    sources: list[int]  # per token: -1, or the previous step's sample row its id comes from (PENDING)
    slot_adapters: dict[int, tuple[str, str]] = field(default_factory=dict)  # TP only: slot -> (adapter, digest)
    slot_ranks: list[int] | None = None  # each slot's adapter rank (SlotManager.slot_ranks), None: no LoRA in the step
    dora_reduce: list[int] = field(default_factory=list)  # TP only: slots whose DoRA norms the ranks sum (executor/dora.py)
    # [B] LongRoPE only: whether each sequence's tokens take the long factors whatever their
    # positions (long_rope_seqs); None: every token's factors follow its position
    long_rope: list[bool] | None = None

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)


def long_rope_length(cfg) -> int | None:
    """A LongRoPE model's original_max_position_embeddings (the sequence length past which a
    sequence takes the long factors at every position), None for any other model."""
    return cfg.rope_scaling["original_max_position_embeddings"] if cfg.rope_type == "longrope" else None


def long_rope_seqs(plan: SchedulePlan, original: int | None) -> list[bool] | None:
    """[B] LongRoPE (`original`: long_rope_length): whether each planned sequence's tokens take the
    long factors below `original` too (Sequence.long_rope: the scheduler marks a sequence longer
    than `original`); None when no token of the step does (or not LongRoPE)."""
    if original is None:
        return None
    flags = [s.seq.long_rope and s.context_len < original for s in plan.seqs]
    return flags if any(flags) else None


def flatten(
    plan: SchedulePlan, runs: dict, prev_rows: dict, slots: SlotManager, tensor_parallel: bool, long_rope: int | None = None
) -> Batch:
    """plan's sequences as one Batch. runs: seq_id -> delivery.Run of each sequence; prev_rows: the
    previous step's sample row of each sequence, where a placeholder (PENDING, only ever a
    sequence's last token) takes its id from; tensor_parallel: also name each slot's adapter
    (the other ranks load what rank 0 has in each slot of the step); long_rope: long_rope_length
    of the model."""
    b = Batch([], [], [], [], [], [], [], [], [], [], [], [], [])
    for s in plan.seqs:
        seq = s.seq
        ids = s.query_token_ids
        b.input_ids += ids
        b.sources += [-1] * (len(ids) - 1) + [prev_rows[seq] if ids[-1] == PENDING else -1]
        b.query_lens.append(s.num_tokens)
        b.context_lens.append(s.context_len)
        b.block_tables.append(list(seq.block_table))
        b.token_slots += [seq.slot] * s.num_tokens
        run = runs[seq.seq_id]
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
        b.slot_ranks = list(slots.slot_ranks)
    b.long_rope = long_rope_seqs(plan, long_rope)
    if tensor_parallel:
        b.slot_adapters = {slot: slots.slot_version(slot) for slot in set(b.token_slots) if slot >= 0}
    return b


def step_kind(b: Batch, graphs, mixed_graphs) -> str:
    """Which of STEP_KINDS (step_stats.py) the batch runs as: a decode batch up to the largest
    decode graph replays it (`graphs`: DecodeGraphs or None); a step with a prefill chunk replays a
    mixed graph (`mixed_graphs`: MixedGraphs or None) when one fits its tokens and sequences and no
    token is a placeholder; everything else runs eagerly. The decode graphs take no long_rope (a
    long sequence's decode token sits past the original length): a 1-token chunk below it runs eagerly."""
    if b.is_decode:
        graphed = graphs is not None and len(b.query_lens) <= graphs.max_batch and b.long_rope is None
        return "decode-graph" if graphed else "decode"
    graphed = mixed_graphs is not None and mixed_graphs.fits(len(b.input_ids), len(b.query_lens))
    return "mixed-graph" if graphed and max(b.sources, default=-1) < 0 else "mixed"
