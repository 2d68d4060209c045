"""`hisparse run`: an end-to-end decode replay through coordinator, worker and backend.

Requests arrive (families of them share a prompt prefix), are admitted under a GPU KV budget and
a host pool budget, prefill writes their KV, and decode steps run. Each step a synthetic indexer
picks top-k positions per request and index group (calibrated so a contract LRU misses about 30%
/ 13% / 7% with hot buffers of 1x / 2x / 4x top-k); every layer's sparse attention over the rows
the backend resolved is compared with the same attention over an all-resident copy, and any
difference fails the run naming the request, layer and position.

Reports steps per second and where a step's time goes (coordinator, worker, forward, indexer,
decode, check), hit rate, misses, bytes host<->device, pages spilled, released and reused, host
pool usage, GPU KV per request against all-resident, prefix-hit tokens, and the largest
concurrency that fits the GPU budget with and without hisparse (measured, next to `hisparse
plan`'s figures).

On a backend that declares the `cuda_graph` capability (nvidia), the decode step (resolve, gather
and follower replay of every index group) is captured in one CUDA graph per batch size and
replayed each step; `--eager` runs it call by call instead.

Presets (`--preset NAME`; flags given override them): `default`, and `large`: 64 requests of
32K+16 tokens at once, 4 layers in 2 index groups with followers, 2 decode rows per request
(a speculative token), a 1 GiB GPU KV budget and a 1.5 GiB host pool, so pages spill, are
released and read back from host and prefix blocks are evicted.
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
    SIZE_UNITS,
    HeldSelectionLog,
    HelpFormatter,
    check_backend_name,
    check_host_budget,
    check_plot_path,
    fail,
    fail_argument,
    float_in,
    import_torch,
    int_in,
    plot_format,
    size_in,
)
from hisparse_core.errors import HiSparseError, InvalidInputError
from hisparse_core.progress import ProgressBar
from hisparse_core.replay.report import kv_place

logger = logging.getLogger(__name__)


#: CLI option -> RunConfig field, for the options that map one to one.
_FIELDS = {"requests": "requests", "context": "context", "decode_tokens": "decode_tokens", "steps": "steps",
           "arrival_every": "arrival_every", "prefix_groups": "prefix_groups", "shared_prefix": "shared_fraction",
           "concurrency": "concurrency", "locality": "locality", "top_k": "top_k", "hot": "hot_multiple",
           "layers": "layers", "index_share": "index_share", "block_size": "block_size",
           "row_format": "row_format", "indexer_bytes": "indexer_bytes", "rows_per_request": "rows_per_request",
           "acceptance": "acceptance", "seed": "seed"}


#: `RunConfig`'s defaults, here so `--help` needs no torch (tests/cli check they agree).
DEFAULTS: dict[str, Any] = {
    "requests": 16, "context": 16384, "decode_tokens": 32, "steps": 48, "top_k": 2048, "hot_multiple": 2.0,
    "layers": 2, "index_share": 2, "block_size": 64, "row_format": "fp8_ds_mla", "indexer_bytes": 132,
    "gpu_kv_bytes": 96 << 20, "host_bytes": 256 << 20, "concurrency": 0, "prefix_groups": 4,
    "shared_fraction": 0.5, "arrival_every": 1, "locality": 1.0, "rows_per_request": 1, "acceptance": 1.0,
    "seed": 0}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    from hisparse_core.replay.presets import PRESETS
    from hisparse_core.replay.report import human_bytes

    d = DEFAULTS
    p = subparsers.add_parser("run", help="replay a serving workload under a GPU and a host budget: hit rate, "
                                          "transfers, concurrency; checked against all-resident", description=__doc__,
                              formatter_class=HelpFormatter)
    p.add_argument("--backend", default=None,
                   help="backend name (default: $HISPARSE_BACKEND, else the highest-priority available; "
                        "see hisparse backends)")
    p.add_argument("--preset", default="default", choices=sorted(PRESETS),
                   help="named workload; the flags below override its values (default: default)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    p.add_argument("--plot", metavar="FILE.png", help="draw hit rate over steps and concurrency against "
                                                      "context length (needs matplotlib: hisparse[plot]; "
                                                      "checked before the run starts)")
    p.add_argument("--eager", action="store_true",
                   help="run the decode step call by call, without CUDA graphs")
    p.add_argument("--validate", action="store_true", help="resolve with value validation (slower; eager)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    w = p.add_argument_group("workload (defaults: the preset's, else these)")
    w.add_argument("--requests", type=int_in(1, MAX_REQUESTS), metavar="N",
                   help=f"requests offered (default: {d['requests']}; at most {MAX_REQUESTS})")
    w.add_argument("--context", type=int_in(2, MAX_TOKENS), metavar="TOKENS",
                   help=f"prompt tokens per request (default: {d['context']}; at most {MAX_TOKENS})")
    w.add_argument("--decode-tokens", type=int_in(1, MAX_TOKENS), metavar="N",
                   help=f"tokens each request decodes (default: {d['decode_tokens']})")
    w.add_argument("--steps", type=int_in(1, MAX_STEPS), metavar="N",
                   help=f"most engine steps; the run stops early once every request has finished "
                        f"(default: {d['steps']})")
    w.add_argument("--arrival-every", type=int_in(0, MAX_STEPS), metavar="STEPS",
                   help=f"steps between arrivals, 0: all at once (default: {d['arrival_every']})")
    w.add_argument("--prefix-groups", type=int_in(0, MAX_REQUESTS), metavar="N",
                   help=f"families sharing a prompt prefix, 0: none (then no --shared-prefix) "
                        f"(default: {d['prefix_groups']})")
    # Below 1: each request keeps a part of its own (the replay's workload refuses a whole shared prompt).
    w.add_argument("--shared-prefix", type=float_in(0.0, 1.0, hi_open=True), metavar="FRACTION",
                   help=f"fraction of the prompt a family shares, in [0, 1) (default: {d['shared_fraction']:g})")
    w.add_argument("--concurrency", type=int_in(0, MAX_REQUESTS), metavar="N",
                   help="most running requests; 0: as many as the GPU budget admits (default: 0)")
    w.add_argument("--rows-per-request", type=int_in(1, 64), metavar="N",
                   help=f"decode rows per request and step: 1 + speculative tokens, resolved as one union "
                        f"(default: {d['rows_per_request']}; at most 64)")
    w.add_argument("--acceptance", type=float_in(0.0, 1.0), metavar="P",
                   help="speculative mode with rejections: each speculative row is accepted with probability P "
                        "while all before it were; rejected rows are read by the step's later rows, then rolled "
                        "back and written again; needs --rows-per-request >= 2 "
                        f"(default: {d['acceptance']:g}, every row accepted)")
    w.add_argument("--locality", type=float_in(0.0, MAX_LOCALITY, lo_open=True), metavar="X",
                   help=f"time scale of top-k drift; 1 = calibrated to published LRU miss rates, >1 more "
                        f"local (default: 1; in (0, {MAX_LOCALITY:g}])")
    w.add_argument("--topk-model", choices=("benign", "code"), default=None,
                   help="take the top-k from the per-layer locality model of a regime (benign: GLM-5.1 "
                        "LongBench v2; code: DeepSeek-V3.2 SWE-bench, GVR) instead of the one-figure indexer "
                        "(not with --locality, which scales only that one)")
    w.add_argument("--resident-layers", type=_layer_list, metavar="L,L", default=None,
                   help="layers kept fully resident on the GPU (whole index groups): no hot buffer, no host copy; "
                        "their pages come off the top of --gpu-kv (default: none)")
    w.add_argument("--seed", type=int_in(0, MAX_SEED), metavar="N",
                   help=f"seed of arrivals, prompts, KV contents and the synthetic indexer; the same seed "
                        f"gives the same run (default: {d['seed']})")
    m = p.add_argument_group("model and memory (defaults: the preset's, else these)")
    m.add_argument("--top-k", type=int_in(1, MAX_TOP_K), metavar="K",
                   help=f"positions the synthetic indexer picks per decode row and index group "
                        f"(default: {d['top_k']})")
    m.add_argument("--hot", type=float_in(1.0, MAX_HOT, what="a multiple of top-k"), metavar="X",
                   help=f"hot buffer in multiples of top-k, in [1, {MAX_HOT:g}] (default: {d['hot_multiple']:g})")
    m.add_argument("--layers", type=int_in(1, MAX_LAYERS), metavar="N",
                   help=f"sparse-attention layers (default: {d['layers']})")
    m.add_argument("--index-share", type=int_in(1, MAX_LAYERS), metavar="N",
                   help=f"layers per indexer (default: {d['index_share']})")
    m.add_argument("--block-size", type=int_in(1, MAX_BLOCK_SIZE), metavar="TOKENS",
                   help=f"tokens per KV page, the unit of GPU and host allocation (default: {d['block_size']})")
    m.add_argument("--row-format", choices=["fp8_ds_mla", "bf16_mla"],
                   help=f"KV row layout (default: {d['row_format']})")
    m.add_argument("--indexer-bytes", type=int_in(0, 1 << 16), metavar="BYTES",
                   help=f"indexer key bytes per token and indexer layer, kept on GPU (default: {d['indexer_bytes']})")
    m.add_argument("--gpu-kv", type=size_in(1), metavar="SIZE",
                   help=f"GPU KV budget (default: {human_bytes(d['gpu_kv_bytes'])}); units: {SIZE_UNITS}")
    m.add_argument("--host", type=size_in(1), metavar="SIZE",
                   help=f"host pool budget (default: {human_bytes(d['host_bytes'])}); same units")
    p.set_defaults(func=run)
    return p


def _layer_list(text: str) -> tuple[int, ...]:
    """'0,1' -> (0, 1). Every item a layer index: `--resident-layers ""` (an unset variable) or `0,,1`
    is refused as --sweep refuses `8K,,32K`, not taken as no resident layer."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices, e.g. 0,1; got {text!r}") from None


