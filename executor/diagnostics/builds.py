"""Triton kernel builds while serving: counted, timed and logged.

Triton builds a kernel the first time a launch meets a new set of compile-time values (block
sizes, token-count-dependent flags, dtypes). The warm-up (engine/warmup.py) builds the ones a serving
process is expected to meet; a build after it holds its whole step (0.1-1 s; milliseconds when
Triton's disk cache has it). So once the engine is ready, every build is logged with its kernel
and time and counted (`/metrics`: loraserve_executor_kernel_builds_total and
loraserve_executor_kernel_build_seconds_total). A count that keeps growing says the warm-up misses
token counts or shapes the traffic brings.

Triton's hooks are process-wide: `watch_builds()` sets them once (chaining hooks set before it) and
returns the one `KernelBuilds` of the process. The hooks run on Triton's compile path only, never on
a launch that finds its kernel built.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)


class KernelBuilds:
    """Builds seen while `armed` (before it, e.g. during a warm-up: started and finished, not counted)."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self.armed = False
        self.recent: list[str] = []  # the last few kernels counted, with their specialisation (tests, diagnosis)
        self._lock = threading.Lock()
        self._started: dict[tuple, float] = {}  # (thread, kernel, key) -> when its build began

    def started(self, *, key, fn, **_) -> None:
        """Triton's jit_cache_hook: a launch found no built kernel for its values."""
        with self._lock:
            self._started[(threading.get_ident(), fn.name, key)] = time.perf_counter()

    def finished(self, *, key, fn, repr, compile=None, **_) -> None:
        """Triton's jit_post_compile_hook: that kernel is built (or loaded from the disk cache)."""
        with self._lock:
            began = self._started.pop((threading.get_ident(), fn.name, key), None)
            if began is None or not self.armed:
                return
            took = time.perf_counter() - began
            self.count += 1
            self.seconds += took
            self.recent = [*self.recent[-7:], f"{fn.name}: {repr[:200]}"]
        values = _named((compile or {}).get("constants"), fn)  # the compile-time values that were new
        log.warning(
            "Triton kernel %s built while serving in %.3f s (the warm-up did not build it): compile-time values %s; %s",
            fn.name,
            took,
            str(values)[:600],
            repr[:300],
        )


def _named(constants, fn):
    """Triton keys the constants by argument position paths ((14,): 64); by parameter name here."""
    names = getattr(getattr(fn, "jit_function", None), "arg_names", None)
    if not constants or not names:
        return constants
    named = {}
    for path, value in constants.items():
        at = path[0] if isinstance(path, tuple) and len(path) == 1 else None
        named[names[at] if isinstance(at, int) and 0 <= at < len(names) else str(path)] = value
    return named


_BUILDS = KernelBuilds()
_hooked = False


def watch_builds() -> KernelBuilds:
    """The process's KernelBuilds, hooked into Triton's compile path (once; a no-op without Triton)."""
    global _hooked
    if _hooked:
        return _BUILDS
    try:
        import triton

        knobs = triton.knobs.runtime
    except (ImportError, AttributeError):  # no Triton (a CPU install), or one without these hooks
        return _BUILDS
    before, after = knobs.jit_cache_hook, knobs.jit_post_compile_hook

    def cache_hook(**kwargs):
        if before is not None and (answer := before(**kwargs)):
            return answer  # theirs skips this build: Triton compiles nothing, so no start is kept
        _guarded(_BUILDS.started, kwargs)
        return None

    def post_compile_hook(**kwargs):
        _guarded(_BUILDS.finished, kwargs)
        return after(**kwargs) if after is not None else None

    knobs.jit_cache_hook, knobs.jit_post_compile_hook = cache_hook, post_compile_hook
    _hooked = True
    return _BUILDS


def _guarded(hook, kwargs) -> None:
    """A fault in the counting must never fail the launch that is building."""
    try:
        hook(**kwargs)
    except Exception:
        log.exception("kernel build counter failed")
