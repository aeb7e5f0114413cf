"""LoRA-capable layers with per-slot weight buffers, the layout the executor declares, and shard loading.

Every LoRA-capable module has the same surface: `create_lora_weights`, `set_lora`, `reset_lora`,
`forward(x, lora_meta)`. Slot buffers hold up to `max_loras` adapters at once; each token picks its
own slot through the step's LoraMeta (slot -1 = base model only). Slot buffers are zero beyond
each adapter's rank, so the kernels may compute over the full `max_rank` and stay exact; each
module also keeps its slots' ranks on the host (`slot_ranks`) to skip modules no active
adapter targets and, on the reference path, to cut the rank to the step's largest. That is a
contract on every writer of slot buffers (the set_lora / reset_lora below, slot loads and clears):
a module's slot holds zeros past its `slot_ranks` entry. Loads and clears rely on it to zero only
the rank positions the slot's previous adapter wrote (a rank-8 load over a rank-8 one moves a
rank-8 adapter's bytes, not the slot's whole `max_rank`).

The exception: with LoraSpec.packed_b a dense layer's B slot holds [N, r8] rows from its start
(r8: the slot's adapter rank rounded up to 8, at most max_rank), written at each load and never
zeroed past them or by a clear; it is read only as such rows (`packed_rows`), never as [N, R].
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from math import prod

import torch
import torch.nn.functional as F
from torch import nn

from loraserve import kernels
from loraserve.kernels import LoraMeta
from loraserve.kernels.copy_reference import ScatterPlan, SlotCopy
from loraserve.v1 import common_pb2

from .model.config import ModelConfig
from .parallel import TPGroup
from .shard_tensors import ShardTensors

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class LoraSpec:
    max_loras: int  # GPU slots
    max_rank: int  # slot rank; adapters of lower rank are zero-padded
    dtype: torch.dtype
    targets_embeddings: bool = False  # also allocate slots for embed_tokens and lm_head (vocab-sized: costly)
    fully_sharded: bool = False  # under TP, also cut the adapter rank (column layers) / B's outputs (row layers)
    # Dense layers keep each slot's B packed at the slot's rank rounded up to 8 (its first N x r8
    # elements, rows contiguous) instead of as [N, R] rows: the expand then reads whole sectors of
    # a low-rank adapter's B (kernels/triton_lora.py lora_expand's packed). The executor's default on
    # CUDA (ExecutorConfig.packs_lora_b): -0.27 ms a mixed decode step (docs/BENCHMARKS.md, "Thirtieth pass").
    packed_b: bool = False


def _fit_error(slot_buf: torch.Tensor, src: torch.Tensor, rank_dim: int = 1) -> str | None:
    """Why src cannot be copied into slot_buf's first r entries of rank_dim (1 for dense modules'
    per-slot buffers, 2 for experts': their leading dim is the expert)."""
    if src.dim() != slot_buf.dim() or src.dtype != slot_buf.dtype:
        return f"shard tensor {tuple(src.shape)} {src.dtype} vs slot {tuple(slot_buf.shape)} {slot_buf.dtype}"
    r = src.shape[rank_dim]
    want = (*slot_buf.shape[:rank_dim], r, *slot_buf.shape[rank_dim + 1 :])
    if r > slot_buf.shape[rank_dim] or tuple(src.shape) != want:
        return f"shard tensor {tuple(src.shape)} does not fit slot {tuple(slot_buf.shape)} (rank is dim {rank_dim})"
    return None


def _step_weights(m: nn.Module, meta: LoraMeta | None, device: torch.device):
    """(lora_a, lora_b) of module m to compute this step with, or None if no token needs it.

    Slot buffers are zero past each adapter's rank and wholly zero for modules an adapter does
    not target, so both cuts below are exact: a module that no active slot's adapter targets
    is skipped (every device, in eager steps; the decode CUDA graphs pass a LoraMeta without
    host_slots, so a captured graph never bakes a skip in), and on the reference path the rank dim (dim 2 of every slot buffer) is cut to the
    largest rank among the active slots (A's only where B is packed: the reference unpacks B). The Triton kernels keep the full slot rank: their
    tuned block sizes are per slot shape.
    """
    if meta is None or m.lora_a is None:
        return None
    if meta.host_slots is None:
        return m.lora_a, m.lora_b
    r = max((m.slot_ranks[s] for s in meta.host_slots), default=0)
    if r == 0:
        return None
    rank_dim = m.slot_rank_dim + 1  # of the [max_loras, ...] buffers
    if device.type == "cuda" or r == m.lora_a.shape[rank_dim] or m.rank_parts > 1:
        return m.lora_a, m.lora_b  # rank_parts > 1: B's columns are laid out per rank part of the full slot rank
    if m.packed_b:  # a packed B is not [N, R] rows: the reference unpacks it whole
        return m.lora_a.narrow(rank_dim, 0, r), m.lora_b
    return m.lora_a.narrow(rank_dim, 0, r), m.lora_b.narrow(rank_dim, 0, r)


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The stream LoRA shrink runs on beside the base GEMM (one per GPU), or None off CUDA."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(index)
    return stream


