"""Decode-step CUDA graphs (executor/engine/graphs.py) against the eager forward.

The bucket rule runs everywhere; the graph tests need a CUDA GPU and skip with a reason elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from loraserve.executor.engine.graphs import DecodeBatch, DecodeGraphs, batch_buckets
from loraserve.executor.engine.kv_cache import AttentionMetadata, BlockAllocator, KVCache
from loraserve.executor.lora import LoraSpec, lora_modules
from loraserve.executor.model.loader import load_hf_checkpoint
from loraserve.kernels import make_lora_meta


def test_batch_buckets_cover_every_batch_up_to_the_maximum():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    for n in range(1, 70):
        buckets = batch_buckets(n)
        assert buckets == sorted(set(buckets)) and buckets[-1] == n


def _cuda_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: no CUDA device here (run benchmarks/gpu_executor.sh on a CUDA host)")


MAX_LORAS, RANK, BLOCK = 4, 8, 4


def _model(hf_model, dtype):
    _, path = hf_model("llama")
    model = load_hf_checkpoint(path, dtype, "cuda", lora=LoraSpec(MAX_LORAS, RANK, dtype))
    torch.manual_seed(1)
    for m in lora_modules(model).values():  # every slot a random adapter of full rank
        m.lora_a.normal_(0, 0.2)
        m.lora_b.normal_(0, 0.2)
        m.slot_ranks = [RANK] * MAX_LORAS
    return model


def _eager_decode(model, kv, ids, positions, tables, slots):
    attn = AttentionMetadata.build([1] * len(ids), positions, tables, BLOCK, "cuda")
    meta = None
    if max(slots) >= 0:
        meta = make_lora_meta(torch.tensor(slots, device="cuda"), MAX_LORAS, frozenset(s for s in slots if s >= 0))
    hidden = model.forward(torch.tensor(ids, device="cuda"), attn.positions, attn, kv, meta)
    return model.compute_logits(hidden, meta)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_graph_replay_equals_the_eager_step(hf_model, dtype, tol):
    """Ragged contexts across block boundaries, batches padded to their bucket, base rows and
    adapter rows mixed, and base-only batches (the graph without LoRA): logits as the eager step's."""
    _cuda_or_skip()
    model = _model(hf_model, dtype)
    cfg = model.cfg
    kv = KVCache(cfg.num_layers, 64, BLOCK, cfg.num_kv_heads, cfg.head_dim, dtype, "cuda")
    graphs = DecodeGraphs(model, kv, max_batch=8, max_model_len=64, max_loras=MAX_LORAS, device="cuda")
    graphs.capture()
    alloc = BlockAllocator(64)
    gen = torch.Generator().manual_seed(0)
    lens = [3, 4, 5, 9, 1, 16, 7]  # ctx before the decode token: inside, at and across block ends
    tables, prompts = [], []
    for n in lens:  # prefill each sequence eagerly
        tables.append(alloc.allocate(-(-(n + 4) // BLOCK)))
        prompts.append(torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist())
        attn = AttentionMetadata.build([n], [0], [tables[-1]], BLOCK, "cuda")
        model.forward(torch.tensor(prompts[-1], device="cuda"), attn.positions, attn, kv, None)
    cases = [  # (sequences, slots): batch sizes 1, 3, 5, 7 -> buckets 1, 4, 8, 8
        ([0], [2]),
        ([1, 2, 3], [-1, 0, 3]),
        ([0, 1, 2, 3, 4], [-1, -1, -1, -1, -1]),
        ([0, 1, 2, 3, 4, 5, 6], [1, -1, 0, 2, 2, -1, 3]),
    ]
    for seqs, slots in cases:
        ids = [int(torch.randint(0, cfg.vocab_size, (1,), generator=gen)) for _ in seqs]
        positions = [lens[s] for s in seqs]
        seq_tables = [tables[s] for s in seqs]
        want = _eager_decode(model, kv, ids, positions, seq_tables, slots).clone()
        got = graphs.run(DecodeBatch(ids, positions, seq_tables, slots)).clone()
        assert torch.isfinite(got).all()
        err = ((got - want).norm() / want.norm()).item()
        assert err < tol, f"batch {len(seqs)}, slots {slots}: relative error {err:.2e}"
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist() or dtype == torch.bfloat16


@pytest.mark.gpu
def test_padding_rows_write_only_the_scratch_block(hf_model):
    """A batch of 3 replays the bucket of 4: the padding row must leave every sequence's blocks as they were."""
    _cuda_or_skip()
    model = _model(hf_model, torch.bfloat16)
    cfg = model.cfg
    kv = KVCache(cfg.num_layers, 16, BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cuda")
    for cache in kv.k_cache + kv.v_cache:
        cache.normal_()
    graphs = DecodeGraphs(model, kv, max_batch=4, max_model_len=16, max_loras=MAX_LORAS, device="cuda")
    graphs.capture()
    before = [c[: kv.num_blocks].clone() for c in kv.k_cache + kv.v_cache]
    # Three sequences in blocks 0-2, each decoding at position 0 of its block.
    graphs.run(DecodeBatch([1, 2, 3], [0, 0, 0], [[0], [1], [2]], [-1, 0, 1]))
    for old, new in zip(before, kv.k_cache + kv.v_cache):
        torch.testing.assert_close(new[3 : kv.num_blocks], old[3:])  # untouched blocks
        torch.testing.assert_close(new[:3, 1:], old[:3, 1:])  # only slot 0 of blocks 0-2 written
