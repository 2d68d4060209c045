"""The decode step as an engine runs it: resolve, gather and follower replay of every index group.

`DecodeRunner.run(topk, row_state, seq_lens)` takes one step's top-k (host numpy, one `[B, K]`
slab per index group) and runs, for every group, `resolve(gather=True)` and, where the group has
followers, `replay_plan()`. The inputs go through static device buffers of `max_rows` rows that
every step reuses (the runtimes' `ResolveInputs` contract), so the step has fixed addresses:

- **CUDA graph** (the backend declares `cuda_graph` and its device is CUDA): the step of every
  group is captured once per capture size (1, 2, 4, then multiples of 8, and `max_rows`) and
  replayed; a batch is padded to the next capture size with padding rows (`row_state` -1, which
  the contract says read and change nothing). No host synchronization can sit inside the
  captured region: capture would fail on one.
- **Eager** otherwise (and with `validate`, which reads values on the host): the same calls on the
  first `B` rows of the buffers.

`device_seconds()` is the time of the last step's input copies plus resolve work: measured with
device events on CUDA (read after the caller synchronized), wall time elsewhere.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from hisparse_core.backend import Backend, Capability
from hisparse_core.runtime import CacheRuntime, ResolveInputs, ResolveResult

logger = logging.getLogger(__name__)


def capture_sizes(max_rows: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, every multiple of 8 below `max_rows`, and `max_rows`."""
    sizes = [s for s in (1, 2, 4) if s < max_rows] + list(range(8, max_rows, 8))
    return sizes + [max_rows]


def graph_choice(backend: Backend, *, enabled: bool, validate: bool) -> tuple[bool, str]:
    """(capture CUDA graphs, why) for this backend and run."""
    # What the backend cannot do first: where it cannot capture, --eager decides nothing.
    flag = "" if enabled else "; --eager asks the same"
    if Capability.CUDA_GRAPH not in backend.capabilities:
        return False, f"backend {backend.name!r} does not declare {Capability.CUDA_GRAPH!r}{flag}"
    if backend.device.type != "cuda":
        return False, f"backend {backend.name!r} runs on {backend.device}, not a CUDA device{flag}"
    if not enabled:
        return False, "graphs turned off (--eager)"
    if validate:
        return False, "--validate reads input values on the host, which a captured graph cannot"
    return True, f"backend {backend.name!r} declares {Capability.CUDA_GRAPH!r}"


class DecodeRunner:
    """One decode step over every index group, eager or replayed from a CUDA graph per batch size."""

    def __init__(self, runtimes: Sequence[CacheRuntime], layers_per_group: Sequence[int], *, source_table: torch.Tensor,
                 resident_table: torch.Tensor, hot_table: torch.Tensor, max_rows: int, top_k: int,
                 device: torch.device, graphs: bool, validate: bool) -> None:
        self._runtimes = list(runtimes)
        self._layers = list(layers_per_group)
        self._tables = (source_table, resident_table, hot_table)
        self._max_rows = max_rows
        self._device = device
        self._validate = validate
        self._cuda = device.type == "cuda"
        self.graphs = graphs
        self._sizes = capture_sizes(max_rows)
        i32 = torch.int32
        pin = self._cuda
        groups = len(self._runtimes)
        self._host_topk = torch.full((groups, max_rows, top_k), -1, pin_memory=pin, dtype=i32)
        self._host_state = torch.full((max_rows,), -1, pin_memory=pin, dtype=i32)
        self._host_lens = torch.zeros((max_rows,), pin_memory=pin, dtype=i32)
        # One tensor per group: each topk buffer starts at its own (aligned) allocation.
        self._topk = [torch.full((max_rows, top_k), -1, device=device, dtype=i32) for _ in range(groups)]
        self._state = torch.full((max_rows,), -1, device=device, dtype=i32)
        self._lens = torch.zeros((max_rows,), device=device, dtype=i32)
        self._captured: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if graphs else None
        self._copied: torch.cuda.Event | None = None    # the last input copy out of the pinned buffers
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._wall = 0.0
        self._rows = 0

    @property
    def mode(self) -> str:
        return "cuda graph" if self.graphs else "eager"

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._captured)

    def _inputs(self, g: int, rows: int) -> ResolveInputs:
        return ResolveInputs(self._topk[g][:rows], self._state[:rows], self._lens[:rows], *self._tables)

    def _step(self, rows: int, validate: bool) -> None:
        for g, (rt, n_layers) in enumerate(zip(self._runtimes, self._layers, strict=True)):
            rt.resolve(self._inputs(g, rows), gather=True, validate=validate)
            if n_layers > 1:
                rt.replay_plan()

    def _graph(self, rows: int) -> torch.cuda.CUDAGraph:
        graph = self._captured.get(rows)
        if graph is None:
            t0 = time.perf_counter()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._step(rows, validate=False)
            self._captured[rows] = graph
            logger.info("decode step captured in a CUDA graph for %d batch rows (%d index groups, %.1f ms)", rows,
                        len(self._runtimes), 1e3 * (time.perf_counter() - t0))
        return graph

    def run(self, topk: np.ndarray, row_state: Sequence[int], seq_lens: Sequence[int]) -> None:
        """Resolve one batch: `topk` `[groups, B, K]` int32, one state row and length per batch row."""
        b = len(row_state)
        rows = next(s for s in self._sizes if s >= b) if self.graphs else b
        if self._copied is not None:
            self._copied.synchronize()        # the pinned buffers are free again (off the decode path)
        self._host_topk[:, :b].numpy()[...] = topk
        self._host_topk[:, b:rows] = -1
        self._host_state[:b] = torch.tensor(row_state, dtype=torch.int32)
        self._host_state[b:rows] = -1
        self._host_lens[:b] = torch.tensor(seq_lens, dtype=torch.int32)
        self._host_lens[b:rows] = 0
        graph = self._graph(rows) if self.graphs else None
        t0 = time.perf_counter()
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        for g in range(len(self._runtimes)):
            self._topk[g][:rows].copy_(self._host_topk[g, :rows], non_blocking=True)
        self._state[:rows].copy_(self._host_state[:rows], non_blocking=True)
        self._lens[:rows].copy_(self._host_lens[:rows], non_blocking=True)
        if self._cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        if graph is not None:
            graph.replay()
        else:
            self._step(rows, self._validate)
        if self._cuda:
            end.record()
            self._events = (start, end)
        self._wall = time.perf_counter() - t0
        self._rows = b

    def result(self, g: int) -> ResolveResult:
        return self._runtimes[g].result

    def topk(self, g: int, rows: int) -> torch.Tensor:
        """The first `rows` rows of group `g`'s top-k input, on the device."""
        return self._topk[g][:rows]

    def device_seconds(self) -> float:
        """Time of the last `run` on the device (call after the results were read)."""
        if self._events is None:
            return self._wall
        start, end = self._events
        end.synchronize()
        return start.elapsed_time(end) / 1e3
