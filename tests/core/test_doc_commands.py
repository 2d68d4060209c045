"""Every command README.md and docs/*.md give for a repository script (`python bench/X.py ...`,
`hisparse ...` / `python -m hisparse_core ...`, `python -m hisparse_core.replay.calibrate_locality ...`)
is one that script's argparse still accepts: a renamed or removed flag fails here, naming the doc's
file and line. Nothing runs: the script's `main` is called with `ArgumentParser.parse_known_args`
wrapped so that it parses for real and then stops the script (`_Parsed`). docs/gpu-validation.md is
a log of past runs (commands as they were then) and is not read.

Commands come from fenced code blocks (a line each, `\\` continuations joined) and from inline code
spans (a span wrapped over lines joined). A doc's `benign|code`, `[on|auto]` and `20,21,...,35` are
expanded. Of a command with a placeholder (`--backend NAME`, `--cells R:1,...,2048:32`) only the
option names are checked, and its id says so. A case is skipped, its id saying why, for a line
hisparse prints (`hisparse run: interrupted`), a command pinned to an old commit, a placeholder
for the command itself (`hisparse COMMAND --help`), a module whose main takes no argparse
arguments, or a script whose optional dependency is not installed here;
`test_every_doc_command_is_seen` bounds their number and checks that no command is lost.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import re
import shlex
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from bench_scripts import imported

ROOT = Path(__file__).resolve().parents[2]

#: A log of past GPU runs: its commands are what ran then, not what runs now.
NOT_READ = ("gpu-validation.md",)

#: The `hisparse` console script is `hisparse_core.cli.main` (launcher.py only imports it lazily).
CLI_MODULE = "hisparse_core.cli"

#: Doc words that stand for a value the reader fills in: an ellipsis, `<x>`, a shell variable, an
#: upper-case word (`NAME`, `SIZE`) or one of the single letters the docs use so (`N`, `M`, `P`).
PLACEHOLDER = re.compile(r"\.\.\.|…|<[^>]*>|\$|\b[A-Z]{2,}\b(?![=_])|(?<![\w:])[NMP]\b(?![:,])")

#: Lines hisparse prints or logs, quoted in the docs (`hisparse run: interrupted`, the logger
#: `hisparse connector`, a metric `hisparse host_prefix_matched_tokens`): not commands.
MESSAGE = re.compile(r"hisparse (\S+:|backend '|connector |worker rank |host_prefix_matched_tokens$)")


@dataclass(frozen=True)
class DocCommand:
    where: str                    # "docs/results.md:51"
    text: str                     # the command as the doc gives it, its lines joined
    target: str                   # "bench/bench_serving.py" or a module name
    argv: tuple[str, ...]
    skip: str | None = None
    #: A placeholder (`--backend NAME`): only the options named are checked, not their values.
    hole: str | None = None
    #: An inline span may be prose naming a command or a flag (`hisparse new-backend`, `hisparse run
    #: --plot`), the required arguments or the flag's value left out.
    inline: bool = False

    @property
    def id(self) -> str:
        note = f" [skip: {self.skip}]" if self.skip else f" [options only: placeholder {self.hole!r}]" if self.hole else ""
        return f"{self.where}:{self.target}{note}"


def doc_files() -> list[Path]:
    docs = sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in NOT_READ)
    return [ROOT / "README.md", *docs]


@dataclass(frozen=True)
class Code:
    line: int
    text: str
    inline: bool
    before: str = ""     # the paragraph's text just before an inline span


def code_texts(text: str) -> Iterator[Code]:
    """Each fenced block's line (continuations joined) and each inline code span (lines joined)."""
    lines = text.splitlines()
    fence: str | None = None
    paragraph: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None

    def spans() -> Iterator[Code]:
        if not paragraph:
            return
        first = paragraph[0][0]
        joined = "\n".join(line for _, line in paragraph)
        for m in re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", joined, flags=re.S):
            # A table cell writes `|` as `\|`, even inside code.
            yield Code(first + joined.count("\n", 0, m.start()), " ".join(m.group(2).replace("\\|", "|").split()),
                       True, joined[max(0, m.start() - 80):m.start()])
        paragraph.clear()

    for number, line in enumerate(lines, start=1):
        marker = re.match(r"\s*(```+|~~~+)", line)
        if fence is not None:
            if marker and marker.group(1)[0] == fence[0] and len(marker.group(1)) >= len(fence):
                fence = None
                continue
            body = re.sub(r"^\s*\$ ", "", line)
            if pending is not None:
                start, before = pending
                body = f"{before} {body.strip()}"
            else:
                start = number
            if body.rstrip().endswith("\\"):
                pending = (start, body.rstrip()[:-1])
                continue
            pending = None
            yield Code(start, body.strip(), False)
        elif marker:
            yield from spans()
            fence = marker.group(1)
        elif not line.strip():
            yield from spans()
        else:
            paragraph.append((number, line))
    yield from spans()


