"""`hisparse bench`: a multi-step synthetic decode through one backend's runtimes.

Prints hit rate, misses, rows and bytes copied and time per step (table, or `--json`).
The default is sized for a CPU: about 10-20 s with the reference_cpu backend on 2 cores.
"""

from __future__ import annotations

import argparse
import logging
import sys

from hisparse_core.errors import HiSparseError
from hisparse_core.progress import ProgressBar

logger = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    from hisparse_core.replay.bench import BenchConfig

    d = BenchConfig()
    p = subparsers.add_parser(
        "bench", help="time a synthetic multi-step decode through a backend's runtimes",
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--backend", default=None,
                   help="backend name (default: $HISPARSE_BACKEND, else the highest-priority available)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    p.add_argument("--requests", type=int, default=d.requests, help="concurrent requests (batch rows)")
    p.add_argument("--context", type=int, default=d.context, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=d.steps, help="decode steps")
    p.add_argument("--top-k", type=int, default=d.top_k, help="positions the indexer picks per step")
    p.add_argument("--hot", type=float, default=d.hot_multiple, help="hot buffer, in multiples of top-k")
    p.add_argument("--layers", type=int, default=d.layers, help="sparse-attention layers")
    p.add_argument("--index-share", type=int, default=d.index_share,
                   help="layers per indexer (followers replay the leader's miss plan)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per page")
    p.add_argument("--tail-pages", type=int, default=d.tail_pages, help="newest pages kept resident")
    p.add_argument("--row-format", default=d.row_format, choices=["fp8_ds_mla", "bf16_mla"])
    p.add_argument("--locality", type=float, default=d.locality,
                   help="time scale of top-k drift: 1 = calibrated to published LRU miss rates, >1 more local")
    p.add_argument("--warmup", type=int, default=None,
                   help=f"first steps left out of the steady-state figures (default: {d.warmup}, at most steps-1)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)
    return p


def _table(res: object) -> str:
    from hisparse_core.replay.bench import BenchResult
    from hisparse_core.replay.report import human_bytes, pct, render_table

    assert isinstance(res, BenchResult)
    s, c = res.summary(), res.config
    rows: list[tuple[str, str]] = [
        ("backend", f"{res.backend['name']} {res.backend['version']} on {res.backend['device']}"),
        ("workload", f"{c['requests']} requests x {c['context']} tokens, {c['steps']} steps, top-k {c['top_k']}, "
                     f"hot {c['hot_rows']} rows ({c['hot_multiple']}x), {c['layers']} layers in index groups "
                     f"{c['index_groups']}, {c['row_format']}, locality {c['locality']}"),
    ]
    for label, title in (("all", "all steps"), ("steady", f"steady state (after {c['warmup']} warm-up steps)")):
        part = s[label]
        rows += [
            (title, ""),
            ("hit rate (hot lookups)", pct(part["hit_rate"])),
            ("misses", f"{part['misses']} ({pct(part['miss_rate_per_entry'])} of top-k entries)"),
            ("hits / resident entries", f"{part['hits']} / {part['resident_entries']}"),
            ("rows copied host->device", f"{part['rows_h2d']}"),
            ("bytes host->device", human_bytes(part["bytes_h2d"])),
            ("bytes device->host", human_bytes(part["bytes_d2h"])),
        ]
    rows += [
        ("time", ""),
        ("per step (mean / median / max)",
         f"{s['step_ms_mean']:.2f} / {s['step_ms_median']:.2f} / {s['step_ms_max']:.2f} ms"),
        ("steps per second", f"{s['steps_per_s']:.2f}"),
        ("indexer stand-in per step", f"{s['indexer_ms_mean']:.2f} ms (not in step time)"),
        ("setup / wall", f"{s['setup_s']:.2f} s / {s['wall_s']:.2f} s"),
    ]
    return render_table(rows, "hisparse bench")


def run(args: argparse.Namespace) -> int:
    from hisparse_core.registry import select_backend
    from hisparse_core.replay.bench import BenchConfig, run_bench
    from hisparse_core.replay.report import dumps, pct

    try:
        config = BenchConfig(requests=args.requests, context=args.context, steps=args.steps, top_k=args.top_k,
                             hot_multiple=args.hot, layers=args.layers, index_share=args.index_share,
                             block_size=args.block_size, tail_pages=args.tail_pages, row_format=args.row_format,
                             locality=args.locality, seed=args.seed,
                             warmup=args.warmup if args.warmup is not None else min(4, max(0, args.steps - 1)))
        backend = select_backend(args.backend)
        with ProgressBar(config.steps, "bench", enabled=not args.no_progress) as bar:
            totals = {"hits": 0, "misses": 0}

            def on_step(step: int, sample: object) -> None:
                totals["hits"] += sample.hits  # type: ignore[attr-defined]
                totals["misses"] += sample.misses  # type: ignore[attr-defined]
                looked = totals["hits"] + totals["misses"]
                bar.update(1, note=f"hit {pct(totals['hits'] / looked) if looked else 'n/a'}, "
                                   f"{1e3 * sample.seconds:.0f} ms/step")  # type: ignore[attr-defined]

            result = run_bench(config, backend, on_step=on_step)
    except (HiSparseError, ValueError) as exc:
        print(f"hisparse bench: error: {exc}", file=sys.stderr)
        return 2
    print(dumps(result.to_json()) if args.json else _table(result))
    return 0
