"""Deterministic tests of `HiSparseCoordinator`: one behaviour each, hand-checked numbers."""

from __future__ import annotations

import logging
import re

import pytest

from hisparse_core.coordinator import (
    CoordinatorConfig,
    HiSparseCoordinator,
    ImportTarget,
    SimpleGpuBlockPool,
    StepRequest,
)
from hisparse_core.coordinator.pages import LOST, PINNED, RELEASED
from hisparse_core.errors import CapacityError, InvalidInputError, ProtocolError
from hisparse_core.types import WorkerMetadata

from .harness import BLOCK, EngineRequest, MiniEngine, MiniWorkers, small_config


def run_prompt(engine: MiniEngine, workers: MiniWorkers, rid: str, tokens: list[int], *, ack: bool = True) -> None:
    """Admit, prefill in one step, then one decode step so the prompt's full pages seal."""
    hit = engine.admit(rid, tokens)
    workers.receive(engine.step({rid: len(tokens) - hit}))
    workers.receive(engine.step({rid: 1}))
    if ack:
        workers.ack_all(engine.coord)


def snapshot(engine: MiniEngine) -> tuple[object, ...]:
    c = engine.coord
    return (c.stats(), [engine.gpu.lease_count(b) for b in range(engine.gpu.num_blocks)], list(c._host._leases),
            sorted(c._requests), len(c._transfers), len(c._copies))


# -- sizing -------------------------------------------------------------------------------

def test_capacity_matches_host_pool_spec_and_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    from hisparse_core.geometry import FP8_DS_MLA
    from hisparse_core.host_pool import HostPoolSpec

    config = CoordinatorConfig(host_pool_gib=384, num_layers=61, block_size=64, row_bytes=656,
                               max_model_len=1 << 20, hot_blocks_per_request=64)
    expected = HostPoolSpec.blocks_for_budget(384 << 30, 61, 64, FP8_DS_MLA)
    assert config.host_num_blocks == expected == 160_996  # 384 GiB / (61 x 64 x 656 B)
    with caplog.at_level(logging.INFO, logger="hisparse_core.coordinator"):
        coord = HiSparseCoordinator(config, SimpleGpuBlockPool(1000))
    assert coord.host_num_blocks == expected
    assert coord.stats().host_blocks_total == expected - 1
    assert f"{expected} blocks ({expected - 1} usable + null) = {(expected - 1) * 64} tokens" in caplog.text


def test_stride_alignment_rounds_the_block_stride_up() -> None:
    config = small_config(row_bytes=16, stride_alignment=4096)
    assert config.host_block_stride == 4096


def test_pool_too_small_for_one_request_is_refused_with_numbers() -> None:
    # 8 pages of 4 tokens + 2 tail pages need 10 usable blocks; 10 blocks give 9 usable.
    with pytest.raises(CapacityError, match=r"10 blocks of 64 bytes .* 9 usable .* needs 10 usable blocks"):
        HiSparseCoordinator(small_config(host_blocks=10), SimpleGpuBlockPool(8))
    HiSparseCoordinator(small_config(host_blocks=11), SimpleGpuBlockPool(8))


def test_the_size_a_too_small_pool_suggests_is_accepted_when_given_back() -> None:
    # The line suggested `host_pool_gib >= X` with X rounded to 3 decimals: 0.000 for a pool of kilobytes.
    # Now X has 4 significant digits, rounded up to a size that holds the blocks asked for.
    with pytest.raises(CapacityError) as err:
        HiSparseCoordinator(small_config(host_blocks=10), SimpleGpuBlockPool(8))
    suggested = float(re.search(r"host_pool_gib >= ([0-9.e+-]+)$", str(err.value)).group(1))  # type: ignore[union-attr]
    assert suggested > 0, str(err.value)
    HiSparseCoordinator(small_config(host_pool_gib=suggested), SimpleGpuBlockPool(8))


