"""One eager step's forward on one rank: the code every tensor-parallel rank runs with the same inputs.

Rank 0 builds StepInputs from the scheduler's plan (batch.Batch has the same fields) and
sends them to ranks 1..N-1 (executor/ranks.py) before it runs this same function itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loraserve.kernels import make_lora_meta

from .. import dora
from .kv_cache import AttentionMetadata, KVCache


@dataclass
class StepInputs:
    """A step's host-side inputs, as every rank needs them (small lists: pickled to the other ranks)."""

    input_ids: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    token_slots: list[int]  # LoRA slot of each token, -1: none
    sample_rows: list[int]  # index of the last token of each sequence that samples
    sample_slots: list[int]
    slot_adapters: dict[int, tuple[str, str]] = field(default_factory=dict)  # slot -> (adapter, digest) in it
    # Run every LoRA module's kernels over whole slots, as a captured graph does, even where no
    # adapter in the step targets the module (the start-up warm-up: its slot 0 is empty).
    every_slot: bool = False
    slot_ranks: list[int] | None = None  # [max_loras] each slot's adapter rank (LoraMeta.slot_ranks); None: full
    dora_reduce: list[int] = field(default_factory=list)  # slots whose DoRA norms every rank sums first (executor/dora.py)
    long_rope: list[bool] | None = None  # [B] sequences whose tokens take LongRoPE's long factors (batch.long_rope_seqs)

    @classmethod
    def of(cls, b) -> "StepInputs":
        return cls(
            b.input_ids,
            b.query_lens,
            b.context_lens,
            b.block_tables,
            b.token_slots,
            b.sample_rows,
            b.sample_slots,
            b.slot_adapters,
            slot_ranks=b.slot_ranks,
            dora_reduce=b.dora_reduce,
            long_rope=b.long_rope,
        )


def lora_meta(
    slots: list[int], max_loras: int, device: torch.device, every_slot: bool = False, slot_ranks: list[int] | None = None
):
    """Token grouping by slot, once per step; None when no token uses an adapter. every_slot: no
    host-side set of the step's slots, so no module is skipped (StepInputs.every_slot), and the
    slots are read at full rank unless slot_ranks says otherwise (the warm-up's, for packed B
    slots). slot_ranks: [max_loras], each slot's adapter rank."""
    if max_loras == 0 or max(slots, default=-1) < 0:
        return None
    active = None if every_slot else frozenset(s for s in slots if s >= 0)
    if slot_ranks is None:
        return make_lora_meta(torch.tensor(slots, dtype=torch.int32, device=device), max_loras, active)
    both = torch.tensor(slots + list(slot_ranks), dtype=torch.int32, device=device)  # one host->device copy
    return make_lora_meta(both[: len(slots)], max_loras, active, both[len(slots) :])


@torch.inference_mode()
def forward_step(model, kv_cache: KVCache, step, max_loras: int, device: torch.device) -> torch.Tensor | None:
    """model.forward over the step's tokens, then the logits [len(sample_rows), vocab] float32 of
    the rows that sample (None when none does). `step`: StepInputs or anything with its fields."""
    every = getattr(step, "every_slot", False)  # the engine's own batches never set it
    ranks = getattr(step, "slot_ranks", None)
    dora.reduce_pending(model, getattr(step, "dora_reduce", ()))
    input_ids = torch.tensor(step.input_ids, dtype=torch.long, device=device)
    attn = AttentionMetadata.build(
        step.query_lens, step.context_lens, step.block_tables, kv_cache.block_size, device,
        long_rope=getattr(step, "long_rope", None),
    )  # fmt: skip
    hidden = model.forward(
        input_ids, attn.positions, attn, kv_cache, lora_meta(step.token_slots, max_loras, device, every, ranks)
    )
    if not step.sample_rows:
        return None
    rows = torch.tensor(step.sample_rows, dtype=torch.long, device=device)
    return model.compute_logits(hidden.index_select(0, rows), lora_meta(step.sample_slots, max_loras, device, every, ranks))
