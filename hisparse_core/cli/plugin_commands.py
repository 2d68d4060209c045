"""Sub-commands that plugins contribute through the `hisparse.commands` entry points.

A distribution adds a command to `hisparse` with one entry point per command in the group
`hisparse.commands`: the entry name is the command's name, the value a module with
`add_parser(subparsers) -> argparse.ArgumentParser` (or `module:function` naming such a
function), exactly what each of the core's own command modules has. `add_parser` adds the one
sub-parser named after its entry point and sets `func` on it: `func(args) -> int` runs the
command and returns the exit status.

`hisparse` imports every such module and calls its `add_parser` on each start, for `--help` and
`--version` too, so a module's top level and `add_parser` import nothing heavy (no torch, no
model library); `func` imports what the command needs when it runs.

A command that cannot be added (its module fails to import, `add_parser` raises, adds another
name or no `func`, or its name is a core command's or two distributions' at once) never stops
the others: `hisparse --help` lists it as broken with the error on one line, running it prints
that line and exits 2, and every other command logs it as one warning line.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import logging
import sys
import types
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from hisparse_core.discovery import VENDOR_ERRORS, error_summary, format_error, vendor_output_to_stderr

logger = logging.getLogger(__name__)

#: Entry-point group whose entries name the modules of plugins' sub-commands.
ENTRY_POINT_GROUP = "hisparse.commands"

Subparsers = argparse._SubParsersAction  # type: ignore[type-arg]


@dataclass(frozen=True, slots=True)
class BrokenCommand:
    """A plugin command that could not be added: `reason` is the one-line error, `source` says
    which entry point (and distribution) it came from, `error` is the traceback if one was raised."""

    name: str
    source: str
    reason: str
    error: str | None = None
    #: Whether a stand-in that reports the error was added under `name` (not for a core
    #: command's name: the core's command runs under it).
    stands_in: bool = True

    @property
    def line(self) -> str:
        return f"the {self.name!r} command of {self.source} cannot be loaded: {self.reason}"


def _source(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    try:
        where = f"{dist.name} {dist.version}" if dist is not None else "no distribution"
    except Exception:  # unreadable metadata still names the entry point
        where = "unreadable distribution"
    return f"entry point {ep.name} = {ep.value} ({where})"


def _add_one(sub: Subparsers, ep: importlib.metadata.EntryPoint) -> argparse.ArgumentParser:
    """Load the entry point and run its `add_parser`; on any failure the sub-parsers are as
    before and the error propagates."""
    choices, actions = dict(sub.choices), len(sub._choices_actions)
    try:
        with vendor_output_to_stderr():  # stdout is the command's: `hisparse backends --json`
            loaded = ep.load()
            add = getattr(loaded, "add_parser", None) if isinstance(loaded, types.ModuleType) else loaded
            if not callable(add):
                raise TypeError(f"{ep.value} has no add_parser(subparsers); expected a module with one, "
                                "or module:function naming one")
            parser = add(sub)
        added = sorted(set(sub.choices) - set(choices))
        if added != [ep.name] or sub.choices[ep.name] is not parser:
            raise ValueError(f"{ep.value} add_parser added {added or 'no command'} and returned "
                             f"{type(parser).__name__}; expected it to add and return the one command named "
                             f"after its entry point, {ep.name!r}")
        if not callable(parser.get_default("func")):
            raise ValueError(f"{ep.value} add_parser set no func on {ep.name!r}; expected "
                             "parser.set_defaults(func=run), run(args) returning the exit status")
    except BaseException:
        sub.choices.clear()
        sub.choices.update(choices)
        del sub._choices_actions[actions:]
        raise
    return parser


def _report(broken: BrokenCommand, args: argparse.Namespace) -> int:
    if broken.error:
        logger.debug("the %r command failed to load:\n%s", broken.name, broken.error)
    print(f"hisparse {broken.name}: error: {broken.line}; reinstall or remove that distribution "
          f"(`hisparse --log-level DEBUG {broken.name}` shows the traceback)", file=sys.stderr)
    return 2


def _add_broken(sub: Subparsers, broken: BrokenCommand) -> None:
    # Takes whatever follows the name (no option is special: no prefix character can start an
    # argument), so that `hisparse NAME --any --option` reports the load error, not the options.
    help_text = f"BROKEN: {broken.reason}".replace("%", "%%")
    parser = sub.add_parser(broken.name, help=help_text, description=help_text, add_help=False,
                            prefix_chars="\0")
    parser.add_argument("ignored", nargs="*", help=argparse.SUPPRESS)
    parser.set_defaults(func=functools.partial(_report, broken))


def add_plugin_commands(sub: Subparsers, reserved: Collection[str],
                        entry_points: Iterable[importlib.metadata.EntryPoint] | None = None,
                        ) -> tuple[list[argparse.ArgumentParser], list[BrokenCommand]]:
    """Add every plugin command, by name, to `sub`.

    :param reserved: the core's own command names, which no plugin may take.
    :param entry_points: default: the installed `hisparse.commands` entry points (tests pass their own).
    :returns: the parsers added, and the commands that could not be (each added as a stand-in
        that reports its error).
    """
    if entry_points is None:
        entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    by_name: dict[str, list[importlib.metadata.EntryPoint]] = {}
    for ep in entry_points:
        same = by_name.setdefault(ep.name, [])
        if all(ep.value != other.value for other in same):  # a distribution seen twice on the path is one
            same.append(ep)
    added: list[argparse.ArgumentParser] = []
    broken: list[BrokenCommand] = []
    for name in sorted(by_name):
        eps = by_name[name]
        sources = " and ".join(_source(ep) for ep in eps)
        if name in reserved:
            broken.append(BrokenCommand(name, sources, f"{name!r} is a command of hisparse itself; expected the "
                                                       "plugin to name its command otherwise", stands_in=False))
            continue
        if len(eps) > 1:
            broken.append(BrokenCommand(name, sources, f"two distributions add a {name!r} command; expected one "
                                                       "(uninstall the other)"))
        else:
            try:
                added.append(_add_one(sub, eps[0]))
                logger.debug("hisparse command %r added from %s", name, sources)
                continue
            except VENDOR_ERRORS as exc:
                broken.append(BrokenCommand(name, sources, error_summary(exc), format_error(exc)))
        _add_broken(sub, broken[-1])
    return added, broken


def warn_broken(broken: Iterable[BrokenCommand], running: str | None) -> None:
    """One warning line for each broken command, but not for the stand-in being run (which says
    it itself)."""
    for command in broken:
        if not (command.stands_in and command.name == running):
            logger.warning("%s", command.line)
