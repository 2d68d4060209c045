"""Wire types: validation, dict/JSON round trips, pickle size, and WorkerMetadata.aggregate laws."""

from __future__ import annotations

import json
import pickle
from functools import reduce

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hisparse_core.errors import InvalidCommandError
from hisparse_core.types import (
    HostBlockCopy,
    OffloadCommand,
    PageTransfer,
    ResidencyUpdate,
    RowMirror,
    WorkerMetadata,
)


def typical_command(transfers: int = 8) -> OffloadCommand:
    return OffloadCommand(
        page_transfers=tuple(PageTransfer(i, 100 + i, (7 + i, 900 + i), after_forward=i % 2 == 0,
                                          restore=i == 3) for i in range(transfers)),
        row_mirrors=(RowMirror((64, 128), 4096, 3), RowMirror((65, 129), 4099, 1)),
        residency_updates=(ResidencyUpdate(3, (1, 2, 3), ((5, 6, -1), (7, 8, -1))),),
        host_block_copies=(HostBlockCopy(11, 12),),
        recycled_host_blocks=(40, 41),
    )


# --- validation -----------------------------------------------------------------------------

@pytest.mark.parametrize("build, needle", [
    (lambda: PageTransfer(-1, 0, (0,)), "PageTransfer.transfer_id must be >= 0, got -1"),
    (lambda: PageTransfer(True, 0, (0,)), "PageTransfer.transfer_id must be an int, got True"),
    (lambda: PageTransfer(0, 1.5, (0,)), "PageTransfer.host_block_id must be an int, got 1.5"),
    (lambda: PageTransfer(0, 1, ()), "PageTransfer.resident_block_ids must not be empty"),
    (lambda: PageTransfer(0, 1, [2]), "PageTransfer.resident_block_ids must be a tuple of ints, got list"),
    (lambda: PageTransfer(0, 1, (2,), after_forward=1), "must be bool"),
    (lambda: RowMirror((0,), 0, 0), "RowMirror.num_rows must be >= 1, got 0"),
    (lambda: RowMirror((-3,), 0, 1), "RowMirror.source_starts must be >= 0, got -3"),
    (lambda: ResidencyUpdate(0, (1, 2), ((3,),)), "has 1 ids for 2 pages"),
    (lambda: ResidencyUpdate(0, (1,), ()), "block_ids must be a non-empty tuple"),
    (lambda: ResidencyUpdate(0, (1,), ((-2,),)), "ResidencyUpdate.block_ids must be >= -1, got -2"),
    (lambda: HostBlockCopy(5, 5), "copies block 5 onto itself"),
    (lambda: OffloadCommand(page_transfers=(PageTransfer(1, 0, (0,)), PageTransfer(1, 2, (3,)))),
     "repeats a transfer id: [1, 1]"),
    (lambda: OffloadCommand(row_mirrors=(HostBlockCopy(1, 2),)), "row_mirrors must be a tuple of RowMirror"),
    (lambda: OffloadCommand(recycled_host_blocks=(-1,)), "recycled_host_blocks must be >= 0, got -1"),
    (lambda: WorkerMetadata({1: 0}), "WorkerMetadata.enqueued[1] must be >= 1, got 0"),
    (lambda: WorkerMetadata(completed={-4: 1}), "WorkerMetadata.completed key must be >= 0, got -4"),
    (lambda: WorkerMetadata(enqueued=[1]), "enqueued must be a mapping"),
])
def test_invalid_wire_objects_raise_naming_the_bad_value(build, needle: str) -> None:
    with pytest.raises(InvalidCommandError) as info:
        build()
    assert needle in str(info.value)


def test_invalid_command_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        HostBlockCopy(1, 1)


def test_wire_objects_are_frozen() -> None:
    transfer = PageTransfer(0, 1, (2,))
    with pytest.raises(AttributeError):
        transfer.transfer_id = 5  # type: ignore[misc]


def test_empty_command_is_empty_and_a_filled_one_is_not() -> None:
    assert OffloadCommand().is_empty()
    assert not OffloadCommand(recycled_host_blocks=(3,)).is_empty()
    assert WorkerMetadata().is_empty()
    assert not WorkerMetadata.report(completed_host_copies=[2]).is_empty()


# --- round trips ----------------------------------------------------------------------------

def test_offload_command_round_trips_through_dict_and_json() -> None:
    cmd = typical_command()
    assert OffloadCommand.from_dict(cmd.to_dict()) == cmd
    assert OffloadCommand.from_dict(json.loads(json.dumps(cmd.to_dict()))) == cmd


