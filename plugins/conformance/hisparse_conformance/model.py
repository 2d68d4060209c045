"""The resolver contract (docs/resolver-contract.md) as slow, obvious Python over lists.

The suite compares every backend with `reference_cpu` on identical inputs, but when the backend
under test *is* `reference_cpu` that comparison proves nothing. This model is a second, independent
reading of the contract, so the suite has teeth on the reference too. It assumes valid inputs
(validation is tested separately) and treats out-of-context positions as masked, as
`validate=False` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hisparse_core.geometry import RuntimeConfig


@dataclass(slots=True)
class HotState:
    """One state row's hot map and LRU order (least recently used first)."""

    hot_map: list[int]
    lru: list[int]

    @classmethod
    def empty(cls, hot_rows: int) -> HotState:
        return cls([-1] * hot_rows, list(range(hot_rows)))


@dataclass(slots=True)
class Counters:
    resident: int = 0
    hits: int = 0
    misses: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        return (self.resident, self.hits, self.misses, self.h2d_bytes, self.d2h_bytes)


@dataclass(slots=True)
class Resolution:
    """The contract's outputs of one call, `max_batch_rows` rows each."""

    rows: list[list[int]]
    valid_counts: list[int]
    plan_host: list[list[int]]
    plan_device: list[list[int]]
    plan_counts: list[int]
    #: The host row behind each host entry's output, -1 for every other entry.
    sources: list[list[int]]

    def plan(self) -> list[tuple[int, int]]:
        """(host row, device row) of every miss, in batch then plan order."""
        return [(h, d) for r, n in enumerate(self.plan_counts)
                for h, d in zip(self.plan_host[r][:n], self.plan_device[r][:n], strict=True)]


@dataclass(slots=True)
class ResolverModel:
    """Persistent hot state of every state row plus the counters, driven like a runtime."""

    config: RuntimeConfig
    states: list[HotState] = field(init=False)
    counters: Counters = field(default_factory=Counters)
    last: Resolution | None = None

    def __post_init__(self) -> None:
        self.states = [HotState.empty(self.config.hot_rows) for _ in range(self.config.max_requests)]

    def hot_row(self, hot_table: Sequence[Sequence[int]], q: int, slot: int) -> int:
        bs = self.config.block_size
        return hot_table[q][slot // bs] * bs + slot % bs

    def resolve(self, topk: Sequence[Sequence[int]], row_state: Sequence[int], seq_lens: Sequence[int],
                source_table: Sequence[Sequence[int]], resident_table: Sequence[Sequence[int]],
                hot_table: Sequence[Sequence[int]]) -> Resolution:
        cfg = self.config
        k, _bs = cfg.top_k, cfg.block_size
        out = Resolution([[-1] * k for _ in range(cfg.max_batch_rows)], [0] * cfg.max_batch_rows,
                         [[-1] * k for _ in range(cfg.max_batch_rows)],
                         [[-1] * k for _ in range(cfg.max_batch_rows)], [0] * cfg.max_batch_rows,
                         [[-1] * k for _ in range(cfg.max_batch_rows)])
        batch = len(row_state)
        start = 0
        while start < batch:
            q = row_state[start]
            end = start + 1
            while end < batch and row_state[end] == q:
                end += 1
            if q >= 0:
                self._resolve_group(out, range(start, end), q, topk, seq_lens, source_table, resident_table,
                                    hot_table)
            start = end
        for r in range(batch):
            out.valid_counts[r] = sum(1 for x in out.rows[r] if x != -1)
        self.last = out
        return out

    def _resolve_group(self, out: Resolution, rows: range, q: int, topk: Sequence[Sequence[int]],
                       seq_lens: Sequence[int], source_table: Sequence[Sequence[int]],
                       resident_table: Sequence[Sequence[int]], hot_table: Sequence[Sequence[int]]) -> None:
        bs = self.config.block_size
        host_entries: list[tuple[int, int, int]] = []  # (batch row, entry, host row)
        first_row: dict[int, int] = {}  # host row -> batch row that referenced it first
        for r in rows:
            for i, t in enumerate(topk[r]):
                if t < 0 or t >= seq_lens[r]:
                    continue
                p, o = divmod(t, bs)
                if resident_table[q][p] >= 0:
                    out.rows[r][i] = resident_table[q][p] * bs + o
                    self.counters.resident += 1
                elif source_table[q][p] >= 0:
                    g = source_table[q][p] * bs + o
                    host_entries.append((r, i, g))
                    first_row.setdefault(g, r)
        if not first_row:
            return
        union = list(first_row)  # dicts keep first-reference order
        state = self.states[q]
        wanted = set(union)
        hit_slots = [s for s in state.lru if state.hot_map[s] in wanted]
        evictable = [s for s in state.lru if state.hot_map[s] not in wanted]
        held = {state.hot_map[s] for s in hit_slots}
        misses = [g for g in union if g not in held]
        for m, g in enumerate(misses):
            state.hot_map[evictable[m]] = g
        state.lru = evictable[len(misses):] + evictable[:len(misses)] + hit_slots
        slot_of = {g: s for s, g in enumerate(state.hot_map) if g >= 0}
        for r, i, g in host_entries:
            out.rows[r][i] = self.hot_row(hot_table, q, slot_of[g])
            out.sources[r][i] = g
        for m, g in enumerate(misses):
            r = first_row[g]
            n = out.plan_counts[r]
            out.plan_host[r][n] = g
            out.plan_device[r][n] = self.hot_row(hot_table, q, evictable[m])
            out.plan_counts[r] = n + 1
        self.counters.hits += len(union) - len(misses)
        self.counters.misses += len(misses)

    def count_copies(self, layers: int) -> None:
        """Account a gather (layers=1) or a replay into `layers` follower layers of the last plan."""
        assert self.last is not None
        self.counters.h2d_bytes += sum(self.last.plan_counts) * self.config.row_format.row_bytes * layers

    def invalidate_written_slots(self, pairs: Sequence[tuple[int, int]]) -> None:
        for q, g in pairs:
            if q < 0:
                continue
            state = self.states[q]
            for s, held in enumerate(state.hot_map):
                if held == g:
                    state.hot_map[s] = -1

    def invalidate_host_blocks(self, block_ids: Sequence[int]) -> None:
        blocks = set(block_ids)
        bs = self.config.block_size
        for state in self.states:
            for s, held in enumerate(state.hot_map):
                if held >= 0 and held // bs in blocks:
                    state.hot_map[s] = -1

    def reset_state(self, state_rows: Sequence[int] | None = None) -> None:
        for q in range(self.config.max_requests) if state_rows is None else state_rows:
            self.states[q] = HotState.empty(self.config.hot_rows)

    def reset_stats(self) -> None:
        self.counters = Counters()
