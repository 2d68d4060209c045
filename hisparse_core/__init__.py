"""hisparse: host-resident KV cache for sparse-attention LLMs, with pluggable backends.

This package is platform-neutral: it never imports vLLM, CUDA or a backend. The names below are
resolved lazily (PEP 562), so `import hisparse_core.hookspecs` from a backend's entry-point
module does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "API_VERSION": "hisparse_core.backend",
    "Backend": "hisparse_core.backend",
    "BackendSpec": "hisparse_core.backend",
    "Capability": "hisparse_core.backend",
    "BackendError": "hisparse_core.errors",
    "BackendNotFoundError": "hisparse_core.errors",
    "BackendUnavailableError": "hisparse_core.errors",
    "CapacityError": "hisparse_core.errors",
    "HiSparseError": "hisparse_core.errors",
    "InvalidCommandError": "hisparse_core.errors",
    "InvalidInputError": "hisparse_core.errors",
    "ProtocolError": "hisparse_core.errors",
    "BF16_MLA": "hisparse_core.geometry",
    "FP8_DS_MLA": "hisparse_core.geometry",
    "RowFormat": "hisparse_core.geometry",
    "RuntimeConfig": "hisparse_core.geometry",
    "hookimpl": "hisparse_core.hookspecs",
    "HostPool": "hisparse_core.host_pool",
    "HostPoolSpec": "hisparse_core.host_pool",
    "CacheRuntime": "hisparse_core.runtime",
    "ResolveInputs": "hisparse_core.runtime",
    "ResolveResult": "hisparse_core.runtime",
    "RuntimeStats": "hisparse_core.runtime",
    "TransferEngine": "hisparse_core.transfer",
    "TransferProgress": "hisparse_core.transfer",
    "HostBlockCopy": "hisparse_core.types",
    "OffloadCommand": "hisparse_core.types",
    "PageTransfer": "hisparse_core.types",
    "ResidencyUpdate": "hisparse_core.types",
    "RowMirror": "hisparse_core.types",
    "WorkerMetadata": "hisparse_core.types",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hisparse_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # pragma: no cover
    from hisparse_core.backend import API_VERSION, Backend, BackendSpec, Capability
    from hisparse_core.errors import (
        BackendError,
        BackendNotFoundError,
        BackendUnavailableError,
        CapacityError,
        HiSparseError,
        InvalidCommandError,
        InvalidInputError,
        ProtocolError,
    )
    from hisparse_core.geometry import BF16_MLA, FP8_DS_MLA, RowFormat, RuntimeConfig
    from hisparse_core.hookspecs import hookimpl
    from hisparse_core.host_pool import HostPool, HostPoolSpec
    from hisparse_core.runtime import CacheRuntime, ResolveInputs, ResolveResult, RuntimeStats
    from hisparse_core.transfer import TransferEngine, TransferProgress
    from hisparse_core.types import (
        HostBlockCopy,
        OffloadCommand,
        PageTransfer,
        ResidencyUpdate,
        RowMirror,
        WorkerMetadata,
    )
