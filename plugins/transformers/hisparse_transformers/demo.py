"""What `hisparse generate` runs: a real transformers DSA model decoding through hisparse, checked
against the same model's own generate.

1. A tiny random model of the family (transformers' own classes, random weights, nothing
   downloaded) and a batch of left-padded prompts of different lengths.
2. The model's own greedy generate (its attention, a `DynamicCache`): the reference tokens and
   logits.
3. The same generate through hisparse (`enable`, with the row check on) under a GPU budget that
   makes the coordinator release pages to host, so decode reads them back through the hot buffer.
4. A second batch whose prompts share a prefix with the first: the prefix comes from the host pool.
5. float32: tokens must be identical and every step's logits within `LOGIT_TOLERANCE`. bfloat16:
   the model alone's tokens are fed back (teacher-forced) to the fp32 model of the same weights, to
   the model alone and through hisparse; hisparse's logit error against fp32 must stay within
   `BF16_FACTOR` x the model's own + `BF16_SLACK`, which on this tiny random model (whose logits
   rounding moves by half their scale) judges little; so hisparse at its budget must also give the
   very logits of the same engine under a budget that releases no page, teacher-forced (`LOGIT_TOLERANCE`):
   the rounding is judged loosely, what offloading does exactly. Either way every row read is
   checked against the model's own latent.
6. fp8 rows (`kv_rows="fp8"`, DeepSeek-V3.2's stored form of the latent): the model alone reads its
   normed latent rounded as hisparse stores it (`kv_rows.model_reads_stored_rows`) in every run that
   stands for it, and every row read is checked within that rounding of the model's latent. Past
   the first layer the model and hisparse compute the latent about 1e-7 apart (absorbed against
   expanded attention), enough to put a value on either side of an e4m3 rounding boundary now and
   then (a rounding flip: one fp8 step apart), so the free-running runs may part by more than float
   noise. The verdict is therefore teacher-forced: hisparse's run records the latents it stored
   (`kv_rows.StoredLatents`), the model alone reads exactly those over the same forwards, and in
   float32 the two must agree within `LOGIT_TOLERANCE` (the flips are counted and reported); in
   bfloat16 the bf16 verdict above applies, with fp8 rows on both sides. Either way, as in 5, the
   run must match the same engine all resident.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from hisparse_core.backend import Backend
from hisparse_transformers.engine import chunk_pages_for, required_gpu_blocks
from hisparse_transformers.forced import forced_logits
from hisparse_transformers.kv_rows import LatentRows, StoredLatents, check_row_kind, model_reads_stored_rows
from hisparse_transformers.tiny import TinyShape, random_prompts, tiny_model
from hisparse_transformers.version import cache_kwarg

#: fp32 on CPU: absorbed MLA over the gathered rows against the model's expanded dense attention.
LOGIT_TOLERANCE = 1e-4
#: bf16: two bf16 computations of attention part ways, so both are teacher-forced on the model
#: alone's tokens and measured against the fp32 model of the same weights; hisparse's max abs logit
#: error may be at most BF16_FACTOR x the model's own bf16 error + BF16_SLACK (the tolerance the GPU
#: tests state, tests/transformers_plugin/test_transformers_gpu.py).
BF16_FACTOR, BF16_SLACK = 2.0, 0.05
#: The second batch's prompts are this many tokens shorter than the first's (at least one token each).
SECOND_BATCH_SHORTER = 16

Progress = Callable[[int, str], None]


@dataclass(frozen=True, slots=True)
class DemoConfig:
    model: str = "deepseek_v32"   # the transformers model type
    name: str = "deepseek-v3.2"   # the built-in model it is built like (`hisparse_core.planner.MODELS`)
    index_share: int = 1          # layers per indexer (GLM-5's indexer_types: one "full", then "shared" ones)
    backend: str | None = None
    prompts: int = 4
    min_prompt: int = 200
    max_prompt: int = 480
    new_tokens: int = 96
    layers: int = 4
    top_k: int = 32
    hot_rows: int = 64
    block_size: int = 16
    prefill_chunk: int = 32
    gpu_kv_pages: int = 0          # 0: 60% of what the first batch needs all resident (at least the engine's floor)
    host_pool_gib: float = 0.05
    shared_prefix: int = 128
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    kv_rows: str = "model"        # how the latent rows are stored (`enable(kv_rows=...)`)

    def __post_init__(self) -> None:
        check_row_kind(self.kv_rows)
        if self.model not in ("deepseek_v32", "glm_moe_dsa"):
            raise ValueError(f"--model {self.model!r}; expected deepseek_v32 or glm_moe_dsa")
        for name in ("prompts", "min_prompt", "max_prompt", "new_tokens", "layers", "top_k", "hot_rows",
                     "block_size", "prefill_chunk", "index_share"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.prompts > 1 and self.min_prompt > self.max_prompt:   # one prompt is max_prompt long
            raise ValueError(f"min_prompt={self.min_prompt} > max_prompt={self.max_prompt}; expected min <= max")
        name = "max_prompt" if self.prompts == 1 else "min_prompt"
        shortest = min(self.lengths())
        if shortest <= SECOND_BATCH_SHORTER:
            raise ValueError(f"{name}={shortest}: the second batch's prompts are {SECOND_BATCH_SHORTER} "
                             f"tokens shorter; expected {name} >= {SECOND_BATCH_SHORTER + 1}")
        if not 0 <= self.shared_prefix <= shortest:
            raise ValueError(f"shared_prefix={self.shared_prefix}; expected 0 to {name}={shortest}")

    def lengths(self) -> list[int]:
        n = self.prompts
        if n == 1:
            return [self.max_prompt]
        step = (self.max_prompt - self.min_prompt) / (n - 1)
        return [round(self.max_prompt - i * step) for i in range(n)]


class _Steps:
    """A transformers streamer that only counts generate's steps (for the progress bar)."""

    def __init__(self, progress: Progress | None, label: str) -> None:
        self.progress, self.label, self.first = progress, label, True

    def put(self, value: torch.Tensor) -> None:
        if self.first:          # generate hands the prompt first
            self.first = False
            return
        if self.progress:
            self.progress(1, self.label)

    def end(self) -> None:
        pass


