"""`hisparse bench`: a multi-step synthetic decode through one backend's runtimes.

Prints hit rate, misses, rows and bytes copied and time per step (table, or `--json`).
The default is sized for a CPU: a few seconds with the reference_cpu backend on 2 cores.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from hisparse_core.cli.options import (
    MAX_BLOCK_SIZE,
    MAX_HOT,
    MAX_LAYERS,
    MAX_LOCALITY,
    MAX_REQUESTS,
    MAX_SEED,
    MAX_STEPS,
    MAX_TOKENS,
    MAX_TOP_K,
    HeldSelectionLog,
    HelpFormatter,
    check_backend_name,
    fail,
    fail_argument,
    float_in,
    import_torch,
    int_in,
)
from hisparse_core.errors import HiSparseError
from hisparse_core.progress import ProgressBar

logger = logging.getLogger(__name__)


#: `BenchConfig`'s defaults, here so `--help` needs no torch (tests/cli check they agree).
DEFAULTS: dict[str, Any] = {"requests": 4, "context": 16384, "steps": 40, "top_k": 2048, "hot_multiple": 2.0,
                               "layers": 4, "index_share": 2, "block_size": 64, "tail_pages": 2,
                               "row_format": "fp8_ds_mla", "locality": 1.0, "warmup": 4, "seed": 0}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    d = DEFAULTS
    p = subparsers.add_parser(
        "bench", help="time a synthetic decode through one backend: hit rate, copies, ms per step",
        description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--backend", default=None,
                   help="backend name (default: $HISPARSE_BACKEND, else the highest-priority available; "
                        "see hisparse backends)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    w = p.add_argument_group("workload")
    w.add_argument("--requests", type=int_in(1, MAX_REQUESTS), default=d["requests"], metavar="N",
                   help=f"concurrent requests, batch rows (default: {d['requests']}; at most {MAX_REQUESTS})")
    w.add_argument("--context", type=int_in(1, MAX_TOKENS), default=d["context"], metavar="TOKENS",
                   help=f"prompt tokens per request (default: {d['context']}; at most {MAX_TOKENS})")
    w.add_argument("--steps", type=int_in(1, MAX_STEPS), default=d["steps"], metavar="N",
                   help=f"decode steps (default: {d['steps']})")
    w.add_argument("--warmup", type=int_in(0, MAX_STEPS - 1), default=None, metavar="N",
                   help=f"first steps left out of the steady-state figures (default: {d['warmup']}, "
                        "at most steps-1)")
    w.add_argument("--locality", type=float_in(0.0, MAX_LOCALITY, lo_open=True), default=d["locality"],
                   metavar="X", help="time scale of top-k drift: 1 = calibrated to published LRU miss rates, "
                                     f">1 more local (default: {d['locality']:g}; in (0, {MAX_LOCALITY:g}])")
    w.add_argument("--seed", type=int_in(0, MAX_SEED), default=d["seed"], metavar="N",
                   help=f"seed of the synthetic indexer and the KV contents (default: {d['seed']})")
    m = p.add_argument_group("model and cache")
    m.add_argument("--top-k", type=int_in(1, MAX_TOP_K), default=d["top_k"], metavar="K",
                   help=f"positions the indexer picks per step (default: {d['top_k']})")
    m.add_argument("--hot", type=float_in(1.0, MAX_HOT, what="a multiple of top-k"), default=d["hot_multiple"],
                   metavar="X",
                   help=f"hot buffer, in multiples of top-k (default: {d['hot_multiple']:g}; in [1, {MAX_HOT:g}])")
    m.add_argument("--layers", type=int_in(1, MAX_LAYERS), default=d["layers"], metavar="N",
                   help=f"sparse-attention layers (default: {d['layers']})")
    m.add_argument("--index-share", type=int_in(1, MAX_LAYERS), default=d["index_share"], metavar="N",
                   help=f"layers per indexer; followers replay the leader's miss plan (default: {d['index_share']})")
    m.add_argument("--block-size", type=int_in(1, MAX_BLOCK_SIZE), default=d["block_size"], metavar="TOKENS",
                   help=f"tokens per page (default: {d['block_size']})")
    m.add_argument("--tail-pages", type=int_in(1, MAX_TOKENS), default=d["tail_pages"], metavar="N",
                   help=f"newest pages kept resident (default: {d['tail_pages']})")
    m.add_argument("--row-format", default=d["row_format"], choices=["fp8_ds_mla", "bf16_mla"],
                   help=f"KV row layout (default: {d['row_format']})")
    p.set_defaults(func=run)
    return p


def _table(res: object) -> str:
    from hisparse_core.replay.bench import BenchResult
    from hisparse_core.replay.report import counted, hit_rate, hot_buffer, human_bytes, pct, render_table

    assert isinstance(res, BenchResult)
    s: dict[str, Any] = res.summary()
    c = res.config
    rows: list[tuple[str, str]] = [
        ("backend", f"{res.backend['name']} {res.backend['version']} on {res.backend['device']}"),
        ("workload", f"{counted(c['requests'], 'request')} x {c['context']} tokens, {counted(c['steps'], 'step')}, "  # type: ignore[arg-type]
                     f"top-k {c['top_k']}, "
                     f"{hot_buffer(c['hot_rows'], c['top_k'], c['hot_multiple'], c['block_size'])}, "  # type: ignore[arg-type]
                     f"{counted(c['layers'], 'layer')} in index groups "  # type: ignore[arg-type]
                     f"{c['index_groups']}, {c['row_format']}, locality {c['locality']}"),
    ]
    for label, title in (("all", "all steps"), ("steady", f"steady state (after {c['warmup']} warm-up steps)")):
        part = s[label]
        rows += [
            (title, ""),
            ("hit rate (hot lookups)", hit_rate(part["hit_rate"], part["hits"] + part["misses"])),
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
    if args.warmup is not None and args.warmup >= args.steps:
        return fail_argument("hisparse bench", "--warmup", f"expected an integer in [0, --steps - 1 = "
                                                           f"{args.steps - 1}], got {args.warmup}")
    if why := check_backend_name(args.backend) or import_torch("hisparse bench"):
        return fail("hisparse bench", why)
    from hisparse_core.registry import select_backend
    from hisparse_core.replay.bench import BenchConfig, run_bench
    from hisparse_core.replay.report import dumps, pct

    totals = {"hits": 0, "misses": 0, "steps": 0}
    # The registry's "backend selected" line waits for the memory checks, which need the
    # backend's device: a refused value is the only line on stderr.
    held = HeldSelectionLog()
    try:
        config = BenchConfig(requests=args.requests, context=args.context, steps=args.steps, top_k=args.top_k,
                             hot_multiple=args.hot, layers=args.layers, index_share=args.index_share,
                             block_size=args.block_size, tail_pages=args.tail_pages, row_format=args.row_format,
                             locality=args.locality, seed=args.seed,
                             warmup=args.warmup if args.warmup is not None else min(4, max(0, args.steps - 1)))
        backend = select_backend(args.backend)
        with ProgressBar(config.steps, "bench", enabled=not args.no_progress) as bar:

            def on_step(step: int, sample: object) -> None:
                totals["steps"] += 1
                totals["hits"] += sample.hits  # type: ignore[attr-defined]
                totals["misses"] += sample.misses  # type: ignore[attr-defined]
                looked = totals["hits"] + totals["misses"]
                bar.update(1, note=f"hit {pct(totals['hits'] / looked) if looked else 'n/a'}, "
                                   f"{1e3 * sample.seconds:.0f} ms/step")  # type: ignore[attr-defined]

            result = run_bench(config, backend, on_step=on_step, on_checked=held.release)
    except KeyboardInterrupt:
        held.release()
        print(f"hisparse bench: interrupted at step {totals['steps']} of {args.steps}", file=sys.stderr)
        return 130
    except (HiSparseError, ValueError) as exc:
        held.drop()  # refused before any work: the error line alone
        return fail("hisparse bench", str(exc))
    finally:
        held.release()  # whatever else ended the bench (idempotent)
    print(dumps(result.to_json()) if args.json else _table(result))
    return 0
