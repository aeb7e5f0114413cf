"""The one-program token grouping (kernels/triton_meta.py) against make_lora_meta's torch ops: the
same sorted ids, counts, starts and block list, exactly, and make_lora_meta(block_m=...) on CUDA
takes it (and falls back to the torch ops for steps too large for one program).

Runs on a CUDA GPU (skips elsewhere); with TRITON_INTERPRET=1 and no GPU, through Triton's
interpreter on CPU tensors. Run: pytest -m gpu tests/kernels/test_meta_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from .gpu_skip import DEV, INTERPRET, skip_unless_cuda_and_triton

skip_unless_cuda_and_triton(interpreter=INTERPRET)

from loraserve.kernels import make_lora_meta, triton_meta  # noqa: E402

pytestmark = pytest.mark.gpu


def _torch_grouping(slots, max_loras, ranks, block_m):
    """make_lora_meta's torch ops: without block_m it builds no block list in the one program."""
    meta = make_lora_meta(slots, max_loras, slot_ranks=ranks)
    return meta, meta.block_list(block_m)


CASES = [  # (tokens, max_loras, share of tokens with no adapter, block_m)
    (1, 4, 0.0, 16),
    (1, 4, 1.0, 16),
    (3, 4, 0.3, 16),
    (8, 8, 0.0, 16),
    (17, 4, 0.2, 16),
    (56, 64, 0.1, 16),
    (64, 64, 0.0, 16),
    (64, 32, 0.5, 16),
    (100, 7, 0.3, 32),
    (256, 64, 0.05, 16),
    (33, 1, 0.4, 16),
]


@pytest.mark.parametrize("num_tokens, max_loras, none, block_m", CASES)
@pytest.mark.parametrize("known_ranks", [True, False], ids=["ranks", "no-ranks"])
def test_one_program_grouping_equals_the_torch_ops(num_tokens, max_loras, none, block_m, known_ranks):
    gen = torch.Generator().manual_seed(num_tokens * 131 + max_loras)
    slots = torch.randint(0, max_loras, (num_tokens,), generator=gen)
    slots[torch.rand(num_tokens, generator=gen) < none] = -1
    ranks = torch.randint(1, 65, (max_loras,), generator=gen).to(torch.int32) if known_ranks else None
    slots, ranks = slots.to(DEV), None if ranks is None else ranks.to(DEV)
    want, want_blocks = _torch_grouping(slots, max_loras, ranks, block_m)
    got = triton_meta.group_tokens(slots, max_loras, ranks, block_m)
    assert got is not None
    sorted_ids, counts, starts, blocks = got
    assert sorted_ids.tolist() == want.sorted_token_ids.tolist()
    assert counts.tolist() == want.tokens_per_slot.tolist()
    assert starts.tolist() == want.slot_start.tolist()
    assert blocks.max_blocks == want_blocks.max_blocks and blocks.block_m == block_m
    assert blocks.blocks.tolist() == want_blocks.blocks.tolist()
    assert blocks.tokens.tolist() == want_blocks.tokens.tolist()
    assert blocks.num_blocks.tolist() == want_blocks.num_blocks.tolist()


def test_steps_too_large_for_one_program_take_the_torch_ops():
    slots = torch.zeros(4096, dtype=torch.int32, device=DEV)
    assert triton_meta.group_tokens(slots, 64, None, 16) is None
    assert triton_meta.group_tokens(slots[:0], 64, None, 16) is None
    assert triton_meta.group_tokens(slots[:8], 64, None, 24) is None  # tile rows not a power of two
    assert triton_meta.group_tokens(slots[:8], 0, None, 16) is None


def test_strided_slots_and_ranks_are_read_as_their_values():
    gen = torch.Generator().manual_seed(5)
    base = torch.randint(-1, 6, (40,), generator=gen).to(torch.int32).to(DEV)
    ranks = torch.randint(1, 65, (12,), generator=gen).to(torch.int32).to(DEV)
    slots, strided_ranks = base[::2], ranks[::2]  # every other element: not contiguous
    want, want_blocks = _torch_grouping(slots.contiguous(), 6, strided_ranks.contiguous(), 16)
    sorted_ids, counts, starts, blocks = triton_meta.group_tokens(slots, 6, strided_ranks, 16)
    assert sorted_ids.tolist() == want.sorted_token_ids.tolist() and counts.tolist() == want.tokens_per_slot.tolist()
    assert starts.tolist() == want.slot_start.tolist()
    assert blocks.blocks.tolist() == want_blocks.blocks.tolist() and blocks.tokens.tolist() == want_blocks.tokens.tolist()


@pytest.mark.skipif(INTERPRET, reason="make_lora_meta takes the fused path for CUDA tensors only")
def test_make_lora_meta_with_block_m_uses_the_program_on_cuda(monkeypatch):
    slots = torch.tensor([3, -1, 0, 3, 1, -1, 0, 3], device=DEV)
    calls = []
    real = triton_meta.group_tokens
    monkeypatch.setattr(triton_meta, "group_tokens", lambda *a: calls.append(a) or real(*a))
    meta = make_lora_meta(slots, 4, block_m=16)
    assert len(calls) == 1 and 16 in meta._block_lists
    want, want_blocks = _torch_grouping(slots, 4, None, 16)
    assert meta.block_list(16).tokens.tolist() == want_blocks.tokens.tolist()
    assert meta.active_slots.tolist() == want.active_slots.tolist() and int(meta.num_active) == 3
