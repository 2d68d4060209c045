"""`NvidiaRuntime`: the per-cache runtime on a CUDA device.

State and workspaces are PyTorch tensors on the device; the work is done by the NVRTC-built
kernels under `cuda/`, launched through the driver on PyTorch's current stream:

- `hisparse_resolve` (resolve.cu): one thread block per request group resolves the group's
  union against the request's hot map and exact LRU order, assigns victims, writes the miss plan,
  the output rows and the counters. Entries are first checked against a per-position slot hint
  (`_pos_slot`, kept by the kernel), and only the rest are hashed; a group with no host entry
  exits before touching its LRU (the resident fast path). Compiled for the runtime's geometry,
  and again as a thread-block cluster for small batches: there the group's block gathers only a
  share of the hints, and the other blocks of its cluster gather the rest into its shared memory.
- `hisparse_gather_plan` (copy.cu): copies the plan's host rows into their hot rows for one or
  more layers, reading the registered host pool directly (zero-copy 16-byte loads). A persistent
  grid takes 16 KB chunks of the plan from a ticket counter, request by request, so the reads in
  flight stay within one or two requests' host regions and no block's placement sets the pace.
  Right after a resolve it is launched while the resolver runs and copies each request's plan as
  soon as the resolver publishes it (`plan_ready`). Where the resolver leaves too few free SMs to
  start its whole grid (batch 128 on an H200), it asks for the shared memory that keeps one block
  an SM, and waits for the whole resolver instead.
- `hisparse_gather_spec` (copy.cu): the copy that follows a resolve of a small batch. It starts
  reading the likely misses' host rows while the resolver still runs, then writes exactly the
  resolver's misses (its miss mask and output rows), loading any it did not guess. A larger batch
  is split: this copy for as many first rows as its blocks fit on the SMs the resolver leaves
  free, and the plan copy, following the resolver, for the rest. `hisparse_gather_spec_entries`
  (above one row) classifies entries first and reads early only the likely misses' slots, so a
  step without misses is one small wave; the blocks of either that can hold no miss leave without
  waiting for the resolver (the resolver's victims flag). `HISPARSE_SPEC_KERNEL` picks one.
- `hisparse_copy_rows` (copy.cu): batched row mirrors and page spills (device to host), page
  restores (host to device) and host block copies, for every layer in one launch.
- maintain.cu: invalidation of written rows and recycled host blocks, and state resets.

`resolve(validate=False)` and the plan copies read no value on the host and launch fixed-shape
kernels, so they can be captured in a CUDA graph and replayed with new inputs in the same tensors.
"""

from __future__ import annotations

import ctypes
import logging
import math
from collections.abc import Sequence

import numpy as np
import torch

from hisparse_core import copy_checks
from hisparse_core.checks import check_bind_arguments, check_int, check_ints, check_range
from hisparse_core.errors import InvalidInputError
from hisparse_core.geometry import RuntimeConfig
from hisparse_core.runtime import CacheRuntime, ResolveInputs, ResolveResult, RuntimeStats
from hisparse_core.types import HostBlockCopy, PageTransfer, RowMirror
from hisparse_nvidia import driver
from hisparse_nvidia.host_pool import device_address_of_host
from hisparse_nvidia.kernels import (
    ENV_RESOLVE_CLUSTER,
    ENV_RESOLVE_SMEM,
    MAINTAIN_BUILD,
    MAINTAIN_THREADS,
    RESOLVE_SMEM_BUDGET,
    CopyShape,
    LoadedKernels,
    ResolverShape,
    cluster_width_allowed,
    resolve_cluster,
    resolver_shape,
)

# The runtime's variables and their parse functions live in settings.py (NvidiaBackend.check_settings
# reads them without importing the driver).
from hisparse_nvidia.settings import (
    ENV_GATHER_FOLLOW,
    ENV_GATHER_PER_SM,
    ENV_PREFETCH_GATHER_BLOCKS,
    ENV_SPEC_EARLY_EXIT,
    ENV_SPEC_GATHER,
    ENV_SPEC_KERNEL,
    ENV_SPEC_ROWS,
    ENV_SPEC_SPLIT,
    copy_switches,
    gather_blocks,
    gather_per_sm,
    prefetch_gather_blocks,
    spec_blocks_per_sm,
    spec_early_exit,
    spec_epb,
    spec_gather,
    spec_kernel,
    spec_rows_cap,
    spec_run,
)
from hisparse_nvidia.validation import check_shapes, check_tensor, check_values

logger = logging.getLogger(__name__)

_HOST, _DEVICE = 0, 1  # row kinds of hisparse_copy_rows
_SPEC_EPB_WHOLE, _SPEC_EPB_SPLIT = 32, 128  # HISPARSE_SPEC_EPB's defaults (settings.ENV_SPEC_EPB)
_STAT_H2D, _STAT_D2H = 3, 4
#: The plan copy keeps its batch rows in its shared memory (one int each, plus one).
_MAX_PLAN_ROWS = 12 * 1024 - 1


def _i32(v: int) -> ctypes.c_int32:
    return ctypes.c_int32(int(v))


def _i64(v: int) -> ctypes.c_int64:
    return ctypes.c_int64(int(v))


def _ptr(t: torch.Tensor | int) -> ctypes.c_void_p:
    return ctypes.c_void_p(t if isinstance(t, int) else t.data_ptr())


