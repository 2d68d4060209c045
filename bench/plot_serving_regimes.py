"""The results page's serving plot: decode throughput against batch under both locality regimes.

Reads the `--json` files of `bench_serving.py` runs, or their stdout (a JSON row a line, which a
run cut short still leaves); each run's rows carry the `topk` it took:
`benign`, `code` or `indexer`. Draws, per context, tokens/s against batch for hisparse and
all-resident under each regime (top row) and hisparse's step as a ratio to all-resident's at the
same batch (bottom row: the offloading cost, with the issue's 1.05x and 1.15x targets). Prints
the figures it plotted as a table, so the page's numbers and the plot come from one read, and,
where a run with `--skip-indexer` sits beside one without, the indexer's share of the step.

Run:  python bench/plot_serving_regimes.py benign.json code.json --png docs/figures/serving_regimes.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

STYLE = {"benign": "-", "code": "--", "indexer": ":"}
COLOR = {"hisparse": "tab:blue", "all-resident": "tab:orange"}
TARGET = {"benign": 1.05, "code": 1.15}


#: What every row drawn must carry (bench_serving.py's rows do).
NEEDED = ("mode", "context", "batch", "step_ms")


def load(paths: list[str]) -> list[dict[str, Any]]:
    """The hisparse and all-resident rows of bench_serving.py's files; ValueError naming the file
    and the row where one is not such a file."""
    rows: list[dict[str, Any]] = []
    for p in paths:
        text = Path(p).read_text()
        try:
            data = json.loads(text)
        except ValueError:   # bench_serving.py's stdout: one JSON row a line as it goes (a cut-short run's)
            data = []
            for n, line in enumerate(text.splitlines(), 1):
                if line.startswith("{"):
                    try:
                        data.append(json.loads(line))
                    except ValueError as exc:
                        raise ValueError(f"{p}: line {n} is not JSON ({exc}); expected the JSON list "
                                         "bench_serving.py --json writes, or its stdout") from None
        if not isinstance(data, list):
            raise ValueError(f"{p}: a JSON {'object' if isinstance(data, dict) else type(data).__name__}; "
                             "expected the JSON list bench_serving.py --json writes, or its stdout")
        for n, r in enumerate(data, 1):
            if not isinstance(r, dict):
                raise ValueError(f"{p}: row {n} is {json.dumps(r)[:40]}; expected an object of bench_serving.py")
            if r.get("step_ms") and r.get("mode") in COLOR:
                if missing := [k for k in NEEDED if k not in r]:
                    raise ValueError(f"{p}: row {n} has no {', '.join(sorted(missing))}; expected the fields of "
                                     "bench_serving.py's rows")
                rows.append(r)
    if not rows:
        raise ValueError(f"no hisparse or all-resident rows with a step time in {paths}")
    return rows


def style(reg: str) -> str:
    return STYLE.get(reg.split("-")[0], "-.")


def marker(reg: str) -> str:
    return "s" if reg.endswith("-no-indexer") else "o"


def ctx(t: int) -> str:
    return f"{t // 1024}K" if t >= 1024 else str(t)


def tok_s(r: dict[str, Any]) -> float:
    return 1e3 * r["batch"] / r["step_ms"]


FIELDS = ("step_ms", "hit_rate", "h2d_mb_per_step", "host_critical_ms", "gpu_ms")


def fragment(rows: list[dict[str, Any]], source: str, command: str) -> dict[str, Any]:
    """results.json's `serving_locality` datasets (its schema: per regime, per mode, lists by batch)
    from the plain regimes' rows (no resident layers, with the indexer) within the fixed budget."""
    out: dict[str, Any] = {}
    for t in sorted({r["context"] for r in rows}, reverse=True):
        key = ("serving_locality" if t == 131072 else f"serving_locality_{t // 1024}k" if t >= 1024
               else f"serving_locality_{t}")
        regimes: dict[str, Any] = {}
        for reg in ("benign", "code"):
            modes: dict[str, Any] = {}
            for mode in COLOR:
                mine = sorted((r for r in rows if r["context"] == t and r.get("topk") == reg and r["mode"] == mode
                               and r.get("within_budget", True)), key=lambda r: r["batch"])
                if mine:
                    modes[mode] = {"batch": [r["batch"] for r in mine],
                                   "tokens_per_s": [round(tok_s(r), 1) for r in mine],
                                   **{f: [round(r[f], 3) if f == "hit_rate" else round(r[f], 2) for r in mine]
                                      for f in FIELDS if all(f in r for r in mine)}}
            if len(modes) == len(COLOR):
                regimes[reg] = modes
        if len(regimes) == 2:
            out[key] = {"source": source, "command": command, "context": t, "regimes": regimes}
    return out


