"""An in-memory, lease-counted GPU block pool implementing `GpuBlockAllocator`.

For tests and for engines without a block pool of their own (the replay engine). Free blocks
are handed out oldest-first. Blocks freed with `release` go to the front of the free queue (their
contents are garbage, reuse them first); blocks freed with `release_readable` go to the back and
stay readable until handed out, so a page released under pressure survives as long as possible.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

from hisparse_core.coordinator.engine import OnReuse
from hisparse_core.errors import CapacityError, InvalidInputError

logger = logging.getLogger(__name__)


class SimpleGpuBlockPool:
    """`num_blocks` GPU blocks with lease counts. Block ids are `0 .. num_blocks-1`."""

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise InvalidInputError(f"SimpleGpuBlockPool.num_blocks must be a positive int, got {num_blocks!r}")
        self._num_blocks = num_blocks
        self._leases = [0] * num_blocks
        # block id -> on-reuse callback (None for garbage blocks); order is hand-out order.
        self._free: OrderedDict[int, OnReuse | None] = OrderedDict((b, None) for b in range(num_blocks))
        # Callbacks waiting for a readable block's lease count to reach zero.
        self._readable_callbacks: dict[int, OnReuse] = {}

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def lease_count(self, block_id: int) -> int:
        self._check_ids((block_id,))
        return self._leases[block_id]

    @property
    def num_leased_blocks(self) -> int:
        return self._num_blocks - len(self._free)

    def is_readable(self, block_id: int) -> bool:
        """True if the block is leased or free but still holding readable contents."""
        self._check_ids((block_id,))
        return self._leases[block_id] > 0 or self._free.get(block_id) is not None

    def acquire(self, count: int) -> list[int]:
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise InvalidInputError(f"acquire count must be an int >= 0, got {count!r}")
        if count > len(self._free):
            raise CapacityError(f"GPU pool has {len(self._free)} free blocks of {self._num_blocks}; "
                                f"asked for {count}")
        out: list[int] = []
        callbacks: list[tuple[OnReuse, int]] = []
        for _ in range(count):
            block, cb = self._free.popitem(last=False)
            self._leases[block] = 1
            out.append(block)
            if cb is not None:
                callbacks.append((cb, block))
        for cb, block in callbacks:
            cb(block)
        return out

    def retain(self, block_ids: Sequence[int]) -> None:
        self._check_ids(block_ids)
        for b in block_ids:
            if self._leases[b] <= 0:
                raise InvalidInputError(f"retain of GPU block {b}, which is free; only leased blocks can be retained")
        for b in block_ids:
            self._leases[b] += 1

    def release(self, block_ids: Sequence[int]) -> None:
        self._check_releasable(block_ids)
        for b in block_ids:
            self._drop(b, None)

    def release_readable(self, block_ids: Sequence[int], on_reuse: OnReuse) -> None:
        self._check_releasable(block_ids)
        for b in block_ids:
            self._drop(b, on_reuse)

    def _drop(self, block: int, on_reuse: OnReuse | None) -> None:
        if on_reuse is not None:
            self._readable_callbacks[block] = on_reuse
        self._leases[block] -= 1
        if self._leases[block]:
            return
        cb = self._readable_callbacks.pop(block, None)
        self._free[block] = cb
        if cb is None:
            self._free.move_to_end(block, last=False)

    def _check_ids(self, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < self._num_blocks:
                raise InvalidInputError(f"GPU block id {b!r} out of range; expected 0 <= id < {self._num_blocks}")

    def _check_releasable(self, block_ids: Sequence[int]) -> None:
        self._check_ids(block_ids)
        counts: dict[int, int] = {}
        for b in block_ids:
            counts[b] = counts.get(b, 0) + 1
        for b, n in counts.items():
            if self._leases[b] < n:
                raise InvalidInputError(f"release of GPU block {b} {n} time(s), but it holds {self._leases[b]} "
                                        f"lease(s)")