class SlotWrites:
    """The copies and zero-fills of one adapter load, issued together by `flush` (one multi-tensor
    copy and one multi-tensor zero).

    The path of the CPU, and of CUDA loads the one-launch scatter does not take (see
    load_shard_into_slot): there every tensor is a copy and a zero-fill of its own, and an 8B
    model's 256 (32 layers x qkv, o, gate_up, down, A and B) cost more host time than their bytes
    take (15-19 ms on an H100 for 40-160 MiB, the pinned floor being 0.8-6 ms), even when one
    host->device copy stages them all first.
    """

    def __init__(self):
        self.dst: list[torch.Tensor] = []
        self.src: list[torch.Tensor] = []
        self.zeros: list[torch.Tensor] = []

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.dst.append(dst)
        self.src.append(src)

    def zero(self, dst: torch.Tensor) -> None:
        if dst.numel():
            self.zeros.append(dst)

    def flush(self) -> None:
        if self.dst:
            torch._foreach_copy_(self.dst, self.src, non_blocking=True)
        if self.zeros:
            torch._foreach_zero_(self.zeros)
        self.dst, self.src, self.zeros = [], [], []


def _copy_into_slot(slot_buf: torch.Tensor, src: torch.Tensor, rank_dim: int = 1, writes: SlotWrites | None = None) -> None:
    """slot_buf[.., :r] = src, slot_buf[.., r:] = 0 on rank_dim. No reshape or cast. src must outlive the async copy.
    writes: record the copy and the zero-fill there (issued by its flush) instead of now."""
    if (err := _fit_error(slot_buf, src, rank_dim)) is not None:
        raise ValueError(err)
    r = src.shape[rank_dim]
    own = writes is None
    writes = writes or SlotWrites()
    writes.copy(slot_buf.narrow(rank_dim, 0, r), src)
    writes.zero(slot_buf.narrow(rank_dim, r, slot_buf.shape[rank_dim] - r))
    if own:
        writes.flush()


