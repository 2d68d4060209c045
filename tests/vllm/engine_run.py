"""One real vLLM `LLM` on CPU, with or without the hisparse connector; prints a JSON report.

Run by test_vllm_engine.py in a subprocess per configuration (an engine per process):

    python tests/vllm/engine_run.py MODEL_DIR [--connector]

Batch 1 (two prompts sharing a 192-token prefix) runs, the engine drains, vLLM's own GPU prefix
cache is reset, then batch 2 (same prefix, other suffixes) runs: without the connector its
prefix is recomputed, with it the prefix comes from the host pool. With the connector it then
corrupts the host pool and reruns batch 2 (the outputs must change, proving the loaded bytes are
used), and finally resets the connector's cache and reports the pool usage against its baseline.
"""

from __future__ import annotations

import json
import os
import random
import sys
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

PREFIX_TOKENS = 192
BLOCK = 32


def prompts(seed: int, count: int, prefix: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [prefix + [rng.randrange(3, 500) for _ in range(24)] for _ in range(count)]


def main(model_dir: str, with_connector: bool) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {}
    if with_connector:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="HiSparseOffloadConnector", kv_role="kv_both",
            kv_connector_extra_config={"host_pool_gib": 0.05, "backend": "reference_cpu"})
    llm = LLM(model=model_dir, skip_tokenizer_init=True, load_format="dummy", dtype="float32", block_size=BLOCK,
              max_model_len=512, max_num_seqs=4, enforce_eager=True, seed=0, disable_log_stats=False, **kwargs)
    client = llm.llm_engine.engine_core
    scheduler = client.engine_core.scheduler
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False)
    rng = random.Random(1234)
    prefix = [rng.randrange(3, 500) for _ in range(PREFIX_TOKENS)]

    def generate(batch: list[list[int]]) -> tuple[list[list[int]], list[int]]:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], [int(o.num_cached_tokens or 0) for o in outs]

    def drain() -> int:
        # LLM.generate returns when outputs are complete; transfers may still be in flight. The
        # scheduler keeps reporting work (has_pending_push_work) until they are acknowledged.
        steps = 0
        while scheduler.has_requests() and steps < 100:
            client.get_output()
            steps += 1
        assert not scheduler.has_requests(), "engine did not drain"
        return steps

    def host_stats() -> dict[str, int]:
        s = scheduler.connector.scheduler_side.coordinator.stats()
        return {"used": s.host_blocks_used, "cached": s.host_blocks_cached, "published": s.published_blocks,
                "prefix_hit_tokens": s.prefix_hit_tokens, "pending": s.pending_transfers}

    report: dict[str, Any] = {}
    if with_connector:
        report["baseline"] = host_stats()
    report["batch1"], report["cached1"] = generate(prompts(1, 2, prefix))
    report["drain1"] = drain()
    report["gpu_reset1"] = llm.reset_prefix_cache()
    report["batch2"], report["cached2"] = generate(prompts(2, 2, prefix))
    report["drain2"] = drain()
    if with_connector:
        side = scheduler.connector.scheduler_side
        report["after_batch2"] = host_stats()
        report["loaded_pages"] = side.loads.loaded_pages
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group().worker_side.worker
        gen = __import__("torch").Generator().manual_seed(0)
        for layer in range(worker.host_pool_spec.num_layers):
            view = worker.host_pool.layer_view(layer)
            view.copy_(__import__("torch").randint(0, 256, view.shape, dtype=view.dtype, generator=gen))
        report["gpu_reset2"] = llm.reset_prefix_cache()
        report["batch2_corrupt"], report["cached2_corrupt"] = generate(prompts(2, 2, prefix))
        report["drain3"] = drain()
        report["full_reset"] = llm.reset_prefix_cache(reset_connector=True)
        report["after_reset"] = host_stats()
        report["metrics"] = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if "hisparse" in m.name}
    return report


if __name__ == "__main__":
    result = main(sys.argv[1], "--connector" in sys.argv[2:])
    print("ENGINE_REPORT " + json.dumps(result), flush=True)
