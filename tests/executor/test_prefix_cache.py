"""Prefix caching without a model: the block keys, the allocator's reference counts and LRU of
cached blocks, and the scheduler's admissions after a cached prefix."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from loraserve.errors import StatusError
from loraserve.executor.engine.kv_cache import BlockAllocator
from loraserve.executor.engine.prefix_cache import KVFormat, chain_seed, extend_keys
from loraserve.executor.engine.scheduler import Scheduler, Sequence

BLOCK = 4
FMT = KVFormat("llama", "tiny", "bfloat16", "bfloat16", "bfloat16", "bfloat16", BLOCK)
BASE = chain_seed(FMT)
A1 = chain_seed(FMT, "a1", "sha256:1111")
_ids = itertools.count()


def _keys(seed: bytes, tokens: list[int], num_blocks: int = 99) -> list[bytes]:
    keys: list[bytes] = []
    extend_keys(keys, seed, tokens, BLOCK, num_blocks)
    return keys


def test_keys_chain_over_full_blocks_and_depend_on_everything_before():
    tokens = list(range(1, 11))  # 2 full blocks + 2 tokens
    keys = _keys(BASE, tokens)
    assert len(keys) == 2 and len(set(keys)) == 2
    assert _keys(BASE, tokens + [5, 6]) == keys + _keys(BASE, tokens + [5, 6])[2:]  # appending keeps the old keys
    changed = [99] + tokens[1:]
    assert not set(_keys(BASE, changed)) & set(keys)  # block 0 differs: every later key differs
    assert _keys(BASE, tokens[:4] + [0, 0, 0, 0])[0] == keys[0]
    assert _keys(BASE, tokens, num_blocks=1) == keys[:1]


def _with(**fields) -> KVFormat:
    return dataclasses.replace(FMT, **fields)


def test_keys_differ_by_adapter_version_and_every_format_field():
    tokens = list(range(1, 9))
    seeds = [
        BASE,
        A1,
        chain_seed(FMT, "a2", "sha256:1111"),  # same content, another name
        chain_seed(FMT, "a1", "sha256:2222"),  # a1 re-registered: new content
        chain_seed(_with(model="/models/mistral")),
        chain_seed(_with(base_model="mistral")),
        chain_seed(_with(dtype="float16")),  # the compute dtype, under an FP8 cache not seen in kv_dtype
        chain_seed(_with(weights="float8_e4m3fn")),  # --quantization fp8
        chain_seed(_with(weights="float8_e4m3fn of fp8 (per-tensor weight scales)")),  # an FP8 checkpoint
        chain_seed(_with(weights="bfloat16 of fp8 (per-tensor weight scales)")),  # the same, dequantized
        chain_seed(_with(lora_dtype="float8_e4m3fn"), "a1", "sha256:1111"),  # --lora-dtype fp8
        chain_seed(_with(kv_dtype="float8_e4m3fn with scales 1.0")),
        chain_seed(_with(kv_dtype="float8_e4m3fn with the checkpoint's scales")),
        chain_seed(_with(block_size=8)),
    ]
    assert {f.name for f in dataclasses.fields(KVFormat)} == {
        "model", "base_model", "dtype", "weights", "lora_dtype", "kv_dtype", "block_size"
    }  # fmt: skip
    chains = [_keys(seed, tokens) for seed in seeds]
    assert len({k for chain in chains for k in chain}) == 2 * len(seeds)
    assert _keys(A1, tokens) == chains[1]  # and the same inputs give the same keys


def test_only_the_weight_format_or_only_the_lora_dtype_changes_the_seed():
    """Executors alike but for their base weights' format, or their LoRA slots' dtype, never publish
    the same keys (kv_events.py); the slots' dtype leaves the base model's seed alone: its KV never
    passes through a slot."""
    fp8_weights = _with(weights="float8_e4m3fn")
    fp8_slots = _with(lora_dtype="float8_e4m3fn")
    assert chain_seed(fp8_weights) != BASE
    assert chain_seed(fp8_weights, "a1", "sha256:1111") != A1
    assert chain_seed(fp8_slots, "a1", "sha256:1111") != A1
    assert chain_seed(fp8_slots) == BASE


def test_a_placeholder_token_stops_the_keys_before_its_block():
    tokens = list(range(1, 9)) + [3, 4, 5, -1]
    assert len(_keys(BASE, tokens)) == 2


def test_allocator_shares_by_reference_and_keeps_freed_cached_blocks_until_needed():
    alloc = BlockAllocator(4)
    a, b = alloc.allocate(2)
    alloc.cache(a, b"ka")
    alloc.share([a])
    assert alloc.refs(a) == 2 and alloc.num_free == 2
    alloc.free([a, b])
    assert alloc.refs(a) == 1 and alloc.refs(b) == 0
    alloc.free([a])
    assert alloc.num_free == 4 and alloc.num_held == 0
    assert alloc.lookup(b"ka") == a  # freed, still findable
    assert alloc.num_unheld([a]) == 1
    # Unkeyed blocks go first: the cached one survives an allocation of the other three.
    got = alloc.allocate(3)
    assert a not in got and alloc.lookup(b"ka") == a
    # Then the cached one is evicted, and its key with it.
    assert alloc.allocate(1) == [a] and alloc.lookup(b"ka") is None
    with pytest.raises(StatusError, match="1 blocks wanted, 0 free of 4"):
        alloc.allocate(1)


def test_allocator_evicts_the_least_recently_freed_and_a_chains_tail_first():
    alloc = BlockAllocator(4)
    blocks = alloc.allocate(4)
    for i, block in enumerate(blocks):
        alloc.cache(block, bytes([i]))
    alloc.free(blocks[2:])  # the older sequence: tail block 3 freed before block 2
    alloc.free(blocks[:2])
    assert alloc.allocate(1) == [blocks[3]]
    assert alloc.allocate(1) == [blocks[2]]
    alloc.share([blocks[0]])  # a hit takes a cached block back out of the LRU
    assert alloc.allocate(1) == [blocks[1]]
    assert alloc.num_free == 0 and alloc.lookup(bytes([0])) == blocks[0]


def test_allocator_refuses_bad_bookkeeping():
    alloc = BlockAllocator(2)
    with pytest.raises(ValueError, match="block 0 freed but not allocated"):
        alloc.free([0])
    with pytest.raises(ValueError, match="block 1 cached but not allocated"):
        alloc.cache(1, b"k")
    (b,) = alloc.allocate(1)
    alloc.cache(b, b"k")
    (c,) = alloc.allocate(1)
    alloc.cache(c, b"k")  # the key keeps its first block
    assert alloc.lookup(b"k") == b
    alloc.free([c])
    alloc.free([b])
    assert alloc.num_cached == 1


def _seq(tokens: list[int], seed: bytes | None = BASE) -> Sequence:
    seq = Sequence(next(_ids), list(tokens), len(tokens))
    seq.cache_seed = seed
    return seq


def _run_to_end(sched: Scheduler, seqs, max_steps: int = 100, next_token: int = 7) -> None:
    """Steps until each of seqs has computed its prompt and one sampled token; files what the steps computed."""
    for _ in range(max_steps):
        plan = sched.schedule()
        sched.cache_computed(plan)
        for s in plan.seqs:
            if s.needs_sample:
                sched.append_token(s.seq, next_token)
                if s.seq.num_output_tokens >= 2:
                    sched.finish(s.seq)
        if all(seq.finished for seq in seqs):
            return
    raise AssertionError("sequences did not finish")


def test_an_admission_starts_after_the_cached_prefix_and_spends_budget_on_the_rest_only():
    sched = Scheduler(BlockAllocator(32), BLOCK, 8, 8)
    prompt = list(range(1, 19))  # 4 full blocks + 2 tokens
    first = _seq(prompt)
    sched.add(first)
    _run_to_end(sched, [first])
    assert first.num_cached_tokens == 0
    second = _seq(prompt[:16] + [50, 51, 52])
    sched.add(second)
    plan = sched.schedule()
    (s,) = plan.seqs
    assert (s.context_len, s.num_tokens, s.needs_sample) == (16, 3, True)
    assert second.num_cached_tokens == 16
    assert second.block_table[:4] == first_blocks(sched, prompt)
    assert all(sched.allocator.refs(b) == 1 for b in second.block_table)


def first_blocks(sched: Scheduler, prompt: list[int]) -> list[int]:
    return [sched.allocator.lookup(k) for k in _keys(BASE, prompt)]


def test_a_block_aligned_prompt_computes_its_last_block_again_into_a_block_of_its_own():
    sched = Scheduler(BlockAllocator(32), BLOCK, 8, 32)
    prompt = list(range(1, 13))  # exactly 3 blocks
    first = _seq(prompt)
    sched.add(first)
    _run_to_end(sched, [first])
    cached = first_blocks(sched, prompt)
    second = _seq(prompt)
    sched.add(second)
    (s,) = sched.schedule().seqs
    assert (s.context_len, s.num_tokens) == (8, 4)  # the last token's block is not taken from the cache
    assert second.block_table[:2] == cached[:2] and second.block_table[2] not in cached


def test_other_adapters_and_versions_never_share_blocks():
    sched = Scheduler(BlockAllocator(64), BLOCK, 8, 64)
    prompt = list(range(1, 14))
    a2 = chain_seed(FMT, "a1", "sha256:2222")
    seqs = [_seq(prompt, seed) for seed in (BASE, A1, a2)]
    for seq in seqs:
        sched.add(seq)
        _run_to_end(sched, [seq])
    assert [seq.num_cached_tokens for seq in seqs] == [0, 0, 0]
    again = [_seq(prompt, seed) for seed in (BASE, A1, a2, None)]
    for seq in again:
        sched.add(seq)
    plan = sched.schedule()
    assert [s.context_len for s in plan.seqs] == [12, 12, 12, 0]
    tables = [set(seq.block_table[:3]) for seq in again[:3]]
    assert not (tables[0] & tables[1] or tables[0] & tables[2] or tables[1] & tables[2])


def test_a_hit_that_needs_more_blocks_than_are_free_changes_nothing():
    sched = Scheduler(BlockAllocator(6), BLOCK, 8, 64)
    prompt = list(range(1, 14))  # 4 blocks with the sampled token
    first = _seq(prompt)
    sched.add(first)
    _run_to_end(sched, [first])
    hog = _seq(list(range(100, 109)))  # takes the 3 unkeyed blocks: the 3 free ones are the cached prefix
    sched.add(hog)
    sched.schedule()
    second = _seq(prompt[:12] + list(range(60, 72)))  # its 3 hits take every free block, and it needs 3 more
    sched.add(second)
    free_before = sched.allocator.num_free
    plan = sched.schedule()
    assert second not in [s.seq for s in plan.seqs] and second.block_table == []
    assert sched.allocator.num_free == free_before


def test_a_plan_voided_by_preemption_files_nothing():
    sched = Scheduler(BlockAllocator(32), BLOCK, 8, 32)
    seq = _seq(list(range(1, 10)))
    sched.add(seq)
    plan = sched.schedule()
    sched._preempt(seq, plan)  # as a plan launched ahead of the collect would
    sched.cache_computed(plan)
    assert sched.allocator.num_cached == 0


def test_a_thousand_mixed_requests_with_cancels_and_preemptions_leave_no_block_held():
    rng = random.Random(0)
    sched = Scheduler(BlockAllocator(24), BLOCK, 6, 24)
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.choice([4, 8, 12]))] for _ in range(5)]
    seeds = [BASE, A1, None]
    live: list[Sequence] = []
    started = preempted = cancelled = hits = 0
    while started < 1000 or live:
        while started < 1000 and len(live) < 10:
            prompt = rng.choice(prefixes) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 6))]
            seq = _seq(prompt, rng.choice(seeds))
            sched.add(seq)
            live.append(seq)
            started += 1
        plan = sched.schedule()
        preempted += len(plan.preempted)
        if rng.random() < 0.3:  # a step that failed or whose sequences ended before it completed
            sched.cache_computed(plan)
        for s in plan.seqs:
            if s.needs_sample and not s.seq.finished:
                sched.append_token(s.seq, rng.randrange(1, 50))
                if s.seq.num_output_tokens >= rng.randrange(1, 8):
                    sched.finish(s.seq)
        for seq in list(live):
            if not seq.finished and rng.random() < 0.02:
                sched.finish(seq)  # cancelled, running or waiting
                cancelled += 1
            if seq.finished:
                hits += bool(seq.num_cached_tokens)
                live.remove(seq)
    assert preempted and cancelled and hits
    assert sched.allocator.num_held == 0 and sched.allocator.num_free == 24
    assert all(sched.allocator.refs(b) == 0 for b in range(24))
    assert not sched.has_work()


def test_dynamic_rope_files_no_block_a_grown_base_wrote_and_a_longer_prompt_takes_none():
    sched = Scheduler(BlockAllocator(32), BLOCK, 8, 64, dynamic_rope=16)
    empty = sched.schedule()
    assert not empty.seqs
    sched.cache_computed(empty)  # nothing to run: nothing filed, no error
    assert sched.allocator.num_cached == 0
    prompt = list(range(1, 10))  # 2 full blocks + 1 token
    short, long = _seq(prompt), _seq(list(range(100, 118)))  # 18 tokens > 16: its step grows the base
    sched.add(short)
    plan = sched.schedule()
    sched.cache_computed(plan)  # alone, within the length: its blocks are filed
    assert sched.allocator.num_cached == 2
    sched.append_token(short, 7)
    sched.add(long)
    mixed = _seq(list(range(40, 52)))  # 3 full blocks, computed beside the long one
    sched.add(mixed)
    plan = sched.schedule()
    assert {s.seq for s in plan.seqs} == {short, long, mixed}
    sched.cache_computed(plan)
    assert sched.allocator.num_cached == 2 and mixed.num_fileable_blocks == 0 and short.num_fileable_blocks == 2
    sched.finish(long)
    for s in plan.seqs:  # later steps within the length file nothing past the grown step's first block
        if s.seq is not long:
            sched.append_token(s.seq, 7)
    for _ in range(4):  # up to 16 tokens: steps of the unchanged base, completing blocks 2 and 3
        plan = sched.schedule()
        assert max(s.context_len + s.num_tokens for s in plan.seqs) <= 16
        sched.cache_computed(plan)
        for s in plan.seqs:
            sched.append_token(s.seq, 7)
    assert len(short.token_ids) == 15 and len(mixed.token_ids) == 17
    assert sched.allocator.num_cached == 2
    again = _seq(prompt[:8] + list(range(200, 210)))  # 18 tokens: the cached 2 blocks are not taken
    sched.add(again)
    sched.finish(short)
    sched.finish(mixed)
    (s,) = sched.schedule().seqs
    assert again.num_cached_tokens == 0 and s.context_len == 0
