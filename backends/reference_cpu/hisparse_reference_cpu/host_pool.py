"""`ReferenceHostPool`: the host pool as a plain CPU tensor, private or shared through /dev/shm.

Layer-major: layer l is rows `[l * rows_per_layer, (l + 1) * rows_per_layer)` of one
`[num_layers * rows_per_layer, width]` buffer.

Shared mode maps one file `/dev/shm/hisparse_<name>.pool` into every rank. The file starts with
one OS page of header (magic, creator pid, geometry) followed by the rows. Rank 0 builds it under
a temporary name and renames it into place, so a peer never maps a half-built file; a peer also
waits while the header names a dead creator, which is how a stale file left by a crashed rank 0
is told apart from the live one that replaces it (the protocol is `hisparse_core.shm`).
"""

from __future__ import annotations

import os

import torch

from hisparse_core import shm
from hisparse_core.errors import InvalidInputError
from hisparse_core.host_pool import OS_PAGE, HostPoolSpec, LayerMajorHostPool

_HEADER = shm.PoolHeader(b"HISPARSE-POOL-v1")


def shm_path(name: str) -> str:
    """The /dev/shm file that backs the shared pool called `name`."""
    return shm.shm_path(name, ".pool")


class ReferenceHostPool(LayerMajorHostPool):
    """Private (`torch.zeros`) or shared (/dev/shm mmap) host pool on the CPU."""

    def __init__(self, spec: HostPoolSpec, *, peer_timeout_s: float = 60.0) -> None:
        if not isinstance(spec, HostPoolSpec):
            raise InvalidInputError(f"spec must be a HostPoolSpec, got {type(spec).__name__}")
        self.spec = spec
        self._path: str | None = None
        self._inode: int | None = None
        rows = spec.num_layers * spec.rows_per_layer
        fmt = spec.row_format
        if not spec.shared:
            # Zeros rather than empty: unwritten rows then read the same on every run.
            self._rows: torch.Tensor | None = torch.zeros((rows, fmt.width), dtype=fmt.dtype)
        elif spec.rank == 0:
            self._rows = self._create(shm_path(spec.name or ""))
        else:
            self._rows = self._attach(shm_path(spec.name or ""), peer_timeout_s)

    # ----------------------------------------------------------------- shared mode

    def _file_bytes(self) -> int:
        return OS_PAGE + -(-self.spec.nbytes // OS_PAGE) * OS_PAGE

    def _map(self, path: str) -> torch.Tensor:
        fmt = self.spec.row_format
        raw = torch.from_file(path, shared=True, size=self._file_bytes(), dtype=torch.uint8)
        data = raw[OS_PAGE:OS_PAGE + self.spec.nbytes]
        return data.view(fmt.dtype).view(self.spec.num_layers * self.spec.rows_per_layer, fmt.width)

    def _create(self, path: str) -> torch.Tensor:
        shm.refuse_live_creator(path, _HEADER, self.spec)
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, self._file_bytes())
            os.pwrite(fd, _HEADER.pack(self.spec, os.getpid()), 0)
            self._inode = os.fstat(fd).st_ino
        finally:
            os.close(fd)
        try:
            rows = self._map(tmp)
            os.replace(tmp, path)  # atomically replaces a stale file left by a crashed creator
        except BaseException:
            os.unlink(tmp)
            raise
        self._path = path
        return rows

    def _attach(self, path: str, timeout_s: float) -> torch.Tensor:
        return shm.wait_for_creator(path, _HEADER, self.spec, timeout_s, lambda _found: self._map(path))

    # ----------------------------------------------------------------- HostPool

    def release(self) -> None:
        # The mapping itself goes away with the last tensor that refers to it; views handed out
        # earlier therefore stay memory-safe, they just stop being the pool.
        self._rows = None
        path, self._path = self._path, None
        if path is None:
            return
        try:
            if os.stat(path).st_ino == self._inode:
                os.unlink(path)
        except FileNotFoundError:
            pass
