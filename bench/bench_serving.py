"""Decode throughput at a fixed GPU KV budget: hisparse, the same engine all-resident, and
transformers' StaticCache decoding in a CUDA graph, one run, one table and one PNG plot.

Model: `DeepseekV32ForCausalLM` with DeepSeek-V3.2's attention geometry (`bench_transformers.GEOMETRY`),
`--layers` layers, random bf16 weights; a tiny MoE, or with `--dense-ffn-gb G` a dense FFN in every
layer sized so that one decode step reads G GB of weights (4.6: DeepSeek-V3.2's 37B active
parameters in fp8 over 8 GPUs), where batching pays as it does in production.

The budget (`--gpu-kv-gib`) is what each mode may hold of KV on the GPU, the indexer keys (which
stay on the GPU in every mode) included:

- hisparse: the engine's GPU pool (resident pages and hot buffers) is the budget less the batch's
  indexer keys; the whole KV lives in the host pool (`--host-gib`);
- all-resident: the same engine, given the budget only at batches whose every page fits it with
  room to spare, so no page is ever released (the `released` column says 0);
- transformers: `StaticCache` of `context + steps` slots (latent and indexer keys), the decode
  step captured in a CUDA graph (eager where capture fails, and the table says so).

Every mode sweeps the batch over powers of two up to the largest it can hold at the budget (and
that largest itself). Contexts are filled with the same random latents and keys, not prefilled
(`bench_transformers.fill_hisparse` / its StaticCache counterpart). Decode steps then run as
transformers' generate runs them, the host waiting for each step's output: `step ms` is the wall
time per step, `gpu ms` the kernels' time per step (torch.profiler), `idle ms` their difference,
the time the GPU waited for the host; `host critical ms` is hisparse's engine work per step
outside the planning ahead (begin_step, end_step's acknowledgements and bookkeeping) and `host
ahead ms` end_step's planning of the next decode step, which runs while the GPU runs this one
(`hisparse_core.coordinator.ahead`; `bench_transformers.EngineHostTime`). `overhead` is
hisparse's step against all-resident's at the same batch; `hit` the hot-buffer hit rate (random
weights: low locality), `H2D MB/step` the host-to-device bytes a step read. `--topk-model benign|code`
takes the engine modes' decode top-k from the calibrated per-layer locality model of that regime
(`enable(synthetic_topk=...)`, `hisparse_transformers.model_topk`; the indexer still runs, so its
cost stays in the step), instead of the random-weight indexer's choice; `--skip-indexer` leaves
the indexer out of those steps, so the difference in step time is the model's own indexer's cost.
The replay's calibrated indexer (`hisparse run`: the published locality, about 81% hits at 2x
top-k) runs the same batches (`replay` rows: hit rate and the decode step's device time).

Bad sizes (a budget that cannot hold one request, a batch the host pool cannot hold, a context
past `--max-context`) are one line naming the value and what fits, before anything is allocated.

Run (on a GPU):  python bench/bench_serving.py --layers 4 --contexts 32768,131072 --gpu-kv-gib 24 --png serving.png
                 python bench/bench_serving.py --layers 4 --dense-ffn-gb 4.6 ...
CPU smoke test:  python bench/bench_serving.py --smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_transformers import (  # noqa: E402 - the sibling script, found through the path above
    GEOMETRY,
    TINY,
    EngineHostTime,
    Timers,
    cache_kwarg,
    caches_latent,
    chunk_data,
    close_hisparse,
    decode,
    fill_hisparse,
    free_device_memory,
    kernel_profile,
    median,
)
from bench_transformers import build_model as base_model  # noqa: E402

MODES = ("hisparse", "all-resident", "transformers")


class BadSize(Exception):
    """A size that cannot run: one line for the user."""


def build_model(geometry: dict[str, int], layers: int, max_context: int, device: str, dtype: torch.dtype,
                dense_ffn_gb: float) -> Any:
    """`bench_transformers.build_model`; with `dense_ffn_gb`, a dense FFN in every layer reading that
    many GB of weights a step."""
    ffn = None
    if dense_ffn_gb:
        # gate, up and down projections of every layer: 3 * hidden * inter weights of 2 bytes
        inter = int(dense_ffn_gb * 1e9 / (layers * 3 * geometry["hidden_size"] * 2))
        ffn = dict(intermediate_size=max(16, inter), first_k_dense_replace=layers)
    return base_model(geometry, layers, max_context, device, dtype, ffn=ffn)


@dataclass(frozen=True)
class Sizes:
    """What one request of one context costs in each mode, and the largest batch each holds."""

    context: int
    max_context: int
    block_bytes: int
    pages: int
    hot_blocks: int
    chunk_pages: int
    indexer_bytes: int          # per request, every layer
    static_bytes: int           # transformers' StaticCache per request (latent + indexer keys)
    host_blocks: int
    budget: int

    def hisparse_blocks(self, b: int) -> int:
        from hisparse_transformers.engine import required_gpu_blocks

        return required_gpu_blocks(b, self.hot_blocks, self.chunk_pages)

    def resident_blocks(self, b: int) -> int:
        return b * self.pages + self.hisparse_blocks(b)

    def fits(self, mode: str, b: int) -> bool:
        kv = self.budget - b * self.indexer_bytes
        if mode == "hisparse":
            return kv >= self.hisparse_blocks(b) * self.block_bytes and b * (self.pages + 2) + 1 <= self.host_blocks
        if mode == "all-resident":
            return kv >= self.resident_blocks(b) * self.block_bytes and b * (self.pages + 2) + 1 <= self.host_blocks
        return b * self.static_bytes <= self.budget

    def largest(self, mode: str, limit: int = 1 << 14) -> int:
        b = 0
        while b < limit and self.fits(mode, b + 1):
            b += 1
        return b


def sizes_for(model_cfg: Any, layers: int, context: int, a: argparse.Namespace) -> Sizes:
    from hisparse_transformers.engine import row_format_for

    bs, top_k = a.block_size, model_cfg.index_topk
    width = model_cfg.kv_lora_rank + model_cfg.qk_rope_head_dim
    elem = 4 if a.smoke else 2
    fmt = row_format_for(torch.float32 if a.smoke else torch.bfloat16, width)
    max_context = context + a.warmup + a.steps + 3 + bs
    if max_context > a.max_context:
        raise BadSize(f"context {context} (+ {max_context - context} decode and alignment tokens) exceeds "
                      f"--max-context={a.max_context}: expected contexts <= {a.max_context - (max_context - context)}")
    hot_rows = a.hot_rows or -(-2 * top_k // bs) * bs
    block_bytes = layers * bs * fmt.row_bytes
    idx = layers * context * model_cfg.index_head_dim * elem
    static = (context + a.warmup + a.steps + 8) * layers * (width * elem + model_cfg.index_head_dim * elem)
    return Sizes(context, max_context, block_bytes, -(-max_context // bs), hot_rows // bs, -(-a.fill_chunk // bs) + 1,
                 idx, static, int(a.host_gib * 2**30) // block_bytes - 1, int(a.gpu_kv_gib * 2**30))


def batches_for(s: Sizes, mode: str, asked: list[int] | None) -> list[int]:
    top = s.largest(mode)
    if asked is not None:
        return [b for b in asked if b <= top]
    out = []
    b = 1
    while b <= top:
        out.append(b)
        b *= 2
    if top and top not in out:
        out.append(top)
    return out


def check_sizes(s: Sizes, asked: list[int] | None) -> None:
    """One line for a size that cannot run, before anything is allocated."""
    need = s.hisparse_blocks(1) * s.block_bytes + s.indexer_bytes
    if s.budget < need:
        raise BadSize(f"--gpu-kv-gib={s.budget / 2**30:g} cannot hold one hisparse request at context {s.context} "
                      f"(its hot buffer, active tail, recent pages and indexer keys); expected --gpu-kv-gib >= "
                      f"{need / 2**30:.4g}")
    if s.host_blocks < s.pages + 3:
        raise BadSize(f"--host-gib={s.host_blocks * s.block_bytes / 2**30:.4g} cannot hold one request of "
                      f"{s.max_context} tokens; expected --host-gib >= {(s.pages + 4) * s.block_bytes / 2**30:.4g}")
    if asked:
        top = max(s.largest(m) for m in MODES)
        big = [b for b in asked if b > top]
        if big:
            host_top = (s.host_blocks - 1) // (s.pages + 2)
            raise BadSize(f"batch {big[0]} at context {s.context} fits no mode: the host pool (--host-gib) holds "
                          f"{host_top} requests of {s.max_context} tokens and the GPU budget at most {top} in any "
                          f"mode; expected --batches <= {top}")


def run_engine(model: Any, s: Sizes, b: int, a: argparse.Namespace, resident: bool) -> dict[str, Any]:
    import hisparse_transformers

    dev = model.device
    out: dict[str, Any] = {"mode": "all-resident" if resident else "hisparse", "batch": b, "context": s.context}
    blocks = s.resident_blocks(b) if resident else (s.budget - b * s.indexer_bytes) // s.block_bytes
    host_gib = (b * (s.pages + 4) + 8) * s.block_bytes / 2**30
    hs = cache = None
    try:
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        hs = hisparse_transformers.enable(model, host_pool_gib=host_gib, gpu_kv_gib=blocks * s.block_bytes / 2**30,
                                          backend=a.backend, hot_rows=s.hot_blocks * a.block_size,
                                          block_size=a.block_size, max_batch=b, max_context=s.max_context,
                                          prefill_chunk=a.fill_chunk,
                                          synthetic_topk=None if a.topk_model == "indexer" else a.topk_model)
        cache = fill_hisparse(hs, b, s.context, a.fill_chunk, a.seed)
        if hs.engine.topk_model is not None:
            # every decode step of the run (warm-up, timed, profiled) made ahead before timing: no step's
            # host time includes making them
            hs.engine.topk_model.lookahead = a.warmup + a.steps + 3
            hs.engine.topk_model.make_ahead(cache.session, [r.pad for r in cache.session.requests], s.context)
            hs.engine.topk_model.run_indexer = not a.skip_indexer
        hs.stats()
        host = EngineHostTime(hs)
        host.reset()
        times = decode(model, cache, b, s.context, a.steps, a.warmup, Timers(dev))
        out["step_ms"] = median(times, "step")
        out["host_critical_ms"], out["host_ahead_ms"] = host.per_step_ms(a.steps + a.warmup)
        steps = a.steps + a.warmup
        if dev.type == "cuda":
            out["gpu_ms"] = kernel_profile(model, cache, b, s.context + a.warmup + a.steps, 3)["all kernels"]
            out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            steps += 3
        st = hs.stats()
        out.update(hit_rate=st.hit_rate, released=st.released_pages, decode_mode=st.decode_mode,
                   planned=hs.engine.ahead.claimed, misses_per_step=st.misses / steps,
                   h2d_mb_per_step=st.h2d_bytes / steps / 1e6,
                   topk=a.topk_model + ("-no-indexer" if a.skip_indexer else ""))
    except torch.OutOfMemoryError as exc:
        out["oom"] = str(exc).split(".")[0]
    finally:
        close_hisparse(hs, cache)
        del cache, hs
        free_device_memory(dev)
    return out


def fill_static(model: Any, b: int, t: int, slots: int, chunk: int, seed: int) -> Any:
    from transformers import StaticCache

    cfg = model.config
    width, lora = cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank
    cache = StaticCache(config=cfg, max_cache_len=slots)
    latent = caches_latent()
    with torch.no_grad():
        for layer, dec in enumerate(model.model.layers):
            for start in range(0, t, chunk):
                n = min(chunk, t - start)
                rows, keys = chunk_data(seed, layer, start, b, n, width, cfg.index_head_dim, model.device, model.dtype)
                k_pass, k_rot = rows[..., :lora].unsqueeze(1), rows[..., lora:].unsqueeze(1)
                kw = {"cache_position": torch.arange(start, start + n, device=model.device)}
                if latent:
                    cache.update(k_pass.contiguous(), k_rot.contiguous(), layer, kw)
                else:
                    key_states, value_states = dec.self_attn.expand_kv(k_pass, k_rot)
                    cache.update(key_states, value_states, layer, kw)
                cache.update_indexer(keys, layer)
    return cache


def run_static(model: Any, s: Sizes, b: int, a: argparse.Namespace) -> dict[str, Any]:
    dev = model.device
    out: dict[str, Any] = {"mode": "transformers", "batch": b, "context": s.context}
    cache = graph = None
    try:
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t = s.context
        cache = fill_static(model, b, t, t + a.warmup + a.steps + 8, a.fill_chunk, a.seed)
        key = cache_kwarg(model)
        kv = {key: cache}
        ids = torch.full((b, 1), 5, dtype=torch.long, device=dev)
        pos = torch.full((b, 1), t, dtype=torch.long, device=dev)
        cpos = torch.full((1,), t, dtype=torch.long, device=dev)

        def step() -> Any:
            return model(input_ids=ids, position_ids=pos, cache_position=cpos, use_cache=True, **kv)

        how = "eager"
        if dev.type == "cuda":
            try:
                with torch.no_grad():
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        step()                               # warm-up: library handles, lazy buffers
                        pos.add_(1)
                        cpos.add_(1)
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        step()
                how = "cuda graph"
            except Exception as exc:  # noqa: BLE001 - reported in the table
                graph = None
                how = f"eager (capture failed: {type(exc).__name__})"
        times = []
        with torch.no_grad():
            for i in range(a.warmup + a.steps):
                t0 = time.perf_counter()
                if graph is not None:
                    graph.replay()
                else:
                    step()
                pos.add_(1)
                cpos.add_(1)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                if i >= a.warmup:
                    times.append(1e3 * (time.perf_counter() - t0))
        out["step_ms"] = statistics.median(times)
        out["decode_mode"] = how
        if dev.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    graph.replay() if graph is not None else step()
                torch.cuda.synchronize()
            out["gpu_ms"] = sum(getattr(e, "device_time_total", 0.0) for e in prof.key_averages()) / 1e3 / 3
            out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    except torch.OutOfMemoryError as exc:
        out["oom"] = str(exc).split(".")[0]
    finally:
        del cache, graph
        free_device_memory(dev)
    return out


def run_replay_workload(layers: int, s: Sizes, b: int, a: argparse.Namespace, top_k: int) -> dict[str, Any]:
    """The replay's calibrated indexer at the same batch and context (its own synthetic KV)."""
    from hisparse_core.errors import HiSparseError
    from hisparse_core.geometry import row_format
    from hisparse_core.registry import select_backend
    from hisparse_core.replay.engine import RunConfig
    from hisparse_core.replay.run import run_replay

    # The replay stores fp8_ds_mla rows: the same budget in pages, not in bytes.
    scale = layers * a.block_size * row_format("fp8_ds_mla").row_bytes / s.block_bytes
    blocks = (s.budget - b * s.indexer_bytes) // s.block_bytes
    cfg = RunConfig(requests=b, context=s.context, decode_tokens=a.steps, steps=a.steps + 4, top_k=top_k,
                    layers=layers, index_share=1, block_size=a.block_size,
                    gpu_kv_bytes=int(blocks * s.block_bytes * scale) + b * s.indexer_bytes * 132 // (
                        128 * (4 if a.smoke else 2)),
                    host_bytes=int((b * (s.pages + 4) + 8) * s.block_bytes * scale), concurrency=b,
                    arrival_every=0, prefix_groups=1, shared_fraction=0.0, seed=a.seed)
    try:
        summary = run_replay(cfg, select_backend(None if a.backend in (None, "auto") else a.backend)).summary()
    except HiSparseError as exc:
        return {"mode": "replay", "batch": b, "context": s.context, "error": str(exc)}
    return {"mode": "replay", "batch": b, "context": s.context, "hit_rate": summary["hit_rate"],
            "step_ms": summary["step_ms_mean"], "gpu_ms": summary["decode_device_ms"],
            "decode_mode": summary["decode_mode"]}


