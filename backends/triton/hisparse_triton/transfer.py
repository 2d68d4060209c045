"""`TritonTransferEngine`: a step's offload copies, stream-ordered on a GPU, synchronous in the interpreter.

- **GPU.** Host writes (row mirrors, page spills, host block copies) run on the engine's copy
  stream, which first waits (on the GPU) for the caller's stream, so a mirror submitted after the
  forward sees the rows the forward wrote. Restores (host to device) run on the caller's stream
  behind the copy stream's earlier writes. A transfer id is reported *enqueued* at the first
  `poll` after its submission and *completed* once the CUDA event recorded behind it has.
- **Interpreter (CPU).** The kernels have run when `submit_*` returns; both reports come at the
  first `poll` after the submission.

Reports are in submission order: a later id is never completed before an earlier one.

Shared host pool: only rank 0 (`host_pool.is_writer`) writes. Every submission that writes the
host pool is one epoch on every rank (ranks receive the same commands); rank 0 publishes in the
pool's header the last epoch it has seen complete, and a peer acknowledges the transfers of an
epoch once rank 0 has published it. A peer's restore, and `wait_for_host_writes` on a peer, order
the peer's stream behind rank 0's interprocess device event (`hisparse_triton.ipc`): the host
waits only until rank 0 has *enqueued* the epoch's writes, the GPU for them to land. Where the
platform has no interprocess events (the interpreter), the peer waits on the host until rank 0
has published the epoch complete.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from hisparse_core.errors import InvalidInputError, ProtocolError
from hisparse_core.host_pool import HostPool
from hisparse_core.runtime import CacheRuntime
from hisparse_core.transfer import TransferEngine, TransferProgress
from hisparse_core.transfer_checks import check_engine_pool, check_engine_runtimes, check_unique_ids
from hisparse_core.types import HostBlockCopy, PageTransfer, RowMirror
from hisparse_triton.host_pool import TritonHostPool
from hisparse_triton.ipc import EventChannel
from hisparse_triton.runtime import TritonRuntime


@dataclass(slots=True)
class _Pending:
    """One acknowledgement owed: a page transfer id or a host copy's destination block."""

    ident: int
    host_copy: bool
    event: Any  # torch.cuda.Event of the local copy; None: nothing left to wait for locally
    epoch: int  # host-write epoch rank 0 must have published (0: none)
    enqueued_reported: bool = False


