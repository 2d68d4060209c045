"""The resolver: outputs, miss plans, hot maps, LRU orders and counters (docs/resolver-contract.md).

Hand-checked calls pin the LRU rules to numbers worked out from the contract; property tests
drive drifting working sets through the backend, the reference and the contract model in
lockstep and compare everything after every call.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hisparse_conformance.examples import examples
from hisparse_conformance.lockstep import Lockstep
from hisparse_conformance.rig import Rig, usable_format
from hisparse_conformance.scenario import (
    Layout,
    ScenarioParams,
    Step,
    Tables,
    build_scenario,
    out_of_context,
    padding_topk,
    scenario_params,
)
from hisparse_core.backend import Backend, Capability
from hisparse_core.geometry import RuntimeConfig

# -- hand-checked calls ----------------------------------------------------------------------
#
# bs=2, K=2, H=4: hot slots 0..3 of state row 0 live in device blocks [4, 1], i.e. device rows
# 8, 9, 2, 3. Pages 0..3 of state row 0 are host blocks 5, 7, 9, 3, so position t is host row
# 10, 11, 14, 15, 18, 19, 6, 7 for t = 0..7. State row 1 has resident pages 0 and 3 (device
# blocks 6 and 11), host page 1 (block 4), a null page 2, and hot blocks [0, 5].

HAND_TABLES = Tables(source=[[5, 7, 9, 3], [2, 4, -1, 8]],
                     resident=[[-1, -1, -1, -1], [6, -1, -1, 11]],
                     hot=[[4, 1], [0, 5]])


def hand_layout(backend: Backend, *, rows_per_request: int = 1) -> Layout:
    config = RuntimeConfig(max_batch_rows=3, max_requests=2, top_k=2, hot_rows=4, block_size=2, max_pages=4,
                           row_format=usable_format(backend), rows_per_request=rows_per_request)
    return Layout(config, host_blocks=10, num_device_blocks=12)


@dataclass(frozen=True)
class Expect:
    """One call and what the contract says it returns (only the first B rows are listed)."""

    topk: list[list[int]]
    row_state: list[int]
    seq_lens: list[int]
    rows: list[list[int]]
    plan_host: list[list[int]]
    plan_device: list[list[int]]
    hot_map: list[int]  # of the state row named by `state`
    lru: list[int]
    delta: tuple[int, int, int]  # (resident, hits, misses) added by the call
    state: int = 0


SINGLE_ROW_CALLS = [
    # Fresh state: misses fill the least recently used slots 0, 1, which move to the back.
    Expect([[0, 1]], [0], [8], rows=[[8, 9]], plan_host=[[10, 11]], plan_device=[[8, 9]],
           hot_map=[10, 11, -1, -1], lru=[2, 3, 0, 1], delta=(0, 0, 2)),
    # Row 10 hits slot 0 (copies nothing); row 14 takes the oldest evictable slot, 2. Hits go last.
    Expect([[2, 0]], [0], [8], rows=[[2, 8]], plan_host=[[14]], plan_device=[[2]],
           hot_map=[10, 11, 14, -1], lru=[3, 1, 2, 0], delta=(0, 1, 1)),
    # No hits: the two oldest slots (3 empty, 1 holding 11) are the victims, in LRU order.
    Expect([[6, 4]], [0], [8], rows=[[3, 9]], plan_host=[[6, 18]], plan_device=[[3, 9]],
           hot_map=[10, 18, 14, 6], lru=[2, 0, 3, 1], delta=(0, 0, 2)),
    # Evicted row 11 comes back into the least recently used slot (2, holding 14); -1 masks.
    Expect([[1, -1]], [0], [8], rows=[[2, -1]], plan_host=[[11]], plan_device=[[2]],
           hot_map=[10, 18, 11, 6], lru=[0, 3, 1, 2], delta=(0, 0, 1)),
    # A repeated position is one row of the union: one hit, both entries share the slot.
    Expect([[0, 0]], [0], [8], rows=[[8, 8]], plan_host=[[]], plan_device=[[]],
           hot_map=[10, 18, 11, 6], lru=[3, 1, 2, 0], delta=(0, 1, 0)),
]

RESIDENT_CALLS = [
    # Resident entries only: rows come from the resident table and the hot state is untouched.
    Expect([[1, 7]], [1], [8], rows=[[13, 23]], plan_host=[[]], plan_device=[[]],
           hot_map=[-1, -1, -1, -1], lru=[0, 1, 2, 3], delta=(2, 0, 0), state=1),
    # A null page (no resident block, no host block) outputs -1; host page 1 misses into slot 0.
    Expect([[5, 2]], [1], [8], rows=[[-1, 0]], plan_host=[[8]], plan_device=[[0]],
           hot_map=[8, -1, -1, -1], lru=[1, 2, 3, 0], delta=(0, 0, 1), state=1),
    # Resident again: the LRU order the previous call left stays exactly as it was.
    Expect([[6, 0]], [1], [8], rows=[[22, 12]], plan_host=[[]], plan_device=[[]],
           hot_map=[8, -1, -1, -1], lru=[1, 2, 3, 0], delta=(2, 0, 0), state=1),
    # A hit on the most recently used slot leaves the order as it is; resident and hot mix in a row.
    Expect([[2, 7]], [1], [8], rows=[[0, 23]], plan_host=[[]], plan_device=[[]],
           hot_map=[8, -1, -1, -1], lru=[1, 2, 3, 0], delta=(1, 1, 0), state=1),
]

SPECULATIVE_CALLS = [
    # Two verification rows of state row 0: the union [10, 14, 18] misses into slots 0, 1, 2;
    # each miss is planned in the row that referenced it first, and row 1 reuses row 0's slot for 14.
    Expect([[0, 2], [2, 4]], [0, 0], [7, 8], rows=[[8, 9], [9, 2]], plan_host=[[10, 14], [18]],
           plan_device=[[8, 9], [2]], hot_map=[10, 14, 18, -1], lru=[3, 0, 1, 2], delta=(0, 0, 3)),
    # Union [6, 10, 7, 11]: 10 is a hit and is not evicted by row 1's misses, which take the
    # remaining slots 3, 1, 2 in LRU order.
    Expect([[6, 0], [7, 1]], [0, 0], [7, 8], rows=[[3, 8], [9, 2]], plan_host=[[6], [7, 11]],
           plan_device=[[3], [9, 2]], hot_map=[10, 7, 11, 6], lru=[3, 1, 2, 0], delta=(0, 1, 3)),
]


def _pad(rows: list[list[int]], k: int) -> list[list[int]]:
    return [r + [-1] * (k - len(r)) for r in rows]


def run_hand_calls(rig: Rig, calls: list[Expect]) -> None:
    cfg = rig.config
    seen = (0, 0, 0)
    for n, call in enumerate(calls, 1):
        out = rig.resolve(Step(call.topk, call.row_state, call.seq_lens, HAND_TABLES))
        b = len(call.topk)
        pad_rows = cfg.max_batch_rows - b
        assert out.rows == call.rows + [[-1, -1]] * pad_rows, f"call {n}: rows: each entry is its resident row, else its hot slot's device row, else -1 (null or masked); padding rows are all -1 (docs/resolver-contract.md: Outputs)"
        assert out.valid_counts == [sum(x >= 0 for x in r) for r in call.rows] + [0] * pad_rows, f"call {n}: valid_counts: the number of entries >= 0 in each row, 0 for padding (docs/resolver-contract.md: Outputs)"
        assert out.plan_counts == [len(p) for p in call.plan_host] + [0] * pad_rows, f"call {n}: plan_counts: the misses planned in each row, each in the row that referenced it first (docs/resolver-contract.md: The miss plan)"
        assert out.plan_host[:b] == _pad(call.plan_host, cfg.top_k), f"call {n}: plan_host: the host rows of the misses, in lookup order, -1 padded to top_k (docs/resolver-contract.md: The miss plan)"
        assert out.plan_device[:b] == _pad(call.plan_device, cfg.top_k), f"call {n}: plan_device: the hot slots (device rows) the misses land in, LRU victims first, -1 padded (docs/resolver-contract.md: The miss plan)"
        assert rig.hot(call.state) == (call.hot_map, call.lru), f"call {n}: (hot map, LRU) of state row {call.state}: hits move to most recently used, misses evict the least recently used slot (docs/resolver-contract.md: The hot lookup)"
        resident, hits, misses, _, _ = rig.stats()
        seen = tuple(a + b for a, b in zip(seen, call.delta, strict=True))  # type: ignore[assignment]
        assert (resident, hits, misses) == seen, f"call {n}: (resident, hits, misses) counters: every looked-up entry counts once as resident, hit or miss (docs/resolver-contract.md: Counters)"


def test_lru_victims_and_order_by_hand(hisparse_backend: Backend) -> None:
    with Rig(hisparse_backend, hand_layout(hisparse_backend), seed=1) as rig:
        run_hand_calls(rig, SINGLE_ROW_CALLS)
        assert rig.hot(1) == ([-1] * 4, [0, 1, 2, 3]), "a state row that no batch row names must not change (docs/resolver-contract.md: After each call)"


def test_resident_null_and_masked_entries_by_hand(hisparse_backend: Backend) -> None:
    with Rig(hisparse_backend, hand_layout(hisparse_backend), seed=2) as rig:
        run_hand_calls(rig, RESIDENT_CALLS)


@pytest.mark.requires_capability(Capability.SPECULATIVE_UNION)
def test_speculative_union_by_hand(hisparse_backend: Backend) -> None:
    with Rig(hisparse_backend, hand_layout(hisparse_backend, rows_per_request=2), seed=3) as rig:
        run_hand_calls(rig, SPECULATIVE_CALLS)


# -- drifting working sets, in lockstep with the reference and the model -----------------------


def _drive(backend: Backend, reference: Backend, params: ScenarioParams, *, replay: bool = False) -> None:
    scenario = build_scenario(params)
    with Lockstep(backend, reference, scenario.layout, seed=params.seed) as run:
        for step, work in scenario.steps:
            problems = run.resolve(step, replay=replay)
            problems += run.apply(work)
            assert not problems, "\n".join(problems[:10])


@examples(30)
@given(data=st.data())
def test_drifting_working_sets(hisparse_backend: Backend, hisparse_reference: Backend, data: st.DataObject) -> None:
    params = data.draw(scenario_params(rows_per_request=1, num_layers=1, row_format=usable_format(hisparse_backend)))
    _drive(hisparse_backend, hisparse_reference, params)


@pytest.mark.requires_capability(Capability.SPECULATIVE_UNION)
@examples(25)
@given(data=st.data())
def test_drifting_speculative_groups(hisparse_backend: Backend, hisparse_reference: Backend,
                                     data: st.DataObject) -> None:
    rows = data.draw(st.integers(2, 3), label="rows_per_request")
    params = data.draw(scenario_params(rows_per_request=rows, num_layers=1,
                                       row_format=usable_format(hisparse_backend)))
    _drive(hisparse_backend, hisparse_reference, params)


@examples(5)
@given(data=st.data())
def test_production_top_k(hisparse_backend: Backend, hisparse_reference: Backend, data: st.DataObject) -> None:
    """DeepSeek-V3.2's geometry (top-k 2048, 64-token pages) over a few steps."""
    params = data.draw(scenario_params(rows_per_request=1, num_layers=1, row_format=usable_format(hisparse_backend)))
    params = replace(params, block_size=64, top_k=2048, max_pages=48, max_requests=2, steps=3,
                     extra_hot_blocks=params.extra_hot_blocks * 4)
    _drive(hisparse_backend, hisparse_reference, params)


