"""`ReferenceCpuBackend`: factories of the plain-PyTorch CPU backend, the oracle of every other one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from hisparse_core.backend import Backend, Capability
from hisparse_core.checks import check_int
from hisparse_core.errors import InvalidInputError
from hisparse_core.geometry import ROW_FORMATS, RuntimeConfig
from hisparse_core.host_pool import HostPool, HostPoolSpec
from hisparse_core.runtime import CacheRuntime
from hisparse_core.transfer import TransferEngine
from hisparse_core.vllm_ops import VllmHiSparseOps
from hisparse_reference_cpu.host_pool import ReferenceHostPool
from hisparse_reference_cpu.runtime import ReferenceRuntime
from hisparse_reference_cpu.transfer import ReferenceTransferEngine

VERSION = "0.1.0"


class ReferenceCpuBackend(Backend):
    """Host pool, runtimes and transfer engine in plain PyTorch on CPU tensors.

    `completion_lag` is how many polls after its enqueue report a transfer is reported completed
    (0 reports both at once, like a synchronous backend).
    """

    name: ClassVar[str] = "reference_cpu"
    version: ClassVar[str] = VERSION
    capabilities: ClassVar[frozenset[str]] = frozenset({
        Capability.FP8_DS_MLA, Capability.BF16_MLA, Capability.SPECULATIVE_UNION, Capability.INDEX_SHARING,
        Capability.SHARED_HOST_POOL, Capability.ASYNC_TRANSFERS, Capability.VLLM_OPS,
    })

    def __init__(self, *, completion_lag: int = 1) -> None:
        self._completion_lag = check_int("completion_lag", completion_lag, 0, 1 << 31)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def create_host_pool(self, spec: HostPoolSpec) -> HostPool:
        _check_format(spec.row_format.name if isinstance(spec, HostPoolSpec) else None, spec)
        return ReferenceHostPool(spec)

    def create_runtime(self, config: RuntimeConfig) -> CacheRuntime:
        _check_format(config.row_format.name if isinstance(config, RuntimeConfig) else None, config)
        return ReferenceRuntime(config)

    def create_transfer_engine(self, host_pool: HostPool, runtimes: Sequence[CacheRuntime]) -> TransferEngine:
        return ReferenceTransferEngine(host_pool, runtimes, completion_lag=self._completion_lag)

    def vllm_ops(self) -> VllmHiSparseOps:
        from hisparse_reference_cpu.vllm_ops import ReferenceVllmOps

        return ReferenceVllmOps()


def _check_format(name: str | None, owner: object) -> None:
    if name is None:
        raise InvalidInputError(f"expected a HostPoolSpec or RuntimeConfig, got {type(owner).__name__}")
    if name not in ROW_FORMATS:
        raise InvalidInputError(f"row format {name!r} is not served by reference_cpu; expected one of "
                                f"{sorted(ROW_FORMATS)}")
