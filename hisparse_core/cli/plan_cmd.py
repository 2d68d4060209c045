"""`hisparse plan`: steady-state concurrency with and without hisparse, host pool needed, and
PCIe traffic per decode step, from a model's geometry and the memory at hand.

Built-in geometries: deepseek-v3.2, glm-5.1, glm-5.2 (override any field by flag), or
`--model custom` with every geometry flag given. The arithmetic is in `hisparse_core.planner`;
`hisparse run` admits requests by the same rules and measures the same numbers.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from hisparse_core.errors import HiSparseError


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    from hisparse_core.planner import DEFAULT_TAIL_PAGES, MODELS

    p = subparsers.add_parser("plan", help="capacity planner: concurrency, host pool and PCIe traffic",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="deepseek-v3.2", choices=[*MODELS, "custom"],
                   help="built-in geometry (default: deepseek-v3.2)")
    g = p.add_argument_group("geometry overrides (required with --model custom)")
    g.add_argument("--layers", type=int, help="sparse-MLA layers")
    g.add_argument("--row-bytes", type=int, help="bytes per token per layer (656 fp8_ds_mla, 1152 bf16)")
    g.add_argument("--indexer-bytes", type=int, help="indexer key bytes per token per indexer layer")
    g.add_argument("--top-k", type=int, help="positions the indexer picks")
    g.add_argument("--block-size", type=int, help="tokens per page")
    g.add_argument("--index-share", type=int, help="layers per indexer")
    p.add_argument("--gpu-kv", default="40GiB", help="GPU memory for KV (default: 40GiB)")
    p.add_argument("--host", default="256GiB", help="host memory for the hisparse pool (default: 256GiB)")
    p.add_argument("--context", type=int, default=131072, help="tokens per request (default: 131072)")
    p.add_argument("--hot", type=float, default=2.0, help="hot buffer in multiples of top-k (default: 2)")
    p.add_argument("--miss-rate", type=float, default=None,
                   help="misses per looked-up entry (default: the published LRU figure for --hot)")
    p.add_argument("--tail-pages", type=int, default=DEFAULT_TAIL_PAGES,
                   help=f"newest pages kept resident (default: {DEFAULT_TAIL_PAGES})")
    p.add_argument("--pcie-gbps", type=float, default=50.0,
                   help="host-to-device bandwidth for the time estimate, GB/s (default: 50)")
    p.add_argument("--sweep", type=str, default=None, metavar="CTX,CTX,...",
                   help="also print concurrency for these context lengths (e.g. 8192,32768,131072)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)
    return p


def geometry_from_args(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from hisparse_core.errors import InvalidInputError
    from hisparse_core.planner import MODELS, ModelGeometry

    fields = {"num_layers": args.layers, "row_bytes": args.row_bytes, "indexer_bytes": args.indexer_bytes,
              "top_k": args.top_k, "block_size": args.block_size, "index_share": args.index_share}
    given = {k: v for k, v in fields.items() if v is not None}
    if args.model == "custom":
        missing = [k for k, v in fields.items() if v is None]
        if missing:
            flags = ", ".join("--" + ("layers" if k == "num_layers" else k.replace("_", "-")) for k in missing)
            raise InvalidInputError(f"--model custom needs every geometry flag; missing {flags}")
        return ModelGeometry("custom", **given)  # type: ignore[arg-type]
    base = MODELS[args.model]
    return replace(base, name=base.name + (" (modified)" if given else ""), **given) if given else base


def plan_from_args(args: argparse.Namespace, context: int | None = None):  # type: ignore[no-untyped-def]
    from hisparse_core.planner import PlanInputs, make_plan, parse_bytes, published_miss_rate
    from hisparse_core.replay.layout import hot_rows_for

    geo = geometry_from_args(args)
    miss = args.miss_rate if args.miss_rate is not None else published_miss_rate(args.hot)
    return make_plan(PlanInputs(geo, parse_bytes(args.gpu_kv), parse_bytes(args.host),
                                context if context is not None else args.context,
                                hot_rows_for(geo.top_k, args.hot, geo.block_size), miss, args.tail_pages,
                                args.pcie_gbps))


def _table(plan, miss_source: str) -> str:  # type: ignore[no-untyped-def]
    from hisparse_core.replay.report import human_bytes, pct, render_table

    i, g = plan.inputs, plan.inputs.geometry
    rows = [
        ("model", f"{g.name}: {g.num_layers} layers x {g.row_bytes} B rows, indexer {g.indexer_bytes} B x "
                  f"{g.index_layers} layers (1 per {g.index_share}), top-k {g.top_k}, block {g.block_size}"),
        ("memory", f"GPU KV {human_bytes(i.gpu_kv_bytes)} = {plan.gpu_blocks} blocks of "
                   f"{human_bytes(plan.block_bytes)}; host {human_bytes(i.host_bytes)} = {plan.host_blocks} blocks"),
        ("request", f"{i.context} tokens = {plan.pages_per_request} pages; hot buffer {i.hot_rows} rows "
                    f"({i.hot_rows / g.top_k:.2f}x top-k); {i.tail_pages} resident tail pages"),
        ("GPU KV per request", ""),
        ("all resident (no hisparse)",
         f"{human_bytes(plan.baseline_blocks_per_request * plan.block_bytes)} "
         f"({plan.pages_per_request} pages + {plan.indexer_blocks_per_request} indexer blocks)"),
        ("hisparse steady state",
         f"{human_bytes(plan.steady_blocks_per_request * plan.block_bytes)} "
         + (f"(all resident: {i.context} tokens fit the {i.hot_rows}-row hot buffer)" if plan.stays_resident else
            f"({plan.indexer_blocks_per_request} indexer + {plan.hot_blocks_per_request} hot + "
            f"{min(i.tail_pages, plan.pages_per_request)} tail blocks)")),
        ("one admission kept free", f"{human_bytes(plan.admission_blocks * plan.block_bytes)} "
                                    f"({plan.admission_blocks} blocks)"),
        ("steady-state concurrency", ""),
        ("without hisparse", f"{plan.baseline_concurrency}"),
        ("with hisparse", f"{plan.hisparse_concurrency} (GPU allows {plan.gpu_concurrency}, host pool "
                          f"{plan.host_concurrency}; bound by {plan.bound_by})"
                          + (f", {plan.gain:.2f}x" if plan.baseline_concurrency else "")),
        ("host pool needed", f"{human_bytes(plan.host_pool_bytes_needed)} for the GPU's "
                             f"{plan.gpu_concurrency} requests (+1 null block)"),
        ("PCIe per decode step", ""),
        ("miss rate", f"{pct(plan.miss_rate)} (requests stay resident; {pct(i.miss_rate)} {miss_source} "
                      f"applies past {i.hot_rows} tokens)" if plan.stays_resident
         else f"{pct(i.miss_rate)} ({miss_source})"),
        ("per request", f"{human_bytes(plan.h2d_bytes_per_request_step)} host->device, "
                        f"{human_bytes(plan.d2h_bytes_per_request_step)} device->host"),
        (f"at {plan.hisparse_concurrency} requests",
         f"{human_bytes(plan.h2d_bytes_per_step)} host->device ({plan.pcie_ms_per_step:.2f} ms at "
         f"{i.pcie_gbps:g} GB/s), {human_bytes(plan.d2h_bytes_per_step)} device->host"),
    ]
    return render_table(rows, "hisparse plan")


def run(args: argparse.Namespace) -> int:
    from hisparse_core.replay.report import dumps, render_grid

    try:
        plan = plan_from_args(args)
        sweep = []
        if args.sweep:
            try:
                contexts = [int(x) for x in args.sweep.split(",") if x.strip()]
            except ValueError:
                raise HiSparseError(f"--sweep expects comma-separated token counts, got {args.sweep!r}") from None
            sweep = [plan_from_args(args, ctx) for ctx in contexts]
    except (HiSparseError, ValueError) as exc:
        print(f"hisparse plan: error: {exc}", file=sys.stderr)
        return 2
    source = "given" if args.miss_rate is not None else f"published LRU figure at {args.hot:g}x top-k"
    if args.json:
        doc = plan.to_dict()
        doc["miss_rate_source"] = source
        if sweep:
            doc["sweep"] = [{"context": s.inputs.context, "baseline_concurrency": s.baseline_concurrency,
                             "hisparse_concurrency": s.hisparse_concurrency, "stays_resident": s.stays_resident}
                           for s in sweep]
        print(dumps(doc))
        return 0
    print(_table(plan, source))
    if sweep:
        print()
        print(render_grid(["context", "without hisparse", "with hisparse", "bound by"],
                          [[str(s.inputs.context), str(s.baseline_concurrency), str(s.hisparse_concurrency),
                            s.bound_by + (", all resident" if s.stays_resident else "")] for s in sweep]))
    return 0
