"""Out-of-tree backends, the way a vendor ships one: a separate distribution on the path.

Most tests write a throwaway distribution (package + `*.dist-info` with METADATA and
entry_points.txt) into tmp_path and run fresh Python processes with it on PYTHONPATH, so
discovery goes through `importlib.metadata` exactly as for a pip-installed package. The slow one
writes the `hisparse new-backend` scaffold, pip-installs it into a fresh venv and runs the
conformance suite on it, through the scaffold's own CI script.
"""

from __future__ import annotations

import importlib.util
import json
import os
import site
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from core_support import subprocess_env, write_dist
from hypothesis_profiles import selected as selected_profile

ACME_PRIORITY = 1000

ACME_PLUGIN = '''
"""Entry point of the Acme backend: registers it; imports nothing heavy."""

from hisparse_core import BackendSpec, hookimpl


def probe():
    return None


@hookimpl
def hisparse_register_backends(register):
    register(BackendSpec(
        name="acme",
        factory="hisparse_acme.backend:AcmeBackend",
        probe=probe,
        priority={priority},
        capabilities=frozenset({capabilities!r}),
        version="1.0",
        description="Acme accelerator (the reference backend under another name)",
    ))
'''

ACME_BACKEND = '''
"""The Acme backend: the reference CPU backend, renamed."""

from {module} import {cls} as _Reference


class AcmeBackend(_Reference):
    name = "acme"
    version = "1.0"
'''


def run_python(args: list[str], site: Path, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], env=subprocess_env(site), cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, check=False)


def list_json(site: Path, cwd: Path) -> tuple[dict[str, dict[str, Any]], str]:
    proc = run_python(["-m", "hisparse_core", "backends", "--json"], site, cwd)
    assert proc.returncode == 0, proc.stderr
    return {d["name"]: d for d in json.loads(proc.stdout)}, proc.stderr


SELECT = textwrap.dedent("""
    import logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
    from hisparse_core.registry import select_backend
    backend = select_backend()
    print(backend.name, type(backend).__module__, type(backend).__name__)
""")


@pytest.fixture
def acme_site(tmp_path: Path) -> Path:
    from hisparse_core.registry import get_registry

    reference = get_registry(reload=True).get("reference_cpu")
    assert reference.available and reference.factory, reference
    module, cls = reference.factory.split(":")
    site = tmp_path / "site"
    write_dist(site, "hisparse-acme", {
        "hisparse_acme/__init__.py": "",
        "hisparse_acme/plugin.py": ACME_PLUGIN.format(priority=ACME_PRIORITY,
                                                      capabilities=set(reference.capabilities)),
        "hisparse_acme/backend.py": ACME_BACKEND.format(module=module, cls=cls),
    }, {"acme": "hisparse_acme.plugin"})
    return site


