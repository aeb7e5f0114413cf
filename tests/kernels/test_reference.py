"""The plain-PyTorch reference (the oracle and CPU path) against float64 einsum, the per-step
grouping it and the Triton kernels share. CPU only: runs in CI."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from loraserve.kernels import (
    lora_embedding_shrink,
    lora_expand,
    lora_shrink,
    make_lora_meta,
    reference,
)
from loraserve.kernels.meta import FULL_RANK, ShrinkWorkspace


def offsets_of(widths):
    offs = [0]
    for w in widths:
        offs.append(offs[-1] + w)
    return tuple(offs)


def random_layer(gen, num_slots, in_features, widths, rank, ranks=None, dtype=torch.float32):
    lora_a = torch.randn(num_slots, len(widths), rank, in_features, generator=gen)
    lora_b = torch.randn(num_slots, sum(widths), rank, generator=gen)
    for slot, r in enumerate(ranks or []):
        lora_a[slot, :, r:] = 0
        lora_b[slot, :, r:] = 0
    return lora_a.to(dtype), lora_b.to(dtype)


def einsum_shrink(x, lora_a, slots):
    """float64, per token: buf[s, t] = A[slot(t), s] @ x[t], 0 for slot -1."""
    a = lora_a.double()[slots.clamp(min=0).long()]  # [T, S, R, in]
    out = torch.einsum("ti,tsri->str", x.double(), a)
    return out * (slots >= 0).double()[None, :, None]


def einsum_expand(y, buf, lora_b, offsets, slots):
    b = lora_b.double()[slots.clamp(min=0).long()]  # [T, N, R]
    delta = torch.cat(
        [torch.einsum("tr,tnr->tn", buf[s].double(), b[:, offsets[s] : offsets[s + 1]]) for s in range(len(offsets) - 1)],
        dim=1,
    )
    return y.double() + delta * (slots >= 0).double()[:, None]


SHAPES = [
    # tokens, slots, in, widths, rank, no-adapter fraction, per-slot ranks
    (1, 1, 16, (24,), 4, 0.0, None),
    (9, 3, 32, (32, 8, 8), 8, 0.3, None),
    (40, 5, 48, (20, 36), 16, 0.2, [16, 4, 8, 16, 2]),
    (64, 4, 24, (8, 8, 8, 8, 8, 8), 8, 0.5, [8, 1, 3, 8]),
    (17, 2, 16, (16,), 8, 1.0, None),
]


@pytest.mark.parametrize("tokens,slots,in_features,widths,rank,none,ranks", SHAPES)
def test_reference_shrink_and_expand_match_float64_einsum(tokens, slots, in_features, widths, rank, none, ranks):
    gen = torch.Generator().manual_seed(tokens)
    lora_a, lora_b = random_layer(gen, slots, in_features, widths, rank, ranks)
    token_slots = torch.randint(0, slots, (tokens,), generator=gen)
    token_slots[torch.rand(tokens, generator=gen) < none] = -1
    meta = make_lora_meta(token_slots, slots)
    x = torch.randn(tokens, in_features, generator=gen)
    offsets = offsets_of(widths)

    buf = lora_shrink(x, lora_a, meta, out=torch.full((len(widths), tokens, rank), float("nan")))
    want_buf = einsum_shrink(x, lora_a, token_slots)
    torch.testing.assert_close(buf.double(), want_buf, rtol=1e-5, atol=1e-4)

    y0 = torch.randn(tokens, offsets[-1], generator=gen)
    y = lora_expand(y0.clone(), buf, lora_b, offsets, meta)
    torch.testing.assert_close(y.double(), einsum_expand(y0, buf, lora_b, offsets, token_slots), rtol=1e-5, atol=1e-4)
    assert torch.equal(y[token_slots < 0], y0[token_slots < 0])


def test_mixed_ranks_are_exact_at_full_slot_rank():
    """A rank-4 adapter in a rank-16 slot gives what its own rank-4 matrices give."""
    gen = torch.Generator().manual_seed(0)
    lora_a, lora_b = random_layer(gen, 2, 32, (16, 16), 16, ranks=[4, 16])
    slots = torch.tensor([0, 1, 0, -1, 0])
    meta = make_lora_meta(slots, 2)
    x = torch.randn(5, 32, generator=gen)
    buf = lora_shrink(x, lora_a, meta)
    y = lora_expand(torch.zeros(5, 32), buf, lora_b, (0, 16, 32), meta)
    a4, b4 = lora_a[0, :, :4], lora_b[0, :, :4]  # [S, 4, in], [N, 4]
    for t in (0, 2, 4):
        want = torch.cat([b4[s * 16 : (s + 1) * 16] @ (a4[s] @ x[t]) for s in range(2)])
        torch.testing.assert_close(y[t], want, rtol=1e-5, atol=1e-4)


def test_reference_embedding_gathers_rows_of_each_tokens_adapter():
    gen = torch.Generator().manual_seed(1)
    lora_a = torch.randn(3, 50, 8, generator=gen).half()
    ids = torch.randint(0, 50, (13,), generator=gen)
    slots = torch.tensor([0, 1, 2, -1, 2, 2, 1, 0, -1, 0, 1, 1, 2])
    buf = lora_embedding_shrink(ids, lora_a, make_lora_meta(slots, 3))
    assert buf.shape == (1, 13, 8) and buf.dtype == torch.float32
    for t in range(13):
        want = lora_a[slots[t], ids[t]].float() if slots[t] >= 0 else torch.zeros(8)
        assert torch.equal(buf[0, t], want)


def test_make_lora_meta_groups_tokens_by_slot_no_adapter_last():
    gen = torch.Generator().manual_seed(2)
    slots = torch.randint(-1, 6, (200,), generator=gen)
    meta = make_lora_meta(slots, 8)
    ids = meta.sorted_token_ids.long()
    assert sorted(ids.tolist()) == list(range(200))  # a permutation
    keys = torch.where(slots < 0, 8, slots)[ids]
    assert (keys[1:] >= keys[:-1]).all()  # grouped, ascending, no-adapter last
    for slot in range(8):
        n, start = int(meta.tokens_per_slot[slot]), int(meta.slot_start[slot])
        assert n == int((slots == slot).sum())
        group = ids[start : start + n]
        assert (slots[group] == slot).all()
        assert (group[1:] > group[:-1]).all()  # stable: token order kept inside a group
    assert meta.tokens_per_slot.dtype == meta.slot_start.dtype == torch.int32
    assert meta.active_slots.tolist()[: int(meta.num_active)] == sorted(set(slots[slots >= 0].tolist()))
    assert (meta.active_slots[int(meta.num_active) :] == -1).all()


@pytest.mark.parametrize("block_m", [1, 4, 16, 64])
@pytest.mark.parametrize("num_slots,none", [(1, 0.0), (5, 0.3), (64, 0.2), (3, 1.0)])
def test_block_list_covers_each_group_once_in_blocks_of_one_slot(block_m, num_slots, none):
    gen = torch.Generator().manual_seed(block_m + num_slots)
    for tokens in (1, 7, 100, 333):
        slots = torch.randint(0, num_slots, (tokens,), generator=gen)
        slots[torch.rand(tokens, generator=gen) < none] = -1
        ranks = torch.randint(1, 65, (num_slots,), generator=gen) if tokens % 2 else None  # odd T: known ranks
        meta = make_lora_meta(slots, num_slots, slot_ranks=ranks)
        work = meta.block_list(block_m)
        assert meta.block_list(block_m) is work  # built once per step
        blocks, (lora_blocks, all_blocks) = work.blocks, work.num_blocks.tolist()
        assert blocks.shape == (4, work.max_blocks) and all_blocks <= work.max_blocks
        covered = torch.zeros(tokens, dtype=torch.int64)
        for b in range(all_blocks):
            slot, first, end, rank = blocks[:, b].tolist()
            assert first < end  # end: where the block's group ends
            assert (slot < num_slots) == (b < lora_blocks)  # real slots first, no-adapter group after
            # the rank the kernels read the block's slot to: its adapter's, whole if unknown, none without one
            assert rank == (0 if slot == num_slots else FULL_RANK if ranks is None else int(ranks[slot]))
            rows = meta.sorted_token_ids[first : min(end, first + block_m)].long()
            assert work.tokens[b, : len(rows)].tolist() == rows.tolist()
            assert (work.tokens[b, len(rows) :] == -1).all()
            want = slot if slot < num_slots else -1
            assert (slots[rows] == want).all()
            covered[rows] += 1
        assert (covered == 1).all()
        assert (blocks[0, all_blocks:] == -1).all() and (work.tokens[all_blocks:] == -1).all()


def test_block_list_bound_depends_only_on_tokens_and_slots():
    a = make_lora_meta(torch.zeros(50, dtype=torch.int32), 8).block_list(16)
    b = make_lora_meta(torch.arange(50) % 8, 8).block_list(16)
    # 9 groups (8 slots and the no-adapter one) open 9 blocks; the other 41 tokens open 41 // 16 more
    assert a.max_blocks == b.max_blocks == 9 + 2


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_block_list_bound_is_reached_and_never_passed(block_m):
    gen = torch.Generator().manual_seed(block_m)
    for num_slots in (1, 3, 8, 64):
        for tokens in (1, 2, 5, 16, 17, 50, 64, 65, 200):
            bound = make_lora_meta(torch.zeros(tokens, dtype=torch.int32), num_slots).block_list(block_m).max_blocks
            # reached: one token in each of the first G - 1 groups, the rest in the last (no adapter)
            groups = min(tokens, num_slots + 1)
            worst = torch.full((tokens,), -1, dtype=torch.int32)
            worst[: groups - 1] = torch.arange(groups - 1, dtype=torch.int32)
            blocks = make_lora_meta(worst, num_slots).block_list(block_m)
            assert int(blocks.num_blocks[1]) == bound == blocks.max_blocks
            for _ in range(20):  # and never passed, whatever the grouping
                slots = torch.randint(-1, num_slots, (tokens,), generator=gen, dtype=torch.int32)
                blocks = make_lora_meta(slots, num_slots).block_list(block_m)
                assert int(blocks.num_blocks[1]) <= blocks.max_blocks == bound


def emulate_kernels(x, lora_a, lora_b, offsets, meta, block_m):
    """What the Triton kernels compute, walked tile by tile over the block list, in float64: each
    block reads its slot's A and B only up to the block's rank (rank positions past it come out 0)."""
    work = meta.block_list(block_m)
    num_slices, rank = lora_a.shape[1], lora_a.shape[2]
    buf = torch.full((num_slices, x.shape[0], rank), float("nan"), dtype=torch.float64)
    y = torch.zeros(x.shape[0], offsets[-1], dtype=torch.float64)
    lora_blocks, all_blocks = work.num_blocks.tolist()
    for b in range(all_blocks):
        slot, first, end, r = work.blocks[:, b].tolist()
        tok = meta.sorted_token_ids[first : min(end, first + block_m)].long()
        buf[:, tok] = 0
        if slot == meta.max_loras:
            continue
        r = min(r, rank)
        buf[:, tok, :r] = torch.einsum("ti,sri->str", x[tok].double(), lora_a[slot, :, :r].double())
    for b in range(lora_blocks):
        slot, first, end, r = work.blocks[:, b].tolist()
        tok = meta.sorted_token_ids[first : min(end, first + block_m)].long()
        r = min(r, rank)
        for s in range(num_slices):
            b_rows = lora_b[slot, offsets[s] : offsets[s + 1], :r].double()
            y[tok, offsets[s] : offsets[s + 1]] += buf[s, tok, :r] @ b_rows.T
    return buf, y


@pytest.mark.parametrize("block_m", [1, 16, 64])
@pytest.mark.parametrize("known_ranks", [False, True])
def test_block_list_walk_reproduces_the_reference(block_m, known_ranks):
    """Slots of rank 8 holding adapters of rank 1-8 (zero past it): reading each only to its
    adapter's rank (LoraMeta.slot_ranks) gives what reading it whole gives."""
    gen = torch.Generator().manual_seed(3)
    ranks = [1, 8, 3, 5, 8, 2, 7]
    lora_a, lora_b = random_layer(gen, 7, 32, (32, 8, 8), 8, ranks)
    slots = torch.randint(-1, 7, (150,), generator=gen)
    meta = make_lora_meta(slots, 7, slot_ranks=torch.tensor(ranks) if known_ranks else None)
    x = torch.randn(150, 32, generator=gen)
    buf, y = emulate_kernels(x, lora_a, lora_b, (0, 32, 40, 48), meta, block_m)
    want_buf = reference.lora_shrink(x, lora_a, meta)
    torch.testing.assert_close(buf, want_buf.double(), rtol=1e-5, atol=1e-4)
    want_y = reference.lora_expand(torch.zeros(150, 48), want_buf, lora_b, (0, 32, 40, 48), meta)
    torch.testing.assert_close(y, want_y.double(), rtol=1e-5, atol=1e-4)


