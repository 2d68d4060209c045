"""The one byte formatter of every message and table: capacity errors, `hisparse run/plan/bench`
and the benches."""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: float | None) -> str:
    """`1536` -> "1.50 KiB", `34359738368` -> "32.00 GiB" (binary units; whole bytes below 1 KiB;
    "n/a" for None or NaN)."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "n/a"
    v, i = float(n), 0
    while abs(v) >= 1024 and i < len(_UNITS) - 1:
        v /= 1024
        i += 1
    if i == 0:
        return f"{int(v)} B"
    if isinstance(n, int):
        # Rounded from the exact ratio: float(n) is inexact past 2**53 (8 PiB), where a value just
        # above a tie such as 52.625 PiB would read back 52.62, more than half a unit off.
        hundredths = round(Fraction(n, 1 << (10 * i)) * 100)   # half to even, as float formatting
        whole, frac = divmod(abs(hundredths), 100)
        return f"{'-' if hundredths < 0 else ''}{whole}.{frac:02d} {_UNITS[i]}"
    return f"{v:.2f} {_UNITS[i]}"


_FLAG_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def _hundredths(h: int, unit: str) -> str:
    # Integer arithmetic throughout: past 2**53 a float quotient can round onto the next hundredth,
    # and a rounded-down size would no longer fit (or a rounded-up one no longer suffice).
    whole, frac = divmod(h, 100)
    return f"{whole}.{frac:02d}{unit}"


def floor_size(nbytes: int) -> str:
    """`nbytes` as a size the CLI's size flags accept, rounded down (so that, given back, it still fits)."""
    for unit, scale in _FLAG_UNITS:
        if nbytes >= scale:
            return _hundredths(100 * nbytes // scale, unit)
    return f"{nbytes}B"


def at_most(limit: int | None, fmt: Callable[[int], str] = str) -> str:
    """What a refusal's `lower --FLAG` is followed by where the largest value that fits is known:
    " to at most LIMIT" (`fmt(limit)`: `floor_size` for a size flag, a count as it is); "" where
    none fits or it is unknown (0 or None)."""
    return f" to at most {fmt(limit)}" if limit else ""


def ceil_size(nbytes: int) -> str:
    """`nbytes` as a size the CLI's size flags accept, rounded up (so that, given back, it is enough)."""
    for unit, scale in _FLAG_UNITS:
        if nbytes >= scale:
            return _hundredths(-(-100 * nbytes // scale), unit)
    return f"{nbytes}B"


def significant(x: float, *, up: bool, digits: int = 4) -> float:
    """`x` > 0 rounded up or down to `digits` significant digits: a size a message suggests must hold
    (up) or fit (down) when it is given back."""
    scale = 10.0 ** (digits - 1 - math.floor(math.log10(x)))
    return (math.ceil(x * scale) if up else math.floor(x * scale)) / scale