def _step(progress: Progress | None, label: str) -> Callable[[], None] | None:
    """A teacher-forced run's per-step callback for the progress bar."""
    return None if progress is None else lambda: progress(1, label)


def _compare(ours: Any, theirs: Any) -> dict[str, Any]:
    diffs = [float((a.float() - b.float()).abs().max()) for a, b in zip(ours.logits, theirs.logits, strict=True)]
    same = torch.equal(ours.sequences, theirs.sequences)
    return {"tokens_identical": same, "max_abs_logit_diff": max(diffs), "steps": len(diffs),
            "exact": same and max(diffs) <= LOGIT_TOLERANCE}


def lossy_label(c: DemoConfig) -> str | None:
    """What rounds this run's numbers beyond fp32 ("bf16", "fp8 rows", both), or None."""
    return rounding_of(c.dtype, c.kv_rows)


def rounding_of(dtype: str, kv_rows: str) -> str | None:
    """`lossy_label` of a run in `dtype` storing `kv_rows` (before a `DemoConfig` exists)."""
    parts = (["bf16"] if dtype == "bfloat16" else []) + (["fp8 rows"] if kv_rows == "fp8" else [])
    return " + ".join(parts) or None


def comparison_pages(all_resident: int, floor: int) -> int:
    """GPU pages of a lossy run's offload check, the same engine with no page to release: both
    batches all resident (the second, prefix hits included, may still hold the first's pages) above
    the engine's floor."""
    return 2 * all_resident + floor


def _max_diff(got: list[list[torch.Tensor]], want: list[list[torch.Tensor]]) -> float:
    """The max abs difference of two teacher-forced runs (per batch, per step logits)."""
    return max(float((a.float() - b.float()).abs().max()) for g, w in zip(got, want, strict=True)
               for a, b in zip(g, w, strict=True))


def _lossy_errors(forced: dict[str, list[list[torch.Tensor]]], label: str) -> dict[str, Any]:
    """Each lossy run's teacher-forced max abs logit error against the fp32 model (its latent as
    computed), over both batches, and whether hisparse's is within BF16_FACTOR x the model alone's
    (in the same dtype, reading the same stored rows) + BF16_SLACK."""
    theirs, ours = _max_diff(forced["transformers"], forced["fp32"]), _max_diff(forced["hisparse"], forced["fp32"])
    limit = BF16_FACTOR * theirs + BF16_SLACK
    return {"lossy": label, "transformers": theirs, "hisparse": ours, "limit": limit, "within": ours <= limit,
            "factor": BF16_FACTOR, "slack": BF16_SLACK,
            "logit_scale": max(float(w.abs().max()) for want in forced["fp32"] for w in want)}


