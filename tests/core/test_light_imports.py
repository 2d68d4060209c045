"""Entry-point modules and the registry import nothing heavy.

Every process that lists or selects a backend imports every plugin module, so importing one must
not load torch, CUDA bindings or vLLM. Checked in a fresh interpreter, where sys.modules is
clean.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from core_support import subprocess_env

HEAVY = ("torch", "vllm", "cuda")

CHECK = """
import importlib, sys
importlib.import_module({module!r})
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r})
print(",".join(heavy))
"""


def imported_heavy(module: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", CHECK.format(module=module, heavy=HEAVY)], env=subprocess_env(),
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return [m for m in proc.stdout.strip().split(",") if m]


@pytest.mark.parametrize("module", ["hisparse_reference_cpu.plugin", "hisparse_nvidia.plugin"])
def test_entry_point_module_imports_nothing_heavy(module: str) -> None:
    assert imported_heavy(module) == []


@pytest.mark.parametrize("module", ["hisparse_core", "hisparse_core.registry", "hisparse_core.cli.backends_cmd",
                                    "hisparse_core.cli.generate_cmd", "hisparse_transformers"])
def test_registry_and_listing_import_nothing_heavy(module: str) -> None:
    assert imported_heavy(module) == []
