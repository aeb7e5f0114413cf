"""The plain-PyTorch paged attention (the oracle and CPU path) against dense float64 attention
built from contiguous per-sequence K/V. CPU only: runs in CI.

Every case scatters the sequences' keys into a paged cache through shuffled, non-contiguous
block ids; block-table padding points at other sequences' blocks, and every cache row that a
query may not see (free blocks, the tail of a last block, keys before the window) holds NaN,
so a read of any of them shows up in the output.
"""

from __future__ import annotations

import pytest
import torch

from loraserve import kernels
from loraserve.kernels import attention_reference

HEADS = [(4, 4), (8, 4), (8, 2), (16, 4), (16, 2), (9, 3)]  # (H, KVH): GQA 1, 2, 4, 4, 8, SmolLM2's 3


def build_case(gen, seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, window=None, dtype=torch.float32):
    """Random dense K/V per sequence, scattered into a paged cache; returns the kernel inputs and the dense truth."""
    num_seqs = len(seq_lens)
    blocks_of = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(blocks_of) + 1  # a spare column: padding past every sequence's last block
    num_blocks = sum(blocks_of) + 3  # a few blocks nobody owns
    ids = torch.randperm(num_blocks, generator=gen)
    tables = torch.empty(num_seqs, max_blocks, dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    dense, taken = [], 0
    for b, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
        own = ids[taken : taken + blocks_of[b]]
        taken += blocks_of[b]
        tables[b] = torch.randint(0, num_blocks, (max_blocks,), generator=gen, dtype=torch.int32)  # any valid id
        tables[b, : len(own)] = own
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        dense.append((k, v))
        ctx = seq_len - q_len
        first = 0 if window is None else max(0, ctx - window + 1)  # earlier keys stay NaN: no query sees them
        pos = torch.arange(first, seq_len)
        blocks, rows = own.long()[pos // block_size], pos % block_size
        k_cache[blocks, rows] = k[first:]
        v_cache[blocks, rows] = v[first:]
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(int(cu[-1]), num_heads, head_dim, generator=gen)
    return dict(
        q=q.to(dtype),
        k_cache=k_cache.to(dtype),
        v_cache=v_cache.to(dtype),
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        cu_query_lens=cu,
        max_query_len=max(q_lens),
        dense=dense,
    )


def dense_attention(case, scale, window=None, softcap=None) -> torch.Tensor:
    """float64 [T, H, D]: softmax(s + causal/window mask) V, s = q K^T * scale (soft-capped to
    c * tanh(s / c) with a softcap c), one sequence and head at a time."""
    q = case["q"].double()
    out = torch.zeros_like(q)
    num_heads = q.shape[1]
    cu = case["cu_query_lens"].tolist()
    for b, (k, v) in enumerate(case["dense"]):
        start, end = cu[b], cu[b + 1]
        seq_len = k.shape[0]
        q_pos = torch.arange(seq_len - (end - start), seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= k_pos > q_pos - window
        for h in range(num_heads):
            kv = h * k.shape[1] // num_heads  # the kv head of query head h
            scores = q[start:end, h] @ k[:, kv].double().T * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            out[start:end, h] = weights @ v[:, kv].double()
    return out


def run_decode(case, scale, window=None, softcap=None):
    return attention_reference.paged_decode_attention(
        case["q"], case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"], scale, window, softcap=softcap
    )


def run_prefill(case, scale, window=None, softcap=None):
    return attention_reference.paged_prefill_attention(
        case["q"],
        case["k_cache"],
        case["v_cache"],
        case["block_tables"],
        case["seq_lens"],
        case["cu_query_lens"],
        case["max_query_len"],
        scale,
        window,
        softcap=softcap,
    )


def assert_close(got, want, tol=1e-5):
    assert not got.isnan().any(), "NaN in the output: a masked cache row was read"
    err = (got.double() - want).abs().max().item()
    assert err < tol, f"max abs error {err}"


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"H{h[0]}-KVH{h[1]}")
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_dense_on_ragged_lengths_across_block_edges(heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(head_dim + block_size)
    lens = [1, block_size - 1, block_size, block_size + 1, 2 * block_size + 3, 77]
    case = build_case(gen, lens, [1] * len(lens), *heads, head_dim, block_size)
    scale = head_dim**-0.5
    assert_close(run_decode(case, scale), dense_attention(case, scale))


@pytest.mark.parametrize("window", [1, 5, 16, 17, 40, 1000])
def test_decode_sliding_window_smaller_and_larger_than_context(window):
    gen = torch.Generator().manual_seed(window)
    lens = [1, 15, 16, 17, 33, 90]
    case = build_case(gen, lens, [1] * len(lens), 8, 2, 64, 16, window)
    assert_close(run_decode(case, 0.125, window), dense_attention(case, 0.125, window))


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"H{h[0]}-KVH{h[1]}")
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_prefill_chunks_with_and_without_context(heads, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    # (seq_len, q_len): whole prompts (ctx 0) at and across block edges, chunks after cached context
    pairs = [(15, 15), (16, 16), (17, 17), (40, 7), (33, 16), (64, 1), (100, 37)]
    case = build_case(gen, [s for s, _ in pairs], [q for _, q in pairs], *heads, head_dim, 16)
    scale = head_dim**-0.5
    assert_close(run_prefill(case, scale), dense_attention(case, scale))


@pytest.mark.parametrize("window", [1, 4, 16, 25, 1000])
def test_prefill_sliding_window(window):
    gen = torch.Generator().manual_seed(100 + window)
    pairs = [(30, 30), (50, 20), (17, 1), (70, 33)]
    case = build_case(gen, [s for s, _ in pairs], [q for _, q in pairs], 9, 3, 16, 16, window)
    assert_close(run_prefill(case, 0.25, window), dense_attention(case, 0.25, window))


def test_mixed_batch_of_decode_tokens_prefill_chunks_and_empty_rows():
    gen = torch.Generator().manual_seed(7)
    pairs = [(33, 1), (20, 20), (5, 0), (48, 1), (81, 17), (1, 1), (16, 0)]
    case = build_case(gen, [s for s, _ in pairs], [q for _, q in pairs], 8, 2, 32, 16)
    assert_close(run_prefill(case, 0.2), dense_attention(case, 0.2))


def test_prefill_of_single_tokens_equals_decode():
    gen = torch.Generator().manual_seed(8)
    lens = [3, 16, 31, 64]
    case = build_case(gen, lens, [1] * len(lens), 16, 4, 64, 16)
    torch.testing.assert_close(run_prefill(case, 0.1), run_decode(case, 0.1), rtol=1e-6, atol=1e-6)


def test_writes_into_the_given_out_buffer():
    gen = torch.Generator().manual_seed(9)
    case = build_case(gen, [10, 20], [1, 1], 4, 2, 16, 16)
    out = torch.full_like(case["q"], float("nan"))
    got = attention_reference.paged_decode_attention(
        case["q"], case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"], 0.25, out=out
    )
    assert got.data_ptr() == out.data_ptr()
    assert_close(out, dense_attention(case, 0.25))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_inputs_keep_their_dtype(dtype):
    gen = torch.Generator().manual_seed(10)
    pairs = [(40, 1), (30, 12)]
    case = build_case(gen, [s for s, _ in pairs], [q for _, q in pairs], 8, 2, 64, 16, dtype=dtype)
    out = run_prefill(case, 0.125)
    assert out.dtype == dtype
    want = dense_attention(case, 0.125)
    assert ((out.double() - want).norm() / want.norm()).item() < 1e-2


def test_dispatch_runs_the_reference_for_cpu_tensors():
    gen = torch.Generator().manual_seed(11)
    case = build_case(gen, [5, 19], [1, 4], 4, 4, 16, 16)
    assert kernels._attention_impl(case["q"]) is attention_reference
    got = kernels.paged_prefill_attention(
        case["q"],
        case["k_cache"],
        case["v_cache"],
        case["block_tables"],
        case["seq_lens"],
        case["cu_query_lens"],
        case["max_query_len"],
        0.25,
    )
    assert_close(got, dense_attention(case, 0.25))


def test_decode_padding_rows_of_length_zero_give_zeros():
    gen = torch.Generator().manual_seed(12)
    case = build_case(gen, [10, 1, 20], [1, 1, 1], 4, 2, 16, 16)
    case["seq_lens"][1] = 0
    out = run_decode(case, 0.25)
    assert (out[1] == 0).all()
    want = dense_attention(case, 0.25)
    assert_close(out[[0, 2]], want[[0, 2]])


TOL = 5e-5


@pytest.mark.parametrize("window", [None, 3, 16, 1000])
@pytest.mark.parametrize("softcap", [None, 1.0, 50.0])
@pytest.mark.parametrize("head_dim", [32, 256])
def test_softcap_and_window_match_dense(window, softcap, head_dim):
    """Gemma's per-layer attention: scores soft-capped (c * tanh(s / c)) before the mask and softmax,
    with and without a sliding window, at Gemma's head_dim 256; decode, prefill and mixed rows.
    Large scores (4x the usual scale) so a cap of 1 saturates them and 50 barely bends them; float32
    sums over 256 dims of such scores round to a few 1e-5."""
    gen = torch.Generator().manual_seed(head_dim + (window or 0) + int(softcap or 0))
    pairs = [(30, 30), (50, 20), (17, 1), (5, 0), (70, 33)]
    case = build_case(gen, [s for s, _ in pairs], [q for _, q in pairs], 8, 2, head_dim, 16, window)
    case["q"] = case["q"] * 2
    scale = head_dim**-0.5 * 4
    want = dense_attention(case, scale, window, softcap)
    assert_close(run_prefill(case, scale, window, softcap), want, TOL)
    if softcap == 1.0:  # the cap changes the output: the comparison above sees it
        assert (dense_attention(case, scale, window) - want).abs().max() > 0.1
    lens = [1, 15, 16, 17, 33, 90]
    dec = build_case(gen, lens, [1] * len(lens), 8, 2, head_dim, 16, window)
    assert_close(run_decode(dec, scale, window, softcap), dense_attention(dec, scale, window, softcap), TOL)
    assert_close(kernels.paged_decode_attention(dec["q"], dec["k_cache"], dec["v_cache"], dec["block_tables"],
                                                dec["seq_lens"], scale, window, softcap=softcap),
                 dense_attention(dec, scale, window, softcap), TOL)  # fmt: skip
