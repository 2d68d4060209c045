"""A count-only model of one state row's hot buffer, following docs/resolver-contract.md.

Used to calibrate the synthetic indexer without a backend, and by tests as an independent
check of a backend's hit/miss counters. Every looked-up position goes through the buffer here
(no resident pages), as in the setting the published miss rates come from.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np


class LruHotBuffer:
    """Hits and misses of one state row with `hot_rows` slots and the contract's LRU rule.

    Per access (one group's entries): `U` = distinct keys in first-reference order; keys already
    held are hits and move to most-recent (keeping their relative order); misses evict the least
    recently used slots not hit in this access, and are inserted in miss order before the hits.
    """

    def __init__(self, hot_rows: int) -> None:
        if hot_rows <= 0:
            raise ValueError(f"hot_rows must be > 0, got {hot_rows}")
        self.hot_rows = hot_rows
        self._order: OrderedDict[int, None] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: int) -> bool:
        return key in self._order

    def access(self, keys: Iterable[int]) -> tuple[int, int]:
        """Look up one step's keys (negative keys are masked). Returns `(hits, misses)`."""
        unique = list(dict.fromkeys(int(k) for k in keys if k >= 0))
        if len(unique) > self.hot_rows:
            raise ValueError(f"{len(unique)} distinct keys do not fit a hot buffer of {self.hot_rows} rows")
        order = self._order
        hits = [k for k in unique if k in order]
        hit_set = set(hits)
        misses = [k for k in unique if k not in hit_set]
        overflow = len(order) + len(misses) - self.hot_rows
        if overflow > 0:
            victims = []
            for key in order:
                if key not in hit_set:
                    victims.append(key)
                    if len(victims) == overflow:
                        break
            for key in victims:
                del order[key]
        for key in misses:
            order[key] = None
        # Hits end most recent in their previous relative order: walk the old order, not `hits`.
        for key in [k for k in order if k in hit_set]:
            order.move_to_end(key)
        return len(hits), len(misses)


@dataclass(frozen=True, slots=True)
class MissRates:
    """Misses per looked-up entry, per hot-buffer size (rows), over the measured steps."""

    by_hot_rows: dict[int, float]
    steps: int
    warmup: int


def lru_miss_rates(topk_steps: Sequence[np.ndarray], hot_rows: Sequence[int], *, warmup: int = 0) -> MissRates:
    """Miss rate of a contract-exact LRU for each buffer size over one request's top-k sequence
    (each element a 1-D array of one step's positions, -1 masked); the first `warmup` steps fill
    the buffer but are not counted."""
    if warmup >= len(topk_steps):
        raise ValueError(f"warmup={warmup} leaves none of the {len(topk_steps)} steps to measure")
    rates: dict[int, float] = {}
    for h in hot_rows:
        buf = LruHotBuffer(h)
        looked = missed = 0
        for t, keys in enumerate(topk_steps):
            hits, misses = buf.access(keys)
            if t >= warmup:
                looked += hits + misses
                missed += misses
        rates[h] = missed / looked if looked else 0.0
    return MissRates(rates, len(topk_steps) - warmup, warmup)
