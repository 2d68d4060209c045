"""`hisparse generate` (`DESCRIPTION` below says what it does, for its --help).

The core finds this command through the `hisparse.commands` entry point `generate` (pyproject.toml)
and calls `add_parser` on every start of `hisparse`, so this module's top level imports only the
light parts of hisparse_core; `run` imports torch, transformers and the rest of this package.
"""

from __future__ import annotations

import argparse
import logging
import sys

from hisparse_core.cli.options import (
    MAX_BLOCK_SIZE,
    MAX_SEED,
    SIZE_UNITS,
    HelpFormatter,
    check_backend_name,
    check_torch_device,
    fail,
    fail_argument,
    float_in,
    import_torch,
    int_in,
    size_in,
)
from hisparse_core.errors import HiSparseError
from hisparse_core.progress import ProgressBar
from hisparse_core.replay.report import counted, kv_place

DESCRIPTION = """\
A real transformers model decodes through hisparse, checked against itself.

A tiny random DeepSeek-V3.2 (or GLM-5, --model glm-5.1) model from transformers' own classes
generates greedily for a batch of left-padded prompts of different lengths, once with its own
attention (transformers alone) and once through hisparse: its indexer picks the top-k, the
resolver maps it to resident pages, hot rows or misses copied from the host pool, and attention
runs on exactly those rows. The GPU budget is below what the batch needs all resident (the
engine's floor for the batch can hold more of it: with short prompts the table says whether any
page was released), so the coordinator releases pages to host-only. A second batch shares a
prompt prefix with the first and takes it from the host pool. Prints tokens/s, hit rate, bytes
each way, GPU KV per request with and without hisparse, and the exactness check (identical
tokens, max abs logit difference, every row read compared with the model's own latent;
--dtype bfloat16 and --kv-rows fp8 say how they are judged). Exit status 1 if the check fails.

Needs the transformers extra: pip install -e '.[transformers]'.
"""

logger = logging.getLogger(__name__)

#: The second batch's prompts are this much shorter than the first's (`demo.SECOND_BATCH_SHORTER`,
#: not imported here: this module's top level imports no torch).
SECOND_BATCH_SHORTER = 16

#: The host pool when neither --host nor --host-pool-gib is given (51.20 MiB).
DEFAULT_HOST_GIB = 0.05

