"""hisparse_core imports no backend and no plugin: imports run from the integrations down to the
core, never back up. The core finds backends through `hisparse.backends` and plugins' commands
through `hisparse.commands` entry points, by name, without importing them itself.

Read from the source with `ast`, so a lazy import inside a function counts as much as one at the
top of a module, and so does `importlib.import_module("hisparse_x...")` with a literal name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import hisparse_core

CORE = Path(hisparse_core.__file__).parent
#: Every other `hisparse_*` package is a backend or a plugin (setup.py's ROOTS lists today's).
KNOWN_OUTSIDE = ("hisparse_reference_cpu", "hisparse_nvidia", "hisparse_triton", "hisparse_conformance",
                 "hisparse_vllm", "hisparse_transformers")


def _is_outside(module: str) -> bool:
    top = module.split(".")[0]
    return top.startswith("hisparse_") and top != "hisparse_core"


def upward_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of each import of a package other than hisparse_core named `hisparse_*`."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        found += [(node.lineno, name) for name in names if _is_outside(name)]
    return found


def test_the_checker_finds_every_form_of_import() -> None:
    source = (
        "import hisparse_vllm\n"
        "from hisparse_transformers.demo import run_demo\n"
        "def f():\n"
        "    import hisparse_nvidia.runtime as r\n"
        "    importlib.import_module('hisparse_triton.plugin')\n"
        "    __import__('hisparse_reference_cpu')\n"
        "from hisparse_core.cli import main\n"
        "from . import options\n"
        "import hisparse_core.registry\n"
    )
    assert [m for _, m in upward_imports(source)] == [
        "hisparse_vllm", "hisparse_transformers.demo", "hisparse_nvidia.runtime", "hisparse_triton.plugin",
        "hisparse_reference_cpu"]
    assert all(_is_outside(name) for name in KNOWN_OUTSIDE)


def test_hisparse_core_imports_no_backend_and_no_plugin() -> None:
    modules = sorted(CORE.rglob("*.py"))
    assert len(modules) > 50 and CORE / "cli" / "__init__.py" in modules
    offences = [f"{path.relative_to(CORE.parent)}:{line} imports {name}"
                for path in modules for line, name in upward_imports(path.read_text())]
    assert offences == [], "the core imports upward:\n" + "\n".join(offences)