# -- rows that must not change anything ----------------------------------------------------------


@examples(25)
@given(data=st.data())
def test_padding_rows_touch_nothing(hisparse_backend: Backend, data: st.DataObject) -> None:
    """Padding rows (with arbitrary in-context positions) between the real rows change no state,
    counter or byte; each outputs -1 with counts 0, and the real rows' outputs just move down."""
    params = data.draw(scenario_params(rows_per_request=1, num_layers=1, row_format=usable_format(hisparse_backend),
                                       max_steps=4))
    scenario = build_scenario(params)
    cfg = scenario.layout.config
    rng = random.Random(params.seed)
    with Rig(hisparse_backend, scenario.layout, seed=params.seed) as plain, \
            Rig(hisparse_backend, scenario.layout, seed=params.seed) as padded:
        for step, _ in scenario.steps:
            real = [row for row in zip(step.topk, step.row_state, step.seq_lens, strict=True) if row[1] >= 0]
            if not real:
                continue
            batch: list[tuple[list[int], int, int]] = []
            pads: list[int] = []
            room = cfg.max_batch_rows - len(real)
            for row in real:
                while room and rng.random() < 0.5:
                    length = rng.randint(0, cfg.max_context)
                    pads.append(len(batch))
                    batch.append((padding_topk(rng, cfg.top_k, length), -1, length))
                    room -= 1
                batch.append(row)
            want = plain.resolve(_as_step(real, step.tables))
            got = padded.resolve(_as_step(batch, step.tables))
            keep = [i for i in range(len(batch)) if i not in pads]
            n = len(keep)
            for name in ("rows", "valid_counts", "plan_counts", "plan_host", "plan_device"):
                moved = [getattr(got, name)[i] for i in keep]
                assert moved == getattr(want, name)[:n], f"{name}: padding rows (beyond the batch) must not change the real rows' outputs (docs/resolver-contract.md: Inputs)"
            for i in pads:
                assert got.rows[i] == [-1] * cfg.top_k, f"padding row {i} must output all -1, got {got.rows[i]} (docs/resolver-contract.md: Outputs)"
                assert (got.valid_counts[i], got.plan_counts[i]) == (0, 0), f"padding row {i} counts must be 0"
            a, b = plain.snapshot(), padded.snapshot()
            assert (a.hot, a.stats, a.device_digest) == (b.hot, b.stats, b.device_digest), (
                "padding rows must touch no hot state, counter or device row (docs/resolver-contract.md: Inputs)")


