"""One real vLLM `LLM` on CPU (tiny Llama), with or without the hisparse connector; prints a JSON
report. Run by test_vllm_engine.py in a subprocess per configuration (an engine per process):

    python tests/vllm_connector/engine_run.py MODEL_DIR plain|connector|small-pool|mp-reset

`plain` and `connector`: batch 1 (two prompts sharing a 192-token prefix) runs, the engine
drains, vLLM's own GPU prefix cache is reset, then batch 2 (same prefix, other suffixes) runs:
without the connector its prefix is recomputed, with it the prefix comes from the host pool
(stepped one engine step at a time, auditing that no GPU block is leased beyond the requests'
own). With the connector it then reruns batch 2 with vLLM's GPU prefix cache holding the prefix
(vLLM serves it, nothing loads), corrupts the host pool and reruns batch 2 from it (the outputs
must change), and resets the connector's cache. `connector` installs a root logging handler
first, as some libraries do, to show that hisparse lines still print once.

Every mode then runs the admission workload of issue 16, item 2: six requests with enough GPU
blocks for all, counting engine steps and the most requests running at once. `small-pool` runs
only that, with the smallest host pool the connector accepts.

`mp-reset` runs with the engine core in a child process (VLLM_ENABLE_V1_MULTIPROCESSING=1): two
batches, then the connector reset, reading the gauges at once (issue 41, item 3).

`plain` and `connector` end with the shared-prefix trace of issue 41, item 1: one request
publishes a 384-token prefix, vLLM's GPU prefix cache is reset, then six requests sharing that
prefix are admitted together. Every engine has a small GPU cache (`GPU_BLOCKS`): six private
copies of the prefix would not fit, one shared copy does.
"""

from __future__ import annotations

import logging
import random
import sys
from typing import Any

import engine_driver as ed

