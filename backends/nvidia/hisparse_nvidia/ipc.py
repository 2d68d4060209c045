"""Cross-process ordering of a shared host pool: rank 0 writes, peers read after its event.

Rank 0 (the writer) owns one CUDA event created with `CU_EVENT_INTERPROCESS`; its 64-byte handle
sits in the shared pool's header page, and every peer opens it once (`cuIpcOpenEventHandle`).
Two 64-bit counters in the same header page order the host side:

- `write_epoch`: bumped by the writer right after it records the event behind a batch of host
  writes (`WriterChannel.publish`). A peer that needs the rows of epoch `e` waits, on the host,
  until `write_epoch >= e` (so the record it is about to wait on exists), then makes its stream
  wait on the event on the GPU (`cuStreamWaitEvent`): the peer's later reads run only after the
  writer's copies landed, without a host synchronization on either side.
- `done_epoch`: set by the writer once it observed its own copies complete; peers use it to
  acknowledge transfers they did not run themselves.

A peer that waits on a later record than the one it needed waits longer, never shorter, so the
single event is enough however far the writer runs ahead.

Tensor parallelism puts each rank on its own GPU, so the event is created in rank 0's context on
its device and opened by each peer in the peer's own context (a CUDA stream may wait on an event of
another device). Every driver call of a channel therefore first makes the channel's device's
primary context current (`driver.ensure_context`): the open must land in the peer's context, not
in whichever context a PyTorch call last left current on the thread.
"""

from __future__ import annotations

import ctypes
import time
from typing import TYPE_CHECKING, Any

from hisparse_core.errors import ProtocolError
from hisparse_core.shm import Creator
from hisparse_nvidia import driver

if TYPE_CHECKING:
    import torch

#: Offsets of the channel inside the pool's header page.
HANDLE_OFFSET = 512
WRITE_EPOCH_OFFSET = HANDLE_OFFSET + driver.IPC_HANDLE_BYTES
DONE_EPOCH_OFFSET = WRITE_EPOCH_OFFSET + 8
CHANNEL_END = DONE_EPOCH_OFFSET + 8


class WriterChannel:
    """The IPC event and epoch counters of one shared pool, seen from one rank.

    `header_address` is the address of the mapped header page (shared by all ranks). The
    writer passes `create=True` and publishes the handle there before the pool file is visible.
    A peer passes the pool's `creator`, so that its waits fail at once when rank 0 has died
    instead of waiting out the timeout. `device` is the GPU of this rank's pool: the event is
    created (writer) or opened (peer) in that device's primary context, and every later driver
    call makes it current first; None uses whatever context is current (the caller's business).
    """

    def __init__(self, header_address: int, *, writer: bool, create: bool, creator: Creator | None = None,
                 device: torch.device | None = None) -> None:
        self._base = header_address
        self._writer = writer
        self._creator = creator
        self._device = device
        self._write = ctypes.c_uint64.from_address(header_address + WRITE_EPOCH_OFFSET)
        self._done = ctypes.c_uint64.from_address(header_address + DONE_EPOCH_OFFSET)
        self._context()
        if create:
            self._event: Any = driver.event_create(interprocess=True)
            handle = driver.ipc_event_handle(self._event)
            ctypes.memmove(header_address + HANDLE_OFFSET, handle, len(handle))
            self._write.value = 0
            self._done.value = 0
            self._owned = True
        else:
            handle = ctypes.string_at(header_address + HANDLE_OFFSET, driver.IPC_HANDLE_BYTES)
            try:
                self._event = driver.ipc_open_event(handle)
            except driver.CudaError as exc:
                where = f" on {self._device}" if self._device is not None else ""
                raise driver.CudaError(
                    f"this rank{where} could not open rank 0's IPC event of the shared host pool ({exc}); "
                    "expected every rank on one node with rank 0's GPU visible to it (CUDA_VISIBLE_DEVICES)") from exc
            self._owned = False
        self._closed = False

    def _context(self) -> None:
        if self._device is not None:
            driver.ensure_context(self._device)

    @property
    def is_writer(self) -> bool:
        return self._writer

    @property
    def write_epoch(self) -> int:
        return int(self._write.value)

    @property
    def done_epoch(self) -> int:
        return int(self._done.value)

    def publish(self, stream: int) -> int:
        """Writer: record the event behind the host writes already on `stream`; returns the epoch."""
        if not self._writer:
            raise ProtocolError("only rank 0 writes the shared host pool; a peer cannot publish writes")
        self._context()
        driver.event_record(self._event, stream)
        self._write.value += 1  # after the record is enqueued, so a peer's wait sees it
        return int(self._write.value)

    def mark_done(self, epoch: int) -> None:
        """Writer: every write of epochs <= `epoch` has landed in host memory."""
        if epoch > self._done.value:
            self._done.value = epoch

    def wait(self, epoch: int, stream: int, *, timeout_s: float = 60.0) -> None:
        """Peer: order `stream` after the writer's writes of `epoch` (a GPU-side wait)."""
        if epoch <= 0:
            return
        now = time.monotonic()
        deadline, next_look = now + timeout_s, now + 0.1
        while self._write.value < epoch:
            now = time.monotonic()
            if now > next_look:  # waiting cannot help once the writer is gone
                next_look = now + 0.1
                if self._creator is not None and self._creator.state() == "dead":
                    raise ProtocolError(
                        f"rank 0 ({self._creator.describe()}) died before publishing host-pool writes of epoch "
                        f"{epoch} (it published {self._write.value}): restart the deployment (every rank)")
            if now > deadline:
                raise ProtocolError(
                    f"waited {timeout_s}s for rank 0 to publish host-pool writes of epoch {epoch} "
                    f"(it published {self._write.value})")
            time.sleep(0.0001)
        self._context()
        driver.stream_wait_event(stream, self._event)

    def writer_dead(self) -> bool:
        """Peer: True once rank 0's process is gone (False on the writer, or where it cannot be judged)."""
        return self._creator is not None and self._creator.state() == "dead"

    def writer_died(self, what: str) -> ProtocolError:
        """The one-line error a peer raises when rank 0 died while `what` (e.g. "its host-pool writes of
        epoch 3 were in flight") still needed it."""
        who = self._creator.describe() if self._creator is not None else "unknown pid"
        return ProtocolError(f"rank 0 ({who}) died while {what} (it published {self._write.value}, finished "
                             f"{self._done.value}): restart the deployment (every rank)")

    def writer_idle(self) -> bool:
        """True when the writer's latest published record has completed."""
        self._context()
        return driver.event_done(self._event)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._context()
            driver.event_destroy(self._event)
        except Exception:  # noqa: BLE001 - teardown after the context is gone must not raise
            pass
