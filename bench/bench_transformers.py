"""Long-context decode of a transformers DeepSeek-V3.2 model: hisparse against transformers alone.

Model: `DeepseekV32ForCausalLM` with DeepSeek-V3.2's real attention geometry (hidden 7168, 128
heads, q_lora 1536, kv_lora 512, rope 64, nope 128, v 128, indexer 64 heads x 128, top-k 2048),
`--layers` layers (default 4), a tiny FFN/MoE, random bf16 weights.

Workload: batch 1, 4 and 16 at contexts of 32K and 128K tokens. The model never prefills those
contexts (far too slow): both caches are filled with the same random latents and indexer keys,

- hisparse's through its own write path (engine steps of `--fill-chunk` tokens: resident pages,
  row mirrors to the host pool, spills, releases under the GPU budget), with the smallest GPU
  budget the engine accepts for the batch;
- transformers' `DynamicCache` as the model itself fills it (5.17/5.18 cache the expanded K/V,
  5.19+ the latent),

then `--steps` decode steps of the model are timed (CUDA events, median after `--warmup`), each
a real forward: the model's indexer over the whole context, then hisparse's resolve + gather and
absorbed attention over the 2048 rows, or transformers' dense masked attention over everything.
Decode feeds one constant token, so the query moves only by its position and the top-k drifts
slowly (the hit rate is printed: random keys give no more locality than that).

Figures, each next to transformers alone from the same run: step time, peak GPU memory, GPU KV per
request (hisparse: leased pages + indexer keys at the end; transformers: its cache tensors), and
hisparse's share of a step. hisparse's decode step replays a CUDA graph where it can
(`hisparse_transformers/graphs.py`; the engine's host work per step stays outside it, and is in
the step time): its share is hisparse's own kernels (the resolver, its miss copy and the
followers' replays; torch.profiler over replays) plus the attention's row gathers (the step's
gathers again, alone in a CUDA graph), against the whole step.
`--modes hisparse-eager` adds hisparse without graphs, with the eager breakdown (resolve, gather,
row mirrors and spills on the copy stream, indexer, attention; CUDA events, launch gaps
included). Both modes report the engine's host work per step in two parts: `host critical`, its
begin_step and end_step outside the planning ahead, and `host ahead`, end_step's planning of the
next decode step, which runs while the device runs this one (`EngineHostTime`). A configuration
that runs out of memory says OOM. A figure not measured (peak GPU memory on the CPU) is `-` in
the table and null in the JSON rows (stdout, `--json`).

Run (on a GPU):  python bench/bench_transformers.py [--layers 4] [--batches 1,4,16] [--contexts 32768,131072]
CPU smoke test:  python bench/bench_transformers.py --tiny
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

GEOMETRY = dict(hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
                kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, index_n_heads=64,
                index_head_dim=128, index_topk=2048)
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, index_n_heads=8, index_head_dim=16, index_topk=16)


def build_model(geometry: dict[str, int], layers: int, max_context: int, device: str, dtype: torch.dtype, *,
                ffn: dict[str, int] | None = None) -> Any:
    """The model with random weights; `ffn` overrides the tiny FFN's `intermediate_size` and
    `first_k_dense_replace` (dense layers before the MoE ones)."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    sizes = {"intermediate_size": 256, "first_k_dense_replace": 1, **(ffn or {})}
    config = DeepseekV32Config(vocab_size=1024, moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
                               n_shared_experts=1, n_group=1, topk_group=1, num_hidden_layers=layers,
                               max_position_embeddings=2 * max_context, pad_token_id=0, eos_token_id=None,
                               **sizes, **geometry)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    with torch.device(device):
        model = DeepseekV32ForCausalLM(config)
    return model.to(dtype).eval()


