"""A prefill expand that moves y, B and the shrink's output by TMA, against the shipped one.

An experiment, not a kernel the executor uses (the companion of bench_tma_shrink.py). The shipped
expand (kernels/triton_lora.py) reads and writes y by pointer, a register tile per step, and the
twenty-first pass's profile found it latency-bound (too few bytes in flight). Here a block of
block_m consecutive tokens of one adapter (a full block: at prefill most are) loads its rows of
the shrink's output once, then walks its columns in a software-pipelined loop whose y and B tiles
are TMA boxes (host-made tensor descriptors), adding into y with TMA stores; a step whose columns
cross the slice's end, and any block that is not full and consecutive, takes pointer loads and
masked stores (a box would write rows or columns another program owns). Same block list and
math as the shipped kernel; kernels/reference.py checks the result.

Prints, per shape and token count, the shipped kernel (its table's config) and the best of the TMA
configs below, each with 1 adapter and with 64 adapters (consecutive runs of T / 64 tokens), in us
per call from CUDA graphs of 8 calls on 8 copies of y, B and the shrink output, and the floor (y read
and written, B and the shrink output read, at the copy rate).

    python benchmarks/bench_tma_expand.py [--shapes 4096x128@4096,14336+14336x8@1024,...] [--every]
"""

from __future__ import annotations

import argparse
import time

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from bench_tma_shrink import _error, _graph_us, best_config
from loraserve.kernels import reference, triton_lora
from loraserve.kernels.meta import make_lora_meta
from loraserve.kernels.triton_lora import _locate_slice

SHAPES = ("4096x128@4096,14336+14336x128@4096,14784+14784x128@4096,4096+1024+1024x128@1024,"
          "4096x8@4096,14336+14336x8@1024,2048x128@1024")
# (block_m, block_n, steps per tile, warps, stages)
CONFIGS = [
    (64, 128, 4, 4, 3), (64, 128, 8, 4, 3), (64, 64, 8, 4, 3), (128, 128, 4, 8, 3), (64, 256, 4, 8, 2),
    (128, 64, 8, 4, 3), (64, 128, 16, 4, 4), (32, 128, 8, 4, 3), (64, 128, 8, 4, 2), (128, 128, 8, 8, 2),
    (32, 128, 8, 4, 4), (64, 64, 8, 4, 4), (64, 64, 16, 4, 3),
]
COPIES = 8


