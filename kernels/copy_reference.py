"""A slot load's scatter in plain PyTorch: the test oracle of kernels/triton_copy.py, and its stand-in
where Triton is missing.

A slot load writes, into one slot of every LoRA module's slot buffers, the rows of a shard's
tensors and zeros after them (the rank tail up to the slot rank, or the whole slot of a module the
shard does not target). Each such write is a `SlotCopy` from a staged source: the shard's bytes
moved to the device in one piece. A load's copies are the same for every adapter of the same
tensor layout, whatever the slot, so the executor builds one `ScatterPlan` per layout and reuses
it (executor/slot_load.py); the Triton kernel then does every copy of a load in one launch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


@dataclass(frozen=True)
class SlotCopy:
    """dst[slot] seen as `rows` rows `dst_stride` elements apart: the first `src_cols` of each row's
    `fill` columns come from the source (rows x src_cols, row-major, from element `src_offset`),
    the rest are zeroed (src_cols 0: zeros only). `unit`: a row's elements per rank position
    (its rank positions lie one after another along the row), 0 when the row is not laid out by
    rank; `parts`: the adapter's rank over a row's positions (a fully sharded layer's rank is cut
    in parts): `ScatterPlan.clipped` cuts the zero fill of a row short by them."""

    dst: torch.Tensor  # a module's slot buffer, [max_loras, ...], contiguous
    rows: int
    fill: int
    dst_stride: int
    src_cols: int = 0
    src_offset: int = 0
    unit: int = 0
    parts: int = 1


@dataclass(eq=False)
class ScatterPlan:
    """The copies of one load layout, into slot buffers of one dtype. `device_tables`:
    kernels/triton_copy.py's descriptor tables of these copies, built on first use, then reused
    by every load of this layout."""

    copies: tuple[SlotCopy, ...]
    device_tables: dict = field(default_factory=dict)
    clips: dict = field(default_factory=dict)  # rank -> the plan clipped to it (`clipped`)

    def clipped(self, rank: int | None) -> ScatterPlan:
        """This plan for a slot that holds zeros past adapter rank `rank` already (None: nothing
        known, the plan itself): each row with a `unit` is filled only up to the larger of its
        source columns and its share of `rank` positions, so a load moves its own rank's bytes and
        zeroes only what the slot's previous adapter left. Cached per rank (their tables with them)."""
        if rank is None:
            return self
        got = self.clips.get(rank)
        if got is None:
            cut = [
                replace(c, fill=min(c.fill, max(c.src_cols, -(-rank // c.parts) * c.unit))) if c.unit else c for c in self.copies
            ]
            got = self.clips.setdefault(rank, ScatterPlan(tuple(c for c in cut if c.fill)))  # one kept if two race
        return got


def slot_scatter(plan: ScatterPlan, src: torch.Tensor | None, slot: int) -> None:
    """Every copy of `plan` into `slot`. src: the staged shard, 1-D, of the slot buffers' dtype
    (None when every copy is zeros only)."""
    for c in plan.copies:
        dst = c.dst.as_strided((c.rows, c.fill), (c.dst_stride, 1), c.dst.storage_offset() + slot * c.dst.stride(0))
        if c.src_cols:
            rows = src[c.src_offset : c.src_offset + c.rows * c.src_cols].view(c.rows, c.src_cols)
            dst[:, : c.src_cols].copy_(rows)
        dst[:, c.src_cols :].zero_()
