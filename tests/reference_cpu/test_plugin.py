"""The entry-point module is light and registers a spec that matches the backend class."""

from __future__ import annotations

import subprocess
import sys

import pluggy

from hisparse_core.backend import API_VERSION, BackendSpec, Capability
from hisparse_core.hookspecs import PROJECT
from hisparse_reference_cpu import plugin
from hisparse_reference_cpu.backend import ReferenceCpuBackend


def test_plugin_module_imports_no_torch() -> None:
    code = "import sys, hisparse_reference_cpu.plugin; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_hook_registers_the_reference_backend() -> None:
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(__import__("hisparse_core.hookspecs", fromlist=["x"]))
    pm.register(plugin, "reference_cpu")
    specs: list[BackendSpec] = []
    pm.hook.hisparse_register_backends(register=specs.append)
    (spec,) = specs
    assert spec.name == ReferenceCpuBackend.name == "reference_cpu"
    assert spec.priority == 0 and spec.probe() is None and spec.api_version == API_VERSION
    assert spec.capabilities == ReferenceCpuBackend.capabilities <= Capability.ALL
    assert Capability.CUDA_GRAPH not in spec.capabilities
    assert spec.version == ReferenceCpuBackend.version
    module, cls = spec.factory.split(":")
    assert getattr(__import__(module, fromlist=[cls]), cls) is ReferenceCpuBackend
    assert ReferenceCpuBackend().device.type == "cpu"
