"""The transfer engine: runs a step's copies on the backend's copy stream and tracks completion."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from hisparse_core.runtime import CacheRuntime
from hisparse_core.types import HostBlockCopy, PageTransfer, RowMirror


@dataclass(frozen=True, slots=True)
class TransferProgress:
    """Ids that became enqueued or completed since the last poll; each id is reported once."""

    enqueued: tuple[int, ...] = ()
    completed: tuple[int, ...] = ()
    completed_host_copies: tuple[int, ...] = ()


class TransferEngine(ABC):
    """Executes offload work for every runtime of one worker, in submission order.

    Created by `Backend.create_transfer_engine(host_pool, runtimes)` and driven by
    `HiSparseWorker`, which forwards the coordinator's `OffloadCommand` in step phases. Work
    is ordered: a later submission never completes before an earlier one (so a spill submitted
    after a mirror sees the mirrored rows). A transfer id is *enqueued* once its copy is ordered
    on the backend's stream (the GPU source block may be reused by later work) and *completed*
    once the copy has landed in host memory (its host page may be published). Synchronous
    backends may report both at once. Nothing here synchronizes the compute stream with the host.

    In a shared host pool only the writer rank copies to host; other ranks still acknowledge the
    transfer (enqueued and completed) once the writer's event says the rows are there.
    """

    @property
    @abstractmethod
    def runtimes(self) -> Sequence[CacheRuntime]: ...

    @abstractmethod
    def submit_row_mirrors(self, mirrors: Sequence[RowMirror]) -> None:
        """Enqueue device-to-host copies of rows written this step, for every runtime.

        Checks the whole submission first, on every runtime (a source row out of range for one
        runtime's resident group, a host row past the pool) and raises `InvalidInputError` before
        enqueuing any of it. Mirrors carry no id: nothing is acknowledged for them."""

    @abstractmethod
    def submit_pages(self, transfers: Sequence[PageTransfer]) -> None:
        """Enqueue page spills (device to host) and restores (host to device) for every runtime.

        Checks the whole submission first (every runtime's `check_pages`, ids not already
        pending) and raises before enqueuing any of it: a refused submission is taken in none of
        its parts. A transfer one runtime refuses (a block out of range for its resident group, say)
        raises `InvalidInputError`; a transfer id repeated within the call or still unacknowledged
        from an earlier one raises `ProtocolError`. The worker records the ids before this call and
        forgets them when it raises, so an id this engine later reports was always recorded (an interrupt in between leaves
        ids pending, never ids unknown)."""

    @abstractmethod
    def submit_host_copies(self, copies: Sequence[HostBlockCopy]) -> None:
        """Enqueue host-to-host block copies for every runtime.

        As `submit_pages`: the whole submission is checked first, and a refused one raises having
        enqueued none of it (`InvalidInputError` for a block past the pool, `ProtocolError` for a
        destination block repeated or still unacknowledged). Each copy is acknowledged once, by its
        destination block, in `TransferProgress.completed_host_copies`."""

    @abstractmethod
    def poll(self) -> TransferProgress:
        """Report ids that became enqueued / completed since the last call (non-blocking).

        Called by `HiSparseWorker` once a step. Each transfer id is reported enqueued once and
        completed once, never completed before (it may be at the same poll as) its enqueue, and
        completed in submission order. A poll with nothing new (before any work, after `drain`)
        reports nothing."""

    def wait_for_host_writes(self) -> None:
        """Order this process's later reads of the host pool after every host write submitted so far.

        Who calls it: `HiSparseWorker.wait_for_host_writes`, which the transformers engine calls on
        each peer rank of a shared pool (rank > 0) at the start of every step, before the step's
        resolves gather from host rows (a writer reads only pages whose copies completed, so it is
        not called there). On a peer the writes are rank 0's (its mirrors, spills and host copies
        of the same commands): reads on this rank's device must wait until they have landed (the
        nvidia backend waits on the GPU for rank 0's IPC event; the host does not block). Called on
        a writer, order behind this engine's own copies. An engine whose copies complete before
        `submit_*` returns needs no wait, which is this default (reference_cpu keeps it); one that
        copies asynchronously and declares `shared_host_pool` must override it, or a peer may gather
        rows rank 0 has not written yet (the conformance suite, in one process, cannot see that race).
        """
        return None  # nothing to wait for: this engine's copies landed before `submit_*` returned

    @abstractmethod
    def drain(self) -> TransferProgress:
        """Wait for all submitted work, then report like `poll` (shutdown and tests): everything
        not yet reported, so a second `drain` reports nothing."""