class TritonTransferEngine(TransferEngine):
    """Runs mirrors, page transfers and host copies for every bound `TritonRuntime` of a worker."""

    def __init__(self, host_pool: HostPool, runtimes: Sequence[CacheRuntime], *, peer_timeout_s: float = 120.0) -> None:
        pool = check_engine_pool(host_pool, TritonHostPool, "a TritonHostPool")

        def same_device(i: int, rt: TritonRuntime) -> None:
            if rt.device != pool.device:
                raise InvalidInputError(f"runtimes[{i}] is on {rt.device}; the host pool is pinned for {pool.device}")

        self._runtimes = check_engine_runtimes(runtimes, TritonRuntime, "a TritonRuntime", same_device)
        self._pool = pool
        self._device = pool.device
        self._gpu = self._device.type == "cuda"
        self._stream = torch.cuda.Stream(self._device) if self._gpu else None
        self._pending: list[_Pending] = []
        self._epoch = 0  # host-write epochs submitted (the same count on every rank)
        self._last_write_event: Any = None
        self._epoch_events: list[tuple[int, Any]] = []  # writer on a GPU: epochs not yet published
        self._timeout = peer_timeout_s
        header = pool.header_bytes
        self._channel = EventChannel(header, self._device, writer=pool.is_writer) \
            if self._gpu and header is not None else None

    @property
    def runtimes(self) -> Sequence[CacheRuntime]:
        return self._runtimes

    @property
    def copy_stream(self) -> torch.cuda.Stream | None:
        """The stream host writes run on (None in the interpreter)."""
        return self._stream

    # ----------------------------------------------------------------- submission

    def _host_writes(self, work: list[Callable[[], None]]) -> tuple[Any, int]:
        """Run `work` as one host-write epoch; returns (local completion event or None, epoch)."""
        self._epoch += 1
        if not self._pool.is_writer:
            return None, self._epoch
        if self._stream is None:
            for fn in work:
                fn()
            self._pool.mark_done(self._epoch)
            return None, self._epoch
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._stream):
            for fn in work:
                fn()
            event = torch.cuda.Event()
            event.record(self._stream)
            if self._channel is not None:
                self._channel.record(self._stream, self._epoch)
        self._last_write_event = event
        self._epoch_events.append((self._epoch, event))
        return event, self._epoch

    def submit_row_mirrors(self, mirrors: Sequence[RowMirror]) -> None:
        for rt in self._runtimes:
            rt.check_mirrors(mirrors)
        if mirrors:
            self._host_writes([partial(rt.mirror_rows, mirrors) for rt in self._runtimes])

    def submit_pages(self, transfers: Sequence[PageTransfer]) -> None:
        for rt in self._runtimes:
            rt.check_pages(transfers, restore=None)
        check_unique_ids("transfer id", [t.transfer_id for t in transfers],
                         {p.ident for p in self._pending if not p.host_copy})
        # In submission order: a restore reads what the spills before it in the list wrote.
        i = 0
        while i < len(transfers):
            j = i
            while j < len(transfers) and transfers[j].restore == transfers[i].restore:
                j += 1
            run = list(transfers[i:j])
            if run[0].restore:
                self._restore(run)
            else:
                event, epoch = self._host_writes([partial(rt.spill_pages, run) for rt in self._runtimes])
                self._pending.extend(_Pending(t.transfer_id, False, event, epoch) for t in run)
            i = j

    def _restore(self, run: list[PageTransfer]) -> None:
        self.wait_for_host_writes()
        for rt in self._runtimes:
            rt.restore_pages(run)
        event = None
        if self._gpu:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._device))
        self._pending.extend(_Pending(t.transfer_id, False, event, 0) for t in run)

    def submit_host_copies(self, copies: Sequence[HostBlockCopy]) -> None:
        for rt in self._runtimes:
            rt.check_host_copies(copies)
        dsts = [c.dst_block_id for c in copies]
        check_unique_ids("host copy destination block", dsts, {p.ident for p in self._pending if p.host_copy})
        if copies:
            event, epoch = self._host_writes([partial(rt.copy_host_blocks, copies) for rt in self._runtimes])
            self._pending.extend(_Pending(d, True, event, epoch) for d in dsts)

    def wait_for_host_writes(self, stream: torch.cuda.Stream | None = None) -> None:
        """Order later reads of the host pool on `stream` (default: current) after every host write
        submitted so far: a GPU-side wait on the copy stream here. On a peer, a GPU-side wait on rank
        0's interprocess event once rank 0 has enqueued every epoch submitted so far; where the
        platform has no such events, a host-side wait until rank 0 has published them complete."""
        if self._pool.is_writer:
            if self._gpu and self._last_write_event is not None:
                (stream or torch.cuda.current_stream(self._device)).wait_event(self._last_write_event)
            return
        deadline = time.monotonic() + self._timeout
        what = f"host-write epoch {self._epoch}"
        if self._channel is not None and self._epoch > 0:
            target = stream or torch.cuda.current_stream(self._device)
            if self._channel.wait(self._epoch, target, lambda: self._pool.done_epoch,
                                  lambda: self._peer_wait_step(what, deadline)):
                return
        while self._pool.done_epoch < self._epoch:
            self._peer_wait_step(what, deadline)

    # ----------------------------------------------------------------- progress

    def _done(self, p: _Pending) -> bool:
        if p.event is not None and not p.event.query():
            return False
        return self._pool.is_writer or not p.epoch or self._pool.done_epoch >= p.epoch

    def _peer_wait_step(self, what: str, deadline: float) -> None:
        file = self._pool.shm_file
        creator = file.creator if file is not None else None
        if creator is not None and creator.state() == "dead":
            raise ProtocolError(f"rank 0 (pid {creator.pid}) of the shared host pool died before finishing {what}")
        if time.monotonic() > deadline:
            raise ProtocolError(f"waited {self._timeout}s for rank 0 to finish {what}")
        time.sleep(0.0005)

    def _publish_done(self) -> None:
        done = 0
        while self._epoch_events and self._epoch_events[0][1].query():  # one stream: in order
            done = self._epoch_events.pop(0)[0]
        if done:
            self._pool.mark_done(done)

    def _report(self, wait: bool) -> TransferProgress:
        enqueued = [p.ident for p in self._pending if not p.host_copy and not p.enqueued_reported]
        for p in self._pending:
            p.enqueued_reported = True
        self._publish_done()
        done: list[_Pending] = []
        deadline = time.monotonic() + self._timeout
        while self._pending:
            p = self._pending[0]
            if not self._done(p):
                if not wait:
                    break
                if p.event is not None and not p.event.query():
                    p.event.synchronize()
                    self._publish_done()
                else:
                    self._peer_wait_step(f"host-write epoch {p.epoch}", deadline)
                continue
            done.append(self._pending.pop(0))
        return TransferProgress(
            enqueued=tuple(enqueued),
            completed=tuple(p.ident for p in done if not p.host_copy),
            completed_host_copies=tuple(p.ident for p in done if p.host_copy),
        )

    def poll(self) -> TransferProgress:
        return self._report(wait=False)

    def drain(self) -> TransferProgress:
        if self._stream is not None and self._pool.is_writer:
            self._stream.synchronize()
        return self._report(wait=True)
