"""Slot loads through the one-launch scatter (kernels.slot_scatter) against the per-tensor copies.

A shard in one host buffer is staged (one copy) and scattered by a plan cached per layout
(executor/slot_load.py); a shard of separate tensors goes through SlotWrites, one copy per tensor.
Both must leave the same bytes in every slot buffer: copies, rank tails zeroed, untargeted
modules zeroed. The modules cover every slot buffer shape: fused and plain linear layers, a fully
sharded column layer (B's rank in 2 parts) and row layer, an embedding and MoE experts.

The plain-PyTorch scatter runs everywhere; the Triton kernel on CUDA (pytest -m gpu), or on the CPU
under Triton's interpreter (TRITON_INTERPRET=1, with triton installed).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from loraserve.executor import slot_load
from loraserve.executor.lora import ExpertsWithLoRA, LinearWithLoRA, VocabEmbeddingWithLoRA, lora_modules
from loraserve.executor.parallel import TPGroup
from loraserve.executor.shard_tensors import shard_signature
from loraserve.executor.slot_layout import LoraSpec, written_rank
from loraserve.executor.slot_load import clear_slot, load_shard_into_slot
from loraserve.kernels import copy_reference

from .conftest import b_packed

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.bfloat16, torch.float32]

# (slot, rank, modules absent from the shard); rank 0: an empty shard. Odd sizes everywhere; slot 2
# gets rank 8, then rank 4 (its old tail must go) without the experts; step 5 repeats step 1's layout;
# step 6 targets the fully sharded column layer alone (its rank parts decide the slot's written rank).
STEPS = [
    (0, 4, ()),
    (2, 8, ("o",)),
    (1, 6, ()),
    (2, 4, ("experts",)),
    (3, 4, ()),
    (3, 10, ("qkv", "o", "sharded_row", "embed", "experts")),
    (0, 0, ()),
]


def _modules(dtype, device, packed_b=False, fp8=False) -> nn.Module:
    """packed_b: the dense layers' B packed at each slot's rank (CUDA's layout) on any device.
    fp8: the dense layers' slots in FP8 (--lora-dtype fp8), the embedding's and experts' in dtype."""
    spec = LoraSpec(max_loras=4, max_rank=16, dtype=dtype, fully_sharded=True, fp8=fp8)
    tp2 = TPGroup(size=2, rank=0)  # only the slot buffers' shapes are used: no process group needed
    with b_packed(packed_b):
        model = nn.ModuleDict({
            "qkv": LinearWithLoRA(24, (20, 12, 12), False, spec, dtype, device),
            "o": LinearWithLoRA(20, (24,), False, spec, dtype, device, row_parallel=True),
            "sharded_col": LinearWithLoRA(24, (14, 14), False, spec, dtype, device, tp=tp2),  # rank_parts 2
            "sharded_row": LinearWithLoRA(24, (14,), False, spec, dtype, device, tp=tp2, row_parallel=True),
            "embed": VocabEmbeddingWithLoRA(37, 24, spec, dtype, device),
            "experts": ExpertsWithLoRA(3, 24, (10, 10), spec, dtype, device),
        })  # fmt: skip
    assert model["sharded_col"].rank_parts == 2
    assert [m.packed_b for m in model.values() if isinstance(m, LinearWithLoRA)] == [packed_b, packed_b, False, False]
    torch.manual_seed(0)
    for m in lora_modules(model).values():  # stale contents: every write must be a copy or a zero
        m.lora_a.copy_(torch.randn(m.lora_a.shape))
        m.lora_b.copy_(torch.randn(m.lora_b.shape))
        if m.fp8_slots:
            m.lora_a_scale.copy_(torch.rand(m.lora_a_scale.shape))
            m.lora_b_scale.copy_(torch.rand(m.lora_b_scale.shape))
        m.slot_ranks[:] = [m.lora_a.shape[m.slot_rank_dim + 1]] * len(m.slot_ranks)  # ... at every rank position
    return model


def _shard(model, rank: int, absent=(), seed=0) -> dict[str, torch.Tensor]:
    if rank == 0:
        return {}
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, m in lora_modules(model).items():
        if name in absent:
            continue
        for part, buf, r in (("lora_a", m.lora_a, rank // m.rank_parts), ("lora_b", m.lora_b, rank)):
            shape = list(buf.shape[1:])
            shape[m.slot_rank_dim] = r
            out[f"{name}.{part}"] = torch.randn(shape, generator=gen).to(m.shard_dtype or buf.dtype)
    return out


def _one_buffer(tensors: dict[str, torch.Tensor], pin: bool) -> dict[str, torch.Tensor]:
    """The tensors as views of one host buffer, packed at their own alignment only (as a shard lands)."""
    offsets, total = {}, 0
    for name, t in tensors.items():
        total = -(-total // t.element_size()) * t.element_size()
        offsets[name], total = total, total + t.nbytes
    blob = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    out = {}
    for name, t in tensors.items():
        out[name] = blob[offsets[name] : offsets[name] + t.nbytes].view(t.dtype).view(t.shape)
        out[name].copy_(t)
    return out


def _assert_same(got, want):
    """The same bytes in every slot buffer (an FP8 module's scales too) and the same slot ranks."""
    for (name, a), b in zip(lora_modules(got).items(), lora_modules(want).values()):
        parts = ("lora_a", "lora_b", "lora_a_scale", "lora_b_scale") if a.fp8_slots else ("lora_a", "lora_b")
        for part in parts:
            x, y = getattr(a, part).cpu(), getattr(b, part).cpu()
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), f"{name}.{part}"
        assert a.slot_ranks == b.slot_ranks, name


def _check_against_per_tensor_copies(scatter, dtype, device, packed_b=False, fp8=False):
    """Every STEP into `new` (one buffer, scattered) and `old` (separate tensors, per-tensor copies).
    packed_b: q/k/v's and o's B packed at each slot's rank (CUDA's layout); the stale contents
    past their packed rows must be left alike too. fp8: the dense layers' slots FP8 (quantized,
    SlotWrites), the embedding's and experts' scattered."""
    new, old = _modules(dtype, device, packed_b, fp8), _modules(dtype, device, packed_b, fp8)
    pin = torch.device(device).type == "cuda"
    for i, (slot, rank, absent) in enumerate(STEPS):
        shard = _shard(new, rank, absent, seed=i)
        load_shard_into_slot(new, slot, _one_buffer(shard, pin), scatter=scatter)
        load_shard_into_slot(old, slot, {k: v.to(device) for k, v in shard.items()})
        _assert_same(new, old)
        _assert_written_ranks(new)
    targets = slot_load._slot_targets(new)
    assert len(targets.layouts) == len(STEPS) - 1  # step 5 reused step 1's layout (checks and plan)
    assert all(layout.plan is not None for layout in targets.layouts.values())

    bad = _one_buffer({**_shard(new, 4), "qkv.lora_b": torch.zeros(44, 17, dtype=dtype)}, pin)
    with pytest.raises(ValueError, match="qkv.lora_b"):
        load_shard_into_slot(new, 3, bad, scatter=scatter)
    _assert_same(new, old)  # nothing was written

    clear_slot(lora_modules(new).values(), 2, scatter=scatter)
    for m in lora_modules(old).values():
        m.reset_lora(2)
    _assert_same(new, old)
    _assert_written_ranks(new)


def _assert_written_ranks(model):
    """The slot targets' written rank (read on a cold load's path from their own slot-rank lists)
    is the modules' own, in every slot (a fully sharded module counting its parts)."""
    targets = slot_load._slot_targets(model)
    for slot in range(len(next(iter(targets.modules.values())).slot_ranks)):
        assert targets.written_rank(slot) == written_rank(targets.modules.values(), slot), slot


@pytest.mark.parametrize("packed_b", [False, True], ids=["b-rows", "b-packed"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_scatter_matches_per_tensor_copies(dtype, packed_b):
    _check_against_per_tensor_copies(copy_reference.slot_scatter, dtype, "cpu", packed_b)


@pytest.mark.gpu
@pytest.mark.parametrize("packed_b", [False, True], ids=["b-rows", "b-packed"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_scatter_matches_per_tensor_copies_interpreted(dtype, packed_b):
    """The Triton kernel, run by Triton's interpreter on CPU tensors."""
    if not INTERPRET:
        pytest.skip("runs the Triton kernel on the CPU: set TRITON_INTERPRET=1 (triton installed)")
    triton_copy = pytest.importorskip("loraserve.kernels.triton_copy", reason="needs triton installed")
    _check_against_per_tensor_copies(triton_copy.slot_scatter, dtype, "cpu", packed_b)


@pytest.mark.gpu
@pytest.mark.parametrize("packed_b", [False, True], ids=["b-rows", "b-packed"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_slot_loads_are_one_scatter_and_match_per_tensor_copies(dtype, packed_b, monkeypatch):
    """On CUDA the default path: a pinned shard staged in one non-blocking copy, then
    kernels.slot_scatter (Triton), once per load and once per clear; equal to per-tensor copies
    (packed_b: B at each slot's rank, the CUDA default; rows: as where the slot rank is no multiple of 8)."""
    if not torch.cuda.is_available() or INTERPRET:
        pytest.skip("needs CUDA + Triton: no CUDA device here (run benchmarks/gpu.sh OUT test on a CUDA host)")
    pytest.importorskip("triton", reason="needs CUDA + Triton: triton is not installed")
    from loraserve import kernels

    calls = []
    scatter = kernels.slot_scatter
    monkeypatch.setattr(kernels, "slot_scatter", lambda *args: calls.append(args[2]) or scatter(*args))
    _check_against_per_tensor_copies(None, dtype, "cuda", packed_b)
    torch.cuda.synchronize()
    # Every load into the model under test and the clear: one scatter each. The per-tensor model's
    # loads fall back (device tensors), except its empty shard (step 5), a clear: one scatter too.
    loads = [slot for slot, _, _ in STEPS]
    assert calls == loads + [STEPS[-1][0], 2]


@pytest.mark.parametrize("packed_b", [False, True], ids=["b-rows", "b-packed"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_slots_keep_the_scatter_for_the_modules_in_the_adapter_dtype(dtype, packed_b):
    """--lora-dtype fp8: the dense layers' slots are quantized and copied (SlotWrites), the embedding's
    and the experts' (adapter dtype) scattered from the same staged shard, one scatter per load and
    per clear over their buffers only; the same bytes as per-tensor copies throughout."""
    plans = []

    def scatter(plan, src, slot):
        plans.append(plan)
        copy_reference.slot_scatter(plan, src, slot)

    _check_against_per_tensor_copies(scatter, dtype, "cpu", packed_b, fp8=True)
    assert len(plans) == len(STEPS) + 1  # every load and the clear
    model = _modules(dtype, "cpu", packed_b, fp8=True)
    plain = {id(b) for n in ("embed", "experts") for b in (model[n].lora_a, model[n].lora_b)}
    load_shard_into_slot(model, 1, _one_buffer(_shard(model, 4), False), scatter=scatter)
    clear_slot(lora_modules(model).values(), 1, scatter=scatter)
    for plan in plans[-2:]:
        assert {id(c.dst) for c in plan.copies} == plain


def test_resizing_the_slots_drops_the_cached_plans_that_hold_the_old_buffers():
    """resize_slots (executor/memory.py) re-creates the slot buffers: the slot-load caches must not
    keep the old ones alive, and a load after it writes the new ones."""
    import weakref

    from loraserve.executor.memory import resize_slots

    model = _modules(torch.float32, "cpu")
    model.lora_spec = LoraSpec(max_loras=4, max_rank=16, dtype=torch.float32, fully_sharded=True)
    load_shard_into_slot(model, 1, _one_buffer(_shard(model, 4), False), scatter=copy_reference.slot_scatter)
    clear_slot(lora_modules(model).values(), 2, scatter=copy_reference.slot_scatter)
    old = weakref.ref(model["qkv"].lora_a)
    assert slot_load._TARGETS_ATTR in vars(model)
    resize_slots(model, lora_modules(model), 3)
    assert slot_load._TARGETS_ATTR not in vars(model) and old() is None  # freed at once
    load_shard_into_slot(model, 2, _one_buffer(_shard(model, 4), False), scatter=copy_reference.slot_scatter)
    assert model["qkv"].lora_a.shape[0] == 3 and model["qkv"].slot_ranks[2] == 4


def test_a_load_zeroes_only_what_the_slots_previous_adapter_wrote():
    """Rank-r over rank-r moves r rank positions per row and no zeros; over a larger rank it zeroes
    the old tail, and nothing past it; a clear covers the written positions only (none after a
    clear). Same bytes as per-tensor copies throughout."""
    new, old = _modules(torch.float32, "cpu"), _modules(torch.float32, "cpu")
    plans = []

    def scatter(plan, src, slot):
        plans.append(plan)
        copy_reference.slot_scatter(plan, src, slot)

    def written(plan):  # elements written per row position: (source, zeros) over all copies
        return sum(c.rows * c.src_cols for c in plan.copies), sum(c.rows * (c.fill - c.src_cols) for c in plan.copies)

    def load(rank, seed):
        shard = _shard(new, rank, seed=seed)
        load_shard_into_slot(new, 1, _one_buffer(shard, False), scatter=scatter)
        load_shard_into_slot(old, 1, shard)
        _assert_same(new, old)
        return written(plans[-1])

    src4, zeros = load(4, 0)  # the slot was stale at every rank position: all zeroed
    assert zeros > 0
    assert load(4, 1) == (src4, 0)  # rank 4 over rank 4: only its own bytes
    src8, _ = load(8, 2)
    src4_again, tail = load(4, 3)  # rank 4 over rank 8: the old tail 4..8 zeroed, nothing past it
    assert src4_again == src4 and tail == src8 - src4
    clear_slot(lora_modules(new).values(), 1, scatter=scatter)
    for m in lora_modules(old).values():
        m.reset_lora(1)
    _assert_same(new, old)
    assert written(plans[-1]) == (0, src4)  # the clear zeroes the rank-4 positions only
    n = len(plans)
    clear_slot(lora_modules(new).values(), 1, scatter=scatter)
    assert written(plans[n]) == (0, 0)  # nothing written since: nothing to zero
    assert load(4, 4) == (src4, 0)


def test_a_shards_signature_is_worked_out_once_and_its_layout_key_shared():
    """A ShardTensors keeps its signature (the CPU cache works it out as the shard lands), so its
    slot loads skip it; shards of one layout share one key object, found by identity."""
    from loraserve.executor.shard_tensors import ShardTensors

    model = _modules(torch.float32, "cpu")
    one, two = (ShardTensors(_one_buffer(_shard(model, 4, seed=s), False)) for s in (0, 1))
    sig = shard_signature(one)
    assert one.signature is sig and shard_signature(one) is sig
    assert shard_signature(two)[0] is sig[0]  # same layout: the same key object
    load_shard_into_slot(model, 1, one, scatter=copy_reference.slot_scatter)
    load_shard_into_slot(model, 2, two, scatter=copy_reference.slot_scatter)
    assert len(slot_load._slot_targets(model).layouts) == 1
    plain = _one_buffer(_shard(model, 4, seed=2), False)  # a plain dict: worked out on each load, nothing kept
    assert shard_signature(plain)[0] is sig[0] and not hasattr(plain, "signature")


def test_a_changed_or_copied_shard_does_not_keep_its_signature():
    """The kept signature names host addresses, the kept `pinned` their memory: a changed dict drops
    both, a copy carries neither (its tensors live elsewhere), and a load of the copy reads the
    copy's bytes. No load on the CPU counts as queued-only (it copies bytes, on a thread)."""
    import copy
    import pickle

    from loraserve.executor.shard_tensors import ShardTensors

    model, ref = _modules(torch.float32, "cpu"), _modules(torch.float32, "cpu")
    shard = ShardTensors(_one_buffer(_shard(model, 4, seed=0), False))
    shard_signature(shard)
    shard.pinned = True  # as the CPU cache marks a CUDA executor's shard
    for other in (copy.copy(shard), copy.deepcopy(shard), pickle.loads(pickle.dumps(shard))):
        assert type(other) is ShardTensors and other.keys() == shard.keys()
        assert not hasattr(other, "signature") and not hasattr(other, "pinned")
    deep = copy.deepcopy(shard)
    shard.clear()  # the original's buffer may go; the copy loads from its own
    load_shard_into_slot(model, 1, deep, scatter=copy_reference.slot_scatter)
    load_shard_into_slot(ref, 1, dict(deep))
    _assert_same(model, ref)
    changed = ShardTensors(_one_buffer(_shard(model, 4, seed=1), False))
    shard_signature(changed)
    changed.pinned = True
    changed["qkv.lora_a"] = changed["qkv.lora_a"].clone()
    assert not hasattr(changed, "signature") and not hasattr(changed, "pinned")
    shard_signature(deep)
    deep.pinned = True
    assert not slot_load.queued_load(model, 1, deep)  # CPU slot buffers: the copy is host work
    with pytest.raises(ValueError, match="not inside their host buffer"):
        slot_load._staged(torch.empty(16, dtype=torch.uint8).untyped_storage(), 0, 16, torch.device("cpu"), torch.uint8)


def test_a_staged_shard_arrives_whole_in_one_copy(monkeypatch):
    """slot_load._staged copies a shard's bytes to the device in one copy: every byte of
    [lo, lo + nbytes) arrives, none from outside it, viewed as the shard's dtype."""
    host = torch.arange(64, dtype=torch.uint8)
    storage = host.untyped_storage()
    copies, copy = [], torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda dst, src, **kw: copies.append(src.numel()) or copy(dst, src, **kw))
    got = slot_load._staged(storage, storage.data_ptr() + 5, 30, torch.device("cpu"), torch.uint8)
    assert got.tolist() == list(range(5, 35)) and copies == [30]
    halves = slot_load._staged(storage, storage.data_ptr() + 4, 32, torch.device("cpu"), torch.float16)
    assert halves.shape == (16,) and halves.view(torch.uint8).tolist() == list(range(4, 36))


@pytest.mark.parametrize("one_buffer", [True, False], ids=["scatter-plan", "per-tensor"])
def test_a_packed_b_is_laid_out_at_the_slot_s_rank_not_its_module_s(one_buffer):
    """A shard whose modules differ in rank (q/k/v 4, the rest 12): the slot's rank is 12, which the
    kernels read every module's packed B at, so q/k/v's B is laid out at 16 (12 rounded up to 8),
    its rows zero past 4. The layer's LoRA delta, read back that way, is the shard's own."""
    from loraserve.kernels import make_lora_meta, reference

    model = _modules(torch.float32, "cpu", packed_b=True)
    shard = _shard(model, 12, seed=1)
    low = _shard(model, 4, seed=2)
    shard["qkv.lora_a"], shard["qkv.lora_b"] = low["qkv.lora_a"], low["qkv.lora_b"]
    src = _one_buffer(shard, False) if one_buffer else shard
    assert load_shard_into_slot(model, 1, src, scatter=copy_reference.slot_scatter) == 12
    m = model["qkv"]
    assert m.slot_ranks[1] == 4
    x = torch.randn(5, m.in_features, generator=torch.Generator().manual_seed(3))
    meta = make_lora_meta(torch.ones(5, dtype=torch.int32), 4, slot_ranks=torch.tensor([0, 12, 0, 0], dtype=torch.int32))
    buf = reference.lora_shrink(x, m.lora_a, meta)
    got = reference.lora_expand(torch.zeros(5, m.slice_offsets[-1]), buf, m.lora_b, m.slice_offsets, meta, packed=True)
    a, b = shard["qkv.lora_a"], shard["qkv.lora_b"]  # [S, 4, in], [N, 4]
    want = torch.cat([x @ a[s].T @ b[m.slice_offsets[s] : m.slice_offsets[s + 1]].T for s in range(a.shape[0])], dim=1)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("packed_b", [True, False], ids=["b-packed", "b-rows"])
def test_a_worker_rank_refuses_its_packed_shard_at_another_rank_than_rank_0s(packed_b):
    """executor/ranks.py _Rank._load_slot: each step tells the tensor-/expert-parallel ranks the rank
    rank 0 loaded a slot at, which their kernels then read it at. A rank whose own shard of the
    adapter loads at another rank would read its packed B wrong, so its load fails naming the slot,
    the adapter and both ranks; at rank 0's rank it loads. B in rows is read at any rank: no check."""
    import asyncio
    import threading

    from loraserve.executor.ranks import _Rank

    rank = object.__new__(_Rank)  # the load's parts only: no process group, no store
    rank.model = _modules(torch.float32, "cpu", packed_b)
    rank.modules, rank.packed, rank.slots = lora_modules(rank.model), packed_b, [("", "")] * 4
    rank.loop = asyncio.new_event_loop()
    threading.Thread(target=rank.loop.run_forever, daemon=True).start()
    shard = _shard(rank.model, 8)

    async def fetch(name, digest):
        return shard

    rank._fetch = fetch
    try:
        version = ("acme", "0123456789abcdef")
        if packed_b:
            with pytest.raises(RuntimeError) as e:
                rank._load_slot(2, version, rank0_rank=16)
            assert str(e.value) == (
                "slot 2: this rank's shard of 'acme' (0123456789ab) has rank 8, rank 0's 16: "
                "its packed B would be read at the wrong rank"
            )
            assert rank.slots[2] == ("", "")
        else:
            rank._load_slot(2, version, rank0_rank=16)
            assert rank.slots[2] == version
        rank._load_slot(1, version, rank0_rank=8)
        assert rank.slots[1] == version
    finally:
        rank.loop.call_soon_threadsafe(rank.loop.stop)