class Timers:
    """Named GPU intervals (CUDA events on the current or a given stream), summed per step."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.open: dict[str, list[Any]] = defaultdict(list)
        self.pairs: list[tuple[str, Any, Any]] = []

    def start(self, name: str, stream: Any = None) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record(stream)
        else:
            e = time.perf_counter()
        self.open[name].append(e)

    def stop(self, name: str, stream: Any = None) -> None:
        s = self.open[name].pop()
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record(stream)
        else:
            e = time.perf_counter()
        self.pairs.append((name, s, e))

    def wrap(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            self.start(name)
            try:
                return fn(*a, **k)
            finally:
                self.stop(name)
        return timed

    def collect(self) -> dict[str, float]:
        """Milliseconds per name since the last collect (synchronizes)."""
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, float] = defaultdict(float)
        for name, s, e in self.pairs:
            out[name] += s.elapsed_time(e) if self.cuda else 1e3 * (e - s)
        self.pairs.clear()
        return dict(out)


def random_rows(gen: torch.Generator, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def chunk_data(seed: int, layer: int, start: int, b: int, n: int, width: int, index_dim: int, device: torch.device,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The latent rows `[b, n, width]` and indexer keys `[b, n, index_dim]` of one layer and chunk:
    the same for both caches."""
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + layer * 10_007 + start)
    return random_rows(gen, (b, n, width), device, dtype), random_rows(gen, (b, n, index_dim), device, dtype)


def cache_kwarg(model: Any) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def caches_latent() -> bool:
    """transformers 5.19+ caches the MLA latent; 5.17/5.18 the expanded K/V."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return (major, minor) >= (5, 19)


def fill_transformers(model: Any, b: int, t: int, chunk: int, seed: int) -> Any:
    from transformers import DynamicCache

    cfg = model.config
    width, lora = cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank
    dev, dtype = model.device, model.dtype
    cache = DynamicCache(config=cfg)
    latent = caches_latent()
    for layer, dec in enumerate(model.model.layers):
        rows, keys = [], []
        for a in range(0, t, chunk):
            r, k = chunk_data(seed, layer, a, b, min(chunk, t - a), width, cfg.index_head_dim, dev, dtype)
            rows.append(r)
            keys.append(k)
        lat = torch.cat(rows, 1)
        del rows
        k_pass, k_rot = lat[..., :lora].unsqueeze(1), lat[..., lora:].unsqueeze(1)
        if latent:
            cache.update(k_pass.contiguous(), k_rot.contiguous(), layer)
        else:
            with torch.no_grad():
                key_states, value_states = dec.self_attn.expand_kv(k_pass, k_rot)
            cache.update(key_states, value_states, layer)
            del key_states, value_states
        del lat, k_pass, k_rot
        cache.update_indexer(torch.cat(keys, 1), layer)
    return cache


def transformers_cache_bytes(cache: Any) -> int:
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "indexer_keys"):
            x = getattr(layer, name, None)
            if isinstance(x, torch.Tensor):
                total += x.numel() * x.element_size()
    return total


def fill_hisparse(hs: Any, b: int, t: int, chunk: int, seed: int) -> Any:
    """Fill through hisparse's write path: engine steps of `chunk` tokens per request."""
    engine = hs.engine
    cfg = hs.model.config
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    dev, dtype = engine.device, engine.dtype
    ids = torch.randint(2, cfg.vocab_size, (b, t), generator=torch.Generator().manual_seed(seed))
    cache = hs.new_cache(ids)
    session = engine.open_session(cache.prompts[0], cache.prompts[1])
    cache.session = session
    ids_dev = ids.to(dev)
    for a in range(0, t, chunk):
        n = min(chunk, t - a)
        engine.begin_step(session, ids_dev[:, a:a + n], n)
        for layer in range(engine.layout.num_layers):
            rows, keys = chunk_data(seed, layer, a, b, n, width, cfg.index_head_dim, dev, dtype)
            group, pos = engine.layout.group_of(layer)
            engine.write_rows(group, pos, rows.reshape(b * n, width))
            cache.update_indexer(keys, layer)
        engine.end_step(session)
        cache.advance(n)
    return cache


