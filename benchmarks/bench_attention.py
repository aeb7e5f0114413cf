"""Paged attention (Triton) on Llama-3-8B shapes against its floor and torch SDPA on contiguous K/V.

    python benchmarks/bench_attention.py
    python benchmarks/bench_attention.py --decode-sweep   (decode launch settings at small batches)

Shapes: H 32, KVH 8, D 128, block size 16, bf16, block tables of shuffled block ids.
Floors, measured in the same run: decode = K and V bytes read / device-to-device copy
bandwidth (a large tensor copy, bytes read + written); prefill = attention FLOPs (4 * H * D per
visible query-key pair) / bf16 matmul rate (an 8192^3 torch.matmul). Every time is the median
of triton.testing.do_bench (which empties L2 before each call) over replays of a CUDA graph
holding one call. SDPA reads the same keys laid out contiguously ([B, KVH, L, D], GQA in the
kernel where torch can): a reference for what a dense kernel gets, not a paged one.
Prints one markdown table; asserts nothing on time.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from loraserve.kernels import triton_attention
from loraserve.kernels.tuning import num_sms

DEV = "cuda"
DTYPE = torch.bfloat16
H, KVH, D, BLOCK = 32, 8, 128, 16
DECODE = [(b, ctx) for ctx in (1024, 4096) for b in (1, 8, 32, 64)] + [(1, 16384)]
PREFILL = [(1, 4096, 0), (16, 256, 1024), (4, 512, 1024)]  # (sequences, chunk tokens, cached tokens before)


@triton.jit
def _empty_kernel(ptr):
    pass


def median_ms(fn) -> float:
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def graph_ms(fn) -> float:
    """fn captured once in a CUDA graph (compiled first), the replay timed; eager if capture fails."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError:
        return median_ms(fn)
    return median_ms(graph.replay)


def measure_ceilings() -> tuple[float, float]:
    """(copy bandwidth bytes/s counting read + write, bf16 matmul FLOP/s)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() / (median_ms(lambda: dst.copy_(src)) * 1e-3)
    src = dst = None  # frees the buffers (the timed closure holds the names)
    a = torch.randn(8192, 8192, dtype=DTYPE, device=DEV)
    b = torch.randn(8192, 8192, dtype=DTYPE, device=DEV)
    flops = 2 * 8192**3 / (median_ms(lambda: a @ b) * 1e-3)
    return bandwidth, flops


def empty_launch_ms() -> float:
    """One empty Triton kernel replayed in a graph: the fixed cost under every row (decode launches two when split)."""
    x = torch.empty(1, device=DEV)
    return graph_ms(lambda: _empty_kernel[(1,)](x))


def paged(seq_lens: list[int], gen) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """A cache holding exactly these sequences through shuffled block ids; also each one's [KVH, L, D] K, V."""
    blocks_of = [-(-n // BLOCK) for n in seq_lens]
    num_blocks = sum(blocks_of)
    k_cache = torch.randn(num_blocks, BLOCK, KVH, D, device=DEV, generator=gen, dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    ids = torch.randperm(num_blocks, device=DEV, generator=gen).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks_of), dtype=torch.int32, device=DEV)
    dense, taken = [], 0
    for b, n in enumerate(blocks_of):
        own = ids[taken : taken + n]
        taken += n
        tables[b, :n] = own
        k, v = (c[own.long()].flatten(0, 1)[: seq_lens[b]].transpose(0, 1) for c in (k_cache, v_cache))
        dense.append((k, v))
    return k_cache, v_cache, tables, dense


def sdpa(q, k, v, **kw):
    """q [B, H, n, D], k / v [B, KVH, L, D]: GQA inside SDPA when this torch can, else K/V expanded first."""
    try:
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
        return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
    except (TypeError, RuntimeError):
        k, v = k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1)
        return lambda: F.scaled_dot_product_attention(q, k, v, **kw)


def bench_decode(batch: int, ctx: int, bandwidth: float, gen, with_sdpa: bool = True) -> dict:
    k_cache, v_cache, tables, dense = paged([ctx] * batch, gen)
    q = torch.randn(batch, H, D, device=DEV, generator=gen, dtype=DTYPE)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    out = torch.empty_like(q)
    ms = graph_ms(lambda: triton_attention.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, D**-0.5, out=out))
    k = torch.stack([kd for kd, _ in dense]).contiguous()
    v = torch.stack([vd for _, vd in dense]).contiguous()
    sdpa_ms = graph_ms(sdpa(q[:, :, None], k, v, scale=D**-0.5)) if with_sdpa else float("nan")
    kv_bytes = 2 * batch * ctx * KVH * D * k_cache.element_size()
    block_n = triton_attention.decode_config(D)[0]
    splits, _ = triton_attention.decode_splits(batch, KVH, tables.shape[1] * BLOCK, num_sms(0), block_n)
    return dict(
        kernel="decode",
        shape=f"B {batch} x ctx {ctx}",
        splits=splits,
        ms=ms,
        floor_ms=kv_bytes / bandwidth * 1e3,
        floor="bytes",
        sdpa_ms=sdpa_ms,
    )


