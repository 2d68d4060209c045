"""Decoder scheduler side of P/D import: where each request lands, and the host-import lifecycle.

`HostImportScheduler` asks the coordinator for each imported request's landing target (chosen
once at admission and kept across retries). A HOST request gets its host blocks leased and a
`HostImportJob` queued for the worker; a WAIT request is retried at the next `admit`; a DEVICE
request is left to the engine's device-landing connector. The worker's `RecvReport`s come back
through `update`: a finished receive completes the import (the coordinator then admits the
request with its pages and restores the partial tail page to the GPU when it is first written);
a failed one releases every lease the import took. Torch-free: it runs in the scheduler process.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from hisparse_core.errors import InvalidInputError, ProtocolError
from hisparse_core.pd.handshake import RemotePrefill
from hisparse_core.pd.messages import FailedRecv, HostImportJob, RecvReport

logger = logging.getLogger(__name__)


class ImportCoordinator(Protocol):
    """The slice of `HiSparseCoordinator` the import path drives."""

    def choose_import_target(self, request_id: str, num_tokens: int, *, other_device_blocks: int = 0) -> Any: ...

    def begin_host_import(self, request_id: str, token_ids: Sequence[int], num_tokens: int, *,
                          extra_key: bytes | None = None) -> tuple[int, ...]: ...

    def complete_host_import(self, request_id: str) -> None: ...

    def fail_host_import(self, request_id: str) -> None: ...


class _Stage(enum.Enum):
    QUEUED = "queued"        # job built, not yet taken by the worker
    SHIPPED = "shipped"      # the worker runs it
    CANCELLING = "cancelling"  # shipped, cancel requested, waiting for the worker's failed receive


@dataclass(slots=True)
class _HostImport:
    job: HostImportJob
    stage: _Stage


class HostImportScheduler:
    """Drives the coordinator's import-target choice and host-import lifecycle."""

    def __init__(self, coordinator: ImportCoordinator) -> None:
        self._coordinator = coordinator
        self._imports: dict[str, _HostImport] = {}
        self._cancels: list[str] = []
        self._local_failures: list[FailedRecv] = []

    def admit(self, remote: RemotePrefill, token_ids: Sequence[int], *, other_device_blocks: int = 0,
              extra_key: bytes | None = None) -> Any:
        """Decide where `remote` lands; returns the coordinator's `ImportTarget`.

        HOST leases the host blocks and queues the worker's job (see `take_jobs`); WAIT changes
        nothing (call `admit` again later; the coordinator keeps its first real choice); DEVICE is
        the engine's to land directly in GPU pages.
        """
        rid = remote.request_id
        if rid in self._imports:
            raise ProtocolError(f"request {rid!r} is already importing into host; expected one admission")
        if len(token_ids) < remote.num_tokens:
            raise InvalidInputError(f"request {rid!r} has {len(token_ids)} token ids for {remote.num_tokens} "
                                    f"imported tokens; expected at least as many")
        target = self._coordinator.choose_import_target(rid, remote.num_tokens,
                                                        other_device_blocks=other_device_blocks)
        kind = getattr(target, "value", target)
        if kind == "host":
            blocks = tuple(self._coordinator.begin_host_import(rid, token_ids, remote.num_tokens, extra_key=extra_key))
            try:
                job = HostImportJob(remote, blocks)
            except Exception:
                self._coordinator.fail_host_import(rid)
                raise
            self._imports[rid] = _HostImport(job, _Stage.QUEUED)
            logger.info("request %s imports %d tokens into %d host blocks from %s@epoch%d: its prefix does not fit "
                        "the device pools, but its host blocks and host-backed GPU footprint do", rid,
                        remote.num_tokens, len(blocks), remote.engine_id, remote.epoch)
        elif kind == "wait":
            logger.debug("request %s waits: neither the device pools nor the host pool can take %d tokens now",
                         rid, remote.num_tokens)
        elif kind == "device":
            logger.debug("request %s imports %d tokens straight into device pages", rid, remote.num_tokens)
        else:
            raise ProtocolError(f"coordinator answered import target {target!r} for {rid!r}; expected "
                                f"device, host or wait")
        return target

    def take_jobs(self) -> tuple[HostImportJob, ...]:
        """Jobs queued since the last call, for the worker's `HostImportReceiver.start`."""
        out = []
        for record in self._imports.values():
            if record.stage is _Stage.QUEUED:
                record.stage = _Stage.SHIPPED
                out.append(record.job)
        return tuple(out)

    def take_cancels(self) -> tuple[str, ...]:
        """Requests whose shipped import the worker must cancel (`HostImportReceiver.cancel`)."""
        out, self._cancels = tuple(self._cancels), []
        return out

    def cancel(self, request_id: str) -> bool:
        """Abort a host import (the request was aborted). Its leases are released once the worker
        confirms nothing is still being written (a failed receive); at once if it never shipped.
        Returns False if the request has no host import."""
        record = self._imports.get(request_id)
        if record is None:
            return False
        if record.stage is _Stage.QUEUED:
            del self._imports[request_id]
            self._coordinator.fail_host_import(request_id)
            self._local_failures.append(FailedRecv(request_id, "cancelled before the worker started it"))
        elif record.stage is _Stage.SHIPPED:
            record.stage = _Stage.CANCELLING
            self._cancels.append(request_id)
        return True

    def update(self, report: RecvReport) -> RecvReport:
        """Apply the worker's report: complete finished imports, release failed ones.

        Returns every receive that ended (with cancellations that never reached the worker), for
        the engine's finished/failed-receive handling. Raises `ProtocolError` for a request with no
        shipped host import, before applying anything.
        """
        for rid in (*report.finished, *report.failed_ids):
            record = self._imports.get(rid)
            if record is None or record.stage is _Stage.QUEUED:
                raise ProtocolError(f"worker reported a receive for {rid!r}, which has no shipped host import")
        finished: list[str] = []
        failed = self._local_failures
        self._local_failures = []
        for rid in report.finished:
            record = self._imports.pop(rid)
            if record.stage is _Stage.CANCELLING:
                # It landed before the cancel reached the worker: nothing is in flight, drop it.
                self._coordinator.fail_host_import(rid)
                failed.append(FailedRecv(rid, "cancelled"))
                continue
            self._coordinator.complete_host_import(rid)
            finished.append(rid)
        for f in report.failed:
            self._imports.pop(f.request_id)
            self._coordinator.fail_host_import(f.request_id)
            failed.append(f)
            logger.warning("host import of %s failed; its leases were released: %s", f.request_id, f.reason)
        if finished:
            logger.info("host import finished for %d request(s): %s", len(finished), ", ".join(finished))
        return RecvReport(tuple(finished), tuple(failed))

    @property
    def num_importing(self) -> int:
        return len(self._imports)

    def importing(self) -> frozenset[str]:
        return frozenset(self._imports)
