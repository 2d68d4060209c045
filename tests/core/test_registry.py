"""The backend registry, in process: discovery, statuses, filters, selection and its messages.

Most tests install throwaway distributions (`fake_site`) and discover only those, so they do not
depend on which in-tree backends exist yet; the in-tree ones have their own tests at the end.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import io
import json
import logging
import sys

import pytest
from core_support import FAKE_BACKEND_CLASS as FAKE_BACKEND
from core_support import FakeSite, plugin_source

from hisparse_core.backend import API_VERSION, Backend
from hisparse_core.cli import main
from hisparse_core.errors import BackendNotFoundError, BackendUnavailableError
from hisparse_core.registry import (
    ENTRY_POINT_GROUP,
    BackendRegistry,
    BackendStatus,
    get_registry,
    resolve_backend_class,
    select_backend,
)

# --- statuses -------------------------------------------------------------------------------


def test_available_backend_is_listed_with_its_spec(fake_site: FakeSite) -> None:
    package = fake_site.backend("alpha", priority=7)
    entry = fake_site.registry().get("alpha")
    assert entry.status is BackendStatus.AVAILABLE and entry.available
    assert (entry.priority, entry.version, entry.capabilities) == (7, "1.0", ("index_sharing",))
    assert entry.reason is None and entry.error is None
    assert entry.factory == f"{package}.backend:FakeBackend"
    assert entry.plugin == "alpha" and entry.distribution == package.replace("_", "-")
    assert entry.distribution_version == "1.0" and entry.api_version == API_VERSION


def test_discovery_does_not_import_the_factory_module(fake_site: FakeSite) -> None:
    package = fake_site.backend("lazy")
    reg = fake_site.registry()
    assert f"{package}.plugin" in sys.modules
    assert f"{package}.backend" not in sys.modules
    reg.resolve_backend_class("lazy")
    assert f"{package}.backend" in sys.modules


def test_probe_reason_makes_a_backend_unavailable(fake_site: FakeSite) -> None:
    fake_site.backend("gpuonly", probe="return 'no CUDA device'")
    entry = fake_site.registry().get("gpuonly")
    assert entry.status is BackendStatus.UNAVAILABLE
    assert entry.reason == "no CUDA device"
    assert entry.error is None


def test_probe_that_raises_is_unavailable_with_the_error(fake_site: FakeSite, caplog: pytest.LogCaptureFixture) -> None:
    fake_site.backend("flaky", probe="raise OSError('driver query failed')")
    with caplog.at_level(logging.WARNING):
        entry = fake_site.registry().get("flaky")
    assert entry.status is BackendStatus.UNAVAILABLE
    assert entry.reason == "probe raised OSError: driver query failed"
    assert "Traceback" in (entry.error or "") and "driver query failed" in (entry.error or "")
    assert "probe raised OSError" in caplog.text


@pytest.mark.parametrize("verdict", ["False", "''", "42"])
def test_probe_returning_something_else_is_unavailable_and_says_what_was_expected(fake_site: FakeSite,
                                                                                 verdict: str) -> None:
    fake_site.backend("odd", probe=f"return {verdict}")
    entry = fake_site.registry().get("odd")
    assert entry.status is BackendStatus.UNAVAILABLE
    assert entry.reason is not None and "expected None (can run) or a non-empty reason string" in entry.reason


def test_api_version_mismatch_is_unavailable_without_probing(fake_site: FakeSite) -> None:
    never = "raise AssertionError('a backend for another API version must not be probed')"
    fake_site.backend("future", plugin_source_text=plugin_source(
        "future", "x.y:Z", probe=never, extra=f", api_version={API_VERSION + 1}"))
    entry = fake_site.registry().get("future")
    assert entry.status is BackendStatus.UNAVAILABLE
    assert entry.reason == (f"built for hisparse backend API version {API_VERSION + 1}; "
                            f"this hisparse provides API version {API_VERSION}")


def test_plugin_that_fails_to_import_is_broken_and_the_others_still_work(
        fake_site: FakeSite, caplog: pytest.LogCaptureFixture) -> None:
    fake_site.backend("good")
    fake_site.backend("bad", plugin_source_text="raise RuntimeError('vendor SDK missing: libacme.so')\n")
    with caplog.at_level(logging.WARNING, logger="hisparse_core"):
        reg = fake_site.registry()
    bad = reg.get("bad")
    assert bad.status is BackendStatus.BROKEN
    assert bad.reason == "RuntimeError: vendor SDK missing: libacme.so"
    assert "Traceback" in (bad.error or "") and "libacme.so" in (bad.error or "")
    assert reg.get("good").available
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "'bad'" in warnings[0].getMessage() and "broken" in warnings[0].getMessage()


def test_a_plugin_probe_or_factory_that_calls_sys_exit_is_listed_and_the_others_still_work(
        fake_site: FakeSite) -> None:
    # A vendor SDK that exits on a machine without its device must not end every hisparse process.
    fake_site.backend("good")
    fake_site.backend("importexit", plugin_source_text="import sys\nsys.exit('acme SDK: no device found')\n")
    fake_site.backend("probeexit", probe="raise SystemExit(3)")
    fake_site.backend("classexit", factory_source="raise SystemExit('acme SDK: no device found')\n")
    reg = fake_site.registry()
    assert reg.get("importexit").status is BackendStatus.BROKEN
    assert reg.get("importexit").reason == "SystemExit: acme SDK: no device found"
    assert reg.get("probeexit").status is BackendStatus.UNAVAILABLE
    assert reg.get("probeexit").reason == "probe raised SystemExit: 3"
    with pytest.raises(BackendUnavailableError, match="failed to import: SystemExit: acme SDK: no device found"):
        reg.select_backend("classexit")
    assert reg.get("classexit").status is BackendStatus.BROKEN
    assert reg.get("good").available


def test_plugin_without_a_hookimpl_is_broken_with_a_hint(fake_site: FakeSite) -> None:
    fake_site.backend("nohook", plugin_source_text="def hisparse_register_backends(register):\n    pass\n")
    entry = fake_site.registry().get("nohook")
    assert entry.status is BackendStatus.BROKEN
    assert entry.reason is not None and "no @hisparse_core.hookimpl hisparse_register_backends" in entry.reason


def test_plugin_that_registers_nothing_is_broken(fake_site: FakeSite) -> None:
    fake_site.backend("empty", plugin_source_text=(
        "from hisparse_core import hookimpl\n\n@hookimpl\ndef hisparse_register_backends(register):\n    pass\n"))
    entry = fake_site.registry().get("empty")
    assert entry.status is BackendStatus.BROKEN
    assert entry.reason is not None and "never called register(BackendSpec(...))" in entry.reason


def test_misspelt_hook_is_caught_by_check_pending_for_that_plugin_only(fake_site: FakeSite) -> None:
    fake_site.backend("fine")
    fake_site.backend("typo", plugin_source_text=(
        "from hisparse_core import hookimpl\n\n@hookimpl\ndef hisparse_register_backend(register):\n    pass\n"))
    reg = fake_site.registry()
    typo = reg.get("typo")
    assert typo.status is BackendStatus.BROKEN
    assert "hisparse_register_backend" in (typo.reason or "")
    assert reg.get("fine").available


def test_hookimpl_with_unknown_argument_is_broken(fake_site: FakeSite) -> None:
    fake_site.backend("wrongarg", plugin_source_text=(
        "from hisparse_core import hookimpl\n\n@hookimpl\ndef hisparse_register_backends(registrar):\n    pass\n"))
    entry = fake_site.registry().get("wrongarg")
    assert entry.status is BackendStatus.BROKEN
    assert "registrar" in (entry.reason or "")


def test_an_unhashable_entry_point_object_is_broken_and_the_others_still_work(fake_site: FakeSite) -> None:
    # pluggy keeps plugins in sets; an unhashable one took discovery (and every backend) down.
    package = fake_site.backend("fine")
    fake_site.backend("odd", plugin_source_text=(
        "import types\n\nfrom hisparse_core import hookimpl\n\n\n@hookimpl\n"
        "def hisparse_register_backends(register):\n    pass\n\n\n"
        "PLUGIN = types.SimpleNamespace(hisparse_register_backends=hisparse_register_backends)\n"))
    odd = importlib.metadata.EntryPoint("odd", f"{package.removesuffix('_fine')}_odd.plugin:PLUGIN", ENTRY_POINT_GROUP)
    fine = [ep for ep in fake_site.entry_points() if ep.name == "fine"]
    reg = BackendRegistry.discover([*fine, odd], {})
    entry = reg.get("odd")
    assert entry.status is BackendStatus.BROKEN
    assert entry.reason is not None and "SimpleNamespace" in entry.reason and "expected a module" in entry.reason
    assert reg.get("fine").available


def test_invalid_spec_is_rejected_naming_the_bad_value(fake_site: FakeSite) -> None:
    fake_site.backend("badfactory", plugin_source_text=plugin_source("badfactory", "no_colon_here"))
    entry = fake_site.registry().get("badfactory")
    assert entry.status is BackendStatus.BROKEN
    assert "factory 'no_colon_here'; expected 'module:Class'" in (entry.reason or "")


def test_duplicate_backend_names_are_an_error_naming_both_plugins(fake_site: FakeSite) -> None:
    fake_site.backend("dup", plugin="first")
    fake_site.backend("dup", plugin="second", dist="second-dist")
    reg = fake_site.registry()
    names = {e.name: e for e in reg.entries()}
    assert names["dup"].status is BackendStatus.BROKEN
    assert names["second"].status is BackendStatus.BROKEN
    for entry in (names["dup"], names["second"]):
        assert "backend name 'dup' is registered twice" in (entry.reason or "")
        assert "plugin 'first'" in (entry.reason or "") and "plugin 'second' (second-dist 1.0)" in (entry.reason or "")
    with pytest.raises(BackendUnavailableError, match="registered twice"):
        reg.select_backend("dup")


# --- filters --------------------------------------------------------------------------------


def test_disabled_plugins_are_not_imported_and_listed_as_unavailable(fake_site: FakeSite) -> None:
    package = fake_site.backend("off")
    fake_site.backend("on")
    reg = fake_site.registry({"HISPARSE_DISABLED_PLUGINS": " off , other"})
    off = reg.get("off")
    assert off.status is BackendStatus.UNAVAILABLE
    assert off.reason == "plugin 'off' is disabled by HISPARSE_DISABLED_PLUGINS"
    assert f"{package}.plugin" not in sys.modules
    assert reg.get("on").available


def test_allowlist_loads_only_the_named_plugins(fake_site: FakeSite) -> None:
    fake_site.backend("keep")
    package = fake_site.backend("skip")
    reg = fake_site.registry({"HISPARSE_PLUGINS": "keep"})
    assert reg.get("keep").available
    assert reg.get("skip").reason == "plugin 'skip' is not in HISPARSE_PLUGINS (keep)"
    assert f"{package}.plugin" not in sys.modules


def test_empty_allowlist_loads_nothing(fake_site: FakeSite) -> None:
    fake_site.backend("any")
    reg = fake_site.registry({"HISPARSE_PLUGINS": ""})
    assert reg.get("any").reason == "plugin 'any' is not in HISPARSE_PLUGINS (<empty>)"
    with pytest.raises(BackendUnavailableError, match="no hisparse backend is available"):
        reg.choose(environ={})


# --- selection ------------------------------------------------------------------------------


def test_automatic_selection_takes_the_highest_priority_and_logs_why(
        fake_site: FakeSite, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_site.backend("low", priority=1)
    fake_site.backend("high", priority=50)
    fake_site.backend("faster", priority=99, probe="return 'no Acme card'")
    reg = fake_site.registry()
    with caplog.at_level(logging.INFO, logger="hisparse_core.registry"):
        backend = reg.select_backend()
    assert isinstance(backend, Backend) and backend.name == "high"
    assert caplog.messages[-1] == ("hisparse backend 'high' selected (automatic: highest priority among "
                                   "[high (50), low (1)]); unavailable: faster (unavailable: no Acme card)")


def test_a_repeated_selection_is_logged_once_at_info(fake_site: FakeSite, caplog: pytest.LogCaptureFixture) -> None:
    """A vLLM worker selects the backend for the ops and again for the connector: the choice and
    its reason are said once; a repeat is DEBUG. Another choice (or reason) is said again."""
    fake_site.backend("low", priority=1)
    fake_site.backend("high", priority=50)
    reg = fake_site.registry()
    with caplog.at_level(logging.DEBUG, logger="hisparse_core.registry"):
        reg.select_backend()
        reg.select_backend()
        reg.select_backend("low")
        reg.select_backend("low")
    said = [(r.levelno, r.getMessage().split(";")[0]) for r in caplog.records if " selected (" in r.getMessage()]
    assert said == [(logging.INFO, "hisparse backend 'high' selected (automatic: highest priority among "
                                   "[high (50), low (1)])"),
                    (logging.DEBUG, "hisparse backend 'high' selected (automatic: highest priority among "
                                    "[high (50), low (1)])"),
                    (logging.INFO, "hisparse backend 'low' selected (explicit)"),
                    (logging.DEBUG, "hisparse backend 'low' selected (explicit)")]


def test_priority_tie_is_broken_by_name_with_a_warning(fake_site: FakeSite,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    fake_site.backend("zeta", priority=5)
    fake_site.backend("beta", priority=5)
    reg = fake_site.registry()
    with caplog.at_level(logging.WARNING, logger="hisparse_core.registry"):
        selection = reg.choose(environ={})
    assert selection.name == "beta" and not selection.explicit
    assert "tie at the highest priority 5" in caplog.text and "HISPARSE_BACKEND" in caplog.text


def test_explicit_unknown_backend_lists_what_is_available_and_why_not(fake_site: FakeSite) -> None:
    fake_site.backend("ok", priority=3)
    fake_site.backend("nope", probe="return 'needs an Acme card'")
    reg = fake_site.registry()
    with pytest.raises(BackendNotFoundError) as info:
        reg.select_backend("missing")
    assert str(info.value) == ("no hisparse backend named 'missing'; available: ok (priority 3); "
                               "not available: nope (unavailable: needs an Acme card)")
    assert isinstance(info.value, LookupError)


@pytest.mark.parametrize("name", ["acme", "core"], ids=["vendor-package", "hisparse-own-package"])
def test_an_unknown_backend_whose_package_imports_says_to_install_it(
        fake_site: FakeSite, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    # A vendor's scaffold on PYTHONPATH (not pip-installed) imports, but has no entry point: "no backend
    # named 'acme'" gave no reason. hisparse's own packages (hisparse_core for 'core') are no backend's.
    fake_site.backend("ok")
    package = fake_site.root / "pythonpath" / f"hisparse_{name}"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    if name != "core":
        monkeypatch.syspath_prepend(str(package.parent))
    with pytest.raises(BackendNotFoundError) as info:
        fake_site.registry().select_backend(name)
    hint = (f". Package hisparse_{name} imports (at {package / '__init__.py'}) but no installed distribution has a "
            f"'hisparse.backends' entry point that registers '{name}': install its distribution (pip install -e DIR). "
            "Entry points are read from installed metadata, not from PYTHONPATH, and an editable install rereads them "
            "only when reinstalled")
    assert str(info.value) == f"no hisparse backend named '{name}'; available: ok (priority 10)" + (
        hint if name != "core" else "")


def test_explicit_unavailable_backend_fails_with_its_reason_and_the_alternatives(fake_site: FakeSite) -> None:
    fake_site.backend("ok", priority=3)
    fake_site.backend("nope", probe="return 'needs an Acme card'")
    reg = fake_site.registry()
    with pytest.raises(BackendUnavailableError) as info:
        reg.select_backend("nope")
    message = str(info.value)
    assert message.startswith("hisparse backend 'nope' is unavailable: needs an Acme card; available: ok (priority 3)")
    assert "hisparse backends -v" in message


def test_explicit_broken_backend_fails_with_its_error(fake_site: FakeSite) -> None:
    fake_site.backend("ok")
    fake_site.backend("bad", plugin_source_text="import not_a_real_module_xyz\n")
    with pytest.raises(BackendUnavailableError, match="'bad' is broken: ModuleNotFoundError: No module named"):
        fake_site.registry().select_backend("bad")


def test_hisparse_backend_variable_selects(fake_site: FakeSite, monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    fake_site.backend("low", priority=1)
    fake_site.backend("high", priority=50)
    reg = fake_site.registry()
    monkeypatch.setenv("HISPARSE_BACKEND", "low")
    with caplog.at_level(logging.INFO, logger="hisparse_core.registry"):
        assert reg.select_backend().name == "low"
    assert "hisparse backend 'low' selected (explicit: HISPARSE_BACKEND=low)" in caplog.text
    # The argument wins over the variable.
    assert reg.select_backend("high").name == "high"


@pytest.mark.parametrize(("variable", "argument", "expected"), [
    (" Auto ", None, "high"),      # the variable's auto: automatic, as unset
    ("AUTO", "auto", "high"),      # both auto
    ("low", "auto", "low"),        # the argument's auto defers to the variable
    (None, " auto", "high"),
])
def test_auto_asks_for_automatic_selection_wherever_a_name_is_taken(
        fake_site: FakeSite, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        variable: str | None, argument: str | None, expected: str) -> None:
    """`HISPARSE_BACKEND=auto` was refused ("no hisparse backend named 'auto'") while the vLLM
    connector's key, `hisparse_transformers.enable(backend="auto")` and the docs took `auto` as the
    automatic choice. The registry reads it so, in the variable and the argument alike."""
    fake_site.backend("low", priority=1)
    fake_site.backend("high", priority=50)
    reg = fake_site.registry()
    if variable is None:
        monkeypatch.delenv("HISPARSE_BACKEND", raising=False)
    else:
        monkeypatch.setenv("HISPARSE_BACKEND", variable)
    with caplog.at_level(logging.INFO, logger="hisparse_core.registry"):
        assert reg.select_backend(argument).name == expected
    why = "explicit: HISPARSE_BACKEND=low" if expected == "low" else "automatic: highest priority among [high (50)"
    assert f"hisparse backend {expected!r} selected ({why}" in caplog.text


def test_hisparse_backend_naming_an_unknown_backend_says_where_the_name_came_from(
        fake_site: FakeSite, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_site.backend("only")
    reg = fake_site.registry()
    monkeypatch.setenv("HISPARSE_BACKEND", "typo")
    with pytest.raises(BackendNotFoundError, match=r"no hisparse backend named 'typo' \(from HISPARSE_BACKEND\); "
                                                   r"available: only \(priority 10\)"):
        reg.select_backend()


def test_nothing_available_lists_every_reason(fake_site: FakeSite) -> None:
    fake_site.backend("a", probe="return 'no A'")
    fake_site.backend("b", probe="return 'no B'")
    with pytest.raises(BackendUnavailableError) as info:
        fake_site.registry().select_backend()
    assert "no hisparse backend is available here; available: none; not available: " in str(info.value)
    assert "a (unavailable: no A)" in str(info.value) and "b (unavailable: no B)" in str(info.value)


def test_factory_that_fails_to_import_marks_the_backend_broken(fake_site: FakeSite) -> None:
    fake_site.backend("late", factory_source="raise ImportError('libacme.so: cannot open shared object')\n")
    reg = fake_site.registry()
    assert reg.get("late").available
    with pytest.raises(BackendUnavailableError, match="factory '.*' failed to import: ImportError: libacme.so"):
        reg.select_backend("late")
    after = reg.get("late")
    assert after.status is BackendStatus.BROKEN and "libacme.so" in (after.error or "")


@pytest.mark.parametrize("source, needle", [
    ("FakeBackend = 42\n", "is 42, not a subclass of hisparse_core.Backend"),
    ("from hisparse_core.backend import Backend\nclass FakeBackend(Backend):\n    pass\n",
     "is abstract: it does not implement create_host_pool, create_runtime, create_transfer_engine, device"),
    # A subclass of another backend that keeps its name would be reported, and tested, as that one.
    (FAKE_BACKEND.format(name="reference_cpu"),
     "declares name 'reference_cpu'; expected 'shape', the name its BackendSpec registers"),
    (FAKE_BACKEND.format(name="shape").replace('    name = "shape"\n', ""),
     "declares no name; expected 'shape', the name its BackendSpec registers"),
    (FAKE_BACKEND.format(name="shape").replace('    version = "1.0"\n', ""),
     "declares no version; expected a str"),
    # A capability named without its frozenset was taken as its characters: a drift warning listing
    # ['8', ':', '_', 'a', ...], and the class ran declaring none of them.
    (FAKE_BACKEND.format(name="shape").replace('frozenset({"index_sharing"})', '"index_sharing"'),
     "declares capabilities 'index_sharing' (str); expected a frozenset of str (Capability names)"),
    (FAKE_BACKEND.format(name="shape").replace('frozenset({"index_sharing"})', '("index_sharing", 1)'),
     "declares capabilities ('index_sharing', 1) (tuple); expected a frozenset of str (Capability names)"),
])
def test_factory_must_be_a_concrete_backend_subclass(fake_site: FakeSite, source: str, needle: str) -> None:
    fake_site.backend("shape", factory_source=source)
    with pytest.raises(BackendUnavailableError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        fake_site.registry().resolve_backend_class("shape")


def test_module_functions_use_one_cached_registry(fake_site: FakeSite, monkeypatch: pytest.MonkeyPatch) -> None:
    first = get_registry()
    assert get_registry() is first
    fake_site.backend("newcomer", priority=10_000)
    assert all(e.name != "newcomer" for e in get_registry().entries())
    reloaded = get_registry(reload=True)
    assert reloaded is not first
    assert reloaded.get("newcomer").available
    assert select_backend().name == "newcomer"
    assert resolve_backend_class("newcomer").__name__ == "FakeBackend"


# --- a class that fails at selection, capability drift -----------------------------------------

MISSING_MODULE = "import hisparse_acme_sdk_that_is_not_installed\n"


def test_automatic_selection_falls_back_past_a_class_that_fails_to_import(
        fake_site: FakeSite, caplog: pytest.LogCaptureFixture) -> None:
    fake_site.backend("acme", priority=50, factory_source=MISSING_MODULE)
    fake_site.backend("base", priority=1)
    reg = fake_site.registry()
    assert reg.get("acme").available  # the probe passed: nothing is wrong until the class is imported
    with caplog.at_level(logging.INFO, logger="hisparse_core"):
        assert reg.select_backend().name == "base"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("hisparse backend 'acme' could not be loaded and is now listed as broken: factory ")
    assert "ModuleNotFoundError: No module named 'hisparse_acme_sdk_that_is_not_installed'" in warnings[0]
    assert "falling back to 'base'" in warnings[0]
    assert caplog.messages[-1].startswith("hisparse backend 'base' selected (automatic: highest priority among "
                                          "[base (1)]); unavailable: acme (broken: factory ")
    acme = reg.get("acme")
    assert acme.status is BackendStatus.BROKEN and "Traceback" in (acme.error or "")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hisparse_core"):
        assert reg.select_backend().name == "base"  # broken from then on: no second attempt, no new warning
    assert caplog.records == []
    with pytest.raises(BackendUnavailableError, match="'acme' is broken: factory .* ModuleNotFoundError"):
        reg.select_backend("acme")


def test_a_constructor_that_raises_is_broken_and_skipped_too(fake_site: FakeSite,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    raising = (FAKE_BACKEND.format(name="picky")
               + "\n    def __init__(self):\n        raise RuntimeError('no Acme card answered')\n")
    fake_site.backend("picky", priority=9, factory_source=raising)
    fake_site.backend("base", priority=1)
    reg = fake_site.registry()
    with caplog.at_level(logging.WARNING, logger="hisparse_core"):
        assert reg.select_backend().name == "base"
    assert len(caplog.records) == 1 and "RuntimeError: no Acme card answered" in caplog.records[0].getMessage()
    assert reg.get("picky").status is BackendStatus.BROKEN


CONSTRUCTOR_RAISES = FAKE_BACKEND.format(name="picky") + "\n    def __init__(self):\n        raise RuntimeError('no card')\n"


@pytest.mark.parametrize(("call", "source", "needle"), [
    *((call, MISSING_MODULE, "ModuleNotFoundError: No module named 'hisparse_acme_sdk_that_is_not_installed'")
      for call in ("select_backend", "resolve_backend_class", "check_settings")),
    *((call, FAKE_BACKEND.format(name="picky").replace("    def create_runtime", "    def create_runtime_"),
       "is abstract: it does not implement create_runtime")
      for call in ("select_backend", "resolve_backend_class", "check_settings")),
    ("select_backend", CONSTRUCTOR_RAISES, "RuntimeError: no card"),  # only selection constructs
])
def test_an_explicit_selection_that_fails_raises_the_reason_and_logs_nothing(
        fake_site: FakeSite, caplog: pytest.LogCaptureFixture, source: str, needle: str, call: str) -> None:
    # The caller prints the error in one line (`hisparse run --backend picky`, the conformance run's usage
    # error, the vLLM connector's ERROR line); a WARNING of the registry said the same above it.
    fake_site.backend("picky", priority=9, factory_source=source)
    reg = fake_site.registry()
    with caplog.at_level(logging.DEBUG, logger="hisparse_core"), pytest.raises(BackendUnavailableError, match=needle):
        getattr(reg, call)("picky")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert reg.get("picky").status is BackendStatus.BROKEN


def test_when_every_class_fails_the_error_lists_each_failure(fake_site: FakeSite) -> None:
    fake_site.backend("one", priority=2, factory_source=MISSING_MODULE)
    fake_site.backend("two", priority=1, factory_source="FakeBackend = 42\n")
    with pytest.raises(BackendUnavailableError) as info:
        fake_site.registry().select_backend()
    message = str(info.value)
    assert message.startswith("no hisparse backend is available here; available: none; not available: ")
    assert "one (broken: factory " in message and "ModuleNotFoundError" in message
    assert "two (broken: factory " in message and "is 42, not a subclass" in message


def test_the_cli_falls_back_past_a_broken_vendor_backend(fake_site: FakeSite) -> None:
    fake_site.backend("acme", priority=500, factory_source=MISSING_MODULE)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["bench", "--requests", "1", "--context", "256", "--steps", "2", "--top-k", "16",
                     "--layers", "1", "--block-size", "16", "--json", "--no-progress"])
    assert code == 0 and json.loads(out.getvalue())["backend"]["name"] == "reference_cpu"


DRIFT_CLASS = FAKE_BACKEND.replace('capabilities = frozenset({{"index_sharing"}})',
                                   'capabilities = frozenset({{"cuda_graph"}})')


def test_capability_drift_is_reported_once_at_selection(fake_site: FakeSite, caplog: pytest.LogCaptureFixture) -> None:
    package = fake_site.backend("drifty", factory_source=DRIFT_CLASS.format(name="drifty"))
    reg = fake_site.registry()
    assert reg.get("drifty").capabilities == ("index_sharing",)  # what its plugin advertises
    with caplog.at_level(logging.WARNING, logger="hisparse_core"):
        reg.select_backend("drifty")
        reg.select_backend("drifty")
    assert len(caplog.records) == 1, caplog.messages
    message = caplog.messages[0]
    assert message.startswith("hisparse backend 'drifty': capability drift: its BackendSpec declares "
                              f"['index_sharing'] that {package}.backend:FakeBackend does not; "
                              f"{package}.backend:FakeBackend declares ['cuda_graph'] that its BackendSpec does not")
    assert reg.get("drifty").capabilities == ("cuda_graph",)  # listed as what runs from now on
    assert reg.spec("drifty").capabilities == frozenset({"index_sharing"})  # the registration as made


@pytest.mark.parametrize("capabilities, needle", [
    (frozenset(), "backend 'plain' does not declare 'vllm_ops'"),
    (frozenset({"vllm_ops"}), "backend 'plain' declares 'vllm_ops' but does not implement Backend.vllm_ops(); "
                              "expected an override returning a hisparse_core.vllm_ops.VllmHiSparseOps"),
], ids=["undeclared", "declared"])
def test_the_default_vllm_ops_says_whether_the_capability_was_declared(capabilities: frozenset[str],
                                                                      needle: str) -> None:
    from hisparse_core.errors import InvalidInputError

    class Plain(Backend):
        name = "plain"
        version = "1.0"
        device = create_host_pool = create_runtime = create_transfer_engine = None

    Plain.capabilities = capabilities
    with pytest.raises(InvalidInputError) as raised:
        Plain().vllm_ops()
    assert str(raised.value).startswith(needle)


def test_matching_capabilities_are_silent(fake_site: FakeSite, caplog: pytest.LogCaptureFixture) -> None:
    fake_site.backend("steady")
    with caplog.at_level(logging.WARNING, logger="hisparse_core"):
        fake_site.registry().select_backend("steady")
    assert caplog.records == []


def test_in_tree_backends_declare_what_their_plugins_advertise() -> None:
    reg = get_registry(reload=True)
    for name in ("reference_cpu", "nvidia"):
        spec = reg.spec(name)
        module_name, _, cls_name = spec.factory.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except ImportError as exc:  # nvidia without cuda-python
            pytest.skip(f"{spec.factory} does not import here: {exc}")
        assert frozenset(cls.capabilities) == frozenset(spec.capabilities), name


# --- filters that match nothing -----------------------------------------------------------------


def test_a_plugin_filter_that_names_no_installed_plugin_warns_with_the_installed_names(
        fake_site: FakeSite, caplog: pytest.LogCaptureFixture) -> None:
    fake_site.backend("alpha")
    fake_site.backend("beta")
    with caplog.at_level(logging.WARNING, logger="hisparse_core"):
        reg = fake_site.registry({"HISPARSE_PLUGINS": "alpah"})
    assert caplog.messages == ["HISPARSE_PLUGINS names 'alpah', which is no installed hisparse plugin, so no plugin "
                               "is loaded; installed plugins: alpha, beta"]
    assert not reg.available()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hisparse_core"):
        reg = fake_site.registry({"HISPARSE_DISABLED_PLUGINS": "beta, nope, gamma"})
    assert caplog.messages == ["HISPARSE_DISABLED_PLUGINS names 'gamma', 'nope', which are no installed hisparse "
                               "plugin; installed plugins: alpha, beta"]
    assert [e.name for e in reg.available()] == ["alpha"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hisparse_core"):
        fake_site.registry({"HISPARSE_PLUGINS": "alpha, typo"})  # one match: loads alpha, warns of the typo
        fake_site.registry({"HISPARSE_PLUGINS": ""})  # set but empty means "none" on purpose: silent
    assert caplog.messages == ["HISPARSE_PLUGINS names 'typo', which is no installed hisparse plugin; installed "
                               "plugins: alpha, beta"]


# --- the in-tree backends ---------------------------------------------------------------------


def test_reference_cpu_is_discovered_and_selectable() -> None:
    reg = get_registry(reload=True)
    entry = reg.get("reference_cpu")
    assert entry.available and entry.distribution == "hisparse"
    assert entry.factory is not None and entry.factory.startswith("hisparse_reference_cpu.")
    backend = reg.select_backend("reference_cpu")
    assert backend.name == "reference_cpu" and str(backend.device) == "cpu"


def test_nvidia_is_unavailable_with_a_reason_on_a_machine_without_a_gpu() -> None:
    import shutil

    if shutil.which("nvidia-smi"):
        pytest.skip("this machine may have an NVIDIA GPU")
    entry = get_registry(reload=True).get("nvidia")
    assert entry.status is BackendStatus.UNAVAILABLE, entry
    assert entry.reason
