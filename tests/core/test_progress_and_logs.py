"""What long CLI work prints while it runs: the progress bar's ETA (none from the warm-up step
alone) and the host pool's start-up line (one number format for a size and its budget)."""

from __future__ import annotations

import io
import logging
import re

import pytest

from hisparse_core import progress
from hisparse_core.progress import ETA_AFTER, ProgressBar


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_no_eta_until_steps_after_the_warm_up_were_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first step carries the warm-up (here 60 s, then 1 s a step): an ETA from it alone
    said 5940 s for what takes 99 s. None is shown until `ETA_AFTER` later steps were timed,
    and then it is their rate."""
    clock = _Clock()
    monkeypatch.setattr(progress.time, "perf_counter", clock)
    out = io.StringIO()
    bar = ProgressBar(100, "run", stream=out)
    clock.now = 60.0
    bar.update(1)
    assert bar.eta() is None and "eta" not in out.getvalue()
    for _ in range(ETA_AFTER - 1):
        clock.now += 1.0
        bar.update(1)
        assert bar.eta() is None
    clock.now += 1.0
    bar.update(1)
    assert bar.eta() == pytest.approx(100 - 1 - ETA_AFTER)
    bar.update(100)
    assert bar.eta() is None  # done


def test_a_drawn_line_shows_the_eta_once_it_is_meaningful(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(progress.time, "perf_counter", clock)
    out = io.StringIO()
    out.isatty = lambda: True  # type: ignore[method-assign]  # redraw on every update
    bar = ProgressBar(50, "generate", stream=out, min_interval_s=0.0)
    clock.now = 30.0
    bar.update(1)
    assert "eta" not in out.getvalue()
    for _ in range(ETA_AFTER + 1):
        clock.now += 2.0
        bar.update(1)
    last = out.getvalue().split("\r\x1b[2K")[-1]
    assert re.search(r" eta 90\.0s", last), last  # 45 steps left at 2 s each


def test_a_bar_made_without_eta_never_shows_one(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(progress.time, "perf_counter", clock)
    out = io.StringIO()
    bar = ProgressBar(8, "generate", stream=out, eta=False)
    for _ in range(7):
        clock.now += 1.0
        bar.update(1)
        assert bar.eta() is None
    assert out.getvalue().count("generate [") == 4 and " eta " not in out.getvalue(), out.getvalue()


def test_host_pool_line_formats_size_and_budget_alike(caplog: pytest.LogCaptureFixture) -> None:
    """`0.050 GiB of the 0.049999999813735485 GiB budget` used to be printed: both in one format."""
    from hisparse_core.coordinator import HiSparseCoordinator
    from hisparse_core.coordinator.config import GIB, CoordinatorConfig
    from hisparse_core.coordinator.simple_gpu_pool import SimpleGpuBlockPool

    budget = (int(0.05 * GIB) - 256) / GIB  # a budget in bytes, as `hisparse run --host` hands it over
    with caplog.at_level(logging.INFO, logger="hisparse_core.coordinator.coordinator"):
        HiSparseCoordinator(CoordinatorConfig(host_pool_gib=budget, num_layers=2, block_size=16, row_bytes=656,
                                              max_model_len=4096, hot_blocks_per_request=4), SimpleGpuBlockPool(64))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("HiSparse host pool:"))
    assert re.search(r", \d+\.\d\d MiB of the 51\.20 MiB budget;", line), line
    assert not re.search(r"\d\.\d{5,}", line), line


def test_a_cpu_runs_log_lines_name_no_gpu(caplog: pytest.LogCaptureFixture) -> None:
    """On a CPU-only `hisparse run` the coordinator's line said `GPU pressure watermark` and `room for
    N max_model_len requests` (vLLM's word; the run has --context and --decode-tokens), the replay's
    `GPU pool N blocks` and `state rows N (GPU blocks / ...)`: the KV pool is in host RAM there."""
    from hisparse_core.cli import main

    argv = ["run", "--backend", "reference_cpu", "--requests", "1", "--context", "32", "--decode-tokens", "2",
            "--steps", "1", "--top-k", "16", "--block-size", "16", "--layers", "1",
            "--index-share", "1", "--gpu-kv", "1MiB", "--host", "4MiB", "--no-progress"]
    with caplog.at_level(logging.INFO, logger="hisparse_core"):
        assert main(argv) == 0
    lines = [r.getMessage() for r in caplog.records
             if r.name in ("hisparse_core.coordinator.coordinator", "hisparse_core.replay.engine")]
    pool = next(line for line in lines if line.startswith("HiSparse host pool:"))
    replay = next(line for line in lines if line.startswith("replay: 1 layers"))
    assert not [line for line in lines if "GPU" in line or "max_model_len requests" in line], lines
    assert re.search(r"; room for \d+\.\d requests of 34 tokens \(max_model_len\); device KV pool pressure "
                     r"watermark \d+ of \d+ blocks$", pool), pool
    assert re.search(r"; cpu device KV pool \d+ blocks of \d+ B, .*state rows \d+ \(cpu device blocks / ", replay), replay
