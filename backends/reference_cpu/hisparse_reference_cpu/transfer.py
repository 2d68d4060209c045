"""`ReferenceTransferEngine`: runs offload work synchronously, reports it with a configurable lag.

The bytes move at submission, in submission order, which trivially satisfies the ordering
guarantee. Acknowledgements are delayed on purpose so callers exercise their asynchronous path:
an id is reported enqueued at the first poll after its submission and completed `completion_lag`
polls later (0: both at that first poll). A later submission is never reported before an earlier one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hisparse_core.checks import check_int
from hisparse_core.host_pool import HostPool
from hisparse_core.runtime import CacheRuntime
from hisparse_core.transfer import TransferEngine, TransferProgress
from hisparse_core.transfer_checks import check_engine_pool, check_engine_runtimes, check_unique_ids
from hisparse_core.types import HostBlockCopy, PageTransfer, RowMirror
from hisparse_reference_cpu.runtime import ReferenceRuntime


@dataclass(slots=True)
class _Pending:
    """One acknowledgement owed: a page transfer id, or a host copy's destination block."""

    ident: int
    host_copy: bool
    enqueued_at: int | None = None  # poll number at which it was reported (or counted) enqueued


class ReferenceTransferEngine(TransferEngine):
    """Executes mirrors, page transfers and host copies on every bound reference runtime."""

    def __init__(self, host_pool: HostPool, runtimes: Sequence[CacheRuntime], *, completion_lag: int = 1) -> None:
        # mypy rejects an ABC where type[T] is expected (python/mypy#4717); check_engine_pool only isinstance()s it.
        self._pool = check_engine_pool(host_pool, HostPool, "a HostPool")  # type: ignore[type-abstract]
        self._runtimes = check_engine_runtimes(runtimes, ReferenceRuntime, "a ReferenceRuntime")
        self._lag = check_int("completion_lag", completion_lag, 0, 1 << 31)
        self._pending: list[_Pending] = []
        self._polls = 0

    @property
    def runtimes(self) -> Sequence[CacheRuntime]:
        return self._runtimes

    @property
    def completion_lag(self) -> int:
        return self._lag

    def submit_row_mirrors(self, mirrors: Sequence[RowMirror]) -> None:
        for rt in self._runtimes:
            rt.check_mirrors(mirrors)
        if self._pool.is_writer:
            for rt in self._runtimes:
                rt.mirror_rows(mirrors)

    def submit_pages(self, transfers: Sequence[PageTransfer]) -> None:
        for rt in self._runtimes:
            rt.check_pages(transfers, restore=None)
        check_unique_ids("transfer id", [t.transfer_id for t in transfers],
                         {p.ident for p in self._pending if not p.host_copy})
        for t in transfers:
            for rt in self._runtimes:
                if t.restore:
                    rt.restore_pages([t])
                elif self._pool.is_writer:
                    rt.spill_pages([t])
            self._pending.append(_Pending(t.transfer_id, host_copy=False))

    def submit_host_copies(self, copies: Sequence[HostBlockCopy]) -> None:
        for rt in self._runtimes:
            rt.check_host_copies(copies)
        dsts = [c.dst_block_id for c in copies]
        check_unique_ids("host copy destination block", dsts, {p.ident for p in self._pending if p.host_copy})
        if self._pool.is_writer:
            for rt in self._runtimes:
                rt.copy_host_blocks(copies)
        self._pending.extend(_Pending(d, host_copy=True) for d in dsts)

    def poll(self) -> TransferProgress:
        self._polls += 1
        enqueued: list[int] = []
        for p in self._pending:
            if p.enqueued_at is None:
                p.enqueued_at = self._polls
                if not p.host_copy:
                    enqueued.append(p.ident)
        done = [p for p in self._pending if self._polls - (p.enqueued_at or 0) >= self._lag]
        self._pending = [p for p in self._pending if self._polls - (p.enqueued_at or 0) < self._lag]
        return TransferProgress(
            enqueued=tuple(enqueued),
            completed=tuple(p.ident for p in done if not p.host_copy),
            completed_host_copies=tuple(p.ident for p in done if p.host_copy),
        )

    def drain(self) -> TransferProgress:
        enqueued = tuple(p.ident for p in self._pending if not p.host_copy and p.enqueued_at is None)
        done, self._pending = self._pending, []
        return TransferProgress(
            enqueued=enqueued,
            completed=tuple(p.ident for p in done if not p.host_copy),
            completed_host_copies=tuple(p.ident for p in done if p.host_copy),
        )