@triton.jit
def _step_by_pointers(y_ptr, b_ptr, lhs, tok, m_mask, slot, n, hi, stride_yt, n_total,
                      BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, R: tl.constexpr):
    offs_n = n + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    n_mask = offs_n < hi
    b = tl.load(b_ptr + (slot.to(tl.int64) * n_total + offs_n[None, :]) * R + offs_r[:, None],
                mask=n_mask[None, :] & (offs_r < R)[:, None], other=0.0)
    ptrs = y_ptr + tl.maximum(tok, 0)[:, None].to(tl.int64) * stride_yt + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    old = tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, (old.to(tl.float32) + tl.dot(lhs, b)).to(ptrs.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_tokens"])
def _expand_tma_kernel(
    y_desc, buf_desc, b_desc, y_ptr, buf_ptr, b_ptr, block_slots_ptr, block_tokens_ptr, num_blocks_ptr,
    num_tokens, num_slots, chunks, stride_yt, n_total, off0, off1, off2, off3, off4,
    NUM_SLICES: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, N_ITERS: tl.constexpr, STAGES: tl.constexpr,
):
    tile = tl.program_id(0)
    block = tile // chunks
    if block < tl.load(num_blocks_ptr):  # blocks of real slots
        chunk = tile - block * chunks
        slot = tl.load(block_slots_ptr + block)
        tok = tl.load(block_tokens_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        if (slot >= 0) & (slot < num_slots):
            s, lo, hi, local = _locate_slice(chunk, off0, off1, off2, off3, off4, NUM_SLICES, BLOCK_N * N_ITERS)
            n_start = lo + local * (BLOCK_N * N_ITERS)
            m_mask = tok >= 0
            tok0 = tl.min(tl.where(m_mask, tok, num_tokens))
            full = (tl.sum(m_mask.to(tl.int32)) == BLOCK_M) & (tl.max(tok) == tok0 + BLOCK_M - 1)
            if full:
                lhs = buf_desc.load([s * num_tokens + tok0, 0]).to(y_desc.dtype)
                # the steps wholly inside the slice, as TMA boxes in a pipelined loop with no branch
                n_end = tl.minimum(n_start + BLOCK_N * N_ITERS, hi)
                whole = (n_end - n_start) // BLOCK_N
                for i in tl.range(0, whole, num_stages=STAGES):
                    n = n_start + i * BLOCK_N
                    b = b_desc.load([slot * n_total + n, 0])
                    old = y_desc.load([tok0, n])
                    y_desc.store([tok0, n], (old.to(tl.float32) + tl.dot(lhs, b.T)).to(y_desc.dtype))
                n = n_start + whole * BLOCK_N
                if n < n_end:  # the slice's last, partial step
                    _step_by_pointers(y_ptr, b_ptr, lhs, tok, m_mask, slot, n, hi, stride_yt, n_total,
                                      BLOCK_R, BLOCK_N, R)
            else:
                offs_r = tl.arange(0, BLOCK_R)
                lhs = tl.load(buf_ptr + (s * num_tokens + tok[:, None]) * R + offs_r[None, :],
                              mask=m_mask[:, None] & (offs_r < R)[None, :], other=0.0).to(y_ptr.dtype.element_ty)
                for i in range(0, N_ITERS):
                    n = n_start + i * BLOCK_N
                    if n < hi:
                        _step_by_pointers(y_ptr, b_ptr, lhs, tok, m_mask, slot, n, hi, stride_yt, n_total,
                                          BLOCK_R, BLOCK_N, R)


def tma_expand(y, buf, lora_b, offsets, meta, cfg):
    """lora_expand(y, buf, lora_b, offsets, meta, ranked=False) by the TMA kernel (at most 5 slices)."""
    bm, bn, iters, warps, stages = cfg
    num_tokens, n_total = y.shape
    num_slots, _, r = lora_b.shape
    block_r = max(16, triton.next_power_of_2(r))
    widths = [b - a for a, b in zip(offsets, offsets[1:])]
    chunks = sum(triton.cdiv(w, bn * iters) for w in widths)
    blocks = meta.block_list(bm)
    y_desc = TensorDescriptor(y, [num_tokens, n_total], [y.stride(0), 1], [bm, bn])
    buf_desc = TensorDescriptor(buf.view(-1, r), [buf.shape[0] * num_tokens, r], [r, 1], [bm, block_r])
    b_desc = TensorDescriptor(lora_b.view(-1, r), [num_slots * n_total, r], [r, 1], [bn, block_r])
    offs = (list(offsets) + [offsets[-1]] * 5)[:5]
    grid = (blocks.max_blocks * chunks,)
    _expand_tma_kernel[grid](
        y_desc, buf_desc, b_desc, y, buf, lora_b, blocks.blocks, blocks.tokens, blocks.num_blocks,
        num_tokens, num_slots, chunks, y.stride(0), n_total, *offs,
        NUM_SLICES=len(widths), R=r, BLOCK_R=block_r, BLOCK_M=bm, BLOCK_N=bn, N_ITERS=iters, STAGES=stages,
        num_warps=warps,
    )
    return y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=SHAPES, help="widths+... x rank @ tokens, comma-separated")
    ap.add_argument("--copy-gbs", type=float, default=3019.0, help="the copy rate the floor takes (GB/s)")
    ap.add_argument("--every", action="store_true", help="also print every TMA config's time")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_tma_expand.py runs on a CUDA host")
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    print(f"TMA expand against the shipped expand - {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}, {time.strftime('%Y-%m-%d %H:%M')}")
    print("| shape @ tokens | adapters | floor us | shipped us (config) | best TMA us (config) | TMA / shipped | max error (both kernels) |")
    print("|---|---|---|---|---|---|---|")
    gen = torch.Generator(device=dev).manual_seed(0)
    for item in args.shapes.split(","):
        shape, tokens = item.split("@")
        widths_text, r = shape.split("x")
        widths = [int(w) for w in widths_text.split("+")]
        r, t = int(r), int(tokens)
        offsets = tuple([0] + [sum(widths[: i + 1]) for i in range(len(widths))])
        n = offsets[-1]
        ys = [torch.randn(t, n, device=dev, dtype=bf16, generator=gen) for _ in range(COPIES)]
        y0 = ys[0].clone()  # the timed calls add into ys in place: the checks start from this
        for adapters in (1, 64):
            bs = [torch.randn(adapters, n, r, device=dev, dtype=bf16, generator=gen) * 0.05 for _ in range(COPIES)]
            bufs = [torch.randn(len(widths), t, r, device=dev, dtype=torch.float32, generator=gen) for _ in range(COPIES)]
            slots = torch.arange(t, device=dev, dtype=torch.int32) * adapters // t  # runs of T / adapters
            meta = make_lora_meta(slots, adapters)
            want = reference.lora_expand(y0.clone(), bufs[0], bs[0], offsets, meta)
            floor = (2 * ys[0].nbytes + bs[0].nbytes + bufs[0].nbytes) / (args.copy_gbs * 1e3)
            cfg = triton_lora.expand_config(dev, t, tuple(widths), r)
            shipped = _graph_us([lambda y=y, b=b, u=u: triton_lora.lora_expand(y, u, b, offsets, meta, ranked=False)
                                 for y, b, u in zip(ys, bs, bufs)])
            shipped_err = _error(triton_lora.lora_expand(y0.clone(), bufs[0], bs[0], offsets, meta, ranked=False), want)
            best, err = best_config(
                CONFIGS, lambda c: _error(tma_expand(y0.clone(), bufs[0], bs[0], offsets, meta, c), want),
                lambda c: _graph_us([lambda y=y, b=b, u=u: tma_expand(y, u, b, offsets, meta, c)
                                     for y, b, u in zip(ys, bs, bufs)]),
                f"{item}, {adapters} adapters", args.every)
            err = max(err, shipped_err)
            print(f"| {item} | {adapters} | {floor:.1f} | {shipped:.1f} ({cfg.block_m}x{cfg.block_n}, {cfg.n_iters} "
                  f"steps, {cfg.num_stages} stages, {cfg.ctas_per_sm} CTAs/SM, maxnreg {cfg.maxnreg}) | "
                  f"{best[0]:.1f} {best[1]} | {best[0] / shipped:.2f} | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
