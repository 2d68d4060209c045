"""The residency policy: when clean pages give their GPU blocks back, and what happens on reuse.

While free GPU blocks stay at or above the watermark every page stays resident. Below it the
policy releases clean, sealed pages outside the active tail, tail-first within a request and
requests in the order they became releasable, until free blocks reach twice the watermark (at
most `max_releases_per_step` pages a step). It runs at every `schedule_step`, after the step's
allocations, and when an engine whose next allocations do not fit asks (`make_room`, after
waiting for its acknowledgements).

Hybrid rule: a request of at most `hot_blocks_per_request + active_tail_pages` pages is never
released (it stays resident, leasing no buffer): released, it would hold its hot buffer and its
active tail, at least as many blocks as its pages. The planner (`hisparse_core.planner`) keeps
such requests resident too.

A request leases its hot buffer before its first release, so it can read released pages from
host. When the pool cannot provide the buffer (free blocks below one hot buffer: acknowledgements
lagging behind the allocations), the request releases its own pages first, at least as many as
the buffer takes (beyond `max_releases_per_step` by at most those), and the buffer is leased from
the blocks they freed: the pool is never drained past the point where it could release again.
A released page keeps its block readable until the engine hands the block out again; then the
page is lost and its resident entry becomes -1 in the next command.
"""

from __future__ import annotations

import logging

from hisparse_core.coordinator.config import CoordinatorConfig
from hisparse_core.coordinator.engine import GpuBlockAllocator
from hisparse_core.coordinator.pages import LOST, RELEASED, RequestPages
from hisparse_core.errors import CapacityError

logger = logging.getLogger(__name__)


