"""Plain-text tables and number formatting shared by `hisparse bench`, `run` and `plan`."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any


def human_bytes(n: float) -> str:
    """1536 -> '1.50 KiB' (binary units)."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "n/a"
    units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    v, i = float(n), 0
    while abs(v) >= 1024 and i < len(units) - 1:
        v /= 1024
        i += 1
    return f"{int(v)} B" if i == 0 else f"{v:.2f} {units[i]}"


def pct(x: float) -> str:
    return f"{100.0 * x:.2f}%"


def render_table(rows: Sequence[tuple[str, str]], title: str | None = None) -> str:
    """Two aligned columns; a row whose value is "" is a section heading."""
    width = max((len(k) for k, _ in rows), default=0)
    lines = [title, "=" * len(title)] if title else []
    for key, value in rows:
        if value == "":
            lines.append(f"{key}")
        else:
            lines.append(f"  {key.ljust(width)}  {value}")
    return "\n".join(lines)


def render_grid(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """A table with a header row; columns right-aligned except the first."""
    cols = list(zip(*([list(header)] + [list(r) for r in body]), strict=True))
    widths = [max(len(c) for c in col) for col in cols]
    out = []
    for j, row in enumerate([list(header)] + [list(r) for r in body]):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        out.append("  ".join(cells))
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def dumps(obj: Any) -> str:
    """JSON with NaN/inf spelled as null, so any JSON reader accepts it."""
    def clean(x: Any) -> Any:
        if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
            return None
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x
    return json.dumps(clean(obj), indent=2, sort_keys=False)
