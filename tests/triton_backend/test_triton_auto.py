"""The triton runtime's knobs per batch size (`hisparse_triton.auto`, `HISPARSE_TRITON_AUTO`): which
profile each batch range gets, that explicit variables win, that picks which do not combine with them
(or PDL where the target lacks it) are left out, and that bad values are refused in one line.

Host logic only: no kernel runs.
"""

from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_core.errors import InvalidInputError
from hisparse_triton import auto, shapes


def _choose(env: dict[str, str], *, b: int = 128, small: int = 16, pdl: bool = True) -> auto.Choice:
    return auto.choose(env, max_batch_rows=b, small=small, pdl=pdl)


def test_small_and_large_batches_get_their_measured_profiles() -> None:
    c = _choose({})
    assert [p.max_rows for p in c.profiles] == [7, 16, 128]
    one, mid, hi = (p.tuning for p in c.profiles)
    for t in (one, mid):
        assert (t.split, t.threads, t.scan, t.shift, t.lean_copy, t.pdl, t.plan_entries, t.plan_per_sm) == \
            (8, 512, True, True, True, True, 4, 4)
    # Half the line up to it: the small profile plus the speculative copy of 128 entries (call E5); smaller batches without it.
    assert (one.spec_copy, mid.spec_copy, hi.spec_copy) == (0, 128, 0)
    assert c.profiles[1].picked == c.profiles[0].picked + (shapes.SPEC_COPY_ENV,)
    assert (hi.split, hi.threads, hi.scan, hi.shift, hi.lean_copy, hi.pdl) == (0, None, True, True, True, False)
    assert (hi.plan_entries, hi.plan_per_sm) == (shapes.COPY_ENTRIES, shapes.PLAN_PER_SM)
    for t in (one, mid, hi):  # nothing auto never picks
        assert (t.resolver, t.fuse, t.lean, t.cas, t.row_copy, t.split_tail, t.split_keep) == (
            "gather", False, True, False, False, False, False)
    assert auto.variant(one) == "gather:t512:p4:e4:s1:b1:d1:n8:v1" and auto.variant(hi) == "gather:s1:b1:v1"
    assert auto.variant(mid) == "gather:t512:p4:e4:s1:b1:d1:n8:v1:x128"
    assert "\n" not in c.line and "batches of 1-7 rows gather:t512:p4:e4:s1:b1:d1:n8:v1 (" in c.line
    assert "; 8-16 rows gather:t512:p4:e4:s1:b1:d1:n8:v1:x128 (" in c.line and "; 17-128 rows gather:s1:b1:v1 (" in c.line
    # Why, once each: E5's figures for the speculative copy at B = 8 and 16 and against it at B = 2.
    assert c.line.count("call E5") == 1 and "52.0 -> 44.1" in c.line and "287.5 -> 267.9" in c.line
    assert "not below half the small line" in c.line and c.line.count("C4 and D1") == 1


@given(rows=st.integers(1, 128), small=st.integers(1, 200), b=st.integers(1, 128))
@settings(max_examples=80, deadline=None)
def test_each_batch_takes_the_profile_of_its_range(rows: int, small: int, b: int) -> None:
    c = _choose({}, b=b, small=small)
    assert c.profiles[-1].max_rows == b and [p.max_rows for p in c.profiles] == sorted({p.max_rows for p in c.profiles})
    p = c.profile(min(rows, b))
    rows = min(rows, b)
    assert p.tuning.split == (8 if rows <= small else 0)
    assert p.tuning.pdl is (rows <= small)
    assert p.tuning.spec_copy == (128 if auto.spec_rows(small) <= rows <= small else 0)
    # One profile per range that holds a batch: below half the line, half the line up to it, past it.
    assert len(c.profiles) == 1 + (min(small, b) >= auto.spec_rows(small)) + (small < b)


