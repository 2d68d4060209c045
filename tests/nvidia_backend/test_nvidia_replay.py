"""`hisparse run`'s replay on the nvidia backend: the decode step captured in CUDA graphs (one per
batch size) and run eagerly give exactly reference_cpu's figures on a workload with prefix hits,
speculative rows, index groups with followers and GPU and host pressure."""

from __future__ import annotations

from dataclasses import replace

import pytest
from nvidia_support import requires_gpu

from hisparse_core.replay.engine import RunConfig
from hisparse_core.replay.run import run_replay
from hisparse_reference_cpu.backend import ReferenceCpuBackend

pytestmark = [requires_gpu, pytest.mark.gpu]

PRESSURED = RunConfig(requests=10, context=600, decode_tokens=12, steps=40, top_k=64, block_size=16, layers=4,
                      index_share=2, rows_per_request=2, gpu_kv_bytes=5 << 20, host_bytes=7 << 20, arrival_every=0,
                      seed=4)
FIGURES = ("hits", "misses", "resident_entries", "bytes_h2d", "bytes_d2h", "prefix_hit_tokens", "decode_rows",
           "attention_entries_checked", "requests_admitted", "requests_finished", "steps", "pages")


def test_graph_and_eager_replays_equal_reference_cpu() -> None:
    from hisparse_nvidia.backend import NvidiaBackend

    ref = run_replay(PRESSURED, ReferenceCpuBackend()).summary()
    graph = run_replay(PRESSURED, NvidiaBackend())
    eager = run_replay(replace(PRESSURED, cuda_graphs=False), NvidiaBackend()).summary()
    got = graph.summary()
    assert got["decode_mode"] == "cuda graph" and got["graph_sizes"] and eager["decode_mode"] == "eager"
    assert {k: got[k] for k in FIGURES} == {k: ref[k] for k in FIGURES} == {k: eager[k] for k in FIGURES}
    assert got["pages"]["released"] and got["pages"]["reused"] and got["prefix_hit_tokens"]
    assert got["decode_device_ms"] > 0
