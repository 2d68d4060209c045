"""`hisparse run`: end-to-end replay through coordinator, worker and backend, checked against
an all-resident copy; its measurements agree with `hisparse plan`."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from hisparse_core.cli import main

#: 12 requests of 700+24 tokens, top-k 64, hot 2x, 2 layers sharing one indexer, GPU budget for 7.
SMALL = ["--requests", "12", "--context", "700", "--decode-tokens", "24", "--steps", "30", "--top-k", "64",
         "--block-size", "16", "--layers", "2", "--index-share", "2", "--gpu-kv", "3MiB", "--host", "8MiB",
         "--no-progress"]


def _run_json(*extra: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["run", "--backend", "reference_cpu", "--json", *SMALL, *extra]) == 0
    return json.loads(out.getvalue())


def _plan_json(*args: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", *args, "--json"]) == 0
    return json.loads(out.getvalue())


@pytest.fixture(scope="module")
def small_run() -> dict:
    return _run_json()


def test_run_checks_every_decode_entry(small_run: dict) -> None:
    s = small_run["summary"]
    assert s["decode_rows"] > 0 and s["attention_mismatches"] == 0
    # Every decode row compares top-k entries in each of the 2 layers.
    assert s["attention_entries_checked"] == s["decode_rows"] * 64 * 2
    assert s["misses"] > 0 and 0 < s["hit_rate"] < 1
    assert s["prefix_hit_tokens"] > 0 and 7 <= s["requests_admitted"] <= 12
    assert s["bytes_h2d"] == s["rows_h2d"] * 656 and s["bytes_d2h"] > 0
    assert 0 < s["host_pool_peak_usage"] <= 1


def test_run_concurrency_matches_planner(small_run: dict) -> None:
    """The planner's steady-state concurrency equals what the replay admitted into the same budget."""
    s = small_run["summary"]
    assert s["gpu_limit_reached"]
    plan = _plan_json("--model", "custom", "--layers", "2", "--row-bytes", "656", "--indexer-bytes", "132",
                      "--top-k", "64", "--block-size", "16", "--index-share", "2", "--gpu-kv", "3MiB",
                      "--host", "8MiB", "--context", str(700 + 24), "--hot", "2")
    assert plan["hisparse_concurrency"] == s["max_concurrency_hisparse_measured"] == 7
    assert plan["baseline_concurrency"] == s["max_concurrency_all_resident_measured"] == 2
    # GPU KV held per running request at peak concurrency is the planner's steady-state footprint.
    # (Measured is a little higher: a page leaving the tail is released only once its spill has completed.)
    assert s["gpu_kv_bytes_per_request_measured"] == pytest.approx(plan["steady_bytes_per_request"], rel=0.12)
    assert s["gpu_kv_bytes_per_request_all_resident"] == plan["baseline_bytes_per_request"]


def test_run_pcie_traffic_matches_planner(small_run: dict) -> None:
    """At the miss rate the run measured, the planner's host-to-device bytes per request-step equal
    the run's decode gathers per decode row."""
    s = small_run["summary"]
    plan = _plan_json("--model", "custom", "--layers", "2", "--row-bytes", "656", "--indexer-bytes", "132",
                      "--top-k", "64", "--block-size", "16", "--index-share", "2", "--gpu-kv", "3MiB",
                      "--host", "8MiB", "--context", "724", "--miss-rate", repr(s["miss_rate_per_entry"]))
    assert plan["h2d_bytes_per_request_step"] == pytest.approx(s["bytes_h2d"] / s["decode_rows"], rel=1e-9)


def test_run_is_deterministic(small_run: dict) -> None:
    again = _run_json()
    for key in ("hits", "misses", "resident_entries", "bytes_h2d", "prefix_hit_tokens"):
        assert again["summary"][key] == small_run["summary"][key]


