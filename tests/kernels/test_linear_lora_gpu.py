"""The skinny GEMM with the LoRA expand in its epilogue (kernels/triton_linear.py
`skinny_linear_expand`, the decode path of `kernels.linear_with_lora`) against the base layer plus
each token's adapter computed in float32, and the rule that picks it.

Runs on a CUDA GPU (skips elsewhere); with TRITON_INTERPRET=1 and no GPU, through Triton's
interpreter on CPU tensors (float16 there: its tl.dot takes bfloat16 as raw integers).
Run: pytest -m gpu tests/kernels/test_linear_lora_gpu.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from .gpu_skip import DEV, INTERPRET, skip_unless_cuda_and_triton

skip_unless_cuda_and_triton(interpreter=INTERPRET)

import loraserve.kernels as kernels  # noqa: E402
from loraserve.kernels import make_lora_meta, triton_linear, triton_lora, tuning  # noqa: E402

pytestmark = pytest.mark.gpu
DTYPES = [torch.float16] if INTERPRET else [torch.bfloat16, torch.float16]
SLOTS = 6


def _case(tokens, widths, k, rank, ranks, dtype, seed, no_adapter=False, skewed=False):
    """x, W, bias, lora_a, lora_b (zero past each slot's rank, as slot loads leave them), token slots, ranks."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(widths)
    x = torch.randn(tokens, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    bias = torch.randn(n, generator=gen)
    a = torch.randn(SLOTS, len(widths), rank, k, generator=gen) / k**0.5
    b = torch.randn(SLOTS, n, rank, generator=gen) / rank**0.5
    slot_ranks = ranks or (rank,) * SLOTS
    for slot, r in enumerate(slot_ranks):
        a[slot, :, r:] = 0
        b[slot, :, r:] = 0
    slots = torch.randint(-1, SLOTS, (tokens,), generator=gen)
    if no_adapter:
        slots[:] = -1
    if skewed:  # most tokens on slot 2: its group spans several blocks of any work list
        slots[torch.randperm(tokens, generator=gen)[: tokens * 3 // 4]] = 2
    cast = [t.to(DEV, dtype) for t in (x, w, bias, a, b)]
    return (*cast, slots.to(DEV), None if ranks is None else torch.tensor(ranks, dtype=torch.int32, device=DEV))


def _want(x, w, bias, a, b, slots, widths):
    """Base layer plus each token's adapter, in float32 from the same (rounded) inputs."""
    y = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    offsets = [0]
    for width in widths:
        offsets.append(offsets[-1] + width)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        for s in range(len(widths)):
            lo, hi = offsets[s], offsets[s + 1]
            shrunk = x[t].float() @ a[slot, s].float().T  # [R]
            y[t, lo:hi] += shrunk.to(x.dtype).float() @ b[slot, lo:hi].float().T
    return y


def _fused(x, w, bias, a, b, slots, ranks, widths, cfg):
    meta = make_lora_meta(slots, SLOTS, slot_ranks=ranks)
    buf = triton_lora.lora_shrink(x, a, meta)
    offsets = (0, *torch.tensor(widths).cumsum(0).tolist())
    return triton_linear.skinny_linear_expand(x, w, bias, cfg, buf, b, tuple(offsets), meta)


@pytest.mark.parametrize("tokens", [1, 3, 16, 17, 40, 64])
@pytest.mark.parametrize("widths, k", [
    ((64, 32, 32), 96),   # q/k/v-like slices, K off the tile
    ((96,), 256),         # one slice
    ((64, 64), 200),      # gate/up-like, K off the tile
    ((32, 32, 32, 32), 128),  # the most slices it takes
])
@pytest.mark.parametrize("rank, ranks", [(16, None), (64, (8, 16, 64, 33, 8, 64))])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_expand_equals_base_plus_each_tokens_adapter(
    tokens, widths, k, rank, ranks, dtype, interpreter_device, no_reference_fallback
):
    case = _case(tokens, widths, k, rank, ranks, dtype, seed=tokens * 100 + k + rank)
    x, w, bias, a, b, slots, slot_ranks = case
    cfg = tuning.SkinnyConfig(block_n=32, block_k=128, num_warps=4, num_stages=2)
    got = _fused(x, w, bias, a, b, slots, slot_ranks, widths, cfg)
    assert got.shape == (tokens, sum(widths)) and got.dtype == dtype
    torch.testing.assert_close(got.float(), _want(x, w, bias, a, b, slots, widths), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("tokens", [47, 64])
@pytest.mark.parametrize("block_m", [16, 32])
def test_fused_expand_adds_a_slot_once_when_its_tokens_fill_several_blocks(
    tokens, block_m, interpreter_device, no_reference_fallback
):
    dtype = DTYPES[0]
    x, w, bias, a, b, slots, ranks = _case(tokens, (64, 32, 32), 128, 16, (16, 8, 16, 16, 8, 16), dtype,
                                           seed=tokens + block_m, skewed=True)
    meta = make_lora_meta(slots, SLOTS, slot_ranks=ranks)
    blocks = meta.block_list(block_m)  # the list the fused kernel walks (the first one built)
    assert meta.any_block_list() is blocks
    assert (blocks.blocks[0, : int(blocks.num_blocks[0])] == 2).sum() >= 2  # slot 2 fills several blocks
    buf = triton_lora.lora_shrink(x, a, meta)
    got = triton_linear.skinny_linear_expand(x, w, bias, tuning.SkinnyConfig(32, 128, 4, 2), buf, b, (0, 64, 96, 128),
                                             meta)
    torch.testing.assert_close(got.float(), _want(x, w, bias, a, b, slots, (64, 32, 32)), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_fused_expand_without_adapters_is_the_base_layer(tokens, interpreter_device, no_reference_fallback):
    dtype = DTYPES[0]
    x, w, bias, a, b, slots, _ = _case(tokens, (64,), 128, 16, None, dtype, seed=tokens, no_adapter=True)
    got = _fused(x, w, None, a, b, slots, None, (64,), tuning.SkinnyConfig(32, 128, 4, 2))
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float()), atol=2e-2, rtol=2e-2)


def test_fused_expand_reads_slots_to_their_rank(interpreter_device, no_reference_fallback):
    """Rank columns past a slot's adapter rank are not read: garbage there changes nothing."""
    dtype = DTYPES[0]
    x, w, bias, a, b, slots, _ = _case(16, (64,), 128, 64, (8, 16, 64, 24, 8, 64), dtype, seed=7)
    ranks = torch.tensor((8, 16, 64, 24, 8, 64), dtype=torch.int32, device=DEV)
    want = _want(x, w, bias, a, b, slots, (64,))
    for slot, r in enumerate(ranks.tolist()):
        b[slot, :, r:] = 1e4  # what a stale, higher-rank adapter might have left
        a[slot, :, r:] = 1e4
    got = _fused(x, w, bias, a, b, slots, ranks, (64,), tuning.SkinnyConfig(32, 128, 4, 2))
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


def test_fuses_expand_picks_the_tables_config_or_the_default_and_refuses_what_it_cannot_take(monkeypatch):
    key = "test-fused"
    monkeypatch.setattr(tuning, "_device_key", lambda device: key)
    cfg = dict(block_n=64, block_k=128, num_warps=4, num_stages=2)
    tuning.set_table(key, {"skinny": {"192x128": {"1": cfg, "8": None}}})
    try:
        dtype = DTYPES[0]
        w = torch.zeros(192, 128, device=DEV, dtype=dtype)
        b = torch.zeros(4, 192, 16, device=DEV, dtype=dtype)

        def pick(tokens, offsets=(0, 128, 192), weight=w, lora_b=b, x_dtype=dtype, rank=16):
            x = torch.zeros(tokens, 128, device=DEV, dtype=x_dtype)
            return triton_linear.fuses_expand(x, weight, None, rank, lora_b, offsets)

        assert pick(1) == tuning.SkinnyConfig(**cfg)  # the table's entry
        assert pick(8) == triton_linear.FUSED_DEFAULT  # cuBLAS won the base GEMM alone: the default
        monkeypatch.setattr(triton_linear, "FUSED_MAX_TOKENS", 64)
        assert pick(64) == triton_linear.FUSED_DEFAULT  # no entry at this count
        monkeypatch.setattr(triton_linear, "FUSED_MAX_TOKENS", 16)
        assert pick(16) == triton_linear.FUSED_DEFAULT and pick(17) is None  # past the fused path's bound
        assert pick(1, offsets=(0, 96, 192)) is None  # a 64-column program would straddle two slices
        assert pick(8, offsets=(0, 48, 96, 144, 160, 176, 192)) is None  # more than 4 slices
        assert pick(65) is None  # more rows than one tile
        assert pick(8, x_dtype=torch.float32) is None  # float32: not the kernel's
        assert pick(8, rank=32) is None  # buffer rank not B's
        assert pick(8, offsets=(0, 128)) is None  # slices not covering the weight's rows
    finally:
        tuning.set_table(key, {})


def test_linear_with_lora_leaves_the_cpu_and_large_batches_to_the_caller():
    x = torch.zeros(4, 128)
    w = torch.zeros(64, 128)
    a = torch.zeros(2, 1, 16, 128)
    b = torch.zeros(2, 64, 16)
    meta = make_lora_meta(torch.zeros(4, dtype=torch.int32), 2)
    assert kernels.linear_with_lora(x, w, None, a, b, (0, 64), meta) is None  # CPU tensors: the reference path
