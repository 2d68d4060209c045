"""`TritonBackend`: factories of the portable Triton backend for one worker process and one device."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from hisparse_core.backend import Backend
from hisparse_core.errors import InvalidInputError
from hisparse_core.geometry import ROW_FORMATS, RuntimeConfig
from hisparse_core.host_pool import HostPool, HostPoolSpec
from hisparse_core.runtime import CacheRuntime
from hisparse_core.transfer import TransferEngine
from hisparse_core.vllm_ops import VllmHiSparseOps
from hisparse_triton.plugin import CAPABILITIES, ENV_INTERPRET, VERSION, interpreted

CPU = torch.device("cpu")


class TritonBackend(Backend):
    """Host pool, runtimes and transfer engine whose kernels are Triton's.

    Compiled, it runs on a GPU that `torch.cuda` drives (`device` defaults to the current one);
    with `TRITON_INTERPRET=1` the kernels run in Triton's interpreter on CPU tensors and `device`
    is the CPU. Construction allocates nothing and imports no kernel; the kernels compile on their
    first launch (Triton caches them on disk).
    """

    name: ClassVar[str] = "triton"
    version: ClassVar[str] = VERSION
    capabilities: ClassVar[frozenset[str]] = CAPABILITIES

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        if interpreted():
            dev = CPU if device is None else torch.device(device) if not isinstance(device, int) else None
            if dev is None or dev.type != "cpu":
                raise InvalidInputError(f"the triton backend under {ENV_INTERPRET}=1 runs on the CPU, got device "
                                        f"{device!r}; unset {ENV_INTERPRET} to compile for a GPU")
            self._device = CPU
            return
        if not torch.cuda.is_available():
            raise InvalidInputError(f"the triton backend needs a GPU that torch.cuda sees, or {ENV_INTERPRET}=1 for "
                                    "Triton's interpreter on the CPU; torch.cuda.is_available() is False")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if dev.type != "cuda":
            raise InvalidInputError(f"the triton backend compiles for a CUDA (or ROCm) device, got {dev}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if not 0 <= dev.index < torch.cuda.device_count():
            raise InvalidInputError(f"CUDA device {dev.index} does not exist; {torch.cuda.device_count()} found")
        self._device = dev

    @classmethod
    def check_settings(cls) -> None:
        """The `HISPARSE_TRITON_*` variables, as a runtime's construction checks them (`auto.check`):
        each value, the rules across them and `HISPARSE_TRITON_AUTO`. Without a device: under the
        interpreter and on ROCm there is no programmatic dependent launch; on CUDA only the GPU's
        compute capability tells, so the runtime checks `HISPARSE_TRITON_PDL` there."""
        import os

        from hisparse_triton import auto

        if interpreted():
            pdl, found, rocm = False, auto.INTERPRETER, None
        elif torch.version.hip:
            import triton  # its version decides HISPARSE_TRITON_CAS there; importing it compiles nothing

            pdl, found, rocm = False, f"a ROCm GPU (HIP {torch.version.hip})", triton.__version__
        else:
            pdl, found, rocm = True, "", None
        auto.check(os.environ, pdl=pdl, found=lambda: found, rocm_triton=rocm)

    @property
    def device(self) -> torch.device:
        return self._device

    def create_host_pool(self, spec: HostPoolSpec) -> HostPool:
        from hisparse_triton.host_pool import TritonHostPool

        _check_format(spec)
        return TritonHostPool(spec, self._device)

    def create_runtime(self, config: RuntimeConfig) -> CacheRuntime:
        from hisparse_triton.runtime import TritonRuntime

        _check_format(config)
        return TritonRuntime(config, self._device)

    def create_transfer_engine(self, host_pool: HostPool, runtimes: Sequence[CacheRuntime]) -> TransferEngine:
        from hisparse_triton.transfer import TritonTransferEngine

        return TritonTransferEngine(host_pool, runtimes)

    def vllm_ops(self) -> VllmHiSparseOps:
        from hisparse_triton.vllm_ops import TritonVllmOps

        return TritonVllmOps(self)

    def describe(self) -> dict[str, object]:
        import triton

        out = super().describe()
        out["triton"] = triton.__version__
        out["mode"] = "interpreted" if self._device.type == "cpu" else "compiled"
        if self._device.type == "cuda":
            out["gpu"] = torch.cuda.get_device_name(self._device)
        return out


def _check_format(owner: object) -> None:
    if not isinstance(owner, (HostPoolSpec, RuntimeConfig)):
        raise InvalidInputError(f"expected a HostPoolSpec or RuntimeConfig, got {type(owner).__name__}")
    name = owner.row_format.name
    if name not in ROW_FORMATS:
        raise InvalidInputError(f"row format {name!r} is not served by triton; expected one of {sorted(ROW_FORMATS)}")
