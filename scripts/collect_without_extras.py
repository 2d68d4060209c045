"""Collects the test suite as a contributor with only `.[test]` installed would.

Every optional extra's top-level package (cuda-python, NIXL, matplotlib, transformers, vLLM,
Triton) is hidden from the import system, so `find_spec` returns None and `import` raises
ModuleNotFoundError exactly as when it is not installed. Any test module that imports an extra at
its top without skipping then fails to collect, and this script exits non-zero.

Run: `python scripts/collect_without_extras.py` (CI runs it after the lint).
"""

from __future__ import annotations

import importlib.machinery
import os
import sys

HIDDEN = ("cuda", "nixl", "matplotlib", "transformers", "vllm", "triton")


def _hidden(name: str) -> bool:
    return name.split(".", 1)[0] in HIDDEN


def hide_extras() -> None:
    original = importlib.machinery.PathFinder.find_spec

    # A classmethod, as PathFinder's own is: pytest keeps `PathFinder.find_spec` as a class attribute
    # of its rewrite hook, which a plain function would turn into a method of the hook.
    def find_spec(cls, fullname, path=None, target=None):  # noqa: ANN001, ANN202 - PathFinder's signature
        return None if _hidden(fullname) else original(fullname, path, target)

    importlib.machinery.PathFinder.find_spec = classmethod(find_spec)  # type: ignore[method-assign, assignment]
    for name in [m for m in sys.modules if _hidden(m)]:
        del sys.modules[name]


def main() -> int:
    # As `python -m pytest` does: the working directory (the repository root) first on sys.path.
    sys.path.insert(0, os.getcwd())
    hide_extras()
    import pytest

    rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]])
    print(f"[collect_without_extras] hidden: {', '.join(HIDDEN)}; pytest exit status {int(rc)}", file=sys.stderr)
    return int(rc)


if __name__ == "__main__":
    raise SystemExit(main())
