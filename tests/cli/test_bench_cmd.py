"""`hisparse bench`: output shape, internal consistency, and agreement with an independent LRU model."""

from __future__ import annotations

import json

import pytest

from hisparse_core.cli import main
from hisparse_core.registry import select_backend
from hisparse_core.replay.bench import BenchConfig, run_bench
from hisparse_core.replay.indexer import DEFAULT_LOCALITY, SyntheticIndexer
from hisparse_core.replay.lru_sim import LruHotBuffer

SMALL = ["--requests", "2", "--context", "1500", "--steps", "6", "--top-k", "128", "--layers", "3",
         "--index-share", "2", "--block-size", "16", "--warmup", "2", "--no-progress"]


def test_bench_json_is_consistent(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--backend", "reference_cpu", "--json", *SMALL]) == 0
    doc = json.loads(capsys.readouterr().out)
    cfg, s = doc["config"], doc["summary"]
    assert cfg["index_groups"] == [2, 1] and cfg["hot_rows"] == 256
    assert len(doc["steps"]) == 6 and s["steady"]["steps"] == 4
    # Every host row a step touches was copied once per layer of its group; first step is cold.
    first = doc["steps"][0]
    assert first["hits"] == 0 and first["misses"] > 0
    assert s["all"]["bytes_h2d"] == s["all"]["rows_h2d"] * 656
    # One decode token per request and step is mirrored to host in every layer.
    assert s["all"]["bytes_d2h"] == 6 * 2 * 3 * 656
    assert 0 < s["steady"]["hit_rate"] <= 1 and s["step_ms_mean"] > 0


def test_bench_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--backend", "reference_cpu", *SMALL]) == 0
    out = capsys.readouterr().out
    for needle in ("hit rate", "misses", "rows copied host->device", "bytes host->device", "per step"):
        assert needle in out


def test_bench_rejects_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--backend", "reference_cpu", "--hot", "0.5", *SMALL])
    assert exit_.value.code == 2
    assert "--hot: expected a multiple of top-k in [1, 64], got 0.5" in capsys.readouterr().err


def test_bench_counters_match_independent_lru_model() -> None:
    """Hits and misses the backend reports equal a contract-exact LRU fed the same top-k minus
    the entries that fall in resident tail pages."""
    cfg = BenchConfig(requests=3, context=2000, steps=8, top_k=128, hot_multiple=1.5, layers=2, index_share=1,
                      block_size=16, tail_pages=2, warmup=1, seed=3)
    res = run_bench(cfg, select_backend("reference_cpu"))
    groups = 2
    hits = misses = resident = 0
    for r in range(cfg.requests):
        ix = SyntheticIndexer(cfg.top_k, groups, DEFAULT_LOCALITY, seed=cfg.seed, request_id=r)
        bufs = [LruHotBuffer(cfg.hot_rows) for _ in range(groups)]
        for step in range(cfg.steps):
            seq_len = cfg.context + step + 1
            first_resident = ((seq_len - 1) // cfg.block_size - cfg.tail_pages + 1) * cfg.block_size
            topk = ix.step(seq_len)
            for g in range(groups):
                row = [int(p) for p in topk[g] if p >= 0]
                host = [p for p in row if p < first_resident]
                resident += len(row) - len(host)
                h, m = bufs[g].access(host)
                hits, misses = hits + h, misses + m
    s = res.summary()["all"]
    assert (s["hits"], s["misses"], s["resident_entries"]) == (hits, misses, resident)


def test_bench_refuses_index_groups_the_backend_does_not_declare() -> None:
    # --index-share 2 puts two layers in a group, which needs index_sharing: refused before the host pool.
    from hisparse_core.backend import Capability
    from hisparse_core.errors import InvalidInputError
    from hisparse_reference_cpu.backend import ReferenceCpuBackend

    class NoSharing(ReferenceCpuBackend):
        capabilities = ReferenceCpuBackend.capabilities - {Capability.INDEX_SHARING}

        def create_host_pool(self, spec):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
            raise AssertionError("the host pool was created before the refusal")

    with pytest.raises(InvalidInputError, match=r"^--index-share 2 \(layers sharing one top-k\) needs capability "
                                                "'index_sharing', which backend 'reference_cpu' does not declare"):
        run_bench(BenchConfig(requests=1, context=256, steps=2, warmup=0, top_k=16, layers=2, index_share=2,
                              block_size=16), NoSharing())
