"""The connector's worker role: a `HiSparseWorker` driven by vLLM's per-step worker hooks.

    (construction)       -> build the backend; refuse one on another device type than the engine's
    register_kv_caches   -> build and bind the HiSparseWorker (host pool) on that backend
    start_load_kv        -> worker.start_step(command)    (before or after the forward launch)
    wait_for_save        -> worker.after_forward()        (after the forward and the drafter)
    build_connector_worker_meta -> worker.build_metadata()  (each id once; None when empty)
    get_kv_connector_stats      -> worker.take_stats()      (counter deltas)
    shutdown             -> worker.shutdown()              (drain, release the pool)

Row mirrors are dropped here: vLLM's paged layouts do not store a token's row contiguously
(`layout.py`), so a row span names page bytes, not tokens. Every sealed page's spill copies the
whole page before the page is published, and only published pages are ever loaded, so the host
copy that anything reads is exact.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch

from hisparse_core.backend import Capability
from hisparse_core.errors import InvalidInputError, ProtocolError
from hisparse_core.geometry import RuntimeConfig
from hisparse_core.registry import Selection, select_backend
from hisparse_core.worker import CacheGroup, HiSparseWorker
from hisparse_vllm.config import ConnectorConfig
from hisparse_vllm.engine_checks import check_rope_is_row_independent
from hisparse_vllm.layout import HostTierLayout
from hisparse_vllm.metadata import HiSparseConnectorMetadata, HiSparseWorkerMetadata
from hisparse_vllm.selection import check_engine_device
from hisparse_vllm.stats import HiSparseConnectorStats

logger = logging.getLogger(__name__)

BACKEND_KEY = "kv_connector_extra_config['backend']"


def host_pool_sharing(config: ConnectorConfig, layout: HostTierLayout, parallel_config: Any,
                      world: int) -> tuple[bool, str | None]:
    """Whether the TP ranks of a node map one physical pool, and if not, why (for the worker's
    line): only where every rank holds the same pages (MLA), with one pipeline stage on one node,
    and when allowed (`share_host_pool`). The reason is None where it is shared or not requested."""
    if not config.share_host_pool:
        return False, None
    if world <= 1:
        return False, "single rank"
    if not layout.replicated:
        return False, f"KV heads sharded over {world} TP ranks: each rank keeps its own shard of every page"
    if parallel_config.pipeline_parallel_size != 1:
        return False, f"{parallel_config.pipeline_parallel_size} pipeline stages"
    nnodes = getattr(parallel_config, "nnodes", 1)
    if nnodes != 1:
        return False, f"{nnodes} nodes"
    return True, None


def shares_host_pool(config: ConnectorConfig, layout: HostTierLayout, parallel_config: Any, world: int) -> bool:
    """One physical pool for the TP ranks of a node (`host_pool_sharing`)."""
    return host_pool_sharing(config, layout, parallel_config, world)[0]


def _parallel_rank() -> tuple[int, int]:
    """(tensor-parallel rank, size) of this worker; (0, 1) outside a distributed setup."""
    try:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
            model_parallel_is_initialized,
        )
        if model_parallel_is_initialized():
            return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except (ImportError, AssertionError):
        pass
    return 0, 1


class WorkerSide:
    """Worker-role state of the connector (one per worker process)."""

    def __init__(self, vllm_config: Any, config: ConnectorConfig, layout: HostTierLayout,
                 selection: Selection) -> None:
        # The backend is built here, in the worker (building a GPU backend initialises CUDA, which the front
        # end and the engine core must not do), and must run where vLLM puts the KV cache: refused now, before
        # vLLM allocates its KV cache and before any host pool or /dev/shm file exists.
        self._backend = select_backend(config.backend)
        check_engine_device(self._backend, vllm_config.device_config.device_type, selection, BACKEND_KEY)
        # The model is built in this process by now: check the KV it computes can be loaded.
        check_rope_is_row_independent(vllm_config)
        self._vllm_config = vllm_config
        self._config = config
        self._layout = layout
        self._worker: HiSparseWorker | None = None
        self._mirrors_dropped = 0

    @property
    def worker(self) -> HiSparseWorker:
        if self._worker is None:
            raise ProtocolError("the hisparse worker is not built yet; vLLM calls register_kv_caches first")
        return self._worker

    # ----------------------------------------------------------------- setup

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._worker is not None:
            raise ProtocolError("register_kv_caches called twice; the host pool is bound once per worker")
        layout, cfg, vc = self._layout, self._config, self._vllm_config
        views = layout.device_views(kv_caches)  # validate the tensors before allocating anything
        backend = self._backend
        for name, view in ((n, v) for names, vs in zip(layout.group_layers, views, strict=False) for n, v in zip(names, vs, strict=False)):
            if view.device != backend.device:  # before the host pool exists: nothing to release
                raise InvalidInputError(f"KV cache of layer {name!r} is on {view.device}; backend {backend.name!r} "
                                        f"runs on {backend.device}, so its tables and caches must be there too")
        sharing = Capability.INDEX_SHARING in backend.capabilities
        max_seqs = vc.scheduler_config.max_num_seqs
        groups: list[CacheGroup] = []
        device_layers: list[list[torch.Tensor]] = []
        for g, (names, layer_views) in enumerate(zip(layout.group_layers, views, strict=False)):
            # The runtimes move pages (spills, restores, loads); nothing calls their resolver on
            # vLLM's attention, so their hot state takes the smallest geometry (one block).
            base = RuntimeConfig(max_batch_rows=max_seqs, max_requests=max_seqs, top_k=1, hot_rows=layout.block_size,
                                 block_size=layout.block_size, row_format=layout.row_format, num_layers=len(names),
                                 max_pages=layout.max_pages(vc.model_config.max_model_len))
            if sharing:  # one runtime for the group: followers replay the leader's plan
                groups.append(CacheGroup(base, resident_group=g, name=f"group{g}"))
                device_layers.append(layer_views)
            else:  # one runtime per layer
                for name, view in zip(names, layer_views, strict=False):
                    groups.append(CacheGroup(replace(base, num_layers=1), resident_group=g, name=name))
                    device_layers.append([view])
        rank, world = _parallel_rank()
        pc = vc.parallel_config
        share, not_shared_because = host_pool_sharing(cfg, layout, pc, world)
        if world > 1 and not layout.replicated:
            logger.info("hisparse: KV heads are sharded over %d TP ranks, so rank %d keeps a private pool of "
                        "host_pool_gib/%d = %.4g GiB (its shard of every page)", world, rank, world,
                        layout.rank_budget_gib(cfg.host_pool_gib))
        pool_name = f"{vc.kv_transfer_config.engine_id}-dp{pc.data_parallel_rank}" if share else None
        num_blocks = layout.coordinator_config(cfg.host_pool_gib, vc.model_config.max_model_len).host_num_blocks
        self._worker = HiSparseWorker(backend, groups, num_host_blocks=num_blocks, rank=rank, world_size=world,
                                      share_host_pool=share, pool_name=pool_name,
                                      not_shared_because=not_shared_because)
        self._worker.register_caches(device_layers)
        logger.info("hisparse connector worker: %d layers in %d KV-cache group(s), block_size %d, page %d B per layer; "
                    "%d runtime(s) (%s); host pool sized like the scheduler's (%d blocks for %s GiB)",
                    layout.num_layers, layout.num_groups, layout.block_size, layout.page_bytes, len(groups),
                    "one per group: backend shares miss plans" if sharing else
                    "one per layer: backend lacks index_sharing", num_blocks, cfg.host_pool_gib)

    # ----------------------------------------------------------------- per step

    def start_step(self, metadata: object) -> None:
        if not isinstance(metadata, HiSparseConnectorMetadata):
            raise ProtocolError(f"expected HiSparseConnectorMetadata from the scheduler, got {type(metadata).__name__}")
        worker = self.worker
        if metadata.reset_hot_state:
            worker.reset_state()
        command = metadata.command
        if command is not None and command.row_mirrors:
            if not self._mirrors_dropped:
                logger.info("hisparse: row mirrors are skipped on vLLM's paged layout (a token's K/V is not one "
                            "contiguous row); sealed pages reach the host pool whole through their spills")
            self._mirrors_dropped += len(command.row_mirrors)
            command = replace(command, row_mirrors=())
        worker.start_step(command)

    def finish_step(self) -> None:
        self.worker.after_forward()

    def build_worker_meta(self) -> HiSparseWorkerMetadata | None:
        acks = self.worker.build_metadata()
        return None if acks.is_empty() else HiSparseWorkerMetadata(acks)

    def stats(self) -> HiSparseConnectorStats | None:
        if self._worker is None:
            return None
        s = self._worker.take_stats()
        if not (s.h2d_bytes or s.d2h_bytes):
            return None
        return HiSparseConnectorStats().record(host_to_device_bytes=s.h2d_bytes, device_to_host_bytes=s.d2h_bytes)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
