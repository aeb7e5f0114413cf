"""LoRA-capable layers: the base layer plus per-slot LoRA weight buffers, and the per-token LoRA delta.

Every LoRA-capable module has the same surface: `create_lora_weights`, `set_lora`, `reset_lora`,
`forward(x, lora_meta)`. Slot buffers hold up to `max_loras` adapters at once; each token picks its
own slot through the step's LoraMeta (slot -1 = base model only). What a slot holds, and the
invariant every writer keeps (zeros past each adapter's rank; a packed B's rows), is
executor/slot_layout.py's contract. Each module also keeps its slots' ranks on the host
(`slot_ranks`) to skip modules no active adapter targets and, on the reference path, to cut the
rank to the step's largest. Loading a whole shard into a slot of every module is
executor/slot_load.py's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loraserve import kernels
from loraserve.kernels import LoraMeta

from . import dora, lora_fp8
from .parallel import TPGroup
from .slot_layout import FP8_SCALES, LORA_AB, LoraSpec, packed_rows, packs_b_on, register_slot_buffer, slot_fit_error


def _step_weights(m: nn.Module, meta: LoraMeta | None, device: torch.device):
    """(lora_a, lora_b) of module m to compute this step with, or None if no token needs it.

    Slot buffers are zero past each adapter's rank and wholly zero for modules an adapter does
    not target, so both cuts below are exact: a module that no active slot's adapter targets
    is skipped (every device, in eager steps; the decode CUDA graphs pass a LoraMeta without
    host_slots, so a captured graph never bakes a skip in), and on the reference path the rank dim
    (dim 2 of every slot buffer) is cut to the largest rank among the active slots (A's only where
    B is packed: the reference unpacks B). The Triton kernels keep the full slot rank: their tuned
    block sizes are per slot shape.
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
_NO_SCALES: tuple[dict, dict] = ({}, {})  # the kernels' scale arguments of bf16 / fp16 / fp32 slots: none


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
    executor/slot_load.py): there every tensor is a copy and a zero-fill of its own, and an 8B
    model's 256 (32 layers x qkv, o, gate_up, down, A and B) one at a time cost more host time than
    their bytes take (15-19 ms on an H100 for 40-160 MiB, the pinned floor being 0.8-6 ms).
    """

    def __init__(self):
        self.dst: list[torch.Tensor] = []
        self.src: list[torch.Tensor] = []
        self.zeros: list[torch.Tensor] = []

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.dtype == lora_fp8.FP8:  # FP8 slots' values as bytes: the multi-tensor ops take no float8 dtype everywhere
            dst, src = dst.view(torch.uint8), src.view(torch.uint8)
        self.dst.append(dst)
        self.src.append(src)

    def zero(self, dst: torch.Tensor) -> None:
        if dst.numel():
            self.zeros.append(dst.view(torch.uint8) if dst.dtype == lora_fp8.FP8 else dst)

    def flush(self) -> None:
        if self.dst:
            torch._foreach_copy_(self.dst, self.src, non_blocking=True)
        if self.zeros:
            torch._foreach_zero_(self.zeros)
        self.dst, self.src, self.zeros = [], [], []


def _copy_into_slot(slot_buf: torch.Tensor, src: torch.Tensor, rank_dim: int = 1, writes: SlotWrites | None = None) -> None:
    """slot_buf[.., :r] = src, slot_buf[.., r:] = 0 on rank_dim. No reshape or cast. src must outlive the async copy.
    writes: record the copy and the zero-fill there (issued by its flush) instead of now."""
    if (err := slot_fit_error(slot_buf, src, rank_dim)) is not None:
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


def _reset_slot(m: nn.Module, slot: int, writes: SlotWrites | None, also: tuple = ()) -> None:
    """Zeroes the slot of m's lora_a, lora_b and of each buffer in `also` (an FP8 slot's scales)."""
    own = writes is None
    writes = writes or SlotWrites()
    writes.zero(m.lora_a[slot])
    writes.zero(m.lora_b[slot])
    for buf in also:
        writes.zero(buf[slot])
    if own:
        writes.flush()
    m.slot_ranks[slot] = 0


class LinearWithLoRA(nn.Module):
    """y = x @ W.T + b + per-token LoRA delta, for one or several output slices packed in W.

    weight:  [N, in], N = sum(output_sizes) (q|k|v for QKV, gate|up for gate_up, one slice otherwise)
    lora_a:  [max_loras, S, max_rank, in]
    lora_b:  [max_loras, N, max_rank]  (scaling already folded in by the adapter store); where
             packed_b (slot_layout.packs_b_on), each slot's first N x r8 elements as [N, r8] rows instead

    Under TP (executor/parallel.py) in_features and output_sizes are this rank's. A column-parallel
    layer holds its slices' output rows; a `row_parallel` one its input columns, and all-reduces
    the partial sums (bias added once, after). Fully sharded LoRA also cuts, on a column layer,
    A's rank (lora_a: [max_loras, S, max_rank / tp, in]; the shrink output is all-gathered, and
    B's columns sit in tp parts of max_rank / tp, rank part p's rows of A at part p) and, on a
    row layer, B's outputs (lora_b: [max_loras, N / tp, max_rank]; the shrink output is
    all-reduced, the expand adds into this rank's 1/tp of the output columns).

    fp8: the base weight is float8_e4m3fn with `weight_scale` [N] float32, one scale per output row
    (executor/model/fp8.py fills both), and the base GEMM is kernels.fp8_linear (activations quantized
    per token, or at decode token counts weight-only where the GPU's table says so); shapes the FP8 GEMM does not take (in or N not a multiple of 16) stay in dtype. LoRA is
    unchanged: it reads the layer's input in dtype and adds into the GEMM's output.

    fp8_slots (LoraSpec.fp8, `--lora-dtype fp8`): lora_a and lora_b hold float8_e4m3fn, with
    lora_a_scale [max_loras, S, max_rank / rank_parts] float32 (one per rank row of each slice) and
    lora_b_scale [max_loras, N] float32 (one per output channel) beside them (executor/lora_fp8.py);
    shards arrive in the adapter dtype (`shard_dtype`) and are quantized as they are loaded.
    """

    slot_rank_dim = 1  # rank's dim in one slot's lora_a [S, r, in] and lora_b [N, r]

    def __init__(
        self,
        in_features,
        output_sizes,
        bias,
        lora: LoraSpec | None,
        dtype,
        device,
        tp: TPGroup | None = None,
        row_parallel: bool = False,
        fp8: bool = False,
    ):
        super().__init__()
        self.tp = tp or TPGroup()
        self.compute_dtype = dtype
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
        fp8 = fp8 and in_features % 16 == 0 and n_out % 16 == 0
        weight_dtype = torch.float8_e4m3fn if fp8 else dtype
        self.weight = nn.Parameter(torch.empty(n_out, in_features, dtype=weight_dtype, device=device), requires_grad=False)
        self.register_buffer("weight_scale", torch.ones(n_out, device=device) if fp8 else None, persistent=False)
        self.bias = nn.Parameter(torch.empty(n_out, dtype=dtype, device=device), requires_grad=False) if bias else None
        self.register_buffer("lora_a", None, persistent=False)  # allocated by create_lora_weights
        self.register_buffer("lora_b", None, persistent=False)
        self.fp8_slots = lora is not None and lora.fp8
        self.shard_dtype = lora.dtype if self.fp8_slots else None  # a shard's dtype where it is not the slots'
        self.register_buffer("lora_a_scale", None, persistent=False)  # FP8 slots only
        self.register_buffer("lora_b_scale", None, persistent=False)
        # B packed at each slot's rank where the device takes it (packs_b_on): not where its rank dim
        # holds tp parts, nor for a fully sharded row layer's 1/tp of the output columns
        self.packed_b = (
            lora is not None
            and packs_b_on(self.weight.device)
            and self.rank_parts == 1
            and lora.max_rank % 8 == 0
            and self.lora_offsets is self.slice_offsets
        )
        self.serves_dora = lora is not None and lora.dora  # the slots hold DoRA scales (LoraSpec.dora, executor/dora.py)
        if lora is not None:
            self.create_lora_weights(lora.max_loras, lora.max_rank, lora.dtype)

    def create_lora_weights(self, max_loras: int, max_rank: int, dtype: torch.dtype | None = None) -> None:
        dtype = dtype or self.compute_dtype
        dev = self.weight.device
        n_slices, n_out = len(self.output_sizes), self.lora_offsets[-1]
        if max_rank % self.rank_parts:
            raise ValueError(f"max LoRA rank {max_rank} does not split over {self.rank_parts} fully sharded ranks")
        if self.fp8_slots:
            dtype = lora_fp8.FP8
            a_scale = torch.zeros(max_loras, n_slices, max_rank // self.rank_parts, dtype=torch.float32, device=dev)
            register_slot_buffer(self, "lora_a_scale", a_scale, FP8_SCALES)
            register_slot_buffer(self, "lora_b_scale", torch.zeros(max_loras, n_out, dtype=torch.float32, device=dev), FP8_SCALES)
        a = torch.zeros(max_loras, n_slices, max_rank // self.rank_parts, self.in_features, dtype=dtype, device=dev)
        b = torch.zeros(max_loras, n_out, max_rank, dtype=dtype, device=dev)
        register_slot_buffer(self, "lora_a", a, LORA_AB)
        register_slot_buffer(self, "lora_b", b, LORA_AB)
        self.slot_ranks = [0] * max_loras  # host copy: each slot's rank in this module, 0 = not targeted
        if self.serves_dora:
            dora.create(self, max_loras)  # each slot's DoRA output scale (executor/dora.py)

    def set_lora(
        self,
        slot: int,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        writes: SlotWrites | None = None,
        slot_rank: int | None = None,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """lora_a: [S, r, in], lora_b: [N, r] (a shard's tensors, already in the slot dtype).
        Fully sharded column layers: lora_a [S, r / tp, in], lora_b [N, r], r a multiple of tp.
        writes: record the copies there (see SlotWrites) instead of issuing them now.
        slot_rank: the adapter's largest rank over its modules (what the step's LoraMeta.slot_ranks
        will say; default this module's), at which a packed B is laid out.
        scales: FP8 slots: (A's [S, r(/tp)], B's [N]) float32, lora_a / lora_b then quantized
        (executor/lora_fp8.py `quantized`)."""
        if self.fp8_slots != (scales is not None):
            raise ValueError(
                f"{'FP8' if self.fp8_slots else 'bf16/fp16/fp32'} slots take {'' if self.fp8_slots else 'no '}scales"
            )
        own = writes is None
        writes = writes or SlotWrites()
        if scales is not None:
            _copy_into_slot(self.lora_a_scale[slot], scales[0], writes=writes)
            writes.copy(self.lora_b_scale[slot], scales[1])
        _copy_into_slot(self.lora_a[slot], lora_a, writes=writes)
        if self.packed_b:
            if (err := slot_fit_error(self.lora_b[slot], lora_b)) is not None:
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
            if self.fp8_slots:
                _reset_slot(self, slot, writes, (self.lora_a_scale, self.lora_b_scale))
                return
            return _reset_slot(self, slot, writes)
        own = writes is None
        writes = writes or SlotWrites()
        writes.zero(self.lora_a[slot])
        if self.fp8_slots:
            writes.zero(self.lora_a_scale[slot])
        if slot_rank:
            writes.zero(packed_rows(self.lora_b, slot, slot_rank))
        if own:
            writes.flush()
        self.slot_ranks[slot] = 0

    def takes_fp8_input(self, tokens: int) -> bool:
        """Whether forward's x_fp8 is used for an input of `tokens` rows: FP8 weights on CUDA where the
        GEMM quantizes its input (torch._scaled_mm; not the skinny GEMM's W8A16 build, which the GPU's
        table picks at some decode token counts and which reads x as it is; the CPU computes the FP8
        math from x itself). The kernel writing this layer's input quantizes it there
        (kernels.rms_norm's and the act-and-muls' `quantize`) only where this holds."""
        if self.weight_scale is None or self.weight.device.type != "cuda":
            return False
        return kernels.fp8_quantizes_input(tokens, self.compute_dtype, self.weight, self.weight_scale, self.bias)

    def _base(self, x: torch.Tensor, bias: torch.Tensor | None, x_fp8=None) -> torch.Tensor:
        """x @ W.T (+ bias) [T, N] in x's dtype: kernels.fp8_linear where the layer holds FP8 weights
        (torch._scaled_mm, from x_fp8 where given, or the skinny GEMM's FP8 build where the GPU's table
        picks it), else kernels.linear (cuBLAS, or the skinny GEMM where the GPU's table picks it)."""
        if self.weight_scale is not None:
            return kernels.fp8_linear(x, self.weight, self.weight_scale, bias, x_fp8)
        return kernels.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor, lora_meta: LoraMeta | None = None, x_fp8=None) -> torch.Tensor:
        """x [T, in] -> [T, N]. x_fp8: x's per-token FP8 quantization (q, scale) where the kernel that
        wrote x made it (takes_fp8_input): the FP8 GEMM's input; LoRA reads x."""
        if self.row_parallel:
            return self._forward_row_parallel(x, lora_meta, x_fp8)
        weights = _step_weights(self, lora_meta, x.device)
        if weights is None:
            return self._base(x, self.bias, x_fp8)  # [T, N]
        lora_a, lora_b = weights
        ranked = self.rank_parts == 1  # a fully sharded column layer's rank dim holds tp parts
        if dora.applies(self, lora_meta):  # DoRA's scale goes between the LoRA sum and the bias
            return dora.apply(self, self._lora_sum(x, lora_a, lora_b, lora_meta, ranked, None, x_fp8), lora_meta, self.bias)
        return self._lora_sum(x, lora_a, lora_b, lora_meta, ranked, self.bias, x_fp8)

    def _scales(self, lora_a: torch.Tensor) -> tuple[dict, dict]:
        """The kernels' scale arguments of this step's (lora_a, lora_b): FP8 slots' A scales cut to
        lora_a's rank (the reference path's cut) and B's; none for bf16 / fp16 / fp32 slots."""
        if not self.fp8_slots:
            return _NO_SCALES
        a_scale = self.lora_a_scale
        if lora_a.shape[2] != a_scale.shape[2]:
            a_scale = a_scale.narrow(2, 0, lora_a.shape[2])
        return {"scale": a_scale}, {"scale": self.lora_b_scale}

    def _lora_sum(self, x, lora_a, lora_b, lora_meta, ranked: bool, bias, x_fp8=None) -> torch.Tensor:
        """x @ W.T (+ bias) + the per-token LoRA delta."""
        side = _side_stream(x.device)
        a_scale, b_scale = self._scales(lora_a)
        if side is None:
            y = self._base(x, bias, x_fp8)
            buf = kernels.lora_shrink(x, lora_a, lora_meta, ranked=ranked, **a_scale)  # [S, T, rank] float32
            if self.rank_parts > 1:
                buf = self.tp.all_gather(buf)  # [S, T, max_rank]: every rank part of x @ A.T
            return kernels.lora_expand(y, buf, lora_b, self.slice_offsets, lora_meta, ranked, packed=self.packed_b, **b_scale)
        # CUDA: shrink (and its zeroing, unless the step's shrink workspace is zeroed already) runs on
        # a side stream beside the base GEMM, which is bandwidth-bound at decode and hides it; only
        # expand waits for both. Captured graphs keep the fork and join. Memory is safe: the side
        # stream waits for the main one before each use, so nothing it frees is reused while the
        # main stream still reads it.
        main = torch.cuda.current_stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            buf = kernels.lora_shrink(x, lora_a, lora_meta, ranked=ranked, **a_scale)
        y = self._base(x, bias, x_fp8)
        main.wait_stream(side)
        if self.rank_parts > 1:
            buf = self.tp.all_gather(buf)
        return kernels.lora_expand(y, buf, lora_b, self.slice_offsets, lora_meta, ranked, packed=self.packed_b, **b_scale)

    def _forward_row_parallel(self, x: torch.Tensor, lora_meta: LoraMeta | None, x_fp8=None) -> torch.Tensor:
        """x: [T, in / tp], this rank's input columns (x_fp8: their quantization). Every term before the
        all-reduce is a partial sum over them, LoRA's included (expand is linear in the shrink output)."""
        y = self._base(x, None, x_fp8)  # [T, N], partial
        weights = _step_weights(self, lora_meta, x.device)
        if weights is not None:
            lora_a, lora_b = weights
            a_scale, b_scale = self._scales(lora_a)
            buf = kernels.lora_shrink(x, lora_a, lora_meta, **a_scale)  # [1, T, rank], partial
            if self.lora_offsets is self.slice_offsets:
                kernels.lora_expand(y, buf, lora_b, self.slice_offsets, lora_meta, packed=self.packed_b, **b_scale)
            else:  # fully sharded: the whole x @ A.T, times this rank's rows of B, into its columns
                buf = self.tp.all_reduce(buf)
                out = y.narrow(1, self.lora_out_start, self.lora_offsets[-1])
                kernels.lora_expand(out, buf, lora_b, self.lora_offsets, lora_meta, **b_scale)
        y = self.tp.all_reduce(y)
        if weights is not None and dora.applies(self, lora_meta):
            return dora.apply(self, y, lora_meta, self.bias)
        return y if self.bias is None else y + self.bias


class VocabEmbeddingWithLoRA(nn.Module):
    """Token embedding with per-token LoRA: y = W[ids] + lora_a[slot, ids] @ lora_b[slot].T

    weight:  [vocab, dim]  (under TP: this rank's vocab / tp rows, partial lookups all-reduced)
    lora_a:  [max_loras, vocab, max_rank]   (PEFT's lora_embedding_A, transposed; never sharded)
    lora_b:  [max_loras, dim, max_rank]
    """

    slot_rank_dim = 1  # one slot's lora_a [vocab, r], lora_b [dim, r]
    rank_parts = 1
    fp8_slots, shard_dtype = False, None  # its slots stay in the adapter dtype under --lora-dtype fp8

    def __init__(self, vocab_size, embed_dim, lora: LoraSpec | None, dtype, device, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp or TPGroup()
        self.vocab_size = vocab_size
        rows = self.tp.part(vocab_size)
        self.vocab_start = rows.start
        self.weight = nn.Parameter(
            torch.empty(rows.stop - rows.start, embed_dim, dtype=dtype, device=device), requires_grad=False
        )
        self.slice_offsets = (0, embed_dim)
        self.register_buffer("lora_a", None, persistent=False)  # allocated by create_lora_weights
        self.register_buffer("lora_b", None, persistent=False)
        self.packed_b = False  # its B stays [.., R] rows (packing is for dense linear layers)
        if lora is not None:
            self.create_lora_weights(lora.max_loras, lora.max_rank, lora.dtype)

    def create_lora_weights(self, max_loras: int, max_rank: int, dtype: torch.dtype | None = None) -> None:
        dtype = dtype or self.weight.dtype
        vocab, dim = self.vocab_size, self.weight.shape[1]
        a = torch.zeros(max_loras, vocab, max_rank, dtype=dtype, device=self.weight.device)
        b = torch.zeros(max_loras, dim, max_rank, dtype=dtype, device=self.weight.device)
        register_slot_buffer(self, "lora_a", a, LORA_AB)
        register_slot_buffer(self, "lora_b", b, LORA_AB)
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

    fp8: weight is float8_e4m3fn with `weight_scale` [E, N] float32, one scale per (expert, output
    row) (executor/model/fp8.py fills both, as for LinearWithLoRA); the fused MoE kernel dequantizes
    in its tiles. LoRA stays in dtype: it reads the unquantized input and adds into the output.
    """

    slot_rank_dim = 2  # one slot's lora_a [E, S, r, in], lora_b [E, N, r]
    rank_parts = 1  # experts are never tensor-parallel: LoRA's rank is whole
    fp8_slots, shard_dtype = False, None  # its slots stay in the adapter dtype under --lora-dtype fp8

    def __init__(self, num_experts, in_features, output_sizes, lora: LoraSpec | None, dtype, device, fp8: bool = False):
        super().__init__()
        self.num_experts, self.in_features, self.output_sizes = num_experts, in_features, tuple(output_sizes)
        self.compute_dtype = dtype
        n_out = sum(self.output_sizes)
        weight_dtype = torch.float8_e4m3fn if fp8 else dtype
        self.weight = nn.Parameter(
            torch.empty(num_experts, n_out, in_features, dtype=weight_dtype, device=device), requires_grad=False
        )
        scale = torch.ones(num_experts, n_out, device=device) if fp8 else None
        self.register_buffer("weight_scale", scale, persistent=False)
        self.register_buffer("lora_a", None, persistent=False)  # allocated by create_lora_weights
        self.register_buffer("lora_b", None, persistent=False)
        self.packed_b = False  # its B stays [.., R] rows (packing is for dense linear layers)
        if lora is not None:
            self.create_lora_weights(lora.max_loras, lora.max_rank, lora.dtype)

    def create_lora_weights(self, max_loras: int, max_rank: int, dtype: torch.dtype | None = None) -> None:
        dtype = dtype or self.compute_dtype
        e, n_out, dev = self.num_experts, self.weight.shape[1], self.weight.device
        a = torch.zeros(max_loras, e, len(self.output_sizes), max_rank, self.in_features, dtype=dtype, device=dev)
        b = torch.zeros(max_loras, e, n_out, max_rank, dtype=dtype, device=dev)
        register_slot_buffer(self, "lora_a", a, LORA_AB)
        register_slot_buffer(self, "lora_b", b, LORA_AB)
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
    return {name: m for name, m in model.named_modules() if isinstance(m, LORA_MODULE_TYPES) and m.lora_a is not None}