@pytest.mark.parametrize("obj", [
    PageTransfer(3, 4, (5, 6), after_forward=False, restore=True),
    RowMirror((1, 2, 3), 99, 7),
    ResidencyUpdate(2, (0, 9), ((1, -1), (2, 3))),
    HostBlockCopy(8, 9),
    WorkerMetadata({1: 2, 7: 1}, {1: 1}, (4, 5)),
])
def test_each_wire_type_round_trips_through_json(obj: object) -> None:
    data = json.loads(json.dumps(obj.to_dict()))  # type: ignore[attr-defined]
    assert type(obj).from_dict(data) == obj  # type: ignore[attr-defined]


def test_from_dict_validates_too() -> None:
    data = PageTransfer(1, 2, (3,)).to_dict()
    data["resident_block_ids"] = []
    with pytest.raises(InvalidCommandError, match="must not be empty"):
        PageTransfer.from_dict(data)


def test_pickle_round_trip_and_size_stays_small() -> None:
    cmd = typical_command()
    assert pickle.loads(pickle.dumps(cmd)) == cmd
    # Plain ints and tuples only: a step's command is a few hundred bytes, and each extra page
    # transfer costs tens of bytes (a tensor or a per-object dict would blow these bounds).
    assert len(pickle.dumps(OffloadCommand())) < 128
    assert len(pickle.dumps(cmd)) < 1024
    per_transfer = (len(pickle.dumps(typical_command(200))) - len(pickle.dumps(typical_command(100)))) / 100
    assert per_transfer < 48
    report = WorkerMetadata.report(enqueued=range(16), completed=range(16), completed_host_copies=[1, 2])
    assert pickle.loads(pickle.dumps(report)) == report
    assert len(pickle.dumps(report)) < 256


# --- WorkerMetadata.aggregate ---------------------------------------------------------------

ids = st.integers(min_value=0, max_value=40)
counts = st.dictionaries(ids, st.integers(min_value=1, max_value=8), max_size=12)
metadata = st.builds(WorkerMetadata, counts, counts, st.lists(ids, max_size=6, unique=True).map(lambda x: tuple(sorted(x))))


@given(metadata, metadata)
def test_aggregate_is_commutative(a: WorkerMetadata, b: WorkerMetadata) -> None:
    assert a.aggregate(b) == b.aggregate(a)


@given(metadata, metadata, metadata)
def test_aggregate_is_associative(a: WorkerMetadata, b: WorkerMetadata, c: WorkerMetadata) -> None:
    assert a.aggregate(b).aggregate(c) == a.aggregate(b.aggregate(c))


@given(metadata)
def test_empty_metadata_is_the_identity(a: WorkerMetadata) -> None:
    assert a.aggregate(WorkerMetadata()) == a
    assert WorkerMetadata().aggregate(a) == a


@given(st.lists(metadata, min_size=1, max_size=5))
def test_aggregate_sums_counts_and_unions_host_copies(parts: list[WorkerMetadata]) -> None:
    total = reduce(WorkerMetadata.aggregate, parts)
    for field in ("enqueued", "completed"):
        keys = set().union(*(getattr(p, field).keys() for p in parts))
        assert dict(getattr(total, field)) == {k: sum(getattr(p, field).get(k, 0) for p in parts) for k in keys}
    assert total.completed_host_copies == tuple(sorted(set().union(*(p.completed_host_copies for p in parts))))


@given(st.lists(st.lists(ids, max_size=10, unique=True), min_size=1, max_size=8))
def test_a_transfer_is_done_everywhere_when_its_count_equals_the_workers(per_worker: list[list[int]]) -> None:
    reports = [WorkerMetadata.report(enqueued=done, completed=done) for done in per_worker]
    total = reduce(WorkerMetadata.aggregate, reports)
    everywhere = set.intersection(*(set(done) for done in per_worker))
    assert {k for k, v in total.completed.items() if v == len(per_worker)} == everywhere


@given(st.lists(st.integers(0, 1 << 40), min_size=1, max_size=4), st.integers(0, 1 << 40), st.integers(1, 4096))
def test_a_trusted_row_mirror_equals_the_checked_one(starts: list[int], dst: int, n: int) -> None:
    """`RowMirror.trusted` (the coordinator's per-step constructor) builds the same frozen value the
    checked constructor does: equal, same hash, same wire form, still immutable."""
    checked, trusted = RowMirror(tuple(starts), dst, n), RowMirror.trusted(tuple(starts), dst, n)
    assert trusted == checked and hash(trusted) == hash(checked)
    assert RowMirror.from_dict(trusted.to_dict()) == checked
    with pytest.raises(AttributeError):
        trusted.num_rows = n + 1  # type: ignore[misc]
