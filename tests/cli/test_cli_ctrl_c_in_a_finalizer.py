"""Ctrl-C that Python delivers inside a finalizer (a weakref callback or `__del__`, where a
KeyboardInterrupt cannot propagate) still ends the command: `interrupted at step N`, exit status
130, no "Exception ignored in" traceback. Before, Python swallowed it there (an import's
module-lock callback during `hisparse generate`, seen on a real Ctrl-C), printed the traceback, and
the run went on to its full report and exit status 0."""

from __future__ import annotations

import signal
import sys

import pytest

from hisparse_core import cli

BENCH = ["bench", "--requests", "1", "--context", "64", "--top-k", "8", "--steps", "4", "--warmup", "0",
         "--layers", "1", "--block-size", "16", "--no-progress", "--backend", "reference_cpu"]


class _CtrlCWhenCollected:
    def __del__(self) -> None:
        signal.raise_signal(signal.SIGINT)   # Python's handler raises KeyboardInterrupt here, in __del__


def _ctrl_c_in_a_finalizer() -> None:
    _CtrlCWhenCollected()   # collected at once: the interrupt lands in its __del__


@pytest.fixture
def default_sigint() -> object:
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_swallowed_in_a_finalizer_ends_bench_at_the_next_step(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], default_sigint: object) -> None:
    from hisparse_core.replay import bench

    real = bench.run_bench

    def run_bench(config: object, backend: object, *, on_step: object, **kw: object) -> object:
        def step(i: int, sample: object) -> None:
            if i == 0:
                _ctrl_c_in_a_finalizer()
            on_step(i, sample)  # type: ignore[operator]
        return real(config, backend, on_step=step, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(bench, "run_bench", run_bench)
    assert cli.main(BENCH) == 130
    out, err = capsys.readouterr()
    assert "hisparse bench: interrupted at step 1 of 4" in err, err
    assert "Exception ignored" not in err and "Traceback" not in err, err
    assert out == "", out    # no report of a run that was interrupted
    assert err.count("interrupted") == 1, err


def test_a_ctrl_c_swallowed_after_the_last_step_still_exits_130(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], default_sigint: object) -> None:
    from hisparse_core.cli import plan_cmd

    real = plan_cmd.run

    def run(args: object) -> int:
        status = real(args)  # type: ignore[arg-type]
        _ctrl_c_in_a_finalizer()
        return int(status)

    monkeypatch.setattr(plan_cmd, "run", run)
    monkeypatch.setattr(sys, "argv", ["hisparse"])
    assert cli.main(["plan", "--context", "100"]) == 130
    err = capsys.readouterr().err
    assert "hisparse plan: interrupted" in err and "Exception ignored" not in err, err


def test_outside_a_command_a_swallowed_interrupt_is_left_to_python(default_sigint: object) -> None:
    """The hook is the command's only: after it, Python's own hook (and pytest's) is back, and
    nothing is pending."""
    from hisparse_core.progress import ProgressBar, interrupts_kept

    before = sys.unraisablehook
    with interrupts_kept():
        assert sys.unraisablehook is not before
    assert sys.unraisablehook is before
    ProgressBar(2, "x", enabled=False).update(1)   # nothing pending: no raise
