"""CLI output that says what happened (issue 43): bad values refused in the flags' words before any
work, a run that reports neither a pass when nothing was checked nor a finish it did not reach,
plots written under the name given with their legends clear of the data, one set of model names."""

from __future__ import annotations

import contextlib
import io
import json
import logging
from pathlib import Path

import pytest

from hisparse_core.cli import build_parser, main

#: 3 requests of 100+4 tokens, top-k 64: a run of seconds on reference_cpu.
TINY = ["run", "--backend", "reference_cpu", "--requests", "3", "--context", "100", "--decode-tokens", "4",
        "--top-k", "64", "--block-size", "16", "--gpu-kv", "3MiB", "--host", "8MiB", "--no-progress"]


def _err_line(capsys: pytest.CaptureFixture[str], prog: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(prog)]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _json(argv: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return json.loads(out.getvalue())


# ------------------------------------------------------------------------------------ --plot


@pytest.mark.parametrize("name", ["x.txt", "p.pgn"])
@pytest.mark.parametrize("command", [TINY, ["plan"]], ids=["run", "plan"])
def test_an_unsupported_plot_extension_is_refused_before_any_work(
        name: str, command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    import hisparse_core.planner as planner
    import hisparse_core.replay.run as replay_run

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the work started although --plot cannot be written")

    monkeypatch.setattr(replay_run, "run_replay", must_not_run)
    monkeypatch.setattr(planner, "make_plan", must_not_run)
    target = tmp_path / name
    assert main([*command, "--plot", str(target)]) == 2
    line = _err_line(capsys, f"hisparse {command[0]}")
    ext = name.rsplit(".", 1)[1]
    assert f"--plot {str(target)!r}: matplotlib cannot write .{ext} files" in line
    assert ".png" in line and ".svg" in line and "(no extension: PNG)" in line
    assert not target.exists()


@pytest.mark.parametrize("command", [TINY, ["plan"]], ids=["run", "plan"])
def test_a_pgf_plot_without_its_tex_is_refused_before_any_work(
        command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """matplotlib lists .pgf among the formats it writes, but writes it through a TeX system (xelatex):
    without one, `plan --plot x.pgf` printed the table, then a RuntimeError traceback ('xelatex' not
    found), and `run --plot x.pgf` did so after the whole run."""
    pytest.importorskip("matplotlib")
    import hisparse_core.planner as planner
    import hisparse_core.replay.run as replay_run

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the work started although --plot cannot be written")

    monkeypatch.setattr(replay_run, "run_replay", must_not_run)
    monkeypatch.setattr(planner, "make_plan", must_not_run)
    monkeypatch.setenv("PATH", str(tmp_path))  # no TeX system on it
    target = tmp_path / "x.pgf"
    assert main([*command, "--plot", str(target)]) == 2
    line = _err_line(capsys, f"hisparse {command[0]}")
    assert f"--plot {str(target)!r}: matplotlib writes .pgf files through xelatex, which is not on PATH; " \
           "expected a name ending in " in line, line
    assert ".png" in line and ".pgf" not in line.split("expected", 1)[1]
    assert not target.exists()


def test_a_plot_writer_that_raises_after_the_table_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A matplotlib writer that fails with a RuntimeError (a TeX system that is there but broken) was a
    traceback after the table; the docs promise one line there."""
    pytest.importorskip("matplotlib")
    import hisparse_core.planner_plot as planner_plot

    def tex_fails(*args: object) -> None:
        raise RuntimeError("xelatex failed: LaTeX Error: File `fontspec.sty' not found")

    monkeypatch.setattr(planner_plot, "write_plan_plot", tex_fails)
    assert main(["plan", "--plot", str(tmp_path / "x.png")]) == 2
    captured = capsys.readouterr()
    assert "hisparse plan" in captured.out and "with hisparse" in captured.out
    assert captured.err.splitlines() == ["hisparse plan: error: --plot failed (figures above): xelatex failed: LaTeX "
                                         "Error: File `fontspec.sty' not found"]


@pytest.mark.parametrize("command", [TINY, ["plan"]], ids=["run", "plan"])
def test_an_empty_plot_name_is_refused_not_ignored(command: list[str], capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`--plot ""` (an unset shell variable) used to run the whole command and write no plot, silently."""
    import hisparse_core.planner as planner
    import hisparse_core.replay.run as replay_run

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the work started although --plot names no file")

    monkeypatch.setattr(replay_run, "run_replay", must_not_run)
    monkeypatch.setattr(planner, "make_plan", must_not_run)
    assert main([*command, "--plot", ""]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [f"hisparse {command[0]}: error: --plot '': expected a file name such as "
                                         "plot.png"]


def test_a_plot_without_extension_is_written_under_exactly_that_name(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "noext"
    with caplog.at_level(logging.INFO), contextlib.redirect_stdout(io.StringIO()):
        assert main(["plan", "--plot", str(target)]) == 0
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["noext"]
    assert f"plot written to {target} (PNG)" in caplog.messages


def test_plan_plot_legends_sit_below_the_data_and_close_markers_are_one() -> None:
    """Each panel's legend lies below its axes (it covers no curve or point); where the crossover
    is all but the hot buffer's context, only the hot buffer's line is drawn and the crossover's
    label says how far past it lies."""
    pytest.importorskip("matplotlib")
    from hisparse_core.planner import MODELS, PlanInputs, crossover_context, make_plan
    from hisparse_core.planner_plot import GID_CROSSOVER, plan_figure, pyplot

    inputs = PlanInputs(MODELS["deepseek-v3.2"], 140 << 30, 256 << 30, 131072, hot_rows=4096, miss_rate=0.13)
    crossover = crossover_context(inputs)
    assert crossover is not None and crossover < 1.25 * inputs.hot_rows
    fig = plan_figure(make_plan(inputs))
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            legend = ax.get_legend()
            if legend is None:
                continue      # the twin axes of the miss rate: its entries are in its host's legend
            assert legend.get_window_extent(renderer).y1 <= ax.get_window_extent(renderer).y0
        ax = fig.axes[0]
        verticals = [ln for ln in ax.get_lines() if len(ln.get_xdata()) > 1 and len(set(ln.get_xdata())) == 1]
        assert [ln.get_xdata()[0] for ln in verticals] == [inputs.hot_rows]
        mark = next(t for t in ax.texts if t.get_gid() == GID_CROSSOVER)
        assert f"at {crossover:,} tokens" in mark.get_text() and "past the hot buffer and tail" in mark.get_text()
    finally:
        pyplot().close(fig)


# ------------------------------------------------------------------------- the flags' language


def test_a_host_pool_too_small_names_host_and_a_size_that_fits(capsys: pytest.CaptureFixture[str]) -> None:
    from hisparse_core.coordinator import CoordinatorConfig
    from hisparse_core.errors import CapacityError
    from hisparse_core.planner import parse_bytes
    from hisparse_core.replay.engine import RunConfig, _check_host_blocks

    assert main([*TINY, "--host", "1"]) == 2
    line = _err_line(capsys, "hisparse run")
    assert line.startswith("hisparse run: error: --host 1 B holds 0 usable host blocks") and "host_pool_gib" not in line
    assert "(--context 100 + --decode-tokens 4)" in line
    fits = line.split("expected --host >= ")[1].split(",")[0]
    # The size named is enough, and a block less is not.

    def check(nbytes: int) -> None:
        c = RunConfig(requests=3, context=100, decode_tokens=4, top_k=64, block_size=16, host_bytes=nbytes)
        _check_host_blocks(c, CoordinatorConfig(
            host_pool_gib=nbytes / 2**30, num_layers=c.layers, block_size=16, row_bytes=c.fmt.row_bytes,
            max_model_len=c.max_tokens, hot_blocks_per_request=8, active_tail_pages=c.tail_pages))

    check(parse_bytes(fits))
    with pytest.raises(CapacityError):
        check(parse_bytes(fits) - 2 * 16 * 656 * 2)


def test_a_gpu_kv_budget_too_small_names_gpu_kv_and_a_size_that_works(capsys: pytest.CaptureFixture[str]) -> None:
    """It said `GPU KV budget of 1 B holds 0 blocks ...: raise --gpu-kv or lower --context`, the
    budget in bytes and no size that works; now the flag as given and the size that admits one request."""
    assert main([*TINY, "--gpu-kv", "1"]) == 2
    line = _err_line(capsys, "hisparse run")
    assert line.startswith("hisparse run: error: --gpu-kv 1 B holds 0 blocks of "), line
    assert "one admission of a 104-token request (--context 100 + --decode-tokens 4) needs " in line
    assert line.endswith(", or a shorter --context")
    fits = line.split("expected --gpu-kv >= ")[1].split(",")[0]
    assert main([*TINY, "--gpu-kv", fits, "--steps", "2"]) == 0
    capsys.readouterr()


def test_context_one_is_refused_by_the_parser_as_help_says(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["run", "--context", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --context: expected an integer in [2, 16777216], got 1" in err
    with pytest.raises(SystemExit), contextlib.redirect_stdout(io.StringIO()) as out:
        main(["run", "--help"])
    text = " ".join(out.getvalue().split())
    assert "prompt tokens per request (default: 16384; at most 16777216; accepted: [2, 16777216])" in text


def test_a_whole_shared_prompt_is_refused_by_the_parser_as_help_says(capsys: pytest.CaptureFixture[str]) -> None:
    """`--shared-prefix 1` passed the parser (help said [0, 1]) and then failed in the workload with
    `prefix groups must be >= 0, shared fraction in [0, 1), ...; got 4, 1.0, 1`, naming no flag."""
    with pytest.raises(SystemExit) as exc:
        main(["run", "--shared-prefix", "1"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "hisparse run: error: argument --shared-prefix: expected a number in [0, 1), got 1 (see hisparse run --help)"]
    with pytest.raises(SystemExit), contextlib.redirect_stdout(io.StringIO()) as out:
        main(["run", "--help"])
    assert "fraction of the prompt a family shares, in [0, 1) (default: 0.5)" in " ".join(out.getvalue().split())
    assert main([*TINY, "--shared-prefix", "0.99", "--steps", "2"]) == 0
    capsys.readouterr()


def test_a_gpu_kv_budget_too_large_names_a_value_that_fits(capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import hisparse_core.capacity as capacity

    monkeypatch.setattr(capacity, "available_host_bytes", lambda: 64 << 30)  # the same verdict on any machine
    assert main([*TINY, "--gpu-kv", "1TiB"]) == 2
    line = _err_line(capsys, "hisparse run")
    assert line.startswith("hisparse run: error: --gpu-kv 1.00 TiB (")
    assert "the backend runs on the CPU, so the KV pool is in host RAM" in line
    assert line.endswith("lower --gpu-kv to at most 60.79GiB")  # 95% of 64 GiB, rounded down


# ------------------------------------------------------------------------- what a run reports


def test_a_run_that_compared_nothing_does_not_report_a_pass(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json([*TINY, "--decode-tokens", "1", "--steps", "1", "--json"])
    s = doc["summary"]
    assert s["attention_entries_checked"] == 0 and s["passed"] is False and s["check"] == "nothing checked"
    assert main([*TINY, "--decode-tokens", "1", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "NOTHING CHECKED: 0 entries compared" in out and "byte-identical" not in out and "PASS" not in out


def _row(out: str, name: str) -> str:
    return next(line for line in out.splitlines() if line.strip().startswith(name))


def test_a_rate_of_no_lookup_is_not_reported_as_100_percent(capsys: pytest.CaptureFixture[str]) -> None:
    """A run that decoded nothing said `hit rate 100.00%` and `0.00 ms ... per decoding step`; bench
    said 100.00% where every entry was resident. Now both say no lookup (no decoding step) was made."""
    doc = _json([*TINY, "--decode-tokens", "1", "--steps", "1", "--json"])
    assert doc["summary"]["hot_lookups"] == 0 and doc["summary"]["decode_steps"] == 0
    assert main([*TINY, "--decode-tokens", "1", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert _row(out, "hit rate").split(None, 2)[2] == "n/a: no lookup went through the hot buffer (0 hits, 0 misses)"
    assert _row(out, "decode step").split(None, 2)[2] == "eager: no decoding step ran"
    looked = [*TINY, "--context", "700", "--decode-tokens", "8"]   # past the hot buffer: lookups
    assert main([*looked, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["hot_lookups"] > 0
    assert main(looked) == 0
    out = capsys.readouterr().out
    assert "n/a" not in _row(out, "hit rate") and "ms on the device per decoding step" in _row(out, "decode step")
    # bench: 1-token prompts stay resident, so no lookup reaches the hot buffer.
    assert main(["bench", "--backend", "reference_cpu", "--context", "1", "--steps", "2", "--top-k", "64",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    rates = [line.split(None, 4)[4] for line in out.splitlines() if line.strip().startswith("hit rate")]
    assert rates == ["n/a: no lookup went through the hot buffer (0 hits, 0 misses)"] * 2, out


def test_a_run_says_when_its_step_limit_left_requests_unfinished(capsys: pytest.CaptureFixture[str]) -> None:
    cut = _json([*TINY, "--steps", "3", "--json"])["summary"]
    assert cut["stopped_at_step_limit"] is True and cut["requests_unfinished"] == 3 - cut["requests_finished"] > 0
    assert main([*TINY, "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert f"{cut['requests_unfinished']} of 3 unfinished: the run stopped at its 3-step limit (raise --steps" in out
    done = _json([*TINY, "--json"])["summary"]
    assert done["stopped_at_step_limit"] is False and done["requests_unfinished"] == 0
    assert done["passed"] is True and done["check"] == "pass" and done["attention_entries_checked"] > 0


def test_the_planner_figure_says_what_bounds_it_and_why_measured_differs() -> None:
    from hisparse_core.cli.run_cmd import _planner_note

    # --preset large: the host pool holds 18 requests' KV, the GPU budget 49; 19 ran (shared prefixes).
    s = {"max_concurrency_hisparse_planned_gpu": 49, "max_concurrency_hisparse_planned_host": 18,
         "max_concurrency_hisparse_measured": 19, "max_concurrency_hisparse_planned": 18,
         "max_concurrency_planned_bound_by": "host pool", "gpu_limit_reached": True}
    note = _planner_note(s, "GPU")
    assert "bound by the host pool: --host holds the whole KV of 18 requests, the GPU budget alone would run 49" in note
    assert "measured above plan" in note and "prefix" in note
    s.update(max_concurrency_hisparse_planned_host=80, max_concurrency_hisparse_planned=49,
             max_concurrency_hisparse_measured=49, max_concurrency_planned_bound_by="GPU")
    assert _planner_note(s, "cpu device") == " (bound by the cpu device budget; the host pool holds 80)"


def test_a_concurrency_cap_is_named_as_what_bounds_the_measured_figure(capsys: pytest.CaptureFixture[str]) -> None:
    """`--concurrency 1` held the run to one request while the budget held more: the table said
    `1 measured (cpu device limit not reached: offer more requests or steps)`, advice that changes
    nothing (the cap binds), and no word of the cap."""
    assert main([*TINY, "--concurrency", "1"]) == 0
    row = _row(capsys.readouterr().out, "with hisparse")
    assert row.split(None, 2)[2].startswith("1 measured (held there by --concurrency 1); planner "), row
    assert "limit not reached" not in row


def test_run_planner_figure_is_the_smaller_of_gpu_and_host() -> None:
    s = _json([*TINY, "--steps", "2", "--host", "1MiB", "--json"])["summary"]
    assert s["max_concurrency_hisparse_planned"] == min(s["max_concurrency_hisparse_planned_gpu"],
                                                        s["max_concurrency_hisparse_planned_host"])


# ------------------------------------------------------------------------------ model names


@pytest.mark.parametrize(("alias", "name"), [("deepseek_v32", "deepseek-v3.2"), ("glm_moe_dsa", "glm-5.2")])
def test_plan_and_generate_take_one_set_of_model_names_and_the_other_as_aliases(alias: str, name: str) -> None:
    assert _json(["plan", "--model", alias, "--json"]) == _json(["plan", "--model", name, "--json"])
    parser = build_parser()
    assert parser.parse_args(["plan", "--model", alias]).model == name
    try:
        import hisparse_transformers.cli  # noqa: F401  (the generate command's plugin)
    except ImportError:
        return
    assert parser.parse_args(["generate", "--model", alias]).model == name
    assert parser.parse_args(["generate", "--model", name]).model == name


def test_generate_selects_and_logs_its_backend_once_in_one_short_line(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    import hisparse_transformers.demo as demo
    from hisparse_core.backend import Backend
    from hisparse_core.errors import HiSparseError

    given: list[object] = []

    def stop(config: object, progress: object = None, backend: object = None) -> None:
        given.append(backend)
        raise HiSparseError("stopped by the test")

    monkeypatch.setattr(demo, "run_demo", stop)
    caplog.set_level(logging.INFO)
    assert main(["generate", "--backend", "reference_cpu", "--no-progress"]) == 2
    assert len(given) == 1 and isinstance(given[0], Backend) and given[0].name == "reference_cpu"
    selected = [m for m in caplog.messages if "selected" in m or "hisparse generate: backend" in m]
    assert selected == ["hisparse generate: backend reference_cpu (explicit) on cpu; the engine's own log lines at "
                        "--log-level DEBUG"], caplog.messages
    assert all(len(m) < 200 for m in caplog.messages), caplog.messages


# ---------------------------------------------------------------------------- hisparse backends


def test_without_a_gpu_the_nvidia_backend_names_the_missing_gpu_not_a_pip_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import ctypes

    from hisparse_nvidia import plugin

    def no_driver(name: str, *args: object, **kwargs: object) -> None:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    reason = plugin.probe()
    assert reason is not None and reason.startswith("needs a CUDA GPU") and "pip" not in reason


def test_a_failed_check_under_json_is_a_json_document_with_passed_false(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from hisparse_core.replay import kvdata

    real = kvdata.ReferenceKV.write

    def skewed(self, layer, start, rows):  # type: ignore[no-untyped-def]
        real(self, layer, start, rows)
        if layer == 1 and start == 100:  # the first decode token of a 100-token prompt: always attended
            self.data[1, 100, 20] += 1

    monkeypatch.setattr(kvdata.ReferenceKV, "write", skewed)
    assert main([*TINY, "--json"]) == 1
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["passed"] is False and doc["check"] == "fail" and "position 100" in doc["error"]
    assert "FAILED" in captured.err


@pytest.mark.parametrize(("layers", "expected"), [("0", "--resident-layers [0] splits index group [0, 1]"),
                                                   ("0,1", "--resident-layers [0, 1] keeps all 2 layers resident")])
def test_a_run_config_refusal_names_the_flag(capsys: pytest.CaptureFixture[str], layers: str, expected: str) -> None:
    assert main([*TINY, "--resident-layers", layers]) == 2
    assert _err_line(capsys, "hisparse run").startswith(f"hisparse run: error: {expected}")


def test_resident_layers_that_take_the_whole_gpu_budget_name_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """Resident layers' pages above --gpu-kv gave "GPU KV memory must be > 0 ..., got -342130688":
    now the flags, the bytes and a budget that admits one request through hisparse, which works."""
    argv = [*TINY, "--layers", "4", "--index-share", "2", "--resident-layers", "0,1", "--steps", "1"]
    assert main([*argv, "--gpu-kv", "64KiB"]) == 2
    line = _err_line(capsys, "hisparse run")
    assert line.startswith("hisparse run: error: --gpu-kv 64.00 KiB is all taken by --resident-layers 0,1: their "
                           "pages for 3 requests of 104 tokens need "), line
    fits = line.split("expected --gpu-kv >= ")[1].split(" ")[0]
    # --concurrency 0 (the default) runs as many as the budget admits: "a lower --concurrency" than 0
    # named no value; the line says which values charge fewer requests' pages.
    assert line.endswith("(with one admission through hisparse), or --concurrency below 3 (0, the default, charges "
                         "their pages for all --requests), or fewer --resident-layers"), line
    assert main([*argv, "--gpu-kv", "64KiB", "--concurrency", "2"]) == 2
    assert _err_line(capsys, "hisparse run").endswith("or a lower --concurrency, or fewer --resident-layers")
    assert main([*argv, "--gpu-kv", fits]) == 0


# ------------------------------------------------------------------------------------ logging


def test_debug_shows_hisparse_lines_not_a_librarys(tmp_path: Path) -> None:
    """`plan --plot x.png --log-level DEBUG` printed some 2,000 lines of matplotlib's font search
    around the one line of hisparse's: below WARNING only hisparse's own loggers reach stderr."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("HISPARSE_")}
    target = tmp_path / "p.png"
    proc = subprocess.run([sys.executable, "-m", "hisparse_core", "--log-level", "DEBUG", "plan", "--plot",
                           str(target)], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines == [f"INFO hisparse_core.cli.plan_cmd: plot written to {target} (PNG)"], lines[:5]
    assert target.stat().st_size > 0


# ------------------------------------------------------------------------------------ hot buffer


def test_the_tables_say_the_hot_buffer_that_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """`--top-k 20 --hot 2` at 16-token blocks runs a 48-row buffer (2.4x top-k); the tables of run
    and bench said "hot 48 rows (2.0x)", the multiple asked for, beside the log's "(2.40x)"."""
    assert main([*TINY, "--top-k", "20", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "hot 48 rows (2.40x top-k; --hot 2 rounded up to whole 16-token blocks)" in out, out
    assert main(["bench", "--backend", "reference_cpu", "--requests", "1", "--context", "100", "--steps", "1",
                 "--top-k", "16", "--block-size", "16", "--no-progress"]) == 0
    assert "hot 32 rows (2.00x top-k)," in capsys.readouterr().out  # no rounding: nothing more said


def test_requests_never_admitted_are_counted_apart() -> None:
    """"1 admitted, 0 finished; 3 of 3 unfinished" read as if three had run: the line says how many
    of the unfinished were never admitted."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*TINY, "--arrival-every", "100", "--steps", "2"]) == 0
    line = next(x for x in out.getvalue().splitlines() if x.strip().startswith("requests "))
    assert line.split(None, 1)[1].strip() == ("1 admitted, 0 finished; 3 of 3 unfinished (2 never admitted): the run "
                                              "stopped at its 2-step limit (raise --steps to let them finish)"), line


def test_the_decode_mode_is_put_down_to_what_decided_it() -> None:
    """`hisparse run --eager` on reference_cpu logged `run eagerly (graphs turned off (--eager))`: the
    backend cannot capture a graph, so the flag decided nothing; the log now names the backend, and
    the flag beside it."""
    from types import SimpleNamespace

    import torch

    from hisparse_core.replay.decode import graph_choice

    cpu = SimpleNamespace(name="reference_cpu", capabilities=frozenset(), device=torch.device("cpu"))
    assert graph_choice(cpu, enabled=False, validate=False) == (  # type: ignore[arg-type]
        False, "backend 'reference_cpu' does not declare 'cuda_graph'; --eager asks the same")
    assert graph_choice(cpu, enabled=True, validate=True) == (  # type: ignore[arg-type]
        False, "backend 'reference_cpu' does not declare 'cuda_graph'")


# ------------------------------------------------------------------------------- counted nouns


@pytest.mark.parametrize(("argv", "one", "many"), [
    (["run", "--backend", "reference_cpu", "--context", "100", "--decode-tokens", "4", "--top-k", "16",
      "--block-size", "16", "--gpu-kv", "3MiB", "--host", "8MiB", "--no-progress"],
     ["--requests", "1", "--steps", "1", "--layers", "1", "--rows-per-request", "1"],
     ["--requests", "2", "--steps", "2", "--layers", "2", "--rows-per-request", "2"]),
    (["bench", "--backend", "reference_cpu", "--context", "256", "--top-k", "16", "--block-size", "16",
      "--warmup", "0", "--no-progress"],
     ["--requests", "1", "--steps", "1", "--layers", "1"], ["--requests", "2", "--steps", "2", "--layers", "2"]),
], ids=["run", "bench"])
def test_the_workload_line_counts_one_in_the_singular(argv: list[str], one: list[str], many: list[str],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The tables said "1 requests x 256 tokens", "1 layers", "1 decode row(s) per request"."""
    def workload(extra: list[str]) -> str:
        assert main([*argv, *extra]) == 0
        return next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("workload"))

    line = workload(one)
    assert "1 request " in line and "1 layer in" in line and "row(s)" not in line, line
    assert ("1 of 1 step," in line and "1 decode row per request" in line) if argv[0] == "run" else "1 step," in line
    line = workload(many)
    assert "2 requests " in line and "2 layers in" in line, line
    assert ("2 decode rows per request" in line) if argv[0] == "run" else "2 steps," in line
