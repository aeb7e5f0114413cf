"""Triton fused MoE with expert LoRA: the CUDA path, same signature and math as kernels/moe_reference.py.

The T*K (token, expert) pairs are sorted by expert and each expert's group padded to BLOCK_M
rows (`align_pairs`), so one grouped-GEMM launch computes every expert's w13 and one its w2,
each program a BLOCK_M x BLOCK_N tile of one expert (vLLM's fused_moe layout). Expert LoRA is
the dense LoRA of the pairs with one adapter index per (slot, expert): pair p of token t on
expert e uses index slot(t) * E + e, and the slot buffers [L, E, S, R, in] / [L, E, N, R] are
read as [L*E, S, R, in] / [L*E, N, R] (free views). The dense shrink/expand kernels
(kernels/triton_lora.py) then apply each (token, expert, slot)'s LoRA, reading each A and B
once per block of its own pairs. Every shape depends only on T, K, E and the slot buffers, and
nothing reads back to the host: safe inside a captured CUDA graph. Under expert parallelism ids
outside [0, E) (other ranks' experts) are left out of the groups, their LoRA index is -1 and
their rows count as zero in the sum.

FP8 experts (w13_scale / w2_scale given) are read as float8_e4m3fn, upcast tile by tile to x's
dtype and the accumulator scaled per (expert, output row): weight-only dequantization (W8A16),
half the bytes of bf16 experts and no activation-quantization pass; the bf16 build is unchanged
(the branch is a constexpr).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import moe_reference, ops_reference
from . import triton_lora as lora_kernels
from .meta import LoraMeta, make_lora_meta

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit(do_not_specialize=["num_pairs"])  # one build for every pair count
def _grouped_gemm_kernel(
    a_ptr, b_ptr, b_scale_ptr, c_ptr, sorted_pairs_ptr, block_experts_ptr,
    num_pairs, n, k, rows_per_a,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32: tl.constexpr, FP8_B: tl.constexpr,
):  # fmt: skip
    """c[p, :] = a[p // rows_per_a, :] @ b[expert(p)].T for the BLOCK_M pairs of this program's block.

    a: [rows, k]; b: [E, n, k]; c: [num_pairs, n]. sorted_pairs holds pair ids grouped by
    expert (num_pairs = padding); block_experts the expert of each BLOCK_M block (-1: unused).
    FP8_B: b is float8_e4m3fn with b_scale [E, n] float32 (contiguous), one scale per row of b:
    each tile is upcast to a's dtype before the dot (exact: e4m3 values are bf16/fp16 values) and
    the accumulator scaled per output column, (a @ q.T) * s = a @ (q * s).T. Else b_scale is None
    and the branch is compiled out.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert >= 0:
        pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        m_mask = pairs < num_pairs
        rows = tl.where(m_mask, pairs // rows_per_a, 0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        b_base = b_ptr + expert.to(tl.int64) * stride_be + offs_n[None, :] * stride_bn
        for k0 in range(0, k, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k
            a = tl.load(a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
            b = tl.load(b_base + offs_k[:, None] * stride_bk, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if FP8_B:
                b = b.to(a.dtype)
            if FP32:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        if FP8_B:
            scale = tl.load(b_scale_ptr + expert.to(tl.int64) * n + offs_n, mask=n_mask, other=0.0)
            acc = acc * scale[None, :]
        c = c_ptr + tl.where(m_mask, pairs, 0).to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs (t*K + k) grouped by expert, each group padded to a multiple of block_m.

    -> sorted_pairs [max_padded] int32 (num_pairs marks padding), block_experts [max_padded // block_m]
    int32 (-1 past the last group). max_padded = T*K + E*(block_m - 1), rounded up to block_m:
    fixed for a given T, so the launch shape is too. Tensor ops only, no host sync. Pairs whose
    id is outside [0, E) (other expert-parallel ranks' experts) are in no group.
    """
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    max_padded = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    flat = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # other ranks' experts: group E
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = torch.cat([padded_end - padded, padded_end.new_full((1,), max_padded)])  # group E: one dummy row
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)  # pair ids by expert
    expert_of = flat[order]
    position = padded_start[expert_of] + torch.arange(num_pairs, device=dev) - start[expert_of]
    position = torch.where(expert_of < num_experts, position, max_padded)
    sorted_pairs = torch.full((max_padded + 1,), num_pairs, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, position, order.to(torch.int32))
    sorted_pairs = sorted_pairs[:max_padded]
    block_first_row = torch.arange(0, max_padded, block_m, device=dev)
    block_experts = torch.searchsorted(padded_end, block_first_row, right=True).to(torch.int32)
    block_experts = torch.where(block_experts < num_experts, block_experts, torch.full_like(block_experts, -1))
    return sorted_pairs, block_experts


def _grouped_gemm(a, w, w_scale, sorted_pairs, block_experts, num_pairs, rows_per_a, block_m, out_dtype):
    """[num_pairs, N] = per-pair a-row @ w[expert].T (w: [E, N, K]; FP8 with w_scale [E, N], or w_scale None)."""
    n, k = w.shape[1], w.shape[2]
    c = torch.empty(num_pairs, n, dtype=out_dtype, device=a.device)
    # Few pairs per expert (decode): thin row blocks, long K steps; many: tensor-core tiles. Untuned.
    block_n, block_k, warps = (64, 128, 4) if block_m <= 16 else (128, 64, 8)
    grid = (block_experts.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, w_scale, c, sorted_pairs, block_experts, num_pairs, n, k, rows_per_a,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), c.stride(0), c.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, FP32=a.dtype == torch.float32,
        FP8_B=w_scale is not None, num_warps=warps,
    )  # fmt: skip
    return c


def _pair_meta(meta: LoraMeta, topk_ids: torch.Tensor, num_experts: int) -> LoraMeta:
    """The LoRA grouping of the pairs: index slot * E + expert, -1 for pairs of base tokens and of
    other ranks' experts."""
    slots = meta.token_slots.long()[:, None].expand_as(topk_ids)
    ids = topk_ids.long()
    mine = (slots >= 0) & (ids >= 0) & (ids < num_experts)
    index = torch.where(mine, slots * num_experts + ids, torch.full_like(slots, -1))
    return make_lora_meta(index.reshape(-1), meta.max_loras * num_experts)


def _flat(lora):
    """(a [L, E, S, R, in], b [L, E, N, R]) -> ([L*E, S, R, in], [L*E, N, R]) views."""
    a, b = lora
    return a.flatten(0, 1), b.flatten(0, 1)


def fused_moe(
    x, topk_weights, topk_ids, w13, w2, lora13, lora2, meta: LoraMeta | None, w13_scale=None, w2_scale=None
) -> torch.Tensor:
    """-> [T, H]; see kernels/moe_reference.py. FP8 experts (w13_scale, w2_scale given): weight-only
    dequantization inside the grouped GEMMs (W8A16: the dot in x's dtype, float32 accumulation)."""
    if x.dtype not in _DTYPES or not (w13.stride(2) == 1 and w2.stride(2) == 1 and x.stride(1) == 1):
        return moe_reference.fused_moe(x, topk_weights, topk_ids, w13, w2, lora13, lora2, meta, w13_scale, w2_scale)
    if w13_scale is not None:
        w13_scale, w2_scale = w13_scale.float().contiguous(), w2_scale.float().contiguous()
    T, K = topk_ids.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    num_pairs = T * K
    block_m = 16 if num_pairs <= 64 * num_experts else 64
    sorted_pairs, block_experts = align_pairs(topk_ids, num_experts, block_m)
    # gate|up of every pair: [T*K, 2I] (the a-row of pair p is token p // K)
    h = _grouped_gemm(x, w13, w13_scale, sorted_pairs, block_experts, num_pairs, K, block_m, x.dtype)
    pair_meta = _pair_meta(meta, topk_ids, num_experts) if meta is not None else None
    if lora13 is not None and pair_meta is not None:
        x_pairs = x.repeat_interleave(K, dim=0)  # [T*K, H]: shrink reads the rows of its pair ids
        a, b = _flat(lora13)
        buf = lora_kernels.lora_shrink(x_pairs, a, pair_meta, None)
        lora_kernels.lora_expand(h, buf, b, (0, inter, 2 * inter), pair_meta)
    act = _silu_and_mul(h)  # [T*K, I]
    y = _grouped_gemm(act, w2, w2_scale, sorted_pairs, block_experts, num_pairs, 1, block_m, x.dtype)  # [T*K, H]
    if lora2 is not None and pair_meta is not None:
        a, b = _flat(lora2)
        buf = lora_kernels.lora_shrink(act, a, pair_meta, None)
        lora_kernels.lora_expand(y, buf, b, (0, y.shape[1]), pair_meta)
    y = y.view(T, K, -1).float() * topk_weights.float()[:, :, None]
    mine = (topk_ids >= 0) & (topk_ids < num_experts)  # other ranks' pairs: rows never written
    out = torch.where(mine[:, :, None], y, 0.0).sum(1)
    return out.to(x.dtype)


def _silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    """The fused op of kernels/triton_ops.py on CUDA, the reference elsewhere (the interpreter)."""
    if h.device.type != "cuda":
        return ops_reference.silu_and_mul(h)
    from . import silu_and_mul  # the package's dispatch (imported late: it imports this module lazily)

    return silu_and_mul(h)
