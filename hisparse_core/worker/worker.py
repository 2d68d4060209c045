"""`HiSparseWorker`: the worker-side half of hisparse, built only on the backend interfaces.

It owns, for one worker process (one tensor-parallel rank):

- the host pool, created through the backend and released at `shutdown`;
- one `CacheRuntime` per `CacheGroup`, bound to its device caches and host-pool layer views;
- the transfer engine that runs each step's `OffloadCommand`;
- the residency tables (int32, on the backend's device) that `ResidencyUpdate`s write;
- a tracker of every transfer's submission, enqueue and completion.

It never sees a request id: commands carry transfer ids and physical coordinates only, and the
acknowledgements it returns (`WorkerMetadata`) name transfer ids and host blocks.

Per step, in this order::

    worker.start_step(command)   # before the forward: residency updates, recycled host blocks,
                                 # host block copies, restores and spills with after_forward=False
    ... forward (writes the step's rows into the device caches) ...
    worker.after_forward()       # row mirrors of written rows, then after_forward page spills
    meta = worker.build_metadata()   # poll the engine; each id reported once

Tensor parallelism: with `share_host_pool=True`, `world_size > 1` and a backend that declares
`Capability.SHARED_HOST_POOL`, every rank maps one physical pool (rank 0 creates and writes it;
the engine of a peer rank acknowledges without copying). Otherwise each rank gets a private pool
of the same logical capacity, and the log line says why.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hisparse_core.backend import Backend, Capability, check_capabilities
from hisparse_core.capacity import check_host_pool
from hisparse_core.errors import InvalidInputError, ProtocolError
from hisparse_core.host_pool import HostPool, HostPoolSpec
from hisparse_core.runtime import CacheRuntime, RuntimeStats
from hisparse_core.transfer import TransferEngine, TransferProgress
from hisparse_core.types import OffloadCommand, PageTransfer, RowMirror, WorkerMetadata
from hisparse_core.worker.groups import CacheGroup, check_groups, host_blocks_for_budget, host_layer_ranges
from hisparse_core.worker.residency import ResidencyTables
from hisparse_core.worker.tracker import Acknowledgements, TransferTracker

logger = logging.getLogger(__name__)

_GIB = float(1 << 30)


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """What one worker observed since the previous `take_stats` call (counters), plus levels.

    `hits`/`misses` are hot-buffer lookups (sparse decode), `resident` entries served from
    resident pages, `h2d_bytes`/`d2h_bytes` bytes moved between host pool and device over every
    layer (gathers, restores / mirrors, spills). `pending_transfers` and the pool sizes are levels.
    """

    resident: int
    hits: int
    misses: int
    h2d_bytes: int
    d2h_bytes: int
    pending_transfers: int
    host_pool_blocks: int
    host_pool_bytes: int


@dataclass(slots=True)
class _AfterForward:
    mirrors: tuple[RowMirror, ...]
    pages: tuple[PageTransfer, ...]


class HiSparseWorker:
    """Worker-side host pool, runtimes and transfers of one worker process.

    :param backend: the backend instance (e.g. from `hisparse_core.registry.select_backend`).
    :param groups: one `CacheGroup` per runtime; all share one block size and row format.
    :param host_pool_bytes: logical host-cache budget per data-parallel replica, rounded down to
        whole blocks; or
    :param num_host_blocks: the exact number of host blocks (give exactly one of the two).
    :param rank, world_size: this worker's tensor-parallel rank.
    :param share_host_pool: map one physical pool across the ranks where the backend can.
    :param pool_name: the name every rank agrees on for a shared pool (required when sharing).
    :param not_shared_because: with `share_host_pool` false, why the caller decided against a
        shared pool (the start-up line says it; default "sharing not requested").

    The pool and the runtimes are created here; `register_caches` binds them to the device caches
    and builds the transfer engine. Construction failures release what was already allocated.
    """

    def __init__(self, backend: Backend, groups: Sequence[CacheGroup], *, host_pool_bytes: int | None = None,
                 num_host_blocks: int | None = None, rank: int = 0, world_size: int = 1,
                 share_host_pool: bool = False, pool_name: str | None = None,
                 not_shared_because: str | None = None) -> None:
        if not isinstance(backend, Backend):
            raise InvalidInputError(f"backend must be a hisparse_core.Backend, got {type(backend).__name__}")
        self._backend = backend
        self._groups = check_groups(groups)
        check_capabilities(backend, [g.config for g in self._groups])
        self._layer_ranges = host_layer_ranges(self._groups)
        first = self._groups[0].config
        num_layers = sum(g.config.num_layers for g in self._groups)
        if (host_pool_bytes is None) == (num_host_blocks is None):
            raise InvalidInputError(
                f"give exactly one of host_pool_bytes={host_pool_bytes!r} and num_host_blocks={num_host_blocks!r}")
        if num_host_blocks is None:
            assert host_pool_bytes is not None
            num_host_blocks = host_blocks_for_budget(host_pool_bytes, num_layers, first.block_size, first.row_format)
        shared, why = self._sharing(share_host_pool, world_size, pool_name, not_shared_because)
        self._spec = HostPoolSpec(num_layers=num_layers, num_blocks=num_host_blocks, block_size=first.block_size,
                                  row_format=first.row_format, shared=shared, name=pool_name if shared else None,
                                  rank=rank if shared else 0, world_size=world_size if shared else 1)
        self._rank, self._world_size = rank, world_size
        check_host_pool(self._spec)  # backends check too; this covers one that would just allocate
        self._pool: HostPool | None = backend.create_host_pool(self._spec)
        try:
            self._runtimes: tuple[CacheRuntime, ...] = tuple(backend.create_runtime(g.config) for g in self._groups)
            self._residency = self._make_residency_tables()
        except BaseException:
            self._pool.release()
            self._pool = None
            raise
        self._engine: TransferEngine | None = None
        self._tracker = TransferTracker()
        self._after: _AfterForward | None = None
        self._in_step = False
        self._steps = 0
        self._shut_down = False
        logger.info(
            "hisparse worker rank %d/%d: backend %r on %s; host pool %d blocks x %d layers x %d rows x %d B = "
            "%.3f GiB (%s: %s); %d cache group(s): %s",
            rank, world_size, backend.name, backend.device, num_host_blocks, num_layers, first.block_size,
            first.row_format.row_bytes, self._spec.nbytes / _GIB, "shared" if shared else "private", why,
            len(self._groups), ", ".join(f"{g.name or i}[{g.config.num_layers} layers, resident group "
                                         f"{g.resident_group}]" for i, g in enumerate(self._groups)))

    # ----------------------------------------------------------------- construction helpers

    def _sharing(self, requested: bool, world_size: int, pool_name: str | None,
                 not_shared_because: str | None) -> tuple[bool, str]:
        if not requested:
            return False, not_shared_because or "sharing not requested"
        if world_size <= 1:
            return False, "single rank"
        if Capability.SHARED_HOST_POOL not in self._backend.capabilities:
            return False, f"backend {self._backend.name!r} lacks capability {Capability.SHARED_HOST_POOL!r}"
        if not pool_name:
            raise InvalidInputError("share_host_pool=True needs pool_name, the name every rank agrees on")
        return True, f"one physical pool for {world_size} ranks, rank 0 writes"

    def _make_residency_tables(self) -> ResidencyTables:
        num_resident = max(g.resident_group for g in self._groups) + 1
        shapes = {(g.config.max_requests, g.config.max_pages) for g in self._groups}
        if len(shapes) != 1:
            raise InvalidInputError(
                f"cache groups disagree on (max_requests, max_pages): {sorted(shapes)}; expected one shape, "
                "since residency tables are indexed by the same state rows and pages")
        (max_requests, max_pages), = shapes
        return ResidencyTables(num_resident, max_requests, max_pages, self._backend.device)

    # ----------------------------------------------------------------- properties

    @property
    def backend(self) -> Backend:
        return self._backend

    @property
    def groups(self) -> tuple[CacheGroup, ...]:
        return self._groups

    @property
    def host_pool_spec(self) -> HostPoolSpec:
        return self._spec

    @property
    def host_pool(self) -> HostPool:
        if self._pool is None:
            raise InvalidInputError("the host pool was released by shutdown()")
        return self._pool

    @property
    def runtimes(self) -> tuple[CacheRuntime, ...]:
        return self._runtimes

    @property
    def registered(self) -> bool:
        return self._engine is not None

    @property
    def pending_transfers(self) -> int:
        return self._tracker.pending_transfers

    def residency_table(self, resident_group: int = 0) -> torch.Tensor:
        """The `[max_requests, max_pages]` int32 residency table of one resident group."""
        return self._residency.table(resident_group)

    def host_layer_views(self, group: int) -> list[torch.Tensor]:
        """The host-pool layer views group `group` is bound to."""
        return [self.host_pool.layer_view(layer) for layer in self._layer_ranges[group]]

    # ----------------------------------------------------------------- registration

    def register_caches(self, device_layers: Sequence[Sequence[torch.Tensor]]) -> None:
        """Bind each group's runtime to its device caches and host views; build the engine.

        `device_layers[i][l]` is layer l of group i: `[num_device_blocks, block_size, width]` of
        the group's row format, owned by the engine's cache manager.
        """
        self._require_live()
        if self._engine is not None:
            raise ProtocolError("register_caches was already called; the caches are bound once")
        if isinstance(device_layers, (str, bytes)) or not isinstance(device_layers, Sequence) \
                or len(device_layers) != len(self._groups):
            got = len(device_layers) if isinstance(device_layers, Sequence) else type(device_layers).__name__
            raise InvalidInputError(f"device_layers has {got} entries; expected one list per cache group "
                                    f"({len(self._groups)})")
        for i, (group, layers) in enumerate(zip(self._groups, device_layers, strict=False)):
            if isinstance(layers, torch.Tensor) or not isinstance(layers, Sequence) \
                    or len(layers) != group.config.num_layers:
                got = len(layers) if isinstance(layers, Sequence) else type(layers).__name__
                raise InvalidInputError(f"device_layers[{i}] ({group.name or 'unnamed'}) has {got} layers; "
                                        f"expected {group.config.num_layers}")
        for i, (group, runtime, layers) in enumerate(zip(self._groups, self._runtimes, device_layers, strict=False)):
            runtime.bind(self.host_layer_views(i), list(layers), resident_group=group.resident_group)
        self._engine = self._backend.create_transfer_engine(self.host_pool, self._runtimes)
        logger.info("hisparse worker rank %d: %d runtime(s) bound; transfer engine %s ready",
                    self._rank, len(self._runtimes), type(self._engine).__name__)

    # ----------------------------------------------------------------- per step

    def start_step(self, command: OffloadCommand | None) -> None:
        """Run the before-forward part of a step's command and keep the rest for `after_forward`.

        Order: residency updates, invalidation of recycled host blocks in every runtime, host
        block copies, then page transfers with `after_forward=False` (restores and early spills)
        in command order. `None` (or an empty command) is a step without offload work.
        """
        engine = self._require_engine()
        if self._in_step:
            raise ProtocolError(
                f"start_step called for step {self._steps + 1} while step {self._steps} has not run "
                "after_forward(); expected start_step, forward, after_forward once per step")
        if command is not None and not isinstance(command, OffloadCommand):
            raise InvalidInputError(f"command must be an OffloadCommand or None, got {type(command).__name__}")
        self._steps += 1
        self._in_step = True
        if command is None or command.is_empty():
            self._after = None
            return
        before = tuple(t for t in command.page_transfers if not t.after_forward)
        after = tuple(t for t in command.page_transfers if t.after_forward)
        bad = [t.transfer_id for t in after if t.restore]
        if bad:
            raise ProtocolError(f"transfers {bad} are restores marked after_forward; a restore feeds this step's "
                                "forward and must have after_forward=False")
        self._residency.apply(command.residency_updates)
        if command.recycled_host_blocks:
            for runtime in self._runtimes:
                runtime.invalidate_host_blocks(command.recycled_host_blocks)
        if command.host_block_copies:
            self._submit_host_copies(engine, command)
        if before:
            self._submit_pages(engine, before)
        self._after = _AfterForward(command.row_mirrors, after) if (command.row_mirrors or after) else None

    def after_forward(self) -> None:
        """Mirror the rows the forward wrote, then submit the after-forward page spills."""
        engine = self._require_engine()
        if not self._in_step:
            raise ProtocolError(f"after_forward called without start_step (last step: {self._steps})")
        work, self._after = self._after, None
        self._in_step = False
        if work is None:
            return
        if work.mirrors:
            engine.submit_row_mirrors(work.mirrors)
        if work.pages:
            self._submit_pages(engine, work.pages)

    # The tracker records a submission before the engine takes it: an interrupt (Ctrl-C) between
    # the two, or in the middle of the engine's copies, then leaves ids the tracker knows and the
    # engine may never report (pending at shutdown), not ids the engine reports and the tracker
    # never saw (a ProtocolError at shutdown that hid the interrupt). An engine that refuses a
    # submission with an error takes none of it, and the tracker forgets it again.

    def _submit_pages(self, engine: TransferEngine, transfers: Sequence[PageTransfer]) -> None:
        ids = [t.transfer_id for t in transfers]
        self._tracker.submit_transfers(ids)
        try:
            engine.submit_pages(transfers)
        except Exception:
            self._tracker.withdraw_transfers(ids)
            raise

    def _submit_host_copies(self, engine: TransferEngine, command: OffloadCommand) -> None:
        dsts = [c.dst_block_id for c in command.host_block_copies]
        self._tracker.submit_host_copies(dsts)
        try:
            engine.submit_host_copies(command.host_block_copies)
        except Exception:
            self._tracker.withdraw_host_copies(dsts)
            raise

    def wait_for_host_writes(self) -> None:
        """Order this rank's later reads of the host pool (the resolver's miss copies, direct reads
        of its layer views) after every host write submitted so far. On a peer of a shared pool
        those writes are rank 0's, and the wait is on rank 0's completion (a GPU-side wait on its
        IPC event on the NVIDIA backend); on a writer it orders behind its own copy stream. A no-op
        for a transfer engine without `wait_for_host_writes` (synchronous copies, a private pool)."""
        wait = getattr(self._require_engine(), "wait_for_host_writes", None)
        if wait is not None:
            wait()

    def build_metadata(self, *, wait: bool = False) -> WorkerMetadata:
        """Poll the engine (or, with `wait=True`, drain it) and report what became enqueued or
        completed since the last report. Each id is reported exactly once."""
        engine = self._require_engine()
        progress = engine.drain() if wait else engine.poll()
        ack = self._observe(progress)
        return WorkerMetadata.report(ack.enqueued, ack.completed, ack.completed_host_copies)

    def _observe(self, progress: TransferProgress) -> Acknowledgements:
        if not isinstance(progress, TransferProgress):
            raise ProtocolError(f"backend {self._backend.name!r} poll/drain returned {type(progress).__name__}; "
                                "expected TransferProgress")
        return self._tracker.observe(progress, backend=self._backend.name)

    # ----------------------------------------------------------------- state and stats

    def reset_state(self, state_rows: Sequence[int] | None = None) -> None:
        """Forget hot contents and residency of the given request state rows (default: all)."""
        self._require_live()
        for runtime in self._runtimes:
            runtime.reset_state(None if state_rows is None else list(state_rows))
        self._residency.reset(state_rows)

    def take_stats(self) -> WorkerStats:
        """Counters since the previous call (then zeroed), plus current levels. Reads device
        counters, so call it off the decode path."""
        self._require_live()
        total = RuntimeStats()
        for runtime in self._runtimes:
            s = runtime.stats()
            total = RuntimeStats(total.resident + s.resident, total.hits + s.hits, total.misses + s.misses,
                                 total.h2d_bytes + s.h2d_bytes, total.d2h_bytes + s.d2h_bytes)
            runtime.reset_stats()
        return WorkerStats(total.resident, total.hits, total.misses, total.h2d_bytes, total.d2h_bytes,
                           self._tracker.pending_transfers, self._spec.num_blocks, self._spec.nbytes)

    # ----------------------------------------------------------------- teardown

    def shutdown(self) -> WorkerMetadata:
        """Wait for every submitted transfer, release the host pool, and return the last
        acknowledgements (which nobody may read once the engine is gone). Idempotent."""
        if self._shut_down:
            return WorkerMetadata()
        self._shut_down = True
        meta = WorkerMetadata()
        try:
            if self._engine is not None:
                meta_ack = self._observe(self._engine.drain())
                meta = WorkerMetadata.report(meta_ack.enqueued, meta_ack.completed, meta_ack.completed_host_copies)
        finally:
            pool, self._pool = self._pool, None
            if pool is not None:
                pool.release()
            self._engine = None
            # The runtimes hold views of the pool and the device caches (bound by register_caches):
            # the memory goes with the last of them, so a shut-down worker keeps none.
            self._runtimes = ()
        logger.info("hisparse worker rank %d shut down after %d steps: %d transfers submitted, %d completed, "
                    "%d still pending; host pool released", self._rank, self._steps,
                    self._tracker.totals.submitted, self._tracker.totals.completed, self._tracker.pending_transfers)
        return meta

    def _require_live(self) -> None:
        if self._shut_down:
            raise ProtocolError("this HiSparseWorker was shut down")

    def _require_engine(self) -> TransferEngine:
        self._require_live()
        if self._engine is None:
            raise ProtocolError("register_caches() must run before the first step")
        return self._engine
