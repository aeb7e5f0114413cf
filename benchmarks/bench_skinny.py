"""The base model's linear layers at 1-64 tokens on a CUDA host: cuBLAS against the skinny GEMM.

    python benchmarks/bench_skinny.py [--model llama-3-8b] [--tokens 1,4,8,16,32,64] [--table-out FILE]
    python benchmarks/bench_skinny.py --greedy   # also: torch's argmax+logsumexp against the fused kernel
    python benchmarks/bench_skinny.py --fp8 [--table-out FILE]   # FP8 layers: the W8A16 build against _scaled_mm

Per layer shape of the model (q/k/v fused, o, gate/up fused, down, lm_head; tp 1 unless --tp)
and token count: the floor (the weight's bytes at the measured copy bandwidth), cuBLAS
(F.linear), and the fastest of the skinny kernel's configurations (kernels/triton_linear.py),
each as a multiple of the floor. Every kernel runs inside a CUDA graph over enough copies of the
weight (>= 4x the L2 cache in all) that each call reads its weight from memory, as a model's
layers do. Every configuration's output is checked against F.linear first.

--fp8: the same layer shapes as FP8 layers (float8_e4m3fn weights, one float32 scale per output
row; needs compute capability 8.9+; lm_head is never FP8): the FP8 path without a table entry,
torch._scaled_mm (kernels/triton_fp8.py, cuBLASLt; for o after its per-token quantization, for
q/k/v, gate/up and down on the input the preceding norm or act-and-mul quantized), against the skinny
kernel's FP8 build (weight-only, bf16 activations), each as a multiple of the FP8 bytes floor
(one byte per weight plus the scales). Every configuration's output is checked against F.linear
over the dequantized weight first.

--table-out FILE writes this GPU's kernel table (kernels/configs/<gpu>.json as loaded, the other
op's entries kept) plus a "skinny" entry (--fp8: "skinny_fp8") per (N, K) and token count: the
fastest configuration where it beats cuBLAS (--fp8: quantization + _scaled_mm) by at least
--min-gain, else null. Copy FILE over the table to use it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from dataclasses import asdict

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run as `python -P`
from bench_kernels import DEV, DTYPE, capture, env_info, measure_ceilings

from loraserve.executor.model.fp8 import quantize_rows
from loraserve.kernels import model_shapes, ops_reference, triton_fp8, tuning
from loraserve.kernels.triton_linear import skinny_linear
from loraserve.kernels.triton_ops import greedy as fused_greedy

L2_MULTIPLE = 4  # the copies of a weight one replay walks: at least this many L2 caches of bytes


def layer_shapes(model: str, tp: int) -> list[tuple[str, int, int]]:
    """(kind, N, K) of the model's base linear layers on one tensor-parallel rank."""
    family = next(f for f in model_shapes.FAMILIES if f.name == model)
    out = []
    for s in model_shapes.layer_shapes(family, tp):
        if s.kind != "embedding":
            out.append((s.kind, s.out_features, s.in_features))
    return out


def candidates(grid: str) -> list[tuning.SkinnyConfig]:
    if grid == "small":
        ns, ks, warps, stages = (16, 32), (256, 512), (4,), (3, 4)
    else:
        ns, ks, warps, stages = (16, 32, 64), (128, 256, 512), (4, 8), (3, 4)
    return [tuning.SkinnyConfig(n, k, w, s) for n, k, w, s in itertools.product(ns, ks, warps, stages)]


def timed(fn_per_copy, copies: int) -> float:
    """Microseconds per call of fn_per_copy(i), replayed in one graph over every copy i."""
    graph = capture(lambda: [fn_per_copy(i) for i in range(copies)])
    ms = do_bench(graph.replay, warmup=5, rep=40, return_mode="median")
    del graph
    return ms * 1e3 / copies


def _weight(n: int, k: int, fp8: bool):
    """A layer's weight: bf16 [n, k], or (fp8) float8_e4m3fn [n, k] with its row scales [n] float32."""
    w = torch.randn(n, k, device=DEV, dtype=DTYPE) / k**0.5
    return quantize_rows(w) if fp8 else (w, None)


