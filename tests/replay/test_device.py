"""The replay on a device that is not the CPU: every engine-side tensor must be on the backend's
device, and the figures must not depend on the backend.

`strict_device.StrictDeviceBackend` is reference_cpu with its tables and caches on an emulated
accelerator that raises, as CUDA does, when a CPU tensor is written into a device tensor. The
replay of issue 19 crashed that way on the H200 at its first decode step.
"""

from __future__ import annotations

import pytest
import torch
from strict_device import STRICT, StrictDeviceBackend, enable

from hisparse_core.registry import select_backend
from hisparse_core.replay.acks import StepAcks
from hisparse_core.replay.decode import capture_sizes
from hisparse_core.replay.engine import RunConfig
from hisparse_core.replay.run import run_replay
from hisparse_core.types import WorkerMetadata

#: Small, but with everything the large preset has: prefix families, 2 decode rows per request,
#: 2 index groups of a leader and a follower, GPU pressure (releases, reuse) and host pressure.
PRESSURED = RunConfig(requests=10, context=600, decode_tokens=12, steps=40, top_k=64, block_size=16, layers=4,
                      index_share=2, rows_per_request=2, gpu_kv_bytes=5 << 20, host_bytes=7 << 20, arrival_every=0,
                      seed=4)
FIGURES = ("hits", "misses", "resident_entries", "bytes_h2d", "bytes_d2h", "prefix_hit_tokens", "decode_rows",
           "attention_entries_checked", "requests_admitted", "requests_finished", "steps", "pages",
           "max_concurrency_hisparse_measured")


def test_the_strict_device_refuses_what_cuda_refuses() -> None:
    """The harness itself: a CPU tensor written by index into a device table raises; copies and
    scalars pass, as on CUDA."""
    enable()
    table = torch.full((4, 8), -1, dtype=torch.int32, device=STRICT)
    with pytest.raises(RuntimeError, match="same device"):
        table[1, [2, 3]] = torch.tensor([5, 6], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="same device"):
        table[torch.tensor([0])] = 7
    with pytest.raises(RuntimeError, match="same device"):
        _ = table[0] + torch.ones(8, dtype=torch.int32)
    table[1, torch.tensor([2, 3], device=STRICT)] = torch.tensor([5, 6], dtype=torch.int32, device=STRICT)
    table[2, :2] = torch.tensor([8, 9], dtype=torch.int32)         # a copy, allowed as on CUDA
    table[3] = 1
    assert table.cpu().tolist() == [[-1] * 8, [-1, -1, 5, 6, -1, -1, -1, -1], [8, 9] + [-1] * 6, [1] * 8]
    with pytest.raises(TypeError, match="numpy"):
        table.numpy()


def test_replay_on_a_strict_device_equals_reference_cpu() -> None:
    """Every figure of the pressured workload equals reference_cpu's, although the strict backend
    reports completions three polls late: the replay's acknowledgement schedule is the same for
    every backend."""
    ref = run_replay(PRESSURED, select_backend("reference_cpu")).summary()
    strict = run_replay(PRESSURED, StrictDeviceBackend(completion_lag=3))
    got = strict.summary()
    assert strict.backend["device"] == "privateuseone:0"
    assert {k: got[k] for k in FIGURES} == {k: ref[k] for k in FIGURES}
    pages = got["pages"]
    assert pages["spilled"] and pages["released"] and pages["reused"] and pages["host_blocks_evicted"]
    assert got["prefix_hit_tokens"] > 0 and 0 < got["hit_rate"] < 1
    assert got["requests_finished"] == PRESSURED.requests and got["steps"] < PRESSURED.steps
    # Two decode rows per request and step: every request decodes its 12 tokens in 6 steps.
    assert got["decode_rows"] == PRESSURED.requests * PRESSURED.decode_tokens
    assert got["attention_entries_checked"] == got["decode_rows"] * PRESSURED.top_k * PRESSURED.layers


def test_step_acks_hold_this_steps_completions_for_one_step() -> None:
    acks = StepAcks()
    first = acks.settle(WorkerMetadata.report([1, 2], [1, 2], [7]), {1, 2}, {7})
    assert dict(first.enqueued) == {1: 1, 2: 1} and not first.completed and not first.completed_host_copies
    second = acks.settle(WorkerMetadata.report([3], [3]), {3}, set())
    assert dict(second.enqueued) == {3: 1} and dict(second.completed) == {1: 1, 2: 1}
    assert second.completed_host_copies == (7,)
    assert dict(acks.settle(WorkerMetadata(), set(), set()).completed) == {3: 1}


def test_capture_sizes_cover_every_batch() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(38) == [1, 2, 4, 8, 16, 24, 32, 38]
    for n in range(1, 40):
        assert all(any(s >= b for s in capture_sizes(n)) for b in range(1, n + 1))
