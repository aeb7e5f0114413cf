"""A slot load's scatter in one launch: same signature and result as kernels/copy_reference.py.

An 8B model's slot load is a few hundred copies (every module's A and B) and as many rank-tail
zero-fills; one launch each costs more host time than the bytes take on the device. Here the
copies are rows of a descriptor table (int64: destination address of slot 0, slot stride, source
offset, elements, source columns, destination row stride, columns to fill, first block), built
once per ScatterPlan and kept on the device; every load of that layout is then one launch whose
only varying argument is the slot. Each program does BLOCK elements of one copy's rows x fill
region: a source element where the column is below src_cols, else zero. Elements move as
integers, so any dtype copies bit for bit: of the widest size up to 8 bytes that every copy's
offsets, row lengths and strides (in bytes) are multiples of, so a bf16 slot of rank >= 4 moves 8
bytes per element and its index arithmetic is a quarter of 2-byte elements'.
"""

from __future__ import annotations

import itertools
import threading

import torch
import triton
import triton.language as tl

from . import copy_reference
from .copy_reference import ScatterPlan

BLOCK = 4096  # elements per program
_WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_COLUMNS = 8  # of the descriptor table


@triton.jit(do_not_specialize=["slot"])
def _slot_scatter_kernel(table_ptr, block_copy_ptr, src_ptr, slot, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    desc = table_ptr + tl.load(block_copy_ptr + pid).to(tl.int64) * 8  # this block's copy
    dst_addr = tl.load(desc)
    slot_stride = tl.load(desc + 1)
    src_offset = tl.load(desc + 2)
    n = tl.load(desc + 3).to(tl.int32)  # rows * fill (< 2**31: checked when the table is built)
    src_cols = tl.load(desc + 4).to(tl.int32)
    dst_stride = tl.load(desc + 5)
    fill = tl.load(desc + 6).to(tl.int32)
    first_block = tl.load(desc + 7).to(tl.int32)
    e = (pid - first_block) * BLOCK + tl.arange(0, BLOCK)  # elements of the copy's rows x fill
    row, col = e // fill, e % fill
    inside = e < n
    from_src = inside & (col < src_cols)
    x = tl.load(src_ptr + src_offset + row.to(tl.int64) * src_cols + col, mask=from_src, other=0)
    dst = dst_addr.to(tl.pointer_type(src_ptr.dtype.element_ty))  # the slot buffer, from its address
    tl.store(dst + slot * slot_stride + row.to(tl.int64) * dst_stride + col, x, mask=inside)


_TABLES_LOCK = threading.Lock()  # loads run in worker threads: one builds a plan's table, once


def _tables(plan: ScatterPlan, device: torch.device):
    """(descriptor table [copies, 8] int64, each block's copy [blocks] int32, blocks, slots, word
    dtype) on device, or None when a copy is too large for the kernel's int32 element index. The
    table counts in words: `_word` elements of the slot buffers' dtype."""
    key = str(device)
    with _TABLES_LOCK:
        return plan.device_tables[key] if key in plan.device_tables else _build_tables(plan, device, key)


def _word(plan: ScatterPlan) -> int:
    """Elements per word: the most (a power of two, up to 8 bytes) that divides every copy's source
    offset, source columns, fill, row stride and slot stride, and its slot buffer's address."""
    size = plan.copies[0].dst.element_size()
    n = 8 // size
    while n > 1:
        if all(
            v % n == 0 for c in plan.copies for v in (c.src_offset, c.src_cols, c.fill, c.dst_stride, c.dst.stride(0))
        ) and all(c.dst.data_ptr() % (n * size) == 0 for c in plan.copies):
            break
        n //= 2
    return n


def _build_tables(plan: ScatterPlan, device: torch.device, key: str):
    w = _word(plan)
    sizes = [c.rows * c.fill // w for c in plan.copies]
    blocks = [triton.cdiv(n, BLOCK) for n in sizes]
    first = [0, *itertools.accumulate(blocks)]
    if max(sizes) >= 2**31:
        plan.device_tables[key] = None
    else:
        table = torch.tensor(
            [[c.dst.data_ptr(), c.dst.stride(0) // w, c.src_offset // w, n, c.src_cols // w, c.dst_stride // w,
              c.fill // w, f]
             for c, n, f in zip(plan.copies, sizes, first)], dtype=torch.int64,
        ).view(-1, _COLUMNS)  # fmt: skip
        block_copy = torch.repeat_interleave(torch.arange(len(blocks), dtype=torch.int32), torch.tensor(blocks))
        slots = min(c.dst.shape[0] for c in plan.copies)
        word = _WORDS[w * plan.copies[0].dst.element_size()]
        plan.device_tables[key] = (table.to(device), block_copy.to(device), first[-1], slots, word)
    return plan.device_tables[key]


def slot_scatter(plan: ScatterPlan, src: torch.Tensor | None, slot: int) -> None:
    """Every copy of `plan` into `slot`, in one launch: see copy_reference.slot_scatter."""
    if not plan.copies:
        return
    dst = plan.copies[0].dst
    tables = _tables(plan, dst.device)
    if tables is None:
        return copy_reference.slot_scatter(plan, src, slot)
    table, block_copy, blocks, slots, word = tables
    if not 0 <= slot < slots:  # the kernel would write past the buffers
        raise IndexError(f"slot {slot} of {slots}")
    raw = (src if src is not None else dst.new_empty(0)).view(torch.uint8)
    src = raw[: raw.numel() - raw.numel() % word.itemsize].view(word)  # the copies end on whole words
    if blocks:
        _slot_scatter_kernel[(blocks,)](table, block_copy, src, slot, BLOCK=BLOCK, num_warps=4)
