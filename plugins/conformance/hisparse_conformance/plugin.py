"""pytest plugin of the hisparse conformance suite (entry point `pytest11: hisparse`).

Passive by design, because pytest loads it in every session of every environment where hisparse
is installed: it only adds options, a marker, fixtures and (when the suite runs) a report header.
Nothing here imports torch or a backend until a fixture asks for one. Disable it with
`-p no:hisparse`; run the suite with `pytest --pyargs hisparse_conformance --hisparse-backend NAME`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from hisparse_core.backend import Backend

#: Used when neither --hisparse-backend nor $HISPARSE_BACKEND names a backend.
DEFAULT_BACKEND = "reference_cpu"
ENV_BACKEND = "HISPARSE_BACKEND"
MARKER = "requires_capability"

_PACKAGE_DIR = Path(__file__).resolve().parent
_backend_key = pytest.StashKey["Backend | BaseException"]()

#: Set from --hisparse-examples at configure time; the suite's property tests read it when their
#: modules are imported (which pytest does after configuring).
examples_override: int | None = None

# The suite's helpers assert too; have pytest rewrite them before any test module imports them.
pytest.register_assert_rewrite("hisparse_conformance.model", "hisparse_conformance.scenario",
                               "hisparse_conformance.rig", "hisparse_conformance.examples")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hisparse", "hisparse conformance suite")
    group.addoption("--hisparse-backend", action="store", default=None, metavar="NAME",
                    help=f"backend the conformance suite tests (default: ${ENV_BACKEND}, else {DEFAULT_BACKEND})")
    group.addoption("--hisparse-examples", action="store", type=int, default=None, metavar="N",
                    help="hypothesis examples per property test of the suite (default: each test's own)")


def pytest_configure(config: pytest.Config) -> None:
    global examples_override
    config.addinivalue_line(
        "markers", f"{MARKER}(*names): skip unless the hisparse backend under test declares every capability "
                   "named (hisparse_core.backend.Capability)")
    examples = config.getoption("hisparse_examples")
    if examples is not None and examples < 1:
        raise pytest.UsageError(f"--hisparse-examples must be >= 1, got {examples}")
    examples_override = examples
    backend = config.getoption("hisparse_backend")
    if backend is not None and not backend.strip():
        # `--hisparse-backend "$BACKEND"` with the variable unset would otherwise test reference_cpu.
        raise pytest.UsageError(f"--hisparse-backend is empty ({backend!r}); expected a backend name (`hisparse "
                                f"backends` lists them), or leave the option out to test ${ENV_BACKEND}, else "
                                f"{DEFAULT_BACKEND}")
    if _suite_requested(config):
        _require_backend(config)


def _require_backend(config: pytest.Config) -> None:
    """A session that runs the suite on a backend that cannot be selected, or whose `describe()`
    (the report header: its `device` among others) raises, fails once, before collection, with the
    reason (not once per test, nor in a traceback of the header)."""
    from hisparse_core.errors import HiSparseError
    from hisparse_core.log_hold import held_unless_it_fails

    source = "--hisparse-backend" if config.getoption("hisparse_backend") else (
        f"${ENV_BACKEND}" if os.environ.get(ENV_BACKEND, "").strip() else "the default backend")
    try:
        # Discovery's and the registry's WARNINGs would say the reason again above the usage error.
        with held_unless_it_fails("hisparse_core"):
            backend = selected_backend(config)
    except HiSparseError as exc:  # unknown, unavailable, broken, or a bad setting of its own (check_settings())
        raise pytest.UsageError(
            f"hisparse conformance: {source} {backend_name(config)!r} cannot be selected: {exc}") from None
    try:  # what the report header shows; a `device` that raises would otherwise end the run in a traceback
        backend.describe()
    except Exception as exc:  # noqa: BLE001 -- the vendor's error, reported in one line
        from hisparse_core.discovery import error_summary

        raise pytest.UsageError(
            f"hisparse conformance: {source} {backend_name(config)!r} cannot describe itself: its describe() (name, "
            f"version, API version, device, capabilities) raised {error_summary(exc)}") from None


def backend_name(config: pytest.Config) -> str:
    """The backend the suite tests: the option, else the environment, else reference_cpu.

    Surrounding spaces are dropped and a blank `HISPARSE_BACKEND` is unset, as the registry reads it.
    """
    option = config.getoption("hisparse_backend")
    return (option or "").strip() or os.environ.get(ENV_BACKEND, "").strip() or DEFAULT_BACKEND


def selected_backend(config: pytest.Config) -> Backend:
    """Select (once per session) the backend under test through the registry.

    Raises the registry's `BackendError` (not found, unavailable, broken) unchanged; selection is
    attempted once, so every test that needs the backend reports the same reason.
    """
    cached = config.stash.get(_backend_key, None)
    if cached is None:
        from hisparse_core.registry import select_backend

        try:
            cached = select_backend(backend_name(config))
        except Exception as exc:  # noqa: BLE001 -- remembered and re-raised for every test
            cached = exc
        config.stash[_backend_key] = cached
    if isinstance(cached, BaseException):
        raise cached
    return cached


def _suite_requested(config: pytest.Config) -> bool:
    """Whether this session runs the suite (so the header may select a backend).

    Unrelated sessions never pay for importing torch and a backend here.
    """
    if config.getoption("hisparse_backend"):
        return True
    for arg in config.args:
        name = arg.split("::", 1)[0]
        if name == "hisparse_conformance" or name.startswith("hisparse_conformance."):
            return True
        try:
            path = Path(name).resolve()
        except OSError:
            continue
        if path == _PACKAGE_DIR or _PACKAGE_DIR in path.parents:
            return True
    return False


def _describe(config: pytest.Config) -> str:
    name = backend_name(config)
    try:
        backend = selected_backend(config)
    except Exception as exc:  # noqa: BLE001 -- reported; the fixtures fail the tests
        return f"hisparse backend: {name} (cannot be selected: {type(exc).__name__}: {exc})"
    info = backend.describe()
    capabilities: Any = info.get("capabilities", [])
    caps = ", ".join(str(c) for c in capabilities) or "none"
    return (f"hisparse backend: {info['name']} {info['version']} (api {info['api_version']}, device "
            f"{info['device']}; capabilities: {caps})")


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [_describe(config)] if _suite_requested(config) else []


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    # The header is hidden under -q; CI logs should still say which backend the verdict is about.
    if _suite_requested(config) and config.get_verbosity() < 0:
        terminalreporter.write_line(_describe(config))


@pytest.fixture(scope="session")
def hisparse_backend(pytestconfig: pytest.Config) -> Backend:
    """The backend under test (`--hisparse-backend`); fails the test if it cannot be selected.

    Override this fixture in a conftest to test a backend instance the registry does not know.
    """
    try:
        return selected_backend(pytestconfig)
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"hisparse backend {backend_name(pytestconfig)!r} cannot be selected: "
                    f"{type(exc).__name__}: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def hisparse_reference() -> Backend:
    """A `reference_cpu` backend, the oracle the backend under test is compared with."""
    from hisparse_reference_cpu.backend import ReferenceCpuBackend

    return ReferenceCpuBackend()


@pytest.fixture(scope="session")
def hisparse_capabilities(hisparse_backend: Backend) -> frozenset[str]:
    """Capability names the backend under test declares."""
    return frozenset(hisparse_backend.capabilities)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A marked test gets the capabilities fixture even if it does not ask for it, so the check
    # below sees the backend the test actually uses (an overridden hisparse_backend included).
    for item in items:
        if item.get_closest_marker(MARKER) is not None:
            names = getattr(item, "fixturenames", None)
            if names is not None and "hisparse_capabilities" not in names:
                names.append("hisparse_capabilities")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    required = {str(n) for m in item.iter_markers(MARKER) for n in m.args}
    if not required:
        return
    have = getattr(item, "funcargs", {}).get("hisparse_capabilities")
    if have is None:
        raise pytest.UsageError(f"{item.nodeid}: @{MARKER} needs the hisparse_capabilities fixture")
    # An override returning one name as a str gated on its characters: every marked test skipped as
    # "lacks capability ...", the backend's real capabilities never tested.
    names = None if isinstance(have, (str, bytes)) or not isinstance(have, Iterable) else tuple(have)
    if names is None or not all(isinstance(c, str) for c in names):
        raise pytest.UsageError(f"the hisparse_capabilities fixture returned {have!r} ({type(have).__name__}); "
                                "expected a frozenset of capability names (str)")
    missing = sorted(required - set(names))
    if missing:
        pytest.skip(f"backend lacks capability {', '.join(missing)}")
