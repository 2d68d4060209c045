"""`bench/compare_runs.py A.json B.json` (docs/cli.md): two `hisparse run --json` documents of one
workload; a pair of different workloads, or a file that is no such document, is one line, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "compare_runs.py"

EXACT = ("steps", "decode_rows", "hits", "misses", "hit_rate", "resident_entries", "rows_h2d", "bytes_h2d",
         "bytes_d2h", "prefix_hit_tokens", "prefill_tokens_computed", "requests_admitted", "requests_finished",
         "max_concurrency_hisparse_measured", "host_pool_peak_blocks", "attention_entries_checked")


def _doc(name: str = "reference_cpu", *, hits: int = 10, **config: object) -> dict[str, object]:
    summary: dict[str, object] = dict.fromkeys(EXACT, 1) | {"hits": hits, "pages": {"spilled": 2}}
    summary |= {"steps_per_s": 1.0, "step_ms_mean": 1.0, "decode_device_ms": 1.0, "decode_mode": "eager",
                "graph_sizes": [], "wall_s": 1.0, "phase_ms": {"worker": 1.0}}
    return {"backend": {"name": name, "device": "cpu"},
            "config": {"requests": 3, "context": 300, "seed": 0, "decode_mode": "eager", "graph_sizes": [],
                       "cuda_graphs": True} | config,
            "summary": summary}


def _compare(tmp_path: Path, a: object, b: object) -> subprocess.CompletedProcess[str]:
    paths = []
    for i, doc in enumerate((a, b)):
        path = tmp_path / f"{i}.json"
        path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
        paths.append(str(path))
    return subprocess.run([sys.executable, str(SCRIPT), *paths], capture_output=True, text=True, timeout=60,
                          check=False)


def test_one_workload_on_two_backends_is_compared(tmp_path: Path) -> None:
    proc = _compare(tmp_path, _doc("nvidia", decode_mode="graph", graph_sizes=[3]), _doc())
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.splitlines()[-1] == "compare_runs: every contract figure of nvidia equals reference_cpu's"
    proc = _compare(tmp_path, _doc("nvidia", hits=11), _doc())
    assert proc.returncode == 1 and proc.stdout.splitlines()[-1] == (
        "compare_runs: nvidia and reference_cpu differ in hits")


def test_two_workloads_are_not_a_contract_failure(tmp_path: Path) -> None:
    """Runs of two seeds (same --requests) were compared figure by figure and reported as
    'reference_cpu and reference_cpu differ in hits, misses, ...', exit 1: a contract failure."""
    proc = _compare(tmp_path, _doc(seed=5, hits=11), _doc())
    assert proc.returncode == 2
    assert proc.stdout.splitlines() == [
        f"compare_runs: the two runs replay different workloads: {tmp_path / '0.json'} vs {tmp_path / '1.json'} "
        "differ in seed (5 vs 0)"]


@pytest.mark.parametrize(("content", "why"), [
    ("", "not JSON (Expecting value: line 1 column 1 (char 0)); expected the output of hisparse run --json"),
    (json.dumps({"check": "fail", "passed": False, "error": "x"}), "the run failed its check, so it has no figures"),
    ("[1, 2]", "not a hisparse run --json document (no backend, config and summary)"),
])
def test_a_file_that_is_no_run_document_is_one_line(content: str, why: str, tmp_path: Path) -> None:
    """An empty file (the output of a refused run), a failed run's document or other JSON ended in
    a JSONDecodeError or KeyError traceback."""
    proc = _compare(tmp_path, content, _doc())
    assert proc.returncode == 2 and proc.stderr == ""
    assert proc.stdout.splitlines() == [f"compare_runs: {tmp_path / '0.json'}: {why}"]


def test_a_bench_document_is_no_run_document(tmp_path: Path) -> None:
    """`hisparse bench --json` has a backend, a config and a summary too: two of them passed the
    check and ended in a KeyError traceback ('steps'), and one beside a run's was called another
    workload, naming some thirty config entries."""
    bench = {"backend": {"name": "reference_cpu", "device": "cpu"}, "config": {"requests": 4, "steps": 3},
             "summary": {"all": {"hits": 1}, "steady": {"hits": 1}, "step_ms_mean": 1.0, "wall_s": 1.0}}
    for pair in ((bench, bench), (_doc(), bench)):
        proc = _compare(tmp_path, *pair)
        assert proc.returncode == 2 and proc.stderr == "", proc.stderr
        which = "0" if pair[0] is bench else "1"
        assert proc.stdout.splitlines()[0] == (
            f"compare_runs: {tmp_path / (which + '.json')}: a hisparse bench --json document, not a run's; expected "
            "the output of hisparse run --json")


@pytest.mark.parametrize("doc", [
    {"backend": "cpu", "config": {}, "summary": {}},
    {"backend": {"name": "x"}, "config": [], "summary": {}},
    {"backend": {"name": "x"}, "config": {}, "summary": {"steps": 1}},
    # a KeyError and a TypeError traceback after the checks
    {**_doc(), "backend": {"name": "reference_cpu"}},
    {**_doc(), "summary": {**_doc()["summary"], "phase_ms": 5}},  # type: ignore[dict-item]
])
def test_a_document_without_a_run_summary_is_one_line(doc: dict[str, object], tmp_path: Path) -> None:
    """The three keys present but not a run's backend, config and summary: a TypeError, AttributeError or
    KeyError traceback."""
    proc = _compare(tmp_path, doc, _doc())
    assert proc.returncode == 2 and proc.stderr == "", proc.stderr
    assert proc.stdout.splitlines() == [f"compare_runs: {tmp_path / '0.json'}: not a hisparse run --json document "
                                        "(no backend, config and summary)"]


def test_two_runs_that_checked_nothing_are_no_pass(tmp_path: Path) -> None:
    """Two runs that decoded nothing (`--decode-tokens 1 --steps 1`: each says NOTHING CHECKED) were
    'every contract figure of nvidia equals reference_cpu's', exit 0: a pass of nothing compared."""
    nothing = {"attention_entries_checked": 0, "decode_rows": 0}
    a, b = _doc("nvidia"), _doc()
    for doc in (a, b):
        doc["summary"] |= nothing  # type: ignore[operator]
    proc = _compare(tmp_path, a, b)
    assert proc.returncode == 2 and proc.stderr == "", proc.stderr
    assert proc.stdout.splitlines()[-1] == (
        "compare_runs: nothing compared: neither run read the KV (0 attention entries checked); expected runs that "
        "decode (--decode-tokens 2 or more, and --steps to reach them)")


