"""Wire types between the scheduler-side coordinator and the workers.

Frozen, slotted and validated on construction. Every field is a plain int, bool or tuple, so the
objects pickle small and msgspec/json-serialise through `to_dict` / `from_dict`. Workers see
transfer ids and physical coordinates only; request identity stays in the scheduler.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from itertools import repeat
from typing import Any, Self

from hisparse_core.errors import InvalidCommandError


def _check_int(owner: str, name: str, value: object, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidCommandError(f"{owner}.{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise InvalidCommandError(f"{owner}.{name} must be >= {minimum}, got {value}")


def _check_ints(owner: str, name: str, values: object, minimum: int = 0, *, nonempty: bool = True) -> None:
    if not isinstance(values, tuple):
        raise InvalidCommandError(f"{owner}.{name} must be a tuple of ints, got {type(values).__name__}")
    if nonempty and not values:
        raise InvalidCommandError(f"{owner}.{name} must not be empty")
    for v in values:
        _check_int(owner, name, v, minimum)


class _Wire:
    """Mixin: dict round-trip for transports that do not pickle (JSON handshakes, logs)."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if isinstance(v, tuple) and v and isinstance(v[0], _Wire):
                v = [x.to_dict() for x in v]
            elif isinstance(v, tuple):
                v = list(v)
            elif isinstance(v, Mapping):
                v = {str(k): (x.to_dict() if isinstance(x, _Wire) else x) for k, x in v.items()}
            out[f.name] = v
        return out


@dataclass(frozen=True, slots=True)
class PageTransfer(_Wire):
    """One logical page copy between the resident GPU pages and one host block, for every layer.

    `resident_block_ids[j]` is the GPU block of resident group j. `restore=False` is a spill
    (device to host); `restore=True` copies the host block back into the resident blocks (P/D
    import of the tail page). `after_forward` transfers run after this step's forward (and the
    drafter), the others before it.
    """

    transfer_id: int
    host_block_id: int
    resident_block_ids: tuple[int, ...]
    after_forward: bool = True
    restore: bool = False

    def __post_init__(self) -> None:
        _check_int("PageTransfer", "transfer_id", self.transfer_id)
        _check_int("PageTransfer", "host_block_id", self.host_block_id)
        _check_ints("PageTransfer", "resident_block_ids", self.resident_block_ids)
        if not isinstance(self.after_forward, bool) or not isinstance(self.restore, bool):
            raise InvalidCommandError("PageTransfer.after_forward and .restore must be bool")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Self:
        return cls(int(d["transfer_id"]), int(d["host_block_id"]), tuple(int(x) for x in d["resident_block_ids"]),
                   bool(d.get("after_forward", True)), bool(d.get("restore", False)))


@dataclass(frozen=True, slots=True)
class RowMirror(_Wire):
    """A contiguous span of rows written this step, mirrored from the resident pages to host.

    `source_starts[j]` is the flat resident row (block * block_size + offset) in resident group
    j; `destination_start` the flat host row. The span never crosses a block boundary on either
    side (the coordinator splits spans at page edges).
    """

    source_starts: tuple[int, ...]
    destination_start: int
    num_rows: int

    def __post_init__(self) -> None:
        _check_ints("RowMirror", "source_starts", self.source_starts)
        _check_int("RowMirror", "destination_start", self.destination_start)
        _check_int("RowMirror", "num_rows", self.num_rows, minimum=1)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Self:
        return cls(tuple(int(x) for x in d["source_starts"]), int(d["destination_start"]), int(d["num_rows"]))

    @classmethod
    def trusted(cls, source_starts: tuple[int, ...], destination_start: int, num_rows: int) -> Self:
        """A mirror from values its producer derived from state it already validated, without the
        field checks of `__init__`.

        For the coordinator, which builds one mirror per running request per step: the checks cost
        about a microsecond a mirror, this about a quarter of that. The values still meet their
        checks at the boundary that matters: every runtime checks each mirror's spans against its
        caches and host views when the mirror is submitted (`copy_checks.check_mirrors`).
        """
        m = object.__new__(cls)
        _SET_SOURCE_STARTS(m, source_starts)
        _SET_DESTINATION_START(m, destination_start)
        _SET_NUM_ROWS(m, num_rows)
        return m


# The slot descriptors `RowMirror.trusted` writes through (a frozen dataclass's own __setattr__ refuses).
_SET_SOURCE_STARTS = RowMirror.__dict__["source_starts"].__set__
_SET_DESTINATION_START = RowMirror.__dict__["destination_start"].__set__
_SET_NUM_ROWS = RowMirror.__dict__["num_rows"].__set__


@dataclass(frozen=True, slots=True)
class ResidencyUpdate(_Wire):
    """New resident block ids for some pages of one request state row.

    `block_ids[j][i]` is the resident block of page `pages[i]` in resident group j; -1 means the
    page is no longer resident and is read from host through the hot buffer. The worker applies
    it to its residency table at `state_index`; the engine's own block table stays append-only.
    """

    state_index: int
    pages: tuple[int, ...]
    block_ids: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        _check_int("ResidencyUpdate", "state_index", self.state_index)
        _check_ints("ResidencyUpdate", "pages", self.pages)
        if not isinstance(self.block_ids, tuple) or not self.block_ids:
            raise InvalidCommandError("ResidencyUpdate.block_ids must be a non-empty tuple (one entry per group)")
        for group in self.block_ids:
            _check_ints("ResidencyUpdate", "block_ids", group, minimum=-1, nonempty=False)
            if len(group) != len(self.pages):
                raise InvalidCommandError(
                    f"ResidencyUpdate.block_ids has {len(group)} ids for {len(self.pages)} pages; expected one per page")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Self:
        return cls(int(d["state_index"]), tuple(int(x) for x in d["pages"]),
                   tuple(tuple(int(x) for x in g) for g in d["block_ids"]))


