"""The eviction rule both adapter tiers use (executor/eviction.py): pure functions, no server."""

from __future__ import annotations

import random

import pytest

from loraserve.executor.eviction import COLD, bumped, coldest, count


def _heat(references: list[int], half_life: float) -> float:
    heat = COLD
    for t in references:
        heat = bumped(heat, t, half_life)
    return heat


def test_heat_is_the_count_of_references_each_halved_every_half_life():
    rng = random.Random(0)
    for _ in range(50):
        half_life = rng.choice([1.5, 16, 128, 1024])
        refs = sorted(rng.sample(range(1, 100_000), rng.randint(1, 40)))
        now = refs[-1] + rng.randint(0, 5_000)
        expected = sum(2.0 ** -((now - t) / half_life) for t in refs)
        assert count(_heat(refs, half_life), now, half_life) == pytest.approx(expected, rel=1e-9)
    assert count(COLD, 10, 16) == 0.0


def test_adapters_asked_once_each_rank_by_recency():
    heats = [_heat([t], 16) for t in (3, 7, 5)]
    assert coldest((i, False, h) for i, h in enumerate(heats)) == 0  # asked at 3: the least recent


def test_an_adapter_asked_often_outranks_a_newer_one_off_until_it_has_cooled():
    half_life = 32
    hot = _heat(list(range(1, 31, 3)), half_life)  # 10 references in the last 30
    for t in range(31, 31 + 2 * half_life):  # a burst of one-offs: each the newest
        assert coldest([("hot", False, hot), ("one-off", False, _heat([t], half_life))]) == "one-off"
    # Long unasked, it cools below a newer one-off: a count of ~7.3 at t=30 falls below 1 in log2(7.3) ~ 2.9 half-lives.
    assert coldest([("hot", False, hot), ("one-off", False, _heat([30 + 3 * half_life], half_life))]) == "hot"


def test_coldest_takes_an_adapter_no_queued_request_wants_first_then_the_lowest_heat():
    assert coldest([(0, True, 1.0), (1, False, 5.0), (2, False, 3.0)]) == 2
    assert coldest([(0, True, 1.0), (1, True, 0.5)]) == 1
    assert coldest([("a", False, COLD), ("b", False, COLD)]) == "a"  # the first listed of equals
    assert coldest([]) is None
