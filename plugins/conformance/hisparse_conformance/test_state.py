"""Hot-state maintenance and counters: invalidations forget exactly the slots named and keep the
LRU order, reloaded rows bring their new bytes, reset returns rows to empty, counters reset."""

from __future__ import annotations

import random
from dataclasses import replace

import torch
from hypothesis import given
from hypothesis import strategies as st

from hisparse_conformance.examples import examples
from hisparse_conformance.model import ResolverModel
from hisparse_conformance.rig import Rig, usable_format
from hisparse_conformance.scenario import (
    Layout,
    Scenario,
    Step,
    Tables,
    as_tensor,
    build_scenario,
    random_bytes,
    scenario_params,
)
from hisparse_core.backend import Backend
from hisparse_core.geometry import RuntimeConfig
from hisparse_core.runtime import RuntimeStats


def _warm(data: st.DataObject, backend: Backend) -> tuple[Scenario, int]:
    params = data.draw(scenario_params(rows_per_request=1, num_layers=1, row_format=usable_format(backend),
                                       max_steps=5))
    params = replace(params, null_share=0.0, resident_share=min(params.resident_share, 0.3), maintenance_share=0.0)
    return build_scenario(params), params.seed


def _states(rig: Rig) -> list[tuple[list[int], list[int]]]:
    return [rig.hot(q) for q in range(rig.config.max_requests)]


def _model_states(model: ResolverModel) -> list[tuple[list[int], list[int]]]:
    return [(s.hot_map[:], s.lru[:]) for s in model.states]


@examples(25)
@given(data=st.data())
def test_invalidated_rows_are_forgotten_and_reloaded(hisparse_backend: Backend, data: st.DataObject) -> None:
    scenario, seed = _warm(data, hisparse_backend)
    cfg = scenario.layout.config
    rng = random.Random(seed)
    model = ResolverModel(cfg)
    with Rig(hisparse_backend, scenario.layout, seed=seed) as rig:
        for n, (step, _) in enumerate(scenario.steps):
            t = step.tables
            rig.resolve(step)
            model.resolve(step.topk, step.row_state, step.seq_lens, t.source, t.resident, t.hot)
            held = [(q, g) for q, s in enumerate(model.states) for g in s.hot_map if g >= 0]
            stale = rng.sample(held, rng.randint(0, len(held)))
            others = [(rng.choice([-1, rng.randrange(cfg.max_requests)]), rng.randrange(scenario.layout.host_blocks
                                                                                       * cfg.block_size))
                      for _ in range(rng.randint(0, 3))]
            pairs = stale + others
            rng.shuffle(pairs)
            # Rewrite a row on the host only where every hot copy of it is being forgotten (a
            # prefix-shared row may be held by a state row not named here, which keeps serving it).
            named = {(q, g) for q, g in pairs if q >= 0}
            rewritten = sorted({g for _, g in named if all((q, g) in named for q, g2 in held if g2 == g)})
            if rewritten:
                rig.write_host_rows(0, rewritten, random_bytes((len(rewritten), cfg.row_format.row_bytes), seed, 4, n))
            lru_before = [lru for _, lru in _states(rig)]
            if pairs:
                rig.runtime.invalidate_written_slots(as_tensor([q for q, _ in pairs], rig.device),
                                                     as_tensor([g for _, g in pairs], rig.device))
            model.invalidate_written_slots(pairs)
            assert _states(rig) == _model_states(model), (
                "invalidate_written_slots forgets exactly the named (state row, host row) slots (docs/resolver-contract.md: Invalidation)")
            assert [lru for _, lru in _states(rig)] == lru_before, "invalidation must not move LRU positions"
            misses_before = rig.stats()[2]
            out = rig.resolve(step)  # the same step again: exactly the forgotten rows miss
            want = model.resolve(step.topk, step.row_state, step.seq_lens, t.source, t.resident, t.hot)
            assert out.plan() == want.plan(), "a forgotten row misses again and is reloaded from host"
            assert rig.stats()[2] - misses_before == len(want.plan()), "every reload counts as a miss"
            pairs_read = [(d, g) for drow, grow in zip(want.rows, want.sources, strict=True)
                          for d, g in zip(drow, grow, strict=True) if g >= 0]
            if pairs_read:
                assert torch.equal(rig.device_bytes(0, [d for d, _ in pairs_read]),
                                   rig.host_bytes(0, [g for _, g in pairs_read])), "a row rewritten on host and invalidated must be served with its new bytes, not the stale ones"


