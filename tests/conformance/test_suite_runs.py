"""The conformance suite runs, and passes, on the reference backend, the way a vendor runs it:
`pytest --pyargs hisparse_conformance --hisparse-backend NAME` from a directory outside the
repository. Also: the plugin stays passive in unrelated sessions, can be disabled, and its
capability gate skips with the reason when the suite is embedded with a narrower backend."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from pytest_child import junit_outcomes, run_pytest


@pytest.mark.slow
def test_suite_passes_on_reference_cpu(tmp_path: Path) -> None:
    report = tmp_path / "report.xml"
    proc = run_pytest(["--pyargs", "hisparse_conformance", "--hisparse-backend", "reference_cpu", "-q",
                       "-p", "no:cacheprovider", f"--junitxml={report}"], tmp_path)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert "hisparse backend: reference_cpu" in proc.stdout, tail  # the report header
    outcomes = junit_outcomes(report)
    assert not outcomes["failed"] and not outcomes["error"], tail
    # Every module of the suite contributed passing tests.
    modules = {name.split(".", 1)[0] for name, _ in outcomes["passed"]}
    for module in ("test_resolver", "test_gather", "test_host_pool", "test_transfers", "test_state", "test_rollback",
                   "test_validation"):
        assert module in modules, f"{module} passed no test: {sorted(modules)}"
    # reference_cpu declares every capability but cuda_graph, which no test needs; the only skip is
    # the check that a backend *without* shared pools refuses them.
    assert [name for name, _ in outcomes["skipped"]] == [
        "test_host_pool.test_shared_pool_needs_the_capability"], outcomes["skipped"]


@pytest.mark.parametrize("args, env, source", [
    (["--hisparse-backend", "no-such-backend"], {}, "--hisparse-backend"),
    ([], {"HISPARSE_BACKEND": "no-such-backend"}, "$HISPARSE_BACKEND"),
], ids=["option", "environment"])
def test_an_unknown_backend_fails_once_with_a_usage_error(tmp_path: Path, args: list[str], env: dict[str, str],
                                                          source: str) -> None:
    proc = run_pytest(["--pyargs", "hisparse_conformance", *args, "-q", "-p", "no:cacheprovider"], tmp_path,
                      timeout=300, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 4, output[-3000:]  # pytest's usage error: nothing was collected or run
    errors = [line for line in output.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1 and errors[0].startswith(
        f"ERROR: hisparse conformance: {source} 'no-such-backend' cannot be selected: no hisparse backend named "
        "'no-such-backend'; available: reference_cpu (priority 0)"), output[-3000:]
    assert len(output.strip().splitlines()) <= 3 and "Traceback" not in output, output[-3000:]


@pytest.mark.parametrize("value", ["", " "], ids=["empty", "blank"])
def test_an_empty_backend_option_is_a_usage_error_not_reference_cpu(tmp_path: Path, value: str) -> None:
    """`--hisparse-backend "$BACKEND"` with the variable unset must not test reference_cpu and pass."""
    proc = run_pytest(["--pyargs", "hisparse_conformance", f"--hisparse-backend={value}", "-q", "-p",
                       "no:cacheprovider"], tmp_path, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 4, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("ERROR")]
    assert errors == [f"ERROR: --hisparse-backend is empty ({value!r}); expected a backend name (`hisparse backends` "
                      "lists them), or leave the option out to test $HISPARSE_BACKEND, else reference_cpu"], output[-3000:]
    assert "Traceback" not in output and "passed" not in output, output[-3000:]


def test_a_backend_that_cannot_describe_itself_fails_once_with_a_usage_error(tmp_path: Path) -> None:
    """A vendor's `device` that raises (torch.device("acme", 0) where torch does not know the device
    type yet) broke the report header: an INTERNALERROR traceback, or under -q every test run and
    then a traceback in the closing summary."""
    site = tmp_path / "site"
    package = site / "hisparse_nodevice"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent("""
        from hisparse_core import BackendSpec, hookimpl
        from hisparse_reference_cpu.backend import ReferenceCpuBackend


        class NoDevice(ReferenceCpuBackend):
            name = "nodevice"

            @property
            def device(self):
                raise RuntimeError("Expected one of cpu, cuda device type at start of device string: acme")


        @hookimpl
        def hisparse_register_backends(register):
            register(BackendSpec(name="nodevice", factory="hisparse_nodevice:NoDevice", probe=lambda: None,
                                 capabilities=ReferenceCpuBackend.capabilities))
    """))
    info = site / "hisparse_nodevice-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hisparse-nodevice\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[hisparse.backends]\nnodevice = hisparse_nodevice\n")
    for quiet in ([], ["-q"]):
        proc = run_pytest(["--pyargs", "hisparse_conformance", "--hisparse-backend", "nodevice", *quiet, "-p",
                           "no:cacheprovider"], tmp_path, timeout=300, env={"PYTHONPATH": str(site)})
        output = proc.stdout + proc.stderr
        assert proc.returncode == 4, output[-3000:]
        errors = [line for line in output.splitlines() if line.startswith("ERROR")]
        assert errors == [
            "ERROR: hisparse conformance: --hisparse-backend 'nodevice' cannot describe itself: its describe() (name, "
            "version, API version, device, capabilities) raised RuntimeError: Expected one of cpu, cuda device type "
            "at start of device string: acme"], output[-3000:]
        assert "Traceback" not in output and "INTERNALERROR" not in output and "passed" not in output, output[-3000:]


VENDOR_PLUGIN = """
    from hisparse_core import BackendSpec, hookimpl
    from hisparse_reference_cpu.backend import ReferenceCpuBackend

    from hisparse_acme.backend import Acme  # noqa: F401


    @hookimpl
    def hisparse_register_backends(register):
        register(BackendSpec(name="acme", factory="hisparse_acme.backend:Acme", probe=lambda: None,
                             capabilities=ReferenceCpuBackend.capabilities))
