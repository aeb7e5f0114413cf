"""What the engine records of each collected forward step: its kind, size and times (StepTime),
and the totals by kind since start (StepTotals: /metrics, serve.py)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple

# A step's kind: a decode step replayed from a captured graph, or run eagerly (a batch larger than the
# largest graph, or no graphs); a step with a prefill chunk ("mixed") replayed, or run eagerly.
STEP_KINDS = ("decode-graph", "decode", "mixed-graph", "mixed")


class StepTime(NamedTuple):
    """One collected step, as the engine records it (times are time.perf_counter())."""

    kind: str  # one of STEP_KINDS
    num_seqs: int
    num_tokens: int
    seconds: float  # from its launch to its sampled tokens on the host
    end: float  # when its tokens were on the host
    launched: float  # when it was launched
    ahead: bool  # launched before the previous step's tokens reached the host
    launch_seconds: float = 0.0  # host time queuing its work (Python launches, graph staging)
    device_seconds: float | None = None  # CUDA: from the device starting its work to ending it


@dataclass
class StepTotals:
    """Every collected step of one kind since start.

    launch_seconds near seconds says the host set the steps' pace (the device waited for
    launches); device_seconds is the device's span from each step's first queued work to its
    last, gaps included (CUDA only), so seconds - device_seconds is the time the step was not on
    the device at all (waiting behind the previous step, or its tokens' trip to the host)."""

    steps: int = 0
    seconds: float = 0.0
    sequences: int = 0
    tokens: int = 0
    launch_seconds: float = 0.0
    device_seconds: float = 0.0

    def add(self, t: StepTime) -> None:
        self.steps += 1
        self.seconds += t.seconds
        self.sequences += t.num_seqs
        self.tokens += t.num_tokens
        self.launch_seconds += t.launch_seconds
        self.device_seconds += t.device_seconds or 0.0

    def minus(self, before: "StepTotals") -> "StepTotals":
        return StepTotals(*(getattr(self, f.name) - getattr(before, f.name) for f in fields(StepTotals)))
