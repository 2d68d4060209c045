"""The README's set-up commands stay the ones CI runs; the `hisparse backends` example of the docs'
command page (docs/cli.md) is what the command prints."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from core_support import subprocess_env

ROOT = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    readme = ROOT / "README.md"
    if not readme.exists():
        pytest.skip("README.md is not in this checkout")
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", readme.read_text(), flags=re.S)]


def test_ci_runs_exactly_the_readme_test_command() -> None:
    test_commands = [c for c in readme_commands() if c.endswith("python -m pytest")]
    assert len(test_commands) == 1, test_commands
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_commands[0] in ci
    assert "set -euo pipefail" in ci


def test_readme_set_up_commands_start_from_a_fresh_venv() -> None:
    setup = [c for c in readme_commands() if c.startswith("python3 -m venv .venv")]
    assert [c.rsplit("&& ", 1)[-1] for c in setup] == ["hisparse generate", "python -m pytest"]
    for command in setup:
        assert "pip install torch==2.13.0 && pip install -e " in command


def test_install_page_gives_the_readme_commands() -> None:
    """docs/install.md repeats the README's two set-up commands; they stay the same commands."""
    page = (ROOT / "docs" / "install.md").read_text()
    on_page = [b.strip() for b in re.findall(r"```bash\n(.*?)```", page, flags=re.S) if b.startswith("python3 -m venv")]
    assert on_page == [c for c in readme_commands() if c.startswith("python3 -m venv .venv")]


#: The page that shows `hisparse backends`' output.
CLI_PAGE = ROOT / "docs" / "cli.md"

#: `hisparse backends` as a CPU-only machine with the triton extra and without the nvidia one runs it
#: (cuda-python hidden from the import system, as if not installed), in an 80-column terminal.
_BACKENDS_AS_IN_DOCS = """
import importlib.machinery, runpy, sys
find = importlib.machinery.PathFinder.find_spec
def find_spec(cls, fullname, path=None, target=None):
    return None if fullname.split(".", 1)[0] == "cuda" else find(fullname, path, target)
importlib.machinery.PathFinder.find_spec = classmethod(find_spec)
sys.argv = ["hisparse", "backends"]
runpy.run_module("hisparse_core", run_name="__main__")
"""


def test_docs_backends_example_is_what_the_command_prints() -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("the example in docs/cli.md has the triton extra installed")
    for driver in ("libcuda.so.1", "libamdhip64.so"):
        try:
            ctypes.CDLL(driver)
        except OSError:
            continue
        pytest.skip(f"the example in docs/cli.md is of a CPU-only machine; {driver} loads here")
    if not CLI_PAGE.exists():
        pytest.skip("docs/cli.md is not in this checkout")
    text = CLI_PAGE.read_text()
    block = re.search(r"```console\n\$ hisparse backends .*?\n(.*?)```", text, flags=re.S)
    assert block is not None, "docs/cli.md has no `hisparse backends` example"
    proc = subprocess.run([sys.executable, "-c", _BACKENDS_AS_IN_DOCS], capture_output=True, text=True,
                          timeout=120, check=False, env=subprocess_env(COLUMNS="80"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == block.group(1), proc.stdout


def _results_data() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((ROOT / "docs" / "figures" / "results.json").read_text())
    return data


def test_results_page_gives_every_figure_its_command() -> None:
    """docs/results.md shows, beside each plotted dataset, the command that measured it."""
    page = (ROOT / "docs" / "results.md").read_text()
    datasets = {name: d for name, d in _results_data().items() if isinstance(d, dict)}
    assert datasets
    for name, d in datasets.items():
        assert d["source"] and d["command"], name
        assert f"`{d['command']}`" in page, f"docs/results.md lacks {name}'s command: {d['command']}"


def test_results_plots_are_drawn_from_the_data(tmp_path: Path) -> None:
    """Every plot docs/results.md shows is one bench/plot_results.py draws, and it draws them all."""
    pytest.importorskip("matplotlib")
    page = (ROOT / "docs" / "results.md").read_text()
    shown = re.findall(r"!\[[^\]]*\]\(figures/([^)]+\.png)\)", page)
    assert shown and len(shown) == len(set(shown)), shown
    for name in shown:
        assert (ROOT / "docs" / "figures" / name).is_file(), name
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "plot_results.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, check=False, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr
    drawn = sorted(p.name for p in tmp_path.glob("*.png"))
    assert drawn == sorted(shown), (drawn, shown)
    assert all((tmp_path / name).stat().st_size > 10_000 for name in drawn)
