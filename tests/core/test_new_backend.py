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
from core_support import FakeSite
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
    assert "priority -20, below every shipped backend" in out and "--backend tpu_x" in out
    readme = (target / "README.md").read_text()
    assert "PRIORITY = -20" in readme and "raise\n`PRIORITY` in `hisparse_tpu_x/plugin.py`" in readme
    written = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
    assert written == sorted(["pyproject.toml", "README.md", "ci/conformance.sh", "hisparse_tpu_x/__init__.py",
                              "hisparse_tpu_x/plugin.py", "hisparse_tpu_x/backend.py", ".gitignore"])
    # What ci/conformance.sh leaves behind (hypothesis's database, Python's caches) is no source to commit.
    ignored = (target / ".gitignore").read_text().splitlines()
    assert {".hypothesis/", "__pycache__/", "*.egg-info/"} <= set(ignored)
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
            "assert specs[0].factory == 'hisparse_lightcheck.backend:LightcheckBackend'; "
            # Below every shipped backend (the lowest is interpreted triton, -10): installing a
            # scaffold changes no one's automatic selection.
            "assert specs[0].priority < -10, specs[0].priority; print('ok')")
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
    ("acmé", "'acmé' is a Python identifier but not ASCII; expected ASCII letters, digits and underscores"),
    ("acme_", "'acme_' ends with an underscore, which makes the distribution name 'hisparse-acme-' that pip refuses"),
    ("_", "'_' ends with an underscore, which makes the distribution name 'hisparse--' that pip refuses"),
    ("reference_cpu", "'reference_cpu' is already taken by an installed backend"),
    # Only the case differs: HISPARSE_BACKEND=NVIDIA would not pick it, and hisparse_NVIDIA is
    # hisparse_nvidia on a case-insensitive file system.
    ("NVIDIA", "'NVIDIA' differs only in case from the installed backend 'nvidia'"),
    ("Reference_CPU", "'Reference_CPU' differs only in case from the installed backend 'reference_cpu'"),
    ("core", "clashes with the installed package 'hisparse_core'"),
    ("conformance", "clashes with the installed package 'hisparse_conformance'"),
    # hisparse_Core beside hisparse_core: one folder on a case-insensitive disk.
    ("Core", "makes the package 'hisparse_Core', which differs only in case from the installed package 'hisparse_core'"),
    ("Transformers", "differs only in case from the installed package 'hisparse_transformers'"),
])
def test_bad_name_is_one_line_exit_2_nothing_written(tmp_path: Path, name: str, expected: str) -> None:
    target = tmp_path / "d"
    code, out, err = new_backend(name, str(target))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("hisparse new-backend: error: ") and expected in err, err
    assert not target.exists()


def test_an_empty_dir_is_refused_not_taken_as_the_current_folder(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = new_backend("acme", "")
    assert (code, out) == (2, "")
    assert err == "hisparse new-backend: error: DIR '' is empty; expected a new or empty folder (`.` for the " \
                  "current one)\n"
    assert not any(tmp_path.iterdir())


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


def test_dir_under_a_file_names_dir_and_creates_nothing(tmp_path: Path) -> None:
    """`new-backend acme /dev/null/x` printed a raw `[Errno 20] Not a directory: '/dev/null/x'`."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    for target in (afile / "x", afile / "x" / "y"):
        code, out, err = new_backend("acme", str(target))
        assert code == 2 and out == ""
        assert err.splitlines() == [f"hisparse new-backend: error: DIR {str(target)!r} cannot be created: "
                                    f"{str(afile)!r} is not a folder; expected a new or empty folder under an "
                                    "existing folder"]
        assert afile.read_text() == "x"
    code, _, err = new_backend("acme", "/dev/null/x")
    assert code == 2 and err.splitlines() == ["hisparse new-backend: error: DIR '/dev/null/x' cannot be created: "
                                              "'/dev/null' is not a folder; expected a new or empty folder under an "
                                              "existing folder"]


def _third_write_raises(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> list[Path]:
    """Files written from now on: the third write raises `error` (a disk that fills, a Ctrl-C)
    halfway through the distribution; the paths asked to be written."""
    real = Path.write_text
    calls: list[Path] = []

    def third_raises(self: Path, text: str, *args: object, **kwargs: object) -> int:
        calls.append(self)
        if len(calls) == 3:
            raise error
        return real(self, text, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "write_text", third_raises)
    return calls


@pytest.mark.parametrize("existing", [False, True], ids=["new folders", "an empty folder"])
def test_a_write_that_fails_names_dir_and_leaves_nothing(tmp_path: Path, existing: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk that fills halfway: one line naming DIR and the file, and what was written removed
    (folders created for DIR included; an empty DIR given is kept, empty)."""
    target = tmp_path / "empty" if existing else tmp_path / "new" / "dist"
    if existing:
        target.mkdir()
    _third_write_raises(monkeypatch, OSError(28, "No space left on device"))
    code, out, err = new_backend("acme", str(target))
    monkeypatch.undo()
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"hisparse new-backend: error: DIR {str(target)!r}: cannot write ")
    assert "(No space left on device); expected a new or empty folder that can be written" in lines[0]
    if existing:
        assert target.is_dir() and not any(target.iterdir())
    else:
        assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("existing", [False, True], ids=["new folders", "an empty folder"])
