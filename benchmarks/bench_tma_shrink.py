"""A prefill shrink that loads its tiles with the tensor memory accelerator (TMA), against the shipped one.

An experiment, not a kernel the executor uses. The shipped shrink (kernels/triton_lora.py) gathers
each tile's x rows by token index with pointer loads; at prefill a block's tokens are usually one
run of consecutive rows (one sequence, one adapter), which a TMA descriptor can load as one box
instead. Here each block whose tokens are consecutive loads x and A through host-made tensor
descriptors (`triton.tools.tensor_descriptor`); other blocks take the gather loop. Same block list,
same output layout and K split as the shipped kernel (its reference checks the result).

Prints, per shape and token count, the shipped kernel (its table's config) and the best of the TMA
configs below, each with 1 adapter and with 64 adapters (consecutive runs of T / 64 tokens), in us per
call from CUDA graphs of 8 calls on 8 copies of x and A (so that no call finds its bytes in L2 from the
one before), and the floor (bytes at the copy rate, FLOPs at the matmul rate).

    python benchmarks/bench_tma_shrink.py [--shapes 4096x3x128@1024,...]
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from loraserve.kernels import reference, triton_lora
from loraserve.kernels.meta import make_lora_meta

SHAPES = "4096x3x128@1024,4096x3x128@4096,4096x2x128@1024,14336x1x128@1024,4096x3x8@1024,8192x2x128@4096,2048x3x128@1024"
# (block_m, block_n, block_k, split_k, warps, stages); block_n cut to the next power of two of S * R
CONFIGS = [
    (128, 128, 64, 1, 8, 3), (128, 128, 64, 2, 8, 3), (128, 128, 64, 4, 8, 3), (128, 256, 64, 2, 8, 3),
    (128, 256, 64, 4, 8, 3), (64, 128, 64, 2, 4, 4), (64, 128, 64, 4, 4, 4), (64, 256, 64, 4, 8, 3),
    (128, 64, 64, 2, 4, 4), (128, 128, 128, 2, 8, 2), (64, 64, 128, 2, 4, 3), (128, 128, 128, 4, 8, 3),
    (64, 256, 128, 4, 8, 2), (128, 256, 64, 8, 8, 3), (64, 128, 128, 2, 4, 3),
    # shallower stages, so that 2-4 blocks fit an SM's shared memory
    (64, 128, 64, 2, 8, 2), (64, 64, 64, 2, 4, 2), (64, 128, 64, 4, 4, 2), (128, 128, 64, 2, 8, 2),
    (64, 64, 128, 4, 4, 2), (64, 64, 64, 4, 4, 3),
]
COPIES = 8


@triton.jit(do_not_specialize=["num_tokens"])
def _shrink_tma_kernel(
    x_desc, a_desc, x_ptr, a_ptr, out_ptr, block_slots_ptr, block_tokens_ptr, num_blocks_ptr,
    num_tokens, num_slots, in_features, k_per_split, stride_xt, stride_as,
    RANK: tl.constexpr, SR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, N_BLOCKS: tl.constexpr, SPLIT_K: tl.constexpr, STAGES: tl.constexpr,
):
    tile = tl.program_id(0)
    per_block = N_BLOCKS * SPLIT_K
    block = tile // per_block
    if block < tl.load(num_blocks_ptr + 1):
        rest = tile - block * per_block
        split = rest // N_BLOCKS
        col0 = (rest - split * N_BLOCKS) * BLOCK_N
        slot = tl.load(block_slots_ptr + block)
        tok = tl.load(block_tokens_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        m_mask = tok >= 0
        offs_j = col0 + tl.arange(0, BLOCK_N)
        j_mask = offs_j < SR
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if (slot >= 0) & (slot < num_slots):
            tok0 = tl.min(tl.where(m_mask, tok, num_tokens))
            count = tl.sum(m_mask.to(tl.int32))
            k_lo = split * k_per_split
            k_hi = tl.minimum(k_lo + k_per_split, in_features)
            if tl.max(tl.where(m_mask, tok, -1)) == tok0 + count - 1:  # one run of rows: TMA boxes
                for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
                    xa = x_desc.load([tok0, k])
                    a = a_desc.load([slot * SR + col0, k])
                    acc = tl.dot(xa, a.T, acc)
            else:  # gathered rows
                x_rows = x_ptr + tl.maximum(tok, 0)[:, None].to(tl.int64) * stride_xt
                a_rows = a_ptr + slot.to(tl.int64) * stride_as + offs_j[None, :] * in_features
                for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
                    offs_k = k + tl.arange(0, BLOCK_K)
                    k_mask = offs_k < k_hi
                    xa = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                    a = tl.load(a_rows + offs_k[:, None], mask=j_mask[None, :] & k_mask[:, None], other=0.0)
                    acc = tl.dot(xa, a, acc)
        out_ptrs = out_ptr + ((offs_j[None, :] // RANK) * num_tokens + tok[:, None]) * RANK + offs_j[None, :] % RANK
        mask = m_mask[:, None] & j_mask[None, :]
        if SPLIT_K == 1:
            tl.store(out_ptrs, acc, mask=mask)
        else:
            tl.atomic_add(out_ptrs, acc, mask=mask, sem="relaxed")


def tma_shrink(x, lora_a, meta, cfg, out=None):
    """lora_shrink's result (ranked=False: every slot read to its full rank) by the TMA kernel."""
    bm, bn, bk, split, warps, stages = cfg
    num_tokens, in_features = x.shape
    num_slots, num_slices, rank, _ = lora_a.shape
    sr = num_slices * rank
    bn = min(bn, max(16, triton.next_power_of_2(sr)))
    out = torch.zeros(num_slices, num_tokens, rank, dtype=torch.float32, device=x.device) if out is None else out
    if split > 1:
        out.zero_()
    blocks = meta.block_list(bm)
    col_blocks = triton.cdiv(sr, bn)
    k_per_split = triton.cdiv(triton.cdiv(in_features, bk), split) * bk
    x_desc = TensorDescriptor(x, [num_tokens, in_features], [x.stride(0), 1], [bm, bk])
    a2 = lora_a.view(num_slots * sr, in_features)
    a_desc = TensorDescriptor(a2, [num_slots * sr, in_features], [in_features, 1], [bn, bk])
    grid = (blocks.max_blocks * col_blocks * split,)
    _shrink_tma_kernel[grid](
        x_desc, a_desc, x, lora_a, out, blocks.blocks, blocks.tokens, blocks.num_blocks,
        num_tokens, num_slots, in_features, k_per_split, x.stride(0), lora_a.stride(0),
        RANK=rank, SR=sr, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, N_BLOCKS=col_blocks, SPLIT_K=split,
        STAGES=stages, num_warps=warps,
    )
    return out


