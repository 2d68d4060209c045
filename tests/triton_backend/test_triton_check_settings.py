"""`TritonBackend.check_settings()`: every `HISPARSE_TRITON_*` variable with a bad value, and every rule
across them that needs no device, is refused in one line before anything is built, by the functions a
runtime's construction calls (`shapes.tuning`, `auto.check_target`, `auto.choose`); the CLI exits 2
with that line and no host pool.

The variables are found in the package's source, so a new knob without a row in `BAD` fails
`test_every_variable_of_the_package_has_bad_values`. Host logic only (and one small CLI process).
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hisparse_triton
from hisparse_core import registry
from hisparse_core.errors import InvalidInputError
from hisparse_triton import auto, shapes
from hisparse_triton.backend import TritonBackend

BAD: dict[str, tuple[str, ...]] = {
    shapes.RESOLVER_ENV: ("fast", "Gather"),
    shapes.THREADS_ENV: ("96", "many", "-64"),
    shapes.PLAN_PER_SM_ENV: ("0", "33", "x"),
    shapes.PLAN_ENTRIES_ENV: ("5", "64"),
    shapes.FUSE_ENV: ("2", "yes"),
    shapes.LEAN_ENV: ("true",),
    shapes.CAS_ENV: ("on",),
    shapes.SCAN_ENV: ("2",),
    shapes.SHIFT_ENV: ("-1",),
    shapes.ROW_COPY_ENV: ("01",),
    shapes.PDL_ENV: ("2",),
    shapes.LEAN_COPY_ENV: ("no",),
    shapes.SPLIT_ENV: ("7", "3", "32"),
    shapes.SPLIT_TAIL_ENV: ("2",),
    shapes.SPLIT_KEEP_ENV: ("keep",),
    shapes.SPEC_COPY_ENV: ("16", "256"),
    shapes.PDL_CHAIN_ENV: ("2",),
    auto.AUTO_ENV: ("2", "auto"),
}
#: Settings each of whose values is good alone but that do not go together (or not on this target):
#: (environment, the variable the line starts with).
RULES: list[tuple[dict[str, str], str]] = [
    ({shapes.RESOLVER_ENV: "scratch", shapes.FUSE_ENV: "1"}, shapes.FUSE_ENV),
    ({shapes.RESOLVER_ENV: "scratch", shapes.SCAN_ENV: "1"}, shapes.SCAN_ENV),
    ({shapes.SPLIT_ENV: "8", shapes.LEAN_ENV: "0"}, shapes.LEAN_ENV),
    ({shapes.SPLIT_ENV: "0", shapes.SPLIT_TAIL_ENV: "1"}, shapes.SPLIT_TAIL_ENV),
    ({shapes.SPLIT_ENV: "8", shapes.SPLIT_TAIL_ENV: "1", shapes.SPEC_COPY_ENV: "32"}, shapes.SPEC_COPY_ENV),
    ({shapes.SPLIT_ENV: "8", shapes.SPLIT_TAIL_ENV: "1", shapes.SPLIT_KEEP_ENV: "1"}, shapes.SPLIT_KEEP_ENV),
    ({shapes.SPLIT_ENV: "0", shapes.SPEC_COPY_ENV: "64"}, shapes.SPEC_COPY_ENV),  # no batch size takes the split
    ({auto.AUTO_ENV: "0", shapes.SPEC_COPY_ENV: "32"}, shapes.SPEC_COPY_ENV),
    ({shapes.PDL_CHAIN_ENV: "1", shapes.PDL_ENV: "0"}, shapes.PDL_CHAIN_ENV),
    ({shapes.PDL_ENV: "1"}, shapes.PDL_ENV),  # the interpreter has no programmatic dependent launch
    ({shapes.PDL_CHAIN_ENV: "1"}, shapes.PDL_CHAIN_ENV),
]


def package_variables() -> set[str]:
    """Every `HISPARSE_*` name the package's modules quote."""
    root = Path(hisparse_triton.__file__).parent
    return {m for path in root.glob("*.py") for m in re.findall(r"[\"'](HISPARSE_[A-Z0-9_]+)[\"']", path.read_text())}


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in BAD:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return monkeypatch


def test_every_variable_of_the_package_has_bad_values() -> None:
    assert package_variables() == set(BAD)


def test_a_clean_environment_is_accepted(clean_env: pytest.MonkeyPatch) -> None:
    assert TritonBackend.check_settings() is None