def test_run_table_and_plot(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "run.png"
    assert main(["run", "--backend", "reference_cpu", *SMALL, "--steps", "8", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    for needle in ("steps per second", "hit rate", "host->device", "device->host", "host pool peak",
                   "cpu device KV per request", "prefix-hit tokens", "with hisparse", "all resident",
                   "attention check"):
        assert needle in out
    assert "GPU" not in out  # reference_cpu runs on the CPU: its KV budget is the cpu device's, not a GPU's
    assert png.stat().st_size > 10_000


def test_run_bf16_rows() -> None:
    doc = _run_json("--row-format", "bf16_mla", "--steps", "10", "--requests", "4")
    assert doc["summary"]["attention_entries_checked"] > 0 and doc["config"]["row_bytes"] == 1152


def test_run_refuses_a_budget_without_one_admission(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--backend", "reference_cpu", *SMALL, "--gpu-kv", "1MiB"]) == 2
    assert "one admission" in capsys.readouterr().err


def test_run_fails_on_a_wrong_row(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A reference copy that disagrees with what the model wrote must fail the run, naming the
    request, layer and position."""
    from hisparse_core.replay import kvdata

    real = kvdata.ReferenceKV.write

    def skewed(self, layer, start, rows):  # type: ignore[no-untyped-def]
        real(self, layer, start, rows)
        if layer == 1 and start == 700:  # the first decode token: the newest position is always attended
            self.data[1, 700, 20] += 1  # one element of one row of layer 1

    monkeypatch.setattr(kvdata.ReferenceKV, "write", skewed)
    code = main(["run", "--backend", "reference_cpu", *SMALL, "--steps", "4"])
    err = capsys.readouterr().err
    assert code == 1 and "FAILED" in err and "layer 1" in err and "position 700" in err and "req-0" in err


def test_run_concurrency_cap() -> None:
    doc = _run_json("--concurrency", "3", "--steps", "12")
    s = doc["summary"]
    assert s["max_concurrency_hisparse_measured"] == 3 and doc["config"]["state_rows"] == 3


def _config(*argv: str):  # type: ignore[no-untyped-def]
    from hisparse_core.cli import build_parser
    from hisparse_core.cli.run_cmd import config_from_args

    return config_from_args(build_parser().parse_args(["run", *argv]))


def test_presets_set_the_large_workload_and_flags_override_them() -> None:
    large = _config("--preset", "large")
    assert (large.requests, large.context, large.rows_per_request, large.layers, large.index_share) == \
        (64, 32768, 2, 4, 2)
    assert large.gpu_kv_bytes == 1 << 30 and large.host_bytes == 3 << 29 and large.prefix_groups == 4
    assert large.plan().gpu_blocks < 64 * large.plan().baseline_blocks_per_request, "GPU pressure"
    assert large.plan().host_blocks < 64 * large.plan().pages_per_request, "host pressure"
    mixed = _config("--preset", "large", "--requests", "8", "--gpu-kv", "2GiB", "--eager")
    assert (mixed.requests, mixed.gpu_kv_bytes, mixed.context, mixed.cuda_graphs) == (8, 2 << 30, 32768, False)
    assert _config() == _config("--preset", "default")


def test_run_reports_the_step_time_split_and_the_decode_mode(small_run: dict) -> None:
    from hisparse_core.replay.timing import PHASES

    s = small_run["summary"]
    assert set(s["phase_ms"]) == set(PHASES) and all(v >= 0 for v in s["phase_ms"].values())
    assert s["phase_ms"]["decode"] > 0 and s["phase_ms"]["check"] > 0 and s["decode_device_ms"] > 0
    assert s["decode_mode"] == "eager" and s["graph_sizes"] == []
    assert s["pages"]["spilled"] > 0 and s["pages"]["released"] > 0


def test_run_with_speculative_rows() -> None:
    doc = _run_json("--rows-per-request", "2", "--steps", "14")
    s = doc["summary"]
    assert doc["config"]["rows_per_request"] == 2 and doc["config"]["max_batch_rows"] == 2 * doc["config"]["state_rows"]
    assert s["attention_entries_checked"] == s["decode_rows"] * 64 * 2 and s["misses"] > 0
    decoding = [r for r in doc["steps"] if r["decode_rows"]]
    assert max(r["decode_rows"] for r in decoding) == 2 * max(r["running"] for r in decoding)


def test_speculative_rows_need_a_hot_buffer_for_their_union(capsys: pytest.CaptureFixture[str]) -> None:
    """In the flags' words, both ways out (it said `run hot buffer of 128 rows ...: raise --hot`)."""
    assert main(["run", "--backend", "reference_cpu", *SMALL, "--rows-per-request", "3"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "hisparse run: error: --rows-per-request 3 needs a hot buffer of 3 x --top-k 64 = 192 rows (a step's rows "
        "resolve as one union); --hot 2 makes 128: expected --hot >= 3, or --rows-per-request <= 2"]
    assert main(["run", "--backend", "reference_cpu", *SMALL, "--rows-per-request", "3", "--hot", "3",
                 "--steps", "2"]) == 0


@pytest.mark.parametrize(("flag", "remedy"), [("--gpu-kv", "lower --gpu-kv"), ("--host", "lower --host")])
def test_run_checks_a_budget_against_memory_before_building_anything(
        flag: str, remedy: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A terabyte budget is refused at once with the figures, before the coordinator builds its
    host block pool (seconds at that size) or anything is allocated."""
    import time
    t0 = time.perf_counter()
    assert main(["run", "--backend", "reference_cpu", *SMALL, flag, "1TiB"]) == 2
    assert time.perf_counter() - t0 < 5.0
    err = capsys.readouterr().err
    assert ("1.00 TiB" in err or "1024.00 GiB" in err) and remedy in err and "Traceback" not in err  # 1 TiB, or the GPU blocks just under it
