"""How long a helper thread waits for the interpreter lock while the serving loop runs Python.

The executor hands blocking work to threads: a fetched shard's views (store_client.shard_tensors),
its checksum, arena allocations. Most torch calls give the GIL back while they run and take it
again after. While the event loop runs Python (a step's launch, the scheduler, gRPC handlers), a
thread that wants the GIL back gets it only when the loop's thread is made to drop it, once per
switch interval (Python's default: 5 ms). A Llama-3-8B-shaped shard's views are ~450 such calls:
beside a loop that never waits, at 5 ms they take seconds on a 16-core host; at 200 us, tens of ms.

So while an engine serves, the interval is `SWITCH_INTERVAL_US`: the first engine of the process
to start serving sets it, the last one to stop puts back the interval it found. A shorter interval
makes the loop's thread hand the GIL over sooner to a thread that asks for it; a thread that does
not ask costs nothing, so the loop pays only while helpers have work. A loop that waits on its
steps' device work most of each step hands the lock over at once either way: the setting is for a
loop saturated with Python (many clients, the HTTP front, a slow host).
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger(__name__)

SWITCH_INTERVAL_US = 200  # the interpreter's switch interval while an engine serves (Python's own: 5,000)

_running = 0  # engines of this process that started serving and have not stopped
_found: float | None = None  # the interval (s) before the first of them set it


def engine_started() -> float:
    """An engine starts serving: the first one sets the interval to SWITCH_INTERVAL_US; returns the
    interval now set (s)."""
    global _running, _found
    if _running == 0:
        _found = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_US / 1e6)
        log.info(
            "engine serving: interpreter switch interval %.0f us (was %.0f us): helper threads get the GIL "
            "back sooner while the loop runs Python",
            SWITCH_INTERVAL_US,
            _found * 1e6,
        )
    _running += 1
    return sys.getswitchinterval()


def engine_stopped() -> None:
    """An engine that started serving stopped: the last one puts the interval it found back."""
    global _running, _found
    if _running == 0:
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
