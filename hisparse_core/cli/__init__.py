"""The `hisparse` command line: `hisparse COMMAND --help` for each command's options.

The core's commands are listed in COMMANDS; plugins add theirs through the `hisparse.commands`
entry points (`hisparse_core.cli.plugin_commands`; `hisparse generate` comes from
hisparse_transformers that way). The core imports no plugin.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from hisparse_core.cli.options import CliParser, HelpFormatter, quiet_stdout
from hisparse_core.cli.plugin_commands import BrokenCommand, add_plugin_commands, warn_broken
from hisparse_core.progress import interrupts_kept, raise_pending_interrupt

#: The core's sub-command name -> module. Each module's top level and `add_parser` import nothing
#: heavy (no torch), so `hisparse --help` and `hisparse backends` start fast and work with a broken
#: torch; the heavy imports happen inside each module's `run` (tests/core/test_light_imports.py).
#: The plugins' command modules (`hisparse.commands` entry points) keep the same rule.
COMMANDS: dict[str, str] = {
    "run": "hisparse_core.cli.run_cmd",
    "bench": "hisparse_core.cli.bench_cmd",
    "plan": "hisparse_core.cli.plan_cmd",
    "backends": "hisparse_core.cli.backends_cmd",
    "new-backend": "hisparse_core.cli.new_backend_cmd",
}

DESCRIPTION = """\
hisparse keeps the KV cache of sparse-attention LLMs (DeepSeek-V3.2, GLM-5.x) in host memory and
only the rows each decode step needs on the GPU. These commands try it on this machine; start
with `hisparse backends` to see what can run here, then `hisparse COMMAND --help`.
"""

EPILOG = "Sizes accept units: 40GiB, 512MiB, 1.5G, 80GB. Docs: README.md and docs/ in the repository."

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_LEVEL_HELP = (f"one of {', '.join(LOG_LEVELS)}, before or after the command (default: $HISPARSE_LOG_LEVEL, "
                  "else INFO)")


def _version() -> str:
    from hisparse_core import __version__

    return f"hisparse {__version__}"


def _build_parser() -> tuple[argparse.ArgumentParser, list[BrokenCommand]]:
    parser = CliParser(prog="hisparse", description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=_version())
    parser.add_argument("--log-level", default=None, metavar="LEVEL", help=LOG_LEVEL_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # The plugins' commands first: they are the jobs (`generate`), the core's are the tools.
    commands, broken = add_plugin_commands(sub, reserved=COMMANDS)
    for module_name in COMMANDS.values():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # sub-command not built yet
        commands.append(module.add_parser(sub))
    for command in commands:
        # Also after the sub-command (`hisparse run --log-level DEBUG`); not given there, the
        # value before it (or none) stands.
        command.add_argument("--log-level", default=argparse.SUPPRESS, metavar="LEVEL", help=LOG_LEVEL_HELP)
    return parser, broken


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command: the core's and the installed plugins'."""
    return _build_parser()[0]


def _log_level(args: argparse.Namespace) -> str | None:
    """The level to use, or None after printing the one error line."""
    # an empty variable is unset, as an empty HISPARSE_BACKEND is
    given, source = (args.log_level, "--log-level") if args.log_level is not None else (
        os.environ.get("HISPARSE_LOG_LEVEL", "").strip() or "INFO", "$HISPARSE_LOG_LEVEL")
    level = given.strip().upper()
    if level not in LOG_LEVELS:
        print(f"hisparse: error: {source} {given!r} is not a logging level; expected one of "
              f"{', '.join(LOG_LEVELS)}", file=sys.stderr)
        return None
    return level


