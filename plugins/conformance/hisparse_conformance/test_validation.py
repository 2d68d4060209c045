"""Bad input raises `InvalidInputError`, names what is wrong, and changes nothing: hot maps, LRU
orders, counters, the result workspace and every byte stay as they were, and the runtime then
behaves exactly like a twin that never saw the bad call."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

import torch
from hypothesis import given
from hypothesis import strategies as st

from hisparse_conformance.contract import must_raise
from hisparse_conformance.examples import examples
from hisparse_conformance.rig import Rig, usable_format
from hisparse_conformance.scenario import Layout, Step, Tables, as_tensor, build_scenario, scenario_params
from hisparse_core.backend import Backend
from hisparse_core.errors import InvalidInputError
from hisparse_core.runtime import ResolveInputs
from hisparse_core.types import HostBlockCopy, PageTransfer, RowMirror

FIELDS = ("topk", "row_state", "seq_lens", "source_table", "resident_table", "hot_table")


class Case:
    """A valid call (one request row with a host entry and, when K > 1, a resident entry) that
    mutations then break in one way."""

    def __init__(self, rng: random.Random, layout: Layout, tables: Tables) -> None:
        cfg = layout.config
        self.rng, self.layout, self.cfg = rng, layout, cfg
        self.q = rng.randrange(cfg.max_requests)
        self.seq_len = rng.randint(1, cfg.max_context)
        positions = [rng.randrange(self.seq_len) for _ in range(cfg.top_k)]
        self.host_pos = positions[0]
        self.tables = tables.copy()
        page = self.host_pos // cfg.block_size
        self.tables.resident[self.q][page] = -1
        if self.tables.source[self.q][page] < 0:
            self.tables.source[self.q][page] = rng.randrange(layout.host_blocks)
        self.resident_pos: int | None = None
        if cfg.top_k > 1 and positions[1] // cfg.block_size != page:
            self.resident_pos = positions[1]
            other = positions[1] // cfg.block_size
            if self.tables.resident[self.q][other] < 0:
                self.tables.resident[self.q][other] = rng.randrange(layout.num_device_blocks)
        self.topk = [positions]
        self.row_state = [self.q]
        self.seq_lens = [self.seq_len]

    def step(self) -> Step:
        return Step([r[:] for r in self.topk], self.row_state[:], self.seq_lens[:], self.tables)

    def lists(self) -> dict[str, list]:
        t = self.tables
        return {"topk": [r[:] for r in self.topk], "row_state": self.row_state[:], "seq_lens": self.seq_lens[:],
                "source_table": [r[:] for r in t.source], "resident_table": [r[:] for r in t.resident],
                "hot_table": [r[:] for r in t.hot]}


def wrong_device(device: torch.device) -> torch.device:
    # 'meta' tensors have no data, so a backend that reads values before checking the device fails loudly.
    return torch.device("meta") if device.type == "cpu" else torch.device("cpu")


# -- mutations: each returns (inputs as tensors, names the message may use) -------------------

Tensors = dict[str, torch.Tensor]
Mutation = Callable[[Case, Tensors], tuple[str, ...]]


def _set(t: Tensors, name: str, index: tuple[int, ...], value: int) -> None:
    t[name] = t[name].clone()
    t[name][index] = value


def beyond_context(c: Case, t: Tensors) -> tuple[str, ...]:
    _set(t, "topk", (0, c.rng.randrange(c.cfg.top_k)), c.seq_len + c.rng.randint(0, c.cfg.block_size))
    return ("topk", "seq_lens")


def below_minus_one(c: Case, t: Tensors) -> tuple[str, ...]:
    _set(t, "topk", (0, c.rng.randrange(c.cfg.top_k)), -c.rng.randint(2, 1000))
    return ("topk",)


def bad_row_state(c: Case, t: Tensors) -> tuple[str, ...]:
    _set(t, "row_state", (0,), c.rng.choice([c.cfg.max_requests, c.cfg.max_requests + 7, -2]))
    return ("row_state",)


def bad_seq_len(c: Case, t: Tensors) -> tuple[str, ...]:
    t["topk"] = torch.full_like(t["topk"], -1)  # so only the length itself is wrong
    _set(t, "seq_lens", (0,), c.rng.choice([-1, c.cfg.max_context + 1, c.cfg.max_context + 64]))
    return ("seq_lens",)


def split_group(c: Case, t: Tensors) -> tuple[str, ...]:
    """The request's rows are not consecutive: [q, padding, q]."""
    for name, pad in (("topk", None), ("row_state", -1), ("seq_lens", 0)):
        x = t[name]
        middle = torch.full_like(x[:1], -1) if pad is None else torch.full_like(x[:1], pad)
        t[name] = torch.cat([x, middle, x])
    return ("row_state",)


def long_group(c: Case, t: Tensors) -> tuple[str, ...]:
    """One more consecutive row than rows_per_request allows."""
    n = c.cfg.rows_per_request + 1
    for name in ("topk", "row_state", "seq_lens"):
        t[name] = torch.cat([t[name]] * n)
    return ("row_state",)