#: The most hot-buffer rows a runtime takes (hisparse_core.geometry.MAX_HOT_ROWS, not imported here:
#: torch-free top level); a top-k must fit the hot buffer, so it bounds --top-k too.
MAX_HOT_ROWS = 32768


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    p = subparsers.add_parser("generate", help="decode with a real (tiny, random) transformers DSA model through "
                                               "hisparse, checked token for token against the model alone",
                              description=DESCRIPTION, formatter_class=HelpFormatter)
    from hisparse_core.planner import MODEL_TYPES, MODELS, aliases_text, model_name

    p.add_argument("--model", default="deepseek-v3.2", choices=list(MODELS), type=model_name,
                   help="the model a tiny random one is built like: its transformers class and how its layers "
                        "share indexers (" + ", ".join(f"{n}: {MODEL_TYPES[n]}, {_indexers(g.index_share)}"
                                                       for n, g in MODELS.items())
                        + f"; the names of hisparse plan; aliases: {aliases_text()}; default: deepseek-v3.2)")
    p.add_argument("--backend", default=None,
                   help="backend name (default: $HISPARSE_BACKEND, else the highest-priority available)")
    p.add_argument("--device", default=None,
                   help="torch device of the model: cpu, cuda or cuda:N where this torch has CUDA (default: the "
                        "backend's)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype of the model weights and KV (default: float32)")
    p.add_argument("--kv-rows", default="model", choices=["model", "fp8"],
                   help="how the latent rows are stored on the GPU and in the host pool: model (the model's dtype, "
                        "the default) or fp8 (DeepSeek-V3.2's serving format, FlashMLA's fp8_ds_mla: e4m3 values, an "
                        "fp32 scale per 128, the roped part in the model's dtype); exactness is then judged against "
                        "the model reading its latent rounded the same way")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    w = p.add_argument_group("workload (defaults: 10-15 s on 2 idle CPU cores)")
    w.add_argument("--prompts", type=int_in(1, 256), metavar="N", default=4, help="prompts in the batch (default: 4)")
    w.add_argument("--min-prompt", type=int_in(1, 1 << 16), metavar="TOKENS", default=200,
                   help="shortest prompt, tokens (default: 200)")
    w.add_argument("--max-prompt", type=int_in(1, 1 << 16), metavar="TOKENS", default=480,
                   help="longest prompt, tokens (default: 480)")
    w.add_argument("--new-tokens", type=int_in(1, 1 << 16), metavar="N", default=96,
                   help="tokens generated per prompt (default: 96)")
    w.add_argument("--shared-prefix", type=int_in(0, 1 << 16), metavar="TOKENS", default=None,
                   help="prefix tokens the second batch shares with the first (default: 128, or --min-prompt "
                        "where that is shorter; --max-prompt for one prompt, which is that long)")
    w.add_argument("--seed", type=int_in(0, MAX_SEED), default=0, metavar="N",
                   help="seed of the random model weights and prompts (default: 0)")
    m = p.add_argument_group("model and memory")
    m.add_argument("--layers", type=int_in(1, 64), metavar="N", default=4,
                   help="decoder layers of the tiny model, each with sparse attention (default: 4)")
    # At most --hot-rows' own bound: a top-k above it could never fit the hot buffer.
    m.add_argument("--top-k", type=int_in(1, MAX_HOT_ROWS), metavar="K", default=32,
                   help="the model's index_topk, at most --hot-rows (default: 32)")
    # At most a runtime's limit: more failed after the model was built, naming RuntimeConfig.hot_rows.
    m.add_argument("--hot-rows", type=int_in(1, MAX_HOT_ROWS), metavar="ROWS", default=None,
                   help="hot-buffer rows per request (default: 2x --top-k rounded up to whole pages of "
                        "--block-size, as enable's default: 64 at the defaults)")
    m.add_argument("--block-size", type=int_in(1, MAX_BLOCK_SIZE), metavar="TOKENS", default=16,
                   help="tokens per page (default: 16)")
    m.add_argument("--prefill-chunk", type=int_in(1, 1 << 16), metavar="TOKENS", default=32,
                   help="prompt tokens per prefill forward (default: 32)")
    # Each budget has a size flag, as in `hisparse run` and `plan`, and its older name; `run` below
    # refuses both at once, so neither has a parser default.
    m.add_argument("--gpu-kv", type=size_in(1), metavar="SIZE", default=None,
                   help="GPU KV budget, rounded down to whole pages of --layers x --block-size rows (default: "
                        f"60%% of what the first batch needs all resident, or the engine's floor for the batch "
                        f"where that is more, which may hold every page, and then no page is released); units: "
                        f"{SIZE_UNITS}")
    m.add_argument("--gpu-kv-pages", type=int_in(0, 1 << 24), metavar="PAGES", default=None,
                   help="the GPU KV budget as a page count instead of a size (not with --gpu-kv); 0: the default")
    m.add_argument("--host", type=size_in(1), metavar="SIZE", default=None,
                   help=f"host pool budget (default: {DEFAULT_HOST_GIB:g}GiB = 51.20MiB); same units as --gpu-kv")
    m.add_argument("--host-pool-gib", type=float_in(0.0, 1024.0, lo_open=True), default=None, metavar="GIB",
                   help="the host pool in GiB, the older name of --host (--host-pool-gib 0.5 = --host 0.5GiB; not "
                        "with --host)")
    p.set_defaults(func=run)
    return p


def _indexers(share: int) -> str:
    return "one indexer per layer" if share == 1 else f"one indexer per {share} layers"


def _none_released(c: dict, s: dict) -> str:  # type: ignore[type-arg]
    """The budgets line's note where the run released no page, and why (the pool holds the hot
    buffers and prefill tails too, so a pool above what the batch needs may still release pages)."""
    if s["released_pages"]:
        return ""
    if c["gpu_kv_pages"]:
        return "; the budget given holds every page, so no page is released"
    return "; the engine's floor for this batch holds every page, so no page is released: longer prompts offload"


