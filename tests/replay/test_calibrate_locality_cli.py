"""`python -m hisparse_core.replay.calibrate_locality` (docs/results.md's command): a bad value is
one line naming the flag, the value and the accepted range, exit 2, before any trace is drawn."""

from __future__ import annotations

import pytest

from hisparse_core.replay.calibrate_locality import main


@pytest.mark.parametrize(("argv", "line"), [
    (["--requests", "0"], "argument --requests: expected an integer in [1, 65536], got 0"),
    (["--steps", "30"], "argument --steps: expected a step count past the 40 warm-up steps in [41, 16777216], got 30"),
    (["--top-k", "1"], "argument --top-k: expected an integer in [2, 65536], got 1"),
    (["--top-k", "-4"], "argument --top-k: expected an integer in [2, 65536], got -4"),
    (["--fit", "--iters", "-1"], "argument --iters: expected an integer in [1, 100000], got -1"),
    (["--iters", "5"], "argument --iters: not allowed without --fit: only the fit iterates; expected --fit, or no "
                       "--iters"),
])
def test_a_bad_value_is_one_line(argv: list[str], line: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--requests 0` ended in a ZeroDivisionError traceback, `--steps 30` (not past the 40 warm-up
    steps) and `--top-k 0` in a ValueError's, `--top-k 1` in a ZeroDivisionError's after the benign
    table; `--iters` without `--fit` was ignored, `--iters -1` taken."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    prog = "python -m hisparse_core.replay.calibrate_locality"
    assert capsys.readouterr() == ("", f"{prog}: error: {line} (see {prog} --help)\n")