def main(argv: list[str] | None = None) -> int:
    from hisparse_core.cli.options import CliParser

    # One line a value argparse refuses (the stock parser printed its usage first).
    ap = CliParser(prog="plot_serving_regimes", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+")
    ap.add_argument("--png", default="serving_regimes.png")
    ap.add_argument("--results-fragment", default="",
                    help="also write docs/figures/results.json's serving_locality datasets from these rows (one per "
                         "context: serving_locality at 128K, serving_locality_32k at 32K; the regimes' rows within "
                         "the fixed budget), to paste in with their source and command (--source, --command)")
    ap.add_argument("--source", default="", help="the fragment's `source` (where the run is recorded)")
    ap.add_argument("--command", default="", help="the fragment's `command` (the GPU command that measured it)")
    a = ap.parse_args(argv)
    try:
        rows = load(a.json)
    except (OSError, ValueError) as exc:
        print(f"plot_serving_regimes: {exc}", file=sys.stderr)
        return 2
    from hisparse_core.cli.options import check_output_path, check_plot_path

    # Before the table: a plot or fragment that cannot be written would end the run after it.
    if why := check_plot_path(a.png, "--png") or (
            a.results_fragment and check_output_path("--results-fragment", a.results_fragment)):
        print(f"plot_serving_regimes: {why}", file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in rows})
    # every top-k source in the files, in the order first met (`code-no-indexer`: --skip-indexer)
    regimes = list(dict.fromkeys(r.get("topk", "indexer") for r in rows))
    fig, axes = plt.subplots(2, len(contexts), figsize=(6 * len(contexts), 8), squeeze=False, sharex="col")
    print("| context | regime | batch | hisparse tok/s | all-resident tok/s | step ratio | hits | H2D MB/step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for col, t in enumerate(contexts):
        top, bottom = axes[0][col], axes[1][col]
        for reg in regimes:
            mine = {(r["mode"], r["batch"]): r for r in rows if r["context"] == t and r.get("topk", "indexer") == reg}
            # hisparse with resident layers or the prefetch ('code+resident0', 'code+prefetch') against the
            # same all-resident rows
            base = reg.split("+")[0]
            mine.update({("all-resident", r["batch"]): r for r in rows if r["context"] == t and r["mode"] == "all-resident"
                         and r.get("topk", "indexer") == base and base != reg})
            for mode, color in COLOR.items():
                if mode == "all-resident" and base != reg:
                    continue                     # drawn once, under its own label
                # all-resident beyond the fixed budget (bench_serving --all-resident-gib): hollow markers
                for inside in (True, False):
                    pts = sorted((b, tok_s(r)) for (m, b), r in mine.items()
                                 if m == mode and r.get("within_budget", True) == inside)
                    if pts:
                        top.plot(*zip(*pts, strict=True), style(reg), marker=marker(reg), color=color,
                                 mfc=None if inside else "none",
                                 label=f"{mode}, {reg}" + ("" if inside else " (beyond the budget)"))
            ratio = sorted((b, r["step_ms"] / mine[("all-resident", b)]["step_ms"]) for (m, b), r in mine.items()
                           if m == "hisparse" and ("all-resident", b) in mine)
            if ratio:
                bottom.plot(*zip(*ratio, strict=True), style(reg), marker=marker(reg), color="tab:blue", label=reg)
            if reg in TARGET:
                bottom.axhline(TARGET[reg], ls=style(reg), color="gray", lw=0.8)
            for b in sorted({b for (_, b) in mine}):
                h, res = mine.get(("hisparse", b)), mine.get(("all-resident", b))
                cells = [f"{tok_s(h):.1f}" if h else "-", f"{tok_s(res):.1f}" if res else "-",
                         f"{h['step_ms'] / res['step_ms']:.2f}x" if h and res else "-",
                         f"{100 * h['hit_rate']:.0f}%" if h and "hit_rate" in h else "-",
                         f"{h['h2d_mb_per_step']:.1f}" if h and "h2d_mb_per_step" in h else "-"]
                print(f"| {ctx(t)} | {reg} | {b} | " + " | ".join(cells) + " |")
        top.set_title(f"context {ctx(t)}")
        top.set_ylabel("decode tokens/s")
        top.set_xscale("log", base=2)
        top.grid(alpha=0.3)
        top.legend(fontsize=8)
        bottom.set_ylabel("hisparse step / all-resident step")
        bottom.set_xlabel("batch (concurrent requests)")
        bottom.grid(alpha=0.3)
        bottom.legend(fontsize=8)
    # The model's own indexer: a run with it against one without it (--skip-indexer), same regime.
    by = {(r.get("topk", "indexer"), r["mode"], r["context"], r["batch"]): r for r in rows}
    shares = [(t, reg, mode, b, 1.0 - r["step_ms"] / by[(reg, mode, t, b)]["step_ms"])
              for (src, mode, t, b), r in sorted(by.items()) if src.endswith("-no-indexer")
              for reg in [src.removesuffix("-no-indexer")] if (reg, mode, t, b) in by]
    for t, reg, mode, b, share in shares:
        print(f"indexer share of the step, {mode}, {reg}, {ctx(t)}, batch {b}: {share:.0%}")
    # The gain at the fixed budget (best tokens/s over batches within it), with and without the indexer.
    for t in contexts:
        for src in regimes:
            def best(mode: str, t: int = t, src: str = src) -> float:
                return max((tok_s(r) for r in rows if r["context"] == t and r.get("topk", "indexer") == src
                            and r["mode"] == mode and r.get("within_budget", True)), default=float("nan"))

            if src.endswith("-no-indexer") or "+" in src:
                continue
            gain = best("hisparse") / best("all-resident")
            bare = src + "-no-indexer"
            if bare in regimes:
                print(f"gain at the fixed budget, {src}, {ctx(t)}: {gain:.2f}x with the model's indexer, "
                      f"{best('hisparse', t, bare) / best('all-resident', t, bare):.2f}x without it")
    fig.tight_layout()
    fig.savefig(a.png, dpi=120)
    plt.close(fig)
    if a.results_fragment:
        Path(a.results_fragment).write_text(json.dumps(fragment(rows, a.source, a.command), indent=1) + "\n")
        print(f"results fragment: {a.results_fragment}")
    print(f"plot: {a.png}")
    return 0


if __name__ == "__main__":
    from hisparse_core.cli.options import run_script

    raise SystemExit(run_script(main))
