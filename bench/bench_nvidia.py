#!/usr/bin/env python3
"""Kernel benchmark of the NVIDIA backend on one GPU, every figure beside a baseline from the same run.

Geometry: top-k 2048, hot buffer 4096 rows per request, 656-byte rows (fp8_ds_mla), 32K-token
contexts (512 pages of 64), one layer. Every measurement is a CUDA graph holding S consecutive
steps (each step a resolve, with or without its gather, on its own input tensors), replayed
many times; the figure is the median replay time divided by S, i.e. the cost per layer and step
once launches are graph nodes. Baselines are measured in the same run with the same method:

- a contiguous pinned host-to-device copy (`cuMemcpyHtoDAsync` from the registered pool) of the
  bytes the step's misses move, for the miss scenarios;
- a graph of S tiny kernels (the per-node floor), for the metadata-only scenarios.

Steps drift like a decode: each request's top-k is a window sliding over a ring of random
positions of its context, so a step brings exactly the wanted number of new rows (274 = 13.4% of
2048, or all 2048) and the LRU evicts rows the window left long ago. The measured miss counts are
checked against the intent and printed.

    python bench/bench_nvidia.py [--json out.json] [--replays 50]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

K, H, BS, CTX = 2048, 4096, 64, 32768
P, HB = CTX // BS, H // BS
MAX_REQ = 128
MISSES = 274  # 13.4% of top-k 2048 (LRU with a 2x buffer on GLM-5.1, LongBenchV2)
# The resolver built with 512 threads per block, with the page tables gathered per entry, and with
# one, two or four blocks per group at small batches (the default is eight): timed in the same run.
VARIANTS = [{"HISPARSE_RESOLVE_THREADS": "512"}, {"HISPARSE_RESOLVE_SMEM": "0"}, {"HISPARSE_RESOLVE_CLUSTER": "1"},
            {"HISPARSE_RESOLVE_CLUSTER": "2"}, {"HISPARSE_RESOLVE_CLUSTER": "4"}]

@dataclass
class Row:
    scenario: str
    batch: int
    ours_us: float
    baseline: str
    baseline_us: float | None
    target: str
    sglang: str
    passed: bool | None
    note: str = ""
    extra: dict = field(default_factory=dict)


class Bench:
    def __init__(self, replays: int) -> None:
        from hisparse_core.host_pool import HostPoolSpec
        from hisparse_nvidia.backend import NvidiaBackend

        self.replays = replays
        self.be = NvidiaBackend()
        self.dev = self.be.device
        t = time.perf_counter()
        self.pool = self.be.create_host_pool(HostPoolSpec(num_layers=1, num_blocks=MAX_REQ * P, block_size=BS))
        self.pool_s = time.perf_counter() - t
        host = self.pool.layer_view(0).view(torch.uint8).view(-1)
        chunk = 256 << 20
        for off in range(0, host.numel(), chunk):  # random bytes, generated on the GPU
            n = min(chunk, host.numel() - off)
            host[off:off + n].copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, device=self.dev))
        self.hot_blocks = MAX_REQ * HB
        self.num_blocks = self.hot_blocks + 64 * P
        self.cache = torch.zeros((self.num_blocks, BS, 656), dtype=torch.uint8, device=self.dev)
        self.gen = torch.Generator().manual_seed(1234)

    # ------------------------------------------------------------------ setup helpers

    def runtime(self, b: int, env: dict[str, str] | None = None, bmax: int | None = None):  # noqa: ANN201
        """A runtime for batch b (outputs of `bmax` rows, default b); `env` sets tuning variables
        while it is built."""
        from hisparse_core.geometry import RuntimeConfig

        cfg = RuntimeConfig(max_batch_rows=bmax or b, max_requests=b, top_k=K, hot_rows=H, block_size=BS,
                            max_pages=P)
        env = env or {}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            rt = self.be.create_runtime(cfg)
        finally:
            for k, v in old.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v
        rt.bind([self.pool.layer_view(0)], [self.cache])
        return rt

    def tables(self, b: int, *, resident: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        i32 = torch.int32
        q = torch.arange(b, dtype=i32)[:, None]
        source = (q * P + torch.arange(P, dtype=i32)[None]).to(self.dev)
        if resident:
            res = (self.hot_blocks + q * P + torch.arange(P, dtype=i32)[None]).to(self.dev)
        else:
            res = torch.full((b, P), -1, dtype=i32, device=self.dev)
        hot = (q * HB + torch.arange(HB, dtype=i32)[None]).to(self.dev)
        return source, res, hot

    def windows(self, b: int, steps: int, shift: int) -> list[torch.Tensor]:
        """Per step a [b, K] top-k: a window of K positions sliding by `shift` over a ring of
        steps * shift random context positions of each request."""
        ring_len = steps * shift
        rings = torch.stack([torch.randperm(CTX, generator=self.gen)[:ring_len] for _ in range(b)])
        out = []
        for s in range(steps):
            idx = (torch.arange(K) + s * shift) % ring_len
            out.append(rings[:, idx].to(torch.int32).contiguous().to(self.dev))
        return out

    def time_graph(self, graph: torch.cuda.CUDAGraph, steps: int, warmup: int = 3) -> float:
        for _ in range(warmup):
            graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(self.replays):
            a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            z.record()
            z.synchronize()
            times.append(a.elapsed_time(z) * 1000.0 / steps)
        return statistics.median(times)

    def resolve_graph(self, rt, inputs: list, *, gather: bool) -> torch.cuda.CUDAGraph:  # noqa: ANN001
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for inp in inputs:
                rt.resolve(inp, gather=gather, validate=False)
        return g

    def copy_graph(self, nbytes: int, steps: int) -> torch.cuda.CUDAGraph:
        """S contiguous pinned host-to-device copies of `nbytes` from the registered pool."""
        from cuda.bindings import driver as cu

        from hisparse_nvidia import driver

        src = self.pool.layer_view(0).view(torch.uint8).view(-1)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=self.dev)
        self._keep = dst
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            stream = torch.cuda.current_stream().cuda_stream
            for s in range(steps):
                off = (s * nbytes) % max(1, src.numel() - nbytes)
                driver.check("cuMemcpyHtoDAsync", cu.cuMemcpyHtoDAsync(
                    dst.data_ptr(), src.data_ptr() + off, nbytes, cu.CUstream(stream)))
        return g

    def floor_graph(self, steps: int) -> torch.cuda.CUDAGraph:
        x = torch.zeros(1, device=self.dev)
        self._keep_floor = x
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(steps):
                x.add_(1)
        return g

    # ------------------------------------------------------------------ scenarios

    def profile_target(self) -> None:
        """A few eager calls of each kind, for a profiler to attach to (`--profile-target`)."""
        from hisparse_core.runtime import ResolveInputs

        for b, resident in ((1, False), (64, False), (64, True)):
            rt = self.runtime(b)
            source, res, hot = self.tables(b, resident=resident)
            inp = ResolveInputs(self.windows(b, 1, K)[0], torch.arange(b, dtype=torch.int32, device=self.dev),
                                torch.full((b,), CTX, dtype=torch.int32, device=self.dev), source, res, hot)
            for _ in range(3):
                rt.resolve(inp, gather=False, validate=False)
        rt = self.runtime(1)
        source, res, hot = self.tables(1, resident=False)
        state = torch.zeros(1, dtype=torch.int32, device=self.dev)
        lens = torch.full((1,), CTX, dtype=torch.int32, device=self.dev)
        for t in self.windows(1, 32, MISSES)[:12]:
            rt.resolve(ResolveInputs(t, state, lens, source, res, hot), gather=True, validate=False)
        torch.cuda.synchronize()

    def hits(self, b: int, env: dict[str, str] | None = None, bmax: int | None = None) -> tuple[float, dict]:
        from hisparse_core.runtime import ResolveInputs

        rt = self.runtime(b, env, bmax)
        source, res, hot = self.tables(b, resident=False)
        topk = self.windows(b, 1, K)[0]
        inp = ResolveInputs(topk, torch.arange(b, dtype=torch.int32, device=self.dev),
                            torch.full((b,), CTX, dtype=torch.int32, device=self.dev), source, res, hot)
        rt.resolve(inp, gather=True, validate=False)  # load the working set once
        steps = 32
        g = self.resolve_graph(rt, [inp] * steps, gather=False)
        rt.reset_stats()
        us = self.time_graph(g, steps)
        st = rt.stats()
        return us, {"hits": st.hits, "misses": st.misses, "shape": rt.launch_shape, **self.phases(rt, inp)}

    def resident(self, b: int, gather: bool, env: dict[str, str] | None = None) -> tuple[float, dict]:
        from hisparse_core.runtime import ResolveInputs

        rt = self.runtime(b, env)
        source, res, hot = self.tables(b, resident=True)
        topk = self.windows(b, 1, K)[0]
        inp = ResolveInputs(topk, torch.arange(b, dtype=torch.int32, device=self.dev),
                            torch.full((b,), CTX, dtype=torch.int32, device=self.dev), source, res, hot)
        steps = 32
        g = self.resolve_graph(rt, [inp] * steps, gather=gather)
        rt.reset_stats()
        us = self.time_graph(g, steps)
        st = rt.stats()
        return us, {"resident": st.resident, "hits": st.hits, "misses": st.misses, "shape": rt.launch_shape,
                    **self.phases(rt, inp)}

    def misses(self, b: int, shift: int, steps: int, env: dict[str, str] | None = None,
               ) -> tuple[float, float, float, dict]:
        """(resolve+gather us, gather-only us, contiguous copy us of the same bytes, info)."""
        from hisparse_core.runtime import ResolveInputs

        rt = self.runtime(b, env)
        source, res, hot = self.tables(b, resident=False)
        state = torch.arange(b, dtype=torch.int32, device=self.dev)
        lens = torch.full((b,), CTX, dtype=torch.int32, device=self.dev)
        inputs = [ResolveInputs(t, state, lens, source, res, hot) for t in self.windows(b, steps, shift)]
        g = self.resolve_graph(rt, inputs, gather=True)
        for _ in range(2):  # two full cycles: the hot buffers reach their steady state
            g.replay()
        torch.cuda.synchronize()
        rt.reset_stats()
        us = self.time_graph(g, steps, warmup=0)
        st = rt.stats()
        calls = (self.replays) * steps
        per_row = st.misses / (calls * b)
        gather_g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gather_g):
            for _ in range(steps):
                rt.gather_misses(0)
        gather_us = self.time_graph(gather_g, steps)
        nbytes = round(per_row) * b * 656
        copy_us = self.time_graph(self.copy_graph(nbytes, steps), steps)
        return us, gather_us, copy_us, {"misses_per_row_step": per_row, "bytes": nbytes,
                                        "hits_per_row_step": st.hits / (calls * b), "shape": rt.launch_shape,
                                        **self.phases(rt, inputs[0], gather=True)}

    @staticmethod
    def phases(rt, inp, gather: bool = False) -> dict:  # noqa: ANN001
        """Phase clocks of the resolver's first block (see `NvidiaRuntime.resolver_phase_cycles`)."""
        return {"phases": rt.resolver_phase_cycles(inp, gather=gather)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replays", type=int, default=50, help="timed graph replays per figure (median)")
    ap.add_argument("--json", help="also write the table as JSON to this path")
    ap.add_argument("--profile-target", action="store_true",
                    help="only run a few eager resolves and gathers (hits B=1 and 64, resident B=64, 274 misses "
                         "B=1) for a kernel profiler such as ncu, then exit")
    ap.add_argument("--variant", action="append", default=[], metavar="VAR=V[,VAR=V]",
                    help="also time the miss scenarios with these tuning variables (e.g. HISPARSE_COPY_LOAD=2); "
                         "repeatable")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_nvidia: no CUDA device", file=sys.stderr)
        return 2
    bench = Bench(args.replays)
    if args.profile_target:
        bench.profile_target()
        bench.pool.release()
        return 0
    rows: list[Row] = []
    floor = bench.time_graph(bench.floor_graph(32), 32)
    note_floor = f"graph node floor {floor:.2f} us"

    def tag(env: dict[str, str]) -> str:
        return "  (" + ",".join(f"{k.replace('HISPARSE_', '').lower()}={v}" for k, v in env.items()) + ")"

    for b, target, sglang in ((1, 4.0, "17.0 us"), (64, 5.0, "20.5 us")):
        us, info = bench.hits(b)
        ok = info["misses"] == 0 and us <= target
        rows.append(Row("all hot hits, resolve only", b, us, "graph node floor", floor, f"<= {target} us", sglang,
                        ok, f"misses={info['misses']}", info))
        for env in VARIANTS:
            us2, info2 = bench.hits(b, env)
            rows.append(Row(tag(env), b, us2, "graph node floor", floor, "-", "-", None,
                            f"misses={info2['misses']}", info2))
        if b == 1:  # a runtime sized for 256 rows: the rows past the batch are padding
            us2, info2 = bench.hits(b, None, 256)
            rows.append(Row("  (max_batch_rows=256)", b, us2, "graph node floor", floor, "-", "-", None,
                            f"misses={info2['misses']}", info2))

    variants = [dict(v.split("=") for v in spec.split(",")) for spec in args.variant]
    for env in [None, *variants]:
        name = None if env is None else tag(env)
        us, gus, cus, info = bench.misses(1, MISSES, 32, env)
        rows.append(Row(name or "274 misses, resolve+gather", 1, us, "contiguous pinned copy", cus, "<= 10 us",
                        "49 us (copy 6.3 us)",
                        None if env else us <= 10.0 and abs(info["misses_per_row_step"] - MISSES) < 0.5,
                        f"misses/step={info['misses_per_row_step']:.1f} gather-only={gus:.2f} us", info))
        us, gus, cus, info = bench.misses(32, MISSES, 32, env)
        rows.append(Row(name or "274 misses each, resolve+gather", 32, us, "contiguous pinned copy", cus,
                        "<= 1.15x copy", "1.35x copy",
                        None if env else us <= 1.15 * cus and abs(info["misses_per_row_step"] - MISSES) < 0.5,
                        f"ratio={us / cus:.2f}x misses/step={info['misses_per_row_step']:.1f} "
                        f"gather-only={gus:.2f} us", info))
        us, gus, cus, info = bench.misses(128, K, 16, env)
        gbs, cgbs = info["bytes"] / us / 1e3, info["bytes"] / cus / 1e3
        rows.append(Row(name or "every row a miss, resolve+gather", 128, us, "contiguous pinned copy", cus,
                        ">= 85% of copy bandwidth", "77%",
                        None if env else gbs >= 0.85 * cgbs and info["misses_per_row_step"] == K,
                        f"{gbs:.1f} GB/s vs copy {cgbs:.1f} GB/s = {100 * gbs / cgbs:.0f}% "
                        f"misses/step={info['misses_per_row_step']:.0f} gather-only={gus:.1f} us "
                        f"({info['bytes'] / gus / 1e3:.1f} GB/s)", info))

    us, info = bench.resident(64, gather=False)
    rows.append(Row("all resident, resolve only", 64, us, "graph node floor", floor, "<= 3 us", "-",
                    us <= 3.0 and info["misses"] == 0 and info["hits"] == 0, "", info))
    for env in VARIANTS:
        us, info = bench.resident(64, gather=False, env=env)
        rows.append(Row(tag(env), 64, us, "graph node floor", floor, "-", "-", None, "", info))
    us, info = bench.resident(64, gather=True)
    rows.append(Row("all resident, resolve+gather", 64, us, "graph node floor", floor, "-", "-", None,
                    "informational: the gather launch is a second graph node, with nothing to copy", info))

    props = torch.cuda.get_device_properties(bench.dev)
    print(f"\nhisparse nvidia bench: {props.name}, torch {torch.__version__}, top-k {K}, hot {H}, rows 656 B, "
          f"context {CTX}, CUDA graph replay, median of {args.replays} replays; {note_floor}; "
          f"host pool {bench.pool.nbytes / 2**30:.2f} GiB registered in {bench.pool_s:.2f} s\n")
    head = f"{'scenario':38} {'B':>4} {'ours us':>9} {'baseline':>24} {'base us':>9} {'target':>24} {'SGLang':>20} {'ok':>4}  note"
    print(head)
    print("-" * len(head))
    for r in rows:
        base = f"{r.baseline_us:9.2f}" if r.baseline_us is not None else f"{'-':>9}"
        ok = "-" if r.passed is None else ("yes" if r.passed else "NO")
        print(f"{r.scenario:38} {r.batch:>4} {r.ours_us:9.2f} {r.baseline:>24} {base} {r.target:>24} {r.sglang:>20} "
              f"{ok:>4}  {r.note}")
    print("\nresolver phases of the first block, cycles since start (NvidiaRuntime.resolver_phase_cycles): group "
          "known, rows loaded, barrier 1, 2 (hints), 3 (LRU walk), LRU written or barrier 4, misses assigned, "
          "end:")
    for r in rows:
        if "phases" in r.extra:
            print(f"  {r.scenario.strip():38} B={r.batch:<4} {r.extra['phases']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": props.name, "torch": torch.__version__, "floor_us": floor,
                       "rows": [asdict(r) for r in rows]}, f, indent=2)
    bench.pool.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
