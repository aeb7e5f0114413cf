"""DoRA in the slots: each dense LoRA layer's per-slot output scale, worked out when an adapter enters a slot.

PEFT's DoRA layer is y = bias + g * (W x + s B A x), g = m / ||W + s B A||_row (the norm over the
whole input dim, one per output row; s is folded into the shard's B). A shard of a DoRA adapter
carries "<module>.dora_m" [N] float32 beside lora_a / lora_b (NaN on rows of slices the adapter
does not target: their g is 1). DoRA is a capability the slots are made with (LoraSpec.dora, the
executor's --enable-dora): without it no layer holds the buffers below and no step does DoRA work,
and a DoRA shard is refused (`check`; the store client refuses a DoRA adapter's fetch before that).
Each LinearWithLoRA with slots made with DoRA keeps

    dora_scale:  [max_loras + 1, N] in the layer's compute dtype: g of each slot, 1 for plain LoRA slots
                 and empty ones; the last row (what slot -1, the base model, indexes) is all 1
    dora_slots:  host list, whether each slot holds a DoRA adapter in this module (eager steps
                 skip the scale when none of theirs does; captured graphs always apply it)

and, when row-parallel under TP (each rank holds 1/tp of the input dim), dora_m and dora_sq
[max_loras, N] float32: m and this rank's partial sum of squares. The norm is computed in one
pass over the layer's weight on its device as the shard is loaded (`load`, through
kernels.dora_norm: on CUDA one Triton launch per slice, writing g itself); a column-parallel
layer's rows are whole on every rank, so g is final then. A row-parallel layer's partial sums are
summed over the ranks by `reduce_pending` at the first step that uses the slot: rank 0 names the
slots to reduce in the step (StepInputs.dora_reduce, from `take_pending`), so every rank meets in
the same all-reduce. The layer's forward applies `apply`: one gather of g by each token's slot and
one multiply-add over the layer's [T, N] output (bias added after the scale, as PEFT does).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import nn

from loraserve import kernels

from .slot_layout import DORA_SCALES, register_slot_buffer

SUFFIX = ".dora_m"
_PENDING_ATTR = "_dora_pending"  # rank 0's model: slots whose row-parallel norms await their reduce
_LOCK = threading.Lock()


def create(m: nn.Module, max_loras: int) -> None:
    """The DoRA buffers of a LinearWithLoRA whose slots serve DoRA (called from its create_lora_weights)."""
    n, dev = m.lora_offsets[-1], m.weight.device
    # in the dtype of the layer's output (its compute dtype: an FP8 layer's weight is float8, its output not)
    register_slot_buffer(m, "dora_scale", torch.ones(max_loras + 1, n, dtype=m.compute_dtype, device=dev), DORA_SCALES)
    m.dora_slots = [False] * max_loras
    row = m.row_parallel
    register_slot_buffer(m, "dora_m", torch.full((max_loras, n), float("nan"), device=dev) if row else None, DORA_SCALES)
    register_slot_buffer(m, "dora_sq", torch.zeros(max_loras, n, device=dev) if row else None, DORA_SCALES)


def applies(m: nn.Module, meta) -> bool:
    """Whether this step scales m's output: m's slots serve DoRA and some slot of the step holds
    DoRA for m (always in a captured graph, which knows no slots on the host); never where the
    slots were made without DoRA (LoraSpec.dora)."""
    if getattr(m, "dora_scale", None) is None or meta is None:
        return False
    if meta.host_slots is None:
        return True
    return any(m.dora_slots[s] for s in meta.host_slots)


def apply(m: nn.Module, y: torch.Tensor, meta, bias: torch.Tensor | None) -> torch.Tensor:
    """g[slot of each token] * y (+ bias): y [T, N] is the base output and LoRA delta, without bias."""
    g = m.dora_scale[meta.token_slots]  # [T, N]; slot -1 reads the last row: ones
    return y * g if bias is None else torch.addcmul(bias, y, g)


def split(tensors: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """(the shard's lora_a / lora_b tensors, module -> its dora_m); the shard itself when it has none."""
    if not any(k.endswith(SUFFIX) for k in tensors):
        return tensors, {}
    rest = {k: v for k, v in tensors.items() if not k.endswith(SUFFIX)}
    return rest, {k[: -len(SUFFIX)]: v for k, v in tensors.items() if k.endswith(SUFFIX)}


def check(modules: dict[str, nn.Module], tensors: dict, magnitudes: dict[str, torch.Tensor]) -> None:
    """ValueError unless every magnitude belongs to a dense LoRA layer the shard targets and fits it."""
    for name, vec in magnitudes.items():
        m = modules.get(name)
        if m is not None and getattr(m, "serves_dora", None) is False:
            raise ValueError(f"shard has {name}{SUFFIX}, but this model's slots were made without DoRA (LoraSpec.dora)")
        if m is None or getattr(m, "dora_scale", None) is None:
            raise ValueError(f"shard has {name}{SUFFIX} for no dense LoRA layer of this model")
        if f"{name}.lora_a" not in tensors:
            raise ValueError(f"shard has {name}{SUFFIX} but no {name}.lora_a / lora_b")
        if m.rank_parts > 1 or m.lora_offsets is not m.slice_offsets:
            raise ValueError(f"{name}: DoRA is not served with fully sharded LoRA")
        if vec.dim() != 1 or vec.shape[0] != m.dora_scale.shape[1]:
            raise ValueError(f"{name}{SUFFIX}: shape {tuple(vec.shape)}, the layer has {m.dora_scale.shape[1]} output rows")


def load(
    model: nn.Module,
    modules: dict[str, nn.Module],
    slot: int,
    tensors: dict,
    magnitudes: dict[str, torch.Tensor],
    on_device: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Sets `slot`'s scale in every dense LoRA layer, after its A and B were written: g from the
    shard's magnitudes (the norm over the layer's weight on its device: kernels.dora_norm, one pass
    over it), 1 where it has none. Row-parallel layers under TP keep m and their partial sums and
    leave g to `reduce_pending`. on_device: one of the shard's tensors on the layers' device (the
    staged copy of its bytes, slot_load.py); by default copied there."""
    pending = False
    for name, m in modules.items():
        if getattr(m, "dora_scale", None) is None:
            continue
        vec = magnitudes.get(name)
        if vec is None:
            if m.dora_slots[slot]:
                _reset(m, slot)
            continue
        dev = m.dora_scale.device
        vec, a, b = ((on_device or _copied(dev))(t) for t in (vec, tensors[f"{name}.lora_a"], tensors[f"{name}.lora_b"]))
        vec, scale = vec.float(), getattr(m, "weight_scale", None)
        if m.dora_m is not None:
            m.dora_m[slot].copy_(vec)
            kernels.dora_norm(m.weight, scale, a, b, m.slice_offsets, vec, sq_out=m.dora_sq[slot])
            pending = True
        else:
            kernels.dora_norm(m.weight, scale, a, b, m.slice_offsets, vec, scale_out=m.dora_scale[slot])
        m.dora_slots[slot] = True
    if pending:
        with _LOCK:
            model.__dict__.setdefault(_PENDING_ATTR, set()).add(slot)


def _copied(device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t.to(device, non_blocking=True)


def clear(modules, slot: int) -> None:
    """`slot` back to scale 1 in every layer (a cleared slot)."""
    for m in modules:
        if getattr(m, "dora_scale", None) is not None and m.dora_slots[slot]:
            _reset(m, slot)


def _reset(m: nn.Module, slot: int) -> None:
    m.dora_scale[slot].fill_(1)
    if m.dora_m is not None:
        m.dora_m[slot].fill_(float("nan"))
    m.dora_slots[slot] = False


def _scale(vec: torch.Tensor, sq: torch.Tensor) -> torch.Tensor:
    """g = m / ||.||, 1 where m is NaN (a slice the adapter does not target)."""
    return torch.where(torch.isnan(vec), torch.ones_like(vec), vec / sq.sqrt())


def take_pending(model: nn.Module, slots) -> list[int]:
    """Rank 0: the step's slots (an iterable) whose row-parallel norms are still to be summed, no
    longer pending once named here (the step that names them reduces them on every rank)."""
    with _LOCK:
        pending = model.__dict__.get(_PENDING_ATTR)
        if not pending:
            return []
        due = sorted(pending.intersection(slots))
        pending.difference_update(due)
    return due


def reduce_pending(model: nn.Module, slots: list[int]) -> None:
    """Every rank, before the step's forward: sums the listed slots' partial squares of every
    row-parallel layer over the ranks (one all-reduce) and sets their g."""
    if not slots:
        return
    layers = [m for m in model.modules() if getattr(m, "dora_sq", None) is not None]
    if not layers:
        return
    index = torch.tensor(slots, dtype=torch.long, device=layers[0].dora_sq.device)
    flat = torch.cat([m.dora_sq.index_select(0, index).reshape(-1) for m in layers])
    flat = layers[0].tp.all_reduce(flat)
    offset = 0
    for m in layers:
        n = len(slots) * m.dora_sq.shape[1]
        total = flat[offset : offset + n].view(len(slots), -1)
        offset += n
        m.dora_scale.index_copy_(0, index, _scale(m.dora_m.index_select(0, index), total).to(m.dora_scale.dtype))
