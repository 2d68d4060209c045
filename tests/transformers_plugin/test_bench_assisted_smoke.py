"""`bench/bench_assisted.py --smoke`: prompt lookup against plain decode end to end on the CPU (tiny
geometry): every mode's row, greedy tokens equal across modes, the oracle draft's candidates all
accepted through unions, batch 1 through transformers' own assisted generate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_assisted.py"


def test_smoke_runs_every_mode(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads((tmp_path / "r.json").read_text())
    assert {(r["batch"], r["mode"]) for r in rows} == {
        (1, "plain"), (1, "lookup 3"), (1, "oracle 3"), (1, "generate lookup 3"),
        (3, "plain"), (3, "lookup 3"), (3, "oracle 3")}
    assert all(r["same_tokens"] and r["tokens_per_s"] > 0 for r in rows), rows
    oracle = [r for r in rows if r["mode"] == "oracle 3"]
    assert all(r["acceptance"] == 1.0 and r["union_shared"] > 0 for r in oracle), oracle
    assert "x plain" in out.stdout
