"""HiSparseWorker with a backend whose device is not the CPU: the residency tables it owns are on
that device, and a command's residency updates, copies and the resolve that reads them give what
the same steps give on reference_cpu (`strict_device`: CPU tensors mixed into device tensors raise,
as on CUDA)."""

from __future__ import annotations

import torch
from strict_device import STRICT, StrictDeviceBackend, enable

from hisparse_core.geometry import FP8_DS_MLA, RuntimeConfig
from hisparse_core.runtime import ResolveInputs
from hisparse_core.types import HostBlockCopy, OffloadCommand, PageTransfer, ResidencyUpdate, RowMirror
from hisparse_core.worker import CacheGroup, HiSparseWorker
from hisparse_core.worker.residency import ResidencyTables
from hisparse_reference_cpu.backend import ReferenceCpuBackend

BS, BLOCKS, HOST_BLOCKS = 4, 8, 10
CFG = RuntimeConfig(max_batch_rows=4, max_requests=3, top_k=6, hot_rows=12, block_size=BS, max_pages=5,
                    row_format=FP8_DS_MLA, num_layers=2, rows_per_request=2)


def test_residency_tables_live_and_change_on_the_device() -> None:
    enable()
    on_device, on_cpu = ResidencyTables(2, 3, 5, STRICT), ResidencyTables(2, 3, 5, torch.device("cpu"))
    updates = [ResidencyUpdate(1, (0, 3), ((4, 5), (6, 7))), ResidencyUpdate(2, (4,), ((1,), (2,))),
               ResidencyUpdate(1, (3,), ((-1,), (0,)))]
    for tables in (on_device, on_cpu):
        tables.apply(updates)
        tables.reset([2])
    for g in range(2):
        assert on_device.table(g).device == STRICT
        assert torch.equal(on_device.table(g).cpu(), on_cpu.table(g))
    assert on_device.table(0).cpu()[1].tolist() == [4, -1, -1, -1, -1]


def _worker(backend: ReferenceCpuBackend, caches: list[torch.Tensor]) -> HiSparseWorker:
    worker = HiSparseWorker(backend, [CacheGroup(CFG, name="g0")], num_host_blocks=HOST_BLOCKS)
    worker.register_caches([[c.to(backend.device) for c in caches]])
    return worker


def test_a_worker_on_the_device_runs_commands_and_resolves_like_reference_cpu() -> None:
    gen = torch.Generator().manual_seed(19)
    caches = [torch.randint(0, 256, (BLOCKS, BS, FP8_DS_MLA.width), dtype=torch.uint8, generator=gen)
              for _ in range(CFG.num_layers)]
    host = [torch.randint(0, 256, (HOST_BLOCKS * BS, FP8_DS_MLA.width), dtype=torch.uint8, generator=gen)
            for _ in range(CFG.num_layers)]
    strict, cpu = _worker(StrictDeviceBackend(completion_lag=0), caches), _worker(ReferenceCpuBackend(), caches)
    command = OffloadCommand(
        residency_updates=(ResidencyUpdate(0, (0, 1), ((2, 3),)), ResidencyUpdate(1, (2,), ((1,),))),
        page_transfers=(PageTransfer(1, 4, (2,), after_forward=False, restore=True),
                        PageTransfer(2, 5, (3,), after_forward=True)),
        row_mirrors=(RowMirror((1 * BS,), 6 * BS, 3),), host_block_copies=(HostBlockCopy(7, 8),),
        recycled_host_blocks=(9,))
    source = torch.tensor([[-1, -1, 4, 7, 9], [0, 1, -1, -1, -1], [-1] * 5], dtype=torch.int32)
    hot = torch.tensor([[5, 6, 7], [0, 4, 6], [4, 5, 6]], dtype=torch.int32)
    topk = torch.tensor([[0, 5, 9, 13, 17, -1], [1, 2, 3, 10, 14, 18], [0, 1, 4, 9, 8, -1], [-1] * 6],
                        dtype=torch.int32)
    state, lens = torch.tensor([0, 0, 1, -1], dtype=torch.int32), torch.tensor([20, 20, 12, 0], dtype=torch.int32)
    for worker in (strict, cpu):
        dev = worker.backend.device
        for layer in range(CFG.num_layers):
            worker.host_pool.layer_view(layer).copy_(host[layer])
        worker.start_step(command)
        assert worker.residency_table(0).device == dev
        worker.runtimes[0].resolve(ResolveInputs(topk.to(dev), state.to(dev), lens.to(dev), source.to(dev),
                                                 worker.residency_table(0), hot.to(dev)), gather=True)
        worker.runtimes[0].replay_plan()
        worker.after_forward()
        worker.build_metadata(wait=True)
    a, b = strict.runtimes[0].result, cpu.runtimes[0].result
    assert torch.equal(a.rows.cpu(), b.rows) and torch.equal(a.plan_host.cpu(), b.plan_host)
    assert (b.rows[:3] >= 0).sum() > 0 and int(b.plan_counts.sum()) > 0
    for layer in range(CFG.num_layers):
        assert torch.equal(strict.host_pool.layer_view(layer), cpu.host_pool.layer_view(layer))
        assert torch.equal(strict.runtimes[0].inner.device_layers[layer], cpu.runtimes[0].device_layers[layer])
    assert torch.equal(strict.residency_table(0).cpu(), cpu.residency_table(0))
    assert strict.take_stats() == cpu.take_stats()
    strict.shutdown()
    cpu.shutdown()
