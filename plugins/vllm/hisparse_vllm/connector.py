"""`HiSparseOffloadConnector`: hisparse behind vLLM's public KV-connector API (v1, HMA).

Standard role split: the scheduler-role instance wraps `HiSparseCoordinator`
(`scheduler_side.py`), the worker-role instance wraps `HiSparseWorker` (`worker_side.py`).
Metadata flows only through `build_connector_meta` -> `bind_connector_metadata` (scheduler to
workers) and `build_connector_worker_meta` -> `aggregate` -> `update_connector_output`
(workers to scheduler). `kv_connector_extra_config` is described in `config.py`. A bad key or
value fails in the front end, with one ERROR line naming it, while vLLM builds `VllmConfig`,
before any engine process starts or any weight loads, on every platform (CPU and `enforce_eager`
included): vLLM passes the connector configuration to no connector hook there on every path
(`requires_piecewise_for_cudagraph` only with CUDA graphs on), so the general plugin has vLLM's
`KVConnectorFactory.get_connector_class`, which `VllmConfig` calls with the `KVTransferConfig` to
ask for HMA support, run `check_kv_transfer_config` on this class (`frontend_check.py`).
`get_required_kvcache_layout` (engine core) and each role, when it is built, check again. The
host pool's size is checked in the engine core, before anything is allocated: against the node's
RAM (the engine's node; how many pools it holds depends on the KV layout) and against one
max_model_len request (the page size comes from the KV cache vLLM builds there).

On a stock engine this is the host tier: sealed pages are spilled to the host pool, prefixes
published there are loaded instead of recomputed, blocks are freed only after their spills
complete, and every finished transfer is reported once.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hisparse_core.backend import Capability
from hisparse_core.errors import BackendError, HiSparseError, InvalidInputError, ProtocolError
from hisparse_core.registry import Selection, get_registry
from hisparse_vllm import CONNECTOR_NAME
from hisparse_vllm.config import KV_ROLE, ConnectorConfig
from hisparse_vllm.layout import HostTierLayout
from hisparse_vllm.logs import route_to_vllm_handlers
from hisparse_vllm.metadata import HiSparseConnectorMetadata
from hisparse_vllm.scheduler_side import SchedulerSide
from hisparse_vllm.stats import HiSparseConnectorStats, HiSparsePromMetrics
from hisparse_vllm.worker_side import WorkerSide, shares_host_pool

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


@contextmanager
def _one_line_errors() -> Iterator[None]:
    """A start-up error is logged as one ERROR line through vLLM's handlers before it propagates,
    so it stands out in the terminal above vLLM's generic "Engine core initialization failed"."""
    try:
        yield
    except HiSparseError as exc:
        logger.error("hisparse connector cannot start: %s", exc)
        raise


def _check_extra_config(vllm_config: VllmConfig) -> tuple[ConnectorConfig, Selection]:
    """Parse and check `kv_connector_extra_config`; an unknown or unavailable backend fails now,
    in every role, not at the first step. Pipeline parallelism is refused here too: in the engine
    core's layout query and when a worker builds its role, before any host pool is allocated (the
    scheduler role, which refused it alone, is built after the workers allocated theirs)."""
    transfer = vllm_config.kv_transfer_config
    assert transfer is not None, "the connector is only built from a kv_transfer_config"
    checked = check_kv_transfer(transfer)
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp > 1:
        raise InvalidInputError(f"hisparse connector: pipeline_parallel_size={pp} is not supported; expected 1 "
                                "(every worker must hold every layer of a host block)")
    return checked


def check_kv_role(kv_role: object) -> None:
    """The connector is a host tier of one engine: it saves that engine's KV to its host pool and
    loads it back there, and moves none between engines, so it has no producer or consumer side
    (`kv_producer` / `kv_consumer` are disaggregated prefill's roles). Anything but `kv_both` is
    refused rather than run as `kv_both`."""
    if kv_role != KV_ROLE:
        raise InvalidInputError(
            f"kv_role={kv_role!r}: {CONNECTOR_NAME} is a host tier of one engine (it saves and loads that engine's "
            f"own KV and moves none between engines), so it has no producer or consumer side; expected "
            f"{KV_ROLE!r} (its own entry's kv_role where a MultiConnector holds it)")


def check_kv_transfer(transfer: Any) -> tuple[ConnectorConfig, Selection]:
    """Every check of a `KVTransferConfig` that needs no KV cache: `kv_role`, then
    `kv_connector_extra_config` (`check_extra_config`)."""
    check_kv_role(transfer.kv_role)
    return check_extra_config(transfer.kv_connector_extra_config)


def check_extra_config(extra: dict[str, Any] | None) -> tuple[ConnectorConfig, Selection]:
    """Every check of `kv_connector_extra_config` that needs no KV cache: keys, values, no hot
    buffer, the backend installed and available on this node, and the backend's own settings
    (its `check_settings()`, on its class, as `hisparse_vllm.ops.register_ops` runs it: nothing is
    constructed, so CUDA is left alone)."""
    config = ConnectorConfig.from_extra_config(extra)
    config.check_stock_attention()
    registry = get_registry()
    try:
        selection = registry.choose(config.backend)
    except BackendError as exc:
        # Unset or "auto" defers to HISPARSE_BACKEND, which the registry's line names when it set the name.
        given = (extra or {}).get("backend")
        key = (f"kv_connector_extra_config['backend']={config.backend!r}" if config.backend is not None
               else "kv_connector_extra_config['backend'] is unset" if given is None
               else f"kv_connector_extra_config['backend'] is {given!r}")
        raise InvalidInputError(f"{key}: {exc}") from exc
    if selection.source == "argument":  # the log line names the key ("explicit: ...['backend']=NAME"), not "explicit"
        selection = dataclasses.replace(selection, source="kv_connector_extra_config['backend']")
    # A bad tuning variable (HISPARSE_TRITON_SPLIT, nvidia's, ...) is refused here, in the front end and
    # when either role is built, before vLLM loads the weights: not first in register_kv_caches after it.
    registry.check_settings(selection.name)
    return config, selection


