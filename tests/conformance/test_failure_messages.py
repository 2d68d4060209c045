"""A backend that breaks a contract clause gets a failure that states the clause, not only
"DID NOT RAISE": the suite embedded with a deliberately wrong backend."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pytest_child import junit_outcomes, run_pytest


def failures_of(tmp_path: Path, conftest: str, imports: str) -> dict[str, str]:
    """Run the suite's tests that `imports` brings in, against the backend `conftest` defines, in a
    child pytest: each failed test's message (the run must fail)."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent(conftest))
    (tmp_path / "test_embedded.py").write_text(imports)
    report = tmp_path / "report.xml"
    proc = run_pytest(["-q", "-p", "no:cacheprovider", f"--junitxml={report}", "test_embedded.py"], tmp_path,
                      timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    return dict(junit_outcomes(report)["failed"])


@pytest.mark.slow
def test_a_broken_clause_is_named_in_the_failure(tmp_path: Path) -> None:
    # Accepts shared pools without declaring shared_host_pool; and its host pools accept layer -1.
    failed = failures_of(tmp_path, """
        import pytest
        from hisparse_core.backend import Capability
        from hisparse_reference_cpu.backend import ReferenceCpuBackend

        class Wrong(ReferenceCpuBackend):
            capabilities = ReferenceCpuBackend.capabilities - {Capability.SHARED_HOST_POOL}

            def create_host_pool(self, spec):
                pool = super().create_host_pool(spec)
                view = pool.layer_view
                pool.layer_view = lambda layer: view(max(layer, 0))
                return pool

        @pytest.fixture(scope="session")
        def hisparse_backend():
            return Wrong()
    """, "from hisparse_conformance.test_host_pool import test_release_is_idempotent_and_final  # noqa: F401\n"
         "from hisparse_conformance.test_host_pool import test_shared_pool_needs_the_capability  # noqa: F401\n")
    assert failed["test_embedded.test_shared_pool_needs_the_capability"] == (
        "Failed: contract: a backend that does not declare shared_host_pool must reject "
        "create_host_pool(HostPoolSpec(shared=True)) with InvalidInputError (the call returned instead of raising "
        "InvalidInputError)")
    assert failed["test_embedded.test_release_is_idempotent_and_final"] == (
        "Failed: contract: layer_view(layer) rejects a negative layer (the call returned instead of raising "
        "InvalidInputError)")


@pytest.mark.parametrize("drop, add, message", [
    ({"speculative_union"}, set(), "capability drift: the BackendSpec advertises ['speculative_union'] that "
                                   "conftest:Drifty lacks"),
    (set(), {"cuda_graph"}, "capability drift: conftest:Drifty declares ['cuda_graph'] that the BackendSpec does "
                            "not advertise"),
], ids=["class-lacks", "class-adds"])
def test_capability_drift_names_only_the_side_that_differs(tmp_path: Path, drop: set[str], add: set[str],
                                                            message: str) -> None:
    # The registered spec is the reference's set; the class drops or adds a capability.
    failed = failures_of(tmp_path, f"""
        import pluggy
        import pytest
        from hisparse_core import registry
        from hisparse_core.backend import BackendSpec
        from hisparse_reference_cpu.backend import ReferenceCpuBackend

        class Drifty(ReferenceCpuBackend):
            name = "drifty"
            capabilities = (ReferenceCpuBackend.capabilities - {drop!r}) | {add!r}

        registry._registry = registry.BackendRegistry([], {{"drifty": BackendSpec(
            name="drifty", factory="conftest:Drifty", probe=lambda: None,
            capabilities=ReferenceCpuBackend.capabilities)}}, pluggy.PluginManager("hisparse"))

        @pytest.fixture(scope="session")
        def hisparse_backend():
            return Drifty()
    """, "from hisparse_conformance.test_declaration import *  # noqa: F403\n")
    assert failed["test_embedded.test_the_class_declares_what_its_plugin_advertises"].startswith(
        f"AssertionError: {message}\n"), failed


def test_a_misspelt_capability_names_the_known_ones(tmp_path: Path) -> None:
    # Declared alike by the spec and the class, "index-sharing" passed the drift check; the index_sharing
    # tests were skipped as lacking it, and the one failure read only "unknown capabilities".
    failed = failures_of(tmp_path, """
        import pluggy
        import pytest
        from hisparse_core import registry
        from hisparse_core.backend import BackendSpec
        from hisparse_reference_cpu.backend import ReferenceCpuBackend

        class Typo(ReferenceCpuBackend):
            name = "typo"
            capabilities = ReferenceCpuBackend.capabilities - {"index_sharing"} | {"index-sharing"}

        registry._registry = registry.BackendRegistry([], {"typo": BackendSpec(
            name="typo", factory="conftest:Typo", probe=lambda: None, capabilities=Typo.capabilities)},
            pluggy.PluginManager("hisparse"))

        @pytest.fixture(scope="session")
        def hisparse_backend():
            return Typo()
    """, "from hisparse_conformance.test_declaration import *  # noqa: F403\n")
    assert failed["test_embedded.test_the_class_declares_what_its_plugin_advertises"].startswith(
        "AssertionError: unknown capabilities ['index-sharing']; expected names of hisparse_core.backend.Capability "
        "(async_transfers, cuda_graph, index_sharing, "), failed


def test_a_backend_that_declares_no_row_format_fails_instead_of_skipping_everything(tmp_path: Path) -> None:
    # Every data-path test needs a row format: without one the suite skipped them all and passed.
    failed = failures_of(tmp_path, """
        import pytest
        from hisparse_reference_cpu.backend import ReferenceCpuBackend

        class NoFormat(ReferenceCpuBackend):
            capabilities = frozenset({"index_sharing"})

        @pytest.fixture(scope="session")
        def hisparse_backend():
            return NoFormat()
    """, "from hisparse_conformance.test_declaration import *  # noqa: F403\n")
    assert failed["test_embedded.test_the_backend_serves_a_row_format"].startswith(
        "AssertionError: the backend declares no row format (capabilities: ['index_sharing']); expected "
        "row_format:fp8_ds_mla, row_format:bf16_mla or both: every test that moves rows would skip"), failed


@pytest.mark.parametrize("resolve_body, message", [
    ("out = super().resolve(inputs, gather=gather, validate=validate)\n"
     "                self._result = ResolveResult(*(t.clone() for t in (out.rows, out.valid_counts, out.plan_host,\n"
     "                                                                   out.plan_device, out.plan_counts)))\n"
     "                return self._result",
     "contract: resolve fills the runtime's result workspace in place, the tensors runtime.result held when the "
     "runtime was bound (ResolveResult: runtime-owned tensors of fixed shape, rewritten in place, so a captured "
     "CUDA graph stays valid); after this call runtime.result.rows is not the bound workspace's rows"),
    ("super().resolve(inputs, gather=gather, validate=validate)",
     "contract: resolve returns the runtime's result workspace (runtime.result, a ResolveResult); it returned None"),
], ids=["new-workspace-each-call", "returns-none"])
def test_a_resolve_outside_the_result_workspace_is_named(tmp_path: Path, resolve_body: str, message: str) -> None:
    # Right values, in new tensors each call (or returned as None): every check read runtime.result's
    # values, so the first passed the whole suite and the second failed with "'NoneType' object has
    # no attribute 'rows'".
    failed = failures_of(tmp_path, f"""
        import pytest
        from hisparse_core.runtime import ResolveResult
        from hisparse_reference_cpu.backend import ReferenceCpuBackend
        from hisparse_reference_cpu.runtime import ReferenceRuntime

        class Fresh(ReferenceRuntime):
            def resolve(self, inputs, *, gather=True, validate=True):
                {resolve_body}

        class Wrong(ReferenceCpuBackend):
            def create_runtime(self, config):
                return Fresh(config)

        @pytest.fixture(scope="session")
        def hisparse_backend():
            return Wrong()
    """, "from hisparse_conformance.test_resolver import test_lru_victims_and_order_by_hand  # noqa: F401\n")
    assert failed["test_embedded.test_lru_victims_and_order_by_hand"].startswith(f"AssertionError: {message}"), failed


def test_a_property_failure_prints_its_reproduce_failure_blob(tmp_path: Path) -> None:
    """docs/conformance.md promises a `@reproduce_failure` line; hypothesis prints one only with
    print_blob, which this repository's test profiles set and a vendor's run (no profile) did not."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent("""
        import pytest
        from hisparse_reference_cpu.backend import ReferenceCpuBackend
        from hisparse_reference_cpu.runtime import ReferenceRuntime

        class OffByOne(ReferenceRuntime):
            def resolve(self, inputs, *, gather=True, validate=True):
                out = super().resolve(inputs, gather=gather, validate=validate)
                out.valid_counts[0] += 1
                return out

        class Wrong(ReferenceCpuBackend):
            def create_runtime(self, config):
                return OffByOne(config)

        @pytest.fixture(scope="session")
        def hisparse_backend():
            return Wrong()
    """))
    (tmp_path / "test_embedded.py").write_text(
        "from hisparse_conformance.test_gather import test_gathered_rows_hold_host_bytes  # noqa: F401\n")
    # No --hypothesis-profile (run_pytest passes this session's ci profile, whose print_blob would hide it).
    child = {k: v for k, v in os.environ.items() if not k.startswith(("HISPARSE_", "PYTEST_", "HYPOTHESIS"))}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "test_embedded.py"],
                          cwd=tmp_path, env=child, capture_output=True, text=True, timeout=300, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    assert "@reproduce_failure(" in output and "ScenarioParams(" in output, output[-3000:]


def test_capability_drift_is_caught_where_the_factory_names_a_re_export(tmp_path: Path) -> None:
    # The plugin names the class where its package re-exports it ("alias:Drifty", as a vendor's
    # "hisparse_acme:AcmeBackend" for hisparse_acme.backend.AcmeBackend): the registry selects that
    # very class, but the check compared the factory string with the class's own module:qualname,
    # skipped as "a fixture override" and the run passed with the drift.
    (tmp_path / "alias.py").write_text("from conftest import Drifty  # noqa: F401\n")
    failed = failures_of(tmp_path, """
        import pluggy
        import pytest
        from hisparse_core import registry
        from hisparse_core.backend import BackendSpec
        from hisparse_reference_cpu.backend import ReferenceCpuBackend

        class Drifty(ReferenceCpuBackend):
            name = "drifty"
            capabilities = ReferenceCpuBackend.capabilities - {"speculative_union"}

        registry._registry = registry.BackendRegistry([], {"drifty": BackendSpec(
            name="drifty", factory="alias:Drifty", probe=lambda: None,
            capabilities=ReferenceCpuBackend.capabilities)}, pluggy.PluginManager("hisparse"))

        @pytest.fixture(scope="session")
        def hisparse_backend():
            return Drifty()
    """, "from hisparse_conformance.test_declaration import *  # noqa: F403\n")
    assert failed["test_embedded.test_the_class_declares_what_its_plugin_advertises"].startswith(
        "AssertionError: capability drift: the BackendSpec advertises ['speculative_union'] that alias:Drifty "
        "lacks\n"), failed


def test_counters_that_are_not_ints_are_named(tmp_path: Path) -> None:
    # Right counts as 0-d tensors (the device counters, not read back): every comparison of the suite
    # passed, and `hisparse bench --json` then failed with "Object of type Tensor is not JSON serializable".
    failed = failures_of(tmp_path, """
        import pytest
        import torch
        from hisparse_core.runtime import RuntimeStats
        from hisparse_reference_cpu.backend import ReferenceCpuBackend
        from hisparse_reference_cpu.runtime import ReferenceRuntime

        class TensorCounters(ReferenceRuntime):
            def stats(self):
                s = super().stats()
                return RuntimeStats(*(torch.tensor(v) for v in (s.resident, s.hits, s.misses, s.h2d_bytes,
                                                                s.d2h_bytes)))

        class Wrong(ReferenceCpuBackend):
            def create_runtime(self, config):
                return TensorCounters(config)

        @pytest.fixture(scope="session")
        def hisparse_backend():
            return Wrong()
    """, "from hisparse_conformance.test_state import test_counters_accumulate_and_reset  # noqa: F401\n")
    assert failed["test_embedded.test_counters_accumulate_and_reset"].startswith(
        "AssertionError: stats() returns a RuntimeStats of Python ints (read back to the host); got "
        "resident=Tensor"), failed


@pytest.mark.parametrize("factory, message", [
    ("create_host_pool(self, spec)",
     "AssertionError: contract: Backend.create_host_pool returns a hisparse_core.HostPool; it returned None"),
    ("create_runtime(self, config)",
     "AssertionError: contract: Backend.create_runtime returns a hisparse_core.CacheRuntime; it returned None"),
], ids=["host-pool", "runtime"])
def test_a_factory_that_returns_no_part_is_named(tmp_path: Path, factory: str, message: str) -> None:
    # A factory left returning None (a stub, a missing return): the failure read "'NoneType' object
    # has no attribute 'release'", raised by the suite's own cleanup over the first error.
    failed = failures_of(tmp_path, f"""
        import pytest
        from hisparse_reference_cpu.backend import ReferenceCpuBackend

        class Wrong(ReferenceCpuBackend):
            def {factory}:
                return None

        @pytest.fixture(scope="session")
        def hisparse_backend():
            return Wrong()
    """, "from hisparse_conformance.test_resolver import test_lru_victims_and_order_by_hand  # noqa: F401\n")
    assert failed["test_embedded.test_lru_victims_and_order_by_hand"].startswith(message), failed


def test_a_capabilities_fixture_that_returns_a_string_is_named(tmp_path: Path) -> None:
    # set("index_sharing") is a set of letters: every marked test was skipped as "backend lacks
    # capability index_sharing", the backend's real capabilities never tested.
    failed = failures_of(tmp_path, """
        import pytest
        from hisparse_reference_cpu.backend import ReferenceCpuBackend

        @pytest.fixture(scope="session")
        def hisparse_backend():
            return ReferenceCpuBackend()

        @pytest.fixture(scope="session")
        def hisparse_capabilities():
            return "index_sharing"
    """, "from hisparse_conformance.test_gather import test_each_layer_is_copied_only_when_asked  # noqa: F401\n")
    assert failed["test_embedded.test_each_layer_is_copied_only_when_asked"].endswith(
        "the hisparse_capabilities fixture returned 'index_sharing' (str); expected a frozenset of capability "
        "names (str)"), failed