PREFIX_TOKENS = 192
BLOCK = 32
MAX_MODEL_LEN = 512
#: One host block of the tiny Llama: 2 layers x 32 tokens x (K + V) x 2 heads x 32 x 4 B.
HOST_BLOCK_BYTES = 2 * BLOCK * 2 * 2 * 32 * 4
#: The smallest pool: one max_model_len request (16 pages), the 2-page active tail, the null block.
SMALLEST_POOL_GIB = (MAX_MODEL_LEN // BLOCK + 2 + 1) * HOST_BLOCK_BYTES / 2**30
#: vLLM's KV cache, in blocks: room for every workload here, not for six copies of a 12-page prefix.
GPU_BLOCKS = 48
SHARED_PREFIX_TOKENS = 384


def prompts(seed: int, count: int, prefix: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [prefix + [rng.randrange(3, 500) for _ in range(24)] for _ in range(count)]


def engine(model_dir: str, host_pool_gib: float | None) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    if host_pool_gib is not None:
        kwargs["kv_transfer_config"] = ed.kv_transfer(host_pool_gib)
    return LLM(model=model_dir, skip_tokenizer_init=True, load_format="dummy", dtype="float32", block_size=BLOCK,
               max_model_len=MAX_MODEL_LEN, max_num_seqs=6, enforce_eager=True, seed=0, disable_log_stats=False,
               num_gpu_blocks_override=GPU_BLOCKS, **kwargs)


def step_through(d: ed.Driver, batch: list[list[int]], params: Any, check: Any = None) -> dict[str, Any]:
    """Add `batch`, step the engine until every request finished: the steps, the most requests
    running at once, and each request's tokens and cached prompt tokens."""
    from vllm.inputs import TokensPrompt

    engine_ = d.llm.llm_engine
    ids = [f"step-{d.added + i}" for i in range(len(batch))]
    d.added += len(batch)
    for i, (rid, p) in enumerate(zip(ids, batch, strict=False)):
        engine_.add_request(rid, TokensPrompt(prompt_token_ids=p), params[i] if isinstance(params, list) else params)
    steps = peak = 0
    finished: dict[str, Any] = {}
    preemptions = dict.fromkeys(ids, 0)
    while len(finished) < len(batch):
        for out in engine_.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        peak = max(peak, len(d.scheduler.running))
        for rid in ids:
            request = d.scheduler.requests.get(rid)
            if request is not None:
                preemptions[rid] = max(preemptions[rid], request.num_preemptions)
        if check is not None:
            check()
        assert steps < 2000, "the workload did not finish"
    return {"steps": steps, "peak_running": peak, "tokens": [list(finished[r].outputs[0].token_ids) for r in ids],
            "cached": [int(finished[r].num_cached_tokens or 0) for r in ids],
            "preemptions": sum(preemptions.values())}


def admission(d: ed.Driver, seed: int = 2, max_tokens: int | None = None) -> dict[str, Any]:
    """Six 96-token prompts generating 16, 24, ..., 56 tokens: 4 or 5 pages each, 27 in all."""
    from vllm import SamplingParams

    rng = random.Random(seed)
    batch = [[rng.randrange(3, 500) for _ in range(96)] for _ in range(6)]
    params = [SamplingParams(max_tokens=max_tokens or 16 + 8 * i, temperature=0.0, ignore_eos=True, detokenize=False)
              for i in range(6)]
    uncached: list[int] = []

    def check() -> None:
        uncached.append(len(getattr(d.side, "_uncached", ())))  # absent before issue 16's fix

    out = step_through(d, batch, params, check if d.scheduler.connector is not None else None)
    out["most_uncached"] = max(uncached, default=0)
    return out


def shared_prefix(d: ed.Driver) -> dict[str, Any]:
    """Issue 41, item 1: six requests sharing a 12-page prefix that only the host pool holds,
    admitted together under the small GPU cache: steps, preemptions, pages loaded, tokens."""
    from vllm import SamplingParams

    rng = random.Random(41)
    prefix = [rng.randrange(3, 500) for _ in range(SHARED_PREFIX_TOKENS)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, detokenize=False)
    side = d.side if d.scheduler.connector is not None else None
    d.generate([prefix + [7] * 8], params)  # publishes the prefix's 12 pages on host (with the connector)
    d.drain()
    assert d.llm.reset_prefix_cache()
    loaded = side.loads.loaded_pages if side is not None else 0
    out = step_through(d, prompts(41, 6, prefix), params)
    d.drain()
    out["loaded_pages"] = side.loads.loaded_pages - loaded if side is not None else 0
    out["distinct_pages"] = SHARED_PREFIX_TOKENS // BLOCK
    return out


class GpuBlockAudit:
    """Per step: GPU blocks the connector leased itself (a hot buffer would be), and blocks in use
    that no request holds and no transfer pins. Both stay 0 on vLLM's attention."""

    def __init__(self, d: ed.Driver) -> None:
        self.d = d
        self.most_acquired = self.most_unaccounted = self.steps = 0

    def __call__(self) -> None:
        sched = self.d.scheduler
        manager, pool, gpu = sched.kv_cache_manager, sched.kv_cache_manager.block_pool, self.d.side.gpu_blocks
        held = {b for rid in sched.requests for group in manager.get_block_ids(rid) for b in group}
        in_use = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
        self.most_acquired = max(self.most_acquired, gpu.num_acquired)
        self.most_unaccounted = max(self.most_unaccounted, in_use - len(held) - gpu.num_pinned)
        self.steps += 1


def child_engine_reset(model_dir: str) -> dict[str, Any]:
    """Issue 41, item 3, with the engine core in a child process (`mp-reset`): the offline
    gauges after `reset_prefix_cache(reset_connector=True)`, read at once."""
    from vllm import SamplingParams

    d = ed.Driver(engine(model_dir, 0.05))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False)
    rng = random.Random(7)
    prefix = [rng.randrange(3, 500) for _ in range(PREFIX_TOKENS)]
    d.generate(prompts(1, 2, prefix), params)
    d.generate(prompts(2, 2, prefix), params)  # its steps report the first batch's published pages
    report: dict[str, Any] = {"child_process": not hasattr(d.client, "engine_core"), "before": d.metrics()}
    report["full_reset"] = d.llm.reset_prefix_cache(reset_connector=True)
    report["after"] = d.metrics()
    return report


def main(model_dir: str, mode: str) -> dict[str, Any]:
    if mode == "mp-reset":
        return child_engine_reset(model_dir)
    records = ed.Records()
    logging.getLogger("hisparse_vllm").addHandler(records)
    if mode == "connector":
        logging.basicConfig(level=logging.INFO)  # a root handler, as vLLM's zentorch helpers install
    pool = {"plain": None, "connector": 0.05, "small-pool": SMALLEST_POOL_GIB}[mode]
    d = ed.Driver(engine(model_dir, pool))
    report: dict[str, Any] = {}
    if mode == "small-pool":
        report["admission"] = admission(d)
        d.drain()
        report["host_after"] = d.host_stats()
        # A second wave of new prompts: its pages evict the first wave's cached ones.
        report["second_wave"] = admission(d, seed=3, max_tokens=8)
        d.drain()
        report["host_after_second"] = d.host_stats()
        report["warnings"] = records.messages(logging.WARNING, "host pool full")
        report["metrics"] = d.metrics()
        return report
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False)
    rng = random.Random(1234)
    prefix = [rng.randrange(3, 500) for _ in range(PREFIX_TOKENS)]
    if pool is not None:
        report["baseline"] = d.host_stats()
    batch1 = d.generate(prompts(1, 2, prefix), params)
    report["batch1"], report["cached1"] = [r["tokens"] for r in batch1], [r["cached"] for r in batch1]
    report["drain1"] = d.drain()
    if pool is not None:
        s = d.side.coordinator.stats()
        report["spills1"] = {"spills": s.spills, "shared": s.shared_spills, "published": s.published_blocks}
    report["gpu_reset1"] = d.llm.reset_prefix_cache()
    if pool is None:
        batch2 = d.generate(prompts(2, 2, prefix), params)
        report["batch2"], report["cached2"] = [r["tokens"] for r in batch2], [r["cached"] for r in batch2]
    else:
        # Stepped, to audit the GPU blocks at every step while the prefixes load and run.
        audit = GpuBlockAudit(d)
        batch2 = step_through(d, prompts(2, 2, prefix), params, audit)
        report["batch2"], report["cached2"] = batch2["tokens"], batch2["cached"]
        report["gpu_audit"] = {"steps": audit.steps, "most_acquired": audit.most_acquired,
                               "most_unaccounted": audit.most_unaccounted}
    report["drain2"] = d.drain()
    if pool is not None:
        report["after_batch2"] = d.host_stats()
        report["loaded_pages"] = d.side.loads.loaded_pages
        # Again, with vLLM's GPU prefix cache holding the prefix: it serves it, the host does not.
        report["cached2_gpu"] = [r["cached"] for r in d.generate(prompts(2, 2, prefix), params)]
        d.drain()
        report["loaded_pages_gpu"] = d.side.loads.loaded_pages
        d.corrupt_host_pool()
        report["gpu_reset2"] = d.llm.reset_prefix_cache()
        corrupt = d.generate(prompts(2, 2, prefix), params)
        report["batch2_corrupt"] = [r["tokens"] for r in corrupt]
        report["cached2_corrupt"] = [r["cached"] for r in corrupt]
        report["drain3"] = d.drain()
        report["metrics"] = d.metrics()
        report["vllm_host_tokens"] = d.vllm_cached_tokens("host")
        report["full_reset"] = d.llm.reset_prefix_cache(reset_connector=True)
        report["metrics_after_reset"] = d.metrics()  # at once, no generate in between (issue 41.3)
        report["after_reset"] = d.host_stats()
        report["busy_after_reset"] = d.scheduler.has_requests()
    assert d.llm.reset_prefix_cache()
    report["admission"] = admission(d)
    d.drain()
    assert d.llm.reset_prefix_cache()
    report["shared_prefix"] = shared_prefix(d)
    if pool is not None:
        report["metrics_end"] = d.metrics()
        report["shared_lines"] = records.messages(logging.INFO, "came from vLLM's GPU prefix cache, not loaded again")
    return report


if __name__ == "__main__":
    ed.report(main(sys.argv[1], sys.argv[2]))
