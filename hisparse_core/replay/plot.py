"""`hisparse run --plot FILE.png`: hit rate over steps, and concurrency against context length
(the planner's panel of `hisparse_core.planner_plot`, with the run's measured concurrency on it).

Needs matplotlib (`pip install 'hisparse[plot]'`); imported only when a plot is asked for.
"""

from __future__ import annotations

from hisparse_core.planner_plot import context_range, draw_concurrency, legend_below, pyplot
from hisparse_core.replay.engine import RunConfig
from hisparse_core.replay.run import RunResult


def write_plot(result: RunResult, config: RunConfig, path: str, fmt: str = "png") -> None:
    """Draw the run's figure into `path` as `fmt` (a format matplotlib writes: png, svg, pdf ...)."""
    plt = pyplot()
    recs = result.records
    steps = [r.step for r in recs if r.hits + r.misses]
    rates = [r.hits / (r.hits + r.misses) for r in recs if r.hits + r.misses]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 6.5))
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
    legend_below(a1, h1 + h2, l1 + l2)

    inputs = config.plan().inputs
    lo, hi = context_range(inputs)
    draw_concurrency(a2, inputs, lo, hi)
    s = result.summary()
    a2.scatter([config.max_tokens], [s["max_concurrency_all_resident_measured"]], marker="o", zorder=5,
               color="tab:blue", label="all resident (measured)")
    a2.scatter([config.max_tokens], [s["max_concurrency_hisparse_measured"]], marker="*", s=120, zorder=5,
               color="tab:orange", label="hisparse (measured)")
    legend_below(a2)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110, format=fmt)
    finally:
        plt.close(fig)
