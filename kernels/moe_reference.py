"""Mixture-of-experts with expert LoRA in plain PyTorch: the test oracle and the CPU path.

Signatures are shared with kernels/triton_moe.py. T tokens, K experts per token, E experts,
H hidden, I expert intermediate size, L = max_loras slots, R = slot rank.

Each (token, expert) pair runs the expert's SiLU-gated MLP, plus the LoRA of the token's own
slot on that expert's w13 (gate|up, two slices) and w2 (down):

    h   = x[t] @ w13[e].T + sum_s (x[t] @ A13[slot, e, s].T) @ B13[slot, e, slice s].T   [2I]
    act = silu(h[:I]) * h[I:]                                                           [I]
    y   = act @ w2[e].T + (act @ A2[slot, e, 0].T) @ B2[slot, e].T                        [H]
    out[t] = sum_k topk_weights[t, k] * y(t, topk_ids[t, k])

FP8 experts: w13 and w2 float8_e4m3fn with one float32 scale per (expert, output row),
w13_scale [E, 2I] and w2_scale [E, H]; the real weight is w * scale[..., None]. Each expert's
weights are dequantized to x's dtype, then the math above (kernels/triton_moe.py upcasts in the
GEMM's tiles and scales its accumulator instead: the same up to rounding).

Expert parallelism: a rank passes its own experts' weights (E = its block) and ids made local to
them; an id outside [0, E) is another rank's expert, and its pair adds nothing here.

The LoRA scaling is folded into B by the adapter store; slot buffers are zero past each
adapter's rank and for experts an adapter does not target, so computing over R is exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import reference
from .meta import LoraMeta, make_lora_meta

ExpertLora = tuple[torch.Tensor, torch.Tensor]  # (lora_a [L, E, S, R, in], lora_b [L, E, N, R])


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, K] float32, topk_ids [T, K] int64).

    Softmax in float32 over all experts, the top k kept; renormalize rescales them to sum to 1
    (Mixtral, Qwen3-MoE's norm_topk_prob) instead of leaving the softmax mass (Qwen2-MoE).
    Plain tensor ops with fixed shapes: the same on every device and inside CUDA graphs.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe(
    x: torch.Tensor,  # [T, H]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] integer; outside [0, E): another expert-parallel rank's, skipped
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    lora13: ExpertLora | None,  # a [L, E, 2, R, H], b [L, E, 2I, R]
    lora2: ExpertLora | None,  # a [L, E, 1, R, I], b [L, E, H, R]
    meta: LoraMeta | None,  # token slots; None = no LoRA in this step
    w13_scale: torch.Tensor | None = None,  # [E, 2I] float32: w13 is FP8
    w2_scale: torch.Tensor | None = None,  # [E, H] float32: w2 is FP8
) -> torch.Tensor:
    """-> [T, H] in x's dtype: the experts' weighted sum for every token (see the module docstring)."""
    T, K = topk_ids.shape
    inter = w2.shape[2]
    out = torch.zeros(T, w2.shape[1], dtype=torch.float32, device=x.device)
    E = w13.shape[0]
    flat = topk_ids.reshape(-1).long()  # [T*K] expert of each (token, k) pair
    flat = torch.where((flat >= 0) & (flat < E), flat, E)  # other ranks' experts: one group E, after ours
    order = torch.argsort(flat, stable=True)  # pairs sorted by expert
    counts = torch.bincount(flat, minlength=E + 1)[:E].tolist()  # host sync: the CPU path
    pair_weights = topk_weights.reshape(-1).float()
    slots = meta.token_slots.long() if meta is not None else None
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        tokens = pairs // K  # [n]
        xe = x.index_select(0, tokens)  # [n, H]
        h = F.linear(xe, _expert_weight(w13, w13_scale, e, x.dtype))  # [n, 2I]
        if lora13 is not None and slots is not None:
            h = _expert_lora(h, xe, lora13, e, slots.index_select(0, tokens), (0, inter, 2 * inter))
        act = F.silu(h[:, :inter]) * h[:, inter:]  # [n, I]
        y = F.linear(act, _expert_weight(w2, w2_scale, e, x.dtype))  # [n, H]
        if lora2 is not None and slots is not None:
            y = _expert_lora(y, act, lora2, e, slots.index_select(0, tokens), (0, y.shape[1]))
        out.index_add_(0, tokens, y.float() * pair_weights.index_select(0, pairs)[:, None])
    return out.to(x.dtype)


def _expert_weight(w: torch.Tensor, scale: torch.Tensor | None, e: int, dtype) -> torch.Tensor:
    """Expert e's weight [N, in]: as held, or FP8 dequantized (float32 product, then dtype)."""
    if scale is None:
        return w[e]
    return (w[e].float() * scale[e].float()[:, None]).to(dtype)


def _expert_lora(y, x, lora: ExpertLora, e: int, token_slots, offsets) -> torch.Tensor:
    """y += expert e's LoRA of each row's slot: the dense shrink/expand over this expert's rows."""
    lora_a, lora_b = lora
    meta = make_lora_meta(token_slots, lora_a.shape[0])
    buf = reference.lora_shrink(x, lora_a[:, e], meta)  # [S, n, R] float32
    return reference.lora_expand(y, buf, lora_b[:, e], offsets, meta)