@pytest.mark.parametrize("field,value", [("block_size", 0), ("host_pool_gib", -1.0), ("active_tail_pages", 0),
                                         ("num_layers", True), ("pressure_watermark_blocks", -3),
                                         ("hot_blocks_per_request", -1), ("hot_blocks_per_request", True)])
def test_bad_config_values_are_named(field: str, value: object) -> None:
    with pytest.raises(InvalidInputError, match=field):
        small_config(**{field: value})


# -- disabled -----------------------------------------------------------------------------

def test_disabled_coordinator_builds_nothing() -> None:
    gpu = SimpleGpuBlockPool(8)
    coord = HiSparseCoordinator(small_config(enabled=False), gpu)
    assert coord.add_request("a", [1, 2, 3]) == 0
    assert coord.schedule_step([StepRequest("a", 0, 0, 3, (1, 2, 3), ((0,),))]) is None
    assert coord.take_table_updates() == ()
    assert coord.choose_import_target("b", 100) is ImportTarget.DEVICE
    coord.update_from_workers(WorkerMetadata(), 2)
    with pytest.raises(ProtocolError):
        coord.update_from_workers(WorkerMetadata.report(enqueued=[0]), 1)
    assert not coord.has_pending_work()
    assert gpu.num_free_blocks == 8


# -- spill transaction --------------------------------------------------------------------

def test_spill_gates_gpu_release_on_enqueue_and_publication_on_completion() -> None:
    engine = MiniEngine(small_config(), gpu_blocks=32)
    tokens = list(range(10))
    engine.admit("a", tokens)
    cmd = engine.step({"a": 10})
    assert cmd is not None and not cmd.page_transfers          # sealed pages spill one step later
    assert [(m.source_starts, m.destination_start, m.num_rows) for m in cmd.row_mirrors] == \
        [((0,), 4, 4), ((4,), 8, 4), ((8,), 12, 2)]
    assert cmd.residency_updates[0].pages == (0, 1, 2)
    cmd = engine.step({"a": 1})
    assert cmd is not None
    spills = cmd.page_transfers
    assert [(t.host_block_id, t.resident_block_ids, t.after_forward, t.restore) for t in spills] == \
        [(1, (0,), True, False), (2, (1,), True, False)]
    coord = engine.coord
    assert engine.gpu.lease_count(0) == 2                      # request lease + spill pin
    coord.update_from_workers(WorkerMetadata.report(enqueued=[0, 1]), 2)          # worker A
    assert engine.gpu.lease_count(0) == 2                      # 1 of 2 workers: still pinned
    coord.update_from_workers(WorkerMetadata.report(enqueued=[0, 1]), 2)          # worker B
    assert engine.gpu.lease_count(0) == 1                      # pin released on the last enqueue
    coord.update_from_workers(WorkerMetadata.report(completed=[0, 1]), 2)         # worker A
    assert coord.lookup_prefix(tokens).num_tokens == 0         # not published before every completion
    coord.update_from_workers(WorkerMetadata.report(completed=[1]), 2)            # worker B, page 1 only
    assert coord.lookup_prefix(tokens).num_tokens == 0         # page 1 durable, but page 0 is not
    coord.update_from_workers(WorkerMetadata.report(completed=[0]), 2)
    hit = coord.lookup_prefix(tokens)
    assert (hit.num_tokens, hit.host_block_ids) == (8, (1, 2))
    assert coord.lookup_prefix(tokens, max_tokens=7).num_tokens == 4
    assert coord.lookup_prefix(tokens, extra_key=b"lora-1").num_tokens == 0
    assert not coord.has_pending_work()


def test_publication_waits_for_a_contiguous_durable_prefix() -> None:
    engine = MiniEngine(small_config(), gpu_blocks=32)
    tokens = list(range(12))
    engine.admit("a", tokens)
    engine.step({"a": 12})
    cmd = engine.step({"a": 1})
    assert cmd is not None and [t.transfer_id for t in cmd.page_transfers] == [0, 1, 2]
    engine.coord.update_from_workers(WorkerMetadata.report(enqueued=[0, 1, 2], completed=[1, 2]), 1)
    assert engine.coord.lookup_prefix(tokens).num_tokens == 0
    assert engine.coord.stats().published_blocks == 0
    engine.coord.update_from_workers(WorkerMetadata.report(completed=[0]), 1)
    assert engine.coord.lookup_prefix(tokens).num_tokens == 12


