"""LoRA-capable layers with per-slot weight buffers, the layout the executor declares, and shard loading.

Every LoRA-capable module has the same surface: `create_lora_weights`, `set_lora`, `reset_lora`,
`forward(x, lora_meta)`. Slot buffers hold up to `max_loras` adapters at once; each token picks its
own slot through the step's LoraMeta (slot -1 = base model only). Slot buffers are zero beyond
each adapter's rank, so the kernels may compute over the full `max_rank` and stay exact; each
module also keeps its slots' ranks on the host (`slot_ranks`) to skip modules no active
adapter targets and, on the reference path, to cut the rank to the step's largest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from loraserve import kernels
from loraserve.kernels import LoraMeta
from loraserve.v1 import common_pb2

from .model.config import ModelConfig
from .parallel import TPGroup

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class LoraSpec:
    max_loras: int  # GPU slots
    max_rank: int  # slot rank; adapters of lower rank are zero-padded
    dtype: torch.dtype
    targets_embeddings: bool = False  # also allocate slots for embed_tokens and lm_head (vocab-sized: costly)
    fully_sharded: bool = False  # under TP, also cut the adapter rank (column layers) / B's outputs (row layers)


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
    largest rank among the active slots. The Triton kernels keep the full slot rank: their
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
    """The copies and zero-fills of one adapter load, issued together by `flush`.

    An 8B model's adapter has ~450 tensors; a host->device copy per tensor costs more than the
    bytes take (measured on an H100: 16-17 ms for 40-160 MiB, the pinned floor being 0.8-3 ms).
    So, when the sources are host tensors of one storage (the store client's one pinned buffer
    per shard), `flush` moves that storage's span in one host->device copy and scatters it into
    the slot views on the device; zero-fills go as one multi-tensor zero.
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
            staged = _staged_on_device(self.src, self.dst[0].device)
            torch._foreach_copy_(self.dst, staged or self.src, non_blocking=True)
        if self.zeros:
            torch._foreach_zero_(self.zeros)
        self.dst, self.src, self.zeros = [], [], []


