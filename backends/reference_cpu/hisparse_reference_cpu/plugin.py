"""Entry point of the `hisparse.backends` group: registers the reference CPU backend.

Imports nothing heavy: `hisparse_core.backend` and `hisparse_core.hookspecs` are torch-free, and
the backend class is named by a string the registry imports only on selection.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from hisparse_core.backend import BackendSpec, Capability
from hisparse_core.hookspecs import hookimpl

NAME = "reference_cpu"
VERSION = "0.1.0"
CAPABILITIES = frozenset({
    Capability.FP8_DS_MLA, Capability.BF16_MLA, Capability.SPECULATIVE_UNION, Capability.INDEX_SHARING,
    Capability.SHARED_HOST_POOL, Capability.ASYNC_TRANSFERS, Capability.VLLM_OPS,
})


def probe() -> str | None:
    """The reference backend runs wherever torch imports."""
    return None if importlib.util.find_spec("torch") is not None else "torch is not installed"


@hookimpl
def hisparse_register_backends(register: Callable[[BackendSpec], None]) -> None:
    register(BackendSpec(
        name=NAME,
        factory="hisparse_reference_cpu.backend:ReferenceCpuBackend",
        probe=probe,
        priority=0,
        capabilities=CAPABILITIES,
        version=VERSION,
        description="plain PyTorch on CPU tensors; the correctness oracle of every other backend",
    ))
