"""A real vLLM `Scheduler` with the hisparse connector in both roles, driven step by step.

Nothing of vLLM is mocked: the scheduler, KV cache manager, block pool, connector factory and
`KVOutputAggregator` are vLLM's own. What stands in for the model runner is `Rig.forward`, which
writes each scheduled token's K and V into the worker's KV tensors in vLLM's CPU layout
(`[num_blocks, num_kv_heads, block_size, 2 * head_size]`, read as `[.., 2 * block_size, head_size]`
with K rows then V rows) as a function of (position, token id), so a page loaded from the host
pool can be compared with what recomputing it would have written.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.plugins import load_general_plugins  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

import hisparse_vllm  # noqa: E402

BLOCK = 16
HEADS = 2
HEAD_DIM = 32
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")

init_none_hash(sha256)
# What every vLLM process does at start-up; it runs hisparse_vllm.register through the
# package's `vllm.general_plugins` entry point (the Scheduler itself does not load plugins).
load_general_plugins()


def write_tiny_llama(directory: Path) -> Path:
    """A 2-layer Llama config (head_dim 32, the smallest the CPU attention backend takes)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HEADS * 2 * HEAD_DIM,
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": HEADS,
        "num_hidden_layers": len(LAYERS), "vocab_size": 512, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
        "tie_word_embeddings": False,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def vllm_config(model_dir: Path, *, extra: dict[str, Any] | None = None, world_size: int = 1,
                max_num_seqs: int = 4, max_model_len: int = 256, batched_tokens: int = 128,
                connector: str = hisparse_vllm.CONNECTOR_NAME, module_path: str | None = None,
                prefix_caching: bool = True, kv_role: str = "kv_both") -> VllmConfig:
    extra = {"host_pool_gib": 0.002, "backend": "reference_cpu"} if extra is None else extra
    return VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", seed=0,
                                 max_model_len=max_model_len),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=batched_tokens,
                                         max_model_len=max_model_len, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching),
        parallel_config=ParallelConfig(tensor_parallel_size=world_size),
        kv_transfer_config=KVTransferConfig(kv_connector=connector, kv_role=kv_role,
                                            kv_connector_extra_config=extra, kv_connector_module_path=module_path),
        device_config=DeviceConfig("cpu"),
    )


def kv_cache_config(num_blocks: int) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])


def kv_value(position: int, token: int, layer: int, head: int, v: bool) -> float:
    """What the stand-in forward writes for one (token, layer, head, K|V) row."""
    return float((position * 131 + token * 7 + layer * 17 + head * 3 + (5 if v else 0)) % 1009)


