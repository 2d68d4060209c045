"""What attention layers consume: a device cache and a resolver."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from hisparse_core.runtime import ResolveInputs, ResolveResult


@runtime_checkable
class CacheHandle(Protocol):
    """One sparse-attention layer's view of its cache.

    The leader layer of an index group resolves (and gathers its misses); a follower replays the
    leader's plan into its own device cache and reuses the leader's rows. Attention then reads
    `device_cache()[rows]` for each valid entry.
    """

    layer: int

    def device_cache(self) -> torch.Tensor:
        """`[num_device_blocks * block_size, width]` rows that `ResolveResult.rows` index."""
        ...

    def resolve(self, inputs: ResolveInputs) -> ResolveResult:
        """Resolve the step's top-k for this layer and make every returned row readable."""
        ...
