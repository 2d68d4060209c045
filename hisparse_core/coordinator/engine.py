"""What the coordinator consumes from the engine that drives it (vLLM connector, replay engine).

Two small Protocols:

- `GpuBlockAllocator`: the engine's GPU block pool, lease-counted. The coordinator takes extra
  leases on resident blocks while a spill is in flight, leases hot-buffer blocks for requests
  that read from host, and gives back the resident leases the engine handed it.
- `ScheduledRequest`: one request scheduled this step, as the engine sees it.

Lease contract: the resident blocks a scheduled request reports for a page the coordinator has
not seen yet are handed over with one lease each. From then on the coordinator returns that lease
(`release` at finish/preemption, `release_readable` under pressure); the engine must not free a
HiSparse request's resident blocks itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

#: Called with a block id when a block released with `release_readable` is handed out again.
OnReuse = Callable[[int], None]


@runtime_checkable
class GpuBlockAllocator(Protocol):
    """The engine's GPU block pool (HMA): the coordinator leases from it, never owns it."""

    @property
    def num_blocks(self) -> int:
        """Total blocks of the pool (resident, hot and any other group sharing it)."""
        ...

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation could get now, released-but-readable ones included."""
        ...

    def acquire(self, count: int) -> list[int]:
        """Lease `count` blocks (one lease each). Raises `CapacityError` and leases nothing if
        fewer are free. Handing out a block released with `release_readable` fires its callback
        before this returns."""
        ...

    def retain(self, block_ids: Sequence[int]) -> None:
        """Add one lease to each of these already-leased blocks."""
        ...

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one lease from each block; at zero the block is free and its contents are garbage."""
        ...

    def release_readable(self, block_ids: Sequence[int], on_reuse: OnReuse) -> None:
        """Drop one lease from each block; at zero the block is free but keeps its contents until it
        is handed out again, at which point `on_reuse(block_id)` fires once. If a block still has
        other leases when it reaches zero later through `release`, no callback fires."""
        ...


@runtime_checkable
class ScheduledRequest(Protocol):
    """One request scheduled this step.

    - `request_id`: the engine's id; the request must have been added (`add_request` or a
      completed host import).
    - `state_index`: the worker's persistent state row for the request (residency, source and
      hot tables are keyed by it). It may change between steps; the coordinator then resends
      the request's whole rows.
    - `num_computed_tokens`: tokens whose KV is final before this step (rows of rejected
      speculative tokens are not counted).
    - `num_new_tokens`: tokens whose KV rows this step writes, starting at `num_computed_tokens`.
    - `token_ids`: every known token of the request (prompt and output); the coordinator reads
      only the tokens of pages it seals, to hash them.
    - `resident_block_ids[g][p]`: GPU block of page p in resident group g, for every page that
      holds a token in `[0, num_computed_tokens + num_new_tokens)`. Entries of pages the
      coordinator reported as host-backed (below `first_resident_page`) are ignored.
    """

    @property
    def request_id(self) -> str: ...

    @property
    def state_index(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def num_new_tokens(self) -> int: ...

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def resident_block_ids(self) -> Sequence[Sequence[int]]: ...


@dataclass(frozen=True, slots=True)
class StepRequest:
    """A plain `ScheduledRequest`, for engines that do not have a view object of their own."""

    request_id: str
    state_index: int
    num_computed_tokens: int
    num_new_tokens: int
    token_ids: Sequence[int]
    resident_block_ids: Sequence[Sequence[int]]