@pytest.mark.parametrize(("b", "small", "bounds", "spec"), [
    (128, 1, [1, 128], [0, 0]),  # a line of 1 row (fewer than 16 multiprocessors): no batch takes the speculative copy
    (1, 16, [1], [0]), (2, 16, [2], [0]), (10, 16, [7, 10], [0, 128]), (2, 1, [1, 2], [0, 0]),
    (3, 2, [1, 2, 3], [0, 128, 0]), (5, 2, [1, 2, 5], [0, 128, 0]),  # the interpreter's line: half the workspace
])
def test_small_workspaces_and_lines_keep_only_ranges_with_batches(b: int, small: int, bounds: list[int],
                                                                   spec: list[int]) -> None:
    c = _choose({}, b=b, small=small)
    assert [p.max_rows for p in c.profiles] == bounds and [p.tuning.spec_copy for p in c.profiles] == spec
    assert ("x128" in c.line) == any(spec) and ("call E5" in c.line) == any(spec)


def test_small_batches_line_is_a_wave_of_split_programs() -> None:
    assert auto.small_rows(132, 128) == 16  # the H200: 8 programs a row on 132 multiprocessors
    assert auto.small_rows(304, 128) == 38  # MI300X
    assert auto.small_rows(4, 128) == 1
    assert auto.small_rows(None, 7) == 3 and auto.small_rows(None, 1) == 1  # the interpreter: half the workspace


def test_no_pdl_where_the_target_lacks_it() -> None:
    c = _choose({}, pdl=False)
    assert not any(p.tuning.pdl for p in c.profiles)
    lo = c.profiles[0].tuning
    assert (lo.split, lo.threads, lo.lean_copy, lo.plan_entries, lo.plan_per_sm) == (8, 512, True, 4, 4)
    assert c.profiles[1].tuning.spec_copy == 128 and c.profiles[1].tuning.split == 8  # without PDL, after the resolver
    assert "HISPARSE_TRITON_PDL not picked" in c.line


def test_off_keeps_the_fixed_defaults() -> None:
    c = _choose({auto.AUTO_ENV: "0"})
    assert len(c.profiles) == 1 and c.profiles[0].tuning == shapes.tuning({}) and c.profiles[0].max_rows == 128
    assert c.profiles[0].picked == () and "HISPARSE_TRITON_AUTO=0" in c.line
    c = _choose({auto.AUTO_ENV: "0", shapes.SCAN_ENV: "1"})
    assert c.profiles[0].tuning == shapes.tuning({shapes.SCAN_ENV: "1"})


@pytest.mark.parametrize(("key", "value"), [(shapes.SPLIT_ENV, "0"), (shapes.SPLIT_ENV, "4"), (shapes.PDL_ENV, "0"),
                                            (shapes.LEAN_COPY_ENV, "0"), (shapes.SCAN_ENV, "0"), (shapes.SHIFT_ENV, "0"),
                                            (shapes.THREADS_ENV, "256"), (shapes.PLAN_ENTRIES_ENV, "16"),
                                            (shapes.PLAN_PER_SM_ENV, "2"), (shapes.ROW_COPY_ENV, "1"),
                                            (shapes.SPEC_COPY_ENV, "0"), (shapes.SPEC_COPY_ENV, "32"),
                                            (shapes.SPEC_COPY_ENV, "128")])
def test_an_explicit_variable_wins_at_every_batch_size(key: str, value: str) -> None:
    c = _choose({key: value})
    for p in c.profiles:
        assert key not in p.picked
        field = {shapes.SPLIT_ENV: "split", shapes.PDL_ENV: "pdl", shapes.LEAN_COPY_ENV: "lean_copy",
                 shapes.SCAN_ENV: "scan", shapes.SHIFT_ENV: "shift", shapes.THREADS_ENV: "threads",
                 shapes.PLAN_ENTRIES_ENV: "plan_entries", shapes.PLAN_PER_SM_ENV: "plan_per_sm",
                 shapes.ROW_COPY_ENV: "row_copy", shapes.SPEC_COPY_ENV: "spec_copy"}[key]
        assert getattr(p.tuning, field) == getattr(shapes.tuning({key: value}), field), (p, key)
    assert f"set explicitly: {key}={value}" in c.line
    if key == shapes.SPEC_COPY_ENV:  # 1-7 rows and 8-16 rows then have the same knobs: one profile
        assert [p.max_rows for p in c.profiles] == [16, 128]


