"""The README's set-up commands stay the ones CI runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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