def test_finishing_mid_spill_publishes_detached_then_releases_everything() -> None:
    engine = MiniEngine(small_config(), gpu_blocks=32)
    workers = MiniWorkers(2)
    tokens = list(range(9))
    run_prompt(engine, workers, "a", tokens, ack=False)
    engine.step({}, finished=("a",))
    coord = engine.coord
    assert coord.stats().detached_requests == 1 and coord.has_pending_work()
    assert engine.gpu.num_free_blocks == 32 - 2               # the two spill pins
    workers.ack_all(coord)
    assert coord.lookup_prefix(tokens).num_tokens == 8
    s = coord.stats()
    assert (s.detached_requests, s.host_blocks_used, s.host_blocks_cached) == (0, 0, 2)
    assert engine.gpu.num_free_blocks == 32 and not coord.has_pending_work()


def test_preempting_mid_spill_drops_publication_and_leaks_nothing() -> None:
    engine = MiniEngine(small_config(), gpu_blocks=32)
    workers = MiniWorkers(1)
    tokens = list(range(9))
    run_prompt(engine, workers, "a", tokens, ack=False)
    engine.step({}, preempted=("a",))
    workers.ack_all(engine.coord)
    assert engine.coord.lookup_prefix(tokens).num_tokens == 0
    s = engine.coord.stats()
    assert (s.host_blocks_used, s.host_blocks_cached, s.running_requests) == (0, 0, 0)
    assert engine.gpu.num_free_blocks == 32


def test_prefix_hit_reuses_published_pages_and_reads_them_from_host() -> None:
    engine = MiniEngine(small_config(), gpu_blocks=32)
    workers = MiniWorkers(1)
    run_prompt(engine, workers, "a", list(range(10)))
    engine.step({}, finished=("a",))
    engine.coord.take_table_updates()
    hit = engine.admit("b", list(range(8)) + [99, 98, 97])
    assert hit == 8 and engine.coord.first_resident_page("b") == 2
    cmd = engine.step({"b": 3})
    assert cmd is not None
    (update,) = cmd.residency_updates
    assert update.pages == (0, 1, 2) and update.block_ids[0][:2] == (-1, -1)
    (table,) = engine.coord.take_table_updates()
    assert table.host_block_ids[:2] == (1, 2) and len(table.hot_block_ids or ()) == 2
    assert engine.coord.stats().prefix_hit_tokens == 8


def test_no_hot_buffer_is_leased_when_the_config_asks_for_none() -> None:
    # Engines whose attention reads resident pages only (vLLM's) configure 0 hot blocks: a prefix
    # hit then takes no GPU block beyond the pages the engine allocates itself.
    engine = MiniEngine(small_config(hot_blocks_per_request=0, pressure_watermark_blocks=0), gpu_blocks=32)
    workers = MiniWorkers(1)
    run_prompt(engine, workers, "a", list(range(10)))
    engine.step({}, finished=("a",))
    free = engine.gpu.num_free_blocks
    assert engine.admit("b", list(range(8)) + [99, 98, 97]) == 8
    assert engine.gpu.num_free_blocks == free, "the hit leased no hot buffer"
    engine.step({"b": 3})
    (table,) = engine.coord.take_table_updates()
    assert table.hot_block_ids == ()
    engine.step({}, finished=("b",))
    workers.ack_all(engine.coord)
    assert engine.coord.stats().running_requests == 0


