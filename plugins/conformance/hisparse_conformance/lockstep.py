"""Drive the backend under test, the reference backend and the contract model with the same
steps, and list every way they disagree after each call."""

from __future__ import annotations

from types import TracebackType

import torch

from hisparse_conformance.model import ResolverModel
from hisparse_conformance.rig import Outcome, Rig, first_difference, outcome_difference
from hisparse_conformance.scenario import Layout, Maintenance, Step
from hisparse_core.backend import Backend


class Lockstep:
    """Three implementations of one runtime, fed identical inputs and identical bytes."""

    def __init__(self, backend: Backend, reference: Backend, layout: Layout, *, seed: int) -> None:
        self.layout = layout
        self.config = layout.config
        self.model = ResolverModel(layout.config)
        self.rig = Rig(backend, layout, seed=seed)
        try:
            self.ref = Rig(reference, layout, seed=seed)
        except BaseException:
            self.rig.close()
            raise
        self.calls = 0

    def __enter__(self) -> Lockstep:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.rig.close()
        self.ref.close()

    def resolve(self, step: Step, *, gather: bool = True, replay: bool = False, validate: bool = True) -> list[str]:
        """One call everywhere (plus the follower replay if asked); the disagreements found."""
        self.calls += 1
        t = step.tables
        want = self.model.resolve(step.topk, step.row_state, step.seq_lens, t.source, t.resident, t.hot)
        got = self.rig.resolve(step, gather=gather, validate=validate)
        ref = self.ref.resolve(step, gather=gather, validate=validate)
        if gather:
            self.model.count_copies(1)
        if replay and self.config.num_layers > 1:
            self.rig.runtime.replay_plan()
            self.ref.runtime.replay_plan()
            self.model.count_copies(self.config.num_layers - 1)
        problems = self._compare(got, ref, Outcome.of(want))
        if gather:
            problems += self._check_bytes(want.sources, range(self.config.num_layers) if replay else range(1))
        return [f"call {self.calls}: {p}" for p in problems]

    def apply(self, work: Maintenance) -> list[str]:
        if work.is_empty():
            return []
        self.model.invalidate_written_slots(work.written)
        self.model.invalidate_host_blocks(work.recycled_blocks)
        if work.reset_rows:
            self.model.reset_state(work.reset_rows)
        self.rig.apply(work)
        self.ref.apply(work)
        return [f"after {work}: {p}" for p in self._compare_state()]

    def _compare(self, got: Outcome, ref: Outcome, want: Outcome) -> list[str]:
        problems = []
        for who, out in (("backend vs contract model", got), ("reference vs contract model", ref)):
            found = outcome_difference(out, want)
            if found:
                problems.append(f"{who}: {found}")
        return problems + self._compare_state()

    def _compare_state(self) -> list[str]:
        problems = []
        want_stats = self.model.counters.as_tuple()
        for who, rig in (("backend", self.rig), ("reference", self.ref)):
            for q in range(self.config.max_requests):
                hot_map, lru = rig.hot(q)
                state = self.model.states[q]
                for what, g, w in (("hot map", hot_map, state.hot_map), ("LRU order", lru, state.lru)):
                    found = first_difference(f"{who} {what} of state row {q}", g, w)
                    if found:
                        problems.append(found)
                if sorted(lru) != list(range(self.config.hot_rows)):
                    problems.append(f"{who}: LRU of state row {q} is not a permutation: {lru}")
                held = [g for g in hot_map if g >= 0]
                if len(held) != len(set(held)):
                    problems.append(f"{who}: hot map of state row {q} repeats a host row: {hot_map}")
            found = first_difference(f"{who} stats (resident, hits, misses, h2d, d2h)", rig.stats(), want_stats)
            if found:
                problems.append(found)
        return problems

    def _check_bytes(self, sources: list[list[int]], layers: range) -> list[str]:
        """Every host entry's row holds its host row's bytes; both backends' caches agree."""
        problems = []
        pairs = [(d, g) for rows, srcs in zip(self.model.last.rows, sources, strict=True)  # type: ignore[union-attr]
                 for d, g in zip(rows, srcs, strict=True) if g >= 0]
        for layer in layers:
            if pairs:
                device = self.rig.device_bytes(layer, [d for d, _ in pairs])
                host = self.rig.host_bytes(layer, [g for _, g in pairs])
                bad = (device != host).any(dim=1).nonzero().flatten().tolist()
                if bad:
                    d, g = pairs[bad[0]]
                    problems.append(f"layer {layer}: {len(bad)} host entries read bytes that are not their host "
                                    f"row's (first: device row {d} should hold host row {g})")
        for layer in range(self.config.num_layers):
            if not torch.equal(self.rig.device_cache_bytes(layer), self.ref.device_cache_bytes(layer)):
                problems.append(f"layer {layer}: the device cache differs from the reference's after the call "
                                f"(a copy the contract does not ask for, or a missing one)")
        return problems
