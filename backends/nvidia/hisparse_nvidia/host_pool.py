"""`NvidiaHostPool`: the registered host pool, private or shared by the TP ranks of a node.

Layout (both modes): layer-major, `num_layers` regions of `num_blocks * block_size` rows, so host
row g of layer l is at `base + (l * rows_per_layer + g) * row_bytes` and each layer view is one
contiguous `[rows_per_layer, width]` tensor. The GPU reads and writes it directly (zero copy)
through its device-mapped address.

- Private mode: an anonymous, page-aligned `mmap` (transparent huge pages requested), registered
  with `cuMemHostRegister(PORTABLE | DEVICEMAP)` rather than PyTorch's power-of-two pinned
  allocator, so a 300 GiB pool costs 300 GiB, not 512.
- Shared mode (`HostPoolSpec(shared=True)`): one file `/dev/shm/hisparse_<name>.nvpool`, one OS
  page of header (magic, creator, geometry, the rank table of `hisparse_core.shm`, the IPC event
  handle and epoch counters of `hisparse_nvidia.ipc`) followed by the rows. Rank 0 builds the file
  unnamed, registers it and names it; peers wait for the name, map the file, mark their rank and
  register their own mapping. The name is removed as soon as every rank has mapped the file (so a
  crash from then on leaves nothing in /dev/shm), else by rank 0 at `release` or exit. Only rank 0
  writes; peers order their reads on rank 0's IPC event. Each rank registers its mapping for its
  own device (tensor parallelism: one GPU per rank), so the pages are pinned once per rank but held
  once: host RAM and /dev/shm hold one pool whatever the world size, and only rank 0's capacity
  check counts it (`hisparse_core.capacity.check_host_pool`; `bench/bench_tp_shared.py` measures it).

Registration is done in chunks of at most `REGISTER_CHUNK_BYTES` (and undone in reverse), so
pinning and unpinning a pool of hundreds of GiB neither hits per-call limits nor stalls in one
multi-minute driver call. The usable capacity (`spec.nbytes`) is the same in both modes.

At interpreter exit a pool still held is not unregistered or unmapped: the driver unpins a dying
process's registrations and the kernel unmaps its memory anyway, and doing it by hand only delays
the exit past a scheduler's kill wait (`bench/bench_pool_release.py` measures both ways;
`HISPARSE_UNREGISTER_AT_EXIT=1` unregisters anyway). `release()` always unregisters.
"""

from __future__ import annotations

import atexit
import mmap
import os
import threading
import weakref

import torch

from hisparse_core import shm
from hisparse_core.capacity import check_host_pool
from hisparse_core.errors import CapacityError, InvalidInputError
from hisparse_core.host_pool import OS_PAGE, HostPoolSpec, LayerMajorHostPool
from hisparse_nvidia import driver
from hisparse_nvidia.ipc import CHANNEL_END, WriterChannel
from hisparse_nvidia.settings import ENV_UNREGISTER_AT_EXIT, unregister_at_exit  # pools still held at exit

HUGE_PAGE = 2 << 20
#: Largest single cuMemHostRegister call (bytes, a multiple of 2 MiB).
REGISTER_CHUNK_BYTES = 32 << 30
_HEADER = shm.PoolHeader(b"HISPARSE-NVPOOL2")
assert _HEADER.size <= 512 and CHANNEL_END <= shm.RANKS_OFFSET and OS_PAGE == shm.HEADER_PAGE

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


_exiting = False
_exit_hook_registered = False


def _mark_exiting() -> None:
    global _exiting
    _exiting = True


def _register_exit_hook() -> None:
    """Registered after the pool's `weakref.finalize`, so it runs before the finalizers at exit
    (atexit runs the latest registration first)."""
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(_mark_exiting)
        _exit_hook_registered = True


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
             file: shm.PoolFile | None) -> None:
    if file is not None:
        file.close()  # first: the /dev/shm name must go however the rest ends
    if _exiting and os.environ.get(ENV_UNREGISTER_AT_EXIT, "") != "1":
        return  # the driver unpins and the kernel unmaps a dying process's memory (module docstring)
    if channel is not None:
        channel.close()
    if registration is not None:
        registration.release()
    if mm is not None:
        try:
            mm.close()
        except BufferError:
            pass  # views still alive elsewhere: the mapping goes with the last of them


class NvidiaHostPool(LayerMajorHostPool):
    """Host pool registered for one CUDA device; see the module docstring for the two modes."""

    def __init__(self, spec: HostPoolSpec, device: torch.device, *, peer_timeout_s: float = 120.0) -> None:
        if not isinstance(spec, HostPoolSpec):
            raise InvalidInputError(f"spec must be a HostPoolSpec, got {type(spec).__name__}")
        self.spec = spec
        self._device = device
        self._path: str | None = None
        self._file: shm.PoolFile | None = None
        self._channel: WriterChannel | None = None
        self._mm: mmap.mmap | None = None
        self._registration: _Registration | None = None
        self._rows: torch.Tensor | None = None
        unregister_at_exit()  # a bad value is said now, not ignored at exit
        check_host_pool(spec, self._file_bytes() if spec.shared else None)
        if spec.shared:
            path = shm_path(spec.name or "")
            data_offset = OS_PAGE
            if spec.rank == 0:
                self._file = shm.create(path, _HEADER, spec, self._file_bytes())
            else:
                self._file = shm.attach(path, _HEADER, spec, self._file_bytes(), peer_timeout_s)
        else:
            data_offset = self._allocate_private()
        try:
            if self._file is not None:
                self._mm = mmap.mmap(self._file.fd, self._file_bytes(), flags=mmap.MAP_SHARED)
                if spec.rank != 0:
                    self._file.mark_mapped(spec.rank)  # before the slow registration: the name goes early
            assert self._mm is not None
            base = _address(self._mm)
            self._registration = _Registration(device, base + data_offset, spec.nbytes)
            raw = torch.frombuffer(self._mm, dtype=torch.uint8, count=spec.nbytes, offset=data_offset)
            fmt = spec.row_format
            self._rows = raw.view(fmt.dtype).view(spec.num_layers * spec.rows_per_layer, fmt.width)
            if spec.shared:
                assert self._file is not None
                # Created (rank 0) or opened (a peer) in this rank's own device context: across
                # devices, a peer's stream waits on the event of rank 0's device (ipc.py).
                self._channel = WriterChannel(base, writer=spec.rank == 0, create=spec.rank == 0,
                                              creator=None if spec.rank == 0 else self._file.creator,
                                              device=device)
            if self._file is not None and spec.rank == 0:
                self._file.publish()  # peers may map it from now on
                self._path = path
        except BaseException:
            self._rows = None
            _cleanup(self._registration, self._channel, self._mm, self._file)
            self._mm = None
            raise
        self._finalizer = weakref.finalize(self, _cleanup, self._registration, self._channel, self._mm, self._file)
        _register_exit_hook()

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
        self._finalizer()  # remove a /dev/shm name left, unregister, close the event, unmap
        self._mm = None
        self._file = None
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
