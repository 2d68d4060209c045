#!/usr/bin/env python3
"""Kernel benchmark of the triton backend beside the nvidia backend and a contiguous copy, one GPU, one run.

The sweep of bench_nvidia.py's swap-in table: misses per request 0, 34, 274 and 2048 at batch 1,
8, 64 and 128, and the resident step (every page resident, so the resolver never consults the hot
state), each timed for both backends on the same host pool, device cache and inputs. Geometry:
top-k 2048, hot buffer 4096 rows per request, 656-byte rows (fp8_ds_mla), 32K-token contexts (512
pages of 64), one layer.

Every figure is a CUDA graph holding S consecutive steps (`resolve(gather=True, validate=False)`
on its own input tensors), replayed many times: the median replay time divided by S. Steps drift
like a decode: each request's top-k is a window sliding over a ring of random context positions,
so a step brings exactly the wanted number of new rows, which the table checks against the
runtime's own counters. Baseline: a pinned contiguous host-to-device copy of the bytes the step's
misses move (`copy`), and "tr/nv", the triton figure over the nvidia one. Before timing, every
cell's outputs and hot state are compared between the two backends (they must be equal), and each
triton variant's layer-0 copy against nvidia's: its plan's rows hold nvidia's bytes and no other hot row
is written (a difference is reported after the table and the exit status is 1).

    python bench/bench_triton.py [--replays 30] [--json out.json] [--no-nvidia] [--variants gather,scratch:p4] [--resolve-alone] [--timeline]

`--variants` times the triton backend once per variant, side by side in one run: the first is
"triton us", the others get a column each. A variant is a resolver (`gather` or `scratch`,
`HISPARSE_TRITON_RESOLVER`) with optional `:tN` (threads per resolver program,
`HISPARSE_TRITON_RESOLVER_THREADS`), `:pN` (plan-copy programs per multiprocessor,
`HISPARSE_TRITON_PLAN_PER_SM`), `:f0` / `:f1` (1: the gather resolver copies its own plan and no
plan-copy kernel is launched; 0, the default: the plan-copy kernel, `HISPARSE_TRITON_FUSE_COPY`) and
`:l0` / `:l1` (the gather resolver's LEAN build, the default: `HISPARSE_TRITON_LEAN`) and `:eN` (plan
entries a plan-copy program moves per chunk, 4/8/16/32: `HISPARSE_TRITON_PLAN_ENTRIES`) and `:c0` / `:c1`
(1: the gather resolver claims hash buckets by compare-and-swap, `HISPARSE_TRITON_CAS`), `:s0` / `:s1`
(1: two-level prefix sums, `HISPARSE_TRITON_SCAN`) and `:b0` / `:b1` (1: block and offset by shift and
mask for a power-of-two block size, `HISPARSE_TRITON_SHIFT`) and `:r0` / `:r1` (1: the plan copy's programs
assigned to batch rows at small batches, `HISPARSE_TRITON_ROW_COPY`) and `:d0` / `:d1` (1: the plan copy
a programmatic dependent launch behind the resolver, `HISPARSE_TRITON_PDL`) and `:nN` (N = 2, 4, 8, 16: the split
resolver, N programs a batch row, `HISPARSE_TRITON_SPLIT`) and `:h0` / `:h1` (1, with `:nN`: the split
resolver's hot rows spread over the N programs too, `HISPARSE_TRITON_SPLIT_TAIL`) and `:v0` / `:v1` (1: the plan copy
in 32-bit block arithmetic and 16-byte accesses, `HISPARSE_TRITON_LEAN_COPY`) and `:k0` / `:k1` (1, with `:nN`: the split
resolver's last program keeps a one-chunk candidate list in registers, `HISPARSE_TRITON_SPLIT_KEEP`) and `:xN` (N = 32, 64, 128:
behind the split resolver, layer 0's copy reads the likely misses' host rows while the resolver runs, N entries a program;
`:x0` off, the default: `HISPARSE_TRITON_SPEC_COPY`) and `:w0` / `:w1` (1: the split resolver itself a programmatic
dependent launch of the copy before it, `HISPARSE_TRITON_PDL_CHAIN`) and `:a0` / `:a1` (0: the fixed defaults
of before for every knob the variant leaves unset; 1, the default: the runtime's choice per batch size,
`HISPARSE_TRITON_AUTO`), set while its runtimes are built. `gather` is the default, `gather:a0` the default
before the seventeenth session, `scratch:p4:a0` the backend as it was before the gather resolver,
`gather:f1:l0:a0` the default of call G3.

`--timeline` prints, after each cell, each backend's kernels from a few profiled replays
(`kernel_timeline.py`): every kernel's duration and where it starts against the end of the one before
(negative: a programmatic dependent launch overlapping its primary).

`--resolve-alone` adds two columns: each backend's step without its layer-0 copy
(`resolve(gather=False)`, the first variant for triton), so a cell's time splits into the resolver
and what the copy adds behind it.

Needs a CUDA GPU and `pip install 'hisparse[triton,nvidia]'`; without the nvidia backend
(`--no-nvidia`, or no cuda-python) the tr/nv column is left empty.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from dataclasses import field as dc_field
from typing import Any

import torch

from hisparse_core.replay.report import json_safe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from graph_timing import median_replay_us  # noqa: E402

K, H, BS, CTX = 2048, 4096, 64, 32768
P, HB = CTX // BS, H // BS
MAX_REQ = 128
#: The byte the triton cache's hot rows hold before each checked resolve (`Bench.check_copy`).
_POISON = 0xA5
SWEEP_MISSES = (0, 34, 274, 2048)
SWEEP_BATCHES = (1, 8, 64, 128)


def variant_env(variant: str) -> dict[str, str | None]:
    """The environment a variant `RESOLVER[:tN][:pN][:fB][:lB][:eN][:cB][:sB][:bB][:rB][:dB][:nN][:hB][:vB][:kB][:xN][:wB][:aB]` sets while
    its runtimes are built (None: unset, so the auto choice picks it per batch size unless `:a0`), checked by the
    backend's own parser; ValueError naming the bad part."""
    from hisparse_core.errors import InvalidInputError
    from hisparse_triton import auto, shapes

    name, *knobs = variant.split(":")
    env: dict[str, str | None] = dict.fromkeys((*auto.KNOB_ENVS, auto.AUTO_ENV))
    env[shapes.RESOLVER_ENV] = name
    suffixes = {s: key for key, s in auto.SUFFIXES} | {"a": auto.AUTO_ENV}
    for knob in knobs:
        key = suffixes.get(knob[:1])
        if key is None:
            raise ValueError(f"{variant!r} has the part {knob!r}; expected tTHREADS, pPROGRAMS_PER_SM, f0/f1, l0/l1, "
                             f"eENTRIES, c0/c1, s0/s1, b0/b1, r0/r1, d0/d1, nPROGRAMS, h0/h1, v0/v1, k0/k1, xENTRIES, "
                             f"w0/w1 or a0/a1")
        env[key] = knob[1:]
    try:
        set_env = {k: v for k, v in env.items() if v is not None}
        shapes.tuning(set_env)
        auto.auto_enabled(set_env)
    except InvalidInputError as exc:
        raise ValueError(f"{variant!r}: {exc}") from exc
    return env


