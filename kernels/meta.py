"""Per-step token grouping, computed once per forward step and reused by every LoRA layer.

Everything here is tensor ops on the device of `token_slots`: no host synchronisation, no
data-dependent shapes, so it is safe inside a captured CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoraMeta:
    """Tokens grouped by GPU slot.

    token_slots:       [T] int32, slot of each token, -1 for no adapter
    sorted_token_ids:  [T] int32, token indices grouped by slot (slot 0 first), no-adapter tokens last
    tokens_per_slot:   [max_loras] int32, how many tokens each slot has this step
    slot_start:        [max_loras] int32, offset of each slot's group in sorted_token_ids
    num_tokens:        T (host int; the launch shape)
    max_loras:         number of slots (host int)
    """

    token_slots: torch.Tensor
    sorted_token_ids: torch.Tensor
    tokens_per_slot: torch.Tensor
    slot_start: torch.Tensor
    num_tokens: int
    max_loras: int


def make_lora_meta(token_slots: torch.Tensor, max_loras: int) -> LoraMeta:
    """Groups tokens by slot. token_slots: [T] integer tensor, -1 = no adapter."""
    slots = token_slots.to(torch.int32)
    # No-adapter tokens sort after every real slot.
    keys = torch.where(slots < 0, torch.full_like(slots, max_loras), slots)
    sorted_ids = torch.argsort(keys, stable=True).to(torch.int32)
    counts = torch.bincount(keys.to(torch.int64), minlength=max_loras + 1)[:max_loras]
    starts = torch.cumsum(counts, 0) - counts
    return LoraMeta(
        token_slots=slots,
        sorted_token_ids=sorted_ids,
        tokens_per_slot=counts.to(torch.int32),
        slot_start=starts.to(torch.int32),
        num_tokens=int(slots.shape[0]),
        max_loras=max_loras,
    )
