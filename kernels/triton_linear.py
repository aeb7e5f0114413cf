"""The base model's linear layers at decode batch sizes: a Triton skinny GEMM beside cuBLAS.

At 1-64 tokens a layer's GEMM is a weight read: y [M, N] = x [M, K] @ W[N, K].T moves N*K*2
bytes and does little arithmetic. In the ninth pass's profile of the decode graph (docs/BENCHMARKS.md,
"Ninth pass") cuBLAS read the wide gate/up projection at ~95% of the copy bandwidth but q/k/v, o
and down at ~82-85% (too few CTAs for the shape, or a split K plus a reduce kernel); timed alone
over cold weights (`benchmarks/bench_skinny.py`, "Tenth pass") it took 1.09-1.64x the bytes'
time. Here each program owns BLOCK_N output columns for every token and streams their rows of W through the
whole reduction: N / BLOCK_N programs, each several stages of loads in flight, no second kernel.

Used only where this GPU's table (kernels/configs/<gpu>.json, op "skinny", written by
`benchmarks/bench_skinny.py --table-out`) holds an entry for the exact (N, K) that beat cuBLAS
when it was measured (in bf16; fp16 layers of that shape take the same entries, unmeasured);
every other shape or token count, and float32, stays on F.linear (kernels/tuning.py
`skinny_config`). Nothing is tuned while serving.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .meta import LoraMeta
from .tuning import SkinnyConfig, skinny_config

MAX_TOKENS = 64  # at most this many rows of x, all in one program's tile (16, 32 or 64 rows: tl.dot's sizes)


@triton.jit
def _slice_of(n_start, off1, off2, off3):
    """The output slice that column n_start lies in (offsets of slices 1-3; unused ones = N)."""
    return (n_start >= off1).to(tl.int32) + (n_start >= off2).to(tl.int32) + (n_start >= off3).to(tl.int32)


@triton.jit
def _rank_mask(offs_r, rank, RANK: tl.constexpr):
    """The rank columns of a slot to read: up to its adapter's rank, in runs of 8 (16-byte loads)."""
    return (offs_r < RANK) & (offs_r // 8 < (tl.minimum(rank, RANK) + 7) // 8)


@triton.jit
def _lora_rows(acc, n_start, rows, offs_m, m_mask, M, buf_ptr, lb_ptr, token_slots_ptr,
               block_slots_ptr, block_ranks_ptr, num_blocks_ptr, stride_ll, stride_ln, off1, off2, off3,
               RANK: tl.constexpr, BLOCK_R: tl.constexpr):
    """acc[t, :] += buf[s, t, :] @ B[slot(t), rows, :].T for the program's columns (one slice s):
    one pass over the step's slots, each slot's B tile read once, its tokens picked by a mask."""
    s = _slice_of(n_start, off1, off2, off3)
    offs_r = tl.arange(0, BLOCK_R)
    tok_slot = tl.load(token_slots_ptr + offs_m, mask=m_mask, other=-1)
    lhs_all = tl.load(buf_ptr + (s * M + offs_m[:, None]) * RANK + offs_r[None, :],
                      mask=m_mask[:, None] & (offs_r < RANK)[None, :], other=0.0)
    num_blocks = tl.load(num_blocks_ptr)  # blocks of real slots; a slot's blocks are consecutive
    prev = -1
    for b in range(0, num_blocks):
        slot = tl.load(block_slots_ptr + b)
        rank = tl.load(block_ranks_ptr + b)
        lead = slot != prev  # the slot's first block: its B is added once
        prev = slot
        r_mask = _rank_mask(offs_r, tl.where(lead, rank, 0), RANK)
        bt = tl.load(lb_ptr + slot.to(tl.int64) * stride_ll + rows.to(tl.int64)[None, :] * stride_ln + offs_r[:, None],
                     mask=r_mask[:, None], other=0.0)  # [BLOCK_R, BLOCK_N]
        lhs = tl.where((tok_slot == slot)[:, None] & r_mask[None, :], lhs_all, 0.0).to(bt.dtype)
        acc = tl.dot(lhs, bt, acc)
    return acc


@triton.jit
def _lora_row(n_start, rows, buf_ptr, lb_ptr, block_slots_ptr, block_ranks_ptr, num_blocks_ptr,
              stride_ll, stride_ln, off1, off2, off3, RANK: tl.constexpr, BLOCK_R: tl.constexpr):
    """One token: buf[s, 0, :] @ B[slot, rows, :].T ([BLOCK_N] float32; 0 without an adapter)."""
    s = _slice_of(n_start, off1, off2, off3)
    offs_r = tl.arange(0, BLOCK_R)
    slot = tl.load(block_slots_ptr)
    rank = tl.where(tl.load(num_blocks_ptr) > 0, tl.load(block_ranks_ptr), 0)  # no real block: no adapter
    r_mask = _rank_mask(offs_r, rank, RANK)
    lhs = tl.load(buf_ptr + s * RANK + offs_r, mask=r_mask, other=0.0)
    bt = tl.load(lb_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_ll + rows.to(tl.int64)[:, None] * stride_ln
                 + offs_r[None, :], mask=r_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_R]
    return tl.sum(bt.to(tl.float32) * lhs.to(bt.dtype).to(tl.float32)[None, :], axis=1)


@triton.jit(do_not_specialize=["M"])  # one build per row tile for every token count (the warm-up's ladder covers it)
def _skinny_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    buf_ptr, lb_ptr, token_slots_ptr, block_slots_ptr, block_ranks_ptr, num_blocks_ptr, stride_ll, stride_ln,
    off1, off2, off3,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    LORA: tl.constexpr = False, RANK: tl.constexpr = 16, BLOCK_R: tl.constexpr = 16,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    if EVEN_N:
        rows = offs_n
    else:  # clamp instead of masking the weight loads: the extra columns are never stored
        rows = tl.minimum(offs_n, N - 1)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    if BLOCK_M == 1:
        # One token: products in registers, one sum over K at the end (no tensor-core tile to fill).
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        x_ptrs = x_ptr + offs_k
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs)
                x = tl.load(x_ptrs)
            else:
                k_mask = (k0 + offs_k) < K
                w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
                x = tl.load(x_ptrs, mask=k_mask, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        out = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]
        if LORA:
            out += _lora_row(pid * BLOCK_N, rows, buf_ptr, lb_ptr, block_slots_ptr, block_ranks_ptr, num_blocks_ptr,
                             stride_ll, stride_ln, off1, off2, off3, RANK, BLOCK_R)[None, :]
    else:
        offs_m = tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs)
                x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            else:
                k_mask = (k0 + offs_k) < K
                w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
                x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        if LORA:
            acc = _lora_rows(acc, pid * BLOCK_N, rows, offs_m, m_mask, M, buf_ptr, lb_ptr, token_slots_ptr,
                             block_slots_ptr, block_ranks_ptr, num_blocks_ptr, stride_ll, stride_ln, off1, off2, off3,
                             RANK, BLOCK_R)
        out = acc
    if HAS_BIAS:
        out += tl.load(b_ptr + rows).to(tl.float32)[None, :]
    offs_m = tl.arange(0, BLOCK_M)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & n_mask[None, :])


