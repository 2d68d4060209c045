"""`bench/bench_coordinator.py` and `bench/bench_engine_host.py` (CPU benchmarks of the host work): a bad
value is one line naming the flag, exit 2, before anything is built."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_scripts import imported

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize(("script", "argv", "line"), [
    ("bench_coordinator", ["--steps", "0"], "argument --steps: expected an integer in [1, 16777216], got 0"),
    ("bench_coordinator", ["--requests", "0"], "argument --requests: expected an integer in [1, 65536], got 0"),
    ("bench_coordinator", ["--workers", "0"], "argument --workers: expected an integer in [1, 1024], got 0"),
    ("bench_coordinator", ["--context", "-1"], "argument --context: expected an integer in [1, 16777216], got -1"),
    # a MemoryError traceback while building the block tables
    ("bench_coordinator", ["--requests", "65536", "--context", "16777216"],
     "--requests 65536 x --context 16777216 (30075002880 GPU blocks of bookkeeping over both scenarios, about 3072 B "
     "each) needs 84.03 TiB"),
    ("bench_engine_host", ["--steps", "0"], "argument --steps: expected an integer in [1, 16777216], got 0"),
    ("bench_engine_host", ["--batch", "0"], "argument --batch: expected an integer in [1, 65536], got 0"),
    ("bench_engine_host", ["--warmup", "-1"], "argument --warmup: expected an integer in [0, 16777216], got -1"),
    ("bench_engine_host", ["--gpu-kv-gib", "nan"], "argument --gpu-kv-gib: expected a number in (0, 65536], got nan"),
    ("bench_engine_host", ["--backend", "nope"], "--backend 'nope': no hisparse backend named 'nope'"),
    # the engine's CapacityError, a traceback in its own terms (gpu_kv_gib=0.0642242, max_batch=43)
    ("bench_engine_host", ["--gpu-kv-gib", "2.5"], "--gpu-kv-gib 2.5 holds 4209 blocks once the indexer keys of "
                                                   "--batch 43 at --context 32768 are taken, below the 5826 its hot "
                                                   "buffers, tails and prefill need; expected --gpu-kv-gib >= 2.944 "
                                                   "or --batch <= 36"),
    ("bench_engine_host", ["--gpu-kv-gib", "1e-9"], "--gpu-kv-gib 1e-09 holds 0 blocks"),
    ("bench_engine_host", ["--mode", "all-resident", "--batch", "65536", "--context", "16777216"],
     "--batch 65536 at --context 16777216 + 25 steps (--warmup + --steps): "),
])
def test_a_bad_value_is_one_line(script: str, argv: list[str], line: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Each ended in a traceback (StatisticsError, InvalidInputError, ZeroDivisionError, ValueError,
    BackendNotFoundError), or ran (`--context -1`, `--warmup -1`) on a value that means nothing."""
    with imported(BENCH / f"{script}.py") as module, pytest.raises(SystemExit) as exit_:
        module.main(argv)
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith(f"{script}: error: {line}"), err


def test_a_hit_rate_of_no_lookup_is_not_0_percent() -> None:
    """bench_engine_host printed `hits 0%` for a run where every entry was resident (no lookup went
    through the hot buffer): a rate of nothing."""
    with imported(BENCH / "bench_engine_host.py") as module:
        assert module.hits_text(0, 0) == "hits n/a: no lookup went through the hot buffer (0 hits, 0 misses)"
        assert module.hits_text(3, 4) == "hits 75.00%"
