"""Python's garbage collector (executor/diagnostics/gc_pauses.py): every collection timed, start-up's
objects frozen out of later walks (and a dropped engine's cycles collected by the next freeze), the
time named in the slow-step line and exported to /metrics by generation."""

from __future__ import annotations

import gc
import logging
import weakref

from loraserve.executor.diagnostics import gc_pauses, slow_steps
from loraserve.executor.engine.step_stats import STEP_KINDS, StepTime
from loraserve.metrics import _ExecutorState


class Node:
    """A container object that can sit in a reference cycle."""

    def __init__(self) -> None:
        self.other = None


def cycle() -> tuple[Node, weakref.ref]:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a, weakref.ref(b)


def test_each_collection_is_timed_by_generation():
    pauses = gc_pauses.GcPauses()
    enabled = gc.isenabled()
    gc.disable()  # no automatic collection (another thread allocating) between: only the two asked for
    gc.callbacks.append(pauses)
    try:
        gc.collect()
        gc.collect(0)
    finally:
        gc.callbacks.remove(pauses)
        if enabled:
            gc.enable()
    assert pauses.count == 2
    assert pauses.seconds_by_generation[2] > 0 and pauses.seconds_by_generation[0] > 0
    assert pauses.seconds == sum(pauses.seconds_by_generation)
    assert gc_pauses.watch_gc() is gc_pauses.watch_gc()  # one per process, set once
    assert gc.callbacks.count(gc_pauses.watch_gc()) == 1


def test_frozen_objects_are_not_walked_until_the_next_freeze_or_unfreeze():
    try:
        live, alive = cycle()
        frozen = gc_pauses.freeze_startup()
        # Frozen objects still die by reference count (another thread may drop one meanwhile), and
        # only a freeze adds to the count: what was returned is an upper bound, never far off.
        assert frozen > 0 and frozen - 1000 <= gc.get_freeze_count() <= frozen
        del live
        gc.collect()
        assert alive() is not None, "a frozen cycle must be out of the collector's walks"
        gc_pauses.freeze_startup()  # a later engine's start: the earlier one's garbage goes first
        assert alive() is None
        live, alive = cycle()
        gc_pauses.freeze_startup()
        del live
        gc_pauses.reset()  # nothing running: put back
        assert gc.get_freeze_count() == 0
        gc.collect()
        assert alive() is None
    finally:
        gc.unfreeze()


def test_only_the_first_running_engine_freezes_and_only_the_last_one_to_stop_thaws():
    try:
        assert gc_pauses.engine_started() > 0
        assert gc_pauses.engine_started() is None  # a second engine: the first one's freeze stands
        gc_pauses.engine_stopped()
        assert gc.get_freeze_count() > 0
        gc_pauses.engine_stopped()
        assert gc.get_freeze_count() == 0
        gc_pauses.engine_stopped()  # a stray stop: no count below zero
        assert gc_pauses.engine_started() > 0
    finally:
        gc_pauses.reset()
    assert gc.get_freeze_count() == 0


def test_a_failing_timing_is_logged_once_and_never_raises(caplog):
    pauses = gc_pauses.GcPauses()
    pauses.seconds_by_generation = None  # the next 'stop' fails inside the callback
    with caplog.at_level(logging.WARNING, logger="loraserve.executor.diagnostics.gc_pauses"):
        for _ in range(3):
            pauses("start", {"generation": 2})
            pauses("stop", {"generation": 2})
    assert caplog.text.count("garbage collection timing failed") == 1


def test_the_slow_step_line_names_the_collectors_time_since_the_previous_step(caplog):
    watch = slow_steps.SlowSteps(STEP_KINDS)
    at = 0.0
    for _ in range(slow_steps.WARMUP_STEPS):
        watch.observe(StepTime("decode-graph", 8, 8, 0.011, at + 0.011, at, False, 0.002, 0.010), gc_pauses=(40, 0.05))
        at += 0.011
    with caplog.at_level(logging.WARNING, logger="loraserve.executor.diagnostics.slow_steps"):
        assert watch.observe(StepTime("decode-graph", 8, 8, 0.33, at + 0.33, at, False, 0.002, 0.010), gc_pauses=(41, 0.371))
    assert "Python's garbage collector: 321.0 ms in 1 collection since the previous step" in caplog.text
    line = slow_steps.describe(StepTime("mixed", 8, 8, 0.5, 0.5, 0.0, False, 0.002, None), 0.05)
    assert "garbage collector" not in line  # not watched: left out


def test_the_collectors_time_is_exported_by_generation():
    pauses = gc_pauses.GcPauses()
    pauses.seconds_by_generation = [0.001, 0.002, 0.3]
    family = _ExecutorState._gc_pauses(pauses)
    assert family.name == "loraserve_executor_gc_pause_seconds"
    assert {s.labels["generation"]: s.value for s in family.samples} == {"0": 0.001, "1": 0.002, "2": 0.3}
    none = _ExecutorState._gc_pauses(None)  # an engine without the watch: zeros, still exported
    assert {s.labels["generation"]: s.value for s in none.samples} == {"0": 0.0, "1": 0.0, "2": 0.0}