def supported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Shapes and layouts the kernel takes: 2-D x of 1-64 rows, half-precision, unit column
    strides, a contiguous bias of the same dtype. Anything else (a mismatched K included) goes
    to F.linear, which also raises its own errors."""
    return (
        x.dim() == 2
        and weight.dim() == 2
        and 0 < x.shape[0] <= MAX_TOKENS
        and x.shape[1] == weight.shape[1]
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and (bias is None or (bias.dtype == x.dtype and bias.dim() == 1 and bias.is_contiguous()))
    )


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: SkinnyConfig) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M <= 64, K] through the skinny kernel with config cfg."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _skinny_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        y, y, y, y, y, y, 0, 0, n, n, n,
        HAS_BIAS=bias is not None, BLOCK_M=_block_m(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=k % cfg.block_k == 0, EVEN_N=n % cfg.block_n == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return y


def _block_m(m: int) -> int:
    return 1 if m == 1 else max(16, triton.next_power_of_2(m))


# The fused path's config where the table has none for the shape and token count (cuBLAS won the
# base GEMM alone there, or the shape was never measured): fits a 64-row tile's pipeline in an
# H100's shared memory (3 x 48 KiB).
FUSED_DEFAULT = SkinnyConfig(block_n=32, block_k=256, num_warps=4, num_stages=4)
MAX_FUSED_SLICES = 4
# The fused path's largest token count. Its epilogue walks the step's slots one after another in
# each program (one program per SM, as the GEMM's pipeline fills shared memory): at 8 tokens of 8
# adapters it saved 3% of an H100 decode step, at 64 tokens of 40 it cost 19% (docs/BENCHMARKS.md).
FUSED_MAX_TOKENS = 16


def fuses_expand(x: torch.Tensor, weight: torch.Tensor, bias, buf_rank: int, lora_b: torch.Tensor,
                 slice_offsets: tuple[int, ...]) -> SkinnyConfig | None:
    """The config to run y = x @ W.T + b + LoRA expand as one skinny kernel, or None where it
    does not apply (more than FUSED_MAX_TOKENS rows, a layout the kernel does not take, slices that a
    program's columns would straddle, more than 4 slices)."""
    if x.shape[0] > FUSED_MAX_TOKENS or not supported(x, weight, bias) or lora_b.dtype != x.dtype or lora_b.stride(2) != 1:
        return None
    if len(slice_offsets) - 1 > MAX_FUSED_SLICES or slice_offsets[-1] != weight.shape[0] or buf_rank != lora_b.shape[2]:
        return None
    cfg = skinny_config(x.device, x.shape[0], weight.shape[0], weight.shape[1]) or FUSED_DEFAULT
    widths = (b - a for a, b in zip(slice_offsets, slice_offsets[1:]))
    return cfg if all(w % cfg.block_n == 0 for w in widths) else None


def skinny_linear_expand(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: SkinnyConfig,
    buf: torch.Tensor, lora_b: torch.Tensor, slice_offsets: tuple[int, ...], meta: LoraMeta,
) -> torch.Tensor:
    """x @ weight.T + bias + lora_expand's delta (buf [S, T, R] float32 from lora_shrink, lora_b
    [max_loras, N, R]) in one kernel: each program adds, after its GEMM tile, every active slot's
    B tile for its columns (read to the adapter's rank), so the expand costs no launch of its own
    and no second pass over y. cfg from `fuses_expand`."""
    m, k = x.shape
    n = weight.shape[0]
    rank = buf.shape[2]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    blocks = meta.any_block_list()
    offs = tuple(slice_offsets[1:-1]) + (n,) * (MAX_FUSED_SLICES - len(slice_offsets) + 1)
    _skinny_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        buf, lora_b, meta.token_slots, blocks.blocks, blocks.blocks[3], blocks.num_blocks,
        lora_b.stride(0), lora_b.stride(1), *offs,
        HAS_BIAS=bias is not None, BLOCK_M=_block_m(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=k % cfg.block_k == 0, EVEN_N=n % cfg.block_n == 0,
        LORA=True, RANK=rank, BLOCK_R=max(16, triton.next_power_of_2(rank)),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the skinny kernel where this GPU's table says it is faster."""
    if supported(x, weight, bias):
        cfg = skinny_config(x.device, x.shape[0], weight.shape[0], weight.shape[1])
        if cfg is not None:
            return skinny_linear(x, weight, bias, cfg)
    return F.linear(x, weight, bias)
