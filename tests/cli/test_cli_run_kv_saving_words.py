"""`hisparse run`'s KV-per-request line says how hisparse compares with all-resident in words that
are true: "(the same)" where the two are equal. Before, a run whose pages all stayed resident
printed "246.00 KiB at peak concurrency vs 246.00 KiB all-resident (1.00x less)"."""

from __future__ import annotations

import pytest

from hisparse_core import cli

SMALL = ["run", "--requests", "2", "--context", "100", "--top-k", "16", "--decode-tokens", "2", "--steps", "3",
         "--block-size", "16", "--no-progress", "--backend", "reference_cpu"]


def test_a_run_that_saved_nothing_says_the_same(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(SMALL) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "KV per request" in x)
    assert line.endswith("all-resident (the same)"), line
    assert "x less" not in line, line


@pytest.mark.parametrize(("per_req", "base", "words"), [
    (100, 250, " (2.50x less)"), (100, 100, " (the same)"), (200, 100, " (2.00x more)"),
    (0, 100, ""), (float("nan"), 100, ""), (100, 0, ""),
])
def test_the_comparison_words(per_req: float, base: float, words: str) -> None:
    from hisparse_core.cli.run_cmd import _saving

    assert _saving(per_req, base) == words
