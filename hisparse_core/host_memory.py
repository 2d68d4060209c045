"""How much host memory a host pool may take, checked before it is allocated.

Upstream vLLM refuses a HiSparse host pool larger than 95% of the memory the OS reports as
available; hisparse applies the same rule, so a pool that cannot fit fails with one line naming
its size instead of an allocator error (or a swapping machine) later.
"""

from __future__ import annotations

import os

#: Share of the available host memory a pool may take.
MAX_FRACTION = 0.95


def available_bytes() -> int | None:
    """Host memory available to new allocations (Linux `MemAvailable`), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def limit_bytes(available: int | None) -> int | None:
    """The most a host pool may take out of `available` bytes (None: unknown, no limit)."""
    return None if available is None else int(available * MAX_FRACTION)
