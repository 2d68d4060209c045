"""Decoder worker side of a host import: run the reads of `HostImportJob`s and report receives.

`start(job)` plans the request against the handshake held for its prefill engine and queues its
chunks; nothing is posted for a job that fails validation (a stale generation, an out-of-range
page or block, a geometry mismatch): it is reported failed at the next `poll`. `poll()` posts
queued chunks within the in-flight budget, checks posted reads, copies staged chunks into the
host pool, fails requests whose reads errored or whose deadline passed, and returns the
receives that ended.

A failed or cancelled request is reported only once no read of it can still write: a read in
flight to a live peer is left to finish; one to a peer that stopped answering (a deadline passed
with reads in flight) is cancelled only after the connection to that peer was closed, which
fails every import from it. So the scheduler may reuse a failed request's host blocks the moment
it sees the failure.

Landing: without a staging buffer, reads land directly in the host pool (which the transport
registered); with one, each chunk is read into a staging slot and copied into the host blocks.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from hisparse_core.errors import HiSparseError, InvalidInputError
from hisparse_core.host_pool import HostPool
from hisparse_core.pd.handshake import PrefillHandshake
from hisparse_core.pd.lifecycle import ImportLedger, ImportPhase, ImportRecord, InFlightRead
from hisparse_core.pd.messages import HostImportJob, ReadNotice, RecvReport
from hisparse_core.pd.plan import (
    HostLayout,
    build_import_plan,
    host_descriptors,
    remote_descriptors,
    staging_descriptors,
)
from hisparse_core.pd.staging import StagingBuffer
from hisparse_core.pd.transport import ImportTransport, ReadState

logger = logging.getLogger(__name__)

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class ReceiverConfig:
    """- `timeout_s`: a request whose reads have not all landed this long after `start` fails.
    - `max_read_bytes`: largest single read when landing directly (staged reads are one slot).
    - `max_reads_in_flight`: posted-but-unfinished reads across all requests."""

    timeout_s: float = 30.0
    max_read_bytes: int = 64 * MIB
    max_reads_in_flight: int = 16

    def __post_init__(self) -> None:
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int | float) \
                or not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise InvalidInputError(f"ReceiverConfig.timeout_s must be a positive number, got {self.timeout_s!r}")
        for name in ("max_read_bytes", "max_reads_in_flight"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidInputError(f"ReceiverConfig.{name} must be a positive int, got {v!r}")


class HostImportReceiver:
    """Runs host imports on one decoder worker through an `ImportTransport`."""

    def __init__(self, transport: ImportTransport, host_pool: HostPool, *, staging: StagingBuffer | None = None,
                 config: ReceiverConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._transport = transport
        self._pool = host_pool
        self._layout = HostLayout.of_pool(host_pool)
        self._staging = staging
        self._config = config or ReceiverConfig()
        self._clock = clock
        self._ledger = ImportLedger()
        self._engine_of: dict[str, str] = {}  # request id -> prefill engine, until reported
        self._closed = False
        if staging is None:
            logger.info("host imports land directly in the host pool (%.1f MiB, registered with the transport); "
                        "no staging buffer was configured", host_pool.nbytes / MIB)
        else:
            logger.info("host imports are staged through %d x %.1f MiB slots on %s, then copied into the host pool",
                        staging.num_slots, staging.slot_bytes / MIB, staging.tensor.device)

    # -- peers ------------------------------------------------------------------------------

    def add_peer(self, handshake: PrefillHandshake) -> None:
        """Hold `handshake` for its engine. A newer epoch replaces the older one (and drops the old
        connection); imports still reading from the older generation fail."""
        if self._staging is not None and self._staging.slot_bytes < handshake.page_bytes:
            raise InvalidInputError(
                f"staging slots of {self._staging.slot_bytes} B cannot hold one {handshake.page_bytes} B page of "
                f"{handshake.engine_id!r}; expected slot_bytes >= page bytes")
        replaced = self._transport.add_peer(handshake)
        if replaced is None:
            return
        for record in self._ledger.records():
            if record.plan.engine_id == handshake.engine_id and record.plan.epoch != handshake.epoch:
                self._abort(record, f"stale handshake: prefill engine {handshake.engine_id!r} restarted "
                                    f"(epoch {record.plan.epoch} -> {handshake.epoch}) during the import")
        self._release_orphans()

    def remove_peer(self, engine_id: str) -> None:
        """Drop an engine's connection; its open imports fail."""
        self._disconnect(engine_id, f"prefill engine {engine_id!r} was removed during the import")

    def _disconnect(self, engine_id: str, reason: str) -> None:
        """Close the connection to `engine_id` (so nothing more can land from it), fail its imports
        and release their reads."""
        for record in self._ledger.records():
            if record.plan.engine_id == engine_id:
                self._abort(record, reason)
        self._transport.remove_peer(engine_id)
        self._release_orphans()

    # -- requests ---------------------------------------------------------------------------

    def start(self, job: HostImportJob) -> None:
        """Queue a job's reads (posted at the next `poll`). A job that fails validation is reported
        failed at the next `poll`, with nothing posted."""
        if self._closed:
            raise InvalidInputError("HostImportReceiver is closed")
        remote = job.remote
        if job.request_id in self._engine_of:
            raise InvalidInputError(f"request {job.request_id!r} was already started on this receiver and has not "
                                    f"been reported yet; expected one job per request")
        self._engine_of[job.request_id] = remote.engine_id
        handshake = self._transport.peer(remote.engine_id)
        if handshake is None:
            self._reject(job, f"no handshake from prefill engine {remote.engine_id!r}; expected add_peer first")
            return
        try:
            plan = build_import_plan(handshake, remote, self._pool.spec, job.host_blocks)
            if self._staging is None:
                chunks = plan.chunks(max(self._config.max_read_bytes, plan.page_bytes))
            else:
                chunks = plan.chunks(self._staging.slot_bytes)
        except HiSparseError as e:
            self._reject(job, f"{type(e).__name__}: {e}")
            return
        self._ledger.open(plan, chunks, now=self._clock(), timeout_s=self._config.timeout_s)
        logger.debug("host import %s: %d pages x %d layers (%d B) from %s in %d chunk(s)", plan.request_id,
                     plan.num_pages, plan.num_layers, plan.total_bytes, handshake.describe(), len(chunks))

    def cancel(self, request_id: str) -> bool:
        """Cancel an open import: nothing more is posted, reads in flight finish (or fail, or time
        out) and the request is reported failed ("cancelled") once none is left. Returns False if
        the request has no open import."""
        record = self._ledger.get(request_id)
        if record is None:
            return False
        self._abort(record, "cancelled")
        return True

    def poll(self) -> RecvReport:
        """Advance every import without blocking on the transport, and report ended receives."""
        self._transport.progress()
        self._post()
        self._check()
        self._expire()
        self._release_orphans()
        report = self._ledger.settle()
        self._announce(report)
        return report

    @property
    def num_open(self) -> int:
        return len(self._ledger)

    def phase(self, request_id: str) -> ImportPhase | None:
        record = self._ledger.get(request_id)
        return None if record is None else record.phase

    def close(self) -> RecvReport:
        """Fail every open import, drop the connections they read from, release their reads.
        Returns the final report (the caller releases the failed imports' leases)."""
        if self._closed:
            return RecvReport()
        engines = {record.plan.engine_id for record in self._ledger.records()}
        for engine_id in sorted(engines):
            self._disconnect(engine_id, "cancelled: the decoder is shutting down")
        report = self._ledger.settle()
        if len(self._ledger):
            logger.error("%d host import(s) keep reads the transport could not cancel; their host blocks must "
                         "not be reused", len(self._ledger))
        self._closed = True
        self._announce(report)
        return report

    # -- steps of poll ----------------------------------------------------------------------

    def _post(self) -> None:
        budget = self._config.max_reads_in_flight - self._ledger.reads_in_flight()
        for record in self._ledger.records():
            while budget > 0 and record.phase is ImportPhase.READING and record.queued:
                slot = None
                if self._staging is not None:
                    slot = self._staging.acquire()
                    if slot is None:
                        return
                chunk = record.queued.popleft()
                handshake = self._transport.peer(record.plan.engine_id)
                try:
                    if handshake is None or handshake.epoch != record.plan.epoch:
                        raise InvalidInputError(
                            f"stale handshake: prefill engine {record.plan.engine_id!r} epoch {record.plan.epoch} "
                            f"is no longer held")
                    remote = remote_descriptors(handshake, chunk)
                    if slot is None:
                        local = host_descriptors(self._layout, chunk)
                    else:
                        assert self._staging is not None
                        local = staging_descriptors(self._staging.slot_address(slot), self._staging.slot_bytes,
                                                    record.plan.page_bytes, chunk, self._staging.device_id)
                    handle = self._transport.post_read(record.plan.engine_id, local, remote)
                except HiSparseError as e:
                    if slot is not None:
                        assert self._staging is not None
                        self._staging.release(slot)
                    self._abort(record, f"read could not be posted: {e}")
                    break
                self._ledger.posted(record, InFlightRead(handle, chunk, slot))
                budget -= 1

    def _check(self) -> None:
        """Retire finished reads: land them (READING) or drop them (ABORTING)."""
        for record in self._ledger.records():
            for read_id, read in list(record.in_flight.items()):
                status = self._transport.check(read.handle)
                if status.state is ReadState.IN_FLIGHT:
                    continue
                if not self._transport.release(read.handle):  # a finished read always releases
                    continue
                if status.state is ReadState.DONE and record.phase is ImportPhase.READING:
                    self._ledger.landed(record, read_id)
                    if read.staging_slot is not None:
                        assert self._staging is not None
                        self._staging.copy_out(read.staging_slot, read.chunk, self._pool, record.plan.page_bytes)
                else:
                    self._ledger.released(record, read_id)
                    if status.state is ReadState.FAILED:
                        self._abort(record, f"read from {record.plan.engine_id!r} failed: {status.error}")
                if read.staging_slot is not None:
                    assert self._staging is not None
                    self._staging.release(read.staging_slot)

    def _expire(self) -> None:
        """A request past its deadline fails. If it still has reads in flight (also after a cancel)
        the peer is not answering: its connection is closed, so no late write can land, and every
        import reading from it fails."""
        now = self._clock()
        for record in self._ledger.records():
            if now <= record.deadline or record.request_id not in self._ledger:
                continue
            reason = (f"timed out after {self._config.timeout_s:g}s with {record.bytes_landed}/"
                      f"{record.plan.total_bytes} bytes landed from {record.plan.engine_id!r}")
            self._abort(record, reason)
            if record.in_flight:
                self._disconnect(record.plan.engine_id, f"prefill engine {record.plan.engine_id!r} stopped "
                                                        f"answering reads (request {record.request_id} {reason})")

    def _release_orphans(self) -> None:
        """Cancel the in-flight reads of aborted imports whose connection is gone; reads to a live
        peer are left to finish (cancelling them could let a late write land in a reused block)."""
        for record in self._ledger.records():
            if record.phase is not ImportPhase.ABORTING:
                continue
            held = self._transport.peer(record.plan.engine_id)
            if held is not None and held.epoch == record.plan.epoch:
                continue
            for read_id, read in list(record.in_flight.items()):
                if not self._transport.release(read.handle):
                    continue
                self._ledger.released(record, read_id)
                if read.staging_slot is not None:
                    assert self._staging is not None
                    self._staging.release(read.staging_slot)

    def _abort(self, record: ImportRecord, reason: str) -> None:
        if record.phase is ImportPhase.READING:
            logger.warning("host import %s failed: %s", record.request_id, reason)
        self._ledger.abort(record, reason)

    def _reject(self, job: HostImportJob, reason: str) -> None:
        logger.warning("host import %s rejected before any read was posted: %s", job.request_id, reason)
        self._ledger.reject(job.request_id, reason)

    def _announce(self, report: RecvReport) -> None:
        """Tell each prefill engine which requests' pages it may free (best effort)."""
        for ok, ids in ((True, report.finished), (False, report.failed_ids)):
            for rid in ids:
                engine_id = self._engine_of.pop(rid, None)
                if engine_id is not None and self._transport.peer(engine_id) is not None:
                    if not self._transport.notify(engine_id, ReadNotice(rid, ok=ok)):
                        logger.info("could not tell %r that request %s is done; its pages are freed by the "
                                    "prefill side's own timeout", engine_id, rid)
