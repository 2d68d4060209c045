"""Two processes share one host pool: rank 0 writes it, rank 1 reads only after rank 0's IPC event.

Also: the /dev/shm file is gone after rank 0 releases the pool, and a file left behind by a dead
creator is replaced by the next creator instead of blocking it.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
from nvidia_ipc_ranks import create_and_die, rank0, rank1, spec, unique_name
from nvidia_support import requires_gpu

pytestmark = [requires_gpu, pytest.mark.gpu]


def test_peer_reads_only_after_rank0_write_event() -> None:
    ctx = mp.get_context("spawn")
    name = unique_name()
    a, b = ctx.Pipe()
    report = ctx.Queue()
    p0 = ctx.Process(target=rank0, args=(name, a, report))
    p1 = ctx.Process(target=rank1, args=(name, b, report))
    p0.start()
    p1.start()
    results = sorted(report.get(timeout=180) for _ in range(2))
    p0.join(60)
    p1.join(60)
    assert not any("error" in r for r in results), "\n".join(results)
    assert results[0] == "rank0 ok"
    r1 = results[1]
    print(r1)
    assert "read_new=True" in r1, r1  # the GPU read saw rank 0's write
    assert "stale_when_enqueued=True" in r1, r1  # ... which had not landed when the read was enqueued
    assert "completed=(7,)" in r1 and "enqueued=(7,)" in r1, r1


def test_stale_file_of_a_dead_creator_is_replaced() -> None:
    from hisparse_nvidia.backend import NvidiaBackend
    from hisparse_nvidia.host_pool import shm_path

    name = unique_name()
    path = shm_path(name)
    ctx = mp.get_context("spawn")
    # A creator that dies without releasing: simulate with a child that creates and exits hard.
    p = ctx.Process(target=create_and_die, args=(name,))
    p.start()
    p.join(120)
    assert os.path.exists(path), "the crashed creator should have left its file"
    pool = NvidiaBackend(0).create_host_pool(spec(name, 0))
    try:
        assert pool.path == path and os.path.exists(path)
    finally:
        pool.release()
    assert not os.path.exists(path)