def _few(lengths: list[int]) -> str:
    """Prompt lengths for a line of text: every one of a few, else the first three and the last."""
    return str(lengths) if len(lengths) <= 6 else f"[{', '.join(map(str, lengths[:3]))}, ..., {lengths[-1]}]"


def _second_batch(c: dict) -> str:  # type: ignore[type-arg]
    """The second batch in words: its prompts and new tokens, and what of them the prefix is (where
    every prompt is shorter than the prefix, each is a start of it: it shares no whole prefix)."""
    lengths, shared = c["second_batch_lengths"], c["shared_prefix"]
    text = f"{counted(len(lengths), 'prompt')} of {_few(lengths)} tokens + {c['second_batch_new_tokens']} new, "
    if max(lengths) <= shared:
        return text + ("the start" if len(lengths) == 1 else "each the start") + f" of the {shared}-token shared prefix"
    return text + f"sharing a {shared}-token prefix" + (" (a prompt shorter than it is all prefix)"
                                                        if min(lengths) < shared else "")


def _table(result: dict) -> str:  # type: ignore[type-arg]
    from hisparse_core.replay.report import NO_LOOKUPS, human_bytes, pct, render_table

    c, e, s, x = result["config"], result["engine"], result["stats"], result["exactness"]
    f1, f2 = x["first_batch"], x["second_batch"]
    per, base = s["gpu_kv_bytes_per_request"], s["gpu_kv_bytes_per_request_all_resident"]
    where = kv_place(e["device"])
    rows = [
        ("backend", f"{e['backend']} on {e['device']}"),
        ("model", f"tiny random {c['name']} ({c['model']}, {c['dtype']}): {counted(c['layers'], 'layer')} in index groups "
                  f"{e['index_groups']}, top-k {c['top_k']}, hot buffer {e['hot_rows']} rows, row {e['row_format']} "
                  f"({e['row_bytes']} B" + (f"; the model's own rows {e['model_row_bytes']} B"
                                            if c.get("kv_rows") == "fp8" else "") + ")"),
        ("batches", f"{counted(c['prompts'], 'prompt')} of {_few(c['prompt_lengths'])} tokens + "
                    f"{c['new_tokens']} new; then " + _second_batch(c)),
        ("budgets", f"{where} {e['gpu_pool_pages']} pages (the first batch needs {e['all_resident_pages']} all "
                    "resident" + _none_released(c, s) + f"), host pool {e['host_pool_blocks']} pages"),
        ("throughput", ""),
        ("decode", f"{s['decode_tokens_per_s']:.1f} tokens/s ({s['decode_tokens']} tokens; steps "
                   f"{s.get('decode_mode', 'eager')})" if s["decode_tokens"] else
                   "n/a: no decode step ran (--new-tokens 1: each prompt's one new token comes from its prefill)"),
        ("prefill", f"{s['prefill_tokens_per_s']:.1f} tokens/s ({s['prefill_tokens']} tokens)"),
        ("wall time", f"hisparse {result['seconds']['hisparse']:.1f} s, transformers alone "
                      f"{result['seconds']['transformers_alone']:.1f} s"),
        ("hot buffer", ""),
        ("hit rate", (pct(s["hit_rate"]) if s["hits"] + s["misses"] else NO_LOOKUPS)
                     + f" ({s['hits']} hits, {s['misses']} misses; {s['resident']} entries from resident pages)"),
        ("pages released", f"{s['released_pages']} released, {s['lost_pages']} then host-only (read through the "
                           "hot buffer)"),
        ("prefix hits", f"{s['prefix_hit_tokens']} tokens taken from the host pool"),
        ("bytes moved", ""),
        ("host->device", f"{human_bytes(s['h2d_bytes'])} by decode misses and page restores, "
                         f"{human_bytes(s['prefill_host_bytes'])} read by prefill from the host pool"),
        ("device->host", f"{human_bytes(s['d2h_bytes'])} (row mirrors and spills)"),
        (f"{where} KV per request", ""),
        ("with hisparse", f"{human_bytes(per)} (resident pages + hot buffer, at the peak)"),
        ("without", f"{human_bytes(base)} (every page resident)" + (
            "" if not per else f": {base / per:.2f}x more" if base > per else ": the same" if base == per else
            f": hisparse takes {per / base:.2f}x more here (its hot buffer outweighs these short prompts' pages)")),
        ("indexer keys", f"{human_bytes(s['indexer_bytes_per_request'])} (on the {where} either way)"),
        ("exactness", ""),
        *([("reference", "the model alone reading its normed latent rounded to fp8 as hisparse stores it "
                         "(--kv-rows fp8)")] if c.get("kv_rows") == "fp8" else []),
        ("first batch", f"tokens {'identical' if f1['tokens_identical'] else 'DIFFER'}, max abs logit diff "
                        f"{f1['max_abs_logit_diff']:.2e} over {counted(f1['steps'], 'step')}"),
        ("second batch", f"tokens {'identical' if f2['tokens_identical'] else 'DIFFER'}, max abs logit diff "
                         f"{f2['max_abs_logit_diff']:.2e} over {counted(f2['steps'], 'step')}"),
        ("rows checked", f"{x['rows_checked']} rows read, each "
                         f"{'within fp8 rounding of' if c.get('kv_rows') == 'fp8' else 'equal to'} the model's own "
                         f"latent (max abs diff {x['rows_max_abs_diff']:.1e})"),
        ("top-k checked", f"{x['topk_checked']} queries against the model's own indexer; decided at a tie: "
                          f"{x['topk_boundary_ties']} exact, {x['topk_near_ties']} near (where the model's own "
                          "generate may pick another key)"),
    ]
    b, st = x.get("lossy_against_fp32"), x.get("stored_rows")
    judged_by_stored = st is not None and st["judged"]
    if st is not None:
        rows.append(("stored rows", f"teacher-forced, the model alone reading the very latents hisparse stored: max "
                                    f"abs logit diff {st['max_abs_logit_diff']:.2e} over {counted(st['steps'], 'step')}; "
                                    f"the model itself rounds {st['rounding_flips']} of {st['latent_values']} "
                                    "latent values to another fp8 value (float noise at a rounding boundary; "
                                    "padding positions not compared)" + ("" if st.get("judged", True) else
                                                                         "; reported, not judged: in bfloat16 the "
                                                                         "two part by bf16 noise")))
    if b is not None:
        alone = "the model alone reading the same fp8 rows" if "fp8" in b["lossy"] else "transformers alone"
        line = (f"teacher-forced max abs logit error against the fp32 model as it is (logit scale "
                f"{b['logit_scale']:.2f}): hisparse {b['hisparse']:.3f}, {alone} {b['transformers']:.3f}")
        rows.append((f"{b['lossy']} vs fp32", line + (" (what fp8 rows cost this tiny random model)" if judged_by_stored
                                                      else f"; limit {b['factor']:g}x + {b['slack']:g} = "
                                                           f"{b['limit']:.3f}")))
    off = x.get("offload_against_all_resident")
    if off is not None:
        rows.append(("offload", f"teacher-forced, hisparse at this budget against the same engine under one that "
                                f"releases no page ({off['all_resident_released_pages']} released; its "
                                f"{off['all_resident_misses']} misses are prefix-hit pages, which start in the host "
                                f"pool): max abs logit diff {off['max_abs_logit_diff']:.2e} over {counted(off['steps'], 'step')}"))
    causes = []          # every check that failed, the offload check first
    if off is not None and not off["exact"]:
        causes.append(f"offloading moved the logits by {off['max_abs_logit_diff']:.2e}: expected the all-resident "
                      f"run's within {x['logit_tolerance']:.0e}")
    if off is not None and off["all_resident_released_pages"]:
        causes.append(f"the all-resident comparison released {off['all_resident_released_pages']} pages: expected "
                      "none (its budget is hisparse generate's own choice; please report it)")
    if judged_by_stored:
        if not st["exact"]:
            causes.append(f"tolerance {x['logit_tolerance']:.0e} against the model reading the latents hisparse stored")
    elif b is not None:
        if not (x["exact"] or b["within"]):
            causes.append(f"tolerance {b['factor']:g}x transformers' own {b['lossy']} error + {b['slack']:g}")
    elif not x["exact"]:
        causes.append(f"tolerance {x['logit_tolerance']:.0e}")
    failed = f"FAILED ({'; '.join(causes) or 'see above'})"
    rows.append(("result", x["verdict"] if x["passed"] else failed))
    return render_table(rows, "hisparse generate")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def preflight(args: argparse.Namespace, device: str) -> tuple[int, float]:
    """Every check the engine and the host pool make, made before the model is built, so a value
    that cannot work fails in a second naming its flag rather than after the transformers-alone
    half (minutes). Returns the budgets in `DemoConfig`'s terms, whichever flag set them: the GPU
    KV in pages (0: the default) and the host pool in GiB. Raises `HiSparseError`
    (`InvalidInputError`, `CapacityError`)."""
    import torch

    from hisparse_core.capacity import (
        HOST_FRACTION,
        available_host_bytes,
        check_device_memory,
        check_host_memory,
        device_free_bytes,
    )
    from hisparse_core.errors import CapacityError, InvalidInputError
    from hisparse_core.units import at_most, ceil_size, floor_size, human_bytes
    from hisparse_transformers.demo import DemoConfig, comparison_pages, rounding_of
    from hisparse_transformers.engine import ACTIVE_TAIL_PAGES, chunk_pages_for, required_gpu_blocks
    from hisparse_transformers.kv_rows import LatentRows
    from hisparse_transformers.tiny import TinyShape

    bs = args.block_size
    hot_given = args.hot_rows is not None
    if not hot_given:  # a --top-k or --block-size given alone was refused against a fixed 64 the user never set
        args.hot_rows = min(_cdiv(2 * args.top_k, bs) * bs, MAX_HOT_ROWS // bs * bs)
    if args.hot_rows % bs:
        raise InvalidInputError(f"--hot-rows {args.hot_rows} is not a multiple of --block-size {bs}; expected "
                                f"{_cdiv(args.hot_rows, bs) * bs} (or another multiple)")
    if args.hot_rows < args.top_k:
        rows = _cdiv(args.top_k, bs) * bs
        raise InvalidInputError(f"--hot-rows {args.hot_rows}{'' if hot_given else ' (the default)'} is below --top-k "
                                f"{args.top_k}: one step's top-k must "
                                "fit the hot buffer; expected " + (
                                    f"--hot-rows >= {rows} (a multiple of --block-size {bs}) or " if rows <= MAX_HOT_ROWS
                                    else "") + f"--top-k <= {args.hot_rows}")
    shape = TinyShape()
    row_bytes = LatentRows.of(args.kv_rows, getattr(torch, args.dtype), shape.kv_lora, shape.rope).fmt.row_bytes
    block_bytes = args.layers * bs * row_bytes
    lengths = DemoConfig(prompts=args.prompts, min_prompt=args.min_prompt, max_prompt=args.max_prompt,
                         shared_prefix=0).lengths()
    floor = required_gpu_blocks(args.prompts, args.hot_rows // bs,
                                chunk_pages_for(args.prefill_chunk, max(lengths) + args.new_tokens, bs))
    needs = f"{args.prompts} prompts with a {args.hot_rows}-row hot buffer and --prefill-chunk {args.prefill_chunk} need"
    if args.gpu_kv is not None:
        given = args.gpu_kv // block_bytes
        if given < floor:
            raise CapacityError(f"--gpu-kv {human_bytes(args.gpu_kv)} holds {counted(given, 'page')} of "
                                f"{block_bytes} B (--layers {args.layers} x --block-size {bs} x {row_bytes} B), below "
                                f"the {floor} that {needs}; expected --gpu-kv >= {ceil_size(floor * block_bytes)}")
    else:
        given = args.gpu_kv_pages or 0
        if given and given < floor:
            raise CapacityError(f"--gpu-kv-pages {given} is below what {needs}; expected --gpu-kv-pages >= {floor} "
                                "(or 0 for the default)")
    all_resident = sum(_cdiv(n + args.new_tokens, bs) for n in lengths)
    pages = given or max(floor, int(0.6 * all_resident))
    gpu_bytes = pages * block_bytes
    gpu_flag = "--gpu-kv-pages" if args.gpu_kv_pages else "--gpu-kv"
    what = (f"--gpu-kv-pages {pages} ({human_bytes(gpu_bytes)} of KV)" if args.gpu_kv_pages else
            f"--gpu-kv {human_bytes(args.gpu_kv)} ({pages} pages)" if args.gpu_kv is not None else
            f"--gpu-kv {human_bytes(gpu_bytes)} (the default: {pages} pages)")
    # The largest budget that fits, in the flag's own unit (as `run` names it): on a CPU model the
    # KV pool is host RAM, so the host rule (HOST_FRACTION of what is available) applies.
    dev = torch.device(device)
    free = device_free_bytes(dev)
    if free is not None and dev.type == "cpu":
        free = int(free * HOST_FRACTION)
    fits = "" if free is None else at_most(free // block_bytes) if args.gpu_kv_pages else at_most(free, floor_size)
    check_device_memory(dev, gpu_bytes, what, remedy=f"lower {gpu_flag}{fits}")
    rounding = rounding_of(args.dtype, args.kv_rows)
    if rounding:
        # the offload check runs the same engine again with every page resident, after the checked run
        # has released its budget: its pool must fit on its own
        compare = comparison_pages(all_resident, floor)
        check_device_memory(dev, compare * block_bytes,
                            f"the {rounding} run's offload check (the same engine with no page released: "
                            f"{compare} pages of {block_bytes} B)",
                            remedy="fewer or shorter prompts (--prompts, --max-prompt, --new-tokens)")
    # --host-pool-gib keeps its own words (a GiB figure) in its messages; --host and the default a size.
    if args.host_pool_gib is not None:
        host_gib, host_flag, shown = args.host_pool_gib, "--host-pool-gib", f"{args.host_pool_gib:g}"
        up, down = _gib_up, _gib_down
    else:
        host_gib = args.host / (1 << 30) if args.host is not None else DEFAULT_HOST_GIB
        host_flag, shown, up, down = "--host", human_bytes(int(host_gib * (1 << 30))), ceil_size, floor_size
    host_bytes = int(host_gib * (1 << 30))
    usable = host_bytes // block_bytes - 1  # the coordinator keeps a null block
    # The host pool holds every running request's whole KV: the batch's prompts and new tokens.
    need = max(_cdiv(max(lengths) + args.new_tokens, bs) + ACTIVE_TAIL_PAGES,
               sum(_cdiv(n + args.new_tokens, bs) for n in lengths))
    if usable < need:
        raise CapacityError(f"{host_flag} {shown} holds {max(usable, 0)} pages of {block_bytes} B; "
                            f"the batch's {counted(args.prompts, 'prompt')} of {_few(lengths)} "
                            f"tokens + {args.new_tokens} new need "
                            f"{need}: expected {host_flag} >= {up((need + 1) * block_bytes)}")
    avail = available_host_bytes()
    fits = at_most(int(avail * HOST_FRACTION), down) if avail else ""
    check_host_memory(host_bytes, f"{host_flag} {shown}", remedy=f"lower {host_flag}{fits}")
    if dev.type == "cpu":  # both pools in host RAM: enable refused the pair after the model alone had run
        together = f" so that together they take at most {floor_size(int(avail * HOST_FRACTION))}" if avail else ""
        check_host_memory(gpu_bytes + host_bytes, f"{what} and {host_flag} {shown} together (the model runs on the "
                          "CPU, so the KV pool and the host pool are both in host RAM)",
                          remedy=f"lower {gpu_flag} or {host_flag}{together}")
        if rounding:  # the offload check's engine has a host pool of the same size beside its pages
            check_host_memory(compare * block_bytes + host_bytes,
                              f"the {rounding} run's offload check ({compare} pages of {block_bytes} B, no page "
                              f"released) and {host_flag} {shown} together (both in host RAM on the CPU)",
                              remedy=f"lower {host_flag}, or fewer or shorter prompts (--prompts, --max-prompt, "
                                     "--new-tokens)")
    return given, host_gib


def _gib_round(nbytes: int, up: bool) -> str:
    """`nbytes` in GiB at 3 significant digits, rounded up (enough) or down (fits)."""
    import math

    gib = nbytes / (1 << 30)
    scale = 10.0 ** (math.floor(math.log10(gib)) - 2)
    return f"{(math.ceil if up else math.floor)(gib / scale) * scale:.3g}"


def _gib_up(nbytes: int) -> str:
    return _gib_round(nbytes, up=True)


def _gib_down(nbytes: int) -> str:
    return _gib_round(nbytes, up=False)


class _QuietEngine:
    """At the default INFO level, the engine's own INFO lines (registry, coordinator, worker, the
    transformers engine, the backends' packages: long, and all in the table) are held back while it
    runs; at DEBUG every line shows."""

    NAMES = ("hisparse_core.registry", "hisparse_core.coordinator", "hisparse_core.worker", "hisparse_transformers")

    def __init__(self) -> None:
        self.active = logging.getLogger().getEffectiveLevel() == logging.INFO
        self._saved: dict[str, int] = {}

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """NAMES and each installed backend's package (its factory's): the triton backend logged
        its runtime line once per index group, 4 lines under the one `generate` promises."""
        from hisparse_core.registry import get_registry

        packages = {e.factory.split(":")[0].split(".")[0] for e in get_registry().entries() if e.factory}
        return (*cls.NAMES, *sorted(packages - {"hisparse_core"}))

    def __enter__(self) -> None:
        if self.active:
            self._saved = {n: logging.getLogger(n).level for n in self.names()}
            for n in self._saved:
                logging.getLogger(n).setLevel(logging.WARNING)

    def __exit__(self, *exc: object) -> None:
        for n, level in self._saved.items():
            logging.getLogger(n).setLevel(level)
        self._saved = {}


def _transformers_missing() -> str | None:
    """Why this command cannot run transformers (not installed, or a release outside the tested
    range), or None; checked before a backend is selected, so the refusal is the only line."""
    import importlib.util

    from hisparse_transformers.version import UnsupportedVersionError, check_version

    try:
        if importlib.util.find_spec("transformers") is None:
            return "transformers is not installed; expected the transformers extra (pip install -e '.[transformers]')"
        check_version()
    except UnsupportedVersionError as exc:
        return str(exc)
    except (ImportError, ValueError):   # a broken install: transformers' own import says why, later
        return None
    return None


def run(args: argparse.Namespace) -> int:
    # Each budget's size flag and its older name, which sets the same budget in other units.
    for flag, value, alias, alias_value, budget in (
            ("--gpu-kv", args.gpu_kv, "--gpu-kv-pages", args.gpu_kv_pages, "GPU KV budget"),
            ("--host", args.host, "--host-pool-gib", args.host_pool_gib, "host pool budget")):
        if value is not None and alias_value is not None:
            return fail_argument("hisparse generate", alias, f"not allowed with {flag}: both set the {budget}; "
                                                             "expected one of the two")
    # one prompt is --max-prompt long: --min-prompt (its default too) is not used
    if args.prompts > 1 and args.min_prompt > args.max_prompt:
        return fail("hisparse generate", f"--min-prompt {args.min_prompt} is above --max-prompt {args.max_prompt}; "
                                         "expected min <= max")
    flag, shortest = ("--max-prompt", args.max_prompt) if args.prompts == 1 else ("--min-prompt", args.min_prompt)
    if shortest <= SECOND_BATCH_SHORTER:
        return fail("hisparse generate", f"{flag} {shortest}: the second batch's prompts are "
                                         f"{SECOND_BATCH_SHORTER} tokens shorter than the first's; expected "
                                         f"{flag} >= {SECOND_BATCH_SHORTER + 1}")
    if args.shared_prefix is None:
        args.shared_prefix = min(128, shortest)
    if args.shared_prefix > shortest:
        one = f" (one prompt, {flag} long)" if args.prompts == 1 else ""
        return fail("hisparse generate", f"--shared-prefix {args.shared_prefix} is above {flag} {shortest}{one}; "
                                         f"expected a prefix in [0, {flag}]")
    if why := check_backend_name(args.backend) or import_torch("hisparse generate") or _transformers_missing():
        return fail("hisparse generate", why)
    # Only a device this command runs on, before a backend is selected or a model built: torch
    # accepts `meta` and builds a model there, and on a torch without CUDA `cuda` fails deep in
    # the capacity check with an AssertionError.
    if args.device is not None and (why := check_torch_device("--device", args.device, "hisparse generate")):
        return fail("hisparse generate", why)
    try:
        from hisparse_transformers.demo import DemoConfig, run_demo, total_steps
    except ModuleNotFoundError as exc:
        print(f"hisparse generate: error: {exc.name} is not installed; expected the transformers extra "
              "(pip install -e '.[transformers]')", file=sys.stderr)
        return 2
    from hisparse_core.replay.report import dumps

    bar = ProgressBar(0, "generate", enabled=False)  # replaced once the step count is known
    quiet = _QuietEngine()
    try:
        from hisparse_core.registry import get_registry, select_backend

        with quiet:
            chosen = select_backend(args.backend)
        device = args.device if args.device is not None else str(chosen.device)
        gpu_kv_pages, host_pool_gib = preflight(args, device)
        logger.info("hisparse generate: backend %s (%s) on %s%s", chosen.name,
                    get_registry().choose(args.backend).explanation(), device,
                    "; the engine's own log lines at --log-level DEBUG" if quiet.active else "")
        from hisparse_core.planner import MODEL_TYPES, MODELS

        config = DemoConfig(model=MODEL_TYPES[args.model], name=args.model,
                            index_share=MODELS[args.model].index_share, backend=args.backend, prompts=args.prompts,
                            min_prompt=args.min_prompt,
                            max_prompt=args.max_prompt, new_tokens=args.new_tokens, layers=args.layers,
                            top_k=args.top_k, hot_rows=args.hot_rows, block_size=args.block_size,
                            prefill_chunk=args.prefill_chunk, gpu_kv_pages=gpu_kv_pages,
                            host_pool_gib=host_pool_gib, shared_prefix=args.shared_prefix, seed=args.seed,
                            device=device, dtype=args.dtype, kv_rows=args.kv_rows)
        # no ETA: a hisparse step on the CPU costs several times one of the model alone, which come first
        bar = ProgressBar(total_steps(config), "generate", enabled=not args.no_progress, eta=False)
        import torch

        # The instance selected above where it runs on the model's device: selected (and logged) once.
        same = torch.device(chosen.device) == torch.device(device)
        with bar, quiet:
            result = run_demo(config, lambda n, label: bar.update(n, note=label), chosen if same else None)
    except ModuleNotFoundError as exc:  # transformers itself is imported on first use
        if (exc.name or "").split(".")[0] != "transformers":
            raise
        return fail("hisparse generate", f"{exc.name} is not installed; expected the transformers extra "
                                         "(pip install -e '.[transformers]')")
    except KeyboardInterrupt:
        print(f"hisparse generate: interrupted at step {bar.done}" + (f" of {bar.total}" if bar.total else ""),
              file=sys.stderr)
        return 130
    except (HiSparseError, ValueError) as exc:
        from hisparse_transformers.check import RowMismatch, TopkMismatch

        if isinstance(exc, RowMismatch | TopkMismatch):  # the exactness check failed: a result, not bad input
            print(f"hisparse generate: FAILED: {exc}", file=sys.stderr)
            return 1
        return fail("hisparse generate", str(exc))
    print(dumps(result) if args.json else _table(result))
    return 0 if result["exactness"]["passed"] else 1
