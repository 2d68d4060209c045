"""The two budgets of `enable` against what this machine has, checked before anything is sized
or allocated from them.

`host_pool_gib` is pinned host RAM: at most `HOST_FRACTION` of the RAM available now
(`hisparse_core.capacity`'s rule). `gpu_kv_gib` is device memory: what the device has free
(CUDA); on the CPU the device caches are host RAM too, so they get what the host pool leaves of
that share. An infinite, absurd or merely too-large budget fails here with one line naming the
value and the largest that fits, instead of an `OverflowError`, an empty `MemoryError` from the
host pool's bookkeeping, or the allocator's error seconds later.
"""

from __future__ import annotations

import math

import torch

from hisparse_core.capacity import HOST_FRACTION, available_host_bytes, device_free_bytes
from hisparse_core.coordinator.config import GIB
from hisparse_core.errors import CapacityError
from hisparse_core.units import human_bytes


def _floor3(x: float) -> str:
    """`x` rounded down to 3 significant digits (a budget printed as fitting must fit)."""
    if x <= 0:
        return "0"
    scale = 10 ** (math.floor(math.log10(x)) - 2)
    return f"{math.floor(x / scale) * scale:.3g}"


def ceil_gib(nbytes: int, digits: int = 6) -> str:
    """`nbytes` in GiB, rounded up to `digits` significant digits: the printed budget holds `nbytes`
    when read back as enable reads it (`int(float(s) * GIB) >= nbytes`)."""
    x = nbytes / GIB
    if x <= 0:
        return "0"
    scale = 10 ** (math.floor(math.log10(x)) - digits + 1)
    units = math.ceil(x / scale)
    while int(float(f"{units * scale:.{digits}g}") * GIB) < nbytes:
        units += 1
    return f"{units * scale:.{digits}g}"


def check_budgets(host_pool_gib: float, gpu_kv_gib: float, device: torch.device) -> None:
    """Raise `CapacityError` unless both budgets are finite and fit this machine (see the module
    docstring). Where the free memory cannot be asked, only finiteness is checked."""
    avail = available_host_bytes()
    host_limit = int(avail * HOST_FRACTION) if avail is not None else None
    if not math.isfinite(host_pool_gib) or (host_limit is not None and host_pool_gib * GIB > host_limit):
        if avail is None or host_limit is None:
            raise CapacityError(f"host_pool_gib={host_pool_gib:g}; expected a finite number of GiB")
        raise CapacityError(
            f"host_pool_gib={host_pool_gib:g} is more pinned host RAM than this machine has: {human_bytes(avail)} is "
            f"available and at most {HOST_FRACTION:.0%} of it may be taken: expected host_pool_gib <= "
            f"{_floor3(host_limit / GIB)}")
    host_bytes = int(host_pool_gib * GIB)
    if device.type == "cpu":
        free = host_limit - host_bytes if host_limit is not None else None
        where = (f"the CPU, where the device caches are host RAM too ({human_bytes(avail or 0)} available, at most "
                 f"{HOST_FRACTION:.0%} of it for both budgets, host_pool_gib={host_pool_gib:g} taken first)")
    else:
        free = device_free_bytes(device)
        where = f"{device} ({human_bytes(free or 0)} free)"
    if not math.isfinite(gpu_kv_gib) or (free is not None and gpu_kv_gib * GIB > free):
        if free is None:
            raise CapacityError(f"gpu_kv_gib={gpu_kv_gib:g}; expected a finite number of GiB")
        raise CapacityError(f"gpu_kv_gib={gpu_kv_gib:g} does not fit on {where}: expected gpu_kv_gib <= "
                            f"{_floor3(max(free, 0) / GIB)}")
