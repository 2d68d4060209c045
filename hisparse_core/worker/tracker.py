"""Bookkeeping of a worker's transfers: what was submitted, enqueued and completed, and when.

The transfer engine reports progress as ids; the tracker checks each report against what was
submitted (an id reported that was never submitted, or twice, is a `ProtocolError` naming it)
and turns the reports into this worker's acknowledgements, each id exactly once.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from hisparse_core.errors import ProtocolError
from hisparse_core.transfer import TransferProgress


@dataclass(slots=True)
class _Record:
    submitted_at: float
    enqueued_at: float | None = None


@dataclass(frozen=True, slots=True)
class Acknowledgements:
    """This worker's newly enqueued and completed transfer ids and completed host copies."""

    enqueued: tuple[int, ...] = ()
    completed: tuple[int, ...] = ()
    completed_host_copies: tuple[int, ...] = ()

    def is_empty(self) -> bool:
        return not (self.enqueued or self.completed or self.completed_host_copies)


@dataclass(slots=True)
class TrackerTotals:
    """Counts since construction (for stats and logs)."""

    submitted: int = 0
    enqueued: int = 0
    completed: int = 0
    host_copies: int = 0
    completion_seconds: float = 0.0  # summed submit-to-completion time of completed transfers


@dataclass(slots=True)
class TransferTracker:
    """Submitted page transfers and host copies that are not acknowledged yet."""

    _transfers: dict[int, _Record] = field(default_factory=dict)
    _host_copies: dict[int, float] = field(default_factory=dict)
    totals: TrackerTotals = field(default_factory=TrackerTotals)

    def submit_transfers(self, ids: Iterable[int]) -> None:
        now = time.monotonic()
        ids = list(ids)
        for i in ids:
            if i in self._transfers:
                raise ProtocolError(
                    f"transfer id {i} submitted while an earlier transfer with that id is still pending; "
                    "expected the coordinator to reuse an id only after its completion was reported")
        for i in ids:
            self._transfers[i] = _Record(now)
        self.totals.submitted += len(ids)

    def submit_host_copies(self, dst_blocks: Iterable[int]) -> None:
        now = time.monotonic()
        dst_blocks = list(dst_blocks)
        for b in dst_blocks:
            if b in self._host_copies:
                raise ProtocolError(
                    f"host copy into block {b} submitted while an earlier copy into it is still pending")
        for b in dst_blocks:
            self._host_copies[b] = now
        self.totals.host_copies += len(dst_blocks)

    def withdraw_transfers(self, ids: Iterable[int]) -> None:
        """Forget transfers just recorded by `submit_transfers` that the engine refused (it raised
        an error, so it took none of them)."""
        ids = list(ids)
        for i in ids:
            self._transfers.pop(i, None)
        self.totals.submitted -= len(ids)

    def withdraw_host_copies(self, dst_blocks: Iterable[int]) -> None:
        """Forget host copies just recorded by `submit_host_copies` that the engine refused."""
        dst_blocks = list(dst_blocks)
        for b in dst_blocks:
            self._host_copies.pop(b, None)
        self.totals.host_copies -= len(dst_blocks)

    def observe(self, progress: TransferProgress, *, backend: str) -> Acknowledgements:
        """Check one report of the engine and retire what it completes."""
        now = time.monotonic()
        for i in progress.enqueued:
            rec = self._transfers.get(i)
            if rec is None or rec.enqueued_at is not None:
                why = "was never submitted" if rec is None else "was already reported enqueued"
                raise ProtocolError(f"backend {backend!r} reported transfer {i} enqueued, but it {why}")
            rec.enqueued_at = now
        for i in progress.completed:
            rec = self._transfers.get(i)
            if rec is None:
                raise ProtocolError(f"backend {backend!r} reported transfer {i} completed, but it is not pending "
                                    "(never submitted, or already reported completed)")
            if rec.enqueued_at is None:
                raise ProtocolError(f"backend {backend!r} reported transfer {i} completed before enqueued; "
                                    "expected enqueued in the same or an earlier report")
        for b in progress.completed_host_copies:
            if b not in self._host_copies:
                raise ProtocolError(f"backend {backend!r} reported a host copy into block {b} completed, but none "
                                    "is pending")
        for i in progress.completed:
            rec = self._transfers.pop(i)
            self.totals.completion_seconds += now - rec.submitted_at
        for b in progress.completed_host_copies:
            del self._host_copies[b]
        self.totals.enqueued += len(progress.enqueued)
        self.totals.completed += len(progress.completed)
        return Acknowledgements(tuple(progress.enqueued), tuple(progress.completed),
                                tuple(progress.completed_host_copies))

    @property
    def pending_transfers(self) -> int:
        """Submitted page transfers not yet reported completed."""
        return len(self._transfers)

    @property
    def pending_host_copies(self) -> int:
        return len(self._host_copies)

    def pending_ids(self) -> list[int]:
        return sorted(self._transfers)
