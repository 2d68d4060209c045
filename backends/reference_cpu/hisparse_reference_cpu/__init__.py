"""The reference CPU backend of hisparse: plain PyTorch, the oracle every backend is compared with.

Exports resolve lazily, so importing the entry-point module `hisparse_reference_cpu.plugin` (which
imports this package first) stays free of torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hisparse_reference_cpu.backend import ReferenceCpuBackend
    from hisparse_reference_cpu.host_pool import ReferenceHostPool
    from hisparse_reference_cpu.runtime import ReferenceRuntime
    from hisparse_reference_cpu.transfer import ReferenceTransferEngine

_EXPORTS = {
    "ReferenceCpuBackend": "hisparse_reference_cpu.backend",
    "ReferenceHostPool": "hisparse_reference_cpu.host_pool",
    "ReferenceRuntime": "hisparse_reference_cpu.runtime",
    "ReferenceTransferEngine": "hisparse_reference_cpu.transfer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hisparse_reference_cpu' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