def too_many_rows(c: Case, t: Tensors) -> tuple[str, ...]:
    extra = c.cfg.max_batch_rows
    t["topk"] = torch.cat([t["topk"], torch.full((extra, c.cfg.top_k), -1, dtype=torch.int32, device=t["topk"].device)])
    t["row_state"] = torch.cat([t["row_state"], torch.full((extra,), -1, dtype=torch.int32, device=t["topk"].device)])
    t["seq_lens"] = torch.cat([t["seq_lens"], torch.zeros(extra, dtype=torch.int32, device=t["topk"].device)])
    return ("topk", "row_state", "seq_lens", "max_batch_rows")


def bad_resident_entry(c: Case, t: Tensors) -> tuple[str, ...]:
    page = (c.resident_pos if c.resident_pos is not None else c.host_pos) // c.cfg.block_size
    _set(t, "resident_table", (c.q, page), c.rng.choice([c.layout.num_device_blocks,
                                                         c.layout.num_device_blocks + 5, -2]))
    return ("resident_table",)


def bad_source_entry(c: Case, t: Tensors) -> tuple[str, ...]:
    _set(t, "source_table", (c.q, c.host_pos // c.cfg.block_size),
         c.rng.choice([c.layout.host_blocks, c.layout.host_blocks + 3, -2]))
    return ("source_table",)


def bad_hot_entries(c: Case, t: Tensors) -> tuple[str, ...]:
    t["hot_table"] = t["hot_table"].clone()
    t["hot_table"][c.q] = c.layout.num_device_blocks + c.rng.randint(0, 9)
    return ("hot_table",)


def wrong_dtype(c: Case, t: Tensors) -> tuple[str, ...]:
    name = c.rng.choice(FIELDS)
    t[name] = t[name].to(c.rng.choice([torch.int64, torch.int16, torch.float32]))
    return (name,)


def wrong_rank(c: Case, t: Tensors) -> tuple[str, ...]:
    name = c.rng.choice(FIELDS)
    t[name] = t[name].reshape(-1) if t[name].dim() == 2 else t[name].reshape(-1, 1)
    return (name,)


def wrong_shape(c: Case, t: Tensors) -> tuple[str, ...]:
    """One element too many: a top-k column, a table row or column, or a per-row entry (which
    then disagrees with topk's row count, so either may be named)."""
    name = c.rng.choice(FIELDS)
    x = t[name]
    dim = 1 if name == "topk" else c.rng.randrange(x.dim())
    t[name] = torch.cat([x, x.narrow(dim, 0, 1)], dim=dim)
    return (name, "topk") if x.dim() == 1 else (name,)


def on_wrong_device(c: Case, t: Tensors) -> tuple[str, ...]:
    name = c.rng.choice(FIELDS)
    t[name] = torch.empty_like(t[name], device=wrong_device(t[name].device)) if t[name].device.type == "cpu" \
        else t[name].cpu()
    return (name,)


VALUE_MUTATIONS: list[Mutation] = [beyond_context, below_minus_one, bad_row_state, bad_seq_len, split_group,
                                   long_group, bad_resident_entry, bad_source_entry, bad_hot_entries]
SHAPE_MUTATIONS: list[Mutation] = [too_many_rows, wrong_dtype, wrong_rank, wrong_shape, on_wrong_device]


def _layout_and_rigs(data: st.DataObject, backend: Backend) -> tuple[Case, Rig, Rig, list[Step]]:
    params = data.draw(scenario_params(rows_per_request=1, num_layers=1, row_format=usable_format(backend),
                                       max_steps=3))
    params = replace(params, extra_batch_rows=2)  # room for [q, padding, q] and for one row too many
    scenario = build_scenario(params)
    case = Case(random.Random(params.seed), scenario.layout, scenario.tables)
    warm = [step for step, _ in scenario.steps]
    return case, Rig(backend, scenario.layout, seed=params.seed), Rig(backend, scenario.layout, seed=params.seed), warm


def _check_rejected(case: Case, rig: Rig, twin: Rig, warm: list[Step], mutation: Mutation, validate: bool) -> None:
    for step in warm:
        rig.resolve(step)
        twin.resolve(step)
    rig.load_tables(case.tables)
    tensors = {name: as_tensor(v, rig.device) for name, v in case.lists().items()}
    names = mutation(case, tensors)
    before = rig.snapshot()
    with must_raise(InvalidInputError, f"resolve(validate={validate}) rejects {mutation.__name__} "
                                       "with InvalidInputError (docs/resolver-contract.md: Validation)") as raised:
        rig.runtime.resolve(ResolveInputs(**tensors), validate=validate)
    message = str(raised.value)
    assert any(n in message for n in names), f"the message does not name any of {names}: {message!r}"
    assert rig.snapshot() == before, f"{mutation.__name__}: a rejected call must leave the runtime unchanged (hot state, counters, device rows)"
    assert rig.resolve(case.step()) == twin.resolve(case.step()), (
        "after a rejected call the runtime resolves exactly like a twin that never saw it")
    assert rig.snapshot() == twin.snapshot(), "after a rejected call the runtime's state equals its twin's"


@examples(40)
@given(data=st.data())
def test_bad_values_are_rejected_without_side_effects(hisparse_backend: Backend, data: st.DataObject) -> None:
    mutation = data.draw(st.sampled_from(VALUE_MUTATIONS), label="mutation")
    case, rig, twin, warm = _layout_and_rigs(data, hisparse_backend)
    with rig, twin:
        _check_rejected(case, rig, twin, warm, mutation, validate=True)


@examples(30)
@given(data=st.data())
def test_bad_shapes_are_rejected_even_unvalidated(hisparse_backend: Backend, data: st.DataObject) -> None:
    """Shapes, dtypes and devices are checked on the host even with validate=False."""
    mutation = data.draw(st.sampled_from(SHAPE_MUTATIONS), label="mutation")
    validate = data.draw(st.booleans(), label="validate")
    case, rig, twin, warm = _layout_and_rigs(data, hisparse_backend)
    with rig, twin:
        _check_rejected(case, rig, twin, warm, mutation, validate=validate)


# -- the other runtime methods ------------------------------------------------------------------


def _bad_calls(rig: Rig, rng: random.Random) -> list[tuple[str, Callable[[], object]]]:
    cfg, layout = rig.config, rig.layout
    rt, dev = rig.runtime, rig.device
    bs, hb, db = cfg.block_size, layout.host_blocks, layout.num_device_blocks
    host_rows = hb * bs
    ok_mirror = RowMirror((rng.randrange(db) * bs,), rng.randrange(hb) * bs, 1)
    ok_page = PageTransfer(1, rng.randrange(hb), (rng.randrange(db),))
    ok_copy = HostBlockCopy(0, 1)
    i32 = torch.int32
    return [
        ("invalidate_written_slots: int64 state rows",
         lambda: rt.invalidate_written_slots(torch.zeros(1, dtype=torch.int64, device=dev), torch.zeros(1, dtype=i32, device=dev))),
        ("invalidate_written_slots: lengths differ",
         lambda: rt.invalidate_written_slots(torch.zeros(2, dtype=i32, device=dev), torch.zeros(1, dtype=i32, device=dev))),
        ("invalidate_written_slots: state row out of range",
         lambda: rt.invalidate_written_slots(as_tensor([0, cfg.max_requests], dev), as_tensor([0, 0], dev))),
        ("invalidate_written_slots: host row out of range",
         lambda: rt.invalidate_written_slots(as_tensor([0, 0], dev), as_tensor([0, host_rows], dev))),
        ("invalidate_written_slots: wrong device",
         lambda: rt.invalidate_written_slots(torch.zeros(1, dtype=i32, device=wrong_device(dev)),
                                             torch.zeros(1, dtype=i32, device=wrong_device(dev)))),
        ("invalidate_host_blocks: block out of range", lambda: rt.invalidate_host_blocks([0, hb])),
        ("invalidate_host_blocks: negative block", lambda: rt.invalidate_host_blocks([-1])),
        ("reset_state: row out of range", lambda: rt.reset_state([0, cfg.max_requests])),
        ("hot_state: row out of range", lambda: rt.hot_state(cfg.max_requests)),
        ("gather_misses: layer out of range", lambda: rt.gather_misses(cfg.num_layers)),
        ("replay_plan: layer out of range", lambda: rt.replay_plan([cfg.num_layers])),
        ("mirror_rows: host rows out of range",
         lambda: rt.mirror_rows([ok_mirror, RowMirror((0,), host_rows, 1)])),
        ("mirror_rows: device rows out of range",
         lambda: rt.mirror_rows([ok_mirror, RowMirror((db * bs,), 0, 1)])),
        ("spill_pages: host block out of range", lambda: rt.spill_pages([ok_page, PageTransfer(2, hb, (0,))])),
        ("spill_pages: device block out of range", lambda: rt.spill_pages([ok_page, PageTransfer(2, 0, (db,))])),
        ("restore_pages: device block out of range",
         lambda: rt.restore_pages([replace(ok_page, restore=True), PageTransfer(2, 0, (db,), restore=True)])),
        ("copy_host_blocks: block out of range", lambda: rt.copy_host_blocks([ok_copy, HostBlockCopy(0, hb)])),
    ]


@examples(10)
@given(data=st.data())
def test_other_methods_reject_bad_arguments_without_side_effects(hisparse_backend: Backend,
                                                                 data: st.DataObject) -> None:
    """A bad element anywhere in a list fails the whole call before the good ones run."""
    case, rig, twin, warm = _layout_and_rigs(data, hisparse_backend)
    rng = random.Random(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    with rig, twin:
        for step in warm:
            rig.resolve(step)
            twin.resolve(step)
        for what, call in _bad_calls(rig, rng):
            before = rig.snapshot()
            with must_raise(InvalidInputError, f"{what}: a bad argument anywhere in the call is rejected"):
                call()
            assert rig.snapshot() == before, f"{what}: a rejected call must leave the runtime unchanged, its good elements included"
        assert rig.resolve(case.step()) == twin.resolve(case.step()), (
            "after rejected calls the runtime resolves exactly like a twin that never saw them")
        assert rig.snapshot() == twin.snapshot(), "after rejected calls the runtime's state equals its twin's"
