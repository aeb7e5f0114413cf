"""Decode-step CUDA graphs (executor/engine/graphs.py) against the eager forward.

The bucket rule runs everywhere; the graph tests need a CUDA GPU and skip with a reason elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from loraserve.executor.engine import graphs as graphs_mod
from loraserve.executor.engine import staging
from loraserve.executor.engine.graphs import (
    DecodeBatch,
    DecodeGraphs,
    batch_buckets,
    shrink_floats_per_token,
)
from loraserve.executor.engine.kv_cache import AttentionMetadata, BlockAllocator, KVCache
from loraserve.executor.engine.staging import SamplingInputs
from loraserve.executor.lora import LinearWithLoRA, lora_modules
from loraserve.executor.model.loader import load_hf_checkpoint
from loraserve.executor.slot_layout import LoraSpec
from loraserve.kernels import make_lora_meta
from loraserve.kernels.meta import ShrinkWorkspace

from .conftest import TINY_MOE


def test_batch_buckets_cover_every_batch_up_to_the_maximum():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    for n in range(1, 70):
        buckets = batch_buckets(n)
        assert buckets == sorted(set(buckets)) and buckets[-1] == n


@pytest.mark.parametrize("family", ["llama", "mixtral", "qwen2_moe"])
def test_static_buffer_step_equals_the_eager_step_on_cpu(hf_model, family, monkeypatch):
    """What the graphs capture, run without capture: inputs staged in the static buffer (ragged
    tables, padding to the bucket, mixed slots, expert LoRA for the MoE families) give the eager
    step's logits. Runs everywhere."""
    _, path = hf_model(family, **TINY_MOE.get(family, {}))
    model = _random_slots(load_hf_checkpoint(path, lora=LoraSpec(MAX_LORAS, RANK, torch.float32)))
    cfg = model.cfg
    kv = KVCache(cfg.num_layers, 32, BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    graphs = DecodeGraphs(model, kv, max_batch=8, max_model_len=32, max_loras=MAX_LORAS, device="cpu")
    alloc, gen = BlockAllocator(32), torch.Generator().manual_seed(0)
    lens, tables = [3, 4, 9], []
    for n in lens:
        tables.append(alloc.allocate(-(-(n + 1) // BLOCK)))
        attn = AttentionMetadata.build([n], [0], [tables[-1]], BLOCK, "cpu")
        model.forward(torch.randint(0, cfg.vocab_size, (n,), generator=gen), attn.positions, attn, kv, None)
    for slots in ([-1, -1, -1], [2, -1, 0]):
        ids = torch.randint(0, cfg.vocab_size, (3,), generator=gen).tolist()
        attn = AttentionMetadata.build([1] * 3, lens, tables, BLOCK, "cpu")
        meta = _meta(torch.tensor(slots))
        want = model.compute_logits(model.forward(torch.tensor(ids), attn.positions, attn, kv, meta), meta)
        bucket, lora = graphs.stage(DecodeBatch(ids, lens, tables, slots))
        assert (bucket, lora) == (4, max(slots) >= 0)
        graphs._shrink_ws.fill_(float("nan"))  # what a previous step's shrinks left
        handed = []
        monkeypatch.setattr(graphs_mod, "ShrinkWorkspace", lambda buf: handed.append(buf.clone()) or ShrinkWorkspace(buf))
        graphs._forward(bucket, lora)
        if lora:  # the step zeroed its whole workspace before any shrink took a view of it
            assert len(handed) == 1 and handed[0].numel() == bucket * shrink_floats_per_token(model)
            assert not handed[0].any()
        else:
            assert not handed
        torch.testing.assert_close(graphs._logits[:3], want, atol=1e-5, rtol=1e-5)
        # the step's shrink outputs all fit the graphs' workspace (sized by shrink_floats_per_token)
        if max(slots) >= 0:
            per_token = shrink_floats_per_token(model)
            ws = ShrinkWorkspace(torch.zeros(3 * per_token))
            meta.shrink_workspace = ws
            torch.testing.assert_close(
                model.compute_logits(model.forward(torch.tensor(ids), attn.positions, attn, kv, meta), meta),
                want,
                atol=1e-5,
                rtol=1e-5,
            )
            assert ws.used == 3 * per_token > 0


def shrink_layers(model):
    return [m for m in lora_modules(model).values() if isinstance(m, LinearWithLoRA)]


def _cuda_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: no CUDA device here (run benchmarks/gpu.sh OUT test on a CUDA host)")


MAX_LORAS, RANK, BLOCK = 4, 8, 4


def _random_slots(model):
    """Every slot of every LoRA module a random adapter of full rank."""
    torch.manual_seed(1)
    for m in lora_modules(model).values():
        m.lora_a.normal_(0, 0.2)
        m.lora_b.normal_(0, 0.2)
        m.slot_ranks = [RANK] * MAX_LORAS
    return model


def _model(hf_model, dtype, device="cuda"):
    _, path = hf_model("llama")
    return _random_slots(load_hf_checkpoint(path, dtype, device, lora=LoraSpec(MAX_LORAS, RANK, dtype)))


def _meta(slots: torch.Tensor):
    """The step's LoraMeta as the engine makes it: every slot's adapter at RANK (a packed B is read at it)."""
    ranks = torch.full((MAX_LORAS,), RANK, dtype=torch.int32, device=slots.device)
    return make_lora_meta(slots, MAX_LORAS, frozenset(s for s in slots.tolist() if s >= 0), slot_ranks=ranks)


def _eager_decode(model, kv, ids, positions, tables, slots):
    attn = AttentionMetadata.build([1] * len(ids), positions, tables, BLOCK, "cuda")
    meta = None
    if max(slots) >= 0:
        meta = _meta(torch.tensor(slots, device="cuda"))
    hidden = model.forward(torch.tensor(ids, device="cuda"), attn.positions, attn, kv, meta)
    return model.compute_logits(hidden, meta)


def _without_device_views(monkeypatch) -> None:
    """As on a platform whose pinned memory has no device view: staged inputs are copied."""
    monkeypatch.setattr(staging, "device_view", lambda host, device: (_ for _ in ()).throw(RuntimeError("no UVA")))


@pytest.mark.gpu
@pytest.mark.parametrize("by_kernel", [False, True], ids=["inputs-copied", "inputs-by-kernel"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_graph_replay_equals_the_eager_step(hf_model, dtype, tol, by_kernel, monkeypatch):
    """Ragged contexts across block boundaries, batches padded to their bucket, base rows and
    adapter rows mixed, and base-only batches (the graph without LoRA): logits as the eager step's.
    by_kernel: the step's inputs read from their pinned buffers by a kernel (staging.py); else as
    where pinned memory has no device view: copied."""
    _cuda_or_skip()
    if not by_kernel:
        _without_device_views(monkeypatch)
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
    caches = kv.k_cache + kv.v_cache
    for seqs, slots in cases:
        ids = [int(torch.randint(0, cfg.vocab_size, (1,), generator=gen)) for _ in seqs]
        positions = [lens[s] for s in seqs]
        seq_tables = [tables[s] for s in seqs]
        before = [c.clone() for c in caches]
        # The graph first, on the cache as the prefill left it: its own K/V write must land.
        got = graphs.run(DecodeBatch(ids, positions, seq_tables, slots)).clone()
        after_graph = [c[: kv.num_blocks].clone() for c in caches]
        for c, old in zip(caches, before):
            c.copy_(old)
        want = _eager_decode(model, kv, ids, positions, seq_tables, slots).clone()
        assert torch.isfinite(got).all()
        err = ((got - want).norm() / want.norm()).item()
        assert err < tol, f"batch {len(seqs)}, slots {slots}: relative error {err:.2e}"
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist() or dtype == torch.bfloat16
        for c, g in zip(caches, after_graph):  # the same keys and values written where the eager step wrote
            torch.testing.assert_close(g, c[: kv.num_blocks], atol=tol, rtol=tol)
        for c, old in zip(caches, before):
            assert not torch.equal(c[: kv.num_blocks], old[: kv.num_blocks])  # something was written
    assert bool(getattr(graphs, "_mapped", None)) == by_kernel  # the inputs went the way asked
    for h in graphs._hosts if by_kernel else ():  # each a view of its pinned buffer, not a copy of it
        assert graphs._mapped[h.data_ptr()].data_ptr() == h.data_ptr()


def test_a_device_view_of_a_buffer_not_int32_is_refused():
    """staging.device_view maps only the step inputs' int32 buffers (a view read as another dtype
    would feed the graphs wrong ids); its other refusal, a view torch places on another GPU or at
    other memory, needs a CUDA host: the GPU graph tests check their views are the buffers themselves."""
    with pytest.raises(ValueError, match="host buffer is torch.int64, not int32"):
        staging.device_view(torch.zeros(4, dtype=torch.int64), torch.device("cuda", 0))


def test_inputs_are_copied_where_pinned_memory_has_no_device_view(hf_model, monkeypatch, caplog):
    """Staged inputs on a host whose pinned input buffers cannot be viewed from the device (here:
    no CUDA at all, the graphs told they are on one): one warning, and each step's inputs are
    copied, every value arriving."""
    _, path = hf_model("llama")
    model = load_hf_checkpoint(path, lora=LoraSpec(MAX_LORAS, RANK, torch.float32))
    cfg = model.cfg
    kv = KVCache(cfg.num_layers, 32, BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    graphs = DecodeGraphs(model, kv, max_batch=8, max_model_len=32, max_loras=MAX_LORAS, device="cpu")
    _without_device_views(monkeypatch)
    graphs.device = torch.device("cuda")  # where the mapping is tried
    with caplog.at_level("WARNING", logger=staging.__name__):
        for step in range(2):  # the second step neither retries nor warns again
            graphs._swap_hosts()
            graphs._host.copy_(torch.arange(graphs._host.numel(), dtype=torch.int32) + step)
            graphs._upload(40)
            assert graphs._dev[:40].tolist() == list(range(step, 40 + step))
    assert graphs._mapped == {}
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == ["DecodeGraphs copies its inputs: its pinned buffers have no device view (no UVA)"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_sampling_inputs_arrive_as_the_sampler_takes_them(device):
    """SamplingInputs packs each row's temperature, top_k and top_p into one int32 buffer (the
    floats as their bits) and hands back tensors of the sampler's dtypes holding the values sent;
    successive steps fill the two host buffers in turn; more rows than it holds: None (the engine
    then copies). On CUDA the values are read by a kernel from the pinned buffer itself."""
    if device == "cuda":
        _cuda_or_skip()
    staged = SamplingInputs(4, device)
    temperature, top_k, top_p = [0.7, 0.0, 1.5], [0, 40, 49_999], [0.9, 1.0, 0.25]
    t, k, p = staged.stage(temperature, top_k, top_p)
    assert (t.dtype, k.dtype, p.dtype) == (torch.float32, torch.int64, torch.float32)
    assert t.device.type == k.device.type == p.device.type == device
    assert t.tolist() == torch.tensor(temperature, dtype=torch.float32).tolist()
    assert k.tolist() == top_k
    assert p.tolist() == torch.tensor(top_p, dtype=torch.float32).tolist()
    first = staged._host
    t, k, p = staged.stage([1.0] * 4, [1, 2, 3, 4], [0.5] * 4)
    assert staged._host is not first and k.tolist() == [1, 2, 3, 4] and p.tolist() == [0.5] * 4
    if device == "cuda":  # read through each pinned buffer's own device view, not a copy of it
        assert all(staged._mapped[h.data_ptr()].data_ptr() == h.data_ptr() for h in staged._hosts)
    assert staged.stage([1.0] * 5, [0] * 5, [1.0] * 5) is None


@pytest.mark.gpu
def test_split_k_shrinks_in_the_graph_add_into_a_workspace_zeroed_each_replay(hf_model, monkeypatch):
    """Every shrink forced to split K (the tiny model's shapes take one split from the tables): the
    LoRA graph's shrinks add into the step's workspace, which each replay zeroes first, so the same
    batch replayed three times gives the eager step's logits, the same each time (a missed zeroing
    would add the previous replay's partial sums). Not run on a GPU yet (written after the last GPU
    run of this change: docs/BENCHMARKS.md, "GPU test suites: their last run")."""
    _cuda_or_skip()
    from loraserve.kernels import triton_lora, tuning

    def split_in_two(device, num_tokens, in_features, num_slices, rank):
        return tuning.ShrinkConfig(16, min(64, tuning._pow2(num_slices * rank)), 16, 2, 4, 2, 8)

    monkeypatch.setattr(triton_lora, "shrink_config", split_in_two)
    outputs = []  # where the graph's shrinks write (captured once: the warm-up and capture runs)
    real_shrink = triton_lora.lora_shrink
    monkeypatch.setattr(triton_lora, "lora_shrink", lambda *a, **k: outputs.append(real_shrink(*a, **k)) or outputs[-1])
    model = _model(hf_model, torch.bfloat16)  # the Triton LoRA kernels take fp16 / bf16
    cfg = model.cfg
    kv = KVCache(cfg.num_layers, 16, BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cuda")
    graphs = DecodeGraphs(model, kv, max_batch=4, max_model_len=16, max_loras=MAX_LORAS, device="cuda")
    graphs.capture()
    ws = graphs._shrink_ws
    inside = [o for o in outputs if ws.data_ptr() <= o.data_ptr() < ws.data_ptr() + ws.numel() * ws.element_size()]
    assert inside and len(inside) % len(shrink_layers(model)) == 0  # every LoRA layer's shrink took a workspace view
    alloc, gen = BlockAllocator(16), torch.Generator().manual_seed(3)
    lens, tables = [3, 6, 5], []
    for n in lens:
        tables.append(alloc.allocate(-(-(n + 1) // BLOCK)))
        attn = AttentionMetadata.build([n], [0], [tables[-1]], BLOCK, "cuda")
        model.forward(torch.randint(0, cfg.vocab_size, (n,), generator=gen).cuda(), attn.positions, attn, kv, None)
    ids, slots = [5, 7, 11], [2, -1, 0]
    want = _eager_decode(model, kv, ids, lens, tables, slots).clone()
    first = graphs.run(DecodeBatch(ids, lens, tables, slots)).clone()
    assert ((first - want).norm() / want.norm()).item() < 2e-2
    for _ in range(2):  # two partial sums add the same either way round: replays agree bit for bit
        assert torch.equal(graphs.run(DecodeBatch(ids, lens, tables, slots)), first)


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


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_lora_shrink_on_the_side_stream_equals_one_stream(hf_model, monkeypatch, tokens):
    """LinearWithLoRA forks shrink onto a side stream on CUDA; the result must be the one-stream one."""
    _cuda_or_skip()
    from loraserve.executor import lora as lora_mod

    model = _model(hf_model, torch.bfloat16)
    layer = model.model.layers[0].mlp.gate_up_proj
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(tokens, layer.in_features, device="cuda", dtype=torch.bfloat16, generator=gen)
    slots = torch.randint(-1, MAX_LORAS, (tokens,), device="cuda", generator=gen)
    forked = layer(x, _meta(slots))
    torch.cuda.synchronize()
    monkeypatch.setattr(lora_mod, "_side_stream", lambda device: None)
    one_stream = layer(x, _meta(slots))
    torch.testing.assert_close(forked, one_stream, atol=0, rtol=0)


@pytest.mark.parametrize(
    "device, max_seqs, by_kernel",
    [
        ("cpu", 5, False),
        ("cpu", 80, False),
        pytest.param("cuda", 5, False, marks=pytest.mark.gpu),
        pytest.param("cuda", 5, True, marks=pytest.mark.gpu, id="cuda-5-inputs-by-kernel"),
    ],
)
def test_mixed_graph_step_equals_the_eager_step(hf_model, device, max_seqs, by_kernel, monkeypatch):
    """Mixed steps from the static buffer (MixedGraphs: captured on CUDA, run directly on the CPU):
    a decode row, a chunk after cached context that samples nothing, new prompts, adapter and base
    rows, steps padded to their token bucket and to the graphs' sequence count, and a base-only step:
    logits and the K/V written are the eager step's. max_seqs 80: more
    sequences than bucket 64 has tokens, so that bucket's graph computes only 64 rows of logits."""
    from loraserve.executor.engine.graphs import MixedBatch, MixedGraphs
    from loraserve.executor.engine.step import StepInputs, forward_step

    if device == "cuda":
        _cuda_or_skip()
    if not by_kernel:  # as where pinned memory has no device view (the CPU copies either way)
        _without_device_views(monkeypatch)
    dtype, tol = (torch.bfloat16, 3e-2) if device == "cuda" else (torch.float32, 1e-4)
    model = _model(hf_model, dtype, device)
    cfg = model.cfg
    kv = KVCache(cfg.num_layers, 96, BLOCK, cfg.num_kv_heads, cfg.head_dim, dtype, device)
    mixed = MixedGraphs(model, kv, max_tokens=96, max_seqs=max_seqs, max_model_len=96, max_loras=MAX_LORAS, device=device)
    assert mixed.buckets == [64, 96]
    if device == "cuda":
        mixed.capture()
    alloc, gen = BlockAllocator(96), torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()  # noqa: E731
    cached = [5, 4, 9, 0, 0, 7, 0]  # tokens each sequence has in the cache before the cases
    tables = [
        alloc.allocate(-(-(n + 72) // BLOCK)) if i in (4, 6) else alloc.allocate(-(-(n + 8) // BLOCK))
        for i, n in enumerate(cached)
    ]
    for n, table in zip(cached, tables):
        if n:
            attn = AttentionMetadata.build([n], [0], [table], BLOCK, device)
            model.forward(torch.tensor(rand(n), device=device), attn.positions, attn, kv, None)
    cases = [  # (sequence, query length, slot, samples) per sequence of the step
        [(0, 1, 2, True), (1, 6, -1, False), (3, 7, 0, True)],  # 14 tokens: bucket 64, 3 of 5 sequences
        [(4, 70, 1, True), (2, 1, 3, True), (5, 1, -1, True)],  # 72 tokens: bucket 96
        [(6, 65, -1, True)],  # base only: the graph without LoRA
    ]
    caches = kv.k_cache + kv.v_cache
    for case in cases:
        ids, q_lens, ctx, seq_tables, slots, rows, row_slots = [], [], [], [], [], [], []
        for seq, q, slot, samples in case:
            ids += rand(q)
            q_lens.append(q)
            ctx.append(cached[seq])
            seq_tables.append(tables[seq])
            slots += [slot] * q
            if samples:
                rows.append(len(ids) - 1)
                row_slots.append(slot)
        before = [c.clone() for c in caches]
        ranks = [RANK] * MAX_LORAS  # each slot's adapter rank, as the engine passes them (a packed B is read at it)
        got = mixed.run(MixedBatch(ids, q_lens, ctx, seq_tables, slots, rows, row_slots, ranks)).clone()
        after_graph = [c[: kv.num_blocks].clone() for c in caches]
        for c, old in zip(caches, before):
            c.copy_(old)
        want = forward_step(
            model,
            kv,
            StepInputs(ids, q_lens, ctx, seq_tables, slots, rows, row_slots, slot_ranks=ranks),
            MAX_LORAS,
            torch.device(device),
        )
        assert got.shape == want.shape and torch.isfinite(got).all()
        err = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert err < tol, f"step {case}: relative error {err:.2e}"
        for c, g in zip(caches, after_graph):  # the same keys and values, where the eager step wrote them
            torch.testing.assert_close(g, c[: kv.num_blocks], atol=tol, rtol=tol)
        for seq, q, _, _ in case:
            cached[seq] += q
    assert bool(getattr(mixed, "_mapped", None)) == by_kernel  # the inputs went the way asked
    for h in mixed._hosts if by_kernel else ():  # each a view of its pinned buffer, not a copy of it
        assert mixed._mapped[h.data_ptr()].data_ptr() == h.data_ptr()
    with pytest.raises(ValueError, match="sequence of 30 tokens needs more than its 2 blocks"):
        mixed.stage(MixedBatch(rand(30), [30], [0], [[0, 1]], [-1] * 30, [29], [-1]))  # a table too short


def test_prefill_work_list_covers_every_query_block_once():
    from loraserve.kernels.attention_plan import prefill_work_list

    work = prefill_work_list([3, 70, 0, 33, 1], queries=32, capacity=12)
    real = work[work[:, 0] >= 0]
    assert sorted(map(tuple, real.tolist())) == [(0, 0), (1, 0), (1, 1), (1, 2), (3, 0), (3, 1), (4, 0)]
    assert (work[len(real) :] == [-1, 0]).all()  # the rest: no work
    assert real[:4, 1].tolist() == [0, 2, 1, 0]  # each sequence's last block first (the most keys)
    with pytest.raises(ValueError, match="8 query blocks exceed the work list's 7 entries"):
        prefill_work_list([3, 70, 0, 33, 1, 1], queries=32, capacity=7)
