"""Tensor-parallel sharing of one host pool (issue 20): `bench/bench_tp_shared.py` and its helpers.

GPU: the harness's parts in a short run, both ranks on GPU 0 (any GPU machine), and one GPU per
rank (two GPUs). CPU: the device mapping, the memory accounting and its verdict, the main run's
plan, the workload's schedule; and the same two-process drifting workload, memory check and
faults on reference_cpu shared pools (the harness with `--backend reference_cpu`).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nvidia_support import requires_gpu

from hisparse_core import shm

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
sys.path.insert(0, str(BENCH))

import tp_shared_support as sup  # noqa: E402


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


def run_harness(tmp_path: Path, *args: str, timeout: int = 600) -> dict:
    out = tmp_path / "tp_shared.json"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_tp_shared.py"), "--json", str(out), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)
    print(proc.stdout[-6000:])
    print(proc.stderr[-4000:], file=sys.stderr)
    assert proc.returncode == 0, f"bench_tp_shared.py exited {proc.returncode}:\n{proc.stdout[-3000:]}"
    assert "\nPASS:" in proc.stdout
    result = json.loads(out.read_text())
    assert result["passed"] and not result["failures"]
    return result


# ----------------------------------------------------------------------------- GPU


@requires_gpu
@pytest.mark.gpu
def test_harness_with_both_ranks_on_gpu_0(tmp_path: Path) -> None:
    result = run_harness(tmp_path, "--quick", "--devices", "0,0")
    assert result["mapping"]["devices"] == [0, 0]
    assert set(result["verdicts"]) >= {"a", "b", "c", "d", "contexts"}
    assert {f["fault"] for f in result["faults"]} == {"peer-mid-step", "writer-before-publish", "writer-in-flight"}


@requires_gpu
@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 2, reason=f"needs two CUDA GPUs (one per rank); this machine has {gpu_count()}")
def test_harness_with_one_gpu_per_rank(tmp_path: Path) -> None:
    result = run_harness(tmp_path, "--quick", "--devices", "0,1")
    assert result["mapping"]["devices"] == [0, 1]
    ends = result["main"]["ranks"]["end"]
    assert [e["active_contexts"] for e in ends] == [[0], [1]]  # no rank touched the other's GPU


# ----------------------------------------------------------------------------- CPU: reference_cpu


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(shm.SHM_DIR), reason="shared pools live in /dev/shm")
def test_two_process_workload_on_reference_cpu_shared_pools(tmp_path: Path) -> None:
    result = run_harness(tmp_path, "--backend", "reference_cpu", "--quick", "--steps", "4", "--parts", "a,c,e")
    a = result["main"]["ranks"]["a:done"]
    assert a[0]["digests"] == a[1]["digests"] and len(a[0]["digests"]) == 4
    assert a[1]["misses"] > 0 and a[0]["released_pages"] > 0  # rank 1 read rank 0's rows from the pool
    assert result["verdicts"] == {"a": True, "c": True}
    faults = {f["fault"]: f for f in result["faults"]}
    assert set(faults) == {"peer-mid-step", "writer-before-publish"}
    assert "died mid-step 3" in faults["peer-mid-step"]["survivor_line"]
    assert "died before publishing" in faults["writer-before-publish"]["survivor_line"]
    assert all(not f["leftovers"] for f in faults.values())


def test_bad_arguments_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    import bench_tp_shared

    for args, want in ((["--parts", "a,x"], "--parts 'a,x': expected a comma-separated subset of a,b,c,d,e"),
                       (["--faults", "nope"], "--faults 'nope': expected a comma-separated subset of peer-mid-step"),
                       (["--steps", "0"], "--steps 0: expected 1.."),
                       (["--context", "1024"], "--context 1024: context 1024 is too short"),
                       (["--devices", "0,x"], "--devices '0,x': expected comma-separated CUDA device indices"),
                       (["--backend", "reference_cpu", "--devices", "0,0"], "--devices applies to --backend nvidia")):
        with pytest.raises(SystemExit) as exc:
            bench_tp_shared.parse_args(args)
        assert exc.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("bench_tp_shared: error: ") and want in lines[0], lines


@pytest.mark.parametrize(("args", "want"), [
    (["--delay", "nan"], "--delay nan: expected a finite number, at least 0.05"),
    (["--time-limit", "nan"], "--time-limit nan: expected a finite number, at least 10.0"),
    (["--peer-timeout", "nan"], "--peer-timeout nan: expected a finite number, at least 1.0"),
    (["--cost-tolerance", "nan"], "--cost-tolerance nan: expected a finite number, at least 0.0"),
    (["--min-seconds", "inf"], "--min-seconds inf: expected a finite number, at least 0.0"),
    (["--delay", "1e400"], "--delay inf: expected a finite number, at least 0.05"),
    (["--seed", str(10**30)], f"--seed {10**30}: expected an integer in [0, 4294967295]"),
    (["--seed", "-1"], "--seed -1: expected an integer in [0, 4294967295]"),
    (["--steps", "x"], "argument --steps: invalid int value: 'x'"),  # after the stock parser's usage lines
])
def test_nan_inf_and_a_seed_torch_cannot_take_are_one_line(args: list[str], want: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`nan < lo` is false, so NaN passed the range check (a --time-limit of nan never ran out), and
    `--seed 10**30` overflowed torch's manual_seed in both ranks after the shared pool was made (a
    traceback each, and the pool left in /dev/shm)."""
    import bench_tp_shared

    with pytest.raises(SystemExit) as exc:
        bench_tp_shared.parse_args(["--backend", "reference_cpu", *args])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"bench_tp_shared: error: {want}"), lines


