"""`ReferenceHostPool`: the host pool as a plain CPU tensor, private or shared through /dev/shm.

Layer-major: layer l is rows `[l * rows_per_layer, (l + 1) * rows_per_layer)` of one
`[num_layers * rows_per_layer, width]` buffer.

Shared mode maps one file `/dev/shm/hisparse_<name>.pool` into every rank. The file starts with
one OS page of header (magic, creator pid, geometry) followed by the rows. Rank 0 builds it under
a temporary name and renames it into place, so a peer never maps a half-built file; a peer also
waits while the header names a dead creator, which is how a stale file left by a crashed rank 0
is told apart from the live one that replaces it.
"""

from __future__ import annotations

import os
import re
import struct
import time

import torch

from hisparse_core.errors import InvalidInputError, ProtocolError
from hisparse_core.host_pool import OS_PAGE, HostPool, HostPoolSpec

SHM_DIR = "/dev/shm"
_MAGIC = b"HISPARSE-POOL-v1"
_HEADER = struct.Struct("<16sqqqqq32s")  # magic, pid, layers, blocks, block_size, width, row format
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def shm_path(name: str) -> str:
    """The /dev/shm file that backs the shared pool called `name`."""
    if not _NAME.fullmatch(name):
        raise InvalidInputError(
            f"shared host pool name {name!r} is not a valid file name part; expected 1-128 of [A-Za-z0-9_.-]")
    return os.path.join(SHM_DIR, f"hisparse_{name}.pool")


def _header(spec: HostPoolSpec, pid: int) -> bytes:
    fmt = spec.row_format
    return _HEADER.pack(_MAGIC, pid, spec.num_layers, spec.num_blocks, spec.block_size, fmt.width,
                        fmt.name.encode())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_header(path: str) -> tuple[int, bytes] | None:
    """(creator pid, header bytes) of a published file, or None if it is absent or unreadable."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_HEADER.size)
    except FileNotFoundError:
        return None
    if len(raw) != _HEADER.size or not raw.startswith(_MAGIC):
        return None
    return _HEADER.unpack(raw)[1], raw


class ReferenceHostPool(HostPool):
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
        found = _read_header(path)
        if found is not None and found[0] != os.getpid() and _pid_alive(found[0]):
            raise InvalidInputError(
                f"shared host pool {self.spec.name!r} ({path}) is in use by live process {found[0]}; "
                f"expected a name no running instance uses")
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, self._file_bytes())
            os.pwrite(fd, _header(self.spec, os.getpid()), 0)
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
        want = _header(self.spec, 0)[len(_MAGIC) + 8:]
        deadline = time.monotonic() + timeout_s
        while True:
            found = _read_header(path)
            if found is not None and _pid_alive(found[0]):
                got = found[1][len(_MAGIC) + 8:]
                if got != want:
                    raise InvalidInputError(
                        f"shared host pool {self.spec.name!r} ({path}) was created with another geometry; "
                        f"expected layers/blocks/block_size/width/format of {self.spec}")
                return self._map(path)
            if time.monotonic() > deadline:
                raise ProtocolError(
                    f"rank {self.spec.rank} waited {timeout_s}s for rank 0 to publish the shared host pool "
                    f"{self.spec.name!r} at {path}")
            time.sleep(0.01)

    # ----------------------------------------------------------------- HostPool

    def layer_view(self, layer: int) -> torch.Tensor:
        self._check_layer(layer)
        assert self._rows is not None
        n = self.spec.rows_per_layer
        return self._rows[layer * n:(layer + 1) * n]

    @property
    def is_writer(self) -> bool:
        return not self.spec.shared or self.spec.rank == 0

    @property
    def released(self) -> bool:
        return self._rows is None

    @property
    def path(self) -> str | None:
        """The /dev/shm file of a shared pool created by this process (None otherwise)."""
        return self._path

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
