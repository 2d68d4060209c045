"""The `hisparse` command line. Each sub-command is a module here with `add_parser` and `run`."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

#: Sub-command name -> module (imported lazily, so `hisparse backends` never imports torch kernels).
COMMANDS: dict[str, str] = {
    "generate": "hisparse_core.cli.generate_cmd",
    "backends": "hisparse_core.cli.backends_cmd",
    "bench": "hisparse_core.cli.bench_cmd",
    "run": "hisparse_core.cli.run_cmd",
    "plan": "hisparse_core.cli.plan_cmd",
    "new-backend": "hisparse_core.cli.new_backend_cmd",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hisparse", description=__doc__)
    parser.add_argument("--log-level", default=os.environ.get("HISPARSE_LOG_LEVEL", "INFO"),
                        help="logging level (default: INFO, or $HISPARSE_LOG_LEVEL)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # sub-command not built yet
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
