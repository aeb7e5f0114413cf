"""What the slot manager (executor/slots.py) reports: each adapter's state, for the admin RPCs and
the HTTP front (`AdapterState`), and its slot events as they happen, for metrics (`SlotObserver`)."""

from __future__ import annotations

from dataclasses import dataclass


class SlotObserver:
    """Told of slot hits, misses, evictions and load times (loraserve/metrics.py's ExecutorMetrics
    is one); on the event loop, so each call must be cheap. This one ignores them."""

    def slot_hit(self) -> None: ...
    def slot_miss(self) -> None: ...
    def slot_eviction(self, name: str) -> None:
        """The idle adapter `name` was taken out of its slot for another."""

    def adapter_loaded(self, tier: str, seconds: float) -> None: ...
    def load_phases(self, fetch_s: float, slot_wait_s: float, copy_s: float) -> None:
        """A slot load's seconds split: in the CPU cache (the fetch and its wait for a seat; ~0 when
        cached), waiting for a slot to free, the copy into it (host side: until the copy is queued)."""


@dataclass
class AdapterState:
    """One adapter as this executor holds it (the admin RPCs' AdapterState)."""

    name: str
    digest: str
    rank: int
    slot: int  # -1: not in a GPU slot
    pinned: bool
    in_use: int
    in_cpu_cache: bool
    last_used_unix_ms: int
    bytes: int
    loading: bool


@dataclass(frozen=True)
class Residency:
    """Where one adapter is now, for routing metrics (`SlotManager.residency`)."""

    name: str
    tier: str  # "gpu": ready in a slot; "cpu": in the CPU cache only; "store": in neither (being fetched)
    pinned: bool
    rank: int  # 0: not known yet (never fetched), or trainable tokens alone (no LoRA)
    waited_for: bool  # a request (or admin load) waits for it and it is not ready in a slot
