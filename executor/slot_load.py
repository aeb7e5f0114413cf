"""Loading one shard's tensors into a slot of every LoRA module of a model, and clearing a slot.

On CUDA a load is one host->device copy of the shard's pinned buffer and one scatter launch
(kernels.slot_scatter) that writes every module's A and B and zeroes every rank tail and every
module the shard does not target. The copies and the checks depend only on the shard's layout
(its tensors' names, shapes, dtypes and offsets in the buffer: shard_tensors.shard_signature),
which repeats across adapters, so both are worked out once per layout and kept by the model's
`_SlotTargets`: a repeat load costs a signature of the shard, the copy and the launch, whatever
its tensor count. Elsewhere (the CPU, or a shard not in one host storage) the modules' set_lora
copies go through SlotWrites. Every path keeps executor/slot_layout.py's invariant.

FP8 slots (executor/lora_fp8.py, the dense layers' under --lora-dtype fp8) take the SlotWrites
path on every device: the shard's bytes are staged on the device in one copy, quantized there, and
the FP8 values and their scales copied into the slot (a multi-tensor copy and zero-fill). The
modules whose slots stay in the adapter dtype (embeddings, lm_head, MoE experts) keep the scatter
from the same staged bytes: on CUDA such a load is one host -> device copy, one scatter launch for
those modules, the quantization's few launches per group of equal shapes and the FP8 modules'
copies; a clear is one scatter launch and the FP8 modules' zero-fills.

What a model's loads work out is owned by the model (`_TARGETS_ATTR`), what a module list's
clears do by its first module (`_CLEAR_PLAN_ATTR`); `forget_slot_plans` drops both before the
slot buffers are replaced.
"""

from __future__ import annotations

import operator
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from math import prod

import torch
from torch import nn

from loraserve import kernels
from loraserve.kernels.copy_reference import ScatterPlan, SlotCopy

from . import dora, lora_fp8, token_rows
from .lora import LORA_MODULE_TYPES, SlotWrites
from .shard_tensors import LayoutKey, shard_signature
from .slot_layout import packed_rank, slot_fit_error, written_rank

_MAX_LAYOUTS = 64  # cached shard layouts per model (adapters of one rank and targets share one)
_TARGETS_ATTR = "_lora_slot_targets"  # a model's _SlotTargets, set by the first load into its slots
_CLEAR_PLAN_ATTR = "_lora_clear_plan"  # (buffers, plan) of the module list a module comes first in


@dataclass(frozen=True)
class _ShardLayout:
    """What a shard of one layout does to a slot, its checks passed: each module's rank there
    (module.slot_ranks, rank; 0 where it has no tensors) and, when its tensors lie in one host
    storage, the plan that scatters the `span` bytes from the first tensor's start."""

    ranks: tuple[tuple[list[int], int], ...]
    plan: ScatterPlan | None
    span: int
    max_rank: int  # the largest adapter rank among its modules (a fully sharded A's part times tp)


