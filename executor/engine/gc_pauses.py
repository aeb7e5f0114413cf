"""The Python garbage collector's pauses: timed, and start-up's objects kept out of its walks.

A full collection (generation 2) walks every container object the process holds, and holds the
GIL while it does: the engine's event loop launches and collects no step meanwhile. With torch,
the model code and the tokenizer imported, a process holds ~400,000 such objects, and a full walk
takes 150-400 ms (measured: 160 ms on a 2-core host; serve benchmark steps of 320-400 ms on a CUDA
host with no build, no pinning and 7-11 ms of device time). Almost all of those objects live as
long as the process, so once the engine is ready (imports, model, warm-up, graphs) it moves them
out of the collector's reach (`freeze_startup`: gc.collect, then gc.freeze); later collections walk
only what was made while serving. Reference counting still frees every object as before; only
cycles among the frozen objects would wait for the process to end.

Every collection is timed (gc.callbacks, `watch_gc`): the slow-step line (slow_steps.py) names the
collector's time since the previous step, and `/metrics` exports the total by generation
(loraserve_executor_gc_pause_seconds_total).
"""

from __future__ import annotations

import gc
import time


class GcPauses:
    """Collections seen since `watch_gc` set the callback: count and seconds, in all and by generation."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self.seconds_by_generation = [0.0, 0.0, 0.0]
        self._began: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        """gc.callbacks: 'start' and 'stop' of each collection (in the thread that triggered it)."""
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
    many objects are frozen. What an earlier engine of the process froze is put back first, so
    its garbage is collected here, not kept for the process's life (tests and benchmarks start
    several engines in one process)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def unfreeze() -> None:
    """Puts the frozen objects back in the collector's reach (an engine that stops: its model and
    caches, if held in reference cycles, are freed by the next collection)."""
    gc.unfreeze()
