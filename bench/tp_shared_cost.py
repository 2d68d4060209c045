"""Swap-in timing of one rank on one host pool (private or shared), for `bench/bench_tp_shared.py`.

The method is `bench/bench_nvidia.py`'s: top-k 2048, hot buffer 4096 rows per request, 656-byte
rows, one layer; each request's top-k is a window sliding over a ring of random positions of its
context, so a step brings exactly the intended number of new rows (274 = 13.4% of 2048 at batch 1
and 32, all 2048 at batch 128) and the LRU evicts rows the window left long ago. A CUDA graph holds
S consecutive resolves with their gathers, each on its own inputs; the figure is the median
replay time divided by S (per layer and step). Every figure here is also timed with the reads'
ordering in front of each replay (`wait_for_host_writes`: on a peer, a wait on rank 0's IPC event,
already complete), and the measured misses per row and step are checked against the intent.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from tp_shared_support import SWAP_IN_BATCHES as BATCHES

from hisparse_core.geometry import RuntimeConfig
from hisparse_core.host_pool import HostPool, HostPoolSpec
from hisparse_core.runtime import ResolveInputs
from hisparse_core.types import RowMirror

K, H, BS, ROW_BYTES = 2048, 4096, 64, 656
MISSES = 274


@dataclass(frozen=True, slots=True)
class CostShape:
    context: int = 32768  # tokens per request
    replays: int = 30  # at least this many timed replays per figure
    min_seconds: float = 0.5  # ... and for at least this long (so concurrent ranks overlap)

    @property
    def pages(self) -> int:
        return self.context // BS

    def pool_spec(self, *, shared: bool = False, name: str | None = None, rank: int = 0) -> HostPoolSpec:
        return HostPoolSpec(num_layers=1, num_blocks=max(BATCHES) * self.pages, block_size=BS, shared=shared,
                            name=name, rank=rank, world_size=2 if shared else 1)

    def plan(self, batch: int) -> tuple[int, int]:
        """(new rows per row and step, steps per graph) of the scenario at `batch`: bench_nvidia.py's
        32 and 16 steps where the context has room, else the fewest whose ring of positions
        outgrows the hot buffer plus one window (so that every row coming round again is a miss)."""
        if batch == max(BATCHES):
            return K, min(16, self.context // K)
        return MISSES, 32 if 32 * MISSES <= self.context else -(-(H + K) // MISSES)

    def runtime_config(self, batch: int, requests: int | None = None) -> RuntimeConfig:
        r = batch if requests is None else requests
        return RuntimeConfig(max_batch_rows=r, max_requests=r, top_k=K, hot_rows=H, block_size=BS,
                             max_pages=self.pages)

    def check(self) -> None:
        for b in BATCHES:
            shift, steps = self.plan(b)
            if not H + K <= steps * shift <= self.context:
                raise ValueError(f"context {self.context} is too short for the batch-{b} scenario ({steps} steps of "
                                 f"{shift} new rows need a ring of {H + K}..{self.context} positions)")


def scenario_inputs(shape: CostShape, batch: int, seed: int, device: torch.device,
                    requests: int | None = None) -> list[ResolveInputs]:
    """The S steps of the scenario at `batch` (the first `requests` rows of it where given): each
    request's top-k a window sliding over a ring of random positions of its context. Request q
    owns host blocks q * pages.. and hot blocks q * hot_blocks.."""
    p, hb, i32 = shape.pages, H // BS, torch.int32
    b = batch if requests is None else requests
    gen = torch.Generator().manual_seed(seed)
    q = torch.arange(b, dtype=i32)[:, None]
    source = (q * p + torch.arange(p, dtype=i32)[None]).to(device)
    resident = torch.full((b, p), -1, dtype=i32, device=device)
    hot = (q * hb + torch.arange(hb, dtype=i32)[None]).to(device)
    state = torch.arange(b, dtype=i32, device=device)
    lens = torch.full((b,), shape.context, dtype=i32, device=device)
    shift, steps = shape.plan(batch)
    ring = steps * shift
    rings = torch.stack([torch.randperm(shape.context, generator=gen)[:ring] for _ in range(b)])
    return [ResolveInputs(rings[:, (torch.arange(K) + s * shift) % ring].to(i32).contiguous().to(device), state,
                          lens, source, resident, hot) for s in range(steps)]


def fill_random(pool: HostPool, device: torch.device) -> None:
    """Random bytes into the whole pool, generated on the GPU (as bench_nvidia.py does)."""
    host = pool.layer_view(0).view(torch.uint8).view(-1)
    chunk = 256 << 20
    for off in range(0, host.numel(), chunk):
        n = min(chunk, host.numel() - off)
        host[off:off + n].copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, device=device))
    torch.cuda.synchronize(device)


class SwapIn:
    """The three scenarios of one rank bound to `pool`, with their graphs and a transfer engine."""

    def __init__(self, backend, pool: HostPool, shape: CostShape, seed: int) -> None:  # noqa: ANN001 - Backend
        self.dev = backend.device
        self.shape = shape
        self.cache = torch.zeros((max(BATCHES) * (H // BS), BS, ROW_BYTES), dtype=torch.uint8, device=self.dev)
        self.runs: dict[int, tuple] = {}
        for b in BATCHES:
            cfg = shape.runtime_config(b)
            rt = backend.create_runtime(cfg)
            rt.bind([pool.layer_view(0)], [self.cache])
            inputs = scenario_inputs(shape, b, seed, self.dev)
            shift, steps = shape.plan(b)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for inp in inputs:
                    rt.resolve(inp, gather=True, validate=False)
            # The graph reads the inputs at their captured addresses: they live as long as it does.
            self.runs[b] = (rt, graph, steps, shift, inputs)
        self.engine = backend.create_transfer_engine(pool, [self.runs[BATCHES[0]][0]])

    def publish_one_write(self, host_row: int) -> None:
        """One host-write epoch (a one-row mirror), so that a peer's reads have rank 0's IPC event to
        wait on; every rank submits it (a peer writes nothing)."""
        self.engine.submit_row_mirrors([RowMirror((0,), host_row, 1)])
        self.engine.drain()

    def time(self, batch: int, *, ordered: bool, start_at: float | None = None) -> dict:
        """Median microseconds per layer-step of the batch's graph; `ordered` puts the reads'
        ordering (`wait_for_host_writes`) in front of every replay. `start_at` (time.monotonic)
        delays the start, so that ranks started by one message overlap."""
        rt, graph, steps, shift, _ = self.runs[batch]
        for _ in range(2):  # two full cycles: the hot buffers reach their steady state
            graph.replay()
        torch.cuda.synchronize(self.dev)
        rt.reset_stats()
        if start_at is not None:
            while time.monotonic() < start_at:
                time.sleep(0.0005)
        times: list[float] = []
        began = time.monotonic()
        stream = torch.cuda.current_stream(self.dev)
        while len(times) < self.shape.replays or time.monotonic() - began < self.shape.min_seconds:
            a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(stream)
            if ordered:
                self.engine.wait_for_host_writes(stream)
            graph.replay()
            z.record(stream)
            z.synchronize()
            times.append(a.elapsed_time(z) * 1000.0 / steps)
        misses = rt.stats().misses / (len(times) * steps * batch)
        return {"us": statistics.median(times), "replays": len(times), "steps": steps,
                "misses_per_row_step": misses, "intended_misses": shift,
                "misses_ok": abs(misses - shift) < 0.5, "seconds": time.monotonic() - began}
