"""Continuous batching decisions, with the real BlockAllocator and no model."""

from __future__ import annotations

import itertools

from loraserve.executor.engine.kv_cache import BlockAllocator
from loraserve.executor.engine.prefix_cache import KVFormat, chain_seed
from loraserve.executor.engine.scheduler import Scheduler, Sequence

BLOCK = 4
_ids = itertools.count()


def _seq(prompt_len: int, ready: bool = True) -> Sequence:
    return Sequence(next(_ids), list(range(1, prompt_len + 1)), prompt_len, is_ready=lambda: ready)


def _scheduler(num_blocks=64, max_num_seqs=8, max_tokens=32) -> Scheduler:
    return Scheduler(BlockAllocator(num_blocks), BLOCK, max_num_seqs, max_tokens)


def _step(sched: Scheduler, next_token: int = 7):
    """One schedule + the engine's part: append a sampled token to every sequence that needs one."""
    plan = sched.schedule()
    for s in plan.seqs:
        if s.needs_sample:
            sched.append_token(s.seq, next_token)
    return plan


def test_prefill_then_decode_mixes_in_one_step():
    sched = _scheduler()
    a = _seq(5)
    sched.add(a)
    plan = _step(sched)
    assert [(s.seq, s.context_len, s.num_tokens, s.needs_sample) for s in plan.seqs] == [(a, 0, 5, True)]
    b = _seq(6)
    sched.add(b)
    plan = _step(sched)
    # a decodes its sampled token at position 5 while b prefills.
    assert [(s.seq, s.context_len, s.num_tokens) for s in plan.seqs] == [(a, 5, 1), (b, 0, 6)]
    assert plan.seqs[0].query_token_ids == [7]
    assert len(a.block_table) == 2 and len(b.block_table) == 2


def test_token_budget_chunks_a_long_prefill():
    sched = _scheduler(max_tokens=8)
    a = _seq(20)
    sched.add(a)
    chunks = []
    while not (plan := _step(sched)).seqs[0].needs_sample:
        chunks.append((plan.seqs[0].context_len, plan.seqs[0].num_tokens))
    chunks.append((plan.seqs[0].context_len, plan.seqs[0].num_tokens))
    assert chunks == [(0, 8), (8, 8), (16, 4)]
    # A decode token and a new prefill share the next 8-token budget.
    b = _seq(10)
    sched.add(b)
    plan = _step(sched)
    assert [(s.seq, s.num_tokens, s.needs_sample) for s in plan.seqs] == [(a, 1, True), (b, 7, False)]
    assert plan.num_tokens == 8


def test_sequence_budget_defers_admission():
    sched = _scheduler(max_num_seqs=2)
    seqs = [_seq(3) for _ in range(3)]
    for s in seqs:
        sched.add(s)
    plan = _step(sched)
    assert [s.seq for s in plan.seqs] == seqs[:2]
    assert list(sched.waiting) == seqs[2:]
    sched.finish(seqs[0])
    plan = _step(sched)
    assert [s.seq for s in plan.seqs] == [seqs[1], seqs[2]]


def test_not_ready_adapter_does_not_block_others():
    sched = _scheduler()
    loading, ready = _seq(3, ready=False), _seq(3)
    sched.add(loading)
    sched.add(ready)
    plan = _step(sched)
    assert [s.seq for s in plan.seqs] == [ready]
    assert list(sched.waiting) == [loading]


def test_finish_frees_blocks_and_is_idempotent():
    sched = _scheduler(num_blocks=10)
    a, b = _seq(9), _seq(3)
    sched.add(a)
    sched.add(b)
    _step(sched)
    assert sched.allocator.num_free == 10 - 3 - 1
    sched.finish(a)
    sched.finish(a)
    assert sched.allocator.num_free == 10 - 1 and a.block_table == [] and a.finished
    sched.finish(b)  # cancelled
    assert sched.allocator.num_free == 10 and not sched.has_work()
    # A waiting sequence that never ran can be cancelled too.
    c = _seq(3)
    sched.add(c)
    sched.finish(c)
    assert not sched.has_work()


def test_short_blocks_defer_admission_until_blocks_free():
    sched = _scheduler(num_blocks=3)
    a, b = _seq(8), _seq(8)  # two blocks each
    sched.add(a)
    sched.add(b)
    plan = _step(sched)
    assert [s.seq for s in plan.seqs] == [a]
    assert list(sched.waiting) == [b]
    sched.finish(a)
    plan = _step(sched)
    assert [s.seq for s in plan.seqs] == [b]


