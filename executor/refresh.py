"""Keeps the executor's adapters at the store's current version.

Every `adapter_refresh_s` the executor asks the store for the digest of each adapter it holds
(in a slot or in the CPU cache) and hands the answers to SlotManager.refresh, which drops a
superseded version once no running request uses it. LoadAdapter asks at once for its one adapter
(`LoadChecks`) but waits for the answer at most LOAD_CHECK_WAIT_S: an answer that comes later applies
as a refresh round's does. With the store down, nothing changes: held adapters keep serving.
"""

from __future__ import annotations

import asyncio
import logging

from loraserve.errors import StatusError

from .slots import SlotManager
from .store_client import StoreClient

log = logging.getLogger(__name__)
# How long LoadAdapter waits for the store's digest of an adapter this executor holds, in seconds: a
# store that answers does so in milliseconds; a stalled one is noticed by the health watch only after
# up to 2 s, and would otherwise hold the load for the whole store timeout.
LOAD_CHECK_WAIT_S = 0.25


async def refresh_one(slots: SlotManager, store: StoreClient, name: str) -> bool:
    """Checks one held adapter against the store; True if a newer (or no) version replaced it there."""
    if name not in slots.known_digests():
        return False  # nothing held: whatever a load fetches is the store's current version
    return await slots.refresh(name, await store.current_digest(name))


class LoadChecks:
    """LoadAdapter's version check of one adapter: the store is asked for its digest at once, and a
    held version it no longer has is dropped before the load (which then fetches the store's), as
    `refresh_one` does. A held adapter never waits on the store longer than `wait_s`: past that the
    load serves what is held and the check goes on in the background, applied when the store answers
    (within the store client's timeout). While the store fails its health checks nothing is asked."""

    def __init__(self, slots: SlotManager, store: StoreClient, wait_s: float = LOAD_CHECK_WAIT_S):
        self.slots, self.store, self.wait_s = slots, store, wait_s
        self._tasks: set[asyncio.Task] = set()  # checks in flight, referenced until they end

    async def check(self, name: str) -> None:
        """Returns once the check is done, or after wait_s; never raises for the store's sake."""
        if name not in self.slots.known_digests():
            return  # nothing held: whatever the load fetches is the store's current version
        if not self.store.answering:
            log.info("LoadAdapter %s: the store at %s does not answer; its version is not checked", name, self.store.address)
            return
        task = asyncio.get_running_loop().create_task(self._check(name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        done, _ = await asyncio.wait({task}, timeout=self.wait_s)  # (a cancelled load leaves the check running)
        if not done:
            log.info(
                "LoadAdapter %s: the store at %s has not answered within %gs; the held version serves, the check goes on",
                name,
                self.store.address,
                self.wait_s,
            )

    async def _check(self, name: str) -> None:
        try:
            await refresh_one(self.slots, self.store, name)
        except StatusError as exc:  # store down or too slow: what is held serves on
            log.info("LoadAdapter %s: could not check the store's version: %s", name, exc.message)
        except Exception:
            log.exception("LoadAdapter %s: checking the store's version failed", name)


async def refresh_all(slots: SlotManager, store: StoreClient) -> list[str]:
    """One round over every held adapter; returns the names whose version changed in the store."""
    changed = []
    for name in slots.known_digests():
        if await slots.refresh(name, await store.current_digest(name)):
            changed.append(name)
    return changed


async def refresh_loop(slots: SlotManager, store: StoreClient, interval_s: float) -> None:
    """Runs refresh_all every interval_s until cancelled; a store outage is logged once."""
    down = False
    while True:
        await asyncio.sleep(interval_s)
        try:
            changed = await refresh_all(slots, store)
        except StatusError as exc:
            if not down:
                log.warning("adapter refresh: %s; held adapters keep their versions", exc.message)
            down = True
            continue
        except Exception:
            log.exception("adapter refresh round failed; retrying in %gs", interval_s)
            continue
        if down:
            log.info("adapter refresh: the store at %s answers again", store.address)
        down = False
        if changed:
            log.info("adapter refresh: new versions in the store for %s", ", ".join(changed))