def _module_file(name: str) -> Path | None:
    """The file of a module of this repository (the core, a backend, a plugin), found without
    importing it: collecting this test imports no backend's or plugin's package."""
    rel = name.replace(".", "/")
    for root in (ROOT, *sorted(ROOT.glob("backends/*")), *sorted(ROOT.glob("plugins/*"))):
        for candidate in (root / f"{rel}.py", root / rel / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def _target(words: list[str]) -> tuple[str, list[str]] | None:
    """The repository entry point a command invokes and its arguments, or None for another program."""
    if words and words[0] == "hisparse":
        return CLI_MODULE, words[1:]
    if words and words[0] in ("python", "python3"):
        words = words[1:]
        if len(words) >= 2 and words[0] == "-m":
            module = CLI_MODULE if words[1] == "hisparse_core" else words[1]
            return (module, words[2:]) if _module_file(module) is not None else None
    # A test module given to pytest (`tests/x/test_y.py -k ...`) is no script.
    if words and words[0].endswith(".py") and (ROOT / words[0]).is_file() and not Path(words[0]).name.startswith("test_"):
        return words[0], words[1:]
    return None


def _source(target: str) -> str:
    path = ROOT / target if target.endswith(".py") else _module_file(target)
    assert path is not None, target
    return path.read_text()


def _not_a_command(part: str, target: str) -> str | None:
    """Why `part`, which names `target`, is not a command to parse, or None."""
    if target == CLI_MODULE and MESSAGE.match(part):
        return "a line hisparse prints or logs, quoted"
    if target != CLI_MODULE and not re.search(r"^def main\(", _source(target), flags=re.M):
        return "no main()"
    if target != CLI_MODULE and "parse_args(" not in _source(target):
        return "its main() parses no arguments with argparse"
    return None


def _alternatives(word: str) -> list[str]:
    """`benign|code` and `[on|auto]` -> each; `20,21,...,35` -> 20 to 35; `[--json` -> `--json`."""
    word = word.removeprefix("[").removesuffix("]")
    if m := re.fullmatch(r"(.*?)(-?\d+),(-?\d+),(?:(-?\d+),)*\.\.\.,(-?\d+)(.*)", word):
        first, second, last = int(m.group(2)), int(m.group(3)), int(m.group(5))
        step = second - first
        if step and (last - first) % step == 0:
            word = m.group(1) + ",".join(str(i) for i in range(first, last + 1, step)) + m.group(6)
    if "|" in word and not any(c in word for c in "'\"( "):
        return word.split("|")
    return [word]


def _expand(words: list[str]) -> list[list[str]]:
    variants: list[list[str]] = [[]]
    for word in words:
        variants = [v + [alt] for v in variants for alt in _alternatives(word)]
    return variants


def commands_in(path: Path) -> Iterator[DocCommand]:
    rel = path.relative_to(ROOT).as_posix()
    for code in code_texts(path.read_text()):
        # one shell command of `a && b`, `a; b`, `a | jq ...` at a time
        for part in re.split(r"\s(?:&&|\|\||;|\|)\s", code.text):
            part = part.strip()
            try:
                words = shlex.split(part, comments=True)
            except ValueError:
                continue
            while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", words[0]):
                words = words[1:]
            found = _target(words)
            if found is None:
                continue
            target, args = found
            if not args and (target == CLI_MODULE or words[0] == target):
                continue  # the program or a file named in prose (`hisparse`, `bench/bench_locality.py`)
            where = f"{rel}:{code.line}"
            if pinned := re.search(r"\(at ([0-9a-f]{7,40})\):?\s*$", code.before):
                # "Command (at 47354dc): ..." is what ran at that commit, a flag since reverted maybe
                yield DocCommand(where, part, target, tuple(args), skip=f"the command as of commit {pinned.group(1)}")
                continue
            if why := _not_a_command(part, target):
                yield DocCommand(where, part, target, tuple(args), skip=why)
                continue
            variants = _expand(args)
            if holes := [m.group(0) for argv in variants if (m := PLACEHOLDER.search(" ".join(argv)))]:
                yield DocCommand(where, part, target, tuple(args), hole=holes[0])
                continue
            for argv in variants:
                yield DocCommand(where, part, target, tuple(argv), inline=code.inline)


def all_commands() -> list[DocCommand]:
    return [c for path in doc_files() for c in commands_in(path)]


COMMANDS = all_commands()


class _Parsed(BaseException):
    """Raised by the wrapped parser once it has parsed: the script stops before any work. A
    BaseException, so that no `except Exception` of the script's takes it."""

    def __init__(self, extras: list[str]) -> None:
        super().__init__()
        self.extras = extras


@contextlib.contextmanager
def stop_after_parsing(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[argparse.ArgumentParser]]:
    """Yields the parsers that parse, in order (the top level's, then a sub-command's). The first
    parse stops the script: one that parsed twice (a pre-parser's parse_known_args first) would fail
    here on the pre-parser's leftovers, not pass unchecked. No script of the docs does now."""
    original: Callable[..., Any] = argparse.ArgumentParser.parse_known_args
    parsers: list[argparse.ArgumentParser] = []
    depth = [0]

    # A sub-command's parser parses from within the top level's parse: only the outermost stops.
    def parse_known_args(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        parsers.append(self)
        depth[0] += 1
        try:
            namespace, extras = original(self, args, namespace)
        finally:
            depth[0] -= 1
        if depth[0]:
            return namespace, extras
        raise _Parsed(extras)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_known_args", parse_known_args)
        yield parsers


@contextlib.contextmanager
def entry_point(target: str) -> Iterator[Callable[..., Any]]:
    """`main` of a repository script (imported as running it does, `bench_scripts.imported`) or module."""
    script = ROOT / target
    saved_path = list(sys.path)  # the scripts put their own folders on it when imported
    try:
        with contextlib.ExitStack() as stack:
            try:
                module: ModuleType = (stack.enter_context(imported(script)) if target.endswith(".py")
                                      else importlib.import_module(target))
            except ModuleNotFoundError as exc:
                top = (exc.name or "").split(".")[0]
                if _module_file(top) is not None or (script.parent / f"{top}.py").is_file():
                    raise
                # an optional extra (triton, transformers, ...) that is not installed here
                pytest.skip(f"{target} cannot be imported here: {exc}")
            yield module.main
    finally:
        sys.path[:] = saved_path


@dataclass
class Parse:
    parsers: list[argparse.ArgumentParser]
    error: str | None    # None: parsed; else why not, as the script says it


def parse(target: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> Parse:
    """What `target`'s main makes of `argv`, stopped once parsed."""
    prog = target if target.endswith(".py") else f"python -m {target}"
    monkeypatch.setattr(sys, "argv", [prog, *argv])   # for a `main()` that reads sys.argv
    out = io.StringIO()
    with entry_point(target) as main, stop_after_parsing(monkeypatch) as parsers:
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                main(argv) if main.__code__.co_argcount else main()
        except _Parsed as parsed:
            # parse_args, and the CLI's own check after parse_known_args, refuse what is left over
            unknown = f"{parsers[-1].prog}: unrecognized arguments: {' '.join(parsed.extras)}"
            return Parse(parsers, unknown if parsed.extras else None)
        except SystemExit as exit_:
            # `--help` and `--version` print and exit 0 from within the parse
            if exit_.code == 0 and {"-h", "--help", "--version"} & set(argv):
                return Parse(parsers, None)
            return Parse(parsers, f"exit status {exit_.code}: {out.getvalue().strip()}")
    return Parse(parsers, f"main returned without parsing its arguments: {out.getvalue()[-500:]}")


@pytest.mark.parametrize("command", COMMANDS, ids=[c.id for c in COMMANDS])
def test_doc_command_parses(command: DocCommand, monkeypatch: pytest.MonkeyPatch) -> None:
    """The script's own parser accepts the doc's arguments. Inline prose may name a command
    without its required arguments (`hisparse new-backend`) or a flag without its value
    (`hisparse run --plot`): then the rest parses and the parser has that flag."""
    if command.skip:
        pytest.skip(f"{command.where}: {command.skip}: {command.text}")
    place = f"{command.where}: `{command.text}`"
    if command.hole:
        check_options_only(command, monkeypatch)
        return
    argv = list(command.argv)
    result = parse(command.target, argv, monkeypatch)
    if result.error is None:
        check_exact_options(place, argv, result.parsers)
        return
    assert command.inline, f"{place}: {result.error}"
    if argv and argv[-1].startswith("-") and f"argument {argv[-1]}: expected one argument" in result.error:
        named = argv.pop()
        result = parse(command.target, argv, monkeypatch)
        assert named in result.parsers[-1]._option_string_actions, f"{place}: {result.parsers[-1].prog} has no {named}"
    assert result.error is None or "the following arguments are required" in result.error, f"{place}: {result.error}"


def check_exact_options(place: str, argv: list[str], parsers: list[argparse.ArgumentParser]) -> None:
    """Each option is named in full: argparse also takes a prefix (`--hot` for `--hot-rows`), which
    stops parsing once another option shares it."""
    known = {name for parser in parsers for name in parser._option_string_actions}
    for option in (w.split("=")[0] for w in argv if re.match(r"--?[a-zA-Z]", w)):
        assert option in known, f"{place}: {option} is no option of {parsers[-1].prog}, only a prefix of one"


def check_options_only(command: DocCommand, monkeypatch: pytest.MonkeyPatch) -> None:
    """A command with a placeholder: the options it names are the (sub-)command's."""
    words = [w.removeprefix("[").removesuffix("]") for w in command.argv]
    first_option = next((i for i, w in enumerate(words) if w.startswith("-")), len(words))
    prefix, rest = words[:first_option], words[first_option:]
    place = f"{command.where}: `{command.text}`"
    if hole := next((w for w in prefix if PLACEHOLDER.search(w)), None):
        pytest.skip(f"{place}: the placeholder {hole!r} names the command itself")
    result = parse(command.target, prefix, monkeypatch)
    assert result.error is None or "arguments are required" in result.error, f"{place}: {result.error}"
    parser = result.parsers[-1]
    for option in (w.split("=")[0] for w in rest if re.match(r"--?[a-zA-Z]", w)):
        assert option in parser._option_string_actions, f"{place}: {parser.prog} has no option {option}"


def test_a_stale_flag_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: an option or sub-command the script does not take, also after a
    sub-command's valid ones."""
    assert parse(CLI_MODULE, ["run", "--preset", "large"], monkeypatch).error is None
    assert "hisparse run: unrecognized arguments: --no-such-flag" in str(
        parse(CLI_MODULE, ["run", "--preset", "large", "--no-such-flag"], monkeypatch).error)
    assert "invalid choice: 'no-such-command'" in str(parse(CLI_MODULE, ["no-such-command"], monkeypatch).error)
    refused = parse("bench/bench_locality.py", ["--no-such-flag", "1"], monkeypatch).error
    assert "unrecognized arguments: --no-such-flag 1" in str(refused), refused
    assert "argument --top-k: expected an integer" in str(parse("bench/bench_locality.py", ["--top-k", "x"], monkeypatch).error)


def test_every_doc_command_is_seen() -> None:
    """The docs' commands are found (README's `hisparse generate`, ones wrapped over lines, in
    fenced blocks), and those skipped are few, each for a reason its id says."""
    found = {(c.where.split(":")[0], c.target) for c in COMMANDS}
    assert {("README.md", CLI_MODULE), ("docs/results.md", "bench/bench_serving.py"),
            ("docs/vllm.md", "bench/bench_nvidia.py"), ("docs/vendors.md", CLI_MODULE)} <= found
    # Any code that looks like one of those commands gave a case: none is lost to the extraction.
    seen = {c.where for c in COMMANDS}
    looks = re.compile(r"([A-Za-z_]\w*=\S*\s+)*(python3? (-m hisparse|bench/\S+\.py|tests/\S+/(?!test_)\w+\.py)|hisparse [a-z-]+)")
    for path in doc_files():
        for code in code_texts(path.read_text()):
            where = f"{path.relative_to(ROOT).as_posix()}:{code.line}"
            for part in re.split(r"\s(?:&&|\|\||;|\|)\s", code.text):
                assert not looks.match(part.strip()) or where in seen, f"{where}: no case for `{part}`"
    parsed = [c for c in COMMANDS if not c.skip and not c.hole]
    assert len(parsed) >= 100, len(parsed)
    assert len([c for c in COMMANDS if c.hole]) <= 15, [c.id for c in COMMANDS if c.hole]
    assert len([c for c in COMMANDS if c.skip]) <= 20, [c.id for c in COMMANDS if c.skip]
