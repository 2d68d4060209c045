"""The prefetch simulation (`hisparse_core.replay.prefetch_sim`) and the reference-layer lists it
and the serving bench take (`locality.parse_reference_layers`): off is the plain per-group LRU;
with the prefetch a group whose top-k equals its predecessor's has no critical miss; resident pages
bypass the buffers; adjacent reference layers let the prefetch take most of the later groups'
critical misses where spread ones do not. Top-k 256, seeded, a few seconds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_core.replay.locality import REFERENCE_LAYERS, parse_reference_layers
from hisparse_core.replay.lru_sim import LruHotBuffer
from hisparse_core.replay.prefetch_sim import request_trace, simulate

SIM = dict(context=4000, hot_rows=64, block_size=16, resident_pages=0, tail_pages=0)


def _random_traces(seed: int, requests: int, steps: int, groups: int, k: int, span: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[np.stack([rng.choice(span, size=k, replace=False) for _ in range(groups)]) for _ in range(steps)]
            for _ in range(requests)]


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 3), st.integers(2, 4))
def test_off_is_the_plain_lru_of_each_group(seed: int, requests: int, groups: int) -> None:
    traces = _random_traces(seed, requests, 8, groups, 24, 120)
    got = simulate(traces, "off", warmup=2, **SIM)
    want = [0] * groups
    for trace in traces:
        bufs = [LruHotBuffer(64) for _ in range(groups)]
        for t, picks in enumerate(trace):
            for g in range(groups):
                miss = bufs[g].access(picks[g])[1]
                want[g] += miss if t >= 2 else 0
    assert list(got.critical_by_group) == want and got.prefetch_misses == 0
    assert got.lookups == requests * 6 * groups * 24 and got.resident == 0


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000))
def test_the_prefetch_takes_every_miss_of_a_group_that_repeats_its_predecessor(seed: int) -> None:
    """Groups with the same top-k: the prefetch copies what the next group would miss, so after the
    first group nothing misses on the critical path, and the copies are the same count as off's."""
    base = _random_traces(seed, 2, 8, 1, 24, 120)
    traces = [[np.repeat(p, 3, axis=0) for p in trace] for trace in base]
    off = simulate(traces, "off", warmup=2, **SIM)
    on = simulate(traces, "next", warmup=2, **SIM)
    assert on.critical_by_group[1:] == (0, 0) and on.critical_by_group[0] == off.critical_by_group[0]
    assert on.prefetch_misses == sum(off.critical_by_group[1:])


def test_resident_pages_bypass_the_buffers() -> None:
    traces = _random_traces(3, 1, 6, 2, 24, 320)
    all_res = simulate(traces, "next", warmup=1, **{**SIM, "resident_pages": 20})      # 320 positions, pages of 16
    assert all_res.resident == all_res.lookups > 0 and all_res.critical_misses == all_res.prefetch_misses == 0
    # the tail pages of the step's context (4000 + t + 1 tokens): none of these picks reach it
    tail = simulate(traces, "off", warmup=1, **{**SIM, "tail_pages": 2})
    assert tail.resident == 0 and tail.critical_misses == simulate(traces, "off", warmup=1, **SIM).critical_misses


def test_bad_variant_and_warmup_are_refused() -> None:
    traces = _random_traces(0, 1, 3, 2, 8, 50)
    with pytest.raises(ValueError, match="prefetch variant 'ahead'"):
        simulate(traces, "ahead", warmup=1, **SIM)
    with pytest.raises(ValueError, match="warmup=3 leaves none of the 3 steps"):
        simulate(traces, "off", warmup=3, **SIM)


@pytest.mark.parametrize("name", ["code", "benign"])
def test_adjacent_reference_layers_let_the_prefetch_take_the_later_groups_misses(name: str) -> None:
    """Under the locality model (top-k 256, hot buffer 2x): with adjacent reference layers the
    prefetch leaves groups 1-3 under 30% of their critical misses; with spread ones (20 layers
    apart) above half. Group 0 has no predecessor either way."""
    k, steps, warmup = 256, 16, 6
    cuts = {}
    for refs in ([0, 20, 40, 60], [20, 21, 22, 23]):
        traces = [request_trace(name, refs, top_k=k, context=32 * k, steps=steps, seed=1, request_id=r)
                  for r in range(3)]
        kw = dict(context=32 * k, hot_rows=2 * k, block_size=16, resident_pages=0, tail_pages=0, warmup=warmup)
        off, on = simulate(traces, "off", **kw), simulate(traces, "next", **kw)
        assert on.critical_by_group[0] == off.critical_by_group[0]
        cuts[refs[0]] = sum(on.critical_by_group[1:]) / sum(off.critical_by_group[1:])
    assert cuts[20] < 0.3 < 0.5 < cuts[0], cuts


