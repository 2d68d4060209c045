"""`hisparse new-backend NAME [DIR]`: what it writes, and what it refuses (one line, exit 2, nothing written)."""

from __future__ import annotations

import ast
import contextlib
import fnmatch
import io
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_core.cli import main
from hisparse_core.scaffold import FILES, ScaffoldNames, check_name, render

ROOT = Path(__file__).resolve().parents[2]


def new_backend(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["new-backend", *args])
    return code, out.getvalue(), err.getvalue()


def test_writes_a_complete_distribution(tmp_path: Path) -> None:
    target = tmp_path / "out"
    code, out, err = new_backend("tpu_x", str(target))
    assert code == 0, err
    assert f"in {target}/" in out and "--hisparse-backend tpu_x" in out
    written = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
    assert written == sorted(["pyproject.toml", "README.md", "ci/conformance.sh", "hisparse_tpu_x/__init__.py",
                              "hisparse_tpu_x/plugin.py", "hisparse_tpu_x/backend.py"])
    meta = tomllib.loads((target / "pyproject.toml").read_text())
    assert meta["project"]["name"] == "hisparse-tpu-x"
    assert meta["project"]["entry-points"]["hisparse.backends"] == {"tpu_x": "hisparse_tpu_x.plugin"}
    assert "pytest>=8" in meta["project"]["optional-dependencies"]["test"]
    assert meta["tool"]["setuptools"]["packages"] == ["hisparse_tpu_x"]
    for py in target.rglob("*.py"):
        ast.parse(py.read_text(), str(py))
    backend = (target / "hisparse_tpu_x" / "backend.py").read_text()
    assert "class TpuXBackend(Backend):" in backend and "ReferenceCpuBackend()" in backend
    assert '"hisparse_tpu_x.backend:TpuXBackend"' in (target / "hisparse_tpu_x" / "plugin.py").read_text()
    script = target / "ci" / "conformance.sh"
    assert script.stat().st_mode & 0o100
    assert "python -m pytest --pyargs hisparse_conformance --hisparse-backend tpu_x" in script.read_text()
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0


def test_plugin_module_is_light_and_its_probe_says_available(tmp_path: Path) -> None:
    """The entry-point module imports no torch; its probe returns None on any machine; the spec and
    the class declare the same capabilities."""
    new_backend("lightcheck", str(tmp_path / "d"))
    code = ("import sys; import hisparse_lightcheck.plugin as p; assert 'torch' not in sys.modules, 'torch'; "
            "assert p.probe() is None; specs = []; p.hisparse_register_backends(specs.append); "
            "import hisparse_lightcheck.backend as b; "
            "assert specs[0].capabilities == b.LightcheckBackend.capabilities, 'drift'; "
            "assert specs[0].factory == 'hisparse_lightcheck.backend:LightcheckBackend'; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path / "d", capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_default_dir_is_the_distribution_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert new_backend("acme")[0] == 0
    assert (tmp_path / "hisparse-acme" / "hisparse_acme" / "plugin.py").is_file()


@pytest.mark.parametrize(("name", "expected"), [
    ("1acme", "'1acme' is not a Python identifier"),
    ("acme-x", "'acme-x' is not a Python identifier"),
    ("class", "'class' is not a Python identifier (or is a keyword)"),
    ("", "'' is not a Python identifier"),
    ("reference_cpu", "'reference_cpu' is already taken by an installed backend"),
    ("core", "clashes with the installed package 'hisparse_core'"),
    ("conformance", "clashes with the installed package 'hisparse_conformance'"),
])
def test_bad_name_is_one_line_exit_2_nothing_written(tmp_path: Path, name: str, expected: str) -> None:
    target = tmp_path / "d"
    code, out, err = new_backend(name, str(target))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("hisparse new-backend: error: ") and expected in err, err
    assert not target.exists()


def test_non_empty_dir_or_a_file_is_refused_and_left_alone(tmp_path: Path) -> None:
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    code, _, err = new_backend("acme", str(full))
    assert code == 2 and err.count("\n") == 1 and "is not empty; expected a new or empty folder" in err
    assert [p.name for p in full.iterdir()] == ["keep.txt"]
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, _, err = new_backend("acme", str(afile))
    assert code == 2 and "exists and is not a folder" in err and afile.read_text() == "x"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert new_backend("acme", str(empty))[0] == 0


@settings(max_examples=60, deadline=None)
@given(st.from_regex(r"[a-z][a-z0-9_]{0,20}", fullmatch=True))
def test_every_identifier_renders_every_file_with_no_placeholder_left(name: str) -> None:
    names = ScaffoldNames.of(name)
    files = render(names)
    assert set(files) == {t.format(package=names.package) for t in FILES.values()}
    for rel, text in files.items():
        assert "$name" not in text and "$package" not in text and "$cls" not in text, rel
        if rel.endswith(".py"):
            ast.parse(text)
    assert names.cls.isidentifier() and names.cls.endswith("Backend")


def test_identifier_check_accepts_new_names() -> None:
    assert check_name("acme", ["reference_cpu"]).package == "hisparse_acme"


def test_templates_ship_as_package_data() -> None:
    """Every template file is matched by pyproject's package-data for hisparse_core.scaffold."""
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = globs["hisparse_core.scaffold"]
    template_dir = ROOT / "hisparse_core" / "scaffold" / "template"
    on_disk = {p.name for p in template_dir.iterdir()}
    assert on_disk == set(FILES)
    assert all(any(fnmatch.fnmatch(f"template/{f}", pat) for pat in patterns) for f in on_disk)