class OwnLinesBelowWarning(logging.Filter):
    """Below WARNING, only the lines of hisparse's own loggers (the core's and every plugin's
    `hisparse*` package) reach the terminal: `--log-level DEBUG` shows each step of discovery, not a
    library's (matplotlib's font search under `--plot`: some 2,000 lines), and a library's INFO
    (torch's FakeTensor cache stats at exit after an interrupted import) never shows at the default
    level. Warnings and errors pass from every logger."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.name.startswith("hisparse")


def _configure_logging(level: str) -> None:
    """The root logger at `level` (plugins read it: `generate` holds the engine's lines back at
    INFO), its stderr handler filtered by `OwnLinesBelowWarning`. As `logging.basicConfig`, it
    adds no handler where the root logger has one already (an embedding program's, pytest's)."""
    root = logging.getLogger()
    before = list(root.handlers)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for handler in root.handlers:
        if handler not in before:
            handler.addFilter(OwnLinesBelowWarning())


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """`parse_args`, except that an argument the command does not take is reported by that command's
    parser (`hisparse generate: error: unrecognized arguments: --batch 0 (see hisparse generate
    --help)`), not by the top level's, whose help does not list the command's options."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        command = subparsers.choices.get(args.command, parser)
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


#: The command `main` is running (once parsed), for the line a write error on stdout gets.
_RUNNING: list[str] = []


def _run(argv: Sequence[str] | None) -> int:
    parser, broken = _build_parser()
    args = _parse(parser, argv)
    _RUNNING.append(args.command)
    level = _log_level(args)
    if level is None:
        return 2
    _configure_logging(level)
    warn_broken(broken, args.command)
    try:
        with interrupts_kept():   # a Ctrl-C Python swallows (in a finalizer) is not lost
            status = int(args.func(args) or 0)
            raise_pending_interrupt()   # one swallowed after the last step
        return status
    except ImportError as exc:
        # A dependency that fails to import (a broken torch, say): one line, and where to look.
        what = f"cannot import {exc.name}" if exc.name else "an import failed"
        print(f"hisparse {args.command}: error: {what}: {exc}; `hisparse backends -v` lists what this install "
              "can run", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # commands with steps say at which; this is the fallback
        print(f"hisparse {args.command}: interrupted", file=sys.stderr)
        return 130


class OutputError(Exception):
    """Writing the command's output to stdout failed (`hisparse run --json > out.json` on a full
    disk, `> /dev/full`); the `OSError` is `.error`. A closed pipe stays a `BrokenPipeError`."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class _GuardedStdout:
    """sys.stdout while a command runs: a write or flush that fails raises `OutputError`, which
    `main` says in one line, not the traceback of whichever `print` met the full disk."""

    def __init__(self, stream: object) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return int(self.stream.write(text))  # type: ignore[attr-defined]
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputError(exc) from None

    def flush(self) -> None:
        try:
            self.stream.flush()  # type: ignore[attr-defined]
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputError(exc) from None

    def __getattr__(self, name: str) -> object:
        return getattr(self.stream, name)


def main(argv: Sequence[str] | None = None) -> int:
    guarded = sys.stdout = _GuardedStdout(sys.stdout)  # type: ignore[assignment]
    try:
        try:
            try:
                status = _run(argv)
            finally:
                sys.stdout.flush()  # a closed pipe shows here (also after --help), not at interpreter exit
            return status
        except BrokenPipeError:
            # `hisparse ... | head`: the reader left. Point stdout at /dev/null so the interpreter's
            # own last flush is quiet too, and exit as a shell does for a writer killed by SIGPIPE.
            quiet_stdout()
            return 141
        except KeyboardInterrupt:
            # Before a command runs (main still imports the commands and plugins, or parses): as `_run`
            # says it for a command that runs, without the command's name where none is parsed yet.
            print(f"hisparse{f' {_RUNNING[-1]}' if _RUNNING else ''}: interrupted", file=sys.stderr)
            return 130
        except OutputError as exc:
            # `hisparse run --json > out.json` on a full disk: one line naming the command, then as
            # for a closed pipe (what is still buffered cannot be written either).
            prog = f"hisparse {_RUNNING[-1]}" if _RUNNING else "hisparse"
            print(f"{prog}: error: cannot write the output to stdout: {exc.error.strerror or exc.error}",
                  file=sys.stderr)
            with contextlib.suppress(OSError, ValueError, AttributeError):  # a capture without a descriptor
                quiet_stdout()
            return 1
    finally:
        _RUNNING.clear()
        if sys.stdout is guarded:
            sys.stdout = guarded.stream  # type: ignore[assignment]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
