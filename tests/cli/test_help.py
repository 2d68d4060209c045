"""Help as a user reads it: what each command is for, every option described once with its
default, the size units, the built-in models' values; `--version`; a backends table that fits."""

from __future__ import annotations

import dataclasses
import re

import pytest

from hisparse_core import __version__
from hisparse_core.cli import bench_cmd, main, run_cmd
from hisparse_core.cli.backends_cmd import format_table
from hisparse_core.registry import get_registry


def _help(*argv: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_top_level_help_is_for_users(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(capsys=capsys)
    assert "module" not in text and "add_parser" not in text
    for cmd in ("generate", "run", "bench", "plan", "backends", "--version", "--log-level"):
        assert cmd in text
    assert "GiB" in text  # the size units


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"hisparse {__version__}"


@pytest.mark.parametrize(("argv", "command", "unknown"), [
    (["run", "--nope", "1"], "run", "--nope 1"),
    (["generate", "--batch", "0"], "generate", "--batch 0"),
    (["--nope", "plan"], "plan", "--nope"),
    (["bench", "--steps", "2", "extra"], "bench", "extra"),
])
def test_an_unknown_argument_names_the_command_and_its_help(argv: list[str], command: str, unknown: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """The command's parser reports it, pointing to the help that lists the command's options."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (f"hisparse {command}: error: unrecognized arguments: {unknown} "
                                       f"(see hisparse {command} --help)\n")


@pytest.mark.parametrize("cmd", ["run", "bench", "plan", "generate", "backends"])
def test_every_option_is_described_once(cmd: str, capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(cmd, capsys=capsys)
    assert "(default: None)" not in text
    flat = " ".join(text.split())
    assert not re.search(r"\(default: [^)]*\) \(default:", flat), "a default shown twice"
    # Every option has a help text of its own (argparse prints a bare flag line otherwise).
    from hisparse_core.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[cmd]
    for action in sub._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and len(action.help) > 12 and not action.help.startswith("("), action.option_strings


def test_run_help_describes_seed_top_k_block_size_and_units(capsys: pytest.CaptureFixture[str]) -> None:
    flat = " ".join(_help("run", capsys=capsys).split())
    assert re.search(r"--seed N seed of .*same seed", flat)
    assert re.search(r"--top-k K positions the synthetic indexer picks", flat)
    assert re.search(r"--block-size TOKENS tokens per KV page", flat)
    assert "units: B, K/KiB, M/MiB, G/GiB" in flat


def test_plan_help_shows_the_built_in_models(capsys: pytest.CaptureFixture[str]) -> None:
    from hisparse_core.planner import MODELS

    flat = " ".join(_help("plan", capsys=capsys).split())
    for name, geo in MODELS.items():
        assert f"{name} {geo.num_layers} layers, {geo.row_bytes} B rows" in flat
        assert f"{name} {geo.index_share}" in flat  # in --index-share's built-in values
    assert "units: B, K/KiB" in flat


@pytest.mark.parametrize(("module", "config"), [(run_cmd, "hisparse_core.replay.engine:RunConfig"),
                                                (bench_cmd, "hisparse_core.replay.bench:BenchConfig")])
def test_help_defaults_are_the_configs_defaults(module: object, config: str) -> None:
    """The light copy of the defaults that `--help` shows equals the real config's."""
    import importlib

    mod, _, cls = config.partition(":")
    real = {f.name: f.default for f in dataclasses.fields(getattr(importlib.import_module(mod), cls))}
    shown = module.DEFAULTS  # type: ignore[attr-defined]
    assert {k: real[k] for k in shown} == shown


@pytest.mark.parametrize("width", [80, 100, 120, 300])
def test_backends_table_fits_the_terminal(width: int) -> None:
    entries = get_registry().entries()
    table = format_table(entries, width=width)
    assert max(len(line) for line in table.splitlines()) <= width
    # Nothing is lost: every capability and every word of each reason is still there.
    flat = " ".join(table.split())
    for e in entries:
        for cap in e.capabilities:
            assert cap in table
        for word in (e.reason or "").split():
            assert word in flat
    if width == 300:
        assert len(table.splitlines()) == 1 + len(entries)  # wide enough: one line per backend


@pytest.mark.parametrize("width", [20, 40, 60, 80])
@pytest.mark.parametrize("verbose", [False, True])
def test_backends_table_never_breaks_a_word(width: int, verbose: bool) -> None:
    """REASON wraps at spaces only (`-v` or a narrow terminal used to cut `cuda-python` and
    longer words mid-word): every word of every reason is whole on one line."""
    entries = get_registry().entries()
    entries.append(dataclasses.replace(entries[0], name="long_reason", reason=(
        "cannot load /opt/vendor/lib/libaccelerator_runtime.so.12: cuda-python not installed: pip install "
        "'hisparse[nvidia]'")))
    table = format_table(entries, verbose=verbose, width=width)
    words = {w for line in table.splitlines() for w in line.split()}
    for e in entries:
        for word in (e.reason or "").split():
            assert word in words, (word, table)


def _walk_parsers(parser, name: str = "hisparse"):  # type: ignore[no-untyped-def]
    import argparse

    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _walk_parsers(sub, f"{name} {sub_name}")


def test_every_bounded_option_shows_its_range_in_help() -> None:
    """What the README promises: `hisparse COMMAND --help` shows every option's accepted range
    (`generate --prompts`, `run --decode-tokens` and `run --steps` used not to)."""
    from hisparse_core.cli import build_parser

    checked = set()
    for name, parser in _walk_parsers(build_parser()):
        bare = "".join(parser.format_help().split())
        for action in parser._actions:
            accepted = getattr(action.type, "accepted", None)
            if not action.option_strings or accepted is None:
                continue
            checked.add((name, action.option_strings[-1]))
            # The option's own entry, as the help prints it (its text may name other flags, so it
            # does not end at the next `--`; the usage line has the flag too), compared without
            # white space, which the wrapping of the whole help places differently.
            formatter = parser._get_formatter()
            formatter.add_argument(action)
            entry = "".join(formatter.format_help().split())
            assert entry in bare, f"{name} {action.option_strings[-1]}: its entry is not in the help"
            assert "".join(accepted.split()) in entry, f"{name} {action.option_strings[-1]}: no {accepted}"
    assert {("hisparse generate", "--prompts"), ("hisparse run", "--decode-tokens"),
            ("hisparse run", "--steps")} <= checked
