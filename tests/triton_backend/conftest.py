"""Starts the AMD/sm_90 compile check (`hisparse_triton.compile_targets`, several minutes of CPU)
as soon as collection ends, in a child process beside the rest of the run, so that
test_compile_targets.py's fixture finds it done or nearly done instead of compiling while
every other test waits. Nothing starts when that file's tests are not selected.

The child takes half the CPUs, and this process's torch keeps to the other half for the rest of
the session (`torch.set_num_threads`; its default is one thread a CPU): on 2 cores, torch's two
threads beside the child ran the in-process torch tests about 2x slower than one thread did
(tests/cli/test_generate_cmd.py's exactness runs: 14.5 s against 6.7 s, the second core busy;
test_generate_cmd.py, tests/transformers_plugin and test_compile_targets.py together, back to back on
2 cores shared with another job: 703 s against 380 s, of which 169 s waiting for the child).
The whole session, not only while the child runs, so that every test computes under one setting."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
CHILD = pytest.StashKey["CompileChild"]()


class CompileChild:
    """The running `compile_targets` child: its process, its JSON report and its log."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="hisparse-compile-targets-"))
        self.report = self.folder / "builds.json"
        self.log = self.folder / "log.txt"
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTEST_ADDOPTS")}
        env["TRITON_CACHE_DIR"] = str(self.folder / "triton_cache")
        env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset; the kernels do integer work
        # Half the CPUs: the rest of the test run keeps the other half.
        cpus = len(os.sched_getaffinity(0))
        jobs = max(1, cpus // 2)
        import torch

        torch.set_num_threads(max(1, cpus - jobs))
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hisparse_triton.compile_targets", "--jobs", str(jobs), "--json", str(self.report)],
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)  # its own process group: a kill takes its compile workers too

    def wait(self, timeout: float) -> tuple[int, str]:
        """The child's exit status and the tail of its log, once it has exited (killed past `timeout`)."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill()
            rc = self.proc.wait()
        return rc, self.log.read_text()[-3000:]

    def _kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        if self.proc.poll() is None:
            self._kill()
            self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture(scope="module")
def builds(request: pytest.FixtureRequest) -> list[dict]:
    """Every build the child reported (`compile_targets.Build` as dicts), once it has exited 0."""
    child = request.config.stash.get(CHILD, None)
    if child is None:  # selected after collection (by a plugin): start it now
        child = request.config.stash[CHILD] = CompileChild()
    rc, tail = child.wait(timeout=900)
    assert child.report.exists(), f"compile_targets exited {rc} without a report:\n{tail}"
    assert rc == 0, f"compile_targets exited {rc}:\n{tail}"
    return json.loads(child.report.read_text())


def pytest_collection_finish(session: pytest.Session) -> None:
    if importlib.util.find_spec("triton") is None:
        return
    if any(item.nodeid.startswith("tests/triton_backend/test_compile_targets.py") for item in session.items):
        session.config.stash[CHILD] = CompileChild()


def pytest_unconfigure(config: pytest.Config) -> None:
    child = config.stash.get(CHILD, None)
    if child is not None:
        child.close()