def _resident_layers_problem(args: argparse.Namespace) -> str | None:
    """Why `--resident-layers` does not name layers of this run (their range is `--layers`, the
    preset's or the default), or None; said as the parser says a value out of its range."""
    if not args.resident_layers:
        return None
    from hisparse_core.replay.presets import preset

    if args.layers is not None:
        layers, where = args.layers, f"--layers {args.layers}"
    elif "layers" in preset(args.preset):
        layers = int(preset(args.preset)["layers"])  # type: ignore[call-overload]
        where = f"--layers {layers} of --preset {args.preset}"
    else:
        layers, where = DEFAULTS["layers"], f"--layers {DEFAULTS['layers']}, the default"
    given = ",".join(str(x) for x in args.resident_layers)
    bad = sorted({x for x in args.resident_layers if not 0 <= x < layers})
    if bad:
        which = "" if len(args.resident_layers) == 1 else \
            f" ({', '.join(map(str, bad))} {'is' if len(bad) == 1 else 'are'} out of range)"
        return f"expected layer indices in [0, {layers}) ({where}), got {given}{which}"
    repeated = sorted({x for x in args.resident_layers if args.resident_layers.count(x) > 1})
    if repeated:
        return f"expected each layer once, got {given} ({', '.join(map(str, repeated))} repeated)"
    return None