def test_hit_capped_inside_a_page_copies_on_write_and_restores() -> None:
    engine = MiniEngine(small_config(), gpu_blocks=32)
    workers = MiniWorkers(1)
    run_prompt(engine, workers, "a", list(range(8)))
    engine.step({}, finished=("a",))
    hit = engine.admit("b", list(range(8)), max_prefix=7)  # must compute the last prompt token
    assert hit == 7 and engine.coord.first_resident_page("b") == 1
    cmd = engine.step({"b": 1})
    assert cmd is not None
    (copy,) = cmd.host_block_copies
    assert copy.src_block_id == 2 and copy.dst_block_id not in (1, 2)
    (restore,) = cmd.page_transfers
    assert restore.restore and not restore.after_forward and restore.host_block_id == copy.dst_block_id
    assert cmd.row_mirrors[0].destination_start == copy.dst_block_id * BLOCK + 3
    workers.receive(cmd)
    workers.receive(engine.step({"b": 1}))
    # the spill of the copied page completes, but the page publishes only after the copy
    meta = workers.report(0)
    engine.coord.update_from_workers(WorkerMetadata(meta.enqueued, meta.completed), 1)
    assert engine.coord._requests["b"].num_ready == 1
    engine.coord.update_from_workers(WorkerMetadata.report(completed_host_copies=[copy.dst_block_id]), 1)
    assert engine.coord._requests["b"].num_ready == 2


# -- residency policy ---------------------------------------------------------------------

def test_pressure_releases_clean_pages_tail_first_but_never_the_active_tail() -> None:
    engine = MiniEngine(small_config(pressure_watermark_blocks=4, max_model_len=32), gpu_blocks=12)
    workers = MiniWorkers(1)
    tokens = list(range(24))
    engine.admit("a", tokens)
    workers.receive(engine.step({"a": 24}))           # 6 pages: 6 free blocks left
    assert engine.gpu.num_free_blocks == 6
    workers.receive(engine.step({"a": 1}))            # 7 pages, 6 sealed; 5 free
    workers.ack_all(engine.coord)
    hog = engine.gpu.acquire(3)                       # 2 free < watermark 4
    cmd = engine.step({"a": 1})                       # policy: hot buffer, then release up to 2*4 free
    rec = engine.coord._requests["a"]
    states = [rec.state[p] for p in range(rec.num_pages)]
    # pages 5 and 6 are the active tail; 4, 3, 2 ... go first
    assert states[5] == PINNED and rec.state[6] != RELEASED
    assert states[4] == RELEASED and states[3] == RELEASED
    assert rec.hot is not None and engine.coord.stats().released_pages == states.count(RELEASED)
    assert cmd is None or all(u.block_ids[0].count(-1) == 0 for u in cmd.residency_updates)
    tables = engine.coord.take_table_updates()
    assert any(t.hot_block_ids for t in tables)
    # the engine reuses a released block: the page is lost and reported -1 next step
    released_block = rec.gpu[4][0]
    grabbed = engine.gpu.acquire(engine.gpu.num_free_blocks)
    assert released_block in grabbed and rec.state[4] == LOST
    engine.gpu.release(grabbed)
    cmd = engine.step({"a": 1})
    assert cmd is not None
    minus = {p for u in cmd.residency_updates for p, b in zip(u.pages, u.block_ids[0], strict=True) if b == -1}
    assert 4 in minus
    engine.gpu.release(hog)


def test_no_release_while_gpu_blocks_are_plentiful() -> None:
    engine = MiniEngine(small_config(pressure_watermark_blocks=2), gpu_blocks=64)
    workers = MiniWorkers(1)
    run_prompt(engine, workers, "a", list(range(20)))
    engine.step({"a": 1})
    assert engine.coord.stats().released_pages == 0 and engine.coord._requests["a"].hot is None