def test_no_deadlock_when_blocks_run_out_during_decode():
    """Every sequence finishes although together they need far more blocks than exist."""
    num_blocks, output_len = 6, 12
    sched = _scheduler(num_blocks=num_blocks, max_num_seqs=4)
    seqs = [_seq(6) for _ in range(4)]  # 18 tokens each at the end = 5 blocks each
    for s in seqs:
        sched.add(s)
    preempted, steps = 0, 0
    while sched.has_work():
        steps += 1
        assert steps < 500, "scheduler made no progress"
        plan = _step(sched)
        assert plan.failed == []
        preempted += len(plan.preempted)
        used = sum(len(s.block_table) for s in seqs)
        assert used + sched.allocator.num_free == num_blocks
        for s in plan.seqs:
            if s.needs_sample and s.seq.num_output_tokens >= output_len:
                sched.finish(s.seq)
    assert preempted > 0
    assert all(s.num_output_tokens == output_len for s in seqs)
    assert sched.allocator.num_free == num_blocks


def test_preempted_sequence_recomputes_prompt_and_output():
    sched = _scheduler(num_blocks=2, max_num_seqs=2)
    a, b = _seq(4), _seq(4)  # one block each; each decode needs a second block
    sched.add(a)
    sched.add(b)
    _step(sched)
    plan = _step(sched)  # a grows into the last free block... b cannot: b is preempted
    assert [s.seq for s in plan.seqs] == [a] and plan.preempted == [b]
    assert b.num_computed == 0 and b.block_table == [] and sched.waiting[0] is b
    sched.finish(a)
    plan = _step(sched)
    # b recomputes its prompt and its one generated token, then samples its next token.
    assert [(s.seq, s.context_len, s.num_tokens, s.needs_sample) for s in plan.seqs] == [(b, 0, 5, True)]


def test_sequence_that_cannot_fit_alone_fails_instead_of_waiting():
    sched = _scheduler(num_blocks=1)
    a = _seq(4)
    sched.add(a)
    _step(sched)
    plan = _step(sched)  # its 5th token needs a second block that does not exist
    assert plan.failed == [a] and plan.seqs == []
    assert sched.allocator.num_free == 1 and not sched.has_work()


def _decoding(sched: Scheduler, n: int) -> list[Sequence]:
    """n sequences admitted and past their prefill: every running one decodes."""
    seqs = [_seq(3) for _ in range(n)]
    for s in seqs:
        sched.add(s)
    _step(sched)
    return seqs


def _paced(ratio: float, delay: int) -> tuple[Scheduler, list[Sequence], Sequence]:
    """A pacing scheduler with 8 sequences decoding and one more request ready to admit."""
    sched = _scheduler(max_num_seqs=16, max_tokens=64)
    sched.admit_ratio, sched.max_admit_delay = ratio, delay
    running = _decoding(sched, 8)
    ready = _seq(4)
    sched.add(ready)
    return sched, running, ready


def test_admission_pacing_gathers_ready_requests_into_one_prefill_step():
    sched, running, first = _paced(0.25, 100)
    plan = _step(sched)  # 1 ready < 0.25 x 8 running: held back, the step decodes only
    assert [s.seq for s in plan.seqs] == running and sched.deferred_steps == 1
    assert not sched.admits_now()
    second = _seq(4)
    sched.add(second)
    assert sched.admits_now()  # 2 ready = 0.25 x 8: both go in the next step, together
    plan = _step(sched)
    assert [s.seq for s in plan.seqs] == running + [first, second]
    assert sched.deferred_steps == 1


def test_admission_pacing_bounds_the_wait_of_a_lone_request():
    sched, running, lone = _paced(0.5, 3)
    waited = 0
    while lone not in [s.seq for s in _step(sched).seqs]:
        waited += 1
        assert waited <= 3, "a ready request waited past max_admit_delay steps"
    assert waited == 3 and sched.deferred_steps == 3
    assert all(s in sched.running for s in running)


def test_admission_pacing_admits_at_once_into_an_idle_batch_or_a_prefill_step():
    sched = _scheduler(max_num_seqs=16, max_tokens=64)
    sched.admit_ratio, sched.max_admit_delay = 1.0, 100
    a = _seq(4)
    sched.add(a)
    assert [s.seq for s in _step(sched).seqs] == [a]  # nothing running: no reason to wait
    long = _seq(40)
    sched.max_num_batched_tokens = 16  # long's prompt takes three steps
    sched.add(long)
    _step(sched)  # long is admitted (a prefill step: eager anyway) and prefills on
    sched.max_num_batched_tokens = 64
    b = _seq(4)
    sched.add(b)
    assert b in [s.seq for s in _step(sched).seqs]  # joins while long still prefills
    assert sched.deferred_steps == 0


def test_admission_pacing_off_admits_each_ready_request_at_once():
    sched = _scheduler(max_num_seqs=16, max_tokens=64)
    assert sched.admit_ratio == 0
    _decoding(sched, 8)
    c = _seq(4)
    sched.add(c)
    assert c in [s.seq for s in _step(sched).seqs] and sched.deferred_steps == 0


