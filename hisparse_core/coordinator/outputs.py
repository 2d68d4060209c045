"""What the coordinator hands back besides the per-step `OffloadCommand`."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ImportTarget(enum.Enum):
    """Where a P/D import lands. Chosen once per request; `WAIT` is an answer, not a choice."""

    DEVICE = "device"
    HOST = "host"
    WAIT = "wait"


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """A read-only prefix lookup: the first `num_tokens` tokens are published on host in `host_block_ids`
    (one block per full page, in page order). Taking the hit is `add_request`'s job."""

    num_tokens: int
    host_block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TableUpdate:
    """Changes to one state row's source (host) table and hot table since the last `take_table_updates`.

    `host_block_ids[i]` is the host block of page `pages[i]` (what the resolver's `source_table`
    holds). `hot_block_ids` is the row's hot-buffer lease when it changed (an empty tuple: no hot
    buffer), None when unchanged. Pages past the request's length keep stale entries; the resolver
    never reads them.
    """

    state_index: int
    pages: tuple[int, ...] = ()
    host_block_ids: tuple[int, ...] = ()
    hot_block_ids: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class CoordinatorStats:
    """A snapshot for logs and metrics.

    Host usage counts blocks leased by requests or transfers; cached blocks (published, unleased,
    evictable) count as free and the null block is excluded, as in upstream's gauge.
    """

    host_blocks_total: int
    host_blocks_used: int
    host_blocks_cached: int
    pending_transfers: int
    pending_host_copies: int
    running_requests: int
    detached_requests: int
    pending_imports: int
    prefix_hit_tokens: int
    prefix_queried_tokens: int
    published_blocks: int
    spills: int
    restores: int
    released_pages: int
    lost_pages: int
    evicted_blocks: int
    #: Sealed pages not spilled because another request's copy of the same page (same prefix
    #: hash) was published or in flight; `spills` counts the copies made.
    shared_spills: int = 0

    @property
    def host_usage(self) -> float:
        return self.host_blocks_used / self.host_blocks_total if self.host_blocks_total else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0
