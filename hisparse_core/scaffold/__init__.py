"""The out-of-tree backend distribution `hisparse new-backend` writes.

The files are templates in `template/` (package data, shipped in the wheel), filled with
`string.Template`: `$name` (the backend and entry-point name), `$package` (`hisparse_<name>`),
`$dist` (`hisparse-<name>`), `$cls` (`<Name>Backend`) and `$hisparse_source` (where the
vendor's environment gets hisparse itself, which is not on PyPI: `hisparse_source()`). Torch-free:
the check of a name against installed backends goes through the registry, which imports plugin
modules only.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import keyword
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from string import Template

from hisparse_core.errors import InvalidInputError

#: Template file -> path in the distribution, relative to its root (`{package}` is filled in).
FILES: dict[str, str] = {
    "pyproject.toml.tmpl": "pyproject.toml",
    "README.md.tmpl": "README.md",
    "__init__.py.tmpl": "{package}/__init__.py",
    "plugin.py.tmpl": "{package}/plugin.py",
    "backend.py.tmpl": "{package}/backend.py",
    "conformance.sh.tmpl": "ci/conformance.sh",
    "gitignore.tmpl": ".gitignore",
}
EXECUTABLE = frozenset({"ci/conformance.sh"})


@dataclass(frozen=True, slots=True)
class ScaffoldNames:
    name: str
    package: str
    dist: str
    cls: str

    @classmethod
    def of(cls, name: str) -> ScaffoldNames:
        camel = "".join(part[:1].upper() + part[1:] for part in name.split("_"))
        return cls(name=name, package=f"hisparse_{name}", dist=f"hisparse-{name.replace('_', '-')}",
                   cls=f"{camel}Backend")


def check_name(name: str, installed_backends: Iterable[str]) -> ScaffoldNames:
    """The names of a new backend `name`; InvalidInputError when it cannot be one."""
    if not name.isidentifier() or keyword.iskeyword(name):
        raise InvalidInputError(f"backend name {name!r} is not a Python identifier (or is a keyword); expected letters, digits "
                                f"and underscores, not starting with a digit (e.g. acme)")
    if not name.isascii():  # a project name pip takes is ASCII
        raise InvalidInputError(f"backend name {name!r} is a Python identifier but not ASCII; expected ASCII letters, "
                                f"digits and underscores (e.g. acme)")
    if name.endswith("_"):  # `hisparse-acme-`: pip refuses a project name that ends in a dash
        raise InvalidInputError(f"backend name {name!r} ends with an underscore, which makes the distribution name "
                                f"{ScaffoldNames.of(name).dist!r} that pip refuses (a project name must end in a "
                                f"letter or digit); expected a name ending in a letter or digit (e.g. acme)")
    from hisparse_core.registry import AUTO, is_auto

    if is_auto(name):   # --backend auto / HISPARSE_BACKEND=auto ask for automatic selection: never this backend
        raise InvalidInputError(f"backend name {name!r} is reserved: {AUTO!r}, in any case, asks for automatic "
                                f"selection wherever a backend name is taken (--backend, HISPARSE_BACKEND, "
                                f"select_backend), so no backend of that name could be selected; choose another")
    installed = sorted(installed_backends)
    if name in installed:
        raise InvalidInputError(f"backend name {name!r} is already taken by an installed backend "
                                f"(installed: {', '.join(installed)}); choose another")
    # The registry compares names exactly, so `NVIDIA` would be another backend than `nvidia`: one that
    # HISPARSE_BACKEND=nvidia does not pick, and whose package is the other's on a case-insensitive disk.
    same = [b for b in installed if b.casefold() == name.casefold()]
    if same:
        raise InvalidInputError(f"backend name {name!r} differs only in case from the installed backend {same[0]!r} "
                                f"(installed: {', '.join(installed)}); expected a name that differs from each installed "
                                f"backend's in more than case")
    names = ScaffoldNames.of(name)
    if importlib.util.find_spec(names.package) is not None:
        raise InvalidInputError(f"backend name {name!r} clashes with the installed package {names.package!r}; "
                                f"choose another")
    # `Core` would make hisparse_Core beside hisparse_core: one folder on a case-insensitive disk.
    # Installed top-level packages, editable installs included (their finders hide them from pkgutil).
    folded = [p for p in importlib.metadata.packages_distributions() if p.casefold() == names.package.casefold()]
    if folded:
        raise InvalidInputError(f"backend name {name!r} makes the package {names.package!r}, which differs only in "
                                f"case from the installed package {folded[0]!r}; expected a name whose package "
                                f"differs from each installed one in more than case")
    try:  # looked up as pip normalizes project names: case, `_` and `-` do not tell them apart
        installed_dist = importlib.metadata.distribution(names.dist).name
    except importlib.metadata.PackageNotFoundError:
        return names
    raise InvalidInputError(f"backend name {name!r} makes the distribution name {names.dist!r}, which pip takes for the "
                            f"installed distribution {installed_dist!r} (installing it would replace that one); "
                            f"choose another")


#: The environment variable `ci/conformance.sh` takes hisparse from: a checkout's path or a pip
#: requirement (`git+https://...`, a wheel file).
ENV_SOURCE = "HISPARSE_SOURCE"


def hisparse_source() -> str:
    """The source checkout the running hisparse comes from (an editable install or a clone on
    PYTHONPATH: the folder whose pyproject.toml names the `hisparse` project), or "" when it is
    installed from a wheel. The scaffold's README and CI script install hisparse from it."""
    import tomllib

    root = Path(__file__).resolve().parents[2]
    try:
        project = tomllib.loads((root / "pyproject.toml").read_text())["project"]["name"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return ""
    return str(root) if project == "hisparse" else ""


def render(names: ScaffoldNames, source: str | None = None) -> dict[str, str]:
    """Relative path -> text of every file of the distribution; `source`: where hisparse itself
    is installed from (default: `hisparse_source()`)."""
    template_dir = files("hisparse_core.scaffold") / "template"
    source = hisparse_source() if source is None else source
    fields: Mapping[str, str] = {"name": names.name, "package": names.package, "dist": names.dist,
                                 "cls": names.cls, "hisparse_source": source,
                                 "hisparse_source_shown": source or "path/to/hisparse"}
    return {target.format(package=names.package): Template((template_dir / source).read_text()).substitute(fields)
            for source, target in FILES.items()}


def check_target(target: Path, label: str = "target") -> None:
    """`target` must be absent (under an existing, writable folder) or an empty, writable folder:
    the scaffold overwrites nothing and fails before writing anything. `label` names it in the
    message (the CLI's `DIR`)."""
    what = f"{label} {str(target)!r}"
    if target.exists() and not target.is_dir():
        raise InvalidInputError(f"{what} exists and is not a folder; expected a new or empty folder")
    if target.is_dir():
        if any(target.iterdir()):
            raise InvalidInputError(f"{what} is not empty; expected a new or empty folder")
        if not os.access(target, os.W_OK | os.X_OK):
            raise InvalidInputError(f"{what} is not writable; expected a new or empty folder that can be written")
        return
    ancestor = _nearest_existing(target)
    if not ancestor.is_dir():
        raise InvalidInputError(f"{what} cannot be created: {str(ancestor)!r} is not a folder; expected a new or "
                                "empty folder under an existing folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise InvalidInputError(f"{what} cannot be created: the folder {str(ancestor)!r} is not writable; expected "
                                "a new or empty folder under a writable folder")


def _nearest_existing(path: Path) -> Path:
    """The nearest of `path`'s ancestors that exists (as given, or the current folder)."""
    for parent in path.parents:
        if os.path.lexists(parent):
            return parent
    return Path(".")


def write(names: ScaffoldNames, target: Path, source: str | None = None, *, label: str = "target") -> list[Path]:
    """Write the distribution into `target` (checked by `check_target` first); the paths written.
    A write that fails (a full disk, say) removes what it wrote, folders it created included, and
    raises `InvalidInputError` naming `label`, the target and the file; one interrupted (Ctrl-C)
    removes it too and lets the interrupt through."""
    check_target(target, label)
    rendered = render(names, source)  # every template is read and filled before anything is written
    existed = target.is_dir()
    created = target if existed else next(
        (p for p in reversed((target, *target.parents)) if not os.path.lexists(p)), target)
    written = []
    rel = ""
    try:
        for rel, text in rendered.items():
            path = target / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            if rel in EXECUTABLE:
                path.chmod(path.stat().st_mode | 0o111 & ~_umask())
            written.append(path)
    except OSError as exc:
        _remove_written(target if existed else created, keep_root=existed)
        detail = exc.strerror or str(exc)
        raise InvalidInputError(f"{label} {str(target)!r}: cannot write {rel} ({detail}); expected a new or empty "
                                "folder that can be written (nothing was left behind)") from exc
    except BaseException:  # Ctrl-C mid-write: no half-written distribution left behind either
        _remove_written(target if existed else created, keep_root=existed)
        raise
    return written


def _remove_written(root: Path, *, keep_root: bool) -> None:
    """Remove what a failed `write` made under `root`: its contents if `keep_root` (the folder
    was there, empty, before), else `root` itself."""
    import shutil

    if not keep_root:
        shutil.rmtree(root, ignore_errors=True)
        return
    for child in list(root.iterdir()) if root.is_dir() else []:
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
