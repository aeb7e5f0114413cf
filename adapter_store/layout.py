"""Layout kinds and their slicing rules: pure functions of (tensors, layout, rank).

The executor declares a `loraserve.v1.Layout`; the store cuts each module's packed LoRA
tensors for one (tp_rank, ep_rank) by the rule of the module's kind, the same rules as
vLLM's slice_lora_a / slice_lora_b:

  column-like (COLUMN, LM_HEAD, MERGED_COLUMN, QKV, MOE_W13): B cut on each slice's output dim
  row-like (ROW, MOE_W2):                                      A cut on the input dim
  fully sharded layouts also cut the rank dim of A (column-like) or the output dim of B (row-like)
  REPLICATED, EMBEDDING:                                       nothing cut
  MoE kinds keep only the EP rank's contiguous block of experts.

Shapes (see docs/SHARD_FORMAT.md): a: [S, r, in], b: [N, r] with N = sum of slice outputs;
MoE adds a leading expert dim to both.
"""

from __future__ import annotations

import hashlib

import torch

from loraserve.errors import invalid
from loraserve.v1 import common_pb2 as pb

K = pb.ModuleKind
COLUMN_LIKE = {K.COLUMN, K.LM_HEAD, K.MERGED_COLUMN, K.QKV, K.MOE_W13}
ROW_LIKE = {K.ROW, K.MOE_W2}
UNSHARDED = {K.REPLICATED, K.EMBEDDING}
MOE = {K.MOE_W13, K.MOE_W2}
SLICES = {K.COLUMN: 1, K.LM_HEAD: 1, K.ROW: 1, K.REPLICATED: 1, K.EMBEDDING: 1, K.MOE_W2: 1, K.QKV: 3, K.MOE_W13: 2}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MAX_TP = 8


def layout_hash(layout: pb.Layout) -> str:
    """Stable identity of a layout: part of every cache key."""
    return hashlib.sha256(layout.SerializeToString(deterministic=True)).hexdigest()[:32]


def check_layout(layout: pb.Layout) -> None:
    """Raises INVALID_ARGUMENT naming the field when a layout cannot be sliced."""
    tp, ep = layout.tp_size or 1, layout.ep_size or 1
    if not 1 <= tp <= MAX_TP:
        raise invalid(f"layout.tp_size {layout.tp_size} must be in 1..{MAX_TP}")
    if layout.dtype not in DTYPES:
        raise invalid(f"layout.dtype {layout.dtype!r} must be one of {sorted(DTYPES)}")
    if layout.max_rank < 1:
        raise invalid("layout.max_rank must be >= 1")
    if not layout.modules:
        raise invalid("layout has no modules")
    seen: set[str] = set()
    for m in layout.modules:
        where = f"layout module {m.name!r}"
        if not m.name or m.name in seen:
            raise invalid(f"{where}: empty or duplicate module name")
        seen.add(m.name)
        if m.kind == K.MODULE_KIND_UNSPECIFIED:
            raise invalid(f"{where}: kind is unspecified")
        want = SLICES.get(m.kind)
        if want is not None and len(m.output_sizes) != want:
            raise invalid(f"{where}: kind {K.Name(m.kind)} needs {want} output_sizes, got {len(m.output_sizes)}")
        if m.kind == K.MERGED_COLUMN and len(m.output_sizes) < 2:
            raise invalid(f"{where}: MERGED_COLUMN needs >= 2 output_sizes")
        if len(m.peft_modules) != len(m.output_sizes):
            raise invalid(f"{where}: {len(m.peft_modules)} peft_modules for {len(m.output_sizes)} slices")
        spans = [name for name, _, _ in peft_spans(m.peft_modules, m.output_sizes)]
        if len(spans) != len(set(spans)):
            raise invalid(f"{where}: a PEFT module named for several slices must name consecutive ones: {list(m.peft_modules)}")
        if m.input_size < 1 or any(n < 1 for n in m.output_sizes):
            raise invalid(f"{where}: input_size and output_sizes must be >= 1")
        if m.kind in MOE:
            if m.num_experts < 1 or m.num_experts % ep:
                raise invalid(f"{where}: num_experts {m.num_experts} not divisible by ep_size {ep}")
            if any("{e}" not in p for p in m.peft_modules):
                raise invalid(f"{where}: MoE peft_modules need an '{{e}}' expert placeholder")
        _check_divisible(m, tp, where)


def peft_spans(peft_modules, output_sizes) -> list[tuple[str, slice, slice]]:
    """(PEFT module, its slices, its rows of the packed B) for each run of equal consecutive
    peft_modules: a module named for several slices is one fused PEFT module spanning them (Phi-3's
    qkv_proj over q, k, v), its A packed into each and its B's rows split over them in order."""
    spans: list[tuple[str, slice, slice]] = []
    row = 0
    for s, (name, n) in enumerate(zip(peft_modules, output_sizes)):
        if spans and spans[-1][0] == name:
            _, slices, rows = spans[-1]
            spans[-1] = (name, slice(slices.start, s + 1), slice(rows.start, row + n))
        else:
            spans.append((name, slice(s, s + 1), slice(row, row + n)))
        row += n
    return spans


