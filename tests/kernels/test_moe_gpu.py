"""The Triton fused MoE + expert LoRA (kernels/triton_moe.py) against the float64 per-pair oracle.

On a CUDA GPU (pytest -m gpu); skipped elsewhere. Under Triton's interpreter
(TRITON_INTERPRET=1, with triton installed) the same checks run on CPU tensors: the grouped
GEMM and the pair alignment run as Triton programs; the LoRA shrink/expand (kernels/triton_lora.py,
tested in test_triton_gpu.py) fall back to the reference for float32 and CPU tensors.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"

from .gpu_skip import skip_unless_cuda_and_triton  # noqa: E402

skip_unless_cuda_and_triton(interpreter=INTERPRET)

from loraserve.kernels import make_lora_meta, moe_reference, triton_moe  # noqa: E402

from .moe_oracle import ep_rank_inputs, fp8_experts, oracle, random_moe  # noqa: E402

pytestmark = pytest.mark.gpu

# Relative error ||got - oracle|| / ||oracle||: bf16 inputs and bf16 h / y between the GEMMs.
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}
# The interpreter computes bf16 dots wrongly on CPU (any kernel), and the fp16 LoRA kernels need a
# GPU: there, float32 runs with LoRA and float16 the base experts only.
DTYPES = [torch.float32, torch.float16] if INTERPRET else [torch.bfloat16, torch.float16]


def rel_err(got, want) -> float:
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,K,E,H,I,L,R", [
    (1, 2, 8, 64, 48, 4, 16),  # one decode token
    (7, 2, 4, 64, 40, 3, 8),  # ragged sizes: I and H not multiples of the tiles
    (33, 4, 8, 128, 96, 4, 16),  # a prefill chunk, top-4
    (70, 2, 2, 64, 40, 2, 8),  # many pairs per expert: the large-tile path
])  # fmt: skip
def test_triton_fused_moe_matches_the_oracle(dtype, T, K, E, H, I, L, R):
    x, w, ids, w13, w2, l13, l2, slots = random_moe(T, K, E, H, I, L, R, dtype, DEV, seed=T)
    if not (INTERPRET and dtype == torch.float16):
        got = triton_moe.fused_moe(x, w, ids, w13, w2, l13, l2, make_lora_meta(slots, L))
        want = oracle(x, w, ids, w13, w2, l13, l2, slots)
        assert got.dtype == dtype and not got.isnan().any()
        assert rel_err(got, want) < TOL[dtype]
    base = triton_moe.fused_moe(x, w, ids, w13, w2, None, None, None)  # no LoRA in the step
    assert rel_err(base, oracle(x, w, ids, w13, w2, None, None, slots)) < TOL[dtype]


@pytest.mark.parametrize("T,K,E,block_m", [(1, 2, 8, 16), (50, 2, 4, 16), (9, 4, 16, 64)])
def test_align_pairs_groups_every_pair_once_by_expert(T, K, E, block_m):
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).to(DEV)
    sorted_pairs, block_experts = triton_moe.align_pairs(ids, E, block_m)
    pairs = sorted_pairs.view(-1, block_m).cpu()
    flat = ids.reshape(-1).cpu()
    real = pairs[pairs < T * K]
    assert sorted(real.tolist()) == list(range(T * K))  # each pair exactly once
    for block, expert in zip(pairs, block_experts.cpu().tolist()):
        members = block[block < T * K]
        if expert < 0:
            assert members.numel() == 0
        else:
            assert (flat[members] == expert).all()


@pytest.mark.parametrize("T", [5, 70])  # small- and large-tile paths
def test_an_expert_parallel_rank_computes_only_the_pairs_of_its_experts(T):
    """Rank 1 of 2 (experts 2, 3 of 4): ids of experts 0, 1 become negative, 4.. are out of range
    too; those pairs are in no group, have no LoRA index, and add nothing."""
    E, L, dtype = 4, 3, torch.float32
    x, w, ids, w13, w2, l13, l2, slots = random_moe(T, 2, E, 64, 40, L, 8, dtype, DEV, seed=T)
    local = ep_rank_inputs(ids, w13, w2, l13, l2, 2, 2)
    sorted_pairs, block_experts = triton_moe.align_pairs(local[0], 2, 16)
    real = sorted_pairs[sorted_pairs < ids.numel()].cpu()
    mine = (ids >= 2).reshape(-1).cpu()
    assert sorted(real.tolist()) == torch.nonzero(mine).flatten().tolist()  # this rank's pairs, each once
    got = triton_moe.fused_moe(x, w, local[0], *local[1:], make_lora_meta(slots, L))
    assert not got.isnan().any()
    assert rel_err(got, oracle(x, w * (ids >= 2), ids, w13, w2, l13, l2, slots)) < TOL[dtype]


def test_triton_and_reference_agree_on_a_bf16_mixed_batch():
    """The two implementations of kernels.fused_moe, on the dtype the GPU path serves."""
    if INTERPRET:
        pytest.skip("bf16 LoRA kernels need CUDA")
    x, w, ids, w13, w2, l13, l2, slots = random_moe(20, 2, 8, 128, 64, 4, 16, torch.bfloat16, DEV, seed=3)
    meta = make_lora_meta(slots, 4)
    got = triton_moe.fused_moe(x, w, ids, w13, w2, l13, l2, meta)
    ref = moe_reference.fused_moe(x, w, ids, w13, w2, l13, l2, meta)
    assert rel_err(got, ref.double()) < TOL[torch.bfloat16]


# FP8 experts: the interpreter runs float32 activations (its bf16 dots are wrong), a GPU bf16.
FP8_DTYPE = torch.float32 if INTERPRET else torch.bfloat16


@pytest.mark.parametrize("T,K,E,H,I,L,R", [
    (1, 2, 8, 64, 48, 4, 16),  # one decode token
    (4, 4, 16, 64, 40, 3, 8),  # decode batch, top-4 of 16, ragged I
    (33, 2, 4, 128, 96, 4, 16),  # a prefill chunk
    (70, 2, 2, 64, 40, 2, 8),  # many pairs per expert: the large-tile path
])  # fmt: skip
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "base"])
def test_fp8_experts_match_the_reference_on_the_same_fp8_operands(T, K, E, H, I, L, R, lora):
    """FP8 w13 / w2 with per-(expert, row) scales: the kernel (tiles upcast, accumulator scaled) against
    kernels/moe_reference.py (weights dequantized first) on the same operands, and both against the
    float64 oracle on the dequantized weights; expert LoRA on the unquantized input and activation."""
    x, w, ids, w13, w2, l13, l2, slots = random_moe(T, K, E, H, I, L, R, FP8_DTYPE, DEV, seed=T + E)
    (q13, s13, q2, s2), (d13, d2) = fp8_experts(w13, w2)
    l13, l2, meta = (l13, l2, make_lora_meta(slots, L)) if lora else (None, None, None)
    got = triton_moe.fused_moe(x, w, ids, q13, q2, l13, l2, meta, s13, s2)
    ref = moe_reference.fused_moe(x, w, ids, q13, q2, l13, l2, meta, s13, s2)
    want = oracle(x, w, ids, d13, d2, l13, l2, slots)
    assert got.dtype == FP8_DTYPE and not got.isnan().any()
    assert rel_err(got, ref.double()) < TOL[FP8_DTYPE]
    assert rel_err(got, want) < TOL[FP8_DTYPE]


def test_fp8_experts_of_an_expert_parallel_rank_take_their_own_scales():
    """Rank 1 of 2 holds experts 2, 3 and their rows' scales: only its pairs, each scaled as its expert."""
    E, L = 4, 3
    x, w, ids, w13, w2, l13, l2, slots = random_moe(9, 2, E, 64, 40, L, 8, FP8_DTYPE, DEV, seed=5)
    (q13, s13, q2, s2), (d13, d2) = fp8_experts(w13, w2)
    local_ids, lq13, lq2, ll13, ll2 = ep_rank_inputs(ids, q13, q2, l13, l2, 2, 2)
    got = triton_moe.fused_moe(x, w, local_ids, lq13, lq2, ll13, ll2, make_lora_meta(slots, L), s13[2:], s2[2:])
    assert rel_err(got, oracle(x, w * (ids >= 2), ids, d13, d2, l13, l2, slots)) < TOL[FP8_DTYPE]