def _graph_us(fns, replays: int = 30) -> float:
    """us per call of the calls `fns`, from a CUDA graph of them all replayed (median of 5 timings)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for fn in fns * 2:
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for fn in fns:
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * len(fns)))
    return sorted(times)[2]


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference over the largest value of the reference."""
    return (got.float() - want.float()).abs().max().item() / want.float().abs().max().item()


def best_config(configs, check, timed, label: str, every: bool) -> tuple[tuple[float, tuple] | None, float]:
    """((us, config) of the fastest of `configs`, the largest error any had): check(config) runs one
    call and returns its error against the reference, timed(config) its us per call. A config that
    does not build or fit is skipped, with a line that says so; every: a line per config's time."""
    best, err = None, 0.0
    for cfg in dict.fromkeys(configs):
        try:
            e = check(cfg)
            us = timed(cfg)
        except Exception as exc:
            print(f"  ({label}, {cfg}: {type(exc).__name__}: {str(exc)[:120]})")
            continue
        err = max(err, e)
        if every:
            print(f"  {label}, {cfg}: {us:.1f} us")
        if best is None or us < best[0]:
            best = (us, cfg)
    return best, err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=SHAPES, help="in x slices x rank @ tokens, comma-separated")
    ap.add_argument("--copy-gbs", type=float, default=3019.0, help="the copy rate the floor takes (GB/s)")
    ap.add_argument("--tflops", type=float, default=699.0, help="the matmul rate the floor takes")
    ap.add_argument("--every", action="store_true", help="also print every TMA config's time")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_tma_shrink.py runs on a CUDA host")
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    print(f"TMA shrink against the shipped shrink - {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}, {time.strftime('%Y-%m-%d %H:%M')}")
    print("| shape @ tokens | adapters | floor us | shipped us (config) | best TMA us (config) | TMA / shipped | max error |")
    print("|---|---|---|---|---|---|---|")
    gen = torch.Generator(device=dev).manual_seed(0)
    for item in args.shapes.split(","):
        shape, tokens = item.split("@")
        k, s, r = map(int, shape.split("x"))
        t = int(tokens)
        xs = [torch.randn(t, k, device=dev, dtype=bf16, generator=gen) for _ in range(COPIES)]
        x = xs[0]
        for adapters in (1, 64):
            a_s = [torch.randn(adapters, s, r, k, device=dev, dtype=bf16, generator=gen) * 0.05 for _ in range(COPIES)]
            lora_a = a_s[0]
            slots = torch.arange(t, device=dev, dtype=torch.int32) * adapters // t  # runs of T / adapters
            meta = make_lora_meta(slots, adapters)
            want = reference.lora_shrink(x, lora_a, meta)
            floor = max((x.nbytes + lora_a.nbytes + want.nbytes) / (args.copy_gbs * 1e3),
                        2 * t * k * s * r / (args.tflops * 1e6))
            out = torch.empty_like(want)
            shipped_cfg = triton_lora.shrink_config(dev, t, k, s, r)
            shipped = _graph_us([lambda x=x, a=a: triton_lora.lora_shrink(x, a, meta, out=out, ranked=False)
                                 for x, a in zip(xs, a_s)])
            best, err = best_config(
                CONFIGS, lambda cfg: _error(tma_shrink(x, lora_a, meta, cfg), want),
                lambda cfg: _graph_us([lambda x=x, a=a: tma_shrink(x, a, meta, cfg, out=out) for x, a in zip(xs, a_s)]),
                f"{item}, {adapters} adapters", args.every)
            print(f"| {item} | {adapters} | {floor:.1f} | {shipped:.1f} ({shipped_cfg.block_m}x{shipped_cfg.block_n}"
                  f"x{shipped_cfg.block_k}, split {shipped_cfg.split_k}) | {best[0]:.1f} {best[1]} | "
                  f"{best[0] / shipped:.2f} | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