# FP8 layers whose input the kernel writing it also quantizes (kernels.rms_norm's and the act-and-muls'
# `quantize`): their vendor path is torch._scaled_mm alone; o's (and --extra shapes') quantizes first.
PREQUANTIZED = ("qkv", "gate_up", "down")


def bench_shape(kind, n, k, tokens_list, configs, ceil, l2_bytes, fp8: bool = False) -> list[dict]:
    """fp8: the layer in FP8, its vendor path torch._scaled_mm (after per-token quantization where the
    layer quantizes its own input: PREQUANTIZED), against the kernel's FP8 build."""
    weight_bytes = n * k + n * 4 if fp8 else n * k * 2
    copies = max(1, -(-L2_MULTIPLE * l2_bytes // weight_bytes))
    weights = [_weight(n, k, fp8) for _ in range(copies)]
    floor_us = weight_bytes / ceil["copy_bytes_per_s"] * 1e6
    w0, s0 = weights[0]
    dense = w0 if s0 is None else (w0.float() * s0[:, None]).to(DTYPE)  # the dequantized weight
    rows = []
    for t in tokens_list:
        x = torch.randn(t, k, device=DEV, dtype=DTYPE)
        want = F.linear(x, dense).float()
        if fp8 and kind in PREQUANTIZED:  # its input comes quantized from the norm / act-and-mul that wrote it
            q, s = triton_fp8.quantize_per_token(x)
            cublas = timed(lambda i: triton_fp8.scaled_mm(q, s, *weights[i], DTYPE), copies)
        elif fp8:  # o (its input comes from attention) quantizes its input itself
            cublas = timed(lambda i: triton_fp8.scaled_mm(*triton_fp8.quantize_per_token(x), *weights[i], DTYPE), copies)
        else:
            cublas = timed(lambda i: F.linear(x, weights[i][0]), copies)
        best, best_cfg, failed = None, None, 0
        for cfg in configs:
            try:
                got = skinny_linear(x, w0, None, cfg, s0).float()
            except Exception as e:  # a config the compiler rejects (e.g. out of shared memory)
                print(f"  {kind} T={t} {cfg}: {type(e).__name__}", file=sys.stderr)
                failed += 1
                continue
            if not torch.allclose(got, want, atol=2e-2, rtol=2e-2):
                raise AssertionError(f"{kind} {n}x{k} T={t} {cfg}: max error {(got - want).abs().max().item():.3g}")
            us = timed(lambda i: skinny_linear(x, weights[i][0], None, cfg, weights[i][1]), copies)
            if best is None or us < best:
                best, best_cfg = us, cfg
        rows.append(
            dict(
                kind=kind,
                n=n,
                k=k,
                tokens=t,
                floor_us=floor_us,
                cublas_us=cublas,
                skinny_us=best,
                config=asdict(best_cfg) if best_cfg else None,
                failed=failed,
            )
        )
        print(
            f"{kind} {n}x{k} T={t}: floor {floor_us:.1f} {'_scaled_mm' if fp8 else 'cuBLAS'} {cublas:.1f} skinny "
            f"{'-' if best is None else f'{best:.1f}'} us {best_cfg}",
            file=sys.stderr,
            flush=True,
        )
    weights = w0 = s0 = dense = None  # frees the copies (closures hold the names)
    torch.cuda.empty_cache()
    return rows


def bench_greedy(vocabs, batches) -> list[str]:
    lines = ["", "| rows x vocab | torch argmax + logsumexp | fused kernel | equal |", "|---|---|---|---|"]
    for v, b in itertools.product(vocabs, batches):
        logits = torch.randn(b, v, device=DEV, dtype=torch.float32) * 4
        ref_ids, ref_lp = ops_reference.greedy(logits)
        ids, lp = fused_greedy(logits)
        equal = bool(torch.equal(ids, ref_ids)) and torch.allclose(lp, ref_lp, atol=1e-5, rtol=1e-5)
        torch_us = timed(lambda i: ops_reference.greedy(logits), 20)
        fused_us = timed(lambda i: fused_greedy(logits), 20)
        lines.append(f"| {b} x {v} | {torch_us:.1f} us | {fused_us:.1f} us | {equal} |")
    return lines


def table_with_skinny(rows, min_gain: float, op: str = "skinny") -> dict:
    """The table as loaded plus op's entries from rows (op: "skinny", or "skinny_fp8" for --fp8)."""
    key = tuning.gpu_key(torch.device(DEV))
    table = json.loads(json.dumps(tuning._table(key)))  # a copy of the table as loaded
    skinny = table.setdefault(op, {})
    for r in rows:
        wins = r["skinny_us"] is not None and r["skinny_us"] * (1 + min_gain) <= r["cublas_us"]
        skinny.setdefault(tuning.skinny_key(r["n"], r["k"]), {})[str(r["tokens"])] = r["config"] if wins else None
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3-8b", choices=[f.name for f in model_shapes.FAMILIES])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--tokens", default="1,4,8,16,32,64")
    p.add_argument("--kinds", help="layer kinds (default: qkv,o,gate_up,down,lm_head; --fp8: no lm_head, never FP8)")
    p.add_argument("--extra", default="", help="more N x K shapes, e.g. 49152x4096,6144x4096")
    p.add_argument("--grid", default="full", choices=("full", "small"))
    p.add_argument("--table-out", default=None)
    p.add_argument("--min-gain", type=float, default=0.02)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--fp8", action="store_true", help="FP8 layers: the W8A16 build against quantization + _scaled_mm")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_skinny.py times CUDA kernels: run it on a CUDA host")
    if args.fp8 and torch.cuda.get_device_capability() < (8, 9):
        sys.exit("bench_skinny.py --fp8 needs compute capability 8.9+ (torch._scaled_mm's FP8 GEMM)")
    torch.manual_seed(0)
    ceil = measure_ceilings()
    info = env_info(ceil)
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    kinds = (args.kinds or ("qkv,o,gate_up,down" if args.fp8 else "qkv,o,gate_up,down,lm_head")).split(",")
    shapes = [s for s in layer_shapes(args.model, args.tp) if s[0] in kinds]
    shapes += [("extra", *(int(v) for v in e.split("x"))) for e in args.extra.split(",") if e]
    tokens = [int(t) for t in args.tokens.split(",")]
    configs = candidates(args.grid)
    rows = []
    for kind, n, k in shapes:
        rows += bench_shape(kind, n, k, tokens, configs, ceil, l2_bytes, args.fp8)
    vendor = "quant + _scaled_mm" if args.fp8 else "cuBLAS"
    what = "FP8 layers (W8A16 skinny build; floor: FP8 weight + scales)" if args.fp8 else "bf16 layers"
    print(f"# skinny GEMM, {what}, {info['device']}, {info['date']}; torch {info['torch']}, triton {info['triton']}")
    print(f"# {info['command']}; copy bandwidth {ceil['copy_bytes_per_s'] / 1e9:.0f} GB/s; {len(configs)} configs")
    print(f"| layer | N x K | tokens | floor | {vendor} | skinny (best) | skinny / {vendor} | config (n, k, warps, stages) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        c, us = r["config"], r["skinny_us"]
        cfg = f"{c['block_n']}, {c['block_k']}, {c['num_warps']}, {c['num_stages']}" if c else "-"
        skinny = "none built" if us is None else f"{us:.1f} us = {us / r['floor_us']:.2f}x"
        ratio = "-" if us is None else f"{us / r['cublas_us']:.3f}"
        print(
            f"| {r['kind']} | {r['n']} x {r['k']} | {r['tokens']} | {r['floor_us']:.1f} us | "
            f"{r['cublas_us']:.1f} us = {r['cublas_us'] / r['floor_us']:.2f}x | {skinny} | {ratio} | {cfg} |"
        )
    if args.greedy:
        print("\n".join(bench_greedy((49152, 128256), (1, 8, 64))))
    if args.table_out:
        with open(args.table_out, "w") as f:
            json.dump(table_with_skinny(rows, args.min_gain, "skinny_fp8" if args.fp8 else "skinny"), f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"# table with the {'skinny_fp8' if args.fp8 else 'skinny'} entries: {args.table_out}")


if __name__ == "__main__":
    main()
