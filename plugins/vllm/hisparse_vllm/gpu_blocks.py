"""The coordinator's view of vLLM's GPU `BlockPool` (`hisparse_core.coordinator.GpuBlockAllocator`).

On a stock engine vLLM's KV-cache manager holds one reference on every block of a running
request and drops it itself when the request finishes or is preempted. The coordinator's lease
contract counts that as the *handover lease* of each resident page. This adapter maps the
coordinator's leases onto the pool as follows:

- `acquire` (hot-buffer blocks): real blocks from `BlockPool.get_new_blocks`, one reference each.
  The connector configures no hot buffer (vLLM's attention reads resident pages only), so the
  coordinator does not call it there.
- `retain` (transfer pins): `BlockPool.touch`, one more reference, so a block under a spill or
  restore cannot be handed out again even after vLLM frees the request.
- `release` of a pin or an acquired block: `BlockPool.free_blocks`.
- `release` of a handover lease, which the coordinator does only inside `finish_request` /
  `preempt_request`: nothing, because vLLM drops its own reference. The connector wraps those
  two calls in `handover()`, which is how the adapter tells the two kinds apart.
- `release_readable`: refused. It would let the engine reuse a block the request's standard
  attention still reads; the connector configures the coordinator so it never asks
  (`pressure_watermark_blocks=0`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from hisparse_core.coordinator import OnReuse
from hisparse_core.errors import CapacityError, ProtocolError


class VllmGpuBlocks:
    """`GpuBlockAllocator` over a vLLM `BlockPool` (see the module docstring)."""

    def __init__(self, block_pool: Any) -> None:
        self._pool = block_pool
        self._acquired: set[int] = set()
        self._pins: Counter[int] = Counter()
        self._handover_depth = 0

    @property
    def num_blocks(self) -> int:
        return int(self._pool.num_gpu_blocks)

    @property
    def num_free_blocks(self) -> int:
        return int(self._pool.get_num_free_blocks())

    @property
    def num_pinned(self) -> int:
        """Blocks holding at least one transfer pin (for tests and leak checks)."""
        return sum(1 for n in self._pins.values() if n > 0)

    def num_pins_on_freed_blocks(self) -> int:
        """Pinned blocks that only this adapter's pins still hold (their request left): they return
        to the pool when their transfers are enqueued everywhere."""
        blocks = self._pool.blocks
        return sum(1 for i, n in self._pins.items() if blocks[i].ref_cnt <= n)

    @property
    def num_acquired(self) -> int:
        return len(self._acquired)

    def acquire(self, count: int) -> list[int]:
        if count > self.num_free_blocks:
            raise CapacityError(f"GPU block pool has {self.num_free_blocks} free blocks; asked for {count}")
        blocks = self._pool.get_new_blocks(count)
        ids = [b.block_id for b in blocks]
        self._acquired.update(ids)
        return ids

    def retain(self, block_ids: Sequence[int]) -> None:
        self._pool.touch([self._pool.blocks[i] for i in block_ids])
        self._pins.update(block_ids)

    def release(self, block_ids: Sequence[int]) -> None:
        to_free = []
        for i in block_ids:
            if i in self._acquired:
                self._acquired.discard(i)
                to_free.append(i)
            elif self._handover_depth:
                continue  # a handover lease: vLLM drops its own reference
            elif self._pins[i] > 0:
                self._pins[i] -= 1
                if not self._pins[i]:
                    del self._pins[i]
                to_free.append(i)
            else:
                raise ProtocolError(f"coordinator released GPU block {i}, which holds no pin or hot lease of "
                                    "this connector outside finish/preempt")
        if to_free:
            self._pool.free_blocks([self._pool.blocks[i] for i in to_free])

    def release_readable(self, block_ids: Sequence[int], on_reuse: OnReuse) -> None:
        raise ProtocolError(
            f"release_readable of GPU blocks {list(block_ids)[:8]}: on a stock vLLM engine attention reads only "
            "resident pages, so resident pages are never released early (pressure_watermark_blocks must be 0)")

    @contextmanager
    def handover(self) -> Iterator[None]:
        """Releases inside this block return handover leases (finish/preempt)."""
        self._handover_depth += 1
        try:
            yield
        finally:
            self._handover_depth -= 1
