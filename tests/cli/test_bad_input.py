"""Bad input on the command line: one clean line naming the flag and the accepted range, exit 2,
no traceback; a closed pipe, Ctrl-C and `--plot` problems handled as a user expects.

The battery covers every bounded option of every sub-command (found by walking the parser, so
a new option is covered, and a numeric option without bounds fails `test_every_numeric_option_is_bounded`).
Its values fail in argparse, before any command code runs, so the whole battery takes about a second.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hisparse_core.cli import build_parser, main, options

COMMANDS = ("run", "bench", "plan", "generate")

#: Every class of bad number: infinities, not-a-number, overflow, huge, huge integer, negatives, junk.
BAD_NUMBERS = ("inf", "-inf", "nan", "1e400", "1e30", "1e12", "1000000000000", "-1", "-1e12", "abc", "")
#: The same classes for sizes, where 1e12 bytes (931 GiB) is a plausible host budget: 1e12 PiB instead.
BAD_SIZES = ("inf", "nan", "1e400", "1e30", "1e12PiB", "1000000000000TiB", "-1", "-1e12", "abc", "12XB", "")


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _bounded_options() -> list[tuple[str, str, str]]:
    """(command, flag, kind) for every option whose type is one of cli.options' bounded types."""
    out = []
    for cmd, parser in _subparsers().items():
        if cmd not in COMMANDS:
            continue
        for action in parser._actions:
            if action.option_strings and hasattr(action.type, "accepted"):
                out.append((cmd, action.option_strings[-1], action.type.__name__))
    return out


OPTIONS = _bounded_options()
CASES = [(cmd, flag, value) for cmd, flag, kind in OPTIONS
         for value in (BAD_SIZES if kind == "size" else BAD_NUMBERS)]


def test_every_numeric_option_is_bounded() -> None:
    """No option of any sub-command parses with a bare int or float: each names its range."""
    for cmd, parser in _subparsers().items():
        for action in parser._actions:
            assert action.type not in (int, float), f"hisparse {cmd} {action.option_strings}: unbounded type"
    covered = {(cmd, flag) for cmd, flag, _ in OPTIONS}
    for needed in [("run", "--host"), ("run", "--gpu-kv"), ("run", "--hot"), ("run", "--layers"),
                   ("run", "--requests"), ("run", "--context"), ("run", "--steps"), ("run", "--block-size"),
                   ("run", "--seed"), ("run", "--arrival-every"), ("run", "--locality"), ("bench", "--tail-pages"),
                   ("bench", "--warmup"), ("plan", "--pcie-gbps"), ("plan", "--miss-rate"),
                   ("generate", "--host-pool-gib"), ("generate", "--host"), ("generate", "--gpu-kv"),
                   ("generate", "--gpu-kv-pages")]:
        assert needed in covered


@pytest.mark.parametrize(("cmd", "flag", "value"), CASES, ids=[f"{c} {f}={v}" for c, f, v in CASES])
def test_bad_value_gives_one_line(cmd: str, flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([cmd, f"{flag}={value}"])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"hisparse {cmd}: error: argument {flag}")
    assert "Traceback" not in captured.err
    option = next(a for a in _subparsers()[cmd]._actions if flag in a.option_strings)
    assert option.type.accepted in lines[0]


