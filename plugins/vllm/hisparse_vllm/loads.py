"""Prefix loads: copying a request's host-published prefix pages into its new GPU blocks.

The coordinator serves sparse attention, which reads host-backed pages through the hot buffer;
vLLM's standard attention cannot, so the connector loads a host prefix hit into the blocks vLLM
allocated for it (`get_num_new_matched_tokens` -> `update_state_after_alloc` -> this step's
command). A load is one `PageTransfer(restore=True, after_forward=False)` per page, with ids from
their own range (`LOAD_ID_BASE` upwards) so they never collide with the coordinator's. Loads are
synchronous in vLLM's terms: the workers run them before this step's forward, in stream order,
and the request computes its remaining tokens in that same forward. The host blocks stay leased
by the request in the coordinator (its prefix hit) while they are read; the GPU blocks are vLLM's.

The ledger counts each load's acknowledgements across workers and says when every worker
completed every load of a request (a request that finished meanwhile gets its blocks back then).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hisparse_core.errors import ProtocolError
from hisparse_core.types import PageTransfer, WorkerMetadata

#: First load transfer id. The coordinator numbers its transfers from 0 and never gets near this.
LOAD_ID_BASE = 1 << 48


def split_acks(meta: WorkerMetadata) -> tuple[WorkerMetadata, WorkerMetadata]:
    """(the coordinator's part, the loads' part) of an aggregated report."""
    def part(counts: dict[int, int] | object, loads: bool) -> dict[int, int]:
        return {k: v for k, v in counts.items() if (k >= LOAD_ID_BASE) == loads}  # type: ignore[union-attr]
    coord = WorkerMetadata(part(meta.enqueued, False), part(meta.completed, False), meta.completed_host_copies)
    loads = WorkerMetadata(part(meta.enqueued, True), part(meta.completed, True))
    return coord, loads


@dataclass(slots=True)
class _Load:
    request_id: str
    resumed: bool = False  # the load of a preempted request resuming (vLLM counts it apart)
    enqueued: int = 0
    completed: int = 0


@dataclass(slots=True)
class LoadLedger:
    """Loads planned, sent and acknowledged."""

    _next_id: int = LOAD_ID_BASE
    _queued: list[PageTransfer] = field(default_factory=list)
    _loads: dict[int, _Load] = field(default_factory=dict)
    _by_request: dict[str, set[int]] = field(default_factory=dict)
    loaded_pages: int = 0
    resumed_pages: int = 0  # the part of `loaded_pages` that preempted requests reloaded

    def plan(self, request_id: str, pages: Sequence[tuple[int, tuple[int, ...]]], *,
             resumed: bool = False) -> list[int]:
        """Queue one restore per `(host_block, resident_blocks_per_group)`; returns their ids.
        `resumed`: the request was preempted before (its load is counted apart, as vLLM does).
        A request preempted before its previous load's acknowledgements arrived may load again:
        its loads add up until all are acknowledged."""
        ids: list[int] = []
        for host_block, blocks in pages:
            tid = self._next_id
            self._next_id += 1
            self._queued.append(PageTransfer(tid, host_block, blocks, after_forward=False, restore=True))
            self._loads[tid] = _Load(request_id, resumed)
            ids.append(tid)
        if ids:
            self._by_request.setdefault(request_id, set()).update(ids)
        return ids

    def take_queued(self) -> tuple[PageTransfer, ...]:
        out = tuple(self._queued)
        self._queued.clear()
        return out

    def pending(self, request_id: str) -> bool:
        return request_id in self._by_request

    def __len__(self) -> int:
        return len(self._loads)

    def acknowledge(self, meta: WorkerMetadata, num_workers: int) -> list[str]:
        """Count the loads' acknowledgements; returns the requests whose loads all completed now."""
        for phase, counts in (("enqueue", meta.enqueued), ("completion", meta.completed)):
            for tid, n in counts.items():
                load = self._loads.get(tid)
                if load is None:
                    raise ProtocolError(f"{phase} acknowledgement for prefix load {tid}, which is not in flight")
                have = load.enqueued if phase == "enqueue" else load.completed
                if have + n > num_workers:
                    raise ProtocolError(f"prefix load {tid}: {have} + {n} {phase} acknowledgements exceed the "
                                        f"{num_workers} workers")
        for tid, n in meta.enqueued.items():
            self._loads[tid].enqueued += n
        done: list[str] = []
        for tid, n in sorted(meta.completed.items()):
            load = self._loads[tid]
            load.completed += n
            if load.completed == num_workers:
                del self._loads[tid]
                self.loaded_pages += 1
                self.resumed_pages += load.resumed
                ids = self._by_request[load.request_id]
                ids.discard(tid)
                if not ids:
                    del self._by_request[load.request_id]
                    done.append(load.request_id)
        return done
