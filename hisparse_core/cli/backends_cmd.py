"""`hisparse backends [--json] [-v]`: list every backend and whether it can run here.

The table (or JSON) goes to stdout; discovery warnings about broken plugins go to stderr
through logging. The exit status is 0 whenever the listing itself worked, whatever the
backends' statuses: scripts check `status` in `--json` output.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from hisparse_core.errors import BackendError
from hisparse_core.registry import ENTRY_POINT_GROUP, BackendEntry, get_registry

_COLUMNS = ("NAME", "STATUS", "PRIORITY", "VERSION", "CAPABILITIES")
_VERBOSE_COLUMNS = ("PLUGIN", "DISTRIBUTION", "API")


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "backends", help="list hisparse backends and whether each can run here",
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


def format_table(entries: Sequence[BackendEntry], verbose: bool = False) -> str:
    """The aligned table `hisparse backends` prints (REASON last and unpadded)."""
    header = [*_COLUMNS, *(_VERBOSE_COLUMNS if verbose else ()), "REASON"]
    rows = [header] + [_row(e, verbose) for e in entries]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    lines = ["  ".join([*(c.ljust(w) for c, w in zip(r, widths, strict=False)), r[-1]]).rstrip() for r in rows]
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