@examples(25)
@given(data=st.data())
def test_recycled_host_blocks_are_forgotten_everywhere(hisparse_backend: Backend, data: st.DataObject) -> None:
    scenario, seed = _warm(data, hisparse_backend)
    cfg = scenario.layout.config
    rng = random.Random(seed)
    model = ResolverModel(cfg)
    with Rig(hisparse_backend, scenario.layout, seed=seed) as rig:
        for step, _ in scenario.steps:
            t = step.tables
            rig.resolve(step)
            model.resolve(step.topk, step.row_state, step.seq_lens, t.source, t.resident, t.hot)
            held_blocks = sorted({g // cfg.block_size for s in model.states for g in s.hot_map if g >= 0})
            blocks = rng.sample(held_blocks, rng.randint(0, len(held_blocks)))
            blocks += rng.sample(range(scenario.layout.host_blocks), rng.randint(0, 2))
            before = _states(rig)
            rig.runtime.invalidate_host_blocks(blocks)
            model.invalidate_host_blocks(blocks)
            after = _states(rig)
            assert after == _model_states(model), (
                "invalidate_host_blocks forgets every hot slot of those blocks in every state row (docs/resolver-contract.md: Invalidation)")
            assert [lru for _, lru in after] == [lru for _, lru in before], "invalidation must not move LRU positions"
            for hot_map, _ in after:
                assert not {g // cfg.block_size for g in hot_map if g >= 0} & set(blocks), (
                    "no hot slot may still map a row of an invalidated host block")


@examples(20)
@given(data=st.data())
def test_reset_state_empties_only_the_rows_named(hisparse_backend: Backend, data: st.DataObject) -> None:
    scenario, seed = _warm(data, hisparse_backend)
    cfg = scenario.layout.config
    empty = ([-1] * cfg.hot_rows, list(range(cfg.hot_rows)))
    with Rig(hisparse_backend, scenario.layout, seed=seed) as rig:
        for step, _ in scenario.steps:
            rig.resolve(step)
        before, stats = _states(rig), rig.stats()
        rows = data.draw(st.lists(st.integers(0, cfg.max_requests - 1), unique=True), label="reset rows")
        rig.runtime.reset_state(rows)
        for q, state in enumerate(_states(rig)):
            assert state == (empty if q in rows else before[q]), f"reset_state(rows) empties exactly the rows named (all slots -1, LRU 0..hot_rows-1); state row {q}"
        assert rig.stats() == stats, "reset_state must not change the counters"
        rig.runtime.reset_state()
        assert _states(rig) == [empty] * cfg.max_requests, "reset_state() with no rows empties every state row"


@examples(15)
@given(data=st.data())
def test_counters_accumulate_and_reset(hisparse_backend: Backend, data: st.DataObject) -> None:
    """stats() sums every call since construction or reset_stats(), which zeroes all five."""
    scenario, seed = _warm(data, hisparse_backend)
    cfg = scenario.layout.config
    model = ResolverModel(cfg)
    cut = data.draw(st.integers(0, len(scenario.steps)), label="reset_stats after step")
    with Rig(hisparse_backend, scenario.layout, seed=seed) as rig:
        for n, (step, _) in enumerate(scenario.steps):
            if n == cut:
                rig.runtime.reset_stats()
                model.reset_stats()
                assert rig.stats() == (0, 0, 0, 0, 0), "reset_stats() zeroes all five counters"
            t = step.tables
            rig.resolve(step)
            model.resolve(step.topk, step.row_state, step.seq_lens, t.source, t.resident, t.hot)
            model.count_copies(1)
            assert rig.stats() == model.counters.as_tuple(), (
                "stats() sums every call since construction or reset_stats() (docs/resolver-contract.md: Counters)")
        stats = rig.runtime.stats()
        fields = ("resident", "hits", "misses", "h2d_bytes", "d2h_bytes")
        assert isinstance(stats, RuntimeStats) and all(type(getattr(stats, f)) is int for f in fields), (
            "stats() returns a RuntimeStats of Python ints (read back to the host); got "
            + (", ".join(f"{f}={type(getattr(stats, f)).__name__}" for f in fields)
               if isinstance(stats, RuntimeStats) else type(stats).__name__))
        looked_up = stats.hits + stats.misses
        assert stats.hit_rate == (stats.hits / looked_up if looked_up else 1.0), (
            "hit_rate is hits / (hits + misses), 1.0 when nothing was looked up")


def test_hot_state_is_a_cpu_copy(hisparse_backend: Backend) -> None:
    config = RuntimeConfig(max_batch_rows=1, max_requests=1, top_k=2, hot_rows=4, block_size=2, max_pages=2,
                           row_format=usable_format(hisparse_backend))
    tables = Tables(source=[[3, 1]], resident=[[-1, -1]], hot=[[0, 2]])
    with Rig(hisparse_backend, Layout(config, host_blocks=4, num_device_blocks=3), seed=9) as rig:
        rig.resolve(Step([[3, 0]], [0], [4], tables))
        want = ([3, 6, -1, -1], [2, 3, 0, 1])  # host rows 1*2+1 and 3*2+0 in slots 0 and 1
        hot_map, lru = rig.runtime.hot_state(0)
        assert (hot_map.tolist(), lru.tolist()) == want, "hot_state(q) returns (hot map, LRU order) of state row q"
        assert hot_map.device.type == "cpu" and lru.device.type == "cpu", "hot_state returns CPU tensors"
        hot_map.fill_(7)
        lru.fill_(0)
        assert rig.hot(0) == want, "hot_state must return a copy: writing to it changed the runtime's state"
