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


@pytest.mark.parametrize("module", ["hisparse_reference_cpu.plugin", "hisparse_nvidia.plugin",
                                    "hisparse_transformers.cli"])
def test_entry_point_module_imports_nothing_heavy(module: str) -> None:
    assert imported_heavy(module) == []


@pytest.mark.parametrize("module", ["hisparse_core", "hisparse_core.registry", "hisparse_core.cli",
                                    "hisparse_core.cli.options", "hisparse_core.cli.backends_cmd",
                                    "hisparse_core.cli.plugin_commands", "hisparse_core.cli.run_cmd",
                                    "hisparse_core.cli.bench_cmd", "hisparse_core.cli.plan_cmd",
                                    "hisparse_core.progress", "hisparse_core.planner_plot", "hisparse_transformers"])
def test_registry_and_listing_import_nothing_heavy(module: str) -> None:
    assert imported_heavy(module) == []


CLI_CHECK = """
import contextlib, io, sys
from hisparse_core.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        status = main({argv!r})
    except SystemExit as exc:
        status = exc.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r})
print(status, ",".join(heavy), file=sys.stderr)
"""


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["backends"], ["backends", "--json"], ["run", "--help"],
                                  ["bench", "--help"], ["plan", "--help"], ["generate", "--help"],
                                  ["run", "--hot", "inf"]])
def test_cli_parser_and_listing_import_nothing_heavy(argv: list[str]) -> None:
    """`build_parser` builds every sub-command's options without torch: help, the version, the
    backend listing and parse-time errors all start fast and work with a broken torch."""
    # Listing runs each backend's probe, and the nvidia probe asks the CUDA driver through cuda-python
    # (light, no torch); everything else imports none of HEAVY.
    heavy_here = tuple(h for h in HEAVY if h != "cuda") if argv[0] == "backends" else HEAVY
    proc = subprocess.run([sys.executable, "-c", CLI_CHECK.format(argv=argv, heavy=heavy_here)], env=subprocess_env(),
                          capture_output=True, text=True, timeout=120, check=False)
    status, _, heavy = proc.stderr.strip().splitlines()[-1].partition(" ")
    assert status in ("0", "2"), proc.stderr
    assert heavy == "", f"hisparse {' '.join(argv)} imported {heavy}"


def test_backends_and_help_work_with_a_broken_torch(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A torch that fails to import (a bad wheel, a CUDA mismatch) is exactly when a user runs
    `hisparse backends`; it and `--help` still work, and a command that needs torch says so in one line."""
    broken = tmp_path / "torch"
    broken.mkdir()
    (broken / "__init__.py").write_text('raise ImportError("this torch is broken (test)")\n')

    def hisparse(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "hisparse_core", *argv], env=subprocess_env(tmp_path),
                              capture_output=True, text=True, timeout=120, check=False)

    listing = hisparse("backends")
    assert listing.returncode == 0 and "reference_cpu" in listing.stdout, listing.stderr
    assert hisparse("--help").returncode == 0
    run = hisparse("run", "--no-progress")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    from hisparse_core.cli.options import TORCH_FIX

    assert run.stderr.strip().splitlines()[-1] == ("hisparse run: error: torch cannot be imported (ImportError: this "
                                                   f"torch is broken (test)): {TORCH_FIX}")
