"""How long a helper thread waits for the interpreter lock while the serving loop runs Python.

The executor hands blocking work to threads: a fetched shard's views (store_client.shard_tensors),
its checksum, arena allocations, the in-process stand-in of serve.py. Most torch calls give the GIL
back while they run and take it again after. While the event loop runs Python (a step's launch,
the scheduler, gRPC handlers), a thread that wants the GIL back gets it only when the loop's
thread is made to drop it, once per switch interval: Python's default 5 ms. A shard's views are
~450 such calls for a Llama-3-8B-shaped adapter (~900 before they were made one a tensor): beside
a loop that never waits, at the 5 ms interval, the ~900 took 0.5 s on a 2-core host and 6.7-10.8 s
on a 16-core one, the ~450 0.2 s on the 2-core host (`benchmarks/bench_gil_handoff.py`); the serve
benchmark's cold fetches, which copied tensor by tensor, waited seconds (docs/BENCHMARKS.md, "Many
adapters", twenty-seventh pass).

When the first engine of the process starts serving, the switch interval is set to the engine's
`switch_interval_us` (ExecutorConfig; 0 leaves Python's); when the last one stops, the interval
it found is put back. A shorter interval makes the loop's thread hand the GIL over sooner to a
thread that asks for it; a thread that does not ask costs nothing, so the loop pays only while
helpers have work. In the serve benchmark, whose loop waits on its steps' device work most of
each step, 200 us and 5 ms measured the same (docs/BENCHMARKS.md, twenty-seventh pass): the setting
is for a loop saturated with Python (many clients, the HTTP front, a slow host), where at 200 us
a shard's ~900 view calls took 30 ms (2-core host) and 85 ms (16-core), the ~450 of now 15 ms
(2-core; the 16-core host not measured again).
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger(__name__)

_running = 0  # engines of this process that set the interval and still serve
_found: float | None = None  # the interval before the first of them set it


def engine_started(interval_us: int) -> float | None:
    """An engine starts serving: the first one that asks (interval_us > 0) sets the interval (s);
    returns the interval set, or None when it left it as it was."""
    global _running, _found
    if interval_us <= 0:
        return None
    if _running == 0:
        _found = sys.getswitchinterval()
        sys.setswitchinterval(interval_us / 1e6)
        log.info("engine serving: interpreter switch interval %.0f us (was %.0f us): helper threads get the GIL "
                 "back sooner while the loop runs Python", interval_us, _found * 1e6)
    _running += 1
    return sys.getswitchinterval()


def engine_stopped(interval_us: int) -> None:
    """An engine that started with interval_us stopped: the last one puts the interval back."""
    global _running, _found
    if interval_us <= 0 or _running == 0:
        return
    _running -= 1
    if _running == 0 and _found is not None:
        sys.setswitchinterval(_found)
        _found = None


def reset() -> None:
    """No engine serving, the interval found put back (tests: an engine a test never stopped)."""
    global _running, _found
    if _found is not None:
        sys.setswitchinterval(_found)
    _running, _found = 0, None