class NvidiaRuntime(CacheRuntime):
    """Hot maps, LRU orders, result workspace and counters of one index group on a CUDA device.

    Built by `NvidiaBackend.create_runtime(config)`; kernels are compiled (or loaded from the
    disk cache) and loaded here, so construction may take a second on the first run.
    """

    def __init__(self, config: RuntimeConfig, device: torch.device, *, arch: int, num_sms: int,
                 max_smem_per_block: int) -> None:
        if not isinstance(config, RuntimeConfig):
            raise InvalidInputError(f"config must be a RuntimeConfig, got {type(config).__name__}")
        self.config = config
        self._device = device
        self._num_sms = num_sms
        shape = resolver_shape(config)
        if shape.dynamic_smem + shape.static_smem > max_smem_per_block:
            raise InvalidInputError(
                f"RuntimeConfig(top_k={config.top_k}, rows_per_request={config.rows_per_request}, "
                f"hot_rows={config.hot_rows}, block_size={config.block_size}) needs "
                f"{shape.dynamic_smem + shape.static_smem} bytes of shared memory per block; the device "
                f"allows {max_smem_per_block}: lower rows_per_request * top_k or hot_rows")
        r, h, b, k = config.max_requests, config.hot_rows, config.max_batch_rows, config.top_k
        with torch.cuda.device(device):
            self._hot_map = torch.full((r, h), -1, dtype=torch.int32, device=device)
            self._lru = torch.arange(h, dtype=torch.int16, device=device).repeat(r, 1)
            # The slot last filled for each logical position: a hint the resolver checks, never trusts.
            self._pos_slot = torch.full((r, config.max_pages * config.block_size), -1, dtype=torch.int16,
                                        device=device)
            self._result = ResolveResult(
                rows=torch.full((b, k), -1, dtype=torch.int32, device=device),
                valid_counts=torch.zeros(b, dtype=torch.int32, device=device),
                plan_host=torch.full((b, k), -1, dtype=torch.int32, device=device),
                plan_device=torch.full((b, k), -1, dtype=torch.int32, device=device),
                plan_counts=torch.zeros(b, dtype=torch.int32, device=device),
            )
            self._stats = torch.zeros(5, dtype=torch.int64, device=device)
            # Bit r * top_k + j: entry j of batch row r was a miss of the last resolve with misses in
            # its group (written by the resolver when top_k % 32 == 0, read by the speculative gather).
            self._miss_mask = torch.zeros(max(1, b * k // 32), dtype=torch.int32, device=device)
            # Per batch row, the plan count the resolver publishes for a plan copy that follows it
            # (-1 while pending); and the plan copy's ticket counter and blocks-done counter.
            self._plan_ready = torch.zeros(b, dtype=torch.int32, device=device)
            self._gather_work = torch.zeros(2, dtype=torch.int32, device=device)
            # Per state row: 1 while the last resolve of its group may have refilled its slots (the
            # resolver's flag that lets the speculative gather's blocks without a miss leave early).
            self._victims = torch.zeros(r, dtype=torch.int32, device=device)
        driver.ensure_context(device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._shape = shape
        self._k_resolve = LoadedKernels.module(index, arch, shape.build).function("hisparse_resolve")
        self._k_resolve.allow_dynamic_smem(shape.dynamic_smem)
        logger.info("nvidia runtime: resolver built for top_k=%d hot_rows=%d block_size=%d rows_per_request=%d "
                    "max_pages=%d: %d threads per block, %d registers a thread, %d bytes of shared memory; page-table "
                    "rows %s (read whole up to %d bytes of shared memory, %s); position hints take %.1f MiB",
                    config.top_k, config.hot_rows, config.block_size, config.rows_per_request, config.max_pages,
                    shape.threads, self._k_resolve.registers, shape.dynamic_smem + shape.static_smem,
                    "in shared memory" if shape.tables_in_smem else "gathered per entry", RESOLVE_SMEM_BUDGET,
                    ENV_RESOLVE_SMEM,
                    self._pos_slot.numel() * 2 / 2**20)
        # The cluster build, for batches whose clusters all run at once (`_cluster_rows`).
        cshape, why = self._cluster_shape(arch, num_sms, max_smem_per_block)
        self._cluster = 1
        self._k_resolve_cluster = None
        self._cluster_smem = self._cluster_rows = 0
        if cshape is not None:
            self._cluster = cshape.cluster
            kernel = LoadedKernels.module(index, arch, cshape.build).function("hisparse_resolve")
            kernel.allow_dynamic_smem(cshape.dynamic_smem)
            fits = kernel.max_active_clusters(self._cluster, cshape.threads, cshape.dynamic_smem)
            self._cluster_rows = min(num_sms // self._cluster, fits)
            if self._cluster_rows > 0:
                self._k_resolve_cluster, self._cluster_smem = kernel, cshape.dynamic_smem
            else:
                why = f"no cluster of {self._cluster} such blocks fits on this device"
                self._cluster = 1
        logger.info("nvidia runtime: resolver %s",
                    f"runs {self._cluster} blocks per group (a thread-block cluster; the others gather position "
                    f"hints for the first) for batches of up to {self._cluster_rows} rows, one block per group "
                    f"beyond" if self._cluster > 1 else f"runs one block per group ({why})")
        self._copy_shape = CopyShape.from_env(config.row_format.row_bytes)
        if b > _MAX_PLAN_ROWS or b * k * self._copy_shape.slots_per_row >= 2**32:
            raise InvalidInputError(
                f"RuntimeConfig(max_batch_rows={b}, top_k={k}) is too large for the plan copy: it allows at most "
                f"{_MAX_PLAN_ROWS} batch rows and max_batch_rows * top_k < "
                f"{2**32 // self._copy_shape.slots_per_row}")
        copy_mod = LoadedKernels.module(index, arch, self._copy_shape.build)
        maint_mod = LoadedKernels.module(index, arch, MAINTAIN_BUILD)
        self._k_gather = copy_mod.function("hisparse_gather_plan")
        self._k_copy = copy_mod.function("hisparse_copy_rows")
        self._spec_kernel = spec_kernel()
        self._k_gather_spec = copy_mod.function("hisparse_gather_spec")
        self._k_gather_entries = copy_mod.function("hisparse_gather_spec_entries")
        # None: 32 entries a block where the speculative gather takes the whole batch, 128 where it
        # takes the first rows of a split batch (the sizes measured in issue 28's sweep).
        self._spec_epb: int | None = spec_epb()
        self._spec_run = spec_run()
        # Blocks of the slot kernel one SM holds at once (its registers decide): how many first rows
        # of a larger batch the speculative gather takes (`_split_rows`), whichever kernel runs.
        self._spec_per_sm = copy_mod.function("hisparse_gather_spec").max_active_blocks(self._copy_shape.threads, 0)
        self._k_inval_written = maint_mod.function("hisparse_invalidate_written")
        self._k_inval_blocks = maint_mod.function("hisparse_invalidate_blocks")
        self._k_reset = maint_mod.function("hisparse_reset_rows")
        self._last_rows = 0  # batch rows of the last resolve (rows of the plan to copy)
        self._overlap, self._follow, split = copy_switches()
        self._early_exit = spec_early_exit()
        self._spec_rows, why = self._speculative_rows(num_sms)
        # Larger batches: the speculative gather for as many first rows as its blocks fit beside the
        # resolver's (`_split_rows`), and the plan copy, following the resolver, for the rest.
        self._split = split and self._spec_rows > 0 and self._follow
        self._gather_blocks = gather_blocks(num_sms)
        self._prefetch_blocks = prefetch_gather_blocks(num_sms)
        # Blocks of the plan copy one SM holds; and the padded shared memory that limits them (0: none).
        self._gather_fit = self._k_gather.max_active_blocks(self._copy_shape.threads, (b + 1) * 4)
        self._gather_smem, self._gather_per_sm = self._gather_shared_memory(max_smem_per_block)
        logger.info("nvidia runtime: %s", self._describe_copies(why))
        self._prof: torch.Tensor | None = None
        self._trace: torch.Tensor | None = None
        self._host: list[torch.Tensor] = []
        self._dev: list[torch.Tensor] = []
        self._host_bases: torch.Tensor | None = None
        self._dev_bases: torch.Tensor | None = None
        self._dev_strides: torch.Tensor | None = None
        self._host_rows = 0
        self._dev_rows = 0
        self._resident_group = 0

    # ----------------------------------------------------------------- storage

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def bound(self) -> bool:
        return bool(self._host)

    @property
    def host_rows(self) -> int:
        self._require_bound()
        return self._host_rows

    @property
    def num_device_blocks(self) -> int:
        self._require_bound()
        return self._dev[0].shape[0]

    @property
    def resident_group(self) -> int:
        return self._resident_group

    def bind(self, host_layers: Sequence[torch.Tensor], device_layers: Sequence[torch.Tensor],
             *, resident_group: int = 0) -> None:
        """Attach the host pool's layer views and the device caches (see `CacheRuntime.bind`).

        Host views must be registered host memory (`NvidiaBackend.create_host_pool`, or PyTorch
        pinned memory) with contiguous rows. Device caches are `[num_blocks, block_size, width]`
        with contiguous rows inside a block; blocks may be strided (a packed multi-layer slab), as
        long as the stride keeps rows 16-byte aligned.
        """
        cfg = self.config
        fmt, n = cfg.row_format, cfg.num_layers
        check_bind_arguments(host_layers, device_layers, n, resident_group, bound=self.bound)
        cpu = torch.device("cpu")
        host_bases: list[int] = []
        dev_bases: list[int] = []
        dev_strides: list[int] = []
        rows = blocks = None
        for layer in range(n):
            h = host_layers[layer]
            d = device_layers[layer]
            check_tensor(f"host_layers[{layer}]", h, (rows, fmt.width), fmt.dtype, cpu)
            rows = h.shape[0]
            if rows == 0 or rows % cfg.block_size:
                raise InvalidInputError(
                    f"host_layers[{layer}] has {rows} rows; expected a positive multiple of "
                    f"block_size={cfg.block_size}")
            addr = device_address_of_host(h.data_ptr(), h.numel() * h.element_size())
            if addr is None:
                raise InvalidInputError(
                    f"host_layers[{layer}] is not registered host memory; allocate the pool with "
                    f"NvidiaBackend.create_host_pool (or pin it) so the GPU can read it directly")
            host_bases.append(addr)
            if not isinstance(d, torch.Tensor):
                raise InvalidInputError(f"device_layers[{layer}] must be a torch.Tensor, got {type(d).__name__}")
            if d.dtype != fmt.dtype or d.device != self._device or d.dim() != 3 or \
                    tuple(d.shape[1:]) != (cfg.block_size, fmt.width) or (blocks is not None and d.shape[0] != blocks):
                want = f"[{'*' if blocks is None else blocks}, {cfg.block_size}, {fmt.width}]"
                raise InvalidInputError(
                    f"device_layers[{layer}] is {d.dtype} {list(d.shape)} on {d.device}; expected {fmt.dtype} "
                    f"{want} on {self._device}")
            blocks = d.shape[0]
            es = d.element_size()
            if blocks == 0:
                raise InvalidInputError(f"device_layers[{layer}] has 0 blocks; expected at least 1")
            if d.stride(2) != 1 or d.stride(1) != fmt.width or (d.stride(0) * es) % 16 or d.data_ptr() % 16:
                raise InvalidInputError(
                    f"device_layers[{layer}] has strides {d.stride()} at address {d.data_ptr():#x}; expected "
                    f"contiguous 16-byte aligned rows within each block")
            dev_bases.append(d.data_ptr())
            dev_strides.append(d.stride(0) * es)
        assert rows is not None and blocks is not None
        if rows * fmt.row_bytes // 16 >= 2**32 or blocks * cfg.block_size >= 2**31:
            raise InvalidInputError("host or device caches exceed the 2^31-row addressing limit")
        self._host = list(host_layers)
        self._dev = list(device_layers)
        self._host_rows = rows
        self._dev_rows = blocks * cfg.block_size
        with torch.cuda.device(self._device):
            self._host_bases = torch.tensor(host_bases, dtype=torch.int64, device=self._device)
            self._dev_bases = torch.tensor(dev_bases, dtype=torch.int64, device=self._device)
            self._dev_strides = torch.tensor(dev_strides, dtype=torch.int64, device=self._device)
        self._resident_group = resident_group

    def _require_bound(self) -> None:
        if not self._host:
            raise InvalidInputError("runtime is not bound; call bind(host_layers, device_layers) first")

    def _stream(self) -> int:
        driver.ensure_context(self._device)
        return torch.cuda.current_stream(self._device).cuda_stream

    # ----------------------------------------------------------------- resolve

    def resolve(self, inputs: ResolveInputs, *, gather: bool = True, validate: bool = True) -> ResolveResult:
        self._require_bound()
        cfg = self.config
        b = check_shapes(inputs, cfg, self._device)
        if validate:
            check_values(inputs, cfg, num_device_blocks=self.num_device_blocks,
                         host_blocks=self._host_rows // cfg.block_size)
        for name in ("topk", "source_table", "resident_table"):  # read with vector loads of up to 16 bytes
            if getattr(inputs, name).data_ptr() % 16:
                raise InvalidInputError(f"inputs.{name} starts at {getattr(inputs, name).data_ptr():#x}, an address "
                                        f"that is not 16-byte aligned; expected a tensor of its own (or a row slice)")
        out = self._result
        shape = self._shape
        # One block per row of the outputs; or a cluster per batch row, whose helpers also write
        # the rows past the batch.
        kernel, grid, smem = self._k_resolve, cfg.max_batch_rows, shape.dynamic_smem
        if self._k_resolve_cluster is not None and b <= self._cluster_rows:
            kernel, grid, smem = self._k_resolve_cluster, b * self._cluster, self._cluster_smem
        # The resolver's blocks of 1024 threads take an SM each (a cluster launch has `grid` of them,
        # the one-block launch b that do work; its padding blocks exit at once).
        spec_rows, plan_from, follow, pad = self._copy_choice(
            b, gather, max(0, self._num_sms - (grid if kernel is self._k_resolve_cluster else b)))
        kernel.launch(
            (grid, 1, 1), shape.threads, smem, self._stream(),
            [_ptr(inputs.topk), _ptr(inputs.row_state), _ptr(inputs.seq_lens), _ptr(inputs.source_table),
             _ptr(inputs.resident_table), _ptr(inputs.hot_table), _ptr(self._hot_map), _ptr(self._lru),
             _ptr(self._pos_slot), _ptr(self._miss_mask), _ptr(out.rows), _ptr(out.valid_counts), _ptr(out.plan_host),
             _ptr(out.plan_device), _ptr(out.plan_counts), _ptr(self._stats), _i32(b), _i32(cfg.max_batch_rows),
             _ptr(self._prof) if self._prof is not None else ctypes.c_void_p(0), _ptr(self._plan_ready),
             _i32(follow), self._victims_arg() if spec_rows else ctypes.c_void_p(0)],
            overlap_previous=self._overlap)
        self._last_rows = b
        if spec_rows:
            self._gather_spec(inputs, spec_rows)
        if plan_from is not None:
            self._gather(0, 1, follow=follow, row_begin=plan_from, pad=pad)
        return out

    @property
    def result(self) -> ResolveResult:
        return self._result

    def resolver_phase_cycles(self, inputs: ResolveInputs, *, gather: bool = False) -> list[int]:
        """Diagnostics: one resolve whose first block records `clock64()` at its phase boundaries.

        Returns the cycles since kernel start (after the wait for the previous kernel) at: 1, the
        group known (row states, top-k and lengths loaded); 2, the request's rows loaded into
        shared memory; 3, barrier 1; 4, barrier 2 (hints checked, candidates hashed); 5, barrier
        3 (LRU walk); 6, the new LRU order written (no misses: the outputs were written after
        barrier 2) or barrier 4 (misses flagged); 7, the misses assigned; 8, the end. -1 marks
        phases the call skipped (the resident fast path ends after 4). The call is a real resolve
        (state changes as usual); it synchronizes, so never use it on the decode path.
        """
        prof = torch.full((9,), -1, dtype=torch.int64, device=self._device)
        self._prof = prof
        try:
            self.resolve(inputs, gather=gather, validate=False)
        finally:
            self._prof = None
        clocks = prof.tolist()
        return [c - clocks[0] if c >= 0 else -1 for c in clocks[1:]]

    def plan_copy_trace(self, inputs: ResolveInputs | None = None) -> list[tuple[int, int, int, int, int]]:
        """Diagnostics: where and when each block of one plan copy ran.

        With `inputs`, a real resolve of them with its miss copy (`resolve(gather=True)`, state
        changes as usual); without, the plan copy of the last resolve into layer 0 (`gather_misses`).
        Returns per block of the plan copy's grid (SM, 16 KB chunks it copied, entry, first chunk,
        exit), the times in ns since the earliest block's entry (first chunk 0: it copied none). A
        batch the speculative gather takes whole launches no plan copy: the list is then empty. It
        synchronizes, so never use it on the decode path."""
        self._require_bound()
        trace = self.new_plan_copy_trace()
        self.trace_plan_copies(trace)
        try:
            if inputs is None:
                self._gather(0, 1)
            else:
                self.resolve(inputs, gather=True, validate=False)
        finally:
            self.trace_plan_copies(None)
        return self.read_plan_copy_trace(trace)

    def _trace_rows(self) -> int:
        return max(self._gather_blocks, self._prefetch_blocks)

    def new_plan_copy_trace(self) -> torch.Tensor:
        """A zeroed trace buffer for `trace_plan_copies`: [blocks of the larger plan-copy grid, 5] int64."""
        return torch.zeros((self._trace_rows(), 5), dtype=torch.int64, device=self._device)

    def trace_plan_copies(self, trace: torch.Tensor | None) -> None:
        """Diagnostics: every plan copy launched from now on (captured into a CUDA graph too) records
        its blocks into `trace` (from `new_plan_copy_trace`; each launch overwrites it); None stops.
        Read it with `read_plan_copy_trace` after the work has run. A graph that captured a traced
        launch writes the buffer on every replay: keep it alive as long as the graph."""
        if trace is not None:
            check_tensor("trace", trace, (self._trace_rows(), 5), torch.int64, self._device)
        self._trace = trace

    @staticmethod
    def read_plan_copy_trace(trace: torch.Tensor) -> list[tuple[int, int, int, int, int]]:
        """The records of a trace buffer (see `plan_copy_trace`); synchronizes with the device."""
        rows = [tuple(int(v) for v in r) for r in trace.tolist()]
        if not any(r[2] for r in rows):
            return []
        t0 = min(r[2] for r in rows)
        return [(sm, chunks, enter - t0, first - t0 if first else 0, done - t0)
                for sm, chunks, enter, first, done in rows]

    # ----------------------------------------------------------------- plan copies

    def prefetch(self, inputs: ResolveInputs) -> None:
        # The default's calls, with the plan copy on the prefetch's grid (HISPARSE_PREFETCH_GATHER_BLOCKS).
        grid = self._gather_blocks
        self._gather_blocks = self._prefetch_blocks
        try:
            super().prefetch(inputs)
        finally:
            self._gather_blocks = grid

    def gather_misses(self, layer: int = 0) -> None:
        self._require_bound()
        check_int("layer", layer, 0, self.config.num_layers)
        self._gather(layer, 1)

    def replay_plan(self, layers: Sequence[int] | None = None) -> None:
        self._require_bound()
        n = self.config.num_layers
        chosen = list(range(1, n)) if layers is None else check_ints("layers", layers, 0, n)
        # One launch per run of consecutive layers.
        start = 0
        while start < len(chosen):
            stop = start + 1
            while stop < len(chosen) and chosen[stop] == chosen[stop - 1] + 1:
                stop += 1
            self._gather(chosen[start], stop - start)
            start = stop

    def _layer_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The per-layer base and stride tables that `bind` built; every launch comes after `bind`."""
        host_bases, dev_bases, dev_strides = self._host_bases, self._dev_bases, self._dev_strides
        assert host_bases is not None and dev_bases is not None and dev_strides is not None
        return host_bases, dev_bases, dev_strides

    def _gather(self, first_layer: int, num_layers: int, *, follow: bool = False, row_begin: int = 0,
                pad: bool = False) -> None:
        """The plan copy of layers [first_layer, first_layer + num_layers) for the batch rows from
        `row_begin` on; `follow`: right behind the resolve that wrote the plan (or the speculative
        gather of its first rows), reading the counts it publishes as it goes; `pad`: with the
        shared memory that limits its blocks per SM (`HISPARSE_GATHER_PER_SM`)."""
        rows = self._last_rows - row_begin
        if rows <= 0 or num_layers == 0:
            return
        host_bases, dev_bases, dev_strides = self._layer_tables()
        cfg = self.config
        out = self._result
        counts = self._plan_ready if follow else out.plan_counts
        first, k = row_begin * 4, row_begin * cfg.top_k * 4  # byte offsets of the first row
        trace = self._trace
        self._k_gather.launch(
            (self._gather_blocks, 1, 1), self._copy_shape.threads, max((rows + 1) * 4, self._gather_smem if pad else 0),
            self._stream(),
            [_ptr(out.plan_host.data_ptr() + k), _ptr(out.plan_device.data_ptr() + k), _ptr(counts.data_ptr() + first),
             _i32(rows), _i32(cfg.top_k), _ptr(host_bases), _ptr(dev_bases), _ptr(dev_strides), _i32(first_layer),
             _i32(num_layers), _i32(cfg.block_size), _i64(self._host_rows), _i64(self._dev_rows), _ptr(self._stats),
             _ptr(self._gather_work), _i32(follow), ctypes.c_void_p(0) if trace is None else _ptr(trace)],
            overlap_previous=self._overlap)

    def _gather_spec(self, inputs: ResolveInputs, rows: int) -> None:
        """The plan copy of layer 0 right after the resolve of `rows` batch rows, started early."""
        host_bases, dev_bases, dev_strides = self._layer_tables()
        cfg = self.config
        out = self._result
        c = self._copy_shape
        entries = self._spec_kernel == "entries" or (self._spec_kernel == "auto" and rows > 1)
        extra: list[ctypes.c_int32] = []
        kernel = self._k_gather_spec
        if entries:
            kernel = self._k_gather_entries
            epb = self._spec_epb or (_SPEC_EPB_WHOLE if rows == self._last_rows else _SPEC_EPB_SPLIT)
            blocks = rows * -(-cfg.top_k // epb)  # every nb-th run of a row a block (copy.cu)
            extra = [_i32(epb), _i32(math.gcd(self._spec_run or epb, epb))]
        else:
            blocks = -(-rows * cfg.top_k * c.slots_per_row // (c.threads * c.unroll))
        kernel.launch(
            (blocks, 1, 1), c.threads, 0, self._stream(),
            [_ptr(inputs.topk), _ptr(inputs.row_state), _ptr(inputs.seq_lens), _ptr(inputs.source_table),
             _ptr(inputs.resident_table), _ptr(self._pos_slot), _ptr(self._hot_map), _ptr(out.rows),
             _ptr(out.plan_counts), _ptr(self._miss_mask), _i32(rows), _i32(cfg.top_k), _i32(cfg.block_size),
             _i32(cfg.max_pages), _i32(cfg.hot_rows), _ptr(host_bases), _ptr(dev_bases),
             _ptr(dev_strides), _i64(self._host_rows), _i64(self._dev_rows), _ptr(self._stats), self._victims_arg(),
             *extra],
            overlap_previous=True)

    def _victims_arg(self) -> ctypes.c_void_p:
        """The victims flags of the resolver and the speculative gather that follows it (null: no early
        exit). A resolve that no speculative gather follows gets null and leaves the flags as they are:
        a stale flag is harmless, since the next resolver sets its own before it refills a slot."""
        return _ptr(self._victims) if self._early_exit else ctypes.c_void_p(0)

    @property
    def launch_shape(self) -> dict[str, int | bool]:
        """The resolver's launch shape and options (for benchmarks and logs)."""
        s = self._shape
        c = self._copy_shape
        return {"threads": s.threads, "entries_per_thread": s.entries_per_thread, "lru_per_thread": s.lru_per_thread,
                "dynamic_smem": s.dynamic_smem, "tables_in_smem": s.tables_in_smem,
                "cluster_blocks": self._cluster, "cluster_max_batch": self._cluster_rows,
                "overlap_launch": self._overlap, "copy_threads": c.threads, "copy_unroll": c.unroll,
                "copy_load": c.load, "spec_max_batch": self._spec_rows, "gather_blocks": self._gather_blocks,
                "prefetch_gather_blocks": self._prefetch_blocks, "gather_follow": self._follow, "spec_split": self._split, "spec_blocks_per_sm": self._spec_per_sm,
                "spec_early_exit": self._early_exit, "spec_kernel": self._spec_kernel,
                "spec_entries_per_block": self._spec_epb or 0,
                "spec_run": self._spec_run,
                "resolve_registers": self._k_resolve.registers,
                "cluster_registers": self._k_resolve_cluster.registers if self._k_resolve_cluster is not None else 0,
                "plan_copy_registers": self._k_gather.registers, "plan_copy_per_sm": self._gather_fit,
                "plan_copy_padded_per_sm": self._gather_per_sm, "plan_copy_pad_smem": self._gather_smem}

    # ----------------------------------------------------------------- page and row copies

    def check_mirrors(self, mirrors: Sequence[RowMirror]) -> list[tuple[int, int, int]]:
        """Validate mirrors; returns `(device_row, host_row, num_rows)` per mirror."""
        self._require_bound()
        return copy_checks.check_mirrors(mirrors, resident_group=self._resident_group,
                                         block_size=self.config.block_size, device_rows=self._dev_rows,
                                         host_rows=self._host_rows)

    def check_pages(self, transfers: Sequence[PageTransfer], *, restore: bool | None) -> list[tuple[int, int]]:
        """Validate page transfers; returns `(device_block, host_block)` per transfer.

        `restore` is the direction every transfer must have (None: either)."""
        self._require_bound()
        return copy_checks.check_pages(transfers, restore=restore, resident_group=self._resident_group,
                                       device_blocks=self.num_device_blocks,
                                       host_blocks=self._host_rows // self.config.block_size)

    def check_host_copies(self, copies: Sequence[HostBlockCopy]) -> list[tuple[int, int]]:
        """Validate host block copies; returns `(src_block, dst_block)` per copy."""
        self._require_bound()
        return copy_checks.check_host_copies(copies, host_blocks=self._host_rows // self.config.block_size)

    def mirror_rows(self, mirrors: Sequence[RowMirror]) -> None:
        spans = self.check_mirrors(mirrors)
        pairs = [(src + o, dst + o) for src, dst, n in spans for o in range(n)]
        self._copy_pairs(pairs, _DEVICE, _HOST, _STAT_D2H)

    def spill_pages(self, transfers: Sequence[PageTransfer]) -> None:
        pages = self.check_pages(transfers, restore=False)
        self._copy_pairs(self._page_rows(pages, device_first=True), _DEVICE, _HOST, _STAT_D2H)

    def restore_pages(self, transfers: Sequence[PageTransfer]) -> None:
        pages = self.check_pages(transfers, restore=True)
        self._copy_pairs(self._page_rows(pages, device_first=False), _HOST, _DEVICE, _STAT_H2D)

    def copy_host_blocks(self, copies: Sequence[HostBlockCopy]) -> None:
        pairs = self.check_host_copies(copies)
        bs = self.config.block_size
        rows = [(s * bs + o, d * bs + o) for s, d in pairs for o in range(bs)]
        self._copy_pairs(rows, _HOST, _HOST, -1)

    def _cluster_shape(self, arch: int, num_sms: int, max_smem: int) -> tuple[ResolverShape | None, str]:
        """The resolver's cluster build for small batches (None: one block per group), and why not."""
        width = resolve_cluster()
        if width == 1:
            return None, f"{ENV_RESOLVE_CLUSTER}=1"
        if arch < 90:
            return None, f"thread-block clusters need sm_90 or newer, this GPU is sm_{arch}"
        if not cluster_width_allowed(self.config, width, self._shape.threads):
            return None, f"top_k={self.config.top_k} does not split into {width} shares of 8-hint pushes"
        if width > num_sms:
            return None, f"{num_sms} SMs"
        shape = resolver_shape(self.config, cluster=width)
        need = shape.dynamic_smem + shape.static_smem
        if need > max_smem:
            return None, f"the cluster build needs {need} bytes of shared memory per block; the device allows {max_smem}"
        return shape, ""

    def _speculative_rows(self, num_sms: int) -> tuple[int, str]:
        """The largest batch whose miss copy starts while the resolver runs (0: none), and why not."""
        k = self.config.top_k
        c = self._copy_shape
        per_sm = spec_blocks_per_sm()
        gather_on = spec_gather()  # read first: a bad value is said whatever else turns it off
        cap = spec_rows_cap()
        rows = per_sm * num_sms * c.threads * c.unroll // (k * c.slots_per_row)
        if k % 32:
            return 0, "top_k is not a multiple of 32"
        if not self._overlap:
            return 0, "programmatic dependent launch is off"
        if not gather_on:
            return 0, f"{ENV_SPEC_GATHER}=0"
        if rows == 0:
            return 0, "top_k is too large for one pass"
        if cap is not None:
            if cap == 0:
                return 0, f"{ENV_SPEC_ROWS}=0"
            rows = min(rows, cap)
        return rows, ""

    def _describe_copies(self, why: str) -> str:
        """Which miss copy follows a resolve, for the log; `why`: why there is no speculative gather."""
        pad = (f"; when the resolver leaves too few free SMs for all of them, {self._gather_per_sm} an SM "
               f"({self._gather_smem} bytes of shared memory a block, {ENV_GATHER_PER_SM}), after the whole resolver"
               if self._gather_smem else "")
        plan_copy = (f"a persistent grid of {self._gather_blocks} blocks ({self._prefetch_blocks} in a prefetch, "
                     f"{ENV_PREFETCH_GATHER_BLOCKS}; up to {self._gather_fit} an SM{pad}) that " +
                     ("copies each request's plan once the resolver has published it" if self._follow
                      else f"waits for the whole resolver ({ENV_GATHER_FOLLOW}=0)"))
        if not self._spec_rows:
            return f"miss copies after a resolve: {plan_copy} (no speculative gather: {why})"
        rest = (f"so for as many first rows as fit on the SMs the resolver leaves free ({self._spec_per_sm} blocks "
                f"to an SM), the other rows by {plan_copy}" if self._split
                else f"by {plan_copy} ({ENV_SPEC_SPLIT}=0 or {ENV_GATHER_FOLLOW}=0)")
        kernel = {"auto": "slots at 1 row, entries above", "entries": "entries", "slots": "slots"}[self._spec_kernel]
        early = (f"by {kernel}" + ("" if self._spec_kernel == "auto" else f", {ENV_SPEC_KERNEL}") +
                 ("; blocks that can hold no miss leave without waiting for the resolver" if self._early_exit
                  else f"; every block waits for the resolver ({ENV_SPEC_EARLY_EXIT}=0)"))
        return (f"miss copies after a resolve start while it runs for batches of up to {self._spec_rows} rows "
                f"({early}); larger batches {rest}")

    def _copy_choice(self, b: int, gather: bool, free_sms: int) -> tuple[int, int | None, bool, bool]:
        """The miss copy after the resolve of `b` rows that leaves `free_sms` SMs free: (rows the
        speculative gather copies from row 0, the row the plan copy starts at or None for none,
        whether the plan copy follows the resolver's published counts, whether its blocks are
        limited per SM: when the free SMs cannot start its whole grid beside the resolver). A plan
        copy so limited waits for the whole resolver instead of following it: its few early blocks
        copy little, and publishing the counts costs the resolver more than they gain (batch 128:
        -16 and -24 us at 137 misses a request, -3 and -4 us at 274, docs/gpu-validation.md)."""
        if not gather:
            return 0, None, False, False
        if b <= self._spec_rows:
            return b, None, False, False
        pad = self._gather_smem > 0 and free_sms * self._gather_fit < self._gather_blocks
        split = self._split_rows(b, free_sms) if self._split else 0
        if split:
            return split, split, True, pad
        return 0, 0, self._follow and not pad, pad

    def _gather_shared_memory(self, max_smem: int) -> tuple[int, int]:
        """(dynamic shared memory of a padded plan-copy launch, its blocks an SM then holds) for
        `HISPARSE_GATHER_PER_SM`: the least that keeps an SM to that many blocks; (0, the blocks an
        SM holds unpadded) where nothing is to be limited."""
        k = self._k_gather
        threads = self._copy_shape.threads
        base = (self.config.max_batch_rows + 1) * 4
        per_sm = gather_per_sm()
        fits = self._gather_fit
        if per_sm == 0 or per_sm >= fits:
            return 0, fits  # nothing to limit
        top = max_smem - k.static_smem  # the most dynamic shared memory a block may ask for
        k.allow_dynamic_smem(top)
        least = k.max_active_blocks(threads, top)
        if least > per_sm:
            raise InvalidInputError(f"{ENV_GATHER_PER_SM}={per_sm}: the plan copy's shared memory cannot limit an "
                                    f"SM to so few blocks ({least} fit with all of it)")
        lo, hi = base, top  # the least size at which at most per_sm blocks fit lies in (lo, hi]
        while hi - lo > 16:
            mid = (lo + hi) // 2
            if k.max_active_blocks(threads, mid) > per_sm:
                lo = mid
            else:
                hi = mid
        return hi, k.max_active_blocks(threads, hi)

    def _split_rows(self, b: int, free_sms: int) -> int:
        """Batch rows whose misses the speculative gather copies after the resolve of `b` rows that
        leaves `free_sms` SMs free (0: none, the plan copy takes them all). Only as many as its blocks
        fit at once on those SMs: a block that waits for an SM runs after the resolver, when the plan
        copy would have done the same work sooner, and the copy cannot start before every block of
        the speculative gather has."""
        c = self._copy_shape
        rows = free_sms * self._spec_per_sm * c.threads * c.unroll // (self.config.top_k * c.slots_per_row)
        rows = min(rows, self._spec_rows)
        return rows if 0 < rows < b else 0

    def _page_rows(self, pages: list[tuple[int, int]], *, device_first: bool) -> list[tuple[int, int]]:
        bs = self.config.block_size
        if device_first:
            return [(dev * bs + o, host * bs + o) for dev, host in pages for o in range(bs)]
        return [(host * bs + o, dev * bs + o) for dev, host in pages for o in range(bs)]

    def _copy_pairs(self, pairs: list[tuple[int, int]], src_kind: int, dst_kind: int, stat: int) -> None:
        """One launch copying rows `pairs` (source, destination) in every layer, on the current stream."""
        if not pairs:
            return
        host_bases, dev_bases, dev_strides = self._layer_tables()
        cfg = self.config
        host = torch.from_numpy(np.asarray(pairs, dtype=np.int32).reshape(-1, 2)).pin_memory()
        with torch.cuda.device(self._device):
            dev_pairs = host.to(self._device, non_blocking=True)
        n, layers = len(pairs), cfg.num_layers
        threads, slots = self._copy_shape.threads, self._copy_shape.slots_per_row
        if n * slots >= 2**32:
            raise InvalidInputError(f"{n} rows in one copy; at most {2**32 // slots - 1} are allowed")
        blocks = max(1, min(4 * self._num_sms, -(-n * slots // threads)))
        self._k_copy.launch(
            (max(1, blocks // layers), 1, layers), threads, 0, self._stream(),
            [_ptr(dev_pairs), _i32(n), _i32(src_kind), _i32(dst_kind), _ptr(host_bases),
             _ptr(dev_bases), _ptr(dev_strides), _i32(0), _i32(cfg.block_size),
             _i64(self._host_rows), _i64(self._dev_rows), _ptr(self._stats), _i32(stat),
             _i64(n * cfg.row_format.row_bytes)])

    # ----------------------------------------------------------------- hot state

    def invalidate_written_slots(self, state_rows: torch.Tensor, host_rows: torch.Tensor, *,
                                 validate: bool = True) -> None:
        """See `CacheRuntime.invalidate_written_slots`. `validate=False` skips the value checks
        (a host synchronization); out-of-range state rows are then ignored by the kernel."""
        self._require_bound()
        states = check_tensor("state_rows", state_rows, (None,), torch.int32, self._device)
        rows = check_tensor("host_rows", host_rows, (states.shape[0],), torch.int32, self._device)
        if validate:
            s_cpu, r_cpu = states.cpu(), rows.cpu()
            check_range("state_rows", s_cpu, -1, self.config.max_requests)
            check_range("host_rows (where state_rows >= 0)", r_cpu[s_cpu >= 0], 0, self._host_rows)
        if states.shape[0] == 0:
            return
        self._k_inval_written.launch(
            (states.shape[0], 1, 1), MAINTAIN_THREADS, 0, self._stream(),
            [_ptr(states), _ptr(rows), _ptr(self._hot_map), _i32(self.config.hot_rows),
             _i32(self.config.max_requests)])

    def invalidate_host_blocks(self, block_ids: Sequence[int]) -> None:
        self._require_bound()
        blocks = check_ints("block_ids", block_ids, 0, self._host_rows // self.config.block_size)
        if not blocks:
            return
        uniq = sorted(set(blocks))
        dev = torch.tensor(uniq, dtype=torch.int32).pin_memory().to(self._device, non_blocking=True)
        total = self.config.max_requests * self.config.hot_rows
        grid = max(1, min(8 * self._num_sms, -(-total // MAINTAIN_THREADS)))
        self._k_inval_blocks.launch(
            (grid, 1, 1), MAINTAIN_THREADS, 0, self._stream(),
            [_ptr(dev), _i32(len(uniq)), _ptr(self._hot_map), _i64(total), _i32(self.config.block_size)])

    def reset_state(self, state_rows: Sequence[int] | None = None) -> None:
        r = self.config.max_requests
        chosen = list(range(r)) if state_rows is None else check_ints("state_rows", state_rows, 0, r)
        if not chosen:
            return
        dev = torch.tensor(chosen, dtype=torch.int32).pin_memory().to(self._device, non_blocking=True)
        self._k_reset.launch((len(chosen), 1, 1), MAINTAIN_THREADS, 0, self._stream(),
                             [_ptr(dev), _ptr(self._hot_map), _ptr(self._lru), _i32(self.config.hot_rows)])

    def hot_state(self, state_row: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = check_int("state_row", state_row, 0, self.config.max_requests)
        torch.cuda.synchronize(self._device)  # work may sit on the transfer engine's stream
        return self._hot_map[q].cpu(), self._lru[q].to(torch.int32).cpu()

    # ----------------------------------------------------------------- counters

    def stats(self) -> RuntimeStats:
        torch.cuda.synchronize(self._device)  # copies on every stream have counted
        s = self._stats.tolist()
        return RuntimeStats(resident=s[0], hits=s[1], misses=s[2], h2d_bytes=s[3], d2h_bytes=s[4])

    def reset_stats(self) -> None:
        self._stats.zero_()