def test_a_request_within_its_hot_buffer_and_tail_stays_resident() -> None:
    """Hot buffer 2 + tail 2: a 4-page request is never released (its buffer and tail would take
    as many blocks as its pages); at 5 pages it is."""
    engine = MiniEngine(small_config(pressure_watermark_blocks=4), gpu_blocks=12)
    workers = MiniWorkers(1)
    run_prompt(engine, workers, "a", list(range(14)))       # 4 pages, 3 sealed and clean
    rec = engine.coord._requests["a"]
    assert rec.num_pages == 4 and rec.has_releasable()        # pages 0 and 1 lie outside the tail
    hog = engine.gpu.acquire(engine.gpu.num_free_blocks - 3)  # 3 free < watermark 4
    workers.receive(engine.step({"a": 1}))                    # 16 tokens: still 4 pages
    assert engine.coord.stats().released_pages == 0 and rec.hot is None
    workers.ack_all(engine.coord)
    workers.receive(engine.step({"a": 1}))                    # 17 tokens: 5 pages
    assert rec.num_pages == 5 and rec.hot is not None and engine.coord.stats().released_pages > 0
    engine.gpu.release(hog)


def test_a_pool_drained_below_one_hot_buffer_still_releases() -> None:
    """No block free for the hot buffer (acknowledgements lagged behind the allocations): the
    request's own released pages pay for it, instead of the pool never releasing again."""
    engine = MiniEngine(small_config(pressure_watermark_blocks=4), gpu_blocks=12)
    workers = MiniWorkers(1)
    engine.admit("a", list(range(24)))
    workers.receive(engine.step({"a": 24}))                   # 6 pages
    workers.receive(engine.step({"a": 1}))                    # 7 pages, 6 sealed
    workers.ack_all(engine.coord)                             # pages 0-4 releasable, 5-6 the tail
    hog = engine.gpu.acquire(engine.gpu.num_free_blocks)      # nothing free
    rec = engine.coord._requests["a"]
    cmd = engine.step({"a": 1})
    assert rec.hot is not None and len(rec.hot) == 2
    stats = engine.coord.stats()
    assert stats.released_pages == 5 and stats.lost_pages == 2  # the buffer took two released blocks
    assert engine.gpu.num_free_blocks == 3
    lost = [p for p in range(rec.num_pages) if rec.state[p] == LOST]
    assert len(lost) == 2 and all(rec.state[p] == RELEASED for p in range(5) if p not in lost)
    assert cmd is not None
    minus = {p for u in cmd.residency_updates for p, b in zip(u.pages, u.block_ids[0], strict=True) if b == -1}
    assert minus == set(lost)
    tables = engine.coord.take_table_updates()
    assert [t.hot_block_ids for t in tables if t.hot_block_ids] == [rec.hot]
    engine.gpu.release(hog)


def test_make_room_releases_for_an_engine_whose_next_pages_do_not_fit() -> None:
    engine = MiniEngine(small_config(pressure_watermark_blocks=2), gpu_blocks=16)
    workers = MiniWorkers(1)
    run_prompt(engine, workers, "a", list(range(28)))         # 8 pages, 7 sealed and clean
    free = engine.gpu.num_free_blocks
    assert free == 8 and engine.coord.make_room(8) == 8         # it fits: nothing released
    assert engine.coord.stats().released_pages == 0
    assert engine.coord.make_room(12) >= 12                     # 2 hot blocks leased, 6 pages released
    assert engine.coord.stats().released_pages == 6 and engine.coord._requests["a"].hot is not None
    with pytest.raises(InvalidInputError, match="gpu_blocks must be an int >= 0, got -1"):
        engine.coord.make_room(-1)


# -- P/D import ---------------------------------------------------------------------------

def test_import_target_is_chosen_once_and_kept() -> None:
    engine = MiniEngine(small_config(host_blocks=20), gpu_blocks=16)
    coord = engine.coord
    assert coord.choose_import_target("d", 20) is ImportTarget.DEVICE          # 5 pages fit 16 blocks
    hog = engine.gpu.acquire(12)
    assert coord.choose_import_target("d", 20) is ImportTarget.WAIT            # kept: DEVICE or WAIT
    assert coord.choose_import_target("h", 20) is ImportTarget.HOST            # 2 hot + 2 tail fit 4
    engine.gpu.release(hog)
    assert coord.choose_import_target("h", 20) is ImportTarget.HOST            # not DEVICE now
    hog = engine.gpu.acquire(14)
    assert coord.choose_import_target("w", 20) is ImportTarget.WAIT
    engine.gpu.release(hog)
    assert coord.choose_import_target("w", 20) is ImportTarget.DEVICE          # WAIT was not a choice
    assert coord.choose_import_target("x", 20, other_device_blocks=1000) is ImportTarget.WAIT
    with pytest.raises(InvalidInputError, match="num_tokens"):
        coord.choose_import_target("z", 33)


