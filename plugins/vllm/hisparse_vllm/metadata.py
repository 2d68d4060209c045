"""What crosses vLLM's scheduler/worker boundary for this connector.

Scheduler to workers (`SchedulerOutput.kv_connector_metadata`, one per step): the hisparse
`OffloadCommand` (transfer ids and physical coordinates only, no request ids), and a flag that
asks the workers to forget their hot state after a cache reset.

Workers to scheduler (`KVConnectorOutput.kv_connector_worker_meta`): one worker's
`WorkerMetadata`; vLLM's `KVOutputAggregator` folds the workers' reports with `aggregate`, which
sums the per-transfer counts, so the scheduler sees each id counted once per worker.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from hisparse_core.errors import ProtocolError
from hisparse_core.types import OffloadCommand, WorkerMetadata


@dataclass
class HiSparseConnectorMetadata(KVConnectorMetadata):
    command: OffloadCommand | None = None
    reset_hot_state: bool = False


@dataclass
class HiSparseWorkerMetadata(KVConnectorWorkerMetadata):
    acks: WorkerMetadata

    def aggregate(self, other: KVConnectorWorkerMetadata) -> HiSparseWorkerMetadata:
        if not isinstance(other, HiSparseWorkerMetadata):
            raise ProtocolError(f"cannot aggregate HiSparseWorkerMetadata with {type(other).__name__}; every worker "
                                "of the engine must run the same connector")
        return HiSparseWorkerMetadata(self.acks.aggregate(other.acks))