@dataclass
class Rig:
    """One scheduler-role connector inside a real `Scheduler`, plus `num_workers` worker-role ones."""

    scheduler: Scheduler
    workers: list[Any]
    caches: list[dict[str, torch.Tensor]]
    aggregator: KVOutputAggregator
    token_of: dict[str, list[int]] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)
    steps: int = 0
    last_worker_metas: list[Any] = field(default_factory=list)  # each worker's own report, last step
    last_output: Any = None  # the (aggregated) ModelRunnerOutput the scheduler got, last step
    connector_stats: list[dict[str, Any]] = field(default_factory=list)  # SchedulerStats.kv_connector_stats
    #: vLLM's own counters of the connector's hits (SchedulerStats.connector_prefix_cache_stats), per step.
    vllm_connector_hits: list[Any] = field(default_factory=list)

    @classmethod
    def build(cls, config: VllmConfig, *, num_blocks: int = 64, num_workers: int = 1) -> Rig:
        kvc = kv_cache_config(num_blocks)
        config.cache_config.num_gpu_blocks = num_blocks
        scheduler = Scheduler(vllm_config=config, kv_cache_config=kvc, log_stats=True,
                              structured_output_manager=StructuredOutputManager(config), block_size=BLOCK)
        workers, caches = [], []
        for _ in range(num_workers):
            worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kvc)
            cache = {name: torch.zeros(num_blocks, HEADS, BLOCK, 2 * HEAD_DIM) for name in LAYERS}
            worker.register_kv_caches(cache)
            workers.append(worker)
            caches.append(cache)
        return cls(scheduler, workers, caches, KVOutputAggregator(num_workers))

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    @property
    def side(self) -> Any:
        return self.scheduler.connector.scheduler_side

    def add(self, request_id: str, prompt: Sequence[int], max_tokens: int) -> Request:
        request = Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                          block_hasher=get_request_block_hasher(BLOCK, sha256))
        self.scheduler.add_request(request)
        return request

    def forward(self, worker: int, scheduler_output: Any) -> None:
        """Write the K and V rows of every scheduled token into worker `worker`'s caches."""
        manager = self.scheduler.kv_cache_manager
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        for rid, count in scheduler_output.num_scheduled_tokens.items():
            request = self.scheduler.requests[rid]
            (blocks,) = manager.get_block_ids(rid)
            tokens = request.all_token_ids
            for pos in range(computed[rid], computed[rid] + count):
                if pos >= len(tokens):
                    break  # the output token's own row is written when it is fed back
                block, off = divmod(pos, BLOCK)
                for li, name in enumerate(LAYERS):
                    view = self.caches[worker][name].view(-1, HEADS, 2 * BLOCK, HEAD_DIM)
                    for h in range(HEADS):
                        view[blocks[block], h, off] = kv_value(pos, tokens[pos], li, h, False)
                        view[blocks[block], h, BLOCK + off] = kv_value(pos, tokens[pos], li, h, True)

    def step(self, after_schedule: Any = None) -> Any:
        """One engine step: schedule, run every worker (bind, load, forward, save, report),
        aggregate with vLLM's aggregator, update the scheduler. `after_schedule()` runs between
        the schedule and the workers (where an abort can land in an engine that pipelines steps)."""
        so = self.scheduler.schedule()
        if after_schedule is not None:
            after_schedule()
        outputs = []
        for i, worker in enumerate(self.workers):
            worker.bind_connector_metadata(so.kv_connector_metadata)
            worker.start_load_kv(None)
            self.forward(i, so)
            worker.wait_for_save()
            kv_out = KVConnectorOutput(kv_connector_worker_meta=worker.build_connector_worker_meta(),
                                       kv_connector_stats=worker.get_kv_connector_stats())
            worker.clear_connector_metadata()
            outputs.append(self._runner_output(so, kv_out))
        self.last_worker_metas = [o.kv_connector_output.kv_connector_worker_meta for o in outputs]
        output = self.aggregator.aggregate(outputs) if len(outputs) > 1 else outputs[0]
        self.last_output = output
        engine_outputs = self.scheduler.update_from_output(so, output)
        for eco in engine_outputs.values():
            if eco.scheduler_stats is not None and eco.scheduler_stats.kv_connector_stats:
                self.connector_stats.append(eco.scheduler_stats.kv_connector_stats)
            if eco.scheduler_stats is not None and eco.scheduler_stats.connector_prefix_cache_stats is not None:
                self.vllm_connector_hits.append(eco.scheduler_stats.connector_prefix_cache_stats)
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.finished.append(o.request_id)
        self.steps += 1
        return so

    def _runner_output(self, so: Any, kv_out: KVConnectorOutput) -> ModelRunnerOutput:
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            request = self.scheduler.requests[rid]
            pos = request.num_tokens
            sampled.append([(pos * 37 + 11) % 500 + 3])
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=sampled, kv_connector_output=kv_out)

    def collected(self) -> Any:
        """Every connector stats object the scheduler reported so far, aggregated (as vLLM's logger does)."""
        from hisparse_vllm.connector import HiSparseOffloadConnector
        from hisparse_vllm.stats import HiSparseConnectorStats

        out = HiSparseConnectorStats()
        for payload in self.connector_stats:
            out.aggregate(HiSparseOffloadConnector.build_kv_connector_stats(payload))
        return out

    def vllm_hits(self) -> dict[str, int]:
        """vLLM's own totals of the connector's hits: by source for new requests, and preempted."""
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        return {"host": sum(s.hits_by_source.get(CacheHitSource.HOST, 0) for s in self.vllm_connector_hits),
                "all_new": sum(s.hits for s in self.vllm_connector_hits),
                "preempted": sum(s.preempted_hits for s in self.vllm_connector_hits)}

    def run(self, until_idle: bool = True, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                return
            self.step()
        raise AssertionError(f"scheduler still busy after {max_steps} steps: {self.describe()}")

    def describe(self) -> dict[str, Any]:
        stats = self.side.coordinator.stats()
        return {"requests": {r: str(q.status) for r, q in self.scheduler.requests.items()},
                "coordinator": stats, "loads": len(self.side.loads), "pending": self.connector.has_pending_push_work()}

    def host_page(self, worker: int, host_block: int) -> list[torch.Tensor]:
        """One host block's bytes per layer, as the worker's host pool holds them."""
        pool = self.workers[worker].worker_side.worker.host_pool
        return [pool.layer_view(li)[host_block * BLOCK:(host_block + 1) * BLOCK] for li in range(len(LAYERS))]

    def device_page(self, worker: int, block: int) -> list[torch.Tensor]:
        return [self.caches[worker][name][block].reshape(-1).view(torch.uint8).view(BLOCK, -1) for name in LAYERS]

    def expected_page(self, tokens: Sequence[int], page: int) -> list[torch.Tensor]:
        """The bytes the stand-in forward writes for a full page of `tokens`."""
        out = []
        for li in range(len(LAYERS)):
            page_t = torch.zeros(HEADS, 2 * BLOCK, HEAD_DIM)
            for off in range(BLOCK):
                pos = page * BLOCK + off
                for h in range(HEADS):
                    page_t[h, off] = kv_value(pos, tokens[pos], li, h, False)
                    page_t[h, BLOCK + off] = kv_value(pos, tokens[pos], li, h, True)
            out.append(page_t.reshape(-1).view(torch.uint8).view(BLOCK, -1))
        return out

    def assert_no_leaks(self) -> None:
        side = self.side
        stats = side.coordinator.stats()
        assert stats.host_blocks_used == 0, stats
        assert stats.pending_transfers == 0 and stats.pending_host_copies == 0, stats
        assert stats.running_requests == 0 and stats.detached_requests == 0, stats
        assert len(side.loads) == 0 and not side._delayed and not side._inflight and not side._delayed_loads
        assert side.gpu_blocks.num_pinned == 0 and side.gpu_blocks.num_acquired == 0
        pool = self.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1, "GPU blocks still held"
        assert not self.scheduler.requests
        for worker in self.workers:
            assert worker.worker_side.worker.pending_transfers == 0


def statuses(requests: Iterable[Request]) -> list[RequestStatus]:
    return [r.status for r in requests]
