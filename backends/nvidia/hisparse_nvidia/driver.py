"""Thin, checked wrappers over the CUDA driver API (`cuda.bindings.driver`).

The backend talks to the driver for what PyTorch does not expose: loading NVRTC-built modules and
launching their kernels on PyTorch's streams, registering host memory (`cuMemHostRegister`) and
inter-process events. Every call's status is checked; a failure raises `CudaError` with the
function name and the driver's error name and text.

PyTorch owns the CUDA context (the device's primary context). Before touching the driver, callers
run `ensure_context(device)`, which makes that context current on the calling thread.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any

import torch
from cuda.bindings import driver

from hisparse_core.errors import BackendError

#: Size of a CUipcEventHandle.
IPC_HANDLE_BYTES = 64


class CudaError(BackendError):
    """A CUDA driver call failed."""


def _name(err: Any) -> str:
    try:
        res, name = driver.cuGetErrorName(err)
        text_res, text = driver.cuGetErrorString(err)
        n = name.decode() if res == driver.CUresult.CUDA_SUCCESS and name else str(err)
        t = text.decode() if text_res == driver.CUresult.CUDA_SUCCESS and text else ""
        return f"{n} ({t})" if t else n
    except Exception:  # noqa: BLE001 - error formatting must never mask the error itself
        return str(err)


def check(what: str, result: Any) -> Any:
    """Unpack a `cuda.bindings` result tuple `(status, *values)`; raise `CudaError` on failure.

    Returns None, the single value, or a tuple of values.
    """
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if err != driver.CUresult.CUDA_SUCCESS:
        raise CudaError(f"{what} failed: {_name(err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


_local = threading.local()
_pdl_supported = True


def ensure_context(device: torch.device) -> None:
    """Make the primary context of `device` (the one PyTorch uses) current on this thread."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    cache: dict[int, Any] = getattr(_local, "contexts", None) or {}
    _local.contexts = cache
    ctx = cache.get(index)
    if ctx is None:
        torch.cuda.init()
        with torch.cuda.device(index):
            torch.cuda.current_stream(index)  # PyTorch creates/sets its primary context
        check("cuInit", driver.cuInit(0))
        dev = check("cuDeviceGet", driver.cuDeviceGet(index))
        ctx = check("cuDevicePrimaryCtxRetain", driver.cuDevicePrimaryCtxRetain(dev))
        cache[index] = ctx
    current = check("cuCtxGetCurrent", driver.cuCtxGetCurrent())
    if current is None or int(current) != int(ctx):
        check("cuCtxSetCurrent", driver.cuCtxSetCurrent(ctx))


def device_attribute(device: torch.device, attribute: Any) -> int:
    """A `CUdevice_attribute` of `device`."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    dev = check("cuDeviceGet", driver.cuDeviceGet(index))
    return int(check("cuDeviceGetAttribute", driver.cuDeviceGetAttribute(attribute, dev)))


class Function:
    """One kernel of a loaded module."""

    def __init__(self, module: Any, name: str) -> None:
        self.name = name
        self._module = module  # keeps the module alive as long as the function
        self.handle = check(f"cuModuleGetFunction({name})", driver.cuModuleGetFunction(module, name.encode()))
        self._dynamic_smem = 0
        self._carveout = -1

    def prefer_carveout(self, percent: int) -> None:
        """The kernel's preferred shared-memory carveout, in percent of the most an SM has (-1: the
        driver's default); set only when it changes."""
        if percent != self._carveout:
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
            check(f"cuFuncSetAttribute({self.name}, carveout={percent})",
                  driver.cuFuncSetAttribute(self.handle, attr, int(percent)))
            self._carveout = percent

    def allow_dynamic_smem(self, nbytes: int) -> None:
        """Raise the kernel's dynamic shared-memory limit (needed above 48 KiB)."""
        if nbytes > self._dynamic_smem:
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(f"cuFuncSetAttribute({self.name}, max dynamic smem={nbytes})",
                  driver.cuFuncSetAttribute(self.handle, attr, int(nbytes)))
            self._dynamic_smem = nbytes

    @property
    def registers(self) -> int:
        """Registers per thread of the loaded kernel (what decides which blocks can share an SM)."""
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS
        return int(check(f"cuFuncGetAttribute({self.name}, registers)", driver.cuFuncGetAttribute(attr, self.handle)))

    @property
    def static_smem(self) -> int:
        """Bytes of static shared memory a block of the kernel takes (counted in the per-block limit)."""
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES
        return int(check(f"cuFuncGetAttribute({self.name}, static smem)", driver.cuFuncGetAttribute(attr, self.handle)))

    def max_active_blocks(self, block: int, smem: int) -> int:
        """Blocks of `block` threads and `smem` bytes of dynamic shared memory that fit on one SM at once."""
        return int(check(f"cuOccupancyMaxActiveBlocksPerMultiprocessor({self.name})",
                         driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(self.handle, block, smem)))

    def max_active_clusters(self, cluster: int, block: int, smem: int) -> int:
        """Clusters of `cluster` blocks (the kernel's compile-time cluster size) of `block` threads
        and `smem` bytes of dynamic shared memory that can run at once on the current device."""
        config = driver.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = cluster, 1, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = block, 1, 1
        config.sharedMemBytes = smem
        config.numAttrs = 0
        return int(check(f"cuOccupancyMaxActiveClusters({self.name})",
                         driver.cuOccupancyMaxActiveClusters(self.handle, config)))

    def launch(self, grid: tuple[int, int, int], block: int, smem: int, stream: int,
               args: Sequence[ctypes._SimpleCData | ctypes.Structure], *, overlap_previous: bool = False) -> None:
        """Enqueue the kernel on the CUDA stream handle `stream` (capturable in a CUDA graph).

        `args` are ctypes scalars (c_void_p for pointers) or structures passed by value, in the
        kernel's parameter order.
        `overlap_previous` launches with programmatic stream serialization (Hopper and newer):
        the kernel may be scheduled while the previous kernel of the stream still runs, and
        must itself wait (`griddepcontrol.wait`) before reading what that kernel wrote. Where
        the driver refuses it, the launch falls back to an ordinary one.
        """
        global _pdl_supported
        ptrs = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        hstream = driver.CUstream(stream)
        if overlap_previous and _pdl_supported:
            config = driver.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = grid
            config.blockDimX, config.blockDimY, config.blockDimZ = block, 1, 1
            config.sharedMemBytes = smem
            config.hStream = hstream
            attr = driver.CUlaunchAttribute()
            attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            config.attrs = [attr]
            config.numAttrs = 1
            result = driver.cuLaunchKernelEx(config, self.handle, ctypes.addressof(ptrs), 0)
            err = result[0] if isinstance(result, tuple) else result
            if err == driver.CUresult.CUDA_SUCCESS:
                return
            if err not in (driver.CUresult.CUDA_ERROR_NOT_SUPPORTED, driver.CUresult.CUDA_ERROR_INVALID_VALUE):
                raise CudaError(f"cuLaunchKernelEx({self.name}) failed: {_name(err)}")
            _pdl_supported = False
        check(f"cuLaunchKernel({self.name})",
              driver.cuLaunchKernel(self.handle, grid[0], grid[1], grid[2], block, 1, 1, smem,
                                    hstream, ctypes.addressof(ptrs), 0))


