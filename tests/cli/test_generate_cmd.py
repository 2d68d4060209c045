"""`hisparse generate`: a tiny random transformers DSA model decodes through hisparse and is
checked against its own generate; the table, the JSON and the error line."""

from __future__ import annotations

import contextlib
import io
import json
import re

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


@pytest.mark.parametrize(("flag", "tiny"), [("--host", "1"), ("--host-pool-gib", "1e-7")])
def test_the_smallest_host_pool_generate_accepts_is_enough(flag: str, tiny: str) -> None:
    """The figure the host-pool check names is one that works (the engine's own check accepted
    less and then failed mid-decode), under the size flag and its older GiB name alike."""
    rc, out, err = _run(flag, tiny, "--new-tokens", "8")
    assert rc == 2
    needed = err.strip().splitlines()[-1].rpartition(">= ")[2]
    rc, out, err = _run(flag, needed, "--new-tokens", "8", "--json")
    assert rc == 0, err
    assert json.loads(out)["exactness"]["exact"]


# The SMALL batch's pages: 2 layers x 4 tokens x 96 B (float32 rows of 24 values) = 768 B; its floor
# is 58 pages (43.50 KiB), and with 8 new tokens it needs 66 host pages + the null one (50.25 KiB).
@pytest.mark.parametrize(("budget", "pages"), [
    (["--gpu-kv", "44KiB"], 58),          # 58.67 pages, rounded down
    (["--gpu-kv", "45056"], 58),          # the same size in bytes
    (["--gpu-kv", "60KiB"], 80),
    (["--gpu-kv-pages", "80"], 80),       # the older name: a page count
])
def test_gpu_kv_is_a_size_taken_in_whole_pages(budget: list[str], pages: int) -> None:
    """`--gpu-kv SIZE` (the size flag of run and plan) sets the GPU budget the engine runs with,
    in pages of the model's real page size; `--gpu-kv-pages` still sets it as a count."""
    rc, out, err = _run(*budget, "--host", "64KiB", "--new-tokens", "8", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["engine"]["gpu_pool_pages"] == pages
    assert doc["engine"]["host_pool_blocks"] == 64 * 1024 // 768
    assert doc["exactness"]["exact"]


@pytest.mark.parametrize(("budget", "expected"), [
    ([], (0, 0.05)),
    (["--gpu-kv", "43.5KiB"], (58, 0.05)),
    (["--gpu-kv", "2GiB"], (2 * 2**30 // 768, 0.05)),
    (["--gpu-kv-pages", "0"], (0, 0.05)),
    (["--gpu-kv-pages", "58"], (58, 0.05)),
    (["--host", "1.5GiB"], (0, 1.5)),
    (["--host", "1536M"], (0, 1.5)),
    (["--host", "0.05GiB"], (0, int(0.05 * 2**30) / 2**30)),
    (["--host-pool-gib", "1.5"], (0, 1.5)),
    (["--gpu-kv", "100KiB", "--host-pool-gib", "2"], (133, 2.0)),
    (["--gpu-kv-pages", "100", "--host", "2G"], (100, 2.0)),
])
def test_new_and_old_budget_flags_give_the_demo_its_budgets(budget: list[str], expected: tuple[int, float],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """What `preflight` hands the demo (pages, 0 for the default; GiB) for every spelling of the
    two budgets, either name of one with either of the other."""
    import hisparse_core.capacity as capacity
    from hisparse_core.cli import build_parser
    from hisparse_transformers.cli import preflight

    monkeypatch.setattr(capacity, "available_host_bytes", lambda: 64 << 30)
    args = build_parser().parse_args(["generate", *SMALL, "--new-tokens", "8", *budget])
    assert preflight(args, "cpu") == expected


@pytest.mark.parametrize(("extra", "refused", "ram_kib"), [
    (["--dtype", "bfloat16"], True, 75),
    (["--kv-rows", "fp8"], True, 75),
    # fp32 model rows: exact on its own, no second run to fit; its 43.5 KiB pool and the 64 KiB host
    # pool are both RAM on the CPU, which 75 KiB does not hold together (enable refuses that pair)
    ([], False, 128),
])
def test_a_lossy_runs_offload_check_must_fit_before_anything_runs(extra: list[str], refused: bool, ram_kib: int,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A lossy run (bf16, fp8 rows) runs the same engine a second time with every page resident;
    where the checked run's budget fits the device and that one does not, preflight says so in one
    line naming the flags that shrink it (it used to fail after the checked run)."""
    import hisparse_core.capacity as capacity
    from hisparse_core.cli import build_parser
    from hisparse_core.errors import CapacityError
    from hisparse_transformers.cli import preflight

    # 75 KiB of host RAM (71.25 KiB takeable; the CPU model's device memory too): the checked run's
    # default budget (58 pages of 384, 512 or 768 B) and a 64 KiB host pool fit; the comparison's
    # 214 pages (2 x 78 all resident + the floor of 58) of 384 or 512 B do not
    monkeypatch.setattr(capacity, "available_host_bytes", lambda: ram_kib << 10)
    args = build_parser().parse_args(["generate", *SMALL, "--host", "64KiB", *extra])
    if not refused:
        assert preflight(args, "cpu") == (0, 64 / 2**20)
        return
    with pytest.raises(CapacityError, match=r"offload check \(the same engine with no page released: 214 pages") as e:
        preflight(args, "cpu")
    assert "fewer or shorter prompts (--prompts, --max-prompt, --new-tokens)" in str(e.value)


def test_the_batches_line_says_where_a_prompt_is_all_prefix() -> None:
    """The second batch's prompts are 16 tokens shorter: a 30-token prefix leaves its 24-token
    prompt all prefix, and the table says so rather than that it shares 30 tokens."""
    rc, out, err = _run("--min-prompt", "40", "--max-prompt", "60", "--shared-prefix", "30")
    assert rc == 0, err
    line = next(x for x in out.splitlines() if x.strip().startswith("batches"))
    assert ("then 3 prompts of [44, 34, 24] tokens + 6 new, sharing a 30-token prefix (a prompt shorter than it is "
            "all prefix)") in line, line
    rc, out, err = _run("--min-prompt", "40", "--max-prompt", "60", "--shared-prefix", "24")
    assert rc == 0 and "all prefix" not in out, out


@pytest.mark.parametrize(("lengths", "shared", "expected"), [
    # --min-prompt 17 --max-prompt 17 --prompts 2 --new-tokens 4: "then [1, 1] + 1 sharing a 17-token prefix"
    ([1, 1], 17, "2 prompts of [1, 1] tokens + 1 new, each the start of the 17-token shared prefix"),
    ([1], 17, "1 prompt of [1] tokens + 1 new, the start of the 17-token shared prefix"),
    ([44, 34, 24], 30, "3 prompts of [44, 34, 24] tokens + 1 new, sharing a 30-token prefix (a prompt shorter than it "
                       "is all prefix)"),
    ([44, 34, 24], 24, "3 prompts of [44, 34, 24] tokens + 1 new, sharing a 24-token prefix"),
])
def test_the_second_batch_reads_as_prompts_and_what_of_them_is_shared(lengths: list[int], shared: int,
                                                                      expected: str) -> None:
    from hisparse_transformers.cli import _second_batch

    assert _second_batch({"second_batch_lengths": lengths, "second_batch_new_tokens": 1,
                          "shared_prefix": shared}) == expected


def test_the_table_counts_one_layer_and_one_step_in_the_singular() -> None:
    rc, out, err = _run("--layers", "1", "--new-tokens", "1")
    assert rc == 0, err
    assert ": 1 layer in index groups" in out and "over 1 step" in out, out
    assert "1 layers" not in out and "over 1 steps" not in out, out


def test_the_table_gives_no_decode_rate_where_nothing_was_decoded() -> None:
    """--new-tokens 1: each prompt's one token comes from its prefill; the table said 'decode
    0.0 tokens/s (0 tokens; ...)', a throughput of nothing."""
    rc, out, err = _run("--new-tokens", "1")
    assert rc == 0, err
    decode = next(ln for ln in out.splitlines() if ln.strip().startswith("decode "))
    assert decode.split(None, 1)[1] == ("n/a: no decode step ran (--new-tokens 1: each prompt's one new token "
                                        "comes from its prefill)"), decode


def test_the_table_counts_one_prompt_in_the_singular() -> None:
    rc, out, err = _run("--prompts", "1")
    assert rc == 0, err
    line = next(x for x in out.splitlines() if x.strip().startswith("batches"))
    assert " 1 prompt of " in line and "1 prompts" not in out, line


#: Machine figures fixed, so that every error line below is exact on any machine.
_RAM = {"available_host_bytes": 64 << 30, "total_host_bytes": 128 << 30}
_NEEDS = "3 prompts with a 16-row hot buffer and --prefill-chunk 8 need"
_BATCH = "the batch's 3 prompts of [100, 80, 60] tokens + 24 new need 78"
_HOST_RAM = ("of host RAM; 64.00 GiB is available of 128.00 GiB total, and at most 95% of it (60.80 GiB) may be "
             "taken")


@pytest.mark.parametrize(("argv", "line"), [
    # the size flags, at parse time: the parser's line, as for run and plan
    (["--gpu-kv", "abc"], "argument --gpu-kv: expected a size in [1 B, 1024 TiB] (a number and an optional unit: "
                          "B, KiB, MiB, GiB, TiB, K, M, G, T, KB, MB, GB, TB), got 'abc' (see hisparse generate --help)"),
    (["--gpu-kv", "0"], "argument --gpu-kv: expected a size in [1 B, 1024 TiB], got '0' (see hisparse generate --help)"),
    (["--host", "-1GiB"], "argument --host: expected a size in [1 B, 1024 TiB] (a number and an optional unit: "
                          "B, KiB, MiB, GiB, TiB, K, M, G, T, KB, MB, GB, TB), got '-1GiB' (see hisparse generate "
                          "--help)"),
    (["--host", "12XB"], "argument --host: expected a size in [1 B, 1024 TiB] (a number and an optional unit: "
                         "B, KiB, MiB, GiB, TiB, K, M, G, T, KB, MB, GB, TB), got '12XB' (see hisparse generate "
                         "--help)"),
    # the older names, at parse time, as before
    (["--gpu-kv-pages", "-1"], "argument --gpu-kv-pages: expected an integer in [0, 16777216], got -1 (see hisparse "
                               "generate --help)"),
    (["--host-pool-gib", "0"], "argument --host-pool-gib: expected a number in (0, 1024], got 0 (see hisparse "
                               "generate --help)"),
    # against the batch and the machine, before the model is built, naming the flag given
    (["--gpu-kv", "1KiB"], f"--gpu-kv 1.00 KiB holds 1 page of 768 B (--layers 2 x --block-size 4 x 96 B), below the "
                           f"58 that {_NEEDS}; expected --gpu-kv >= 43.50KiB"),
    (["--gpu-kv", "43.49KiB"], f"--gpu-kv 43.49 KiB holds 57 pages of 768 B (--layers 2 x --block-size 4 x 96 B), "
                               f"below the 58 that {_NEEDS}; expected --gpu-kv >= 43.50KiB"),
    (["--gpu-kv", "100GiB"], f"--gpu-kv 100.00 GiB (139810133 pages) needs 100.00 GiB (107374182144 B) {_HOST_RAM}: "
                             "lower --gpu-kv to at most 60.79GiB"),
    # --layers 64: pages of 64 x 4 x 96 B = 24576 B; 95% of 64 GiB holds 2656392 of them
    (["--layers", "64", "--gpu-kv-pages", "16777216"], f"--gpu-kv-pages 16777216 (384.00 GiB of KV) needs 384.00 GiB "
                                                       f"(412316860416 B) {_HOST_RAM}: lower --gpu-kv-pages to at most "
                                                       "2656392"),
    (["--gpu-kv-pages", "3"], f"--gpu-kv-pages 3 is below what {_NEEDS}; expected --gpu-kv-pages >= 58 (or 0 for "
                              "the default)"),
    (["--host", "1"], f"--host 1 B holds 0 pages of 768 B; {_BATCH}: expected --host >= 59.25KiB"),
    (["--host", "59KiB"], f"--host 59.00 KiB holds 77 pages of 768 B; {_BATCH}: expected --host >= 59.25KiB"),
    (["--host", "1000GiB"], f"--host 1000.00 GiB needs 1000.00 GiB (1073741824000 B) {_HOST_RAM}: lower --host to "
                            "at most 60.79GiB"),
    (["--host-pool-gib", "1e-7"], f"--host-pool-gib 1e-07 holds 0 pages of 768 B; {_BATCH}: expected --host-pool-gib "
                                  ">= 5.66e-05"),
    (["--host-pool-gib", "1000"], f"--host-pool-gib 1000 needs 1000.00 GiB (1073741824000 B) {_HOST_RAM}: lower "
                                  "--host-pool-gib to at most 60.7"),
    # --top-k past what --hot-rows can ever hold: the parser's range, and no --hot-rows beyond its own bound suggested
    (["--top-k", "65536"], "argument --top-k: expected an integer in [1, 32768], got 65536 (see hisparse generate "
                           "--help)"),
    (["--top-k", "32768", "--block-size", "3", "--hot-rows", "32766"],
     "--hot-rows 32766 is below --top-k 32768: one step's top-k must fit the hot buffer; expected --top-k <= 32766"),
    (["--top-k", "32"], "--hot-rows 16 is below --top-k 32: one step's top-k must fit the hot buffer; expected "
                        "--hot-rows >= 32 (a multiple of --block-size 4) or --top-k <= 16"),
    # both names of one budget: refused before anything, naming both
    (["--gpu-kv", "1GiB", "--gpu-kv-pages", "100"], "argument --gpu-kv-pages: not allowed with --gpu-kv: both set the "
                                                    "GPU KV budget; expected one of the two (see hisparse generate "
                                                    "--help)"),
    (["--gpu-kv-pages", "0", "--gpu-kv", "1GiB"], "argument --gpu-kv-pages: not allowed with --gpu-kv: both set the "
                                                  "GPU KV budget; expected one of the two (see hisparse generate "
                                                  "--help)"),
    (["--host-pool-gib", "1", "--host", "1GiB"], "argument --host-pool-gib: not allowed with --host: both set the "
                                                 "host pool budget; expected one of the two (see hisparse generate "
                                                 "--help)"),
    (["--host", "1", "--host-pool-gib", "1e-7", "--gpu-kv-pages", "3"],
     "argument --host-pool-gib: not allowed with --host: both set the host pool budget; expected one of the two (see "
     "hisparse generate --help)"),
])
def test_budget_flags_refuse_bad_input_in_one_exact_line(argv: list[str], line: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Each bad budget, under its new or its old name, is the one line that names the flag, the
    value and what is expected, exit status 2, nothing on stdout, before any work."""
    import hisparse_core.capacity as capacity
    import hisparse_transformers.demo as demo

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the demo started although a budget cannot work")

    monkeypatch.setattr(demo, "run_demo", must_not_run)
    for name, value in _RAM.items():
        monkeypatch.setattr(capacity, name, lambda value=value: value)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(["generate", *SMALL, *argv])
        except SystemExit as exc:  # the parser's refusals
            rc = exc.code  # type: ignore[assignment]
    assert rc == 2 and out.getvalue() == ""
    assert err.getvalue().splitlines() == [f"hisparse generate: error: {line}"]


@pytest.mark.parametrize("argv", [["--gpu-kv", "1GiB", "--gpu-kv-pages", "100"],
                                  ["--host", "1GiB", "--host-pool-gib", "1"]])
def test_both_names_of_a_budget_are_refused_before_the_backend_or_torch(argv: list[str],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Two flags for one budget fail before anything else is looked at: a bad backend name and a
    bad prompt range given with them are not reached, nor is the backend selected."""
    import hisparse_core.registry as registry

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("a backend was selected although two flags set one budget")

    monkeypatch.setattr(registry, "select_backend", must_not_run)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["generate", *argv, "--backend", "no-such-backend", "--min-prompt", "300", "--max-prompt", "200"])
    assert rc == 2 and out.getvalue() == ""
    lines = err.getvalue().splitlines()
    assert len(lines) == 1 and "not allowed with" in lines[0] and argv[0] in lines[0] and argv[2] in lines[0], lines


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


def test_bfloat16_is_judged_against_fp32_not_exactly() -> None:
    """Two bf16 computations of attention part ways (tokens differ, logits by about a unit), so a bf16
    run is teacher-forced with the fp32 model of the same weights: it passes where hisparse's error
    is within the stated bf16 tolerance of the model's own, and every row read is still exact."""
    rc, out, err = _run("--dtype", "bfloat16", "--json")
    assert rc == 0, err
    x = json.loads(out)["exactness"]
    b = x["lossy_against_fp32"]
    assert x["passed"] and x["verdict"] == "WITHIN BF16 TOLERANCE" and b["lossy"] == "bf16" and b["judged"], x
    assert b["limit"] == pytest.approx(b["factor"] * b["transformers"] + b["slack"])
    assert 0 < b["hisparse"] <= b["limit"] and b["transformers"] > 0
    assert x["rows_checked"] > 0 and x["rows_max_abs_diff"] == 0
    # what offloading does is judged exactly: the same engine under a budget that releases no page
    off = x["offload_against_all_resident"]
    assert off["exact"] and off["max_abs_logit_diff"] == 0 and off["all_resident_released_pages"] == 0, off


def test_a_lossy_run_fails_where_offloaded_reads_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bf16 verdict can fail: rows read 1% off at the tight budget only (within the bf16 row
    check, and the loose tolerance against fp32 still holds) move the logits away from the same
    engine's under a budget that releases no page."""
    from hisparse_transformers import attention

    real = attention._gather

    def gather(engine: object, group: int, position: int, rmap: object) -> object:
        kv = real(engine, group, position, rmap)  # type: ignore[arg-type]
        return kv * 1.01 if engine.gpu_blocks < 100 else kv  # type: ignore[attr-defined]

    monkeypatch.setattr(attention, "_gather", gather)
    rc, out, _ = _run("--dtype", "bfloat16", "--json")
    x = json.loads(out)["exactness"]
    off = x["offload_against_all_resident"]
    assert rc == 1 and not x["passed"] and x["verdict"] == "FAILED" and not off["exact"], x
    assert x["lossy_against_fp32"]["within"], x          # the loose tolerance alone would have passed it


def test_fp8_rows_are_exact_against_the_model_reading_the_rows_hisparse_stored() -> None:
    """`--kv-rows fp8`: rows stored as DeepSeek-V3.2 serves them (64 B here: 16 e4m3 values, a scale,
    8 fp32 rope values). The verdict (fp32) is teacher-forced: the model alone reading the very
    latents hisparse stored, within 1e-4, its rounding flips counted; every row read is within fp8
    rounding of the model's latent (not equal to it); the cost against fp32 is reported, not judged."""
    rc, out, err = _run("--kv-rows", "fp8", "--new-tokens", "24", "--json")
    assert rc == 0, err
    r = json.loads(out)
    x, b, st = r["exactness"], r["exactness"]["lossy_against_fp32"], r["exactness"]["stored_rows"]
    assert r["config"]["kv_rows"] == "fp8" and r["engine"]["row_bytes"] == 64, r["engine"]
    assert x["passed"] and x["verdict"] == "EXACT" and x["exact"], x
    assert st["exact"] and st["judged"] and st["max_abs_logit_diff"] <= x["logit_tolerance"] and st["steps"] > 0, st
    assert 0 <= st["rounding_flips"] < st["latent_values"] and st["latent_values"] > 0, st
    assert b["lossy"] == "fp8 rows" and b["hisparse"] > 0 and b["transformers"] > 0 and not b["judged"], b
    assert x["rows_checked"] > 0 and x["rows_max_abs_diff"] > 0
    # the rows moved are fp8's: 64 B each, where the model's fp32 rows are 96
    assert r["stats"]["h2d_bytes"] >= 64 * r["stats"]["misses"] > 0
    # the table says so too: the rows read are within fp8 rounding of the latent, not equal to it
    from hisparse_transformers.cli import _table

    table = _table(r)
    line = next(ln for ln in table.splitlines() if ln.strip().startswith("rows checked"))
    assert "within fp8 rounding of the model's own latent" in line and "each equal" not in line, line
    assert "the model alone reading the very latents hisparse stored" in table
    assert "the model alone reading the same fp8 rows" in table and "limit" not in table, table


def test_the_default_shared_prefix_fits_short_prompts() -> None:
    """Without --shared-prefix, the second batch shares min(128, --min-prompt) tokens: short prompts
    run as asked rather than being refused for a default the user never gave."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["generate", "--prompts", "2", "--min-prompt", "40", "--max-prompt", "60", "--new-tokens", "2",
                   "--layers", "1", "--top-k", "8", "--hot-rows", "16", "--block-size", "4", "--prefill-chunk", "8",
                   "--no-progress", "--json"])
    assert rc == 0, err.getvalue()
    r = json.loads(out.getvalue())
    assert r["config"]["shared_prefix"] == 40 and r["stats"]["prefix_hit_tokens"] > 0, r["config"]


def test_fp8_rows_fail_where_attention_is_off_by_a_thousandth(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fp8 verdict is live: attention 0.1% off (the rows read still right, so the row check
    passes) fails the teacher-forced comparison with the model reading the same stored latents."""
    from hisparse_transformers import attention

    real = attention.absorbed_attention
    monkeypatch.setattr(attention, "absorbed_attention", lambda *a, **k: real(*a, **k) * 1.001)
    rc, out, _ = _run("--kv-rows", "fp8", "--new-tokens", "8")
    assert rc == 1
    result = [ln.split(None, 1) for ln in out.splitlines() if ln.strip().startswith("result")]
    assert result == [["result", "FAILED (tolerance 1e-04 against the model reading the latents hisparse stored)"]], out


def test_bfloat16_fails_beyond_its_tolerance(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bf16 verdict is live: with no tolerance at all (factor 0, slack 0), hisparse's nonzero error
    fails the run, exit 1, and the table says by what rule."""
    from hisparse_transformers import demo

    monkeypatch.setattr(demo, "BF16_FACTOR", 0.0)
    monkeypatch.setattr(demo, "BF16_SLACK", 0.0)
    rc, out, _ = _run("--dtype", "bfloat16", "--new-tokens", "8")
    assert rc == 1
    lines = [ln.split(None, 1) for ln in out.splitlines() if ln.strip().startswith(("result", "bf16 vs fp32"))]
    assert any(ln[0] == "bf16" for ln in lines), out
    assert lines[-1] == ["result", "FAILED (tolerance 0x transformers' own bf16 error + 0)"], out
    assert "limit 0x + 0 = 0.000" in out


def test_float32_has_no_bf16_verdict(json_runs: dict[str, tuple[int, str, str]]) -> None:
    x = json.loads(_json_run(json_runs, "deepseek_v32")[1])["exactness"]
    assert x["lossy_against_fp32"] is None and x["passed"] and x["verdict"] == "EXACT"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_progress_bar_counts_every_step_it_waits_for(dtype: str) -> None:
    """The progress units `run_demo` reports add up to `total_steps` (the bar's length), the
    teacher-forced runs of a bfloat16 run included: the bar neither stops short nor overflows."""
    from hisparse_transformers.demo import DemoConfig, run_demo, total_steps

    c = DemoConfig(dtype=dtype, backend="reference_cpu", prompts=2, min_prompt=40, max_prompt=60, new_tokens=8,
                   layers=2, top_k=8, hot_rows=16, block_size=4, prefill_chunk=8, shared_prefix=8)
    ticks: list[str] = []
    run_demo(c, progress=lambda n, label: ticks.extend([label] * n))
    assert len(ticks) == total_steps(c)
    assert any(t.startswith("teacher-forced") for t in ticks) == (dtype == "bfloat16")


@pytest.mark.parametrize(("extra", "why"), [
    # the floor (40 pages) is above the 34 the batch needs all resident, yet its hot buffers and
    # prefill tails come out of the same pool: 12 pages are released
    ([], None),
    # a budget the user gave that holds everything: none released, and the floor is not the cause
    (["--gpu-kv-pages", "1000"], "the budget given"),
])
def test_the_budgets_line_says_no_page_is_released_only_where_none_is(extra: list[str], why: str | None) -> None:
    rc, out, err = _run("--prompts", "2", "--min-prompt", "40", "--max-prompt", "80", "--new-tokens", "8", *extra)
    assert rc == 0, err
    budgets = next(ln for ln in out.splitlines() if ln.strip().startswith("budgets"))
    released = next(ln for ln in out.splitlines() if ln.strip().startswith("pages released"))
    none = released.split()[2] == "0"
    assert none == (why is not None), released
    assert ("no page is released" in budgets) == none, (budgets, released)
    if why is not None:
        assert why in budgets and "floor" not in budgets, budgets


def test_bf16_fp8_stored_rows_are_reported_not_judged() -> None:
    """bf16 with fp8 rows: the model reading hisparse's stored latents parts from hisparse by bf16
    noise (its `exact` is false while the run passes on the bf16 verdict), so the JSON and the table
    say that comparison is reported, not judged, rather than showing a failed check under a pass."""
    rc, out, err = _run("--dtype", "bfloat16", "--kv-rows", "fp8", "--new-tokens", "8", "--json")
    assert rc == 0, err
    r = json.loads(out)
    x = r["exactness"]
    assert x["passed"] and x["stored_rows"]["judged"] is False, x["stored_rows"]
    from hisparse_transformers.cli import _table

    line = next(ln for ln in _table(r).splitlines() if ln.strip().startswith("stored rows"))
    assert "not judged" in line, line


def test_a_failed_result_names_every_check_that_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 failing both its tolerance against fp32 (none at all) and the offload check (rows read
    1% off at the tight budget): the result line names both, not only the first."""
    from hisparse_transformers import attention, demo

    real = attention._gather

    def gather(engine: object, group: int, position: int, rmap: object) -> object:
        kv = real(engine, group, position, rmap)  # type: ignore[arg-type]
        return kv * 1.01 if engine.gpu_blocks < 100 else kv  # type: ignore[attr-defined]

    monkeypatch.setattr(attention, "_gather", gather)
    monkeypatch.setattr(demo, "BF16_FACTOR", 0.0)
    monkeypatch.setattr(demo, "BF16_SLACK", 0.0)
    rc, out, _ = _run("--dtype", "bfloat16", "--new-tokens", "8")
    assert rc == 1
    result = next(ln for ln in out.splitlines() if ln.strip().startswith("result"))
    assert "offloading moved the logits" in result and "tolerance 0x transformers' own bf16 error + 0" in result, result


@pytest.mark.parametrize("shortest", ["1", "10", "16"])
def test_prompts_too_short_for_the_second_batch_are_one_line(shortest: str) -> None:
    """The second batch's prompts are 16 tokens shorter than the first's: a --min-prompt of 16 or
    less (reachable with the default --shared-prefix, min(128, --min-prompt)) is refused in one
    line before anything is built, not a traceback or an error about a prompt the user never gave."""
    rc, out, err = _run("--min-prompt", shortest, "--max-prompt", "40")
    assert rc == 2 and out == "", out
    assert err.strip().splitlines()[-1] == (
        f"hisparse generate: error: --min-prompt {shortest}: the second batch's prompts are 16 tokens shorter "
        "than the first's; expected --min-prompt >= 17"), err
    from hisparse_transformers.demo import DemoConfig

    with pytest.raises(ValueError, match="min_prompt"):
        DemoConfig(min_prompt=int(shortest), max_prompt=40, shared_prefix=0)


def test_one_prompt_is_as_long_as_max_prompt_so_a_short_min_prompt_is_fine() -> None:
    from hisparse_transformers.demo import DemoConfig

    assert DemoConfig(prompts=1, min_prompt=4, max_prompt=40, shared_prefix=0).lengths() == [40]


def test_one_prompt_is_not_refused_for_the_default_min_prompt() -> None:
    """With one prompt --min-prompt is not used (the prompt is --max-prompt long): --max-prompt 40
    was refused as below the default --min-prompt 200, and a --shared-prefix up to the prompt's
    length as above it; the default prefix is min(128, the prompt's length)."""
    from hisparse_transformers.demo import DemoConfig

    assert DemoConfig(prompts=1, max_prompt=40, shared_prefix=40).lengths() == [40]
    for extra, prefix in (([], 40), (["--shared-prefix", "30"], 30)):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["generate", "--prompts", "1", "--max-prompt", "40", "--new-tokens", "2", "--layers", "1",
                       "--top-k", "8", "--hot-rows", "16", "--block-size", "4", "--prefill-chunk", "8",
                       "--no-progress", "--json", *extra])
        assert rc == 0, err.getvalue()
        r = json.loads(out.getvalue())
        assert r["config"]["shared_prefix"] == prefix and r["config"]["prompt_lengths"] == [40], r["config"]
    rc, _, err = _run("--prompts", "1", "--max-prompt", "40", "--shared-prefix", "41")
    assert rc == 2 and err.strip().splitlines()[-1] == (
        "hisparse generate: error: --shared-prefix 41 is above --max-prompt 40 (one prompt, --max-prompt long); "
        "expected a prefix in [0, --max-prompt]"), err


def test_the_table_claims_no_rate_or_ratio_it_did_not_measure() -> None:
    """One new token: no decode step, so no hot-buffer lookup; the hit rate line said 100.00% of
    0 hits and 0 misses. Prompts this short need fewer pages all resident than hisparse's hot
    buffer takes: the 'without' line said '0.80x more' (and '1.00x more' where they were equal). The host->device bytes include page
    restores, not only decode misses (512 B 'by decode misses' beside 0 misses)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["generate", "--prompts", "2", "--min-prompt", "20", "--max-prompt", "24", "--new-tokens", "1",
                   "--layers", "1", "--top-k", "8", "--hot-rows", "16", "--block-size", "4", "--prefill-chunk", "8",
                   "--no-progress"])
    assert rc == 0, err.getvalue()
    line = {ln.split()[0]: ln for ln in out.getvalue().splitlines() if ln.startswith("  ")}
    assert "n/a: no lookup went through the hot buffer (0 hits, 0 misses" in line["hit"], line["hit"]
    ratio = re.search(r"([0-9.]+)x more", line["without"])
    assert ratio is None or float(ratio.group(1)) > 1, line["without"]
    assert "by decode misses and page restores" in line["host->device"], line["host->device"]


def test_a_large_batch_is_named_in_a_short_line() -> None:
    """--prompts 256 listed all 256 prompt lengths in the one-line refusal (about 1,800 characters)."""
    rc, out, err = _run("--prompts", "256", "--host", "1")
    line = err.strip().splitlines()[-1]
    assert rc == 2 and out == "" and len(line) < 300, line
    assert "the batch's 256 prompts of [100, 100, 100, ..., 60] tokens + 24 new need" in line, line


def test_a_prefill_chunk_past_the_context_is_sized_as_the_engine_sizes_it() -> None:
    """No forward holds more than max_context tokens (124 here), so the engine's floor counts a
    --prefill-chunk past it as 124 tokens: the preflight counted 65536 whole (16385 pages a request
    and step) and named 196,642 pages as the least budget that fits (the default budget too). The floor it names now is the engine's, and it runs."""
    rc, out, err = _run("--prefill-chunk", "65536", "--gpu-kv-pages", "1")
    assert rc == 2 and err.strip().splitlines()[-1].endswith("expected --gpu-kv-pages >= 406 (or 0 for the default)"), err
    rc, out, err = _run("--prefill-chunk", "65536", "--gpu-kv-pages", "406", "--json")
    assert rc == 0, err
    assert json.loads(out)["engine"]["gpu_pool_pages"] == 406


def test_an_all_resident_comparison_that_releases_pages_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The offload check compares offloading with none: a comparison run that released pages (here
    given the tight run's budget) would compare it with less of it, so the run fails, naming why."""
    import hisparse_transformers

    real = hisparse_transformers.enable
    budgets: list[float] = []

    def enable(model: object, **kw: object) -> object:
        budgets.append(kw["gpu_kv_gib"])  # type: ignore[arg-type]
        if kw.get("cuda_graphs") is False:            # the comparison run: the tight run's budget
            kw["gpu_kv_gib"] = budgets[0]
        return real(model, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(hisparse_transformers, "enable", enable)
    rc, out, _ = _run("--dtype", "bfloat16", "--new-tokens", "8")
    assert rc == 1 and len(budgets) == 2
    result = next(ln for ln in out.splitlines() if ln.strip().startswith("result"))
    assert "the all-resident comparison released" in result and "expected none" in result, result


def test_the_progress_bar_shows_no_eta() -> None:
    """generate's steps are those of the model alone, then of hisparse, several times slower on the
    CPU: the ETA from the first ones said 1.2 s with 10 s left (default workload, 2 cores)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["generate", *(a for a in SMALL if a != "--no-progress")])
    assert rc == 0, err.getvalue()
    bar = [ln for ln in err.getvalue().splitlines() if ln.startswith("generate [")]
    assert len(bar) >= 3, err.getvalue()  # the quarter milestones (stderr is no terminal here)
    assert not any(" eta " in ln for ln in bar), bar


@pytest.mark.parametrize(("flags", "hot_rows"), [
    ([], 64),
    (["--block-size", "128"], 128),                      # was: --hot-rows 64 is not a multiple of --block-size 128
    (["--top-k", "100"], 208),                           # was: --hot-rows 64 is below --top-k 100
    (["--top-k", "32768", "--block-size", "64"], 32768),  # 2x is past a runtime's limit: the limit
])
def test_hot_rows_default_follows_top_k_and_block_size(flags: list[str], hot_rows: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """--hot-rows was a fixed 64: --top-k or --block-size given alone was refused naming a --hot-rows
    the user never set. Its default is now enable's: 2x --top-k in whole pages of --block-size."""
    import hisparse_core.capacity as capacity
    from hisparse_core.cli import build_parser
    from hisparse_transformers.cli import preflight

    monkeypatch.setattr(capacity, "available_host_bytes", lambda: 64 << 30)
    args = build_parser().parse_args(["generate", "--prompts", "1", "--max-prompt", "40", "--new-tokens", "4",
                                      "--host", "1GiB", *flags])
    preflight(args, "cpu")
    assert args.hot_rows == hot_rows


def test_a_default_hot_rows_that_cannot_hold_top_k_says_it_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    import hisparse_core.capacity as capacity
    from hisparse_core.cli import build_parser
    from hisparse_core.errors import InvalidInputError
    from hisparse_transformers.cli import preflight

    monkeypatch.setattr(capacity, "available_host_bytes", lambda: 64 << 30)
    args = build_parser().parse_args(["generate", "--top-k", "32768", "--block-size", "3"])
    with pytest.raises(InvalidInputError, match=r"^--hot-rows 32766 \(the default\) is below --top-k 32768: .*"
                                                r"expected --top-k <= 32766$"):
        preflight(args, "cpu")


def test_generate_holds_back_every_installed_backends_info_lines() -> None:
    """`generate --backend triton` printed the triton runtime's INFO line once per index group (4
    at the defaults) under the one line naming the backend: only the core's and the transformers
    engine's loggers were held back, not the backends' packages."""
    import logging

    from hisparse_core.registry import get_registry
    from hisparse_transformers.cli import _QuietEngine

    packages = {e.factory.split(":")[0].split(".")[0] for e in get_registry().entries() if e.factory}
    assert "hisparse_reference_cpu" in packages, packages
    root = logging.getLogger()
    before = root.level
    root.setLevel(logging.INFO)
    try:
        quiet = _QuietEngine()
        with quiet:
            assert not [p for p in packages if logging.getLogger(f"{p}.runtime").isEnabledFor(logging.INFO)]
        assert all(logging.getLogger(f"{p}.runtime").isEnabledFor(logging.INFO) for p in packages)
    finally:
        root.setLevel(before)


@pytest.mark.parametrize("host", [["--host", "40MiB"], ["--host-pool-gib", "0.04"]])
def test_budgets_that_fit_the_ram_only_one_at_a_time_are_refused_together(host: list[str],
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU model both pools are host RAM: each budget was checked alone, and the pair was
    refused by enable in its words (gpu_kv_gib=..., host_pool_gib=... taken first) after the model
    was built and had generated alone."""
    import hisparse_core.capacity as capacity
    from hisparse_core.cli import build_parser
    from hisparse_core.errors import CapacityError
    from hisparse_transformers.cli import preflight

    monkeypatch.setattr(capacity, "available_host_bytes", lambda: 64 << 20)  # 60.8 MiB takeable
    args = build_parser().parse_args(["generate", *SMALL, "--gpu-kv", "40MiB", *host])
    with pytest.raises(CapacityError) as e:
        preflight(args, "cpu")
    why = str(e.value)
    assert why.startswith("--gpu-kv 40.00 MiB ") and f"and {host[0]} " in why and "together" in why, why
    assert why.endswith(f"lower --gpu-kv or {host[0]} so that together they take at most 60.79MiB"), why
    assert "gpu_kv_gib" not in why and "host_pool_gib" not in why, why


def test_a_lossy_runs_offload_check_must_fit_beside_the_host_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """The offload check's second engine (214 pages of 384 B, bf16) has its own host pool of --host:
    on the CPU both are RAM. Each fit alone at 128 KiB, so the run went through the whole checked run
    and was refused at that engine's enable."""
    import hisparse_core.capacity as capacity
    from hisparse_core.cli import build_parser
    from hisparse_core.errors import CapacityError
    from hisparse_transformers.cli import preflight

    monkeypatch.setattr(capacity, "available_host_bytes", lambda: 128 << 10)  # 121.6 KiB takeable
    args = build_parser().parse_args(["generate", *SMALL, "--host", "64KiB", "--dtype", "bfloat16"])
    with pytest.raises(CapacityError, match=r"^the bf16 run's offload check \(214 pages of 384 B, no page "
                                            r"released\) and --host 64.00 KiB together .*: lower --host, or fewer "
                                            r"or shorter prompts"):
        preflight(args, "cpu")
