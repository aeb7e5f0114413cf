"""Steps far slower than their kind's recent ones (executor/engine/slow_steps.py): flagged only past
the warm-up count, over FACTOR x the kind's median and over MIN_SECONDS, each kind on its own;
logged with the step's parts, counted, exported to /metrics."""

from __future__ import annotations

import logging

from loraserve.executor.engine import slow_steps
from loraserve.executor.engine.engine import STEP_KINDS, StepTime
from loraserve.metrics import _ExecutorState


def step(kind: str, seconds: float, at: float, device: float | None = None) -> StepTime:
    return StepTime(kind, 8, 8, seconds, at + seconds, at, False, 0.002, device)


def feed(watch: slow_steps.SlowSteps, kind: str, count: int, seconds: float, at: float = 0.0) -> float:
    for _ in range(count):
        assert not watch.observe(step(kind, seconds, at))
        at += seconds
    return at


def test_a_step_far_over_its_kinds_median_is_logged_and_counted(caplog):
    watch = slow_steps.SlowSteps(STEP_KINDS)
    at = feed(watch, "decode-graph", slow_steps.WARMUP_STEPS, 0.011)
    with caplog.at_level(logging.WARNING, logger="loraserve.executor.engine.slow_steps"):
        assert watch.observe(step("decode-graph", 0.315, at + 0.004, device=0.012), builds=0)
    assert watch.counts["decode-graph"] == 1 and sum(watch.counts.values()) == 1
    assert watch.slowest[0] == 0.315
    text = caplog.text
    assert "slow decode-graph step: 315.0 ms from launch to tokens (its kind's recent median 11.0 ms)" in text
    assert "8 sequences, 8 tokens" in text and "host queuing 2.0 ms, device 12.0 ms" in text
    assert "launched 4.0 ms after the previous step's tokens reached the host" in text
    assert "0 Triton builds while serving so far" in text


def test_no_flag_before_the_warm_up_count_below_the_factor_or_below_the_floor():
    watch = slow_steps.SlowSteps(STEP_KINDS)
    at = feed(watch, "decode-graph", slow_steps.WARMUP_STEPS - 1, 0.011)
    assert not watch.observe(step("decode-graph", 1.0, at))  # the kind's median is not known yet
    watch = slow_steps.SlowSteps(STEP_KINDS)
    at = feed(watch, "decode-graph", slow_steps.WARMUP_STEPS, 0.030)
    assert not watch.observe(step("decode-graph", 0.140, at))  # under 5x the median
    watch = slow_steps.SlowSteps(STEP_KINDS)
    at = feed(watch, "decode", slow_steps.WARMUP_STEPS, 0.001)
    assert not watch.observe(step("decode", 0.09, at))  # 90x the median, under MIN_SECONDS
    assert sum(watch.counts.values()) == 0


def test_each_kind_has_its_own_median():
    watch = slow_steps.SlowSteps(STEP_KINDS)
    at = feed(watch, "decode-graph", slow_steps.WARMUP_STEPS, 0.011)
    at = feed(watch, "mixed-graph", slow_steps.WARMUP_STEPS, 0.120, at)
    assert not watch.observe(step("mixed-graph", 0.300, at))  # 2.5x a mixed step: no
    assert watch.observe(step("decode-graph", 0.300, at + 0.3))  # 27x a decode step: yes
    assert watch.counts == {"decode-graph": 1, "decode": 0, "mixed-graph": 0, "mixed": 0}


def test_a_step_launched_ahead_says_how_long_before_the_previous_ones_tokens():
    one = StepTime("decode-graph", 1, 1, 1.293, 11.0, 9.707, True, 0.0006, 0.0062)
    line = slow_steps.describe(one, 0.0119, gap=-1.2616, builds=0)
    assert line.startswith("1293.0 ms from launch to tokens (its kind's recent median 11.9 ms); 1 sequence, 1 token;")
    assert "device 6.2 ms" in line and "launched 1261.6 ms before the previous step's tokens reached the host" in line


def test_slow_steps_are_exported_by_kind():
    watch = slow_steps.SlowSteps(STEP_KINDS)
    at = feed(watch, "mixed", slow_steps.WARMUP_STEPS, 0.05)
    watch.observe(step("mixed", 0.6, at))
    family = _ExecutorState._slow_steps(watch)
    assert family.name == "loraserve_executor_slow_steps"
    assert {s.labels["kind"]: s.value for s in family.samples} == {k: (1 if k == "mixed" else 0) for k in STEP_KINDS}
