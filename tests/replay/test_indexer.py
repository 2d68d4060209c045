"""The synthetic indexer: shape, validity, determinism, locality, and calibration to published LRU miss rates."""

from __future__ import annotations

import numpy as np
import pytest

from hisparse_core.replay.calibrate import PUBLISHED_MISS_RATES, measure_miss_rates
from hisparse_core.replay.indexer import DEFAULT_LOCALITY, LocalityParams, SyntheticIndexer
from hisparse_core.replay.lru_sim import LruHotBuffer, lru_miss_rates


def _steps(indexer: SyntheticIndexer, start: int, n: int) -> list[np.ndarray]:
    return [indexer.step(start + t) for t in range(n)]


@pytest.mark.parametrize("seq_len", [1, 5, 64, 65, 300, 1000, 5000])
def test_topk_is_distinct_and_in_context(seq_len: int) -> None:
    ix = SyntheticIndexer(256, 3, seed=1, request_id=2)
    out = ix.step(seq_len)
    assert out.shape == (3, 256) and out.dtype == np.int32
    for row in out:
        valid = row[row >= 0]
        assert len(valid) == min(256, seq_len)
        assert len(set(valid.tolist())) == len(valid)
        assert valid.max() < seq_len
        assert (row[len(valid):] == -1).all()  # padding only at the end
        assert seq_len - 1 in valid  # the newest token is always attended


def test_recent_window_is_always_selected() -> None:
    ix = SyntheticIndexer(128, 1, LocalityParams(0.9, 0.3, 0.02, recent_fraction=16 / 128), seed=0)
    for seq_len in range(2000, 2010):
        row = ix.step(seq_len)[0]
        assert set(range(seq_len - 16, seq_len)) <= set(row.tolist())


def test_deterministic_per_request_and_seed() -> None:
    a = _steps(SyntheticIndexer(128, 2, seed=7, request_id=3), 4000, 5)
    b = _steps(SyntheticIndexer(128, 2, seed=7, request_id=3), 4000, 5)
    c = _steps(SyntheticIndexer(128, 2, seed=7, request_id=4), 4000, 5)
    assert all((x == y).all() for x, y in zip(a, b, strict=True))
    assert any((x != y).any() for x, y in zip(a, c, strict=True))


def test_groups_draw_different_topk() -> None:
    out = SyntheticIndexer(128, 2, seed=0).step(10000)
    assert set(out[0].tolist()) != set(out[1].tolist())


def test_contexts_only_grow() -> None:
    ix = SyntheticIndexer(16, 1)
    ix.step(100)
    with pytest.raises(ValueError, match="went back"):
        ix.step(99)


def test_locality_knob_orders_miss_rates() -> None:
    def rate(locality: float) -> float:
        p = DEFAULT_LOCALITY.scaled(locality)
        return measure_miss_rates(p, top_k=256, context=8192, multiples=(2,), steps=60, warmup=10)[2]

    low, mid, high = rate(0.5), rate(1.0), rate(4.0)
    assert low > mid > high


def test_scaled_identity_and_bounds() -> None:
    same = DEFAULT_LOCALITY.scaled(1.0)
    assert (same.persistence, same.jitter, same.refresh) == pytest.approx(
        (DEFAULT_LOCALITY.persistence, DEFAULT_LOCALITY.jitter, DEFAULT_LOCALITY.refresh))
    with pytest.raises(ValueError):
        DEFAULT_LOCALITY.scaled(0.0)
    with pytest.raises(ValueError):
        LocalityParams(persistence=1.0, jitter=0.1, refresh=0.1)


def test_default_locality_lands_near_published_lru_miss_rates() -> None:
    """The default workload reproduces 30% / 13.4% / 6.7% (1x / 2x / 4x top-k) within 15%, on a
    seed the calibration did not see."""
    got = measure_miss_rates(DEFAULT_LOCALITY, top_k=2048, context=32768, steps=96, warmup=24, seed=5)
    for mult, target in PUBLISHED_MISS_RATES.items():
        assert got[mult] == pytest.approx(target, rel=0.15), (mult, got)


def test_lru_buffer_follows_contract_order() -> None:
    buf = LruHotBuffer(4)
    assert buf.access([1, 2, 3, 4]) == (0, 4)
    assert buf.access([2, 5]) == (1, 1)  # 5 evicts 1 (least recent non-hit); 2 becomes most recent
    assert 1 not in buf and 2 in buf
    assert buf.access([3, 6]) == (1, 1)  # evicts 4 (3 is hit; 4 is the oldest evictable)
    assert 4 not in buf and all(k in buf for k in (2, 3, 5, 6))
    assert buf.access([7, 7, -1]) == (0, 1)  # repeats load once, masked entries ignored
    with pytest.raises(ValueError, match="do not fit"):
        buf.access(range(10, 15))


def test_lru_miss_rates_counts_after_warmup() -> None:
    seq = [np.array([0, 1]), np.array([0, 1]), np.array([2, 3])]
    rates = lru_miss_rates(seq, [2, 4], warmup=1)
    assert rates.by_hot_rows == {2: 0.5, 4: 0.5}
    with pytest.raises(ValueError):
        lru_miss_rates(seq, [2], warmup=3)