# ----------------------------------------------------------------------------- CPU: helpers


@given(st.integers(1, 16), st.integers(1, 8))
def test_rank_r_runs_on_gpu_r_mod_count(count: int, world: int) -> None:
    m = sup.choose_mapping(world, count)
    assert m.devices == tuple(r % count for r in range(world))
    assert m.one_gpu_per_rank == (count >= world)
    assert str(count) in m.reason


def test_mapping_reasons_and_refusals() -> None:
    one = sup.choose_mapping(2, 1)
    assert one.devices == (0, 0) and "share GPU 0" in one.reason and "needs two CUDA GPUs" in one.reason
    assert "rank 0 -> cuda:0, rank 1 -> cuda:0" in one.describe()
    two = sup.choose_mapping(2, 2)
    assert two.devices == (0, 1) and "one GPU per rank" in two.reason
    forced = sup.choose_mapping(2, 2, (0, 0))
    assert forced.devices == (0, 0) and "forced by --devices" in forced.reason and not forced.one_gpu_per_rank
    with pytest.raises(ValueError, match=r"no CUDA device is visible"):
        sup.choose_mapping(2, 0)
    with pytest.raises(ValueError, match=r"--devices names 3 device\(s\); expected 2"):
        sup.choose_mapping(2, 4, (0, 1, 2))
    with pytest.raises(ValueError, match=r"CUDA device 2 does not exist; 2 visible \(0..1\)"):
        sup.choose_mapping(2, 2, (0, 2))
    assert sup.parse_devices("0,1") == (0, 1)
    for bad in ("", "a", "0,,1", "-1,0"):
        with pytest.raises(ValueError, match=r"--devices"):
            sup.parse_devices(bad)


SMAPS = """\
7f0000000000-7f0000400000 rw-s 00000000 00:1a 4242                       /dev/shm/#4242 (deleted)
Size:               4096 kB
Rss:                4096 kB
Pss:                2048 kB
Shared_Clean:          0 kB
Shared_Dirty:       4096 kB
Private_Clean:         0 kB
Private_Dirty:         0 kB
VmFlags: rd wr sh mr mw me ms sd
7f0000400000-7f0000500000 rw-s 00400000 00:1a 4242                       /dev/shm/#4242 (deleted)
Size:               1024 kB
Rss:                 512 kB
Pss:                 512 kB
Shared_Clean:          0 kB
Shared_Dirty:          0 kB
Private_Clean:         0 kB
Private_Dirty:       512 kB
7f0000600000-7f0000700000 rw-p 00000000 00:00 0
Size:               1024 kB
Rss:                 100 kB
Pss:                 100 kB
"""


def test_smaps_sums_every_mapping_of_the_file() -> None:
    m = sup.mapping_memory(0x7f0000450000, SMAPS)  # in the second VMA of inode 4242
    assert (m.size, m.rss, m.pss, m.shared, m.private, m.vmas) == (5 << 20, 4608 << 10, 2560 << 10, 4 << 20,
                                                                   512 << 10, 2)
    anon = sup.mapping_memory(0x7f0000600000, SMAPS)  # anonymous: that VMA alone
    assert (anon.rss, anon.vmas) == (100 << 10, 1)
    with pytest.raises(ValueError, match="no mapping of this process contains address 0x1000"):
        sup.mapping_memory(0x1000, SMAPS)