def decode(model: Any, cache: Any, b: int, t: int, steps: int, warmup: int, timers: Timers) -> list[float]:
    key = cache_kwarg(model)
    dev = model.device
    token = torch.full((b, 1), 5, dtype=torch.long, device=dev)
    times = []
    with torch.no_grad():
        for i in range(warmup + steps):
            pos = torch.full((b, 1), t + i, dtype=torch.long, device=dev)
            timers.start("step")
            model(input_ids=token, position_ids=pos, use_cache=True, **{key: cache})
            timers.stop("step")
            ms = timers.collect()
            if i >= warmup:
                times.append(ms)
    return times


def instrument(hs: Any, timers: Timers) -> Callable[[], None]:
    """Time hisparse's parts of a step; returns the undo."""
    import hisparse_transformers.attention as attn

    saved = {name: getattr(attn, name) for name in ("_decode_rows", "_gather", "absorbed_attention")}
    attn._decode_rows = timers.wrap(saved["_decode_rows"], "resolve")
    attn._gather = timers.wrap(saved["_gather"], "gather")
    attn.absorbed_attention = timers.wrap(saved["absorbed_attention"], "attention")
    hooks = []
    for layer in hs.model.model.layers:
        idx = layer.self_attn.indexer
        hooks.append(idx.register_forward_pre_hook(lambda m, a: timers.start("indexer")))
        hooks.append(idx.register_forward_hook(lambda m, a, o: timers.stop("indexer")))
    engine = hs.engine
    worker = engine.worker
    after = worker.after_forward
    transfer = getattr(worker, "_engine", None)
    stream = getattr(transfer, "copy_stream", None) if timers.cuda else None

    def timed_after() -> None:
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        timers.start("mirror+spill (copy stream)", stream)
        after()
        timers.stop("mirror+spill (copy stream)", stream)

    worker.after_forward = timed_after
    engine._bench_host = host = EngineHostTime(hs)

    def undo() -> None:
        for name, fn in saved.items():
            setattr(attn, name, fn)
        for h in hooks:
            h.remove()
        del worker.after_forward
        host.undo()

    return undo


def median(times: list[dict[str, float]], name: str) -> float | None:
    """The median of `name` over the timed steps; None (JSON's null: not measured) where none was."""
    vals = [t.get(name, 0.0) for t in times]
    return statistics.median(vals) if vals else None


def peak_gib(dev: torch.device) -> float | None:
    """The device's peak allocation since the last reset, in GiB; None (JSON's null) where none is
    measured (a CPU has no such counter)."""
    return torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None


def run_transformers(model: Any, b: int, t: int, a: argparse.Namespace) -> dict[str, Any]:
    dev = model.device
    out: dict[str, Any] = {"mode": "transformers", "batch": b, "context": t}
    cache = None
    try:
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        cache = fill_transformers(model, b, t, a.fill_chunk, a.seed)
        out["kv_bytes_per_request"] = transformers_cache_bytes(cache) / b
        times = decode(model, cache, b, t, a.steps, a.warmup, Timers(dev))
        out["step_ms"] = median(times, "step")
        out["peak_gib"] = peak_gib(dev)
    except torch.OutOfMemoryError as exc:
        out["oom"] = str(exc).split(".")[0]
    finally:
        del cache
        free_device_memory(dev)
    return out


def close_hisparse(hs: Any, cache: Any, undo: Callable[[], None] | None = None) -> None:
    """The end of a hisparse run, however far it got (any of them may be None): undo the
    instrumentation, finish the cache's batch, close the handle."""
    if undo is not None:
        undo()
    if cache is not None:
        cache.finish()
    if hs is not None:
        hs.close()


