"""The plots of docs/results.md, drawn from docs/figures/results.json (figures copied from the GPU
run log, docs/gpu-validation.md; each dataset there names its call and command). Nothing is
measured here: rerun this after editing the data file.

Run:  python bench/plot_results.py [--data docs/figures/results.json] [--out docs/figures]
Needs matplotlib (`pip install -e '.[plot]'`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "figures" / "results.json"

#: One file per plot; docs/results.md links each by this name.
PLOTS = ("swap_in_vs_copy.png", "no_miss_steps.png", "serving.png", "serving_locality.png", "transformers_step.png")

#: The datasets of results.json the plots read (`serving_locality_32k` is drawn where it is present).
DATASETS = ("miss_steps", "no_miss_steps", "serving", "serving_locality", "transformers_step")


def mean(samples: list[float]) -> float:
    return statistics.fmean(samples)


def swap_in_vs_copy(ax: Any, data: dict[str, Any]) -> None:
    cells = data["miss_steps"]["cells"]
    markers = iter("osD^vP*")
    for batch in sorted({c["batch"] for c in cells}):
        row = sorted((c["misses"], c["x_copy"]) for c in cells if c["batch"] == batch)
        ax.plot([m for m, _ in row], [x for _, x in row], marker=next(markers), markersize=7 if len(row) > 1 else 10,
                linestyle="-" if len(row) > 1 else "none", markerfacecolor="none" if len(row) == 1 else None,
                label=f"batch {batch}" + (" (274 misses only)" if len(row) == 1 else ""))
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="the copy alone (1.0)")
    ax.set_xscale("log")
    misses = sorted({c["misses"] for c in cells})
    ax.set_xticks(misses, [str(m) for m in misses])
    ax.minorticks_off()
    ax.set_ylim(0.8, None)
    ax.set_xlabel("misses per request and step (top-k 2048)")
    ax.set_ylabel("swap-in time / contiguous copy of the same bytes")
    ax.set_title("nvidia backend, H200: a step with misses against the copy engine")
    ax.legend(loc="upper right", fontsize=8)


def no_miss_steps(axes: Any, data: dict[str, Any]) -> None:
    d = data["no_miss_steps"]
    batches = d["batches"]
    width = 0.27
    for ax, kind, title in ((axes[0], "resident", "every page resident"), (axes[1], "hits", "hot-buffer hits")):
        series = [("hisparse (resolve + copy)", [mean(s) for s in d[kind]["hisparse"]]),
                  ("resolve alone, same run", d[kind]["resolve_alone"]),
                  ("vLLM (separate run)", d[kind]["vllm"])]
        for i, (label, values) in enumerate(series):
            xs = [j + (i - 1) * width for j, v in enumerate(values) if v is not None]
            ax.bar(xs, [v for v in values if v is not None], width, label=label)
            for j, v in enumerate(values):
                if v is None:
                    ax.text(j + (i - 1) * width, 0.1, "not\nmeasured", ha="center", va="bottom", fontsize=6,
                            rotation=90)
        ax.set_xticks(range(len(batches)), [str(b) for b in batches])
        ax.set_xlabel("batch (requests)")
        ax.set_title(f"a step without misses: {title}", fontsize=10)
    axes[0].set_ylabel("us per layer-step")
    axes[0].legend(loc="upper left", fontsize=8, framealpha=1.0)
    axes[0].set_ylim(0, 9.5)


def tokens_by_batch(ax: Any, series: Any, title: str, legend: str, context_k: int = 128) -> None:
    """The axes of a decode tokens/s against batch plot, ticks at every batch of `series` (a batch
    within 15% of the previous tick is left unlabelled, so labels do not overlap)."""
    ax.set_xscale("log", base=2)
    batches = sorted({b for m in series for b in m["batch"]})
    labels, last = [], 0.0
    for b in batches:
        labels.append(str(b) if not last or b >= 1.15 * last else "")
        last = b if labels[-1] else last
    ax.set_xticks(batches, labels)
    ax.minorticks_off()
    ax.set_xlabel(f"batch (concurrent {context_k}K-token requests)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(title)
    ax.legend(loc=legend, fontsize=8)


def serving(ax: Any, data: dict[str, Any]) -> None:
    modes = data["serving"]["modes"]
    for name, m in modes.items():
        ax.plot(m["batch"], m["tokens_per_s"], marker="o", label=f"{name} (largest batch {max(m['batch'])})")
    ax.set_yscale("log")
    tokens_by_batch(ax, modes.values(), "H200, 3 GiB of GPU KV, 4 layers of DeepSeek-V3.2 attention", "center right")


def serving_locality(ax: Any, data: dict[str, Any], key: str = "serving_locality") -> None:
    """Tokens/s against batch under both regimes; a dataset with a `context` says it in the title
    (`serving_locality_32k`: the same plot at 32K, drawn where results.json has it)."""
    dataset = data[key]
    regimes = dataset["regimes"]
    for (regime, modes), color in zip(regimes.items(), ("tab:blue", "tab:red"), strict=True):
        for mode, style in (("hisparse", "-"), ("all-resident", "--")):
            m = modes[mode]
            within = m.get("within_budget", [True] * len(m["batch"]))
            inside = [(b, t) for b, t, w in zip(m["batch"], m["tokens_per_s"], within, strict=True) if w]
            beyond = [(b, t) for b, t, w in zip(m["batch"], m["tokens_per_s"], within, strict=True) if not w]
            ax.plot([b for b, _ in inside], [t for _, t in inside], marker="o", linestyle=style, color=color,
                    label=f"{mode}, {regime} (largest batch at the budget {max(b for b, _ in inside)})")
            if beyond:  # the same engine under a larger budget: the offloading cost at hisparse's batches
                ax.plot([inside[-1][0]] + [b for b, _ in beyond], [inside[-1][1]] + [t for _, t in beyond],
                        marker="o", markerfacecolor="none", linestyle=":", color=color,
                        label=f"{mode}, {regime}, beyond the budget")
    context_k = dataset.get("context", 131072) // 1024
    tokens_by_batch(ax, [m for modes in regimes.values() for m in modes.values()],
                    f"H200, {context_k}K tokens, 3 GiB of GPU KV, top-k from the locality model", "upper left",
                    context_k)


def serving_locality_32k(ax: Any, data: dict[str, Any]) -> None:
    serving_locality(ax, data, "serving_locality_32k")


def transformers_step(ax: Any, data: dict[str, Any]) -> None:
    cells = data["transformers_step"]["cells"]
    labels = [f"batch {c['batch']}\n{c['context'] // 1024}K" for c in cells]
    width = 0.38
    xs = range(len(cells))
    ax.bar([x - width / 2 for x in xs], [c["hisparse_ms"] for c in cells], width, label="hisparse (CUDA graph)")
    tf = [(x, c["transformers_ms"]) for x, c in zip(xs, cells, strict=True)]
    ax.bar([x + width / 2 for x, v in tf if v is not None], [v for _, v in tf if v is not None], width,
           label="transformers alone")
    for x, v in tf:
        if v is None:
            ax.text(x + width / 2, 1.0, "out of\nmemory", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("ms per decode step")
    ax.set_title("H200, 4 layers of DeepSeek-V3.2 attention")
    ax.legend(loc="upper left", fontsize=8)


def draw(data: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    jobs: list[tuple[str, tuple[int, int], Callable[[Any, dict[str, Any]], None]]] = [
        ("swap_in_vs_copy.png", (1, 1), swap_in_vs_copy),
        ("no_miss_steps.png", (1, 2), no_miss_steps),
        ("serving.png", (1, 1), serving),
        ("serving_locality.png", (1, 1), serving_locality),
        ("transformers_step.png", (1, 1), transformers_step),
    ]
    if "serving_locality_32k" in data:     # issue 42's 32K runs, once results.json holds them
        jobs.append(("serving_locality_32k.png", (1, 1), serving_locality_32k))
    written = []
    for name, (rows, cols), plot in jobs:
        fig, ax = plt.subplots(rows, cols, figsize=(4.6 * cols + 2.2 * (cols == 1), 4.2), squeeze=True)
        plot(ax, data)
        fig.tight_layout()
        path = out / name
        # No software version in the file, so that redrawing the same data changes no byte.
        fig.savefig(path, dpi=110, metadata={"Software": None})
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    from hisparse_core.cli.options import unwritable

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Strings, not Paths: Path('') is '.', so `--out ""` (an unset variable) wrote the PNGs into the
    # current folder and `--data ""` was reported as the folder '.'.
    ap.add_argument("--data", default=str(DATA), help=f"the figures (default: {DATA.relative_to(ROOT)})")
    ap.add_argument("--out", default=str(DATA.parent), help="folder for the PNGs (default: the data's)")
    args = ap.parse_args(argv)
    for flag, value in (("--data", args.data), ("--out", args.out)):
        if not value:
            print(f"plot_results: error: {flag} '': expected a {'file' if flag == '--data' else 'folder'} name",
                  file=sys.stderr)
            return 2
    args.data, args.out = Path(args.data), Path(args.out)
    if not args.out.is_dir():
        print(f"plot_results: error: --out {args.out}: no such folder; expected an existing folder", file=sys.stderr)
        return 2
    if why := unwritable(str(args.out)):  # savefig failed after the drawing (/proc, say)
        print(f"plot_results: error: --out {args.out}: the folder is {why}; expected a folder the PNGs can be "
              "written to", file=sys.stderr)
        return 2
    try:
        data = json.loads(args.data.read_text())
    except (OSError, ValueError) as e:
        print(f"plot_results: error: --data {args.data}: {e}; expected the JSON of docs/figures/results.json",
              file=sys.stderr)
        return 2
    missing = [k for k in DATASETS if k not in data] if isinstance(data, dict) else list(DATASETS)
    if missing:  # another JSON (a `hisparse run --json` document): said before matplotlib is loaded
        print(f"plot_results: error: --data {args.data}: no {', '.join(missing)} dataset{'s' * (len(missing) > 1)}; "
              "expected the JSON of docs/figures/results.json", file=sys.stderr)
        return 2
    for path in draw(data, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    from hisparse_core.cli.options import run_script

    raise SystemExit(run_script(main))
