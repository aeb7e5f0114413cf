"""The plain-PyTorch fused MoE + expert LoRA (the CPU path) against a per-pair float64 loop."""

from __future__ import annotations

import pytest
import torch

from loraserve.kernels import fused_moe, make_lora_meta, moe_route

from .moe_oracle import ep_rank_inputs, fp8_experts, oracle, random_moe


@pytest.mark.parametrize("T", [1, 5, 40])  # decode-sized (gathered LoRA) and prefill-sized (grouped) steps
def test_fused_moe_reference_matches_the_per_pair_oracle(T):
    x, w, ids, w13, w2, l13, l2, slots = random_moe(T, 2, 4, 32, 24, 3, 8, torch.float32, "cpu", seed=T)
    got = fused_moe(x, w, ids, w13, w2, l13, l2, make_lora_meta(slots, 3))
    torch.testing.assert_close(got.double(), oracle(x, w, ids, w13, w2, l13, l2, slots), atol=1e-4, rtol=1e-4)


def test_fused_moe_without_lora_is_the_base_experts():
    x, w, ids, w13, w2, l13, l2, slots = random_moe(7, 2, 4, 32, 24, 2, 4, torch.float32, "cpu")
    got = fused_moe(x, w, ids, w13, w2, None, None, None)
    torch.testing.assert_close(got.double(), oracle(x, w, ids, w13, w2, None, None, slots), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("ep", [2, 4])
def test_an_expert_parallel_rank_computes_only_the_pairs_of_its_experts(ep):
    """Each rank's output is the oracle's over the pairs routed to its block of experts (ids of
    other ranks' experts are skipped), and the ranks' outputs sum to the whole MoE."""
    E, L = 4, 3
    x, w, ids, w13, w2, l13, l2, slots = random_moe(9, 2, E, 32, 24, L, 8, torch.float32, "cpu", seed=1)
    meta, n, total = make_lora_meta(slots, L), E // ep, 0
    for rank in range(ep):
        local = ep_rank_inputs(ids, w13, w2, l13, l2, rank * n, n)
        part = fused_moe(x, w, local[0], *local[1:], meta).double()
        mine = (ids >= rank * n) & (ids < (rank + 1) * n)
        torch.testing.assert_close(part, oracle(x, w * mine, ids, w13, w2, l13, l2, slots), atol=1e-4, rtol=1e-4)
        total = total + part
    torch.testing.assert_close(total, oracle(x, w, ids, w13, w2, l13, l2, slots), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_route_is_softmax_top_k(renormalize):
    logits = torch.randn(6, 8)
    weights, ids = moe_route(logits, 3, renormalize)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == probs.topk(3).indices.tolist()
    want = probs.topk(3).values
    torch.testing.assert_close(weights, want / want.sum(-1, keepdim=True) if renormalize else want)


@pytest.mark.parametrize("T", [1, 9])
def test_fp8_experts_are_dequantized_per_expert_row(T):
    """FP8 w13 / w2 with one scale per (expert, output row): the oracle on q * scale, with LoRA."""
    x, w, ids, w13, w2, l13, l2, slots = random_moe(T, 2, 4, 32, 24, 3, 8, torch.float32, "cpu", seed=T)
    (q13, s13, q2, s2), (d13, d2) = fp8_experts(w13, w2)
    assert q13.dtype == torch.float8_e4m3fn and s13.shape == (4, 48) and s2.shape == (4, 32)
    got = fused_moe(x, w, ids, q13, q2, l13, l2, make_lora_meta(slots, 3), s13, s2)
    torch.testing.assert_close(got.double(), oracle(x, w, ids, d13, d2, l13, l2, slots), atol=1e-4, rtol=1e-4)
    assert (got - fused_moe(x, w, ids, w13, w2, l13, l2, make_lora_meta(slots, 3))).abs().max() > 1e-4  # FP8 is not float
