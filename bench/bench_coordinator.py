"""Scheduler overhead of `HiSparseCoordinator` per decode step.

256 running requests at 128K context (block size 64: 2048 pages each), DeepSeek-V3.2 geometry
(61 sparse layers, 656-byte FP8 rows). Each measured step schedules one decode token for every
request (a new page and a sealed-page spill every 64 steps per request, staggered), builds the
command, then applies the acknowledgements of `--workers` tensor-parallel workers from the step
before. The engine's own work (block allocation, building its request views) is not timed.

Scenarios:
- resident: GPU blocks plentiful, everything stays resident.
- pressure: the GPU pool holds three quarters of the pages; free blocks hover at the watermark,
  so the policy keeps releasing clean pages tail-first and the engine's allocations reuse them
  (pages lost, residency updates to -1).

Planned ahead (`hisparse_core.coordinator.ahead.StepAhead`, what the transformers engine and
the replay do for decode steps): the same work runs right after the previous step's
acknowledgements, while the device runs that step; `crit us` is what is left between two device
steps then (claiming the started step), `ahead us` the planning that runs beside the device step.

Per-step work is O(changes): the cost depends on the number of running requests, not on their
context (compare `--context 16384`).

What is timed: `update_from_workers` + `schedule_step` + `take_table_updates`, the coordinator's
share of an engine's host work. Not timed: the engine's views and allocations, the device-table
writes (`coordinator.tables.apply_table_updates`, a few indexed tensor writes a step) and the
worker's `start_step`/`after_forward` (residency writes, and the backend's per-mirror checks
when it submits the row mirrors); the serving benchmark times the whole step on a device. On a
shared machine the mean follows the load: compare runs made in the same minute.

Run: python bench/bench_coordinator.py [--requests 256] [--context 131072] [--steps 512]
"""

from __future__ import annotations

import gc
import statistics
import time

from hisparse_core.coordinator import CoordinatorConfig, HiSparseCoordinator, SimpleGpuBlockPool, StepRequest
from hisparse_core.types import OffloadCommand, WorkerMetadata


