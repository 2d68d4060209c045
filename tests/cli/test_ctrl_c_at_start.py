"""Ctrl-C in the first moments of `hisparse`, while the launcher still imports the CLI or the CLI
imports its commands, ends as Ctrl-C later in a run does: one line, exit status 130, no traceback.

Deterministic: a `-c` wrapper runs the console script's own body (the entry point pyproject.toml
declares, imported and called) with an import finder that holds the process, after one line on stdout,
when the named module is first imported; the test's SIGINT lands there, mid-import, on any machine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

#: argv[1]: the module whose import is held; the rest: the command line of `hisparse`.
_HELD_WHILE_IMPORTING = """
import sys, time
held, sys.argv = sys.argv[1], ["hisparse", *sys.argv[2:]]
class Hold:
    def find_spec(self, name, path=None, target=None):
        if name == held:
            print("held", flush=True)
            time.sleep(60)
        return None
sys.meta_path.insert(0, Hold())
from {module} import {func}
sys.exit({func}())
"""

#: The console script's entry point, as pyproject.toml declares it (what pip's generated script imports).
_ENTRY = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["scripts"]["hisparse"]


@pytest.mark.parametrize(("module", "argv"), [
    ("hisparse_core.cli.options", ["backends"]),           # the launcher's import of the CLI
    ("hisparse_core.cli.plugin_commands", ["--version"]),
    ("hisparse_core.cli.plan_cmd", ["plan", "--help"]),    # main() importing the commands
])
def test_ctrl_c_while_importing_ends_in_one_line(module: str, argv: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HISPARSE_")}
    # SIGINT at its default in the child (a runner in the background ignores it).
    entry_module, entry_func = _ENTRY.split(":")
    body = _HELD_WHILE_IMPORTING.format(module=entry_module, func=entry_func)
    proc = subprocess.Popen([sys.executable, "-c", body, module, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "held\n"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert err.splitlines() == ["hisparse: interrupted"] and out == "", err
