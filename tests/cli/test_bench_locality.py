"""`python bench/bench_locality.py` (docs/results.md's command): a bad value is one line naming the
flag, the value and what was expected, exit 2, before any trace is drawn."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_scripts import imported

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_locality.py"


@pytest.mark.parametrize(("argv", "line"), [
    (["--hot", "nan"], "argument --hot: expected a multiple of top-k in [1, 64], got nan"),
    (["--hot", "inf"], "argument --hot: expected a multiple of top-k in [1, 64], got inf"),
    (["--seed", "-1"], "argument --seed: expected an integer in [0, 4294967295], got -1"),
    (["--resident-budget", "-1"], "argument --resident-budget: expected an integer in [0, 61], got -1"),
    (["--top-k", "0"], "argument --top-k: expected an integer in [1, 65536], got 0"),
    (["--steps", "40"], "argument --steps: expected an integer in [--warmup + 1 = 41, 16777216], got 40"),
    (["--backend", "nope"], "--backend 'nope': no hisparse backend named 'nope'"),
    (["--no-policies", "--no-replay"], "argument --no-replay: not allowed with --no-policies: nothing would be "
                                       "measured; expected one of the two at most"),
])
def test_a_bad_value_is_one_line(argv: list[str], line: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--hot nan` and `--hot inf` passed the script's own check and ended in a ValueError or
    OverflowError traceback, as did `--seed -1`, `--resident-budget -1` (an InvalidInputError) and
    `--backend nope` (after the policy tables); `--no-policies --no-replay` measured nothing and
    exited 0."""
    with imported(SCRIPT) as script, pytest.raises(SystemExit) as exit_:
        script.main(argv)
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(f"bench_locality: error: {line}"), err
