"""`hisparse plan`: steady-state concurrency with and without hisparse, host pool needed, and
PCIe traffic per decode step, from a model's geometry and the memory at hand.

A built-in model (listed below; override any field by flag), or `--model custom` with every
geometry flag given. The arithmetic is in `hisparse_core.planner`;
`hisparse run` admits requests by the same rules and measures the same numbers.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import replace

from hisparse_core.cli.options import (
    MAX_BLOCK_SIZE,
    MAX_HOT,
    MAX_LAYERS,
    MAX_TOKENS,
    MAX_TOP_K,
    SIZE_UNITS,
    HelpFormatter,
    check_plot_path,
    fail,
    float_in,
    int_in,
    plot_format,
    size_in,
)
from hisparse_core.errors import HiSparseError

logger = logging.getLogger(__name__)


def _indexers(index_share: int) -> str:
    """How the layers share indexers, in words (`index_share` layers per indexer)."""
    return "one indexer per layer" if index_share == 1 else f"one indexer per {index_share} layers"


def _model_values(field: str) -> str:
    from hisparse_core.planner import MODELS

    return "; built-in: " + ", ".join(f"{name} {getattr(geo, field)}" for name, geo in MODELS.items())


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    from hisparse_core.planner import DEFAULT_TAIL_PAGES, MODELS, aliases_text, model_name

    models = "\n".join(f"  {name:14} {g.num_layers} layers, {g.row_bytes} B rows, indexer {g.indexer_bytes} B, "
                       f"top-k {g.top_k}, block {g.block_size}, {_indexers(g.index_share)}"
                       for name, g in MODELS.items())
    p = subparsers.add_parser("plan", help="capacity planner: concurrent requests with and without hisparse, "
                                           "host pool, PCIe traffic",
                              description=f"{__doc__}\nBuilt-in models:\n{models}\n", formatter_class=HelpFormatter)
    p.add_argument("--model", default="deepseek-v3.2", choices=[*MODELS, "custom"], type=model_name,
                   help=f"built-in geometry (default: deepseek-v3.2; values above); transformers' model types are "
                        f"aliases: {aliases_text()}")
    g = p.add_argument_group("geometry overrides (required with --model custom)")
    g.add_argument("--layers", type=int_in(1, MAX_LAYERS), metavar="N",
                   help="sparse-MLA layers" + _model_values("num_layers"))
    g.add_argument("--row-bytes", type=int_in(1, 1 << 20), metavar="BYTES",
                   help="bytes per token per layer (656 fp8_ds_mla, 1152 bf16)" + _model_values("row_bytes"))
    g.add_argument("--indexer-bytes", type=int_in(0, 1 << 16), metavar="BYTES",
                   help="indexer key bytes per token per indexer layer" + _model_values("indexer_bytes"))
    g.add_argument("--top-k", type=int_in(1, MAX_TOP_K), metavar="K",
                   help="positions the indexer picks" + _model_values("top_k"))
    g.add_argument("--block-size", type=int_in(1, MAX_BLOCK_SIZE), metavar="TOKENS",
                   help="tokens per page" + _model_values("block_size"))
    g.add_argument("--index-share", type=int_in(1, MAX_LAYERS), metavar="N",
                   help="layers per indexer" + _model_values("index_share"))
    p.add_argument("--gpu-kv", type=size_in(1), default="40GiB", metavar="SIZE",
                   help=f"GPU memory for KV (default: 40GiB); units: {SIZE_UNITS}")
    p.add_argument("--host", type=size_in(1), default="256GiB", metavar="SIZE",
                   help="host memory for the hisparse pool (default: 256GiB); same units")
    p.add_argument("--context", type=int_in(1, MAX_TOKENS), default=131072, metavar="TOKENS",
                   help=f"tokens per request (default: 131072; at most {MAX_TOKENS})")
    p.add_argument("--hot", type=float_in(1.0, MAX_HOT, what="a multiple of top-k"), default=2.0, metavar="X",
                   help=f"hot buffer in multiples of top-k, in [1, {MAX_HOT:g}] (default: 2)")
    p.add_argument("--miss-rate", type=float_in(0.0, 1.0), default=None, metavar="FRACTION",
                   help="misses per looked-up entry, in [0, 1] (default: the published LRU figure for the hot "
                        "buffer, --hot in whole blocks)")
    p.add_argument("--tail-pages", type=int_in(1, MAX_TOKENS), default=DEFAULT_TAIL_PAGES, metavar="N",
                   help=f"newest pages kept resident (default: {DEFAULT_TAIL_PAGES})")
    # At least 1 MB/s: a bandwidth such as 5e-324 GB/s made the time per step overflow to `inf ms`.
    p.add_argument("--pcie-gbps", type=float_in(1e-3, 1e4), default=50.0, metavar="GB/S",
                   help="host-to-device bandwidth for the time estimate, GB/s, in [0.001, 10000] (default: 50)")
    p.add_argument("--sweep", type=parse_sweep, default=None, metavar="CTX,CTX,...",
                   help="also print concurrency for these context lengths, tokens with an optional K or M "
                        "(x1024) suffix (e.g. 8K,32K,128K)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw concurrency and GPU KV per request against context length, marking the hot "
                        "buffer (up to it requests stay resident) and the context where hisparse overtakes "
                        "all resident (needs matplotlib: hisparse[plot])")
    p.set_defaults(func=run)
    return p


def parse_sweep(text: str) -> list[int]:
    """'8192,32K,1M' -> token counts; every entry a context `--context` would accept."""
    one = int_in(1, MAX_TOKENS, "a token count")
    out = []
    for item in text.split(","):
        item = item.strip()
        scale = {"k": 1 << 10, "m": 1 << 20}.get(item[-1:].lower(), 1)
        if not item or (scale > 1 and not item[:-1].strip()):
            raise argparse.ArgumentTypeError(f"expected comma-separated token counts such as 8K,32K,128K, "
                                             f"got {text!r}")
        digits = item[:-1] if scale > 1 else item
        try:
            n = int(digits) * scale
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected token counts in [1, {MAX_TOKENS}] (K or M suffix), "
                                             f"got {item!r} in {text!r}") from None
        n = one(str(n))
        if n in out:  # 8K and 8192 are one context: its row would print twice
            raise argparse.ArgumentTypeError(f"expected distinct token counts, got {n} twice ({item!r}) in {text!r}")
        out.append(n)
    return out


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
    from hisparse_core.errors import InvalidInputError
    from hisparse_core.planner import PlanInputs, make_plan, published_miss_rate
    from hisparse_core.replay.layout import hot_rows_for, hot_rows_limit_problem

    geo = geometry_from_args(args)
    if why := hot_rows_limit_problem(geo.top_k, args.hot, geo.block_size):  # no runtime runs that plan
        raise InvalidInputError(why)
    hot_rows = hot_rows_for(geo.top_k, args.hot, geo.block_size)
    # The buffer's own multiple: --hot rounded up to whole blocks holds more rows, and misses less.
    miss = args.miss_rate if args.miss_rate is not None else published_miss_rate(hot_rows / geo.top_k)
    return make_plan(PlanInputs(geo, args.gpu_kv, args.host,
                                context if context is not None else args.context,
                                hot_rows, miss, args.tail_pages, args.pcie_gbps))


def miss_rate_source(args: argparse.Namespace, plan) -> str:  # type: ignore[no-untyped-def]
    """Where the plan's miss rate comes from, in words: given, or the published figure at the hot
    buffer's multiple of top-k (the table's `request` line says where whole blocks made it larger)."""
    if args.miss_rate is not None:
        return "given"
    multiple = plan.inputs.hot_rows / plan.inputs.geometry.top_k
    return f"published LRU figure at {args.hot:g}x top-k" if multiple == args.hot else \
        f"published LRU figure at the hot buffer's {multiple:.2f}x top-k"


def _crossover(plan, crossover: int | None) -> str:  # type: ignore[no-untyped-def]
    """Where hisparse starts to run more requests than all resident, in words."""
    from hisparse_core.planner import no_crossover_reason

    i = plan.inputs
    if crossover is None:
        return f"never up to {MAX_TOKENS} tokens: {no_crossover_reason(i)}"
    return (f"from {crossover} tokens ({-(-crossover // i.geometry.block_size)} pages); up to the {i.hot_rows}-row "
            f"hot buffer and {i.tail_pages} tail pages requests stay resident, past them each holds its hot "
            f"buffer and tail instead of its pages")


def _table(plan, miss_source: str, crossover: int | None, hot: float) -> str:  # type: ignore[no-untyped-def]
    from hisparse_core.planner import resident_context
    from hisparse_core.replay.report import hot_buffer, human_bytes, pct, render_table

    i, g = plan.inputs, plan.inputs.geometry
    rows = [
        ("model", f"{g.name}: {g.num_layers} layers x {g.row_bytes} B rows, indexer {g.indexer_bytes} B x "
                  f"{g.index_layers} layers ({_indexers(g.index_share)}), top-k {g.top_k}, block {g.block_size}"),
        ("memory", f"GPU KV {human_bytes(i.gpu_kv_bytes)} = {plan.gpu_blocks} blocks of "
                   f"{human_bytes(plan.block_bytes)}; host {human_bytes(i.host_bytes)} = {plan.host_blocks} blocks"),
        ("request", f"{i.context} tokens = {plan.pages_per_request} pages; "
                    f"{hot_buffer(i.hot_rows, g.top_k, hot, g.block_size).replace('hot', 'hot buffer', 1)}; "
                    f"{i.tail_pages} resident tail pages"),
        ("GPU KV per request", ""),
        ("all resident (no hisparse)",
         f"{human_bytes(plan.baseline_blocks_per_request * plan.block_bytes)} "
         f"({plan.pages_per_request} pages + {plan.indexer_blocks_per_request} indexer blocks)"),
        ("hisparse steady state",
         f"{human_bytes(plan.steady_blocks_per_request * plan.block_bytes)} "
         + (f"(all resident: {i.context} tokens fit the {i.hot_rows}-row hot buffer and {i.tail_pages} tail pages)"
            if plan.stays_resident else
            f"({plan.indexer_blocks_per_request} indexer + {plan.hot_blocks_per_request} hot + "
            f"{min(i.tail_pages, plan.pages_per_request)} tail blocks)")),
        ("one admission kept free", f"{human_bytes(plan.admission_blocks * plan.block_bytes)} "
                                    f"({plan.admission_blocks} blocks)"),
        ("steady-state concurrency", ""),
        ("without hisparse", f"{plan.baseline_concurrency}"),
        ("with hisparse", f"{plan.hisparse_concurrency} (GPU allows {plan.gpu_concurrency}, host pool "
                          f"{plan.host_concurrency}; bound by {plan.bound_by})"
                          + (f", {plan.gain:.2f}x" if plan.baseline_concurrency else "")),
        ("hisparse runs more", _crossover(plan, crossover)),
        ("host pool needed", f"{human_bytes(plan.host_pool_bytes_needed)} for the GPU's "
                             f"{plan.gpu_concurrency} requests (+1 null block)"),
        ("PCIe per decode step", ""),
        ("miss rate", f"{pct(plan.miss_rate)} (requests stay resident; {pct(i.miss_rate)} {miss_source} "
                      f"applies past {resident_context(i)} tokens)" if plan.stays_resident
         else f"{pct(i.miss_rate)} ({miss_source})"),
        ("per request", f"{human_bytes(plan.h2d_bytes_per_request_step)} host->device, "
                        f"{human_bytes(plan.d2h_bytes_per_request_step)} device->host"),
        (f"at {plan.hisparse_concurrency} requests",
         f"{human_bytes(plan.h2d_bytes_per_step)} host->device ({plan.pcie_ms_per_step:.2f} ms at "
         f"{i.pcie_gbps:g} GB/s), {human_bytes(plan.d2h_bytes_per_step)} device->host"),
    ]
    return render_table(rows, "hisparse plan")


def gpu_budget_problem(plan) -> str | None:  # type: ignore[no-untyped-def]
    """Why `--gpu-kv` holds no request at any context (not even one of 1 token: a page and its
    indexer block), naming the smallest budget that holds one, or None. A budget that holds one
    short request but none of `--context` is a plan (0 at this context, the crossover and
    `--sweep` say where requests fit); one that holds none at all is a typo (1B for 1GiB), and
    its table would only say 0 everywhere."""
    from dataclasses import replace as replace_inputs

    from hisparse_core.planner import make_plan
    from hisparse_core.replay.report import human_bytes
    from hisparse_core.units import ceil_size

    i, g = plan.inputs, plan.inputs.geometry
    one_token = make_plan(replace_inputs(i, context=1))  # all resident: a page and its indexer blocks
    smallest = one_token.baseline_blocks_per_request
    if plan.gpu_blocks >= smallest:
        return None
    blocks = "no block" if not plan.gpu_blocks else f"{plan.gpu_blocks} block{'s' if plan.gpu_blocks > 1 else ''}"
    indexer = one_token.indexer_blocks_per_request
    return (f"--gpu-kv {human_bytes(i.gpu_kv_bytes)} holds {blocks} of {human_bytes(plan.block_bytes)} "
            f"({g.num_layers} layers x {g.block_size} tokens x {g.row_bytes} B), so no request fits at any context; "
            f"expected --gpu-kv >= {ceil_size(smallest * plan.block_bytes)} (one 1-token request: 1 page"
            + (f" + {indexer} indexer block{'s' if indexer > 1 else ''}" if indexer else "")
            + f"), >= {ceil_size(plan.admission_blocks * plan.block_bytes)} for one request of --context "
              f"{i.context} with hisparse")


def host_budget_problem(plan) -> str | None:  # type: ignore[no-untyped-def]
    """Why `--host` holds no request at any context (not one usable block: block 0 is the null
    block), naming the smallest pool that holds one, or None. As `gpu_budget_problem` says for
    `--gpu-kv`: `--host 1B` for 1GiB is a typo, and its table said 0 with hisparse everywhere."""
    from hisparse_core.replay.report import human_bytes
    from hisparse_core.units import ceil_size

    i, g = plan.inputs, plan.inputs.geometry
    if plan.host_blocks >= 2:
        return None
    blocks = "no block" if not plan.host_blocks else "only the null block"
    return (f"--host {human_bytes(i.host_bytes)} holds {blocks} of {human_bytes(plan.host_block_bytes)} "
            f"({g.num_layers} layers x {g.block_size} tokens x {g.row_bytes} B), so no request fits at any context; "
            f"expected --host >= {ceil_size(2 * plan.host_block_bytes)} (one 1-token request: 1 page + the null "
            f"block), >= {ceil_size((plan.pages_per_request + 1) * plan.host_block_bytes)} for one request of "
            f"--context {i.context}")


def run(args: argparse.Namespace) -> int:
    from hisparse_core.planner import crossover_context
    from hisparse_core.replay.report import dumps, render_grid

    if args.plot is not None and (why := check_plot_path(args.plot)):
        return fail("hisparse plan", why)
    try:
        plan = plan_from_args(args)
        if why := gpu_budget_problem(plan) or host_budget_problem(plan):
            return fail("hisparse plan", why)
        sweep = []
        if args.sweep:
            sweep = [plan_from_args(args, ctx) for ctx in args.sweep]
    except (HiSparseError, ValueError) as exc:
        return fail("hisparse plan", str(exc))
    crossover = crossover_context(plan.inputs, up_to=MAX_TOKENS)
    source = miss_rate_source(args, plan)
    if args.json:
        doc = plan.to_dict()
        doc["miss_rate_source"] = source
        doc["crossover_context"] = crossover
        if sweep:
            doc["sweep"] = [{"context": s.inputs.context, "baseline_concurrency": s.baseline_concurrency,
                             "hisparse_concurrency": s.hisparse_concurrency, "stays_resident": s.stays_resident}
                           for s in sweep]
        print(dumps(doc))
    else:
        print(_table(plan, source, crossover, args.hot))
        if sweep:
            print()
            print(render_grid(["context", "without hisparse", "with hisparse", "bound by"],
                              [[str(s.inputs.context), str(s.baseline_concurrency), str(s.hisparse_concurrency),
                                s.bound_by + (", all resident" if s.stays_resident else "")] for s in sweep]))
    if args.plot:
        from hisparse_core.planner_plot import write_plan_plot

        try:
            write_plan_plot(plan, args.plot, sweep, plot_format(args.plot))
        except (HiSparseError, OSError, RuntimeError, ValueError) as exc:  # a writer's own (a broken TeX)
            return fail("hisparse plan", f"--plot failed (figures above): {exc}")
        logger.info("plot written to %s (%s)", args.plot, plot_format(args.plot).upper())
    return 0
