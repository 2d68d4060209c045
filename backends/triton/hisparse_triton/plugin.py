"""Entry point of the `hisparse.backends` group: registers the portable Triton backend.

Imports nothing heavy (no torch, no triton): every process that lists or selects a backend
imports every plugin. The probe answers, cheapest check first, why the backend cannot run here.

Where it runs, and how `auto` treats it:

- **Compiled** for the GPU that torch sees (`torch.cuda`: NVIDIA, or AMD through ROCm): available,
  priority 50, so `auto` prefers nvidia (100) on NVIDIA and takes triton over reference_cpu (0)
  where nvidia cannot run.
- **Interpreted** (`TRITON_INTERPRET=1`, Triton's interpreter runs the kernels on CPU tensors,
  for tests): available with priority -10, so `auto` never picks the slow interpreter; choose it
  by name (`--backend triton`, `HISPARSE_BACKEND=triton`).
- Otherwise unavailable, with the reason and what to install or set.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import re
from collections.abc import Callable

from hisparse_core.backend import BackendSpec, Capability
from hisparse_core.hookspecs import hookimpl

NAME = "triton"
VERSION = "0.1.0"
#: The Triton releases the backend is tested against (pyproject's `.[triton]` extra says the same).
TRITON_MIN = (3, 6)
TRITON_BELOW = (3, 10)
TRITON_RANGE = ">=3.6,<3.10"
INSTALL = "pip install 'hisparse[triton]'"
ENV_INTERPRET = "TRITON_INTERPRET"
#: The driver libraries of the GPUs torch.cuda drives (NVIDIA, AMD ROCm); without one there is no GPU.
GPU_DRIVERS = ("libcuda.so.1", "libamdhip64.so")
PRIORITY_COMPILED = 50
PRIORITY_INTERPRETED = -10
CAPABILITIES = frozenset({
    Capability.FP8_DS_MLA, Capability.BF16_MLA, Capability.SPECULATIVE_UNION, Capability.INDEX_SHARING,
    Capability.SHARED_HOST_POOL, Capability.CUDA_GRAPH, Capability.ASYNC_TRANSFERS, Capability.VLLM_OPS,
})


def _loads(library: str) -> bool:
    try:
        ctypes.CDLL(library)
    except OSError:
        return False
    return True


def interpreted() -> bool:
    """Whether Triton runs its kernels in its interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get(ENV_INTERPRET, "0") not in ("", "0")


def triton_version() -> tuple[int, int] | None:
    """The installed Triton's (major, minor), None when it is not installed."""
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        text = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        import triton  # an unpackaged build: ask the module

        text = triton.__version__
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def probe() -> str | None:
    """None when the Triton backend can run here, else the reason it cannot."""
    version = triton_version()
    if version is None:
        return f"triton is not installed: {INSTALL}"
    if not TRITON_MIN <= version < TRITON_BELOW:
        return (f"triton {version[0]}.{version[1]} is outside the tested range {TRITON_RANGE}: {INSTALL}")
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    if interpreted():
        return None
    if not any(_loads(lib) for lib in GPU_DRIVERS):
        # Asked before torch: listing backends on a machine without a GPU stays torch-free.
        return f"no GPU for Triton to compile for (no CUDA or ROCm driver); {ENV_INTERPRET}=1 interprets it on the CPU"

    import torch

    if torch.cuda.device_count() == 0:     # NVML (or amdsmi), not cudaGetDeviceCount: see nvidia's probe
        return f"no GPU for Triton to compile for (torch sees none); {ENV_INTERPRET}=1 interprets it on the CPU"

    return None


@hookimpl
def hisparse_register_backends(register: Callable[[BackendSpec], None]) -> None:
    interp = interpreted()
    register(BackendSpec(
        name=NAME,
        factory="hisparse_triton.backend:TritonBackend",
        probe=probe,
        priority=PRIORITY_INTERPRETED if interp else PRIORITY_COMPILED,
        capabilities=CAPABILITIES,
        version=VERSION,
        description=("Triton: portable fused resolver with exact LRU and plan copies" +
                     (" (in Triton's interpreter on the CPU: selected by name only)" if interp else "")),
    ))