class _SlotTargets:
    """A model's LoRA modules with the shard layouts checked against them; valid while every
    LoRA-capable module keeps the slot buffers it had (create_lora_weights, `model.to` replace them)."""

    def __init__(self, model: nn.Module):
        named = [(n, m) for n, m in model.named_modules() if isinstance(m, LORA_MODULE_TYPES)]
        self.candidates = [m for _, m in named]
        self.buffers = _buffers(self.candidates)
        # each module's buffer dict (kept for the module's life; a replaced buffer changes its entry)
        # with the buffers it held: `current` reads these, a few times faster than listing them again
        self._held = [(m._buffers, m._buffers["lora_a"], m._buffers["lora_b"]) for m in self.candidates]
        self.modules = {n: m for n, m in named if m.lora_a is not None}
        self.known = frozenset(f"{n}.{part}" for n in self.modules for part in ("lora_a", "lora_b"))
        slot_bufs = [b for b in self.buffers if b is not None]
        self.device = slot_bufs[0].device if slot_bufs else torch.device("cpu")
        self.fp8 = any(m.fp8_slots for m in self.modules.values())
        # the scatter writes the modules whose slots hold the shard's dtype (not the FP8 ones)
        self.scattered = [n for n, m in self.modules.items() if not m.fp8_slots]
        bufs = [b for n in self.scattered for b in (self.modules[n].lora_a, self.modules[n].lora_b)]
        self.scatterable = bool(bufs) and len({b.dtype for b in bufs}) == 1 and all(b.is_contiguous() for b in bufs)
        self.layouts: OrderedDict[LayoutKey, _ShardLayout] = OrderedDict()
        self.lock = threading.Lock()
        # each module's slot_ranks list (replaced only with its slot buffers, which retires these
        # targets) and rank parts: `written_rank` without an attribute lookup per module
        self._rank_lists = [(m.slot_ranks, m.rank_parts) for m in self.modules.values()]

    def written_rank(self, slot: int) -> int:
        """slot_layout.written_rank over these modules, from the lists kept above: a cold load's
        path reads it twice, the first time before its copy is queued."""
        return max([ranks[slot] * parts for ranks, parts in self._rank_lists], default=0)

    def current(self) -> bool:
        return all(d["lora_a"] is a and d["lora_b"] is b for d, a, b in self._held)

    def layout(self, tensors: dict[str, torch.Tensor], key: LayoutKey, offsets: list[int | None]) -> _ShardLayout:
        """The layout of `tensors` (signature `key`): cached, or checked (ValueError) and planned."""
        with self.lock:
            found = self.layouts.get(key)
            if found is not None:
                self.layouts.move_to_end(key)
                return found
        _check_shard(self.modules, self.known, tensors)
        found = self._plan(tensors, dict(zip(tensors, offsets)))
        with self.lock:
            self.layouts[key] = found
            while len(self.layouts) > _MAX_LAYOUTS:
                self.layouts.popitem(last=False)
        return found

    def _plan(self, tensors: dict[str, torch.Tensor], offsets: dict[str, int | None]) -> _ShardLayout:
        ranks, copies, top = [], [], 0
        size = next(iter(tensors.values())).element_size() if tensors else 1
        plannable = self.scatterable and all(
            offsets[k] is not None and offsets[k] % size == 0 and t.is_contiguous() for k, t in tensors.items()
        )
        for name, m in self.modules.items():
            a = tensors.get(f"{name}.lora_a")
            ranks.append((m.slot_ranks, 0 if a is None else a.shape[m.slot_rank_dim]))
            top = max(top, ranks[-1][1] * m.rank_parts)  # the slot's rank: a packed B is laid out at it
        for name in self.scattered if plannable else ():
            m = self.modules[name]
            a, b = tensors.get(f"{name}.lora_a"), tensors.get(f"{name}.lora_b")
            for buf, src, part, parts in ((m.lora_a, a, "lora_a", 1), (m.lora_b, b, "lora_b", m.rank_parts)):
                offset = 0 if src is None else offsets[f"{name}.{part}"] // size
                if part == "lora_b" and m.packed_b:
                    if top:  # (an empty shard, rank 0: nothing, as a clear)
                        copies.append(_packed_copy(buf, src, offset, top))
                else:
                    copies.append(_slot_copy(buf, m.slot_rank_dim, src, offset, parts, m.rank_parts))
        if not plannable:
            return _ShardLayout(tuple(ranks), None, 0, top)
        span = max((offsets[k] + t.nbytes for k, t in tensors.items()), default=0)
        return _ShardLayout(tuple(ranks), ScatterPlan(tuple(copies)), span, top)


def forget_slot_plans(model: nn.Module) -> None:
    """Drops what the slot loads and clears keep of `model` (its slot buffers among it): call before
    its buffers are replaced, so the old ones are freed at once."""
    model.__dict__.pop(_TARGETS_ATTR, None)
    for m in model.modules():
        m.__dict__.pop(_CLEAR_PLAN_ATTR, None)


def _buffers(modules) -> tuple:
    return tuple(b for m in modules for b in (m._buffers["lora_a"], m._buffers["lora_b"]))