def test_a_write_interrupted_by_ctrl_c_leaves_nothing(tmp_path: Path, existing: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C halfway through the files: the interrupt goes through, and what was written is removed
    as after a failed write (only an OSError removed it: a half-written distribution was left)."""
    from hisparse_core.scaffold import write

    target = tmp_path / "empty" if existing else tmp_path / "new" / "dist"
    if existing:
        target.mkdir()
    calls = _third_write_raises(monkeypatch, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        write(ScaffoldNames.of("acme"), target)
    monkeypatch.undo()
    assert len(calls) == 3
    if existing:
        assert target.is_dir() and not any(target.iterdir())
    else:
        assert not (tmp_path / "new").exists()


def test_a_name_whose_distribution_pip_takes_for_an_installed_one_is_refused(fake_site: FakeSite) -> None:
    """pip normalizes project names (case, `_`, `-`): `hisparse-Acme` would replace `hisparse-acme`."""
    from hisparse_core.errors import InvalidInputError

    package = fake_site.backend("acme")
    name = package.removeprefix("hisparse_").upper()
    installed = package.replace("_", "-")
    with pytest.raises(InvalidInputError) as raised:
        check_name(name, ["reference_cpu", "acme"])
    assert str(raised.value) == (
        f"backend name {name!r} makes the distribution name 'hisparse-{name.replace('_', '-')}', which pip takes for "
        f"the installed distribution {installed!r} (installing it would replace that one); choose another")


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


@settings(max_examples=60, deadline=None)
@given(st.from_regex(r"[a-z_][a-z0-9_]{0,20}", fullmatch=True))
def test_every_accepted_name_makes_a_distribution_name_pip_takes(name: str) -> None:
    """PEP 508's project name: letters, digits, `.`, `_`, `-`, starting and ending with a letter or digit."""
    import re

    from hisparse_core.errors import InvalidInputError

    try:
        dist = check_name(name, ["reference_cpu"]).dist
    except InvalidInputError:
        return
    assert re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?", dist), dist


def test_templates_ship_as_package_data() -> None:
    """Every template file is matched by pyproject's package-data for hisparse_core.scaffold."""
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = globs["hisparse_core.scaffold"]
    template_dir = ROOT / "hisparse_core" / "scaffold" / "template"
    on_disk = {p.name for p in template_dir.iterdir()}
    assert on_disk == set(FILES)
    assert all(any(fnmatch.fnmatch(f"template/{f}", pat) for pat in patterns) for f in on_disk)


def test_the_scaffold_names_where_hisparse_comes_from(tmp_path: Path) -> None:
    """hisparse is not on PyPI: the README, the CI script and the command's own output say how to
    put it into a fresh environment, defaulting to this checkout."""
    from hisparse_core.scaffold import hisparse_source

    assert hisparse_source() == str(ROOT)  # tests run from a checkout
    code, out, _ = new_backend("srcx", str(tmp_path / "d"))
    assert code == 0 and f"pip install -e '{ROOT}'" in out.splitlines()[2]
    readme = (tmp_path / "d" / "README.md").read_text()
    assert f"pip install -e '{ROOT}'" in readme and "not on PyPI" in readme and "HISPARSE_SOURCE" in readme
    assert f'HISPARSE_SOURCE="${{HISPARSE_SOURCE:-{ROOT}}}"' in (tmp_path / "d" / "ci" / "conformance.sh").read_text()
    wheel_readme = render(ScaffoldNames.of("srcx"), source="")["README.md"]
    assert "pip install -e 'path/to/hisparse'" in wheel_readme


def test_ci_script_refuses_a_hisparse_source_path_that_is_not_here(tmp_path: Path) -> None:
    """The default HISPARSE_SOURCE is the checkout on the machine new-backend ran on: on a vendor's CI
    machine it is not there, and pip said only "Invalid requirement: '/work/...'". One line, exit 2,
    and pip is not run. A stand-in `python` has torch and lacks hisparse, and logs what it is asked."""
    new_backend("civendor", str(tmp_path / "d"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    fake = bin_dir / "python"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {calls}\ncase "$*" in *"import torch"*) exit 0;; esac\nexit 1\n')
    fake.chmod(0o755)
    missing = tmp_path / "elsewhere" / "hisparse"
    proc = subprocess.run(["bash", str(tmp_path / "d" / "ci" / "conformance.sh")], capture_output=True, text=True,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HISPARSE_SOURCE": str(missing)}, timeout=60,
                          check=False)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        f"ci/conformance.sh: hisparse is not installed in this environment and HISPARSE_SOURCE={missing} does not "
        "exist on this machine; expected a hisparse checkout here (a path) or a pip requirement (git+https://...)"]
    assert "pip" not in calls.read_text()


@pytest.mark.slow
def test_ci_script_installs_hisparse_into_an_environment_without_it(tmp_path: Path) -> None:
    """A fresh virtual environment that has torch and the other dependencies but not hisparse (as
    a vendor's has): the scaffold's ci/conformance.sh installs hisparse from this checkout, then the
    backend, lists it and collects the conformance suite. Offline: pip takes no index and no
    dependencies; the shared packages come from this interpreter's site-packages through a .pth
    line, which (unlike a site folder) runs none of their .pth files, so hisparse's own editable
    install there stays invisible."""
    import importlib.metadata
    import importlib.util
    import site
    import sysconfig
    import venv

    setuptools = tuple(int(x) for x in importlib.metadata.version("setuptools").split(".")[:2])
    if setuptools < (70, 1) and importlib.util.find_spec("wheel") is None:
        pytest.skip(f"an offline editable build needs setuptools >= 70.1 or wheel here (setuptools {setuptools})")

    new_backend("civendor", str(tmp_path / "d"))
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False, symlinks=True)  # pip, setuptools and wheel: the shared ones
    py = env_dir / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    shared = [p for p in [sysconfig.get_paths()["purelib"], *site.getsitepackages()] if Path(p).is_dir()]
    Path(purelib, "shared_site.pth").write_text("\n".join(dict.fromkeys(shared)) + "\n")
    env = {"PATH": f"{env_dir / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "PIP_NO_INDEX": "1",
           "PIP_NO_DEPS": "1", "PIP_NO_BUILD_ISOLATION": "0", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    before = subprocess.run([str(py), "-c", "import hisparse_core"], env=env, cwd=tmp_path, capture_output=True,
                            check=False)
    assert before.returncode != 0, "the fresh environment must start without hisparse"
    proc = subprocess.run(["bash", str(tmp_path / "d" / "ci" / "conformance.sh"), "--collect-only"], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "civendor" in proc.stdout and "available" in proc.stdout
    where = subprocess.run([str(py), "-c", "import hisparse_core; print(hisparse_core.__file__)"], env=env,
                           cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(ROOT))
