"""Entry point of the `hisparse.backends` group: registers the reference CPU backend.

Imports nothing heavy. `hisparse_core`'s package `__init__` imports torch, so this module builds
its hook marker from pluggy directly (same project name, hence the same marker) and imports
`BackendSpec` only inside the hook.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

hookimpl = pluggy.HookimplMarker("hisparse")

NAME = "reference_cpu"
VERSION = "0.1.0"
#: The `Capability` strings of `ReferenceCpuBackend.capabilities`, spelled out so no torch is imported.
CAPABILITIES = frozenset({
    "row_format:fp8_ds_mla", "row_format:bf16_mla", "speculative_union", "index_sharing",
    "shared_host_pool", "async_transfers",
})


def probe() -> str | None:
    """The reference backend runs wherever torch does."""
    return None


@hookimpl
def hisparse_register_backends(register: Callable[[Any], None]) -> None:
    from hisparse_core.backend import BackendSpec

    register(BackendSpec(
        name=NAME,
        factory="hisparse_reference_cpu.backend:ReferenceCpuBackend",
        probe=probe,
        priority=0,
        capabilities=CAPABILITIES,
        version=VERSION,
        description="plain PyTorch on CPU tensors; the correctness oracle of every other backend",
    ))
