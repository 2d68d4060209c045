"""docs/transformers.md's CPU example runs as written and prints what the page says it prints."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

PAGE = Path(__file__).resolve().parents[2] / "docs" / "transformers.md"


def test_the_cpu_example_runs_and_prints_its_comment() -> None:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    example = next(b for b in blocks if "tiny_model" in b)
    assert re.search(r"# e\.g\. \d+ \d+ \d+ True\n", example), "the example's last line says what it prints"
    out = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    # The counts depend on the CPU's float summation order (the tiny model's top-k has many near
    # ties); what the page promises is that pages went back to host, rows came back through the
    # hot buffer, and the tokens are the model's own.
    hits, misses, released, same = out.stdout.strip().splitlines()[-1].split()
    assert int(hits) > 0 and int(misses) > 0 and int(released) > 0 and same == "True", out.stdout