"""
VENDOR_BACKEND = """
    from hisparse_reference_cpu.backend import ReferenceCpuBackend


    class Acme(ReferenceCpuBackend):
        name = "acme"
"""


@pytest.mark.parametrize("plugin, backend, reason", [
    (VENDOR_PLUGIN.replace("from hisparse_acme.backend import Acme", "import acme_sdk"), VENDOR_BACKEND,
     "hisparse backend 'acme' is broken: ModuleNotFoundError: No module named 'acme_sdk'"),
    (VENDOR_PLUGIN.replace("from hisparse_acme.backend import Acme  # noqa: F401", ""), """
        from hisparse_core.backend import Backend
        from hisparse_reference_cpu.backend import ReferenceCpuBackend


        class Acme(Backend):  # create_runtime forgotten
            name, version, capabilities = "acme", "1.0", ReferenceCpuBackend.capabilities
            device = create_host_pool = create_transfer_engine = None
     """, "hisparse backend 'acme': factory 'hisparse_acme.backend:Acme' is abstract: it does not implement "
          "create_runtime"),
    # Its own setting refused by check_settings(): an INTERNALERROR traceback, exit status 3.
    (VENDOR_PLUGIN, VENDOR_BACKEND + """
        @classmethod
        def check_settings(cls):
            from hisparse_core.errors import InvalidInputError
            raise InvalidInputError("ACME_SPLIT='7': expected 0 (off), 2 or 4")
     """, "ACME_SPLIT='7': expected 0 (off), 2 or 4"),
], ids=["entry-point-import-error", "missing-method", "bad-setting"])
def test_a_vendor_backend_that_cannot_be_selected_is_one_line(tmp_path: Path, plugin: str, backend: str,
                                                              reason: str) -> None:
    """A vendor's likely mistakes: the entry point's module does not import, or the class lacks a method
    (the usage error said it below a WARNING of discovery, or of the registry, saying the same); and a
    bad value of the backend's own setting."""
    site = tmp_path / "site"
    package = site / "hisparse_acme"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "plugin.py").write_text(textwrap.dedent(plugin))
    (package / "backend.py").write_text(textwrap.dedent(backend))
    info = site / "hisparse_acme-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hisparse-acme\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[hisparse.backends]\nacme = hisparse_acme.plugin\n")
    proc = run_pytest(["--pyargs", "hisparse_conformance", "--hisparse-backend", "acme", "-q", "-p", "no:cacheprovider"],
                      tmp_path, timeout=300, env={"PYTHONPATH": str(site)})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 4, output[-3000:]
    lines = output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"ERROR: hisparse conformance: --hisparse-backend 'acme' cannot be selected: {reason}"), output[-3000:]


