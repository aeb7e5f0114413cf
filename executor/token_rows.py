"""Trainable tokens in the slots: each slot's own embedding (and lm_head) rows for a few token ids.

An adapter trained with PEFT's `trainable_token_indices` replaces the base weight's rows of its
token ids with its own (adapter_store/trainable_tokens.py): the input embedding's, and the
lm_head's where the model ties it to the embedding or the adapter has its own lm_head rows. Its
shard carries "tokens.embed.ids" / "tokens.embed.rows" (and "tokens.lm_head.*"). Trainable tokens
are a capability the slots are made with (LoraSpec.trainable_tokens, the executor's
--enable-trainable-tokens): without it `model.token_rows` is None, no step does token work, and a
shard with them is refused (executor/slot_load.py; the store client refuses the adapter's fetch
before that). With it the model holds, in `model.token_rows` (a `TokenRows`):

    table:     [max_loras + 1, vocab] int32: per slot, each token id's row in `embed`, -1 for the
               base row (the last row, which slot -1 reads, is all -1)
    embed:     [max_loras, max_tokens, hidden] the slots' embedding rows
    head_ids:  [max_loras + 1, max_tokens] int64, the token ids of `head` rows, -1 past them
    head:      [max_loras, max_tokens, hidden] the slots' lm_head rows
    slots:     host list, whether each slot holds trainable tokens (eager steps without any skip them)

Applied after the (all-reduced) embedding lookup and after the (all-gathered) logits, so the same
on every TP rank; a captured graph, which knows no slots on the host, always applies them.
"""

from __future__ import annotations

import torch
from torch import nn

from loraserve.adapter_store.trainable_tokens import MAX_TOKENS  # trainable tokens per adapter a slot holds

from .slot_layout import TOKEN_ROWS, register_slot_buffer

PREFIX = "tokens."


