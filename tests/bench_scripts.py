"""Importing a `bench/` script in process, as running it does (its folder on `sys.path`), so that a
test calls its `main(argv)` without a fresh interpreter (and torch imported anew) a case."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType


@contextmanager
def imported(script: Path) -> Iterator[ModuleType]:
    """The module of `script`, registered in `sys.modules` while in use (its dataclasses look it up)."""
    name = f"{script.stem}_under_test"
    sys.path.insert(0, str(script.parent))
    try:
        spec = importlib.util.spec_from_file_location(name, script)
        assert spec is not None and spec.loader is not None, script
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
        sys.path.remove(str(script.parent))