def _check_divisible(m: pb.ModuleLayout, tp: int, where: str) -> None:
    if m.kind == K.QKV:
        if not m.head_size:
            raise invalid(f"{where}: QKV needs head_size")
        q, k, v = m.output_sizes
        if q % m.head_size or k % m.head_size or k != v:
            raise invalid(f"{where}: q/k/v sizes {q}/{k}/{v} are not whole heads of head_size {m.head_size}")
        q_heads, kv_heads = q // m.head_size, k // m.head_size
        if q_heads % tp:
            raise invalid(f"{where}: {q_heads} attention heads do not split over tp_size {tp}")
        if kv_heads >= tp and kv_heads % tp or kv_heads < tp and tp % kv_heads:
            raise invalid(f"{where}: {kv_heads} kv heads do not split over tp_size {tp}")
    elif m.kind in COLUMN_LIKE and any(n % tp for n in m.output_sizes):
        raise invalid(f"{where}: output_sizes {list(m.output_sizes)} not divisible by tp_size {tp}")
    elif m.kind in ROW_LIKE and m.input_size % tp:
        raise invalid(f"{where}: input_size {m.input_size} not divisible by tp_size {tp}")


def _part(size: int, parts: int, index: int) -> slice:
    n = size // parts
    return slice(index * n, (index + 1) * n)


def qkv_output_ranges(m: pb.ModuleLayout, tp: int, tp_rank: int) -> list[slice]:
    """Row ranges of q, k and v this TP rank keeps; kv heads are replicated when tp > kv heads."""
    q, k, v = m.output_sizes
    kv_heads = k // m.head_size
    if kv_heads >= tp:
        kv = _part(k, tp, tp_rank)
    else:
        head = tp_rank // (tp // kv_heads)
        kv = slice(head * m.head_size, (head + 1) * m.head_size)
    return [_part(q, tp, tp_rank), kv, kv]


def output_ranges(m: pb.ModuleLayout, tp: int, tp_rank: int, fully_sharded: bool) -> list[slice]:
    """For each slice, the rows of its B this rank keeps (relative to the slice)."""
    if m.kind == K.QKV:
        return qkv_output_ranges(m, tp, tp_rank)
    if m.kind in COLUMN_LIKE or (m.kind in ROW_LIKE and fully_sharded):
        return [_part(n, tp, tp_rank) for n in m.output_sizes]
    return [slice(0, n) for n in m.output_sizes]


def input_range(m: pb.ModuleLayout, tp: int, tp_rank: int) -> slice:
    if m.kind in ROW_LIKE:
        return _part(m.input_size, tp, tp_rank)
    return slice(0, m.input_size)


def rank_range(m: pb.ModuleLayout, rank: int, tp: int, tp_rank: int, fully_sharded: bool) -> slice:
    """Fully sharded column-like layers cut A's rank dim (rank is padded to a multiple of tp)."""
    if fully_sharded and m.kind in COLUMN_LIKE:
        return _part(rank, tp, tp_rank)
    return slice(0, rank)


def expert_range(m: pb.ModuleLayout, ep: int, ep_rank: int) -> slice:
    return _part(m.num_experts, ep, ep_rank)


def slice_module(
    m: pb.ModuleLayout, a: torch.Tensor, b: torch.Tensor, layout: pb.Layout, rank: pb.ShardRank
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cuts one module's full packed (a, b) for (tp_rank, ep_rank).

    a: [S, r, in] (MoE: [E, S, r, in]); EMBEDDING a: [vocab, r]
    b: [N, r]     (MoE: [E, N, r])
    """
    tp, ep = layout.tp_size or 1, layout.ep_size or 1
    if m.kind in UNSHARDED:
        return a, b
    if m.kind in MOE:
        experts = expert_range(m, ep, rank.ep_rank)
        a, b = a[experts], b[experts]
    r = a.shape[-2]
    rows = rank_range(m, r, tp, rank.tp_rank, layout.fully_sharded)
    a = a[..., rows, input_range(m, tp, rank.tp_rank)]
    offsets = [0]
    for n in m.output_sizes:
        offsets.append(offsets[-1] + n)
    keep = output_ranges(m, tp, rank.tp_rank, layout.fully_sharded)
    b = torch.cat([b[..., offsets[s] + k.start : offsets[s] + k.stop, :] for s, k in enumerate(keep)], dim=-2)
    return a.contiguous(), b.contiguous()
