"""What the cross-layer prefetch buys under the locality model: a CPU simulation (counts, no timing).

For each serving geometry (context:batch), regime and reference-layer list, every request's
decode top-k from `LayeredIndexer` (as `bench_serving.py --topk-model` makes them) goes through
per-group LRU hot buffers (`hisparse_core.replay.prefetch_sim`) without the prefetch, with it
(`prefetch_next_group`), and with it plus a wrap-around prefetch of group 0 from the last group's
top-k of the step before (not built: what it would buy). Critical misses are the copies that wait
for a group's own top-k; prefetch misses are copied while the previous group's attention runs.

The hot buffer and the resident pages per request follow bench_serving.py's sizing of the same
flags (`--layers`, `--gpu-kv-gib`, DeepSeek-V3.2's geometry, top-k 2048, `--hot-rows`, 0 for 2x
top-k): the GPU pool less every request's hot buffer and the coordinator's watermark, spread evenly
over the batch, the active tail among them (`--resident-pages N` overrides; `--indexer-keys`,
`--fill-chunk` and `--hot-rows` as bench_serving.py takes them; the LRU replay's buffers hold
`--hot-rows` rows a group). H2D bytes are misses times the row: bf16's 1152
bytes, or 656 with `--kv-rows fp8` (DeepSeek-V3.2's fp8_ds_mla, `enable(kv_rows="fp8")`), which
also sizes the pool in those rows.

Plans (`--plans`): `off`, `next` and `next+wrap` as above; `auto` the prefetch from every group
but the regime's poor layers (`bench_serving.py --prefetch-next-group auto`: under code the groups
standing for reference layers 0-1); `res` the poor layers kept resident (`--resident-layers auto`:
no lookups, no buffer) without the prefetch, `res+next` with it from every group, `res+auto` with it
from the good ones (the plan as `enable` takes it: a tuple of source groups).

Predicted step: the call D3 (seventeenth session, H200, 32K, batch 43, docs/gpu-validation.md)
timed eight hisparse rows whose step over all-resident's fits `18.8 us x critical MB + 11.2 us x
prefetched MB` within 0.21 ms (least squares, no constant: the critical copies wait at the link's
53 GB/s, the prefetch's overlap the attention but still cost about 60% as much per byte). The
`pred. excess ms` column is that; `pred. vs all-resident` divides by `--all-resident-ms` (15.54 for
32K batch 43 in D3; other geometries need their own figure).

A layer mix (`--subsets`): with many layers (`--layers 61 --references 0,1,...,60`, the
4-layer bench's pages and hot rows through `--resident-pages` and `--hot-rows`), each row is
followed by what a `--bench-layers`-layer step would copy if its layers averaged those of a subset:
`all` (the model's own mix) or a '/'-separated list of reference-layer lists (`0,20,40,60`, the
4-layer bench's spread). A subset is read only from plans without the prefetch (what a layer
prefetches depends on its neighbour in this run), `all` from every plan.

Run:  python bench/bench_prefetch_locality.py
      python bench/bench_prefetch_locality.py --geometries 32768:43 --regimes code --references spread/20,21,22,23
      python bench/bench_prefetch_locality.py --geometries 32768:43 --plans off,next,auto,res,res+next,res+auto
      python bench/bench_prefetch_locality.py --geometries 32768:132 --references spread --plans off --indexer-keys fp8 \
          --kv-rows fp8 --hot-rows 2048 --fill-chunk 64 --all-resident-ms ""
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hisparse_core.geometry import MAX_HOT_ROWS  # noqa: E402
from hisparse_core.replay.locality import parse_reference_layers  # noqa: E402
from hisparse_core.replay.prefetch_sim import request_trace, simulate  # noqa: E402

#: D3's fit (see the module docstring): ms per MB of critical-path and of prefetched H2D copies
CRITICAL_MS_PER_MB = 18.8e-3
PREFETCH_MS_PER_MB = 11.2e-3
#: plan -> (simulate's variant, prefetch from the good groups only, poor groups resident)
PLANS = {"off": ("off", False, False), "next": ("next", False, False), "next+wrap": ("next+wrap", False, False),
         "auto": ("next", True, False), "res": ("off", False, True), "res+next": ("next", False, True),
         "res+auto": ("next", True, True)}


def poor_groups(regime_name: str, refs: list[int]) -> list[int]:
    """bench_serving.poor_layers: under code the groups standing for reference layers 0-1."""
    return [g for g, r in enumerate(refs) if r < 2] if regime_name == "code" else []


def all_resident_ms(text: str) -> dict[tuple[int, int], float]:
    out: dict[tuple[int, int], float] = {}
    for part in filter(None, text.split(",")):
        key, _, ms = part.partition("=")
        try:
            (t, b), step = geometry(key)[0], float(ms)
        except ValueError:
            step = math.nan
        if not 0 < step < math.inf:  # nan passed, and the ratio column read `nanx`
            raise ValueError(f"--all-resident-ms={text!r}: {part!r} is not CONTEXT:BATCH=MS with MS a positive number "
                             "of milliseconds; expected e.g. 32768:43=15.54")
        out[(t, b)] = step
    return out


def geometry(text: str) -> list[tuple[int, int]]:
    from hisparse_core.cli.options import MAX_REQUESTS, MAX_TOKENS

    out = []
    for part in text.split(","):
        t, _, b = part.partition(":")
        try:  # isdigit() alone let '²' through to int()
            context, batch = int(t), int(b)
        except ValueError:
            context = batch = 0
        if not (t.isdigit() and b.isdigit() and 0 < context <= MAX_TOKENS and 0 < batch <= MAX_REQUESTS):
            raise ValueError(f"--geometries={text!r}: {part!r} is not CONTEXT:BATCH with a context in [1, {MAX_TOKENS}] "
                             f"and a batch in [1, {MAX_REQUESTS}]; expected e.g. 32768:43,131072:18")
        out.append((context, batch))
    return out


def resident_per_request(context: int, batch: int, layers: int, gpu_kv_gib: float, keys: str = "model",
                         rows: str = "model", fill_chunk: int = 1024, hot_rows: int = 0) -> tuple[int, int, int]:
    """(resident pages per request, hot rows, row bytes) as bench_serving.py sizes hisparse's pool
    (`hot_rows`: bench_serving's --hot-rows, 0 for 2x the model's top-k)."""
    from bench_serving import sizes_for
    from bench_transformers import GEOMETRY
    from transformers import DeepseekV32Config

    from hisparse_transformers.engine import pressure_watermark

    cfg = DeepseekV32Config(num_hidden_layers=layers, **GEOMETRY)
    a = argparse.Namespace(block_size=64, smoke=False, warmup=5, steps=5, max_context=context + 1024, hot_rows=hot_rows,
                           fill_chunk=fill_chunk, host_gib=100.0, gpu_kv_gib=gpu_kv_gib, all_resident_gib=None)
    s = sizes_for(cfg, layers, context, a, keys, rows)
    if s.largest("hisparse") < batch:
        raise ValueError(f"batch {batch} at context {context}: hisparse holds at most {s.largest('hisparse')} at "
                         f"--gpu-kv-gib {gpu_kv_gib:g}")
    blocks = (s.budget - batch * s.indexer_bytes) // s.hs_block_bytes
    free = blocks - batch * s.hot_blocks - pressure_watermark(batch, s.hot_blocks, s.chunk_pages)
    return max(0, free // batch), s.hot_blocks * 64, s.row_bytes


def row_bytes_of(rows: str) -> int:
    """A latent row's bytes in bf16 at DeepSeek-V3.2's geometry, stored as `rows` ('model': 1152, 'fp8': 656)."""
    import torch
    from bench_transformers import GEOMETRY

    from hisparse_transformers.kv_rows import LatentRows

    return LatentRows.of(rows, torch.bfloat16, GEOMETRY["kv_lora_rank"], GEOMETRY["qk_rope_head_dim"]).fmt.row_bytes


def parse_subsets(spec: str, refs: list[list[int]]) -> list[str | list[int]]:
    """`--subsets`: 'all' or reference-layer lists, each of layers every `--references` list runs."""
    out: list[str | list[int]] = []
    for part in filter(None, (x.strip() for x in spec.split("/"))):
        if part == "all":
            out.append("all")
            continue
        try:
            layers = [int(x) for x in part.split(",")]
        except ValueError:
            raise ValueError(f"--subsets={spec!r}: {part!r} is not 'all' or a comma list of reference layers") from None
        missing = sorted({x for x in layers for ref in refs if x not in ref})
        if missing or len(set(layers)) != len(layers):
            raise ValueError(f"--subsets={spec!r}: {part!r} names layer(s) {missing or 'twice'} not run once by every "
                             f"--references list; expected layers of each")
        out.append(layers)
    return out


def main(argv: list[str] | None = None) -> int:
    from hisparse_core.cli.options import (
        MAX_LAYERS,
        MAX_SEED,
        MAX_STEPS,
        MAX_TOKENS,
        MAX_TOP_K,
        CliParser,
        float_in,
        int_in,
    )

    p = CliParser(prog="bench_prefetch_locality", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--geometries", default="32768:43,131072:18", help="comma list of CONTEXT:BATCH")
    p.add_argument("--regimes", default="code,benign")
    p.add_argument("--references", default="spread/20,21,22,23",
                   help="'/'-separated reference-layer lists ('spread' or LAYERS ascending layers of 61)")
    # Every count bounded (10**30 steps ran until memory ran out); a layer per reference layer of 61.
    p.add_argument("--layers", type=int_in(1, 61), default=4)
    p.add_argument("--gpu-kv-gib", type=float_in(0.0, 65536.0, lo_open=True), default=3.0)
    p.add_argument("--top-k", type=int_in(1, MAX_TOP_K), default=2048)
    p.add_argument("--resident-pages", type=int_in(-1, MAX_TOKENS), default=-1,
                   help="resident pages a request, without bench_serving's sizing (-1: from it)")
    p.add_argument("--hot-rows", type=int, default=0,
                   help="hot-buffer rows a request a group, a multiple of 64 in [--top-k, a runtime's limit] "
                        "(0: 2x top-k), as bench_serving.py takes them: the LRU buffers and the sizing")
    p.add_argument("--kv-rows", default="model", choices=("model", "fp8"),
                   help="how the latent rows are stored: the bytes a miss copies and the pool's sizing")
    p.add_argument("--indexer-keys", default="model", choices=("model", "fp8"), help="the sizing's indexer keys")
    p.add_argument("--fill-chunk", type=int_in(1, MAX_TOKENS), default=1024, help="the sizing's prefill chunk (bench_serving's)")
    p.add_argument("--warmup", type=int_in(1, MAX_STEPS), default=5)
    p.add_argument("--steps", type=int_in(1, MAX_STEPS), default=10, help="measured steps after the warm-up")
    p.add_argument("--seed", type=int_in(0, MAX_SEED), default=0)
    p.add_argument("--plans", default="off,next,next+wrap", help=f"comma list of {', '.join(PLANS)} (module docstring)")
    p.add_argument("--subsets", default="",
                   help="'/'-separated: 'all' or reference-layer lists of this run, each printed after a row as a "
                        "--bench-layers-layer step of its average layer (module docstring)")
    p.add_argument("--bench-layers", type=int_in(1, MAX_LAYERS), default=4, help="the layers of the bench a --subsets line stands for")
    p.add_argument("--all-resident-ms", default="32768:43=15.54",
                   help="all-resident's measured step per CONTEXT:BATCH, for the predicted ratio (D3: 32768:43=15.54)")
    a = p.parse_args(argv)
    try:
        geos = geometry(a.geometries)
        refs = [parse_reference_layers("--references", x, range(a.layers), a.layers) for x in a.references.split("/")]
        regimes = a.regimes.split(",")
        bad = [r for r in regimes if r not in ("benign", "code")]
        if bad:
            raise ValueError(f"--regimes={a.regimes!r}: {bad[0]!r} is not a regime; expected benign and/or code")
        plans = a.plans.split(",")
        bad = [x for x in plans if x not in PLANS]
        if bad:
            raise ValueError(f"--plans={a.plans!r}: {bad[0]!r} is not a plan; expected a comma list of {', '.join(PLANS)}")
        base_ms = all_resident_ms(a.all_resident_ms)
        if a.hot_rows and (a.hot_rows < 0 or a.hot_rows % 64 or not a.top_k <= a.hot_rows <= MAX_HOT_ROWS):
            raise ValueError(f"--hot-rows={a.hot_rows}: expected 0 (2x top-k) or a multiple of the 64-token block in "
                             f"[{a.top_k} (--top-k), {MAX_HOT_ROWS}]")
        subsets = parse_subsets(a.subsets, refs)
        if a.resident_pages >= 0:   # no sizing: e.g. a 61-layer model at the 4-layer bench's pages and hot rows
            sizing = {g: (a.resident_pages, a.hot_rows or 2 * a.top_k, row_bytes_of(a.kv_rows)) for g in geos}
        else:
            sizing = {g: resident_per_request(*g, a.layers, a.gpu_kv_gib, a.indexer_keys, a.kv_rows, a.fill_chunk,
                                              a.hot_rows) for g in geos}
    except ValueError as exc:
        print(f"bench_prefetch_locality: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    print(f"# CPU simulation (counts, no timing): {a.layers} layers, top-k {a.top_k}, {a.warmup} warm-up + {a.steps} "
          f"measured decode steps, LRU hot buffers per index group, seed {a.seed}, latent rows {a.kv_rows}")
    print("| context | batch | regime | reference layers | plan | critical misses/step | critical MB/step | "
          "prefetch MB/step | H2D MB/step | critical vs off | critical by group | prefetched into group | "
          "pred. excess ms | pred. vs all-resident |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (context, batch), (res, hot, row_bytes) in sizing.items():
        resident = res
        for name in regimes:
            for ref in refs:
                traces = [request_trace(name, ref, top_k=a.top_k, context=context, steps=a.warmup + a.steps,
                                        seed=a.seed, request_id=r) for r in range(batch)]
                base = None
                poor = poor_groups(name, ref)
                for plan in plans:
                    variant, good_only, res_poor = PLANS[plan]
                    pairs = [g for g in range(len(ref)) if g not in poor] if good_only else None
                    c = simulate(traces, variant, context=context, hot_rows=hot, block_size=64,
                                 resident_pages=max(0, resident - 2), tail_pages=2, warmup=a.warmup, pairs=pairs,
                                 resident_groups=poor if res_poor else ())
                    n = c.steps
                    crit, pre = c.critical_misses / n, c.prefetch_misses / n
                    base = base if base is not None else crit
                    crit_mb, pre_mb = crit * row_bytes / 1e6, pre * row_bytes / 1e6
                    excess = CRITICAL_MS_PER_MB * crit_mb + PREFETCH_MS_PER_MB * pre_mb
                    ms = base_ms.get((context, batch))
                    label = "spread " if ref == parse_reference_layers("", "spread", range(a.layers), a.layers) else ""
                    print(f"| {context // 1024}K | {batch} | {name} | {label}{','.join(map(str, ref))} | {plan} | "
                          f"{crit:,.0f} | {crit_mb:.1f} | {pre_mb:.1f} | "
                          f"{crit_mb + pre_mb:.1f} | {crit / base if base else 1.0:.2f}x | "
                          f"{' / '.join(f'{x / n:,.0f}' for x in c.critical_by_group)} | "
                          f"{' / '.join(f'{x / n:,.0f}' for x in c.prefetch_by_group)} | {excess:.2f} | "
                          f"{f'{(ms + excess) / ms:.3f}x' if ms else '-'} |", flush=True)
                    for subset in subsets:
                        if subset == "all":
                            groups = list(range(len(ref)))
                        elif variant == "off":
                            groups = [ref.index(x) for x in subset]
                        else:
                            continue
                        scale = a.bench_layers / len(groups) * row_bytes / 1e6 / n
                        s_crit = sum(c.critical_by_group[g] for g in groups) * scale
                        s_pre = sum(c.prefetch_by_group[g] for g in groups) * scale
                        s_excess = CRITICAL_MS_PER_MB * s_crit + PREFETCH_MS_PER_MB * s_pre
                        what = "every layer" if subset == "all" else f"layers {','.join(map(str, subset))}"
                        print(f"#   {plan}, {what} as a {a.bench_layers}-layer step: critical {s_crit:.1f} MB, "
                              f"prefetched {s_pre:.1f} MB, pred. excess {s_excess:.2f} ms"
                              f"{f', {(ms + s_excess) / ms:.3f}x all-resident' if ms else ''}", flush=True)
        print(f"# {context // 1024}K batch {batch}: {resident} resident pages a request (sinks' and active tail's "
              f"among them), {hot} hot rows", flush=True)
    print(f"# ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    from hisparse_core.cli.options import run_script

    sys.exit(run_script(main))