@dataclass(frozen=True, slots=True)
class HostBlockCopy(_Wire):
    """Host-to-host copy of one block, every layer (copy-on-write of a shared partial page)."""

    src_block_id: int
    dst_block_id: int

    def __post_init__(self) -> None:
        _check_int("HostBlockCopy", "src_block_id", self.src_block_id)
        _check_int("HostBlockCopy", "dst_block_id", self.dst_block_id)
        if self.src_block_id == self.dst_block_id:
            raise InvalidCommandError(f"HostBlockCopy copies block {self.src_block_id} onto itself")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Self:
        return cls(int(d["src_block_id"]), int(d["dst_block_id"]))


@dataclass(frozen=True, slots=True)
class OffloadCommand(_Wire):
    """Everything a worker does for one step. Built only when HiSparse is enabled and there is work."""

    page_transfers: tuple[PageTransfer, ...] = ()
    row_mirrors: tuple[RowMirror, ...] = ()
    residency_updates: tuple[ResidencyUpdate, ...] = ()
    host_block_copies: tuple[HostBlockCopy, ...] = ()
    recycled_host_blocks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name, kind in (("page_transfers", PageTransfer), ("row_mirrors", RowMirror),
                           ("residency_updates", ResidencyUpdate), ("host_block_copies", HostBlockCopy)):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(map(isinstance, value, repeat(kind))):
                raise InvalidCommandError(f"OffloadCommand.{name} must be a tuple of {kind.__name__}")
        _check_ints("OffloadCommand", "recycled_host_blocks", self.recycled_host_blocks, nonempty=False)
        ids = [t.transfer_id for t in self.page_transfers]
        if len(ids) != len(set(ids)):
            raise InvalidCommandError(f"OffloadCommand repeats a transfer id: {sorted(ids)}")

    def is_empty(self) -> bool:
        return not (self.page_transfers or self.row_mirrors or self.residency_updates
                    or self.host_block_copies or self.recycled_host_blocks)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Self:
        return cls(
            tuple(PageTransfer.from_dict(x) for x in d.get("page_transfers", ())),
            tuple(RowMirror.from_dict(x) for x in d.get("row_mirrors", ())),
            tuple(ResidencyUpdate.from_dict(x) for x in d.get("residency_updates", ())),
            tuple(HostBlockCopy.from_dict(x) for x in d.get("host_block_copies", ())),
            tuple(int(x) for x in d.get("recycled_host_blocks", ())),
        )


def _count_map(owner: str, name: str, value: object) -> None:
    if not isinstance(value, Mapping):
        raise InvalidCommandError(f"{owner}.{name} must be a mapping of transfer id to count")
    for k, v in value.items():
        _check_int(owner, f"{name} key", k)
        _check_int(owner, f"{name}[{k}]", v, minimum=1)


@dataclass(frozen=True, slots=True)
class WorkerMetadata(_Wire):
    """What one worker (or, after `aggregate`, several) reports back after a step.

    Each worker reports `{transfer_id: 1}` once when the copy entered its stream (enqueued) and
    once when it observed the copy's completion. `aggregate` sums the counts, so the scheduler
    knows a transfer is done everywhere when its count equals the number of workers. Host copies
    run identically on every worker, so their acknowledgements are a union.
    """

    enqueued: Mapping[int, int] = field(default_factory=dict)
    completed: Mapping[int, int] = field(default_factory=dict)
    completed_host_copies: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _count_map("WorkerMetadata", "enqueued", self.enqueued)
        _count_map("WorkerMetadata", "completed", self.completed)
        _check_ints("WorkerMetadata", "completed_host_copies", self.completed_host_copies, nonempty=False)

    @classmethod
    def report(cls, enqueued: Iterable[int] = (), completed: Iterable[int] = (),
               completed_host_copies: Iterable[int] = ()) -> Self:
        """One worker's report: each id counted once."""
        return cls(dict.fromkeys(enqueued, 1), dict.fromkeys(completed, 1), tuple(sorted(set(completed_host_copies))))

    def aggregate(self, other: WorkerMetadata) -> WorkerMetadata:
        enq = dict(self.enqueued)
        for k, v in other.enqueued.items():
            enq[k] = enq.get(k, 0) + v
        done = dict(self.completed)
        for k, v in other.completed.items():
            done[k] = done.get(k, 0) + v
        copies = tuple(sorted(set(self.completed_host_copies) | set(other.completed_host_copies)))
        return WorkerMetadata(enq, done, copies)

    def is_empty(self) -> bool:
        return not (self.enqueued or self.completed or self.completed_host_copies)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Self:
        return cls({int(k): int(v) for k, v in d.get("enqueued", {}).items()},
                   {int(k): int(v) for k, v in d.get("completed", {}).items()},
                   tuple(int(x) for x in d.get("completed_host_copies", ())))
