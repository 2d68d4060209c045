"""Decoder-side rig of the P/D tests: a coordinator over a small GPU pool, a reference_cpu host
pool, a transport, the worker's receiver and the scheduler's import manager, wired together."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from hisparse_core.coordinator import CoordinatorConfig, HiSparseCoordinator, SimpleGpuBlockPool
from hisparse_core.geometry import FP8_DS_MLA
from hisparse_core.host_pool import HostPool, HostPoolSpec
from hisparse_core.pd.importer import HostImportScheduler
from hisparse_core.pd.messages import FailedRecv, HostImportJob, RecvReport
from hisparse_core.pd.receiver import HostImportReceiver, ReceiverConfig
from hisparse_core.pd.staging import StagingBuffer
from hisparse_core.pd.transport import ImportTransport
from hisparse_reference_cpu.backend import ReferenceCpuBackend

GIB = 1 << 30


def coordinator_config(num_layers: int, block_size: int, host_blocks: int, *, max_model_len: int,
                       hot_blocks: int = 2) -> CoordinatorConfig:
    stride = num_layers * block_size * FP8_DS_MLA.row_bytes
    cfg = CoordinatorConfig(host_pool_gib=(host_blocks * stride + stride // 2) / GIB, num_layers=num_layers,
                            block_size=block_size, row_bytes=FP8_DS_MLA.row_bytes, max_model_len=max_model_len,
                            hot_blocks_per_request=hot_blocks)
    assert cfg.host_num_blocks == host_blocks, (cfg.host_num_blocks, host_blocks)
    return cfg


@dataclass
class Decoder:
    config: CoordinatorConfig
    gpu: SimpleGpuBlockPool
    coord: HiSparseCoordinator
    pool: HostPool
    transport: ImportTransport
    receiver: HostImportReceiver
    scheduler: HostImportScheduler
    finished: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    jobs: dict[str, HostImportJob] = field(default_factory=dict)

    def pump(self) -> RecvReport:
        """One engine step of the import path: ship jobs and cancels, poll the worker, apply."""
        for job in self.scheduler.take_jobs():
            self.jobs[job.request_id] = job
            self.receiver.start(job)
        for rid in self.scheduler.take_cancels():
            self.receiver.cancel(rid)
        report = self.scheduler.update(self.receiver.poll())
        self.finished += report.finished
        self.failed.update((f.request_id, f.reason) for f in report.failed)
        return report

    def run_until(self, request_ids: Iterable[str], *, timeout_s: float = 30.0,
                  between: Callable[[], None] | None = None) -> None:
        want = set(request_ids)
        deadline = time.monotonic() + timeout_s
        while not want <= set(self.finished) | set(self.failed):
            if time.monotonic() > deadline:
                raise TimeoutError(f"imports {sorted(want - set(self.finished) - set(self.failed))} did not end "
                                   f"in {timeout_s}s")
            self.pump()
            if between is not None:
                between()
            time.sleep(0.0005)

    def close(self) -> list[FailedRecv]:
        report = self.scheduler.update(self.receiver.close())
        self.transport.close()
        self.pool.release()
        return list(report.failed)


def make_decoder(make_transport: Callable[[HostPool, StagingBuffer | None], ImportTransport], *, num_layers: int,
                 block_size: int, host_blocks: int, gpu_blocks: int, max_model_len: int, hot_blocks: int = 2,
                 staging: StagingBuffer | None = None, receiver_config: ReceiverConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> Decoder:
    cfg = coordinator_config(num_layers, block_size, host_blocks, max_model_len=max_model_len, hot_blocks=hot_blocks)
    gpu = SimpleGpuBlockPool(gpu_blocks)
    coord = HiSparseCoordinator(cfg, gpu)
    pool = ReferenceCpuBackend().create_host_pool(HostPoolSpec(num_layers, cfg.host_num_blocks, block_size))
    transport = make_transport(pool, staging)
    receiver = HostImportReceiver(transport, pool, staging=staging, config=receiver_config, clock=clock)
    return Decoder(cfg, gpu, coord, pool, transport, receiver, HostImportScheduler(coord))


def prompt(n: int, salt: int) -> list[int]:
    """Token ids of an imported prompt (distinct per salt so prefixes never collide)."""
    return [(salt * 7919 + i * 31) % 50000 for i in range(n)]
