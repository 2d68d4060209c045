"""Planning a step ahead (`hisparse_core.coordinator.ahead`): the replay gives the same figures
with and without it, on reference_cpu and on the strict device, and a failure while planning
surfaces at the step that would have run it."""

from __future__ import annotations

from dataclasses import replace

import pytest
from strict_device import StrictDeviceBackend

from hisparse_core.coordinator.ahead import StepAhead
from hisparse_core.errors import CapacityError
from hisparse_core.registry import select_backend
from hisparse_core.replay.engine import ReplayEngine, RunConfig, StepRecord
from hisparse_core.replay.run import run_replay
from hisparse_core.types import OffloadCommand

#: GPU and host pressure (releases, reuse, evictions), prefix families, and long decode phases
#: with nobody arriving, so most steps are planned ahead.
PRESSURED = RunConfig(requests=6, context=600, decode_tokens=16, steps=30, top_k=64, block_size=16, layers=4,
                      index_share=2, rows_per_request=2, gpu_kv_bytes=5 << 20, host_bytes=7 << 20, arrival_every=0,
                      seed=5)
STEP_FIGURES = ("running", "admitted", "finished", "prefill_tokens", "decode_rows", "resident", "hits", "misses",
                "h2d_bytes", "d2h_bytes", "gpu_blocks_leased", "host_blocks_used", "checked_entries")


def _run(config: RunConfig, backend: object) -> tuple[dict[str, object], list[tuple[int, ...]], StepAhead]:
    engines: list[ReplayEngine] = []

    def keep(rec: StepRecord, engine: ReplayEngine) -> None:
        if not engines:
            engines.append(engine)

    result = run_replay(config, backend, on_step=keep)  # type: ignore[arg-type]
    steps = [tuple(getattr(r, f) for f in STEP_FIGURES) for r in result.records]
    return result.summary(), steps, engines[0].ahead


@pytest.mark.parametrize("backend", ["reference_cpu", "strict_device"])
def test_planned_replay_equals_the_unplanned_one(backend: str) -> None:
    make = (lambda: select_backend("reference_cpu")) if backend == "reference_cpu" else \
        (lambda: StrictDeviceBackend(completion_lag=2))
    today, today_steps, off = _run(replace(PRESSURED, plan_ahead=False), make())
    ours, our_steps, ahead = _run(PRESSURED, make())
    assert off.planned == 0 and ahead.claimed >= 5 and ahead.failed == 0, (ahead.planned, ahead.claimed)
    assert our_steps == today_steps
    for key in ("hits", "misses", "bytes_h2d", "bytes_d2h", "prefix_hit_tokens", "pages", "decode_rows",
                "attention_entries_checked", "requests_finished"):
        assert ours[key] == today[key], key
    pages = ours["pages"]
    assert isinstance(pages, dict) and pages["released"] and pages["reused"] and pages["host_blocks_evicted"]


def test_a_planning_failure_is_raised_by_the_step_that_would_run_it() -> None:
    started: list[OffloadCommand | None] = []
    closed: list[int] = []
    ahead = StepAhead(start_step=started.append, close_step=lambda: closed.append(1))

    def fails() -> OffloadCommand | None:
        raise CapacityError("no GPU block for request 'r7'")

    ahead.plan(3, fails)
    assert ahead.pending and not started
    with pytest.raises(CapacityError, match="'r7'") as err:
        ahead.claim(3)
    assert any("planning step 3 ahead" in n for n in err.value.__notes__)
    assert not ahead.pending and ahead.failed == 1
    # A planned step of another key is closed with nothing written, once.
    ahead.plan(4, lambda: None)
    assert started == [None] and ahead.claim(5) is False and closed == [1]
    ahead.cancel()
    assert closed == [1]
    ahead.plan(6, lambda: None)
    assert ahead.claim(6) is True and ahead.claimed == 1 and closed == [1]
    # A failure whose step never runs is dropped by cancel (logged), not raised.
    ahead.plan(7, fails)
    ahead.cancel()
    assert not ahead.pending and ahead.claim(7) is False