def _as_step(rows: list[tuple[list[int], int, int]], tables: Tables) -> Step:
    return Step([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], tables)


@examples(20)
@given(data=st.data())
def test_outputs_are_rewritten_by_every_call(hisparse_backend: Backend, data: st.DataObject) -> None:
    """Rows past the batch are padding (-1, count 0); nothing of the previous call survives."""
    params = data.draw(scenario_params(rows_per_request=1, num_layers=1, row_format=usable_format(hisparse_backend),
                                       max_steps=3))
    scenario = build_scenario(params)
    cfg = scenario.layout.config
    with Rig(hisparse_backend, scenario.layout, seed=params.seed) as rig:
        for step, _ in scenario.steps:
            rig.resolve(step)
            out = rig.resolve(Step(step.topk[:1], step.row_state[:1], step.seq_lens[:1], step.tables))
            for r in range(1, cfg.max_batch_rows):
                assert out.rows[r] == [-1] * cfg.top_k, f"every call rewrites all outputs: row {r} beyond this batch kept {out.rows[r]} (docs/resolver-contract.md: Outputs)"
                assert out.plan_host[r] == [-1] * cfg.top_k and out.plan_device[r] == [-1] * cfg.top_k, (
                    f"every call rewrites all outputs: plan of row {r} beyond this batch must be all -1")
                assert (out.valid_counts[r], out.plan_counts[r]) == (0, 0), (
                    f"every call rewrites all outputs: counts of row {r} beyond this batch must be 0")
            n = out.plan_counts[0]
            assert out.plan_host[0][n:] == [-1] * (cfg.top_k - n), "plan_host past plan_counts must be -1 (docs/resolver-contract.md: Outputs)"
            assert out.plan_device[0][n:] == [-1] * (cfg.top_k - n), "plan_device past plan_counts must be -1"


@examples(25)
@given(data=st.data())
def test_unvalidated_calls_mask_out_of_context_positions(hisparse_backend: Backend, hisparse_reference: Backend,
                                                         data: st.DataObject) -> None:
    """With validate=False a position >= its seq_len, or < -1, behaves exactly like -1."""
    params = data.draw(scenario_params(rows_per_request=1, num_layers=1, row_format=usable_format(hisparse_backend),
                                       max_steps=5))
    scenario = build_scenario(params)
    cfg = scenario.layout.config
    rng = random.Random(params.seed ^ 0x5EED)
    with Lockstep(hisparse_backend, hisparse_reference, scenario.layout, seed=params.seed) as run:
        for step, _ in scenario.steps:
            problems = run.resolve(out_of_context(step, cfg, rng), validate=False)
            assert not problems, "\n".join(problems[:10])