def tokens_per_s(r: dict[str, Any]) -> float:
    return 1e3 * r["batch"] / r["step_ms"] if r.get("step_ms") else float("nan")


def ctx(t: int) -> str:
    return f"{t // 1024}K" if t >= 1024 else str(t)


def fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and x != x) else format(x, spec)


def table(rows: list[dict[str, Any]]) -> str:
    from hisparse_core.replay.report import render_grid

    by = {(r["mode"], r["batch"], r["context"]): r for r in rows}
    body = []
    for r in sorted(rows, key=lambda r: (r["context"], MODES.index(r["mode"]) if r["mode"] in MODES else 9,
                                         r["batch"])):
        if "oom" in r or "error" in r:
            body.append([f"{r['mode']} T={ctx(r['context'])}", str(r["batch"]), "OOM" if "oom" in r else "error"]
                        + ["-"] * 11)
            continue
        res = by.get(("all-resident", r["batch"], r["context"]), {})
        over = (f"{r['step_ms'] / res['step_ms']:.2f}x" if r["mode"] == "hisparse" and res.get("step_ms") else "-")
        gpu = r.get("gpu_ms")
        idle = r["step_ms"] - gpu if gpu is not None and r["mode"] != "replay" else None
        body.append([f"{r['mode']} T={ctx(r['context'])}", str(r["batch"]), fmt(r.get("step_ms")),
                     fmt(tokens_per_s(r), ".1f") if r["mode"] != "replay" else "-", fmt(gpu), fmt(idle),
                     fmt(r.get("host_critical_ms")), fmt(r.get("host_ahead_ms")), over, fmt(r.get("peak_gib"), ".1f"),
                     "-" if "hit_rate" not in r else f"{100 * r['hit_rate']:.0f}%", fmt(r.get("h2d_mb_per_step"), ".1f"),
                     str(r.get("released", "-")),
                     str(r.get("decode_mode", "-"))])
    header = ["mode", "batch", "step ms", "tok/s", "gpu ms", "idle ms", "host critical ms", "host ahead ms",
              "overhead", "peak GiB", "hit", "H2D MB/step", "released", "decode"]
    out = render_grid(header, body)
    gains = []
    for t in sorted({r["context"] for r in rows}):
        best = {m: max((tokens_per_s(r) for r in rows if r["mode"] == m and r["context"] == t and "step_ms" in r),
                       default=float("nan")) for m in MODES}
        gains.append(f"T={ctx(t)}: best tokens/s over the batches: hisparse {fmt(best['hisparse'], '.1f')}, all-resident "
                     f"{fmt(best['all-resident'], '.1f')}, transformers {fmt(best['transformers'], '.1f')}; gain over "
                     f"all-resident {fmt(best['hisparse'] / best['all-resident'], '.2f')}x")
    return out + "\n" + "\n".join(gains)


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4.5), squeeze=False)
    for ax, t in zip(axes[0], contexts, strict=True):
        for mode in MODES:
            pts = sorted((r["batch"], tokens_per_s(r)) for r in rows
                         if r["mode"] == mode and r["context"] == t and "step_ms" in r)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (concurrent requests)")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"context {ctx(t)}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--contexts", default="32768,131072")
    p.add_argument("--gpu-kv-gib", type=float, default=None,
                   help="GPU KV budget of every mode, indexer keys included (default 24; --smoke: 320 KiB)")
    p.add_argument("--host-gib", type=float, default=100.0, help="host pool limit (pinned)")
    p.add_argument("--max-context", type=int, default=131072 + 1024)
    p.add_argument("--batches", default="", help="comma list; default: powers of two up to each mode's largest")
    p.add_argument("--modes", default=",".join(MODES) + ",replay")
    p.add_argument("--dense-ffn-gb", type=float, default=0.0, help="dense FFN weight bytes read per step (GB)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--hot-rows", type=int, default=0, help="0: 2x top-k")
    p.add_argument("--fill-chunk", type=int, default=1024)
    p.add_argument("--backend", default="auto")
    p.add_argument("--topk-model", choices=("indexer", "benign", "code"), default="indexer",
                   help="where the engine modes' decode top-k comes from: the model's indexer (random weights), or "
                        "the calibrated locality model of a regime (enable(synthetic_topk=...); the indexer still runs)")
    p.add_argument("--skip-indexer", action="store_true",
                   help="with --topk-model: decode steps skip the model's indexer (its cost, measured as the "
                        "difference to a run with it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every figure to this file")
    p.add_argument("--png", default="bench_serving.png", help="the tokens/s against batch plot")
    p.add_argument("--smoke", action="store_true", help="tiny geometry on the CPU (checks this script end to end)")
    a = p.parse_args(argv)
    if a.smoke:
        a.contexts, a.block_size, a.steps, a.warmup, a.fill_chunk = "160", 4, 2, 1, 32
        a.host_gib, a.max_context = 1e-3, 4096
        a.gpu_kv_gib = 320 * 1024 / 2**30 if a.gpu_kv_gib is None else a.gpu_kv_gib
        a.dense_ffn_gb = a.dense_ffn_gb and 1e-4
    if a.gpu_kv_gib is None:
        a.gpu_kv_gib = 24.0
    if a.skip_indexer and a.topk_model == "indexer":
        print("bench_serving: --skip-indexer needs --topk-model benign or code (the indexer's choice is what "
              "--topk-model indexer attends)", file=sys.stderr)
        return 2
    device = "cpu" if a.smoke else "cuda"
    contexts = [int(x) for x in a.contexts.split(",")]
    asked = [int(x) for x in a.batches.split(",")] if a.batches else None
    modes = a.modes.split(",")
    geometry = TINY if a.smoke else GEOMETRY
    from transformers import DeepseekV32Config

    probe_cfg = DeepseekV32Config(num_hidden_layers=a.layers, **geometry)
    try:
        sizes = [sizes_for(probe_cfg, a.layers, t, a) for t in contexts]
        for s in sizes:
            check_sizes(s, asked)
    except BadSize as exc:
        print(f"bench_serving: {exc}", file=sys.stderr)
        return 2
    import transformers

    model = build_model(geometry, a.layers, max(s.max_context for s in sizes), device,
                        torch.float32 if a.smoke else torch.bfloat16, a.dense_ffn_gb)
    ffn = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".mlp." in n)
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    print(f"# transformers {transformers.__version__}, torch {torch.__version__}, {gpu}; {a.layers} layers, top-k "
          f"{model.config.index_topk}, block {a.block_size}; GPU KV budget {a.gpu_kv_gib:g} GiB, host pool <= "
          f"{a.host_gib:g} GiB; FFN weights {ffn / 1e9:.3g} GB; decode top-k from {a.topk_model}", flush=True)
    for s in sizes:
        print(f"# T={s.context}: largest batch hisparse {s.largest('hisparse')}, all-resident "
              f"{s.largest('all-resident')}, transformers {s.largest('transformers')}", flush=True)
    rows: list[dict[str, Any]] = []
    for s in sizes:
        for mode in modes:
            for b in batches_for(s, "hisparse" if mode == "replay" else mode, asked):
                t0 = time.perf_counter()
                if mode == "transformers":
                    r = run_static(model, s, b, a)
                elif mode == "replay":
                    r = run_replay_workload(a.layers, s, b, a, model.config.index_topk)
                else:
                    r = run_engine(model, s, b, a, resident=mode == "all-resident")
                r["wall_s"] = time.perf_counter() - t0
                rows.append(r)
                print(json.dumps(r), flush=True)
    print(table(rows))
    if a.png:
        plot(rows, a.png)
        print(f"# plot: {a.png}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
