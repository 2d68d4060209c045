"""`ReferenceHostPool`: the host pool as a plain CPU tensor, private or shared through /dev/shm.

Layer-major: layer l is rows `[l * rows_per_layer, (l + 1) * rows_per_layer)` of one
`[num_layers * rows_per_layer, width]` buffer.

Shared mode maps one file `/dev/shm/hisparse_<name>.pool` into every rank: one OS page of header
(magic, creator, geometry, the rank table) followed by the rows. The file protocol is
`hisparse_core.shm`: rank 0 builds the file unnamed and names it once mapped; the name is removed
as soon as every rank has mapped the file, so a crash of any rank from then on leaves nothing in
/dev/shm.
"""

from __future__ import annotations

import mmap

import torch

from hisparse_core import shm
from hisparse_core.capacity import check_host_pool
from hisparse_core.errors import InvalidInputError
from hisparse_core.host_pool import OS_PAGE, HostPoolSpec, LayerMajorHostPool

_HEADER = shm.PoolHeader(b"HISPARSE-POOL-v2")
assert OS_PAGE == shm.HEADER_PAGE


def shm_path(name: str) -> str:
    """The /dev/shm file that backs the shared pool called `name`."""
    return shm.shm_path(name, ".pool")


class ReferenceHostPool(LayerMajorHostPool):
    """Private (`torch.zeros`) or shared (/dev/shm mmap) host pool on the CPU.

    Other backends reuse it (`hisparse_triton`): `HEADER` and `SUFFIX` name their own files, and
    `_allocate_private` / `_map` are where they allocate or map the rows their own way.
    """

    HEADER = _HEADER
    SUFFIX = ".pool"

    def __init__(self, spec: HostPoolSpec, *, peer_timeout_s: float = 60.0) -> None:
        if not isinstance(spec, HostPoolSpec):
            raise InvalidInputError(f"spec must be a HostPoolSpec, got {type(spec).__name__}")
        self.spec = spec
        self._path: str | None = None
        self._file: shm.PoolFile | None = None
        check_host_pool(spec, self._file_bytes() if spec.shared else None)
        rows = spec.num_layers * spec.rows_per_layer
        fmt = spec.row_format
        if not spec.shared:
            # Zeros rather than empty: unwritten rows then read the same on every run.
            self._rows: torch.Tensor | None = self._allocate_private(rows, fmt.width, fmt.dtype)
            return
        path = shm.shm_path(spec.name or "", self.SUFFIX)
        if spec.rank == 0:
            self._file = shm.create(path, self.HEADER, spec, self._file_bytes())
        else:
            self._file = shm.attach(path, self.HEADER, spec, self._file_bytes(), peer_timeout_s)
        try:
            self._rows = self._map(self._file.fd)
            if spec.rank == 0:
                self._file.publish()
                self._path = path
            else:
                self._file.mark_mapped(spec.rank)
        except BaseException:
            self._rows = None
            self._file.close()
            raise

    # ----------------------------------------------------------------- shared mode

    def _allocate_private(self, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros((rows, width), dtype=dtype)

    def _file_bytes(self) -> int:
        return OS_PAGE + -(-self.spec.nbytes // OS_PAGE) * OS_PAGE

    def _map(self, fd: int) -> torch.Tensor:
        fmt = self.spec.row_format
        mm = mmap.mmap(fd, self._file_bytes(), flags=mmap.MAP_SHARED)
        # The tensor keeps the mapping alive; it goes with the last view of it.
        data = torch.frombuffer(mm, dtype=torch.uint8, count=self.spec.nbytes, offset=OS_PAGE)
        return data.view(fmt.dtype).view(self.spec.num_layers * self.spec.rows_per_layer, fmt.width)

    @property
    def shm_file(self) -> shm.PoolFile | None:
        """This rank's handle on the shared pool file (None for a private pool)."""
        return self._file

# ----------------------------------------------------------------- HostPool

    def release(self) -> None:
        # The mapping itself goes away with the last tensor that refers to it; views handed out
        # earlier therefore stay memory-safe, they just stop being the pool.
        self._rows = None
        self._path = None
        if self._file is not None:
            self._file.close()
