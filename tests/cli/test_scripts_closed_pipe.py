"""The documented CPU scripts stop quietly when their reader leaves (`... | head -1`), as `hisparse`
does: no BrokenPipeError traceback, exit 141."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv", [
    ["-m", "hisparse_core.replay.calibrate_locality", "--top-k", "16", "--steps", "50", "--requests", "1"],
    [str(ROOT / "bench" / "bench_locality.py"), "--no-replay", "--top-k", "16", "--steps", "50"],
], ids=["calibrate_locality", "bench_locality"])
def test_a_reader_that_leaves_ends_the_script_quietly(argv: list[str]) -> None:
    """With PYTHONUNBUFFERED=1 (each print a write), `calibrate_locality | head -1` and
    `bench_locality.py | head -1` ended in a BrokenPipeError traceback, exit 1."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HISPARSE_")} | {"PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            cwd=ROOT)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline()
    proc.stdout.close()  # the reader leaves after one line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


#: Runs the script given as its first argument as `python SCRIPT ...` does, holding it for a minute
#: after its first printed line: the test's Ctrl-C lands there, mid-run, however fast the machine
#: (on an idle one the script could finish before the signal came, exit 0).
_HELD_AFTER_ITS_FIRST_LINE = """
import builtins, runpy, sys, time
sys.argv = sys.argv[1:]
real, printed = builtins.print, []
def held(*args, **kwargs):
    real(*args, **kwargs)
    printed.append(1)
    if len(printed) == 1:
        time.sleep(60)
builtins.print = held
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_ctrl_c_ends_the_script_in_one_line() -> None:
    """Ctrl-C during `bench_locality.py` ended in a KeyboardInterrupt traceback from wherever numpy was."""
    import signal

    env = {k: v for k, v in os.environ.items() if not k.startswith("HISPARSE_")} | {"PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _HELD_AFTER_ITS_FIRST_LINE, str(ROOT / "bench" / "bench_locality.py"),
                             "--no-replay"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout is not None
    assert proc.stdout.readline()  # under way
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.decode().splitlines() == ["bench_locality: interrupted"]
