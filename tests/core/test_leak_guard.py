"""The session guard of tests/conftest.py fails a run that leaves a shared pool file or a
multiprocessing temporary folder behind, and removes what it found."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_the_guard_fails_a_run_that_leaks(tmp_path: Path) -> None:
    name = f"guard{os.getpid()}{uuid.uuid4().hex[:8]}"
    for support in ("conftest.py", "hypothesis_profiles.py"):  # the conftest imports the profiles
        shutil.copy(TESTS / support, tmp_path / support)
    (tmp_path / "test_leaks.py").write_text(textwrap.dedent(f"""
        import multiprocessing.util, os

        def test_a_child_dies_holding_a_published_pool_and_a_temporary_folder():
            pid = os.fork()
            if pid == 0:
                from hisparse_core.host_pool import HostPoolSpec
                from hisparse_reference_cpu.host_pool import ReferenceHostPool
                pool = ReferenceHostPool(HostPoolSpec(num_layers=1, num_blocks=1, block_size=1, shared=True,
                                                      name="{name}", world_size=2))
                multiprocessing.util.get_temp_dir()
                os._exit(0)  # no finalizers: both stay behind
            os.waitpid(pid, 0)
            assert os.path.exists("/dev/shm/hisparse_{name}.pool")
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HISPARSE_", "PYTEST_"))}
    env["TMPDIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_leaks.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "1 passed, 1 error" in proc.stdout, proc.stdout[-3000:]
    assert f"the test run left behind (now removed): /dev/shm/hisparse_{name}.pool (a shared pool file of pid" in \
        proc.stdout, proc.stdout[-3000:]
    assert f"{tmp_path}/pymp-" in proc.stdout and "(a multiprocessing temporary folder)" in proc.stdout
    assert not os.path.exists(f"/dev/shm/hisparse_{name}.pool") and not list(tmp_path.glob("pymp-*"))