def _slot_targets(model: nn.Module) -> _SlotTargets:
    """`model`'s targets, built anew when its slot buffers changed since they were."""
    targets = getattr(model, _TARGETS_ATTR, None)
    if targets is None or not targets.current():
        targets = _SlotTargets(model)
        setattr(model, _TARGETS_ATTR, targets)
    return targets


def _slot_copy(
    buf: torch.Tensor, rank_dim: int, src: torch.Tensor | None, src_offset: int, parts: int = 1, rank_parts: int = 1
) -> SlotCopy:
    """One slot of `buf` ([max_loras, ...], rank on dim rank_dim of a slot) as rows x fill: rows are
    the dims before the rank, a row the rank and the dims after it. src (its rank r <= the slot's)
    fills each row's first r / R; None: zeros. parts > 1: a fully sharded column layer's B, whose rank
    is `parts` blocks (one per TP rank's A) each padded on its own: each block is a row.
    rank_parts: the module's (a row's rank positions hold 1 / rank_parts of an adapter's rank)."""
    shape = buf.shape[1:]
    inner = prod(shape[rank_dim + 1 :])
    fill = shape[rank_dim] // parts * inner
    cols = 0 if src is None else src.shape[rank_dim] // parts * inner
    return SlotCopy(buf, prod(shape[:rank_dim]) * parts, fill, fill, cols, src_offset, unit=inner, parts=rank_parts)


def _packed_copy(buf: torch.Tensor, src: torch.Tensor | None, src_offset: int, slot_rank: int) -> SlotCopy:
    """A packed B's slot ([N, r8] rows from its start, r8 = packed_rank(slot_rank, R)): the shard's
    [N, r] B in each row's first r columns, zeros to r8 (src None: zeros only). Never clipped: a
    packed slot is read no further than its own rows, whatever a previous adapter left past them."""
    width = packed_rank(slot_rank, buf.shape[2])
    return SlotCopy(buf, buf.shape[1], width, width, 0 if src is None else src.shape[1], src_offset)


def _staged(storage: torch.UntypedStorage, lo: int, nbytes: int, device: torch.device, dtype: torch.dtype):
    """The `nbytes` of host `storage` from address lo, on `device` as `dtype`: one copy (async from
    pinned memory). One copy, not pieces: the copy engine serves host -> device copies in the order
    queued, whatever the stream, so pieces would not let a step's own copies pass the shard's. The
    caching allocator reuses the buffer only for work queued after the scatter on the current
    stream, so it is freed when the caller drops it."""
    if not storage.data_ptr() <= lo <= lo + nbytes <= storage.data_ptr() + storage.nbytes():
        raise ValueError(f"shard bytes [{lo:#x}, +{nbytes}) are not inside their host buffer (a stale signature?)")
    host = torch.empty(0, dtype=torch.uint8).set_(storage, lo - storage.data_ptr(), (nbytes,), (1,))
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if nbytes:
        dev.copy_(host, non_blocking=True)
    return dev.view(dtype)


