"""Per-request page bookkeeping: each page's host block, resident blocks and state.

Page states (`PageState`):

- DIRTY: resident; its rows may still change, or it is sealed but its spill is not planned yet.
- PENDING: sealed; its spill transaction is in flight (GPU source and host destination pinned).
- PINNED: clean (the host block is durable) and still resident under the request's lease.
- RELEASED: clean; the resident lease went back to the engine but the block stays readable
  until the engine hands it out again.
- LOST: clean and not resident: its released block was reused, or it came from host (a prefix
  hit or a host import). The request reads it through its hot buffer.

Only DIRTY -> PENDING -> PINNED -> RELEASED -> LOST moves forward while the request runs; pages
enter as DIRTY (written here) or LOST (taken from host).

Releasable pages (PINNED and outside the active tail) sit in a max-heap so the policy releases
them tail-first in O(log n) each; PINNED pages still inside the tail wait in a short list and
move to the heap as the request grows.
"""

from __future__ import annotations

import enum
import heapq

from hisparse_core.errors import InvalidInputError


class PageState(enum.IntEnum):
    DIRTY = 0
    PENDING = 1
    PINNED = 2
    RELEASED = 3
    LOST = 4


DIRTY, PENDING, PINNED, RELEASED, LOST = (int(s) for s in PageState)
#: States whose host block is durable.
CLEAN_STATES = frozenset((PINNED, RELEASED, LOST))
#: States where the page holds the request's resident lease.
LEASED_STATES = frozenset((DIRTY, PENDING, PINNED))


def unknown_request(request_id: str) -> InvalidInputError:
    """The error for a request id that is not (or no longer) admitted."""
    return InvalidInputError(f"unknown request {request_id!r}: not admitted (add_request or "
                             f"complete_host_import) or already finished/preempted")


class Lifecycle(enum.IntEnum):
    RUNNING = 0
    DETACHED = 1  # finished with spills in flight: publishes when they land
    GONE = 2      # finished or preempted, nothing left to do


class RequestPages:
    """Everything the coordinator knows about one admitted request."""

    __slots__ = (
        "request_id", "root", "active_tail", "lifecycle", "state_index",
        "host", "gpu", "state", "hashes",
        "num_mirrored", "num_sealed", "num_ready", "first_resident_page",
        "restore_page", "restore_source", "cow_pages", "hot", "hot_changed", "resend",
        "pending_spills", "_releasable", "_tail_clean",
        "decode_end", "decode_src", "decode_dst",
    )

    def __init__(self, request_id: str, root: bytes, active_tail: int) -> None:
        self.request_id = request_id
        self.root = root
        self.active_tail = active_tail
        self.lifecycle = Lifecycle.RUNNING
        self.state_index = -1
        self.host: list[int] = []                      # host block per page (-1: lease returned)
        self.gpu: list[tuple[int, ...] | None] = []    # resident block per group, None if not leased
        self.state = bytearray()
        self.hashes: list[bytes] = []                  # hash of each sealed page
        self.num_mirrored = 0        # rows [0, num_mirrored) are on host or on their way
        self.num_sealed = 0          # pages [0, num_sealed) are spilled, pending or clean
        self.num_ready = 0           # pages [0, num_ready) are clean and were offered for publication
        self.first_resident_page = 0
        self.restore_page = -1       # partial page whose first rows exist only on host
        self.restore_source = -1
        self.cow_pages: set[int] = set()   # pages whose host block awaits a copy-on-write
        self.hot: tuple[int, ...] | None = None
        self.hot_changed = False
        self.resend = True           # the worker's rows for this request must be sent whole
        self.pending_spills = 0
        self._releasable: list[int] = []   # max-heap of negated pages
        self._tail_clean: list[int] = []
        # The decode cursor (`refresh_decode_cursor`): rows [num_mirrored, decode_end) lie in the
        # page being written; its source rows are decode_src + row per group, its host rows
        # decode_dst + row. decode_end = -1: no such page (the next step is planned in full).
        self.decode_end = -1
        self.decode_src: tuple[int, ...] = ()
        self.decode_dst = 0

    @property
    def num_pages(self) -> int:
        return len(self.host)

    @property
    def alive(self) -> bool:
        return self.lifecycle is Lifecycle.RUNNING

    def parent_hash(self, page: int) -> bytes:
        return self.hashes[page - 1] if page else self.root

    def refresh_decode_cursor(self, block_size: int) -> None:
        """Recompute the decode cursor after a step changed the request's pages (the planner runs
        it after every full plan, the only place that seals pages, adds pages, moves the state row
        or restores a page of a running request; a decode step changes none of them).

        The cursor covers the first unsealed page when it is resident and known: a step whose
        rows all lie in it, starting at `num_mirrored`, only mirrors them (the decode fast path
        of `StepPlanner.validate`)."""
        p = self.num_sealed
        blocks = self.gpu[p] if p < len(self.host) else None
        if blocks is None or self.restore_page >= 0 or self.state_index < 0 or self.num_mirrored < p * block_size:
            self.decode_end = -1
            return
        base = p * block_size
        self.decode_end = base + block_size
        self.decode_src = tuple(b * block_size - base for b in blocks)
        self.decode_dst = self.host[p] * block_size - base

    def take_host_blocks(self) -> list[int]:
        """The host blocks the request still leases; from now on it leases none (the caller releases them)."""
        blocks = [b for b in self.host if b >= 0]
        self.host = [-1] * len(self.host)
        return blocks

    # -- releasable set --------------------------------------------------------------

    def file_clean(self, page: int) -> bool:
        """Record a page that just became PINNED; True if it is releasable now."""
        if page < len(self.host) - self.active_tail:
            heapq.heappush(self._releasable, -page)
            return True
        self._tail_clean.append(page)
        return False

    def promote_out_of_tail(self) -> bool:
        """Move PINNED pages that left the active tail into the releasable heap; True if any moved."""
        if not self._tail_clean:
            return False
        limit = len(self.host) - self.active_tail
        moved = False
        keep: list[int] = []
        for p in self._tail_clean:
            if p < limit:
                heapq.heappush(self._releasable, -p)
                moved = True
            else:
                keep.append(p)
        self._tail_clean = keep
        return moved

    def pop_releasable(self) -> int | None:
        """The highest releasable page (tail-first), or None."""
        heap = self._releasable
        while heap:
            p = -heapq.heappop(heap)
            if self.state[p] == PINNED:
                return p
        return None

    def unpop_releasable(self, pages: list[int]) -> None:
        """Put back pages `pop_releasable` returned and that stay resident after all."""
        for p in pages:
            heapq.heappush(self._releasable, -p)

    def has_releasable(self) -> bool:
        return bool(self._releasable)

    def forget_releasable(self) -> None:
        self._releasable.clear()
        self._tail_clean.clear()
