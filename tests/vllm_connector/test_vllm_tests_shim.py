"""`scripts/vllm_tests_shim`, the stand-in `vllm` that runs vLLM's own HiSparse kernel tests
against a hisparse backend (docs/vllm.md, "vLLM's own kernel tests on any backend"), as a user
runs it: `PYTHONPATH=scripts/vllm_tests_shim ... python -m pytest FILE`, in a child process.

vLLM's test file is not in this repository; a probe test file imports the shim the way it does
(`from vllm.platforms import current_platform`) and calls one op.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed; run scripts/install_vllm_cpu.sh")

SHIM = Path(__file__).resolve().parents[2] / "scripts" / "vllm_tests_shim"
PROBE = '''
import torch
from vllm.platforms import current_platform

def test_the_ops_are_served():
    assert current_platform.device_type == "cpu"
    assert hasattr(torch.ops._C_cache_ops, "hisparse_resolve_residency")
'''


def _run(tmp_path: Path, **env: str) -> tuple[int, str]:
    (tmp_path / "test_probe.py").write_text(PROBE)
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("HISPARSE_", "PYTEST_"))}
    environ.update(env, PYTHONPATH=str(SHIM))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_probe.py"],
                          cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def test_the_cpu_command_runs_the_tests(tmp_path: Path) -> None:
    rc, out = _run(tmp_path, HISPARSE_BACKEND="reference_cpu", HISPARSE_SHIM_DEVICE="cpu")
    assert rc == 0 and "1 passed" in out, out[-3000:]


@pytest.mark.parametrize(("env", "line"), [
    ({"HISPARSE_BACKEND": "reference_cpu", "HISPARSE_SHIM_DEVICE": "gpu"},
     "HISPARSE_SHIM_DEVICE='gpu'; expected one of cuda, cpu"),
    ({"HISPARSE_BACKEND": "no-such-backend", "HISPARSE_SHIM_DEVICE": "cpu"},
     "HISPARSE_BACKEND='no-such-backend' cannot serve vLLM's HiSparse ops: no hisparse backend "
     "named 'no-such-backend'"),
    # `off` registered nothing: vLLM's 41 tests all skipped ("not compiled into this build"), exit
    # status 0; a bad mode was blamed on HISPARSE_BACKEND.
    ({"HISPARSE_BACKEND": "reference_cpu", "HISPARSE_SHIM_DEVICE": "cpu", "HISPARSE_VLLM_OPS": "off"},
     "HISPARSE_VLLM_OPS='off': the shim serves vLLM's HiSparse ops from HISPARSE_BACKEND; expected it unset, "
     "auto or replace"),
    ({"HISPARSE_BACKEND": "reference_cpu", "HISPARSE_SHIM_DEVICE": "cpu", "HISPARSE_VLLM_OPS": "bogus"},
     "HISPARSE_VLLM_OPS='bogus': the shim serves"),
])
def test_a_bad_setting_is_one_error_naming_it(tmp_path: Path, env: dict[str, str], line: str) -> None:
    """A bad setting is the probe's one collection error, its line naming the variable and the
    value, and no test runs (before: every test failed on its own, deep in torch or the shim)."""
    rc, out = _run(tmp_path, **env)
    assert rc == 2, out[-3000:]
    errors = [x for x in out.splitlines() if x.startswith("E   ")]
    assert len(errors) == 1 and errors[0].startswith(f"E   vllm.ShimSettingError: {line}"), out[-3000:]
    assert "During handling" not in out and "passed" not in out


def test_without_the_cpu_setting_on_a_machine_without_cuda_it_says_so(tmp_path: Path) -> None:
    """The command without `HISPARSE_SHIM_DEVICE=cpu` on a CPU: the tests would allocate on cuda
    (41 failures, "Torch not compiled with CUDA enabled"); one line names the setting instead."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: cuda is a valid default here")
    rc, out = _run(tmp_path, HISPARSE_BACKEND="reference_cpu")
    assert rc == 2, out[-3000:]
    errors = [x for x in out.splitlines() if x.startswith("E   ")]
    assert errors == [f"E   vllm.ShimSettingError: HISPARSE_SHIM_DEVICE is unset, so cuda, but torch "
                      f"{torch.__version__} sees no CUDA device here; on a CPU set HISPARSE_SHIM_DEVICE=cpu with "
                      "HISPARSE_BACKEND=reference_cpu (or triton under TRITON_INTERPRET=1)"], out[-3000:]


def test_a_backend_on_another_device_than_the_tests_is_one_error(tmp_path: Path) -> None:
    """docs/vllm.md sets `HISPARSE_SHIM_DEVICE=cpu` "only on a machine without a GPU": on a GPU
    machine, `HISPARSE_BACKEND=reference_cpu` registered the ops and vLLM's 41 tests each failed
    at their first op call ("tensors are on cuda:0; ... runs on cpu"). The shim compares the device
    the backend serves the ops on with the tests' and refuses once. A CUDA device is faked here."""
    (tmp_path / "conftest.py").write_text("import torch\ntorch.cuda.is_available = lambda: True\n")
    rc, out = _run(tmp_path, HISPARSE_BACKEND="reference_cpu")
    assert rc == 2, out[-3000:]
    errors = [x for x in out.splitlines() if x.startswith("E   ")]
    assert errors == ["E   vllm.ShimSettingError: HISPARSE_SHIM_DEVICE is unset, so cuda, but "
                      "HISPARSE_BACKEND='reference_cpu' serves the ops on cpu, so every test would fail; expected "
                      "HISPARSE_SHIM_DEVICE=cpu or a backend that runs on cuda"], out[-3000:]
