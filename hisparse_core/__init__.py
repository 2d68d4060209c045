"""hisparse: host-resident KV cache for sparse-attention LLMs, with pluggable backends.

This package is platform-neutral: it never imports vLLM, CUDA or a backend at import time.
"""

from __future__ import annotations

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

__version__ = "0.1.0"

__all__ = [
    "API_VERSION", "BF16_MLA", "FP8_DS_MLA", "Backend", "BackendError", "BackendNotFoundError", "BackendSpec",
    "BackendUnavailableError", "CacheRuntime", "Capability", "CapacityError", "HiSparseError", "HostBlockCopy",
    "HostPool", "HostPoolSpec", "InvalidCommandError", "InvalidInputError", "OffloadCommand", "PageTransfer",
    "ProtocolError", "ResidencyUpdate", "ResolveInputs", "ResolveResult", "RowFormat", "RowMirror",
    "RuntimeConfig", "RuntimeStats", "TransferEngine", "TransferProgress", "WorkerMetadata", "__version__",
    "hookimpl",
]
