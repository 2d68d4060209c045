"""Real vLLM engines in child processes: start one on a script of this folder, read its report.

Each script prints one `ENGINE_REPORT {json}` line at the end; an engine that fails, or prints
none, fails the test with the tail of its output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def start_engine(script: Path, *args: str, child_engine_core: bool = False) -> subprocess.Popen[str]:
    """Start `script args...` offline, in-process engine mode (no engine-core subprocess) unless
    `child_engine_core`."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="1" if child_engine_core else "0",
               VLLM_CPU_KVCACHE_SPACE="1")
    return subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)


def engine_report(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """Wait for the engine and return its report, with its whole output under "output"."""
    out, _ = proc.communicate(timeout=480)
    lines = [line for line in out.splitlines() if line.startswith("ENGINE_REPORT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"engine run failed (exit {proc.returncode}):\n{out[-6000:]}")
    return {"output": out, **json.loads(lines[-1].removeprefix("ENGINE_REPORT "))}
