"""Count-only model of the cross-layer prefetch (`prefetch_next_group`) under the locality model.

Each request's hot buffers, one per index group (`lru_sim.LruHotBuffer`, the contract's LRU), see
the decode steps in the engine's order: group g's own resolve of its top-k, then, with the
prefetch, group g+1's resolve of g's top-k (its misses are the prefetch's copies, off the critical
path), then g+1's own resolve (its misses wait for the top-k: the critical path). Positions on
resident pages (`resident_pages`: the lowest pages, where the sinks are, and the active tail)
bypass the buffers, as the resolver's resident entries do.

`wrap` adds what no engine does today: after the last group's resolve, group 0's resolve of that
top-k, for the next step (group 0 has no predecessor within a step), to measure what it would buy.

CPU only, seeded; one `LayeredIndexer` per request, as `hisparse_transformers.model_topk` makes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hisparse_core.replay.locality import LayeredIndexer, regime
from hisparse_core.replay.lru_sim import LruHotBuffer

#: the prefetch variants `simulate` runs: none, the engine's next-group prefetch, and that plus
#: group 0 prefetched from the last group's top-k of the step before
VARIANTS = ("off", "next", "next+wrap")


@dataclass(frozen=True, slots=True)
class PrefetchCounts:
    """Totals over the measured steps and the batch (divide by `steps` for per step)."""

    steps: int
    lookups: int              # every valid top-k entry of every group's own resolve
    resident: int             # of them on resident pages
    critical_misses: int      # misses of the groups' own resolves (copies that wait for the top-k)
    prefetch_misses: int      # copies of the prefetch resolves (overlapped with earlier groups' work)
    critical_by_group: tuple[int, ...]


def request_trace(regime_name: str, reference: Sequence[int], *, top_k: int, context: int, steps: int,
                  seed: int, request_id: int) -> list[np.ndarray]:
    """One request's decode top-k, `steps` arrays of `[groups, top_k]`, the first at `context + 1`
    tokens (the new token included, as `ModelTopk` makes them)."""
    ix = LayeredIndexer(top_k, reference, regime(regime_name), seed=seed, request_id=request_id)
    return [ix.step(context + t + 1) for t in range(steps)]


def simulate(traces: Sequence[Sequence[np.ndarray]], variant: str, *, context: int, hot_rows: int, block_size: int,
             resident_pages: int, tail_pages: int, warmup: int) -> PrefetchCounts:
    """Run `variant` (one of `VARIANTS`) over every request's trace; the first `warmup` steps fill
    the buffers uncounted. A position is resident when its page is below `resident_pages` or among
    the `tail_pages` newest pages of the step's context."""
    if variant not in VARIANTS:
        raise ValueError(f"prefetch variant {variant!r}; expected one of {list(VARIANTS)}")
    if not traces or warmup >= len(traces[0]):
        raise ValueError(f"warmup={warmup} leaves none of the {len(traces[0]) if traces else 0} steps to measure")
    groups = traces[0][0].shape[0]
    lookups = resident = pre = 0
    crit = [0] * groups
    for trace in traces:
        bufs = [LruHotBuffer(hot_rows) for _ in range(groups)]
        for t, picks in enumerate(trace):
            counted = t >= warmup
            seq_len = context + t + 1
            tail_start = ((seq_len - 1) // block_size - tail_pages + 1) * block_size
            keys = []
            for g in range(groups):
                row = picks[g][picks[g] >= 0]
                page_res = (row < resident_pages * block_size) | (row >= tail_start)
                keys.append(row[~page_res])
                if counted:
                    lookups += row.size
                    resident += int(page_res.sum())
            for g in range(groups):
                _, miss = bufs[g].access(keys[g])
                if counted:
                    crit[g] += miss
                if variant != "off" and g + 1 < groups:
                    _, miss = bufs[g + 1].access(keys[g])
                    pre += miss if counted else 0
            if variant == "next+wrap" and groups > 1:
                _, miss = bufs[0].access(keys[-1])     # for the next step's group 0
                pre += miss if counted else 0
    return PrefetchCounts(len(traces[0]) - warmup, lookups, resident, sum(crit), pre, tuple(crit))