def _pools_on_node(vllm_config: VllmConfig, config: ConnectorConfig, layout: HostTierLayout,
                   selection: Selection) -> int:
    """Host pools the workers of this node allocate: one when the TP ranks share it, else one per
    rank on the node (what `worker_side.shares_host_pool` decides, with the backend's capability)."""
    pc = vllm_config.parallel_config
    world = int(pc.tensor_parallel_size)
    capable = Capability.SHARED_HOST_POOL in get_registry().get(selection.name).capabilities
    if capable and shares_host_pool(config, layout, pc, world):
        return 1
    return max(1, world // max(1, int(getattr(pc, "nnodes", 1) or 1)))


class HiSparseOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    """hisparse host-resident KV cache as a vLLM KV connector (see the module docstring)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        route_to_vllm_handlers()
        with _one_line_errors():
            self._hs_config, selection = _check_extra_config(vllm_config)
            self._layout = HostTierLayout.from_kv_cache_config(kv_cache_config,
                                                               vllm_config.parallel_config.tensor_parallel_size)
            max_len = vllm_config.model_config.max_model_len
            # Too small for one request first: a pool of no whole block has no size to weigh against the RAM.
            self._layout.check_capacity(self._hs_config.host_pool_gib, max_len)
            self._layout.check_host_memory(self._hs_config.host_pool_gib, max_len,
                                           _pools_on_node(vllm_config, self._hs_config, self._layout, selection))
            self._scheduler: SchedulerSide | None = None
            self._worker: WorkerSide | None = None
            if role == KVConnectorRole.SCHEDULER:
                self._scheduler = SchedulerSide(vllm_config, self._hs_config, self._layout)
            elif role == KVConnectorRole.WORKER:
                self._worker = WorkerSide(vllm_config, self._hs_config, self._layout, selection)
            else:
                raise ProtocolError(f"unsupported KV connector role {role!r}; expected SCHEDULER or WORKER")
        logger.info("HiSparseOffloadConnector (%s): host_pool_gib=%s, backend %r (%s), no hot buffer (vLLM's "
                    "attention reads resident pages only), shared TP pool %s", role.name.lower(),
                    self._hs_config.host_pool_gib, selection.name, selection.explanation(),
                    "allowed" if self._hs_config.share_host_pool else "off")

    @classmethod
    def check_kv_transfer_config(cls, kv_transfer_config: Any) -> None:
        """Check `kv_connector_extra_config` in full, except what needs the KV cache (the host
        pool's size against the node's RAM and one max_model_len request); one ERROR line, then
        `InvalidInputError`.

        Called by the general plugin's check (`hisparse_vllm.frontend_check`) when vLLM resolves
        this class from a config while it builds `VllmConfig`: in the front end, before any
        engine process starts or any weight loads, on every platform and with `enforce_eager`."""
        route_to_vllm_handlers()
        with _one_line_errors():
            check_kv_transfer(kv_transfer_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """False: no layer-wise work runs inside the forward (transfers run in `start_load_kv`
        and `wait_for_save`), so full CUDA graphs are safe.

        vLLM calls this while it builds `VllmConfig`, in the front end, before any engine process
        starts or any weight loads, when CUDA graphs are on: the earliest hook that carries
        `kv_connector_extra_config`, so its keys and values are checked here (the backend and the
        host pool's size need the engine's platform and KV cache, checked later)."""
        route_to_vllm_handlers()
        with _one_line_errors():
            ConnectorConfig.from_extra_config(extra_config).check_stock_attention()
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """No layout is required (each layer's pages are contiguous in every vLLM layout).

        vLLM calls this in the engine core while it picks the KV-cache layout, after the model is
        loaded: without CUDA graphs (CPU, `enforce_eager`) the first call into the connector that
        carries the configuration. `kv_connector_extra_config` is checked here so a bad key fails
        before the KV cache and the workers' connectors are built."""
        route_to_vllm_handlers()
        with _one_line_errors():
            _check_extra_config(vllm_config)
        return None

    def _sched(self) -> SchedulerSide:
        if self._scheduler is None:
            raise ProtocolError("scheduler-side connector method called on the worker-role instance")
        return self._scheduler

    def _work(self) -> WorkerSide:
        if self._worker is None:
            raise ProtocolError("worker-side connector method called on the scheduler-role instance")
        return self._worker

    @property
    def scheduler_side(self) -> SchedulerSide:
        return self._sched()

    @property
    def worker_side(self) -> WorkerSide:
        return self._work()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped spill is a future miss, not lost output

    # ================================================================= scheduler role

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._sched().bind(kv_cache_manager)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(range(self._layout.num_groups))  # a load fills every group's blocks

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids), None

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, (block_ids,)), None

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_work()

    def has_pending_block_frees(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_block_frees()

    def reset_cache(self) -> bool | None:
        return self._sched().reset_cache()

    # ================================================================= worker role

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, HiSparseConnectorMetadata):
            raise ProtocolError(f"bound metadata is {type(metadata).__name__}; expected HiSparseConnectorMetadata")
        self._work().start_step(metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv's command order; layers need no per-layer wait

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return  # spills run after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        self._work().finish_step()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._work().build_worker_meta()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # ================================================================= stats

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is not None:
            return self._worker.stats()
        if self._scheduler is not None and self._scheduler.bound:
            return self._scheduler.stats()
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return HiSparseConnectorStats(data=data) if data is not None else HiSparseConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return HiSparsePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
