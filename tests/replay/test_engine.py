"""The replay engine's parts: workload families, KV rows, the attention check, and detection of a
corrupted host pool (rows served through the hot buffer must equal the all-resident copy)."""

from __future__ import annotations

import pytest
import torch

from hisparse_core.geometry import BF16_MLA, FP8_DS_MLA
from hisparse_core.registry import select_backend
from hisparse_core.replay.attention import AttentionMismatch, check_layer
from hisparse_core.replay.engine import ReplayEngine, RunConfig, measure_all_resident_concurrency
from hisparse_core.replay.kvdata import RowSource
from hisparse_core.replay.workload import make_workload


def test_workload_families_share_prefix_tokens() -> None:
    reqs = make_workload(6, 100, 5, prefix_groups=2, shared_fraction=0.5, arrival_every=2)
    a, b, c = reqs[0], reqs[2], reqs[1]
    assert [r.arrival_step for r in reqs] == [0, 2, 4, 6, 8, 10]
    assert a.token_ids()[:50] == b.token_ids()[:50] and a.token_ids()[50:] != b.token_ids()[50:]
    assert a.token_ids()[:50] != c.token_ids()[:50]
    assert a.content_keys(40, 60) == [(a.family_key, 40, 50), (a.own_key, 50, 60)]
    assert make_workload(2, 10, 1, prefix_groups=0)[0].shared_tokens == 0


@pytest.mark.parametrize("fmt", [FP8_DS_MLA, BF16_MLA])
def test_rows_are_deterministic_and_distinct(fmt) -> None:  # type: ignore[no-untyped-def]
    src = RowSource(fmt, 2, seed=1)
    pos = torch.arange(0, 3000)
    a, b = src.rows(5, pos, 0), src.rows(5, pos, 0)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.isfinite(a.float()).all()
    assert len({bytes(r.view(torch.uint8).numpy()) for r in a}) == 3000         # positions differ
    assert not torch.equal(a.view(torch.uint8), src.rows(6, pos, 0).view(torch.uint8))   # keys differ
    assert not torch.equal(a.view(torch.uint8), src.rows(5, pos, 1).view(torch.uint8))   # layers differ


def test_check_layer_passes_and_names_the_first_difference() -> None:
    src = RowSource(FP8_DS_MLA, 1)
    ref = src.rows(1, torch.arange(100), 0)
    device = torch.zeros((200, 656), dtype=torch.uint8)
    device[100:200] = ref                               # position p lives at physical row 100 + p
    topk = torch.tensor([[5, 7, -1, 99]], dtype=torch.int32)
    rows = torch.tensor([[105, 107, -1, 199]], dtype=torch.int32)
    q = torch.randn(1, 656)
    assert check_layer(device, rows, topk, [ref], q, ["r"], 3) == 3
    device[107, 0] ^= 1
    with pytest.raises(AttentionMismatch) as info:
        check_layer(device, rows, topk, [ref], q, ["r"], 3)
    assert (info.value.request, info.value.layer, info.value.position, info.value.row) == ("r", 3, 7, 107)
    with pytest.raises(AttentionMismatch, match="no row"):
        check_layer(device, torch.tensor([[105, -1, -1, 199]], dtype=torch.int32), topk, [ref], q, ["r"], 3)


def test_all_resident_probe() -> None:
    assert measure_all_resident_concurrency(100, 30) == 3
    assert measure_all_resident_concurrency(29, 30) == 0


def test_corrupted_host_pool_fails_the_check() -> None:
    """Zero layer 1 of the host pool once requests read from host: the next miss replayed into
    layer 1 (a follower of the index group) must be reported."""
    cfg = RunConfig(requests=4, context=700, decode_tokens=40, steps=40, top_k=64, block_size=16, layers=2,
                    index_share=2, gpu_kv_bytes=3 << 20, host_bytes=8 << 20, arrival_every=0, seed=2)
    engine = ReplayEngine(cfg, select_backend("reference_cpu"))
    try:
        misses = 0
        while misses == 0:                      # run until the hot buffer is in use
            misses = engine.step().misses
        engine.worker.host_pool.layer_view(1).zero_()
        with pytest.raises(AttentionMismatch) as info:
            for _ in range(20):
                engine.step()
        assert info.value.layer == 1 and info.value.request.startswith("req-") and info.value.position is not None
    finally:
        engine.close()