def split(tensors: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """(the shard's other tensors, its "tokens.*" tensors); the shard itself when it has none."""
    if not any(k.startswith(PREFIX) for k in tensors):
        return tensors, {}
    return {k: v for k, v in tensors.items() if not k.startswith(PREFIX)}, {
        k: v for k, v in tensors.items() if k.startswith(PREFIX)
    }


class TokenRows(nn.Module):
    def __init__(self, max_loras: int, vocab: int, hidden: int, tied: bool, dtype, device, max_tokens: int = MAX_TOKENS):
        super().__init__()
        self.vocab, self.hidden, self.tied, self.max_tokens = vocab, hidden, tied, max_tokens
        self.dtype, self.device = dtype, device
        self.allocate(max_loras)

    def allocate(self, max_loras: int) -> None:
        """(Re)creates the buffers for max_loras slots, all holding no tokens."""
        dev, k = self.device, self.max_tokens
        register_slot_buffer(
            self, "table", torch.full((max_loras + 1, self.vocab), -1, dtype=torch.int32, device=dev), TOKEN_ROWS
        )
        register_slot_buffer(self, "embed", torch.zeros(max_loras, k, self.hidden, dtype=self.dtype, device=dev), TOKEN_ROWS)
        register_slot_buffer(self, "head_ids", torch.full((max_loras + 1, k), -1, dtype=torch.int64, device=dev), TOKEN_ROWS)
        register_slot_buffer(self, "head", torch.zeros(max_loras, k, self.hidden, dtype=self.dtype, device=dev), TOKEN_ROWS)
        self.slots = [False] * max_loras

    def applies(self, meta) -> bool:
        if meta is None:
            return False
        return meta.host_slots is None or any(self.slots[s] for s in meta.host_slots)

    def embed_rows(self, ids: torch.Tensor, y: torch.Tensor, meta) -> torch.Tensor:
        """y [T, hidden] (the base embedding plus LoRA) with each token's slot rows in place of its id's."""
        if not self.applies(meta):
            return y
        k = self.table[meta.token_slots, ids]  # [T]; slot -1 reads the all -1 row
        rows = self.embed[meta.token_slots, k.clamp(min=0)]  # [T, hidden]
        return torch.where((k >= 0).unsqueeze(1), rows, y)

    def logits(self, hidden: torch.Tensor, logits: torch.Tensor, meta) -> torch.Tensor:
        """logits [B, vocab] float32 with each row's slot head rows' logits in place of their ids'."""
        if not self.applies(meta):
            return logits
        ids = self.head_ids[meta.token_slots]  # [B, K]
        vals = torch.bmm(self.head[meta.token_slots], hidden.unsqueeze(2)).squeeze(2).float()  # [B, K]
        hit = ids >= 0
        wide = torch.cat([logits, logits.new_zeros(logits.shape[0], 1)], 1)  # column vocab: where misses go
        wide.scatter_(1, torch.where(hit, ids, self.vocab), torch.where(hit, vals, 0.0))
        return wide[:, : self.vocab]

    def check(self, tokens: dict[str, torch.Tensor], head_lora: bool = False) -> None:
        """ValueError unless the shard's trainable tokens fit the slots. A tied model's lm_head takes
        the embedding rows (its own rows for the same ids must equal them; for other ids they are its
        own, as PEFT then ties neither). No lm_head rows beside lm_head LoRA (head_lora): PEFT wraps the
        token rows inside the LoRA layer, so its logits are the replaced rows' plus the LoRA's, while
        `logits` replaces those ids' logits whole; the store refuses such an adapter at registration."""
        unknown = sorted(set(tokens) - {f"{PREFIX}{t}.{p}" for t in ("embed", "lm_head") for p in ("ids", "rows")})
        if unknown:
            raise ValueError(f"shard has unknown trainable-token tensors {unknown}")
        for target in ("embed", "lm_head"):
            ids, rows = tokens.get(f"{PREFIX}{target}.ids"), tokens.get(f"{PREFIX}{target}.rows")
            if ids is None and rows is None:
                continue
            if ids is None or rows is None:
                raise ValueError(f"shard has only one of {PREFIX}{target}.ids / .rows")
            if ids.dim() != 1 or rows.shape != (ids.shape[0], self.hidden):
                raise ValueError(
                    f"{PREFIX}{target}: ids {tuple(ids.shape)} and rows {tuple(rows.shape)} for hidden size {self.hidden}"
                )
            if ids.shape[0] > self.max_tokens:
                raise ValueError(f"{PREFIX}{target}: {ids.shape[0]} trainable tokens, a slot holds at most {self.max_tokens}")
            if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < self.vocab:
                raise ValueError(f"{PREFIX}{target}: token ids must lie in the vocabulary of {self.vocab}")
        embed, head = tokens.get(f"{PREFIX}embed.ids"), tokens.get(f"{PREFIX}lm_head.ids")
        tied = self.tied and embed is not None and (head is None or torch.equal(embed, head))  # the lm_head takes embed's rows
        if tied and head is not None and not torch.equal(tokens[f"{PREFIX}embed.rows"], tokens[f"{PREFIX}lm_head.rows"]):
            raise ValueError(
                "the model ties lm_head to the embedding, but the shard's lm_head token rows differ from its embedding's "
                "for the same ids"
            )
        if head_lora and (tied or head is not None):
            raise ValueError(
                "shard has lm_head LoRA and lm_head trainable token rows (its own, or the embedding's the model ties to it), "
                "which are not served (PEFT adds the LoRA to those ids' logits; a slot's rows replace them whole). The store "
                "refuses such an adapter at registration only when it knows the base model: this shard came from a store "
                "started without --base-model-path (start it with one) or from an older store (upgrade it)"
            )

    def load(self, slot: int, tokens: dict[str, torch.Tensor]) -> None:
        """Sets `slot`'s rows from the shard's trainable tokens (none: the slot holds none)."""
        if not tokens and not self.slots[slot]:
            return
        self.table[slot].fill_(-1)
        self.head_ids[slot].fill_(-1)
        embed = tokens.get(f"{PREFIX}embed.ids"), tokens.get(f"{PREFIX}embed.rows")
        head = tokens.get(f"{PREFIX}lm_head.ids"), tokens.get(f"{PREFIX}lm_head.rows")
        if head[0] is None and self.tied:
            head = embed  # the lm_head is the embedding: PEFT ties its token rows too
        if embed[0] is not None:
            ids = embed[0].to(self.device, torch.long)
            self.table[slot, ids] = torch.arange(ids.shape[0], dtype=torch.int32, device=self.device)
            self.embed[slot, : ids.shape[0]] = embed[1].to(self.device, self.dtype)
        if head[0] is not None:
            n = head[0].shape[0]
            self.head_ids[slot, :n] = head[0].to(self.device, torch.long)
            self.head[slot, :n] = head[1].to(self.device, self.dtype)
        self.slots[slot] = bool(tokens)
