"""`bench/bench_prefetch_locality.py --hot-rows`: the CPU simulation's hot buffer, as bench_serving.py
takes it (0: 2x top-k), sizes the pool (fewer hot rows leave more resident pages a request and
a larger batch) and the LRU replay; a bad value is one line naming the flag."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from bench_scripts import imported

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_prefetch_locality.py"
TINY = ["--geometries", "32768:2", "--regimes", "benign", "--references", "spread", "--plans", "off",
        "--warmup", "1", "--steps", "1", "--indexer-keys", "fp8", "--kv-rows", "fp8", "--all-resident-ms", ""]


@dataclass(frozen=True, slots=True)
class Result:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def bench():
    # In process: a fresh interpreter a run (torch and transformers imported anew) cost most of this
    # module's time; one bad value below still runs the script as a user does.
    with imported(SCRIPT) as module:
        yield module


@pytest.fixture()
def run(bench):
    def call(*args: str) -> Result:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = bench.main(list(args))
        return Result(code, out.getvalue(), err.getvalue())
    return call


def footer(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("# 32K batch"))


def critical_misses(stdout: str) -> int:
    row = next(line for line in stdout.splitlines() if line.startswith("| 32K |"))
    return int(row.split("|")[6].replace(",", ""))


def test_hot_rows_size_the_pool_and_the_buffers(run) -> None:
    default, half = run(*TINY), run(*TINY, "--hot-rows", "2048")
    assert default.returncode == 0 and half.returncode == 0, default.stderr[-2000:] + half.stderr[-2000:]
    assert footer(default.stdout).endswith(" 4096 hot rows"), default.stdout
    assert footer(half.stdout).endswith(" 2048 hot rows"), half.stdout
    # the 32 blocks a request the buffer gives back become resident pages
    pages = [int(footer(r.stdout).split(": ")[1].split()[0]) for r in (default, half)]
    assert pages[1] > pages[0], pages
    # with the sizing bypassed the flag still sets the replay's buffers
    fixed = run(*TINY, "--resident-pages", "17", "--hot-rows", "2560")
    assert fixed.returncode == 0 and footer(fixed.stdout).endswith(": 17 resident pages a request (sinks' and active "
                                                                   "tail's among them), 2560 hot rows"), fixed.stdout
    # the same resident pages, a smaller LRU buffer: once a few steps' top-k outgrow it, it misses more
    steps = ["--resident-pages", "17", "--warmup", "4", "--steps", "2"]
    small, large = run(*TINY, *steps, "--hot-rows", "2048"), run(*TINY, *steps)
    assert small.returncode == 0 and large.returncode == 0, small.stderr[-2000:] + large.stderr[-2000:]
    assert critical_misses(small.stdout) > critical_misses(large.stdout), (small.stdout, large.stdout)


def test_fewer_hot_rows_hold_a_larger_batch(run) -> None:
    """At 32K, 3 GiB, fp8 keys and rows, 64-token fill chunks: 107 requests with 4096 hot rows, 132
    with 2048 (bench_serving.py's sizing)."""
    geo = ["--geometries", "32768:132", "--fill-chunk", "64"]
    too_many = run(*TINY, *geo)
    assert too_many.returncode == 2 and "hisparse holds at most 107" in too_many.stderr, too_many.stderr
    held = run(*TINY, *geo, "--hot-rows", "2048")
    assert held.returncode == 0, held.stderr[-2000:]
    assert footer(held.stdout).startswith("# 32K batch 132: 8 resident pages a request"), held.stdout


@pytest.mark.parametrize("value", ["100", "1024", "-64", "40960"])
def test_a_bad_hot_rows_is_one_line(run, value: str) -> None:
    out = run(*TINY, "--hot-rows", value)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and f"--hot-rows={value}" in out.stderr, out.stderr


def test_a_bad_hot_rows_from_the_command_line() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--hot-rows", "100"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1 and "--hot-rows=100" in out.stderr, out.stderr


MIX = ["--geometries", "32768:2", "--regimes", "code", "--references", "0,1,2,20,21,22,40,60", "--layers", "8",
       "--resident-pages", "17", "--warmup", "1", "--steps", "1", "--kv-rows", "fp8", "--all-resident-ms", "32768:2=10"]


def test_subsets_are_the_rows_own_groups_averaged_over_a_bench_step(run) -> None:
    """`--subsets`: each line is the row's own per-group misses, averaged over the subset's layers and
    counted for a 4-layer step (656 B fp8 rows), through D3's fit; subsets only without the prefetch."""
    out = run(*MIX, "--plans", "off,auto", "--subsets", "all/0,20,40,60/20,21,22")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for plan, expect in (("off", ["every layer", "layers 0,20,40,60", "layers 20,21,22"]), ("auto", ["every layer"])):
        i = next(i for i, ln in enumerate(lines) if ln.startswith("| 32K |") and f"| {plan} |" in ln)
        cells = [c.strip() for c in lines[i].split("|")]
        crit = [float(x.replace(",", "")) for x in cells[11].split("/")]
        pre = [float(x.replace(",", "")) for x in cells[12].split("/")]
        ref = [0, 1, 2, 20, 21, 22, 40, 60]
        notes = [ln for ln in lines[i + 1:i + 4] if ln.startswith(f"#   {plan},")]
        assert [n.split(", ")[1].split(" as ")[0] for n in notes] == expect, notes
        for note, what in zip(notes, expect, strict=True):
            layers = ref if what == "every layer" else [int(x) for x in what.split()[1].split(",")]
            groups = [ref.index(x) for x in layers]
            c_mb = sum(crit[g] for g in groups) / len(groups) * 4 * 656 / 1e6
            p_mb = sum(pre[g] for g in groups) / len(groups) * 4 * 656 / 1e6
            excess = 18.8e-3 * c_mb + 11.2e-3 * p_mb
            assert f"critical {c_mb:.1f} MB, prefetched {p_mb:.1f} MB, pred. excess {excess:.2f} ms, " \
                   f"{(10 + excess) / 10:.3f}x all-resident" in note, (note, c_mb, p_mb)
    assert any(float(x.replace(",", "")) > 0 for x in lines[i].split("|")[12].split("/")), lines[i]  # auto prefetched


@pytest.mark.parametrize("value, says", [("0,20,41", "[41]"), ("20,20", "twice"), ("x", "'x' is not 'all'")])
def test_a_bad_subset_is_one_line(run, value: str, says: str) -> None:
    out = run(*MIX, "--plans", "off", "--subsets", value)
    assert out.returncode == 2 and out.stdout == "", out.stdout
    assert out.stderr.count("\n") == 1 and f"--subsets={value!r}" in out.stderr and says in out.stderr, out.stderr


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--top-k", "0", "expected an integer in [1, 65536], got 0"),
    ("--seed", "-1", "expected an integer in [0, 4294967295], got -1"),
    ("--gpu-kv-gib", "nan", "expected a number in (0, 65536], got nan"),
    ("--gpu-kv-gib", "inf", "expected a number in (0, 65536], got inf"),
    # unbounded ints: 10**30 steps ran until the memory ran out, --resident-pages -5 was taken as -1
    ("--steps", str(10**30), f"expected an integer in [1, 16777216], got {10**30}"),
    ("--warmup", "0", "expected an integer in [1, 16777216], got 0"),
    ("--layers", "0", "expected an integer in [1, 61], got 0"),
    ("--resident-pages", "-5", "expected an integer in [-1, 16777216], got -5"),
    ("--fill-chunk", "2.5", "expected an integer in [1, 16777216], got '2.5'"),
    ("--bench-layers", "0", "expected an integer in [1, 1024], got 0"),
])
def test_a_bad_number_is_one_line_naming_the_flag(bench, capsys: pytest.CaptureFixture[str], flag: str, value: str,
                                                  says: str) -> None:
    """`--top-k 0`, `--seed -1` and `--gpu-kv-gib inf` ended in a ValueError or OverflowError traceback;
    `--gpu-kv-gib nan` in 'cannot convert float NaN to integer', naming no flag."""
    with pytest.raises(SystemExit) as exit_:
        bench.main([*TINY, flag, value])
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"bench_prefetch_locality: error: argument {flag}: {says} (see bench_prefetch_locality " \
                                "--help)\n"


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--all-resident-ms", "32768:2=nan", "'32768:2=nan' is not CONTEXT:BATCH=MS with MS a positive number"),
    ("--all-resident-ms", "32768:2=0", "'32768:2=0' is not CONTEXT:BATCH=MS with MS a positive number"),
    ("--geometries", "\u00b2:43", "'\u00b2:43' is not CONTEXT:BATCH with a context in [1, 16777216]"),
    ("--geometries", f"{10**22}:1", f"'{10**22}:1' is not CONTEXT:BATCH with a context in [1, 16777216]"),
])
def test_a_bad_list_item_is_one_line(run, flag: str, value: str, says: str) -> None:
    """`--all-resident-ms 32768:2=nan` ran and printed `nanx` in the ratio column; `--geometries '\u00b2:43'`
    (a digit to isdigit(), not to int()) said `invalid literal for int()`, naming no flag, and a
    context of 10**22 tokens ran until the memory ran out."""
    out = run(*TINY, flag, value)
    assert out.returncode == 2 and out.stdout == "", out.stdout
    assert out.stderr.count("\n") == 1 and f"{flag}={value!r}: {says}" in out.stderr, out.stderr
