"""The portable Triton backend of hisparse: the resolver and every copy as Triton kernels.

Exports resolve lazily, so importing the entry-point module `hisparse_triton.plugin` (which
imports this package first) stays free of torch and triton.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hisparse_triton.backend import TritonBackend
    from hisparse_triton.host_pool import TritonHostPool
    from hisparse_triton.runtime import TritonRuntime
    from hisparse_triton.transfer import TritonTransferEngine

_EXPORTS = {
    "TritonBackend": "hisparse_triton.backend",
    "TritonHostPool": "hisparse_triton.host_pool",
    "TritonRuntime": "hisparse_triton.runtime",
    "TritonTransferEngine": "hisparse_triton.transfer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hisparse_triton' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
