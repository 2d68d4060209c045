"""Plugins' sub-commands through the `hisparse.commands` entry points: listed in `hisparse --help`
with their help, run like the core's; one that cannot load is one line, and the rest work.

The end-to-end tests write throwaway distributions (a module + `*.dist-info` with
entry_points.txt) into tmp_path and run `python -m hisparse_core` on them, so the commands are
found through `importlib.metadata` as for a pip-installed plugin; the others hand
`add_plugin_commands` entry points directly.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from core_support import subprocess_env, write_dist

from hisparse_core.cli import COMMANDS, build_parser
from hisparse_core.cli.options import CliParser
from hisparse_core.cli.plugin_commands import ENTRY_POINT_GROUP, add_plugin_commands

HELLO = '''
"""A plugin's command module: light at the top, the work in run."""


def add_parser(subparsers):
    p = subparsers.add_parser("hello", help="greets NAME from a plugin", description="Greets.")
    p.add_argument("--name", default="world", help="whom to greet (default: world)")
    p.set_defaults(func=run)
    return p


def run(args):
    print(f"hello {args.name}")
    return 3
'''


def _hisparse(site: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hisparse_core", *argv], env=subprocess_env(site),
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One working command (`hello`) and one whose module fails to import (`broken-cmd`)."""
    root = tmp_path_factory.mktemp("site")
    tag = uuid.uuid4().hex[:8]
    write_dist(root, "acme-hello", {f"acme_hello_{tag}.py": HELLO}, {"hello": f"acme_hello_{tag}"},
               group=ENTRY_POINT_GROUP)
    write_dist(root, "acme-broken", {f"acme_broken_{tag}.py": "import acme_no_such_module\n"},
               {"broken-cmd": f"acme_broken_{tag}"}, version="2.0", group=ENTRY_POINT_GROUP)
    return root


def _listing(help_text: str, command: str) -> str:
    """The command's entry in the help's list of commands, as one line however the terminal wraps it."""
    flat = " ".join(help_text.split())
    return flat[flat.index(f" {command} ") + 1:]


def test_help_lists_plugin_commands_with_their_help(site: Path) -> None:
    proc = _hisparse(site, "--help")
    assert proc.returncode == 0, proc.stderr
    assert _listing(proc.stdout, "hello").startswith("hello greets NAME from a plugin ")
    assert _listing(proc.stdout, "broken-cmd").startswith(
        "broken-cmd BROKEN: ModuleNotFoundError: No module named 'acme_no_such_module' ")
    for core in COMMANDS:
        assert core in proc.stdout
    assert "Traceback" not in proc.stderr


def test_a_plugin_command_runs_with_its_options(site: Path) -> None:
    proc = _hisparse(site, "hello", "--name", "vendor")
    assert (proc.returncode, proc.stdout) == (3, "hello vendor\n"), proc.stderr
    warnings = proc.stderr.strip().splitlines()
    assert len(warnings) == 1 and "'broken-cmd' command of entry point" in warnings[0], proc.stderr
    bad = _hisparse(site, "hello", "--nme", "x")
    # The command's own parser names it and points to its help, which lists its options.
    assert bad.returncode == 2 and bad.stderr == (
        "hisparse hello: error: unrecognized arguments: --nme x (see hisparse hello --help)\n")


def test_a_broken_plugin_command_is_one_line_and_the_others_work(site: Path) -> None:
    proc = _hisparse(site, "broken-cmd", "--any", "option", "-h")
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    tag = next(p.stem for p in site.glob("acme_broken_*.py"))
    assert lines[0].startswith(f"hisparse broken-cmd: error: the 'broken-cmd' command of entry point broken-cmd = "
                               f"{tag} (acme-broken 2.0) cannot be loaded: ModuleNotFoundError: No module named "
                               "'acme_no_such_module'; reinstall or remove that distribution"), lines[0]
    traced = _hisparse(site, "--log-level", "DEBUG", "broken-cmd")
    assert traced.returncode == 2 and "Traceback" in traced.stderr and "import acme_no_such_module" in traced.stderr
    listing = _hisparse(site, "backends", "--json")
    assert listing.returncode == 0 and '"reference_cpu"' in listing.stdout, listing.stderr
    assert [line for line in listing.stderr.splitlines() if "broken-cmd" in line] == [
        f"WARNING hisparse_core.cli.plugin_commands: {lines[0].removeprefix('hisparse broken-cmd: error: ').partition('; ')[0]}"]
    assert _hisparse(site, "--version").returncode == 0


def test_generate_comes_from_the_transformers_plugin(capsys: pytest.CaptureFixture[str]) -> None:
    """The one command the repository's plugins add, declared in pyproject.toml and installed."""
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    assert eps.get("generate") == "hisparse_transformers.cli", (
        "the installed metadata lacks the hisparse.commands entry point `generate`; reinstall: pip install -e .")
    assert "generate" not in COMMANDS
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert sub.choices["generate"].get_default("func").__module__ == "hisparse_transformers.cli"
    help_line = next(a.help for a in sub._choices_actions if a.dest == "generate")
    assert help_line and help_line.startswith("decode with a real (tiny, random) transformers DSA model")


# In-process: entry points handed in, modules written to a folder on sys.path.


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """write(source) -> the name of a fresh module holding it, importable for this test."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(source: str) -> str:
        name = f"acme_cmd_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(source)
        return name

    return write


def _ep(name: str, value: str) -> importlib.metadata.EntryPoint:
    return importlib.metadata.EntryPoint(name, value, ENTRY_POINT_GROUP)


def _fresh() -> tuple[CliParser, argparse._SubParsersAction]:  # type: ignore[type-arg]
    parser = CliParser(prog="hisparse")
    return parser, parser.add_subparsers(dest="command", required=True)


def _adds(*names: str, func: str = "lambda args: 0", fail: str = "") -> str:
    body = "".join(f"    p = subparsers.add_parser({n!r}, help='adds {n}')\n    p.set_defaults(func={func})\n"
                   for n in names)
    return f"def add_parser(subparsers):\n{body}{fail}    return p\n"


def test_a_module_function_entry_point_works_too(modules) -> None:  # type: ignore[no-untyped-def]
    module = modules(_adds("tool").replace("def add_parser", "def contribute"))
    parser, sub = _fresh()
    added, broken = add_plugin_commands(sub, reserved=COMMANDS, entry_points=[_ep("tool", f"{module}:contribute")])
    assert broken == [] and [p.prog for p in added] == ["hisparse tool"]
    assert parser.parse_args(["tool"]).func(None) == 0


@pytest.mark.parametrize(("source", "reason"), [
    (_adds("tool", "extra"), "add_parser added ['extra', 'tool'] and returned CliParser; expected it to add and "
                             "return the one command named after its entry point, 'tool'"),
    (_adds("other"), "add_parser added ['other']"),
    (_adds("tool", fail="    raise RuntimeError('half-built')\n"), "RuntimeError: half-built"),
    (_adds("tool", func="None"), "add_parser set no func on 'tool'"),
    ("VALUE = 1\n", "has no add_parser(subparsers)"),
    ("raise ImportError('its dependency is missing')\n", "ImportError: its dependency is missing"),
    ("import sys\nsys.exit('acme SDK: no device found')\n", "SystemExit: acme SDK: no device found"),
    (_adds("tool", fail="    raise SystemExit(3)\n"), "SystemExit: 3"),
])
def test_a_command_that_cannot_be_added_leaves_a_stand_in_only(source: str, reason: str,
                                                               modules, capsys) -> None:  # type: ignore[no-untyped-def]
    module = modules(source)
    parser, sub = _fresh()
    added, broken = add_plugin_commands(sub, reserved=COMMANDS,
                                        entry_points=[_ep("tool", module), _ep("fine", modules(_adds("fine")))])
    assert [p.prog for p in added] == ["hisparse fine"]
    assert [b.name for b in broken] == ["tool"] and reason in broken[0].reason, broken[0].reason
    assert sorted(sub.choices) == ["fine", "tool"]  # what it half-added is gone
    [tool_help] = [a.help for a in sub._choices_actions if a.dest == "tool"]
    assert tool_help is not None and tool_help.startswith("BROKEN: ")
    args = parser.parse_args(["tool", "--x", "1"])
    assert args.func(args) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"hisparse tool: error: the 'tool' command of entry point tool = "
                                               f"{module} (no distribution) cannot be loaded: ")


def test_a_core_name_or_a_name_taken_twice_is_reported(modules) -> None:  # type: ignore[no-untyped-def]
    parser, sub = _fresh()
    one, two = modules(_adds("tool")), modules(_adds("tool"))
    same = modules(_adds("same"))
    eps = [_ep("run", modules(_adds("run"))), _ep("tool", one), _ep("tool", two), _ep("same", same), _ep("same", same)]
    added, broken = add_plugin_commands(sub, reserved=COMMANDS, entry_points=eps)
    assert [p.prog for p in added] == ["hisparse same"]  # one distribution seen twice on the path is one
    by_name = {b.name: b for b in broken}
    assert "'run' is a command of hisparse itself" in by_name["run"].reason and not by_name["run"].stands_in
    assert "run" not in sub.choices  # the core adds its own `run` after the plugins
    assert "two distributions add a 'tool' command" in by_name["tool"].reason
    assert f"tool = {one} (no distribution) and entry point tool = {two}" in by_name["tool"].source
    assert by_name["tool"].stands_in and "tool" in sub.choices


def test_what_a_command_module_prints_while_loading_goes_to_stderr(modules, capsys) -> None:  # type: ignore[no-untyped-def]
    # Every start of hisparse loads every command module: a banner its import or add_parser printed
    # landed in front of `hisparse backends --json` (and bench's), which no longer parsed.
    module = modules('print("Acme tools 2.0")\n'
                     + _adds("tool").replace("def add_parser(subparsers):\n",
                                             "def add_parser(subparsers):\n    print('registering tool')\n"))
    parser, sub = _fresh()
    added, broken = add_plugin_commands(sub, reserved=COMMANDS, entry_points=[_ep("tool", module)])
    assert broken == [] and [p.prog for p in added] == ["hisparse tool"]
    out, err = capsys.readouterr()
    assert out == "" and "Acme tools 2.0" in err and "registering tool" in err, (out, err)
