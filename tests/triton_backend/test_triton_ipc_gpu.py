"""Two processes share one triton host pool on a GPU: rank 0's copy is held back on its GPU, and
rank 1's read (a resolve + gather through the pool) must wait for it on the GPU, behind rank 0's
interprocess event, not on the host. The harness is the nvidia backend's
(tests/nvidia_backend/nvidia_ipc_ranks.py), run with the triton backend."""

from __future__ import annotations

import multiprocessing as mp
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                   reason="needs a CUDA GPU: the interprocess event is a device event")]

sys.path.insert(0, str(Path(__file__).parents[1] / "nvidia_backend"))


def test_peer_reads_only_after_rank0_write_event() -> None:
    from nvidia_ipc_ranks import rank0, rank1, unique_name

    ctx = mp.get_context("spawn")
    name = unique_name()
    a, b = ctx.Pipe()
    report = ctx.Queue()
    p0 = ctx.Process(target=rank0, args=(name, a, report, "triton"))
    p1 = ctx.Process(target=rank1, args=(name, b, report, "triton"))
    p0.start()
    p1.start()
    results = sorted(report.get(timeout=240) for _ in range(2))
    p0.join(60)
    p1.join(60)
    assert not any("error" in r for r in results), "\n".join(results)
    assert results[0] == "rank0 ok"
    r1 = results[1]
    print(r1)
    assert "read_new=True" in r1, r1  # the GPU read saw rank 0's write
    assert "stale_when_enqueued=True" in r1, r1  # ... which had not landed when the read was enqueued
    assert "completed=(7,)" in r1 and "enqueued=(7,)" in r1, r1