def test_host_import_completes_into_published_host_pages_and_restores_the_tail() -> None:
    engine = MiniEngine(small_config(), gpu_blocks=16)
    coord = engine.coord
    tokens = list(range(30))                                   # 8 pages, the last one holds 2 tokens
    # DEVICE needs 8 + other blocks, HOST 2 hot + 2 tail + other
    assert coord.choose_import_target("p", 30, other_device_blocks=100) is ImportTarget.WAIT
    assert coord.choose_import_target("p", 30, other_device_blocks=10) is ImportTarget.HOST
    blocks = coord.begin_host_import("p", tokens, 30)
    assert len(blocks) == 8 and coord.stats().pending_imports == 1
    assert engine.gpu.num_free_blocks == 14                    # the hot buffer
    assert coord.lookup_prefix(tokens).num_tokens == 0
    coord.complete_host_import("p")
    assert coord.lookup_prefix(tokens).host_block_ids == blocks[:7]
    assert coord.first_resident_page("p") == 7
    engine.requests["p"] = EngineRequest("p", tokens, 5, 30, [[-1] * 7])
    cmd = engine.step({"p": 1})
    assert cmd is not None
    (restore,) = cmd.page_transfers
    assert restore.restore and restore.host_block_id == blocks[7]
    assert [m.destination_start for m in cmd.row_mirrors] == [blocks[7] * BLOCK + 2]
    (update,) = cmd.residency_updates
    assert update.state_index == 5 and update.block_ids[0][:7] == (-1,) * 7 and update.block_ids[0][7] >= 0


def test_failed_host_import_releases_every_lease() -> None:
    engine = MiniEngine(small_config(), gpu_blocks=16)
    coord = engine.coord
    before = snapshot(engine)
    assert coord.choose_import_target("p", 30, other_device_blocks=10) is ImportTarget.HOST
    coord.begin_host_import("p", list(range(30)), 30)
    assert coord.stats().host_blocks_used == 8 and engine.gpu.num_free_blocks == 14
    coord.fail_host_import("p")
    assert snapshot(engine) == before and not coord.has_request("p")


# -- bad input ----------------------------------------------------------------------------

def _with_spills() -> tuple[MiniEngine, MiniWorkers]:
    engine = MiniEngine(small_config(), gpu_blocks=32)
    workers = MiniWorkers(2)
    run_prompt(engine, workers, "a", list(range(9)), ack=False)
    return engine, workers


@pytest.mark.parametrize("meta,num_workers,message", [
    (WorkerMetadata.report(enqueued=[77]), 2, "transfer 77, which is never issued"),
    (WorkerMetadata({0: 3}), 2, "exceed the 2 workers"),
    (WorkerMetadata.report(completed=[0]), 2, "1 completions but only 0 enqueues"),
    (WorkerMetadata.report(completed_host_copies=[5]), 2, "destination block 5"),
])
def test_bad_acknowledgements_raise_and_change_nothing(meta: WorkerMetadata, num_workers: int, message: str) -> None:
    engine, _ = _with_spills()
    before = snapshot(engine)
    with pytest.raises(ProtocolError, match=message):
        engine.coord.update_from_workers(meta, num_workers)
    assert snapshot(engine) == before


