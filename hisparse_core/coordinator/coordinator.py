"""`HiSparseCoordinator`: the scheduler-side owner of host blocks, prefix identity and residency.

Pure Python and engine-agnostic: it talks to the engine through `engine.GpuBlockAllocator` and
`engine.ScheduledRequest` and to the workers through the wire types of `hisparse_core.types`.

Per step the engine calls, in this order:

1. `finish_request` / `preempt_request` for requests that left (or pass them to `schedule_step`);
   `add_request` for newly admitted ones (after `lookup_prefix` if it wants the hit first).
2. Its own GPU allocations for the step (resident blocks for the pages written this step).
3. `schedule_step(scheduled)`: returns the step's `OffloadCommand` (or None when there is nothing
   to do or HiSparse is disabled), then `take_table_updates()` for the source/hot table deltas.
   It must run after the step's GPU allocations, so that a released page whose block was handed
   out again is reported non-resident (-1) in the same step's command.
4. After the step, `update_from_workers(meta, num_workers)` with the workers' acknowledgements.

Meaning of the command's parts (the worker contract):

- `row_mirrors`: rows that the host copy does not have yet (rows written this step: prefill
  chunks and decode tokens; and rows that were loaded into resident pages by someone else, such
  as a device-side P/D import). The host copy is the source of truth.
- `page_transfers` with `restore=False` (spills) carry **no data the mirrors have not carried**:
  every row of the page was covered by a mirror of this or an earlier command. The transfer is the
  transaction that gates the release of the GPU source lease (at enqueue) and the publication of
  the host page (at completion). A worker may implement it as a fence after the mirrors (record
  an event) or re-copy the page; the page's GPU contents no longer change, so a re-copy is
  idempotent. Spills are `after_forward=True`.
- `page_transfers` with `restore=True` copy a host block into the resident blocks of a page the
  request is about to write, whose first rows exist only on host (a partial page reached by a
  prefix hit or a host import). They run before the forward (`after_forward=False`).
- `residency_updates`: the resident block of pages that became resident (new pages) or stopped
  being resident (-1: a released page whose block was reused, or host-backed pages of a prefix
  hit or host import).
- `host_block_copies`: copy-on-write of a published block whose tail the request re-writes
  (a prefix hit capped inside a page). They run before this command's mirrors and restores.
- `recycled_host_blocks`: host blocks handed out again this step after holding other contents;
  the worker forgets hot copies of their rows.

Page states and transitions live in `pages.py`, transactions and acknowledgement counting in
`spill.py`, the host pool and prefix map in `host_blocks.py`, P/D import choice in `imports.py`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from hisparse_core.coordinator.config import CoordinatorConfig
from hisparse_core.coordinator.engine import GpuBlockAllocator, ScheduledRequest
from hisparse_core.coordinator.outputs import CoordinatorStats, ImportTarget, PrefixHit, TableUpdate
from hisparse_core.types import OffloadCommand, WorkerMetadata


class HiSparseCoordinator:
    """Scheduler-side owner of logical host blocks, source-prefix identity and residency transitions."""

    def __init__(self, config: CoordinatorConfig, gpu: GpuBlockAllocator) -> None:
        """Size the host pool from `config` and bind the engine's GPU allocator.

        Logs the realized capacity. Raises `CapacityError` if the pool cannot hold one
        `max_model_len` request plus the active tail.
        """
        raise NotImplementedError

    # -- admission -------------------------------------------------------------------------

    def lookup_prefix(self, token_ids: Sequence[int], *, extra_key: bytes | None = None,
                      max_tokens: int | None = None) -> PrefixHit:
        """Longest published prefix of `token_ids` (whole pages, at most `max_tokens`). Read-only."""
        raise NotImplementedError

    def add_request(self, request_id: str, token_ids: Sequence[int], *, extra_key: bytes | None = None,
                    max_prefix_tokens: int | None = None) -> int:
        """Admit a request and take its prefix hit; returns the hit in tokens (its first computed
        tokens). `max_prefix_tokens` caps the hit (engines that must compute at least one token
        pass `len(prompt) - 1`); a cap inside a page copies that page on host (copy-on-write).
        A hit leases the request's hot buffer; if the GPU pool cannot provide it, raises
        `CapacityError` and nothing changes. Pages below `first_resident_page(request_id)` are
        host-backed: the engine allocates resident blocks from that page on."""
        raise NotImplementedError

    def first_resident_page(self, request_id: str) -> int:
        """First page the engine must allocate resident blocks for (pages below are host-backed)."""
        raise NotImplementedError

    def host_blocks_needed(self, request_id: str, num_new_tokens: int) -> int:
        """Host blocks a step writing `num_new_tokens` more tokens of this request would allocate."""
        raise NotImplementedError

    @property
    def num_free_host_blocks(self) -> int:
        """Host blocks available for allocation: free ones plus evictable cached ones."""
        raise NotImplementedError

    # -- per step --------------------------------------------------------------------------

    def schedule_step(self, scheduled: Sequence[ScheduledRequest], *, finished: Iterable[str] = (),
                      preempted: Iterable[str] = ()) -> OffloadCommand | None:
        """Plan this step: leave `finished`/`preempted`, allocate host blocks for pages written this
        step, mirror the written rows, seal and spill full pages, apply the residency policy.

        Returns None when there is nothing for the workers (always when disabled). Validates every
        request before changing anything: an unknown request, bad block ids or a host pool too
        small for the step raise and leave the state as it was.
        """
        raise NotImplementedError

    def take_table_updates(self) -> tuple[TableUpdate, ...]:
        """Source (host) and hot table changes per state row since the last call."""
        raise NotImplementedError

    def update_from_workers(self, meta: WorkerMetadata, num_workers: int) -> None:
        """Apply acknowledgements (one worker's report or an aggregate of several).

        A transfer is enqueued (its GPU source lease is released) once `num_workers` enqueue
        acknowledgements arrived, and completed (its host page published, its host lease
        released) once `num_workers` completions arrived. Raises `ProtocolError` for an unknown
        transfer or host copy, or more acknowledgements than workers, and then applies nothing.
        """
        raise NotImplementedError

    # -- leaving ---------------------------------------------------------------------------

    def finish_request(self, request_id: str) -> None:
        """The request is done: return its GPU and hot leases now. Pages whose spill is still in
        flight keep their host leases and are published when their last acknowledgement arrives
        (detached publication); nothing is held after that."""
        raise NotImplementedError

    def preempt_request(self, request_id: str) -> None:
        """The request is preempted: return every lease now except transfer pins, which go when
        their acknowledgements arrive; unpublished pages are dropped. Re-admit it with
        `add_request` (its published prefix is then a prefix hit)."""
        raise NotImplementedError

    # -- P/D import ------------------------------------------------------------------------

    def choose_import_target(self, request_id: str, num_tokens: int, *,
                             other_device_blocks: int = 0) -> ImportTarget:
        """Where a P/D import of `num_tokens` tokens lands, from the admission arithmetic.

        DEVICE if the whole prefix fits the GPU pool (plus `other_device_blocks` the engine needs
        for other groups, such as the indexer) and its host blocks fit; else HOST if the host
        blocks plus the hot buffer and active tail fit; else WAIT. The first DEVICE or HOST
        answer is kept for the request; later calls answer that target or WAIT.
        """
        raise NotImplementedError

    def begin_host_import(self, request_id: str, token_ids: Sequence[int], num_tokens: int, *,
                          extra_key: bytes | None = None) -> tuple[int, ...]:
        """Lease the host blocks (returned, in page order) and the hot buffer of a HOST import."""
        raise NotImplementedError

    def complete_host_import(self, request_id: str) -> None:
        """The imported pages are on host: admit the request with them as its prefix and publish
        its full pages. The partial last page is restored to its resident block when first
        written."""
        raise NotImplementedError

    def fail_host_import(self, request_id: str) -> None:
        """The import failed: release every lease it took and forget the request."""
        raise NotImplementedError

    # -- introspection ---------------------------------------------------------------------

    def stats(self) -> CoordinatorStats:
        raise NotImplementedError

    def has_pending_work(self) -> bool:
        """True while transfers or host copies await acknowledgements or queued work awaits a step."""
        raise NotImplementedError