class BenchEngine:
    """A minimal engine: per-request token lists and block tables, views rebuilt each step."""

    def __init__(self, coord: HiSparseCoordinator, gpu: SimpleGpuBlockPool, block_size: int) -> None:
        self.coord, self.gpu, self.bs = coord, gpu, block_size
        self.tokens: dict[str, list[int]] = {}
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.state: dict[str, int] = {}
        self.pending: list[int] = []

    def admit(self, rid: str, tokens: list[int]) -> None:
        self.coord.add_request(rid, tokens, max_prefix_tokens=0)
        self.tokens[rid], self.tables[rid], self.computed[rid] = tokens, [], 0
        self.state[rid] = len(self.state)

    def views(self, work: dict[str, int]) -> list[StepRequest]:
        out = []
        bs = self.bs
        for rid, n in work.items():
            table = self.tables[rid]
            need = -(-(self.computed[rid] + n) // bs) - len(table)
            if need > 0:
                table.extend(self.gpu.acquire(need))
            out.append(StepRequest(rid, self.state[rid], self.computed[rid], n, self.tokens[rid], (table,)))
        return out

    def advance(self, work: dict[str, int]) -> None:
        for rid, n in work.items():
            self.computed[rid] += n
            toks = self.tokens[rid]
            if len(toks) < self.computed[rid] + 1:
                toks.append(self.computed[rid] % 50_000)

    def acknowledgements(self, cmd: OffloadCommand | None, workers: int) -> WorkerMetadata:
        """All workers acknowledge the previous step's transfers (enqueued and completed)."""
        ids, self.pending = self.pending, [t.transfer_id for t in cmd.page_transfers] if cmd else []
        copies = [c.dst_block_id for c in cmd.host_block_copies] if cmd else []
        return WorkerMetadata(dict.fromkeys(ids, workers), dict.fromkeys(ids, workers), tuple(sorted(copies)))


def build(requests: int, context: int, gpu_blocks: int, workers: int, pressure: bool) -> tuple[BenchEngine, float]:
    bs = 64
    pages = -(-(context + 1024) // bs)
    host_blocks = requests * pages + 4096
    stride = 61 * bs * 656
    config = CoordinatorConfig(host_pool_gib=host_blocks * stride / (1 << 30), num_layers=61, block_size=bs,
                               row_bytes=656, max_model_len=context + 1024, hot_blocks_per_request=64,
                               num_resident_groups=1, pressure_watermark_blocks=4096 if pressure else 64,
                               max_releases_per_step=256)
    gpu = SimpleGpuBlockPool(gpu_blocks)
    coord = HiSparseCoordinator(config, gpu)
    engine = BenchEngine(coord, gpu, bs)
    t0 = time.perf_counter()
    chunk = 8192
    for r in range(requests):
        rid = f"req{r}"
        # Stagger lengths so page boundaries are spread over steps.
        n = context - (r * 37) % bs
        engine.admit(rid, [(r * 7919 + i) % 50_000 for i in range(n)])
        while engine.computed[rid] < n:
            work = {rid: min(chunk, n - engine.computed[rid])}
            cmd = coord.schedule_step(engine.views(work))
            engine.advance(work)
            coord.update_from_workers(engine.acknowledgements(cmd, workers), workers)
    # one more round so every prompt page is sealed and acknowledged
    for _ in range(2):
        work = dict.fromkeys(engine.tokens, 1)
        cmd = coord.schedule_step(engine.views(work))
        engine.advance(work)
        coord.update_from_workers(engine.acknowledgements(cmd, workers), workers)
    return engine, time.perf_counter() - t0


def measure_ahead(engine: BenchEngine, steps: int, workers: int) -> dict[str, float]:
    """The same steps planned ahead: the critical path is the claim, the planning overlaps."""
    from hisparse_core.coordinator.ahead import StepAhead

    coord = engine.coord
    work = dict.fromkeys(engine.tokens, 1)
    started: list[OffloadCommand | None] = []
    ahead = StepAhead(start_step=started.append, close_step=lambda: None)
    crit: list[float] = []
    planning: list[float] = []
    meta = WorkerMetadata()
    gc.collect()
    gc.disable()
    try:
        for i in range(steps + 1):
            t0 = time.perf_counter()
            claimed = ahead.claim(i)
            t1 = time.perf_counter()
            cmd = ahead.command if claimed else None
            if i:
                crit.append(t1 - t0)
                engine.advance(work)
                meta = engine.acknowledgements(cmd, workers)
            views = engine.views(work)

            def prepare(meta: WorkerMetadata = meta, views: list[StepRequest] = views) -> OffloadCommand | None:
                coord.update_from_workers(meta, workers)
                out = coord.schedule_step(views)
                coord.take_table_updates()
                return out

            t2 = time.perf_counter()
            ahead.plan(i + 1, prepare)
            if i < steps:
                planning.append(time.perf_counter() - t2)
    finally:
        gc.enable()
    ahead.cancel()
    crit.sort()
    return dict(crit=statistics.fmean(crit), crit_p99=crit[int(len(crit) * 0.99)], ahead=statistics.fmean(planning))


def measure(engine: BenchEngine, steps: int, workers: int) -> dict[str, float]:
    coord = engine.coord
    work = dict.fromkeys(engine.tokens, 1)
    sched: list[float] = []
    acks: list[float] = []
    before = coord.stats()
    totals = dict(transfers=0, mirrors=0, residency=0, recycled=0)
    meta = WorkerMetadata()
    gc.collect()
    gc.disable()
    try:
        for _ in range(steps):
            views = engine.views(work)
            t0 = time.perf_counter()
            coord.update_from_workers(meta, workers)
            t1 = time.perf_counter()
            cmd = coord.schedule_step(views)
            coord.take_table_updates()
            t2 = time.perf_counter()
            engine.advance(work)
            meta = engine.acknowledgements(cmd, workers)
            acks.append(t1 - t0)
            sched.append(t2 - t1)
            if cmd is not None:
                totals["transfers"] += len(cmd.page_transfers)
                totals["mirrors"] += len(cmd.row_mirrors)
                totals["residency"] += sum(len(u.pages) for u in cmd.residency_updates)
                totals["recycled"] += len(cmd.recycled_host_blocks)
    finally:
        gc.enable()
    after = coord.stats()
    totals["released"] = after.released_pages - before.released_pages
    totals["lost"] = after.lost_pages - before.lost_pages
    total = [a + s for a, s in zip(acks, sched, strict=True)]
    total.sort()
    return dict(mean=statistics.fmean(total), p50=total[len(total) // 2], p90=total[int(len(total) * 0.9)],
                p99=total[int(len(total) * 0.99)], sched=statistics.fmean(sched), acks=statistics.fmean(acks),
                **{k: v / steps for k, v in totals.items()})


#: Host RAM the bookkeeping takes a GPU block, rounded up from the 2.7 KiB measured (see `main`).
BOOKKEEPING_BYTES = 3 << 10


def main(argv: list[str] | None = None) -> None:
    from hisparse_core.capacity import check_host_memory
    from hisparse_core.cli.options import MAX_REQUESTS, MAX_STEPS, MAX_TOKENS, CliParser, int_in
    from hisparse_core.errors import CapacityError

    ap = CliParser(prog="bench_coordinator", description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int_in(1, MAX_REQUESTS), default=256)
    ap.add_argument("--context", type=int_in(1, MAX_TOKENS), default=131072)
    ap.add_argument("--steps", type=int_in(1, MAX_STEPS), default=512)
    ap.add_argument("--workers", type=int_in(1, 1024), default=8)
    args = ap.parse_args(argv)
    pages = -(-(args.context + 1024) // 64)
    # The coordinator's and the engine's bookkeeping (Python lists of blocks and tokens) takes about
    # 2.7 KiB a GPU block (measured at 64 requests x 131072 tokens), and the second scenario's is built
    # while the first's is still held: --requests 65536 --context 16777216 was a MemoryError traceback.
    hot = args.requests * 64
    blocks = (args.requests * pages + hot + 8192) + (args.requests * pages * 3 // 4 + hot)
    try:
        check_host_memory(blocks * BOOKKEEPING_BYTES, f"--requests {args.requests} x --context {args.context} "
                          f"({blocks} GPU blocks of bookkeeping over both scenarios, about {BOOKKEEPING_BYTES} B each)",
                          remedy="expected fewer --requests or a shorter --context")
    except CapacityError as exc:
        ap.error(str(exc))
    rows = []
    for name, pressure in (("resident", False), ("pressure", True)):
        # Resident: room for every page and hot buffer. Pressure: room for three quarters of the
        # pages, so the engine keeps reusing pages the policy released (they become lost).
        hot = args.requests * 64
        gpu_blocks = args.requests * pages + hot + 8192 if not pressure else args.requests * pages * 3 // 4 + hot
        engine, setup_s = build(args.requests, args.context, gpu_blocks, args.workers, pressure)
        r = measure(engine, args.steps, args.workers)
        r.update(measure_ahead(engine, args.steps, args.workers))
        s = engine.coord.stats()
        rows.append((name, setup_s, r, s))
    print(f"HiSparseCoordinator per-step overhead: {args.requests} requests x {args.context} tokens "
          f"(block 64 -> {args.context // 64} pages each), {args.workers} workers, {args.steps} decode steps; "
          f"times are update_from_workers + schedule_step, engine work excluded")
    header = (f"{'scenario':<10} {'mean us':>8} {'p50 us':>8} {'p90 us':>8} {'p99 us':>8} {'sched us':>9} "
              f"{'acks us':>8} {'xfer/st':>8} {'mirr/st':>8} {'resid/st':>9} {'rel/st':>7} {'lost/st':>8} "
              f"{'host GiB':>9} {'setup s':>8} {'crit us':>8} {'ahead us':>9}")
    print(header)
    print("-" * len(header))
    for name, setup_s, r, s in rows:
        print(f"{name:<10} {r['mean'] * 1e6:8.1f} {r['p50'] * 1e6:8.1f} {r['p90'] * 1e6:8.1f} {r['p99'] * 1e6:8.1f} "
              f"{r['sched'] * 1e6:9.1f} {r['acks'] * 1e6:8.1f} {r['transfers']:8.2f} {r['mirrors']:8.1f} "
              f"{r['residency']:9.2f} {r['released']:7.2f} {r['lost']:8.2f} "
              f"{s.host_blocks_used * 61 * 64 * 656 / (1 << 30):9.1f} {setup_s:8.1f} {r['crit'] * 1e6:8.2f} "
              f"{r['ahead'] * 1e6:9.1f}")


if __name__ == "__main__":
    from hisparse_core.cli.options import run_script

    raise SystemExit(run_script(main))
