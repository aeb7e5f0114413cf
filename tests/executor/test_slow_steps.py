"""Steps far slower than their kind's recent ones (executor/diagnostics/slow_steps.py): flagged only past
the warm-up count, over FACTOR x the median of their kind and size and over MIN_SECONDS, each kind and
size on its own, a stall once however many steps were in flight behind it; logged with the step's
parts, counted, exported to /metrics; every step the engine collects goes through it."""

from __future__ import annotations

import logging

import pytest

from loraserve.executor.diagnostics import slow_steps
from loraserve.executor.engine.step_stats import STEP_KINDS, StepTime
from loraserve.metrics import _ExecutorState

LOGGER = "loraserve.executor.diagnostics.slow_steps"


def step(kind: str, seconds: float, at: float, device: float | None = None, tokens: int = 8, ahead: bool = False) -> StepTime:
    return StepTime(kind, tokens, tokens, seconds, at + seconds, at, ahead, 0.002, device)


def feed(watch: slow_steps.SlowSteps, kind: str, count: int, seconds: float, at: float = 0.0, tokens: int = 8) -> float:
    """`count` steps back to back (each launched when the previous one's tokens arrived)."""
    for _ in range(count):
        assert not watch.observe(step(kind, seconds, at, tokens=tokens))
        at += seconds
    return at


def test_a_step_far_over_its_kinds_median_is_logged_and_counted(caplog):
    watch = slow_steps.SlowSteps(STEP_KINDS)
    at = feed(watch, "decode-graph", slow_steps.WARMUP_STEPS, 0.011)
    watch.observe(step("decode-graph", 0.011, at), builds=3)  # the build count before the slow step
    at += 0.011
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert watch.observe(step("decode-graph", 0.315, at + 0.004, device=0.012), builds=4)
    assert watch.counts["decode-graph"] == 1 and sum(watch.counts.values()) == 1
    assert watch.longest[0] == pytest.approx(0.315)
    text = caplog.text
    assert ("slow decode-graph step: 315.0 ms from launch to tokens (the recent median of its kind and size 11.0 ms)") in text
    assert "8 sequences, 8 tokens" in text and "host queuing 2.0 ms, device 12.0 ms" in text
    assert "launched 4.0 ms after the previous step's tokens reached the host" in text
    assert "1 Triton build while serving since the previous step" in text


def test_no_flag_before_the_warm_up_count_below_the_factor_at_it_or_below_the_floor():
    watch = slow_steps.SlowSteps(STEP_KINDS)
    at = feed(watch, "decode-graph", slow_steps.WARMUP_STEPS - 1, 0.011)
    assert not watch.observe(step("decode-graph", 1.0, at))  # the median is not known yet
    watch = slow_steps.SlowSteps(STEP_KINDS)
    at = feed(watch, "decode-graph", slow_steps.WARMUP_STEPS, 0.030)
    assert not watch.observe(step("decode-graph", 0.140, at))  # under 5x the median
    assert not watch.observe(step("decode-graph", 0.150, at + 0.14))  # exactly 5x: not over it
    watch = slow_steps.SlowSteps(STEP_KINDS)
    at = feed(watch, "decode", slow_steps.WARMUP_STEPS, 0.001)
    assert not watch.observe(step("decode", 0.09, at))  # 90x the median, under MIN_SECONDS
    assert sum(watch.counts.values()) == 0


def test_each_kind_and_size_has_its_own_median():
    watch = slow_steps.SlowSteps(STEP_KINDS)
    at = feed(watch, "decode-graph", slow_steps.WARMUP_STEPS, 0.011)
    at = feed(watch, "mixed-graph", slow_steps.WARMUP_STEPS, 0.040, at, tokens=100)
    at = feed(watch, "mixed-graph", slow_steps.WARMUP_STEPS, 0.120, at, tokens=2048)
    assert not watch.observe(step("mixed-graph", 0.300, at, tokens=2048))  # 2.5x a 2,048-token step: no
    assert watch.observe(step("mixed-graph", 0.300, at + 0.3, tokens=120))  # 7.5x a ~100-token one: yes
    assert watch.observe(step("decode-graph", 0.300, at + 0.6))  # 27x a decode step: yes
    assert watch.counts == {"decode-graph": 1, "decode": 0, "mixed-graph": 1, "mixed": 0}


def test_the_window_forgets_old_steps():
    watch = slow_steps.SlowSteps(STEP_KINDS)
    at = feed(watch, "decode", slow_steps.WINDOW, 0.010)
    assert watch.observe(step("decode", 0.2, at))  # 20x
    at = feed(watch, "decode", slow_steps.WINDOW, 0.060, at + 0.2)  # the steps got slower for good
    assert not watch.observe(step("decode", 0.2, at))  # 3.3x the new median: the 10 ms steps are gone


def test_a_stall_counts_once_not_once_per_step_in_flight_behind_it(caplog):
    """The step launched ahead of a stalled one waits for it: its own time starts at the stalled
    step's tokens (as the serve benchmark's 1.3 s stall did)."""
    watch = slow_steps.SlowSteps(STEP_KINDS)
    at = feed(watch, "decode-graph", slow_steps.WARMUP_STEPS, 0.012)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert watch.observe(step("decode-graph", 1.264, at, device=0.009))  # the stalled step
        behind = StepTime("decode-graph", 1, 1, 1.293, at + 1.264 + 0.030, at + 0.001, True, 0.0006, 0.0062)
        assert not watch.observe(behind)  # launched 1.263 s before those tokens, done 30 ms after them
    assert watch.counts["decode-graph"] == 1 and caplog.text.count("slow decode-graph step") == 1
    line = slow_steps.describe(behind, 0.012, gap=-1.263, own=0.030)
    assert line.startswith(
        "1293.0 ms from launch to tokens, 30.0 ms of it after the previous step's tokens "
        "(the recent median of its kind and size 12.0 ms); 1 sequence, 1 token;"
    )
    assert "launched 1263.0 ms before the previous step's tokens reached the host" in line


def test_the_first_step_and_unwatched_builds_leave_those_parts_out():
    line = slow_steps.describe(step("mixed", 0.5, 0.0, tokens=71), 0.05)
    assert "launched after the previous step's tokens" in line and "Triton" not in line
    watch = slow_steps.SlowSteps(STEP_KINDS)
    assert not watch.observe(step("mixed", 0.5, 0.0), builds=None)


def test_slow_steps_are_exported_by_kind():
    watch = slow_steps.SlowSteps(STEP_KINDS)
    at = feed(watch, "mixed", slow_steps.WARMUP_STEPS, 0.05)
    watch.observe(step("mixed", 0.6, at))
    family = _ExecutorState._slow_steps(watch)
    assert family.name == "loraserve_executor_slow_steps"
    assert "over 5x the recent median of their kind and size, and over 0.1 s" in family.documentation
    assert {s.labels["kind"]: s.value for s in family.samples} == {k: (1 if k == "mixed" else 0) for k in STEP_KINDS}
