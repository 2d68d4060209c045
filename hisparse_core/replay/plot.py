"""`hisparse run --plot FILE.png`: hit rate over steps, and concurrency against context length.

Needs matplotlib (`pip install 'hisparse[plot]'`); imported only when a plot is asked for.
"""

from __future__ import annotations

from dataclasses import replace

from hisparse_core.errors import HiSparseError
from hisparse_core.planner import PlanInputs, make_plan
from hisparse_core.replay.engine import RunConfig
from hisparse_core.replay.run import RunResult


def context_sweep(config: RunConfig, points: int = 16) -> list[tuple[int, int, int]]:
    """(context, all-resident, hisparse) concurrency from the planner for this run's geometry and
    budgets, from one top-k of context to 8x the run's context (log-spaced)."""
    lo, hi = max(config.top_k, config.block_size), 8 * config.max_tokens
    ctxs = sorted({int(round(lo * (hi / lo) ** (i / (points - 1)))) for i in range(points)} | {config.max_tokens})
    base = config.plan()
    out = []
    for ctx in ctxs:
        p = make_plan(replace(base.inputs, context=ctx) if isinstance(base.inputs, PlanInputs) else base.inputs)
        out.append((ctx, p.baseline_concurrency, p.hisparse_concurrency))
    return out


def write_plot(result: RunResult, config: RunConfig, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise HiSparseError(f"--plot needs matplotlib: pip install 'hisparse[plot]' ({exc})") from None
    recs = result.records
    steps = [r.step for r in recs if r.hits + r.misses]
    rates = [r.hits / (r.hits + r.misses) for r in recs if r.hits + r.misses]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    a1.plot(steps, rates, marker=".", label="hot-buffer hit rate")
    a1.set_xlabel("step")
    a1.set_ylabel("hit rate (hits / hot lookups)")
    a1.set_ylim(0, 1.02)
    a1.grid(alpha=0.3)
    a1b = a1.twinx()
    a1b.step([r.step for r in recs], [r.running for r in recs], where="post", color="gray", alpha=0.6,
              label="running requests")
    a1b.set_ylabel("running requests")
    a1.set_title(f"hit rate over steps (top-k {config.top_k}, hot {config.hot_rows} rows)")
    h1, l1 = a1.get_legend_handles_labels()
    h2, l2 = a1b.get_legend_handles_labels()
    a1.legend(h1 + h2, l1 + l2, loc="lower right")

    sweep = context_sweep(config)
    ctx = [s[0] for s in sweep]
    a2.plot(ctx, [s[1] for s in sweep], label="all resident (planner)")
    a2.plot(ctx, [s[2] for s in sweep], label="hisparse (planner)")
    s = result.summary()
    a2.scatter([config.max_tokens], [s["max_concurrency_all_resident_measured"]], marker="o", zorder=3,
               label="all resident (measured)")
    a2.scatter([config.max_tokens], [s["max_concurrency_hisparse_measured"]], marker="*", s=120, zorder=3,
               label="hisparse (measured)")
    a2.set_xscale("log")
    a2.set_xlabel("context length (tokens)")
    a2.set_ylabel("requests that fit the GPU KV budget")
    a2.set_title("concurrency against context length")
    a2.grid(alpha=0.3)
    a2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
