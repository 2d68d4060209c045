"""Count-only model of the cross-layer prefetch (`prefetch_next_group`) under the locality model.

Each request's hot buffers, one per index group (`lru_sim.LruHotBuffer`, the contract's LRU), see
the decode steps in the engine's order: group g's own resolve of its top-k, then, with the
prefetch, group g+1's resolve of g's top-k (its misses are the prefetch's copies, off the critical
path), then g+1's own resolve (its misses wait for the top-k: the critical path). Positions on
resident pages (`resident_pages`: the lowest pages, where the sinks are, and the active tail)
bypass the buffers, as the resolver's resident entries do.

`wrap` adds what no engine does today: after the last group's resolve, group 0's resolve of that
top-k, for the next step (group 0 has no predecessor within a step), to measure what it would buy.

`pairs` limits the prefetch to the successors of those source groups (`prefetch_next_group` given
a selection); `resident_groups` are layers kept whole on the GPU (`resident_layers`): no lookups,
no buffer, nothing prefetched into them, their successor still prefetched from their top-k (as the
engine does). `hot_rows` may differ per group (what a per-layer hot buffer would buy).

CPU only, seeded; one `LayeredIndexer` per request, as `hisparse_transformers.model_topk` makes them.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
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
    prefetch_by_group: tuple[int, ...] = ()   # prefetch copies into each group


def request_trace(regime_name: str, reference: Sequence[int], *, top_k: int, context: int, steps: int,
                  seed: int, request_id: int) -> list[np.ndarray]:
    """One request's decode top-k, `steps` arrays of `[groups, top_k]`, the first at `context + 1`
    tokens (the new token included, as `ModelTopk` makes them)."""
    ix = LayeredIndexer(top_k, reference, regime(regime_name), seed=seed, request_id=request_id)
    return [ix.step(context + t + 1) for t in range(steps)]


def simulate(traces: Sequence[Sequence[np.ndarray]], variant: str, *, context: int, hot_rows: int | Sequence[int],
             block_size: int, resident_pages: int, tail_pages: int, warmup: int, pairs: Collection[int] | None = None,
             resident_groups: Collection[int] = ()) -> PrefetchCounts:
    """Run `variant` (one of `VARIANTS`) over every request's trace; the first `warmup` steps fill
    the buffers uncounted. A position is resident when its page is below `resident_pages` or among
    the `tail_pages` newest pages of the step's context. `pairs`: the source groups whose successor
    is prefetched (None: all); `resident_groups`: groups kept whole on the GPU; `hot_rows`: one
    size, or one per group."""
    if variant not in VARIANTS:
        raise ValueError(f"prefetch variant {variant!r}; expected one of {list(VARIANTS)}")
    if not traces or warmup >= len(traces[0]):
        raise ValueError(f"warmup={warmup} leaves none of the {len(traces[0]) if traces else 0} steps to measure")
    groups = traces[0][0].shape[0]
    rows = [hot_rows] * groups if isinstance(hot_rows, int) else list(hot_rows)
    if len(rows) != groups:
        raise ValueError(f"hot_rows={list(rows)}: {len(rows)} sizes for {groups} groups; expected one or one per group")
    bad = [g for g in [*(pairs or ()), *resident_groups] if not 0 <= g < groups]
    if bad:
        raise ValueError(f"group {bad[0]} in pairs/resident_groups; expected groups in [0, {groups})")
    resident_set = set(resident_groups)
    sources = set(range(groups)) if pairs is None else set(pairs)
    #: target[g]: the group prefetched from g's top-k (None: none)
    target = [g + 1 if variant != "off" and g in sources and g + 1 < groups and g + 1 not in resident_set else None
              for g in range(groups)]
    lookups = resident = 0
    crit = [0] * groups
    pre = [0] * groups
    for trace in traces:
        bufs = [LruHotBuffer(rows[g]) for g in range(groups)]
        for t, picks in enumerate(trace):
            counted = t >= warmup
            seq_len = context + t + 1
            tail_start = ((seq_len - 1) // block_size - tail_pages + 1) * block_size
            keys = []
            for g in range(groups):
                row = picks[g][picks[g] >= 0]
                page_res = (row < resident_pages * block_size) | (row >= tail_start)
                keys.append(row[~page_res])
                if counted and g not in resident_set:
                    lookups += row.size
                    resident += int(page_res.sum())
            for g in range(groups):
                if g not in resident_set:
                    _, miss = bufs[g].access(keys[g])
                    if counted:
                        crit[g] += miss
                nxt = target[g]
                if nxt is not None:
                    _, miss = bufs[nxt].access(keys[g])
                    pre[nxt] += miss if counted else 0
            if variant == "next+wrap" and groups > 1 and 0 not in resident_set:
                _, miss = bufs[0].access(keys[-1])     # for the next step's group 0
                pre[0] += miss if counted else 0
    return PrefetchCounts(len(traces[0]) - warmup, lookups, resident, sum(crit), sum(pre), tuple(crit), tuple(pre))
