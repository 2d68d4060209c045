"""What the cross-layer prefetch buys under the locality model: a CPU simulation (counts, no timing).

For each serving geometry (context:batch), regime and reference-layer list, every request's
decode top-k from `LayeredIndexer` (as `bench_serving.py --topk-model` makes them) goes through
per-group LRU hot buffers (`hisparse_core.replay.prefetch_sim`) without the prefetch, with it
(`prefetch_next_group`), and with it plus a wrap-around prefetch of group 0 from the last group's
top-k of the step before (not built: what it would buy). Critical misses are the copies that wait
for a group's own top-k; prefetch misses are copied while the previous group's attention runs.

The hot buffer and the resident pages per request follow bench_serving.py's sizing of the same
flags (`--layers`, `--gpu-kv-gib`, DeepSeek-V3.2's geometry, top-k 2048, 2x hot rows): the GPU
pool less every request's hot buffer and the coordinator's watermark, spread evenly over the
batch, the active tail among them (`--resident-pages N` overrides). H2D bytes are misses times
the bf16 row (1152 bytes).

Run:  python bench/bench_prefetch_locality.py
      python bench/bench_prefetch_locality.py --geometries 32768:43 --regimes code --references spread/20,21,22,23
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hisparse_core.replay.locality import parse_reference_layers  # noqa: E402
from hisparse_core.replay.prefetch_sim import VARIANTS, request_trace, simulate  # noqa: E402


def geometry(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        t, _, b = part.partition(":")
        if not (t.isdigit() and b.isdigit() and int(t) > 0 and int(b) > 0):
            raise ValueError(f"--geometries={text!r}: {part!r} is not CONTEXT:BATCH; expected e.g. 32768:43,131072:18")
        out.append((int(t), int(b)))
    return out


def resident_per_request(context: int, batch: int, layers: int, gpu_kv_gib: float) -> tuple[int, int, int]:
    """(resident pages per request, hot rows, row bytes) as bench_serving.py sizes hisparse's pool."""
    from bench_serving import sizes_for
    from bench_transformers import GEOMETRY
    from transformers import DeepseekV32Config

    from hisparse_transformers.engine import pressure_watermark

    cfg = DeepseekV32Config(num_hidden_layers=layers, **GEOMETRY)
    a = argparse.Namespace(block_size=64, smoke=False, warmup=5, steps=5, max_context=context + 1024, hot_rows=0,
                           fill_chunk=1024, host_gib=100.0, gpu_kv_gib=gpu_kv_gib, all_resident_gib=None)
    s = sizes_for(cfg, layers, context, a)
    if s.largest("hisparse") < batch:
        raise ValueError(f"batch {batch} at context {context}: hisparse holds at most {s.largest('hisparse')} at "
                         f"--gpu-kv-gib {gpu_kv_gib:g}")
    blocks = (s.budget - batch * s.indexer_bytes) // s.hs_block_bytes
    free = blocks - batch * s.hot_blocks - pressure_watermark(batch, s.hot_blocks, s.chunk_pages)
    return max(0, free // batch), s.hot_blocks * 64, s.row_bytes


def bf16_row_bytes() -> int:
    import torch
    from bench_transformers import GEOMETRY

    from hisparse_transformers.engine import row_format_for

    return row_format_for(torch.bfloat16, GEOMETRY["kv_lora_rank"] + GEOMETRY["qk_rope_head_dim"]).row_bytes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--geometries", default="32768:43,131072:18", help="comma list of CONTEXT:BATCH")
    p.add_argument("--regimes", default="code,benign")
    p.add_argument("--references", default="spread/20,21,22,23",
                   help="'/'-separated reference-layer lists ('spread' or LAYERS ascending layers of 61)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--gpu-kv-gib", type=float, default=3.0)
    p.add_argument("--top-k", type=int, default=2048)
    p.add_argument("--resident-pages", type=int, default=-1,
                   help="resident pages a request, hot rows 2x top-k, without bench_serving's sizing (-1: from it)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="measured steps after the warm-up")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        geos = geometry(a.geometries)
        refs = [parse_reference_layers("--references", x, range(a.layers), a.layers) for x in a.references.split("/")]
        regimes = a.regimes.split(",")
        bad = [r for r in regimes if r not in ("benign", "code")]
        if bad:
            raise ValueError(f"--regimes={a.regimes!r}: {bad[0]!r} is not a regime; expected benign and/or code")
        if a.steps <= 0 or a.warmup < 1:
            raise ValueError(f"--steps={a.steps} --warmup={a.warmup}: expected --steps >= 1 and --warmup >= 1")
        if a.resident_pages >= 0:   # no sizing: e.g. a 61-layer model at the 4-layer bench's pages and hot rows
            sizing = {g: (a.resident_pages, 2 * a.top_k, bf16_row_bytes()) for g in geos}
        else:
            sizing = {g: resident_per_request(*g, a.layers, a.gpu_kv_gib) for g in geos}
    except ValueError as exc:
        print(f"bench_prefetch_locality: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    print(f"# CPU simulation (counts, no timing): {a.layers} layers, top-k {a.top_k}, {a.warmup} warm-up + {a.steps} "
          f"measured decode steps, LRU hot buffers per index group, seed {a.seed}")
    print("| context | batch | regime | reference layers | prefetch | critical misses/step | critical MB/step | "
          "prefetch MB/step | H2D MB/step | critical vs off | critical by group |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (context, batch), (res, hot, row_bytes) in sizing.items():
        resident = res
        for name in regimes:
            for ref in refs:
                traces = [request_trace(name, ref, top_k=a.top_k, context=context, steps=a.warmup + a.steps,
                                        seed=a.seed, request_id=r) for r in range(batch)]
                base = None
                for variant in VARIANTS:
                    c = simulate(traces, variant, context=context, hot_rows=hot, block_size=64,
                                 resident_pages=max(0, resident - 2), tail_pages=2, warmup=a.warmup)
                    n = c.steps
                    crit, pre = c.critical_misses / n, c.prefetch_misses / n
                    base = base or crit
                    label = "spread " if ref == parse_reference_layers("", "spread", range(a.layers), a.layers) else ""
                    print(f"| {context // 1024}K | {batch} | {name} | {label}{','.join(map(str, ref))} | {variant} | "
                          f"{crit:,.0f} | {crit * row_bytes / 1e6:.1f} | {pre * row_bytes / 1e6:.1f} | "
                          f"{(crit + pre) * row_bytes / 1e6:.1f} | {crit / base if base else 1.0:.2f}x | "
                          f"{' / '.join(f'{x / n:,.0f}' for x in c.critical_by_group)} |", flush=True)
        print(f"# {context // 1024}K batch {batch}: {resident} resident pages a request (sinks' and active tail's "
              f"among them), {hot} hot rows", flush=True)
    print(f"# ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
