"""In-flight page transfers and host copies, and acknowledgement counting across workers.

A transfer is acknowledged twice by every worker (tensor-parallel rank): once when its copy
entered the worker's stream (enqueued) and once when the copy landed (completed). The ledger
sums the counts it is given (one worker's report or an aggregate) and reports a phase as done
only when all `num_workers` workers have reported it. A bad report (unknown id, more
acknowledgements than workers, completions outrunning enqueues, a different worker count) is
rejected whole, before any count changes.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from hisparse_core.coordinator.pages import RequestPages
from hisparse_core.errors import ProtocolError
from hisparse_core.types import HostBlockCopy, PageTransfer, WorkerMetadata


class TransferKind(enum.IntEnum):
    SPILL = 0    # resident page -> host block (publication gate)
    RESTORE = 1  # host block -> resident page


@dataclass(slots=True, eq=False)
class Transfer:
    """One page transfer and the leases it pins: `gpu_blocks` until enqueued everywhere,
    `host_block` until completed everywhere. A spill carries its page's `block_hash`; pages of
    other requests with the same hash sealed while it is in flight wait on it as `followers`
    (each holds its own lease on `host_block`) instead of being spilled again."""

    transfer_id: int
    kind: TransferKind
    owner: RequestPages
    page: int
    host_block: int
    gpu_blocks: tuple[int, ...]
    expected: int = 0
    enqueued: int = 0
    completed: int = 0
    enqueue_applied: bool = False
    block_hash: bytes | None = None
    followers: list[tuple[RequestPages, int]] | None = None

    def wire(self) -> PageTransfer:
        restore = self.kind is TransferKind.RESTORE
        return PageTransfer(self.transfer_id, self.host_block, self.gpu_blocks, after_forward=not restore,
                            restore=restore)


class TransferLedger:
    """Transfers issued and not yet completed on every worker, by id (ids are never reused)."""

    def __init__(self) -> None:
        self._pending: dict[int, Transfer] = {}
        self._spilling: dict[bytes, Transfer] = {}
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, transfer_id: int) -> bool:
        return transfer_id in self._pending

    def pending(self) -> Iterable[Transfer]:
        return self._pending.values()

    def open(self, kind: TransferKind, owner: RequestPages, page: int, host_block: int,
             gpu_blocks: tuple[int, ...], block_hash: bytes | None = None) -> Transfer:
        t = Transfer(self._next_id, kind, owner, page, host_block, gpu_blocks, block_hash=block_hash)
        self._next_id += 1
        self._pending[t.transfer_id] = t
        if block_hash is not None and kind is TransferKind.SPILL:
            self._spilling.setdefault(block_hash, t)
        return t

    def spilling(self, block_hash: bytes) -> Transfer | None:
        """The spill in flight of a page with this hash, if any."""
        return self._spilling.get(block_hash)

    def _unknown(self, phase: str, transfer_id: int) -> ProtocolError:
        why = "already completed on every worker" if 0 <= transfer_id < self._next_id else "never issued"
        return ProtocolError(f"{phase} acknowledgement for transfer {transfer_id}, which is {why}; "
                             f"expected one of the {len(self._pending)} transfers in flight")

    def acknowledge(self, meta: WorkerMetadata, num_workers: int) -> tuple[list[Transfer], list[Transfer]]:
        """Count `meta`'s acknowledgements. Returns the transfers whose enqueue and whose completion
        became complete on every worker with this report (each in id order)."""
        pending = self._pending
        for phase, counts in (("enqueue", meta.enqueued), ("completion", meta.completed)):
            for tid, n in counts.items():
                t = pending.get(tid)
                if t is None:
                    raise self._unknown(phase, tid)
                if t.expected and t.expected != num_workers:
                    raise ProtocolError(f"transfer {tid} was acknowledged for {t.expected} workers, now for "
                                        f"{num_workers}; the worker count must not change")
                have = t.enqueued if phase == "enqueue" else t.completed
                if have + n > num_workers:
                    raise ProtocolError(f"transfer {tid}: {have} + {n} {phase} acknowledgements exceed the "
                                        f"{num_workers} workers (a duplicate or excess report)")
        for tid, n in meta.completed.items():
            t = pending[tid]
            if t.completed + n > t.enqueued + meta.enqueued.get(tid, 0):
                raise ProtocolError(f"transfer {tid}: {t.completed + n} completions but only "
                                    f"{t.enqueued + meta.enqueued.get(tid, 0)} enqueues; a worker must "
                                    f"report enqueued no later than completed")
        enqueue_done: list[Transfer] = []
        complete_done: list[Transfer] = []
        for tid in sorted(meta.enqueued):
            t = pending[tid]
            t.expected = num_workers
            t.enqueued += meta.enqueued[tid]
            if t.enqueued == num_workers and not t.enqueue_applied:
                t.enqueue_applied = True
                enqueue_done.append(t)
        for tid in sorted(meta.completed):
            t = pending[tid]
            t.expected = num_workers
            t.completed += meta.completed[tid]
            if t.completed == num_workers:
                del pending[tid]
                if t.block_hash is not None and self._spilling.get(t.block_hash) is t:
                    del self._spilling[t.block_hash]
                complete_done.append(t)
        return enqueue_done, complete_done


@dataclass(slots=True, eq=False)
class HostCopy:
    """A copy-on-write host copy; pins both blocks until a worker reports the destination done."""

    src: int
    dst: int
    owner: RequestPages
    page: int


class HostCopyLedger:
    """Host copies queued for the next command and those awaiting acknowledgement, keyed by destination."""

    def __init__(self) -> None:
        self._queued: list[HostCopy] = []
        self._pending: dict[int, HostCopy] = {}

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    def open(self, src: int, dst: int, owner: RequestPages, page: int) -> None:
        copy = HostCopy(src, dst, owner, page)
        self._queued.append(copy)
        self._pending[dst] = copy

    def take_queued(self) -> tuple[HostBlockCopy, ...]:
        out = tuple(HostBlockCopy(c.src, c.dst) for c in self._queued)
        self._queued.clear()
        return out

    def check(self, dst_ids: Iterable[int]) -> tuple[int, ...]:
        """Validate an acknowledgement without applying it; returns the distinct destinations."""
        ids = tuple(dict.fromkeys(dst_ids))
        queued = {c.dst for c in self._queued}
        for d in ids:
            if d not in self._pending or d in queued:
                state = "not yet sent" if d in queued else "not in flight"
                raise ProtocolError(f"host-copy acknowledgement for destination block {d}, which is {state}; "
                                    f"expected one of {sorted(set(self._pending) - queued)}")
        return ids

    def acknowledge(self, dst_ids: Iterable[int]) -> list[HostCopy]:
        """Copies done everywhere (workers run the same copies, so one report completes a copy)."""
        return [self._pending.pop(d) for d in self.check(dst_ids)]

    def pending_for(self, owner: RequestPages) -> bool:
        return any(c.owner is owner for c in self._pending.values())
