"""`python bench/plot_serving_regimes.py FILE... --png OUT` (docs/results.md's command): input that is
not bench_serving.py's rows, or an output it cannot write, is one line naming the file or flag,
exit 2, before anything is drawn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_scripts import imported

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "plot_serving_regimes.py"
ROW = {"mode": "hisparse", "topk": "benign", "context": 32768, "batch": 8, "step_ms": 10.0}


def _main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with imported(SCRIPT) as script:
        code = script.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(("text", "why"), [
    (json.dumps({"backend": {}, "config": {}}, indent=2),
     "a JSON object; expected the JSON list bench_serving.py --json writes, or its stdout"),
    ("[1, 2]", "row 1 is 1; expected an object of bench_serving.py"),
    (json.dumps([{"mode": "hisparse", "step_ms": 1.0}]), "row 1 has no batch, context; expected the fields of "
                                                         "bench_serving.py's rows"),
])
def test_input_that_is_not_serving_rows_is_one_line(text: str, why: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A `hisparse run --json` document ended in 'Expecting property name enclosed in double quotes:
    line 1 column 2' (its first line read as a row), naming no file; a list of numbers in an
    AttributeError traceback, a row without its context in a KeyError."""
    data = tmp_path / "in.json"
    data.write_text(text)
    code, out, err = _main([str(data), "--png", str(tmp_path / "p.png")], capsys)
    assert (code, out) == (2, "")
    assert err == f"plot_serving_regimes: {data}: {why}\n"


@pytest.mark.parametrize(("name", "why"), [
    ("missing/p.png", "the folder '{folder}' does not exist"),
    ("p.txt", "matplotlib cannot write .txt files"),
])
def test_an_output_it_cannot_write_is_one_line_before_the_table(name: str, why: str, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """`--png` into a missing folder ended in a FileNotFoundError traceback, and `--png p.txt` in a
    ValueError's, after the table was printed."""
    pytest.importorskip("matplotlib")
    data = tmp_path / "in.json"
    data.write_text(json.dumps([ROW]))
    code, out, err = _main([str(data), "--png", str(tmp_path / name)], capsys)
    assert (code, out) == (2, "")
    assert len(err.splitlines()) == 1 and err.startswith(f"plot_serving_regimes: --png '{tmp_path / name}'"), err
    assert why.format(folder=tmp_path / "missing") in err, err
