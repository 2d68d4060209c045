"""HiSparseWorker on the reference_cpu backend: pool lifecycle, step phases, acknowledgements."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from hisparse_core.backend import Capability
from hisparse_core.errors import CapacityError, InvalidCommandError, InvalidInputError, ProtocolError
from hisparse_core.geometry import BF16_MLA, FP8_DS_MLA, RuntimeConfig
from hisparse_core.registry import select_backend
from hisparse_core.runtime import ResolveInputs
from hisparse_core.transfer import TransferProgress
from hisparse_core.types import HostBlockCopy, OffloadCommand, PageTransfer, ResidencyUpdate, RowMirror
from hisparse_core.worker import CacheGroup, HiSparseWorker, TransferTracker, host_blocks_for_budget
from hisparse_reference_cpu.backend import ReferenceCpuBackend

BS = 4
DEVICE_BLOCKS = 6


def config(num_layers: int = 2, **kw: object) -> RuntimeConfig:
    base: dict[str, object] = dict(max_batch_rows=2, max_requests=3, top_k=4, hot_rows=8, block_size=BS,
                                   max_pages=5, row_format=FP8_DS_MLA, num_layers=num_layers)
    base.update(kw)
    return RuntimeConfig(**base)  # type: ignore[arg-type]


def device_layers(cfg: RuntimeConfig, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (DEVICE_BLOCKS, BS, cfg.row_format.width), dtype=torch.uint8, generator=gen)
            for _ in range(cfg.num_layers)]


def make_worker(backend: ReferenceCpuBackend | None = None, *, num_host_blocks: int = 8, **kw: object,
                ) -> tuple[HiSparseWorker, list[torch.Tensor]]:
    cfg = config()
    worker = HiSparseWorker(backend or ReferenceCpuBackend(completion_lag=1), [CacheGroup(cfg, name="g0")],
                            num_host_blocks=num_host_blocks, **kw)  # type: ignore[arg-type]
    dev = device_layers(cfg, seed=1)
    worker.register_caches([dev])
    return worker, dev


def host_block(worker: HiSparseWorker, layer: int, block: int) -> torch.Tensor:
    return worker.host_pool.layer_view(layer)[block * BS:(block + 1) * BS]


def test_select_backend_by_name_builds_a_working_worker() -> None:
    backend = select_backend("reference_cpu")
    worker = HiSparseWorker(backend, [CacheGroup(config())], num_host_blocks=4)
    worker.register_caches([device_layers(config(), seed=0)])
    assert worker.registered and worker.host_pool_spec.num_blocks == 4
    worker.shutdown()


def test_pool_is_sized_from_the_budget_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    cfg = config(num_layers=3)
    stride = 3 * BS * FP8_DS_MLA.row_bytes
    caplog.set_level(logging.INFO, logger="hisparse_core.worker.worker")
    worker = HiSparseWorker(ReferenceCpuBackend(), [CacheGroup(cfg)], host_pool_bytes=10 * stride + stride - 1)
    assert worker.host_pool_spec.num_blocks == 10
    assert worker.host_pool_spec.num_layers == 3
    assert worker.host_pool.nbytes == 10 * stride
    text = caplog.text
    assert "backend 'reference_cpu'" in text and "10 blocks x 3 layers" in text and "private" in text
    worker.shutdown()


def test_budget_below_one_block_names_both_numbers() -> None:
    with pytest.raises(CapacityError, match=r"100 bytes holds no block.*needs 5248 bytes"):
        host_blocks_for_budget(100, 2, BS, FP8_DS_MLA)
    with pytest.raises(InvalidInputError, match="exactly one of host_pool_bytes"):
        HiSparseWorker(ReferenceCpuBackend(), [CacheGroup(config())])
    with pytest.raises(InvalidInputError, match="exactly one of host_pool_bytes"):
        HiSparseWorker(ReferenceCpuBackend(), [CacheGroup(config())], host_pool_bytes=1 << 20, num_host_blocks=2)


def test_groups_must_share_block_size_and_row_format() -> None:
    with pytest.raises(InvalidInputError, match=r"groups\[1\] \(b\) has block_size=8; expected 4"):
        HiSparseWorker(ReferenceCpuBackend(), [CacheGroup(config(), name="a"),
                                               CacheGroup(config(block_size=8, hot_rows=8), name="b")],
                       num_host_blocks=2)
    with pytest.raises(InvalidInputError, match="row format 'bf16_mla'"):
        HiSparseWorker(ReferenceCpuBackend(), [CacheGroup(config()), CacheGroup(config(row_format=BF16_MLA))],
                       num_host_blocks=2)


def test_two_groups_get_consecutive_host_layers() -> None:
    a, b = config(num_layers=2), config(num_layers=1)
    worker = HiSparseWorker(ReferenceCpuBackend(completion_lag=0), [CacheGroup(a), CacheGroup(b)],
                            num_host_blocks=3)
    dev_a, dev_b = device_layers(a, 1), device_layers(b, 2)
    worker.register_caches([dev_a, dev_b])
    assert worker.host_pool_spec.num_layers == 3
    worker.start_step(OffloadCommand(page_transfers=(PageTransfer(0, 2, (5,)),)))
    worker.after_forward()
    for layer, dev in enumerate([*dev_a, *dev_b]):
        assert torch.equal(host_block(worker, layer, 2), dev[5])
    worker.shutdown()


def test_step_phases_move_the_right_bytes_at_the_right_time() -> None:
    worker, dev = make_worker()
    for layer in range(2):  # known contents in host block 3, to be restored and copied
        host_block(worker, layer, 3).fill_(7 + layer)
    command = OffloadCommand(
        page_transfers=(PageTransfer(10, 1, (2,), after_forward=True),
                        PageTransfer(11, 3, (4,), after_forward=False, restore=True)),
        row_mirrors=(RowMirror((0 * BS + 1,), 5 * BS + 1, 2),),
        host_block_copies=(HostBlockCopy(3, 6),),
    )
    worker.start_step(command)
    # Before the forward: the restore and the host copy ran, the spill and mirror did not.
    for layer in range(2):
        assert torch.all(dev[layer][4] == 7 + layer)
        assert torch.all(host_block(worker, layer, 6) == 7 + layer)
        assert not torch.equal(host_block(worker, layer, 1), dev[layer][2])
    for layer in range(2):  # "the forward" writes rows 1..2 of block 0 and all of block 2
        dev[layer][0, 1:3] = 100 + layer
        dev[layer][2] = 50 + layer
    worker.after_forward()
    for layer in range(2):
        assert torch.all(host_block(worker, layer, 1) == 50 + layer)
        assert torch.all(host_block(worker, layer, 5)[1:3] == 100 + layer)
    # completion_lag=1: first report enqueues, second completes; each id exactly once.
    first = worker.build_metadata()
    assert dict(first.enqueued) == {10: 1, 11: 1} and dict(first.completed) == {}
    assert worker.pending_transfers == 2
    second = worker.build_metadata()
    assert dict(second.enqueued) == {} and dict(second.completed) == {10: 1, 11: 1}
    assert second.completed_host_copies == (6,) or first.completed_host_copies == (6,)
    assert worker.build_metadata().is_empty()
    assert worker.pending_transfers == 0
    worker.shutdown()


def test_without_forward_after_forward_must_follow_start_step() -> None:
    worker, _ = make_worker()
    with pytest.raises(ProtocolError, match="without start_step"):
        worker.after_forward()
    worker.start_step(None)
    with pytest.raises(ProtocolError, match="has not run after_forward"):
        worker.start_step(None)
    worker.after_forward()
    worker.start_step(OffloadCommand())
    worker.after_forward()
    assert worker.build_metadata().is_empty()
    worker.shutdown()


def test_restore_marked_after_forward_is_rejected() -> None:
    worker, _ = make_worker()
    with pytest.raises(ProtocolError, match=r"transfers \[4\] are restores marked after_forward"):
        worker.start_step(OffloadCommand(page_transfers=(PageTransfer(4, 0, (0,), after_forward=True,
                                                                      restore=True),)))
    worker.shutdown()


def test_steps_need_registered_caches() -> None:
    worker = HiSparseWorker(ReferenceCpuBackend(), [CacheGroup(config())], num_host_blocks=2)
    with pytest.raises(ProtocolError, match="register_caches"):
        worker.start_step(None)
    with pytest.raises(InvalidInputError, match="expected one list per cache group"):
        worker.register_caches([])
    with pytest.raises(InvalidInputError, match=r"device_layers\[0\] \(unnamed\) has 1 layers; expected 2"):
        worker.register_caches([device_layers(config(num_layers=1), 0)])
    worker.shutdown()


def test_residency_updates_write_int32_tables_atomically() -> None:
    worker, _ = make_worker()
    table = worker.residency_table(0)
    assert table.dtype == torch.int32 and tuple(table.shape) == (3, 5) and bool((table == -1).all())
    worker.start_step(OffloadCommand(residency_updates=(ResidencyUpdate(1, (0, 2), ((4, 5),)),)))
    worker.after_forward()
    assert table[1].tolist() == [4, -1, 5, -1, -1]
    bad = OffloadCommand(residency_updates=(ResidencyUpdate(0, (1,), ((3,),)), ResidencyUpdate(3, (0,), ((1,),))))
    with pytest.raises(InvalidCommandError, match=r"state_index=3 out of range; expected \[0, 3\)"):
        worker.start_step(bad)
    assert bool((table[0] == -1).all()), "a rejected command must change nothing"
    worker.reset_state([1])
    assert bool((table == -1).all())
    worker.shutdown()


def test_recycled_host_blocks_are_forgotten_by_the_hot_state() -> None:
    worker, _ = make_worker()
    runtime = worker.runtimes[0]
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    # State row 0 reads two host rows of host block 2 (page 0 not resident) into its hot buffer.
    source = torch.full((3, 5), -1, dtype=torch.int32)
    source[0, 0] = 2
    resident = torch.full((3, 5), -1, dtype=torch.int32)
    hot = i32([[0, 1], [2, 3], [4, 5]])
    runtime.resolve(ResolveInputs(i32([[0, 1, -1, -1]]), i32([0]), i32([4]), source, resident, hot))
    hot_map, _ = runtime.hot_state(0)
    assert sorted(hot_map[hot_map >= 0].tolist()) == [8, 9]
    worker.start_step(OffloadCommand(recycled_host_blocks=(2,)))
    worker.after_forward()
    hot_map, _ = runtime.hot_state(0)
    assert bool((hot_map == -1).all())
    worker.shutdown()


def test_two_workers_aggregate_to_one_count_per_worker() -> None:
    workers = [make_worker(ReferenceCpuBackend(completion_lag=0))[0] for _ in range(2)]
    command = OffloadCommand(page_transfers=(PageTransfer(3, 0, (1,)), PageTransfer(4, 1, (2,))))
    metas = []
    for w in workers:
        w.start_step(command)
        w.after_forward()
        metas.append(w.build_metadata())
    total = metas[0].aggregate(metas[1])
    assert dict(total.enqueued) == {3: 2, 4: 2} and dict(total.completed) == {3: 2, 4: 2}
    for w in workers:
        w.shutdown()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="shared pools live in /dev/shm")
def test_tensor_parallel_ranks_share_one_pool_and_only_rank_0_writes() -> None:
    name = f"worker-test-{os.getpid()}"
    rank0, dev0 = make_worker(ReferenceCpuBackend(completion_lag=0), rank=0, world_size=2, share_host_pool=True,
                              pool_name=name)
    rank1, dev1 = make_worker(ReferenceCpuBackend(completion_lag=0), rank=1, world_size=2, share_host_pool=True,
                              pool_name=name)
    assert rank0.host_pool_spec.shared and rank1.host_pool_spec.shared
    assert rank0.host_pool.is_writer and not rank1.host_pool.is_writer
    for d in dev1:
        d.zero_()  # rank 1's device copy differs: if rank 1 wrote, the host block would be zeros
    command = OffloadCommand(page_transfers=(PageTransfer(1, 4, (3,)),))
    for w in (rank0, rank1):
        w.start_step(command)
        w.after_forward()
    assert rank0.build_metadata().aggregate(rank1.build_metadata()).completed == {1: 2}
    for layer in range(2):
        assert torch.equal(host_block(rank1, layer, 4), dev0[layer][3])
    rank1.shutdown()
    rank0.shutdown()


def test_without_the_capability_each_rank_gets_a_private_pool(caplog: pytest.LogCaptureFixture) -> None:
    class PrivateOnly(ReferenceCpuBackend):
        capabilities = ReferenceCpuBackend.capabilities - {Capability.SHARED_HOST_POOL}

    caplog.set_level(logging.INFO, logger="hisparse_core.worker.worker")
    worker, _ = make_worker(PrivateOnly(), rank=1, world_size=2, share_host_pool=True, pool_name="unused")
    assert not worker.host_pool_spec.shared and worker.host_pool.is_writer
    assert "lacks capability 'shared_host_pool'" in caplog.text
    worker.shutdown()


def test_shutdown_drains_releases_and_is_idempotent() -> None:
    worker, _ = make_worker(ReferenceCpuBackend(completion_lag=5))
    worker.start_step(OffloadCommand(page_transfers=(PageTransfer(9, 0, (0,)),)))
    worker.after_forward()
    pool = worker.host_pool
    last = worker.shutdown()
    assert dict(last.enqueued) == {9: 1} and dict(last.completed) == {9: 1}
    assert pool.released
    assert worker.shutdown().is_empty()
    with pytest.raises(ProtocolError, match="shut down"):
        worker.start_step(None)


def test_take_stats_reports_bytes_once_and_pending_levels() -> None:
    worker, _ = make_worker()
    worker.start_step(OffloadCommand(page_transfers=(PageTransfer(1, 0, (0,)), PageTransfer(2, 1, (1,), False, True))))
    worker.after_forward()
    stats = worker.take_stats()
    row_bytes_all_layers = 2 * FP8_DS_MLA.row_bytes
    assert stats.d2h_bytes == BS * row_bytes_all_layers and stats.h2d_bytes == BS * row_bytes_all_layers
    assert stats.pending_transfers == 2 and stats.host_pool_blocks == 8
    again = worker.take_stats()
    assert again.d2h_bytes == 0 and again.h2d_bytes == 0
    worker.shutdown()


def test_tracker_rejects_reports_of_unknown_or_repeated_ids() -> None:
    tracker = TransferTracker()
    tracker.submit_transfers([1, 2])
    with pytest.raises(ProtocolError, match="transfer 7 enqueued, but it was never submitted"):
        tracker.observe(TransferProgress(enqueued=(7,)), backend="x")
    with pytest.raises(ProtocolError, match="transfer 1 completed before enqueued"):
        tracker.observe(TransferProgress(completed=(1,)), backend="x")
    ack = tracker.observe(TransferProgress(enqueued=(1, 2), completed=(1,)), backend="x")
    assert ack.enqueued == (1, 2) and ack.completed == (1,)
    with pytest.raises(ProtocolError, match="transfer 2 enqueued, but it was already reported enqueued"):
        tracker.observe(TransferProgress(enqueued=(2,)), backend="x")
    with pytest.raises(ProtocolError, match="transfer 1 completed, but it is not pending"):
        tracker.observe(TransferProgress(completed=(1,)), backend="x")
    with pytest.raises(ProtocolError, match="transfer id 2 submitted while an earlier"):
        tracker.submit_transfers([2])
    assert tracker.pending_transfers == 1


def test_a_submission_the_engine_refuses_is_not_left_pending() -> None:
    """The tracker records a step's transfers before the engine takes them (so a Ctrl-C in between
    leaves nothing the engine reports unrecorded); one the engine refuses is forgotten again, so the
    same ids go through once corrected and nothing is pending at shutdown."""
    worker, _ = make_worker()
    bad_host_block = PageTransfer(1, 99, (0,), after_forward=False)  # the pool has 8 blocks
    with pytest.raises(InvalidInputError, match="host_block_id=99 is out of range"):
        worker.start_step(OffloadCommand(page_transfers=(bad_host_block,)))
    assert worker.take_stats().pending_transfers == 0
    worker.after_forward()
    worker.start_step(OffloadCommand(page_transfers=(PageTransfer(1, 0, (0,), after_forward=False),)))
    worker.after_forward()
    assert worker.take_stats().pending_transfers == 1
    last = worker.shutdown()
    assert dict(last.completed) == {1: 1}


def test_wait_for_host_writes_is_part_of_the_transfer_engine_interface() -> None:
    """HiSparseWorker.wait_for_host_writes calls the engine's `wait_for_host_writes` where it has one
    (a shared pool's peers order their reads after rank 0's writes through it); a vendor reading
    TransferEngine found no such method, so an asynchronous engine without it let a peer read host
    rows before rank 0's copies landed. It is now a documented method of the interface (a no-op by
    default, for synchronous engines)."""
    from hisparse_core.transfer import TransferEngine

    method = vars(TransferEngine).get("wait_for_host_writes")
    assert method is not None and "HiSparseWorker" in (method.__doc__ or ""), "not part of TransferEngine"
    assert "shared" in method.__doc__ and "rank 0" in method.__doc__
    worker, _ = make_worker()
    try:
        worker.wait_for_host_writes()  # reference_cpu's synchronous engine keeps the default
        assert type(worker._require_engine()).wait_for_host_writes is TransferEngine.wait_for_host_writes
    finally:
        worker.shutdown()


class _Lacking(ReferenceCpuBackend):
    """reference_cpu declaring fewer capabilities (`lacking`); records every host pool it creates."""

    pools: list[object]

    def __init__(self, *lacking: str) -> None:
        super().__init__()
        self.capabilities = frozenset(ReferenceCpuBackend.capabilities - set(lacking))  # type: ignore[misc]
        self.pools = []

    def create_host_pool(self, spec):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN201
        self.pools.append(spec)
        return super().create_host_pool(spec)


@pytest.mark.parametrize(("lacking", "kw", "names"), [
    (Capability.INDEX_SHARING, {"num_layers": 2}, "num_layers=2"),
    (Capability.SPECULATIVE_UNION, {"num_layers": 1, "rows_per_request": 2, "max_batch_rows": 4}, "rows_per_request=2"),
    (Capability.BF16_MLA, {"num_layers": 1, "row_format": BF16_MLA}, "row_format=bf16_mla"),
])
def test_a_setting_the_backend_does_not_declare_is_refused_before_the_pool(lacking: str, kw: dict, names: str) -> None:
    # A vendor backend without, say, index_sharing used to be driven with several layers a group until it failed
    # wherever it first met them (a replay plan), after the host pool was allocated; now one line, nothing allocated.
    backend = _Lacking(lacking)
    with pytest.raises(InvalidInputError) as err:
        HiSparseWorker(backend, [CacheGroup(config(**kw))], num_host_blocks=8)
    text = str(err.value)
    assert lacking in text and names in text and "\n" not in text, text
    assert backend.pools == []
    HiSparseWorker(_Lacking(), [CacheGroup(config(**kw))], num_host_blocks=8).shutdown()  # declared: served