def total_steps(c: DemoConfig) -> int:
    """Progress units: generate steps of the reference and hisparse runs, both batches (bfloat16 or
    fp8 rows: and the steps of the four teacher-forced runs, fp32, the model alone, hisparse and
    hisparse all resident; fp8 rows: and the model alone reading the latents hisparse stored)."""
    runs = (6 if lossy_label(c) else 2) + (1 if c.kv_rows == "fp8" else 0)
    return runs * (c.new_tokens + max(1, c.new_tokens // 4))


def run_demo(c: DemoConfig, progress: Progress | None = None, backend: Backend | None = None) -> dict[str, Any]:
    """Run the demo of `c`; `backend`: an instance already selected for `c.backend` on `c.device`
    (None: `enable` selects one)."""
    from transformers import DynamicCache

    import hisparse_transformers

    dtype = getattr(torch, c.dtype)
    shape = TinyShape(layers=c.layers, index_topk=c.top_k, max_position=4 * (c.max_prompt + c.new_tokens),
                      index_share=c.index_share)
    model: Any = tiny_model(c.model, shape=shape, seed=c.seed, dtype=dtype, device=c.device)
    lengths = c.lengths()
    ids, mask = random_prompts(lengths, vocab=shape.vocab, seed=c.seed + 1)
    prefix = ids[0, -lengths[0]:][:c.shared_prefix].tolist()
    ids2, mask2 = random_prompts([n - SECOND_BATCH_SHORTER for n in lengths], vocab=shape.vocab, seed=c.seed + 2, prefix=prefix)
    ids, mask, ids2, mask2 = (t.to(c.device) for t in (ids, mask, ids2, mask2))
    new2 = max(1, c.new_tokens // 4)
    gen: dict[str, Any] = dict(do_sample=False, output_logits=True, return_dict_in_generate=True,
               prefill_chunk_size=c.prefill_chunk)

    def rows_of(m: Any) -> LatentRows:
        return LatentRows.of(c.kv_rows, m.dtype, shape.kv_lora, shape.rope)

    def reference(i: torch.Tensor, m: torch.Tensor, new: int) -> Any:
        with model_reads_stored_rows(model, rows_of(model)):
            return model.generate(i, attention_mask=m, max_new_tokens=new,
                                  streamer=_Steps(progress, "transformers alone"),
                                  **{cache_kwarg(model): DynamicCache(config=model.config)}, **gen)

    t0 = time.perf_counter()
    theirs = reference(ids, mask, c.new_tokens)
    theirs2 = reference(ids2, mask2, new2)
    reference_s = time.perf_counter() - t0
    batches = ((ids, mask, theirs.sequences[:, ids.shape[1]:]), (ids2, mask2, theirs2.sequences[:, ids2.shape[1]:]))
    forced: dict[str, list[list[torch.Tensor]]] = {}
    label = lossy_label(c)
    if label:
        # the fp32 model reads its latent as computed; the model alone in its dtype reads it as stored
        fp32 = copy.deepcopy(model).float()
        for name, m, rows in (("fp32", fp32, LatentRows.of("model", torch.float32, shape.kv_lora, shape.rope)),
                              ("transformers", model, rows_of(model))):
            with model_reads_stored_rows(m, rows):
                forced[name] = [forced_logits(m, i, k, t, DynamicCache(config=m.config), c.prefill_chunk,
                                              _step(progress, f"teacher-forced, {name}")) for i, k, t in batches]
        del fp32

    block_bytes = c.layers * c.block_size * rows_of(model).fmt.row_bytes
    all_resident = sum(-(-(n + c.new_tokens) // c.block_size) for n in lengths)
    max_context = max(lengths) + c.new_tokens
    floor = required_gpu_blocks(c.prompts, -(-c.hot_rows // c.block_size),
                                chunk_pages_for(c.prefill_chunk, max_context, c.block_size))
    pages = c.gpu_kv_pages or max(floor, int(0.6 * all_resident))
    gpu_gib = pages * block_bytes / 2**30

    def enabled(gpu_kv_gib: float, **extra: Any) -> Any:
        return hisparse_transformers.enable(model, host_pool_gib=c.host_pool_gib, gpu_kv_gib=gpu_kv_gib,
                                            backend=backend if backend is not None else c.backend,
                                            hot_rows=c.hot_rows, block_size=c.block_size, max_batch=c.prompts,
                                            max_context=max_context, prefill_chunk=c.prefill_chunk,
                                            kv_rows=c.kv_rows, **extra)

    def forced_through(hs: Any, label: str) -> list[list[torch.Tensor]]:
        """Both batches teacher-forced through hisparse (handle `hs`)."""
        runs = []
        for i, k, t in batches:
            cache = hs.new_cache(i, k, max_new_tokens=t.shape[1])
            runs.append(forced_logits(model, i, k, t, cache, c.prefill_chunk, _step(progress, label)))
            cache.finish()
        return runs

    with enabled(gpu_gib, check=True) as hs:
        t0 = time.perf_counter()
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=c.new_tokens,
                              streamer=_Steps(progress, "hisparse"), **gen)
        first = hs.stats()
        ours2 = model.generate(ids2, attention_mask=mask2, max_new_tokens=new2,
                               streamer=_Steps(progress, "hisparse, shared prefix"), **gen)
        hisparse_s = time.perf_counter() - t0
        stats = hs.stats()
        stored = StoredLatents(model, rows_of(model)) if c.kv_rows == "fp8" else None
        if forced:
            with stored.record() if stored is not None else contextlib.nullcontext():
                forced["hisparse"] = forced_through(hs, "teacher-forced, hisparse")
        engine = {"backend": hs.engine.backend.name, "device": str(hs.engine.device),
                  "gpu_pool_pages": hs.engine.gpu_blocks, "all_resident_pages": all_resident,
                  "host_pool_blocks": hs.engine.coordinator.host_num_blocks, "row_format": hs.engine.fmt.name,
                  "row_bytes": hs.engine.fmt.row_bytes,
                  "model_row_bytes": LatentRows.of("model", dtype, shape.kv_lora, shape.rope).fmt.row_bytes,
                  "hot_rows": hs.engine.hot_rows,
                  "index_groups": [list(g) for g in hs.engine.layout.groups]}
    exact1, exact2 = _compare(ours, theirs), _compare(ours2, theirs2)
    exact = exact1["exact"] and exact2["exact"]
    lossy = _lossy_errors(forced, label) if label else None
    passed = exact or (lossy is not None and lossy["within"])
    stored_rows = None
    if stored is not None:
        # the model alone, teacher-forced on the same tokens, reading the very latents hisparse stored
        with stored.replay():
            replayed = [forced_logits(model, i, k, t, DynamicCache(config=model.config), c.prefill_chunk,
                                      _step(progress, "teacher-forced, the model reading hisparse's rows"))
                        for i, k, t in batches]
        diff = _max_diff(forced["hisparse"], replayed)
        stored_rows = {"max_abs_logit_diff": diff, "steps": sum(len(r) for r in replayed),
                       "rounding_flips": stored.flips, "latent_values": stored.values,
                       "exact": diff <= LOGIT_TOLERANCE,
                       # bf16: absorbed and expanded attention part by bf16 noise even on the same
                       # latents (and few values pass the closeness rule the flips are counted by): reported only
                       "judged": dtype == torch.float32}
        if dtype == torch.float32:
            # fp32: exact against the model reading the same stored values; the free-running comparison
            # with the model rounding its own latent parts ways at rounding flips (module docstring)
            passed = exact = stored_rows["exact"]
    if lossy is not None:
        # judged where it decides (bf16); fp32 with fp8 rows reports it (the stored rows decide)
        lossy["judged"] = not (stored_rows is not None and stored_rows["judged"])
    offload = None
    if label:
        # A lossy run's logits part from the model's by its rounding, so a loose tolerance judges them;
        # what offloading itself does is judged tightly: the same engine with a budget that releases no
        # page (its only misses: prefix-hit pages, which start in the host pool) must give the same logits.
        # eager, as the checked run is (check=True keeps graphs off)
        with enabled(comparison_pages(all_resident, floor) * block_bytes / 2**30, cuda_graphs=False) as hs_all:
            resident_runs = forced_through(hs_all, "teacher-forced, hisparse all resident")
            everywhere = hs_all.stats()
        diff = _max_diff(forced["hisparse"], resident_runs)
        offload = {"max_abs_logit_diff": diff, "steps": sum(len(r) for r in resident_runs),
                   "all_resident_misses": everywhere.misses, "all_resident_released_pages": everywhere.released_pages,
                   "exact": diff <= LOGIT_TOLERANCE}
        # a comparison run that released pages would compare offloading with less of it: refused, not weakened
        passed = passed and offload["exact"] and everywhere.released_pages == 0
    return {
        "config": {**asdict(c), "prompt_lengths": lengths, "second_batch_lengths": [n - SECOND_BATCH_SHORTER for n in lengths],
                   "second_batch_new_tokens": new2},
        "engine": engine,
        "exactness": {"first_batch": exact1, "second_batch": exact2, "logit_tolerance": LOGIT_TOLERANCE,
                      "rows_checked": stats.checked_entries, "rows_max_abs_diff": stats.checked_max_abs_diff,
                      "topk_checked": stats.checked_topk_queries, "topk_ties": stats.checked_topk_ties,
                      "topk_boundary_ties": stats.checked_topk_boundary_ties,
                      "topk_near_ties": stats.checked_topk_near_ties,
                      "exact": exact, "lossy_against_fp32": lossy, "stored_rows": stored_rows,
                      "offload_against_all_resident": offload, "passed": passed,
                      "verdict": ("EXACT" if exact else f"WITHIN {str(label).upper()} TOLERANCE") if passed
                      else "FAILED"},
        "first_batch": first.to_json(),
        "stats": stats.to_json(),
        "seconds": {"transformers_alone": reference_s, "hisparse": hisparse_s},
    }
