"""`NvidiaHostPool`: the registered host pool, private or shared by the TP ranks of a node.

Layout (both modes): layer-major, `num_layers` regions of `num_blocks * block_size` rows, so host
row g of layer l is at `base + (l * rows_per_layer + g) * row_bytes` and each layer view is one
contiguous `[rows_per_layer, width]` tensor. The GPU reads and writes it directly (zero copy)
through its device-mapped address.

- Private mode: an anonymous, page-aligned `mmap` (transparent huge pages requested), registered
  with `cuMemHostRegister(PORTABLE | DEVICEMAP)` rather than PyTorch's power-of-two pinned
  allocator, so a 300 GiB pool costs 300 GiB, not 512.
- Shared mode (`HostPoolSpec(shared=True)`): one file `/dev/shm/hisparse_<name>.nvpool`, one OS
  page of header (magic, creator pid, geometry, the IPC event handle and epoch counters of
  `hisparse_nvidia.ipc`) followed by the rows. Rank 0 builds it under a temporary name and renames
  it into place, atomically replacing a file left by a crashed creator; peers wait until the
  header names a live creator, map the file and register their own mapping. Only rank 0 writes;
  peers order their reads on rank 0's IPC event. Rank 0 removes the file at `release`.

Registration is done in chunks of at most `REGISTER_CHUNK_BYTES` (and undone in reverse), so
pinning and unpinning a pool of hundreds of GiB neither hits per-call limits nor stalls in one
multi-minute driver call. The usable capacity (`spec.nbytes`) is the same in both modes.
"""

from __future__ import annotations

import mmap
import os
import re
import threading
import weakref

import torch

from hisparse_core import shm
from hisparse_core.errors import CapacityError, InvalidInputError
from hisparse_core.host_pool import OS_PAGE, HostPoolSpec, LayerMajorHostPool

from hisparse_nvidia import driver
from hisparse_nvidia.ipc import CHANNEL_END, WriterChannel

HUGE_PAGE = 2 << 20
#: Largest single cuMemHostRegister call (bytes, a multiple of 2 MiB).
REGISTER_CHUNK_BYTES = 32 << 30
_HEADER = shm.PoolHeader(b"HISPARSE-NVPOOL1", with_nbytes=True)
assert _HEADER.size <= 512 and CHANNEL_END <= OS_PAGE

# Registered ranges of every live pool of this process: host start -> (bytes, device start).
_registry_lock = threading.Lock()
_registry: dict[int, tuple[int, int]] = {}


def device_address_of_host(ptr: int, nbytes: int) -> int | None:
    """Device address of `nbytes` of registered host memory at `ptr`, or None.

    Ranges registered by an `NvidiaHostPool` are looked up directly; anything else (PyTorch
    pinned tensors) is asked of the driver.
    """
    with _registry_lock:
        for start, (size, dev) in _registry.items():
            if start <= ptr and ptr + nbytes <= start + size:
                return dev + (ptr - start)
    return driver.host_device_pointer(ptr)


def shm_path(name: str) -> str:
    """The /dev/shm file backing the shared pool called `name`."""
    return shm.shm_path(name, ".nvpool")


def _remove_stale_temporaries(path: str) -> None:
    """Temporary files of creators that died while building the pool."""
    folder, base = os.path.split(path)
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for n in names:
        m = re.fullmatch(re.escape(base) + r"\.(\d+)\.tmp", n)
        if m and not shm.pid_alive(int(m.group(1))):
            try:
                os.unlink(os.path.join(folder, n))
            except OSError:
                pass


class _Registration:
    """Chunked cuMemHostRegister of one mapping; `release` undoes it (idempotent)."""

    def __init__(self, device: torch.device, ptr: int, nbytes: int) -> None:
        self._device = device
        self.ptr = ptr
        self.nbytes = nbytes
        self._chunks: list[int] = []
        driver.ensure_context(device)
        try:
            dev_start = self._register_chunks()
        except driver.CudaError as exc:
            self.release()
            raise CapacityError(f"could not register {nbytes} bytes of host memory for the GPU: {exc}") from exc
        self.device_ptr = dev_start
        with _registry_lock:
            _registry[ptr] = (nbytes, dev_start)

    def _register_chunks(self) -> int:
        dev_start = None
        offset = 0
        while offset < self.nbytes:
            size = min(REGISTER_CHUNK_BYTES, self.nbytes - offset)
            dev = driver.host_register(self.ptr + offset, size)
            self._chunks.append(self.ptr + offset)
            if dev_start is None:
                dev_start = dev
            elif dev != dev_start + offset:
                # Device mappings of separate registrations are not contiguous here: one call.
                self.release()
                dev = driver.host_register(self.ptr, self.nbytes)
                self._chunks = [self.ptr]
                return dev
            offset += size
        assert dev_start is not None
        return dev_start

    def release(self) -> None:
        with _registry_lock:
            _registry.pop(self.ptr, None)
        if not self._chunks:
            return
        try:
            driver.ensure_context(self._device)
        except Exception:  # noqa: BLE001 - the context may already be gone at interpreter exit
            self._chunks.clear()
            return
        while self._chunks:
            start = self._chunks.pop()
            try:
                driver.host_unregister(start)
            except driver.CudaError:
                pass