def test_rank_one_finds_a_registered_class_made_at_run_time(tmp_path: Path) -> None:
    """The shared-pool tests' child process imports the class the registry imports (its factory),
    not `__module__:__qualname__`, which no import finds for a class a function made."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent("""
        import pluggy
        import pytest
        from hisparse_core import registry
        from hisparse_core.backend import BackendSpec
        from hisparse_reference_cpu.backend import ReferenceCpuBackend

        def make(name):
            class Made(ReferenceCpuBackend):
                pass
            Made.name = name
            return Made

        Acme = make("acme")
        registry._registry = registry.BackendRegistry([], {"acme": BackendSpec(
            name="acme", factory="conftest:Acme", probe=lambda: None,
            capabilities=ReferenceCpuBackend.capabilities)}, pluggy.PluginManager("hisparse"))

        @pytest.fixture(scope="session")
        def hisparse_backend():
            return Acme()
    """))
    (tmp_path / "test_embedded.py").write_text(
        "from hisparse_conformance.test_host_pool import test_shared_pool_peers_see_the_writers_bytes  # noqa: F401\n"
        "from hisparse_conformance.test_host_pool import test_a_reader_rank_restores_pages_into_its_own_device  # noqa: F401\n")
    proc = run_pytest(["-q", "-p", "no:cacheprovider", "test_embedded.py"], tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_plugin_is_passive_in_unrelated_sessions(tmp_path: Path) -> None:
    """Loaded into every pytest session, it imports neither torch nor a backend there."""
    (tmp_path / "test_unrelated.py").write_text(textwrap.dedent("""
        import sys

        def test_nothing_heavy_was_imported(pytestconfig):
            assert pytestconfig.pluginmanager.has_plugin("hisparse")
            heavy = [m for m in ("torch", "hisparse_core.registry", "hisparse_reference_cpu") if m in sys.modules]
            assert not heavy, heavy
    """))
    proc = run_pytest(["-q", "-p", "no:cacheprovider", "test_unrelated.py"], tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "hisparse backend:" not in proc.stdout


def test_plugin_can_be_disabled(tmp_path: Path) -> None:
    enabled = run_pytest(["--help"], tmp_path, timeout=300)
    disabled = run_pytest(["-p", "no:hisparse", "--help"], tmp_path, timeout=300)
    assert "--hisparse-backend" in enabled.stdout
    assert disabled.returncode == 0 and "--hisparse-backend" not in disabled.stdout


def test_embedded_suite_skips_what_the_backend_lacks(tmp_path: Path) -> None:
    """A vendor's own test tree imports suite modules and overrides `hisparse_backend`; tests
    needing an undeclared capability skip with its name."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent("""
        import pytest
        from hisparse_core.backend import Capability
        from hisparse_reference_cpu.backend import ReferenceCpuBackend

        class FewerCapabilities(ReferenceCpuBackend):
            capabilities = frozenset({Capability.FP8_DS_MLA})

        @pytest.fixture(scope="session")
        def hisparse_backend():
            return FewerCapabilities()
    """))
    (tmp_path / "test_embedded.py").write_text(
        "from hisparse_conformance.test_resolver import *  # noqa: F403\n")
    report = tmp_path / "report.xml"
    proc = run_pytest(["-q", "-p", "no:cacheprovider", "-k", "by_hand", f"--junitxml={report}", "test_embedded.py"],
                      tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    outcomes = junit_outcomes(report)
    assert [name for name, _ in outcomes["skipped"]] == ["test_embedded.test_speculative_union_by_hand"]
    assert "speculative_union" in outcomes["skipped"][0][1]
    assert len(outcomes["passed"]) == 2


class _Options:
    def __init__(self, backend: str | None) -> None:
        self.backend = backend

    def getoption(self, name: str) -> str | None:
        assert name == "hisparse_backend", name
        return self.backend


@pytest.mark.parametrize("option, env, expected", [
    (None, " acme ", "acme"),                 # the registry strips it: the suite names the same backend
    (None, "   ", "reference_cpu"),           # blank is unset, as the registry reads it
    (" acme", "other", "acme"),
    (None, None, "reference_cpu"),
])
def test_the_backend_name_is_read_as_the_registry_reads_it(monkeypatch: pytest.MonkeyPatch, option: str | None,
                                                           env: str | None, expected: str) -> None:
    from hisparse_conformance.plugin import backend_name

    if env is None:
        monkeypatch.delenv("HISPARSE_BACKEND", raising=False)
    else:
        monkeypatch.setenv("HISPARSE_BACKEND", env)
    assert backend_name(_Options(option)) == expected  # type: ignore[arg-type]
