"""The conformance suite passes on the triton backend in Triton's interpreter, run the way a vendor
runs it (docs/backends.md): `TRITON_INTERPRET=1 pytest --pyargs hisparse_conformance --hisparse-backend triton`
from a directory outside the repository, in a child process so that the interpreter setting stays
out of this session. Few hypothesis examples per property test keep it within CI's budget; the
hand-checked and fixed-geometry tests run whole.

Skipped when triton is not installed; with a GPU the suite runs compiled instead (the same command
without `TRITON_INTERPRET`), which this CPU test leaves to the GPU runs.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from pytest_child import junit_outcomes, run_pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

#: Hypothesis examples per property test of the suite (its defaults are 5-30 per test).
EXAMPLES = 5


@pytest.mark.slow
def test_suite_passes_interpreted(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the suite runs compiled there (scripts/gpu_validate.sh triton_conformance)")
    report = tmp_path / "report.xml"
    proc = run_pytest(["--pyargs", "hisparse_conformance", "--hisparse-backend", "triton", "--hisparse-examples",
                       str(EXAMPLES), "-q", "-p", "no:cacheprovider", f"--junitxml={report}"],
                      tmp_path, timeout=1800, env={"TRITON_INTERPRET": "1"})
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert "hisparse backend: triton" in proc.stdout, tail
    outcomes = junit_outcomes(report)
    assert not outcomes["failed"] and not outcomes["error"], tail
    modules = {name.split(".", 1)[0] for name, _ in outcomes["passed"]}
    for module in ("test_resolver", "test_gather", "test_host_pool", "test_transfers", "test_state", "test_rollback",
                   "test_validation", "test_declaration"):
        assert module in modules, f"{module} passed no test: {sorted(modules)}"
    # triton declares shared pools, so the check that a backend *without* them refuses them skips.
    skipped = outcomes["skipped"]
    assert ("test_host_pool.test_shared_pool_needs_the_capability", "backend declares shared_host_pool") in skipped, \
        skipped
    assert len(skipped) == 1, skipped  # nothing else skips: vllm_ops is declared and served
    assert "test_vllm_ops" in modules, f"test_vllm_ops passed no test: {sorted(modules)}"
