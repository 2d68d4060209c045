"""Stream-ordered reads of a shared host pool on the triton backend: peers wait on rank 0's device
event, not on the host for rank 0's copies to finish.

Rank 0 (the writer) owns one interprocess device event (`torch.cuda.Event(interprocess=True)`,
CUDA's or HIP's IPC event); its handle sits in the pool's header page with a flag saying it is
there. After it records the event behind an epoch's host writes on its copy stream, rank 0 stores
the epoch in `WRITE_EPOCH` (host memory, no synchronization). A peer that needs the rows of epoch
`e` waits on the host only until `WRITE_EPOCH >= e` (rank 0 has *enqueued* the writes, which it does
when it submits them), opens the event once, and makes its stream wait on it: its later reads run
on the GPU after rank 0's copies landed. A peer that waits on a later record than the one it
needed waits longer, never shorter, so one event is enough however far rank 0 runs ahead.

Where the platform has no interprocess events (Triton's interpreter on the CPU, a torch build
without them), rank 0 publishes no handle and peers wait on the host for `DONE_EPOCH` (the epochs
rank 0 has seen complete, `TritonHostPool.mark_done`), as before.

Header words (byte offsets in the pool's header page; `host_pool.DONE_EPOCH_OFFSET` is 512):
`WRITE_EPOCH_OFFSET` the last epoch whose event record rank 0 enqueued, `HANDLE_FLAG_OFFSET` 1 once
the handle is published, `HANDLE_OFFSET` the handle's bytes (`HANDLE_BYTES` at most).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from hisparse_core import shm

logger = logging.getLogger(__name__)

WRITE_EPOCH_OFFSET = 520
HANDLE_FLAG_OFFSET = 528
HANDLE_LEN_OFFSET = 536
HANDLE_OFFSET = 544
HANDLE_BYTES = 256
CHANNEL_END = HANDLE_OFFSET + HANDLE_BYTES
assert CHANNEL_END <= shm.RANKS_OFFSET


def create_event(device: torch.device) -> tuple[Any, bytes]:
    """An interprocess event on `device`, and its handle; raises where unsupported."""
    with torch.cuda.device(device):
        event = torch.cuda.Event(interprocess=True)
        event.record()  # the handle exists once the event does on the device
        return event, bytes(event.ipc_handle())


def open_event(device: torch.device, handle: bytes) -> Any:  # noqa: ANN401 - torch.cuda.Event
    """Rank 0's event from its handle, in this rank's device context."""
    with torch.cuda.device(device):
        return torch.cuda.Event.from_ipc_handle(device, handle)


class EventChannel:
    """Rank 0's interprocess event of one shared pool, seen from one rank.

    `header` is the pool's header page as bytes (a uint8 tensor over the shared mapping), `device`
    this rank's GPU. The writer creates the event and publishes its handle at construction (before
    any epoch is published); if the platform refuses, `available` is False and the engine keeps the
    host-side wait. A peer opens the event at its first wait.
    """

    def __init__(self, header: torch.Tensor, device: torch.device, *, writer: bool) -> None:
        self._words = header[:CHANNEL_END].view(torch.int64)
        self._bytes = header
        self._device = device
        self._writer = writer
        self._event: Any = None
        self.available = True
        if writer:
            try:
                self._event, handle = create_event(device)
            except (RuntimeError, AttributeError, TypeError) as exc:
                self.available = False
                logger.info("shared host pool: no interprocess device events here (%s); peers wait on the host "
                            "for rank 0's writes to complete", exc)
                return
            if len(handle) > HANDLE_BYTES:
                self.available = False
                logger.info("shared host pool: the event handle (%d bytes) does not fit the header; peers wait on "
                            "the host", len(handle))
                return
            self._bytes[HANDLE_OFFSET:HANDLE_OFFSET + len(handle)] = torch.frombuffer(bytearray(handle),
                                                                                      dtype=torch.uint8)
            self._words[HANDLE_LEN_OFFSET // 8] = len(handle)
            self._words[HANDLE_FLAG_OFFSET // 8] = 1
            logger.info("shared host pool: peers wait for rank 0's writes on the GPU, behind its interprocess event")

    @property
    def published(self) -> int:
        """The last epoch whose event record rank 0 enqueued."""
        return int(self._words[WRITE_EPOCH_OFFSET // 8])

    def record(self, stream: Any, epoch: int) -> None:  # noqa: ANN401 - torch.cuda.Stream
        """Writer: record the event behind `stream`'s work (an epoch's host writes) and publish `epoch`."""
        if self._writer and self.available:
            self._event.record(stream)
            self._words[WRITE_EPOCH_OFFSET // 8] = epoch

    def wait(self, epoch: int, stream: Any, done: Callable[[], int], step: Callable[[], None]) -> bool:  # noqa: ANN401
        """Peer: order `stream` after rank 0's writes of `epoch`. Returns True once the stream waits on
        the event; False when rank 0 has no event (`done()` reached `epoch` instead, which the caller's
        host-side wait then sees at once). `step` is one bounded wait (it raises on timeout or on a
        dead rank 0)."""
        while True:
            if int(self._words[HANDLE_FLAG_OFFSET // 8]) == 1 and self.published >= epoch:
                if self._event is None:
                    n = int(self._words[HANDLE_LEN_OFFSET // 8])
                    handle = bytes(self._bytes[HANDLE_OFFSET:HANDLE_OFFSET + n].tolist())
                    self._event = open_event(self._device, handle)
                stream.wait_event(self._event)
                return True
            if done() >= epoch:
                return False
            step()
