"""`TritonHostPool`: the host pool of the triton backend, pinned through torch on a GPU.

The layout and the shared-pool file protocol are reference_cpu's (`ReferenceHostPool`, itself on
`hisparse_core.shm`), with this backend's own magic and suffix (`/dev/shm/hisparse_<name>.trpool`):

- On a GPU a private pool is `torch.zeros(..., pin_memory=True)`, and a shared pool's mapping is
  registered with `cudaHostRegister` through `torch.cuda.cudart()` (unregistered at `release`),
  so the kernels read and write it directly (zero copy) through its host address.
- In Triton's interpreter (device CPU) nothing is pinned: it is reference_cpu's pool.

Shared mode: only rank 0 writes. The header page keeps, at `DONE_EPOCH_OFFSET`, the number of
host-write epochs rank 0 has seen complete (`TritonTransferEngine`); peers acknowledge their
transfers against it. After it, up to `ipc.CHANNEL_END`, rank 0's interprocess event channel
(`hisparse_triton.ipc`), through which peers order their reads behind rank 0's writes on the GPU.
"""

from __future__ import annotations

import mmap

import torch

from hisparse_core import shm
from hisparse_core.errors import CapacityError
from hisparse_core.host_pool import OS_PAGE, HostPoolSpec
from hisparse_reference_cpu.host_pool import ReferenceHostPool

_HEADER = shm.PoolHeader(b"HISPARSE-TRPOOL1")
#: Byte offset in the header page of rank 0's completed host-write epoch (uint64).
DONE_EPOCH_OFFSET = 512
assert _HEADER.size <= DONE_EPOCH_OFFSET and DONE_EPOCH_OFFSET + 8 <= 520  # 520..: hisparse_triton.ipc


def shm_path(name: str) -> str:
    """The /dev/shm file that backs the shared pool called `name`."""
    return shm.shm_path(name, TritonHostPool.SUFFIX)


class TritonHostPool(ReferenceHostPool):
    """Private or shared host pool; pinned (page-locked, GPU-addressable) when `device` is a GPU."""

    HEADER = _HEADER
    SUFFIX = ".trpool"

    def __init__(self, spec: HostPoolSpec, device: torch.device, *, peer_timeout_s: float = 60.0) -> None:
        self.device = device
        self._pin = device.type == "cuda"
        self._registered: int | None = None  # host address registered with cudaHostRegister
        self._header: torch.Tensor | None = None  # shared mode: the header page as int64 words
        self._header_bytes: torch.Tensor | None = None  # ... and as bytes
        super().__init__(spec, peer_timeout_s=peer_timeout_s)

    def _allocate_private(self, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        try:
            return torch.zeros((rows, width), dtype=dtype, pin_memory=self._pin)
        except RuntimeError as exc:
            raise CapacityError(f"could not allocate {rows * width * dtype.itemsize} bytes of pinned host memory: "
                                f"{exc}") from exc

    def _map(self, fd: int) -> torch.Tensor:
        mm = mmap.mmap(fd, self._file_bytes(), flags=mmap.MAP_SHARED)
        self._header_bytes = torch.frombuffer(mm, dtype=torch.uint8, count=OS_PAGE)
        self._header = self._header_bytes.view(torch.int64)
        data = torch.frombuffer(mm, dtype=torch.uint8, count=self.spec.nbytes, offset=OS_PAGE)
        if self._pin:
            err = torch.cuda.cudart().cudaHostRegister(data.data_ptr(), self.spec.nbytes, 0)
            if int(err) != 0:
                raise CapacityError(f"cudaHostRegister of the shared host pool ({self.spec.nbytes} bytes) failed "
                                    f"with error {int(err)}")
            self._registered = data.data_ptr()
        fmt = self.spec.row_format
        return data.view(fmt.dtype).view(self.spec.num_layers * self.spec.rows_per_layer, fmt.width)

    @property
    def done_epoch(self) -> int:
        """Shared mode: host-write epochs rank 0 has seen complete (0 for a private pool)."""
        return int(self._header[DONE_EPOCH_OFFSET // 8]) if self._header is not None else 0

    @property
    def header_bytes(self) -> torch.Tensor | None:
        """Shared mode: the pool's header page as a uint8 tensor over the shared mapping (None for a
        private pool); `hisparse_triton.ipc` keeps rank 0's event handle there."""
        return self._header_bytes

    def mark_done(self, epoch: int) -> None:
        """Rank 0: publish that every host write up to `epoch` has landed."""
        if self._header is not None:
            self._header[DONE_EPOCH_OFFSET // 8] = epoch

    def release(self) -> None:
        if self._registered is not None:
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = None
        self._header = None
        self._header_bytes = None
        super().release()