def test_process_memory_reads_status_and_rollup() -> None:
    status = "Name:\tpython\nVmRSS:\t  2048 kB\nRssAnon:\t  1024 kB\nRssShmem:\t   512 kB\nThreads:\t4\n"
    rollup = "00400000-7fff0000 ---p 00000000 00:00 0  [rollup]\nRss:  2048 kB\nPss:  1500 kB\nPss_Shmem:  256 kB\n"
    got = sup.process_memory(status, rollup)
    assert got == {"VmRSS": 2 << 20, "RssAnon": 1 << 20, "RssShmem": 512 << 10, "Pss": 1500 << 10,
                   "Pss_Shmem": 256 << 10}
    assert sup.meminfo_shmem("MemTotal: 100 kB\nShmem:  12 kB\n") == 12 << 10
    assert set(sup.process_memory()) >= {"VmRSS"}  # this process, from /proc


@pytest.mark.skipif(not os.path.isdir(shm.SHM_DIR), reason="needs /dev/shm")
def test_a_file_mapped_by_two_processes_is_counted_once() -> None:
    """The accounting on a real /dev/shm file mapped by this process and a forked child: each has
    it all resident, each Pss is half, /dev/shm holds it once."""
    size = 8 << 20
    before = sup.shm_used_bytes()
    fd = os.open(shm.SHM_DIR, os.O_TMPFILE | os.O_RDWR, 0o600)
    r, w = os.pipe()
    go_r, go_w = os.pipe()
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        mm[:] = random.Random(7).randbytes(size)
        buf = ctypes.c_char.from_buffer(mm)
        addr = ctypes.addressof(buf)
        del buf
        alone = sup.mapping_memory(addr)
        assert alone.rss == size and alone.pss == size
        pid = os.fork()
        if pid == 0:  # the child: touch every page, report, wait until the parent has measured
            sum(mm[i] for i in range(0, size, 4096))
            os.write(w, json.dumps(sup.mapping_memory(addr).as_dict()).encode())
            os.read(go_r, 1)
            os._exit(0)
        child = sup.MappingMemory(**json.loads(os.read(r, 4096)))
        ours = sup.mapping_memory(addr)
        used = sup.shm_used_bytes()
        os.write(go_w, b"x")
        os.waitpid(pid, 0)
        delta = None if before is None or used is None else used - before
        assert ours.pss == size // 2 and child.pss == size // 2 and child.rss == size, (ours, child)
        verdict = sup.judge_memory(size, [ours, child], delta)
        assert verdict.passed, verdict.checks
        # A private copy per rank would fail the /dev/shm and the Pss checks.
        twice = sup.judge_memory(size, [sup.MappingMemory(size, size, size, 0, size, 1)] * 2, 2 * size)
        assert not twice.passed and [ok for _, ok, _ in twice.checks] == [False, True, True, False]
        mm.close()
    finally:
        for f in (fd, r, w, go_r, go_w):
            os.close(f)


def test_memory_verdict_names_each_figure() -> None:
    mib = 1 << 20
    full = sup.MappingMemory(100 * mib, 100 * mib, 50 * mib, 100 * mib, 0, 1)
    ok = sup.judge_memory(100 * mib, [full, full], 100 * mib)
    assert ok.passed and len(ok.checks) == 4
    half = sup.MappingMemory(100 * mib, 50 * mib, 25 * mib, 50 * mib, 0, 1)
    bad = sup.judge_memory(100 * mib, [full, half], None)
    assert not bad.passed
    assert [c[0] for c in bad.checks if not c[1]] == ["/dev/shm grew by one pool", "rank 1 maps the whole pool",
                                                       "the ranks' Pss add up to one pool"]
    assert "Rss 50.0 MiB of 100.0 MiB" in bad.checks[2][2]


@pytest.mark.parametrize("gpu", [True, False])
def test_the_main_plan_is_one_ordered_walk(gpu: bool) -> None:
    plan = sup.main_plan(["a", "b", "c", "d"], gpu)
    assert plan[0] == "setup" and plan[-1] == "end" and len(plan) == len(set(plan))
    for i, tag in enumerate(plan):
        if ":" in tag:  # "X:done", "X:released": after X
            assert plan.index(tag.split(":")[0]) < i
    assert plan.index("a:released") > plan.index("a:done")
    has = {t for t in plan if t.startswith(("b", "d_"))}
    assert bool(has) == gpu  # b and d need a GPU
    if gpu:
        assert plan.index("d_private1:done") < plan.index("c_before") < plan.index("c_mapped") < \
            plan.index("c_measure") < plan.index("d_1_alone0")  # private pools are gone when memory is measured
    assert sup.main_plan(["c"], gpu) == ["setup", "c_before", "c_mapped", "c_measure", "end"]


