"""The mutation harness (conformance_mutants.py) stays runnable: every planted bug still applies to
today's reference_cpu, and one planted bug is caught by the suite end to end. The whole run (every
mutant, about half an hour on two cores) is `python tests/conformance/conformance_mutants.py`."""

from __future__ import annotations

import conformance_mutants as cm
import pytest


def test_every_mutant_still_applies_to_reference_cpu() -> None:
    assert not cm.check_anchors()


def test_mutant_names_are_unique() -> None:
    names = [m.name for m in cm.MUTANTS + cm.EQUIVALENT]
    assert len(names) == len(set(names))


@pytest.mark.slow
def test_a_planted_lru_bug_fails_the_suite() -> None:
    """Victims behind the untouched slots: the suite must fail on it (exit 1, a failed test), which
    also shows the copy is found through the entry point and selected (else the exit is 4)."""
    outcome = cm.run(next(m for m in cm.MUTANTS if m.name == "lru_victims_first"))
    assert outcome.status == "killed", outcome


def test_unknown_names_are_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cm.main(["no_such_mutant"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("unknown mutant 'no_such_mutant'; expected one of: " + ", ".join(
        m.name for m in cm.MUTANTS + cm.EQUIVALENT)), err