def test_picks_that_do_not_combine_with_explicit_settings_are_left_out() -> None:
    # The scratch resolver has no split, scans, shift or PDL: only the plan copy's picks remain.
    lo = _choose({shapes.RESOLVER_ENV: "scratch"}).profiles[0]
    assert (lo.tuning.split, lo.tuning.scan, lo.tuning.shift, lo.tuning.pdl, lo.tuning.threads) == (0, False, False,
                                                                                                    False, None)
    assert lo.tuning.lean_copy and lo.tuning.plan_entries == 4
    # The split has no fused, CAS or non-LEAN build; its 512 threads go with it.
    for key, value in ((shapes.FUSE_ENV, "1"), (shapes.CAS_ENV, "1"), (shapes.LEAN_ENV, "0")):
        lo = _choose({key: value}).profiles[0]
        assert lo.tuning.split == 0 and lo.tuning.threads is None and lo.tuning.scan, key
        assert shapes.SPLIT_ENV not in lo.picked and shapes.THREADS_ENV not in lo.picked
    lo = _choose({shapes.SPLIT_ENV: "0"}).profiles[0]
    assert lo.tuning.threads is None and lo.tuning.pdl  # no split, no 512 threads; the copy's picks stay
    # The speculative copy runs behind the split resolver only, and not beside its spread tail.
    for env in ({shapes.SPLIT_ENV: "0"}, {shapes.SPLIT_TAIL_ENV: "1", shapes.SPLIT_ENV: "8"},
                {shapes.RESOLVER_ENV: "scratch"}, {shapes.FUSE_ENV: "1"}):
        c = _choose(env)
        assert not any(p.tuning.spec_copy for p in c.profiles) and len(c.profiles) == 2, env
        assert all(shapes.SPEC_COPY_ENV not in p.picked for p in c.profiles) and "x128" not in c.line, env
    c = _choose({shapes.SPLIT_ENV: "4"})  # another split count keeps it
    assert [(p.tuning.split, p.tuning.spec_copy) for p in c.profiles] == [(4, 0), (4, 128), (4, 0)]


def test_a_profile_equal_at_every_size_is_one_profile() -> None:
    explicit = {shapes.SPLIT_ENV: "0", shapes.PDL_ENV: "0", shapes.PLAN_ENTRIES_ENV: "16", shapes.PLAN_PER_SM_ENV: "2"}
    c = _choose(explicit)
    assert len(c.profiles) == 1 and c.profiles[0].max_rows == 128
    assert c.profiles[0].tuning == shapes.tuning(explicit | {shapes.SCAN_ENV: "1", shapes.SHIFT_ENV: "1",
                                                             shapes.LEAN_COPY_ENV: "1"})
    # No batch past the line: below half of it, and half of it up to the workspace; a workspace below half the line: one.
    assert [p.max_rows for p in _choose({}, small=128).profiles] == [63, 128]
    assert [p.max_rows for p in _choose({}, b=4, small=16).profiles] == [4]
    c = _choose({shapes.SPEC_COPY_ENV: "0"}, b=4, small=16)
    assert [p.max_rows for p in c.profiles] == [4] and "every batch (1-4 rows)" in c.line
    assert "every batch (1 row)" in _choose({}, b=1, small=1).line