def packed_rank(rank: int, slot_width: int) -> int:
    """The row width of a B packed at slot rank `rank` in slots of rank `slot_width` (a multiple of
    8): rounded up to 8, at most the slot's (kernels/triton_lora.py reads it so; FULL_RANK, a rank
    not known, reads the whole slot)."""
    return min(-(-rank // 8) * 8, slot_width)


def packed_rows(lora_b: torch.Tensor, slot: int, rank: int) -> torch.Tensor:
    """Slot `slot` of a packed B buffer ([max_loras, N, R]) as the [N, packed_rank(rank, R)] rows it holds."""
    n, width = lora_b.shape[1], packed_rank(rank, lora_b.shape[2])
    return lora_b[slot].view(-1)[: n * width].view(n, width)


def _set_slot(m: nn.Module, slot: int, lora_a: torch.Tensor, lora_b: torch.Tensor, writes: SlotWrites | None) -> None:
    """set_lora of a module whose A and B both go whole into the slot (rank on m.slot_rank_dim)."""
    own = writes is None
    writes = writes or SlotWrites()
    _copy_into_slot(m.lora_a[slot], lora_a, m.slot_rank_dim, writes)
    _copy_into_slot(m.lora_b[slot], lora_b, m.slot_rank_dim, writes)
    if own:
        writes.flush()
    m.slot_ranks[slot] = lora_a.shape[m.slot_rank_dim]


def _reset_slot(m: nn.Module, slot: int, writes: SlotWrites | None) -> None:
    own = writes is None
    writes = writes or SlotWrites()
    writes.zero(m.lora_a[slot])
    writes.zero(m.lora_b[slot])
    if own:
        writes.flush()
    m.slot_ranks[slot] = 0


class LinearWithLoRA(nn.Module):
    """y = x @ W.T + b + per-token LoRA delta, for one or several output slices packed in W.

    weight:  [N, in], N = sum(output_sizes) (q|k|v for QKV, gate|up for gate_up, one slice otherwise)
    lora_a:  [max_loras, S, max_rank, in]
    lora_b:  [max_loras, N, max_rank]  (scaling already folded in by the adapter store); with
             packed_b (LoraSpec.packed_b) each slot's first N x r8 elements as [N, r8] rows instead

    Under TP (executor/parallel.py) in_features and output_sizes are this rank's. A column-parallel
    layer holds its slices' output rows; a `row_parallel` one its input columns, and all-reduces
    the partial sums (bias added once, after). Fully sharded LoRA also cuts, on a column layer,
    A's rank (lora_a: [max_loras, S, max_rank / tp, in]; the shrink output is all-gathered, and
    B's columns sit in tp parts of max_rank / tp, rank part p's rows of A at part p) and, on a
    row layer, B's outputs (lora_b: [max_loras, N / tp, max_rank]; the shrink output is
    all-reduced, the expand adds into this rank's 1/tp of the output columns).
    """

    slot_rank_dim = 1  # rank's dim in one slot's lora_a [S, r, in] and lora_b [N, r]

    def __init__(self, in_features, output_sizes, bias, lora: LoraSpec | None, dtype, device,
                 tp: TPGroup | None = None, row_parallel: bool = False):
        super().__init__()
        self.tp = tp or TPGroup()
        self.row_parallel = row_parallel and self.tp.size > 1
        sharded = lora is not None and lora.fully_sharded and self.tp.size > 1
        self.rank_parts = self.tp.size if sharded and not self.row_parallel else 1  # parts of A's rank over ranks
        self.in_features = in_features
        self.output_sizes = tuple(output_sizes)
        offsets = [0]
        for n in self.output_sizes:
            offsets.append(offsets[-1] + n)
        self.slice_offsets = tuple(offsets)  # (0, n0, n0 + n1, ...)
        n_out = offsets[-1]
        # LoRA's output columns: all of them, or a fully sharded row layer's 1/tp starting at lora_out_start
        self.lora_offsets, self.lora_out_start = self.slice_offsets, 0
        if sharded and self.row_parallel:
            self.lora_offsets, self.lora_out_start = (0, n_out // self.tp.size), self.tp.rank * (n_out // self.tp.size)
        self.weight = nn.Parameter(torch.empty(n_out, in_features, dtype=dtype, device=device), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(n_out, dtype=dtype, device=device), requires_grad=False) if bias else None
        )
        self.register_buffer("lora_a", None, persistent=False)  # allocated by create_lora_weights
        self.register_buffer("lora_b", None, persistent=False)
        # B packed at each slot's rank (LoraSpec.packed_b): not where its rank dim holds tp parts
        self.packed_b = (lora is not None and lora.packed_b and self.rank_parts == 1 and lora.max_rank % 8 == 0
                         and self.lora_offsets is self.slice_offsets)
        if lora is not None:
            self.create_lora_weights(lora.max_loras, lora.max_rank, lora.dtype)

    def create_lora_weights(self, max_loras: int, max_rank: int, dtype: torch.dtype | None = None) -> None:
        dtype = dtype or self.weight.dtype
        dev = self.weight.device
        n_slices, n_out = len(self.output_sizes), self.lora_offsets[-1]
        if max_rank % self.rank_parts:
            raise ValueError(f"max LoRA rank {max_rank} does not split over {self.rank_parts} fully sharded ranks")
        a = torch.zeros(max_loras, n_slices, max_rank // self.rank_parts, self.in_features, dtype=dtype, device=dev)
        b = torch.zeros(max_loras, n_out, max_rank, dtype=dtype, device=dev)
        self.register_buffer("lora_a", a, persistent=False)
        self.register_buffer("lora_b", b, persistent=False)
        self.slot_ranks = [0] * max_loras  # host copy: each slot's rank in this module, 0 = not targeted

    def set_lora(self, slot: int, lora_a: torch.Tensor, lora_b: torch.Tensor, writes: SlotWrites | None = None,
                 slot_rank: int | None = None) -> None:
        """lora_a: [S, r, in], lora_b: [N, r] (a shard's tensors, already in the slot dtype).
        Fully sharded column layers: lora_a [S, r / tp, in], lora_b [N, r], r a multiple of tp.
        writes: record the copies there (see SlotWrites) instead of issuing them now.
        slot_rank: the adapter's largest rank over its modules (what the step's LoraMeta.slot_ranks
        will say; default this module's), at which a packed B is laid out."""
        own = writes is None
        writes = writes or SlotWrites()
        _copy_into_slot(self.lora_a[slot], lora_a, writes=writes)
        if self.packed_b:
            if (err := _fit_error(self.lora_b[slot], lora_b)) is not None:
                raise ValueError(err)
            rows = packed_rows(self.lora_b, slot, max(slot_rank or 0, lora_b.shape[1]))
            writes.copy(rows[:, : lora_b.shape[1]], lora_b)
            writes.zero(rows[:, lora_b.shape[1] :])
        elif self.rank_parts == 1:
            _copy_into_slot(self.lora_b[slot], lora_b, writes=writes)
        else:  # rank part p of B (columns p*r/tp ...) goes to columns p*R/tp ... of the slot
            n, parts = lora_b.shape[0], self.rank_parts
            dst = self.lora_b[slot].view(n, parts, -1)
            src = lora_b.view(n, parts, lora_b.shape[1] // parts)
            writes.copy(dst[:, :, : src.shape[2]], src)
            writes.zero(dst[:, :, src.shape[2] :])
        if own:
            writes.flush()
        self.slot_ranks[slot] = lora_a.shape[1]

    def reset_lora(self, slot: int, writes: SlotWrites | None = None, slot_rank: int | None = None) -> None:
        """Zeroes the slot. A packed B is not zeroed by a clear (a cleared slot's rank is 0: nothing
        reads it, and its A is zero); slot_rank (in a load of an adapter that does not target this
        module): its rows at that rank are, as the load's scatter plan writes them."""
        if not self.packed_b:
            return _reset_slot(self, slot, writes)
        own = writes is None
        writes = writes or SlotWrites()
        writes.zero(self.lora_a[slot])
        if slot_rank:
            writes.zero(packed_rows(self.lora_b, slot, slot_rank))
        if own:
            writes.flush()
        self.slot_ranks[slot] = 0

    def forward(self, x: torch.Tensor, lora_meta: LoraMeta | None = None) -> torch.Tensor:
        if self.row_parallel:
            return self._forward_row_parallel(x, lora_meta)
        weights = _step_weights(self, lora_meta, x.device)
        if weights is None:
            return kernels.linear(x, self.weight, self.bias)  # [T, N]
        lora_a, lora_b = weights
        ranked = self.rank_parts == 1  # a fully sharded column layer's rank dim holds tp parts
        side = _side_stream(x.device)
        if side is None:
            y = kernels.linear(x, self.weight, self.bias)
            buf = kernels.lora_shrink(x, lora_a, lora_meta, ranked=ranked)  # [S, T, rank] float32
            if self.rank_parts > 1:
                buf = self.tp.all_gather(buf)  # [S, T, max_rank]: every rank part of x @ A.T
            return kernels.lora_expand(y, buf, lora_b, self.slice_offsets, lora_meta, ranked, packed=self.packed_b)
        # CUDA: shrink (and its zeroing, unless the step's shrink workspace is zeroed already) runs on
        # a side stream beside the base GEMM, which is bandwidth-bound at decode and hides it; only
        # expand waits for both. Captured graphs keep the fork and join. Memory is safe: the side
        # stream waits for the main one before each use, so nothing it frees is reused while the
        # main stream still reads it.
        main = torch.cuda.current_stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            buf = kernels.lora_shrink(x, lora_a, lora_meta, ranked=ranked)
        y = kernels.linear(x, self.weight, self.bias)
        main.wait_stream(side)
        if self.rank_parts > 1:
            buf = self.tp.all_gather(buf)
        return kernels.lora_expand(y, buf, lora_b, self.slice_offsets, lora_meta, ranked, packed=self.packed_b)

    def _forward_row_parallel(self, x: torch.Tensor, lora_meta: LoraMeta | None) -> torch.Tensor:
        """x: [T, in / tp], this rank's input columns. Every term before the all-reduce is a
        partial sum over them, LoRA's included (expand is linear in the shrink output)."""
        y = kernels.linear(x, self.weight)  # [T, N], partial
        weights = _step_weights(self, lora_meta, x.device)
        if weights is not None:
            lora_a, lora_b = weights
            buf = kernels.lora_shrink(x, lora_a, lora_meta)  # [1, T, rank], partial
            if self.lora_offsets is self.slice_offsets:
                kernels.lora_expand(y, buf, lora_b, self.slice_offsets, lora_meta, packed=self.packed_b)
            else:  # fully sharded: the whole x @ A.T, times this rank's rows of B, into its columns
                buf = self.tp.all_reduce(buf)
                out = y.narrow(1, self.lora_out_start, self.lora_offsets[-1])
                kernels.lora_expand(out, buf, lora_b, self.lora_offsets, lora_meta)
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabEmbeddingWithLoRA(nn.Module):
    """Token embedding with per-token LoRA: y = W[ids] + lora_a[slot, ids] @ lora_b[slot].T

    weight:  [vocab, dim]  (under TP: this rank's vocab / tp rows, partial lookups all-reduced)
    lora_a:  [max_loras, vocab, max_rank]   (PEFT's lora_embedding_A, transposed; never sharded)
    lora_b:  [max_loras, dim, max_rank]
    """

    slot_rank_dim = 1  # one slot's lora_a [vocab, r], lora_b [dim, r]
    rank_parts = 1

    def __init__(self, vocab_size, embed_dim, lora: LoraSpec | None, dtype, device, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp or TPGroup()
        self.vocab_size = vocab_size
        rows = self.tp.part(vocab_size)
        self.vocab_start = rows.start
        self.weight = nn.Parameter(torch.empty(rows.stop - rows.start, embed_dim, dtype=dtype, device=device),
                                   requires_grad=False)
        self.slice_offsets = (0, embed_dim)
        self.register_buffer("lora_a", None, persistent=False)  # allocated by create_lora_weights
        self.register_buffer("lora_b", None, persistent=False)
        self.packed_b = False  # its B stays [.., R] rows (LoraSpec.packed_b is for dense linear layers)
        if lora is not None:
            self.create_lora_weights(lora.max_loras, lora.max_rank, lora.dtype)

    def create_lora_weights(self, max_loras: int, max_rank: int, dtype: torch.dtype | None = None) -> None:
        dtype = dtype or self.weight.dtype
        vocab, dim = self.vocab_size, self.weight.shape[1]
        a = torch.zeros(max_loras, vocab, max_rank, dtype=dtype, device=self.weight.device)
        b = torch.zeros(max_loras, dim, max_rank, dtype=dtype, device=self.weight.device)
        self.register_buffer("lora_a", a, persistent=False)
        self.register_buffer("lora_b", b, persistent=False)
        self.slot_ranks = [0] * max_loras  # as in LinearWithLoRA

    def set_lora(self, slot: int, lora_a: torch.Tensor, lora_b: torch.Tensor, writes: SlotWrites | None = None) -> None:
        """lora_a: [vocab, r], lora_b: [dim, r]."""
        _set_slot(self, slot, lora_a, lora_b, writes)

    def reset_lora(self, slot: int, writes: SlotWrites | None = None) -> None:
        _reset_slot(self, slot, writes)

    def forward(self, ids: torch.Tensor, lora_meta: LoraMeta | None = None) -> torch.Tensor:
        if self.tp.size == 1:
            y = F.embedding(ids, self.weight)  # [T, dim]
        else:  # rows of other ranks' tokens are 0 here; the all-reduce fills them in
            local = ids - self.vocab_start
            inside = (local >= 0) & (local < self.weight.shape[0])
            y = F.embedding(local.masked_fill(~inside, 0), self.weight) * inside.unsqueeze(1).to(self.weight.dtype)
            y = self.tp.all_reduce(y)
        weights = _step_weights(self, lora_meta, ids.device)
        if weights is None:
            return y
        lora_a, lora_b = weights
        buf = kernels.lora_embedding_shrink(ids, lora_a, lora_meta)  # [1, T, rank]
        return kernels.lora_expand(y, buf, lora_b, self.slice_offsets, lora_meta)


class ExpertsWithLoRA(nn.Module):
    """One projection of every expert (w13 = gate|up, or w2 = down), with per-slot expert LoRA.

    The fused MoE kernel (kernels.fused_moe) reads both projections of a layer at once, so this
    module only holds weights and slots; executor/model/moe.py's block calls the kernel.

    weight:  [E, N, in], N = sum(output_sizes) (I|I for w13, H for w2)
    lora_a:  [max_loras, E, S, max_rank, in]
    lora_b:  [max_loras, E, N, max_rank]  (scaling already folded in by the adapter store)

    Under expert parallelism E is this rank's block of experts (the store's EP shard has the same).
    """

    slot_rank_dim = 2  # one slot's lora_a [E, S, r, in], lora_b [E, N, r]
    rank_parts = 1  # experts are never tensor-parallel: LoRA's rank is whole

    def __init__(self, num_experts, in_features, output_sizes, lora: LoraSpec | None, dtype, device):
        super().__init__()
        self.num_experts, self.in_features, self.output_sizes = num_experts, in_features, tuple(output_sizes)
        n_out = sum(self.output_sizes)
        self.weight = nn.Parameter(
            torch.empty(num_experts, n_out, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.register_buffer("lora_a", None, persistent=False)  # allocated by create_lora_weights
        self.register_buffer("lora_b", None, persistent=False)
        self.packed_b = False  # its B stays [.., R] rows (LoraSpec.packed_b is for dense linear layers)
        if lora is not None:
            self.create_lora_weights(lora.max_loras, lora.max_rank, lora.dtype)

    def create_lora_weights(self, max_loras: int, max_rank: int, dtype: torch.dtype | None = None) -> None:
        dtype = dtype or self.weight.dtype
        e, n_out, dev = self.num_experts, self.weight.shape[1], self.weight.device
        a = torch.zeros(max_loras, e, len(self.output_sizes), max_rank, self.in_features, dtype=dtype, device=dev)
        b = torch.zeros(max_loras, e, n_out, max_rank, dtype=dtype, device=dev)
        self.register_buffer("lora_a", a, persistent=False)
        self.register_buffer("lora_b", b, persistent=False)
        self.slot_ranks = [0] * max_loras  # as in LinearWithLoRA

    def set_lora(self, slot: int, lora_a: torch.Tensor, lora_b: torch.Tensor, writes: SlotWrites | None = None) -> None:
        """lora_a: [E, S, r, in], lora_b: [E, N, r]."""
        _set_slot(self, slot, lora_a, lora_b, writes)

    def reset_lora(self, slot: int, writes: SlotWrites | None = None) -> None:
        _reset_slot(self, slot, writes)

    def step_lora(self, lora_meta: LoraMeta | None, device: torch.device):
        """(lora_a, lora_b) for this step, or None when no token's adapter targets these experts."""
        return _step_weights(self, lora_meta, device)


LORA_MODULE_TYPES = (LinearWithLoRA, VocabEmbeddingWithLoRA, ExpertsWithLoRA)


def lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Modules that have slot buffers, by their path in the model."""
    return {
        name: m for name, m in model.named_modules() if isinstance(m, LORA_MODULE_TYPES) and m.lora_a is not None
    }


def declare_layout(model_cfg: ModelConfig, spec: LoraSpec, base_model_name: str, tp_size: int = 1, ep_size: int = 1):
    """The loraserve.v1.Layout of the slot buffers LlamaForCausalLM(cfg, spec) allocates.

    Module sizes are the whole model's; the store cuts each rank's part (tp_size, ep_size), so every
    rank declares the same layout and names its own ShardRank when it fetches.

    Module names are the executor's; peft_modules are the PEFT names packed into each, in slice order.
    """
    c = model_cfg
    K = common_pb2.ModuleKind
    modules = []
    if spec.targets_embeddings:
        modules.append(
            common_pb2.ModuleLayout(
                name="model.embed_tokens", kind=K.EMBEDDING, input_size=c.vocab_size,
                output_sizes=[c.hidden_size], peft_modules=["model.embed_tokens"],
            )
        )
    for i in range(c.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        modules += [
            common_pb2.ModuleLayout(
                name=f"{attn}.qkv_proj", kind=K.QKV, input_size=c.hidden_size,
                output_sizes=[c.q_size, c.kv_size, c.kv_size], head_size=c.head_dim,
                peft_modules=[f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"],
            ),
            common_pb2.ModuleLayout(
                name=f"{attn}.o_proj", kind=K.ROW, input_size=c.q_size,
                output_sizes=[c.hidden_size], peft_modules=[f"{attn}.o_proj"],
            ),
        ]  # fmt: skip
        if c.is_moe_layer(i):
            modules += _moe_layout(c, mlp)
        else:
            modules += _mlp_layout(mlp, c.hidden_size, c.intermediate_size)
    if spec.targets_embeddings:
        modules.append(
            common_pb2.ModuleLayout(
                name="lm_head", kind=K.LM_HEAD, input_size=c.hidden_size,
                output_sizes=[c.vocab_size], peft_modules=["lm_head"],
            )
        )
    return common_pb2.Layout(
        modules=modules, tp_size=tp_size, fully_sharded=spec.fully_sharded and tp_size > 1, ep_size=ep_size,
        dtype=DTYPE_NAMES[spec.dtype], max_rank=spec.max_rank, base_model=base_model_name,
    )  # fmt: skip


def _mlp_layout(mlp: str, hidden: int, inter: int) -> list:
    K = common_pb2.ModuleKind
    return [
        common_pb2.ModuleLayout(
            name=f"{mlp}.gate_up_proj", kind=K.MERGED_COLUMN, input_size=hidden, output_sizes=[inter, inter],
            peft_modules=[f"{mlp}.gate_proj", f"{mlp}.up_proj"],
        ),
        common_pb2.ModuleLayout(
            name=f"{mlp}.down_proj", kind=K.ROW, input_size=inter, output_sizes=[hidden],
            peft_modules=[f"{mlp}.down_proj"],
        ),
    ]  # fmt: skip


def _moe_layout(c: ModelConfig, mlp: str) -> list:
    """A sparse layer's experts (per-expert PEFT names, the store's canonical form whatever file
    format the adapter came in; see adapter_store/validate.py) and its shared expert, if any."""
    K = common_pb2.ModuleKind
    e, inter = f"{mlp}.experts.{{e}}", c.moe_intermediate_size
    modules = [
        common_pb2.ModuleLayout(
            name=f"{mlp}.experts.gate_up_proj", kind=K.MOE_W13, input_size=c.hidden_size, output_sizes=[inter, inter],
            peft_modules=[f"{e}.gate_proj", f"{e}.up_proj"], num_experts=c.num_experts,
        ),
        common_pb2.ModuleLayout(
            name=f"{mlp}.experts.down_proj", kind=K.MOE_W2, input_size=inter, output_sizes=[c.hidden_size],
            peft_modules=[f"{e}.down_proj"], num_experts=c.num_experts,
        ),
    ]  # fmt: skip
    if c.shared_expert_intermediate_size:
        modules += _mlp_layout(f"{mlp}.shared_expert", c.hidden_size, c.shared_expert_intermediate_size)
    return modules


# ---- loading a slot ---------------------------------------------------------------------------
#
# On CUDA a load is one host->device copy of the shard's pinned buffer and one scatter launch
# (kernels.slot_scatter) that writes every module's A and B and zeroes every rank tail and every
# module the shard does not target. The copies and the checks depend only on the shard's layout
# (its tensors' names, shapes, dtypes and offsets in the buffer), which repeats across adapters,
# so both are worked out once per layout and cached with the model's LoRA modules: a repeat load
# costs a signature of the shard, the copy and the launch, whatever its tensor count. Elsewhere
# (the CPU, or a shard not in one host storage) the modules' set_lora copies go through SlotWrites.

_MAX_LAYOUTS = 64  # cached shard layouts per model (adapters of one rank and targets share one)


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
        self.scatterable = len({b.dtype for b in slot_bufs}) == 1 and all(b.is_contiguous() for b in slot_bufs)
        self.layouts: OrderedDict[tuple, _ShardLayout] = OrderedDict()
        self.lock = threading.Lock()
        # each module's slot_ranks list (replaced only with its slot buffers, which retires these
        # targets) and rank parts: `written_rank` without an attribute lookup per module
        self._rank_lists = [(m.slot_ranks, m.rank_parts) for m in self.modules.values()]

    def written_rank(self, slot: int) -> int:
        """`written_rank` over these modules, from the lists kept above: a cold load's path reads it
        twice, the first time before its copy is queued (docs/BENCHMARKS.md "Twenty-fifth pass")."""
        return max([ranks[slot] * parts for ranks, parts in self._rank_lists], default=0)

    def current(self) -> bool:
        return all(d["lora_a"] is a and d["lora_b"] is b for d, a, b in self._held)

    def layout(self, tensors: dict[str, torch.Tensor], key: "_LayoutKey", offsets: list[int | None]) -> _ShardLayout:
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
        for name, m in self.modules.items() if plannable else ():
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


_TARGETS: weakref.WeakKeyDictionary[nn.Module, _SlotTargets] = weakref.WeakKeyDictionary()
_CLEAR_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # first module -> (buffers, plan)


def forget_slot_plans(model: nn.Module) -> None:
    """Drops what the slot-load caches hold of `model` (its slot buffers among it): call before
    its buffers are replaced, so the old ones are freed at once."""
    _TARGETS.pop(model, None)
    for m in model.modules():
        _CLEAR_PLANS.pop(m, None)


def _buffers(modules) -> tuple:
    return tuple(b for m in modules for b in (m._buffers["lora_a"], m._buffers["lora_b"]))


def _slot_targets(model: nn.Module) -> _SlotTargets:
    targets = _TARGETS.get(model)
    if targets is None or not targets.current():
        targets = _TARGETS[model] = _SlotTargets(model)
    return targets


def _slot_copy(buf: torch.Tensor, rank_dim: int, src: torch.Tensor | None, src_offset: int, parts: int = 1,
               rank_parts: int = 1) -> SlotCopy:
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


class _LayoutKey:
    """A shard layout's key (a tuple over every tensor) with its hash worked out once; one object
    per layout (`_KEYS`), so the layout cache finds a shard's by identity, not by comparing ~450
    names and shapes on every load."""

    __slots__ = ("parts", "hash", "__weakref__")

    def __init__(self, parts: tuple):
        self.parts, self.hash = parts, hash(parts)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, _LayoutKey) and self.hash == other.hash and self.parts == other.parts)


_KEYS: weakref.WeakValueDictionary[tuple, _LayoutKey] = weakref.WeakValueDictionary()
_KEYS_LOCK = threading.Lock()


def shard_signature(tensors: dict[str, torch.Tensor]):
    """What a slot load of `tensors` works out before it copies anything: (key, byte offsets,
    storage, lo). The key names each tensor's name, shape, dtype, contiguity and, when all are host
    tensors in one storage (`storage`, else None), its byte offset from lo, the lowest start among
    them. Kept on a ShardTensors (the CPU cache calls this as a shard lands, off the serving loop),
    so its loads into slots skip it."""
    known = getattr(tensors, "signature", None)
    if known is not None:
        return known
    ts = tuple(tensors.values())
    ptrs = [t.data_ptr() for t in ts]
    lo, storage = min(ptrs, default=0), None
    if ts and ts[0].device.type == "cpu":
        first = ts[0].untyped_storage()
        if first.data_ptr() <= lo and max(ptrs) < first.data_ptr() + first.nbytes():
            storage = first
    offsets = [p - lo for p in ptrs] if storage is not None else [None] * len(ts)
    shapes, dtypes, contiguous = [t.shape for t in ts], [t.dtype for t in ts], [t.is_contiguous() for t in ts]
    parts = (tuple(tensors), tuple(zip(shapes, dtypes, contiguous, offsets)))
    with _KEYS_LOCK:
        key = _KEYS.get(parts)
        if key is None:
            key = _KEYS[parts] = _LayoutKey(parts)
    found = key, offsets, storage, lo
    if isinstance(tensors, ShardTensors):
        tensors.signature = found
    return found


STAGE_CHUNK_BYTES = 0  # a staged shard's host -> device copy in pieces of this size (0: one copy)


def _staged(storage: torch.UntypedStorage, lo: int, nbytes: int, device: torch.device, dtype: torch.dtype):
    """The `nbytes` of host `storage` from address lo, copied to `device` in STAGE_CHUNK_BYTES pieces
    (0, the default: one copy; async from pinned memory). Pieces were meant to let a step's own small
    copies wait behind one piece, not the shard; on a CUDA host they did not (a small copy queued
    on another stream ended with the last piece, however small), and the step now reads its inputs
    by a kernel instead (graphs.INPUTS_BY_KERNEL; docs/BENCHMARKS.md, thirty-second pass). The
    caching allocator reuses the buffer only for work queued after the scatter on the current
    stream, so it is freed when the caller drops it."""
    if not storage.data_ptr() <= lo <= lo + nbytes <= storage.data_ptr() + storage.nbytes():
        raise ValueError(f"shard bytes [{lo:#x}, +{nbytes}) are not inside their host buffer (a stale signature?)")
    host = torch.empty(0, dtype=torch.uint8).set_(storage, lo - storage.data_ptr(), (nbytes,), (1,))
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    piece = STAGE_CHUNK_BYTES or max(nbytes, 1)
    for at in range(0, nbytes, piece):
        dev[at : at + piece].copy_(host[at : at + piece], non_blocking=True)
    return dev.view(dtype)


def _planned(model: nn.Module, key: "_LayoutKey"):
    """(targets, layout) of a layout already planned for `model`'s CUDA slot buffers (no check that
    they are current: what a caller does with them stays valid for any buffers of that device; their
    written ranks may then be stale, which only `queued_load`'s loop-or-thread answer reads), or None."""
    known = _TARGETS.get(model)
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
    planned = _planned(model, signature[0])
    if planned is None:
        return None
    known, layout = planned
    clip = layout.plan.clips.get(known.written_rank(slot))
    if clip is None or str(known.device) not in clip.device_tables:
        return None
    staged = _staged(signature[2], signature[3], layout.span, known.device, next(iter(tensors.values())).dtype)
    return lambda: load_shard_into_slot(model, slot, tensors, staged=staged)


def _staged_early(model: nn.Module, key: "_LayoutKey", storage, lo: int, tensors: dict[str, torch.Tensor]):
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
        for part, src, buf in (("lora_a", a, module.lora_a[0]), ("lora_b", b, module.lora_b[0])):
            if (err := _fit_error(buf, src, rank_dim)) is not None:
                raise ValueError(f"{name}.{part}: {err}")
        if a.shape[rank_dim] * module.rank_parts != b.shape[rank_dim]:
            parts = f" x {module.rank_parts} rank parts" if module.rank_parts > 1 else ""
            raise ValueError(f"{name}: lora_a rank {a.shape[rank_dim]}{parts} != lora_b rank {b.shape[rank_dim]}")


def _default_scatter(device: torch.device):
    return kernels.slot_scatter if device.type == "cuda" else None


def _clear_plan(modules: list[nn.Module], buffers: tuple) -> ScatterPlan | None:
    """Zeros over one slot of each of `buffers` (the modules'), row by row as a load writes them (so
    `clipped` cuts them to a rank); None when they are not all contiguous of one dtype. Cached by
    the list's first module, checked against the buffers."""
    cached = _CLEAR_PLANS.get(modules[0])
    if cached is None or len(cached[0]) != len(buffers) or not all(map(operator.is_, cached[0], buffers)):
        ok = len({b.dtype for b in buffers}) == 1 and all(b.is_contiguous() for b in buffers)
        plan = ScatterPlan(tuple(
            _slot_copy(buf, m.slot_rank_dim, None, 0, parts, m.rank_parts)
            for m in modules for buf, parts, part in ((m.lora_a, 1, "a"), (m.lora_b, m.rank_parts, "b"))
            if not (part == "b" and m.packed_b)  # a packed B: not cleared, as reset_lora
        )) if ok else None  # fmt: skip
        cached = _CLEAR_PLANS[modules[0]] = (buffers, plan)
    return cached[1]


def written_rank(modules, slot: int) -> int:
    """The adapter rank past which `slot` holds zeros in every one of `modules`: the largest of their
    slot_ranks (set by every load and clear; a fully sharded layer's counts 1 / rank_parts of it)."""
    return max((m.slot_ranks[slot] * m.rank_parts for m in modules), default=0)


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
    one go: on CUDA one launch, over the rank positions its adapter wrote only. scatter: as in
    load_shard_into_slot."""
    modules = list(modules)
    scatter, plan = _clearing(modules, scatter)
    if plan is None:
        writes = SlotWrites()
        for m in modules:
            m.reset_lora(slot, writes)
        writes.flush()
        return
    scatter(plan.clipped(written_rank(modules, slot)), None, slot)
    for m in modules:
        m.slot_ranks[slot] = 0


def load_shard_into_slot(model: nn.Module, slot: int, tensors: dict[str, torch.Tensor], scatter=None,
                         staged: torch.Tensor | None = None) -> int:
    """Copies one shard's tensors into `slot` of every LoRA module; modules absent from it are zeroed.
    Returns the slot's adapter rank as the kernels may read it (LoraMeta.slot_ranks): the largest
    rank among its modules, slot buffers being zero past each module's own.

    tensors: "<module>.lora_a" / "<module>.lora_b" as in docs/SHARD_FORMAT.md. Everything is checked
    before any slot buffer is written, so a bad shard leaves the slot as it was (a layout that passed
    once is not checked again). scatter: how a shard staged in one piece is scattered into the slots
    (default: kernels.slot_scatter on CUDA, one launch; None on the CPU: per-tensor copies there).
    staged: the shard's bytes on the device already (`queued_load`), else staged here.
    """
    key, offsets, storage, lo = shard_signature(tensors)
    if staged is None:
        staged = _staged_early(model, key, storage, lo, tensors)
    targets = _slot_targets(model)
    layout = targets.layout(tensors, key, offsets)
    scatter = scatter or _default_scatter(targets.device)
    if scatter is not None and layout.plan is not None:
        dtype = next(iter(tensors.values())).dtype if tensors else torch.uint8
        if staged is None or staged.device != targets.device:
            staged = _staged(storage, lo, layout.span, targets.device, dtype) if tensors else None
        # zeros only up to what the slot's previous adapter wrote: its tail past that is zero already
        scatter(layout.plan.clipped(targets.written_rank(slot)), staged, slot)
    else:
        writes = SlotWrites()  # every module's copies and zero-fills issued together
        for name, module in targets.modules.items():
            rank = {"slot_rank": layout.max_rank} if module.packed_b else {}  # a packed B's row width
            if f"{name}.lora_a" in tensors:
                module.set_lora(slot, tensors[f"{name}.lora_a"], tensors[f"{name}.lora_b"], writes, **rank)
            else:
                module.reset_lora(slot, writes, **rank)
        writes.flush()
    for ranks, r in layout.ranks:
        ranks[slot] = r
    return layout.max_rank
