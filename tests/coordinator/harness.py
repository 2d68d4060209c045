"""A tiny engine and worker model that drive `HiSparseCoordinator` in tests.

`MiniEngine` plays the scheduler: it keeps each request's token ids and resident block table,
allocates resident blocks from a `SimpleGpuBlockPool` for the pages a step writes, and hands them
to the coordinator through `StepRequest` views. `MiniWorkers` plays the tensor-parallel workers:
it remembers the transfers and host copies of every command and acknowledges them on demand.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hisparse_core.coordinator import (
    CoordinatorConfig,
    HiSparseCoordinator,
    SimpleGpuBlockPool,
    StepRequest,
)
from hisparse_core.types import OffloadCommand, WorkerMetadata

BLOCK = 4


def small_config(**overrides: object) -> CoordinatorConfig:
    """Blocks of 4 tokens, 1 layer of 16-byte rows: a block is 64 bytes, so gib maps to blocks exactly."""
    host_blocks = int(overrides.pop("host_blocks", 64))  # type: ignore[arg-type]
    base: dict[str, object] = dict(
        host_pool_gib=host_blocks * BLOCK * 16 / (1 << 30), num_layers=1, block_size=BLOCK, row_bytes=16,
        max_model_len=32, hot_blocks_per_request=2, num_resident_groups=1, pressure_watermark_blocks=4,
    )
    base.update(overrides)
    return CoordinatorConfig(**base)  # type: ignore[arg-type]


@dataclass
class EngineRequest:
    request_id: str
    tokens: list[int]
    state_index: int
    num_computed: int = 0
    table: list[list[int]] = field(default_factory=list)


class MiniEngine:
    def __init__(self, config: CoordinatorConfig, gpu_blocks: int) -> None:
        self.config = config
        self.gpu = SimpleGpuBlockPool(gpu_blocks)
        self.coord = HiSparseCoordinator(config, self.gpu)
        self.requests: dict[str, EngineRequest] = {}
        self._next_state = 0

    def admit(self, rid: str, tokens: list[int], *, max_prefix: int | None = None) -> int:
        hit = self.coord.add_request(rid, tokens, max_prefix_tokens=max_prefix)
        g = self.config.num_resident_groups
        self.requests[rid] = EngineRequest(rid, list(tokens), self._next_state, hit, [[] for _ in range(g)])
        self._next_state += 1
        return hit

    def view(self, rid: str, num_new: int) -> StepRequest:
        """Allocate resident blocks for the pages the step writes and build the coordinator's view."""
        r = self.requests[rid]
        bs = self.config.block_size
        first = self.coord.first_resident_page(rid)
        pages = -(-(r.num_computed + num_new) // bs)
        for row in r.table:
            while len(row) < first:
                row.append(0)  # host-backed page: the placeholder is ignored
        missing = pages - len(r.table[0])
        if missing > 0:
            for row in r.table:
                row.extend(self.gpu.acquire(missing))
        return StepRequest(rid, r.state_index, r.num_computed, num_new, tuple(r.tokens),
                           tuple(tuple(row) for row in r.table))

    def step(self, work: dict[str, int], *, finished: tuple[str, ...] = (),
             preempted: tuple[str, ...] = ()) -> OffloadCommand | None:
        for rid in finished + preempted:
            self.requests.pop(rid, None)
        views = [self.view(rid, n) for rid, n in work.items()]
        cmd = self.coord.schedule_step(views, finished=finished, preempted=preempted)
        for rid, n in work.items():
            r = self.requests[rid]
            r.num_computed += n
            while len(r.tokens) < r.num_computed + 1:
                r.tokens.append(len(r.tokens) % 7)
        return cmd


class MiniWorkers:
    """`num` workers; each acknowledges independently."""

    def __init__(self, num: int) -> None:
        self.num = num
        self.to_enqueue: list[set[int]] = [set() for _ in range(num)]
        self.to_complete: list[set[int]] = [set() for _ in range(num)]
        self.copies: set[int] = set()

    def receive(self, cmd: OffloadCommand | None) -> None:
        if cmd is None:
            return
        for t in cmd.page_transfers:
            for w in range(self.num):
                self.to_enqueue[w].add(t.transfer_id)
        self.copies.update(c.dst_block_id for c in cmd.host_block_copies)

    def report(self, worker: int, *, complete: bool = True) -> WorkerMetadata:
        enq = sorted(self.to_enqueue[worker])
        self.to_enqueue[worker].clear()
        self.to_complete[worker].update(enq)
        done: list[int] = []
        if complete:
            done = sorted(self.to_complete[worker])
            self.to_complete[worker].clear()
        copies = sorted(self.copies)
        self.copies.clear()
        return WorkerMetadata.report(enq, done, copies)

    def ack_all(self, coord: HiSparseCoordinator) -> None:
        meta = WorkerMetadata()
        for w in range(self.num):
            meta = meta.aggregate(self.report(w))
        coord.update_from_workers(meta, self.num)
