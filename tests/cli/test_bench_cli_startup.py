"""`python bench/bench_cli_startup.py` (docs/results.md's command): a bad --repeat is one line, and a
command that fails is reported as failed, not timed as if it had started."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_scripts import imported

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_cli_startup.py"


@pytest.mark.parametrize("repeat", ["0", "-1"])
def test_a_repeat_of_nothing_is_one_line(repeat: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--repeat 0` ran every command's -X importtime probe, then ended in a StatisticsError traceback
    (the median of no time)."""
    with imported(SCRIPT) as script, pytest.raises(SystemExit) as exit_:
        script.main(["--repeat", repeat])
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        f"bench_cli_startup: error: argument --repeat: expected an integer in [1, 1000], got {repeat} "
        "(see bench_cli_startup --help)"]


def test_a_command_that_fails_is_not_timed_as_a_start_up(capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A command that exits at once with an error (a broken install's `hisparse --help`) was in the
    table as a fast start-up, exit 0."""
    with imported(SCRIPT) as script:
        monkeypatch.setattr(script, "COMMANDS", [("python -c pass", ["-c", "pass"], 0),
                                                 ("broken", ["-c", "import sys; sys.exit('no module x')"], 0)])
        assert script.main(["--repeat", "1"]) == 1
    out, err = capsys.readouterr()
    assert "broken" not in out
    assert err.splitlines() == ["bench_cli_startup: error: broken exited 1, expected 0: no module x"]