def _cleanup(registration: _Registration | None, channel: WriterChannel | None, mm: mmap.mmap | None,
             path: str | None, inode: int | None) -> None:
    if channel is not None:
        channel.close()
    if registration is not None:
        registration.release()
    if mm is not None:
        try:
            mm.close()
        except BufferError:
            pass  # views still alive elsewhere: the mapping goes with the last of them
    if path is not None:
        try:
            if os.stat(path).st_ino == inode:
                os.unlink(path)
        except FileNotFoundError:
            pass


class NvidiaHostPool(LayerMajorHostPool):
    """Host pool registered for one CUDA device; see the module docstring for the two modes."""

    def __init__(self, spec: HostPoolSpec, device: torch.device, *, peer_timeout_s: float = 120.0) -> None:
        if not isinstance(spec, HostPoolSpec):
            raise InvalidInputError(f"spec must be a HostPoolSpec, got {type(spec).__name__}")
        self.spec = spec
        self._device = device
        self._path: str | None = None
        self._inode: int | None = None
        self._channel: WriterChannel | None = None
        self._mm: mmap.mmap | None = None
        self._registration: _Registration | None = None
        self._rows: torch.Tensor | None = None
        if spec.shared:
            path = shm_path(spec.name or "")
            data_offset = OS_PAGE
            if spec.rank == 0:
                self._create(path)
            else:
                self._attach(path, peer_timeout_s)
        else:
            data_offset = self._allocate_private()
        assert self._mm is not None
        try:
            base = _address(self._mm)
            self._registration = _Registration(device, base + data_offset, spec.nbytes)
            raw = torch.frombuffer(self._mm, dtype=torch.uint8, count=spec.nbytes, offset=data_offset)
            fmt = spec.row_format
            self._rows = raw.view(fmt.dtype).view(spec.num_layers * spec.rows_per_layer, fmt.width)
            if spec.shared:
                self._channel = WriterChannel(base, writer=spec.rank == 0, create=spec.rank == 0)
            if spec.shared and spec.rank == 0:
                assert self._path is not None
                os.replace(self._tmp, self._path)  # publish: peers may map it from now on
        except BaseException:
            self._rows = None
            _cleanup(self._registration, self._channel, self._mm, getattr(self, "_tmp", None), self._inode)
            self._mm = None
            raise
        self._finalizer = weakref.finalize(self, _cleanup, self._registration, self._channel, self._mm,
                                           self._path, self._inode)

    # ----------------------------------------------------------------- allocation

    def _allocate_private(self) -> int:
        """Map the private pool; returns the offset of its 2 MiB-aligned start in the mapping.

        Pools of at least 2 MiB start on a huge-page boundary and ask for transparent huge pages,
        so the GPU's random row reads need fewer host page translations."""
        size = max(OS_PAGE, -(-self.spec.nbytes // OS_PAGE) * OS_PAGE)
        huge = size >= HUGE_PAGE
        try:
            self._mm = mmap.mmap(-1, size + (HUGE_PAGE if huge else 0), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as exc:
            raise CapacityError(f"could not map {size} bytes of host memory for the pool: {exc}") from exc
        if not huge:
            return 0
        offset = -_address(self._mm) % HUGE_PAGE
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._mm.madvise(mmap.MADV_HUGEPAGE, offset, size)
            except OSError:
                pass
        return offset

    def _file_bytes(self) -> int:
        return OS_PAGE + -(-self.spec.nbytes // OS_PAGE) * OS_PAGE

    def _create(self, path: str) -> None:
        shm.refuse_live_creator(path, _HEADER, self.spec)
        _remove_stale_temporaries(path)
        self._tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(self._tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                os.ftruncate(fd, self._file_bytes())
            except OSError as exc:
                os.unlink(self._tmp)
                raise CapacityError(f"could not size {self._tmp} to {self._file_bytes()} bytes: {exc}") from exc
            os.pwrite(fd, _HEADER.pack(self.spec, os.getpid()), 0)
            self._inode = os.fstat(fd).st_ino
            self._mm = mmap.mmap(fd, self._file_bytes(), flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self._path = path

    def _attach(self, path: str, timeout_s: float) -> None:
        self._mm = shm.wait_for_creator(path, _HEADER, self.spec, timeout_s,
                                        lambda found: self._map_published(path, found.inode))

    def _map_published(self, path: str, inode: int) -> mmap.mmap | None:
        """Map `path` if it is still file `inode` at full size; None (keep waiting) otherwise."""
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_ino == inode and os.fstat(fd).st_size == self._file_bytes():
                return mmap.mmap(fd, self._file_bytes(), flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        return None

    # ----------------------------------------------------------------- HostPool

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def device_address(self) -> int:
        """Device-mapped address of row 0 of layer 0."""
        if self._registration is None or self._rows is None:
            raise InvalidInputError("host pool was released; its views are gone")
        return self._registration.device_ptr

    @property
    def channel(self) -> WriterChannel | None:
        """Cross-rank write ordering of a shared pool (None for a private pool)."""
        return self._channel

    def release(self) -> None:
        if self._rows is None:
            return
        self._rows = None
        self._finalizer()  # unregister, close the event, unmap, remove the file (rank 0)
        self._mm = None
        self._channel = None
        self._registration = None
        self._path = None


def _address(mm: mmap.mmap) -> int:
    import ctypes

    buf = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(buf)
    finally:
        del buf
