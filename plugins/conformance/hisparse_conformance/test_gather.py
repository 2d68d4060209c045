"""Miss copies: gathered and replayed rows hold their host rows' bytes, hits copy nothing, and
nothing else in the device caches is written. Bytes are compared as bytes, so bf16 rows whose
random bits spell NaN compare exactly."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hisparse_conformance.examples import examples
from hisparse_conformance.lockstep import Lockstep
from hisparse_conformance.model import ResolverModel
from hisparse_conformance.rig import Rig, usable_format
from hisparse_conformance.scenario import build_scenario, out_of_context, random_bytes, scenario_params
from hisparse_core.backend import Backend, Capability
from hisparse_core.errors import InvalidInputError
from hisparse_core.geometry import BF16_MLA, FP8_DS_MLA, RowFormat

FORMATS = [
    pytest.param(FP8_DS_MLA, marks=pytest.mark.requires_capability(Capability.FP8_DS_MLA), id="fp8_ds_mla"),
    pytest.param(BF16_MLA, marks=pytest.mark.requires_capability(Capability.BF16_MLA), id="bf16_mla"),
]


def _changed_rows(before: torch.Tensor, after: torch.Tensor, row_bytes: int) -> set[int]:
    diff = (before.reshape(-1, row_bytes) != after.reshape(-1, row_bytes)).any(dim=1)
    return set(diff.nonzero().flatten().tolist())


@pytest.mark.parametrize("fmt", FORMATS)
@examples(12)
@given(data=st.data())
def test_gathered_rows_hold_host_bytes(hisparse_backend: Backend, hisparse_reference: Backend, fmt: RowFormat,
                                       data: st.DataObject) -> None:
    """After resolve(gather=True) every host entry reads its host row (656-byte fp8 rows and
    1152-byte bf16 rows alike) and the device caches equal the reference's."""
    params = data.draw(scenario_params(rows_per_request=1, num_layers=1, row_format=fmt, max_steps=8))
    scenario = build_scenario(params)
    with Lockstep(hisparse_backend, hisparse_reference, scenario.layout, seed=params.seed) as run:
        for step, work in scenario.steps:
            problems = run.resolve(step) + run.apply(work)
            assert not problems, "\n".join(problems[:10])


@pytest.mark.requires_capability(Capability.INDEX_SHARING)
@pytest.mark.parametrize("fmt", FORMATS)
@examples(12)
@given(data=st.data())
def test_followers_replay_the_leaders_plan(hisparse_backend: Backend, hisparse_reference: Backend,
                                          fmt: RowFormat, data: st.DataObject) -> None:
    """With num_layers > 1, replay_plan() brings every follower layer's rows to its host bytes."""
    layers = data.draw(st.integers(2, 4), label="num_layers")
    params = data.draw(scenario_params(rows_per_request=1, num_layers=layers, row_format=fmt, max_steps=8))
    scenario = build_scenario(params)
    with Lockstep(hisparse_backend, hisparse_reference, scenario.layout, seed=params.seed) as run:
        for step, work in scenario.steps:
            problems = run.resolve(step, replay=True) + run.apply(work)
            assert not problems, "\n".join(problems[:10])


@examples(20)
@given(data=st.data())
def test_deferred_gather_matches_fused_gather(hisparse_backend: Backend, data: st.DataObject) -> None:
    """resolve(gather=False) copies nothing; gather_misses(0) then does what gather=True does."""
    params = data.draw(scenario_params(rows_per_request=1, num_layers=1, row_format=usable_format(hisparse_backend),
                                       max_steps=6))
    scenario = build_scenario(params)
    with Rig(hisparse_backend, scenario.layout, seed=params.seed) as fused, \
            Rig(hisparse_backend, scenario.layout, seed=params.seed) as deferred:
        for step, _ in scenario.steps:
            want = fused.resolve(step, gather=True)
            before = (deferred.device_cache_bytes(0), deferred.stats()[3])
            got = deferred.resolve(step, gather=False)
            assert got == want, "resolve(gather=False) returns the same outputs as resolve(gather=True)"
            assert torch.equal(deferred.device_cache_bytes(0), before[0]), "resolve(gather=False) must copy no row"
            assert deferred.stats()[3] == before[1], "resolve(gather=False) must count no host-to-device bytes"
            deferred.runtime.gather_misses(0)
            assert torch.equal(deferred.device_cache_bytes(0), fused.device_cache_bytes(0)), (
                "gather_misses(0) after resolve(gather=False) writes exactly what resolve(gather=True) writes (docs/resolver-contract.md: Copies)")
            assert deferred.stats() == fused.stats(), "deferred and fused gathers count the same (docs/resolver-contract.md: Counters)"


