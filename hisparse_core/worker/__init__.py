"""The worker-side half of hisparse: host pool lifecycle, runtimes and step transfers.

    from hisparse_core.worker import CacheGroup, HiSparseWorker

See `hisparse_core.worker.worker` for the per-step protocol.
"""

from __future__ import annotations

from hisparse_core.worker.groups import CacheGroup, host_blocks_for_budget, host_layer_ranges
from hisparse_core.worker.residency import ResidencyTables
from hisparse_core.worker.tracker import Acknowledgements, TransferTracker
from hisparse_core.worker.worker import HiSparseWorker, WorkerStats

__all__ = ["Acknowledgements", "CacheGroup", "HiSparseWorker", "ResidencyTables", "TransferTracker", "WorkerStats",
           "host_blocks_for_budget", "host_layer_ranges"]
