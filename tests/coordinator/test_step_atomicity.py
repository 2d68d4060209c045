"""A step is applied whole or refused whole, and takes exactly the host blocks its validation counted.

`test_restore_pinned_page_sealed_onto_a_cached_block` is the case the state machine found (issue
38, `failure-8b0d74f.txt` in the shared findings): a prefix hit capped inside a page restores that
page from its host copy-on-write block; when the page seals while the restore is still in flight,
its hash is published on a *cached* block (the original page of the finished request it copied
from). Sharing that block took it off the cache (one allocatable block fewer) while releasing the
page's own block gave none back (the restore still pinned it), so a later request of the same step
found the pool empty mid-apply: `CapacityError` from `HostBlockPool.allocate` with the step half
applied. Here it is reduced to four requests, deterministically.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from hisparse_core.coordinator import HiSparseCoordinator
from hisparse_core.errors import CapacityError
from hisparse_core.types import WorkerMetadata

from .harness import MiniEngine, MiniWorkers, small_config

T = [1, 2, 3, 4, 5, 6, 7, 8]   # two pages of 4 tokens


def coordinator_state(coord: HiSparseCoordinator) -> tuple[object, ...]:
    """Everything a refused step must leave as it was: leases, tables, host blocks, transfers."""
    host = coord._host
    recs = tuple((rid, list(r.host), list(r.gpu), bytes(r.state), r.num_mirrored, r.num_sealed, r.num_ready,
                  r.state_index, r.restore_page, r.hot, r.pending_spills)
                 for rid, r in sorted(coord._requests.items()))
    return (coord.stats(), list(host._leases), list(host._free), list(host._cached), dict(host._by_hash),
            [coord._gpu.lease_count(b) for b in range(coord._gpu.num_blocks)],  # type: ignore[attr-defined]
            recs, sorted(t.transfer_id for t in coord._transfers.pending()), len(coord._copies), coord._table_updates)


def setup_pinned_restore(host_blocks: int = 12, max_model_len: int = 32) -> tuple[MiniEngine, MiniWorkers, int]:
    """B's page 1 restored from its copy-on-write block (restore unacknowledged) while the block it
    was copied from (A's page 1, published) is cached; returns the engine, workers and that block."""
    engine = MiniEngine(small_config(host_blocks=host_blocks, max_model_len=max_model_len), gpu_blocks=96)
    workers = MiniWorkers(1)
    coord = engine.coord
    engine.admit("A", list(T))
    workers.receive(engine.step({"A": 8}))
    workers.receive(engine.step({"A": 1}))          # pages 0 and 1 seal and spill
    workers.ack_all(coord)                          # ... and are published
    a_page1 = coord.source_block_ids("A")[1]
    workers.receive(engine.step({}, finished=("A",)))
    assert coord._host.lease_count(a_page1) == 0 and coord._host.num_cached == 2
    assert engine.admit("B", [*T, 9], max_prefix=6) == 6   # page 1 copied on write
    cmd = engine.step({"B": 2})                     # writes rows 6, 7: restores page 1 first
    assert cmd is not None and len(cmd.host_block_copies) == 1 and [t.restore for t in cmd.page_transfers] == [True]
    workers.receive(cmd)
    # The copy completes (A's page 1 is cached again); the restore does not report yet.
    coord.update_from_workers(WorkerMetadata.report(completed_host_copies=sorted(workers.copies)), 1)
    workers.copies.clear()
    assert coord._host.lease_count(a_page1) == 0
    return engine, workers, a_page1


def test_restore_pinned_page_sealed_onto_a_cached_block() -> None:
    engine, _, a_page1 = setup_pinned_restore()
    coord = engine.coord
    # A filler request takes every free block but one; the cached A page 1 is the other allocatable one.
    filler = [20 + i for i in range(4 * (coord.num_free_host_blocks - 2))]
    engine.admit("F", filler)
    engine.step({"F": len(filler)})
    assert coord.num_free_host_blocks == 2 and coord._host.num_cached == 1
    need = coord.host_blocks_needed("B", 9) + coord.host_blocks_needed("F", len(filler) + 1)
    assert need == 2
    # B seals page 1 (its hash is A's page 1, cached) and adds page 2; F adds a page. Before the
    # fix: B took the cached block, F's allocation found none, the step was left half applied.
    engine.step({"B": 1, "F": 1})
    assert coord.num_free_host_blocks == 0
    b_host = coord.source_block_ids("B")
    assert b_host[1] != a_page1, "B's page 1 stays on its own block while its restore pins it"
    coord._host.check_invariants()
    # Everything drains: every lease comes back.
    workers = MiniWorkers(1)
    for rid in ("B", "F"):
        coord.finish_request(rid)
    workers.receive(coord.schedule_step([]))
    meta = WorkerMetadata.report(sorted(t.transfer_id for t in coord._transfers.pending()),
                                 sorted(t.transfer_id for t in coord._transfers.pending()))
    coord.update_from_workers(meta, 1)
    assert not coord.has_pending_work()
    assert coord.stats().host_blocks_used == 0


def test_restored_page_shares_the_cached_block_once_its_restore_landed() -> None:
    """The same seal after the restore completed: the swap is free, so the page takes the cached block."""
    engine, workers, a_page1 = setup_pinned_restore()
    coord = engine.coord
    workers.ack_all(coord)                          # the restore lands
    free = coord.num_free_host_blocks
    engine.step({"B": 1})                           # seals page 1, adds page 2
    assert coord.source_block_ids("B")[1] == a_page1
    assert coord.num_free_host_blocks == free - 1   # exactly the one new page
    coord._host.check_invariants()


@settings(max_examples=30, deadline=None)
@given(extra=st.integers(1, 4), order=st.permutations(["B", "F", "G"]), grow=st.lists(st.integers(0, 5), min_size=3,
                                                                                     max_size=3))
def test_a_refused_step_changes_nothing(extra: int, order: list[str], grow: list[int]) -> None:
    """A step that needs more host blocks than the pool has raises `CapacityError` before anything
    changes (leases, tables, host blocks, pending transfers), whatever the mix of requests: a page
    sealing onto a cached block under a pending restore, prefills and decodes; and the same step
    with exactly enough blocks goes through whole."""
    engine, _, _ = setup_pinned_restore(host_blocks=24, max_model_len=64)
    coord = engine.coord
    engine.admit("G", [30 + i for i in range(5)])
    engine.step({"G": 5})
    filler = [60 + i for i in range(4 * min(10, coord.num_free_host_blocks - 6))]
    engine.admit("F", filler)
    engine.step({"F": len(filler)})
    new = {"B": 1 + 4 * grow[0], "F": 1 + 4 * grow[1], "G": 1 + 4 * grow[2]}
    computed = {rid: engine.requests[rid].num_computed for rid in new}
    for rid in new:   # stay within max_model_len
        new[rid] = max(1, min(new[rid], 64 - computed[rid]))
    need = sum(coord.host_blocks_needed(rid, computed[rid] + new[rid]) for rid in new)
    # Another request takes blocks out of the pool until the step is `extra` short.
    short = coord.num_free_host_blocks - need + min(extra, need)
    if short > 0:
        engine.admit("X", [100 + i for i in range(4 * short)])
        engine.step({"X": 4 * short})
    assert coord.num_free_host_blocks < need
    views = [engine.view(rid, new[rid]) for rid in order]
    before = coordinator_state(coord)
    with pytest.raises(CapacityError, match="host pool"):
        coord.schedule_step(views)
    assert coordinator_state(coord) == before
    # X leaves: now enough blocks, and the same step applies whole.
    if short > 0:
        coord.finish_request("X")
    if coord.num_free_host_blocks >= need:
        free = coord.num_free_host_blocks
        coord.schedule_step(views)
        assert coord.num_free_host_blocks >= free - need
        coord._host.check_invariants()
