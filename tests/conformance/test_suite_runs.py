"""The conformance suite runs, and passes, on the reference backend, the way a vendor runs it:
`pytest --pyargs hisparse_conformance --hisparse-backend NAME` from a directory outside the
repository. Also: the plugin stays passive in unrelated sessions, can be disabled, and its
capability gate skips with the reason when the suite is embedded with a narrower backend."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest


def _pytest(args: list[str], cwd: Path, *, timeout: float = 900,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("HISPARSE_", "PYTEST_"))}, **(env or {})}
    return subprocess.run([sys.executable, "-m", "pytest", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def _outcomes(report: Path) -> dict[str, list[tuple[str, str]]]:
    """testcase outcome -> [(test name, message)] from a junit xml report."""
    out: dict[str, list[tuple[str, str]]] = {"passed": [], "failed": [], "error": [], "skipped": []}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}.{case.get('name')}"
        children = {child.tag: child for child in case}
        for tag, outcome in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            if tag in children:
                out[outcome].append((name, children[tag].get("message", "")))
                break
        else:
            out["passed"].append((name, ""))
    return out


@pytest.mark.slow
def test_suite_passes_on_reference_cpu(tmp_path: Path) -> None:
    report = tmp_path / "report.xml"
    proc = _pytest(["--pyargs", "hisparse_conformance", "--hisparse-backend", "reference_cpu", "-q",
                    "-p", "no:cacheprovider", f"--junitxml={report}"], tmp_path)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert "hisparse backend: reference_cpu" in proc.stdout, tail  # the report header
    outcomes = _outcomes(report)
    assert not outcomes["failed"] and not outcomes["error"], tail
    # Every module of the suite contributed passing tests.
    modules = {name.rsplit(".", 2)[-2] for name, _ in outcomes["passed"]}
    for module in ("test_resolver", "test_gather", "test_host_pool", "test_transfers", "test_state", "test_rollback",
                   "test_validation"):
        assert module in modules, f"{module} passed no test: {sorted(modules)}"
    # reference_cpu declares every capability but cuda_graph, which no test needs; the only skip is
    # the check that a backend *without* shared pools refuses them.
    assert [name for name, _ in outcomes["skipped"]] == [
        "test_host_pool.test_shared_pool_needs_the_capability"], outcomes["skipped"]


@pytest.mark.parametrize("args, env, source", [
    (["--hisparse-backend", "no-such-backend"], {}, "--hisparse-backend"),
    ([], {"HISPARSE_BACKEND": "no-such-backend"}, "$HISPARSE_BACKEND"),
], ids=["option", "environment"])
def test_an_unknown_backend_fails_once_with_a_usage_error(tmp_path: Path, args: list[str], env: dict[str, str],
                                                          source: str) -> None:
    proc = _pytest(["--pyargs", "hisparse_conformance", *args, "-q", "-p", "no:cacheprovider"], tmp_path,
                   timeout=300, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 4, output[-3000:]  # pytest's usage error: nothing was collected or run
    errors = [line for line in output.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1 and errors[0].startswith(
        f"ERROR: hisparse conformance: {source} 'no-such-backend' cannot be selected: no hisparse backend named "
        "'no-such-backend'; available: reference_cpu (priority 0)"), output[-3000:]
    assert len(output.strip().splitlines()) <= 3 and "Traceback" not in output, output[-3000:]


def test_plugin_is_passive_in_unrelated_sessions(tmp_path: Path) -> None:
    """Loaded into every pytest session, it imports neither torch nor a backend there."""
    (tmp_path / "test_unrelated.py").write_text(textwrap.dedent("""
        import sys

        def test_nothing_heavy_was_imported(pytestconfig):
            assert pytestconfig.pluginmanager.has_plugin("hisparse")
            heavy = [m for m in ("torch", "hisparse_core.registry", "hisparse_reference_cpu") if m in sys.modules]
            assert not heavy, heavy
    """))
    proc = _pytest(["-q", "-p", "no:cacheprovider", "test_unrelated.py"], tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "hisparse backend:" not in proc.stdout


def test_plugin_can_be_disabled(tmp_path: Path) -> None:
    enabled = _pytest(["--help"], tmp_path, timeout=300)
    disabled = _pytest(["-p", "no:hisparse", "--help"], tmp_path, timeout=300)
    assert "--hisparse-backend" in enabled.stdout
    assert disabled.returncode == 0 and "--hisparse-backend" not in disabled.stdout


def test_embedded_suite_skips_what_the_backend_lacks(tmp_path: Path) -> None:
    """A vendor's own test tree imports suite modules and overrides `hisparse_backend`; tests
    needing an undeclared capability skip with its name."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent("""
        import pytest
        from hisparse_core.backend import Capability
        from hisparse_reference_cpu.backend import ReferenceCpuBackend

        class FewerCapabilities(ReferenceCpuBackend):
            capabilities = frozenset({Capability.FP8_DS_MLA})

        @pytest.fixture(scope="session")
        def hisparse_backend():
            return FewerCapabilities()
    """))
    (tmp_path / "test_embedded.py").write_text(
        "from hisparse_conformance.test_resolver import *  # noqa: F403\n")
    report = tmp_path / "report.xml"
    proc = _pytest(["-q", "-p", "no:cacheprovider", "-k", "by_hand", f"--junitxml={report}", "test_embedded.py"],
                   tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    outcomes = _outcomes(report)
    assert [name for name, _ in outcomes["skipped"]] == ["test_embedded.test_speculative_union_by_hand"]
    assert "speculative_union" in outcomes["skipped"][0][1]
    assert len(outcomes["passed"]) == 2