@pytest.mark.parametrize("fmt", FORMATS)
@examples(20)
@given(data=st.data())
def test_hits_copy_nothing(hisparse_backend: Backend, fmt: RowFormat, data: st.DataObject) -> None:
    """Sentinel bytes written into every held hot row survive a call unless that row is one of the
    call's victims: hits are served in place, and only plan rows are written (with host bytes).
    Repeating a step makes every host entry a hit: no plan, no h2d bytes, no byte changes."""
    params = data.draw(scenario_params(rows_per_request=1, num_layers=1, row_format=fmt, max_steps=6))
    scenario = build_scenario(params)
    cfg = scenario.layout.config
    model = ResolverModel(cfg)
    with Rig(hisparse_backend, scenario.layout, seed=params.seed) as rig:
        for n, (step, _) in enumerate(scenario.steps):
            t = step.tables
            held_rows = [model.hot_row(t.hot, q, s) for q, st_ in enumerate(model.states)
                         for s, g in enumerate(st_.hot_map) if g >= 0]
            if held_rows:
                rig.write_device_rows(0, held_rows, random_bytes((len(held_rows), fmt.row_bytes), params.seed, 3, n))
            for repeat in (False, True):
                before, h2d = rig.device_cache_bytes(0), rig.stats()[3]
                out = rig.resolve(step)
                want = model.resolve(step.topk, step.row_state, step.seq_lens, t.source, t.resident, t.hot)
                plan = out.plan()
                assert plan == want.plan(), "the miss plan must equal the reference model's (docs/resolver-contract.md: The miss plan)"
                changed = _changed_rows(before, rig.device_cache_bytes(0), fmt.row_bytes)
                assert changed <= {d for _, d in plan}, f"rows written that are not in the plan: " \
                                                        f"{sorted(changed - {d for _, d in plan})}"
                assert rig.stats()[3] - h2d == len(plan) * fmt.row_bytes, (
                    "host-to-device bytes count len(plan) * row_bytes per gathered layer (docs/resolver-contract.md: Counters)")
                if plan:
                    assert torch.equal(rig.device_bytes(0, [d for _, d in plan]), rig.host_bytes(0, [h for h, _ in plan])), (
                        "each planned hot slot must hold the bytes of its host row after the gather (docs/resolver-contract.md: Copies)")
                if repeat:
                    assert not plan, "a step repeated at once must hit: its rows are in the hot buffer, nothing to copy"


@pytest.mark.requires_capability(Capability.INDEX_SHARING)
@examples(15)
@given(data=st.data())
def test_each_layer_is_copied_only_when_asked(hisparse_backend: Backend, data: st.DataObject) -> None:
    """gather_misses(layer) and replay_plan(layers) write exactly the layers named, with host
    bytes into plan rows only, and count |misses| * row_bytes per layer copied (a layer listed twice,
    or layer 0, included; an empty list names none, where None names every follower:
    docs/resolver-contract.md: Copies)."""
    layers = data.draw(st.integers(2, 4), label="num_layers")
    params = data.draw(scenario_params(rows_per_request=1, num_layers=layers,
                                       row_format=usable_format(hisparse_backend), max_steps=4))
    scenario = build_scenario(params)
    row_bytes = scenario.layout.config.row_format.row_bytes
    followers = list(range(1, layers))
    with Rig(hisparse_backend, scenario.layout, seed=params.seed) as rig:
        for step, _ in scenario.steps:
            plan = rig.resolve(step, gather=False).plan()
            follower = data.draw(st.sampled_from(followers), label="follower")
            some = data.draw(st.lists(st.sampled_from(range(layers)), min_size=1, max_size=layers + 1), label="replayed")
            for action, written in ((lambda f=follower: rig.runtime.gather_misses(f), [follower]),
                                    (lambda s=some: rig.runtime.replay_plan(s), some),
                                    (lambda: rig.runtime.replay_plan([]), []),
                                    (lambda: rig.runtime.gather_misses(0), [0]),
                                    (lambda: rig.runtime.replay_plan(), followers)):
                before = [rig.device_cache_bytes(layer) for layer in range(layers)]
                h2d = rig.stats()[3]
                action()
                for layer in range(layers):
                    changed = _changed_rows(before[layer], rig.device_cache_bytes(layer), row_bytes)
                    if layer not in written:
                        assert not changed, f"layer {layer} was written; only {written} were asked for"
                        continue
                    assert changed <= {d for _, d in plan}, f"layer {layer}: rows outside the plan were written"
                    if plan:
                        assert torch.equal(rig.device_bytes(layer, [d for _, d in plan]),
                                           rig.host_bytes(layer, [h for h, _ in plan])), (
                            f"layer {layer}: each planned slot must hold its host row's bytes of that layer")
                assert rig.stats()[3] - h2d == len(plan) * row_bytes * len(written), (
                    f"host-to-device bytes count len(plan) * row_bytes for each layer copied, each time it is listed "
                    f"({written}) (docs/resolver-contract.md: Counters)")


@pytest.mark.requires_capability(Capability.INDEX_SHARING)
@examples(12)
@given(data=st.data())
def test_a_prefetch_is_a_resolve_that_copies_every_layer(hisparse_backend: Backend, data: st.DataObject) -> None:
    """`prefetch(inputs)` (the cross-layer prefetch's call; a backend may run its copies with fewer
    resources) leaves every buffer as `resolve(inputs, gather=True, validate=False)` then
    `replay_plan()` does: outputs, plan, hot maps, LRU orders, counters, every device and host byte.
    Like that resolve it validates no values: positions out of context are masked, not refused."""
    layers = data.draw(st.integers(1, 3), label="num_layers")
    params = data.draw(scenario_params(rows_per_request=1, num_layers=layers,
                                       row_format=usable_format(hisparse_backend), max_steps=8))
    scenario = build_scenario(params)
    rng = random.Random(params.seed ^ 0x9E7C)
    with Rig(hisparse_backend, scenario.layout, seed=params.seed) as prefetched, \
            Rig(hisparse_backend, scenario.layout, seed=params.seed) as plain:
        for n, (step, work) in enumerate(scenario.steps):
            if rng.random() < 0.5:
                step = out_of_context(step, scenario.layout.config, rng)
            try:
                prefetched.runtime.prefetch(prefetched.inputs(step))
            except InvalidInputError as exc:
                pytest.fail(f"step {n}: prefetch raised {exc}; like resolve(validate=False) it must mask positions "
                            "out of context, not refuse them (docs/resolver-contract.md: Classifying an entry)")
            prefetched.check_workspace()
            plain.resolve(step, gather=True, validate=False)
            if layers > 1:
                plain.runtime.replay_plan()
            assert prefetched.snapshot() == plain.snapshot(), f"step {n}: prefetch differs from resolve + replay_plan"
            prefetched.apply(work)
            plain.apply(work)
