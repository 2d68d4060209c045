"""`hisparse backends [--json] [-v]`: list every backend and whether it can run here.

The table (or JSON) goes to stdout; discovery warnings about broken plugins go to stderr
through logging. The exit status is 0 whenever the listing itself worked, whatever the
backends' statuses: scripts check `status` in `--json` output.
"""

from __future__ import annotations

import argparse
import json
import shutil
import textwrap
from collections.abc import Sequence
from typing import Any

from hisparse_core.errors import BackendError
from hisparse_core.registry import ENTRY_POINT_GROUP, BackendEntry, get_registry

_COLUMNS = ("NAME", "STATUS", "PRIORITY", "VERSION", "CAPABILITIES")
_VERBOSE_COLUMNS = ("PLUGIN", "DISTRIBUTION", "API")


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "backends", help="list installed backends, whether each can run here and which one is used",
        description="List every hisparse backend found through the hisparse.backends entry points: "
                    "available, unavailable (with the reason) or broken (with the error), and which one "
                    "selection would use (HISPARSE_BACKEND, else the highest priority available).")
    parser.add_argument("--json", action="store_true",
                        help="print a JSON list of objects (name, status, priority, version, capabilities, "
                             "reason, selected, plugin, distribution, ...) instead of the table")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="add plugin, distribution and API version columns, descriptions, factories "
                             "and the tracebacks of broken backends")
    parser.set_defaults(func=run)
    return parser


def _cell(value: object) -> str:
    if value is None or value == "" or value == ():
        return "-"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def _row(entry: BackendEntry, verbose: bool) -> list[str]:
    cells = [entry.name, entry.status.value, _cell(entry.priority), _cell(entry.version), _cell(entry.capabilities)]
    if verbose:
        dist = f"{entry.distribution}=={entry.distribution_version}" if entry.distribution else None
        cells += [_cell(entry.plugin), _cell(dist), _cell(entry.api_version)]
    return cells + [_cell(entry.reason)]


def _wrap_list(text: str, width: int) -> list[str]:
    """'a,b,c' in lines of at most `width`, each but the last ending in a comma (an item longer
    than that gets a line of its own)."""
    lines: list[str] = []
    items = text.split(",")
    for i, item in enumerate(items):
        comma = 1 if i < len(items) - 1 else 0
        if lines and len(lines[-1]) + 1 + len(item) + comma <= width:
            lines[-1] += "," + item
        else:
            if lines:
                lines[-1] += ","
            lines.append(item)
    return lines or [""]


def _column_widths(rows: Sequence[Sequence[str]], wrapped: tuple[int, int], width: int) -> list[int]:
    """Natural widths, except the two wrappable columns (CAPABILITIES, REASON) share what the
    terminal leaves after the others (an 80-column terminal fits the base install); REASON keeps
    at least 8 characters, so a terminal narrower than that overflows rather than losing text."""
    natural = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    cap, reason = wrapped
    fixed = sum(w for i, w in enumerate(natural) if i not in wrapped) + 2 * (len(natural) - 1)
    avail = width - fixed
    if natural[cap] + natural[reason] <= avail:
        return natural
    cap_min = max(len(item) + 1 for r in rows for item in r[cap].split(","))  # + its comma
    reason_w = max(8, min(natural[reason], avail // 2))
    cap_w = max(cap_min, min(natural[cap], avail - reason_w))
    widths = list(natural)
    widths[cap], widths[reason] = cap_w, max(8, avail - cap_w)
    return widths


def format_table(entries: Sequence[BackendEntry], verbose: bool = False, width: int | None = None) -> str:
    """The aligned table `hisparse backends` prints, fitted to `width` (default: the terminal's):
    CAPABILITIES wraps at commas and REASON at spaces, each within its column (a word longer than
    its column overflows rather than being broken)."""
    width = width if width is not None else shutil.get_terminal_size((100, 24)).columns
    header = [*_COLUMNS, *(_VERBOSE_COLUMNS if verbose else ()), "REASON"]
    rows = [header] + [_row(e, verbose) for e in entries]
    cap, reason = _COLUMNS.index("CAPABILITIES"), len(header) - 1
    widths = _column_widths(rows, (cap, reason), width)
    longest_word = max((len(w) for r in rows[1:] for w in r[reason].split()), default=0)
    if longest_word > widths[reason]:
        return _table_reason_below(rows, cap, width)
    lines = []
    for r in rows:
        cells = [[c] for c in r]
        cells[cap] = _wrap_list(r[cap], widths[cap])
        # At spaces only: a word longer than the column (a path, `cuda-python`) overflows whole.
        cells[reason] = textwrap.wrap(r[reason], widths[reason], break_long_words=False,
                                      break_on_hyphens=False) or [""]
        for k in range(max(len(c) for c in cells)):
            parts = [(c[k] if k < len(c) else "").ljust(w) for c, w in zip(cells, widths, strict=True)]
            lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _table_reason_below(rows: Sequence[Sequence[str]], cap: int, width: int) -> str:
    """The table for a terminal too narrow for REASON's longest word beside CAPABILITIES: each
    reason goes on indented lines under its backend's row, wrapped at spaces to the full width."""
    body = [list(r[:-1]) for r in rows]
    widths = [max(len(r[i]) for r in body) for i in range(len(body[0]))]
    fixed = sum(w for i, w in enumerate(widths) if i != cap) + 2 * (len(widths) - 1)
    cap_min = max(len(item) + 1 for r in body for item in r[cap].split(","))  # + its comma
    widths[cap] = max(cap_min, min(widths[cap], width - fixed))
    lines = []
    for r, full in zip(body, rows, strict=True):
        cells = [[c] for c in r]
        cells[cap] = _wrap_list(r[cap], widths[cap])
        for k in range(max(len(c) for c in cells)):
            parts = [(c[k] if k < len(c) else "").ljust(w) for c, w in zip(cells, widths, strict=True)]
            lines.append("  ".join(parts).rstrip())
        if full is not rows[0] and full[-1] not in ("", "-"):
            lines += textwrap.wrap(f"reason: {full[-1]}", max(8, width - 4), initial_indent="    ",
                                   subsequent_indent="      ", break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines)


def _details(entries: Sequence[BackendEntry]) -> str:
    blocks = []
    for e in entries:
        lines = [f"{e.name}:"]
        if e.description:
            lines.append(f"  description: {e.description}")
        if e.factory:
            lines.append(f"  factory: {e.factory}")
        if e.error:
            lines.append("  error:")
            lines += [f"    {line}" for line in e.error.rstrip().splitlines()]
        if len(lines) > 1:
            blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def run(args: argparse.Namespace) -> int:
    registry = get_registry()
    entries = registry.entries()
    try:
        selection = registry.choose()
        selected: str | None = selection.name
        verdict = f"selected: {selection.name} ({selection.explanation()})"
    except BackendError as exc:
        selected = None
        verdict = f"selected: none ({exc})"

    if args.json:
        payload: list[dict[str, Any]] = [{**e.to_dict(), "selected": e.name == selected and e.available}
                                         for e in entries]
        print(json.dumps(payload, indent=2))
        return 0

    if not entries:
        print(f"no hisparse backends installed (the {ENTRY_POINT_GROUP!r} entry-point group is empty)")
        return 0
    print(format_table(entries, verbose=args.verbose))
    print()
    print(verdict)
    if args.verbose:
        details = _details(entries)
        if details:
            print()
            print(details)
    return 0
