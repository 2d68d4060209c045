"""The import layers of hisparse_transformers: every import of every module (function-local and
`TYPE_CHECKING` ones included) runs down `LAYERS` (the package `__init__`), never sideways or up,
so no circle can form and a new back-edge fails here.

Read with `ast` only: nothing of the package (nor torch or transformers) is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = "hisparse_transformers"
ROOT = Path(__file__).resolve().parents[2] / "plugins" / "transformers" / PKG


def _init_tree() -> ast.Module:
    return ast.parse((ROOT / "__init__.py").read_text(), filename="__init__.py")


def _assigned(tree: ast.Module, name: str) -> ast.expr:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node.value
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            assert node.value is not None
            return node.value
    raise AssertionError(f"{PKG}/__init__.py assigns no {name}")


LAYERS: tuple[tuple[str, ...], ...] = ast.literal_eval(_assigned(_init_tree(), "LAYERS"))
MODULES = sorted(p.stem for p in ROOT.glob("*.py"))


def _layer_of(layers: tuple[tuple[str, ...], ...]) -> dict[str, int]:
    return {m: i for i, layer in enumerate(layers) for m in layer}


def package_imports(module: str, tree: ast.Module, modules: list[str]) -> list[tuple[int, str]]:
    """(line, module of the package) for every import in `tree`, wherever it stands. Importing the
    package itself (or a name that is not one of its modules) is importing `__init__`."""

    def target(dotted: str) -> str:
        rest = dotted[len(PKG) + 1:] if dotted.startswith(PKG + ".") else ""
        return rest.split(".", 1)[0] if rest else "__init__"

    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, target(a.name)) for a in node.names if a.name == PKG or a.name.startswith(PKG + ".")]
        elif isinstance(node, ast.ImportFrom):
            if node.level > 1:
                raise AssertionError(f"{module}.py:{node.lineno}: a relative import out of the package")
            base = (PKG + ("." + node.module if node.module else "")) if node.level == 1 else (node.module or "")
            if base == PKG:       # from hisparse_transformers import x: a module, or a name of __init__
                found += [(node.lineno, a.name if a.name in modules else "__init__") for a in node.names]
            elif base.startswith(PKG + "."):
                found.append((node.lineno, target(base)))
    if module == "__init__":      # its lazy names: imported on first use
        lazy = _assigned(tree, "_LAZY")
        assert isinstance(lazy, ast.Dict)
        found += [(v.lineno, target(v.value)) for v in lazy.values
                  if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    return found


def violations(module: str, source: str, layers: tuple[tuple[str, ...], ...], modules: list[str]) -> list[str]:
    """One line per import of `module` (its `source`) that does not run down `layers`."""
    layer = _layer_of(layers)
    own = layer[module]
    bad = []
    for line, imported in package_imports(module, ast.parse(source, filename=f"{module}.py"), modules):
        if imported not in layer:
            bad.append(f"{module}.py:{line} imports {PKG}.{imported}, which is in no layer of LAYERS")
        elif layer[imported] >= own:
            where = "beside it" if layer[imported] == own else "above it"
            bad.append(f"{module}.py:{line} (layer {own + 1}) imports {imported} (layer {layer[imported] + 1}, "
                       f"{where}); imports must run down LAYERS in {PKG}/__init__.py")
    return bad


def test_every_module_has_one_layer() -> None:
    declared = [m for layer in LAYERS for m in layer]
    assert len(declared) == len(set(declared)), f"a module is in two layers: {declared}"
    assert all(LAYERS), "an empty layer"
    missing = sorted(set(MODULES) - set(declared))
    assert not missing, f"{missing} in no layer: add each to LAYERS in {PKG}/__init__.py (and its docstring)"


@pytest.mark.parametrize("module", MODULES)
def test_imports_run_down_the_layers(module: str) -> None:
    bad = violations(module, (ROOT / f"{module}.py").read_text(), LAYERS, MODULES)
    assert not bad, "\n".join(bad)


def test_the_engine_knows_neither_the_model_side_nor_the_checker() -> None:
    """What the issue asked for, stated directly: nothing below the model side reaches up to it."""
    layer = _layer_of(LAYERS)
    assert layer["rows"] < layer["session"] < layer["engine"] < layer["cache"] < layer["attention"] < layer["handle"]
    assert layer["check"] > layer["engine"] and layer["check"] != layer["attention"]
    imported = {m for _, m in package_imports("engine", ast.parse((ROOT / "engine.py").read_text()), MODULES)}
    assert not imported & {"attention", "cache", "check", "graphs", "handle"}


def test_the_docstring_lists_the_layers_in_order() -> None:
    doc = ast.get_docstring(_init_tree()) or ""
    spans = []
    for layer in LAYERS:
        at = [doc.find(f"`{m}`") for m in layer]
        assert all(i >= 0 for i in at), f"the {PKG} docstring does not name every module of layer {layer}"
        spans.append((min(at), max(at)))
    for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
        assert end < start, f"the {PKG} docstring lists the layers out of the order of LAYERS"


# ----------------------------------------------------------------------- the check itself can fail

@pytest.mark.parametrize(("module", "source", "what"), [
    ("engine", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hisparse_transformers.attention import "
               "RowMap\n", "above it"),
    ("engine", "def f():\n    from hisparse_transformers.check import ExactnessChecker\n", "above it"),
    ("check", "import hisparse_transformers.cache as c\n", "beside it"),
    ("session", "from . import engine\n", "above it"),
    ("rows", "from .tokens import LazyTokens\n", "beside it"),
    ("handle", "import hisparse_transformers\n", "above it"),
    ("cache", "from hisparse_transformers import enable\n", "above it"),
    ("engine", "from hisparse_transformers.nowhere import x\n", "in no layer"),
])
def test_a_back_edge_is_caught(module: str, source: str, what: str) -> None:
    bad = violations(module, source, LAYERS, MODULES)
    assert len(bad) == 1 and what in bad[0], bad


def test_downward_imports_pass() -> None:
    source = ("from hisparse_transformers.session import Session\nfrom .rows import RowMap\n"
              "import hisparse_transformers.tokens\nfrom hisparse_core.errors import HiSparseError\n")
    assert violations("engine", source, LAYERS, MODULES) == []
