"""The Python garbage collector's pauses: timed, and start-up's objects kept out of its walks.

A full collection (generation 2) walks every container object the process holds, and holds the
GIL while it does: the engine's event loop launches and collects no step meanwhile. With torch,
the model code and the tokenizer imported, a process holds ~400,000 such objects, and a full walk
takes 0.1-0.4 s, for which a step of a few ms is held. Almost all of those objects live as long as
the process, so when the first engine of the process starts serving (after imports, model,
warm-up, graphs) they are moved out of the collector's reach
(`engine_started`: gc.collect, then gc.freeze); later collections walk only what was made while
serving. When the last running engine stops they are put back (`engine_stopped`), so a dropped
engine's reference cycles are freed by the next collection. Reference counting still frees every
object; only cycles that pass through frozen objects wait until then. Tensor- and
expert-parallel worker ranks (executor/ranks.py) freeze once their shard of the model is loaded
and serve until their process exits (a full collection on one rank holds every rank's collective);
their state reply names the frozen count and the collector's time.

Every collection is timed (gc.callbacks, `watch_gc`): the slow-step line (slow_steps.py) names the
collector's time since the previous step, and `/metrics` exports the total by generation
(loraserve_executor_gc_pause_seconds_total).
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


class GcPauses:
    """Collections seen since `watch_gc` set the callback: count and seconds, in all and by generation."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self.seconds_by_generation = [0.0, 0.0, 0.0]
        self._began: float | None = None
        self._failed = False

    def __call__(self, phase: str, info: dict) -> None:
        """gc.callbacks: 'start' and 'stop' of each collection (in the thread that triggered it; the
        GIL keeps two from overlapping). A failure here would print on every collection: logged once."""
        try:
            self._record(phase, info)
        except Exception:
            if not self._failed:
                self._failed = True
                log.warning("garbage collection timing failed; collections go on untimed", exc_info=True)

    def _record(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        if self._began is None:
            return
        took = time.perf_counter() - self._began
        self._began = None
        self.count += 1
        self.seconds += took
        generation = info.get("generation", 2)
        if 0 <= generation < len(self.seconds_by_generation):
            self.seconds_by_generation[generation] += took


_PAUSES: GcPauses | None = None


def watch_gc() -> GcPauses:
    """The process's one GcPauses (gc.callbacks is process-wide), set on the first call."""
    global _PAUSES
    if _PAUSES is None:
        _PAUSES = GcPauses()
        gc.callbacks.append(_PAUSES)
    return _PAUSES


def freeze_startup() -> int:
    """Collects once, then moves every object left out of later collections' walks; returns how
    many objects are frozen. Anything frozen before is put back first (and collected if dead)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


_running = 0  # engines of this process between engine_started and engine_stopped


def engine_started() -> int | None:
    """An engine starts serving: the first one of the process freezes (returns the frozen count);
    None when another engine runs already (what it froze stays frozen)."""
    global _running
    _running += 1
    return freeze_startup() if _running == 1 else None


def engine_stopped() -> None:
    """An engine stopped: when it was the last one running, the frozen objects are put back."""
    global _running
    _running = max(0, _running - 1)
    if _running == 0:
        gc.unfreeze()


def reset() -> None:
    """No engine running, nothing frozen (tests: an engine a test never stopped)."""
    global _running
    _running = 0
    gc.unfreeze()
