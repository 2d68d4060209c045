"""The replay engine: a small inference server that drives the real coordinator, worker and backend.

It plays the engine side of `hisparse_core.coordinator` (a `SimpleGpuBlockPool` is its GPU
allocator; `StepRequest`s are its scheduled requests) and hosts one `HiSparseWorker`:

per step
  1. finished requests leave (their indexer blocks and state rows are freed);
  2. arrived requests are admitted FIFO while the GPU pool has one full admission free
     (`planner` arithmetic: all pages of the request, its indexer blocks and a hot buffer) and
     the host pool has a block for each of its pages; `add_request` takes any prefix hit;
  3. the engine leases resident blocks for the pages written this step and calls
     `schedule_step`; the table updates go into the source/hot tables, the command to
     `worker.start_step`;
  4. "forward": prefill writes the prompt rows (those not served by a prefix hit), decode writes
     `rows_per_request` rows per request (the token and its speculative successors), into
     resident pages, and into each request's all-resident reference. With `acceptance` < 1 this
     is speculative decoding with rejections: each successor is accepted with that probability
     while every one before it was; the rejected ones are written with draft contents of their
     own, read by the step's later rows, then rolled back: the request's computed length stops
     at the accepted ones, hot copies of the rejected rows' host rows are forgotten in every
     runtime, and the next step writes those positions again with the real contents (the
     coordinator mirrors them again and never seals a page holding a rejected row), so a later
     read of a rejected row would differ from the reference;
  5. decode attention: the synthetic indexer picks top-k per decode row and index group, every
     group's runtime resolves its rows (gather + follower replay; `decode.DecodeRunner`, one CUDA
     graph per batch size where the backend can), and `attention.check_layer` compares every
     layer with the all-resident copy;
  6. `worker.after_forward`, `build_metadata(wait=True)`, `update_from_workers`, with the
     completions of this step's copies held for the next (`acks.StepAcks`), so every backend
     shows the coordinator the same schedule.

The coordinator's pressure watermark is one full admission, so it releases clean pages (tail
first, keeping the active tail) until the next admission fits, as `planner` assumes.

Every engine-side tensor (the source and hot tables, the device caches, the resolve inputs, the
reference copies and the rows written) is made on the backend's device; the only host-to-device
traffic is explicit copies.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from hisparse_core.backend import Backend
from hisparse_core.capacity import check_device_memory, check_host_memory, device_limit
from hisparse_core.coordinator import CoordinatorConfig, HiSparseCoordinator, SimpleGpuBlockPool, StepRequest
from hisparse_core.coordinator.ahead import StepAhead
from hisparse_core.coordinator.config import GIB
from hisparse_core.coordinator.tables import apply_table_updates
from hisparse_core.errors import CapacityError, InvalidInputError
from hisparse_core.geometry import RowFormat, RuntimeConfig, row_format
from hisparse_core.planner import ModelGeometry, Plan, PlanInputs, make_plan, published_miss_rate
from hisparse_core.replay.acks import StepAcks
from hisparse_core.replay.attention import check_layer
from hisparse_core.replay.decode import DecodeRunner, graph_choice
from hisparse_core.replay.indexer import DEFAULT_LOCALITY, SyntheticIndexer
from hisparse_core.replay.kvdata import ReferenceKV, RowSource
from hisparse_core.replay.layout import check_flag_capabilities, hot_rows_for, hot_rows_limit_problem, index_groups
from hisparse_core.replay.locality import REFERENCE_LAYERS, REGIMES, LayeredIndexer, reference_layers, regime
from hisparse_core.replay.report import kv_place
from hisparse_core.replay.timing import PhaseTimer
from hisparse_core.replay.workload import RequestSpec, make_workload
from hisparse_core.residency import parse_resident_layers
from hisparse_core.types import OffloadCommand
from hisparse_core.units import at_most, ceil_size, floor_size, human_bytes
from hisparse_core.worker import CacheGroup, HiSparseWorker

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RunConfig:
    """What `hisparse run` replays. Sizes are bytes; `context` is prompt tokens."""

    requests: int = 16
    context: int = 16384
    decode_tokens: int = 32
    steps: int = 48
    top_k: int = 2048
    hot_multiple: float = 2.0
    layers: int = 2
    index_share: int = 2
    block_size: int = 64
    row_format: str = "fp8_ds_mla"
    indexer_bytes: int = 132
    gpu_kv_bytes: int = 96 << 20
    host_bytes: int = 256 << 20
    concurrency: int = 0           # most running requests (state rows); 0: as many as the GPU allows
    prefix_groups: int = 4
    shared_fraction: float = 0.5
    arrival_every: int = 1
    locality: float = 1.0
    tail_pages: int = 2
    rows_per_request: int = 1      # decode rows per request and step: 1 + speculative tokens
    acceptance: float = 1.0        # probability a speculative token is accepted (while all before it were)
    validate: bool = False
    cuda_graphs: bool = True       # capture the decode step where the backend declares cuda_graph
    plan_ahead: bool = True        # plan each pure decode step at the end of the step before
    seed: int = 0
    #: "": the one-figure calibrated indexer (`locality` scales it); "benign" / "code": the per-layer
    #: locality model of that regime (`hisparse_core.replay.locality`; `locality` is then unused).
    topk_model: str = ""
    #: Layers kept fully resident on the GPU: no hot buffer, no host copy, every lookup served from
    #: their own pages (whole index groups). They take `resident_kv_bytes` off the top of the budget.
    resident_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("requests", "context", "decode_tokens", "steps", "top_k", "layers", "index_share",
                     "block_size", "gpu_kv_bytes", "host_bytes", "rows_per_request"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise InvalidInputError(f"run {name} must be a positive int, got {v!r}")
        if isinstance(self.acceptance, bool) or not isinstance(self.acceptance, int | float) \
                or not 0.0 <= self.acceptance <= 1.0:
            raise InvalidInputError(f"run acceptance must be a probability in [0, 1], got {self.acceptance!r}")
        if self.concurrency < 0:
            raise InvalidInputError(f"run concurrency must be >= 0 (0: GPU-bound), got {self.concurrency}")
        row_format(self.row_format)
        if self.topk_model not in ("", *REGIMES):
            raise InvalidInputError(f"run topk_model must be '' (the one-figure indexer) or one of {sorted(REGIMES)}, "
                                    f"got {self.topk_model!r}")
        resident = parse_resident_layers(self.resident_layers, self.layers)
        object.__setattr__(self, "resident_layers", resident)   # normalised: sorted
        if len(resident) == self.layers:
            raise InvalidInputError(f"run resident_layers {list(resident)} keeps all {self.layers} layers resident; "
                                    "expected at least one layer through hisparse")
        first = 0
        for n in index_groups(self.layers, self.index_share):
            members = set(range(first, first + n))
            if members & set(resident) and not members <= set(resident):
                raise InvalidInputError(f"run resident_layers {list(resident)} splits index group {sorted(members)}; "
                                        "expected whole index groups (they share one top-k)")
            first += n
        if self.topk_model:
            # Each index group stands for one layer of the 61-layer reference model; two groups on
            # one layer failed mid-run in LayeredIndexer ("layers must be ascending ...").
            groups = index_groups(self.layers, self.index_share)
            leaders = [sum(groups[:g]) for g in range(len(groups))]
            ref = reference_layers(leaders, self.layers)
            twice = next((i for i in range(1, len(ref)) if ref[i] <= ref[i - 1]), None)
            if twice is not None:
                raise InvalidInputError(
                    f"run topk_model {self.topk_model} stands each index group for a layer of the "
                    f"{REFERENCE_LAYERS}-layer reference model; --layers {self.layers} in index groups of "
                    f"--index-share {self.index_share} makes {len(groups)} groups, and those of layers "
                    f"{leaders[twice - 1]} and {leaders[twice]} stand for the same one ({ref[twice]}): expected at "
                    f"most {REFERENCE_LAYERS} index groups spread over it (fewer --layers or a larger --index-share)")
        hot = hot_rows_for(self.top_k, self.hot_multiple, self.block_size)
        if why := hot_rows_limit_problem(self.top_k, self.hot_multiple, self.block_size):
            raise InvalidInputError(why)
        if hot < self.rows_per_request * self.top_k:
            raise InvalidInputError(
                f"--rows-per-request {self.rows_per_request} needs a hot buffer of {self.rows_per_request} x --top-k "
                f"{self.top_k} = {self.rows_per_request * self.top_k} rows (a step's rows resolve as one union); --hot "
                f"{self.hot_multiple:g} makes {hot}: expected --hot >= {self.rows_per_request}, or --rows-per-request "
                f"<= {hot // self.top_k}")

    @property
    def fmt(self) -> RowFormat:
        return row_format(self.row_format)

    @property
    def max_tokens(self) -> int:
        return self.context + self.decode_tokens

    @property
    def hot_rows(self) -> int:
        return hot_rows_for(self.top_k, self.hot_multiple, self.block_size)

    @property
    def offloaded_layers(self) -> int:
        """Layers through hisparse (host pool, hot buffers): all but `resident_layers`."""
        return self.layers - len(self.resident_layers)

    @property
    def resident_kv_bytes(self) -> int:
        """What the resident layers take off the top of the GPU budget: every page of theirs for
        `concurrency` requests (0: for all `requests`); the rest is hisparse's."""
        if not self.resident_layers:
            return 0
        pages = -(-self.max_tokens // self.block_size)
        return (self.concurrency or self.requests) * pages * len(self.resident_layers) * self.block_size \
            * self.fmt.row_bytes

    def geometry(self) -> ModelGeometry:
        return ModelGeometry("replay", self.offloaded_layers, self.fmt.row_bytes, self.indexer_bytes, self.top_k,
                             self.block_size, self.index_share)

    def plan(self, miss_rate: float | None = None) -> Plan:
        """The planner's figures for this configuration (requests of `context + decode_tokens`),
        for the layers through hisparse and their share of the GPU budget."""
        return make_plan(PlanInputs(self.geometry(), self.gpu_kv_bytes - self.resident_kv_bytes, self.host_bytes,
                                    self.max_tokens,
                                    self.hot_rows, published_miss_rate(self.hot_rows / self.top_k) if miss_rate is None
                                    else miss_rate, self.tail_pages))


@dataclass(slots=True)
class StepRecord:
    """What one engine step did and measured."""

    step: int
    seconds: float
    running: int
    admitted: int
    finished: int
    waiting: int
    prefill_tokens: int
    decode_rows: int
    resident: int
    hits: int
    misses: int
    h2d_bytes: int
    d2h_bytes: int
    gpu_blocks_leased: int
    host_blocks_used: int
    checked_entries: int
    gpu_bound: bool          # a waiting request was refused for lack of GPU blocks
    phase_seconds: dict[str, float] = field(default_factory=dict)   # timing.PHASES
    decode_device_seconds: float = 0.0   # the decode phase's resolve work on the device
    rejected_rows: int = 0               # speculative rows written, read and rolled back this step


@dataclass(slots=True)
class _Running:
    spec: RequestSpec
    state_index: int
    blocks: list[int]
    indexer_blocks: list[int]
    tokens: list[int]
    prefix_hit: int
    indexer: SyntheticIndexer | LayeredIndexer
    ref: ReferenceKV
    queries: torch.Tensor            # [layers, width] float32, on the engine's device
    computed: int = 0                # tokens whose KV is final
    prefilled: bool = False
    decoded: int = 0
    resident_blocks: list[int] = field(default_factory=list)   # every page of the resident layers


@dataclass(slots=True)
class EngineTotals:
    admitted: int = 0
    finished: int = 0
    prefix_hit_tokens: int = 0
    prefill_tokens: int = 0
    checked_entries: int = 0
    peak_running: int = 0
    peak_host_blocks: int = 0
    gpu_bound_steps: int = 0
    rejected_rows: int = 0          # speculative rows rolled back (acceptance < 1)
    rollbacks: int = 0              # request steps that rolled back at least one row
    resident_layer_entries: int = 0  # top-k entries of resident layers' groups (served from their own pages)
    records: list[StepRecord] = field(default_factory=list)
    pages: dict[str, int] = field(default_factory=dict)   # coordinator page and host-block counters


def _check_host_blocks(c: RunConfig, config: CoordinatorConfig) -> None:
    """`CapacityError` in the flags' words unless `--host` holds one whole request and the active
    tail (the coordinator's own rule, `HiSparseCoordinator`)."""
    usable = max(0, config.host_num_blocks - 1)
    if usable >= config.min_host_blocks:
        return
    need = (config.min_host_blocks + 1) * config.host_block_stride
    raise CapacityError(
        f"--host {human_bytes(c.host_bytes)} holds {usable} usable host blocks of {config.host_block_stride} B "
        f"({c.offloaded_layers} offloaded layers x {c.block_size} tokens x {config.row_bytes} B); one request of {c.max_tokens} tokens "
        f"(--context {c.context} + --decode-tokens {c.decode_tokens}) plus the {c.tail_pages}-page active tail needs "
        f"{config.min_host_blocks}: expected --host >= {ceil_size(need)}, or a shorter --context")


class ReplayEngine:
    """One replay: build with a config and a backend, call `step()` `config.steps` times, `close()`."""

    def __init__(self, config: RunConfig, backend: Backend, on_checked: Callable[[], None] | None = None) -> None:
        """Check the budgets (`CapacityError` in the flags' words), call `on_checked()` once they
        pass, then build the coordinator, host pool, worker and device caches."""
        c = self.config = config
        self.backend = backend
        self.fmt = c.fmt
        if c.resident_kv_bytes >= c.gpu_kv_bytes:
            # Nothing of the budget left for the layers through hisparse (the plan would get a
            # negative budget): said in the flags' words, with a budget that admits one request.
            probe = make_plan(PlanInputs(c.geometry(), c.gpu_kv_bytes, c.host_bytes, c.max_tokens, c.hot_rows, 0.0,
                                         c.tail_pages))
            need = c.resident_kv_bytes + probe.admission_blocks * probe.block_bytes
            raise CapacityError(
                f"--gpu-kv {human_bytes(c.gpu_kv_bytes)} is all taken by --resident-layers "
                f"{','.join(map(str, c.resident_layers))}: their pages for {c.concurrency or c.requests} requests of "
                f"{c.max_tokens} tokens need {human_bytes(c.resident_kv_bytes)}; expected --gpu-kv >= {ceil_size(need)} "
                "(with one admission through hisparse), or "
                + ("a lower --concurrency" if c.concurrency else
                   f"--concurrency below {c.requests} (0, the default, charges their pages for all --requests)")
                + ", or fewer --resident-layers")
        self.plan = c.plan()
        p = self.plan
        bs = c.block_size
        self.group_layers = index_groups(c.layers, c.index_share)
        self.group_first_layer = [sum(self.group_layers[:g]) for g in range(len(self.group_layers))]
        #: index groups kept fully resident (`resident_layers`), and those through hisparse, in order
        self.resident_groups = frozenset(g for g, first in enumerate(self.group_first_layer)
                                         if first in c.resident_layers)
        self.offloaded_groups = [g for g in range(len(self.group_layers)) if g not in self.resident_groups]
        self.layer_group = [(g, li) for g, n in enumerate(self.group_layers) for li in range(n)]
        check_flag_capabilities(backend, [self.group_layers[g] for g in self.offloaded_groups], index_share=c.index_share,
                                rows_per_request=c.rows_per_request, row_format_name=c.fmt.name)
        self.reference_layers = reference_layers(self.group_first_layer, c.layers)
        self.pages_per_request = p.pages_per_request
        self.indexer_blocks = p.indexer_blocks_per_request
        self.admission_blocks = p.admission_blocks
        self.hot_blocks = p.hot_blocks_per_request
        # Hybrid rule: requests that fit the hot buffer and tail stay resident, so they take no prefix
        # hit from host (that would read it through a hot buffer) and admit without one.
        self.stays_resident = p.stays_resident
        admission_hot = 0 if p.stays_resident else self.hot_blocks
        # State rows: the GPU can never hold more running requests than this bound.
        upper = max(1, p.gpu_blocks // max(1, min(p.steady_blocks_per_request, p.baseline_blocks_per_request)))
        # Resident layers: one block holds a page of every resident layer; a request holds all its pages.
        self.resident_block_bytes = len(c.resident_layers) * bs * self.fmt.row_bytes
        self.resident_blocks = c.resident_kv_bytes // self.resident_block_bytes if c.resident_layers else 0
        if c.resident_layers:
            if self.resident_blocks < self.pages_per_request:
                raise CapacityError(
                    f"the resident layers' share of the GPU budget ({c.resident_kv_bytes} B for layers "
                    f"{list(c.resident_layers)}) holds {self.resident_blocks} pages; one {c.max_tokens}-token request "
                    f"needs {self.pages_per_request}")
            upper = min(upper, self.resident_blocks // self.pages_per_request)
        self.max_running = c.concurrency if c.concurrency else upper
        if p.gpu_blocks < self.admission_blocks:
            kept = (f" ({c.resident_kv_bytes} B of it kept for resident layers {list(c.resident_layers)}: their pages "
                    f"for {c.concurrency or c.requests} requests)" if c.resident_layers else "")
            need = c.resident_kv_bytes + self.admission_blocks * p.block_bytes
            raise CapacityError(
                f"--gpu-kv {human_bytes(c.gpu_kv_bytes)}{kept} holds {p.gpu_blocks} blocks of {p.block_bytes} B; one "
                f"admission of a {c.max_tokens}-token request (--context {c.context} + --decode-tokens "
                f"{c.decode_tokens}) needs {self.admission_blocks} ({self.pages_per_request} pages + "
                f"{self.indexer_blocks} indexer + {admission_hot} hot): expected --gpu-kv >= {ceil_size(need)}, or a "
                "shorter --context")
        # Both budgets are checked before anything is built: the coordinator's host block pool
        # alone takes seconds at a terabyte, and the device caches are allocated whole.
        coordinator_config = CoordinatorConfig(
            host_pool_gib=c.host_bytes / GIB, num_layers=c.offloaded_layers, block_size=bs, row_bytes=self.fmt.row_bytes,
            max_model_len=c.max_tokens, hot_blocks_per_request=self.hot_blocks, active_tail_pages=c.tail_pages,
            pressure_watermark_blocks=self.admission_blocks)
        _check_host_blocks(c, coordinator_config)
        dev = torch.device(backend.device)
        limit = free = device_limit(dev)
        kv_bytes = p.gpu_blocks * p.block_bytes + self.resident_blocks * self.resident_block_bytes
        if dev.type == "cpu" and limit is not None:
            # The host pool is host RAM too: the size named must fit beside it.
            free = max(0, limit - c.host_bytes)
        fits = at_most(free, floor_size)
        where = "; the backend runs on the CPU, so the KV pool is in host RAM" if dev.type == "cpu" else ""
        resident = (f" and {self.resident_blocks} resident-layer blocks x {self.resident_block_bytes} B"
                    if c.resident_layers else "")
        check_device_memory(dev, kv_bytes, f"--gpu-kv {human_bytes(c.gpu_kv_bytes)} ({p.gpu_blocks} blocks x "
                                           f"{p.block_bytes} B{resident}{where})", remedy=f"lower --gpu-kv{fits}")
        check_host_memory(c.host_bytes, f"--host {human_bytes(c.host_bytes)} (the host pool)",
                          remedy="lower --host")
        if dev.type == "cpu":  # both pools in host RAM: each fitting alone is not enough
            together = f" so that together they take at most {floor_size(limit)}" if limit else ""
            check_host_memory(kv_bytes + c.host_bytes,
                              f"--gpu-kv {human_bytes(c.gpu_kv_bytes)} and --host {human_bytes(c.host_bytes)} together "
                              "(the backend runs on the CPU, so the KV pool and the host pool are both in host RAM)",
                              remedy=f"lower --gpu-kv or --host{together}")
        if on_checked is not None:
            on_checked()
        self.gpu = SimpleGpuBlockPool(p.gpu_blocks)
        self.resident_pool = SimpleGpuBlockPool(self.resident_blocks) if c.resident_layers else None
        # The coordinator, host pool and worker see only the layers through hisparse.
        self.coordinator = HiSparseCoordinator(coordinator_config, self.gpu)
        max_pages = p.pages_per_request
        self.max_batch_rows = self.max_running * c.rows_per_request
        groups = [CacheGroup(RuntimeConfig(max_batch_rows=self.max_batch_rows, max_requests=self.max_running,
                                           top_k=c.top_k, hot_rows=c.hot_rows, block_size=bs, max_pages=max_pages,
                                           row_format=self.fmt, num_layers=n, rows_per_request=c.rows_per_request),
                             resident_group=0,
                             name=f"index group {g} (layers {self.group_first_layer[g]}-"
                                  f"{self.group_first_layer[g] + n - 1})")
                  for g, n in enumerate(self.group_layers) if g not in self.resident_groups]
        self.worker = HiSparseWorker(backend, groups, num_host_blocks=self.coordinator.host_num_blocks)
        try:  # the worker holds the host pool from here on
            self.device = dev = backend.device
            self.device_layers = [[torch.zeros((self.resident_blocks if g in self.resident_groups else p.gpu_blocks, bs,
                                                self.fmt.width), dtype=self.fmt.dtype, device=dev)
                                   for _ in range(n)] for g, n in enumerate(self.group_layers)]
            self.worker.register_caches([self.device_layers[g] for g in self.offloaded_groups])
            self.source_table = torch.full((self.max_running, max_pages), -1, dtype=torch.int32, device=dev)
            self.hot_table = torch.full((self.max_running, self.hot_blocks), -1, dtype=torch.int32, device=dev)
            self.resident_table = self.worker.residency_table(0)
            graphs, why = graph_choice(backend, enabled=c.cuda_graphs, validate=c.validate)
            self.decoder = DecodeRunner(self.worker.runtimes, [self.group_layers[g] for g in self.offloaded_groups],
                                        source_table=self.source_table,
                                        resident_table=self.resident_table, hot_table=self.hot_table,
                                        max_rows=self.max_batch_rows, top_k=c.top_k, device=dev, graphs=graphs,
                                        validate=c.validate)
            logger.info("replay: decode step %s (%s)", "captured in one CUDA graph per batch size" if graphs
                        else "run eagerly", why)
            if c.resident_layers:
                logger.info("replay: layers %s kept fully resident (%d blocks of %d B, %d B of --gpu-kv); the other "
                            "%d layers go through hisparse", list(c.resident_layers), self.resident_blocks,
                            self.resident_block_bytes, c.resident_kv_bytes, c.offloaded_layers)
            if c.topk_model:
                logger.info("replay: top-k from the %s locality model, index groups standing for reference layers %s",
                            c.topk_model, self.reference_layers)
            self.rows = RowSource(self.fmt, c.layers, seed=c.seed, device=dev)
            self.locality = DEFAULT_LOCALITY.scaled(c.locality)
            self.pending = deque(make_workload(c.requests, c.context, c.decode_tokens, prefix_groups=c.prefix_groups,
                                               shared_fraction=c.shared_fraction, arrival_every=c.arrival_every))
        except BaseException:
            self.worker.shutdown()
            raise
        self.acks = StepAcks()
        self.timer = PhaseTimer()
        self.waiting: deque[RequestSpec] = deque()
        self.running: list[_Running] = []
        self.free_states = list(range(self.max_running - 1, -1, -1))
        self.totals = EngineTotals()
        self.step_no = 0
        # Plan each pure decode step at the end of the step before (hisparse_core.coordinator.ahead).
        self.plan_ahead = c.plan_ahead
        self.ahead = StepAhead(start_step=self.worker.start_step, close_step=self.worker.after_forward)
        place = kv_place(dev)  # "GPU" on CUDA, else the device's ("cpu device"): a CPU run's pool is host RAM
        logger.info(
            "replay: %d layers in index groups %s, top-k %d, hot buffer %d rows, %s; %s KV pool %d blocks of %d B, "
            "admission needs %d free (%d pages + %d indexer + %d hot); host pool %d blocks; state rows %d (%s), "
            "%d decode rows per request%s",
            c.layers, self.group_layers, c.top_k, c.hot_rows, self.fmt.name, place, p.gpu_blocks, p.block_bytes,
            self.admission_blocks, self.pages_per_request, self.indexer_blocks, admission_hot,
            self.coordinator.host_num_blocks, self.max_running,
            "--concurrency" if c.concurrency else f"{place} blocks / smallest per-request footprint", c.rows_per_request,
            f"; requests of {c.max_tokens} tokens fit the {c.hot_rows}-row hot buffer and {c.tail_pages}-page tail, "
            "so they stay resident "
            "(no hot buffer, no host prefix hits)" if p.stays_resident else "")

    # ----------------------------------------------------------------------------- steps

    def _finish(self) -> list[str]:
        done = [r for r in self.running if r.decoded >= r.spec.decode_tokens]
        for r in done:
            self.running.remove(r)
            self.gpu.release(r.indexer_blocks)
            if self.resident_pool is not None:
                self.resident_pool.release(r.resident_blocks)
            with self.timer.phase("worker"):
                self.worker.reset_state([r.state_index])
            self.source_table[r.state_index] = -1
            self.hot_table[r.state_index] = -1
            self.free_states.append(r.state_index)
        self.totals.finished += len(done)
        return [r.spec.request_id for r in done]

    def _admit(self) -> tuple[int, bool]:
        """Admit waiting requests FIFO while one full admission fits; (admitted, refused for GPU)."""
        admitted = 0
        c = self.config
        while self.waiting and len(self.running) < self.max_running:
            if self.gpu.num_free_blocks < self.admission_blocks:
                return admitted, True
            if self.coordinator.num_free_host_blocks < self.pages_per_request:
                return admitted, False
            if self.resident_pool is not None and self.resident_pool.num_free_blocks < self.pages_per_request:
                return admitted, True
            spec = self.waiting[0]
            tokens = spec.token_ids()
            try:
                with self.timer.phase("coordinator"):
                    hit = self.coordinator.add_request(spec.request_id, tokens[:spec.prompt_tokens],
                                                       max_prefix_tokens=0 if self.stays_resident
                                                       else spec.prompt_tokens - 1)
            except CapacityError:
                return admitted, True
            self.waiting.popleft()
            first = self.coordinator.first_resident_page(spec.request_id)
            prompt_pages = -(-spec.prompt_tokens // c.block_size)
            indexer = self.gpu.acquire(self.indexer_blocks)
            blocks = [-1] * first + self.gpu.acquire(prompt_pages - first)
            gen = torch.Generator().manual_seed(c.seed * 1_000_003 + spec.index)
            queries = (torch.randn((c.layers, self.fmt.width), generator=gen) / 64.0).to(self.device)
            r = _Running(spec, self.free_states.pop(), blocks, indexer, tokens, hit, self._indexer(spec.index),
                         ReferenceKV(self.fmt, c.layers, spec.total_tokens, self.device), queries, computed=hit,
                         resident_blocks=self.resident_pool.acquire(self.pages_per_request)
                         if self.resident_pool is not None else [])
            self.running.append(r)
            admitted += 1
            self.totals.prefix_hit_tokens += hit
            logger.debug("step %d: admitted %s (state row %d, prefix hit %d tokens)", self.step_no,
                         spec.request_id, r.state_index, hit)
        return admitted, False

    def _indexer(self, index: int) -> SyntheticIndexer | LayeredIndexer:
        c = self.config
        if c.topk_model:
            return LayeredIndexer(c.top_k, self.reference_layers, regime(c.topk_model), seed=c.seed, request_id=index)
        return SyntheticIndexer(c.top_k, len(self.group_layers), self.locality, seed=c.seed, request_id=index)

    def _write(self, r: _Running, start: int, end: int, *, device_from: int, draft_key: int | None = None) -> None:
        """Write the KV rows of positions [start, end) into the reference, and those from
        `device_from` on into the request's resident pages (all on the engine's device).
        `draft_key`: the contents of rejected speculative rows instead of the request's own."""
        bs, width, dev = self.config.block_size, self.fmt.width, self.device
        runs = r.spec.content_keys(start, end) if draft_key is None else [(draft_key, start, end)]
        for key, lo, hi in runs:
            positions = torch.arange(lo, hi, device=dev)
            dev_lo = max(lo, device_from)
            if dev_lo < hi:
                first_page = dev_lo // bs
                blocks = r.blocks[first_page:(hi - 1) // bs + 1]
                if min(blocks) < 0:
                    raise InvalidInputError(f"{r.spec.request_id}: writing a host-backed page")
                dpos = positions[dev_lo - lo:]
                dev_rows = torch.tensor(blocks, dtype=torch.int64, device=dev)[dpos // bs - first_page] * bs + dpos % bs
            if self.resident_pool is not None:   # resident layers: every position, into their own pages
                res = torch.tensor(r.resident_blocks, dtype=torch.int64, device=dev)[positions // bs] * bs + positions % bs
            for layer in range(self.config.layers):
                rows = self.rows.rows(key, positions, layer)
                r.ref.write(layer, lo, rows)
                g, li = self.layer_group[layer]
                cache = self.device_layers[g][li].view(-1, width)
                if g in self.resident_groups:
                    cache[res] = rows
                elif dev_lo < hi:
                    cache[dev_rows] = rows[dev_lo - lo:]

    def _new_tokens(self, r: _Running) -> int:
        """Tokens a decoding request writes this step: itself and its speculative successors."""
        return min(self.config.rows_per_request, r.spec.decode_tokens - r.decoded)

    def _accepted(self, r: _Running, written: int) -> int:
        """Of the `written` rows of a decode step, how many are kept: the token itself, then each
        successor with probability `acceptance` while all before it were (seeded per request and
        step, so every backend replays the same rejections)."""
        p = self.config.acceptance
        if p >= 1.0:
            return written
        rng = np.random.default_rng((self.config.seed, r.spec.index, self.step_no))
        kept = 1
        while kept < written and rng.random() < p:
            kept += 1
        return kept

    def _roll_back(self, r: _Running, start: int, end: int) -> None:
        """Rows [start, end) of `r` were rejected: forget their hot copies in every runtime."""
        bs = self.config.block_size
        host = self.coordinator.source_block_ids(r.spec.request_id)
        rows = [host[p // bs] * bs + p % bs for p in range(start, end) if p // bs < len(host) and host[p // bs] >= 0]
        if rows:
            states = torch.full((len(rows),), r.state_index, dtype=torch.int32).to(self.device)
            host_rows = torch.tensor(rows, dtype=torch.int32).to(self.device)
            for runtime in self.worker.runtimes:
                runtime.invalidate_written_slots(states, host_rows)

    def step(self) -> StepRecord:
        t0 = time.perf_counter()
        # Planned at the end of the step before (`_plan_next`): nobody arrives, is admitted or
        # finishes, and every running request decodes.
        planned = self.ahead.claim(self.step_no)
        while self.pending and self.pending[0].arrival_step <= self.step_no:
            self.waiting.append(self.pending.popleft())
        finished = self._finish()
        admitted, gpu_bound = self._admit()

        prefill: list[_Running]
        decode: list[_Running]
        if planned:
            prefill, decode, command = [], list(self.running), self.ahead.command
        else:
            prefill, decode, scheduled = self._scheduled()
            with self.timer.phase("coordinator"):
                command = self.coordinator.schedule_step(scheduled, finished=finished)
            with self.timer.phase("worker"):
                apply_table_updates(self.coordinator.take_table_updates(), self.source_table, self.hot_table)
                self.worker.start_step(command)

        # Forward: write this step's rows.
        prefill_tokens = 0
        with self.timer.phase("forward"):
            for r in prefill:
                self._write(r, 0, r.spec.prompt_tokens, device_from=r.prefix_hit)
                prefill_tokens += r.spec.prompt_tokens - r.prefix_hit
            kept: dict[str, int] = {}
            for r in decode:
                n = self._new_tokens(r)
                a = kept[r.spec.request_id] = self._accepted(r, n)
                self._write(r, r.computed, r.computed + a, device_from=r.computed)
                if a < n:
                    draft = (0x5EC000 + r.spec.index * 7919 + self.step_no) & 0xFFFFFF
                    self._write(r, r.computed + a, r.computed + n, device_from=r.computed + a, draft_key=draft)
        checked, rows = self._decode_attention(decode) if decode else (0, 0)

        with self.timer.phase("worker"):
            self.worker.after_forward()
            drained = self.worker.build_metadata(wait=True)
        submitted = {t.transfer_id for t in command.page_transfers} if command else set()
        copies = {h.dst_block_id for h in command.host_block_copies} if command else set()
        with self.timer.phase("coordinator"):
            self.coordinator.update_from_workers(self.acks.settle(drained, submitted, copies), 1)
        for r in prefill:
            r.computed, r.prefilled = r.spec.prompt_tokens, True
        rejected = 0
        for r in decode:
            n, a = self._new_tokens(r), kept[r.spec.request_id]
            if a < n:
                with self.timer.phase("worker"):
                    self._roll_back(r, r.computed + a, r.computed + n)
                rejected += n - a
                self.totals.rollbacks += 1
                r.indexer.rewind(r.computed + a)
            r.computed += a
            r.decoded += a
        self.totals.rejected_rows += rejected

        with self.timer.phase("worker"):
            ws = self.worker.take_stats()
        with self.timer.phase("coordinator"):
            cs = self.coordinator.stats()
        t = self.totals
        t.admitted += admitted
        t.prefill_tokens += prefill_tokens
        t.checked_entries += checked
        t.peak_running = max(t.peak_running, len(self.running))
        t.peak_host_blocks = max(t.peak_host_blocks, cs.host_blocks_used)
        t.gpu_bound_steps += int(gpu_bound)
        t.pages = {"spilled": cs.spills, "released": cs.released_pages, "reused": cs.lost_pages,
                   "restored": cs.restores, "host_blocks_evicted": cs.evicted_blocks}
        rec = StepRecord(self.step_no, time.perf_counter() - t0, len(self.running), admitted, len(finished),
                         len(self.waiting), prefill_tokens, rows, ws.resident, ws.hits, ws.misses,
                         ws.h2d_bytes, ws.d2h_bytes, self.gpu.num_leased_blocks, cs.host_blocks_used, checked,
                         gpu_bound, self.timer.take(), self.decoder.device_seconds() if decode else 0.0, rejected)
        t.records.append(rec)
        self.step_no += 1
        self._plan_next()
        return rec

    def _scheduled(self) -> tuple[list[_Running], list[_Running], list[StepRequest]]:
        """This step's prefill and decode requests and their scheduled views, with the GPU blocks
        of the pages they write leased."""
        bs = self.config.block_size
        scheduled: list[StepRequest] = []
        prefill: list[_Running] = []
        decode: list[_Running] = []
        for r in self.running:
            if not r.prefilled:
                nc, nn = r.prefix_hit, r.spec.prompt_tokens - r.prefix_hit
                prefill.append(r)
            else:
                nc, nn = r.computed, self._new_tokens(r)
                need = (nc + nn - 1) // bs + 1 - len(r.blocks)
                if need > 0:
                    try:
                        r.blocks.extend(self.gpu.acquire(need))
                    except CapacityError as exc:
                        raise CapacityError(f"step {self.step_no}: no GPU block for the next page of "
                                            f"{r.spec.request_id}: {exc}. The admission reserve should prevent "
                                            f"this") from None
                decode.append(r)
            scheduled.append(StepRequest(r.spec.request_id, r.state_index, nc, nn, r.tokens[:nc + nn], [r.blocks]))
        return prefill, decode, scheduled

    def _next_is_decode(self) -> bool:
        """The next step can only be a decode of every running request: nobody arrives, waits,
        is prefilled or finishes."""
        nxt = self.step_no
        return bool(self.running) and not self.waiting and not (self.pending and self.pending[0].arrival_step <= nxt) \
            and all(r.prefilled and r.decoded < r.spec.decode_tokens for r in self.running)

    def _plan_next(self) -> None:
        """At the end of a step: plan the next one now when it can only be a decode
        (`hisparse_core.coordinator.ahead`). The coordinator sees the same calls in the same order
        as when the next step plans itself, so every figure is the same."""
        if not (self.plan_ahead and self._next_is_decode()):
            return

        def prepare() -> OffloadCommand | None:
            _, _, scheduled = self._scheduled()
            command = self.coordinator.schedule_step(scheduled)
            apply_table_updates(self.coordinator.take_table_updates(), self.source_table, self.hot_table)
            return command

        with self.timer.phase("coordinator"):
            self.ahead.plan(self.step_no, prepare)

    def _decode_attention(self, batch: list[_Running]) -> tuple[int, int]:
        """Resolve and check every decode row of `batch`; (entries checked, decode rows)."""
        owners: list[_Running] = []
        seq: list[int] = []
        with self.timer.phase("indexer"):
            picks = []
            for r in batch:
                for j in range(self._new_tokens(r)):
                    owners.append(r)
                    seq.append(r.computed + j + 1)
                    picks.append(r.indexer.step(seq[-1]))
            topk = np.stack(picks, axis=1)                                   # [G, B, K]
        n = len(owners)
        with self.timer.phase("decode"):
            self.decoder.run(topk[self.offloaded_groups] if self.resident_groups else topk,
                             [r.state_index for r in owners], seq)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        checked = 0
        ids = [r.spec.request_id for r in owners]
        with self.timer.phase("check"):
            for g, n_layers in enumerate(self.group_layers):
                if g in self.resident_groups:
                    rows, topk_g = self._resident_rows(owners, topk[g])
                else:
                    i = self.offloaded_groups.index(g)
                    rows, topk_g = self.decoder.result(i).rows[:n], self.decoder.topk(i, n)
                for li in range(n_layers):
                    layer = self.group_first_layer[g] + li
                    cache = self.device_layers[g][li].view(-1, self.fmt.width)
                    queries = torch.stack([r.queries[layer] for r in owners])
                    checked += check_layer(cache, rows, topk_g, [r.ref.data[layer] for r in owners], queries, ids,
                                           layer)
        return checked, n

    def _resident_rows(self, owners: list[_Running], topk: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """A resident group's lookups `[B, K]`: each position's row in its request's own pages."""
        bs, dev = self.config.block_size, self.device
        pos = torch.from_numpy(np.ascontiguousarray(topk)).to(dev, torch.int64)
        table = torch.tensor([r.resident_blocks for r in owners], dtype=torch.int64, device=dev)
        safe = pos.clamp(min=0)
        rows = torch.where(pos >= 0, table.gather(1, safe // bs) * bs + safe % bs, -1)
        self.totals.resident_layer_entries += int((pos >= 0).sum())
        return rows, pos

    # ----------------------------------------------------------------------------- end

    @property
    def done(self) -> bool:
        """Every offered request has finished (later steps would have nothing to do)."""
        return not (self.pending or self.waiting or self.running)

    def close(self) -> None:
        self.ahead.cancel()
        self.worker.shutdown()

    def describe(self) -> dict[str, object]:
        return {**asdict(self.config), "hot_rows": self.config.hot_rows, "index_groups": self.group_layers,
                "row_bytes": self.fmt.row_bytes, "gpu_blocks": self.plan.gpu_blocks,
                "block_bytes": self.plan.block_bytes, "host_blocks": self.coordinator.host_num_blocks,
                "admission_blocks": self.admission_blocks, "state_rows": self.max_running,
                "max_batch_rows": self.max_batch_rows, "decode_mode": self.decoder.mode,
                "resident_blocks": self.resident_blocks, "reference_layers": self.reference_layers,
                "graph_sizes": self.decoder.captured_sizes}


def measure_all_resident_concurrency(gpu_blocks: int, blocks_per_request: int) -> int:
    """Admit all-resident requests (every page plus indexer blocks) into a fresh pool of the same
    size until it refuses; the count of admitted requests."""
    pool = SimpleGpuBlockPool(gpu_blocks)
    n = 0
    while True:
        try:
            pool.acquire(blocks_per_request)
        except CapacityError:
            return n
        n += 1