def test_admission_pacing_waits_for_free_seats_not_for_the_backlog():
    """A backlog of ready requests does not end a hold: what counts is how many of them the batch
    has seats for (else every finished sequence would cost one eager admission step)."""
    sched = _scheduler(max_num_seqs=16, max_tokens=64)
    sched.admit_ratio, sched.max_admit_delay = 0.25, 100
    running = _decoding(sched, 16)
    backlog = [_seq(4) for _ in range(10)]
    for s in backlog:
        sched.add(s)
    sched.finish(running[0])  # one seat: 1 < 0.25 x 15 running, held although 10 are ready
    assert [s.seq for s in _step(sched).seqs] == running[1:] and sched.deferred_steps == 1
    for seq in running[1:4]:
        sched.finish(seq)  # four seats: 4 >= 0.25 x 12, four admitted in one step
    assert [s.seq for s in _step(sched).seqs] == running[4:] + backlog[:4]
    assert sched.deferred_steps == 1


def test_admission_pacing_admits_at_once_a_request_cached_but_for_its_last_token():
    """Its admission adds one decode row (one token at its last position), so the step stays a
    decode step: pacing holds it back only where the batch is at the largest graph. A request that
    needs a prefill is still held, its hold's clock running."""
    seed = chain_seed(KVFormat("llama", "tiny", "bfloat16", "bfloat16", "bfloat16", "bfloat16", BLOCK))
    sched = _scheduler(max_num_seqs=16, max_tokens=64)
    sched.admit_ratio, sched.max_admit_delay = 0.5, 3
    prompt = list(range(1, 14))  # 3 full blocks of 4 and a token
    first = Sequence(next(_ids), list(prompt), 13, cache_seed=seed)
    sched.add(first)
    sched.cache_computed(sched.schedule())
    sched.finish(first)  # its 3 full blocks stay cached
    running = _decoding(sched, 8)

    def cached() -> Sequence:
        return Sequence(next(_ids), prompt[:12] + [99], 13, cache_seed=seed)

    held, late = _seq(5), cached()
    sched.add(held)
    sched.add(late)
    assert sched.admits_now()
    plan = _step(sched)  # held: 1 ready to prefill < 0.5 x 8 running; late: a decode row, admitted
    assert [(s.seq, s.context_len, s.num_tokens) for s in plan.seqs] == [(s, 3, 1) for s in running] + [(late, 12, 1)]
    assert sched.deferred_steps == 1 and not sched.admits_now()
    sched.pace_max_running = 9  # 9 running: the largest graph is full, one more row would decode eagerly
    at_max = cached()
    sched.add(at_max)
    assert not sched.admits_now()
    assert at_max not in [s.seq for s in _step(sched).seqs] and sched.deferred_steps == 2
    sched.pace_max_running = 16
    seqs = [s.seq for s in _step(sched).seqs]  # the hold's 3rd step: at_max admitted, held still waits
    assert at_max in seqs and held not in seqs and sched.deferred_steps == 3
    seqs = [s.seq for s in _step(sched).seqs]  # admissions of decode rows did not restart the clock
    assert held in seqs and sched.deferred_steps == 3


def test_longrope_sequence_past_the_original_length_is_recomputed_once_under_its_own_key_chain():
    """LongRoPE, original length 8: a 6-token prompt decodes with short-factor keys; the step that
    feeds its 9th token frees its blocks and recomputes all 9 with the long factors (once, under
    the long chain's seed); a 10-token prompt is admitted long; a preempted long sequence stays long."""
    from loraserve.executor.engine.batch import long_rope_seqs
    from loraserve.executor.engine.prefix_cache import long_rope_seed

    sched = Scheduler(BlockAllocator(64), BLOCK, 8, 32, long_rope=8)
    a, b = _seq(6), _seq(10)
    a.cache_seed = b.cache_seed = seed = b"s" * 16
    sched.add(a)
    for _ in range(3):  # prefill (6), then tokens at positions 6 and 7
        plan = _step(sched)
    assert (plan.seqs[0].context_len, a.long_rope, a.cache_seed, long_rope_seqs(plan, 8)) == (7, False, seed, None)
    sched.add(b)
    plan = _step(sched)  # a's 9th token: recomputed from position 0; b admitted long
    assert [(s.seq, s.context_len, s.num_tokens, s.needs_sample) for s in plan.seqs] == [(a, 0, 9, True), (b, 0, 10, True)]
    assert a.long_rope and b.long_rope and a.cache_seed == b.cache_seed == long_rope_seed(seed) != seed
    assert long_rope_seqs(plan, 8) == [True, True]
    plan = _step(sched)
    assert [(s.context_len, s.num_tokens) for s in plan.seqs] == [(9, 1), (10, 1)] and long_rope_seqs(plan, 8) is None
    sched._preempt(a, plan)
    plan = _step(sched)
    assert (plan.seqs[-1].seq, plan.seqs[-1].context_len, a.cache_seed) == (a, 0, long_rope_seed(seed))
    assert long_rope_seqs(plan, 8) == [False, True] and long_rope_seqs(plan, None) is None
