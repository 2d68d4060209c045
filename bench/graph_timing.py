"""Timing a captured CUDA graph, as every kernel benchmark here does: a few untimed replays, then
`replays` timed ones between CUDA events; the median, in us per step of the graph."""

from __future__ import annotations

import statistics

import torch


def median_replay_us(graph: torch.cuda.CUDAGraph, replays: int, steps: int = 1, warmup: int = 3) -> float:
    """Median over `replays` timed replays of `graph` (after `warmup` untimed ones) of its time in us,
    divided by the `steps` steps it holds."""
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        z.record()
        z.synchronize()
        times.append(a.elapsed_time(z) * 1000.0 / steps)
    return statistics.median(times)