def _merged(args: argparse.Namespace, opt: str, field: str) -> tuple[Any, str]:
    """The value `field` takes in this run (the flag's, else the preset's, else the default) and
    where it comes from, in the flag's words: `--rows-per-request 1, the default`."""
    from hisparse_core.replay.presets import preset

    flag = "--" + opt.replace("_", "-")
    if getattr(args, opt) is not None:
        return getattr(args, opt), f"{flag} {getattr(args, opt)}"
    if field in preset(args.preset):
        value = preset(args.preset)[field]
        return value, f"{flag} {value} of --preset {args.preset}"
    return DEFAULTS[field], f"{flag} {DEFAULTS[field]}, the default"


def _unused_flag_problem(args: argparse.Namespace) -> tuple[str, str] | None:
    """(flag, why) for a flag given that this run would ignore, another flag (or the preset) taking
    away what it acts on, or None: a run that reports `acceptance 0.5` must have had rows to reject."""
    if args.acceptance is not None and args.acceptance < 1:  # 1, every row accepted, is true of none too
        rows, where = _merged(args, "rows_per_request", "rows_per_request")
        if rows == 1:
            return "--acceptance", (f"not allowed with {where}: a step has no speculative row to accept or reject; "
                                    "expected --rows-per-request >= 2, or no --acceptance")
    if args.locality is not None and args.topk_model is not None:
        return "--locality", (f"not allowed with --topk-model {args.topk_model}: the locality model draws the top-k, "
                              "and --locality scales only the one-figure indexer; expected one of the two")
    if args.shared_prefix is not None:
        groups, where = _merged(args, "prefix_groups", "prefix_groups")
        if groups == 0:
            return "--shared-prefix", (f"not allowed with {where}: no family shares a prompt prefix; expected "
                                       "--prefix-groups >= 1, or no --shared-prefix")
    return None