def test_reference_layer_lists_parse_and_refuse_in_one_line() -> None:
    assert parse_reference_layers("f", "spread", range(4), 4) == [0, 20, 40, 60]
    assert parse_reference_layers("f", None, [0, 2], 4) == [0, 40]
    assert parse_reference_layers("f", "20, 21,22,23", range(4), 4) == [20, 21, 22, 23]
    assert parse_reference_layers("f", [np.int64(5), 9], range(2), 2) == [5, 9]  # type: ignore[list-item]
    for spec, msg in (("20,21,22", "3 layers for 4 index groups"), ("21,20,22,23", "not strictly ascending"),
                      ("20,20,21,22", "not strictly ascending"), (f"1,2,3,{REFERENCE_LAYERS}", "not strictly"),
                      ("20,21,x,23", "'x' is not a layer"), ("-1,2,3,4", "'-1' is not a layer"),
                      ([1.5, 2, 3, 4], "not all ints"), ([True, 2, 3, 4], "not all ints")):
        with pytest.raises(ValueError, match=msg) as info:
            parse_reference_layers("--reference-layers", spec, range(4), 4)  # type: ignore[arg-type]
        text = str(info.value)
        assert "\n" not in text and text.startswith(f"--reference-layers={spec!r}") and "expected 'spread'" in text


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 4), st.data())
def test_pairs_and_resident_groups_change_only_what_they_name(seed: int, groups: int, data: st.DataObject) -> None:
    """`pairs`: copies land only in the successors of the chosen groups, every pair is the default,
    none is `off`; `resident_groups`: no lookups, no misses, nothing prefetched into them, and the
    other groups' buffers see what they saw without them (their own lookups; a resident group's
    successor is still prefetched from its top-k). One hot size equals that size per group."""
    traces = _random_traces(seed, 2, 8, groups, 24, 160)
    pairs = data.draw(st.lists(st.integers(0, groups - 2), unique=True))
    resident = data.draw(st.lists(st.integers(0, groups - 1), unique=True, max_size=groups - 1))
    every = simulate(traces, "next", warmup=2, **SIM)
    assert simulate(traces, "next", warmup=2, pairs=range(groups - 1), **SIM) == every
    none, plain = simulate(traces, "next", warmup=2, pairs=[], **SIM), simulate(traces, "off", warmup=2, **SIM)
    assert none.critical_by_group == plain.critical_by_group and none.prefetch_misses == 0
    assert simulate(traces, "next", warmup=2, **{**SIM, "hot_rows": [64] * groups}) == every
    chosen = simulate(traces, "next", warmup=2, pairs=pairs, resident_groups=resident, **SIM)
    off = simulate(traces, "off", warmup=2, **SIM)
    targets = {g + 1 for g in pairs} - set(resident)
    assert {g for g, n in enumerate(chosen.prefetch_by_group) if n} <= targets
    for g in range(groups):
        if g in resident:
            assert chosen.critical_by_group[g] == chosen.prefetch_by_group[g] == 0
        elif g not in targets:
            assert chosen.critical_by_group[g] == off.critical_by_group[g], (g, chosen, off)
    assert chosen.lookups == off.lookups * (groups - len(resident)) // groups


def test_a_resident_groups_successor_is_prefetched_from_its_top_k() -> None:
    base = _random_traces(5, 2, 8, 1, 24, 120)
    traces = [[np.repeat(p, 2, axis=0) for p in trace] for trace in base]   # group 1 repeats group 0
    got = simulate(traces, "next", warmup=2, resident_groups=[0], **SIM)
    assert got.critical_by_group == (0, 0) and got.prefetch_by_group[1] > 0


def test_bad_hot_rows_and_groups_are_refused() -> None:
    traces = _random_traces(0, 1, 3, 2, 8, 50)
    with pytest.raises(ValueError, match=r"hot_rows=\[64\]: 1 sizes for 2 groups"):
        simulate(traces, "off", warmup=1, **{**SIM, "hot_rows": [64]})
    with pytest.raises(ValueError, match="group 2 in pairs/resident_groups"):
        simulate(traces, "next", warmup=1, pairs=[2], **SIM)
