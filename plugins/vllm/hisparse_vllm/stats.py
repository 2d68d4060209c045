"""Connector statistics (`get_kv_connector_stats`) and Prometheus metrics (`build_prom_metrics`).

Workers report counters (bytes moved each way) as deltas since their previous report; the
scheduler reports levels (host pool use, cached pages, transfers in flight, uncached requests)
and the prefix and eviction counters. Everything travels in `data` as lists, so vLLM can aggregate the
workers' objects and the scheduler's: counters concatenate (their sum is the total), levels keep
the most recent value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

#: Counter keys: (Prometheus name, help). No hot-buffer hits or misses: vLLM's attention reads
#: resident pages only, so the connector takes no hot buffer and nothing would count them.
COUNTERS: dict[str, tuple[str, str]] = {
    "host_to_device_bytes": ("vllm:hisparse_host_to_device_bytes",
                             "Bytes copied from the hisparse host pool to the device (prefix loads)."),
    "device_to_host_bytes": ("vllm:hisparse_device_to_host_bytes",
                             "Bytes copied from the device to the hisparse host pool (spills of sealed pages)."),
    "prefix_loaded_tokens": ("vllm:hisparse_prefix_loaded_tokens",
                             "Prompt tokens of new requests loaded from the hisparse host pool instead of being "
                             "recomputed (the tokens vLLM counts with source HOST)."),
    "preempted_loaded_tokens": ("vllm:hisparse_preempted_loaded_tokens",
                                "Tokens a preempted request reloaded from the hisparse host pool when it resumed "
                                "(vLLM counts them among its preempted requests' hits, not by source)."),
    "shared_loaded_tokens": ("vllm:hisparse_shared_loaded_tokens",
                             "Prompt tokens a request took from vLLM's GPU prefix cache whose pages another "
                             "request had loaded from the hisparse host pool: each page loads once however many "
                             "requests need it."),
    "host_prefix_matched_tokens": ("vllm:hisparse_host_prefix_matched_tokens",
                              "Prompt tokens of admitted requests whose pages were published in the hisparse host "
                              "pool, whether the host or vLLM's own GPU prefix cache then served them."),
    "host_evicted_blocks": ("vllm:hisparse_host_evicted_blocks",
                            "Cached (published, unleased) host blocks evicted to make room for new pages."),
}
#: Level keys: (Prometheus name, help).
LEVELS: dict[str, tuple[str, str]] = {
    "host_pool_usage": ("vllm:hisparse_host_pool_usage_perc",
                        "Share of the hisparse host pool leased by running requests and transfers (1 = all); "
                        "cached blocks are not counted here."),
    "host_pool_cached": ("vllm:hisparse_host_pool_cached_perc",
                         "Share of the hisparse host pool holding cached pages: published, unleased, evictable."),
    "host_blocks_cached": ("vllm:hisparse_host_blocks_cached",
                           "hisparse host blocks holding cached (published, unleased) pages."),
    "pending_transfers": ("vllm:hisparse_pending_transfers",
                          "hisparse page transfers (spills, prefix loads) not yet completed everywhere."),
    "requests_uncached": ("vllm:hisparse_requests_uncached",
                          "Running requests the full host pool could not cache: they run on without host copies "
                          "(nothing waits for host blocks)."),
}
#: Reported but not exported (for logs and tests). `reset_epoch`: the scheduler's count of
#: connector resets, so an offline front end can tell when a reset's stats arrived (offline_stats.py).
INFO_LEVELS = ("host_blocks_used", "host_blocks_total", "reset_epoch")
#: The highest `reset_epoch` this process's Prometheus metrics observed, per engine index, since
#: the metrics of that index were built (each engine counts its resets from 0).
_RESET_EPOCHS: dict[int, int] = {}
_PROM_METRICS_BUILT = [0]


def reset_epochs_observed() -> int:
    """Connector resets whose stats this process's metrics observed, summed over engines."""
    return sum(_RESET_EPOCHS.values())


def prom_metrics_built() -> bool:
    """Whether this process built hisparse's Prometheus metrics (they observe `reset_epoch`)."""
    return bool(_PROM_METRICS_BUILT[0])
_PROM_PREFIX = "vllm:hisparse_"


def log_label(key: str) -> str:
    """What vLLM's periodic log calls a series: `hisparse ` and its Prometheus name without the
    `vllm:hisparse_` prefix (`hisparse host_prefix_matched_tokens`), so both say the same."""
    named = COUNTERS.get(key) or LEVELS.get(key)
    return "hisparse " + (named[0].removeprefix(_PROM_PREFIX) if named else key)


@dataclass
class HiSparseConnectorStats(KVConnectorStats):
    """Stats of one interval. `data[key]` is a list of observations (see the module docstring)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, list[int | float]] = {key: [] for key in (*COUNTERS, *LEVELS, *INFO_LEVELS)}

    def record(self, **values: int | float) -> HiSparseConnectorStats:
        for key, value in values.items():
            if key not in self.data:
                raise KeyError(f"unknown hisparse stat {key!r}; expected one of {sorted(self.data)}")
            self.data[key].append(value)
        return self

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other.is_empty():
            return self
        for key, values in other.data.items():
            mine = self.data.setdefault(key, [])
            if key in COUNTERS:
                mine.extend(values)
            elif values:
                mine[:] = values[-1:]
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {log_label(key): sum(self.data.get(key, [])) for key in COUNTERS}
        for key in (*LEVELS, *INFO_LEVELS):
            values = self.data.get(key, [])
            if key == "reset_epoch":
                continue  # bookkeeping for offline_stats.py, not a figure for the log
            if values:
                out[log_label(key)] = round(100 * values[-1], 1) if key.startswith("host_pool_") else values[-1]
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def total(self, key: str) -> int | float:
        """Sum of a counter's observations."""
        return sum(self.data.get(key, []))

    def last(self, key: str) -> int | float | None:
        values = self.data.get(key, [])
        return values[-1] if values else None


class HiSparsePromMetrics(KVConnectorPromMetrics):
    """Per-engine Prometheus counters and gauges fed from `HiSparseConnectorStats.data`."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _PROM_METRICS_BUILT[0] += 1
        for engine_idx in per_engine_labelvalues:  # a new engine (another LLM in this process) counts from 0
            _RESET_EPOCHS.pop(engine_idx, None)
        self.counters: dict[str, Any] = {
            key: create_metric_per_engine(self._counter_cls(name=name, documentation=doc, labelnames=labelnames),
                                          per_engine_labelvalues)
            for key, (name, doc) in COUNTERS.items()}
        self.gauges: dict[str, Any] = {
            key: create_metric_per_engine(self._gauge_cls(name=name, documentation=doc, labelnames=labelnames,
                                                          multiprocess_mode="mostrecent"),  # type: ignore[call-arg]  # a Gauge class; vLLM types it as any metric
                                          per_engine_labelvalues)
            for key, (name, doc) in LEVELS.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        epochs = transfer_stats_data.get("reset_epoch", [])
        if epochs:
            _RESET_EPOCHS[engine_idx] = max(_RESET_EPOCHS.get(engine_idx, 0), int(epochs[-1]))
        for key, counter in self.counters.items():
            total = sum(transfer_stats_data.get(key, []))
            if total:
                counter[engine_idx].inc(total)
        for key, gauge in self.gauges.items():
            values = transfer_stats_data.get(key, [])
            if values:
                gauge[engine_idx].set(values[-1])
