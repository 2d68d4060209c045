"""The two ranks of the shared-host-pool test (`test_nvidia_ipc.py`), run as spawned processes.

Rank 0 writes rows into the shared pool from its GPU behind a long GPU sleep and publishes its
IPC event; rank 1 orders its read (a resolve + gather from the pool) on that event. Rank 1 checks
that, when it enqueued the read, the rows in host memory were still the old ones (the write had
not landed yet), and that what its GPU read is the new rows: the read waited for the write.

Both ranks first run every kernel of the timed part once (`_warm_up`): a backend that compiles its
kernels at first launch (triton's JIT) would otherwise spend the sleep compiling rank 0's copy and
rank 1's resolver on the host, so the write lands before rank 1 even enqueues its read and the
test cannot tell a GPU-side wait from a late enqueue.
"""

from __future__ import annotations

import os
import time
import traceback

import torch

from hisparse_core.geometry import RuntimeConfig
from hisparse_core.host_pool import HostPoolSpec
from hisparse_core.runtime import ResolveInputs
from hisparse_core.types import PageTransfer, RowMirror

BS = 16
CFG = RuntimeConfig(max_batch_rows=1, max_requests=1, top_k=BS, hot_rows=2 * BS, block_size=BS, max_pages=8)
HOST_BLOCK = 2  # the host block rank 0 writes
SOURCE_BLOCK = 5  # rank 0's device block holding the new rows
SLEEP_CYCLES = 1_500_000_000  # ~0.75 s of GPU time before rank 0's copy runs


def new_rows() -> torch.Tensor:
    return torch.randint(0, 256, (BS, 656), dtype=torch.uint8, generator=torch.Generator().manual_seed(99))


def spec(name: str, rank: int) -> HostPoolSpec:
    return HostPoolSpec(num_layers=1, num_blocks=8, block_size=BS, shared=True, name=name, rank=rank, world_size=2)


def _setup(name: str, rank: int, backend: str = "nvidia"):  # noqa: ANN202
    if backend == "triton":  # the same protocol on the triton backend (tests/triton_backend)
        from hisparse_triton.backend import TritonBackend

        be = TritonBackend(0)
    else:
        from hisparse_nvidia.backend import NvidiaBackend

        be = NvidiaBackend(0)
    pool = be.create_host_pool(spec(name, rank))
    dev_cache = torch.zeros((8, BS, 656), dtype=torch.uint8, device=be.device)
    rt = be.create_runtime(CFG)
    rt.bind(pool.layer_views(), [dev_cache])
    engine = be.create_transfer_engine(pool, [rt])
    return be, pool, dev_cache, rt, engine


def _warm_up(be, rt, engine) -> None:  # noqa: ANN001
    """Launch (and so compile) the kernels the timed part runs, changing no row that part reads: a
    mirror of the still-zero source block onto the (zeroed) host block, which is one host-write epoch
    on every rank, and a resolve + gather of a padding row, which leaves the hot state as it was."""
    engine.submit_row_mirrors([RowMirror((SOURCE_BLOCK * BS,), HOST_BLOCK * BS, BS)])
    engine.drain()
    dev = be.device
    i32 = torch.int32
    rt.resolve(ResolveInputs(torch.full((1, BS), -1, dtype=i32, device=dev), torch.full((1,), -1, dtype=i32, device=dev),
                             torch.full((1,), 8 * BS, dtype=i32, device=dev), torch.full((1, 8), -1, dtype=i32, device=dev),
                             torch.full((1, 8), -1, dtype=i32, device=dev), torch.tensor([[0, 1]], dtype=i32, device=dev)),
               validate=False)
    torch.cuda.synchronize()


def rank0(name: str, conn, report, backend: str = "nvidia") -> None:  # noqa: ANN001
    try:
        be, pool, dev_cache, rt, engine = _setup(name, 0, backend)
        pool.layer_view(0).view(torch.uint8).zero_()  # the old contents
        _warm_up(be, rt, engine)  # before the new rows reach the source block
        dev_cache[SOURCE_BLOCK].copy_(new_rows().to(be.device))
        torch.cuda.synchronize()
        conn.send("ready")
        assert conn.recv() == "attached"
        torch.cuda._sleep(SLEEP_CYCLES)  # delays everything the copy stream runs after it
        engine.submit_row_mirrors([RowMirror((SOURCE_BLOCK * BS,), HOST_BLOCK * BS, BS)])
        engine.submit_pages([PageTransfer(7, HOST_BLOCK + 1, (SOURCE_BLOCK,))])
        conn.send("submitted")
        progress = engine.drain()
        assert progress.completed == (7,), progress
        assert conn.recv() == "done"
        path = pool.path
        pool.release()
        assert path is not None and not os.path.exists(path), "rank 0 left the shm file behind"
        conn.send("ok")
        report.put("rank0 ok")
    except BaseException:  # noqa: BLE001
        report.put("rank0 error: " + traceback.format_exc())


def rank1(name: str, conn, report, backend: str = "nvidia") -> None:  # noqa: ANN001
    try:
        assert conn.recv() == "ready"
        be, pool, dev_cache, rt, engine = _setup(name, 1, backend)
        assert not pool.is_writer
        _warm_up(be, rt, engine)  # rank 0's warm-up epoch (zeros) is complete: it sent "ready" after it
        conn.send("attached")
        assert conn.recv() == "submitted"
        # The same commands reach every rank; the peer writes nothing and acknowledges later.
        engine.submit_row_mirrors([RowMirror((SOURCE_BLOCK * BS,), HOST_BLOCK * BS, BS)])
        engine.submit_pages([PageTransfer(7, HOST_BLOCK + 1, (SOURCE_BLOCK,))])
        dev = be.device
        i32 = torch.int32
        inputs = ResolveInputs(
            torch.arange(HOST_BLOCK * BS, HOST_BLOCK * BS + BS, dtype=i32, device=dev)[None],
            torch.zeros(1, dtype=i32, device=dev), torch.full((1,), 8 * BS, dtype=i32, device=dev),
            torch.arange(8, dtype=i32, device=dev)[None], torch.full((1, 8), -1, dtype=i32, device=dev),
            torch.tensor([[0, 1]], dtype=i32, device=dev))
        engine.wait_for_host_writes()  # GPU-side wait on rank 0's IPC event
        out = rt.resolve(inputs, validate=False)
        host_now = pool.layer_view(0).view(torch.uint8)[HOST_BLOCK * BS:(HOST_BLOCK + 1) * BS].clone()
        stale_when_enqueued = bool((host_now == 0).all())
        torch.cuda.synchronize()
        got = dev_cache.view(-1, 656)[out.rows[0].long()].cpu()
        read_new = torch.equal(got, new_rows())
        progress = engine.drain()
        conn.send("done")
        assert conn.recv() == "ok"
        pool.release()
        report.put(f"rank1 stale_when_enqueued={stale_when_enqueued} read_new={read_new} "
                   f"completed={progress.completed} enqueued={progress.enqueued}")
    except BaseException:  # noqa: BLE001
        report.put("rank1 error: " + traceback.format_exc())


def unique_name() -> str:
    return f"ipctest{os.getpid()}x{int(time.time() * 1000) % 1_000_000}"


def create_and_die(name: str) -> None:
    """A rank 0 that creates the shared pool and exits without releasing it (like a crash)."""
    from hisparse_nvidia.backend import NvidiaBackend

    pool = NvidiaBackend(0).create_host_pool(spec(name, 0))
    assert pool.path is not None
    os._exit(0)  # with the pool still referenced: no release, no finalizer