def test_cpu_tensors_use_the_reference_and_never_import_triton():
    code = (
        "import sys, torch\n"
        "from loraserve import kernels\n"
        "m = kernels.make_lora_meta(torch.tensor([0, -1]), 1)\n"
        "kernels.lora_shrink(torch.randn(2, 8), torch.randn(1, 1, 4, 8), m)\n"
        "assert kernels._impl(torch.zeros(1)) is kernels.reference\n"
        "assert 'triton' not in sys.modules and 'loraserve.kernels.triton_lora' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_shrink_workspace_hands_out_zeroed_views_in_call_order_until_full():
    buf = torch.zeros(2 * 3 * 4 + 1 * 3 * 8)
    ws = ShrinkWorkspace(buf)
    a, b = ws.take(2, 3, 4), ws.take(1, 3, 8)
    assert a.shape == (2, 3, 4) and b.shape == (1, 3, 8) and ws.used == buf.numel()
    assert a.data_ptr() == buf.data_ptr() and b.data_ptr() == buf[24:].data_ptr()
    assert ws.take(1, 1, 1) is None  # full: the shrink allocates its own output instead
    # the reference shrink writes into the workspace's view (every element)
    x, lora_a = torch.randn(3, 5), torch.randn(2, 2, 4, 5)
    meta = make_lora_meta(torch.tensor([1, -1, 0]), 2)
    meta.shrink_workspace = ShrinkWorkspace(torch.full((2 * 3 * 4,), float("nan")))
    out = lora_shrink(x, lora_a, meta)
    assert out.data_ptr() == meta.shrink_workspace.buffer.data_ptr() and not out.isnan().any()
    meta.shrink_workspace = None
    torch.testing.assert_close(out, lora_shrink(x, lora_a, meta))


def test_a_packed_b_unpacks_at_each_slot_s_rank_and_whole_where_the_rank_is_not_known():
    """reference.unpacked (a packed B on the reference path, a CUDA executor's layout): slot rank 4 reads the
    slot's first N x 8 elements as rows, FULL_RANK (a slot whose rank is not known, e.g. never
    loaded) the whole slot as [N, R], rank 0 nothing; never past the slot."""
    lora_b = torch.randn(3, 5, 16)
    meta = make_lora_meta(
        torch.tensor([0, 1, 2], dtype=torch.int32), 3, slot_ranks=torch.tensor([FULL_RANK, 4, 0], dtype=torch.int32)
    )
    out = reference.unpacked(lora_b, meta, 16)
    assert torch.equal(out[0], lora_b[0])
    assert torch.equal(out[1, :, :8], lora_b[1].reshape(-1)[:40].view(5, 8)) and not out[1, :, 8:].any()
    assert not out[2].any()
    with pytest.raises(ValueError, match="slot_ranks"):
        reference.unpacked(lora_b, make_lora_meta(torch.tensor([0], dtype=torch.int32), 3), 16)
