"""Plain-text tables and number formatting shared by `hisparse bench`, `run` and `plan` (bytes:
`hisparse_core.units.human_bytes`, re-exported here)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from hisparse_core.units import human_bytes


def kv_place(device: object) -> str:
    """What the output calls the memory of the KV pool on `device`: "GPU" on a CUDA device, else
    the device itself ("cpu device"), so a CPU-only run never reports GPU pages."""
    return "GPU" if str(device).startswith("cuda") else f"{device} device"

__all__ = ["counted", "dumps", "human_bytes", "json_safe", "kv_place", "pct", "render_grid", "render_table"]


def counted(count: int, noun: str) -> str:
    """`count` `noun`s, the noun singular for one: "1 layer", "4 layers"."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def pct(x: float) -> str:
    return f"{100.0 * x:.2f}%"


#: What a hit rate says where no lookup went through the hot buffer (a rate of nothing is no 100%).
NO_LOOKUPS = "n/a: no lookup went through the hot buffer"


def hit_rate(rate: float, lookups: int) -> str:
    """A hot-buffer hit rate, or n/a where no lookup went through the buffer."""
    return pct(rate) if lookups else f"{NO_LOOKUPS} (0 hits, 0 misses)"


def hot_buffer(hot_rows: int, top_k: int, hot_multiple: float, block_size: int) -> str:
    """The hot buffer as the tables of `run` and `bench` say it: its rows and their multiple of
    top-k, and where `--hot` was rounded up to whole blocks, by how much (`--top-k 16 --hot 2` at
    64-token blocks is 64 rows, 4x top-k: the table said "(2.0x)" beside a log line's "(4.00x)")."""
    text = f"hot {hot_rows} rows ({hot_rows / top_k:.2f}x top-k"
    if hot_rows != top_k * hot_multiple:
        text += f"; --hot {hot_multiple:g} rounded up to whole {block_size}-token blocks"
    return text + ")"


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


def json_safe(x: Any) -> Any:
    """`x` with NaN/inf (a figure not measured) as None, JSON's null, so any JSON reader accepts it
    (JSON has no NaN); dict keys as str."""
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def dumps(obj: Any) -> str:
    """JSON with NaN/inf spelled as null, so any JSON reader accepts it."""
    return json.dumps(json_safe(obj), indent=2, sort_keys=False)
