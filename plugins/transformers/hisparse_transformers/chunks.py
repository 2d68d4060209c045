"""Chunked decode (`EngineConfig.decode_chunks`): an index group's indexer and swap-in in parts of
the batch, each part's copies overlapping the next part's indexer.

A decode step's misses cannot be copied before the group's top-k is known, and its attention
cannot start before they land, so with the whole batch at once the host-to-device copies sit on
the step's critical path (at 32K contexts, 75 requests and code locality, 326 MB a step: 1.26x the
same engine all-resident, docs/results.md). The indexer scores each request's own keys, so it
splits by request at no extra work. With `decode_chunks` = C the leader of an index group runs
the indexer on part 1 of the batch, forks that part's resolve (its misses copied into the leader
and, by `replay_plan`, every follower) onto a side stream, runs the indexer on part 2 while those
copies run, and so on; attention joins the side stream and reads every part's rows. Only the last
part's copies stay exposed.

Why the parts do not interfere: a decode row is one request, and the resolver touches only the
hot state of the rows the call marks live (a row whose state is -1 publishes -1 and touches
nothing, the resolver contract), so part i's resolve is the whole batch's resolve restricted to
part i's requests, and the parts' resolves together leave the hot state, the plan copies and the
counters exactly as one resolve of the batch would. Each part gets its own input tensor and its
row states with every other part's rows at -1; the resolver's published rows are kept per part
(a later part's resolve overwrites the runtime's result with -1 for every other row). The
resolves run one after another on the side stream, so the runtime's shared scratch is never used
by two at once.

Streams: one side stream a device, at the highest priority torch offers, so a part's copy
kernels are scheduled ahead of the indexer's when multiprocessors free up. The side stream waits
(an event, no host synchronization) for the main stream after each part's indexer, which wrote
that part's top-k; the main stream waits for the side stream before attention. Shapes and parts
depend only on the batch size, so a captured decode graph (graphs.py) captures the fork and join.
On the CPU there are no streams and the parts run one after another (same outputs).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch

from hisparse_core.runtime import CacheRuntime, ResolveInputs

logger = logging.getLogger(__name__)

#: (first row, end row) of each part of a batch
Bounds = tuple[tuple[int, int], ...]


def split_batch(batch: int, parts: int) -> Bounds:
    """`batch` rows in min(parts, batch) consecutive parts whose sizes differ by at most one (larger first)."""
    n = max(1, min(parts, batch))
    size, extra = divmod(batch, n)
    bounds, lo = [], 0
    for i in range(n):
        hi = lo + size + (1 if i < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return tuple(bounds)


class DecodeChunks:
    """The chunked decode of every index group (see the module docstring); built at setup with the
    engine's devices."""

    def __init__(self, parts: int, devices: Sequence[torch.device]) -> None:
        self.parts = parts
        # priority_range() is (lowest, highest); a static method the stubs type as an instance one
        high = torch.cuda.Stream.priority_range()[1] if any(d.type == "cuda" for d in devices) else 0  # type: ignore[call-arg]
        self._side = {d: torch.cuda.Stream(d, priority=high) for d in devices if d.type == "cuda"}
        self._masks: dict[tuple[torch.device, int], tuple[Bounds, list[torch.Tensor]]] = {}
        logger.info(
            "hisparse: decode_chunks=%d: each index group's decode indexer and swap-in run in up to %d parts of the "
            "batch; part i's resolve and copies run %s while part i + 1's indexer scores, so only the last part's "
            "copies wait on the step", parts, parts,
            "on a high-priority side stream (joined by an event before attention)" if self._side
            else "inline (no streams on the CPU)")

    def bounds(self, batch: int) -> Bounds:
        return split_batch(batch, self.parts)

    def _row_masks(self, device: torch.device, batch: int) -> tuple[Bounds, list[torch.Tensor]]:
        key = (device, batch)
        got = self._masks.get(key)
        if got is None:
            bounds = self.bounds(batch)
            rows = torch.arange(batch, device=device)
            got = (bounds, [(rows >= lo) & (rows < hi) for lo, hi in bounds])
            self._masks[key] = got
        return got

    def resolve(self, runtime: CacheRuntime, tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                row_state: torch.Tensor, seq_lens: torch.Tensor,
                part_topk: Callable[[int, int], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step's resolve of an index group, part by part.

        `part_topk(lo, hi)` runs on the main stream and returns rows lo..hi of the step's resolver
        input (`[hi - lo, top_k]` int32 logical positions, -1 where unused): it runs the part's
        indexer. `row_state` and `seq_lens` are the batch's (`[B]`). Returns the whole batch's
        input `[B, top_k]` and the rows the resolver published `[B, top_k]` int32, once the main
        stream has joined every part's copies (followers' included)."""
        batch, k = row_state.shape[0], runtime.config.top_k
        device = row_state.device
        bounds, masks = self._row_masks(device, batch)
        side = self._side.get(device)
        main = torch.cuda.current_stream(device) if side is not None else None
        source, resident, hot = tables
        followers = runtime.config.num_layers > 1
        rows = torch.empty((batch, k), dtype=runtime.result.rows.dtype, device=device)
        inputs: list[torch.Tensor] = []
        alive: list[torch.Tensor] = []      # what the side stream reads stays allocated until the join
        for (lo, hi), mask in zip(bounds, masks, strict=True):
            flat = torch.full((batch, k), -1, dtype=torch.int32, device=device)
            flat[lo:hi] = part_topk(lo, hi)
            states = torch.where(mask, row_state, -1)
            inputs.append(flat)
            alive.append(states)
            if side is not None and main is not None:
                side.wait_stream(main)      # this part's top-k (and everything before) is written
            with torch.cuda.stream(side) if side is not None else nullcontext():
                runtime.resolve(ResolveInputs(flat, states, seq_lens, source, resident, hot), gather=True,
                                validate=False)
                if followers:
                    runtime.replay_plan()   # the followers' copies too: their layers read these rows
                rows[lo:hi] = runtime.result.rows[lo:hi]
        if side is not None and main is not None:
            main.wait_stream(side)
        del alive
        whole = torch.cat([flat[lo:hi] for flat, (lo, hi) in zip(inputs, bounds, strict=True)])
        return whole, rows