def free_device_memory(device: torch.device) -> None:
    """Once a run has dropped its objects: collect them and give the device's cached memory back,
    so the next run starts from the same free memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def kernel_profile(model: Any, cache: Any, b: int, t: int, steps: int) -> dict[str, float]:
    """GPU kernel time per decode step by kind (ms), from torch.profiler over `steps` replays:
    hisparse's own kernels (the resolver, its miss copy and the followers' replays, all named
    hisparse_*) and all kernels; with the 16 that took longest, for the record."""
    from torch.profiler import ProfilerActivity, profile

    key = cache_kwarg(model)
    token = torch.full((b, 1), 5, dtype=torch.long, device=model.device)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            pos = torch.full((b, 1), t + i, dtype=torch.long, device=model.device)
            model(input_ids=token, position_ids=pos, use_cache=True, **{key: cache})
        torch.cuda.synchronize()
    out: dict[str, Any] = {"hisparse kernels": 0.0, "all kernels": 0.0, "top": []}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        if us is None:
            us = getattr(e, "cuda_time_total", 0.0)
        if not us:
            continue
        ms = us / 1e3 / steps
        name = e.key.lower()
        if "hisparse" in name:
            out["hisparse kernels"] += ms
        out["all kernels"] += ms
        out["top"].append((round(ms, 4), e.key[:90]))
    out["top"] = sorted(out["top"], reverse=True)[:16]
    return out


def row_gather_ms(hs: Any, b: int, replays: int = 50) -> float:
    """GPU time of one step's attention row gathers (every layer), in a CUDA graph of just them.

    They are stateless: the rows the last step's resolve wrote (`runtime.result.rows`, static
    buffers) are gathered again from the same layer caches, the step's exact work. The profiler
    cannot tell them from the model's other gather kernels by name."""
    engine = hs.engine
    outs: list[torch.Tensor] = []

    def gathers() -> None:
        outs.clear()
        for g, layers in enumerate(engine.layout.groups):
            rows = engine.worker.runtimes[g].result.rows[:b].to(torch.int64).clamp(min=0).view(-1)
            for pos in range(len(layers)):
                outs.append(engine.flat_layers[g][pos].index_select(0, rows))

    gathers()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gathers()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def run_hisparse(model: Any, b: int, t: int, a: argparse.Namespace, *, graphs: bool = True) -> dict[str, Any]:
    import hisparse_transformers
    from hisparse_transformers.engine import required_gpu_blocks
    from hisparse_transformers.kv_rows import row_format_for

    cfg = model.config
    dev = model.device
    out: dict[str, Any] = {"mode": "hisparse" if graphs else "hisparse-eager", "batch": b, "context": t}
    bs, top_k = a.block_size, cfg.index_topk
    hot_rows = a.hot_rows or -(-2 * top_k // bs) * bs
    fmt = row_format_for(model.dtype, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    block_bytes = cfg.num_hidden_layers * bs * fmt.row_bytes
    profiled = 3 if graphs and dev.type == "cuda" else 0
    max_context = t + a.warmup + a.steps + profiled + bs
    blocks = required_gpu_blocks(b, hot_rows // bs, -(-a.fill_chunk // bs) + 1)
    pages = -(-max_context // bs)
    host_gib = (b * (pages + 4) + 8) * block_bytes / 2**30
    hs = cache = undo = None
    try:
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        hs = hisparse_transformers.enable(model, host_pool_gib=host_gib, gpu_kv_gib=blocks * block_bytes / 2**30,
                                          backend=a.backend, hot_rows=hot_rows, block_size=bs, max_batch=b,
                                          max_context=max_context, prefill_chunk=a.fill_chunk,
                                          cuda_graphs=None if graphs else False)
        t0 = time.perf_counter()
        cache = fill_hisparse(hs, b, t, a.fill_chunk, a.seed)
        out["fill_s"] = time.perf_counter() - t0
        hs.stats()                                      # reset the device counters' window
        timers = Timers(dev)
        if hs.graphs.enabled:
            host = EngineHostTime(hs)
        else:
            undo = instrument(hs, timers)
            host = hs.engine._bench_host
        host.reset()
        times = decode(model, cache, b, t, a.steps, a.warmup, timers)
        out["step_ms"] = median(times, "step")
        out["host_critical_ms"], out["host_ahead_ms"] = host.per_step_ms(a.steps + a.warmup)
        out["peak_gib"] = peak_gib(dev)
        s = hs.stats()
        out["decode_mode"], out["graph_captures"] = s.decode_mode, s.graph_captures
        if hs.graphs.enabled and profiled:
            k = kernel_profile(model, cache, b, t + a.warmup + a.steps, profiled)
            out["resolve_ms"], out["kernels_ms"] = k["hisparse kernels"], k["all kernels"]
            out["top_kernels"] = k["top"]
            out["gather_ms"] = row_gather_ms(hs, b)
        elif not hs.graphs.enabled:
            for name in ("resolve", "gather", "mirror+spill (copy stream)", "indexer", "attention"):
                out[f"{name}_ms"] = median(times, name)
        leased = hs.engine.gpu.num_leased_blocks
        out["kv_bytes_per_request"] = (leased * block_bytes + cache.indexer_bytes) / b
        out["pool_bytes_per_request"] = (blocks * block_bytes + cache.indexer_bytes) / b
        s = hs.stats()
        out.update(hit_rate=s.hit_rate, misses=s.misses, h2d_bytes=s.h2d_bytes, released_pages=s.released_pages)
    except torch.OutOfMemoryError as exc:
        out["oom"] = str(exc).split(".")[0]
    finally:
        close_hisparse(hs, cache, undo)
        del cache, hs
        free_device_memory(dev)
    return out


class EngineHostTime:
    """Host seconds of the engine's step work, in two parts:

    - `critical`: `begin_step` and `end_step` less the planning below: the step's own work (its
      plan when it was not planned ahead, the worker's step, the acknowledgements);
    - `ahead`: `end_step`'s planning of the next decode step (`_plan_next`, StepAhead in
      `hisparse_core.coordinator.ahead`), which runs once this step's forward is launched, so the
      device runs this step meanwhile.

    Patched on the engine instance (the handle's close drops the engine; `undo` restores it)."""

    def __init__(self, hs: Any) -> None:
        self.engine = engine = hs.engine
        self.steps_s = 0.0   # begin_step + end_step, planning ahead included
        self.ahead_s = 0.0
        begin, end, plan = engine.begin_step, engine.end_step, engine._plan_next

        def timed(fn: Callable[..., Any], field: str) -> Callable[..., Any]:
            def run(*a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    setattr(self, field, getattr(self, field) + time.perf_counter() - t0)
            return run

        engine.begin_step, engine.end_step = timed(begin, "steps_s"), timed(end, "steps_s")
        engine._plan_next = timed(plan, "ahead_s")

    def reset(self) -> None:
        self.steps_s = self.ahead_s = 0.0

    def per_step_ms(self, steps: int) -> tuple[float, float]:
        """(critical, ahead) ms per step over `steps` steps since the last `reset`."""
        return 1e3 * (self.steps_s - self.ahead_s) / steps, 1e3 * self.ahead_s / steps

    def undo(self) -> None:
        del self.engine.begin_step, self.engine.end_step, self.engine._plan_next


def fmt_ms(x: Any, spec: str = ".2f") -> str:
    """`x` to `spec`; "-" where it was not measured (None, or NaN)."""
    return "-" if x is None or x != x else f"{x:{spec}}"


def config_label(batch: int, context: int) -> str:
    """`B=8 T=32K`; a context below 1K in tokens (--tiny's 256 read `T=0K`)."""
    return f"B={batch} T={context // 1024}K" if context >= 1024 and not context % 1024 else f"B={batch} T={context}"


def table(rows: list[dict[str, Any]]) -> str:
    from hisparse_core.replay.report import human_bytes, render_grid

    by = {(r["batch"], r["context"], r["mode"]): r for r in rows}
    configs = sorted({(r["batch"], r["context"]) for r in rows}, key=lambda x: (x[1], x[0]))

    def ms(r: dict[str, Any]) -> str:
        return "OOM" if "oom" in r else fmt_ms(r.get("step_ms"))

    body = []
    for b, t in configs:
        h, e, base = (by.get((b, t, m), {}) for m in ("hisparse", "hisparse-eager", "transformers"))
        speed = (f"{base['step_ms'] / h['step_ms']:.1f}x" if h.get("step_ms") and base.get("step_ms") is not None else
                 ("tf OOM" if "oom" in base else "-"))
        kv = (f"{100 * h['kv_bytes_per_request'] / base['kv_bytes_per_request']:.1f}%"
              if "kv_bytes_per_request" in h and "kv_bytes_per_request" in base else "-")
        share = (f"{100 * (h['resolve_ms'] + h['gather_ms']) / h['step_ms']:.1f}%"
                 if h.get("step_ms") and h.get("resolve_ms") is not None and h.get("gather_ms") is not None
                 else "-")
        body.append([config_label(b, t), ms(h), ms(e) if e else "-", ms(base) if base else "-", speed,
                     fmt_ms(h.get("peak_gib"), ".1f"), "OOM" if "oom" in base else fmt_ms(base.get("peak_gib"), ".1f"),
                     human_bytes(h["kv_bytes_per_request"]) if "kv_bytes_per_request" in h else "-",
                     human_bytes(base["kv_bytes_per_request"]) if "kv_bytes_per_request" in base else "-", kv,
                     fmt_ms(h.get("resolve_ms")), fmt_ms(h.get("gather_ms")), fmt_ms(h.get("kernels_ms")),
                     fmt_ms(h.get("host_critical_ms")), fmt_ms(h.get("host_ahead_ms")), share,
                     "-" if "hit_rate" not in h else f"{100 * h['hit_rate']:.0f}%", h.get("decode_mode", "-")])
    header = ["config", "hs ms", "hs eager ms", "tf ms", "speedup", "hs GiB", "tf GiB", "hs KV/req", "tf KV/req",
              "KV %", "hs kernels", "row gather", "all kernels", "host critical", "host ahead", "res+gat %", "hit",
              "hs decode"]
    out = render_grid(header, body)
    eager = [(b, t, by[(b, t, "hisparse-eager")]) for b, t in configs if "step_ms" in by.get((b, t, "hisparse-eager"), {})]
    if eager:
        names = ("resolve", "gather", "mirror+spill (copy stream)", "indexer", "attention", "host_critical",
                 "host_ahead")
        out += "\n\nhisparse eager, GPU timeline per step (ms, CUDA events around each part, launch gaps included)\n"
        out += render_grid(["config", *(n.replace("_", " ") for n in names)],
                           [[config_label(b, t), *(fmt_ms(r.get(f"{n}_ms")) for n in names)] for b, t, r in eager])
    out += ("\n\nhost critical: the engine's host ms per step outside the planning ahead (begin_step, end_step's "
            "acknowledgements and bookkeeping)\nhost ahead: end_step's planning of the next decode step, which runs "
            "after this step's forward is launched, while the device runs it (hisparse_core.coordinator.ahead)")
    return out



MODES = ("hisparse", "hisparse-eager", "transformers")
#: What --tiny sets (a tiny geometry on the CPU) where the flag is not given, and the defaults without it.
TINY_ARGS = {"batches": [1, 2], "contexts": [256], "block_size": 4, "steps": 3, "warmup": 1, "fill_chunk": 32}
DEFAULTS = {"batches": [1, 4, 16], "contexts": [32768, 131072], "block_size": 64, "steps": 10, "warmup": 3,
            "fill_chunk": 256}


def options(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, every one checked (one line and exit 2 for a bad one), --tiny's values filling
    only those not given."""
    from hisparse_core.cli.options import (
        MAX_BLOCK_SIZE,
        MAX_LAYERS,
        MAX_REQUESTS,
        MAX_SEED,
        MAX_STEPS,
        MAX_TOKENS,
        CliParser,
        check_backend_name,
        check_output_path,
        int_in,
        int_list_in,
    )
    from hisparse_core.geometry import MAX_HOT_ROWS

    def modes(text: str) -> list[str]:
        if not text or not set(text.split(",")) <= set(MODES):
            raise argparse.ArgumentTypeError(f"expected comma-separated modes of {', '.join(MODES)}, got {text!r}")
        return text.split(",")

    d = DEFAULTS
    p = CliParser(prog="bench_transformers", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int_in(1, MAX_LAYERS), default=4)
    p.add_argument("--batches", type=int_list_in(1, MAX_REQUESTS), help="default: 1,4,16")
    p.add_argument("--contexts", type=int_list_in(1, MAX_TOKENS), help="default: 32768,131072")
    p.add_argument("--steps", type=int_in(1, MAX_STEPS), help=f"default: {d['steps']}")
    p.add_argument("--warmup", type=int_in(0, MAX_STEPS), help=f"default: {d['warmup']}")
    p.add_argument("--block-size", type=int_in(1, MAX_BLOCK_SIZE), help=f"default: {d['block_size']}")
    p.add_argument("--hot-rows", type=int_in(0, MAX_HOT_ROWS), default=0, help="0: 2x top-k")
    p.add_argument("--fill-chunk", type=int_in(1, MAX_TOKENS),
                   help=f"tokens per fill step (also the engine's prefill chunk; default: {d['fill_chunk']})")
    p.add_argument("--backend", default="auto")
    p.add_argument("--modes", type=modes, default="hisparse,transformers",
                   help="of hisparse (decode captured in CUDA graphs where it can be), hisparse-eager, transformers")
    p.add_argument("--seed", type=int_in(0, MAX_SEED), default=0)
    p.add_argument("--json", help="write every figure to this file")
    p.add_argument("--tiny", action="store_true",
                   help="tiny geometry on the CPU (a smoke test of this script); flags given override its values")
    a = p.parse_args(argv)
    for key, value in (TINY_ARGS if a.tiny else DEFAULTS).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.hot_rows % a.block_size:
        p.error(f"argument --hot-rows: expected 0 (2x top-k) or a multiple of --block-size {a.block_size}, "
                f"got {a.hot_rows}")
    if a.json and (why := check_output_path("--json", a.json)):
        p.exit(2, f"bench_transformers: error: {why} (see bench_transformers --help)\n")
    if a.backend != "auto" and (why := check_backend_name(a.backend)):
        p.exit(2, f"bench_transformers: error: {why}\n")
    return a


def main(argv: list[str] | None = None) -> int:
    from hisparse_core.replay.report import json_safe

    a = options(argv)
    if not a.tiny and not torch.cuda.is_available():  # build_model's AssertionError (no CUDA) was a traceback
        print("bench_transformers: error: needs a CUDA GPU (this torch sees none); expected --tiny for the tiny "
              "geometry on the CPU", file=sys.stderr)
        return 2
    device = "cpu" if a.tiny else "cuda"
    batches, contexts, modes = a.batches, a.contexts, a.modes
    import transformers

    model = build_model(TINY if a.tiny else GEOMETRY, a.layers, max(contexts) + 64, device,
                        torch.float32 if a.tiny else torch.bfloat16)
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    print(f"# transformers {transformers.__version__}, torch {torch.__version__}, {gpu}; {a.layers} layers, "
          f"top-k {model.config.index_topk}, block {a.block_size}, fill chunk {a.fill_chunk}; transformers caches "
          f"{'the latent' if caches_latent() else 'expanded K/V'}; MoE experts "
          f"{getattr(model.config, '_experts_implementation', None) or 'default'}", flush=True)
    rows = []
    for t in contexts:
        for b in batches:
            for mode in modes:
                t0 = time.perf_counter()
                if mode == "transformers":
                    r = run_transformers(model, b, t, a)
                else:
                    r = run_hisparse(model, b, t, a, graphs=mode == "hisparse")
                r["wall_s"] = time.perf_counter() - t0
                rows.append(r := json_safe(r))   # a figure not measured (NaN) is null: JSON has no NaN
                print(json.dumps(r, allow_nan=False), flush=True)
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1, allow_nan=False)
    return 0


if __name__ == "__main__":
    from hisparse_core.cli.options import run_script

    raise SystemExit(run_script(main))
