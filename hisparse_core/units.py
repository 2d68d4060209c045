"""The one byte formatter of every message and table: capacity errors, `hisparse run/plan/bench`
and the benches."""

from __future__ import annotations

import math

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
    return f"{int(v)} B" if i == 0 else f"{v:.2f} {_UNITS[i]}"