class ResidencyPolicy:
    """Owns the releasable-request queue, the released-block map and the pages lost since the last command."""

    def __init__(self, config: CoordinatorConfig, gpu: GpuBlockAllocator) -> None:
        self._gpu = gpu
        self._groups = config.num_resident_groups
        self._hot_blocks = config.hot_blocks_per_request
        # The hybrid rule: requests of at most this many pages stay resident.
        self._resident_pages = config.hot_blocks_per_request + config.active_tail_pages
        # Pages a hot buffer takes back, in pages of `groups` blocks.
        self._hot_pages = -(-config.hot_blocks_per_request // config.num_resident_groups)
        self._max_releases = config.max_releases_per_step
        self.watermark = config.watermark_for(gpu.num_blocks)
        self._target = min(gpu.num_blocks, 2 * self.watermark)
        self._candidates: dict[RequestPages, None] = {}          # running requests with releasable pages
        self._readable: dict[int, tuple[RequestPages, int]] = {}  # released GPU block -> (request, page)
        self._lost: list[tuple[RequestPages, int]] = []
        self._hot_leased: list[RequestPages] = []
        self.released_pages = 0
        self.lost_pages = 0

    def note_releasable(self, rec: RequestPages) -> None:
        """`rec` has a releasable page now."""
        self._candidates[rec] = None

    def forget(self, rec: RequestPages) -> None:
        """`rec` leaves: its released blocks no longer belong to anyone it cares about."""
        self._candidates.pop(rec, None)
        readable = self._readable
        for p, blocks in enumerate(rec.gpu):
            if blocks is not None and rec.state[p] == RELEASED:
                for b in blocks:
                    readable.pop(b, None)

    def is_lost_pending(self, rec: RequestPages, page: int) -> bool:
        """True if the page was lost since the last command (its -1 is not sent yet)."""
        return (rec, page) in self._lost

    @property
    def has_pending(self) -> bool:
        return bool(self._lost)

    def apply(self) -> None:
        """Release pages if free GPU blocks are below the watermark (at every `schedule_step`)."""
        if self._gpu.num_free_blocks < self.watermark:
            self._relieve(self._target)

    def make_room(self, blocks: int) -> None:
        """Release pages now if fewer than `blocks` GPU blocks are free: for an engine whose next
        allocations do not fit (it waited for acknowledgements first, so its pages are clean)."""
        target = max(self._target, min(blocks, self._gpu.num_blocks))
        while self._gpu.num_free_blocks < blocks:
            before = self.released_pages
            self._relieve(target)             # a first release also leases a hot buffer: go on
            if self.released_pages == before:
                return

    def _relieve(self, target: int) -> None:
        gpu = self._gpu
        free = gpu.num_free_blocks
        if not self._candidates:
            return
        want = min(self._max_releases, -(-(target - free) // self._groups))
        exhausted: list[RequestPages] = []
        released = 0
        for rec in self._candidates:
            if want <= 0:
                break
            if rec.hot is None:
                if rec.num_pages <= self._resident_pages:
                    continue                  # the hybrid rule: it stays resident
                if gpu.num_free_blocks >= self._hot_blocks:
                    if self._lease_hot(rec):
                        n = self._release(rec, want)
                        released, want = released + n, want - n
                else:
                    # Too few free blocks for the buffer: its own pages pay for it.
                    n = self._release_for_hot(rec, want + self._hot_pages)
                    released, want = released + n, want - (n - self._hot_pages)
            else:
                n = self._release(rec, want)
                released, want = released + n, want - n
            if not rec.has_releasable():
                exhausted.append(rec)
        for rec in exhausted:
            self._candidates.pop(rec, None)
        if released:
            self.released_pages += released
            logger.debug("GPU pressure: %d free blocks < %d; released %d clean pages", free,
                         self.watermark if target == self._target else target, released)

    def _release(self, rec: RequestPages, limit: int) -> int:
        """Release up to `limit` of `rec`'s releasable pages, tail-first; the count released."""
        pages = self._pop_releasable(rec, limit)
        self._give_back(rec, pages)
        return len(pages)

    def _release_for_hot(self, rec: RequestPages, limit: int) -> int:
        """Release up to `limit` of `rec`'s pages, then lease its hot buffer from the blocks they
        freed; nothing (0) unless they free at least the buffer's blocks and the lease fits."""
        pages = self._pop_releasable(rec, limit)
        if len(pages) < self._hot_pages or \
                self._gpu.num_free_blocks + len(pages) * self._groups < self._hot_blocks:
            rec.unpop_releasable(pages)
            return 0
        self._give_back(rec, pages)
        leased = self._lease_hot(rec)
        assert leased, "the released pages freed at least the hot buffer's blocks"
        return len(pages)

    @staticmethod
    def _pop_releasable(rec: RequestPages, limit: int) -> list[int]:
        """Up to `limit` of `rec`'s releasable pages, tail-first, taken out of its releasable list."""
        pages: list[int] = []
        while len(pages) < limit:
            p = rec.pop_releasable()
            if p is None:
                break
            pages.append(p)
        return pages

    def _give_back(self, rec: RequestPages, pages: list[int]) -> None:
        if not pages:
            return
        state, gpu_blocks, readable = rec.state, rec.gpu, self._readable
        blocks: list[int] = []
        for p in pages:
            page_blocks = gpu_blocks[p]
            assert page_blocks is not None
            state[p] = RELEASED
            blocks.extend(page_blocks)
            for b in page_blocks:
                readable[b] = (rec, p)
        self._gpu.release_readable(blocks, self._on_reuse)

    def take_lost(self) -> list[tuple[RequestPages, int]]:
        out, self._lost = self._lost, []
        return out

    def take_hot_leased(self) -> list[RequestPages]:
        out, self._hot_leased = self._hot_leased, []
        return out

    def acquire_hot(self) -> tuple[int, ...]:
        """A hot buffer's GPU blocks, one lease each; none (and no allocator call) when the config
        asks for none. Raises `CapacityError`, leasing nothing, if the pool cannot provide them."""
        n = self._hot_blocks
        return tuple(self._gpu.acquire(n)) if n else ()

    def _lease_hot(self, rec: RequestPages) -> bool:
        try:
            rec.hot = self.acquire_hot()
        except CapacityError:
            return False
        rec.hot_changed = True
        self._hot_leased.append(rec)
        return True

    def _on_reuse(self, block_id: int) -> None:
        # Runs inside the engine's allocator: must not raise.
        entry = self._readable.pop(block_id, None)
        if entry is None:
            return
        rec, p = entry
        blocks = rec.gpu[p]
        if rec.state[p] != RELEASED or blocks is None:
            return
        rec.state[p] = LOST
        for b in blocks:
            self._readable.pop(b, None)
        rec.gpu[p] = None
        self._lost.append((rec, p))
        self.lost_pages += 1

    def check_idle(self) -> None:
        """Nothing tracked for departed requests (tests, debugging)."""
        for rec, _ in self._readable.values():
            if not rec.alive:
                raise AssertionError(f"released block of departed request {rec.request_id} still tracked")
        for rec in self._candidates:
            if not rec.alive:
                raise AssertionError(f"departed request {rec.request_id} is still a release candidate")
