"""Every bad input raises `InvalidInputError` and leaves the runtime exactly as it was."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from refcpu_support import bound_runtime, i32, small_config

from hisparse_core.errors import InvalidInputError
from hisparse_core.runtime import ResolveInputs
from hisparse_core.types import HostBlockCopy, PageTransfer, RowMirror
from hisparse_reference_cpu.runtime import ReferenceRuntime

# Geometry: R=2, P=4, bs=4, K=4, H=8 (2 hot blocks), Bmax=3, rows_per_request=2, 2 layers.
HOST_BLOCKS, DEVICE_BLOCKS = 8, 16
CFG = small_config(rows_per_request=2, num_layers=2)


def snapshot(rt: ReferenceRuntime, host: list[torch.Tensor], dev: list[torch.Tensor]) -> tuple[object, ...]:
    hot = [tuple(t.tolist() for t in rt.hot_state(q)) for q in range(CFG.max_requests)]
    res = [t.clone() for t in dataclasses.astuple(rt.result)]
    return hot, rt.stats(), res, [t.view(torch.uint8).clone() for t in host], [t.view(torch.uint8).clone() for t in dev]


def same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    hot_a, stats_a, res_a, host_a, dev_a = a
    hot_b, stats_b, res_b, host_b, dev_b = b
    tensors_equal = all(torch.equal(x, y) for x, y in zip([*res_a, *host_a, *dev_a], [*res_b, *host_b, *dev_b], strict=False))
    return hot_a == hot_b and stats_a == stats_b and tensors_equal


@st.composite
def primed(draw: st.DrawFn) -> tuple[ReferenceRuntime, list[torch.Tensor], list[torch.Tensor], dict[str, list]]:
    """A runtime with some random history, and a random valid batch (as lists) for it."""
    seed = draw(st.integers(0, 2**31 - 1))
    rt, host, dev = bound_runtime(CFG, host_blocks=HOST_BLOCKS, device_blocks=DEVICE_BLOCKS, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    source = torch.randint(-1, HOST_BLOCKS, (2, 4), generator=gen).tolist()
    source[0][0] = 3  # at least one host page, so a hot buffer is read
    resident = [[-1, -1, 0, -1], [-1, 1, -1, -1]]
    hot = [[4, 5], [6, 7]]
    lens = [draw(st.integers(1, 16)), draw(st.integers(0, 16))]

    def row(n: int) -> list[int]:
        return [0] + [draw(st.integers(-1, n - 1)) if n else -1 for _ in range(3)]

    batch = {"topk": [row(lens[0]), row(lens[0]), [-1] * 4], "row_state": [0, 0, 1], "seq_lens": [lens[0], lens[0], lens[1]],
             "source_table": source, "resident_table": resident, "hot_table": hot}
    batch["topk"][2] = [draw(st.integers(-1, lens[1] - 1)) if lens[1] else -1 for _ in range(4)]
    rt.resolve(_inputs(batch))  # history: the same batch once
    return rt, host, dev, batch


def _inputs(batch: dict[str, list]) -> ResolveInputs:
    return ResolveInputs(*(i32(batch[f.name]) for f in dataclasses.fields(ResolveInputs)))


def _set(batch: dict[str, list], name: str, index: tuple[int, ...], value: int) -> dict[str, list]:
    out = {k: [list(r) if isinstance(r, list) else r for r in v] for k, v in batch.items()}
    target = out[name]
    for i in index[:-1]:
        target = target[i]
    target[index[-1]] = value
    return out


# Value corruptions: (name, batch -> corrupted batch). Each breaks one rule of the contract.
VALUE_CORRUPTIONS: dict[str, Callable[[dict[str, list], st.DataObject], dict[str, list]]] = {
    "row_state below -1": lambda b, d: _set(b, "row_state", (2,), d.draw(st.integers(-50, -2))),
    "row_state >= R": lambda b, d: _set(b, "row_state", (2,), d.draw(st.integers(2, 50))),
    "state row in two groups": lambda b, d: _set(_set(b, "row_state", (1,), 1), "row_state", (2,), 0),
    "group too long": lambda b, d: _set(b, "row_state", (2,), 0),
    "seq_len negative": lambda b, d: _set(b, "seq_lens", (2,), d.draw(st.integers(-50, -1))),
    "seq_len beyond max_context": lambda b, d: _set(b, "seq_lens", (2,), d.draw(st.integers(17, 99))),
    "position below -1": lambda b, d: _set(b, "topk", (d.draw(st.integers(0, 1)), d.draw(st.integers(0, 3))),
                                           d.draw(st.integers(-99, -2))),
    "position >= seq_len": lambda b, d: _set(b, "topk", (0, d.draw(st.integers(0, 3))),
                                             b["seq_lens"][0] + d.draw(st.integers(0, 9))),
    "resident block >= device blocks": lambda b, d: _set(b, "resident_table", (0, 0),
                                                         d.draw(st.integers(DEVICE_BLOCKS, 99))),
    "resident block below -1": lambda b, d: _set(b, "resident_table", (0, 0), d.draw(st.integers(-99, -2))),
    "source block >= host blocks": lambda b, d: _set(b, "source_table", (0, 0), d.draw(st.integers(HOST_BLOCKS, 99))),
    "source block below -1": lambda b, d: _set(b, "source_table", (0, 0), d.draw(st.integers(-99, -2))),
    "hot block out of range": lambda b, d: _set(b, "hot_table", (0, d.draw(st.integers(0, 1))),
                                                d.draw(st.sampled_from([-1, -7, DEVICE_BLOCKS, 99]))),
}


@pytest.mark.parametrize("kind", sorted(VALUE_CORRUPTIONS))
@settings(max_examples=15, deadline=None)
@given(case=primed(), data=st.data(), gather=st.booleans())
def test_bad_values_raise_and_change_nothing(kind: str, case: tuple, data: st.DataObject, gather: bool) -> None:
    rt, host, dev, batch = case
    bad = VALUE_CORRUPTIONS[kind](batch, data)
    before = snapshot(rt, host, dev)
    with pytest.raises(InvalidInputError):
        rt.resolve(_inputs(bad), gather=gather)
    assert same(before, snapshot(rt, host, dev))
    rt.resolve(_inputs(batch))  # still usable


SHAPE_CORRUPTIONS: dict[str, Callable[[ResolveInputs], ResolveInputs]] = {
    "topk int64": lambda x: dataclasses.replace(x, topk=x.topk.long()),
    "row_state int64": lambda x: dataclasses.replace(x, row_state=x.row_state.long()),
    "seq_lens float": lambda x: dataclasses.replace(x, seq_lens=x.seq_lens.float()),
    "source_table int16": lambda x: dataclasses.replace(x, source_table=x.source_table.short()),
    "resident_table int64": lambda x: dataclasses.replace(x, resident_table=x.resident_table.long()),
    "hot_table int64": lambda x: dataclasses.replace(x, hot_table=x.hot_table.long()),
    "topk wrong K": lambda x: dataclasses.replace(x, topk=x.topk[:, :3]),
    "topk rank 1": lambda x: dataclasses.replace(x, topk=x.topk.reshape(-1)),
    "B > Bmax": lambda x: dataclasses.replace(x, topk=torch.cat([x.topk, x.topk[:1]]),
                                             row_state=torch.cat([x.row_state, i32([-1])]),
                                             seq_lens=torch.cat([x.seq_lens, i32([0])])),
    "B == 0": lambda x: dataclasses.replace(x, topk=x.topk[:0], row_state=x.row_state[:0], seq_lens=x.seq_lens[:0]),
    "row_state length": lambda x: dataclasses.replace(x, row_state=x.row_state[:2]),
    "seq_lens length": lambda x: dataclasses.replace(x, seq_lens=torch.cat([x.seq_lens, i32([1])])),
    "source_table shape": lambda x: dataclasses.replace(x, source_table=x.source_table[:, :3]),
    "resident_table shape": lambda x: dataclasses.replace(x, resident_table=x.resident_table[:1]),
    "hot_table shape": lambda x: dataclasses.replace(x, hot_table=x.hot_table[:, :1]),
    "topk on meta": lambda x: dataclasses.replace(x, topk=torch.empty_like(x.topk, device="meta")),
    "hot_table on meta": lambda x: dataclasses.replace(x, hot_table=torch.empty_like(x.hot_table, device="meta")),
    "topk not a tensor": lambda x: dataclasses.replace(x, topk=x.topk.tolist()),
}


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("kind", sorted(SHAPE_CORRUPTIONS))
@settings(max_examples=5, deadline=None)
@given(case=primed())
def test_bad_shapes_raise_with_and_without_validation(kind: str, validate: bool, case: tuple) -> None:
    rt, host, dev, batch = case
    before = snapshot(rt, host, dev)
    with pytest.raises(InvalidInputError):
        rt.resolve(SHAPE_CORRUPTIONS[kind](_inputs(batch)), validate=validate)
    assert same(before, snapshot(rt, host, dev))


@settings(max_examples=20, deadline=None)
@given(case=primed(), junk=st.integers(-99, 99))
def test_unread_table_entries_and_padding_rows_are_not_validated(case: tuple, junk: int) -> None:
    rt, _, _, batch = case
    # Page 3 of state row 1 is never read if no entry of row 2 points into it; padding rows are ignored.
    batch = _set(batch, "topk", (2,), [-1, -1, -1, -1])
    batch = _set(batch, "resident_table", (1, 3), junk)
    batch = _set(batch, "source_table", (1, 3), junk)
    batch = _set(batch, "hot_table", (1, 0), junk)  # state row 1 has no host entries
    batch["row_state"] = [0, 0, -1]
    batch["seq_lens"][2] = junk
    batch = _set(batch, "topk", (2, 0), junk)
    rt.resolve(_inputs(batch))


def test_out_of_context_positions_are_masked_without_validation() -> None:
    rt, _, _ = bound_runtime(CFG, host_blocks=HOST_BLOCKS, device_blocks=DEVICE_BLOCKS)
    src = [[1, 2, 3, 4], [5, 6, 7, 0]]
    batch = {"topk": [[-7, 5, 6, 0]], "row_state": [1], "seq_lens": [6], "source_table": src,
             "resident_table": [[-1] * 4] * 2, "hot_table": [[2, 3], [4, 5]]}
    with pytest.raises(InvalidInputError, match=r"topk\[0, 0\]=-7"):
        rt.resolve(_inputs(batch))
    res = rt.resolve(_inputs(batch), validate=False)
    # -7 and 6 are out of context (masked); 5 -> host row 25 -> slot 0; 0 -> host row 20 -> slot 1.
    assert res.rows[0].tolist() == [-1, 16, -1, 17]
    assert res.valid_counts[0].item() == 2


# ------------------------------------------------------------------ the other methods

def _runtime() -> tuple[ReferenceRuntime, list[torch.Tensor], list[torch.Tensor]]:
    rt, host, dev = bound_runtime(CFG, host_blocks=HOST_BLOCKS, device_blocks=DEVICE_BLOCKS, seed=3)
    batch = {"topk": [[0, 1, 5, 9]], "row_state": [1], "seq_lens": [16], "source_table": [[0, 1, 2, 3], [4, 5, 6, 7]],
             "resident_table": [[-1] * 4] * 2, "hot_table": [[2, 3], [4, 5]]}
    rt.resolve(_inputs(batch))
    return rt, host, dev


def _pt(tid: int, host: int, dev: int, restore: bool = False) -> PageTransfer:
    return PageTransfer(tid, host, (dev,), restore=restore)


BAD_CALLS: dict[str, Callable[[ReferenceRuntime], None]] = {
    "gather layer out of range": lambda rt: rt.gather_misses(2),
    "gather layer not int": lambda rt: rt.gather_misses(0.0),  # type: ignore[arg-type]
    "replay layer out of range": lambda rt: rt.replay_plan([1, 2]),
    "replay layer negative": lambda rt: rt.replay_plan([-1]),
    "mirror past device end": lambda rt: rt.mirror_rows([RowMirror((0,), 0, 1), RowMirror((63,), 0, 2)]),
    "mirror past host end": lambda rt: rt.mirror_rows([RowMirror((0,), 31, 2)]),
    "mirror crosses a block": lambda rt: rt.mirror_rows([RowMirror((2,), 8, 3)]),
    "mirror without our group": lambda rt: _grouped(rt, 1).mirror_rows([RowMirror((0,), 0, 1)]),
    "spill without our group": lambda rt: _grouped(rt, 1).spill_pages([_pt(1, 0, 0)]),
    "mirror not a RowMirror": lambda rt: rt.mirror_rows([_pt(1, 0, 0)]),  # type: ignore[list-item]
    "spill a restore": lambda rt: rt.spill_pages([_pt(1, 0, 0), _pt(2, 1, 1, restore=True)]),
    "restore a spill": lambda rt: rt.restore_pages([_pt(1, 0, 0, restore=True), _pt(2, 1, 1)]),
    "spill device block out of range": lambda rt: rt.spill_pages([_pt(1, 0, 0), _pt(2, 1, 16)]),
    "spill host block out of range": lambda rt: rt.spill_pages([_pt(1, 0, 0), _pt(2, 8, 1)]),
    "restore host block out of range": lambda rt: rt.restore_pages([_pt(1, 9, 0, restore=True)]),
    "host copy out of range": lambda rt: rt.copy_host_blocks([HostBlockCopy(0, 1), HostBlockCopy(8, 1)]),
    "host copies not a sequence": lambda rt: rt.copy_host_blocks(HostBlockCopy(0, 1)),  # type: ignore[arg-type]
    "invalidate state row out of range": lambda rt: rt.invalidate_written_slots(i32([1, 2]), i32([16, 17])),
    "invalidate host row out of range": lambda rt: rt.invalidate_written_slots(i32([1, 1]), i32([16, 32])),
    "invalidate lengths differ": lambda rt: rt.invalidate_written_slots(i32([1, 1]), i32([16])),
    "invalidate int64": lambda rt: rt.invalidate_written_slots(i32([1]).long(), i32([16]).long()),
    "invalidate 2-D": lambda rt: rt.invalidate_written_slots(i32([[1]]), i32([[16]])),
    "invalidate block out of range": lambda rt: rt.invalidate_host_blocks([4, 8]),
    "invalidate block negative": lambda rt: rt.invalidate_host_blocks([-1]),
    "invalidate block not int": lambda rt: rt.invalidate_host_blocks([4.0]),  # type: ignore[list-item]
    "reset state row out of range": lambda rt: rt.reset_state([1, 2]),
    "reset state rows not a sequence": lambda rt: rt.reset_state(1),  # type: ignore[arg-type]
    "hot_state out of range": lambda rt: rt.hot_state(2),
}


def _grouped(rt: ReferenceRuntime, group: int) -> ReferenceRuntime:
    """A runtime over the same storage that reads resident group `group` of the wire objects."""
    other = ReferenceRuntime(rt.config)
    other.bind(rt.host_layers, rt.device_layers, resident_group=group)
    return other


@pytest.mark.parametrize("kind", sorted(BAD_CALLS))
def test_bad_calls_raise_and_change_nothing(kind: str) -> None:
    rt, host, dev = _runtime()
    before = snapshot(rt, host, dev)
    with pytest.raises(InvalidInputError):
        BAD_CALLS[kind](rt)
    assert same(before, snapshot(rt, host, dev))


def test_bind_rejects_bad_storage() -> None:
    fmt = CFG.row_format
    host = [torch.zeros(32, fmt.width, dtype=fmt.dtype) for _ in range(2)]
    dev = [torch.zeros(16, 4, fmt.width, dtype=fmt.dtype) for _ in range(2)]
    cases = {
        "one layer short": (host[:1], dev),
        "wrong dtype": (host, [d.view(torch.int8) for d in dev]),
        "host rows not whole blocks": ([h[:30] for h in host], dev),
        "device block size": (host, [d.view(32, 2, fmt.width) for d in dev]),
        "layers disagree": (host, [dev[0], dev[1][:8]]),
        "not contiguous": (host, [d.transpose(0, 1).contiguous().transpose(0, 1) for d in dev]),
    }
    for name, (h, d) in cases.items():
        rt = ReferenceRuntime(CFG)
        with pytest.raises(InvalidInputError):
            rt.bind(h, d)
        assert not rt.bound, name
    rt = ReferenceRuntime(CFG)
    with pytest.raises(InvalidInputError, match="not bound"):
        rt.gather_misses()
    rt.bind(host, dev)
    with pytest.raises(InvalidInputError, match="already bound"):
        rt.bind(host, dev)
