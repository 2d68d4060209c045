"""The flags of bench scripts that need a GPU (or NIXL) to measure anything: `bench_pool_release`,
`bench_indexer_split`, `bench_host_reads` and `bench_pd_import`. A bad value is one line naming the
flag, the value and what was expected, exit 2, before any GPU is asked for or any process started;
`bench_pool_release` without a GPU refuses in one line instead of starting a child per way."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_scripts import imported

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize(("script", "argv", "line"), [
    # each child ended in a traceback (cannot convert float NaN to integer, HostPoolSpec's
    # InvalidInputError), and a chunk that rounds to 0 bytes would never end the registration loop
    ("bench_pool_release", ["--gib", "nan"], "argument --gib: expected a number in [0.01, 65536], got nan"),
    ("bench_pool_release", ["--gib", "-1"], "argument --gib: expected a number in [0.01, 65536], got -1"),
    ("bench_pool_release", ["--chunk-gib", "0"], "argument --chunk-gib: expected a number in [0.002, 65536], got 0"),
    ("bench_pool_release", ["--chunk-gib", "inf"], "argument --chunk-gib: expected a number in [0.002, 65536], got inf"),
    ("bench_pool_release", ["--ways", ""], "argument --ways: expected some of release, exit, exit-unregister, "
                                           "sigterm-default, sigkill, got ''"),
    ("bench_pool_release", ["--json", "/nonexistent/x.json"], "--json '/nonexistent/x.json': the folder "
                                                              "'/nonexistent' does not exist"),
    # a ValueError traceback (int('')) before the GPU check
    ("bench_indexer_split", ["--parts", "1,,2"], "argument --parts: expected comma-separated integers in [1, 65536], "
                                                 "got '1,,2'"),
    ("bench_indexer_split", ["--parts", "x"], "argument --parts: expected comma-separated integers"),
    ("bench_indexer_split", ["--replays", "0"], "argument --replays: expected an integer in [1, 100000], got 0"),
    ("bench_indexer_split", ["--batch", "-1"], "argument --batch: expected an integer in [1, 65536], got -1"),
    ("bench_host_reads", ["--reps", "0"], "argument --reps: expected an integer in [1, 10000], got 0"),
    ("bench_host_reads", ["--steps", "-1"], "argument --steps: expected an integer in [1, 10000], got -1"),
    ("bench_host_reads", ["--json", "/nonexistent/x.json"], "--json '/nonexistent/x.json': the folder '/nonexistent' "
                                                            "does not exist"),
    # NIXL runs on the CPU: these were tracebacks (ValueError, OverflowError, ZeroDivisionError), or
    # came after the prefill process had started (HostPoolSpec's InvalidInputError, an EOFError)
    ("bench_pd_import", ["--gib", "nan"], "argument --gib: expected a number in (0, 1024], got nan"),
    ("bench_pd_import", ["--gib", "1e400"], "argument --gib: expected a number in (0, 1024], got 1e400"),
    ("bench_pd_import", ["--gib", "0"], "argument --gib: expected a number in (0, 1024], got 0"),
    ("bench_pd_import", ["--gib", "1e-9"], "argument --gib: 1e-09 holds 1 page of --layers 8 x --block-size 64 rows; "
                                           "expected --gib >= 0.0009385 (4 pages)"),
    ("bench_pd_import", ["--layers", "0"], "argument --layers: expected an integer in [1, 1024], got 0"),
    ("bench_pd_import", ["--block-size", "-1"], "argument --block-size: expected an integer in [1, 4096], got -1"),
    ("bench_pd_import", ["--repeats", "0"], "argument --repeats: expected an integer in [1, 1000], got 0"),
    ("bench_pd_import", ["--gib", "1024"], "--gib 1024 (the prefill's pages, the decoder's pool and the memcpy case's "
                                           "two copies: 4x the pages) needs 4.00 TiB"),
    # read after the GPU check: int() and dict() tracebacks on a GPU machine; --replays 0 the median of none
    ("bench_nvidia", ["--variant", "HISPARSE_GATHER_BLOCKS"], "argument --variant: expected VAR=V[,VAR=V]"),
    ("bench_nvidia", ["--variant-cells", "0:x"], "argument --variant-cells: expected M:B pairs, M misses per request "
                                                 "in [0, 2048] or R, B a batch in [1, 128] (e.g. 0:1,R:128), got '0:x'"),
    ("bench_nvidia", ["--vllm-ops-misses", "1,,2"], "argument --vllm-ops-misses: expected misses per request in "
                                                    "[0, 2048] or R, comma-separated, got '1,,2'"),
    ("bench_nvidia", ["--vllm-ops-batches", "0"], "argument --vllm-ops-batches: expected batches in [1, 128]"),
    ("bench_nvidia", ["--vllm-ops-rows", ""], "argument --vllm-ops-rows: expected comma-separated integers in [1, 64]"),
    ("bench_nvidia", ["--replays", "0"], "argument --replays: expected an integer in [1, 100000], got 0"),
    ("bench_triton", ["--replays", "-1"], "argument --replays: expected an integer in [1, 100000], got -1"),
    # the stock parser printed its usage (some 20 lines for bench_serving) before the error
    ("bench_triton", ["--cells", "x"], "--cells 'x': expected M:B pairs"),
    ("bench_serving", ["--steps", "x"], "argument --steps: invalid int value: 'x'"),
    ("plot_serving_regimes", [], "the following arguments are required: json"),
])
def test_a_bad_value_is_one_line(script: str, argv: list[str], line: str, capsys: pytest.CaptureFixture[str]) -> None:
    with imported(BENCH / f"{script}.py") as module, pytest.raises(SystemExit) as exit_:
        module.main(argv)
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith(f"{script}: error: {line}"), err


def test_pool_release_without_a_gpu_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Each of the five ways started a child that ended in its own traceback (no CUDA driver), and the
    script exited 0 after a table of `child exited with 1 before registering`."""
    with imported(BENCH / "bench_pool_release.py") as module:
        try:
            from hisparse_nvidia.plugin import probe

            why = probe()
        except ImportError:
            why = "not installed"
        if why is None:
            pytest.skip("an NVIDIA GPU is usable here: the script would measure")
        assert module.main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert err.startswith("bench_pool_release: error: needs an NVIDIA GPU: "), err


def test_host_reads_without_a_gpu_is_a_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2 and one line, as every bench script refuses a machine it cannot run on (it was exit 1)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU: bench_host_reads would run")
    with imported(BENCH / "bench_host_reads.py") as module:
        assert module.main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "bench_host_reads: needs a CUDA GPU (torch.cuda.is_available() is False)\n"
