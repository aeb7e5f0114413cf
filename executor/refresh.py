"""Keeps the executor's adapters at the store's current version.

Every `adapter_refresh_s` the executor asks the store for the digest of each adapter it holds
(in a slot or in the CPU cache) and hands the answers to SlotManager.refresh, which drops a
superseded version once no running request uses it. LoadAdapter does the same for its one
adapter at once. With the store down, nothing changes: held adapters keep serving.
"""

from __future__ import annotations

import asyncio
import logging

from loraserve.errors import StatusError

from .slots import SlotManager
from .store_client import StoreClient

log = logging.getLogger(__name__)


async def refresh_one(slots: SlotManager, store: StoreClient, name: str) -> bool:
    """Checks one held adapter against the store; True if a newer (or no) version replaced it there."""
    if name not in slots.known_digests():
        return False  # nothing held: whatever a load fetches is the store's current version
    return await slots.refresh(name, await store.current_digest(name))


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