def _staged_views(staged: torch.Tensor | None, lo: int, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """One of the shard's host tensors -> its bytes in `staged` (the shard's span from host address lo,
    on the device) where they lie inside it, else a copy queued there."""
    raw = staged.view(torch.uint8) if staged is not None else None

    def view(t: torch.Tensor) -> torch.Tensor:
        start, size = t.data_ptr() - lo, t.numel() * t.element_size()
        if raw is not None and t.is_contiguous() and 0 <= start and start + size <= raw.numel() and start % t.element_size() == 0:
            return raw[start : start + size].view(t.dtype).view(t.shape)
        return t.to(device, non_blocking=True)

    return view


def _planned(model: nn.Module, key: LayoutKey):
    """(targets, layout) of a layout already planned for `model`'s CUDA slot buffers (no check that
    they are current: what a caller does with them stays valid for any buffers of that device; their
    written ranks may then be stale, which only `queued_load`'s loop-or-thread answer reads), or None."""
    known = getattr(model, _TARGETS_ATTR, None)
    if known is None or known.device.type != "cuda":
        return None
    with known.lock:
        layout = known.layouts.get(key)
    return (known, layout) if layout is not None and layout.plan is not None else None


def queued_load(model: nn.Module, slot: int, tensors: dict[str, torch.Tensor]) -> Callable[[], int] | None:
    """A load of `tensors` into `slot` of `model`'s slots begun, when all it does is queue device
    work: CUDA slot buffers, the shard in page-locked memory (ShardTensors.pinned, kept as it landed
    in the CPU cache), its layout checked and planned by an earlier load, and the scatter's tables
    for what this slot holds now built already (building them copies from pageable memory, which
    waits for the copy stream's queued work). Its host -> device copy is then queued on the current
    stream (the slot manager's copy stream), so that what the caller does next (the slot taken)
    overlaps the copy; the returned function finishes the load (as load_shard_into_slot, whose rank
    it returns). None otherwise, with nothing queued (the caller's copy thread loads it)."""
    signature = getattr(tensors, "signature", None)
    if not getattr(tensors, "pinned", False) or signature is None or signature[2] is None:
        return None
    if dora.split(tensors)[1] or any(k.startswith("tokens.") for k in tensors):
        return None  # a DoRA shard (its scales are worked out) or one with trainable tokens: load_shard_into_slot
    planned = _planned(model, signature[0])
    if planned is None or planned[0].fp8:
        return None  # FP8 slots: their quantization and copies are the copy thread's
    known, layout = planned
    clip = layout.plan.clips.get(known.written_rank(slot))
    if clip is None or str(known.device) not in clip.device_tables:
        return None
    staged = _staged(signature[2], signature[3], layout.span, known.device, next(iter(tensors.values())).dtype)
    return lambda: load_shard_into_slot(model, slot, tensors, staged=staged)


def _staged_early(model: nn.Module, key: LayoutKey, storage, lo: int, tensors: dict[str, torch.Tensor]):
    """A CUDA load of a layout already planned: its bytes staged before the slot buffers are
    checked (`_slot_targets`, ~0.05-0.1 ms of host time), so the host -> device copy, the longest
    part of a load, starts that much sooner. None otherwise (the load stages after its checks)."""
    planned = _planned(model, key) if storage is not None else None
    if planned is None:
        return None
    known, layout = planned
    return _staged(storage, lo, layout.span, known.device, next(iter(tensors.values())).dtype)


def _check_shard(modules: dict[str, nn.Module], known: frozenset, tensors: dict[str, torch.Tensor]) -> None:
    """ValueError unless every tensor belongs to a module and fits its slot buffers."""
    unknown = sorted(set(tensors) - known)
    if unknown:
        raise ValueError(f"shard has tensors for no LoRA module of this model: {unknown[:8]}")
    for name, module in modules.items():
        a, b = tensors.get(f"{name}.lora_a"), tensors.get(f"{name}.lora_b")
        if (a is None) != (b is None):
            raise ValueError(f"shard has only one of {name}.lora_a / {name}.lora_b")
        if a is None:
            continue
        rank_dim = module.slot_rank_dim
        dtype = module.shard_dtype  # an FP8 slot's shard: the adapter dtype
        for part, src, buf in (("lora_a", a, module.lora_a[0]), ("lora_b", b, module.lora_b[0])):
            if (err := slot_fit_error(buf, src, rank_dim, dtype)) is not None:
                raise ValueError(f"{name}.{part}: {err}")
        if a.shape[rank_dim] * module.rank_parts != b.shape[rank_dim]:
            parts = f" x {module.rank_parts} rank parts" if module.rank_parts > 1 else ""
            raise ValueError(f"{name}: lora_a rank {a.shape[rank_dim]}{parts} != lora_b rank {b.shape[rank_dim]}")


def _fp8_quantized(
    targets: _SlotTargets, tensors: dict[str, torch.Tensor], offsets, storage, lo: int, staged: torch.Tensor | None = None
) -> dict:
    """The FP8 modules' A and B of the shard, quantized on the slots' device (lora_fp8.quantized). A
    shard in one host storage is staged there in one copy (its tensors then views of it; `staged`:
    the scatter's staging of it, from the same first byte, used as it is); else each tensor is
    copied on its own."""
    names = [
        f"{n}.{part}"
        for n, m in targets.modules.items()
        if m.fp8_slots and f"{n}.lora_a" in tensors
        for part in ("lora_a", "lora_b")
    ]
    if not names:
        return {}
    device, src = targets.device, {k: tensors[k] for k in names}
    dtypes = {t.dtype for t in tensors.values()}
    where = dict(zip(tensors, offsets))
    one_piece = storage is not None and len(dtypes) == 1 and all(t.is_contiguous() for t in tensors.values())
    if staged is not None or (
        device.type == "cuda" and one_piece and all(where[k] % next(iter(dtypes)).itemsize == 0 for k in names)
    ):
        if staged is None:
            staged = _staged(storage, lo, max(where[k] + tensors[k].nbytes for k in names), device, torch.uint8)
        staged = staged.view(torch.uint8)
        src = {k: staged[where[k] : where[k] + t.nbytes].view(t.dtype).view(t.shape) for k, t in src.items()}
    elif src[names[0]].device != device:
        src = {k: t.to(device, non_blocking=True) for k, t in src.items()}
    return lora_fp8.quantized(src, names)


def _default_scatter(device: torch.device):
    return kernels.slot_scatter if device.type == "cuda" else None


def _clear_plan(modules: list[nn.Module], buffers: tuple) -> ScatterPlan | None:
    """Zeros over one slot of each of the non-FP8 modules' buffers (`buffers`: every module's), row by
    row as a load writes them (so `clipped` cuts them to a rank); None when there are none, or they
    are not all contiguous of one dtype. FP8 modules are left to reset_lora (their scales too). Kept
    by the list's first module, checked against the buffers."""
    cached = getattr(modules[0], _CLEAR_PLAN_ATTR, None)
    if cached is None or len(cached[0]) != len(buffers) or not all(map(operator.is_, cached[0], buffers)):
        plain = [m for m in modules if not m.fp8_slots]
        bufs = _buffers(plain)
        ok = bool(bufs) and len({b.dtype for b in bufs}) == 1 and all(b.is_contiguous() for b in bufs)
        plan = ScatterPlan(tuple(
            _slot_copy(buf, m.slot_rank_dim, None, 0, parts, m.rank_parts)
            for m in plain for buf, parts, part in ((m.lora_a, 1, "a"), (m.lora_b, m.rank_parts, "b"))
            if not (part == "b" and m.packed_b)  # a packed B: not cleared, as reset_lora
        )) if ok else None  # fmt: skip
        cached = (buffers, plan)
        setattr(modules[0], _CLEAR_PLAN_ATTR, cached)
    return cached[1]


def _clearing(modules: list[nn.Module], scatter=None):
    """(scatter, clear plan) for zeroing slots of `modules`; the plan None where no scatter applies."""
    buffers = _buffers(modules)
    scatter = scatter or (_default_scatter(buffers[0].device) if buffers else None)
    return scatter, _clear_plan(modules, buffers) if scatter is not None else None


def warm_slot_scatter(modules, slot: int = 0) -> None:
    """Builds the slot-load kernel before serving (the engine's warm-up): zeroes `slot`, which holds
    nothing yet, cut to rank 1, to rank 2 and whole, so that each word width a load or clear may
    use (kernels/triton_copy.py: 2-, 4- and 8-byte words for bf16) is built once."""
    scatter, plan = _clearing(list(modules))
    if plan is not None:
        for rank in (1, 2, None):
            scatter(plan.clipped(rank), None, slot)


def clear_slot(modules, slot: int, scatter=None) -> None:
    """Zeroes `slot` of every module (an iterable of LoRA modules, e.g. lora_modules(model).values()) in
    one go: on CUDA one launch, over the rank positions its adapter wrote only (FP8 modules: their
    values and scales zero-filled beside it, reset_lora). scatter: as in load_shard_into_slot."""
    modules = list(modules)
    dora.clear(modules, slot)
    scatter, plan = _clearing(modules, scatter)
    rest = modules if plan is None else [m for m in modules if m.fp8_slots]
    if plan is not None:
        plain = [m for m in modules if not m.fp8_slots]
        scatter(plan.clipped(written_rank(plain, slot)), None, slot)
        for m in plain:
            m.slot_ranks[slot] = 0
    if rest:
        writes = SlotWrites()
        for m in rest:
            m.reset_lora(slot, writes)
        writes.flush()


def load_shard_into_slot(
    model: nn.Module, slot: int, tensors: dict[str, torch.Tensor], scatter=None, staged: torch.Tensor | None = None
) -> int:
    """Copies one shard's tensors into `slot` of every LoRA module; modules absent from it are zeroed.
    Returns the slot's adapter rank as the kernels may read it (LoraMeta.slot_ranks): the largest
    rank among its modules, slot buffers being zero past each module's own.

    tensors: "<module>.lora_a" / "<module>.lora_b" as in docs/SHARD_FORMAT.md. Everything is checked
    before any slot buffer is written, so a bad shard leaves the slot as it was (a layout that passed
    once is not checked again). scatter: how a shard staged in one piece is scattered into the slots
    (default: kernels.slot_scatter on CUDA, one launch; None on the CPU: per-tensor copies there).
    staged: the shard's bytes on the device already (`queued_load`), else staged here.
    """
    rows = getattr(model, "token_rows", None)  # trainable tokens: executor/token_rows.py
    tensors, tokens = token_rows.split(tensors)
    if tokens and rows is None:
        raise ValueError(
            f"shard has trainable tokens ({sorted(tokens)[0]}, ...), but this model's slots were made without them "
            "(LoraSpec.trainable_tokens)"
        )
    tensors, magnitudes = dora.split(tensors)  # a DoRA shard's magnitudes: executor/dora.py
    key, offsets, storage, lo = shard_signature(tensors)
    if staged is None:
        staged = _staged_early(model, key, storage, lo, tensors)
    targets = _slot_targets(model)
    layout = targets.layout(tensors, key, offsets)
    dora.check(targets.modules, tensors, magnitudes)
    if rows is not None:
        rows.check(tokens, head_lora="lm_head.lora_a" in tensors)
    scatter = scatter or _default_scatter(targets.device)
    scattered = scatter is not None and layout.plan is not None  # the scatter writes targets.scattered
    if scattered:
        dtype = next(iter(tensors.values())).dtype if tensors else torch.uint8
        if staged is None or staged.device != targets.device:
            staged = _staged(storage, lo, layout.span, targets.device, dtype) if tensors else None
        # zeros only up to what the slot's previous adapter wrote: its tail past that is zero already
        scatter(layout.plan.clipped(targets.written_rank(slot)), staged, slot)
    if not scattered or targets.fp8:  # the FP8 modules (and, without the scatter, every module)
        fp8 = _fp8_quantized(targets, tensors, offsets, storage, lo, staged if scattered else None) if targets.fp8 else {}
        writes = SlotWrites()  # these modules' copies and zero-fills issued together
        for name, module in targets.modules.items():
            if scattered and not module.fp8_slots:
                continue
            rank = {"slot_rank": layout.max_rank} if module.packed_b else {}  # a packed B's row width
            if f"{name}.lora_a" in tensors and module.fp8_slots:
                (qa, sa), (qb, sb) = fp8[f"{name}.lora_a"], fp8[f"{name}.lora_b"]
                module.set_lora(slot, qa, qb, writes, **rank, scales=(sa, sb))
            elif f"{name}.lora_a" in tensors:
                module.set_lora(slot, tensors[f"{name}.lora_a"], tensors[f"{name}.lora_b"], writes, **rank)
            else:
                module.reset_lora(slot, writes, **rank)
        writes.flush()
    for ranks, r in layout.ranks:
        ranks[slot] = r
    dora.load(model, targets.modules, slot, tensors, magnitudes, _staged_views(staged, lo, targets.device) if scattered else None)
    if rows is not None:
        rows.load(slot, tokens)
    return layout.max_rank
