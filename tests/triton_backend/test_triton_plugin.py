"""The triton backend's entry point: probe reasons, priorities and selection. Runs without triton."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hisparse_core.backend import BackendSpec
from hisparse_core.errors import BackendUnavailableError
from hisparse_core.registry import get_registry, select_backend
from hisparse_triton import plugin


def registered() -> BackendSpec:
    specs: list[BackendSpec] = []
    plugin.hisparse_register_backends(specs.append)
    (spec,) = specs
    return spec


def test_probe_without_triton_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugin, "triton_version", lambda: None)
    assert plugin.probe() == "triton is not installed: pip install 'hisparse[triton]'"


@pytest.mark.parametrize("version", [(3, 5), (2, 3), (3, 10), (4, 0)])
def test_probe_outside_the_tested_range(monkeypatch: pytest.MonkeyPatch, version: tuple[int, int]) -> None:
    monkeypatch.setattr(plugin, "triton_version", lambda: version)
    reason = plugin.probe()
    assert reason == (f"triton {version[0]}.{version[1]} is outside the tested range >=3.6,<3.10: "
                      "pip install 'hisparse[triton]'")


@pytest.mark.parametrize("version", [(3, 6), (3, 9)])
def test_probe_interpreted_is_available(monkeypatch: pytest.MonkeyPatch, version: tuple[int, int]) -> None:
    monkeypatch.setattr(plugin, "triton_version", lambda: version)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert plugin.probe() is None


def test_probe_without_gpu_or_interpreter_says_how(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(plugin, "triton_version", lambda: (3, 9))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    reason = plugin.probe()
    assert reason is not None and "no GPU for Triton to compile for" in reason and "TRITON_INTERPRET=1" in reason


def test_probe_without_a_gpu_driver_imports_no_torch() -> None:
    """`hisparse backends` on a CPU machine stays torch-free with triton installed."""
    if any(plugin._loads(lib) for lib in plugin.GPU_DRIVERS):
        pytest.skip("a GPU driver is present: the probe asks torch.cuda")
    code = ("import sys, hisparse_triton.plugin as p; p.triton_version = lambda: (3, 9); print(p.probe()); "
            "print('torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
                         timeout=120).stdout.splitlines()
    assert out[-1] == "False", out
    assert "no CUDA or ROCm driver" in out[0] and "TRITON_INTERPRET=1" in out[0], out


def test_priorities_keep_nvidia_first_and_the_interpreter_out_of_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert 0 < registered().priority < 100  # between reference_cpu and nvidia
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert registered().priority < 0  # below reference_cpu: auto never picks the interpreter
    assert registered().capabilities == plugin.CAPABILITIES


def test_entry_point_module_imports_nothing_heavy() -> None:
    code = ("import sys, hisparse_triton.plugin as p; p.hisparse_register_backends(lambda s: None); "
            "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_explicit_selection_on_a_cpu_without_the_interpreter_is_one_clear_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: triton compiles for it")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    get_registry(reload=True)
    try:
        with pytest.raises(BackendUnavailableError, match="triton"):
            select_backend("triton")
    finally:
        get_registry(reload=True)


def test_backends_listing_names_triton() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "hisparse_core", "backends"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "triton" in out.stdout
