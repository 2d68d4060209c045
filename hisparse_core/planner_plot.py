"""The planner's picture: concurrency against context length, with where hisparse overtakes
all-resident and why (`hisparse plan --plot FILE.png`; `hisparse run --plot` draws the same panel
beside its measurements).

- Left: requests that fit the GPU KV budget (and the host pool), all-resident and hisparse. The
  hybrid-rule regime is shaded: a context of at most the hot buffer and tail stays resident (no hot
  buffer leased, misses about 0), so hisparse equals all-resident there. Past it a
  request holds its hot buffer and tail instead of its pages, which pays from the crossover on
  (`planner.crossover_context`), marked with its context.
- Right: GPU KV per request. All-resident grows with the context; hisparse's steady state stops
  growing past the hot buffer and tail (indexer blocks + hot buffer + tail), and the miss rate
  charged to PCIe goes from 0 to the plan's there.

Needs matplotlib (`pip install 'hisparse[plot]'`); imported only when a plot is drawn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from hisparse_core.errors import HiSparseError
from hisparse_core.planner import Plan, PlanInputs, crossover_context, make_plan, no_crossover_reason, resident_context

#: Artist ids (matplotlib `gid`) of the annotations, for tests and for anyone post-editing a figure.
GID_CROSSOVER = "crossover"
GID_HOT_BUFFER = "hot-buffer"
GID_RESIDENT = "resident-regime"
GID_NO_CROSSOVER = "no-crossover"

ALL_RESIDENT = "all resident (no hisparse)"
HISPARSE = "hisparse"
HISPARSE_RULE = "hisparse: resident up to the hot buffer and tail, host-backed past them"


def context_range(inputs: PlanInputs, extra: Sequence[int] = ()) -> tuple[int, int]:
    """Contexts a plot spans: from well inside the resident regime to well past the plan's
    context and the hot buffer (and every context in `extra`), at most 2**24 tokens."""
    hot = inputs.hot_rows
    # Every marked context at least a factor 2 inside the edges, so its marker is drawn whole.
    lo = max(1, min([hot // 8, inputs.context // 2, *(e // 2 for e in extra)]))
    hi = min(1 << 24, max([4 * inputs.context, 16 * hot, *(2 * e for e in extra)]))
    return lo, hi


def context_points(inputs: PlanInputs, lo: int, hi: int, crossover: int | None, points: int = 160) -> list[int]:
    """Log-spaced contexts in [lo, hi], plus the first and last token of the pages around the hot
    buffer and around the crossover, so the steps there are drawn exactly."""
    bs = inputs.geometry.block_size
    out = {int(round(lo * (hi / lo) ** (i / (points - 1)))) for i in range(points)} | {inputs.context}
    hot_page = inputs.hot_rows // bs
    pages = set(range(hot_page - 1, hot_page + 64))
    if crossover is not None:
        cross_page = -(-crossover // bs)
        pages.update(range(cross_page - 4, cross_page + 4))
    for page in pages:
        out.update((page * bs + 1, (page + 1) * bs))
    return sorted(c for c in out if lo <= c <= hi)


def _log_axes(ax: Any, lo: int, hi: int, ylabel: str, title: str) -> None:
    """Both panels: log-log against context length over [lo, hi]."""
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)


def near_hot_buffer(inputs: PlanInputs, crossover: int) -> bool:
    """Whether the crossover's line would all but cover the hot buffer's on a log axis (within
    25%): then only the hot buffer's is drawn, and the crossover's label says where it is."""
    return max(crossover, inputs.hot_rows) < 1.25 * min(crossover, inputs.hot_rows)


def legend_below(ax: Any, handles: Sequence[Any] | None = None, labels: Sequence[str] | None = None) -> None:
    """The legend of `ax` under its x axis, where it covers no curve or point."""
    kw: dict[str, Any] = {"loc": "upper center", "bbox_to_anchor": (0.5, -0.14), "fontsize": 8, "ncol": 1,
                          "frameon": False}
    if handles is not None:
        ax.legend(handles, labels, **kw)
    else:
        ax.legend(**kw)


def draw_concurrency(ax: Any, inputs: PlanInputs, lo: int, hi: int) -> int | None:
    """Draw the concurrency panel on matplotlib axes `ax`; returns the crossover it marks."""
    crossover = crossover_context(inputs, up_to=hi)
    ctxs = context_points(inputs, lo, hi, crossover)
    plans = [make_plan(replace(inputs, context=c)) for c in ctxs]
    ax.plot(ctxs, [p.baseline_concurrency for p in plans], color="tab:blue", label=ALL_RESIDENT)
    ax.plot(ctxs, [p.hisparse_concurrency for p in plans], color="tab:orange", label=HISPARSE_RULE)
    hot = inputs.hot_rows
    ax.axvspan(lo, resident_context(inputs), color="tab:green", alpha=0.12, gid=GID_RESIDENT,
               label="context <= hot buffer + tail: requests stay resident\n(no hot buffer, misses ~0): "
                     "hisparse = all resident\n(less only where the host pool binds)")
    ax.axvline(hot, color="tab:green", linestyle="--", linewidth=1, gid=GID_HOT_BUFFER,
               label=f"hot buffer: {hot:,} rows (the regime boundary)")
    if crossover is not None:
        at = make_plan(replace(inputs, context=crossover))
        near = near_hot_buffer(inputs, crossover)
        if not near:
            ax.axvline(crossover, color="tab:red", linestyle=":", linewidth=1)
        ax.plot([crossover], [at.hisparse_concurrency], marker="o", color="tab:red", zorder=4)
        pages = at.pages_per_request
        past = crossover - resident_context(inputs)
        where = (f"\n({past:,} token{'s' if past != 1 else ''} past the hot buffer and tail)" if near and past > 0
                 else "\n(at the hot buffer)" if near else "")
        ax.annotate(f"hisparse overtakes all resident\nat {crossover:,} tokens ({pages} pages):\n"
                    f"{at.hisparse_concurrency} vs {at.baseline_concurrency} requests{where}",
                    xy=(crossover, at.hisparse_concurrency), xytext=(28, 18), textcoords="offset points",
                    arrowprops={"arrowstyle": "->", "color": "tab:red"}, color="tab:red", fontsize=8,
                    gid=GID_CROSSOVER)
    else:
        ax.text(0.62, 0.85, f"hisparse never runs more requests than all resident\nup to {hi:,} tokens: "
                            f"{no_crossover_reason(inputs)}",
                transform=ax.transAxes, ha="center", color="tab:red", fontsize=8, gid=GID_NO_CROSSOVER)
    _log_axes(ax, lo, hi, "concurrent requests that fit", "concurrency against context length")
    return crossover


def draw_kv_per_request(ax: Any, inputs: PlanInputs, lo: int, hi: int, crossover: int | None) -> None:
    """Draw GPU KV per request (GiB) and the miss rate charged, against context, on axes `ax`."""
    ctxs = context_points(inputs, lo, hi, crossover)
    plans = [make_plan(replace(inputs, context=c)) for c in ctxs]
    gib = float(1 << 30)
    ax.plot(ctxs, [p.baseline_blocks_per_request * p.block_bytes / gib for p in plans], color="tab:blue",
            label=f"{ALL_RESIDENT}: every page + indexer")
    ax.plot(ctxs, [p.steady_blocks_per_request * p.block_bytes / gib for p in plans], color="tab:orange",
            label=f"{HISPARSE} steady state: indexer + hot buffer + tail")
    ax.axvspan(lo, resident_context(inputs), color="tab:green", alpha=0.12)
    ax.axvline(inputs.hot_rows, color="tab:green", linestyle="--", linewidth=1)
    if crossover is not None and not near_hot_buffer(inputs, crossover):
        ax.axvline(crossover, color="tab:red", linestyle=":", linewidth=1)
    _log_axes(ax, lo, hi, "GPU KV per request (GiB)", "why: what one request holds on the GPU")
    miss = ax.twinx()
    miss.step(ctxs, [100 * p.miss_rate for p in plans], where="post", color="gray", alpha=0.7,
              label="miss rate charged to PCIe (%)")
    miss.set_ylabel("miss rate charged (%)")
    miss.set_ylim(0, max(1.0, 100 * inputs.miss_rate) * 1.3)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = miss.get_legend_handles_labels()
    legend_below(ax, h1 + h2, l1 + l2)


def plan_figure(plan: Plan, sweep: Sequence[Plan] = ()) -> Any:
    """The `hisparse plan` figure (a matplotlib Figure): both panels, the plan's context and any
    swept contexts marked. Raises `HiSparseError` without matplotlib."""
    plt = pyplot()
    inputs = plan.inputs
    lo, hi = context_range(inputs, [s.inputs.context for s in sweep])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 7))
    crossover = draw_concurrency(a1, inputs, lo, hi)
    marked = [plan, *sweep]
    a1.scatter([s.inputs.context for s in marked], [s.hisparse_concurrency for s in marked], marker="*", s=90,
               color="tab:orange", zorder=5, label="this plan (and --sweep): hisparse")
    a1.scatter([s.inputs.context for s in marked], [s.baseline_concurrency for s in marked], marker="o", s=25,
               color="tab:blue", zorder=5, label="this plan (and --sweep): all resident")
    legend_below(a1)
    draw_kv_per_request(a2, inputs, lo, hi, crossover)
    g = inputs.geometry
    fig.suptitle(f"hisparse plan: {g.name}, top-k {g.top_k}, hot buffer {inputs.hot_rows:,} rows, "
                 f"{plan.gpu_blocks:,} GPU blocks, {plan.host_blocks:,} host blocks", fontsize=10)
    fig.tight_layout()
    return fig


def write_plan_plot(plan: Plan, path: str, sweep: Sequence[Plan] = (), fmt: str = "png") -> None:
    """Draw the plan's figure into `path` as `fmt` (a format matplotlib writes: png, svg, pdf ...)."""
    fig = plan_figure(plan, sweep)
    try:
        fig.savefig(path, dpi=110, format=fmt)
    finally:
        pyplot().close(fig)


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend; `HiSparseError` (one line) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise HiSparseError(f"--plot needs matplotlib: pip install 'hisparse[plot]' ({exc})") from None
    return plt
