#!/usr/bin/env python3
"""What splitting the batch costs DeepSeek-V3.2's indexer (transformers' `DeepseekV32Indexer`), one GPU.

The decode indexer of one layer at DeepSeek-V3.2's geometry (64 heads of 128, top-k 2048) over
fp8 keys with an fp32 scale per 128 (`index_keys.py`, dequantized to fp32 for scoring, as the
hisparse transformers engine hands them to it), for a batch of B requests of T keys each: the
whole batch in one call against the same batch in P parts (P calls on row slices), each captured
in a CUDA graph and replayed. Every figure is a ratio to the whole batch's time in the same run,
and a torch.profiler table per P gives the kernels' summed time by name (which part grows).

    python bench/bench_indexer_split.py [--batch 75] [--context 32768] [--parts 1,2,4] [--replays 20]

Needs a CUDA GPU and transformers with DeepseekV32.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict

import torch


def split_batch(batch: int, parts: int) -> list[tuple[int, int]]:
    """`batch` rows in min(parts, batch) consecutive parts of sizes differing by at most one."""
    n = max(1, min(parts, batch))
    size, extra = divmod(batch, n)
    bounds, lo = [], 0
    for i in range(n):
        hi = lo + size + (1 if i < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


class _Keys:
    """The cache side of the indexer's call: fp8 keys of B rows, handed back dequantized (rows lo..hi)."""

    def __init__(self, values: torch.Tensor, scales: torch.Tensor) -> None:
        self.values, self.scales = values, scales
        self.rows = slice(None)

    def update_indexer(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:  # noqa: ARG002
        from hisparse_transformers.index_keys import dequantize_fp8

        return dequantize_fp8(self.values[self.rows], self.scales[self.rows])


def main(argv: list[str] | None = None) -> int:
    from hisparse_core.cli.options import MAX_REQUESTS, MAX_TOKENS, CliParser, int_in, int_list_in

    # Bounded at parse time, before the GPU check: `--parts 1,,2` was a ValueError traceback (an
    # int() of ''), and `--replays 0` the median of no replay once the model was built.
    ap = CliParser(prog="bench_indexer_split", description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int_in(1, MAX_REQUESTS), default=75)
    ap.add_argument("--context", type=int_in(1, MAX_TOKENS), default=32768)
    ap.add_argument("--parts", type=int_list_in(1, MAX_REQUESTS), default=[1, 2, 4])
    ap.add_argument("--replays", type=int_in(1, 100_000), default=20)
    a = ap.parse_args(argv)
    parts = a.parts
    if not torch.cuda.is_available():
        print("bench_indexer_split: needs a CUDA GPU", file=sys.stderr)
        return 2
    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer

    from hisparse_transformers.index_keys import quantize_fp8

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_transformers import GEOMETRY
    from graph_timing import median_replay_us

    dev = torch.device("cuda")
    torch.manual_seed(0)
    cfg = DeepseekV32Config(num_hidden_layers=1, **GEOMETRY)
    ind = DeepseekV32Indexer(cfg, 0).to(dev, torch.bfloat16).eval()
    b, t = a.batch, a.context
    keys = torch.randn(b, t, cfg.index_head_dim, device=dev, dtype=torch.bfloat16)
    values, scales = quantize_fp8(keys)
    del keys
    cache = _Keys(values, scales)
    hidden = torch.randn(b, 1, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
    q_resid = torch.randn(b, 1, cfg.q_lora_rank, device=dev, dtype=torch.bfloat16)
    cos = torch.randn(b, 1, cfg.qk_rope_head_dim, device=dev, dtype=torch.bfloat16)
    sin = torch.randn(b, 1, cfg.qk_rope_head_dim, device=dev, dtype=torch.bfloat16)
    mask = torch.zeros(b, 1, t, device=dev, dtype=torch.bfloat16)

    def step(p: int) -> list[torch.Tensor]:
        out = []
        for lo, hi in split_batch(b, p):
            cache.rows = slice(lo, hi)
            out.append(ind(hidden[lo:hi], q_resid[lo:hi], (cos[lo:hi], sin[lo:hi]), mask[lo:hi], None, cache))
        cache.rows = slice(None)
        return out

    times: dict[int, float] = {}
    profiles: dict[int, dict[str, float]] = {}
    want = torch.cat(step(1))
    for p in parts:
        got = torch.cat(step(p))
        same = bool(torch.equal(got.sort(-1).values, want.sort(-1).values))
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step(p)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step(p)
        times[p] = median_replay_us(g, a.replays, warmup=1) / 1e3
        by: dict[str, float] = defaultdict(float)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step(p)
            torch.cuda.synchronize()
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                by[ev.name[:70]] += ev.device_time_total / 1e3
        profiles[p] = dict(by)
        print(f"parts {p}: {times[p]:.3f} ms a layer-step (graph, median of {a.replays}), "
              f"{times[p] / times[parts[0]]:.2f}x the first; same top-k sets as the whole batch: {same}", flush=True)
    names = sorted({n for pr in profiles.values() for n in pr}, key=lambda n: -profiles[parts[-1]].get(n, 0.0))
    print("\nkernel time by name, ms (eager run under torch.profiler):")
    print("| kernel | " + " | ".join(f"{p} part(s)" for p in parts) + " |")
    print("| --- |" + " --- |" * len(parts))
    for n in names[:15]:
        print(f"| {n} | " + " | ".join(f"{profiles[p].get(n, 0.0):.3f}" for p in parts) + " |")
    print("| total | " + " | ".join(f"{sum(profiles[p].values()):.3f}" for p in parts) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
