"""`hisparse run`: a whole replay and its report (every figure measured or derived from the records)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from hisparse_core.backend import Backend
from hisparse_core.replay.engine import (
    EngineTotals,
    ReplayEngine,
    RunConfig,
    StepRecord,
    measure_all_resident_concurrency,
)
from hisparse_core.replay.timing import PHASES


@dataclass(slots=True)
class RunResult:
    backend: dict[str, object]
    config: dict[str, object]
    plan: dict[str, object]
    totals: EngineTotals
    all_resident_concurrency: int
    host_blocks_total: int
    wall_seconds: float
    loop_seconds: float

    @property
    def records(self) -> list[StepRecord]:
        return self.totals.records

    def summary(self) -> dict[str, object]:
        recs = self.records
        t = self.totals
        block_bytes = int(self.config["block_bytes"])  # type: ignore[call-overload]
        hits = sum(r.hits for r in recs)
        misses = sum(r.misses for r in recs)
        resident = sum(r.resident for r in recs)
        looked = hits + misses
        decode_rows = sum(r.decode_rows for r in recs)
        peak = t.peak_running
        at_peak = [r.gpu_blocks_leased / r.running for r in recs if r.running == peak and peak]
        plan = self.plan
        baseline_bytes = int(plan["baseline_blocks_per_request"]) * block_bytes  # type: ignore[call-overload]
        measured_bytes = statistics.fmean(at_peak) * block_bytes if at_peak else float("nan")
        steady_from = next((i for i, r in enumerate(recs) if r.running == peak), len(recs))
        steady = recs[steady_from:]
        s_hits, s_misses = sum(r.hits for r in steady), sum(r.misses for r in steady)
        row_bytes = int(self.config["row_bytes"])  # type: ignore[call-overload]
        decoding = [r for r in recs if r.decode_rows]
        return {
            "steps": len(recs),
            "steps_per_s": len(recs) / self.loop_seconds if self.loop_seconds else float("inf"),
            "step_ms_mean": 1e3 * statistics.fmean(r.seconds for r in recs) if recs else 0.0,
            # Mean milliseconds per step in each phase (timing.PHASES), and of the decode phase on
            # the device, over the steps that decoded.
            "phase_ms": {p: 1e3 * statistics.fmean(r.phase_seconds.get(p, 0.0) for r in recs) if recs else 0.0
                         for p in PHASES},
            "decode_steps": len(decoding),
            "decode_device_ms": 1e3 * statistics.fmean(r.decode_device_seconds for r in decoding) if decoding
            else 0.0,
            "decode_mode": self.config["decode_mode"],
            "graph_sizes": self.config["graph_sizes"],
            "decode_rows": decode_rows,
            "decode_rows_per_s": decode_rows / self.loop_seconds if self.loop_seconds else float("inf"),
            "hit_rate": hits / looked if looked else 1.0,
            "hit_rate_from_peak": s_hits / (s_hits + s_misses) if s_hits + s_misses else 1.0,
            # Hot-buffer lookups behind the two rates above: where one is 0 its rate measured nothing.
            "hot_lookups": looked,
            "hot_lookups_from_peak": s_hits + s_misses,
            "misses": misses,
            "hits": hits,
            "resident_entries": resident,
            "resident_layer_entries": t.resident_layer_entries,   # lookups of --resident-layers (no hot buffer)
            "miss_rate_per_entry": misses / (looked + resident) if looked + resident else 0.0,
            "bytes_h2d": sum(r.h2d_bytes for r in recs),
            "bytes_d2h": sum(r.d2h_bytes for r in recs),
            "rows_h2d": sum(r.h2d_bytes for r in recs) // row_bytes,
            "host_pool_blocks": self.host_blocks_total,
            "host_pool_peak_blocks": t.peak_host_blocks,
            "host_pool_peak_usage": t.peak_host_blocks / max(1, self.host_blocks_total - 1),
            "host_pool_peak_bytes": t.peak_host_blocks * block_bytes,
            "gpu_kv_bytes_per_request_measured": measured_bytes,
            "gpu_kv_bytes_per_request_all_resident": baseline_bytes,
            "gpu_kv_bytes_per_request_planned": int(plan["steady_blocks_per_request"]) * block_bytes,  # type: ignore[call-overload]
            "prefix_hit_tokens": t.prefix_hit_tokens,
            "speculative_rows_rejected": t.rejected_rows,
            "speculative_rollbacks": t.rollbacks,
            "prefill_tokens_computed": t.prefill_tokens,
            "requests_admitted": t.admitted,
            "requests_finished": t.finished,
            "requests_unfinished": int(self.config["requests"]) - t.finished,  # type: ignore[call-overload]
            "stopped_at_step_limit": len(recs) >= int(self.config["steps"])  # type: ignore[call-overload]
            and t.finished < int(self.config["requests"]),  # type: ignore[call-overload]
            "pages": dict(t.pages),
            "max_concurrency_hisparse_measured": peak,
            "gpu_limit_reached": t.gpu_bound_steps > 0,
            "max_concurrency_all_resident_measured": self.all_resident_concurrency,
            # The planner's hisparse figure is the smaller of what the GPU budget and the host pool hold.
            "max_concurrency_hisparse_planned": plan["hisparse_concurrency"],
            "max_concurrency_hisparse_planned_gpu": plan["gpu_concurrency"],
            "max_concurrency_hisparse_planned_host": plan["host_concurrency"],
            "max_concurrency_planned_bound_by": plan["bound_by"],
            "max_concurrency_all_resident_planned": plan["baseline_concurrency"],
            "attention_entries_checked": t.checked_entries,
            "attention_mismatches": 0,
            # A mismatch raises `AttentionMismatch`, so a result is a pass unless nothing was compared.
            "check": "pass" if t.checked_entries else "nothing checked",
            "passed": t.checked_entries > 0,
            "wall_s": self.wall_seconds,
        }

    def to_json(self) -> dict[str, object]:
        return {"backend": self.backend, "config": self.config, "plan": self.plan, "summary": self.summary(),
                "steps": [asdict(r) for r in self.records]}


def run_replay(config: RunConfig, backend: Backend,
               on_step: Callable[[StepRecord, ReplayEngine], None] | None = None,
               on_checked: Callable[[], None] | None = None) -> RunResult:
    """Replay `config.steps` steps, or fewer once every request has finished; raises
    `AttentionMismatch` at the first wrong row or output. `on_checked()` is called once the
    budgets have passed their checks, before anything is allocated (`ReplayEngine`)."""
    t0 = time.perf_counter()
    engine = ReplayEngine(config, backend, on_checked=on_checked)
    try:
        t1 = time.perf_counter()
        for _ in range(config.steps):
            rec = engine.step()
            if on_step is not None:
                on_step(rec, engine)
            if engine.done:
                break
        loop = time.perf_counter() - t1
    finally:
        engine.close()
    plan = engine.plan
    probe = measure_all_resident_concurrency(plan.gpu_blocks, plan.baseline_blocks_per_request)
    return RunResult(backend=backend.describe(), config=engine.describe(), plan=plan.to_dict(), totals=engine.totals,
                     all_resident_concurrency=probe, host_blocks_total=engine.coordinator.host_num_blocks,
                     wall_seconds=time.perf_counter() - t0, loop_seconds=loop)