def test_duplicate_and_late_acknowledgements_are_rejected() -> None:
    engine, _ = _with_spills()
    coord = engine.coord
    coord.update_from_workers(WorkerMetadata.report(enqueued=[0]), 1)
    with pytest.raises(ProtocolError, match="exceed"):
        coord.update_from_workers(WorkerMetadata.report(enqueued=[0]), 1)
    with pytest.raises(ProtocolError, match="must not change"):
        coord.update_from_workers(WorkerMetadata.report(completed=[0]), 2)
    coord.update_from_workers(WorkerMetadata.report(completed=[0]), 1)
    with pytest.raises(ProtocolError, match="already completed on every worker"):
        coord.update_from_workers(WorkerMetadata.report(completed=[0]), 1)


def test_bad_engine_input_raises_and_changes_nothing() -> None:
    engine, _ = _with_spills()
    coord = engine.coord
    r = engine.requests["a"]
    good = StepRequest("a", r.state_index, r.num_computed, 1, tuple(r.tokens), (tuple(r.table[0]),))
    before = snapshot(engine)
    bad = [
        ([StepRequest("ghost", 0, 0, 1, (1,), ((0,),))], InvalidInputError, "unknown request 'ghost'"),
        ([good, good], InvalidInputError, "scheduled twice"),
        ([StepRequest("a", 0, 0, 1, tuple(r.tokens), (tuple(r.table[0]),))], InvalidInputError, "sealed page 0"),
        ([StepRequest("a", 0, 10, 3, tuple(r.tokens), ((0, 1, 2, 999),))], InvalidInputError, "out of range"),
        ([StepRequest("a", 0, 10, 3, tuple(r.tokens), ((0, 1, 2),))], InvalidInputError, "lists 3 blocks"),
        ([StepRequest("a", 0, 10, 30, tuple(r.tokens), ((0,) * 10,))], InvalidInputError, "exceed max_model_len"),
    ]
    for views, error, message in bad:
        with pytest.raises(error, match=message):
            coord.schedule_step(views)
        assert snapshot(engine) == before
    with pytest.raises(InvalidInputError, match="unknown request 'ghost'"):
        coord.schedule_step([good], finished=["ghost"])
    with pytest.raises(InvalidInputError, match="unknown request"):
        coord.preempt_request("ghost")
    with pytest.raises(InvalidInputError, match="already admitted"):
        coord.add_request("a", [1, 2])
    assert snapshot(engine) == before


def test_step_beyond_host_capacity_raises_capacity_error_and_changes_nothing() -> None:
    engine = MiniEngine(small_config(host_blocks=11), gpu_blocks=64)
    engine.admit("a", list(range(32)))
    engine.admit("b", list(range(100, 132)))
    engine.step({"a": 32})
    before = snapshot(engine)
    view = engine.view("b", 32)
    with pytest.raises(CapacityError, match="writes 8 new pages but the host pool has 2 allocatable"):
        engine.coord.schedule_step([view])
    assert snapshot(engine)[2:] == before[2:]
    assert engine.coord.host_blocks_needed("b", 32) == 8


# -- host pool ----------------------------------------------------------------------------

def test_cached_blocks_are_evicted_lru_and_reported_recycled() -> None:
    engine = MiniEngine(small_config(host_blocks=14), gpu_blocks=64)   # usable host blocks 1..13
    workers = MiniWorkers(1)
    run_prompt(engine, workers, "a", list(range(8)))        # 3 pages in blocks 1, 2, 3; pages 0, 1 published
    engine.step({}, finished=("a",))                        # 1, 2 cached (1 least recent), 3 freed
    assert engine.coord.stats().host_blocks_cached == 2
    engine.admit("b", list(range(100, 132)))
    cmd = engine.step({"b": 32})                            # 8 never-used blocks: 4..11
    assert cmd is not None and cmd.recycled_host_blocks == ()
    engine.admit("c", list(range(200, 216)))
    cmd = engine.step({"c": 16})                            # 12, 13, then freed 3, then evicts cached 1
    assert cmd is not None and cmd.recycled_host_blocks == (3, 1)
    assert engine.coord.stats().evicted_blocks == 1
    assert engine.coord.lookup_prefix(list(range(8))).num_tokens == 0
