"""`NvidiaBackend`: factories of the CUDA backend for one worker process and one GPU."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from hisparse_core.backend import Backend, Capability
from hisparse_core.errors import InvalidInputError
from hisparse_core.geometry import ROW_FORMATS, RuntimeConfig
from hisparse_core.host_pool import HostPool, HostPoolSpec
from hisparse_core.runtime import CacheRuntime
from hisparse_core.transfer import TransferEngine
from hisparse_core.vllm_ops import VllmHiSparseOps
from hisparse_nvidia.plugin import VERSION


class NvidiaBackend(Backend):
    """Host pool, runtimes and transfer engine on one CUDA device.

    `device` defaults to PyTorch's current CUDA device. Construction allocates nothing; the
    kernels are compiled (or loaded from the disk cache) by the first `create_runtime`.
    """

    name: ClassVar[str] = "nvidia"
    version: ClassVar[str] = VERSION
    capabilities: ClassVar[frozenset[str]] = frozenset({
        Capability.FP8_DS_MLA, Capability.BF16_MLA, Capability.SPECULATIVE_UNION, Capability.INDEX_SHARING,
        Capability.SHARED_HOST_POOL, Capability.CUDA_GRAPH, Capability.ASYNC_TRANSFERS, Capability.VLLM_OPS,
    })

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        if not torch.cuda.is_available():
            raise InvalidInputError("NvidiaBackend needs a CUDA device; torch.cuda.is_available() is False")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if device.type != "cuda":
            raise InvalidInputError(f"NvidiaBackend runs on a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if not 0 <= device.index < torch.cuda.device_count():
            raise InvalidInputError(f"CUDA device {device.index} does not exist; {torch.cuda.device_count()} found")
        self._device = device
        self._props: tuple[int, int, int] | None = None

    @classmethod
    def check_settings(cls) -> None:
        """Every `HISPARSE_*` tuning variable of this backend (`hisparse_nvidia.settings.check_settings`):
        the runtime's, the host pool's, the kernel builds', vLLM's op set's and the kernel cache's, each
        by the parse function its build uses. Asks no device and imports no CUDA binding: bounds that
        need the GPU (blocks per SM) are checked again when a runtime is built."""
        from hisparse_nvidia.settings import check_settings

        check_settings()

    @property
    def device(self) -> torch.device:
        return self._device

    def _device_props(self) -> tuple[int, int, int]:
        """(compute capability as 90, multiprocessors, opt-in shared memory per block)."""
        if self._props is None:
            from cuda.bindings import driver as cu

            from hisparse_nvidia import driver

            driver.ensure_context(self._device)
            major, minor = torch.cuda.get_device_capability(self._device)
            attr = cu.CUdevice_attribute
            sms = driver.device_attribute(self._device, attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            smem = driver.device_attribute(self._device, attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            self._props = (major * 10 + minor, sms, smem)
        return self._props

    def create_host_pool(self, spec: HostPoolSpec) -> HostPool:
        from hisparse_nvidia.host_pool import NvidiaHostPool

        _check_format(spec)
        return NvidiaHostPool(spec, self._device)

    def create_runtime(self, config: RuntimeConfig) -> CacheRuntime:
        from hisparse_nvidia.runtime import NvidiaRuntime

        _check_format(config)
        arch, sms, smem = self._device_props()
        return NvidiaRuntime(config, self._device, arch=arch, num_sms=sms, max_smem_per_block=smem)

    def create_transfer_engine(self, host_pool: HostPool, runtimes: Sequence[CacheRuntime]) -> TransferEngine:
        from hisparse_nvidia.transfer import NvidiaTransferEngine

        return NvidiaTransferEngine(host_pool, runtimes)

    def vllm_ops(self) -> VllmHiSparseOps:
        from hisparse_nvidia.vllm_ops import NvidiaVllmOps

        return NvidiaVllmOps(self)

    def describe(self) -> dict[str, object]:
        out = super().describe()
        out["gpu"] = torch.cuda.get_device_name(self._device)
        return out


def _check_format(owner: object) -> None:
    if not isinstance(owner, (HostPoolSpec, RuntimeConfig)):
        raise InvalidInputError(f"expected a HostPoolSpec or RuntimeConfig, got {type(owner).__name__}")
    name = owner.row_format.name
    if name not in ROW_FORMATS:
        raise InvalidInputError(f"row format {name!r} is not served by nvidia; expected one of {sorted(ROW_FORMATS)}")
