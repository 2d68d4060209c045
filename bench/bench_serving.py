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
weights: low locality; n/a where no entry went through the hot buffer: all-resident, or every page
resident), `H2D MB/step` the host-to-device bytes a step read. `--topk-model benign|code`
takes the engine modes' decode top-k from the calibrated per-layer locality model of that regime
(`enable(synthetic_topk=...)`, `hisparse_transformers.model_topk`; the indexer still runs, so its
cost stays in the step), instead of the random-weight indexer's choice; `--skip-indexer` leaves
the indexer out of those steps, so the difference in step time is the model's own indexer's cost.
The replay's calibrated indexer (`hisparse run`: the published locality, about 81% hits at 2x
top-k) runs the same batches (`replay` rows: hit rate and the decode step's device time).

Issue 42's runs (steady state, all in one run): `--warmup` decode steps run untimed before the
`--steps` timed ones, and every figure of an engine row (step, host critical/ahead ms, hits,
misses, H2D and D2H MB per step) is of the timed steps only (the locality models' LRU hit rate
is steady from the 5th step). `--contexts` takes several contexts; `--batches` takes `max`
(hisparse's largest at each context) and `budget` (all-resident's largest at the fixed budget);
`--all-resident-gib` gives all-resident a larger budget, so it runs at hisparse's batches too (the
offloading cost at the same batch; such rows say `within_budget: false`, and the best-throughput
gain counts only rows within the fixed budget). `--resident-layers none/auto` runs every hisparse
row without and with resident layers (`enable(resident_layers=...)`; `auto`: under the code
regime the layers standing for reference layers 0-1, the log says which and why; rows labelled
`code+resident0`). `--indexer-share max` adds rows at each mode's largest batch (hisparse's, and
all-resident's at the fixed budget) with the model's indexer left out of the decode steps
(`<regime>-no-indexer`): the indexer is the whole `indexer` module of every index group's leader
(its projections, the bf16 key store on the GPU and the fp32 scoring over the whole context with
its top-k), so the step difference and the gain without it are its measured share.
`--prefetch-next-group` runs every hisparse row with `enable(prefetch_next_group=True)` (the next
index group's resolve on this group's top-k, its copies overlapping this group's attention; rows
labelled `code+prefetch`); `--prefetch-next-group off/on` runs each without and with it. Such rows
also give the prefetches' own misses and H2D bytes apart (`prefetch misses/MB per step`): the
misses and H2D columns count both, the critical path's are the difference (`critical_*` in JSON).
`--prefetch-next-group auto` prefetches from every layer but the regime's poor ones (under code the
layers standing for reference layers 0-1: their top-k predicts the next layer's no better than their
own next step's, so prefetching from them copies rows nobody reads; rows labelled
`code+prefetch-from1,2`; the same rows as `on` where no layer is poor); `off/on/auto` runs all three.
`--resident-stores outside` puts the resident layers' stores on top of `--gpu-kv-gib` instead of
inside it, so a resident alternative runs at hisparse's batches without resident layers (`max` is
that largest; rows labelled `code+resident0-outside`, JSON `resident_stores_outside_budget_gib`:
their memory is the budget plus that); `inside/outside` runs each resident alternative both ways.
Under `max` all-resident also runs at each inside alternative's largest batch (same-batch ratios).
`--reference-layers` says which reference layers of the 61-layer locality profile the model's
layers stand for (`enable(synthetic_topk_layers=...)`): `spread` (the default, 0/20/40/60 for 4
layers: neighbours 20 layers apart, so a group's top-k predicts little of the next one's) or an
ascending list such as `20,21,22,23` (adjacent layers of the plateau band, whose top-k overlap
87-90% as a real model's neighbours do: what the prefetch sees on a real model); `spread/20,21,22,23`
runs every hisparse row under each (rows labelled `code+ref20,21,22,23`; JSON `reference_layers`).

`--indexer-keys fp8` stores the engine modes' indexer keys as DeepSeek-V3.2 does (e4m3 with an fp32
scale per 128 values: 132 bytes a token a layer against bf16's 256; `enable(indexer_keys="fp8")`,
scored dequantized), in both modes, so each holds more requests at the budget; `fp8/model` runs
every engine row under each format, each with its own largest batches (rows labelled
`<regime>:fp8`). For each context and format the log prints, once, what sets each mode's largest
batch at the budget: the keys, hisparse's per-request blocks (hot buffer, active tail, and the
pages a request writes in a step, which `--fill-chunk` sets), all-resident's pages and the same
engine minimum, and the capacity against pages and keys only.

`--kv-rows fp8` stores the engine modes' latent rows as DeepSeek-V3.2 is served (FlashMLA's
fp8_ds_mla: e4m3 values with an fp32 scale per 128, the roped part in bf16: 656 bytes a token a
layer against bf16's 1,152; `enable(kv_rows="fp8")`, read dequantized), in both modes, so a page
is smaller and every miss copies 57% of the bytes; `fp8/model` runs every engine row under each
(rows labelled `<regime>:fp8-rows`).

Bad sizes (a budget that cannot hold one request, a batch the host pool cannot hold, a context
past `--max-context`) are one line naming the value and what fits, before anything is allocated.

Run (on a GPU):  python bench/bench_serving.py --layers 4 --contexts 32768,131072 --gpu-kv-gib 24 --png serving.png
                 python bench/bench_serving.py --layers 4 --dense-ffn-gb 4.6 ...
