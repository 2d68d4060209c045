"""Capacity checks made before allocating, so a budget that cannot fit fails with one line of
figures instead of an allocator traceback or the OOM killer.

- `check_host_memory`: host RAM (pinned pools, CPU tensors). At most `HOST_FRACTION` of the RAM
  available now (`MemAvailable`), as upstream vLLM does for its CPU offload buffers: a pool just
  under the machine's RAM would leave nothing for the rest of the process.
- `check_shm_space`: free space in /dev/shm for a shared pool file (tmpfs would otherwise accept
  the size and kill the process with SIGBUS when a page is first touched).
- `check_device_memory`: device memory for tensors on a device (CUDA: what the driver reports
  free plus what PyTorch's caching allocator holds unused; CPU: host RAM as above).

Every check raises `CapacityError` naming what was asked, the figures, and the remedy. Torch is
imported only to ask a CUDA device.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from hisparse_core import shm
from hisparse_core.errors import CapacityError
from hisparse_core.units import human_bytes

if TYPE_CHECKING:
    import torch

    from hisparse_core.host_pool import HostPoolSpec

#: The largest share of the available host RAM one allocation may take.
HOST_FRACTION = 0.95


def available_host_bytes() -> int | None:
    """RAM available to new allocations without swapping (Linux `MemAvailable`), or None if unknown."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def total_host_bytes() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def host_limit(available: int | None = None) -> int | None:
    """The most host RAM one allocation may take now (`HOST_FRACTION` of `available`, default:
    `available_host_bytes()`), what `check_host_memory` allows; None where unknown."""
    avail = available_host_bytes() if available is None else available
    return None if avail is None else int(avail * HOST_FRACTION)


def check_host_memory(nbytes: int, what: str, *, fraction: float = HOST_FRACTION,
                      available: int | None = None, remedy: str = "lower the budget") -> None:
    """Raise `CapacityError` unless `nbytes` of host RAM fit in `fraction` of what is available.

    :param what: what is being allocated, for the message (e.g. "host pool of 8192 blocks").
    :param available: the available bytes (default: `available_host_bytes()`); where unknown,
        nothing is checked.
    :param remedy: what the message tells the user to do.
    """
    avail = available_host_bytes() if available is None else available
    if avail is None:
        return
    limit = int(avail * fraction)
    if nbytes > limit:
        total = total_host_bytes()
        of_total = f" of {human_bytes(total)} total" if total else ""
        raise CapacityError(
            f"{what} needs {human_bytes(nbytes)} ({nbytes} B) of host RAM; {human_bytes(avail)} is available"
            f"{of_total}, and at most {fraction:.0%} of it ({human_bytes(limit)}) may be taken: {remedy}")


def check_shm_space(nbytes: int, what: str, directory: str | None = None, *,
                    remedy: str = "lower the budget") -> None:
    """Raise `CapacityError` unless a file of `nbytes` fits in the free space of `directory`
    (default: /dev/shm, `hisparse_core.shm.SHM_DIR`)."""
    directory = shm.SHM_DIR if directory is None else directory
    try:
        st = os.statvfs(directory)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        size = st.f_blocks * st.f_frsize
        raise CapacityError(
            f"{what} needs a {human_bytes(nbytes)} ({nbytes} B) file in {directory}, which has {human_bytes(free)} "
            f"free of {human_bytes(size)}: {remedy}, or enlarge {directory} (for example "
            f"`mount -o remount,size=... {directory}`, or `docker run --shm-size`)")


def check_host_pool(spec: HostPoolSpec, file_bytes: int | None = None) -> None:
    """What `Backend.create_host_pool` checks before it allocates: the pool's bytes against host
    RAM, and for rank 0 of a shared pool its file (`file_bytes`, header included) against
    /dev/shm. A shared pool's peers map memory that rank 0 already holds: nothing to check."""
    if spec.shared and spec.rank != 0:
        return
    nbytes = file_bytes if file_bytes is not None else spec.nbytes
    kind = f"shared host pool {spec.name!r}" if spec.shared else "host pool"
    what = (f"{kind} of {spec.num_blocks} blocks x {spec.num_layers} layers x {spec.block_size} rows x "
            f"{spec.row_format.row_bytes} B")
    remedy = "lower the host pool budget"
    check_host_memory(nbytes, what, remedy=remedy)
    if spec.shared:
        check_shm_space(nbytes, what, remedy=remedy)


def device_free_bytes(device: torch.device) -> int | None:
    """Bytes that tensors on `device` can still get, or None where it cannot be asked."""
    if device.type == "cpu":
        return available_host_bytes()
    if device.type == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + max(0, cached))
    return None


def device_limit(device: torch.device) -> int | None:
    """The most bytes of tensors one allocation may take on `device`, what `check_device_memory`
    allows (CPU: `host_limit()`; CUDA: what is free); None where it cannot be asked."""
    return host_limit() if device.type == "cpu" else device_free_bytes(device)


def check_device_memory(device: torch.device, nbytes: int, what: str, *, remedy: str = "lower the budget") -> None:
    """Raise `CapacityError` unless `nbytes` of tensors fit on `device` (CPU: the host RAM rule of
    `check_host_memory`; CUDA: the free device memory; other devices: not checked)."""
    if device.type == "cpu":
        check_host_memory(nbytes, what, remedy=remedy)
        return
    free = device_free_bytes(device)
    if free is not None and nbytes > free:
        raise CapacityError(f"{what} needs {human_bytes(nbytes)} ({nbytes} B) on {device}, which has "
                            f"{human_bytes(free)} free: {remedy}")
