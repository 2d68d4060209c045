"""The transfer engine: copies match the reference engine's bytes, acknowledgements are ordered."""

from __future__ import annotations

import random

import pytest
import torch
from nvidia_support import Twin, random_step, random_tables, requires_gpu

from hisparse_core.errors import ProtocolError
from hisparse_core.geometry import RuntimeConfig
from hisparse_core.types import HostBlockCopy, PageTransfer, RowMirror

pytestmark = [requires_gpu, pytest.mark.gpu]


def test_engine_copies_match_reference_and_report_in_order() -> None:
    rng = random.Random(31)
    cfg = RuntimeConfig(max_batch_rows=2, max_requests=2, top_k=32, hot_rows=64, block_size=16, max_pages=8,
                        num_layers=2)
    twin = Twin(cfg, host_blocks=18, num_device_blocks=40, seed=31)
    try:
        twin.set_tables(random_tables(cfg, 18, 40, rng, resident_share=0.3, null_share=0.0))
        nv = twin.nv.create_transfer_engine(twin.nv_pool, [twin.rt])
        ref = twin.ref_backend.create_transfer_engine(twin.ref_pool, [twin.ref])
        torch.cuda._sleep(200_000_000)  # keep the copy stream busy behind the compute stream
        for eng in (nv, ref):
            eng.submit_row_mirrors([RowMirror((16 * 3 + 1,), 16 * 4 + 1, 5)])
            eng.submit_pages([PageTransfer(1, 10, (30,)), PageTransfer(2, 11, (31,)),
                              PageTransfer(3, 12, (32,), restore=True)])
            eng.submit_host_copies([HostBlockCopy(10, 15)])
        first = nv.poll()
        assert first.enqueued == (1, 2, 3)
        with pytest.raises(ProtocolError):
            nv.submit_pages([PageTransfer(2, 13, (33,))])  # id 2 is still unacknowledged
        done = nv.drain()
        got = set(first.completed) | set(done.completed)
        assert got == {1, 2, 3}
        assert list(first.completed + done.completed) == sorted(first.completed + done.completed)
        assert set(first.completed_host_copies) | set(done.completed_host_copies) == {15}
        ref.drain()
        twin.compare_bytes("engine")
        assert twin.rt.stats() == twin.ref.stats()
        # The gather after the engine's host writes sees them (same process: stream order).
        nv.wait_for_host_writes()
        step = random_step(cfg, rng, {}, locality=0.0, padding_share=0.0)
        twin.resolve(step)
        twin.compare_all("after engine")
    finally:
        twin.close()