def config_from_args(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """RunConfig defaults, then the preset's values, then every flag given."""
    from hisparse_core.replay.engine import RunConfig
    from hisparse_core.replay.presets import preset

    values: dict[str, object] = dict(preset(args.preset))
    values.update({field: getattr(args, opt) for opt, field in _FIELDS.items() if getattr(args, opt) is not None})
    if args.gpu_kv is not None:
        values["gpu_kv_bytes"] = args.gpu_kv
    if args.host is not None:
        values["host_bytes"] = args.host
    if args.topk_model is not None:
        values["topk_model"] = args.topk_model
    if args.resident_layers is not None:
        values["resident_layers"] = args.resident_layers
    try:
        return RunConfig(**values, validate=args.validate, cuda_graphs=not args.eager)  # type: ignore[arg-type]
    except InvalidInputError as exc:
        raise InvalidInputError(in_flag_words(str(exc))) from None


#: The flag that sets each RunConfig field, for its refusals ("run resident_layers ..." ->
#: "--resident-layers ...").
_FLAG_OF_FIELD = {field: "--" + opt.replace("_", "-") for opt, field in _FIELDS.items()} | {
    "gpu_kv_bytes": "--gpu-kv", "host_bytes": "--host", "topk_model": "--topk-model",
    "resident_layers": "--resident-layers"}


def in_flag_words(message: str) -> str:
    """A RunConfig refusal that starts with its field (`run NAME ...`) restated with the flag's name."""
    head, _, rest = message.partition(" ")
    field, sep, tail = rest.partition(" ")
    flag = _FLAG_OF_FIELD.get(field) if head == "run" else None
    return f"{flag}{sep}{tail}" if flag else message


def _saving(per_req: float, base: float) -> str:
    """How the measured KV per request compares with all-resident, in words that are true either way
    (the same where no page was saved, not "1.00x less")."""
    if not (per_req == per_req and per_req > 0 and base > 0):   # NaN or 0: nothing ran at peak
        return ""
    if per_req == base:
        return " (the same)"
    return f" ({base / per_req:.2f}x less)" if per_req < base else f" ({per_req / base:.2f}x more)"


def _table(result) -> str:  # type: ignore[no-untyped-def]
    from hisparse_core.replay.report import counted, hot_buffer, human_bytes, pct, render_table

    s, c = result.summary(), result.config
    per_req = s["gpu_kv_bytes_per_request_measured"]
    base = s["gpu_kv_bytes_per_request_all_resident"]
    where = kv_place(result.backend["device"])
    capped = bool(c["concurrency"]) and s["max_concurrency_hisparse_measured"] >= c["concurrency"]
    # Under a --concurrency that binds, more requests or steps change nothing: the cap is the why.
    reached = f" (held there by --concurrency {c['concurrency']})" if capped else "" if s["gpu_limit_reached"] \
        else f" ({where} limit not reached: offer more requests or steps)"
    rows = [
        ("backend", f"{result.backend['name']} {result.backend['version']} on {result.backend['device']}"),
        ("workload", f"{counted(c['requests'], 'request')} of {c['context']}+{c['decode_tokens']} tokens, "
                     f"{s['steps']} of {counted(c['steps'], 'step')}, top-k {c['top_k']}, "
                     f"{hot_buffer(c['hot_rows'], c['top_k'], c['hot_multiple'], c['block_size'])}, "
                     f"{counted(c['rows_per_request'], 'decode row')} per request, "
                     f"{counted(c['layers'], 'layer')} in index groups "
                     f"{c['index_groups']}, {c['row_format']}"),
        ("budgets", f"{where} KV {human_bytes(c['gpu_kv_bytes'])} ({c['gpu_blocks']} blocks), host pool "
                    f"{human_bytes(c['host_bytes'])} ({c['host_blocks']} blocks)"),
        ("throughput", ""),
        ("steps per second", f"{s['steps_per_s']:.2f} ({s['step_ms_mean']:.0f} ms/step; {s['decode_rows']} decode "
                             f"rows, {s['decode_rows_per_s']:.1f}/s)"),
        ("ms per step", "  ".join(f"{k} {v:.1f}" for k, v in s["phase_ms"].items())),
        ("decode step", f"{s['decode_mode']}" + (f" (graphs for batch sizes {s['graph_sizes']})" if s["graph_sizes"]
                                                 else "") + (f": {s['decode_device_ms']:.2f} ms on the device per "
                                                             f"decoding step (resolve + gather + follower replay)"
                                                             if s["decode_steps"] else ": no decoding step ran")),
        ("hot buffer", ""),
        ("hit rate", _hit_rate(s)),
        ("misses", f"{s['misses']} ({pct(s['miss_rate_per_entry'])} of looked-up entries; "
                   f"{s['resident_entries']} resident entries"
                   + (f"; {s['resident_layer_entries']} in resident layers {c['resident_layers']}"
                      if c.get("resident_layers") else "") + ")"),
        ("transfers", ""),
        ("host->device", f"{human_bytes(s['bytes_h2d'])} ({s['rows_h2d']} rows)"),
        ("device->host", human_bytes(s["bytes_d2h"])),
        ("pages", f"{s['pages'].get('spilled', 0)} spilled, {s['pages'].get('released', 0)} released, "
                  f"{s['pages'].get('reused', 0)} reused (then read from host), {s['pages'].get('restored', 0)} "
                  f"restored; {s['pages'].get('host_blocks_evicted', 0)} host blocks evicted"),
        ("host pool peak", f"{s['host_pool_peak_blocks']} of {s['host_pool_blocks'] - 1} blocks "
                           f"({pct(s['host_pool_peak_usage'])}, {human_bytes(s['host_pool_peak_bytes'])})"),
        ("speculative", f"{s['speculative_rows_rejected']} rows rejected and rolled back in "
                        f"{s['speculative_rollbacks']} request steps (acceptance {c['acceptance']:g})"),
        ("prefix-hit tokens", f"{s['prefix_hit_tokens']} (prefill computed {s['prefill_tokens_computed']} tokens)"),
        ("requests", f"{s['requests_admitted']} admitted, {s['requests_finished']} finished"
                     + (f"; {s['requests_unfinished']} of {c['requests']} unfinished"
                        + (f" ({int(c['requests']) - s['requests_admitted']} never admitted)"
                           if s["requests_admitted"] < c["requests"] else "")
                        + f": the run stopped at its {c['steps']}-step limit (raise --steps to let them finish)"
                        if s["stopped_at_step_limit"] else "")),
        ("memory", ""),
        (f"{where} KV per request", f"{human_bytes(per_req)} at peak concurrency vs {human_bytes(base)} all-resident"
                               + _saving(per_req, base)),
        ("max concurrency", ""),
        ("with hisparse", f"{s['max_concurrency_hisparse_measured']} measured{reached}; planner "
                          f"{s['max_concurrency_hisparse_planned']}{_planner_note(s, where)}"),
        ("all resident", f"{s['max_concurrency_all_resident_measured']} measured; planner "
                         f"{s['max_concurrency_all_resident_planned']}"),
        ("correctness", ""),
        ("attention check", f"PASS: {s['attention_entries_checked']} entries compared, all byte-identical, "
                            "outputs equal" if s["passed"] else
                            "NOTHING CHECKED: 0 entries compared (no decode step read the KV; a request decodes "
                            "from its second token on: raise --decode-tokens to 2 or more and --steps so a decode "
                            "step runs)"),
        ("wall time", f"{s['wall_s']:.1f} s"),
    ]
    return render_table(rows, "hisparse run")


def _hit_rate(s: dict[str, Any]) -> str:
    """The hit rate, or n/a where no lookup went through the hot buffer (a rate of nothing is no 100%)."""
    from hisparse_core.replay.report import hit_rate, pct

    if not s["hot_lookups"]:
        return hit_rate(s["hit_rate"], 0)
    peak = pct(s["hit_rate_from_peak"]) if s["hot_lookups_from_peak"] else "n/a, no lookup"
    return f"{pct(s['hit_rate'])} (from peak concurrency on: {peak})"


def _planner_note(s: dict[str, Any], where: str = "GPU") -> str:
    """Why the planner's figure is what it is, and why the measured one may differ from it
    (`where`: what the output calls the KV pool's memory, `kv_place`)."""
    gpu, host = s["max_concurrency_hisparse_planned_gpu"], s["max_concurrency_hisparse_planned_host"]
    measured, planned = s["max_concurrency_hisparse_measured"], s["max_concurrency_hisparse_planned"]
    if s["max_concurrency_planned_bound_by"] == "host pool":
        note = (f" (bound by the host pool: --host holds the whole KV of {host} requests, the {where} budget alone "
                f"would run {gpu})")
    else:
        note = f" (bound by the {where} budget; the host pool holds {host})"
    if measured > planned:
        note += "; measured above plan: requests sharing a prompt prefix share its host blocks, which the planner " \
                "does not count"
    return note


def run(args: argparse.Namespace) -> int:
    if why := _resident_layers_problem(args):
        return fail_argument("hisparse run", "--resident-layers", why)
    if unused := _unused_flag_problem(args):
        return fail_argument("hisparse run", *unused)
    if args.plot is not None and (why := check_plot_path(args.plot)):
        return fail("hisparse run", why)
    # The checks that need no torch come first: a bad value fails in a fraction of a second.
    from hisparse_core.replay.presets import preset

    host = args.host if args.host is not None else preset(args.preset).get("host_bytes", DEFAULTS["host_bytes"])
    if why := (check_backend_name(args.backend) or check_host_budget("--host", int(host))  # type: ignore[arg-type]
               or import_torch("hisparse run")):
        return fail("hisparse run", why)
    from hisparse_core.registry import select_backend
    from hisparse_core.replay.attention import AttentionMismatch
    from hisparse_core.replay.report import dumps, pct
    from hisparse_core.replay.run import run_replay

    acc = {"hits": 0, "misses": 0, "step": 0, "steps": 0}
    # The registry's "backend selected" line waits for the budget checks, which need the
    # backend's device: a refused value is the only line on stderr.
    held = HeldSelectionLog()
    try:
        config = config_from_args(args)
        acc["steps"] = config.steps
        backend = select_backend(args.backend)
        with ProgressBar(config.steps, "run", enabled=not args.no_progress) as bar:

            def on_step(rec, engine) -> None:  # type: ignore[no-untyped-def]
                acc["step"] += 1
                acc["hits"] += rec.hits
                acc["misses"] += rec.misses
                looked = acc["hits"] + acc["misses"]
                note = (f"running {rec.running}, waiting {rec.waiting}, hit "
                        f"{pct(acc['hits'] / looked) if looked else 'n/a'}")
                bar.update(config.steps if engine.done else 1, note=note + (", all finished" if engine.done else ""))

            result = run_replay(config, backend, on_step=on_step, on_checked=held.release)
    except KeyboardInterrupt:
        held.release()
        # As bench and generate say it: the step reached of the most the run would take (--steps).
        print(f"hisparse run: interrupted at step {acc['step']}" + (f" of {acc['steps']}" if acc["steps"] else ""),
              file=sys.stderr)
        return 130
    except AttentionMismatch as exc:
        held.release()
        if args.json:
            print(dumps({"check": "fail", "passed": False, "error": str(exc)}))
        print(f"hisparse run: FAILED: {exc}", file=sys.stderr)
        return 1
    except (HiSparseError, ValueError) as exc:
        held.drop()  # refused before any work: the error line alone
        return fail("hisparse run", str(exc))
    finally:
        held.release()  # whatever else ended the run (idempotent)
    # The table first: a plot that cannot be written never costs the finished run's figures.
    print(dumps(result.to_json()) if args.json else _table(result))
    sys.stdout.flush()
    if args.plot:
        from hisparse_core.replay.plot import write_plot

        try:
            write_plot(result, config, args.plot, plot_format(args.plot))
        except (HiSparseError, OSError, RuntimeError, ValueError) as exc:  # a writer's own (a broken TeX)
            return fail("hisparse run", f"the run finished (figures above) but --plot failed: {exc}")
        logger.info("plot written to %s (%s)", args.plot, plot_format(args.plot).upper())
    return 0
