"""Rollback of rejected speculative rows: after a verification call (several rows of one request
resolved as one union), the rows the verification rejected are rewritten on host with the
accepted tokens' bytes and their hot copies are forgotten (`invalidate_written_slots`, what an
engine's crop does). The hot state must forget exactly those slots and keep the LRU order, and the
next verification must reload exactly them and serve the new bytes, in every layer, never the
rejected ones (docs/resolver-contract.md: Speculative rows, Invalidation)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hisparse_conformance.examples import examples
from hisparse_conformance.model import ResolverModel
from hisparse_conformance.rig import Rig, usable_format
from hisparse_conformance.scenario import as_tensor, build_scenario, random_bytes, scenario_params
from hisparse_core.backend import Backend, Capability


@pytest.mark.requires_capability(Capability.SPECULATIVE_UNION)
@examples(20)
@given(data=st.data(), rows=st.integers(2, 3))
def test_rejected_rows_are_forgotten_and_reloaded_with_the_accepted_bytes(hisparse_backend: Backend,
                                                                          data: st.DataObject, rows: int) -> None:
    params = data.draw(scenario_params(rows_per_request=rows, num_layers=None, row_format=usable_format(hisparse_backend),
                                       max_steps=5))
    # Private host rows (no shared prefix): every hot copy of a rejected row belongs to its request.
    params = replace(params, prefix_share=0.0, null_share=0.0, maintenance_share=0.0,
                     resident_share=min(params.resident_share, 0.3))
    scenario = build_scenario(params)
    cfg = scenario.layout.config
    rng = random.Random(params.seed)
    model = ResolverModel(cfg)
    with Rig(hisparse_backend, scenario.layout, seed=params.seed) as rig:
        for n, (step, _) in enumerate(scenario.steps):
            t = step.tables
            out = rig.resolve(step)
            rig.runtime.replay_plan()              # every layer holds what the hot slots hold
            want = model.resolve(step.topk, step.row_state, step.seq_lens, t.source, t.resident, t.hot)
            assert out.plan() == want.plan(), "the verification call's miss plan is the reference's"
            # Each request rejects a random share of the host rows its rows read this call.
            read: dict[int, set[int]] = {}
            for q, sources in zip(step.row_state, want.sources, strict=False):
                if q >= 0:
                    read.setdefault(q, set()).update(g for g in sources if g >= 0)
            pairs = [(q, g) for q, gs in sorted(read.items()) for g in sorted(gs) if rng.random() < 0.5]
            if not pairs:
                continue
            host_rows = sorted({g for _, g in pairs})
            for layer in range(cfg.num_layers):
                rig.write_host_rows(layer, host_rows, random_bytes((len(host_rows), cfg.row_format.row_bytes),
                                                                   params.seed, 9, n, layer))
            lru_before = [rig.hot(q)[1] for q in range(cfg.max_requests)]
            rig.runtime.invalidate_written_slots(as_tensor([q for q, _ in pairs], rig.device),
                                                 as_tensor([g for _, g in pairs], rig.device))
            model.invalidate_written_slots(pairs)
            for q in range(cfg.max_requests):
                assert rig.hot(q) == (model.states[q].hot_map, model.states[q].lru), (
                    f"state row {q}: a rollback forgets exactly the rejected rows' hot slots (docs/resolver-contract.md: "
                    "Invalidation)")
                assert rig.hot(q)[1] == lru_before[q], "a rollback must not move LRU positions"
            misses_before = rig.stats()[2]
            again = rig.resolve(step)              # the next verification reads the same positions
            rig.runtime.replay_plan()
            want = model.resolve(step.topk, step.row_state, step.seq_lens, t.source, t.resident, t.hot)
            assert again.plan() == want.plan(), "the rejected rows miss again and are reloaded from host"
            assert {h for h, _ in want.plan()} >= {g for _, g in pairs if g in {
                s for srcs in want.sources for s in srcs}}, "every rejected row read again is a miss"
            assert rig.stats()[2] - misses_before == len(want.plan()), "every reload counts as a miss"
            served = [(d, g) for drow, grow in zip(want.rows, want.sources, strict=True)
                      for d, g in zip(drow, grow, strict=True) if g >= 0]
            for layer in range(cfg.num_layers):
                assert torch.equal(rig.device_bytes(layer, [d for d, _ in served]),
                                   rig.host_bytes(layer, [g for _, g in served])), (
                    f"layer {layer}: a rolled-back row must be served with the accepted bytes, not the rejected ones")
