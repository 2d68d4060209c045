"""Helpers for the engine scripts (engine_run.py, mla_run.py): one real in-process vLLM `LLM` per
script, driven through its public API plus the engine core it owns (for stepping and for the
connector's own state). Nothing of vLLM is replaced.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

CONNECTOR = "HiSparseOffloadConnector"


def kv_transfer(host_pool_gib: float) -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector=CONNECTOR, kv_role="kv_both",
                            kv_connector_extra_config={"host_pool_gib": host_pool_gib, "backend": "reference_cpu"})


class Driver:
    """One `LLM` and what the tests read from it."""

    def __init__(self, llm: Any) -> None:
        from vllm import SamplingParams

        self.llm = llm
        self.client = llm.llm_engine.engine_core
        self.params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=0)
        self.added = 0  # requests added by id (engine_run.step_through)

    @property
    def core(self) -> Any:
        """The in-process `EngineCore` (absent with the engine core in a child process)."""
        return self.client.engine_core

    @property
    def scheduler(self) -> Any:
        return self.core.scheduler

    @property
    def side(self) -> Any:
        return self.scheduler.connector.scheduler_side

    def generate(self, batch: list[list[int]], params: Any = None) -> list[dict[str, Any]]:
        """Greedy tokens, their logprobs and the prompt tokens vLLM did not compute, per prompt; with
        `logprobs >= 2` also each token's margin over the runner-up ("margins")."""
        from vllm.inputs import TokensPrompt

        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params or self.params,
                                 use_tqdm=False)
        report = []
        for o in outs:
            out = o.outputs[0]
            logprobs = [d[t].logprob for t, d in zip(out.token_ids, out.logprobs, strict=False)] if out.logprobs else []
            entry = {"tokens": list(out.token_ids), "logprobs": logprobs, "cached": int(o.num_cached_tokens or 0)}
            if out.logprobs and all(len(d) >= 2 for d in out.logprobs):
                ranked = [sorted((x.logprob for x in d.values()), reverse=True) for d in out.logprobs]
                entry["margins"] = [r[0] - r[1] for r in ranked]
            report.append(entry)
        return report

    def drain(self) -> int:
        """Step until the connector's transfers are acknowledged: `LLM.generate` returns when the
        outputs are complete, and the scheduler reports work (has_pending_push_work) until then."""
        steps = 0
        while self.scheduler.has_requests() and steps < 100:
            self.client.get_output()
            steps += 1
        assert not self.scheduler.has_requests(), "engine did not drain"
        return steps

    def host_stats(self) -> dict[str, int]:
        s = self.side.coordinator.stats()
        return {"used": s.host_blocks_used, "cached": s.host_blocks_cached, "published": s.published_blocks,
                "prefix_hit_tokens": s.prefix_hit_tokens, "pending": s.pending_transfers, "evicted": s.evicted_blocks}

    def corrupt_host_pool(self, seed: int = 0) -> None:
        """Overwrite the host pool with noise (the pages a later load must then bring in): finite
        fp32 values, not random bytes. Random bytes hold NaNs, and a GPU block they were loaded
        into keeps them when vLLM hands it out again; the CPU attention reads a reused block's
        stale tail slots (masked, but 0 * NaN is NaN), so a later request on a small GPU cache
        would sample from NaN logits: a fault of the test, not of the pages it loads."""
        import torch
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group().worker_side.worker
        gen = torch.Generator().manual_seed(seed)
        for layer in range(worker.host_pool_spec.num_layers):
            view = worker.host_pool.layer_view(layer)
            noise = torch.rand(view.numel() * view.element_size() // 4, generator=gen) * 8 - 4
            view.copy_(noise.view(view.dtype).view(view.shape))

    def metrics(self) -> dict[str, Any]:
        return {m.name: getattr(m, "value", None) for m in self.llm.get_metrics() if "hisparse" in m.name}

    def vllm_cached_tokens(self, source: str) -> int:
        """vLLM's own count of prompt tokens served by one cache tier (`vllm:prompt_tokens_cached_by_source`)."""
        return int(sum(getattr(m, "value", 0) for m in self.llm.get_metrics()
                       if m.name == "vllm:prompt_tokens_cached_by_source" and m.labels.get("source") == source))


class Records(logging.Handler):
    """Keeps the hisparse log records a script saw (added next to vLLM's handlers)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, level: int, contains: str) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level and contains in r.getMessage()]


def report(result: dict[str, Any]) -> None:
    print("ENGINE_REPORT " + json.dumps(result), flush=True)
