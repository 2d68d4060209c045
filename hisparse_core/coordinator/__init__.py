"""Scheduler-side HiSparse: host blocks, prefix identity and residency (`HiSparseCoordinator`)."""

from __future__ import annotations

from hisparse_core.coordinator.config import CoordinatorConfig
from hisparse_core.coordinator.coordinator import HiSparseCoordinator
from hisparse_core.coordinator.engine import GpuBlockAllocator, OnReuse, ScheduledRequest, StepRequest
from hisparse_core.coordinator.outputs import CoordinatorStats, ImportTarget, PrefixHit, TableUpdate
from hisparse_core.coordinator.simple_gpu_pool import SimpleGpuBlockPool

__all__ = [
    "CoordinatorConfig", "CoordinatorStats", "GpuBlockAllocator", "HiSparseCoordinator", "ImportTarget",
    "OnReuse", "PrefixHit", "ScheduledRequest", "SimpleGpuBlockPool", "StepRequest", "TableUpdate",
]
