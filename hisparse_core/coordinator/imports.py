"""P/D import: where an imported prefix lands, and the leases a host import holds until it ends.

The target comes from the normal admission arithmetic, once per request: DEVICE if the whole
imported prefix fits the GPU pool, else HOST if its host blocks plus the fixed GPU footprint of a
host-backed request (hot buffer and active tail) fit, else WAIT. Every target needs a host block
per page, because the host copy is the source of truth. The first DEVICE or HOST answer is kept:
a request that waits for capacity later gets that target or WAIT, never the other one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hisparse_core.coordinator.config import CoordinatorConfig
from hisparse_core.coordinator.outputs import ImportTarget


@dataclass(frozen=True, slots=True)
class ImportFootprint:
    """What each target needs, in blocks."""

    host_blocks: int
    device_blocks: int       # DEVICE: every page in every resident group, plus the engine's other groups
    host_gpu_blocks: int     # HOST: hot buffer + active tail in every resident group, plus other groups

    @classmethod
    def of(cls, config: CoordinatorConfig, num_tokens: int, other_device_blocks: int) -> ImportFootprint:
        pages = config.pages_for(num_tokens)
        groups = config.num_resident_groups
        tail = min(pages, config.active_tail_pages)
        return cls(pages, pages * groups + other_device_blocks,
                   config.hot_blocks_per_request + tail * groups + other_device_blocks)

    def fits(self, target: ImportTarget, free_gpu: int, free_host: int) -> bool:
        if self.host_blocks > free_host:
            return False
        if target is ImportTarget.DEVICE:
            return self.device_blocks <= free_gpu
        if target is ImportTarget.HOST:
            return self.host_gpu_blocks <= free_gpu
        return False


def choose_target(footprint: ImportFootprint, kept: ImportTarget | None, free_gpu: int,
                  free_host: int) -> ImportTarget:
    """DEVICE, HOST or WAIT; with a `kept` choice, that choice or WAIT."""
    if kept is not None:
        return kept if footprint.fits(kept, free_gpu, free_host) else ImportTarget.WAIT
    for target in (ImportTarget.DEVICE, ImportTarget.HOST):
        if footprint.fits(target, free_gpu, free_host):
            return target
    return ImportTarget.WAIT


@dataclass(slots=True, eq=False)
class HostImport:
    """A host import in flight: the host blocks it writes (one per page) and its hot buffer."""

    request_id: str
    token_ids: Sequence[int]
    num_tokens: int
    root: bytes
    host_blocks: list[int]
    hot: tuple[int, ...]