def test_reports_helpers() -> None:
    assert sup.exit_description(-9) == "killed by SIGKILL"
    assert sup.exit_description(3) == "exit status 3" and sup.exit_description(None) == "still running"
    table = sup.format_table("t", ["a", "bb"], [[1, "x"], [22, "yyy"]]).splitlines()
    assert table == ["t", "a   bb", "--  ---", "1   x", "22  yyy"]


def test_leftover_files_name_only_that_pool(tmp_path: Path) -> None:
    (tmp_path / "hisparse_tpx1a.nvpool").write_bytes(b"")
    (tmp_path / "hisparse_tpx1ab.pool").write_bytes(b"")
    (tmp_path / "hisparse_other.pool").write_bytes(b"")
    assert sup.leftover_files(["tpx1a"], str(tmp_path)) == [str(tmp_path / "hisparse_tpx1a.nvpool")]


def test_a_run_s_leftovers_are_removed_after_they_are_recorded(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A rank that died in setup left its pool in /dev/shm after the bench exited (the verdict named it,
    nothing removed it); the bench unlinks what it recorded, a line each, and only that."""
    (tmp_path / "hisparse_tpx1a.nvpool").write_bytes(b"x")
    (tmp_path / "hisparse_other.pool").write_bytes(b"")
    found = sup.leftover_files(["tpx1a"], str(tmp_path))
    sup.remove_leftovers(found + [str(tmp_path / "hisparse_gone.pool")])   # one already gone: no error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hisparse_other.pool"]
    assert capsys.readouterr().err == f"bench_tp_shared: removed {found[0]}, which the run left behind\n"


def test_the_schedule_is_the_same_in_every_process_and_valid() -> None:
    """Two schedules of one seed give identical plans; the reference, validating every resolve,
    runs them, with releases under the reads and misses served from the host pool."""
    import torch
    from tp_shared_workload import Executor, Schedule, WorkloadShape, compare

    from hisparse_reference_cpu.backend import ReferenceCpuBackend

    shape = WorkloadShape()
    a, b = Schedule(shape, 3), Schedule(shape, 3)
    be = ReferenceCpuBackend(completion_lag=1)
    oracle = ReferenceCpuBackend(completion_lag=0)
    subject = Executor(be, be.create_host_pool(shape.pool_spec()), shape, 3, graph=False, validate=True)
    ref = Executor(oracle, oracle.create_host_pool(shape.pool_spec()), shape, 3, graph=False)
    released = 0
    for step in range(5):
        pa, pb = (a.prefill(), b.prefill()) if step == 0 else (a.next_step(), b.next_step())
        assert pa.mirrors == pb.mirrors and pa.spills == pb.spills and pa.releases == pb.releases
        assert torch.equal(pa.topk, pb.topk) and torch.equal(a.resident, b.resident)
        subject.run(pa, a)
        ref.run(pa, a)
        compare(subject, ref, pa, writer=True, host_lengths=list(a.lengths))
        released += len(pa.releases)
    subject.finish()
    assert released > 0 and subject.rt.stats().misses > 0
    assert sorted(subject.completed) == list(range(1, a.spills_submitted + 1))


@pytest.mark.parametrize("context", [8192, 32768])
def test_the_swap_in_scenarios_miss_exactly_as_intended(context: int) -> None:
    """The cost part's inputs, run through the reference: in the steady state (from the third
    cycle of the graph's steps, as the harness times it) each row-step misses exactly the
    intended rows (274 at batch 1 and 32, all 2048 at batch 128). One request stands for each batch."""
    import torch
    from tp_shared_cost import BS, CostShape, H, scenario_inputs

    from hisparse_core.host_pool import HostPoolSpec
    from hisparse_reference_cpu.backend import ReferenceCpuBackend

    shape = CostShape(context=context)
    shape.check()
    be = ReferenceCpuBackend(completion_lag=0)
    for batch in (1, 128) if context == 8192 else (1,):
        shift, steps = shape.plan(batch)
        pool = be.create_host_pool(HostPoolSpec(num_layers=1, num_blocks=shape.pages, block_size=BS))
        rt = be.create_runtime(shape.runtime_config(batch, requests=1))
        rt.bind([pool.layer_view(0)], [torch.zeros((H // BS, BS, 656), dtype=torch.uint8)])
        inputs = scenario_inputs(shape, batch, 20, torch.device("cpu"), requests=1)
        for _ in range(3):
            rt.reset_stats()
            for inp in inputs:
                rt.resolve(inp, gather=False, validate=False)
        assert rt.stats().misses == shift * steps, (batch, rt.stats(), shift, steps)