def steps_for(misses: int) -> int:
    """Steps in one graph: the ring a window slides over (steps * misses positions) must hold at least
    hot_rows + top_k positions, or the steady state brings fewer new rows than asked (the 34-miss rows
    measured 0 on the H200 with a ring of 2048, docs/gpu-validation.md); as bench_nvidia.steps_for."""
    if misses in (0, K):
        return 8
    return min(CTX // misses, max(32, -(-(H + K) // misses)))


@dataclass
class Row:
    scenario: str
    batch: int
    misses: int  # measured per request and step
    triton_us: float
    nvidia_us: float | None
    copy_us: float | None
    others: dict[str, float]  # us per step of the further resolver variants
    alone: dict[str, float] = dc_field(default_factory=dict)  # --resolve-alone: backend -> us without the copy


    @property
    def vs_nvidia(self) -> float | None:
        return self.triton_us / self.nvidia_us if self.nvidia_us else None


class Bench:
    def __init__(self, replays: int, with_nvidia: bool, variants: list[str], resolve_alone: bool = False) -> None:
        from hisparse_core.host_pool import HostPoolSpec
        from hisparse_triton.backend import TritonBackend

        self.replays = replays
        self.resolve_alone = resolve_alone
        self.resolvers = variants
        self.backends: dict[str, Any] = {"triton": TritonBackend()}
        if with_nvidia:
            from hisparse_nvidia.backend import NvidiaBackend

            self.backends["nvidia"] = NvidiaBackend()
        self.dev = self.backends["triton"].device
        spec = HostPoolSpec(num_layers=1, num_blocks=MAX_REQ * P, block_size=BS)
        # The nvidia pool is registered memory, the triton one pinned by torch: each backend reads its own.
        self.pools = {name: be.create_host_pool(spec) for name, be in self.backends.items()}
        src = torch.randint(0, 256, (spec.nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
        for pool in self.pools.values():
            pool.layer_view(0).view(torch.uint8).view(-1).copy_(src)
        self.hot_blocks = MAX_REQ * HB
        self.caches = {name: torch.zeros((self.hot_blocks + 64 * P, BS, 656), dtype=torch.uint8, device=self.dev)
                       for name in self.backends}
        self.gen = torch.Generator().manual_seed(1234)
        self.copy_failures: list[str] = []  # `check_copy`'s findings

    def runtime(self, name: str, b: int, resolver: str | None = None):  # noqa: ANN201 - CacheRuntime
        from hisparse_core.geometry import RuntimeConfig

        cfg = RuntimeConfig(max_batch_rows=b, max_requests=b, top_k=K, hot_rows=H, block_size=BS, max_pages=P)
        env = variant_env(resolver or self.resolvers[0])
        before = {k: os.environ.get(k) for k in env}
        os.environ.update({k: v for k, v in env.items() if v is not None})
        for k in (k for k, v in env.items() if v is None):
            os.environ.pop(k, None)
        try:
            rt = self.backends[name].create_runtime(cfg)
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        rt.bind([self.pools[name].layer_view(0)], [self.caches[name]])
        return rt

    def steps(self, b: int, steps: int, shift: int, *, resident: bool) -> list:
        from hisparse_core.runtime import ResolveInputs

        i32 = torch.int32
        q = torch.arange(b, dtype=i32)[:, None]
        source = (q * P + torch.arange(P, dtype=i32)[None]).to(self.dev)
        res = ((self.hot_blocks + q * P + torch.arange(P, dtype=i32)[None]) if resident
               else torch.full((b, P), -1, dtype=i32)).to(self.dev)
        hot = (q * HB + torch.arange(HB, dtype=i32)[None]).to(self.dev)
        ring_len = max(K, steps * shift)
        rings = torch.stack([torch.randperm(CTX, generator=self.gen)[:ring_len] for _ in range(b)])
        state = torch.arange(b, dtype=i32, device=self.dev)
        lens = torch.full((b,), CTX, dtype=i32, device=self.dev)
        out = []
        for s in range(steps):
            idx = (torch.arange(K) + s * shift) % ring_len
            out.append(ResolveInputs(rings[:, idx].to(i32).contiguous().to(self.dev), state, lens, source, res, hot))
        return out

    def time_graph(self, graph: torch.cuda.CUDAGraph, steps: int) -> float:
        return median_replay_us(graph, self.replays, steps, 3)

    def resolve_us(self, name: str, b: int, inputs: list, resolver: str | None = None,
                   gather: bool = True) -> tuple[float, int]:
        """(us per step, misses per request and step) of one backend (triton: with `resolver`) over
        the cycle `inputs`; `gather=False`: the resolver without its layer-0 copy."""
        g, misses = self.graph(name, b, inputs, resolver, gather)
        return self.time_graph(g, len(inputs)), misses

    def graph(self, name: str, b: int, inputs: list, resolver: str | None = None,
              gather: bool = True) -> tuple[torch.cuda.CUDAGraph, int]:
        """The captured cycle `inputs` of one backend, replayed once, and its misses per request and step."""
        rt = self.runtime(name, b, resolver)
        for inp in inputs:  # warm the LRU to its steady state, and compile
            rt.resolve(inp, gather=gather, validate=False)
        rt.reset_stats()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for inp in inputs:
                rt.resolve(inp, gather=gather, validate=False)
        g.replay()
        torch.cuda.synchronize()
        return g, rt.stats().misses // (b * len(inputs))

    def timeline(self, b: int, misses: int | None) -> list[str]:
        """`--timeline`: each backend's kernels in one cell (the first variant for triton), from the profiler."""
        from kernel_timeline import graph_kernels, summary

        resident = misses is None
        shift = 0 if misses is None else misses
        inputs = self.steps(b, 8 if resident else steps_for(shift), shift, resident=resident)
        lines = []
        for name in self.backends:
            g, _ = self.graph(name, b, inputs)
            lines += [f"  {name} timeline: {line}" for line in summary(graph_kernels(g))]
        return lines

    def check_equal(self, b: int, inputs: list) -> None:
        """The two backends (triton with each resolver) agree on every output and on the hot state
        after the cycle, and each triton variant's copy of layer 0 writes exactly its plan's rows, with
        the bytes nvidia's copy wrote there (`check_copy`)."""
        if "nvidia" not in self.backends:
            return
        rts = {"nvidia": self.runtime("nvidia", b)}
        for v in self.resolvers:
            try:
                rts[v] = self.runtime("triton", b, v)
            except Exception as exc:  # noqa: BLE001 - a variant this GPU refuses: its column stays empty
                if v == self.resolvers[0]:
                    raise
                print(f"bench_triton: variant {v} at batch {b}: {type(exc).__name__}: {exc}", file=sys.stderr)
        for i, inp in enumerate(inputs):
            outs = {}
            for name, rt in rts.items():  # nvidia first: its copy is the reference for each variant's
                if name != "nvidia":
                    self.caches["triton"][:b * HB].fill_(_POISON)
                outs[name] = rt.resolve(inp, gather=True, validate=False)
                if name != "nvidia":
                    self.check_copy(b, i, name, outs[name])
            for v in (v for v in self.resolvers if v in rts):
                for field in ("rows", "valid_counts", "plan_host", "plan_device", "plan_counts"):
                    if not torch.equal(getattr(outs[v], field), getattr(outs["nvidia"], field)):
                        raise SystemExit(f"batch {b}, step {i}: triton ({v}) and nvidia differ in {field}")
        for q in range(b):
            for v in (v for v in self.resolvers if v in rts):
                if any(not torch.equal(x, y) for x, y in zip(rts[v].hot_state(q), rts["nvidia"].hot_state(q),
                                                             strict=True)):
                    raise SystemExit(f"batch {b}: triton ({v}) and nvidia differ in the hot state of request {q}")

    def check_copy(self, b: int, step: int, variant: str, out: Any) -> None:  # noqa: ANN401 - a ResolveResult
        """After a resolve of triton `variant` over hot rows filled with `_POISON`: its plan's rows hold what
        nvidia's copy wrote there this step, and every other hot row of the batch's requests is untouched."""
        tc = self.caches["triton"][:b * HB].view(-1, 656)
        nc = self.caches["nvidia"][:b * HB].view(-1, 656)
        cols = torch.arange(K, device=self.dev)[None, :]
        planned = (cols < out.plan_counts[:, None]) & (out.plan_device >= 0)
        rows = out.plan_device[planned].long()
        # Reported, not fatal: the sweep's timings still come back (main exits 1 after the table).
        if not torch.equal(tc[rows], nc[rows]):
            self.copy_failures.append(f"batch {b}, step {step}: triton ({variant})'s copy differs from nvidia's in "
                                      f"its plan's rows")
        tc[rows] = _POISON
        if not bool((tc == _POISON).all()):
            self.copy_failures.append(f"batch {b}, step {step}: triton ({variant})'s copy wrote hot rows outside its plan")

    def copy_us(self, nbytes: int, steps: int) -> float | None:
        if nbytes == 0:
            return None
        src = self.pools["triton"].layer_view(0).view(torch.uint8).view(-1)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=self.dev)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for s in range(steps):
                off = (s * nbytes) % max(1, src.numel() - nbytes)
                dst.copy_(src[off:off + nbytes], non_blocking=True)
        return self.time_graph(g, steps)

    def cell(self, b: int, misses: int | None) -> Row:
        resident = misses is None
        shift = 0 if misses is None else misses
        steps = 8 if resident else steps_for(shift)
        inputs = self.steps(b, steps, shift, resident=resident)
        self.check_equal(b, inputs)
        tr, got = self.resolve_us("triton", b, inputs)
        others: dict[str, float] = {}
        for v in self.resolvers[1:]:
            try:
                others[v] = self.resolve_us("triton", b, inputs, v)[0]
            except Exception as exc:  # noqa: BLE001 - one variant failing (a capture, a refusal) spares the others
                print(f"bench_triton: variant {v} at batch {b}: {type(exc).__name__}: {exc}", file=sys.stderr)
                others[v] = float("nan")
        nv = self.resolve_us("nvidia", b, inputs)[0] if "nvidia" in self.backends else None
        copy = None if resident else self.copy_us(b * got * 656, steps)
        alone = {}
        if self.resolve_alone:
            alone = {name: self.resolve_us(name, b, inputs, gather=False)[0] for name in self.backends}
        return Row("resident" if resident else f"{misses} misses", b, got, tr, nv, copy, others, alone)


def main(argv: list[str] | None = None) -> int:
    from hisparse_core.cli.options import CliParser, int_in

    # One line a bad value (the stock parser printed its usage first); --replays 0 was the median of none.
    ap = CliParser(prog="bench_triton", description=__doc__.splitlines()[0])
    ap.add_argument("--replays", type=int_in(1, 100_000), default=30, help="timed graph replays per figure (median)")
    ap.add_argument("--json", help="also write the table as JSON to this path")
    ap.add_argument("--no-nvidia", action="store_true", help="time the triton backend and the copy only")
    ap.add_argument("--resolve-alone", action="store_true",
                    help="also time each backend's resolver without its layer-0 copy (two more columns)")
    ap.add_argument("--timeline", action="store_true",
                    help="after each cell, each backend's kernels on a timeline (durations, overlaps; torch.profiler)")
    ap.add_argument("--cells", metavar="M:B[,M:B]",
                    help="only these cells (misses per request, or R for the resident step : batch), e.g. 0:1,R:128 "
                         "(default: the whole sweep)")
    ap.add_argument("--variants", default="gather", metavar="V[,V]",
                    help="triton variants to time, each "
                         "RESOLVER[:tTHREADS][:pPLAN_PER_SM][:f0|:f1][:l0|:l1][:eENTRIES][:c0|:c1][:s0|:s1][:b0|:b1][:r0|:r1][:d0|:d1][:nN][:h0|:h1][:v0|:v1]"
                         "[:k0|:k1][:xN][:w0|:w1][:a0|:a1] (e.g. gather,gather:a0,gather:c1,scratch:p4:a0; unset knobs: the runtime's "
                         "choice per batch size unless :a0); "
                         "the first is 'triton us'")
    args = ap.parse_args(argv)
    resolvers = [v for v in args.variants.split(",") if v]
    try:
        for v in resolvers:
            variant_env(v)
    except ValueError as exc:
        ap.error(f"--variants {args.variants!r}: {exc}")
    if not resolvers or len(set(resolvers)) != len(resolvers):
        ap.error(f"--variants {args.variants!r}: expected distinct variants, e.g. gather,scratch:p4")
    cells = [(m, b) for m in (*SWEEP_MISSES, None) for b in SWEEP_BATCHES]
    if args.cells:
        try:
            cells = [(None if m == "R" else int(m), int(b)) for m, b in (c.split(":") for c in args.cells.split(","))]
        except ValueError:
            ap.error(f"--cells {args.cells!r}: expected M:B pairs, M misses per request or R, B a batch (e.g. 0:1,R:128)")
        if any(b < 1 or b > MAX_REQ or (m is not None and not 0 <= m <= K) for m, b in cells):
            ap.error(f"--cells {args.cells!r}: batches must be 1-{MAX_REQ} and misses 0-{K}")
    if not torch.cuda.is_available():
        print("bench_triton: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    with_nvidia = not args.no_nvidia
    if with_nvidia:
        from hisparse_nvidia.plugin import probe

        why = probe()
        if why is not None:
            print(f"bench_triton: nvidia backend unavailable ({why}); timing triton alone", file=sys.stderr)
            with_nvidia = False
    bench = Bench(args.replays, with_nvidia, resolvers, args.resolve_alone)
    rows: list[Row] = []
    extra = "".join(f" {v[:10]:>10} {'/nv':>6}" for v in resolvers[1:])
    if args.resolve_alone:
        extra += f" {'tr alone':>9}" + (f" {'nv alone':>9}" if with_nvidia else "")
    print(f"triton variant: {resolvers[0]}" + (f"; also {', '.join(resolvers[1:])}" if resolvers[1:] else ""))
    print(f"{'scenario':>14} {'batch':>5} {'misses':>6} {'triton us':>10} {'nvidia us':>10} {'tr/nv':>6} "
          f"{'copy us':>9} {'tr/copy':>7}{extra}")
    for misses, b in cells:
        r = bench.cell(b, misses)
        rows.append(r)

        def f(v: float | None, w: int) -> str:
            return f"{v:{w}.1f}" if v is not None else " " * (w - 1) + "-"

        vs = f"{r.vs_nvidia:6.2f}" if r.vs_nvidia is not None else "     -"
        vc = f"{r.triton_us / r.copy_us:7.2f}" if r.copy_us else "      -"
        more = "".join(f" {f(us, 10)} " + (f"{us / r.nvidia_us:6.2f}" if r.nvidia_us else "     -")
                       for us in r.others.values())
        more += "".join(f" {f(us, 9)}" for us in r.alone.values())
        print(f"{r.scenario:>14} {b:5d} {r.misses:6d} {f(r.triton_us, 10)} {f(r.nvidia_us, 10)} {vs} "
              f"{f(r.copy_us, 9)} {vc}{more}", flush=True)
        if args.timeline:
            print("\n".join(bench.timeline(b, misses)), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            # A variant that failed at a batch timed NaN: null in the file (JSON has no NaN).
            json.dump(json_safe({"rows": [asdict(r) | {"vs_nvidia": r.vs_nvidia} for r in rows], "variants": resolvers,
                                 "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                 "triton": __import__("triton").__version__}), fh, indent=1, allow_nan=False)
    for line in bench.copy_failures[:20]:
        print(f"bench_triton: {line}", file=sys.stderr)
    if bench.copy_failures:
        print(f"bench_triton: {len(bench.copy_failures)} checked steps where a triton copy was not nvidia's",
              file=sys.stderr)
        return 1
    print("bench_triton: every triton variant's layer-0 copy wrote exactly its plan's rows, with nvidia's bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