def bench_prefill(num_seqs: int, chunk: int, ctx: int, flops_rate: float, gen) -> dict:
    total = ctx + chunk
    k_cache, v_cache, tables, dense = paged([total] * num_seqs, gen)
    q = torch.randn(num_seqs * chunk, H, D, device=DEV, generator=gen, dtype=DTYPE)
    seq_lens = torch.full((num_seqs,), total, dtype=torch.int32, device=DEV)
    cu = torch.arange(num_seqs + 1, device=DEV, dtype=torch.int32) * chunk
    out = torch.empty_like(q)
    ms = graph_ms(
        lambda: triton_attention.paged_prefill_attention(q, k_cache, v_cache, tables, seq_lens, cu, chunk, D**-0.5, out=out)
    )
    qd = q.view(num_seqs, chunk, H, D).transpose(1, 2)
    k = torch.stack([kd for kd, _ in dense]).contiguous()
    v = torch.stack([vd for _, vd in dense]).contiguous()
    if ctx == 0:
        sdpa_fn = sdpa(qd, k, v, is_causal=True, scale=D**-0.5)
    else:
        from torch.nn.attention.bias import causal_lower_right

        sdpa_fn = sdpa(qd, k, v, attn_mask=causal_lower_right(chunk, total), scale=D**-0.5)
    try:
        sdpa_ms = graph_ms(sdpa_fn)
    except RuntimeError:  # e.g. no fused kernel for this mask with GQA
        sdpa_ms = float("nan")
    pairs = num_seqs * sum(ctx + j + 1 for j in range(chunk))  # visible (query, key) pairs
    flops = 4 * H * D * pairs
    return dict(
        kernel="prefill",
        shape=f"{num_seqs} x {chunk} after {ctx}",
        splits="",
        ms=ms,
        floor_ms=flops / flops_rate * 1e3,
        floor="FLOPs",
        sdpa_ms=sdpa_ms,
    )


def decode_sweep(bandwidth: float, gen) -> None:
    """Decode launch settings at small batches (latency-bound): min partition, programs per SM and
    (BLOCK_N, warps, stages), each timed in a graph like the table; prints one line per setting."""
    saved = triton_attention._MIN_PARTITION, triton_attention._PROGRAMS_PER_SM, triton_attention.decode_config
    print("| B x ctx | BLOCK_N, warps, stages | min partition | programs / SM | splits | us |")
    print("|---|---|---|---|---|---|")
    try:
        for batch, ctx in ((1, 1024), (8, 1024), (32, 1024), (1, 4096)):
            for cfg in ((64, 4, 3), (32, 4, 3), (32, 2, 2), (16, 2, 2), (64, 8, 3)):
                triton_attention.decode_config = lambda d_pad, cfg=cfg: cfg
                for min_part in sorted({cfg[0], 2 * cfg[0], 128}):
                    for per_sm in (2, 4, 8):
                        triton_attention._MIN_PARTITION, triton_attention._PROGRAMS_PER_SM = min_part, per_sm
                        row = bench_decode(batch, ctx, bandwidth, gen, with_sdpa=False)
                        print(
                            f"| {batch} x {ctx} | {cfg} | {min_part} | {per_sm} | {row['splits']} | {row['ms'] * 1e3:.1f} |",
                            flush=True,
                        )
    finally:
        triton_attention._MIN_PARTITION, triton_attention._PROGRAMS_PER_SM, triton_attention.decode_config = saved


def main() -> None:
    if "--decode-sweep" in sys.argv:
        bandwidth, _ = measure_ceilings()
        decode_sweep(bandwidth, torch.Generator(device=DEV).manual_seed(0))
        return
    torch.manual_seed(0)
    gen = torch.Generator(device=DEV).manual_seed(0)
    bandwidth, flops_rate = measure_ceilings()
    empty_ms = empty_launch_ms()
    rows = [bench_decode(b, ctx, bandwidth, gen) for b, ctx in DECODE]
    rows += [bench_prefill(n, chunk, ctx, flops_rate, gen) for n, chunk, ctx in PREFILL]
    print(
        f"\n{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s (read + write), "
        f"bf16 matmul {flops_rate / 1e12:.0f} TFLOP/s, empty kernel in a graph {empty_ms * 1e3:.1f} us; H {H}, KVH {KVH}, D {D}, block {BLOCK}, bf16, CUDA graph, median\n"
    )
    print("| kernel | shape | splits | Triton us | floor us | floor / Triton | SDPA (contiguous) us |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['kernel']} | {r['shape']} | {r['splits']} | {r['ms'] * 1e3:.1f} | {r['floor_ms'] * 1e3:.1f} ({r['floor']}) "
            f"| {r['floor_ms'] / r['ms']:.2f} | {r['sdpa_ms'] * 1e3:.1f} |"
        )


if __name__ == "__main__":
    main()