def _staged_on_device(srcs: list[torch.Tensor], device: torch.device) -> list[torch.Tensor] | None:
    """Device copies of host tensors that are contiguous views of one storage, made by one
    host->device copy of the span they cover; None when that does not apply (then each tensor is
    copied on its own). The staging buffer is freed on return: the caching allocator reuses it only
    for work queued after these copies on the current stream."""
    if device.type != "cuda" or not srcs or any(t.device.type != "cpu" or not t.is_contiguous() for t in srcs):
        return None
    storage = srcs[0].untyped_storage()
    if any(t.untyped_storage().data_ptr() != storage.data_ptr() for t in srcs):
        return None
    starts = [t.storage_offset() * t.element_size() for t in srcs]
    lo = min(starts)
    hi = max(b + t.numel() * t.element_size() for b, t in zip(starts, srcs))
    host = torch.empty(0, dtype=torch.uint8).set_(storage, lo, (hi - lo,), (1,))
    dev = torch.empty(hi - lo, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)
    return [dev[b - lo : b - lo + t.numel() * t.element_size()].view(t.dtype).view(t.shape) for b, t in zip(starts, srcs)]


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
    lora_b:  [max_loras, N, max_rank]  (scaling already folded in by the adapter store)

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

    def set_lora(self, slot: int, lora_a: torch.Tensor, lora_b: torch.Tensor, writes: SlotWrites | None = None) -> None:
        """lora_a: [S, r, in], lora_b: [N, r] (a shard's tensors, already in the slot dtype).
        Fully sharded column layers: lora_a [S, r / tp, in], lora_b [N, r], r a multiple of tp.
        writes: record the copies there (see SlotWrites) instead of issuing them now."""
        own = writes is None
        writes = writes or SlotWrites()
        _copy_into_slot(self.lora_a[slot], lora_a, writes=writes)
        if self.rank_parts == 1:
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

    def reset_lora(self, slot: int, writes: SlotWrites | None = None) -> None:
        _reset_slot(self, slot, writes)

    def forward(self, x: torch.Tensor, lora_meta: LoraMeta | None = None) -> torch.Tensor:
        if self.row_parallel:
            return self._forward_row_parallel(x, lora_meta)
        weights = _step_weights(self, lora_meta, x.device)
        if weights is None:
            return F.linear(x, self.weight, self.bias)  # [T, N]
        lora_a, lora_b = weights
        side = _side_stream(x.device)
        if side is None:
            y = F.linear(x, self.weight, self.bias)
            buf = kernels.lora_shrink(x, lora_a, lora_meta)  # [S, T, rank] float32
            if self.rank_parts > 1:
                buf = self.tp.all_gather(buf)  # [S, T, max_rank]: every rank part of x @ A.T
            return kernels.lora_expand(y, buf, lora_b, self.slice_offsets, lora_meta)
        # CUDA: shrink (and its zeroing) runs on a side stream beside the base GEMM, which is
        # bandwidth-bound at decode and hides it; only expand waits for both. Captured graphs
        # keep the fork and join. Memory is safe: the side stream waits for the main one before
        # each use, so nothing it frees is reused while the main stream still reads it.
        main = torch.cuda.current_stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            buf = kernels.lora_shrink(x, lora_a, lora_meta)
        y = F.linear(x, self.weight, self.bias)
        main.wait_stream(side)
        if self.rank_parts > 1:
            buf = self.tp.all_gather(buf)
        return kernels.lora_expand(y, buf, lora_b, self.slice_offsets, lora_meta)

    def _forward_row_parallel(self, x: torch.Tensor, lora_meta: LoraMeta | None) -> torch.Tensor:
        """x: [T, in / tp], this rank's input columns. Every term before the all-reduce is a
        partial sum over them, LoRA's included (expand is linear in the shrink output)."""
        y = F.linear(x, self.weight)  # [T, N], partial
        weights = _step_weights(self, lora_meta, x.device)
        if weights is not None:
            lora_a, lora_b = weights
            buf = kernels.lora_shrink(x, lora_a, lora_meta)  # [1, T, rank], partial
            if self.lora_offsets is self.slice_offsets:
                kernels.lora_expand(y, buf, lora_b, self.slice_offsets, lora_meta)
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


def clear_slot(modules, slot: int) -> None:
    """Zeroes `slot` of every module (an iterable of LoRA modules, e.g. lora_modules(model).values()) in one go."""
    writes = SlotWrites()
    for m in modules:
        m.reset_lora(slot, writes)
    writes.flush()


def load_shard_into_slot(model: nn.Module, slot: int, tensors: dict[str, torch.Tensor]) -> None:
    """Copies one shard's tensors into `slot` of every LoRA module; modules absent from it are zeroed.

    tensors: "<module>.lora_a" / "<module>.lora_b" as in docs/SHARD_FORMAT.md. Everything is checked
    before any slot buffer is written, so a bad shard leaves the slot as it was.
    """
    modules = lora_modules(model)
    known = {f"{name}.{part}" for name in modules for part in ("lora_a", "lora_b")}
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
        for part, src, buf in (("lora_a", a, module.lora_a[slot]), ("lora_b", b, module.lora_b[slot])):
            if (err := _fit_error(buf, src, rank_dim)) is not None:
                raise ValueError(f"{name}.{part}: {err}")
        if a.shape[rank_dim] * module.rank_parts != b.shape[rank_dim]:
            parts = f" x {module.rank_parts} rank parts" if module.rank_parts > 1 else ""
            raise ValueError(f"{name}: lora_a rank {a.shape[rank_dim]}{parts} != lora_b rank {b.shape[rank_dim]}")
    writes = SlotWrites()  # every module's copies and zero-fills issued together
    for name, module in modules.items():
        if f"{name}.lora_a" in tensors:
            module.set_lora(slot, tensors[f"{name}.lora_a"], tensors[f"{name}.lora_b"], writes)
        else:
            module.reset_lora(slot, writes)
    writes.flush()