class Module:
    """A loaded cubin (or PTX) image in the current context."""

    def __init__(self, image: bytes) -> None:
        buf = (ctypes.c_char * len(image)).from_buffer_copy(image)  # the driver copies the image
        self.handle = check("cuModuleLoadData", driver.cuModuleLoadData(ctypes.addressof(buf)))
        self._functions: dict[str, Function] = {}

    def function(self, name: str) -> Function:
        fn = self._functions.get(name)
        if fn is None:
            fn = self._functions[name] = Function(self.handle, name)
        return fn


def host_register(ptr: int, nbytes: int) -> int:
    """Page-lock and map `nbytes` of host memory at `ptr`; returns its device address."""
    flags = (driver.CU_MEMHOSTREGISTER_PORTABLE | driver.CU_MEMHOSTREGISTER_DEVICEMAP)
    check(f"cuMemHostRegister({nbytes} bytes)", driver.cuMemHostRegister(ptr, nbytes, flags))
    return int(check("cuMemHostGetDevicePointer", driver.cuMemHostGetDevicePointer(ptr, 0)))


def host_unregister(ptr: int) -> None:
    check("cuMemHostUnregister", driver.cuMemHostUnregister(ptr))


def host_device_pointer(ptr: int) -> int | None:
    """Device address of page-locked host memory at `ptr`, or None if it is not registered."""
    err, dptr = driver.cuMemHostGetDevicePointer(ptr, 0)
    if err != driver.CUresult.CUDA_SUCCESS:
        return None
    return int(dptr)


# ----------------------------------------------------------------------------- events

def event_create(*, interprocess: bool) -> Any:
    flags = driver.CUevent_flags.CU_EVENT_DISABLE_TIMING
    if interprocess:
        flags |= driver.CUevent_flags.CU_EVENT_INTERPROCESS
    return check("cuEventCreate", driver.cuEventCreate(int(flags)))


def event_destroy(event: Any) -> None:
    check("cuEventDestroy", driver.cuEventDestroy(event))


def event_record(event: Any, stream: int) -> None:
    check("cuEventRecord", driver.cuEventRecord(event, driver.CUstream(stream)))


def stream_wait_event(stream: int, event: Any) -> None:
    check("cuStreamWaitEvent", driver.cuStreamWaitEvent(driver.CUstream(stream), event, 0))


def event_done(event: Any) -> bool:
    err = driver.cuEventQuery(event)
    err = err[0] if isinstance(err, tuple) else err
    if err == driver.CUresult.CUDA_SUCCESS:
        return True
    if err == driver.CUresult.CUDA_ERROR_NOT_READY:
        return False
    raise CudaError(f"cuEventQuery failed: {_name(err)}")


def event_synchronize(event: Any) -> None:
    check("cuEventSynchronize", driver.cuEventSynchronize(event))


def ipc_event_handle(event: Any) -> bytes:
    """The 64-byte handle another process opens with `ipc_open_event`."""
    handle = check("cuIpcGetEventHandle", driver.cuIpcGetEventHandle(event))
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)


def ipc_open_event(handle: bytes) -> Any:
    """Open, in this process, an event another process created with `interprocess=True`."""
    if len(handle) != IPC_HANDLE_BYTES:
        raise CudaError(f"an IPC event handle is {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
    h = driver.CUipcEventHandle()
    ctypes.memmove(h.getPtr(), handle, IPC_HANDLE_BYTES)
    return check("cuIpcOpenEventHandle", driver.cuIpcOpenEventHandle(h))
