"""`bench/plot_results.py --data FILE`: a file that is not the figures of docs/figures/results.json
is one line naming `--data` and what was expected, exit 2, before any plot is drawn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_scripts import imported

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "plot_results.py"


@pytest.mark.parametrize("doc", [
    {"backend": {"name": "reference_cpu"}, "config": {}, "summary": {}},  # a `hisparse run --json` document
    [1, 2],
])
def test_data_that_is_not_the_figures_is_one_line(doc: object, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A `hisparse run --json` document given as --data ended in a KeyError traceback ('miss_steps'),
    after matplotlib was loaded; a JSON list in an AttributeError."""
    data = tmp_path / "run.json"
    data.write_text(json.dumps(doc))
    with imported(SCRIPT) as script:
        assert script.main(["--data", str(data), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == (f"plot_results: error: --data {data}: no miss_steps, no_miss_steps, serving, serving_locality, "
                   "transformers_step datasets; expected the JSON of docs/figures/results.json\n")
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize(("argv", "line"), [
    (["--out", ""], "plot_results: error: --out '': expected a folder name"),
    (["--data", ""], "plot_results: error: --data '': expected a file name"),
    (["--out", "/proc"], "plot_results: error: --out /proc: the folder is not writable; expected a folder the PNGs "
                         "can be written to"),
])
def test_an_empty_or_unwritable_path_is_one_line(argv: list[str], line: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """`--out ""` (Path('') is '.') wrote the six PNGs into the current folder, `--data ""` was reported
    as the folder '.', and `--out /proc` ended in savefig's FileNotFoundError traceback after the drawing."""
    if argv[1] == "/proc" and not Path("/proc").is_dir():
        pytest.skip("needs /proc")
    monkeypatch.chdir(tmp_path)
    with imported(SCRIPT) as script:
        assert script.main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [line]
    assert not list(tmp_path.glob("*.png"))