@pytest.mark.parametrize(("env", "line"), [
    ({auto.AUTO_ENV: "yes"}, "HISPARSE_TRITON_AUTO='yes' is not a switch; expected 0 (the fixed defaults) or 1"),
    ({shapes.SPLIT_ENV: "3"}, "HISPARSE_TRITON_SPLIT='3' is not a program count"),
    ({shapes.SPLIT_TAIL_ENV: "1"}, "HISPARSE_TRITON_SPLIT_TAIL='1' needs the split resolver"),
    ({shapes.PDL_ENV: "1", shapes.RESOLVER_ENV: "scratch"}, "HISPARSE_TRITON_PDL='1' needs the gather resolver"),
    ({shapes.PDL_CHAIN_ENV: "on"}, "HISPARSE_TRITON_PDL_CHAIN='on' is not a switch; expected 0 or 1"),
    ({shapes.PDL_CHAIN_ENV: "1", shapes.PDL_ENV: "0"}, "HISPARSE_TRITON_PDL is '0', expected HISPARSE_TRITON_PDL=1"),
    ({shapes.PDL_CHAIN_ENV: "1", shapes.SPLIT_ENV: "0"}, "HISPARSE_TRITON_PDL_CHAIN='1' chains the split resolver's"),
    ({shapes.PDL_CHAIN_ENV: "1", shapes.SPLIT_ENV: "8", shapes.SPLIT_TAIL_ENV: "1"},
     "HISPARSE_TRITON_PDL_CHAIN='1' does not combine with HISPARSE_TRITON_SPLIT_TAIL='1'"),
    ({shapes.PDL_CHAIN_ENV: "1", auto.AUTO_ENV: "0"}, "expected HISPARSE_TRITON_SPLIT and HISPARSE_TRITON_PDL=1 set"),
])
def test_bad_values_are_refused_in_one_line(env: dict[str, str], line: str) -> None:
    with pytest.raises(InvalidInputError) as err:
        _choose(env)
    assert line in str(err.value) and "\n" not in str(err.value)


def test_variant_strings_round_trip_through_the_bench_parser() -> None:
    """`auto.variant` writes what `bench_triton.py --variants` reads back to the same knobs."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "bench" / "bench_triton.py"
    spec = importlib.util.spec_from_file_location("bench_triton", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_triton"] = bench  # its dataclasses look their module up
    try:
        spec.loader.exec_module(bench)
    finally:
        del sys.modules["bench_triton"]
    for p in (_choose({}).profiles + _choose({shapes.RESOLVER_ENV: "scratch"}).profiles
              + _choose({shapes.SPEC_COPY_ENV: "64"}).profiles):
        env = bench.variant_env(auto.variant(p.tuning) + ":a0")
        assert shapes.tuning({k: v for k, v in env.items() if v is not None}) == p.tuning


def test_chain_joins_the_split_profiles_only() -> None:
    """`HISPARSE_TRITON_PDL_CHAIN`, set explicitly, acts where the split resolver serves with PDL, the
    speculative copy's pick among them."""
    from hisparse_core.geometry import RuntimeConfig
    from hisparse_triton import launches

    cfg = RuntimeConfig(max_batch_rows=32, max_requests=32, top_k=2048, hot_rows=4096, block_size=64, max_pages=512)
    c = _choose({shapes.PDL_CHAIN_ENV: "1"}, b=32, small=16)
    built = [launches.build(cfg, p, lanes=32, multiprocessors=132) for p in c.profiles]
    assert [p.tuning.spec_copy for p in c.profiles] == [0, 128, 0]
    for x in built[:2]:  # the split profiles: the resolver waits for the copy before it, the copies let it launch
        assert x.split_meta["PDL"] == 2 and x.split_meta["launch_pdl"] is True and x.plan_meta["PDL"] == 2
    assert built[1].spec_meta["PDL"] == 2
    assert not built[2].split_shape and built[2].plan_meta["PDL"] == 0
    # Without PDL on the target, the chain has no profile to act in: refused.
    with pytest.raises(InvalidInputError, match="HISPARSE_TRITON_PDL_CHAIN='1' chains the split resolver's"):
        _choose({shapes.PDL_CHAIN_ENV: "1"}, pdl=False)