@pytest.mark.parametrize(("argv", "needle"), [
    (["bench", "--steps", "10", "--warmup", "10"], "--warmup: expected an integer in [0, --steps - 1 = 9], got 10"),
    (["generate", "--min-prompt", "300", "--max-prompt", "200"], "--min-prompt 300 is above --max-prompt 200"),
    (["generate", "--shared-prefix", "250", "--min-prompt", "200"], "--shared-prefix 250 is above --min-prompt"),
    (["plan", "--sweep", ",,"], "argument --sweep: expected comma-separated token counts"),
    (["plan", "--sweep", "8K,x"], "argument --sweep: expected token counts in [1, 16777216]"),
    (["plan", "--sweep", "1e12"], "argument --sweep"),
    (["plan", "--top-k", "2048", "--hot", "32"], "--top-k 2048 with --hot 32 makes a hot buffer of 65536 rows per "
                                                 "request, over the 32768-row limit of a runtime"),
    (["plan", "--sweep", "8K,32K,8192"], "argument --sweep: expected distinct token counts, got 8192 twice ('8192') "
                                         "in '8K,32K,8192'"),
])
def test_combinations_name_the_flags(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code  # type: ignore[assignment]
    assert rc == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and needle in err, err


def test_sweep_accepts_token_suffixes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--sweep", "8K,32k,1M"]) == 0
    grid = capsys.readouterr().out
    for ctx in ("8192", "32768", "1048576"):
        assert re.search(rf"^\s*{ctx}\s", grid, re.M)


@pytest.mark.parametrize("how", ["flag", "env"])
def test_bad_log_level_is_one_line(how: str, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    if how == "flag":
        rc = main(["--log-level", "bogus", "backends"])
    else:
        monkeypatch.setenv("HISPARSE_LOG_LEVEL", "bogus")
        rc = main(["backends"])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    source = "--log-level" if how == "flag" else "$HISPARSE_LOG_LEVEL"
    assert captured.err.splitlines() == [f"hisparse: error: {source} 'bogus' is not a logging level; expected one "
                                         "of DEBUG, INFO, WARNING, ERROR, CRITICAL"]


def test_log_level_is_case_blind(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HISPARSE_LOG_LEVEL", "warning")
    assert main(["backends"]) == 0


@pytest.mark.parametrize("value", ["", " "])
def test_empty_log_level_variable_is_unset(value: str, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`HISPARSE_LOG_LEVEL= hisparse backends` was `$HISPARSE_LOG_LEVEL '' is not a logging level`,
    exit 2, where an empty HISPARSE_BACKEND means automatic selection."""
    monkeypatch.setenv("HISPARSE_LOG_LEVEL", value)
    assert main(["backends"]) == 0
    assert "is not a logging level" not in capsys.readouterr().err


def test_empty_log_level_flag_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--log-level", "", "backends"]) == 2
    assert capsys.readouterr().err.splitlines() == ["hisparse: error: --log-level '' is not a logging level; "
                                                    "expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HISPARSE_")}
    env.update(extra)
    return env


@pytest.mark.parametrize("argv", [["plan", "--sweep", ",".join(str(n) for n in range(1, 5001))],
                                  ["run", "--help"]])
def test_closed_pipe_is_quiet(argv: list[str]) -> None:
    """`hisparse ... | head -1`: the first line arrives and nothing is said about the closed pipe.
    The sweep's grid (about 200 KB) outgrows the pipe's buffer, so the writer meets the closed end."""
    writer = subprocess.Popen([sys.executable, "-m", "hisparse_core", *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=_env())
    head = subprocess.Popen(["head", "-1"], stdin=writer.stdout, stdout=subprocess.PIPE)
    assert writer.stdout is not None and writer.stderr is not None
    writer.stdout.close()
    first, _ = head.communicate(timeout=120)
    err = writer.stderr.read().decode()
    writer.wait(timeout=120)
    assert first.strip()
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err
    assert writer.returncode in (0, 141)  # 0 when the output fit the pipe before head closed it


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("unbuffered", ["", "1"])
@pytest.mark.parametrize(("argv", "prog"), [(["plan", "--json"], "hisparse plan"),
                                            (["backends", "--json"], "hisparse backends"),
                                            (["--version"], "hisparse")])
def test_a_full_disk_under_stdout_is_one_line(argv: list[str], prog: str, unbuffered: str) -> None:
    """`hisparse plan --json > out.json` on a full disk ended in the traceback of the print (or of
    the last flush) that met it, OSError: [Errno 28]: one line naming the command, exit status 1."""
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "hisparse_core", *argv], stdout=full, stderr=subprocess.PIPE,
                              text=True, env=_env(PYTHONUNBUFFERED=unbuffered), timeout=120, check=False)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines() == [f"{prog}: error: cannot write the output to stdout: No space left on device"]


#: A run that lasts for minutes unless interrupted: two small requests decoding 5000 tokens.
ENDLESS_RUN = ["run", "--backend", "reference_cpu", "--requests", "2", "--context", "64", "--decode-tokens",
               "5000", "--steps", "5000", "--top-k", "16", "--block-size", "16", "--layers", "1",
               "--index-share", "1", "--prefix-groups", "0", "--gpu-kv", "64MiB", "--host", "256MiB"]


def _interrupt_after_first_progress_line(argv: list[str], label: str) -> tuple[int, list[str]]:
    # SIGINT back to its default in the child: a runner started in the background (`cmd &` in a
    # script) ignores SIGINT, and Python then never raises KeyboardInterrupt.
    proc = subprocess.Popen([sys.executable, "-m", "hisparse_core", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stderr is not None
    seen = []
    try:
        for line in proc.stderr:
            seen.append(line.rstrip("\n"))
            if line.startswith(f"{label} ["):
                proc.send_signal(signal.SIGINT)
                break
        else:
            pytest.fail(f"no progress line before exit: {seen}")
        rest, _ = proc.communicate(timeout=120)[1], None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, seen + (rest or "").splitlines()


def test_ctrl_c_during_run_says_where(tmp_path: Path) -> None:
    rc, err = _interrupt_after_first_progress_line(ENDLESS_RUN, "run")
    assert rc == 130, err
    assert re.fullmatch(r"hisparse run: interrupted at step \d+ of \d+", err[-1]), err
    assert not any("Traceback" in line or "KeyboardInterrupt" in line for line in err), err


def test_ctrl_c_in_the_middle_of_a_transfer_is_an_interrupt(capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while the engine copies a step's pages (it has taken the transfers, the worker has not
    recorded them yet) is still `interrupted at step N`, exit 130: the worker's shutdown drained
    ids it never saw submitted and said `error: ... transfer 0 enqueued, but it was never
    submitted`, exit 2, hiding the interrupt (seen with `timeout -s INT 9 hisparse run ...`)."""
    from hisparse_reference_cpu.transfer import ReferenceTransferEngine

    take = ReferenceTransferEngine.submit_pages

    def interrupted(self: ReferenceTransferEngine, transfers: object) -> None:
        take(self, transfers)  # type: ignore[arg-type]
        raise KeyboardInterrupt

    monkeypatch.setattr(ReferenceTransferEngine, "submit_pages", interrupted)
    assert main(SMALL_RUN) == 130
    err = capsys.readouterr().err.splitlines()
    assert re.fullmatch(r"hisparse run: interrupted at step \d+ of \d+", err[-1]), err
    assert not any("error" in line for line in err), err


#: One Ctrl-C, raised where the import of numpy starts (a meta-path finder asked for it first).
_CTRL_C_IN_NUMPY = """
import sys

class CtrlC:
    fired = False

    def find_spec(self, name, path=None, target=None):
        if name == "numpy" and not CtrlC.fired:
            CtrlC.fired = True
            raise KeyboardInterrupt
        return None

sys.meta_path.insert(0, CtrlC())
from hisparse_core.cli.options import import_torch
try:
    import_torch("hisparse run")
except KeyboardInterrupt:
    print("interrupted")
else:
    print("went on")
"""


def test_ctrl_c_while_torch_imports_numpy_is_an_interrupt() -> None:
    """torch's C extension imports numpy and clears whatever that raises: a Ctrl-C there (`timeout -s
    INT 0.7 hisparse run`) was swallowed, and the run went on for its whole 40 s, exit 0, or ended
    in `AttributeError: module 'numpy' has no attribute 'multiply'` (a numpy half imported)."""
    proc = subprocess.run([sys.executable, "-c", _CTRL_C_IN_NUMPY], capture_output=True, text=True, timeout=120,
                          env=_env(), check=False)
    assert proc.stdout == "interrupted\n", proc.stdout + proc.stderr


def _installed(name: str) -> bool:
    """A real installed package (tests/ on sys.path makes folders look like namespace packages)."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin is not None


@pytest.mark.skipif(not _installed("transformers"), reason="needs transformers (the transformers extra)")
def test_ctrl_c_during_generate_says_where() -> None:
    rc, err = _interrupt_after_first_progress_line(["generate", "--backend", "reference_cpu"], "generate")
    assert rc == 130, err
    assert re.fullmatch(r"hisparse generate: interrupted at step \d+ of \d+", err[-1]), err


SMALL_RUN = ["run", "--backend", "reference_cpu", "--requests", "3", "--context", "100", "--decode-tokens", "4",
             "--steps", "8", "--top-k", "16", "--block-size", "16", "--layers", "1", "--index-share", "1",
             "--gpu-kv", "1MiB", "--host", "4MiB", "--no-progress"]


def test_plot_into_missing_folder_fails_before_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import hisparse_core.replay.run as replay_run

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the run started although --plot cannot be written")

    monkeypatch.setattr(replay_run, "run_replay", must_not_run)
    target = tmp_path / "missing" / "x.png"
    assert main([*SMALL_RUN, "--plot", str(target)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [f"hisparse run: error: --plot {str(target)!r}: the folder "
                                         f"{str(target.parent)!r} does not exist"]


@pytest.mark.parametrize("case", ["file as folder", "name too long", "unwritable folder"])
def test_plot_that_cannot_be_written_fails_before_the_run(case: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of these passed the check and failed after the whole run: a file where the folder
    should be was 'does not exist', a name over NAME_MAX and procfs (which os.access calls writable
    for root) were `the run finished (figures above) but --plot failed`."""
    import hisparse_core.replay.run as replay_run

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the run started although --plot cannot be written")

    monkeypatch.setattr(replay_run, "run_replay", must_not_run)
    (tmp_path / "f.png").write_text("")
    target, why = {
        "file as folder": (tmp_path / "f.png" / "x.png", f"the folder {str(tmp_path / 'f.png')!r} is not a folder"),
        "name too long": (tmp_path / ("a" * 300 + ".png"), "the file name is 304 bytes long; expected at most 255"),
        "unwritable folder": (Path("/proc/x.png"), "the folder '/proc' is not writable"),
    }[case]
    assert main([*SMALL_RUN, "--plot", str(target)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [f"hisparse run: error: --plot {str(target)!r}: {why}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.png"]  # the check left nothing


@pytest.mark.parametrize("cmd", ["run", "plan"])
def test_a_plot_name_ending_in_a_slash_fails_before_the_work(cmd: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """`--plot out/x.png/` passed the check (abspath drops the slash, and no such folder exists yet)
    and failed after the whole run: `--plot failed (figures above): [Errno 21] Is a directory`."""
    import hisparse_core.replay.run as replay_run

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the run started although --plot cannot be written")

    monkeypatch.setattr(replay_run, "run_replay", must_not_run)
    target = f"{tmp_path / 'x.png'}/"
    assert main([*(SMALL_RUN if cmd == "run" else ["plan"]), "--plot", target]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [f"hisparse {cmd}: error: --plot {target!r} ends with a '/', which names a "
                                         "folder; expected a file name such as plot.png"]
    assert not list(tmp_path.iterdir())


def test_plot_without_matplotlib_fails_before_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert main([*SMALL_RUN, "--plot", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--plot needs matplotlib" in err and "hisparse[plot]" in err


def test_a_failing_plot_keeps_the_finished_table(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    import hisparse_core.replay.plot as plot

    def disk_full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plot, "write_plot", disk_full)
    assert main([*SMALL_RUN, "--plot", str(tmp_path / "x.png")]) == 2
    captured = capsys.readouterr()
    assert "hisparse run" in captured.out and "hit rate" in captured.out
    assert "the run finished (figures above) but --plot failed" in captured.err


#: Runs `main(argv)` in a fresh interpreter; the last stderr line is the status and whether torch was imported.
_NO_TORCH_CHECK = """
import sys
from hisparse_core.cli import main
try:
    status = main({argv!r})
except SystemExit as exc:
    status = exc.code
print(status, "torch" in sys.modules, file=sys.stderr)
"""


@pytest.mark.parametrize(("argv", "needle"), [
    (["run", "--host", "1000TiB"], "hisparse run: error: --host 1000.00 TiB needs"),
    (["run", "--backend", "nosuch"], "hisparse run: error: --backend 'nosuch': no hisparse backend named 'nosuch'"),
    (["bench", "--backend", "nosuch"], "hisparse bench: error: --backend 'nosuch': no hisparse backend named"),
    (["generate", "--backend", "nosuch"], "hisparse generate: error: --backend 'nosuch': no hisparse backend"),
])
def test_bad_values_fail_before_torch_is_imported(argv: list[str], needle: str) -> None:
    """A budget over this machine's RAM and an unknown backend are told apart from the entry-point
    metadata and /proc/meminfo alone: a second, not the 20 s of importing torch first."""
    proc = subprocess.run([sys.executable, "-c", _NO_TORCH_CHECK.format(argv=[*argv, "--no-progress"])],
                          env=_env(), capture_output=True, text=True, timeout=120, check=False)
    *lines, last = proc.stderr.strip().splitlines()
    assert last == "2 False", proc.stderr
    assert len(lines) == 1 and lines[0].startswith(needle), proc.stderr
    if "--host" in argv:
        assert "lower --host to at most " in lines[0]


@pytest.mark.parametrize("cmd", ["run", "bench", "generate"])
def test_a_torch_that_raises_oserror_is_one_line(cmd: str, tmp_path: Path) -> None:
    """A broken torch install raises more than ImportError (a missing shared library is an
    OSError): one line naming torch, the error and the fix, no traceback."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text('raise OSError("libtorch_cpu.so: cannot open shared object file")\n')
    env = _env(PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "hisparse_core", cmd, "--no-progress"], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"hisparse {cmd}: error: torch cannot be imported (OSError: libtorch_cpu.so: cannot open shared "
                     f"object file): {options.TORCH_FIX}"], proc.stderr


NEGATIVE_LOOKING = ("-1", "-1GiB", "-1e12", "-inf", "-.5")


@pytest.mark.parametrize(("cmd", "flag"), [(c, f) for c, f, _ in OPTIONS], ids=[f"{c} {f}" for c, f, _ in OPTIONS])
def test_a_negative_looking_value_after_a_space_reports_the_range(cmd: str, flag: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """`--gpu-kv -1GiB` (with a space) is the option's value, checked against its range: stock
    argparse calls it an option and says "expected one argument"."""
    option = next(a for a in _subparsers()[cmd]._actions if flag in a.option_strings)
    for value in NEGATIVE_LOOKING:
        with pytest.raises(SystemExit) as exit_:
            main([cmd, flag, value])
        assert exit_.value.code == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"hisparse {cmd}: error: argument {flag}: expected"), lines
        assert option.type.accepted in lines[0]


def test_plan_tail_pages_range_is_the_one_it_accepts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--tail-pages", "0"])
    assert capsys.readouterr().err.startswith("hisparse plan: error: argument --tail-pages: expected an integer in "
                                              "[1, 16777216], got 0")
    assert main(["plan", "--tail-pages", "1", "--json"]) == 0


def test_a_warmup_past_the_steps_is_said_as_the_parser_says_a_range(capsys: pytest.CaptureFixture[str]) -> None:
    """The one range checked after parsing read as the parser's lines do, but without their
    `(see hisparse bench --help)`."""
    assert main(["bench", "--steps", "10", "--warmup", "10"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "hisparse bench: error: argument --warmup: expected an integer in [0, --steps - 1 = 9], got 10 "
        "(see hisparse bench --help)"]


@pytest.mark.parametrize(("argv", "needle", "not_said"), [
    # As run's refusals do, each names what would fit (the rest as given): not even one request of
    # 16777216 tokens does, so only --context; 384408 tokens (6007 pages of 64 with the 40 steps)
    # would, beside the 4 requests' device caches (both in host RAM: the backend runs on the CPU).
    (["bench", "--context", "16777216"], "lower --context to at most 384408", "host pool budget"),
    # (--top-k 65536 --hot 64 is now refused earlier: its hot buffer is over a runtime's row limit.)
    (["bench", "--requests", "65536", "--top-k", "16384"],
     "lower --requests to at most 31, or --top-k, --hot or --tail-pages", None),
    # Not one request's caches fit with 9999999 tail pages: the most that do with the rest as given.
    (["bench", "--tail-pages", "9999999"], "lower --tail-pages to at most 5752, or --top-k or --hot", None),
])
def test_bench_capacity_errors_name_bench_flags(argv: list[str], needle: str, not_said: str | None,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    import hisparse_core.capacity as capacity

    monkeypatch.setattr(capacity, "available_host_bytes", lambda: 4 << 30)  # the same verdict on any machine
    assert main([*argv, "--backend", "reference_cpu", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("hisparse bench: error: ") and err.endswith(needle), err
    assert not_said is None or not_said not in err


def test_a_cpu_run_checks_both_budgets_against_the_ram_together(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """On a CPU backend the KV pool (--gpu-kv) and the host pool (--host) are both host RAM: each
    was checked alone, so two budgets that each fit but not together were allocated (the OOM
    killer, on a real machine). Refused in one line before anything is allocated."""
    import hisparse_core.capacity as capacity

    monkeypatch.setattr(capacity, "available_host_bytes", lambda: 400 << 20)  # the same verdict on any machine
    argv = ["--gpu-kv", "300MiB", "--host", "300MiB", "--steps", "1"]
    assert main([*SMALL_RUN[:SMALL_RUN.index("--gpu-kv")], *argv, "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, lines
    assert re.fullmatch(
        r"hisparse run: error: --gpu-kv 300\.00 MiB and --host 300\.00 MiB together \(the backend runs on the CPU, so "
        r"the KV pool and the host pool are both in host RAM\) needs 599\.99 MiB \(629137920 B\) of host RAM; "
        r"400\.00 MiB is available( of [\d.]+ \w+ total)?, and at most 95% of it \(380\.00 MiB\) may be taken: lower "
        r"--gpu-kv or --host so that together they take at most 380\.00MiB", lines[0]), lines[0]


def test_a_cpu_bench_checks_its_caches_and_pool_against_the_ram_together(monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """bench's device caches and host pool, each under the RAM's limit, together over it."""
    import hisparse_core.capacity as capacity

    monkeypatch.setattr(capacity, "available_host_bytes", lambda: 64 << 20)
    # Device caches 4 x (64 hot + 3 tail) blocks and a host pool of 4 x 64 pages, of 4 layers x 64
    # rows x 656 B: each under 60.8 MiB, together 84.56 MiB.
    assert main(["bench", "--context", "4096", "--backend", "reference_cpu", "--no-progress"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(
        "hisparse bench: error: the device caches and the host pool together (the backend runs on the CPU, so both "
        "are in host RAM) needs 84.56 MiB (88670208 B) of host RAM; 64.00 MiB is available"), err
    assert err[0].endswith("lower --requests to at most 2, or --context to at most 1688, or --top-k, --hot or "
                           "--tail-pages")


class _Checked(Exception):
    """Raised where `run_bench` says its memory checks passed, before it allocates anything."""


def _bench_fits(**config: int) -> bool:
    from hisparse_core.errors import CapacityError
    from hisparse_core.registry import select_backend
    from hisparse_core.replay.bench import BenchConfig, run_bench

    def checked() -> None:
        raise _Checked

    try:
        run_bench(BenchConfig(**config), select_backend("reference_cpu"), on_checked=checked)
    except _Checked:
        return True
    except CapacityError:
        return False
    raise AssertionError("run_bench ran past its checks without calling on_checked")


@pytest.mark.parametrize(("config", "avail"), [
    ({"context": 16777216}, 4 << 30),
    ({"requests": 65536, "top_k": 16384}, 4 << 30),
    ({"context": 4096}, 64 << 20),
    ({"tail_pages": 9999999}, 4 << 30),
])
def test_what_a_bench_refusal_says_would_fit_does_and_no_more(config: dict[str, int], avail: int,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Each `--FLAG to at most N` of bench's memory refusals, given back with the rest as it was,
    passes all of bench's memory checks; N + 1 does not (the figure is the largest)."""
    import hisparse_core.capacity as capacity

    monkeypatch.setattr(capacity, "available_host_bytes", lambda: avail)
    argv = [a for k, v in config.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    assert main(["bench", *argv, "--backend", "reference_cpu", "--no-progress"]) == 2
    named = re.findall(r"--(requests|context|tail-pages) to at most (\d+)", capsys.readouterr().err)
    assert named
    for flag, value in ((f.replace("-", "_"), v) for f, v in named):
        assert _bench_fits(**(config | {flag: int(value)}))
        assert not _bench_fits(**(config | {flag: int(value) + 1}))


def test_log_level_after_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    """`hisparse run --log-level X` works as `hisparse --log-level X run` does."""
    assert main(["backends", "--log-level", "bogus"]) == 2
    assert capsys.readouterr().err.splitlines() == ["hisparse: error: --log-level 'bogus' is not a logging level; "
                                                    "expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL"]
    assert main(["--log-level", "bogus", "plan", "--json", "--log-level", "warning"]) == 0  # the later one stands


# ------------------------------------------------ refused before anything is said or selected


@pytest.mark.parametrize(("argv", "needle"), [
    (["run", "--host", "1"], "hisparse run: error: --host 1 B holds 0 usable host blocks"),
    (["run", "--gpu-kv", "1024TiB"], "hisparse run: error: --gpu-kv 1.00 PiB ("),
    (["run", "--gpu-kv", "1B"], "hisparse run: error: --gpu-kv 1 B holds 0 blocks"),
    (["run", "--hot", "64"], "hisparse run: error: --top-k 2048 with --hot 64 makes a hot buffer of 131072 rows"),
    (["bench", "--requests", "65536", "--context", "16777216"], "hisparse bench: error: device caches of "),
    (["bench", "--hot", "17"], "hisparse bench: error: --top-k 2048 with --hot 17 makes a hot buffer of 34816 rows"),
])
def test_a_refused_budget_is_the_only_line(argv: list[str], needle: str) -> None:
    """The registry's "backend 'X' selected" INFO line used to come first: the backend is selected
    (its device decides the memory checks) but the line waits until the checks pass."""
    proc = subprocess.run([sys.executable, "-m", "hisparse_core", *argv, "--no-progress"], env=_env(),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(needle), proc.stderr


def test_a_run_that_passes_its_checks_still_says_which_backend_first() -> None:
    """The held line is logged once the checks pass: before the coordinator's and worker's lines."""
    proc = subprocess.run([sys.executable, "-m", "hisparse_core", *SMALL_RUN], env=_env(), capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("INFO hisparse_core.registry: hisparse backend 'reference_cpu' selected (explicit)")
    assert sum("selected" in line for line in lines) == 1, proc.stderr


@pytest.mark.parametrize(("argv", "expected"), [
    (["--resident-layers", "7"], "expected layer indices in [0, 2) (--layers 2, the default), got 7"),
    (["--resident-layers", "0,7,9", "--layers", "4"],
     "expected layer indices in [0, 4) (--layers 4), got 0,7,9 (7, 9 are out of range)"),
    (["--resident-layers", "-1"], "expected layer indices in [0, 2) (--layers 2, the default), got -1"),
    (["--preset", "large", "--resident-layers", "4"],
     "expected layer indices in [0, 4) (--layers 4 of --preset large), got 4"),
    (["--resident-layers", "1,1", "--layers", "4"], "expected each layer once, got 1,1 (1 repeated)"),
])
def test_resident_layers_out_of_range_is_said_as_the_parser_says_it(argv: list[str], expected: str,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", *argv, "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [f"hisparse run: error: argument --resident-layers: {expected} "
                                         "(see hisparse run --help)"]


@pytest.mark.parametrize("value", ["", " ", ",,", "0,,1", "0,"])
def test_resident_layers_without_an_index_is_refused(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--resident-layers ""` (an unset variable) and empty items ran with no (or fewer) resident
    layers than named, silently."""
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--resident-layers", value, "--layers", "4", "--index-share", "1"])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == ["hisparse run: error: argument --resident-layers: expected comma-separated "
                                         f"layer indices, e.g. 0,1; got {value!r} (see hisparse run --help)"]


@pytest.mark.parametrize(("argv", "expected"), [
    (["--acceptance", "0.5"], "argument --acceptance: not allowed with --rows-per-request 1, the default: a step "
                              "has no speculative row to accept or reject; expected --rows-per-request >= 2, or no "
                              "--acceptance"),
    (["--preset", "large", "--rows-per-request", "1", "--acceptance", "0.9"],
     "argument --acceptance: not allowed with --rows-per-request 1: "),
    (["--topk-model", "code", "--locality", "5"],
     "argument --locality: not allowed with --topk-model code: the locality model draws the top-k, and --locality "
     "scales only the one-figure indexer; expected one of the two"),
    (["--prefix-groups", "0", "--shared-prefix", "0.25"],
     "argument --shared-prefix: not allowed with --prefix-groups 0: no family shares a prompt prefix; expected "
     "--prefix-groups >= 1, or no --shared-prefix"),
])
def test_a_flag_the_run_would_ignore_is_refused(argv: list[str], expected: str, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Each ran and reported the flag's value (`speculative ... (acceptance 0.5)`) although nothing
    used it: no speculative row, the locality model's own top-k, no family to share a prefix."""
    import hisparse_core.replay.run as replay_run

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the run started")

    monkeypatch.setattr(replay_run, "run_replay", must_not_run)
    assert main(["run", *argv, "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"hisparse run: error: {expected}"), lines
    assert lines[0].endswith(" (see hisparse run --help)")


def test_more_index_groups_than_the_locality_model_has_layers_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """`--topk-model code --layers 62 --index-share 1`: two index groups stand for one layer of the
    61-layer reference model. The run started and failed at the first admission with
    `error: layers must be ascending reference layers >= 0, got [0, 1, 2, ...]`, naming no flag."""
    import hisparse_core.replay.run as replay_run

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the run started")

    monkeypatch.setattr(replay_run, "run_replay", must_not_run)
    assert main(["run", "--topk-model", "code", "--layers", "62", "--index-share", "1", "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "hisparse run: error: --topk-model code stands each index group for a layer of the 61-layer reference model; "
        "--layers 62 in index groups of --index-share 1 makes 62 groups, and those of layers 30 and 31 stand for the "
        "same one (30): expected at most 61 index groups spread over it (fewer --layers or a larger --index-share)"]
    from hisparse_core.replay.engine import RunConfig

    RunConfig(topk_model="code", layers=61, index_share=1)  # one group a reference layer
    RunConfig(topk_model="benign", layers=122, index_share=2)


def test_the_flags_a_preset_gives_effect_are_accepted() -> None:
    """--acceptance with the large preset's 2 rows per request, --shared-prefix with its families."""
    from hisparse_core.cli.run_cmd import _unused_flag_problem

    parser = build_parser()
    for argv in (["--preset", "large", "--acceptance", "0.5"], ["--rows-per-request", "2", "--acceptance", "0.5"],
                 ["--shared-prefix", "0.25"], ["--topk-model", "benign"], ["--locality", "2"], ["--acceptance", "1"]):
        assert _unused_flag_problem(parser.parse_args(["run", *argv])) is None, argv


def test_the_top_k_the_hot_limit_names_is_accepted() -> None:
    from hisparse_core.errors import InvalidInputError
    from hisparse_core.geometry import MAX_HOT_ROWS
    from hisparse_core.replay.bench import BenchConfig
    from hisparse_core.replay.engine import RunConfig

    for hot, block in ((2.0, 64), (17.0, 64), (3.0, 16), (64.0, 64)):
        with pytest.raises(InvalidInputError, match="--top-k <= ") as exc:
            RunConfig(top_k=MAX_HOT_ROWS, hot_multiple=hot, block_size=block)
        largest = int(str(exc.value).rpartition("--top-k <= ")[2].rstrip(")"))
        RunConfig(top_k=largest, hot_multiple=hot, block_size=block)
        BenchConfig(top_k=largest, hot_multiple=hot, block_size=block)
        with pytest.raises(InvalidInputError):
            BenchConfig(top_k=largest + 1, hot_multiple=hot, block_size=block)


@pytest.mark.parametrize(("cuda", "device", "expected"), [
    (0, "cuda", "--device 'cuda': this torch has no CUDA; expected cpu"),
    (0, "cuda:0", "--device 'cuda:0': this torch has no CUDA; expected cpu"),
    (0, "nonsense", "--device 'nonsense' is not a torch device; expected cpu"),
    (0, "meta", "--device 'meta': hisparse generate runs on the CPU or a CUDA GPU only; expected cpu"),
    (0, "cpu:1", "--device 'cpu:1': the CPU has no device index 1; expected cpu"),
    (0, "cpu", None),
    (1, "cuda:1", "--device 'cuda:1': this machine has 1 CUDA device (cuda:0); expected cpu, cuda or cuda:0"),
    (1, "cuda", None),
    (2, "cuda:2", "--device 'cuda:2': this machine has 2 CUDA devices (cuda:0..cuda:1); expected cpu, cuda or "
                  "cuda:0..cuda:1"),
    (2, "cuda:1", None),
    (2, "meta", "--device 'meta': hisparse generate runs on the CPU or a CUDA GPU only; expected cpu, cuda or "
                "cuda:0..cuda:1"),
])
def test_torch_device_check(cuda: int, device: str, expected: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only devices a command runs on: the CPU, and CUDA devices that exist (counted by torch)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: cuda > 0)
    assert options.check_torch_device("--device", device, "hisparse generate") == expected


def test_a_cuda_torch_without_a_device_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    assert options.check_torch_device("--device", "cuda", "hisparse generate") == (
        "--device 'cuda': this torch has CUDA but sees no CUDA device; expected cpu")


@pytest.mark.parametrize(("lacking", "argv", "setting", "instead"), [
    ("index_sharing", ["--index-share", "2"], "--index-share 2 (layers sharing one top-k)", "--index-share 1"),
    ("speculative_union", ["--rows-per-request", "2"], "--rows-per-request 2", "--rows-per-request 1"),
    ("row_format:bf16_mla", ["--row-format", "bf16_mla"], "--row-format bf16_mla", "another --row-format"),
])
def test_a_setting_the_backend_lacks_is_refused_in_the_flags_words_before_any_work(
        lacking: str, argv: list[str], setting: str, instead: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`--backend X --index-share 2` with an X without index_sharing logged the coordinator's
    `HiSparse host pool: ...` INFO line, then the worker's refusal naming `num_layers=2`, no flag."""
    import hisparse_core.registry as registry
    import hisparse_core.replay.engine as engine
    from hisparse_reference_cpu.backend import ReferenceCpuBackend

    class Lacking(ReferenceCpuBackend):
        capabilities = ReferenceCpuBackend.capabilities - {lacking}

    def must_not_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("the coordinator was built before the refusal")

    monkeypatch.setattr(registry, "select_backend", lambda name=None: Lacking())
    monkeypatch.setattr(engine, "HiSparseCoordinator", must_not_build)
    assert main(["run", *argv, "--layers", "2", "--requests", "2", "--context", "256", "--top-k", "16",
                 "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"hisparse run: error: {setting} needs capability {lacking!r}, which backend "
                               "'reference_cpu' does not declare"), lines
    assert lines[0].endswith(f"expected {instead}, or a backend that declares it"), lines
