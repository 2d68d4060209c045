"""Running pytest in a child process the way a vendor runs the conformance suite, and reading the
junit report it writes (tests of the suite itself: tests/conformance, tests/triton_backend)."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from hypothesis_profiles import selected as selected_profile


def run_pytest(args: list[str], cwd: Path, *, timeout: float = 900,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m pytest ARGS` in `cwd`, with this session's HISPARSE_* and PYTEST_* settings left
    out (the child chooses its own backend) and `env` added. Under the derandomized `ci` profile
    the child runs hypothesis's own `ci` profile (derandomized too): it loads no conftest of ours."""
    child = {**{k: v for k, v in os.environ.items() if not k.startswith(("HISPARSE_", "PYTEST_"))}, **(env or {})}
    profile = ["--hypothesis-profile=ci"] if selected_profile() == "ci" else []
    return subprocess.run([sys.executable, "-m", "pytest", *profile, *args], cwd=cwd, env=child, capture_output=True,
                          text=True, timeout=timeout, check=False)


def junit_outcomes(report: Path) -> dict[str, list[tuple[str, str]]]:
    """testcase outcome (passed, failed, error, skipped) -> [("module.test", message)] from a junit
    xml report; the module is the last part of the test's class name."""
    out: dict[str, list[tuple[str, str]]] = {"passed": [], "failed": [], "error": [], "skipped": []}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}.{case.get('name')}"
        children = {child.tag: child for child in case}
        for tag, outcome in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            if tag in children:
                out[outcome].append((name, children[tag].get("message", "")))
                break
        else:
            out["passed"].append((name, ""))
    return out
