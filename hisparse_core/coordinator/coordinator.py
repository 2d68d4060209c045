"""`HiSparseCoordinator`: the scheduler-side owner of host blocks, prefix identity and residency.

Pure Python and engine-agnostic: it talks to the engine through `engine.GpuBlockAllocator` and
`engine.ScheduledRequest` and to the workers through the wire types of `hisparse_core.types`.

Per step the engine calls, in this order:

1. `finish_request` / `preempt_request` for requests that left (or pass them to `schedule_step`);
   `add_request` for newly admitted ones (after `lookup_prefix` if it wants the hit first).
2. Its own GPU allocations for the step (resident blocks for the pages written this step).
3. `schedule_step(scheduled)`: returns the step's `OffloadCommand` (or None when there is nothing
   to do or HiSparse is disabled), then `take_table_updates()` for the source/hot table deltas.
   It must run after the step's GPU allocations, so that a released page whose block was handed
   out again is reported non-resident (-1) in the same step's command.
4. After the step, `update_from_workers(meta, num_workers)` with the workers' acknowledgements.

A GPU block the engine hands out again (to a request, a hot buffer or a device-side import) may
still be listed as resident for the page released into it, until the next command says -1. So
nothing may write a newly allocated block before the worker has applied the residency updates of
the step that allocated it: forward writes and KV loads the worker starts in that step are fine.
Host capacity for a step is checked before that step's `finished`/`preempted` are applied.

Meaning of the command's parts (the worker contract):

- `row_mirrors`: rows that the host copy does not have yet (rows written this step: prefill
  chunks and decode tokens; and rows that were loaded into resident pages by someone else, such
  as a device-side P/D import). The host copy is the source of truth.
- `page_transfers` with `restore=False` (spills) carry **no data the mirrors have not carried**:
  every row of the page was covered by a mirror of this or an earlier command. The transfer is the
  transaction that gates the release of the GPU source lease (at enqueue) and the publication of
  the host page (at completion). A worker may implement it as a fence after the mirrors (record
  an event) or re-copy the page; the page's GPU contents no longer change, so a re-copy is
  idempotent. Spills are `after_forward=True`.
- `page_transfers` with `restore=True` copy a host block into the resident blocks of a page the
  request is about to write, whose first rows exist only on host (a partial page reached by a
  prefix hit or a host import). They run before the forward (`after_forward=False`).
- `residency_updates`: the resident block of pages that became resident (new pages) or stopped
  being resident (-1: a released page whose block was reused, or host-backed pages of a prefix
  hit or host import).
- `host_block_copies`: copy-on-write of a published block whose tail the request re-writes
  (a prefix hit capped inside a page). They run before this command's mirrors and restores.
- `recycled_host_blocks`: host blocks handed out again this step after holding other contents;
  the worker forgets hot copies of their rows.

A page is sealed, and its spill planned, in the first step whose `num_computed_tokens` covers
it (one step after its last row was written), so rows of rejected speculative tokens are never
sealed. The spill pins the page's GPU blocks and its host block. The enqueue acknowledgement of
every worker drops the GPU pin: for a running request the page stays resident under the
request's own lease (its resident entry changes only when the policy releases it and the block
is reused); for a finished or preempted request that pin was the last lease, so the block goes
back to the engine only once the copy is ordered. The completion acknowledgement of every worker
makes the page clean, publishes the durable contiguous prefix and drops the host pin.

This class is the facade: it checks the engine's arguments once, at its public methods, and
keeps admission (prefix hits) and departures. The parts it drives share its state:
`step.py` plans a step (validation, then the command), `acks.py` applies acknowledgements,
`imports.py` keeps the P/D import bookkeeping. Page states live in `pages.py`, transactions and
acknowledgement counting in `spill.py`, the host pool and prefix map in `host_blocks.py`, the
watermark policy in `policy.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from hisparse_core.coordinator.acks import Acknowledgements
from hisparse_core.coordinator.config import GIB, CoordinatorConfig, least_gib
from hisparse_core.coordinator.engine import GpuBlockAllocator, ScheduledRequest
from hisparse_core.coordinator.host_blocks import NULL_BLOCK, HostBlockPool
from hisparse_core.coordinator.imports import ImportBook
from hisparse_core.coordinator.outputs import CoordinatorStats, ImportTarget, PrefixHit, TableUpdate
from hisparse_core.coordinator.pages import DIRTY, LEASED_STATES, LOST, Lifecycle, RequestPages, unknown_request
from hisparse_core.coordinator.policy import ResidencyPolicy
from hisparse_core.coordinator.prefix import block_hash, root_hash
from hisparse_core.coordinator.spill import HostCopyLedger, TransferLedger
from hisparse_core.coordinator.step import StepPlanner
from hisparse_core.errors import CapacityError, InvalidInputError, ProtocolError
from hisparse_core.types import OffloadCommand, WorkerMetadata
from hisparse_core.units import human_bytes

logger = logging.getLogger(__name__)


def _is_int(value: object) -> bool:
    return type(value) is int or (isinstance(value, int) and not isinstance(value, bool))


class HiSparseCoordinator:
    """Scheduler-side owner of logical host blocks, source-prefix identity and residency transitions."""

    def __init__(self, config: CoordinatorConfig, gpu: GpuBlockAllocator) -> None:
        """Size the host pool from `config` and bind the engine's GPU allocator.

        Logs the realized capacity. Raises `CapacityError` if the pool cannot hold one
        `max_model_len` request plus the active tail.
        """
        if not isinstance(config, CoordinatorConfig):
            raise InvalidInputError(f"config must be a CoordinatorConfig, got {type(config).__name__}")
        if not isinstance(gpu, GpuBlockAllocator):
            raise InvalidInputError(f"gpu must implement GpuBlockAllocator, got {type(gpu).__name__}")
        num_blocks = config.host_num_blocks
        usable = num_blocks - 1
        stride = config.host_block_stride
        if config.enabled and usable < config.min_host_blocks:
            least = least_gib((config.min_host_blocks + 1) * stride)
            raise CapacityError(
                f"host_pool_gib={config.host_pool_gib} holds {max(num_blocks, 0)} blocks of {stride} bytes "
                f"({config.num_layers} layers x {config.block_size} tokens x {config.row_bytes} B), {max(usable, 0)} "
                f"usable after the null block; one max_model_len={config.max_model_len} request plus the "
                f"{config.active_tail_pages}-page active tail needs {config.min_host_blocks} usable blocks, "
                f"host_pool_gib >= {least}")
        self._config = config
        self._gpu = gpu
        self._enabled = config.enabled
        self._bs = config.block_size
        self._max_tokens = config.max_pages_per_request * config.block_size
        self._host = HostBlockPool(num_blocks if config.enabled else 2)
        self._policy = ResidencyPolicy(config, gpu)
        self._requests: dict[str, RequestPages] = {}
        self._detached: dict[RequestPages, None] = {}
        self._transfers = TransferLedger()
        self._copies = HostCopyLedger()
        self._table_updates: tuple[TableUpdate, ...] = ()
        self._prefix_hit_tokens = self._prefix_queried_tokens = 0
        # The parts share this state; each has one job (see the module docstring).
        self._step = StepPlanner(config, gpu, self._host, self._policy, self._transfers, self._copies,
                                 self._requests)
        self._acks = Acknowledgements(gpu, self._host, self._policy, self._transfers, self._copies, self._detached)
        self._pd = ImportBook(config, gpu, self._host, self._policy)
        if not self._enabled:
            logger.info("HiSparse disabled: the coordinator tracks nothing and builds no offload command")
            return
        logger.info(
            "HiSparse host pool: %d blocks (%d usable + null) = %d tokens, %s of the %s budget; "
            "block stride %d B (%d layers x %d tokens x %d B, aligned to %d); room for %.1f requests of %d tokens "
            "(max_model_len); device KV pool pressure watermark %d of %d blocks",
            num_blocks, usable, usable * config.block_size, human_bytes(num_blocks * stride),
            human_bytes(config.host_pool_gib * GIB),
            stride, config.num_layers, config.block_size, config.row_bytes, config.stride_alignment,
            usable / config.max_pages_per_request, config.max_model_len, self._policy.watermark, gpu.num_blocks)

    # -- properties ------------------------------------------------------------------------

    @property
    def config(self) -> CoordinatorConfig:
        return self._config

    @property
    def enabled(self) -> bool:
        return self._enabled

    @property
    def null_block_id(self) -> int:
        return NULL_BLOCK

    @property
    def host_num_blocks(self) -> int:
        """Host blocks of the pool, the null block included (what the worker allocates)."""
        return self._host.num_blocks if self._enabled else 0

    @property
    def num_free_host_blocks(self) -> int:
        """Host blocks available for allocation: free ones plus evictable cached ones."""
        return self._host.num_free if self._enabled else 0

    @property
    def pressure_watermark(self) -> int:
        return self._policy.watermark

    def has_request(self, request_id: str) -> bool:
        """True for admitted requests and host imports in flight."""
        return request_id in self._requests or request_id in self._pd

    def first_resident_page(self, request_id: str) -> int:
        """First page the engine must allocate resident blocks for (pages below are host-backed)."""
        return self._request(request_id).first_resident_page

    def source_block_ids(self, request_id: str) -> tuple[int, ...]:
        """The request's host block per page (its source-table row)."""
        return tuple(self._request(request_id).host)

    def host_blocks_needed(self, request_id: str, total_tokens: int) -> int:
        """Host blocks a step bringing this request to `total_tokens` tokens would allocate."""
        rec = self._request(request_id)
        return max(0, self._config.pages_for(total_tokens) - rec.num_pages)

    # -- admission -------------------------------------------------------------------------

    def lookup_prefix(self, token_ids: Sequence[int], *, extra_key: bytes | None = None,
                      max_tokens: int | None = None) -> PrefixHit:
        """Longest published prefix of `token_ids` (whole pages, at most `max_tokens`). Read-only."""
        if not self._enabled:
            return PrefixHit(0, ())
        blocks, _ = self._walk_prefix(token_ids, root_hash(extra_key), self._cap(token_ids, max_tokens) // self._bs)
        n = len(blocks) * self._bs
        return PrefixHit(n, tuple(blocks))

    def add_request(self, request_id: str, token_ids: Sequence[int], *, extra_key: bytes | None = None,
                    max_prefix_tokens: int | None = None) -> int:
        """Admit a request and take its prefix hit; returns the hit in tokens (its first computed
        tokens). `max_prefix_tokens` caps the hit (engines that must compute at least one token
        pass `len(prompt) - 1`); a cap inside a page copies that page on host (copy-on-write)
        and restores it to the page's resident blocks when the request first writes it.
        A hit of at least one whole page leases the request's hot buffer; if the GPU pool cannot
        provide it, raises `CapacityError` and nothing changes (retry with `max_prefix_tokens=0`).
        Pages below `first_resident_page(request_id)` are host-backed: the engine allocates
        resident blocks from that page on."""
        if not self._enabled:
            return 0
        self._check_new_id(request_id)
        cap = self._cap(token_ids, max_prefix_tokens)
        root = root_hash(extra_key)
        blocks, hashes = self._walk_prefix(token_ids, root, -(-cap // self._bs))
        bs = self._bs
        hit = min(len(blocks) * bs, cap)
        full, partial = divmod(hit, bs)
        held = blocks[:full + (1 if partial else 0)]
        if partial:
            unleased = sum(1 for b in held if self._host.lease_count(b) == 0)
            if self._host.num_free - unleased < 1:
                raise CapacityError(f"prefix hit of {hit} tokens needs 1 host block for the copy-on-write of "
                                    f"page {full}; the pool has {self._host.num_free - unleased} allocatable")
        hot = self._policy.acquire_hot() if full else None
        self._host.touch(blocks[:full])
        rec = RequestPages(request_id, root, self._config.active_tail_pages)
        rec.host = list(blocks[:full])
        rec.gpu = [None] * full
        rec.state = bytearray([LOST]) * full
        rec.hashes = hashes[:full]
        rec.num_sealed = rec.num_ready = rec.first_resident_page = full
        rec.num_mirrored = hit
        rec.hot = tuple(hot) if hot is not None else None
        if partial:
            src = blocks[full]
            self._host.touch([src])         # pinned by the copy until a worker reports it
            (dst,) = self._host.allocate(1)
            self._host.touch([dst])
            self._copies.open(src, dst, rec, full)
            rec.host.append(dst)
            rec.gpu.append(None)
            rec.state.append(DIRTY)
            rec.cow_pages.add(full)
            # Restore from the private copy, not from `src`: the copy may be acknowledged (and `src`
            # evicted) before the request is first scheduled; workers run a command's host copies
            # before its restores, so the copy is complete either way.
            rec.restore_page, rec.restore_source = full, dst
        self._requests[request_id] = rec
        self._pd.admitted(request_id)
        self._prefix_hit_tokens += hit
        self._prefix_queried_tokens += cap
        if hit:
            logger.debug("request %s: prefix hit of %d tokens (%d pages from host%s)", request_id, hit, full,
                         f", page {full} copied on write" if partial else "")
        return hit

    # -- per step --------------------------------------------------------------------------

    def schedule_step(self, scheduled: Sequence[ScheduledRequest], *, finished: Iterable[str] = (),
                      preempted: Iterable[str] = ()) -> OffloadCommand | None:
        """Plan this step: leave `finished`/`preempted`, allocate host blocks for pages written this
        step, mirror the written rows, seal and spill full pages, apply the residency policy.

        Returns None when there is nothing for the workers (always when disabled). Validates every
        request before changing anything: an unknown request, bad block ids or a host pool too
        small for the step raise and leave the state as it was.
        """
        if not self._enabled:
            return None
        finished = tuple(finished)
        preempted = tuple(preempted)
        leaving = set(finished) | set(preempted)
        if len(leaving) != len(finished) + len(preempted):
            raise InvalidInputError(f"a request is listed twice among finished={finished} and preempted={preempted}")
        for rid in leaving:
            self._request_or_import(rid)
        step = self._step.validate(scheduled, leaving)
        for rid in finished:
            self.finish_request(rid)
        for rid in preempted:
            self.preempt_request(rid)
        command, self._table_updates = self._step.apply(step)
        return command

    def take_table_updates(self) -> tuple[TableUpdate, ...]:
        """Source (host) and hot table changes per state row made by the last `schedule_step`."""
        out, self._table_updates = self._table_updates, ()
        return out

    def update_from_workers(self, meta: WorkerMetadata, num_workers: int) -> None:
        """Apply acknowledgements (one worker's report or an aggregate of several).

        A transfer is enqueued (its GPU source lease is released) once `num_workers` enqueue
        acknowledgements arrived, and completed (its host page published, its host lease
        released) once `num_workers` completions arrived. Raises `ProtocolError` for an unknown
        transfer or host copy, or more acknowledgements than workers, and then applies nothing.
        """
        if not isinstance(meta, WorkerMetadata):
            raise InvalidInputError(f"meta must be a WorkerMetadata, got {type(meta).__name__}")
        if not _is_int(num_workers) or num_workers < 1:
            raise InvalidInputError(f"num_workers must be an int >= 1, got {num_workers!r}")
        if not self._enabled:
            if not meta.is_empty():
                raise ProtocolError("acknowledgements arrived but HiSparse is disabled and issued no transfers")
            return
        self._acks.apply(meta, num_workers)

    def make_room(self, gpu_blocks: int) -> int:
        """Release clean pages now (the residency policy, outside a step) if fewer than
        `gpu_blocks` GPU blocks are free; returns the free blocks. For an engine whose next
        allocations do not fit because acknowledgements lag: apply them first (drained), then
        ask. Released blocks stay readable until handed out; pages lost to that and hot buffers
        leased here go out in the next command."""
        if not _is_int(gpu_blocks) or gpu_blocks < 0:
            raise InvalidInputError(f"gpu_blocks must be an int >= 0, got {gpu_blocks!r}")
        if self._enabled:
            self._policy.make_room(gpu_blocks)
        return self._gpu.num_free_blocks

    # -- leaving ---------------------------------------------------------------------------

    def finish_request(self, request_id: str) -> None:
        """The request is done: return its GPU and hot leases now. Pages whose spill is still in
        flight keep their host leases and are published when their last acknowledgement arrives
        (detached publication); nothing is held after that. A host import in flight fails."""
        rec = self._leave(request_id)
        if rec is None:
            return
        if rec.pending_spills:
            self._acks.detach(rec)
        else:
            rec.lifecycle = Lifecycle.GONE
            self._host.release(rec.take_host_blocks())

    def preempt_request(self, request_id: str) -> None:
        """The request is preempted: return every lease now except transfer pins, which go when
        their acknowledgements arrive; unpublished pages are dropped. Re-admit it with
        `add_request` (its published prefix is then a prefix hit). A host import in flight fails."""
        rec = self._leave(request_id)
        if rec is None:
            return
        rec.lifecycle = Lifecycle.GONE
        self._host.release(rec.take_host_blocks())

    def _leave(self, request_id: str) -> RequestPages | None:
        """The common start of finishing and preempting: end an import in flight (then there is
        nothing else to do: None), or forget the request and return its GPU leases."""
        if not self._enabled or self._pd.end(request_id, admitted=request_id in self._requests):
            return None
        rec = self._request(request_id)
        del self._requests[request_id]
        self._drop_gpu(rec)
        return rec

    # -- P/D import ------------------------------------------------------------------------

    def choose_import_target(self, request_id: str, num_tokens: int, *,
                             other_device_blocks: int = 0) -> ImportTarget:
        """Where a P/D import of `num_tokens` tokens lands, from the admission arithmetic.

        DEVICE if the whole prefix fits the GPU pool (plus `other_device_blocks` the engine needs
        for other groups, such as the indexer) and its host blocks fit; else HOST if the host
        blocks plus the hot buffer and active tail fit; else WAIT. The first DEVICE or HOST
        answer is kept for the request; later calls answer that target or WAIT. When HiSparse is
        disabled the answer is always DEVICE (the engine's own admission decides).
        """
        if not self._enabled:
            return ImportTarget.DEVICE
        if request_id in self._requests or request_id in self._pd:
            raise InvalidInputError(f"request {request_id!r} is already admitted or importing; the import "
                                    f"target is chosen before admission")
        if not _is_int(num_tokens) or not 0 < num_tokens <= self._max_tokens:
            raise InvalidInputError(f"num_tokens must be an int in [1, {self._max_tokens}], got {num_tokens!r}")
        if not _is_int(other_device_blocks) or other_device_blocks < 0:
            raise InvalidInputError(f"other_device_blocks must be an int >= 0, got {other_device_blocks!r}")
        return self._pd.choose(request_id, num_tokens, other_device_blocks)

    def begin_host_import(self, request_id: str, token_ids: Sequence[int], num_tokens: int, *,
                          extra_key: bytes | None = None) -> tuple[int, ...]:
        """Lease the host blocks (returned, in page order) and the hot buffer of a HOST import.

        Raises `CapacityError` (nothing leased) if either pool cannot provide them."""
        if not self._enabled:
            raise InvalidInputError("begin_host_import while HiSparse is disabled; imports land on the device")
        if self._pd.target_of(request_id) is not ImportTarget.HOST:
            raise InvalidInputError(f"request {request_id!r} has import target "
                                    f"{self._pd.target_of(request_id)}; begin_host_import needs HOST "
                                    f"from choose_import_target")
        if request_id in self._pd or request_id in self._requests:
            raise InvalidInputError(f"request {request_id!r} is already importing or admitted")
        if not _is_int(num_tokens) or not 0 < num_tokens <= min(len(token_ids), self._max_tokens):
            raise InvalidInputError(f"num_tokens must be an int in [1, min(len(token_ids)={len(token_ids)}, "
                                    f"{self._max_tokens})], got {num_tokens!r}")
        return self._pd.begin(request_id, token_ids, num_tokens, root_hash(extra_key))

    def complete_host_import(self, request_id: str) -> None:
        """The imported pages are on host: admit the request with them as its prefix and publish
        its full pages. The partial last page is restored to its resident block when first
        written; the engine allocates resident blocks from `first_resident_page` on."""
        rec = self._pd.complete(request_id)
        self._requests[request_id] = rec
        self._acks.advance_publication(rec)

    def fail_host_import(self, request_id: str) -> None:
        """The import failed: release every lease it took and forget the request."""
        self._pd.fail(request_id)

    # -- introspection ---------------------------------------------------------------------

    def stats(self) -> CoordinatorStats:
        host = self._host
        return CoordinatorStats(
            host_blocks_total=host.capacity if self._enabled else 0,
            host_blocks_used=host.num_leased if self._enabled else 0,
            host_blocks_cached=host.num_cached if self._enabled else 0,
            pending_transfers=len(self._transfers),
            pending_host_copies=len(self._copies),
            running_requests=len(self._requests),
            detached_requests=len(self._detached),
            pending_imports=len(self._pd),
            prefix_hit_tokens=self._prefix_hit_tokens,
            prefix_queried_tokens=self._prefix_queried_tokens,
            published_blocks=host.num_published if self._enabled else 0,
            spills=self._step.spills,
            shared_spills=self._step.shared_spills,
            restores=self._step.restores,
            released_pages=self._policy.released_pages,
            lost_pages=self._policy.lost_pages,
            evicted_blocks=host.evictions if self._enabled else 0,
        )

    def has_pending_work(self) -> bool:
        """True while transfers or host copies await acknowledgements or queued work awaits a step."""
        return bool(len(self._transfers) or len(self._copies) or self._policy.has_pending or self._detached)

    # -- internals: validation -------------------------------------------------------------

    def _request(self, request_id: str) -> RequestPages:
        rec = self._requests.get(request_id)
        if rec is None:
            raise unknown_request(request_id)
        return rec

    def _request_or_import(self, request_id: str) -> None:
        if request_id not in self._requests and not self._pd.knows(request_id):
            raise InvalidInputError(f"unknown request {request_id!r}: not admitted, importing or choosing an "
                                    f"import target")

    def _check_new_id(self, request_id: str) -> None:
        if not isinstance(request_id, str):
            raise InvalidInputError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self._requests or request_id in self._pd:
            raise InvalidInputError(f"request {request_id!r} is already admitted or importing")

    def _cap(self, token_ids: Sequence[int], max_tokens: int | None) -> int:
        n = len(token_ids)
        if max_tokens is None:
            return min(n, self._max_tokens)
        if not _is_int(max_tokens) or max_tokens < 0:
            raise InvalidInputError(f"max_tokens must be an int >= 0 or None, got {max_tokens!r}")
        return min(n, max_tokens, self._max_tokens)

    def _walk_prefix(self, token_ids: Sequence[int], root: bytes, max_pages: int) -> tuple[list[int], list[bytes]]:
        """Published blocks of the longest prefix of whole pages (at most `max_pages`), with their hashes."""
        bs = self._bs
        pages = min(max_pages, len(token_ids) // bs)
        blocks: list[int] = []
        hashes: list[bytes] = []
        parent = root
        published = self._host.published_block
        for p in range(pages):
            parent = block_hash(parent, token_ids[p * bs:(p + 1) * bs])
            b = published(parent)
            if b is None:
                break
            blocks.append(b)
            hashes.append(parent)
        return blocks, hashes

    # -- internals: leaving ----------------------------------------------------------------

    def _drop_gpu(self, rec: RequestPages) -> None:
        """Return the request's resident and hot leases (transfer pins stay with their transfers)."""
        self._policy.forget(rec)
        leased: list[int] = []
        for p, blocks in enumerate(rec.gpu):
            if blocks is None:
                continue
            if rec.state[p] in LEASED_STATES:
                leased.extend(blocks)
            rec.gpu[p] = None
        if leased:
            self._gpu.release(leased)
        if rec.hot is not None:
            self._gpu.release(rec.hot)
            rec.hot = None
        rec.restore_page = -1
        rec.forget_releasable()
