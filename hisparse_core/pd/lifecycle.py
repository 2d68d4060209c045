"""Bookkeeping of the host imports one decoder worker runs: what is queued, in flight, landed,
aborting, and what to report.

A request moves READING -> (reported finished) when every chunk landed, or READING -> ABORTING ->
(reported failed) once it failed or was cancelled and every read it still had in flight was
released. It is reported exactly once and then forgotten. The ledger never touches memory or a
transport; the receiver drives it.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from hisparse_core.errors import ProtocolError
from hisparse_core.pd.messages import FailedRecv, RecvReport
from hisparse_core.pd.plan import ImportPlan, PageRun
from hisparse_core.pd.transport import ReadHandle

Chunk = tuple[PageRun, ...]


class ImportPhase(enum.Enum):
    READING = "reading"
    ABORTING = "aborting"


@dataclass(slots=True, eq=False)
class InFlightRead:
    handle: ReadHandle
    chunk: Chunk
    staging_slot: int | None


@dataclass(slots=True, eq=False)
class ImportRecord:
    """One request's import on this worker (mutable; owned by the ledger)."""

    plan: ImportPlan
    deadline: float
    started: float
    queued: deque[Chunk]
    in_flight: dict[int, InFlightRead] = field(default_factory=dict)
    phase: ImportPhase = ImportPhase.READING
    reason: str | None = None
    bytes_landed: int = 0

    @property
    def request_id(self) -> str:
        return self.plan.request_id

    @property
    def settled(self) -> bool:
        if self.phase is ImportPhase.READING:
            return not self.queued and not self.in_flight
        return not self.in_flight


class ImportLedger:
    """Open imports by request id, and the receives that ended but were not reported yet."""

    def __init__(self) -> None:
        self._open: dict[str, ImportRecord] = {}
        self._failed_early: list[FailedRecv] = []

    def open(self, plan: ImportPlan, chunks: tuple[Chunk, ...], *, now: float, timeout_s: float) -> ImportRecord:
        if plan.request_id in self._open:
            raise ProtocolError(f"request {plan.request_id!r} already has a host import in progress; "
                                f"expected each request to be imported once")
        record = ImportRecord(plan, now + timeout_s, now, deque(chunks))
        self._open[plan.request_id] = record
        return record

    def reject(self, request_id: str, reason: str) -> None:
        """A request that failed before it was opened (bad job, unknown peer): report it failed."""
        if request_id in self._open:
            raise ProtocolError(f"request {request_id!r} is open; abort it instead of rejecting it")
        self._failed_early.append(FailedRecv(request_id, reason))

    def get(self, request_id: str) -> ImportRecord | None:
        return self._open.get(request_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._open

    def __len__(self) -> int:
        return len(self._open)

    def records(self) -> Iterator[ImportRecord]:
        return iter(list(self._open.values()))

    def reads_in_flight(self) -> int:
        return sum(len(r.in_flight) for r in self._open.values())

    def posted(self, record: ImportRecord, read: InFlightRead) -> None:
        if record.phase is not ImportPhase.READING:
            raise ProtocolError(f"request {record.request_id!r} is {record.phase.value}; no read may be posted")
        record.in_flight[read.handle.read_id] = read

    def landed(self, record: ImportRecord, read_id: int) -> InFlightRead:
        read = self._take(record, read_id)
        record.bytes_landed += read.handle.nbytes
        return read

    def released(self, record: ImportRecord, read_id: int) -> InFlightRead:
        return self._take(record, read_id)

    def abort(self, record: ImportRecord, reason: str) -> list[InFlightRead]:
        """Fail `record` with `reason` (the first reason wins); returns the reads to release."""
        if record.phase is ImportPhase.READING:
            record.phase = ImportPhase.ABORTING
            record.reason = reason
            record.queued.clear()
        return list(record.in_flight.values())

    def settle(self) -> RecvReport:
        """Report and forget every settled request."""
        finished: list[str] = []
        failed = self._failed_early
        self._failed_early = []
        for rid, record in list(self._open.items()):
            if not record.settled:
                continue
            del self._open[rid]
            if record.phase is ImportPhase.READING:
                finished.append(rid)
            else:
                failed.append(FailedRecv(rid, record.reason or "aborted"))
        return RecvReport(tuple(finished), tuple(failed))

    @staticmethod
    def _take(record: ImportRecord, read_id: int) -> InFlightRead:
        try:
            return record.in_flight.pop(read_id)
        except KeyError:
            raise ProtocolError(f"read {read_id} is not in flight for request {record.request_id!r}") from None
