"""The kernels of a captured CUDA graph on a timeline, from torch.profiler's CUDA activity records
(CUPTI): each kernel's duration, and where it starts against the end of the kernel before it.

A bench figure says how long a step takes; this says which kernel holds the time and how much two
kernels overlap (a programmatic dependent launch starts before its primary ends, so its gap is
negative). The profiler adds no work inside the graph, but its records are of a few replays, not a
median over many: read them for shape, and take figures from the bench's own timing.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KernelSpan:
    name: str
    start_us: float
    end_us: float

    @property
    def us(self) -> float:
        return self.end_us - self.start_us


def graph_kernels(graph: torch.cuda.CUDAGraph, replays: int = 5) -> list[KernelSpan]:
    """The kernels of `replays` replays of `graph` (after one untimed replay), in start order."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = json.load(fh).get("traceEvents", [])
    finally:
        os.unlink(path)
    spans = [KernelSpan(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"]))
             for e in events if e.get("cat") == "kernel" and "dur" in e]
    return sorted(spans, key=lambda s: s.start_us)


def short(name: str) -> str:
    """A kernel's name without its template or argument list."""
    return name.split("(")[0].split("<")[0].strip() or name


def summary(spans: list[KernelSpan]) -> list[str]:
    """One line per kernel name (median duration, and the median start against the previous kernel's
    end), in the order the names first appear; a last line with the median period of the first name."""
    if not spans:
        return ["no kernel records (is the CUDA profiler available here?)"]
    names: dict[str, list[float]] = {}
    gaps: dict[str, list[float]] = {}
    for i, s in enumerate(spans):
        n = short(s.name)
        names.setdefault(n, []).append(s.us)
        if i:
            prev = spans[i - 1]
            gaps.setdefault(f"{short(prev.name)} -> {n}", []).append(s.start_us - prev.end_us)
    lines = [f"{n}: {statistics.median(d):.2f} us (x{len(d)})" for n, d in names.items()]
    lines += [f"{pair}: starts {statistics.median(g):+.2f} us from its end (x{len(g)})" for pair, g in gaps.items()]
    first = short(spans[0].name)
    starts = [s.start_us for s in spans if short(s.name) == first]
    if len(starts) > 1:
        period = statistics.median(b - a for a, b in zip(starts, starts[1:], strict=False))
        lines.append(f"period of {first}: {period:.2f} us")
    return lines