CPU smoke test:  python bench/bench_serving.py --smoke
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
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
    resident_budget: int        # all-resident's budget (--all-resident-gib; default the same)
    layers: int = 0
    row_bytes: int = 0
    resident_layers: tuple[int, ...] = ()    # hisparse's layers kept whole on the GPU (--resident-layers)
    stores_outside: bool = False             # their stores come on top of the budget (--resident-stores outside)
    indexer_keys: str = "model"              # how the engine modes store the indexer keys (--indexer-keys)
    kv_rows: str = "model"                   # how the engine modes store the latent rows (--kv-rows)

    @property
    def hs_block_bytes(self) -> int:
        """A hisparse block: one page of the layers through hisparse (the resident ones have stores)."""
        return self.block_bytes * (self.layers - len(self.resident_layers)) // self.layers

    def store_bytes(self, b: int) -> int:
        """The resident layers' stores at batch `b` (`enable(resident_layers=...)`: max_batch x max_context rows)."""
        return len(self.resident_layers) * b * self.pages * (self.block_bytes // self.layers)

    def budget_store_bytes(self, b: int) -> int:
        """The part of the stores the budget pays for (none under --resident-stores outside)."""
        return 0 if self.stores_outside else self.store_bytes(b)

    def with_resident(self, layers: tuple[int, ...], outside: bool = False) -> Sizes:
        from dataclasses import replace

        return replace(self, resident_layers=layers, stores_outside=outside and bool(layers))

    def largest_batch(self) -> int:
        """hisparse's largest batch (`max`): with the stores outside the budget, that of hisparse without
        resident layers (so a resident alternative is timed at the same batches)."""
        base = self.with_resident(()) if self.stores_outside else self
        return base.largest("hisparse")

    def fits_budget(self, b: int) -> bool:
        """Whether all-resident holds batch `b` at the fixed budget (`--gpu-kv-gib`)."""
        from dataclasses import replace

        return replace(self, resident_budget=self.budget).fits("all-resident", b)

    def hisparse_blocks(self, b: int) -> int:
        from hisparse_transformers.engine import required_gpu_blocks

        return required_gpu_blocks(b, self.hot_blocks, self.chunk_pages)

    def resident_blocks(self, b: int) -> int:
        return b * self.pages + self.hisparse_blocks(b)

    def fits(self, mode: str, b: int) -> bool:
        kv = self.budget - b * self.indexer_bytes
        if mode == "hisparse":
            return (kv >= self.hisparse_blocks(b) * self.hs_block_bytes + self.budget_store_bytes(b)
                    and b * (self.pages + 2) + 1 <= self.host_blocks)
        if mode == "all-resident":
            kv = self.resident_budget - b * self.indexer_bytes
            return kv >= self.resident_blocks(b) * self.block_bytes and b * (self.pages + 2) + 1 <= self.host_blocks
        return b * self.static_bytes <= self.budget

    def largest(self, mode: str, limit: int = 1 << 14) -> int:
        b = 0
        while b < limit and self.fits(mode, b + 1):
            b += 1
        return b

    def capacity_line(self, fill_chunk: int, key_bytes: dict[str, int]) -> str:
        """What sets each mode's largest batch at the fixed budget (`--gpu-kv-gib`), in words and MiB.
        `key_bytes`: bytes of one token's key in one layer, per --indexer-keys format."""
        from dataclasses import replace

        from hisparse_transformers.engine import ACTIVE_TAIL_PAGES, pressure_watermark

        mib = 2**20
        fixed = replace(self, resident_budget=self.budget)
        hs, ar = fixed.largest("hisparse"), fixed.largest("all-resident")
        per_hs = self.hisparse_blocks(2) - self.hisparse_blocks(1)          # blocks a further request adds
        once = pressure_watermark(1, self.hot_blocks, self.chunk_pages) - self.chunk_pages
        pages_only = self.budget // (self.pages * self.block_bytes + self.indexer_bytes)
        others = ", ".join(f"{k} {v} B" for k, v in key_bytes.items() if k != self.indexer_keys)
        return (f"# capacity at T={self.context}, {self.budget / 2**30:g} GiB, latent rows {self.kv_rows} "
                f"({self.row_bytes} B a token a layer), indexer keys {self.indexer_keys} "
                f"({key_bytes[self.indexer_keys]} B a token a layer; {others}): {self.indexer_bytes / mib:.1f} MiB of "
                f"keys a request, on the GPU in both modes. hisparse a request: hot buffer {self.hot_blocks} + active "
                f"tail {ACTIVE_TAIL_PAGES} + 3 x {self.chunk_pages} recent pages + {self.chunk_pages} of watermark "
                f"(--fill-chunk {fill_chunk}: {self.chunk_pages} pages a request writes in a step) = {per_hs} blocks of "
                f"{self.hs_block_bytes / 1024:g} KiB ({per_hs * self.hs_block_bytes / mib:.1f} MiB) + keys "
                f"= {(per_hs * self.hs_block_bytes + self.indexer_bytes) / mib:.1f} MiB, and {once} blocks of watermark "
                f"once -> {hs}; all-resident a request: {self.pages} pages + the engine's same {per_hs}-block minimum "
                f"(never leased: no page is released) = {(self.pages + per_hs) * self.block_bytes / mib:.1f} MiB + keys "
                f"-> {ar}; capacity {hs / ar if ar else float('inf'):.2f}x (against pages and keys only, as an engine "
                f"without that minimum holds: {pages_only}, {hs / pages_only if pages_only else float('inf'):.2f}x)")


def sizes_for(model_cfg: Any, layers: int, context: int, a: argparse.Namespace, keys: str = "model",
              rows: str = "model") -> Sizes:
    from hisparse_transformers.engine import chunk_pages_for
    from hisparse_transformers.index_keys import bytes_per_key
    from hisparse_transformers.kv_rows import LatentRows

    bs, top_k = a.block_size, model_cfg.index_topk
    width = model_cfg.kv_lora_rank + model_cfg.qk_rope_head_dim
    elem = 4 if a.smoke else 2
    fmt = LatentRows.of(rows, torch.float32 if a.smoke else torch.bfloat16, model_cfg.kv_lora_rank,
                        model_cfg.qk_rope_head_dim).fmt
    max_context = context + a.warmup + a.steps + 3 + bs
    if max_context > a.max_context:
        room = a.max_context - (max_context - context)
        raise BadSize(f"context {context} (+ {max_context - context} decode and alignment tokens: --warmup "
                      f"{a.warmup} + --steps {a.steps} + 3 + --block-size {bs}) exceeds --max-context={a.max_context}: "
                      "expected " + (f"contexts <= {room} or " if room > 0 else "") + f"--max-context >= {max_context}")
    hot_rows = a.hot_rows or -(-2 * top_k // bs) * bs
    block_bytes = layers * bs * fmt.row_bytes
    idx = layers * context * bytes_per_key(keys, model_cfg.index_head_dim, elem)
    static = (context + a.warmup + a.steps + 8) * layers * (width * elem + model_cfg.index_head_dim * elem)
    return Sizes(context, max_context, block_bytes, -(-max_context // bs), hot_rows // bs,
                 chunk_pages_for(a.fill_chunk, max_context, bs),
                 idx, static, int(a.host_gib * 2**30) // block_bytes - 1, int(a.gpu_kv_gib * 2**30),
                 int((a.all_resident_gib or a.gpu_kv_gib) * 2**30), layers, fmt.row_bytes, indexer_keys=keys,
                 kv_rows=rows)


def batches_for(s: Sizes, mode: str, asked: list[int] | None, also_max: tuple[int, ...] = ()) -> list[int]:
    """The batches `mode` runs at this context: `asked` (0 standing for hisparse's largest, `max`, and
    then for `also_max` too, the largest of hisparse's resident-layer alternatives, so that all-resident
    runs at their batches as well; -1 for all-resident's largest at the fixed budget, `budget`) that
    fit, else powers of two up to the mode's largest and that largest itself."""
    top = s.largest(mode)
    if asked is not None:
        fixed = max((x for x in range(1, s.largest("all-resident") + 1) if s.fits_budget(x)), default=0)
        want = {s.largest_batch() if b == 0 else fixed if b == -1 else b for b in asked}
        if 0 in asked:
            want |= set(also_max)
        return sorted(b for b in want if 0 < b <= top)
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
        big = [b for b in asked if b > top and b > 0]
        if big:
            host_top = (s.host_blocks - 1) // (s.pages + 2)
            raise BadSize(f"batch {big[0]} at context {s.context} fits no mode: the host pool (--host-gib) holds "
                          f"{host_top} requests of {s.max_context} tokens and the GPU budget at most {top} in any "
                          f"mode; expected --batches <= {top}")


@dataclass(frozen=True)
class Plan:
    """The run's lists, validated before anything is built (`parse_plan`)."""

    contexts: list[int]
    batches: list[int] | None           # 0: hisparse's largest at each context ('max')
    modes: list[str]
    resident: list[tuple[int, ...]]     # hisparse's resident-layer alternatives, in order, distinct
    resident_why: str
    indexer_share: list[int] | None     # batches (0: 'max') also run without the indexer; None: every batch
    share_contexts: list[int] | None    # the contexts those rows run at (None: every context)
    references: list[list[int]]         # reference layers the model's layers stand for, per alternative
    resident_by_ref: list[list[tuple[int, ...]]]  # hisparse's resident alternatives under each of them
    keys: list[str]                     # --indexer-keys alternatives, in order, distinct
    rows: list[str]                     # --kv-rows alternatives, in order, distinct


def _ints(flag: str, text: str, *, allow_max: bool = False, allow_all: bool = False) -> list[int] | None:
    out: list[int] = []
    for part in (x.strip() for x in text.split(",")):
        if allow_max and part == "max":
            out.append(0)
        elif allow_max and part == "budget":
            out.append(-1)
        elif allow_all and part == "all":
            return None
        elif part.isdigit() and int(part) > 0:
            out.append(int(part))
        else:
            extra = ", 'max' or 'budget'" if allow_max else ""
            extra += " or 'all'" if allow_all else ""
            raise BadSize(f"{flag}={text!r}: {part!r} is not a positive int{extra}; expected a comma list")
    return out


def poor_layers(refs: list[int], regime_name: str) -> tuple[int, ...]:
    """The model's layers whose top-k barely repeats step to step under `regime_name`: under code those
    standing for reference layers 0-1 of 61 (GVR: about 1.5% consecutive overlap); none otherwise."""
    return tuple(i for i, ref in enumerate(refs) if ref < 2) if regime_name == "code" else ()


def prefetch_sources(spec: str, refs: list[int], regime_name: str) -> bool | tuple[int, ...]:
    """--prefetch-next-group's alternative `spec` as enable takes it: off False, on True, auto the
    groups (one layer each) whose successor is worth prefetching, every one but the poor layers (their
    top-k predicts the next layer's no better than their own next step's; bench_prefetch_locality.py
    measures what prefetching from them costs); True where that is every group."""
    if spec != "auto":
        return spec == "on"
    poor = poor_layers(refs, regime_name)
    sources = tuple(g for g in range(len(refs) - 1) if g not in poor)
    return True if len(sources) == len(refs) - 1 else sources


def prefetch_label(sources: bool | tuple[int, ...]) -> str:
    """A hisparse row's top-k label suffix for its prefetch ('+prefetch': every group; '+prefetch-from1,2')."""
    if sources is False:
        return ""
    return "+prefetch" if sources is True else "+prefetch-from" + ",".join(map(str, sources))


def resident_alternatives(spec: str, layers: int, regime_name: str,
                          refs: list[int] | None = None) -> tuple[list[tuple[int, ...]], str]:
    """--resident-layers: its '/'-separated alternatives as layer tuples (distinct, in order), and
    the line saying what 'auto' chose and why (the layers standing for `refs`; default spread)."""
    from hisparse_core.errors import InvalidInputError
    from hisparse_core.replay.locality import reference_layers
    from hisparse_core.residency import parse_resident_layers

    refs = reference_layers(list(range(layers)), layers) if refs is None else refs
    poor = poor_layers(refs, regime_name)
    why = ""
    out: list[tuple[int, ...]] = []
    for alt in spec.split("/"):
        alt = alt.strip()
        if alt == "none":
            chosen: tuple[int, ...] = ()
        elif alt == "auto":
            chosen = poor
            why = (f"--resident-layers auto under --topk-model code: layers {list(poor)} (standing for the reference "
                   "layers 0-1 of 61, whose top-k overlaps about 1.5% step to step, GVR) kept whole on the GPU"
                   if poor else f"--resident-layers auto under --topk-model {regime_name}: none (no layer of that "
                   f"regime standing for reference layers {refs} is below the hot buffer's reach)")
        else:
            try:
                chosen = parse_resident_layers(alt, layers)
            except InvalidInputError as exc:
                raise BadSize(f"--resident-layers={spec!r}: {exc}; expected 'none', 'auto' or a comma list of "
                              f"layers in [0, {layers}), alternatives separated by '/'") from None
        if len(chosen) >= layers:
            raise BadSize(f"--resident-layers={spec!r} keeps all {layers} layers resident; expected at most "
                          f"{layers - 1} (all-resident is --modes all-resident)")
        if chosen not in out:
            out.append(chosen)
    return out, why


def parse_plan(a: argparse.Namespace) -> Plan:
    """Every list flag checked before anything is built: one line naming the flag (`BadSize`)."""
    from hisparse_core.cli.options import MAX_SEED, check_backend_name
    from hisparse_core.errors import InvalidInputError
    from hisparse_core.geometry import MAX_HOT_ROWS
    from hisparse_transformers.index_keys import check_key_format
    from hisparse_transformers.kv_rows import check_row_kind

    contexts = _ints("--contexts", a.contexts)
    assert contexts is not None
    batches = _ints("--batches", a.batches, allow_max=True) if a.batches is not None else None
    modes = [m.strip() for m in (",".join(MODES) + ",replay" if a.modes is None else a.modes).split(",")]
    bad = [m for m in modes if m not in MODES + ("replay",)]
    if bad:
        raise BadSize(f"--modes={a.modes!r}: {bad[0]!r} is not a mode; expected a comma list of "
                      f"{', '.join(MODES + ('replay',))}")
    if a.steps <= 0 or a.warmup < 0:
        raise BadSize(f"--steps={a.steps} --warmup={a.warmup}: expected --steps >= 1 and --warmup >= 0")
    if a.all_resident_gib is not None and not 0 < a.all_resident_gib < math.inf:
        raise BadSize(f"--all-resident-gib={a.all_resident_gib:g}: expected a positive number of GiB")
    if not math.isfinite(a.gpu_kv_gib):
        raise BadSize(f"--gpu-kv-gib={a.gpu_kv_gib:g}: expected a number of GiB")
    if not 0 <= a.seed <= MAX_SEED:  # a larger one overflowed torch's manual_seed once the model was built
        raise BadSize(f"--seed={a.seed}: expected a seed in [0, {MAX_SEED}]")
    if a.layers < 1:
        raise BadSize(f"--layers={a.layers}: expected >= 1")
    if a.fill_chunk < 1:
        raise BadSize(f"--fill-chunk={a.fill_chunk}: expected a positive number of prompt tokens a forward")
    if a.block_size < 1:
        raise BadSize(f"--block-size={a.block_size}: expected a positive number of tokens a page")
    if not 0 < a.host_gib < math.inf or a.max_context < 1:
        raise BadSize(f"--host-gib={a.host_gib:g} --max-context={a.max_context}: expected both positive (and finite)")
    if a.hot_rows:      # 0: 2x top-k; else whole pages, at least one step's top-k, at most a runtime's limit
        top_k = (TINY if a.smoke else GEOMETRY)["index_topk"]
        if a.hot_rows < 0 or a.hot_rows % a.block_size or not top_k <= a.hot_rows <= MAX_HOT_ROWS:
            raise BadSize(f"--hot-rows={a.hot_rows}: expected 0 (2x top-k) or a multiple of --block-size "
                          f"{a.block_size} in [{top_k} (the model's top-k), {MAX_HOT_ROWS}]")
    if set(modes) & {"hisparse", "all-resident", "replay"}:      # the modes that run a hisparse backend
        why = check_backend_name(None if a.backend in (None, "auto") else a.backend)
        if why:
            raise BadSize(why)
    references = reference_alternatives(a.reference_layers, a.layers, a.topk_model)
    resident_by_ref: list[list[tuple[int, ...]]] = []
    whys: list[str] = []
    for refs in references:
        alts, why = resident_alternatives(a.resident_layers, a.layers, a.topk_model, refs)
        resident_by_ref.append(alts)
        if why and why not in whys:
            whys.append(why)
    resident = list(dict.fromkeys(x for alts in resident_by_ref for x in alts))
    why = "; ".join(whys)
    spec, share_contexts = a.indexer_share, None
    if "@" in spec:          # 'max@131072': only at those contexts
        spec, _, where = spec.partition("@")
        share_contexts = _ints("--indexer-share", where.replace("+", ","))
        assert share_contexts is not None
        missing = [t for t in share_contexts if t not in contexts]
        if missing:
            raise BadSize(f"--indexer-share={a.indexer_share!r}: context {missing[0]} is not one of --contexts "
                          f"{a.contexts}; expected BATCHES@CONTEXT[+CONTEXT...] with contexts of the run")
    share = _ints("--indexer-share", spec, allow_max=True, allow_all=True) if spec else []
    if (share is None or share) and a.topk_model == "indexer":
        raise BadSize(f"--indexer-share={a.indexer_share!r} needs --topk-model benign or code (the indexer's choice "
                      "is what --topk-model indexer attends)")
    if (share is None or share) and a.skip_indexer:
        raise BadSize(f"--indexer-share={a.indexer_share!r} with --skip-indexer: every row already leaves the indexer "
                      "out; expected one of them")
    def formats(flag: str, given: str, check: Callable[[str, str], str]) -> list[str]:
        """`given`'s '/'-separated alternatives, distinct, in order, each checked by `check`."""
        alts = list(dict.fromkeys(x.strip() for x in given.split("/")))
        for x in alts:
            try:
                check(x, flag)
            except InvalidInputError as exc:
                where = f" (alternative of {given!r}; several separated by /)" if "/" in given else ""
                raise BadSize(f"{exc}{where}") from None
        return alts

    keys = formats("--indexer-keys", a.indexer_keys, check_key_format)
    rows = formats("--kv-rows", a.kv_rows, check_row_kind)
    own_keys = [m for m in modes if m in ("transformers", "replay")]
    for flag, given, alts in (("--indexer-keys", a.indexer_keys, keys), ("--kv-rows", a.kv_rows, rows)):
        if own_keys and "model" not in alts and a.modes is None:
            modes = [m for m in modes if m not in own_keys]   # main() says so
        elif own_keys and "model" not in alts:
            raise BadSize(f"{flag}={given!r} with --modes {','.join(own_keys)}: those modes keep their own "
                          "format and run only under 'model'; expected an alternative 'model' (e.g. fp8/model) or "
                          "--modes without them")
    return Plan(contexts, batches, modes, resident, why, share, share_contexts, references, resident_by_ref, keys,
                rows)


def reference_alternatives(spec: str, layers: int, regime_name: str) -> list[list[int]]:
    """--reference-layers: its '/'-separated alternatives ('spread' or a comma list of `layers`
    strictly ascending reference layers of 61), distinct, in order."""
    from hisparse_core.replay.locality import SPREAD, parse_reference_layers

    out: list[list[int]] = []
    for alt in spec.split("/"):
        try:
            refs = parse_reference_layers("--reference-layers", alt, range(layers), layers)
        except ValueError as exc:
            where = f" (alternative {alt!r} of {spec!r})" if "/" in spec else ""
            raise BadSize(f"{exc}{where}") from None
        if refs not in out:
            out.append(refs)
    if regime_name == "indexer" and spec.strip() != SPREAD:
        raise BadSize(f"--reference-layers={spec!r} needs --topk-model benign or code (the reference layers are the "
                      "locality model's); expected 'spread' (the default) without it")
    return out


def reference_label(refs: list[int], layers: int) -> str:
    """A hisparse row's top-k label suffix for `refs` ('' for the spread default; all-resident rows take none)."""
    from hisparse_core.replay.locality import reference_layers

    return "" if refs == reference_layers(list(range(layers)), layers) else "+ref" + ",".join(map(str, refs))


def key_label(keys: str, rows: str = "model") -> str:
    """An engine row's top-k label suffix for its indexer keys and latent rows (':fp8' for fp8 keys,
    ':fp8-rows' for fp8 rows; none for the model's own, so earlier logs read the same): hisparse and
    all-resident rows of one format share it."""
    return ("" if keys == "model" else ":" + keys) + ("" if rows == "model" else f":{rows}-rows")


def run_engine(model: Any, s: Sizes, b: int, a: argparse.Namespace, resident: bool, *,
               skip_indexer: bool = False, prefetch: bool | tuple[int, ...] = False,
               reference: list[int] | None = None) -> dict[str, Any]:
    """One engine row: hisparse (with `s.resident_layers` kept whole on the GPU) or the same engine
    all-resident, the locality model's layers standing for `reference` (None: spread). `a.warmup`
    decode steps run untimed first; every figure (step, host time, hits, misses, PCIe bytes) is of
    the `a.steps` timed steps after them (steady hot buffers)."""
    import hisparse_transformers
    from hisparse_core.replay.locality import reference_layers

    dev = model.device
    modelled = a.topk_model != "indexer"
    refs = reference_layers(list(range(s.layers)), s.layers) if reference is None else reference
    topk = a.topk_model + key_label(s.indexer_keys, s.kv_rows) + ("-no-indexer" if skip_indexer else "")
    if modelled and not resident:
        topk += reference_label(refs, s.layers)   # all-resident's cost does not depend on them: one label
    layers = () if resident else s.resident_layers
    if layers:
        topk += "+resident" + ",".join(map(str, layers)) + ("-outside" if s.stores_outside else "")
    if resident or prefetch == ():
        prefetch = False
    topk += prefetch_label(prefetch)
    out: dict[str, Any] = {"mode": "all-resident" if resident else "hisparse", "batch": b, "context": s.context,
                           "topk": topk, "reference_layers": refs if modelled else None,
                           "indexer_keys": s.indexer_keys, "kv_rows": s.kv_rows, "row_bytes": s.row_bytes}
    if layers and s.stores_outside:
        out["resident_stores_outside_budget_gib"] = s.store_bytes(b) / 2**30
    if resident:
        # False: this batch runs all-resident only under --all-resident-gib (the offloading cost at the
        # same batch), not at the fixed budget the capacity and best-throughput figures compare
        out["within_budget"] = s.fits_budget(b)
    if resident:
        blocks, block_bytes, store = s.resident_blocks(b), s.block_bytes, 0
    else:
        store = s.store_bytes(b)
        block_bytes = s.hs_block_bytes
        blocks = (s.budget - b * s.indexer_bytes - s.budget_store_bytes(b)) // block_bytes
    host_gib = (b * (s.pages + 4) + 8) * block_bytes / 2**30
    hs = cache = None
    try:
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        hs = hisparse_transformers.enable(model, host_pool_gib=host_gib,
                                          gpu_kv_gib=(blocks * block_bytes + store) / 2**30,
                                          backend=a.backend, hot_rows=s.hot_blocks * a.block_size,
                                          block_size=a.block_size, max_batch=b, max_context=s.max_context,
                                          prefill_chunk=a.fill_chunk,
                                          synthetic_topk=a.topk_model if modelled else None,
                                          synthetic_topk_layers=refs if modelled else None,
                                          resident_layers=layers, prefetch_next_group=prefetch,
                                          indexer_keys=s.indexer_keys, kv_rows=s.kv_rows)
        out["backend"] = hs.engine.backend.name
        cache = fill_hisparse(hs, b, s.context, a.fill_chunk, a.seed)
        if hs.engine.topk_model is not None:
            # every decode step of the run (warm-up, timed, profiled) made ahead before timing: no step's
            # host time includes making them
            hs.engine.topk_model.lookahead = a.warmup + a.steps + 3
            hs.engine.topk_model.make_ahead(cache.session, [r.pad for r in cache.session.requests], s.context)
            hs.engine.topk_model.run_indexer = not skip_indexer
        timers = Timers(dev)
        if a.warmup:
            decode(model, cache, b, s.context, 0, a.warmup, timers)
        before = hs.stats()
        host = EngineHostTime(hs)
        host.reset()
        times = decode(model, cache, b, s.context + a.warmup, a.steps, 0, timers)
        out["step_ms"] = median(times, "step")
        out["host_critical_ms"], out["host_ahead_ms"] = host.per_step_ms(a.steps)
        st = hs.stats()
        looked = (st.hits - before.hits) + (st.misses - before.misses)
        out.update(hit_rate=(st.hits - before.hits) / looked if looked else 1.0, hot_lookups=looked,
                   misses_per_step=(st.misses - before.misses) / a.steps,
                   h2d_mb_per_step=(st.h2d_bytes - before.h2d_bytes) / a.steps / 1e6,
                   d2h_mb_per_step=(st.d2h_bytes - before.d2h_bytes) / a.steps / 1e6,
                   released=st.released_pages, decode_mode=st.decode_mode, planned=hs.engine.ahead.claimed,
                   resident_store_mb=st.resident_store_bytes / 1e6, timed_steps=a.steps, warmup_steps=a.warmup)
        if prefetch is not False:
            pre = (st.prefetch_misses - before.prefetch_misses) / a.steps
            pre_mb = (st.prefetch_h2d_bytes - before.prefetch_h2d_bytes) / a.steps / 1e6
            out.update(prefetch_misses_per_step=pre, prefetch_h2d_mb_per_step=pre_mb,
                       critical_misses_per_step=out["misses_per_step"] - pre,
                       critical_h2d_mb_per_step=out["h2d_mb_per_step"] - pre_mb)
        if dev.type == "cuda":
            out["gpu_ms"] = kernel_profile(model, cache, b, s.context + a.warmup + a.steps, 3)["all kernels"]
            out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
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
            "hot_lookups": summary["hot_lookups"],
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

    def label(r: dict[str, Any]) -> str:
        return str(r.get("topk", "-"))

    def base(r: dict[str, Any]) -> str:
        """All-resident's label for a hisparse row: the same top-k source, without resident layers or prefetch."""
        return label(r).split("+")[0]

    by = {(r["mode"], r["batch"], r["context"], label(r)): r for r in rows}
    body = []
    for r in sorted(rows, key=lambda r: (r["context"], MODES.index(r["mode"]) if r["mode"] in MODES else 9,
                                         label(r), r["batch"])):
        if "oom" in r or "error" in r:
            body.append([f"{r['mode']} T={ctx(r['context'])}", label(r), str(r["batch"]),
                         "OOM" if "oom" in r else "error"] + ["-"] * 13)
            continue
        res = by.get(("all-resident", r["batch"], r["context"], base(r)), {})
        over = (f"{r['step_ms'] / res['step_ms']:.2f}x" if r["mode"] == "hisparse" and res.get("step_ms") else "-")
        gpu = r.get("gpu_ms")
        idle = r["step_ms"] - gpu if gpu is not None and r["mode"] != "replay" else None
        body.append([f"{r['mode']} T={ctx(r['context'])}", label(r), str(r["batch"]), fmt(r.get("step_ms")),
                     fmt(tokens_per_s(r), ".1f") if r["mode"] != "replay" else "-", fmt(gpu), fmt(idle),
                     fmt(r.get("host_critical_ms")), fmt(r.get("host_ahead_ms")), over, fmt(r.get("peak_gib"), ".1f"),
                     # a rate of nothing is no 100% (all-resident, or every entry read resident)
                     "-" if "hit_rate" not in r else "n/a" if r.get("hot_lookups") == 0 else
                     f"{100 * r['hit_rate']:.0f}%", fmt(r.get("h2d_mb_per_step"), ".1f"),
                     fmt(r.get("d2h_mb_per_step"), ".1f"), fmt(r.get("prefetch_h2d_mb_per_step"), ".1f"),
                     str(r.get("released", "-")),
                     str(r.get("decode_mode", "-"))])
    header = ["mode", "top-k", "batch", "step ms", "tok/s", "gpu ms", "idle ms", "host critical ms", "host ahead ms",
              "overhead", "peak GiB", "hit", "H2D MB/step", "D2H MB/step", "prefetch MB/step", "released", "decode"]
    out = render_grid(header, body)
    gains = []
    for t in sorted({r["context"] for r in rows}):
        for lab in sorted({label(r) for r in rows if r["context"] == t and r["mode"] == "hisparse"} or {"-"}):
            def best(m: str, want: str, t: int = t) -> float:
                return max((tokens_per_s(r) for r in rows if r["mode"] == m and r["context"] == t and "step_ms" in r
                            and r.get("within_budget", True) and (m == "transformers" or label(r) == want)),
                           default=float("nan"))

            hs, res = best("hisparse", lab), best("all-resident", lab.split("+")[0])
            gains.append(f"T={ctx(t)} ({lab}): best tokens/s over the batches at the fixed budget: hisparse {fmt(hs, '.1f')}, all-resident "
                         f"{fmt(res, '.1f')}, transformers {fmt(best('transformers', lab), '.1f')}; gain over "
                         f"all-resident {fmt(hs / res, '.2f')}x")
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


def print_sizing(sizes: list[Sizes], plan: Plan, stores_alts: list[bool], fill_chunk: int,
                 key_bytes: dict[str, int]) -> None:
    """Each context's largest batch per mode at the budget and its capacity line (what a run sizes)."""
    for s in sizes:
        extra = "".join(f", hisparse with resident layers {list(x)} {s.with_resident(x).largest('hisparse')}"
                        for x in plan.resident if x and False in stores_alts)
        keys = (f" (indexer keys {s.indexer_keys})" if plan.keys != ["model"] else "") + (
            f" (latent rows {s.kv_rows}, {s.row_bytes} B)" if plan.rows != ["model"] else "")
        print(f"# T={s.context}{keys}: largest batch hisparse {s.largest('hisparse')}, all-resident "
              f"{s.largest('all-resident')}, transformers {s.largest('transformers')}{extra}", flush=True)
        print(s.capacity_line(fill_chunk, key_bytes), flush=True)


def main(argv: list[str] | None = None) -> int:
    from hisparse_core.cli.options import CliParser

    # One line a value argparse refuses (the stock parser printed its usage, some 20 lines, first).
    p = CliParser(prog="bench_serving", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--contexts", default=None, help="comma list of context lengths (default 32768,131072; --smoke: 160)")
    p.add_argument("--gpu-kv-gib", type=float, default=None,
                   help="GPU KV budget of every mode, indexer keys included (default 24; --smoke: 320 KiB)")
    p.add_argument("--host-gib", type=float, default=None, help="host pool limit (pinned; default 100; --smoke: 0.001)")
    p.add_argument("--max-context", type=int, default=None, help="default 132096; --smoke: 4096")
    p.add_argument("--batches", default=None,
                   help="comma list, 'max' standing for hisparse's largest at each context and 'budget' for "
                        "all-resident's largest at the fixed budget (--gpu-kv-gib); a batch a context cannot "
                        "hold is left out there (refused only where no context can); default: powers of two up to "
                        "each mode's largest")
    p.add_argument("--modes", default=None,
                   help=f"comma list of {', '.join(MODES)}, replay (default: all; without 'model' among "
                        "--indexer-keys, the engine modes only)")
    p.add_argument("--dense-ffn-gb", type=float, default=0.0, help="dense FFN weight bytes read per step (GB)")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps (default 10; --smoke: 2)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed decode steps before them, so the timed ones see filled hot buffers (default 6: the "
                        "locality models' LRU hit rate is steady from the 5th step; --smoke: 1)")
    p.add_argument("--all-resident-gib", type=float, default=None,
                   help="all-resident's GPU budget (default --gpu-kv-gib): a larger one runs all-resident at "
                        "hisparse's batches, for the offloading cost at the same batch")
    p.add_argument("--resident-layers", default="none",
                   help="hisparse's layers kept whole on the GPU (enable(resident_layers=...)): 'none', 'auto' (the "
                        "--topk-model regime's poor layers: under code the layers standing for reference layers 0-1; "
                        "none otherwise) or a comma list; several alternatives separated by '/' (e.g. none/auto) "
                        "run each hisparse row once per alternative")
    p.add_argument("--indexer-share", default="",
                   help="with --topk-model: comma list of batches ('max': hisparse's largest, and all-resident's "
                        "largest at the fixed budget; 'all') whose engine rows also run with the model's indexer left "
                        "out of the decode steps (rows labelled <regime>-no-indexer): the difference is the "
                        "indexer's cost, and the gain at the fixed budget without it; '@CONTEXT[+CONTEXT]' limits "
                        "them to those contexts, e.g. max@131072")
    p.add_argument("--block-size", type=int, default=None, help="tokens a page (default 64; --smoke: 4)")
    p.add_argument("--hot-rows", type=int, default=0, help="0: 2x top-k")
    p.add_argument("--fill-chunk", type=int, default=None, help="prompt tokens a prefill forward (default 1024; --smoke: 32)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--topk-model", choices=("indexer", "benign", "code"), default="indexer",
                   help="where the engine modes' decode top-k comes from: the model's indexer (random weights), or "
                        "the calibrated locality model of a regime (enable(synthetic_topk=...); the indexer still runs)")
    p.add_argument("--skip-indexer", action="store_true",
                   help="with --topk-model: decode steps skip the model's indexer (its cost, measured as the "
                        "difference to a run with it)")
    p.add_argument("--reference-layers", default="spread",
                   help="with --topk-model: the reference layers (of the 61-layer locality profile) the model's "
                        "layers stand for: 'spread' (default: layer l of L stands for round(l * 60 / (L - 1)), 0, 20, "
                        "40, 60 for 4 layers, 20 apart) or --layers strictly ascending ones, e.g. 20,21,22,23 (adjacent "
                        "layers of the plateau band, as a real model's neighbours); several alternatives separated by "
                        "'/' run each hisparse row once per alternative (rows labelled <regime>+ref20,21,22,23)")
    p.add_argument("--prefetch-next-group", nargs="?", const="on", default="off",
                   help="hisparse rows with enable(prefetch_next_group=True) ('on', the flag alone), without ('off', the "
                        "default), from every layer but the regime's poor ones ('auto': under code not from the layers "
                        "standing for reference layers 0-1, whose top-k predicts nothing; rows labelled "
                        "+prefetch-from1,2 where that leaves some out), or each row several ways ('off/on/auto')")
    p.add_argument("--resident-stores", default="inside",
                   help="whether the resident layers' stores (--resident-layers) come out of --gpu-kv-gib ('inside', "
                        "the default: the fixed budget) or on top of it ('outside': a resident alternative runs at "
                        "hisparse's batches without resident layers, 'max' being that largest; rows labelled "
                        "+resident0-outside say resident_stores_outside_budget_gib, their memory is not the fixed "
                        "budget's); 'inside/outside' runs each resident alternative both ways")
    p.add_argument("--indexer-keys", default="model",
                   help="how the engine modes store the indexer keys, which stay on the GPU in both and count in "
                        "--gpu-kv-gib: 'model' (the default: the model's dtype, bf16, 256 B a token a layer, as "
                        "transformers keeps them) or 'fp8' (e4m3 with an fp32 scale per 128 values, 132 B, as "
                        "DeepSeek-V3.2 stores them; the indexer scores them dequantized; rows labelled <regime>:fp8); "
                        "'fp8/model' runs every engine row under each, with its own largest batches (transformers "
                        "and replay rows run under 'model' only)")
    p.add_argument("--kv-rows", default="model",
                   help="how the engine modes store the latent rows, on the GPU and in the host pool (and so what "
                        "each miss copies): 'model' (the default: the model's dtype, bf16, 1,152 B a token a layer, "
                        "as transformers keeps them) or 'fp8' (DeepSeek-V3.2's serving format, FlashMLA's "
                        "fp8_ds_mla: e4m3 with an fp32 scale per 128 values and the roped part in bf16, 656 B; "
                        "attention reads them dequantized; rows labelled <regime>:fp8-rows); 'fp8/model' runs every "
                        "engine row under each (transformers and replay rows run under 'model' only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every figure to this file")
    p.add_argument("--png", default="bench_serving.png", help="the tokens/s against batch plot")
    p.add_argument("--smoke", action="store_true", help="tiny geometry on the CPU (checks this script end to end)")
    p.add_argument("--sizing", action="store_true",
                   help="print each context's largest batches and capacity at the budget, as a run would size them, "
                        "and exit (no model is built; needs no GPU)")
    a = p.parse_args(argv)
    if not (math.isfinite(a.dense_ffn_gb) and a.dense_ffn_gb >= 0):   # before --smoke shrinks it
        print(f"bench_serving: --dense-ffn-gb={a.dense_ffn_gb:g}: expected GB >= 0 (0: no dense FFN)", file=sys.stderr)
        return 2
    if a.smoke:
        a.contexts = a.contexts or "160"
        a.steps = 2 if a.steps is None else a.steps
        a.warmup = 1 if a.warmup is None else a.warmup
        a.gpu_kv_gib = 320 * 1024 / 2**30 if a.gpu_kv_gib is None else a.gpu_kv_gib
        a.dense_ffn_gb = a.dense_ffn_gb and 1e-4
    # --smoke's tiny geometry fills only what the user left unset
    for name, full, tiny in (("block_size", 64, 4), ("fill_chunk", 1024, 32), ("host_gib", 100.0, 1e-3),
                             ("max_context", 131072 + 1024, 4096)):
        if getattr(a, name) is None:
            setattr(a, name, tiny if a.smoke else full)
    if a.gpu_kv_gib is None:
        a.gpu_kv_gib = 24.0
    a.contexts = a.contexts or "32768,131072"
    a.steps = 10 if a.steps is None else a.steps
    a.warmup = 6 if a.warmup is None else a.warmup
    try:
        plan = parse_plan(a)
    except BadSize as exc:
        print(f"bench_serving: {exc}", file=sys.stderr)
        return 2
    stores_alts = list(dict.fromkeys(x.strip() == "outside" for x in a.resident_stores.split("/")))
    if not all(x.strip() in ("inside", "outside") for x in a.resident_stores.split("/")):
        print(f"bench_serving: --resident-stores={a.resident_stores!r}: expected inside, outside or inside/outside",
              file=sys.stderr)
        return 2
    prefetch_alts = list(dict.fromkeys(x.strip() for x in a.prefetch_next_group.split("/")))
    if not all(x in ("off", "on", "auto") for x in prefetch_alts):
        print(f"bench_serving: --prefetch-next-group={a.prefetch_next_group!r}: expected on, off, auto or several "
              "separated by '/' (e.g. off/on/auto)", file=sys.stderr)
        return 2
    if a.skip_indexer and a.topk_model == "indexer":
        print("bench_serving: --skip-indexer needs --topk-model benign or code (the indexer's choice is what "
              "--topk-model indexer attends)", file=sys.stderr)
        return 2
    if a.sizing:
        a.png, a.json = "", None   # nothing is run, so nothing is written
    if not a.smoke and not a.sizing and not torch.cuda.is_available():
        print("bench_serving: needs a CUDA GPU (this torch sees none); expected --smoke for the tiny geometry on the "
              "CPU", file=sys.stderr)
        return 2
    if a.png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(f"# --png {a.png}: matplotlib is not installed (pip install -e '.[plot]'), so no plot is drawn",
                  flush=True)
            a.png = ""
    # both files are written after the whole run: checked before anything is built
    from hisparse_core.cli.options import check_output_path, check_plot_path

    why = (check_plot_path(a.png, flag="--png") if a.png else None) or (
        check_output_path("--json", a.json) if a.json is not None else None)
    if why:
        print(f"bench_serving: {why}", file=sys.stderr)
        return 2
    device = "cpu" if a.smoke else "cuda"
    contexts, asked, modes = plan.contexts, plan.batches, plan.modes
    geometry = TINY if a.smoke else GEOMETRY
    from transformers import DeepseekV32Config

    probe_cfg = DeepseekV32Config(num_hidden_layers=a.layers, **geometry)
    from hisparse_transformers.index_keys import KEY_FORMATS, bytes_per_key

    key_bytes = {k: bytes_per_key(k, probe_cfg.index_head_dim, 4 if a.smoke else 2) for k in KEY_FORMATS}
    try:
        sizes = [sizes_for(probe_cfg, a.layers, t, a, keys, rows) for t in contexts for keys in plan.keys
                 for rows in plan.rows]
        for s in sizes:
            check_sizes(s, None)
            for alt in plan.resident:
                for outside in stores_alts:
                    check_sizes(s.with_resident(alt, outside), None)
        if asked:
            # a batch some context cannot hold is left out there; refused only where none can
            tops: dict[int, int] = {}
            for s in sizes:
                tops[s.context] = max(tops.get(s.context, 0), *(s.largest(m) for m in MODES))
            big = [b for b in asked if b > max(tops.values())]
            if big:
                raise BadSize(f"batch {big[0]} fits no mode at any context (largest per context: "
                              f"{', '.join(f'{ctx(t)} {n}' for t, n in tops.items())}); expected --batches <= "
                              f"{max(tops.values())}")
            # a batch some mode holds, but none of the modes asked for ('budget' where all-resident holds none)
            if not any(batches_for(s, "hisparse" if m == "replay" else m, asked) for s in sizes for m in modes):
                largest = "; ".join(f"{m} " + ", ".join(f"T={s.context} {s.largest('hisparse' if m == 'replay' else m)}"
                                                      for s in sizes) for m in modes)
                raise BadSize(f"--batches={a.batches!r} runs nothing with --modes {','.join(modes)} (largest batch "
                              f"per mode and context: {largest}); expected batches those modes hold")
    except BadSize as exc:
        print(f"bench_serving: {exc}", file=sys.stderr)
        return 2
    if a.sizing:
        print_sizing(sizes, plan, stores_alts, a.fill_chunk, key_bytes)
        return 0
    import transformers

    model = build_model(geometry, a.layers, max(s.max_context for s in sizes), device,
                        torch.float32 if a.smoke else torch.bfloat16, a.dense_ffn_gb)
    ffn = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".mlp." in n)
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    print(f"# transformers {transformers.__version__}, torch {torch.__version__}, {gpu}; {a.layers} layers, top-k "
          f"{model.config.index_topk}, block {a.block_size}; GPU KV budget {a.gpu_kv_gib:g} GiB, host pool <= "
          f"{a.host_gib:g} GiB; FFN weights {ffn / 1e9:.3g} GB; decode top-k from {a.topk_model}", flush=True)
    if "hisparse" in plan.modes:
        from hisparse_core.registry import get_registry

        sel = get_registry().choose(None if a.backend in (None, "auto") else a.backend)
        # The registry's choice; a model on another device than that backend's takes the first that runs
        # there (hisparse_transformers.enable), so each engine row names the backend it ran on.
        print(f"# hisparse backend: {sel.name} ({sel.explanation()})", flush=True)
    if a.modes is None and ("model" not in plan.keys or "model" not in plan.rows):
        print(f"# modes: {', '.join(plan.modes)} (transformers and replay keep the indexer keys and latent rows in "
              f"their own format, so --indexer-keys {a.indexer_keys} --kv-rows {a.kv_rows} leaves them out)",
              flush=True)
    print(f"# {a.warmup} untimed warm-up decode steps, then {a.steps} timed: step, host, hits and PCIe figures "
          f"are the timed steps'; all-resident's budget {(a.all_resident_gib or a.gpu_kv_gib):g} GiB", flush=True)
    print("# hisparse resident layers: " + " / ".join(str(list(x)) if x else "none" for x in plan.resident)
          + (f" ({plan.resident_why})" if plan.resident_why else " (--resident-layers; default none: every layer "
             "through hisparse)")
          + (f"; their stores {' / '.join('on top of the budget' if o else 'inside it' for o in stores_alts)} "
             f"(--resident-stores {a.resident_stores})" if any(plan.resident) else ""), flush=True)
    print(f"# hisparse prefetch_next_group: {a.prefetch_next_group} (--prefetch-next-group; rows with it are labelled "
          "+prefetch, or +prefetch-fromG,... where auto leaves the regime's poor layers out as sources)", flush=True)
    if a.topk_model != "indexer":
        print("# locality model's reference layers (of 61) the model's layers stand for: "
              + " / ".join(f"{x}" + (" (spread)" if not reference_label(x, a.layers) else "") for x in plan.references)
              + " (--reference-layers; all-resident rows take the first)", flush=True)
    print_sizing(sizes, plan, stores_alts, a.fill_chunk, key_bytes)
    rows: list[dict[str, Any]] = []

    def emit(r: dict[str, Any], t0: float) -> None:
        r["wall_s"] = time.perf_counter() - t0
        rows.append(r)
        print(json.dumps(r), flush=True)

    for s in sizes:
        for mode in modes:
            if mode in ("transformers", "replay") and (s.indexer_keys != "model" or s.kv_rows != "model"):
                continue                 # their keys are their own (StaticCache: the model's dtype; replay: fp8)
            if mode == "hisparse":
                variants = [(refs, s.with_resident(x, o)) for refs, alts in zip(plan.references, plan.resident_by_ref,
                                                                                strict=True)
                            for x in alts for o in (stores_alts if x else [False])]
            else:
                variants = [(plan.references[0], s)]
            prefetches = prefetch_alts if mode == "hisparse" else ["off"]
            also = (tuple(s.with_resident(x).largest("hisparse") for x in plan.resident if x and False in stores_alts)
                    if mode != "hisparse" else ())
            for (refs, v), pf in ((v, pf) for v in variants for pf in prefetches):
                sources = prefetch_sources(pf, refs, a.topk_model)
                if pf == "auto" and sources is True and "on" in prefetches:
                    continue                       # the same rows as 'on'
                for b in batches_for(v, "hisparse" if mode == "replay" else mode, asked, also):
                    t0 = time.perf_counter()
                    if mode == "transformers":
                        r = run_static(model, v, b, a)
                    elif mode == "replay":
                        r = run_replay_workload(a.layers, v, b, a, model.config.index_topk)
                    else:
                        r = run_engine(model, v, b, a, resident=mode == "all-resident", skip_indexer=a.skip_indexer,
                                       prefetch=sources, reference=refs)
                    emit(r, t0)
        if (plan.indexer_share is None or plan.indexer_share) and (plan.share_contexts is None
                                                                  or s.context in plan.share_contexts):
            # the same rows without the model's indexer (first resident alternative): its share of the step
            share = plan.indexer_share
            for mode in (m for m in modes if m in ("hisparse", "all-resident")):
                v = s.with_resident(plan.resident_by_ref[0][0]) if mode == "hisparse" else s
                picked = batches_for(v, mode, share if share is not None else asked)
                if mode == "all-resident" and share is not None and 0 in share:
                    # 'max': all-resident's largest at the fixed budget (its best throughput there), so the
                    # gain at the fixed budget can be read with and without the indexer
                    top = max((x for x in range(1, v.largest(mode) + 1) if v.fits_budget(x)), default=0)
                    picked = sorted(({x for x in picked if v.fits_budget(x)} | {top}) - {0})
                for b in picked:
                    t0 = time.perf_counter()
                    emit(run_engine(model, v, b, a, resident=mode == "all-resident", skip_indexer=True,
                                    reference=plan.references[0]), t0)
    print(table(rows))
    if a.png:
        plot(rows, a.png)
        print(f"# plot: {a.png}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
