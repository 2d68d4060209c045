"""`hisparse generate`: a tiny random transformers DSA model decodes through hisparse and is
checked against its own generate; the table, the JSON and the error line."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from hisparse_core.cli import main

pytest.importorskip("transformers")

SMALL = ["--backend", "reference_cpu", "--prompts", "3", "--min-prompt", "60", "--max-prompt", "100",
         "--new-tokens", "24", "--layers", "2", "--top-k", "8", "--hot-rows", "16", "--block-size", "4",
         "--prefill-chunk", "8", "--shared-prefix", "16", "--no-progress"]


def _run(*extra: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["generate", *SMALL, *extra])
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def json_runs() -> dict[str, tuple[int, str, str]]:
    """One `generate --json` per model family, shared by the JSON and the table test (a run is
    most of this module's time)."""
    return {}


def _json_run(runs: dict[str, tuple[int, str, str]], family: str) -> tuple[int, str, str]:
    if family not in runs:
        runs[family] = _run("--json", "--model", family)
    return runs[family]


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_generate_json_is_exact_and_reads_host(family: str, json_runs: dict[str, tuple[int, str, str]]) -> None:
    rc, out, _ = _json_run(json_runs, family)
    assert rc == 0
    doc = json.loads(out)
    x, s = doc["exactness"], doc["stats"]
    assert x["exact"] and x["first_batch"]["tokens_identical"] and x["second_batch"]["tokens_identical"]
    assert x["first_batch"]["max_abs_logit_diff"] <= 1e-4 and x["rows_checked"] > 0
    assert s["misses"] > 0 and s["released_pages"] > 0 and s["prefix_hit_tokens"] >= 3 * 16
    assert s["gpu_kv_bytes_per_request"] < s["gpu_kv_bytes_per_request_all_resident"]
    assert doc["engine"]["gpu_pool_pages"] < doc["engine"]["all_resident_pages"]
    if family == "glm_moe_dsa":
        assert doc["engine"]["index_groups"] == [[0, 1]]


def test_generate_table(json_runs: dict[str, tuple[int, str, str]]) -> None:
    """The table `generate` prints without --json: `_table` of the same result (the default model's
    run of the JSON test)."""
    from hisparse_transformers.cli import _table

    rc, doc, _ = _json_run(json_runs, "deepseek_v32")
    assert rc == 0
    out = _table(json.loads(doc))
    for needle in ("tokens/s", "hit rate", "host->device", "device->host", "with hisparse", "without",
                   "tokens identical", "max abs logit diff", "EXACT", "cpu device KV per request"):
        assert needle in out, needle
    assert "GPU" not in out  # a CPU-only run reports the cpu device's pages, not a GPU's


@pytest.mark.parametrize(("extra", "needle"), [
    (["--host-pool-gib", "1000"], "--host-pool-gib 1000 needs 1000.00 GiB"),
    (["--host-pool-gib", "1e-7"], "--host-pool-gib 1e-07 holds 0 pages of 768 B; the batch's 3 prompts"),
    (["--top-k", "65", "--hot-rows", "64", "--block-size", "16"], "--hot-rows 64 is below --top-k 65"),
    (["--hot-rows", "18"], "--hot-rows 18 is not a multiple of --block-size 4"),
    (["--gpu-kv-pages", "3"], "--gpu-kv-pages 3 is below what 3 prompts"),
])
def test_generate_checks_every_input_before_the_first_forward(extra: list[str], needle: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A value that cannot work fails at once, naming the flag (not the API argument), before the
    model is built: the transformers-alone half used to run first, for minutes."""
    import hisparse_core.capacity as capacity
    import hisparse_transformers.demo as demo

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the demo started although an input cannot work")

    monkeypatch.setattr(demo, "run_demo", must_not_run)
    monkeypatch.setattr(capacity, "available_host_bytes", lambda: 64 << 30)  # the same verdict on any machine
    rc, out, err = _run(*extra)
    assert rc == 2 and not out
    lines = [line for line in err.splitlines() if line.startswith("hisparse generate")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("hisparse generate: error: ") and needle in lines[0], lines[0]
    for api_name in ("host_pool_gib", "hot_rows", "gpu_kv_gib", "block_size", "index_topk", "max_batch"):
        assert api_name not in lines[0]


def test_the_smallest_host_pool_generate_accepts_is_enough() -> None:
    """The figure the host-pool check names is one that works (the engine's own check accepted
    less and then failed mid-decode)."""
    rc, out, err = _run("--host-pool-gib", "1e-7", "--new-tokens", "8")
    assert rc == 2
    needed = err.strip().splitlines()[-1].rpartition(">= ")[2]
    rc, out, err = _run("--host-pool-gib", needed, "--new-tokens", "8", "--json")
    assert rc == 0, err
    assert json.loads(out)["exactness"]["exact"]


@pytest.mark.parametrize(("argv", "needle"), [
    (["--device", "cuda"], "--device 'cuda': this torch has no CUDA; expected cpu"),
    (["--device", "cuda:0", "--backend", "reference_cpu"], "--device 'cuda:0': this torch has no CUDA; expected cpu"),
    (["--device", "nonsense"], "--device 'nonsense' is not a torch device; expected cpu"),
    (["--device", "meta"], "--device 'meta': hisparse generate runs on the CPU or a CUDA GPU only; expected cpu"),
])
def test_a_device_it_cannot_run_on_is_refused_before_anything(argv: list[str], needle: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """`--device cuda` on a torch without CUDA was a 20-line AssertionError traceback from the
    capacity check, `nonsense` a RuntimeError traceback, and `meta` built the model and failed
    deep in transformers: each is one line naming --device, before a backend is selected."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA: the CUDA cases are valid here (tests/cli/test_bad_input.py fakes both)")
    import hisparse_core.registry as registry
    import hisparse_transformers.demo as demo

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("work started although --device cannot be used")

    monkeypatch.setattr(demo, "run_demo", must_not_run)
    monkeypatch.setattr(registry, "select_backend", must_not_run)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["generate", *argv, "--no-progress"])
    assert rc == 2 and out.getvalue() == ""
    assert err.getvalue().splitlines() == [f"hisparse generate: error: {needle}"]


def test_hot_rows_over_the_runtime_limit_fail_at_parse_time(capsys: pytest.CaptureFixture[str]) -> None:
    """`--hot-rows 65536` was accepted, then failed after the model was built naming
    `RuntimeConfig.hot_rows`; the parser's bound is the runtime's limit."""
    import argparse

    from hisparse_core.cli import build_parser
    from hisparse_core.geometry import MAX_HOT_ROWS

    with pytest.raises(SystemExit) as exc:
        main(["generate", "--hot-rows", str(MAX_HOT_ROWS + 1)])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"hisparse generate: error: argument --hot-rows: expected an integer in [1, {MAX_HOT_ROWS}], got "
        f"{MAX_HOT_ROWS + 1} (see hisparse generate --help)"]
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    option = next(a for a in sub.choices["generate"]._actions if "--hot-rows" in a.option_strings)
    assert option.type.accepted == f"[1, {MAX_HOT_ROWS}]"  # type: ignore[union-attr]
