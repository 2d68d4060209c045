"""The transformers engine's host work per decode step on the CPU (issue 42): `begin_step` and
`end_step` (critical: what the device waits for) and the planning ahead, at a serving shape.

The block counts are bench_serving's on the H200 (DeepSeek-V3.2 geometry, `--gpu-kv-gib` budget
less the batch's indexer keys), the top-k 2048 and the block size 64 too; only the row width is
small (the host work does not depend on it). Decode steps run the engine's step path without the
model (`begin_step`, one row written per layer, the locality model's top-k resolved by the
backend as the attention would, `end_step`), so the timing is the engine's alone.

`tensor ops` counts the aten operations each part dispatches (on a GPU each is a launch, a copy
or an allocation: what the host pays there, which the CPU's own copies here do not show).

Run:  python bench/bench_engine_host.py --batch 43 --context 32768 [--mode all-resident] [--profile 25]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_transformers import GEOMETRY, EngineHostTime  # noqa: E402 - the sibling script
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


class OpCount(TorchDispatchMode):
    """Tensor operations dispatched while active (each a kernel launch or a copy on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.n += 1
        return func(*args, **(kwargs or {}))


def parts(engine: Any, session: Any, token: torch.Tensor, steps: int, resolve: bool, *, count: bool) -> list[float]:
    """Per decode step, [engine critical, worker after_forward, planning ahead, top-k fill]: host
    ms, or with `count` tensor operations (slower: every operation goes through Python). Engine
    critical is `begin_step` + `end_step` less the planning ahead, the worker's `after_forward` (the
    backend's row mirrors, critical too) and the benchmark's top-k copy (`ModelTopk.fill`: one
    device-to-device copy on a GPU, a slow strided copy on the CPU)."""
    names = ("begin_step", "end_step", "_plan_next", "_after_forward", "fill")
    ops = dict.fromkeys(names, 0)
    secs = dict.fromkeys(names, 0.0)
    owner = {n: engine.topk_model if n == "fill" else engine for n in names}
    saved = {n: getattr(owner[n], n) for n in names}

    def wrap(name: str) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            c = OpCount()
            try:
                if not count:
                    return saved[name](*a, **k)
                with c:
                    return saved[name](*a, **k)
            finally:
                ops[name] += c.n
                secs[name] += time.perf_counter() - t0
        return run

    for n in names:
        setattr(owner[n], n, wrap(n))
    try:
        for _ in range(steps):
            decode_step(engine, session, token, resolve)
    finally:
        for n in names:
            delattr(owner[n], n)

    d = ops if count else {k: 1e3 * v for k, v in secs.items()}
    crit = d["begin_step"] + d["end_step"] - d["_plan_next"] - d["_after_forward"] - d["fill"]
    return [crit / steps, d["_after_forward"] / steps, d["_plan_next"] / steps, d["fill"] / steps]


def serving_sizes(context: int, budget_gib: float, steps: int) -> Any:
    """bench_serving's `Sizes` of a request of `context` tokens on the H200 geometry at this budget."""
    from bench_serving import sizes_for
    from transformers import DeepseekV32Config

    a = SimpleNamespace(block_size=64, smoke=False, warmup=0, steps=steps, max_context=context + steps + 1024,
                        hot_rows=0, fill_chunk=1024, host_gib=1e4, gpu_kv_gib=budget_gib, all_resident_gib=1e3)
    return sizes_for(DeepseekV32Config(num_hidden_layers=4, **GEOMETRY), 4, context, a)


def budget_problem(batch: int, context: int, budget_gib: float, steps: int) -> str | None:
    """Why `--gpu-kv-gib` cannot hold hisparse's floor for `--batch` (its hot buffers, tails and
    prefill pages, after the batch's indexer keys), in the flags' words, or None. The engine refused
    it after the parse, in its own terms (its scaled-down gpu_kv_gib), as a traceback."""
    from hisparse_core.units import significant

    s = serving_sizes(context, budget_gib, steps)
    if s.fits("hisparse", batch):
        return None
    blocks, need = (s.budget - batch * s.indexer_bytes) // s.block_bytes, s.hisparse_blocks(batch)
    smallest = significant((need * s.block_bytes + batch * s.indexer_bytes) / 2**30, up=True)
    largest = s.largest("hisparse")
    return (f"--gpu-kv-gib {budget_gib:g} holds {max(blocks, 0)} blocks once the indexer keys of --batch {batch} at "
            f"--context {context} are taken, below the {need} its hot buffers, tails and prefill need; expected "
            + " or ".join(([f"--gpu-kv-gib >= {smallest:g}"] if smallest <= 65536 else [])
                          + ([f"--batch <= {largest}"] if largest else [])))


def serving_blocks(batch: int, context: int, budget_gib: float, steps: int, mode: str) -> tuple[int, int]:
    """(GPU blocks, pages per request) of bench_serving's row at this batch on the H200 geometry."""
    s = serving_sizes(context, budget_gib, steps)
    if mode == "all-resident":
        return s.resident_blocks(batch), s.pages
    return (s.budget - batch * s.indexer_bytes) // s.block_bytes, s.pages


class Shell:
    """What `fill_hisparse`/`decode` need of a handle: the engine (no model)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine


def build(batch: int, context: int, mode: str, steps: int, budget_gib: float, backend: str) -> Any:
    from hisparse_core.registry import select_backend
    from hisparse_transformers.engine import EngineConfig, HiSparseEngine
    from hisparse_transformers.families import DsaLayout

    blocks, pages = serving_blocks(batch, context, budget_gib, steps, mode)
    width, bs, dtype = 16, 64, torch.float32
    layout = DsaLayout("deepseek_v32", (None,) * 4, ((0,), (1,), (2,), (3,)), True, None, width - 8, 8, 16, 16, 4,
                       2048, 16)
    row_bytes = width * 4
    block_bytes = 4 * bs * row_bytes
    cfg = EngineConfig(host_pool_gib=(batch * (pages + 4) + 8) * block_bytes / 2**30,
                       gpu_kv_gib=blocks * block_bytes / 2**30 * (1 + 1e-9), block_size=bs, max_batch=batch,
                       max_context=pages * bs, prefill_chunk=1024)
    engine = HiSparseEngine(layout, cfg, select_backend(backend), dtype=dtype)
    engine.use_model_topk("benign", seed=0, lookahead=4 * steps + 8)
    return engine


def fill(engine: Any, batch: int, context: int) -> Any:
    prompts = [[2 + (i % 1000) for i in range(context)] for _ in range(batch)]
    session = engine.open_session(prompts, [0] * batch)
    width = engine.fmt.width
    for a in range(0, context, 1024):
        n = min(1024, context - a)
        engine.begin_step(session, None, n)
        rows = torch.randn(batch * n, width)
        for g in range(engine.layout.num_layers):
            engine.write_rows(g, 0, rows)
        engine.end_step(session)
    return session


def decode_step(engine: Any, session: Any, token: torch.Tensor, resolve: bool) -> None:
    step = engine.begin_step(session, token, 1)
    rows = torch.randn(session.batch_size, engine.fmt.width)
    for g in range(engine.layout.num_layers):
        engine.write_rows(g, 0, rows)
        if resolve:
            from hisparse_transformers.attention import _decode_rows

            _decode_rows(engine, step, g, 0, engine.topk_model.take(g, session.batch_size), None)
    engine.end_step(session)


def hits_text(hits: int, looked: int) -> str:
    """`hits 81.21%`, or n/a where no lookup went through the hot buffer (every entry resident)."""
    from hisparse_core.replay.report import hit_rate

    return f"hits {hit_rate(hits / looked if looked else 1.0, looked)}"


def main(argv: list[str] | None = None) -> int:
    from hisparse_core.cli.options import (
        MAX_REQUESTS,
        MAX_STEPS,
        MAX_TOKENS,
        CliParser,
        check_backend_name,
        float_in,
        int_in,
    )
    from hisparse_core.errors import HiSparseError

    p = CliParser(prog="bench_engine_host", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int_in(1, MAX_REQUESTS), default=43)
    p.add_argument("--context", type=int_in(1, MAX_TOKENS), default=32768)
    p.add_argument("--mode", choices=("hisparse", "all-resident"), default="hisparse")
    p.add_argument("--gpu-kv-gib", type=float_in(0.0, 65536.0, lo_open=True), default=3.0)
    p.add_argument("--warmup", type=int_in(0, MAX_STEPS), default=5)
    p.add_argument("--steps", type=int_in(1, MAX_STEPS), default=20)
    p.add_argument("--backend", default="reference_cpu")
    p.add_argument("--no-resolve", action="store_true", help="skip the resolver (host work only)")
    p.add_argument("--profile", type=int_in(0, 10_000), default=0, help="print cProfile's top N of the timed steps")
    a = p.parse_args(argv)
    if why := check_backend_name(a.backend) or (a.mode == "hisparse" and budget_problem(
            a.batch, a.context, a.gpu_kv_gib, a.warmup + a.steps)):
        p.exit(2, f"bench_engine_host: error: {why}\n")
    t0 = time.perf_counter()
    try:
        engine = build(a.batch, a.context, a.mode, a.warmup + a.steps, a.gpu_kv_gib, a.backend)
    except HiSparseError as exc:  # the engine's own checks (a host pool past the RAM): before any work
        p.exit(2, f"bench_engine_host: error: --batch {a.batch} at --context {a.context} + {a.warmup + a.steps} "
                  f"steps (--warmup + --steps): {exc}\n")
    session = fill(engine, a.batch, a.context)
    token = torch.full((a.batch, 1), 5, dtype=torch.long)
    for _ in range(a.warmup):
        decode_step(engine, session, token, not a.no_resolve)
    host = EngineHostTime(Shell(engine))
    prof = cProfile.Profile() if a.profile else None
    released0 = engine.coordinator.stats().released_pages
    stats0 = engine.collect().worker.copy()
    for _ in range(a.steps):
        host.reset()
        if prof is not None:
            prof.enable()
        decode_step(engine, session, token, not a.no_resolve)
        if prof is not None:
            prof.disable()
    host.reset()
    times = []
    for _ in range(a.steps):
        host.reset()
        decode_step(engine, session, token, not a.no_resolve)
        times.append(host.per_step_ms(1))
    ms = parts(engine, session, token, a.steps, not a.no_resolve, count=False)
    ops = parts(engine, session, token, a.steps, not a.no_resolve, count=True)
    crit = sorted(t[0] for t in times)[len(times) // 2]
    ahead = sorted(t[1] for t in times)[len(times) // 2]
    w = engine.collect().worker
    looked = (w["hits"] - stats0["hits"]) + (w["misses"] - stats0["misses"])
    print(f"{a.mode} B={a.batch} T={a.context}: GPU pool {engine.gpu_blocks} blocks; host critical {crit:.3f} ms, "
          f"ahead {ahead:.3f} ms per step (median of {a.steps}); released pages {engine.coordinator.stats().released_pages - released0} "
          f"in {4 * a.steps} steps; {hits_text(w['hits'] - stats0['hits'], looked)}; "
          f"total {time.perf_counter() - t0:.0f} s")
    print(f"  per step, host ms (mean) / tensor ops: engine critical {ms[0]:.3f} / {ops[0]:.0f}, worker after_forward "
          f"(backend mirrors) {ms[1]:.3f} / {ops[1]:.0f}, planning ahead {ms[2]:.3f} / {ops[2]:.0f}, top-k fill "
          f"{ms[3]:.3f} / {ops[3]:.0f}")
    if prof is not None:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(a.profile)
        pstats.Stats(prof).sort_stats("tottime").print_stats(a.profile)
    engine.close()
    return 0


if __name__ == "__main__":
    from hisparse_core.cli.options import run_script

    raise SystemExit(run_script(main))
