"""Forward steps far slower than their kind's recent ones: counted and logged.

A serving run's throughput can swing with no error anywhere: a step that usually takes 11 ms takes
300 ms once, and the streams stall behind it. Triton builds explain some (builds.py logs those);
others need the step itself: its kind and size, how long the host took to queue it, how long the
device worked on it, how long it waited between the two. So every collected step is compared with
the median of the last `WINDOW` steps of its kind; one over `FACTOR` times that median and over
`MIN_SECONDS` is logged with all of that and counted (`/metrics`: loraserve_executor_slow_steps_total
by kind). The first `WARMUP_STEPS` of a kind set the median only.
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


class SlowSteps:
    """The steps of each kind (engine.StepTime) compared with their kind's recent median."""

    def __init__(self, kinds=()) -> None:
        self.counts: Counter[str] = Counter({k: 0 for k in kinds})  # slow steps by kind, since start (every kind listed)
        self.slowest = None  # (seconds, StepTime, median then) of the slowest slow step
        self._recent: dict[str, deque[float]] = {}
        self._last_end: float | None = None

    def observe(self, step, builds: int = 0) -> bool:
        """Records `step`; True (and a warning logged) when it is slow. builds: Triton builds while
        serving so far (one during the step says why it was slow)."""
        recent = self._recent.setdefault(step.kind, deque(maxlen=WINDOW))
        gap = None if self._last_end is None else step.launched - self._last_end
        self._last_end = step.end
        slow = False
        if len(recent) >= WARMUP_STEPS:
            median = statistics.median(recent)
            slow = step.seconds > max(MIN_SECONDS, FACTOR * median)
            if slow:
                self.counts[step.kind] += 1
                if self.slowest is None or step.seconds > self.slowest[0]:
                    self.slowest = (step.seconds, step, median)
                log.warning("slow %s step: %s", step.kind, describe(step, median, gap, builds))
        recent.append(step.seconds)
        return slow


def describe(step, median: float, gap: float | None = None, builds: int | None = None,
             against: str = "its kind's recent median") -> str:
    """One line on a step: its time against `median` (named by `against`), size, host and device parts."""
    device = "-" if step.device_seconds is None else f"{step.device_seconds * 1e3:.1f} ms"
    parts = [
        f"{step.seconds * 1e3:.1f} ms from launch to tokens ({against} {median * 1e3:.1f} ms)",
        f"{_count(step.num_seqs, 'sequence')}, {_count(step.num_tokens, 'token')}",
        f"host queuing {step.launch_seconds * 1e3:.1f} ms, device {device}",
    ]
    if gap is None:
        parts.append("launched ahead of the previous step's tokens" if step.ahead else "launched after the previous step's tokens")
    elif gap < 0:
        parts.append(f"launched {-gap * 1e3:.1f} ms before the previous step's tokens reached the host")
    else:
        parts.append(f"launched {gap * 1e3:.1f} ms after the previous step's tokens reached the host")
    if builds is not None:
        parts.append(f"{builds} Triton builds while serving so far")
    return "; ".join(parts)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
