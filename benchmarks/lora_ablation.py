"""What the LoRA kernels cost inside the engine's step: each replaced by nothing, or the expand by
a plain read of the bytes a packed layout would hold, or the side stream taken away
(`bench_engine.py --ablate NAME[+NAME]`).

A diagnostic, not a serving mode: all but the serial ones make the outputs wrong. It answers how much of
a decode step each LoRA kernel holds on the critical path, and how much an ideal expand could
save there (the alone-timed kernels have misled before: docs/BENCHMARKS.md, "Eleventh pass").

  expand         lora_expand does nothing (y is the base layer's output)
  shrink         lora_shrink computes nothing (its zeroed output; the expand still runs)
  lora           both: what is left is LoraMeta and the streams' fork and join
  serial         no side stream: each layer's shrink runs after its base GEMM on the step's own
                 stream (no fork and join per layer; the kernels themselves unchanged)
  serial-KIND    the same for one kind of layer only (qkv, o, gate_up, down; told apart by shape)
  serial-pdl     serial, and each layer's shrink and expand launched as programmatic dependents
                 (kernels' pdl=True): the shrink follows the base GEMM, the expand starts during
                 the shrink (outputs right)
  stream-expand  lora_expand reads, per block of the step's list, the first N * r elements of its
                 slot's B (N output columns, r the adapter's rank) as one contiguous run, and
                 writes nothing: the bytes of the adapters' B at their own ranks, at the speed a
                 plain streaming read reaches (no y read or write, no products)
  packed-expand  the shipped expand kernel reading each slot's B as if it were packed at the
                 slot's rank (kernels/triton_lora.py lora_expand's packed: the slot's first
                 N * r8 elements, rows contiguous) from slots written as [N, R] rows: what the
                 packed layout costs in the step, products and y included, outputs wrong
                 (bench_engine.py runs it on rows slots: --packed-b off, whatever the default;
                 --packed-b on runs the layout itself, outputs right)
"""

from __future__ import annotations

import triton
import triton.language as tl

from loraserve import kernels

KINDS = ("qkv", "o", "gate_up", "down")
ABLATIONS = ("expand", "shrink", "lora", "serial", *(f"serial-{k}" for k in KINDS), "serial-pdl", "stream-expand",
             "packed-expand")
_STEP = 4096  # elements per load (8 KiB of bf16)
_STEPS = 4  # loads per program: 32 KiB of B per program


@triton.jit
def _stream_kernel(b_ptr, block_slots_ptr, block_ranks_ptr, sink_ptr, num_slots, stride_bl, n_cols,
                   STEP: tl.constexpr, STEPS: tl.constexpr):
    block = tl.program_id(0)
    chunk = tl.program_id(1)
    slot = tl.load(block_slots_ptr + block)
    if (slot >= 0) & (slot < num_slots):
        count = n_cols * tl.load(block_ranks_ptr + block)
        first = chunk * STEP * STEPS
        if first < count:
            row = b_ptr + slot.to(tl.int64) * stride_bl
            total = tl.zeros([STEP], dtype=tl.float32)
            for i in tl.range(0, STEPS):
                offs = first + i * STEP + tl.arange(0, STEP)
                total += tl.load(row + offs, mask=offs < count, other=0.0).to(tl.float32)
            s = tl.sum(total)
            # never true for these sums in practice; keeps the loads from being dropped as dead
            tl.store(sink_ptr + block, s, mask=s == 1.2345e-30)


def _stream_expand(y, buf, lora_b, slice_offsets, meta, ranked=True, packed=False):
    blocks = meta.block_list(16)
    n_cols, rank = slice_offsets[-1], buf.shape[2]
    chunks = triton.cdiv(n_cols * rank, _STEP * _STEPS)
    sink = buf.new_empty(blocks.max_blocks)
    _stream_kernel[(blocks.max_blocks, chunks)](
        lora_b, blocks.blocks, blocks.blocks[3], sink, lora_b.shape[0], lora_b.stride(0), n_cols,
        STEP=_STEP, STEPS=_STEPS, num_warps=4,
    )
    return y


def _packed_expand(y, buf, lora_b, slice_offsets, meta, ranked=True, packed=False):
    from loraserve.kernels import triton_lora

    if not ranked or meta.slot_ranks is None:  # (a packed slot needs its rank): as shipped
        return triton_lora.lora_expand(y, buf, lora_b, slice_offsets, meta, ranked)
    return triton_lora.lora_expand(y, buf, lora_b, slice_offsets, meta, ranked, packed=True)


def _no_expand(y, buf, lora_b, slice_offsets, meta, ranked=True, packed=False):
    return y


def _no_shrink(x, lora_a, meta, out=None, ranked=True):
    from loraserve.kernels.meta import shrink_output

    num_slots, num_slices, rank, _ = lora_a.shape
    out, zeroed = shrink_output(meta, out, num_slices, x.shape[0], rank, x.device)
    if not zeroed:
        out.zero_()
    return out


def _kind(module) -> str:
    """qkv, o, gate_up or down, from a Llama-family LinearWithLoRA's shape."""
    sizes = module.output_sizes
    if len(sizes) > 1:
        return "qkv" if len(sizes) == 3 else "gate_up"
    return "down" if module.in_features > sizes[0] else "o"


def _serial(kinds: set[str], pdl: bool = False) -> None:
    """The layers of these kinds run their shrink on the step's own stream (no side stream);
    pdl: their shrink and expand launched as programmatic dependents."""
    from loraserve.executor import lora

    forward = lora.LinearWithLoRA.forward
    shrink, expand = kernels.lora_shrink, kernels.lora_expand

    def serial_forward(self, x, lora_meta=None):
        if _kind(self) not in kinds:
            return forward(self, x, lora_meta)
        side = lora._side_stream
        lora._side_stream = lambda device: None
        if pdl:
            kernels.lora_shrink = lambda *a, **k: shrink(*a, **k, pdl=True)
            kernels.lora_expand = lambda *a, **k: expand(*a, **k, pdl=True)
        try:
            return forward(self, x, lora_meta)
        finally:
            lora._side_stream = side
            kernels.lora_shrink, kernels.lora_expand = shrink, expand

    lora.LinearWithLoRA.forward = serial_forward


def apply(names: str) -> None:
    """Replaces the LoRA kernels the executor's layers call (loraserve.kernels.lora_*), or the side
    stream they run on, for this process. names: one of ABLATIONS, or several joined by "+"."""
    for name in names.split("+"):
        _apply(name)


def _apply(name: str) -> None:
    if name not in ABLATIONS:
        raise ValueError(f"unknown ablation {name!r}; one of {', '.join(ABLATIONS)}")
    if name == "serial-pdl":
        _serial(set(KINDS), pdl=True)
    elif name.startswith("serial"):
        _serial(set(KINDS) if name == "serial" else {name.removeprefix("serial-")})
    if name in ("expand", "lora"):
        kernels.lora_expand = _no_expand
    if name in ("shrink", "lora"):
        kernels.lora_shrink = _no_shrink
    if name == "stream-expand":
        kernels.lora_expand = _stream_expand
    if name == "packed-expand":
        kernels.lora_expand = _packed_expand
