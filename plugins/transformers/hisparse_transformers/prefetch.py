"""Cross-layer prefetch (`EngineConfig.prefetch_next_group`): the next index group's misses copied
while the current group's attention runs.

Adjacent layers' top-k sets overlap heavily (IndexCache: 70-100%), so once group g's resolve has
its top-k, group g+1's resolve runs on those positions (same rows, row states and context lengths,
g+1's own runtime and tables) on a side stream: its miss copies overlap g's attention and FFN, and
when g+1's own top-k arrives most of its misses are hot hits. The prefetch is an ordinary resolve
with its plan copied into every layer of g+1 (followers share the leader's hot map), so the hot
state stays what the contract says; attention reads only the rows of g+1's own resolve, which
overwrites the prefetch's published result and waits for it on the device (an event, no host
synchronization). Only the LRU order differs from a run without it, so misses differ, outputs not.

Streams and buffers: each runtime owns every buffer its resolve and copies touch (hot map, LRU,
position hints, result workspace, miss mask, plan-ready flags, the plan copy's ticket counter,
victims flags, counters; backends/nvidia runtime.py, backends/triton runtime.py, reference_cpu),
and each group has its own device caches, so g+1's resolve on the side stream shares nothing
writable with g's work on the main stream. The side stream forks from the main stream after g's
resolve (so everything before, previous steps' reads of g+1's rows included, is done) and joins
before g+1's resolve; the inputs it reads stay referenced until that join (the caching allocator
must not hand their memory to the main stream while the side stream reads it). Fork and join are
events, so a captured decode graph captures both. On the CPU there are no streams: the prefetch
runs inline, right after g's resolve.

`sources` (`prefetch_next_group` given a tuple) limits the prefetch to those groups' successors:
a group whose top-k barely repeats step to step (DeepSeek-V3.2's layers 0-1 on code) predicts its
successor no better, so prefetching from it copies rows nobody reads and evicts ones that would
hit (the CPU simulation, bench/bench_prefetch_locality.py, and docs/results.md give the figures).

A resident group (`resident_layers`) has no resolve, so nothing is prefetched into it; its
successor is prefetched from its top-k all the same unless `sources` leaves it out (the attention
layer launches it from the resident rows' positions), so the first group after the resident ones
(layer 2 of DeepSeek-V3.2 with layers 0-1 resident) is covered too. No pair spans two devices (`device_map`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import torch

from hisparse_core.runtime import CacheRuntime, ResolveInputs

if TYPE_CHECKING:
    from hisparse_transformers.session import StepState

logger = logging.getLogger(__name__)


class NextGroupPrefetch:
    """The prefetch of each index group's successor (see the module docstring); built at setup.

    `runtimes[g]` and `tables[g]` (source, resident, hot): index group g's (runtime None: a
    resident group); `group_device[g]`: the index into `devices` of its device; `sources`: the
    groups whose successor is prefetched (None: every group)."""

    def __init__(self, runtimes: Sequence[CacheRuntime | None],
                 tables: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], group_device: Sequence[int],
                 devices: Sequence[torch.device], sources: Collection[int] | None = None) -> None:
        self.runtimes = list(runtimes)
        self.tables = list(tables)
        self.group_device = list(group_device)
        G = len(self.runtimes)
        where = self.group_device
        #: target[g]: the group whose resolve runs on g's top-k after g's (None: no prefetch)
        chosen = set(range(G)) if sources is None else set(sources)
        self.target: list[int | None] = [
            g + 1 if g in chosen and g + 1 < G and self.runtimes[g + 1] is not None and where[g] == where[g + 1]
            else None for g in range(G)]
        devices = [torch.device(d) for d in devices]
        self._side = {d: torch.cuda.Stream(dev) for d, dev in enumerate(devices) if dev.type == "cuda"}
        cuda = [g for g in range(G) if where[g] in self._side]
        self._forked = {g: torch.cuda.Event() for g in cuda}
        self._done = {g: torch.cuda.Event() for g in cuda}
        #: rows each group's prefetches copied (misses of its prefetch resolves), on its device
        self.counts = [torch.zeros(1, dtype=torch.int64, device=devices[where[g]]) for g in range(G)]
        pairs = [f"{g}->{t}" for g, t in enumerate(self.target) if t is not None]
        logger.info(
            "hisparse: prefetch_next_group on: after each index group's resolve, the next group's resolve runs on its "
            "top-k %s, so that group's misses are copied while this group's attention runs (adjacent layers' top-k "
            "overlap heavily) and its own resolve then finds most of them hot; pairs %s%s",
            "on a side stream (joined by an event before the next group's own resolve)" if self._side
            else "inline (no streams on the CPU)", ", ".join(pairs) or "none",
            "" if len(pairs) == G - 1 else " (none into a resident group, none across devices"
            + ("" if sources is None else f", only from the source groups {sorted(chosen)}") + ")")

    def launch(self, step: StepState, group: int, flat: torch.Tensor) -> None:
        """Right after group `group`'s resolve of `flat` (`[R, top_k]` int32; a resident group: its
        rows' positions): its successor's resolve on the same positions, forked onto the side
        stream (inline on the CPU)."""
        target = self.target[group]
        if target is None:
            return
        side = self._side.get(self.group_device[group])
        if side is None:
            self._resolve(step, target, flat)
            return
        main = torch.cuda.current_stream(side.device)
        forked = self._forked[group]
        forked.record(main)
        side.wait_event(forked)
        with torch.cuda.stream(side):
            self._resolve(step, target, flat)
            self._done[target].record(side)
        step.prefetched[target] = flat          # alive until `join` (the side stream reads it)

    def join(self, step: StepState, group: int) -> None:
        """Before group `group`'s own resolve: the current stream waits for its prefetch, if one ran."""
        flat = step.prefetched.pop(group, None)
        if flat is not None:
            torch.cuda.current_stream(flat.device).wait_event(self._done[group])

    def _resolve(self, step: StepState, target: int, flat: torch.Tensor) -> None:
        runtime = self.runtimes[target]
        assert runtime is not None           # a target has a runtime (resident groups are none)
        source, resident, hot = self.tables[target]
        # Every layer of the group: the followers' hot slots must hold what the shared hot map says.
        runtime.prefetch(ResolveInputs(flat, step.row_state, step.seq_lens, source, resident, hot))
        self.counts[target] += runtime.result.plan_counts[:flat.shape[0]].sum()

    def take_counts(self) -> list[int]:
        """Rows each group's prefetches copied since the last call (then zeroed; reads the device)."""
        out = [int(c.item()) for c in self.counts]
        for c in self.counts:
            c.zero_()
        return out