@pytest.mark.parametrize(("name", "value"), [(n, v) for n, values in BAD.items() for v in values])
def test_each_bad_value_is_one_line_naming_the_variable(name: str, value: str, clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(name, value)
    with pytest.raises(InvalidInputError) as err:
        TritonBackend.check_settings()
    text = str(err.value)
    assert text.startswith(f"{name}={value!r} ") and "expected" in text and "\n" not in text, text


@pytest.mark.parametrize(("env", "named"), RULES)
def test_settings_that_do_not_go_together_are_refused(env: dict[str, str], named: str,
                                                      clean_env: pytest.MonkeyPatch) -> None:
    for name, value in env.items():
        clean_env.setenv(name, value)
    with pytest.raises(InvalidInputError) as err:
        TritonBackend.check_settings()
    assert str(err.value).startswith(f"{named}=") and "\n" not in str(err.value), str(err.value)


VALUES = {name: ("", *values) for name, values in {
    shapes.RESOLVER_ENV: ("gather", "scratch"), shapes.THREADS_ENV: ("256", "512"), shapes.FUSE_ENV: ("0", "1"),
    shapes.LEAN_ENV: ("0", "1"), shapes.CAS_ENV: ("1",), shapes.SCAN_ENV: ("0", "1"), shapes.PDL_ENV: ("0", "1"),
    shapes.SPLIT_ENV: ("0", "8"), shapes.SPLIT_TAIL_ENV: ("0", "1"), shapes.SPLIT_KEEP_ENV: ("1",),
    shapes.SPEC_COPY_ENV: ("0", "32"), shapes.PDL_CHAIN_ENV: ("0", "1"), shapes.PLAN_ENTRIES_ENV: ("4",),
    auto.AUTO_ENV: ("0", "1"),
}.items()}


def _refusal(call: object) -> str | None:
    try:
        call()  # type: ignore[operator]
    except InvalidInputError as exc:
        return str(exc)
    return None


@given(env=st.fixed_dictionaries({k: st.sampled_from(v) for k, v in VALUES.items()}), pdl=st.booleans())
@settings(max_examples=150, deadline=None)
def test_the_check_refuses_exactly_what_a_runtime_of_any_size_refuses(env: dict[str, str], pdl: bool) -> None:
    env = {k: v for k, v in env.items() if v}

    def build(b: int, small: int) -> None:  # what TritonRuntime.__init__ runs on the environment
        auto.check_target(shapes.tuning(env), pdl=pdl, found=lambda: "the target")
        auto.choose(env, max_batch_rows=b, small=small, pdl=pdl)

    said = _refusal(lambda: auto.check(env, pdl=pdl, found=lambda: "the target"))
    for b, small in ((1, 1), (2, 1), (7, 3), (16, 16), (64, 16), (128, 33)):
        assert _refusal(lambda b=b, small=small: build(b, small)) == said, (b, small)


def test_the_cli_refuses_in_one_line_before_the_backend_or_its_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    from hisparse_core.cli import main

    built: list[str] = []
    monkeypatch.setattr(TritonBackend, "__init__", lambda self, *a, **k: built.append("backend"))
    monkeypatch.setattr(TritonBackend, "create_host_pool", lambda self, spec: built.append("pool"))
    monkeypatch.setattr(registry, "_registry", None)
    monkeypatch.delenv("HISPARSE_BACKEND", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(shapes.SPLIT_ENV, "7")
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(["run", "--backend", "triton", "--requests", "1", "--context", "256", "--steps", "2",
                     "--no-progress"])
    assert code == 2 and built == [] and out.getvalue() == ""
    assert err.getvalue() == (f"hisparse run: error: {shapes.SPLIT_ENV}='7' is not a program count; expected 0 (off) "
                              "or one of 2, 4, 8, 16\n")
    assert registry.get_registry().get("triton").available  # not marked broken: the user fixes the variable


def test_the_cli_process_exits_2_with_one_line_and_no_traceback() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HISPARSE_")}
    env.update(TRITON_INTERPRET="1", HISPARSE_TRITON_SPLIT="7")
    proc = subprocess.run([sys.executable, "-m", "hisparse_core", "run", "--backend", "triton", "--requests", "1",
                           "--context", "256", "--steps", "2", "--no-progress"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == ["hisparse run: error: HISPARSE_TRITON_SPLIT='7' is not a program count; "
                                        "expected 0 (off) or one of 2, 4, 8, 16"], proc.stderr