def test_out_of_tree_backend_is_discovered_listed_and_auto_selected(acme_site: Path, tmp_path: Path) -> None:
    entries, _ = list_json(acme_site, tmp_path)
    acme = entries["acme"]
    assert acme["status"] == "available" and acme["selected"] is True
    assert acme["priority"] == ACME_PRIORITY and acme["version"] == "1.0"
    assert acme["distribution"] == "hisparse-acme" and acme["distribution_version"] == "1.0"
    assert acme["capabilities"] == entries["reference_cpu"]["capabilities"]
    assert entries["reference_cpu"]["status"] == "available" and entries["reference_cpu"]["selected"] is False

    proc = run_python(["-c", SELECT], acme_site, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["acme", "hisparse_acme.backend", "AcmeBackend"]
    assert "hisparse backend 'acme' selected (automatic: highest priority among [acme (1000), " \
        in proc.stderr


def test_console_script_lists_the_out_of_tree_backend(acme_site: Path, tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "hisparse"
    if not script.exists():
        pytest.skip(f"no console script next to {sys.executable}")
    proc = subprocess.run([str(script), "backends"], env=subprocess_env(acme_site), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()[1:] if line.strip()}
    assert rows["acme"][:4] == ["acme", "available", str(ACME_PRIORITY), "1.0"]
    assert proc.stdout.splitlines()[-1].startswith("selected: acme (automatic")


def test_hisparse_backend_variable_overrides_priority(acme_site: Path, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", SELECT], env=subprocess_env(acme_site, HISPARSE_BACKEND="reference_cpu"),
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == "reference_cpu"
    assert "selected (explicit: HISPARSE_BACKEND=reference_cpu)" in proc.stderr


def linked_venv(path: Path) -> Path:
    """A fresh virtual environment (no pip of its own) that sees this one's site-packages, so it
    "has hisparse" and pip, and installs go into its own site-packages; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    python = path / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    outer = [p for p in site.getsitepackages() if Path(p).is_dir()]
    Path(purelib, "_hisparse_outer.pth").write_text(f"import site; list(map(site.addsitedir, {outer!r}))\n")
    return python


#: Hypothesis examples per property test of the suite on the scaffold (its defaults are 5-30).
SCAFFOLD_EXAMPLES = 2


@pytest.mark.slow
def test_new_backend_scaffold_installs_and_passes_the_conformance_suite(tmp_path: Path) -> None:
    """`hisparse new-backend acme DIR`, then DIR's own CI script, unchanged: pip install -e into a
    venv that has hisparse, acme listed as available, and the conformance suite passing."""
    dist = tmp_path / "hisparse-acme"
    proc = run_python(["-m", "hisparse_core", "new-backend", "acme", str(dist)], tmp_path, tmp_path)
    assert proc.returncode == 0, proc.stderr
    python = linked_venv(tmp_path / "venv")
    # Offline, building with this environment's setuptools where it has one (everything else the
    # scaffold needs is installed); without setuptools pip builds in isolation from its index.
    offline = {"PIP_NO_INDEX": "1", "PIP_NO_BUILD_ISOLATION": "0"} if importlib.util.find_spec("setuptools") else {}
    env = subprocess_env(PATH=f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}",
                         PIP_DISABLE_PIP_VERSION_CHECK="1", **offline)
    # cwd outside the repository: the suite must run from the installed packages alone.
    # Few hypothesis examples: acme delegates every part to reference_cpu, on which
    # tests/conformance runs the whole suite at its full counts; here every test of the suite runs
    # on the installed scaffold, which is what this checks. (Arguments go to pytest.)
    derandomized = ["--hypothesis-profile=ci"] if selected_profile() == "ci" else []
    proc = subprocess.run(["bash", str(dist / "ci" / "conformance.sh"), "--hisparse-examples", str(SCAFFOLD_EXAMPLES),
                           *derandomized],
                          env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=900, check=False)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    assert "Successfully installed hisparse-acme-0.1.0" in proc.stdout, tail
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.strip()}
    # A scaffold ranks below every shipped backend (PRIORITY = -20) until its author raises it: not
    # selected automatically, and the suite runs on it by name (--hisparse-backend acme).
    assert rows["acme"][:4] == ["acme", "available", "-20", "0.1.0"], tail
    assert "selected: reference_cpu (automatic" in proc.stdout, tail
    assert "hisparse backend: acme 0.1.0" in proc.stdout and " passed" in proc.stdout, tail
    assert " failed" not in proc.stdout and "capability drift" not in proc.stdout + proc.stderr, tail
    # Installed editable, from DIR, into the new venv only.
    where = subprocess.run([str(python), "-c", "import hisparse_acme.backend as b, sys; print(b.__file__, sys.prefix)"],
                           env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=True)
    module, prefix = where.stdout.split()
    assert Path(module) == dist / "hisparse_acme" / "backend.py" and Path(prefix) == tmp_path / "venv"
    assert run_python(["-c", "import hisparse_acme"], tmp_path, tmp_path).returncode != 0


BROKEN_PLUGIN = '''
raise RuntimeError("acme driver exploded while importing the plugin")
'''


@pytest.fixture
def broken_site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    write_dist(site, "hisparse-broken", {"hisparse_broken/__init__.py": "",
                                         "hisparse_broken/plugin.py": BROKEN_PLUGIN},
               {"broken": "hisparse_broken.plugin"}, version="0.3")
    return site


def test_broken_out_of_tree_backend_is_listed_and_reference_cpu_keeps_working(broken_site: Path,
                                                                             tmp_path: Path) -> None:
    entries, stderr = list_json(broken_site, tmp_path)
    broken = entries["broken"]
    assert broken["status"] == "broken"
    assert broken["reason"] == "RuntimeError: acme driver exploded while importing the plugin"
    assert "Traceback (most recent call last)" in broken["error"]
    assert (broken["distribution"], broken["distribution_version"]) == ("hisparse-broken", "0.3")
    assert entries["reference_cpu"]["status"] == "available" and entries["reference_cpu"]["selected"] is True
    warnings = [line for line in stderr.splitlines() if line.startswith("WARNING") and "'broken'" in line]
    assert len(warnings) == 1, stderr

    proc = run_python(["-c", SELECT], broken_site, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == "reference_cpu"
    assert "unavailable: " in proc.stderr and "broken (broken: RuntimeError: acme driver exploded" in proc.stderr


def test_selecting_the_broken_backend_explicitly_fails_listing_the_alternatives(broken_site: Path,
                                                                               tmp_path: Path) -> None:
    code = "from hisparse_core.registry import select_backend\nselect_backend('broken')\n"
    proc = run_python(["-c", code], broken_site, tmp_path)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hisparse_core.errors.BackendUnavailableError: hisparse backend 'broken' is broken: "
                           "RuntimeError: acme driver exploded")
    assert "available: reference_cpu (priority 0)" in last


@pytest.mark.parametrize("command", ["run", "bench"])
def test_naming_the_broken_backend_on_the_command_line_is_one_line(broken_site: Path, tmp_path: Path,
                                                                   command: str) -> None:
    """`hisparse run --backend broken` printed discovery's WARNING (failed to import) above its error
    line saying the same; a run that selects another backend still gets the WARNING."""
    proc = run_python(["-m", "hisparse_core", command, "--backend", "broken", "--no-progress"], broken_site, tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"hisparse {command}: error: --backend 'broken': hisparse backend 'broken' is broken: "
                               "RuntimeError: acme driver exploded"), lines
    if command != "run":
        return
    proc = run_python(["-m", "hisparse_core", "run", "--backend", "reference_cpu", "--host", "1"], broken_site,
                      tmp_path)  # the choice made, then refused: the WARNING passed on
    assert proc.returncode == 2
    assert proc.stderr.startswith("WARNING hisparse_core.discovery: hisparse backend plugin 'broken'"), proc.stderr


def test_disabled_plugins_variable_hides_the_broken_backend(broken_site: Path, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "hisparse_core", "backends", "--json"],
                          env=subprocess_env(broken_site, HISPARSE_DISABLED_PLUGINS="broken"), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    broken = {d["name"]: d for d in json.loads(proc.stdout)}["broken"]
    assert broken["status"] == "unavailable"
    assert broken["reason"] == "plugin 'broken' is disabled by HISPARSE_DISABLED_PLUGINS"
    assert "'broken'" not in proc.stderr
