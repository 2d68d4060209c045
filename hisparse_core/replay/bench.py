"""`hisparse bench`: drive one backend's runtimes through a multi-step synthetic decode.

A runtime-level benchmark (no coordinator, no worker): each request's prompt sits in the host
pool, its newest `tail_pages` pages are resident, and every decode step

1. writes the new token's row into its resident tail page and mirrors it to host
   (`mirror_rows`), moving the tail window when a page fills;
2. asks the synthetic indexer for each request's top-k per index group;
3. resolves every index group (`resolve(gather=True, validate=False)`) and replays the miss plan
   into the group's follower layers (`replay_plan`).

The data-plane time of step 1 and 3 is the step time; the indexer stand-in is timed apart.
Counters come from the runtimes (`stats()`), read after each step outside the timed region.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from hisparse_core.backend import Backend, check_capabilities
from hisparse_core.capacity import check_device_memory, check_host_memory, device_limit, host_limit
from hisparse_core.errors import InvalidInputError
from hisparse_core.geometry import RowFormat, RuntimeConfig, row_format
from hisparse_core.host_pool import HostPoolSpec
from hisparse_core.replay.indexer import DEFAULT_LOCALITY, SyntheticIndexer
from hisparse_core.replay.layout import check_flag_capabilities, hot_rows_for, hot_rows_limit_problem, index_groups
from hisparse_core.replay.report import counted
from hisparse_core.runtime import CacheRuntime, ResolveInputs, RuntimeStats
from hisparse_core.types import RowMirror
from hisparse_core.units import at_most

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """What `hisparse bench` runs. `hot_multiple` is the hot buffer in units of top-k."""

    requests: int = 4
    context: int = 16384
    steps: int = 40
    top_k: int = 2048
    hot_multiple: float = 2.0
    layers: int = 4
    index_share: int = 2
    block_size: int = 64
    tail_pages: int = 2
    row_format: str = "fp8_ds_mla"
    locality: float = 1.0
    warmup: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("requests", "context", "steps", "top_k", "layers", "index_share", "block_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise InvalidInputError(f"bench {name} must be a positive int, got {v!r}")
        if self.tail_pages < 1:
            raise InvalidInputError(f"bench tail_pages must be >= 1 (the page being written), got {self.tail_pages}")
        if not 0 <= self.warmup < self.steps:
            raise InvalidInputError(f"bench warmup must be in [0, steps={self.steps}), got {self.warmup}")
        row_format(self.row_format)  # raises for an unknown name
        hot_rows_for(self.top_k, self.hot_multiple, self.block_size)
        if why := hot_rows_limit_problem(self.top_k, self.hot_multiple, self.block_size):
            raise InvalidInputError(why)

    @property
    def fmt(self) -> RowFormat:
        return row_format(self.row_format)

    @property
    def hot_rows(self) -> int:
        return hot_rows_for(self.top_k, self.hot_multiple, self.block_size)

    @property
    def max_pages(self) -> int:
        return -(-(self.context + self.steps) // self.block_size)


@dataclass(frozen=True, slots=True)
class StepSample:
    """One decode step: data-plane seconds, indexer seconds, and the counter deltas."""

    seconds: float
    indexer_seconds: float
    resident: int
    hits: int
    misses: int
    h2d_bytes: int
    d2h_bytes: int


@dataclass(slots=True)
class BenchResult:
    backend: dict[str, object]
    config: dict[str, object]
    samples: list[StepSample] = field(default_factory=list)
    setup_seconds: float = 0.0
    wall_seconds: float = 0.0

    def _sum(self, name: str, start: int = 0) -> int:
        return sum(getattr(s, name) for s in self.samples[start:])

    def summary(self) -> dict[str, object]:
        """Every reported figure, derived from the per-step samples."""
        warm = int(self.config["warmup"])  # type: ignore[call-overload]
        row_bytes = int(self.config["row_bytes"])  # type: ignore[call-overload]
        secs = [s.seconds for s in self.samples]
        out: dict[str, object] = {}
        for label, start in (("all", 0), ("steady", warm)):
            hits, misses, resident = self._sum("hits", start), self._sum("misses", start), self._sum("resident", start)
            looked = hits + misses
            out[label] = {
                "steps": len(self.samples) - start,
                "resident_entries": resident,
                "hits": hits,
                "misses": misses,
                "hit_rate": hits / looked if looked else 1.0,
                "miss_rate_per_entry": misses / (looked + resident) if looked + resident else 0.0,
                "rows_h2d": self._sum("h2d_bytes", start) // row_bytes,
                "bytes_h2d": self._sum("h2d_bytes", start),
                "bytes_d2h": self._sum("d2h_bytes", start),
            }
        out["step_ms_mean"] = 1e3 * statistics.fmean(secs)
        out["step_ms_median"] = 1e3 * statistics.median(secs)
        out["step_ms_max"] = 1e3 * max(secs)
        out["steps_per_s"] = len(secs) / sum(secs) if sum(secs) else float("inf")
        out["indexer_ms_mean"] = 1e3 * statistics.fmean(s.indexer_seconds for s in self.samples)
        out["setup_s"] = self.setup_seconds
        out["wall_s"] = self.wall_seconds
        return out

    def to_json(self) -> dict[str, object]:
        return {"backend": self.backend, "config": self.config, "summary": self.summary(),
                "steps": [asdict(s) for s in self.samples]}


def _stats_sum(runtimes: list[CacheRuntime]) -> RuntimeStats:
    tot = RuntimeStats()
    for rt in runtimes:
        s = rt.stats()
        tot = RuntimeStats(tot.resident + s.resident, tot.hits + s.hits, tot.misses + s.misses,
                           tot.h2d_bytes + s.h2d_bytes, tot.d2h_bytes + s.d2h_bytes)
    return tot


def _fill_pattern(view: torch.Tensor, block_size: int, gen: torch.Generator) -> None:
    """Fill a `[rows, width]` host or device view with a repeated random block of bytes (cheap,
    and touches every page as a real prefill would)."""
    raw = view.view(torch.uint8).view(-1, block_size, view.element_size() * view.shape[-1])
    pattern = torch.randint(0, 256, raw.shape[1:], dtype=torch.uint8, generator=gen)
    raw.copy_(pattern.expand_as(raw))


#: The flags that shrink each request's device caches, for bench's refusals.
_HOT = ("--top-k", "--hot", "--tail-pages")


def _either(flags: tuple[str, ...]) -> str:
    """"A", "A or B", "A, B or C"."""
    return ", ".join(flags[:-1]) + " or " + flags[-1] if len(flags) > 1 else "".join(flags)


@dataclass(frozen=True, slots=True)
class _Fits:
    """The largest --requests (the rest as given) and --context (the rest as given) whose device
    caches and host pool fit the memory checks of `run_bench`, for its refusals to name, as `hisparse
    run`'s name the largest --gpu-kv or --host that fits (`units.at_most`); 0 where none does or the
    memory is unknown. Where the backend runs on the CPU both are host RAM and each figure fits
    every check at once."""

    requests: int
    context: int
    tail_pages: int = 0

    @classmethod
    def of(cls, c: BenchConfig, device: torch.device, hot_blocks: int) -> _Fits:
        page = c.block_size * c.layers * c.fmt.row_bytes  # one block (page) of every layer
        device_per_request = (hot_blocks + c.tail_pages + 1) * page
        host_per_request = c.max_pages * page
        host, on_device = host_limit(), device_limit(device)
        if host is None or on_device is None:
            return cls(0, 0)
        if device.type == "cpu":  # one limit for both: each request takes its caches and its pages there
            requests = host // (device_per_request + host_per_request)
            pages = max(0, host - c.requests * device_per_request) // (c.requests * page)
            device_blocks = max(0, host - c.requests * host_per_request) // (c.requests * page)
        else:
            requests = min(on_device // device_per_request, host // host_per_request)
            pages = host // (c.requests * page)
            device_blocks = on_device // (c.requests * page)
        tail = device_blocks - hot_blocks - 1  # each request cycles tail_pages + 1 resident blocks
        return cls(min(requests, c.requests - 1), max(0, min(pages * c.block_size - c.steps, c.context - 1)),
                   max(0, min(tail, c.tail_pages - 1)))

    def remedy(self, plain: str, *, context: bool = False, others: tuple[str, ...] = ()) -> str:
        """`lower --requests to at most R, or --context to at most C, or --tail-pages to at most T,
        or OTHERS` (--context where `context`, --tail-pages where `others` names it, then left out
        of them), naming each figure that fits; `plain` where none does."""
        sized = [f"--requests{at_most(self.requests)}"] if self.requests else []
        if context and self.context:
            sized.append(f"--context{at_most(self.context)}")
        if "--tail-pages" in others and self.tail_pages:
            sized.append(f"--tail-pages{at_most(self.tail_pages)}")
            others = tuple(f for f in others if f != "--tail-pages")
        return "lower " + ", or ".join(sized + ([_either(others)] if others else [])) if sized else plain


def run_bench(config: BenchConfig, backend: Backend,
              on_step: Callable[[int, StepSample], None] | None = None,
              on_checked: Callable[[], None] | None = None) -> BenchResult:
    """Run the benchmark on `backend`; `on_step(step, sample)` after each step (progress);
    `on_checked()` once the device and host memory checks have passed, before anything is
    allocated or logged."""
    t_start = time.perf_counter()
    c, fmt, bs = config, config.fmt, config.block_size
    group_layers = index_groups(c.layers, c.index_share)
    n_req, pages, hot_rows, k = c.requests, c.max_pages, c.hot_rows, c.top_k
    hot_blocks = hot_rows // bs
    tail_slots = c.tail_pages + 1  # resident blocks cycled per request
    num_dev_blocks = n_req * (hot_blocks + tail_slots)
    check_flag_capabilities(backend, group_layers, index_share=c.index_share, rows_per_request=1,
                            row_format_name=fmt.name)  # in the flags' words, then the runtimes' own
    check_capabilities(backend, [RuntimeConfig(max_batch_rows=n_req, max_requests=n_req, top_k=k, hot_rows=hot_rows,
                                               block_size=bs, max_pages=pages, row_format=fmt, num_layers=n)
                                 for n in group_layers])
    dev = backend.device
    fits = _Fits.of(c, torch.device(dev), hot_blocks)
    check_device_memory(dev, num_dev_blocks * bs * c.layers * fmt.row_bytes,
                        f"device caches of {num_dev_blocks} blocks x {counted(c.layers, 'layer')} "
                        f"({counted(n_req, 'request')} x "
                        f"({hot_blocks} hot + {tail_slots} tail blocks))",
                        remedy=fits.remedy("lower --requests, --top-k, --hot or --tail-pages", others=_HOT))
    spec = HostPoolSpec(num_layers=c.layers, num_blocks=n_req * pages, block_size=bs, row_format=fmt)
    # Checked here with bench's own flags (the pool's check would say "lower the host pool budget").
    check_host_memory(spec.nbytes, f"the host pool of {counted(n_req, 'request')} x {counted(pages, 'page')} of "
                                   f"{c.context}-token prompts x {counted(c.layers, 'layer')}", remedy=fits.remedy("lower --context or --requests", context=True))
    if torch.device(dev).type == "cpu":  # both in host RAM: each fitting alone is not enough
        check_host_memory(num_dev_blocks * bs * c.layers * fmt.row_bytes + spec.nbytes,
                          "the device caches and the host pool together (the backend runs on the CPU, so both are in "
                          "host RAM)", remedy=fits.remedy("lower --requests, --context, --top-k, --hot or --tail-pages",
                                                          context=True, others=_HOT))
    if on_checked is not None:
        on_checked()
    logger.info("bench: %s of %d tokens, %s, top-k %d, hot buffer %d rows (%.2fx), "
                "%s in %s %s, %s rows of %d B, %s resident, locality %.2f",
                counted(n_req, "request"), c.context, counted(c.steps, "step"), k, hot_rows, hot_rows / k,
                counted(c.layers, "layer"), counted(len(group_layers), "index group"), group_layers,
                fmt.name, fmt.row_bytes, counted(c.tail_pages, "tail page"), c.locality)
    pool = backend.create_host_pool(spec)
    try:
        gen = torch.Generator().manual_seed(c.seed)
        runtimes: list[CacheRuntime] = []
        layer0 = 0
        device_layers: list[list[torch.Tensor]] = []
        for n_layers in group_layers:
            cfg = RuntimeConfig(max_batch_rows=n_req, max_requests=n_req, top_k=k, hot_rows=hot_rows, block_size=bs,
                                max_pages=pages, row_format=fmt, num_layers=n_layers)
            rt = backend.create_runtime(cfg)
            host_views = [pool.layer_view(layer0 + i) for i in range(n_layers)]
            for v in host_views:
                _fill_pattern(v, bs, gen)
            layers = [torch.zeros((num_dev_blocks, bs, fmt.width), dtype=fmt.dtype, device=dev)
                      for _ in range(n_layers)]
            rt.bind(host_views, layers)
            runtimes.append(rt)
            device_layers.append(layers)
            layer0 += n_layers

        i32 = torch.int32
        source = (torch.arange(n_req * pages, dtype=i32, device=dev).view(n_req, pages))
        resident = torch.full((n_req, pages), -1, dtype=i32, device=dev)
        hot_table = torch.arange(n_req * hot_blocks, dtype=i32, device=dev).view(n_req, hot_blocks)
        row_state = torch.arange(n_req, dtype=i32, device=dev)
        seq = [c.context] * n_req
        tail_base = n_req * hot_blocks

        def tail_block(r: int, page: int) -> int:
            return tail_base + r * tail_slots + page % tail_slots

        def make_resident(r: int, page: int) -> None:
            """Page becomes resident: its block gets the host rows written so far."""
            blk = tail_block(r, page)
            resident[r, page] = blk
            lo = page * bs
            n = min(bs, seq[r] - lo)
            if n > 0:
                host_row = int(source[r, page]) * bs
                layer = 0
                for gi, n_layers in enumerate(group_layers):
                    for li in range(n_layers):
                        device_layers[gi][li].view(-1, fmt.width)[blk * bs:blk * bs + n] = \
                            pool.layer_view(layer + li)[host_row:host_row + n].to(dev)
                    layer += n_layers

        for r in range(n_req):
            last = (seq[r] - 1) // bs
            for p in range(max(0, last - c.tail_pages + 1), last + 1):
                make_resident(r, p)
        for rt in runtimes:
            rt.reset_stats()
        indexers = [SyntheticIndexer(k, len(group_layers), DEFAULT_LOCALITY.scaled(c.locality), seed=c.seed,
                                     request_id=r) for r in range(n_req)]
        new_rows = [torch.randint(0, 256, (fmt.row_bytes,), dtype=torch.uint8, generator=gen).view(fmt.dtype).to(dev)
                    for _ in range(c.layers)]
        result = BenchResult(backend=backend.describe(),
                             config={**asdict(c), "hot_rows": hot_rows, "row_bytes": fmt.row_bytes,
                                     "index_groups": group_layers, "device_blocks": num_dev_blocks,
                                     "host_blocks": n_req * pages})
        result.setup_seconds = time.perf_counter() - t_start
        prev = _stats_sum(runtimes)
        for step in range(c.steps):
            t0 = time.perf_counter()
            mirrors: list[RowMirror] = []
            for r in range(n_req):
                pos = seq[r]
                page = pos // bs
                if pos % bs == 0:  # a new page: it becomes resident, the oldest tail page leaves
                    make_resident(r, page)
                    old = page - c.tail_pages
                    if old >= 0:
                        resident[r, old] = -1
                seq[r] = pos + 1
                dev_row = tail_block(r, page) * bs + pos % bs
                for gi, n_layers in enumerate(group_layers):
                    for li in range(n_layers):
                        device_layers[gi][li].view(-1, fmt.width)[dev_row] = new_rows[sum(group_layers[:gi]) + li]
                mirrors.append(RowMirror((dev_row,), int(source[r, page]) * bs + pos % bs, 1))
            for rt in runtimes:
                rt.mirror_rows(mirrors)
            t1 = time.perf_counter()
            topk = np.stack([ix.step(seq[r]) for r, ix in enumerate(indexers)], axis=1)  # [G, R, K]
            topk_t = [torch.from_numpy(topk[g]).to(dev) for g in range(len(group_layers))]
            seq_t = torch.tensor(seq, dtype=i32, device=dev)
            t2 = time.perf_counter()
            for g, rt in enumerate(runtimes):
                rt.resolve(ResolveInputs(topk_t[g], row_state, seq_t, source, resident, hot_table),
                           gather=True, validate=False)
                if group_layers[g] > 1:
                    rt.replay_plan()
            if dev.type != "cpu" and hasattr(torch, dev.type):
                getattr(torch, dev.type).synchronize(dev)
            t3 = time.perf_counter()
            now = _stats_sum(runtimes)
            sample = StepSample(seconds=(t1 - t0) + (t3 - t2), indexer_seconds=t2 - t1,
                                resident=now.resident - prev.resident, hits=now.hits - prev.hits,
                                misses=now.misses - prev.misses, h2d_bytes=now.h2d_bytes - prev.h2d_bytes,
                                d2h_bytes=now.d2h_bytes - prev.d2h_bytes)
            prev = now
            result.samples.append(sample)
            if on_step is not None:
                on_step(step, sample)
        result.wall_seconds = time.perf_counter() - t_start
        return result
    finally:
        pool.release()


__all__ = ["BenchConfig", "BenchResult", "StepSample", "run_bench"]
