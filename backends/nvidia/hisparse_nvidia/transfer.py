"""`NvidiaTransferEngine`: a step's offload copies on a copy stream, tracked by CUDA events.

Streams and ordering:

- Host writes (row mirrors, page spills, host block copies) run on the engine's copy stream,
  which first waits (on the GPU) for the work already queued on the caller's stream, so a mirror
  submitted after the forward sees the rows the forward wrote. Each is one launch per runtime
  (every layer, every row of the batch).
- Page restores (host to device into resident pages) run on the caller's stream, behind the
  copy stream's earlier host writes, so the attention that follows reads restored pages.
- A transfer id is reported *enqueued* at the first `poll` after its submission (its copy is
  ordered on a stream by then) and *completed* once the CUDA event behind it has completed.
  Reports are in submission order: a later id is never completed before an earlier one.

Shared host pool (tensor parallelism on one node): only rank 0 (`host_pool.is_writer`) runs host
writes. Every submission that writes the host pool is one epoch on every rank (ranks receive the
same commands); rank 0 records its IPC event behind the epoch's copies (`WriterChannel.publish`),
and peers acknowledge the epoch's transfers once rank 0 reports the epoch done. Before reading the
pool (a restore here, or the resolver's gathers after `wait_for_host_writes`), a peer's stream
waits on rank 0's event, so it never reads a row before rank 0's write has landed. A peer's
`drain` polls instead of blocking and fails at once, naming rank 0's pid, when rank 0 has died
with work it waits for (`bench/bench_tp_shared.py` kills rank 0 mid-step).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hisparse_core.errors import InvalidInputError, ProtocolError
from hisparse_core.host_pool import HostPool
from hisparse_core.runtime import CacheRuntime
from hisparse_core.transfer import TransferEngine, TransferProgress
from hisparse_core.transfer_checks import check_engine_pool, check_engine_runtimes, check_unique_ids
from hisparse_core.types import HostBlockCopy, PageTransfer, RowMirror
from hisparse_nvidia.host_pool import NvidiaHostPool
from hisparse_nvidia.runtime import NvidiaRuntime


@dataclass(slots=True)
class _Pending:
    """One acknowledgement owed: a page transfer id or a host copy's destination block."""

    ident: int
    host_copy: bool
    event: torch.cuda.Event | None  # local completion (None: this rank ran no copy)
    epoch: int  # host-write epoch that must be done (0: none)
    enqueued_reported: bool = False


