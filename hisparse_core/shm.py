"""The /dev/shm file protocol of a shared host pool, shared by every backend.

A shared pool is one file `/dev/shm/hisparse_<name><suffix>`: a header (magic, creator pid,
geometry) at offset 0, then whatever the backend lays out. Rank 0 builds the file under a
temporary name and renames it into place, so a peer never maps a half-built file. The creator
pid in the header is how a stale file left by a crashed creator is told apart from a live one:
a creator refuses a name whose file a live process owns, and a peer waits until the header names
a live creator before it maps the file. Torch-free.
"""

from __future__ import annotations

import os
import re
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from hisparse_core.errors import InvalidInputError, ProtocolError

if TYPE_CHECKING:  # it loads torch; the protocol does not need it
    from hisparse_core.host_pool import HostPoolSpec

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_T = TypeVar("_T")


def shm_path(name: str, suffix: str) -> str:
    """The /dev/shm file that backs the shared pool called `name` (`suffix`: the backend's, e.g. ".pool")."""
    if not _NAME.fullmatch(name):
        raise InvalidInputError(
            f"shared host pool name {name!r} is not a valid file name part; expected 1-128 of [A-Za-z0-9_.-]")
    return os.path.join(SHM_DIR, f"hisparse_{name}{suffix}")


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (one owned by another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True, slots=True)
class Published:
    """The header of a published pool file, as read."""

    pid: int  # creator
    raw: bytes  # the whole header
    inode: int  # of the file the header was read from


class PoolHeader:
    """One backend's header layout: 16-byte magic, creator pid, layers, blocks, block_size, width,
    row format name, and with `with_nbytes` the pool's byte size."""

    def __init__(self, magic: bytes, *, with_nbytes: bool = False) -> None:
        if len(magic) != 16:
            raise ValueError(f"magic must be 16 bytes, got {len(magic)}")
        self.magic = magic
        self._with_nbytes = with_nbytes
        self._struct = struct.Struct("<16sqqqqq32s" + ("q" if with_nbytes else ""))

    @property
    def size(self) -> int:
        return self._struct.size

    def pack(self, spec: HostPoolSpec, pid: int) -> bytes:
        fmt = spec.row_format
        fields = [self.magic, pid, spec.num_layers, spec.num_blocks, spec.block_size, fmt.width, fmt.name.encode()]
        if self._with_nbytes:
            fields.append(spec.nbytes)
        return self._struct.pack(*fields)

    def geometry(self, raw: bytes) -> bytes:
        """What follows the magic and the pid: equal headers describe the same pool."""
        return raw[len(self.magic) + 8:]

    def read(self, path: str) -> Published | None:
        """The header of a published file, or None if it is absent or not (yet) one of ours."""
        try:
            with open(path, "rb") as f:
                raw = f.read(self.size)
                inode = os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            return None
        if len(raw) != self.size or not raw.startswith(self.magic):
            return None
        return Published(self._struct.unpack(raw)[1], raw, inode)


def refuse_live_creator(path: str, header: PoolHeader, spec: HostPoolSpec) -> None:
    """Before creating: a file at `path` owned by another live process means the name is taken."""
    found = header.read(path)
    if found is not None and found.pid != os.getpid() and pid_alive(found.pid):
        raise InvalidInputError(
            f"shared host pool {spec.name!r} ({path}) is in use by live process {found.pid}; "
            f"expected a name no running instance uses")


def wait_for_creator(path: str, header: PoolHeader, spec: HostPoolSpec, timeout_s: float,
                     open_published: Callable[[Published], _T | None]) -> _T:
    """Wait until `path` holds a pool of `spec`'s geometry from a live creator, and open it.

    `open_published` maps the file; it returns None to keep waiting (e.g. the file was replaced
    between reading the header and opening it).
    """
    want = header.geometry(header.pack(spec, 0))
    deadline = time.monotonic() + timeout_s
    while True:
        found = header.read(path)
        if found is not None and pid_alive(found.pid):
            if header.geometry(found.raw) != want:
                raise InvalidInputError(
                    f"shared host pool {spec.name!r} ({path}) was created with another geometry; "
                    f"expected layers/blocks/block_size/width/format of {spec}")
            opened = open_published(found)
            if opened is not None:
                return opened
        if time.monotonic() > deadline:
            raise ProtocolError(
                f"rank {spec.rank} waited {timeout_s}s for rank 0 to publish the shared host pool "
                f"{spec.name!r} at {path}")
        time.sleep(0.01)
