"""Paged attention in plain PyTorch: the test oracle, and the path for CPU tensors.

The cache holds each sequence's keys and values in fixed-size blocks named by its block table:
token p of sequence b is row `p % block_size` of block `block_tables[b, p // block_size]`.
Both functions loop over sequences on the host, gather exactly the keys each one sees (the
block table's tail and keys outside a sliding window are never read, so stale or NaN memory
there cannot leak in through 0 * NaN), and make one 4-D SDPA call per sequence with the GQA
group folded into the query length (no repeat of K/V). An FP8 cache (float8_e4m3fn, with k_scale and
v_scale [KVH] float32: real value = fp8 * scale) is dequantized to q's dtype as it is gathered. The lengths are read on the host, so
on CUDA this path synchronises and cannot be captured in a graph; there it is only the
fallback when Triton is missing or a shape is unsupported (kernels/triton_attention.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_decode_attention(
    q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window=None, out=None, softcap=None, k_scale=None, v_scale=None
) -> torch.Tensor:
    """One query token per sequence over its paged keys/values.

    q:               [B, H, D] (fp32 / fp16 / bf16)
    k_cache/v_cache: [num_blocks, block_size, KVH, D], H % KVH == 0
    block_tables:    [B, max_blocks] int32
    seq_lens:        [B] int32, keys of each sequence including the current token's (already cached);
                     0 marks a padding row (e.g. of a captured batch size), whose output is zeros
    sliding_window:  None or W: the query at p = seq_len - 1 sees keys at positions (p - W, p]
    out:             optional [B, H, D]
    softcap:         None or c: each score s = q.k * scale becomes c * tanh(s / c) before the softmax (Gemma 2)
    k_scale/v_scale: [KVH] float32 for a float8_e4m3fn cache (k = fp8 * k_scale[head]); None otherwise
    -> out [B, H, D], dtype of q
    """
    if out is None:
        out = torch.empty_like(q)
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            out[b] = 0
            continue
        first = 0 if sliding_window is None else max(0, seq_len - sliding_window)
        k, v = _gather(k_cache, v_cache, block_tables[b], first, seq_len, k_scale, v_scale, q.dtype)  # [KVH, L, D]
        out[b] = _attend(q[b][None], k, v, None, scale, softcap)[0]
    return out


def paged_prefill_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    cu_query_lens,
    max_query_len,
    scale,
    sliding_window=None,
    out=None,
    work=None,
    softcap=None,
    k_scale=None,
    v_scale=None,
) -> torch.Tensor:
    """Variable-length causal queries (prefill chunks and decode tokens mixed) over cached + new keys.

    q:             [T, H, D], the flattened queries of B sequences
    block_tables:  [B, max_blocks] int32
    seq_lens:      [B] int32, keys of sequence b after this step (its chunk's k/v already cached)
    cu_query_lens: [B + 1] int32, sequence b owns q rows [cu[b], cu[b + 1])
    max_query_len: host int, the longest chunk (unused here: the Triton grid is sized by it)
    work:          the Triton kernel's work list (unused here)
    softcap, k_scale, v_scale: as in paged_decode_attention
    Query j of sequence b sits at p = seq_len_b - q_len_b + j and sees keys at positions <= p
    (and > p - W with a sliding window W). Sequences with q_len 0 produce nothing.
    -> out [T, H, D], dtype of q
    """
    if out is None:
        out = torch.empty_like(q)
    cu = cu_query_lens.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = cu[b], cu[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        ctx = seq_len - q_len  # keys cached before this chunk
        first = 0 if sliding_window is None else max(0, ctx - sliding_window + 1)  # the first query's window
        k, v = _gather(k_cache, v_cache, block_tables[b], first, seq_len, k_scale, v_scale, q.dtype)
        q_pos = torch.arange(ctx, seq_len, device=q.device)[:, None]  # [q_len, 1]
        k_pos = torch.arange(first, seq_len, device=q.device)[None, :]  # [1, L]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        out[start:end] = _attend(q[start:end], k, v, mask, scale, softcap)
    return out


def _gather(k_cache, v_cache, table, first: int, last: int, k_scale=None, v_scale=None, dtype=None):
    """Keys and values at positions [first, last) of one sequence -> two [KVH, last - first, D]; an FP8
    cache's dequantized (fp8 * scale in float32, then to dtype)."""
    block_size = k_cache.shape[1]
    pos = torch.arange(first, last, device=k_cache.device)
    blocks = table.to(torch.long)[pos // block_size]
    rows = pos % block_size
    k, v = k_cache[blocks, rows].transpose(0, 1), v_cache[blocks, rows].transpose(0, 1)
    if k_cache.dtype == torch.float8_e4m3fn:
        k = (k.float() * k_scale[:, None, None]).to(dtype)
        v = (v.float() * v_scale[:, None, None]).to(dtype)
    return k, v


def _attend(q, k, v, mask, scale, softcap=None):
    """q [n, H, D] over k, v [KVH, L, D]; mask None or [n, L] bool -> [n, H, D].

    The H / KVH query heads of a kv head become rows of one SDPA query ([1, KVH, group * n, D],
    row = g * n + i), so K/V are used as they are; 4-D inputs (3-D ones take a slow CPU path).
    With a softcap the scores are computed explicitly (SDPA has no soft-capping), as transformers'
    eager attention does: capped in q's dtype, softmax in float32, cast back before V.
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[0]
    group = num_heads // num_kv_heads
    qg = q.reshape(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(1, num_kv_heads, group * n, head_dim)
    if mask is not None:
        mask = mask.repeat(group, 1)  # [group * n, L], the same for every head of the group
    if softcap is None:
        o = F.scaled_dot_product_attention(qg, k[None], v[None], attn_mask=mask, scale=scale)
    else:
        scores = torch.tanh(qg @ k[None].transpose(-1, -2) * scale / softcap) * softcap  # [1, KVH, group * n, L]
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        o = scores.softmax(-1, dtype=torch.float32).to(q.dtype) @ v[None]
    return o.reshape(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)
