"""`python bench/bench_assisted.py --smoke` (docs/transformers.md's CPU command): a bad value is one line
naming the flag, exit 2, before the model is built; flags given beside --smoke are the ones that run."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from bench_scripts import imported

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_assisted.py"


@pytest.mark.parametrize(("argv", "line"), [
    (["--k", "0"], "argument --k: expected an integer in [1, 64], got 0"),
    (["--new", "-1"], "argument --new: expected an integer in [1, 16777216], got -1"),
    (["--batches", "1,,3"], "argument --batches: expected comma-separated integers in [1, 65536], got '1,,3'"),
    (["--contexts", "abc"], "argument --contexts: expected comma-separated integers in [1, 16777216], got 'abc'"),
    (["--seed", "-1"], "argument --seed: expected an integer in [0, 4294967295], got -1"),
    (["--json", "/nonexistent-folder/x.json"], "--json '/nonexistent-folder/x.json': the folder "
                                               "'/nonexistent-folder' does not exist"),
    (["--backend", "nope"], "--backend 'nope': no hisparse backend named 'nope'"),
    # row i's prompt is 8 x i tokens shorter: a RuntimeError (a tensor of negative dimension) once the model was built
    (["--contexts", "1"], "argument --contexts: a batch of 3 (--batches) makes its last prompt 8 x 2 tokens shorter "
                          "than --contexts 1, so no token is left; expected --contexts >= 17, or --batches <= 1"),
    (["--batches", "65536"], "argument --contexts: a batch of 65536 (--batches) makes its last prompt"),
])
def test_a_bad_value_is_one_line_before_any_work(argv: list[str], line: str, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`--k 0` ended in an InvalidInputError traceback and `--json` into a missing folder in a
    FileNotFoundError's after the whole run; `--new -1`, `--seed -1` and `--contexts abc` in tracebacks too."""
    with imported(SCRIPT) as script:
        monkeypatch.setattr(script, "run", lambda args: pytest.fail("the run started"))
        with pytest.raises(SystemExit) as exit_:
            script.main(["--smoke", *argv])
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith(f"bench_assisted: error: {line}"), err


def test_flags_given_beside_smoke_are_the_ones_that_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--smoke --new 0 --batches 0 --contexts abc --layers 0` ran the smoke's own values, exit 0:
    every flag given was dropped without a word."""
    seen: list[argparse.Namespace] = []
    with imported(SCRIPT) as script:
        monkeypatch.setattr(script, "run", lambda args: seen.append(args) or [])
        assert script.main(["--smoke", "--new", "5", "--batches", "2", "--layers", "3"]) == 0
    (args,) = seen
    assert (args.new, args.batches, args.layers) == (5, [2], 3)
    assert (args.contexts, args.block_size, args.backend) == ([120], 4, "reference_cpu")  # the smoke's
