"""P/D import bookkeeping: where an imported prefix lands, and the leases a host import holds until it ends.

The target comes from the normal admission arithmetic, once per request: DEVICE if the whole
imported prefix fits the GPU pool, else HOST if its host blocks plus the fixed GPU footprint of a
host-backed request (hot buffer and active tail) fit, else WAIT. Every target needs a host block
per page, because the host copy is the source of truth. The first DEVICE or HOST answer is kept:
a request that waits for capacity later gets that target or WAIT, never the other one.

`ImportBook` keeps those choices until the request is admitted or leaves, and the host imports in
flight: a HOST import leases its host blocks and hot buffer at `begin`, and at `complete` becomes
an admitted request whose imported pages are host-backed (LOST) and whose partial last page is
restored to its resident blocks when the request first writes it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from hisparse_core.coordinator.config import CoordinatorConfig
from hisparse_core.coordinator.engine import GpuBlockAllocator
from hisparse_core.coordinator.host_blocks import HostBlockPool
from hisparse_core.coordinator.outputs import ImportTarget
from hisparse_core.coordinator.pages import DIRTY, LOST, RequestPages
from hisparse_core.coordinator.policy import ResidencyPolicy
from hisparse_core.coordinator.prefix import chain_hashes
from hisparse_core.errors import CapacityError, InvalidInputError

logger = logging.getLogger(__name__)


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


class ImportBook:
    """The kept import target per request and the host imports in flight. Arguments are checked by
    the coordinator's public methods; this class trusts them."""

    def __init__(self, config: CoordinatorConfig, gpu: GpuBlockAllocator, host: HostBlockPool,
                 policy: ResidencyPolicy) -> None:
        self._config = config
        self._gpu = gpu
        self._host = host
        self._policy = policy
        self._choices: dict[str, ImportTarget] = {}
        self.in_flight: dict[str, HostImport] = {}

    def __contains__(self, request_id: str) -> bool:
        """True while a host import of the request is in flight."""
        return request_id in self.in_flight

    def __len__(self) -> int:
        return len(self.in_flight)

    def knows(self, request_id: str) -> bool:
        """True for a host import in flight or a kept target."""
        return request_id in self.in_flight or request_id in self._choices

    def target_of(self, request_id: str) -> ImportTarget | None:
        return self._choices.get(request_id)

    def choose(self, request_id: str, num_tokens: int, other_device_blocks: int) -> ImportTarget:
        """DEVICE, HOST or WAIT for a request not admitted yet (see the module docstring)."""
        footprint = ImportFootprint.of(self._config, num_tokens, other_device_blocks)
        kept = self._choices.get(request_id)
        target = choose_target(footprint, kept, self._gpu.num_free_blocks, self._host.num_free)
        if kept is None and target is not ImportTarget.WAIT:
            self._choices[request_id] = target
            logger.debug("request %s: import of %d tokens lands on %s (%s)", request_id, num_tokens,
                         target.value, footprint)
        return target

    def begin(self, request_id: str, token_ids: Sequence[int], num_tokens: int, root: bytes) -> tuple[int, ...]:
        """Lease the host blocks (returned, in page order) and the hot buffer of a HOST import.
        Raises `CapacityError`, leasing nothing, if either pool cannot provide them."""
        pages = self._config.pages_for(num_tokens)
        if pages > self._host.num_free:
            raise CapacityError(f"host import of {num_tokens} tokens needs {pages} host blocks; "
                                f"{self._host.num_free} are allocatable")
        hot = self._policy.acquire_hot()
        blocks = self._host.allocate(pages)
        self.in_flight[request_id] = HostImport(request_id, token_ids, num_tokens, root, blocks, hot)
        return tuple(blocks)

    def complete(self, request_id: str) -> RequestPages:
        """The imported pages are on host: the admitted request's record, leases carried over.
        The caller registers it and publishes its full pages."""
        imp = self._take(request_id)
        bs = self._config.block_size
        full, partial = divmod(imp.num_tokens, bs)
        rec = RequestPages(request_id, imp.root, self._config.active_tail_pages)
        rec.host = list(imp.host_blocks)
        rec.gpu = [None] * len(rec.host)
        rec.state = bytearray([LOST]) * full
        rec.hashes = chain_hashes(imp.token_ids, bs, imp.root, 0, full)
        rec.num_sealed = rec.first_resident_page = full
        rec.num_mirrored = imp.num_tokens
        rec.hot = imp.hot
        if partial:
            rec.state.append(DIRTY)
            rec.restore_page, rec.restore_source = full, rec.host[full]
        self._choices.pop(request_id, None)
        return rec

    def fail(self, request_id: str) -> None:
        """Release every lease the import took and forget the request."""
        imp = self._take(request_id)
        self._host.release(imp.host_blocks)
        self._gpu.release(imp.hot)
        self._choices.pop(request_id, None)

    def admitted(self, request_id: str) -> None:
        """The request was admitted another way (`add_request`): its kept target no longer applies."""
        self._choices.pop(request_id, None)

    def end(self, request_id: str, admitted: bool) -> bool:
        """The request leaves: fail its import in flight, or forget the kept target of a request
        that was never admitted. True if there was such an import or target (nothing else to do)."""
        if request_id in self.in_flight:
            self.fail(request_id)
            return True
        return not admitted and self._choices.pop(request_id, None) is not None

    def _take(self, request_id: str) -> HostImport:
        imp = self.in_flight.pop(request_id, None)
        if imp is None:
            raise InvalidInputError(f"request {request_id!r} has no host import in flight "
                                    f"(begin_host_import first)")
        return imp
