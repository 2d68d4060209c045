"""`bench/bench_serving.py --smoke`: the serving benchmark end to end on the CPU (tiny geometry),
every mode and the replay's workload, its table and plot, the engine modes' top-k from the code
locality model, and the results page's regime plot of its JSON; and its one-line refusal of a
budget that holds no request, before anything is built."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_serving.py"
PLOT = SCRIPT.with_name("plot_serving_regimes.py")


def test_smoke_runs_every_mode(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--batches", "1", "--png", str(tmp_path / "p.png"),
                          "--json", str(tmp_path / "r.json"), "--topk-model", "code"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads((tmp_path / "r.json").read_text())
    assert {r["mode"] for r in rows} == {"hisparse", "all-resident", "transformers", "replay"}
    assert all(r.get("step_ms", 0) > 0 for r in rows), rows
    # The engine's host time per step comes in two parts: the next step's planning ahead is its own.
    engine_rows = [r for r in rows if r["mode"] in ("hisparse", "all-resident")]
    assert engine_rows and all(r["host_critical_ms"] > 0 and r["host_ahead_ms"] > 0 for r in engine_rows), engine_rows
    assert "host critical ms" in out.stdout and "host ahead ms" in out.stdout
    assert (tmp_path / "p.png").stat().st_size > 0 and "overhead" in out.stdout
    assert all(r["topk"] == "code" and "h2d_mb_per_step" in r for r in engine_rows), engine_rows
    assert "decode top-k from code" in out.stdout
    plot = subprocess.run([sys.executable, str(PLOT), str(tmp_path / "r.json"), "--png", str(tmp_path / "g.png")],
                          capture_output=True, text=True, timeout=120)
    assert plot.returncode == 0, plot.stderr[-2000:]
    assert "| 160 | code | 1 |" in plot.stdout and (tmp_path / "g.png").stat().st_size > 10_000


def test_a_budget_without_room_for_one_request_is_one_line() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--gpu-kv-gib", "1e-6", "--png", ""],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1 and "cannot hold one hisparse request" in out.stderr, out.stderr
