"""Entry point of the `hisparse.backends` group: registers the NVIDIA CUDA backend.

Imports nothing heavy at module level (no torch, no CUDA): every process that lists or selects a
backend imports every plugin. The probe runs only when the registry asks and answers, cheapest
check first, why the backend cannot run here.
"""

from __future__ import annotations

import ctypes
import importlib.util
from collections.abc import Callable

from hisparse_core.backend import BackendSpec, Capability
from hisparse_core.hookspecs import hookimpl

NAME = "nvidia"
VERSION = "0.1.0"
CAPABILITIES = frozenset({
    Capability.FP8_DS_MLA, Capability.BF16_MLA, Capability.SPECULATIVE_UNION, Capability.INDEX_SHARING,
    Capability.SHARED_HOST_POOL, Capability.CUDA_GRAPH, Capability.ASYNC_TRANSFERS, Capability.VLLM_OPS,
})


def probe() -> str | None:
    """None when an NVIDIA GPU is usable here, else the reason it is not.

    The machine comes first: without a CUDA driver no package makes this backend run, so the
    reason names the missing GPU rather than a pip install that cannot help."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "needs a CUDA GPU: no NVIDIA driver here (libcuda.so.1 not found)"
    if importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None:
        return "cuda-python not installed: pip install 'hisparse[nvidia]'"
    import torch

    if torch.version.cuda is None:
        return "torch has no CUDA (CPU build)"
    # device_count() asks NVML before CUDA is initialized (cudaGetDeviceCount only where NVML fails);
    # is_available() calls cudaGetDeviceCount unless PYTORCH_NVML_BASED_CUDA_CHECK=1 (which `import
    # vllm` sets, so inside vLLM both ask NVML), and that poisons fork: a process that probes and then
    # forks (vLLM's front end and engine core do; so may any program that lists backends) leaves
    # children whose first CUDA call raises "Cannot re-initialize CUDA in forked subprocess".
    if torch.cuda.device_count() == 0:
        return "no CUDA device"
    try:
        from cuda.bindings import nvrtc

        err, *_ = nvrtc.nvrtcVersion()
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            return "NVRTC unavailable: pip install 'cuda-python[all]'"
    except Exception as exc:  # noqa: BLE001 - a missing libnvrtc raises from cuda.pathfinder
        return f"NVRTC unavailable ({type(exc).__name__}): pip install 'hisparse[nvidia]'"
    return None


@hookimpl
def hisparse_register_backends(register: Callable[[BackendSpec], None]) -> None:
    register(BackendSpec(
        name=NAME,
        factory="hisparse_nvidia.backend:NvidiaBackend",
        probe=probe,
        priority=100,
        capabilities=CAPABILITIES,
        version=VERSION,
        description="CUDA: fused GPU resolver with exact LRU, zero-copy multi-block gathers, NVRTC-built kernels",
    ))
