"""Forward steps far slower than their kind's recent ones: counted and logged.

A serving run's throughput can swing with no error anywhere: a step that usually takes 11 ms takes
300 ms once, and the streams stall behind it. Triton builds explain some (builds.py logs those),
the garbage collector's walks others (gc_pauses.py times them); the rest need the step itself: its
kind and size, how long the host took to queue it, how long the device worked on it, and when it
was launched against the previous step's tokens. So every collected step's own time (from its
launch, or from the previous step's tokens if it was launched ahead of them, to its own tokens: a
stall counts once, not once per step in flight behind it) is compared with the median of the last
`WINDOW` steps of its kind and size (token count to the next power of two: a 2,048-token prefill
chunk is not judged against 100-token ones). One over `FACTOR` times that median and over
`MIN_SECONDS` is logged with all of that and counted (`/metrics`:
loraserve_executor_slow_steps_total by kind). The first `WARMUP_STEPS` of a kind and size set the
median only.
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter, deque

log = logging.getLogger(__name__)

WINDOW = 64
WARMUP_STEPS = 16
FACTOR = 5.0
MIN_SECONDS = 0.1
RULE = f"over {FACTOR:g}x the recent median of their kind and size, and over {MIN_SECONDS:g} s"


class SlowSteps:
    """The steps (engine/step_stats.py, StepTime) compared with the recent median of their kind and size."""

    def __init__(self, kinds=()) -> None:
        self.counts: Counter[str] = Counter({k: 0 for k in kinds})  # slow steps by kind, since start (every kind listed)
        self.longest = None  # (own seconds, StepTime) of the longest step since `reset_longest` (benchmarks)
        self._recent: dict[tuple[str, int], deque[float]] = {}
        self._last_end: float | None = None
        self._last_builds: int | None = None
        self._last_gc: tuple[int, float] | None = None

    def reset_longest(self) -> None:
        self.longest = None

    def observe(self, step, builds: int | None = None, gc_pauses: tuple[int, float] | None = None) -> bool:
        """Records `step`; True (and a warning logged) when it is slow. builds: Triton builds while
        serving so far (None where they are not watched); gc_pauses: the garbage collector's
        (collections, seconds) so far (gc_pauses.py; None: not watched). The line says how many of
        each came since the previous step."""
        gap = None if self._last_end is None else step.launched - self._last_end
        own = step.seconds if gap is None or gap >= 0 else step.end - self._last_end
        self._last_end = step.end
        new_builds = None if builds is None or self._last_builds is None else builds - self._last_builds
        self._last_builds = builds
        new_gc = None
        if gc_pauses is not None and self._last_gc is not None:
            new_gc = (gc_pauses[0] - self._last_gc[0], gc_pauses[1] - self._last_gc[1])
        self._last_gc = gc_pauses
        if self.longest is None or own > self.longest[0]:
            self.longest = (own, step)
        recent = self._recent.setdefault((step.kind, _bucket(step.num_tokens)), deque(maxlen=WINDOW))
        slow = False
        if len(recent) >= WARMUP_STEPS and own > MIN_SECONDS:  # a short step can't be slow: no median needed
            median = statistics.median(recent)
            slow = own > FACTOR * median
            if slow:
                self.counts[step.kind] += 1
                log.warning("slow %s step: %s", step.kind, describe(step, median, gap, new_builds, own=own, gc_pauses=new_gc))
        recent.append(own)
        return slow


def _bucket(num_tokens: int) -> int:
    return 1 << max(0, num_tokens - 1).bit_length()


def describe(
    step,
    median: float,
    gap: float | None = None,
    builds: int | None = None,
    against: str = "the recent median of its kind and size",
    own: float | None = None,
    gc_pauses: tuple[int, float] | None = None,
) -> str:
    """One line on a step: its time against `median` (named by `against`), size, host and device
    parts, its launch against the previous step's tokens (gap), Triton builds and the garbage
    collector's (collections, seconds) since that step."""
    device = "-" if step.device_seconds is None else f"{step.device_seconds * 1e3:.1f} ms"
    took = f"{step.seconds * 1e3:.1f} ms from launch to tokens"
    if own is not None and own < step.seconds:
        took += f", {own * 1e3:.1f} ms of it after the previous step's tokens"
    parts = [
        f"{took} ({against} {median * 1e3:.1f} ms)",
        f"{count(step.num_seqs, 'sequence')}, {count(step.num_tokens, 'token')}",
        f"host queuing {step.launch_seconds * 1e3:.1f} ms, device {device}",
    ]
    if gap is None:
        parts.append(
            "launched ahead of the previous step's tokens" if step.ahead else "launched after the previous step's tokens"
        )
    elif gap < 0:
        parts.append(f"launched {-gap * 1e3:.1f} ms before the previous step's tokens reached the host")
    else:
        parts.append(f"launched {gap * 1e3:.1f} ms after the previous step's tokens reached the host")
    if builds is not None:
        parts.append(f"{count(builds, 'Triton build')} while serving since the previous step")
    if gc_pauses is not None:
        parts.append(
            f"Python's garbage collector: {gc_pauses[1] * 1e3:.1f} ms in "
            f"{count(gc_pauses[0], 'collection')} since the previous step"
        )
    return "; ".join(parts)


def count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
