"""Which adapter a full tier gives up: the coldest idle one by a decayed count of its requests (LRFU).

The slot manager counts references to each adapter (an acquire, an admin load) on one clock of
references, t = 1, 2, ... An adapter's count at time t is its references, each halved every
`half_life` references since it was made:

    count(t) = sum over the adapter's references t_i of 2^-((t - t_i) / half_life)

It is kept as one number, heat = log2(sum of 2^(t_i / half_life)), so that a reference updates it
in O(1) (`bumped`) and nothing needs ageing between references: count(t) = 2^(heat - t / half_life)
(`count`), so at any t the hotter adapter is the one with the larger heat. Adapters referenced once
each rank by recency (LRU); one referenced often ranks by how often (LFU); the half-life sets where
between the two it stands.

The rule (`coldest`): of the idle candidates, one that no queued request wants goes before one that
some request wants; among those, the lowest heat goes first. Both tiers use it: the GPU slots
(executor/slots.py) and, through the heat their holder reports, the CPU cache (executor/cpu_cache.py).

The slot tier's half-life is HALF_LIFE_PER_SLOT references per slot. An adapter with a share p of
the requests holds a count of about p * half_life / ln 2, above a one-off's 1 where p > ~0.043 /
max_loras: under Zipf 1.0 over 1,000 adapters at 8 slots that is the top ~25 (the hottest takes ~13%),
so a burst of one-off adapters churns one slot and leaves the hot ones in theirs, while an adapter that
stops being asked for falls below a one-off within half_life * log2(its count) references.

The rule picks among the idle slots only: it never holds a slot idle for a hot adapter's next request.
When more adapters are running at once than there are slots, the slot that frees is taken whatever its
heat; waiting for a colder one instead would leave slots idle while requests queue for them.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable

HALF_LIFE_PER_SLOT = 16  # references per GPU slot in the slot tier's half-life

COLD = -math.inf  # the heat of an adapter never referenced: count 0


def bumped(heat: float, now: int, half_life: float) -> float:
    """The heat after one more reference at clock `now` (references, counted from 1): count(now) + 1."""
    x = now / half_life
    if heat == COLD:
        return x
    hi, lo = (heat, x) if heat >= x else (x, heat)
    return hi + math.log2(1.0 + 2.0 ** (lo - hi))


def count(heat: float, now: int, half_life: float) -> float:
    """The decayed count of references at clock `now` (0 for COLD)."""
    return 2.0 ** (heat - now / half_life)


def coldest(candidates: Iterable[tuple[Hashable, bool, float]]) -> Hashable | None:
    """The key of the candidate to evict from (key, wanted by a queued request, heat): not wanted
    before wanted, then the lowest heat; the first listed of equals. None when there are none."""
    best, best_rank = None, None
    for key, wanted, heat in candidates:
        rank = (wanted, heat)
        if best_rank is None or rank < best_rank:
            best, best_rank = key, rank
    return best