def test_a_missing_file_is_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "none.json"), str(tmp_path / "other.json")],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and proc.stderr == ""
    assert proc.stdout.splitlines() == [f"compare_runs: {tmp_path / name}.json: cannot read it (No such file or "
                                        "directory)" for name in ("none", "other")]


@pytest.mark.parametrize("content", [None, "{", "[]"])
def test_one_bad_file_named_twice_is_one_line(content: str | None, tmp_path: Path) -> None:
    """`compare_runs.py x.json x.json` (or `x.json ./x.json`) with x.json missing or no run's document
    printed the same line twice: one file has one problem."""
    path = tmp_path / "x.json"
    if content is not None:
        path.write_text(content)
    proc = subprocess.run([sys.executable, str(SCRIPT), str(path), "./x.json"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 2 and proc.stderr == "", proc.stderr
    assert len(proc.stdout.splitlines()) == 1 and proc.stdout.startswith(f"compare_runs: {path}: "), proc.stdout


def test_a_run_compared_with_itself_is_no_pass(tmp_path: Path) -> None:
    """`compare_runs.py run.json run.json` (a typo for the baseline) was 'every contract figure of
    reference_cpu equals reference_cpu's', exit 0: a file equals itself, so nothing was compared."""
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_doc()))
    proc = subprocess.run([sys.executable, str(SCRIPT), str(path), "./run.json"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 2 and proc.stderr == "", proc.stderr
    assert proc.stdout.splitlines() == [f"compare_runs: {path} and ./run.json are the same file; expected two runs "
                                        "of one workload"]


@pytest.mark.parametrize("name", ["", " "])
def test_an_empty_expected_backend_is_refused(name: str, tmp_path: Path) -> None:
    """`--expect-backend "$BACKEND"` with the variable unset checked no backend and passed."""
    paths = []
    for i, doc in enumerate((_doc("nvidia"), _doc())):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(doc))
    proc = subprocess.run([sys.executable, str(SCRIPT), *map(str, paths), "--expect-backend", name],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and proc.stderr == "", proc.stderr
    assert proc.stdout.splitlines() == [f"compare_runs: --expect-backend {name!r}: expected a backend name, such as "
                                        "nvidia"]


def test_runs_that_time_other_phases_are_compared(tmp_path: Path) -> None:
    """A run of another hisparse release timing other phases (`check` added, say) was a KeyError
    traceback: each run's phases are shown, '-' where it has none."""
    a, b = _doc("nvidia"), _doc()
    b["summary"]["phase_ms"] = {"worker": 1.0, "check": 2.5}  # type: ignore[index]
    proc = _compare(tmp_path, a, b)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    rows = [ln.split() for ln in proc.stdout.splitlines() if ln.startswith("ms/step")]
    assert rows == [["ms/step", "worker", "1.00", "1.00"], ["ms/step", "check", "-", "2.50"]], proc.stdout


def test_a_python_without_hisparse_compares_too(tmp_path: Path) -> None:
    """`python3 bench/compare_runs.py A B` outside the venv was a ModuleNotFoundError traceback
    (hisparse_core, for the Ctrl-C handling only): the comparison itself needs only json."""
    paths = []
    for i, doc in enumerate((_doc("nvidia"), _doc())):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(doc))
    # -S: no site-packages, so neither hisparse nor its editable install's path
    proc = subprocess.run([sys.executable, "-S", str(SCRIPT), *map(str, paths)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.splitlines()[-1] == "compare_runs: every contract figure of nvidia equals reference_cpu's"
