"""A per-(token, expert) loop of the fused MoE + expert LoRA math in float64: the kernels' oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def random_moe(T, K, E, H, I, L, R, dtype, device, seed=0):
    """Inputs of kernels.fused_moe: mixed slots (-1 included), ranks cut per slot, some slots
    with LoRA on w2 only (their w13 slots zero)."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    x = rnd(T, H)
    logits = torch.randn(T, E, generator=g)
    weights, ids = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    w13, w2 = rnd(E, 2 * I, H, scale=H**-0.5), rnd(E, H, I, scale=I**-0.5)
    a13, b13 = rnd(L, E, 2, R, H, scale=H**-0.5), rnd(L, E, 2 * I, R, scale=0.3)
    a2, b2 = rnd(L, E, 1, R, I, scale=I**-0.5), rnd(L, E, H, R, scale=0.3)
    for slot in range(L):  # slot s has rank R - s (zero past it), slot 1 no w13 LoRA at all
        r = max(R - slot, 1)
        for t in (a13, a2):
            t[slot, :, :, r:] = 0
        for t in (b13, b2):
            t[slot, :, :, r:] = 0
    if L > 1:
        a13[1], b13[1] = 0, 0
    slots = torch.randint(-1, L, (T,), generator=g).to(device)
    return x, weights.to(device), ids.to(device), w13, w2, (a13, b13), (a2, b2), slots


def oracle(x, weights, ids, w13, w2, lora13, lora2, slots):
    """float64 [T, H]."""
    T, K = ids.shape
    inter = w2.shape[2]
    d = torch.float64
    out = torch.zeros(T, w2.shape[1], dtype=d, device=x.device)
    for t in range(T):
        s = int(slots[t])
        for k in range(K):
            e = int(ids[t, k])
            xt = x[t].to(d)
            h = w13[e].to(d) @ xt
            if s >= 0 and lora13 is not None:
                a, b = lora13[0][s, e].to(d), lora13[1][s, e].to(d)
                h[:inter] += b[:inter] @ (a[0] @ xt)
                h[inter:] += b[inter:] @ (a[1] @ xt)
            act = F.silu(h[:inter]) * h[inter:]
            y = w2[e].to(d) @ act
            if s >= 0 and lora2 is not None:
                y += lora2[1][s, e].to(d) @ (lora2[0][s, e, 0].to(d) @ act)
            out[t] += float(weights[t, k]) * y
    return out


def ep_rank_inputs(ids, w13, w2, lora13, lora2, first: int, n: int):
    """What the expert-parallel rank holding experts [first, first + n) passes kernels.fused_moe:
    ids made local (others' fall outside [0, n)), its experts' weights and LoRA slots."""
    block = slice(first, first + n)

    def cut(lora):
        return None if lora is None else (lora[0][:, block], lora[1][:, block])

    return ids - first, w13[block], w2[block], cut(lora13), cut(lora2)


def fp8_experts(w13, w2):
    """FP8 experts of float ones, one scale per (expert, output row): (q13, s13, q2, s2) for
    kernels.fused_moe, and the dequantized w13, w2 (float32) the oracle takes."""
    from loraserve.executor.model.fp8 import quantize_rows

    q13, s13 = quantize_rows(w13.float())
    q2, s2 = quantize_rows(w2.float())
    return (q13, s13, q2, s2), (q13.float() * s13[..., None], q2.float() * s2[..., None])
