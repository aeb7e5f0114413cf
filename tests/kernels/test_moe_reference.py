"""The plain-PyTorch fused MoE + expert LoRA (the CPU path) against a per-pair float64 loop."""

from __future__ import annotations

import pytest
import torch

from loraserve.kernels import fused_moe, make_lora_meta, moe_route

from .moe_oracle import oracle, random_moe


@pytest.mark.parametrize("T", [1, 5, 40])  # decode-sized (gathered LoRA) and prefill-sized (grouped) steps
def test_fused_moe_reference_matches_the_per_pair_oracle(T):
    x, w, ids, w13, w2, l13, l2, slots = random_moe(T, 2, 4, 32, 24, 3, 8, torch.float32, "cpu", seed=T)
    got = fused_moe(x, w, ids, w13, w2, l13, l2, make_lora_meta(slots, 3))
    torch.testing.assert_close(got.double(), oracle(x, w, ids, w13, w2, l13, l2, slots), atol=1e-4, rtol=1e-4)


def test_fused_moe_without_lora_is_the_base_experts():
    x, w, ids, w13, w2, l13, l2, slots = random_moe(7, 2, 4, 32, 24, 2, 4, torch.float32, "cpu")
    got = fused_moe(x, w, ids, w13, w2, None, None, None)
    torch.testing.assert_close(got.double(), oracle(x, w, ids, w13, w2, None, None, slots), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_route_is_softmax_top_k(renormalize):
    logits = torch.randn(6, 8)
    weights, ids = moe_route(logits, 3, renormalize)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == probs.topk(3).indices.tolist()
    want = probs.topk(3).values
    torch.testing.assert_close(weights, want / want.sum(-1, keepdim=True) if renormalize else want)
