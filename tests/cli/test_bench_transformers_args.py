"""`python bench/bench_transformers.py --tiny` (the script's CPU smoke test): a bad value is one line
naming the flag, exit 2, before the model is built; flags given beside --tiny are the ones that run."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_scripts import imported

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_transformers.py"


@pytest.mark.parametrize(("argv", "line"), [
    (["--steps", "0"], "argument --steps: expected an integer in [1, 16777216], got 0"),
    (["--layers", "-1"], "argument --layers: expected an integer in [1, 1024], got -1"),
    (["--batches", "abc"], "argument --batches: expected comma-separated integers in [1, 65536], got 'abc'"),
    (["--modes", "hisparse,fast"], "argument --modes: expected comma-separated modes of hisparse, hisparse-eager, "
                                   "transformers, got 'hisparse,fast'"),
    (["--hot-rows", "10"], "argument --hot-rows: expected 0 (2x top-k) or a multiple of --block-size 4, got 10"),
    (["--json", "/nonexistent-folder/x.json"], "--json '/nonexistent-folder/x.json': the folder "
                                               "'/nonexistent-folder' does not exist"),
    (["--backend", "nope"], "--backend 'nope': no hisparse backend named 'nope'"),
])
def test_a_bad_value_is_one_line_before_any_work(argv: list[str], line: str, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`--steps 0`, `--layers -1`, `--batches abc` and `--modes hisparse,fast` ended in tracebacks (the
    model built first for most); `--json` into a missing folder in a FileNotFoundError's after the run."""
    with imported(SCRIPT) as script:
        monkeypatch.setattr(script, "build_model", lambda *a, **k: pytest.fail("the model was built"))
        with pytest.raises(SystemExit) as exit_:
            script.main(["--tiny", *argv])
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith(f"bench_transformers: error: {line}"), err


def test_without_a_gpu_and_without_tiny_it_is_one_line(capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --tiny the model was built on `cuda`: an AssertionError traceback (Torch not compiled with
    CUDA enabled) on a machine without a GPU."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with imported(SCRIPT) as script:
        monkeypatch.setattr(script, "build_model", lambda *a, **k: pytest.fail("the model was built"))
        assert script.main(["--batches", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == ["bench_transformers: error: needs a CUDA GPU (this torch sees none); "
                                              "expected --tiny for the tiny geometry on the CPU"]


def test_flags_given_beside_tiny_are_the_ones_that_run() -> None:
    """`--tiny --steps 7 --batches 4 --fill-chunk 64` ran 3 steps at batches 1,2 and a fill chunk of 32:
    every flag given was dropped without a word."""
    with imported(SCRIPT) as script:
        a = script.options(["--tiny", "--steps", "7", "--batches", "4", "--fill-chunk", "64"])
    assert (a.steps, a.batches, a.fill_chunk) == (7, [4], 64)
    assert (a.contexts, a.block_size, a.warmup) == ([256], 4, 1)  # the tiny's


def test_a_context_below_1k_is_labelled_in_tokens() -> None:
    """`--tiny`'s 256-token context was labelled `T=0K` in every row of the table."""
    with imported(SCRIPT) as script:
        assert [script.config_label(2, t) for t in (256, 32768, 1536)] == ["B=2 T=256", "B=2 T=32K", "B=2 T=1536"]


def test_the_json_says_null_for_what_a_cpu_does_not_measure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """On a CPU `--json` held `"peak_gib": NaN` (each row on stdout too), which is not JSON: strict
    readers (`jq`, JavaScript's JSON.parse) refused the file. Now null, and `-` in the table."""
    import json

    def strict(text: str) -> object:
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))

    out = tmp_path / "tf.json"
    with imported(SCRIPT) as script:
        assert script.main(["--tiny", "--batches", "1", "--layers", "1", "--steps", "1", "--warmup", "0",
                            "--modes", "hisparse-eager,transformers", "--json", str(out)]) == 0
    rows = strict(out.read_text())
    assert isinstance(rows, list) and [r["mode"] for r in rows] == ["hisparse-eager", "transformers"]
    assert all(r["peak_gib"] is None and r["step_ms"] > 0 for r in rows)
    printed = capsys.readouterr().out.splitlines()
    assert [strict(line) for line in printed if line.startswith("{")] == rows
    grid = next(line for line in printed if line.startswith("B=1 T=256")).split()
    assert grid[5:7] == ["-", "-"], grid  # hs GiB, tf GiB
