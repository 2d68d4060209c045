"""Acknowledgements: what the workers' reports do to leases, page states and prefix publication.

The counting (every worker, twice per transfer; bad reports rejected whole) is `spill.py`'s. This
module applies what became complete:

- a transfer enqueued on every worker: its GPU pin goes back to the engine (stream order makes
  reuse of the source block safe);
- a transfer completed on every worker: its host pin goes. A spilled page (and every page of
  another request that waited on that spill, see `step.py`) of a running request
  becomes PINNED (clean; releasable once outside the active tail) and the durable contiguous
  prefix is published. A page of a detached request becomes LOST (it holds no resident lease
  any more) and the request is gone once its last spill has landed;
- a host copy done: both blocks' pins go, and the copied page may complete the publishable prefix.

Detached requests are the finished ones whose spills are still in flight: `detach` keeps only
the host blocks those spills and the publication of their prefix still need.
"""

from __future__ import annotations

from hisparse_core.coordinator.engine import GpuBlockAllocator
from hisparse_core.coordinator.host_blocks import HostBlockPool
from hisparse_core.coordinator.pages import CLEAN_STATES, LOST, PENDING, PINNED, Lifecycle, RequestPages
from hisparse_core.coordinator.policy import ResidencyPolicy
from hisparse_core.coordinator.spill import HostCopyLedger, Transfer, TransferKind, TransferLedger
from hisparse_core.types import WorkerMetadata


def advance_publication(host_pool: HostBlockPool, rec: RequestPages) -> None:
    """Publish the durable, contiguous prefix: clean pages with no host copy pending."""
    p = rec.num_ready
    sealed = rec.num_sealed
    state, host, hashes, cow = rec.state, rec.host, rec.hashes, rec.cow_pages
    publish = host_pool.publish
    while p < sealed and state[p] in CLEAN_STATES and p not in cow and host[p] >= 0:
        publish(host[p], hashes[p])
        p += 1
    rec.num_ready = p


class Acknowledgements:
    """Applies validated worker reports; owns nothing but the detached requests it finishes."""

    def __init__(self, gpu: GpuBlockAllocator, host: HostBlockPool, policy: ResidencyPolicy,
                 transfers: TransferLedger, copies: HostCopyLedger, detached: dict[RequestPages, None]) -> None:
        self._gpu = gpu
        self._host = host
        self._policy = policy
        self._transfers = transfers
        self._copies = copies
        self._detached = detached

    def apply(self, meta: WorkerMetadata, num_workers: int) -> None:
        """Count `meta` (one worker's report or an aggregate) and apply what became complete.
        Raises `ProtocolError`, applying nothing, for a report the ledgers reject."""
        self._copies.check(meta.completed_host_copies)
        enqueued, completed = self._transfers.acknowledge(meta, num_workers)
        for t in enqueued:
            self._gpu.release(t.gpu_blocks)
        for t in completed:
            self._complete_transfer(t)
        for c in self._copies.acknowledge(meta.completed_host_copies):
            self._host.release((c.src, c.dst))
            owner = c.owner
            owner.cow_pages.discard(c.page)
            if owner.lifecycle is not Lifecycle.GONE:
                self.advance_publication(owner)

    def detach(self, rec: RequestPages) -> None:
        """`rec` finished with spills in flight (its GPU leases are already returned): keep the host
        blocks of pages that its spills or its publication still need, release the rest."""
        rec.lifecycle = Lifecycle.DETACHED
        keep_from = rec.num_ready
        release: list[int] = []
        for p, b in enumerate(rec.host):
            st = rec.state[p]
            if p >= keep_from and p < rec.num_sealed and (st == PENDING or st in CLEAN_STATES):
                if st != PENDING:
                    rec.state[p] = LOST
                continue
            if b >= 0:
                release.append(b)
                rec.host[p] = -1
        self._host.release(release)
        self._detached[rec] = None

    def advance_publication(self, rec: RequestPages) -> None:
        advance_publication(self._host, rec)

    def _complete_transfer(self, t: Transfer) -> None:
        self._host.release((t.host_block,))
        if t.kind is TransferKind.RESTORE:
            return
        self._page_spilled(t.owner, t.page)
        for rec, p in t.followers or ():
            if rec.lifecycle is not Lifecycle.GONE:
                self._page_spilled(rec, p)

    def _page_spilled(self, rec: RequestPages, p: int) -> None:
        """Page `p` of `rec` is durable on host (its own spill, or the one it waited on)."""
        rec.pending_spills -= 1
        if rec.lifecycle is Lifecycle.RUNNING:
            rec.state[p] = PINNED
            if rec.file_clean(p):
                self._policy.note_releasable(rec)
            self.advance_publication(rec)
        elif rec.lifecycle is Lifecycle.DETACHED:
            rec.state[p] = LOST
            self.advance_publication(rec)
            if not rec.pending_spills:
                rec.lifecycle = Lifecycle.GONE
                del self._detached[rec]
                self._host.release(rec.take_host_blocks())