class NvidiaTransferEngine(TransferEngine):
    """Runs mirrors, page transfers and host copies for every bound `NvidiaRuntime` of a worker."""

    def __init__(self, host_pool: HostPool, runtimes: Sequence[CacheRuntime], *, peer_timeout_s: float = 120.0) -> None:
        pool = check_engine_pool(host_pool, NvidiaHostPool, "an NvidiaHostPool")

        def same_device(i: int, rt: NvidiaRuntime) -> None:
            if rt.device != pool.device:
                raise InvalidInputError(f"runtimes[{i}] is on {rt.device}; the host pool is registered for "
                                        f"{pool.device}")

        self._runtimes = check_engine_runtimes(runtimes, NvidiaRuntime, "an NvidiaRuntime", same_device)
        self._pool = pool
        self._device = pool.device
        self._stream = torch.cuda.Stream(self._device)
        self._pending: list[_Pending] = []
        self._epoch = 0  # host-write epochs submitted (the same count on every rank)
        self._last_write_event: torch.cuda.Event | None = None
        self._epoch_events: list[tuple[int, torch.cuda.Event]] = []  # writer: not yet reported done
        self._timeout = peer_timeout_s

    @property
    def runtimes(self) -> Sequence[CacheRuntime]:
        return self._runtimes

    @property
    def copy_stream(self) -> torch.cuda.Stream:
        return self._stream

    # ----------------------------------------------------------------- submission

    def _host_writes(self, work: list) -> tuple[torch.cuda.Event | None, int]:  # noqa: ANN401
        """Run `work` (callables taking no argument) as one host-write epoch.

        Returns the local completion event (None on peers, which write nothing) and the epoch.
        """
        self._epoch += 1
        if not self._pool.is_writer:
            return None, self._epoch
        current = torch.cuda.current_stream(self._device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            for fn in work:
                fn()
            event = torch.cuda.Event()
            event.record(self._stream)
            channel = self._pool.channel
            if channel is not None:
                published = channel.publish(self._stream.cuda_stream)
                if published != self._epoch:
                    raise ProtocolError(f"rank 0 published host-write epoch {published}, expected {self._epoch}")
        self._last_write_event = event
        self._epoch_events.append((self._epoch, event))
        return event, self._epoch

    def submit_row_mirrors(self, mirrors: Sequence[RowMirror]) -> None:
        for rt in self._runtimes:
            rt.check_mirrors(mirrors)
        if not mirrors:
            return
        self._host_writes([lambda rt=rt: rt.mirror_rows(mirrors) for rt in self._runtimes])

    def submit_pages(self, transfers: Sequence[PageTransfer]) -> None:
        for rt in self._runtimes:
            rt.check_pages(transfers, restore=None)
        check_unique_ids("transfer id", [t.transfer_id for t in transfers],
                         {p.ident for p in self._pending if not p.host_copy})
        spills = [t for t in transfers if not t.restore]
        restores = [t for t in transfers if t.restore]
        if spills:
            event, epoch = self._host_writes([lambda rt=rt: rt.spill_pages(spills) for rt in self._runtimes])
            self._pending.extend(_Pending(t.transfer_id, False, event, epoch) for t in spills)
        if restores:
            current = torch.cuda.current_stream(self._device)
            self.wait_for_host_writes(current)
            for rt in self._runtimes:
                rt.restore_pages(restores)
            event = torch.cuda.Event()
            event.record(current)
            self._pending.extend(_Pending(t.transfer_id, False, event, 0) for t in restores)

    def submit_host_copies(self, copies: Sequence[HostBlockCopy]) -> None:
        for rt in self._runtimes:
            rt.check_host_copies(copies)
        dsts = [c.dst_block_id for c in copies]
        check_unique_ids("host copy destination block", dsts, {p.ident for p in self._pending if p.host_copy})
        if not copies:
            return
        event, epoch = self._host_writes([lambda rt=rt: rt.copy_host_blocks(copies) for rt in self._runtimes])
        self._pending.extend(_Pending(d, True, event, epoch) for d in dsts)

    def wait_for_host_writes(self, stream: torch.cuda.Stream | None = None) -> None:
        """Order later reads of the host pool on `stream` (default: current) after every host
        write submitted so far: behind the copy stream here, behind rank 0's IPC event on a peer.
        A GPU-side wait; the host does not block (a peer spins only until rank 0 has *submitted*
        the epoch)."""
        stream = stream if stream is not None else torch.cuda.current_stream(self._device)
        if self._pool.is_writer:
            if self._last_write_event is not None:
                stream.wait_event(self._last_write_event)
            return
        channel = self._pool.channel
        if channel is not None and self._epoch:
            channel.wait(self._epoch, stream.cuda_stream, timeout_s=self._timeout)

    # ----------------------------------------------------------------- progress

    def _done(self, p: _Pending) -> bool:
        if p.event is not None and not p.event.query():
            return False
        if p.epoch and not self._pool.is_writer:
            channel = self._pool.channel
            return channel is None or channel.done_epoch >= p.epoch
        return True

    def _report(self, wait: bool) -> TransferProgress:
        enqueued = [p.ident for p in self._pending if not p.host_copy and not p.enqueued_reported]
        for p in self._pending:
            p.enqueued_reported = True
        done: list[_Pending] = []
        deadline = time.monotonic() + self._timeout
        while self._pending:
            p = self._pending[0]
            if not self._done(p):
                if not wait:
                    break
                if p.event is not None and self._pool.is_writer:
                    p.event.synchronize()
                else:
                    self._peer_wait_step(p, deadline)
                continue
            done.append(self._pending.pop(0))
        self._publish_done()
        return TransferProgress(
            enqueued=tuple(enqueued),
            completed=tuple(p.ident for p in done if not p.host_copy),
            completed_host_copies=tuple(p.ident for p in done if p.host_copy),
        )

    def _peer_wait_step(self, p: _Pending, deadline: float) -> None:
        """A peer's drain waits by polling, never in a blocking synchronize: what it waits for (rank
        0's epoch, or a restore ordered behind rank 0's IPC event) never comes once rank 0 is dead,
        and then it fails at once with one line instead of hanging or waiting out the timeout."""
        channel = self._pool.channel
        if channel is not None and channel.writer_dead():
            what = (f"a restore of transfer {p.ident} waited on its host-pool writes" if p.epoch == 0 else
                    f"transfer {p.ident} waited for its host-write epoch {p.epoch} to finish")
            raise channel.writer_died(what)
        if time.monotonic() > deadline:
            what = f"host-write epoch {p.epoch}" if p.epoch else f"the host-pool writes that restore {p.ident} reads"
            raise ProtocolError(f"waited {self._timeout}s for rank 0 to finish {what}")
        time.sleep(0.0005)

    def _publish_done(self) -> None:
        """Writer: tell peers which epochs have landed (every epoch before the oldest pending one)."""
        done = 0
        while self._epoch_events and self._epoch_events[0][1].query():  # one stream: in order
            done = self._epoch_events.pop(0)[0]
        channel = self._pool.channel
        if done and channel is not None and self._pool.is_writer:
            channel.mark_done(done)

    def poll(self) -> TransferProgress:
        return self._report(wait=False)

    def drain(self) -> TransferProgress:
        if self._pool.is_writer:
            self._stream.synchronize()
        return self._report(wait=True)

