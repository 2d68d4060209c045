"""The engine role for a transformers model: what the replay engine does for `hisparse run`, here
for real attention layers.

One `HiSparseEngine` per enabled model owns:

- a `SimpleGpuBlockPool` sized from the GPU KV budget (one block is one page of every sparse
  layer; resident pages and hot buffers are blocks of it);
- the real `HiSparseCoordinator` (host blocks, prefix identity, spill and release under the GPU
  budget) and the real `HiSparseWorker` with the selected backend: one `CacheRuntime` per index
  group, bound to device caches `[num_blocks, block_size, width]` of the row format `kv_rows`
  chooses (`kv_rows.py`: the model's dtype, or DeepSeek-V3.2's fp8 bytes);
- the persistent source and hot tables the resolver reads.

A model spread over several devices (`device_map`) gets one worker per device (`shards.py`):
each holds its layers' runtimes, device caches, tables and host pool, and runs the same command;
the coordinator counts their merged reports. Under tensor parallelism (`ranks.py`) the reports of
every rank are exchanged after each step, so every rank's coordinator decides the same.

A `Session` (`session.py`) is one batch of requests (one generate call): each batch row is a hisparse request
with its own state row and its own logical positions (left padding stripped). One model forward
is one engine step: `begin_step` (allocations, `schedule_step`, table updates,
`worker.start_step`) before the first layer and `end_step` (`after_forward`, `build_metadata`,
`update_from_workers`) after the last.

Assisted generation (`speculative_tokens` > 0): a forward of 2 to `speculative_tokens + 1` tokens
per row once every prompt is in the cache is a verification step. Its `B x S` query rows go to the
resolver in one call, the rows of a request consecutive and sharing its state row, so they resolve
the union of their top-k against that request's hot state (a host row two rows pick is copied once,
and no row's miss evicts a hot row another row of the step reads). `rollback` (the cache's `crop`)
then drops the rejected suffix: the requests' computed lengths and token ids go back, so the next
step rewrites those positions (its writes precede every read of them) and the coordinator mirrors
them again (it re-mirrors any row below what it mirrored and never seals a page holding a rejected
row); hot copies of their host rows are forgotten in every runtime.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from hisparse_core.backend import Backend
from hisparse_core.checks import as_index
from hisparse_core.coordinator import CoordinatorConfig, HiSparseCoordinator, SimpleGpuBlockPool, StepRequest
from hisparse_core.coordinator.ahead import StepAhead
from hisparse_core.coordinator.config import GIB
from hisparse_core.coordinator.tables import apply_table_updates
from hisparse_core.errors import CapacityError, InvalidInputError
from hisparse_core.geometry import MAX_HOT_ROWS, RuntimeConfig
from hisparse_core.replay.report import kv_place
from hisparse_core.residency import parse_resident_layers
from hisparse_core.runtime import CacheRuntime
from hisparse_core.types import OffloadCommand
from hisparse_core.worker import CacheGroup, HiSparseWorker
from hisparse_transformers.budgets import ceil_gib, check_budgets
from hisparse_transformers.families import DsaLayout
from hisparse_transformers.index_keys import check_key_format
from hisparse_transformers.kv_rows import LatentRows, check_row_kind
from hisparse_transformers.model_topk import ModelTopk
from hisparse_transformers.prefetch import NextGroupPrefetch
from hisparse_transformers.ranks import Ranks
from hisparse_transformers.session import Request, Session, StepState
from hisparse_transformers.shards import Placement, ReportMerger
from hisparse_transformers.tokens import LazyTokens, StagedIds

logger = logging.getLogger(__name__)

ACTIVE_TAIL_PAGES = 2


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rope_key(offset: int | None, request_id: str) -> bytes | None:
    """The prefix identity's extra key of a request whose first token is roped at `offset`: None
    (generate's logical positions) for 0, the offset otherwise, the request itself for None (its
    positions are not one offset: its pages are nobody else's)."""
    if offset == 0:
        return None
    return f"rope+{offset}".encode() if offset is not None else f"rope:{request_id}".encode()


def _numerics_key(device: torch.device) -> bytes | None:
    """The prefix identity's part for how the rows are computed: None at the model's own precision,
    the autocast dtype while `torch.autocast` is on for `device` (its products are rounded, so its
    rows differ from the model's own and must not be hits for a batch without it, nor the reverse)."""
    if not torch.is_autocast_enabled(device.type):
        return None
    return f"autocast:{torch.get_autocast_dtype(device.type)}".encode()


def _prefix_key(*parts: bytes | None) -> bytes | None:
    present = [p for p in parts if p is not None]
    return b"|".join(present) if present else None


def resident_groups(groups: Sequence[Sequence[int]], spec: str | Sequence[int], num_layers: int) -> list[int]:
    """The index groups `resident_layers` keeps resident: every listed layer in `[0, num_layers)`,
    whole groups only (a group's followers read the leader's rows), not every layer. Bad input is
    one `InvalidInputError` line naming `resident_layers`."""
    try:
        layers = parse_resident_layers(spec, num_layers)
    except InvalidInputError as exc:
        raise InvalidInputError(f"resident_layers={spec!r}: {exc}") from None
    if len(layers) == num_layers:
        raise InvalidInputError(f"resident_layers={list(layers)} keeps all {num_layers} layers resident; expected at "
                                "most all but one (all-resident: give every page the GPU budget instead)")
    chosen = [g for g, members in enumerate(groups) if any(x in layers for x in members)]
    for g in chosen:
        if not set(groups[g]) <= set(layers):
            raise InvalidInputError(f"resident_layers={list(layers)} splits index group {list(groups[g])}; expected "
                                    "whole index groups (its layers share one top-k and one resolve)")
    return chosen


def required_gpu_blocks(max_batch: int, hot_blocks: int, chunk_pages: int) -> int:
    """The smallest GPU pool an engine accepts.

    Per request: its hot buffer, the active tail, and the pages of the last three steps, which are
    not releasable yet (a page written in step k is sealed and spilled in k+1, acknowledged in k+2,
    releasable in k+3); plus the watermark (`pressure_watermark`). `chunk_pages`: most pages one
    request writes in a step.
    """
    return max_batch * (hot_blocks + ACTIVE_TAIL_PAGES + 3 * chunk_pages) + pressure_watermark(
        max_batch, hot_blocks, chunk_pages)


def _largest_batch(gpu_blocks: int, hot_blocks: int, chunk_pages: int, below: int) -> int:
    """The largest max_batch under `below` whose `required_gpu_blocks` fit `gpu_blocks` (0: none);
    the requirement grows with the batch, so a bisection finds it."""
    lo, hi = 0, below - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if required_gpu_blocks(mid, hot_blocks, chunk_pages) <= gpu_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo


def chunk_pages_for(prefill_chunk: int, max_context: int, block_size: int, spec_rows: int = 0) -> int:
    """The most pages one request writes in a step (`required_gpu_blocks`' `chunk_pages`): a
    prefill chunk or a verification step's `spec_rows`, never more than `max_context` tokens (no
    forward holds more), one page more where it straddles a page boundary."""
    return _cdiv(min(max(prefill_chunk, spec_rows), max_context), block_size) + 1


def pressure_watermark(max_batch: int, hot_blocks: int, chunk_pages: int) -> int:
    """Free GPU blocks below which the coordinator releases clean pages: one step's allocations of
    every request plus one hot buffer, since a request leases its hot buffer (from the free
    blocks) before its first page is released."""
    return max_batch * chunk_pages + hot_blocks


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Sizes of one engine, as `hisparse_transformers.enable` takes them (budgets in GiB)."""

    host_pool_gib: float
    gpu_kv_gib: float
    block_size: int = 64
    hot_rows: int | None = None
    max_batch: int = 8
    max_context: int = 4096
    prefill_chunk: int = 512
    speculative_tokens: int = 0     # most candidate tokens a verification step checks per request
    #: layers whose whole KV stays on the GPU (never through the host pool or a hot buffer)
    resident_layers: tuple[int, ...] = ()
    #: after each index group's decode resolve, run the next group's on its top-k (prefetch.py):
    #: True for every group, or the source groups whose successor is prefetched (a tuple of group
    #: indices; a group whose top-k barely repeats predicts its successor no better)
    prefetch_next_group: bool | tuple[int, ...] = False
    #: how HiSparseCache stores the indexer keys: "model" (the model's dtype) or "fp8" (index_keys.py)
    indexer_keys: str = "model"
    #: how the engine stores the latent rows, on the GPU and in the host pool: "model" or "fp8" (kv_rows.py)
    kv_rows: str = "model"

    def __post_init__(self) -> None:
        check_key_format(self.indexer_keys)
        check_row_kind(self.kv_rows)
        for name in ("host_pool_gib", "gpu_kv_gib"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
                raise InvalidInputError(f"{name} must be a positive number of GiB, got {v!r}")
        # Counts are any integral value (`as_index`: a numpy integer, a 0-dim integer tensor), stored
        # as plain ints; a bool or a float is refused.
        for name in ("block_size", "max_batch", "max_context", "prefill_chunk"):
            v = getattr(self, name)
            n = as_index(v)
            if n is None or n <= 0:
                raise InvalidInputError(f"{name} must be a positive int, got {v!r}")
            object.__setattr__(self, name, n)
        v = self.speculative_tokens
        n = as_index(v)
        if n is None or n < 0:
            raise InvalidInputError(f"speculative_tokens must be an int >= 0 (0: no assisted generation), got {v!r}")
        object.__setattr__(self, "speculative_tokens", n)
        pf = self.prefetch_next_group
        groups = [as_index(g) for g in pf] if isinstance(pf, tuple) else []
        if not isinstance(pf, bool) and not (isinstance(pf, tuple) and all(g is not None and g >= 0 for g in groups)
                                             and len(set(groups)) == len(groups)):
            raise InvalidInputError(f"prefetch_next_group must be True or False, or a tuple of distinct index groups "
                                    f"(ints >= 0) whose successor is prefetched, got {pf!r}")
        if isinstance(pf, tuple):
            object.__setattr__(self, "prefetch_next_group", tuple(groups))
        if self.hot_rows is not None:
            n = as_index(self.hot_rows)
            if n is None or n <= 0:
                raise InvalidInputError(f"hot_rows must be a positive int or None, got {self.hot_rows!r}")
            object.__setattr__(self, "hot_rows", n)

    @property
    def host_pool_bytes(self) -> int:
        return int(self.host_pool_gib * GIB)

    @property
    def gpu_kv_bytes(self) -> int:
        return int(self.gpu_kv_gib * GIB)


@dataclass(slots=True)
class EngineTotals:
    """Counters since the engine was built (the host-side ones; device counters come from the worker)."""

    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    prefill_host_rows: int = 0          # rows the prefill read straight from the host pool (all layers)
    pressure_waits: int = 0             # steps that waited for spills before allocating (pages did not fit)
    requests: int = 0
    prefix_hit_tokens: int = 0
    peak_blocks_per_request: float = 0.0          # leased GPU blocks (resident + hot) per running request
    peak_all_resident_blocks_per_request: float = 0.0   # the same requests' pages, all resident
    peak_indexer_bytes_per_request: float = 0.0
    peak_context: int = 0
    verify_steps: int = 0               # steps that resolved several rows per request as one union
    verify_rows: int = 0                # query rows of those steps (candidates and the token before them)
    rollbacks: int = 0                  # crops that dropped a rejected suffix
    rolled_back_tokens: int = 0         # rows dropped by them (summed over the batch's requests)
    #: per index group: host rows its prefetches copied (prefetch_next_group; in `worker`'s misses too)
    prefetch_misses: list[int] = field(default_factory=list)
    worker: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("resident", "hits", "misses", "h2d_bytes", "d2h_bytes"), 0))


class HiSparseEngine:
    """GPU block pool, coordinator, worker and device caches for one model (see the module docstring)."""

    def __init__(self, layout: DsaLayout, config: EngineConfig, backend: Backend | Sequence[Backend], *,
                 dtype: torch.dtype, placement: Placement | None = None, ranks: Ranks | None = None) -> None:
        """`backend`: one backend, or (with `placement`, a model spread over devices) one per device of
        `placement.devices`, in that order. `ranks`: this process's tensor-parallel rank (None: one)."""
        backends = [backend] if isinstance(backend, Backend) else list(backend)
        if placement is None:
            placement = Placement((torch.device(backends[0].device),), (0,) * layout.num_layers,
                                  (0,) * len(layout.groups))
        if len(backends) != len(placement.devices):
            raise InvalidInputError(f"{len(backends)} backend(s) for {len(placement.devices)} device(s); expected one "
                                    "per device of the placement")
        self.layout = layout
        self.config = config
        self.backend = backends[0]
        self.backends = backends
        self.placement = placement
        self.ranks = ranks
        self.device = torch.device(backends[0].device)
        self.dtype = dtype
        c = config
        bs = c.block_size
        #: the stored form of a latent row (`kv_rows`): written by `write_rows`, read by attention's gather
        self.rows = LatentRows.of(c.kv_rows, dtype, layout.kv_lora_rank, layout.qk_rope_head_dim)
        self.fmt = self.rows.fmt
        top_k = layout.index_topk
        spec = c.speculative_tokens
        self.spec_rows = spec + 1          # query rows per request a verification step resolves as one union
        # Default: 2 x top-k, and (k + 2) x top-k for k speculative tokens (the production shape of
        # 3 tokens is 5 x top-k): the union of the k + 1 rows plus one top-k of reuse across steps.
        base = max(2, spec + 2) * top_k
        hot_rows = c.hot_rows if c.hot_rows is not None else _cdiv(base, bs) * bs
        rounded = f" = {base}, rounded up to whole pages of block_size={bs}" if hot_rows != base else ""
        #: why the hot buffer has its size (the engine's log line says it)
        self.hot_rows_reason = (f"hot_rows={c.hot_rows}" if c.hot_rows is not None else
                                f"the default: (speculative_tokens + 2) x index_topk{rounded}" if spec else
                                f"the default: 2 x index_topk{rounded}")
        if bs > MAX_HOT_ROWS:   # no hot buffer of whole pages fits a runtime: name block_size, not what it rounds
            raise InvalidInputError(f"block_size={bs}: the hot buffer is whole pages, and a runtime's holds at most "
                                    f"{MAX_HOT_ROWS} rows; expected block_size <= {MAX_HOT_ROWS}")
        if hot_rows % bs:
            raise InvalidInputError(f"hot_rows={hot_rows} must be a multiple of block_size={bs}")
        largest = MAX_HOT_ROWS // bs * bs
        if hot_rows > largest:
            if c.hot_rows is not None:
                raise InvalidInputError(f"hot_rows={hot_rows} is over a runtime's {MAX_HOT_ROWS}-row hot buffer: "
                                        f"expected hot_rows <= {largest}")
            raise InvalidInputError(
                f"speculative_tokens={spec} makes the default hot buffer ({spec} + 2) x index_topk={top_k} = "
                f"{base} rows{f' ({hot_rows} in whole pages)' if rounded else ''}, over a runtime's {MAX_HOT_ROWS}-row hot buffer: expected speculative_tokens <= "
                f"{max(0, largest // top_k - 2)}, or hot_rows between (speculative_tokens + 1) x index_topk and "
                f"{largest}")
        if spec and hot_rows < self.spec_rows * top_k:
            fits = _cdiv(self.spec_rows * top_k, bs) * bs
            most = max(0, hot_rows // top_k - 1)
            raise InvalidInputError(
                f"hot_rows={hot_rows} cannot hold the union of one request's {self.spec_rows} verification rows "
                f"(speculative_tokens={spec} + 1, each picking index_topk={top_k}): expected "
                + (f"hot_rows >= {fits}, or speculative_tokens <= {most}" if fits <= largest else
                   f"speculative_tokens <= {most} (a runtime's hot buffer holds at most {MAX_HOT_ROWS} rows)"))
        if hot_rows < top_k:
            raise InvalidInputError(
                f"the model's index_topk={top_k} is larger than the hot buffer allows (hot_rows={hot_rows}); one "
                f"step's top-k must fit the hot buffer: expected hot_rows >= {top_k}")
        self.hot_rows = hot_rows
        self.hot_blocks = hot_rows // bs
        self.max_pages = _cdiv(c.max_context, bs)
        self.chunk_pages = chunk_pages_for(c.prefill_chunk, c.max_context, bs, self.spec_rows)
        L = layout.num_layers
        pf = c.prefetch_next_group
        if not isinstance(pf, bool) and any(g >= len(layout.groups) - 1 for g in pf):
            raise InvalidInputError(
                f"prefetch_next_group={pf!r}: group {max(pf)} has no next index group; expected source groups in "
                f"[0, {len(layout.groups) - 1}) (the model has {len(layout.groups)} index groups)")
        resident = resident_groups(layout.groups, c.resident_layers, L)
        if resident and (placement.spread or ranks is not None):
            raise InvalidInputError(f"resident_layers={list(c.resident_layers)} runs on one device and one rank; "
                                    "expected a model on one device without tensor parallelism, or resident_layers=()")
        self.resident_groups = frozenset(resident)
        self.resident_layers = tuple(sorted(x for g in resident for x in layout.groups[g]))
        offloaded = [x for x in range(L) if x not in self.resident_layers]
        self.block_bytes = len(offloaded) * bs * self.fmt.row_bytes
        for dev in placement.devices:
            check_budgets(c.host_pool_gib, c.gpu_kv_gib, dev)      # before any size is derived from them
        #: positions of one state row in a resident layer's store (`[max_batch * capacity, width]`)
        self.resident_capacity = _cdiv(c.max_context, bs) * bs
        self.resident_bytes = len(self.resident_layers) * c.max_batch * self.resident_capacity * self.fmt.row_bytes
        # gpu_kv_gib is each device's budget (less the resident layers' stores): a block holds one page
        # of that device's offloaded layers, so the device with the most of them decides how many fit.
        widest = max(range(len(placement.devices)),
                     key=lambda d: len([x for x in placement.layers_on(d) if x not in self.resident_layers]))
        device_layers = len([x for x in placement.layers_on(widest) if x not in self.resident_layers])
        device_block_bytes = device_layers * bs * self.fmt.row_bytes
        need = required_gpu_blocks(c.max_batch, self.hot_blocks, self.chunk_pages)
        if self.resident_bytes and self.resident_bytes >= c.gpu_kv_bytes:
            raise CapacityError(
                f"resident_layers={list(self.resident_layers)} keep {self.resident_bytes} B on the GPU (max_batch="
                f"{c.max_batch} x max_context={self.resident_capacity} x {self.fmt.row_bytes} B per layer), all of "
                f"gpu_kv_gib={c.gpu_kv_gib:g}: expected gpu_kv_gib >= "
                f"{ceil_gib(need * device_block_bytes + self.resident_bytes)} (the stores and the {need} blocks "
                "max_batch's hot buffers and prefill need), or fewer resident layers")
        self.gpu_blocks = (c.gpu_kv_bytes - self.resident_bytes) // device_block_bytes
        self.watermark = pressure_watermark(c.max_batch, self.hot_blocks, self.chunk_pages)
        if self.gpu_blocks < need:
            where = f" on {placement.devices[widest]}" if placement.spread else ""
            kept = (f" (less {self.resident_bytes} B for resident_layers={list(self.resident_layers)})"
                    if self.resident_bytes else "")
            raise CapacityError(
                f"gpu_kv_gib={c.gpu_kv_gib:g}{where}{kept} holds {self.gpu_blocks} blocks of {device_block_bytes} B "
                f"({device_layers} layers x {bs} tokens x {self.fmt.row_bytes} B); "
                f"max_batch={c.max_batch} with a {self.hot_blocks}-block hot buffer and prefill_chunk={c.prefill_chunk} "
                f"needs at least {need}: expected gpu_kv_gib >= "
                f"{ceil_gib(need * device_block_bytes + self.resident_bytes)}"
                + (f", or max_batch <= {fits}" if (fits := _largest_batch(self.gpu_blocks, self.hot_blocks,
                                                                           self.chunk_pages, c.max_batch)) else ""))
        host_blocks = c.host_pool_bytes // self.block_bytes - 1          # the coordinator keeps a null block
        host_need = self.max_pages + ACTIVE_TAIL_PAGES
        if host_blocks < host_need:
            raise CapacityError(
                f"host_pool_gib={c.host_pool_gib:g} holds {max(host_blocks, 0)} usable blocks of {self.block_bytes} B; "
                f"one request of max_context={self.max_pages * bs} tokens needs {host_need} (its pages plus the "
                f"{ACTIVE_TAIL_PAGES}-page active tail): expected host_pool_gib >= "
                f"{ceil_gib((host_need + 1) * self.block_bytes, 3)}"
                + (f", or max_context <= {(host_blocks - ACTIVE_TAIL_PAGES) * bs}"
                   if host_blocks > ACTIVE_TAIL_PAGES else ""))
        self.gpu = SimpleGpuBlockPool(self.gpu_blocks)
        self.coordinator = HiSparseCoordinator(CoordinatorConfig(
            host_pool_gib=c.host_pool_bytes / GIB, num_layers=len(offloaded), block_size=bs, row_bytes=self.fmt.row_bytes,
            max_model_len=self.max_pages * bs, hot_blocks_per_request=self.hot_blocks,
            active_tail_pages=ACTIVE_TAIL_PAGES, pressure_watermark_blocks=self.watermark), self.gpu)
        runtime_config = RuntimeConfig(max_batch_rows=c.max_batch * self.spec_rows, max_requests=c.max_batch,
                                       top_k=top_k, hot_rows=hot_rows, block_size=bs, max_pages=self.max_pages,
                                       row_format=self.fmt, num_layers=1, rows_per_request=self.spec_rows)
        G = len(layout.groups)
        self.workers: list[HiSparseWorker] = []
        self.runtimes: list[CacheRuntime] = [None] * G  # type: ignore[list-item]  # filled per device below
        # a resident group's layers: one store each, `[max_batch * resident_capacity, width]`, row
        # `state * resident_capacity + position` (written as the pages are, read by position)
        self.device_layers: list[list[torch.Tensor]] = [
            [torch.zeros((c.max_batch * self.resident_capacity, self.fmt.width), dtype=self.fmt.dtype,
                         device=placement.devices[placement.group_device[g]]) for _ in layout.groups[g]]
            if g in self.resident_groups else [] for g in range(G)]
        self.host_views: list[list[torch.Tensor]] = [[] for _ in range(G)]
        self.group_tables: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._tables: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []   # per device
        try:
            for d, (dev, be) in enumerate(zip(placement.devices, backends, strict=True)):
                mine = [g for g in placement.groups_on(d) if g not in self.resident_groups]
                groups = [CacheGroup(replace(runtime_config, num_layers=len(layout.groups[g])), resident_group=0,
                                     name=f"index group {g} (layers {list(layout.groups[g])})") for g in mine]
                share = ranks is not None and ranks.share_host_pool
                worker = HiSparseWorker(be, groups, num_host_blocks=self.coordinator.host_num_blocks,
                                        rank=ranks.rank if ranks else 0, world_size=ranks.world_size if ranks else 1,
                                        share_host_pool=share,
                                        pool_name=ranks.pool_for(d) if share and ranks is not None else None)
                self.workers.append(worker)
                local = [[torch.zeros((self.gpu_blocks, bs, self.fmt.width), dtype=self.fmt.dtype, device=dev)
                          for _ in layout.groups[g]] for g in mine]
                worker.register_caches(local)
                tables = (torch.full((c.max_batch, self.max_pages), -1, dtype=torch.int32, device=dev),
                          worker.residency_table(0),
                          torch.full((c.max_batch, self.hot_blocks), -1, dtype=torch.int32, device=dev))
                self._tables.append(tables)
                for i, g in enumerate(mine):
                    self.runtimes[g] = worker.runtimes[i]
                    self.device_layers[g] = local[i]
                    self.host_views[g] = worker.host_layer_views(i)
            # [entries, distinct positions] of the verification unions, summed on the device (no sync)
            self.union_counts = torch.zeros(2, dtype=torch.int64, device=self.device)
        except BaseException:
            for w in self.workers:
                w.shutdown()
            raise
        self.worker = self.workers[0]
        self.source_table, self.resident_table, self.hot_table = self._tables[0]
        self.group_tables = [self._tables[d] for d in placement.group_device]
        self.flat_layers = [[t.view(-1, self.fmt.width) for t in g] for g in self.device_layers]
        if self.resident_layers:
            logger.info("hisparse: resident_layers=%s keep their whole KV on the GPU (%d B of the %g GiB budget: "
                        "max_batch %d x %d positions each), never through the host pool or a hot buffer; the other "
                        "%d layers go through hisparse; prefix hits from the host pool are off (the resident layers "
                        "have no host copy)", list(self.resident_layers), self.resident_bytes, c.gpu_kv_gib,
                        c.max_batch, self.resident_capacity, len(offloaded))
        self._reports = ReportMerger(len(self.workers) * (ranks.world_size if ranks is not None else 1))
        self._peer = ranks is not None and ranks.share_host_pool and ranks.rank != 0
        self.free_states = list(range(c.max_batch - 1, -1, -1))
        self.totals = EngineTotals()
        self.session: Session | None = None
        self._next_request = 0
        self.closed = False
        # Plan each decode step while the device runs the one before (hisparse_core.coordinator.ahead).
        self.plan_ahead = True
        self.ahead = StepAhead(start_step=self._start_workers, close_step=self._after_forward)
        self._handed: dict[str, int] = {}                  # blocks of each request the coordinator took over
        self._planned_writes: tuple[list[int], list[int]] = ([], [])
        self._planned_command: OffloadCommand | None = None
        self._planned_state: StepState | None = None       # the planned step's device tensors
        self._last_prefill = False
        #: Benchmarks only (`use_model_topk`): decode steps take their top-k from a locality model.
        self.topk_model: ModelTopk | None = None
        #: Called with (session, tokens removed) after each rollback (the checker's copies follow it).
        self.rollback_listeners: list[Callable[[Session, int], None]] = []
        #: Bumped by the model side whenever the model's weights changed since the last batch: part of
        #: the prefix identity, so pages computed with other weights are no batch's hits.
        self.weights_epoch = 0
        self.prefetch = (NextGroupPrefetch(self.runtimes, self.group_tables, placement.group_device, placement.devices,
                                           sources=None if isinstance(pf, bool) else pf)
                         if pf else None)
        self.totals.prefetch_misses = [0] * G
        if spec:
            logger.info("hisparse transformers engine: assisted generation of up to %d candidate tokens: a verification "
                        "step resolves up to %d rows per request as one union (hot buffer %d rows >= %d x top-k)",
                        spec, self.spec_rows, hot_rows, self.spec_rows)
        logger.info(
            "hisparse transformers engine: %s, %d layers in %d index group(s), row %s (%d B), top-k %d, hot buffer "
            "%d rows (%s); %s KV pool %d blocks of %d B (watermark %d), host pool %d blocks; %d state rows, max "
            "context %d, prefill chunk %d; backend %s on %s", layout.family, L, len(layout.groups), self.fmt.name,
            self.fmt.row_bytes, top_k, hot_rows, self.hot_rows_reason, kv_place(placement.devices[0]), self.gpu_blocks, self.block_bytes, self.watermark,
            self.coordinator.host_num_blocks, c.max_batch, self.max_pages * bs, c.prefill_chunk, self.backend.name,
            ", ".join(str(d) for d in placement.devices))
        if placement.spread:
            logger.info(
                "hisparse: the attention layers sit on %d devices (%s): one worker per device, each with its layers' "
                "device caches, tables and host pool; gpu_kv_gib=%g is each device's budget (%d blocks, set by %s with "
                "%d layers); host_pool_gib=%g is the model's, split over the devices' pools by their layers (%d blocks "
                "each); index groups stay on their leader's device", len(placement.devices), placement.describe(),
                c.gpu_kv_gib, self.gpu_blocks, placement.devices[widest], len(placement.layers_on(widest)),
                c.host_pool_gib, self.coordinator.host_num_blocks)

    # ------------------------------------------------------------------------------- workers

    @property
    def num_report_workers(self) -> int:
        """Workers whose reports the coordinator counts: the devices' workers on every rank."""
        return self._reports.num_workers

    def _start_workers(self, command: OffloadCommand | None) -> None:
        for w in self.workers:
            w.start_step(command)
        if self._peer:
            # A peer of a shared pool orders its reads after rank 0's writes (NVIDIA: on rank 0's
            # IPC event). A writer needs no such wait: it reads only pages whose copies completed.
            for w in self.workers:
                w.wait_for_host_writes()

    def _after_forward(self) -> None:
        for w in self.workers:
            w.after_forward()

    def _acknowledge(self, *, wait: bool = False) -> None:
        """Every worker's report, merged (and, under tensor parallelism, exchanged between the ranks,
        so every rank's coordinator counts the same acknowledgements and decides the same)."""
        reports = [w.build_metadata(wait=wait) for w in self.workers]
        if self.ranks is not None:
            reports = self.ranks.exchange(reports)
        self.coordinator.update_from_workers(self._reports.merge(reports), self._reports.num_workers)

    def tables_of(self, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(source, resident, hot) tables on index group `group`'s device."""
        return self.group_tables[group]

    def local_step(self, step: StepState, group: int) -> StepState:
        """`step` with its tensors on index group `group`'s device (the step itself on the first
        device; elsewhere a copy made once per step and device, device to device)."""
        d = self.placement.group_device[group]
        if d == 0:
            return step
        local = step.local.get(d)
        if local is None:
            dev = self.placement.devices[d]
            assert step.state_rows is not None

            def to(t: torch.Tensor) -> torch.Tensor:
                return t.to(dev, non_blocking=True)

            local = dataclasses.replace(
                step, pad=to(step.pad), pad32=to(step.pad32), qpos=to(step.qpos), row_state=to(step.row_state),
                seq_lens=to(step.seq_lens), write_src=to(step.write_src), write_dst=to(step.write_dst),
                state_rows=to(step.state_rows), group_cache=step.group_cache, local=step.local)
            step.local[d] = local
        return local

    # ------------------------------------------------------------------------------- sessions

    def open_session(self, prompts: Sequence[Sequence[int]], pads: Sequence[int],
                     max_new_tokens: int | None = None, candidates: int = 0,
                     rope_offsets: Sequence[int | None] | None = None) -> Session:
        """Admit one request per batch row; takes prefix hits from the host pool.

        A latent row carries its rope position, so the prefix identity of a row's pages includes
        `rope_offsets[b]`, the rope position of its first token (None, the default: 0 for every row,
        its logical positions, as generate ropes them): a row takes hits only from rows roped alike.
        An offset of None in the list (positions that are not one offset) shares with no other row.
        It includes the autocast state of the engine's device too (`_numerics_key`): rows computed
        under `torch.autocast` are hits only for a batch opened under the same autocast; and
        `weights_epoch`, so rows computed before the model's weights changed are no later batch's.

        The whole of every request must fit before anything runs: each row's prompt plus
        `max_new_tokens` (None: as far as `max_context` allows) against `max_context` and against
        the host pool's free blocks, so no step can find the host pool full mid-decode.
        `candidates`: an assisted generate's bound on the candidate tokens a verification step
        writes past the last token it keeps (reserved on top of `max_new_tokens`)."""
        if self.closed:
            raise InvalidInputError("this hisparse engine was closed; enable hisparse again")
        if self.session is not None and not self.session.closed:
            self._finish_abandoned(self.session)
        n = len(prompts)
        if not 1 <= n <= self.config.max_batch:
            raise CapacityError(f"batch of {n} prompts; expected 1 to max_batch={self.config.max_batch} "
                                "(enable(..., max_batch=N))")
        bs = self.config.block_size
        max_context = self.max_pages * bs
        longest = max(pad + len(p) for p, pad in zip(prompts, pads, strict=False))
        if longest > max_context:
            raise CapacityError(f"a prompt of {longest} padded tokens exceeds max_context="
                                f"{max_context}; expected enable(..., max_context >= {longest})")
        # The last generated token is never fed back: its KV is not written.
        grow = max(0, max_new_tokens - 1) + candidates if max_new_tokens is not None else None
        if grow is not None and longest + grow > max_context:
            extra = (f" and up to {candidates} candidate tokens a verification step writes past the last token "
                     "it keeps" if candidates else "")
            raise CapacityError(
                f"max_new_tokens={max_new_tokens} after a prompt of {longest} padded tokens{extra} reaches "
                f"{longest + grow} tokens of KV; max_context is {max_context}: expected max_new_tokens <= "
                f"{max_context - longest + 1 - candidates} or enable(..., max_context >= {longest + grow})")
        totals = [len(p) + grow if grow is not None else max_context - pad for p, pad in zip(prompts, pads, strict=False)]
        requests: list[Request] = []
        numerics = _prefix_key(_numerics_key(self.device),
                               f"weights:{self.weights_epoch}".encode() if self.weights_epoch else None)
        rids: list[str] = []       # named before admission, so an interrupt anywhere below is undone
        states = list(self.free_states)
        counted = (self.totals.requests, self.totals.prefix_hit_tokens)
        try:
            for tokens, pad, total in zip(prompts, pads, totals, strict=False):
                rid = f"hf-{self._next_request}"
                rids.append(rid)
                self._next_request += 1
                tokens = list(tokens)
                cap = max(0, len(tokens) - 1) if not self.resident_layers else 0
                key = _prefix_key(_rope_key(rope_offsets[len(requests)] if rope_offsets is not None else 0, rid),
                                  numerics)
                try:
                    hit = self.coordinator.add_request(rid, tokens, extra_key=key, max_prefix_tokens=cap)
                except CapacityError:
                    hit = self.coordinator.add_request(rid, tokens, extra_key=key, max_prefix_tokens=0)
                first = self.coordinator.first_resident_page(rid)
                requests.append(Request(rid, states[-1 - len(requests)], pad, LazyTokens(tokens), len(tokens), hit,
                                        first, [-1] * first, hit, total))
            self._check_host_room(requests, totals, max_new_tokens)
            with torch.inference_mode(False):   # its tables outlive this forward's mode (the next may differ)
                session = Session(self.device, requests)
            session.max_new_tokens = max_new_tokens
            self.free_states = states[:len(states) - n]
            self.totals.requests += n
            self.totals.prefix_hit_tokens += sum(r.hit for r in requests)
            self.session = session      # last: once it is set, the batch is whole
        except BaseException:
            # an error or an interrupt (Ctrl-C) anywhere above: nothing stays admitted
            self.free_states = states
            self.totals.requests, self.totals.prefix_hit_tokens = counted
            for rid in rids:
                if self.coordinator.has_request(rid):
                    self.coordinator.finish_request(rid)
            raise
        if any(r.hit for r in requests):
            logger.info("hisparse: prefix hits from the host pool: %s tokens", [r.hit for r in requests])
        return session

    def _finish_abandoned(self, session: Session) -> None:
        """Finish the open batch `session` if the cache running it is gone (direct forwards whose
        cache was dropped without `finish()`: nobody else can finish it); else refuse in one line."""
        owner = session.owner
        if owner is not None and owner() is not None:
            gc.collect()                    # a dropped cache may wait in a reference cycle
        if owner is None or owner() is not None:
            raise InvalidInputError("a hisparse batch is still open on this model (a generate running, or direct "
                                    "forwards whose cache was not finished: call cache.finish()); expected one batch "
                                    "at a time")
        logger.info("hisparse: the batch of %d request(s) whose cache was dropped without finish() is finished now",
                    session.batch_size)
        self.close_session(session)

    def discard_session(self, session: Session) -> None:
        """Undo `open_session` of a batch whose first step was refused or failed before its forward
        ran: its requests finish as in `close_session`, and the totals no longer count them."""
        self.close_session(session)
        self.totals.requests -= session.batch_size
        self.totals.prefix_hit_tokens -= sum(r.hit for r in session.requests)

    def _check_host_room(self, requests: Sequence[Request], totals: Sequence[int], max_new_tokens: int | None) -> None:
        """`CapacityError` unless the host pool has a block for every page the admitted requests
        will write (their prefix hits already counted): one line naming host_pool_gib and what fits."""
        coord = self.coordinator
        need = sum(coord.host_blocks_needed(r.request_id, t) for r, t in zip(requests, totals, strict=True))
        free = coord.num_free_host_blocks
        if need <= free:
            return
        fits_blocks = coord.host_num_blocks - free + need
        fits = fits_blocks * self.block_bytes / GIB
        scale = 10 ** (math.floor(math.log10(fits)) - 2)
        what = (f"prompts plus max_new_tokens={max_new_tokens}" if max_new_tokens is not None else
                "prompts grown to max_context (direct forwards: pass max_new_tokens to new_cache to reserve less)")
        raise CapacityError(
            f"host_pool_gib={self.config.host_pool_gib:g} cannot hold this batch: its {len(requests)} requests "
            f"({what}, up to {max(totals)} tokens each) need {need} more host blocks of {self.block_bytes} B and "
            f"{free} are free: expected host_pool_gib >= {math.ceil(fits / scale) * scale:.3g}, or fewer or "
            "shorter prompts or fewer new tokens")

    def close_session(self, session: Session, *, indexer_bytes: int = 0) -> None:
        """Finish every request of the session: leases go back, spills in flight publish when they land.
        `indexer_bytes`: the device bytes of the batch's indexer keys, for the stats."""
        if session.closed:
            return
        session.closed = True
        self.totals.peak_indexer_bytes_per_request = max(self.totals.peak_indexer_bytes_per_request,
                                                         indexer_bytes / session.batch_size)
        self.ahead.cancel()                    # a step planned ahead that will not run
        if session.step is not None:           # a forward raised mid-step: close the worker's step
            session.step = None
            self._after_forward()
        unhanded: list[int] = []
        for r in session.requests:
            self.coordinator.finish_request(r.request_id)
            # Blocks of a step that failed before the coordinator took them over are still the engine's.
            unhanded.extend(b for b in r.blocks[self._handed.pop(r.request_id, 0):] if b >= 0)
        if unhanded:
            self.gpu.release(unhanded)
        states = [r.state_index for r in session.requests]
        for w in self.workers:
            w.reset_state(states)
        for source, _, hot in self._tables:
            source[states] = -1
            hot[states] = -1
        self.free_states.extend(states)
        # Drain so the prompt pages this batch sealed are published for the next batch's prefix hits.
        self._acknowledge(wait=True)
        self._collect_worker_stats()
        if self.session is session:
            self.session = None

    # ------------------------------------------------------------------------------- steps

    def begin_step(self, session: Session, input_ids: torch.Tensor | None, num_new: int) -> StepState:
        """Plan one forward of `num_new` padded positions for every row and start the worker's step.

        A decode step that `end_step` planned ahead (`plan_ahead`) has started already and its
        device tensors are made: only its tokens are recorded here (one copy to the host for the
        whole batch, whatever its size); a planning failure is raised here, with the request named."""
        if session.closed:
            raise InvalidInputError("this hisparse cache's generate has finished; use a fresh cache")
        if session.step is not None:
            raise InvalidInputError("a forward started on this hisparse cache before the previous one ended")
        if num_new < 1:
            self.ahead.cancel()
            raise InvalidInputError(f"a forward of {num_new} tokens with a hisparse cache; expected at least one new "
                                    "token a row")
        bs = self.config.block_size
        past = session.padded_len
        end_padded = past + num_new
        if end_padded > self.max_pages * bs:
            self.ahead.cancel()
            raise CapacityError(f"the batch reaches {end_padded} padded tokens; max_context is {self.max_pages * bs}: "
                                "expected enable(..., max_context >= prompt + new tokens + padding)")
        over = next((r for r in session.requests if max(end_padded, r.pad) - r.pad > r.limit), None)
        if over is not None:
            self.ahead.cancel()
            reach = max(end_padded, over.pad) - over.pad
            raise CapacityError(
                f"this forward takes request {over.request_id} to {reach} tokens, past the {over.limit} its admission "
                f"reserved host blocks for (a prompt of {over.prompt_len} tokens and "
                f"max_new_tokens={session.max_new_tokens}); expected handle.new_cache(..., max_new_tokens >= "
                f"{reach - over.prompt_len + 1}), or max_new_tokens=None to reserve up to max_context")
        if input_ids is None and any(max(end_padded, r.pad) - r.pad > len(r.tokens) for r in session.requests):
            self.ahead.cancel()
            raise InvalidInputError("a forward past the prompt needs input_ids (inputs_embeds only cover the "
                                    "prompt given to generate)")
        planned = self.ahead.claim((session, past, num_new))
        known = [len(r.tokens) for r in session.requests]
        started = planned                      # the workers' step has started (planned ahead, or below)
        try:
            staged: StagedIds | None = None
            for b, r in enumerate(session.requests):
                if max(end_padded, r.pad) - r.pad > known[b]:
                    assert input_ids is not None
                    if staged is None:
                        # one copy to the host for the whole batch; columns past num_new are not this step's
                        staged = StagedIds(input_ids if input_ids.shape[1] <= num_new else input_ids[:, :num_new])
                    r.tokens.extend_staged(staged, b, known[b] + r.pad - past)
            step = self._planned_state if planned else None
            self._planned_state = None
            if step is None:
                if planned:
                    src, dst = self._planned_writes
                else:
                    src, dst = self._schedule(session, past, num_new, start=True)
                    started = True
                step = self._step_state(session, past, num_new, src, dst)
        except BaseException:
            # The forward will not run: its tokens are not the requests' (a retry of the position may
            # feed others, and a page would be sealed under these), and a started workers' step is
            # ended, as after a forward that raised, so the next step (this batch's close, the next
            # generate) finds them between steps.
            for r, n in zip(session.requests, known, strict=True):
                r.tokens.truncate(n)
            if started:
                self._after_forward()
            raise
        if step.verify:
            # A rollback may follow: no step is planned ahead of it (its schedule would seal the
            # pages of candidates that the crop drops).
            session.speculative = True
        step.started = time.perf_counter()
        session.step = step
        if self.topk_model is not None and num_new == 1 and all(r.computed >= r.prompt_len for r in session.requests):
            self.topk_model.fill(session, step, [r.pad for r in session.requests], past)
        return step

    def _step_state(self, session: Session, past: int, num_new: int, src: list[int], dst: list[int]) -> StepState:
        """The device tensors the attention layers of a step read: query positions, resolver rows,
        context lengths and the write rows `src`/`dst` (`_schedule`). Enqueued on the current
        stream; for a step planned ahead they are made while the device runs the step before."""
        dev = self.device
        qpos = (past + torch.arange(num_new, device=dev)).unsqueeze(0) - session.pads.unsqueeze(1)
        qpos = qpos.masked_fill(qpos < 0, -1)
        verify = self.is_verification(session, num_new)
        if verify:
            # One resolver row per query, b-major: a request's rows are consecutive and share its state row.
            row_state = session.state_rows.repeat_interleave(num_new)
            seq_lens = (qpos + 1).reshape(-1).to(torch.int32)
            row_pad32 = session.pads32.repeat_interleave(num_new, dim=0)
        else:
            last = qpos[:, -1]
            row_state = torch.where(last >= 0, session.state_rows, torch.full_like(session.state_rows, -1))
            seq_lens = (last + 1).to(torch.int32)
            row_pad32 = session.pads32
        write_src = torch.tensor(src, dtype=torch.int64).to(dev, non_blocking=True)
        step = StepState(past, num_new, session.pads, row_pad32, qpos, row_state, seq_lens, write_src,
                         torch.tensor(dst, dtype=torch.int64).to(dev, non_blocking=True),
                         prefill=num_new > 1 and not verify, verify=verify, state_rows=session.state_rows)
        if self.resident_layers:
            # the same rows' places in the resident stores: state row x capacity + logical position
            states = session.state_rows.to(torch.int64)[write_src // num_new]
            step.write_res = states * self.resident_capacity + qpos.reshape(-1)[write_src]
        return step

    def use_model_topk(self, regime_name: str, *, seed: int = 0, lookahead: int = 32,
                       reference: str | Sequence[int] | None = None) -> None:
        """Benchmarks only: decode steps take every index group's top-k from the locality model
        `regime_name` (`model_topk.py`), made `lookahead` steps at a time, the groups standing for
        `reference` layers of the 61-layer profile (None or "spread": spread over it)."""
        self.topk_model = ModelTopk(regime_name, top_k=self.layout.index_topk,
                                    leaders=[g[0] for g in self.layout.groups], num_layers=self.layout.num_layers,
                                    max_batch=self.config.max_batch, device=self.device, seed=seed, lookahead=lookahead,
                                    reference=reference)

    def is_verification(self, session: Session, num_new: int) -> bool:
        """Whether a forward of `num_new` tokens per row is a verification step (its rows resolved
        as one union per request): 2 to `speculative_tokens + 1` tokens with every prompt in the
        cache (so every row of the forward is a query of its request)."""
        return 1 < num_new <= self.spec_rows and all(r.computed >= r.prompt_len for r in session.requests)

    def _schedule(self, session: Session, past: int, num_new: int, *, start: bool) -> tuple[list[int], list[int]]:
        """The coordinator half of a step: GPU blocks for its pages, `schedule_step`, the table
        writes (and, with `start`, the worker's `start_step`). Returns the step's write positions
        (flat index into the step's `[B * S]` rows, flat device row). Reads only lengths of the
        requests' tokens, so a decode step can run it before its input ids exist (`plan_ahead`)."""
        bs = self.config.block_size
        end_padded = past + num_new
        needed = sum(max(0, _cdiv(max(max(end_padded, r.pad) - r.pad, r.computed), bs) - len(r.blocks))
                     for r in session.requests)
        if needed > self.gpu.num_free_blocks:
            # Spill acknowledgements lag behind the allocations (a fast prefill on a device): wait
            # for them, so their pages turn clean, and let the residency policy release them.
            self._acknowledge(wait=True)
            free = self.coordinator.make_room(needed)
            self.totals.pressure_waits += 1
            logger.debug("hisparse: step needs %d GPU blocks; waited for spills, %d free now", needed, free)
            if free < needed:
                # Refuse before leasing any: a lease of a released block would lose its page.
                raise CapacityError(f"step {self.totals.steps}: its new pages need {needed} GPU blocks and "
                                    f"{free} are free after releasing every clean page the policy may; raise "
                                    "gpu_kv_gib or lower max_batch/prefill_chunk")
        fresh: list[tuple[Request, int]] = []       # (request, blocks before this step): undone if the step fails
        try:
            command, src, dst = self._plan_step(session, num_new, past, end_padded, fresh)
        except BaseException:
            # Nothing reached the coordinator: the blocks leased above go back, so a failed step
            # (a refused schedule, no GPU block for a later row, an interrupt) leaks none.
            for r, before in reversed(fresh):
                self.gpu.release(r.blocks[before:])
                del r.blocks[before:]
            raise
        updates = self.coordinator.take_table_updates()
        for source, _, hot in self._tables:
            apply_table_updates(updates, source, hot)
        if start:
            self._start_workers(command)
        else:
            self._planned_command = command
        return src, dst

    def _plan_step(self, session: Session, num_new: int, past: int, end_padded: int,
                   fresh: list[tuple[Request, int]]) -> tuple[OffloadCommand | None, list[int], list[int]]:
        """Lease the step's new pages (recorded in `fresh`) and schedule it: the offload command and
        the step's write rows (flat source in the batch, flat device row)."""
        bs = self.config.block_size
        scheduled: list[StepRequest] = []
        src: list[int] = []
        dst: list[int] = []
        for b, r in enumerate(session.requests):
            hi = max(end_padded, r.pad) - r.pad
            end = max(hi, r.computed)
            pages = _cdiv(end, bs)
            missing = pages - len(r.blocks)
            if missing > 0:
                try:
                    leased = self.gpu.acquire(missing)
                except CapacityError as exc:
                    raise CapacityError(f"step {self.totals.steps}: no GPU block for request {r.request_id}'s next "
                                        f"page ({exc}); raise gpu_kv_gib or lower max_batch/prefill_chunk") from None
                fresh.append((r, len(r.blocks)))
                r.blocks.extend(leased)
            for pos in range(r.computed, hi):
                src.append(b * num_new + pos + r.pad - past)
                dst.append(r.blocks[pos // bs] * bs + pos % bs)
            if end == 0:
                continue    # all padding so far: nothing to write or read (and no pages to report)
            scheduled.append(StepRequest(r.request_id, r.state_index, r.computed, max(0, hi - r.computed), r.tokens,
                                         [r.blocks]))
        command = self.coordinator.schedule_step(scheduled)
        for s in scheduled:                    # the coordinator holds these blocks' leases now
            self._handed[s.request_id] = len(s.resident_block_ids[0])
        for r in session.requests:             # and has sealed every page their lengths cover
            r.sealed = max(r.sealed, r.computed // bs * bs)
        return command, src, dst

    def _plan_next(self, session: Session) -> None:
        """Right after a step's forward and acknowledgements: when the next forward can only be a
        decode of one token per row (every prompt is in the cache), run its coordinator half and
        start its worker step now, while the device still runs this step (`StepAhead`)."""
        past = session.padded_len
        bs = self.config.block_size
        if (session.closed or session.speculative or past + 1 > self.max_pages * bs
                or any(r.computed < r.prompt_len or r.computed + 1 > r.limit for r in session.requests)):
            return
        # The planned step seals every page the lengths cover, so a page the last forward completed
        # could no longer be cropped: direct forwards (which may crop after any forward) plan that
        # step when it comes instead.
        if session.direct and any(r.computed % bs == 0 for r in session.requests):
            return

        def prepare() -> OffloadCommand | None:
            self._planned_state = None
            self._planned_writes = self._schedule(session, past, 1, start=False)
            # the step's device tensors too: their uploads and small kernels leave the critical path
            try:
                self._planned_state = self._step_state(session, past, 1, *self._planned_writes)
            except BaseException:
                # The coordinator scheduled the step: start and end it with nothing written, as a
                # cancelled planned step (its spills run and are acknowledged; the error comes at claim).
                self._start_workers(self._planned_command)
                self._after_forward()
                raise
            return self._planned_command

        self.ahead.plan((session, past, 1), prepare)

    def write_rows(self, group: int, position: int, rows: torch.Tensor) -> None:
        """Write this step's rows of one layer: `rows` `[B * S, width]` (the step's flat batch) go to
        the resident pages `begin_step` planned (positions whose KV is not final yet)."""
        step = self.session.step if self.session is not None else None
        if step is None:
            raise InvalidInputError("write_rows outside a step (begin_step first)")
        step = self.local_step(step, group)
        if step.write_dst.numel():
            flat = self.flat_layers[group][position]
            dst = step.write_res if group in self.resident_groups else step.write_dst
            assert dst is not None
            # detached: a store that outlives the forward joins no autograd graph (a direct forward
            # with autograd on would otherwise keep every forward's saved activations reachable)
            self.rows.store(flat, dst, rows.detach()[step.write_src])

    def is_resident(self, group: int) -> bool:
        """Whether index group `group`'s layers keep their whole KV on the GPU (`resident_layers`)."""
        return group in self.resident_groups

    def end_step(self, session: Session) -> None:
        step = session.step
        if step is None:
            return
        session.step = None
        self._after_forward()
        self._acknowledge()
        end_padded = step.past + step.num_new
        new_tokens = 0
        for r in session.requests:
            hi = max(end_padded, r.pad) - r.pad
            new_tokens += max(0, hi - r.computed)
            r.computed = max(r.computed, hi)
        session.padded_len = end_padded
        session.last_num_new = step.num_new
        t = self.totals
        seconds = time.perf_counter() - step.started
        t.steps += 1
        self._last_prefill = step.prefill
        if step.verify:
            t.verify_steps += 1
            t.verify_rows += session.batch_size * step.num_new
        if step.prefill:
            t.prefill_steps += 1
            t.prefill_tokens += new_tokens
            t.prefill_seconds += seconds
        else:
            t.decode_steps += 1
            t.decode_tokens += new_tokens
            t.decode_seconds += seconds
        n = session.batch_size
        t.peak_blocks_per_request = max(t.peak_blocks_per_request, self.gpu.num_leased_blocks / n)
        bs = self.config.block_size
        t.peak_all_resident_blocks_per_request = max(t.peak_all_resident_blocks_per_request,
                                                     sum(_cdiv(r.computed, bs) for r in session.requests) / n)
        t.peak_context = max(t.peak_context, max(r.computed for r in session.requests))
        if self.plan_ahead:
            self._plan_next(session)

    def rollback(self, session: Session, num_tokens: int) -> int:
        """Drop the last `num_tokens` padded positions of the batch (assisted generation's rejected
        candidates; `HiSparseCache.crop`). Returns the rows dropped over all requests.

        Only the suffix the last forward wrote can go (`InvalidInputError` otherwise, nothing
        changed). Each request's computed length and token ids go back, so the next forward writes
        those positions again before any layer reads them, and the coordinator, seeing a step start
        below what it mirrored, mirrors them again; none of them is ever sealed (a page is sealed
        only once `num_computed_tokens` covers it). Hot copies of their host rows are forgotten in
        every runtime, so no later resolve can serve a row that was not accepted."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise InvalidInputError(f"a rollback removes an int >= 0 of tokens, got {num_tokens!r}")
        if session.closed:
            raise InvalidInputError("this hisparse cache's generate has finished; nothing to roll back")
        if session.step is not None:
            raise InvalidInputError("a rollback (cache.crop) during a forward; expected it between forwards")
        if num_tokens == 0:
            return 0
        last = session.last_num_new
        if num_tokens > last:
            raise InvalidInputError(
                f"crop removes {num_tokens} tokens but the last forward added {last}: hisparse rolls back only the "
                "suffix of the last forward (the candidates a verification step rejected); earlier rows may be "
                "sealed and published already")
        bs = self.config.block_size
        end = session.padded_len - num_tokens
        # A step planned ahead ran `schedule_step` with the lengths after the last forward, which
        # sealed every page they cover: those pages' rows are final, even once that step is cancelled
        # (by an earlier crop of this forward's suffix).
        for r in session.requests:
            keep = max(end, r.pad) - r.pad
            if keep < r.sealed:
                raise InvalidInputError(
                    f"crop removes {num_tokens} tokens, but request {r.request_id}'s page {keep // bs} was "
                    "sealed by the decode step planned ahead after the last forward; roll back only after a "
                    "verification forward (2 or more tokens a row), or set engine.plan_ahead = False")
        self.ahead.cancel()                    # planned for the longer batch
        states: list[int] = []
        host_rows: list[int] = []
        dropped = 0
        for r in session.requests:
            keep = max(end, r.pad) - r.pad
            if keep >= r.computed:
                continue
            blocks = self.coordinator.source_block_ids(r.request_id)
            for pos in range(keep, r.computed):
                p = pos // bs
                if p < len(blocks) and blocks[p] >= 0:
                    states.append(r.state_index)
                    host_rows.append(blocks[p] * bs + pos % bs)
            dropped += r.computed - keep
            r.computed = keep
            r.tokens.truncate(keep)
        session.padded_len = end
        session.last_num_new -= num_tokens
        if host_rows:
            dev = self.device
            st = torch.tensor(states, dtype=torch.int32).to(dev, non_blocking=True)
            hr = torch.tensor(host_rows, dtype=torch.int32).to(dev, non_blocking=True)
            for runtime in self.worker.runtimes:
                runtime.invalidate_written_slots(st, hr)
        t = self.totals
        t.rollbacks += 1
        t.rolled_back_tokens += dropped
        if self._last_prefill:
            t.prefill_tokens -= dropped
        else:
            t.decode_tokens -= dropped
        for listener in self.rollback_listeners:
            listener(session, num_tokens)
        logger.debug("hisparse: rolled back %d padded positions (%d rows over %d requests)", num_tokens, dropped,
                     session.batch_size)
        return dropped

    # ------------------------------------------------------------------------------- stats, end

    def _collect_worker_stats(self) -> None:
        w = self.totals.worker
        for worker in self.workers:
            s = worker.take_stats()
            for k in w:
                w[k] += getattr(s, k)
        if self.prefetch is not None:
            for g, n in enumerate(self.prefetch.take_counts()):
                self.totals.prefetch_misses[g] += n

    def collect(self) -> EngineTotals:
        """The totals with the device counters read (a host synchronization)."""
        if not self.closed:
            self._collect_worker_stats()
        return self.totals

    def close(self) -> None:
        """Finish a session still open, then release the host pool. Idempotent."""
        if self.closed:
            return
        try:
            if self.session is not None and not self.session.closed:
                self.close_session(self.session)
            self._collect_worker_stats()
        finally:
            self.closed = True
            for worker in self.workers:
                worker.shutdown()
            self.device_layers = []
            self.flat_layers = []
            self.host_views = []
            # Each runtime keeps views of the host pool and of the device caches (CacheRuntime.bind),
            # and the workers and the prefetch keep the runtimes: dropped here, the pool's RAM and the
            # device KV are freed at close, not only once the handle itself is gone.
            self.runtimes = [None] * len(self.runtimes)  # type: ignore[list-item]
            self.prefetch = None
