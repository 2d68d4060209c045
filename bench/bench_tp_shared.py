#!/usr/bin/env python3
"""Tensor-parallel sharing of one host pool by two ranks, each on its own GPU (issue 20).

Two rank processes (torch.multiprocessing, spawn) share one /dev/shm host pool: rank 0 creates,
registers and writes it, rank 1 maps it, registers its own mapping for its own GPU and reads it
after rank 0's writes, ordered on rank 0's CUDA IPC event. Rank r runs on GPU
`r % torch.cuda.device_count()` (or `--devices`), so the same command runs on one GPU (both ranks
on GPU 0) and on two; the mapping and why are printed first.

- a. Two ranks, one pool: a drifting decode workload (4 requests, top-k 256, 2 layers, pages
  spilled and released under the reads, the engine reusing released blocks). Rank 0 mirrors and
  spills, rank 1 resolves and gathers the same rows from its own mapping after waiting on rank
  0's IPC event; resolves and follower replays are CUDA graph replays on both ranks. Every step
  each rank is compared with `reference_cpu` run on the same plan in the same process (outputs,
  every gathered byte, device caches, hot maps, LRU orders, counters, host rows), and the two
  ranks' gathered bytes with each other.
- b. Delayed write: rank 0's copy held back on its GPU (torch.cuda._sleep); rank 1's host rows
  are still the old ones when its read is enqueued, and what it reads are the new ones.
- c. Memory: per-rank RSS, the Rss and Pss of each rank's mapping (/proc/self/smaps) and the
  growth of /dev/shm while both ranks hold one pool: physical host memory is one pool, not two.
- d. Cost: each rank's swap-in time (bench_nvidia.py's method) at batch 1, 32 and 128 on the
  shared pool, alone and with both ranks at once, beside a private pool on the same GPU in the
  same run (one process, one GPU), and with the reads' ordering (the IPC-event wait) in front.
- e. Faults, one fresh pair of ranks each: rank 1 killed mid-step, rank 0 killed mid-step before
  publishing its writes, and with its writes published but held back on the GPU. The survivor
  reports the peer's death in one line, and nothing of the pool remains in /dev/shm.

With `--backend reference_cpu` (no GPU) parts a, c and e run on reference_cpu shared pools; the
peer then orders its reads on a step counter that rank 0 bumps after submitting its writes (the
CPU backend copies at submission), and parts b and d are skipped with the reason.

    python bench/bench_tp_shared.py [--quick] [--json FILE] [--parts a,b,c,d,e] [--devices 0,1]

Exit status: 0 when every check passed, 1 when one failed, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
import traceback
from dataclasses import asdict
from multiprocessing.connection import wait
from typing import Any

import torch
from tp_shared_cost import CostShape
from tp_shared_ranks import Fault, RankJob, rank_main
from tp_shared_support import (
    SWAP_IN_BATCHES,
    DeviceMapping,
    MappingMemory,
    choose_mapping,
    exit_description,
    format_table,
    judge_memory,
    leftover_files,
    main_plan,
    meminfo_shmem,
    parse_devices,
    remove_leftovers,
    shm_size_bytes,
    shm_used_bytes,
)

from hisparse_core.cli.options import MAX_SEED, CliParser
from hisparse_core.errors import HiSparseError

PARTS = ("a", "b", "c", "d", "e")
FAULTS = {
    "peer-mid-step": Fault(victim=1, kind="mid-step"),
    "writer-before-publish": Fault(victim=0, kind="before-publish"),
    "writer-in-flight": Fault(victim=0, kind="in-flight"),
}
#: NVLink multicast stays off on the multi-GPU machines (the device notes): for every child too.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
MIB = float(1 << 20)


class RunFailed(Exception):
    """A rank of a run failed, died or stopped answering (the message says which and how)."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class Ranks:
    """The two rank processes of one run and their pipes."""

    def __init__(self, jobs: list[RankJob], published: Any) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        self.procs, self.conns = [], []
        for job in jobs:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=rank_main, args=(job, child, published), name=f"tp-rank{job.rank}",
                               daemon=True)
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        self.published = published  # held until the children have rebuilt it
        self.tracebacks: dict[int, str] = {}

    def _lost(self, rank: int) -> RunFailed:
        proc = self.procs[rank]
        proc.join(2)
        return RunFailed(f"rank {rank} (pid {proc.pid}) ended without a report: {exit_description(proc.exitcode)}",
                         rank)

    def next_message(self, ranks: list[int], deadline: float) -> tuple:
        """The next message of any of `ranks` (a dead rank with nothing left to read raises)."""
        while True:
            for r in ranks:
                if self.conns[r].poll():
                    try:
                        return self.conns[r].recv()
                    except EOFError:
                        raise self._lost(r) from None
            for r in ranks:
                if not self.procs[r].is_alive() and not self.conns[r].poll():
                    raise self._lost(r)
            left = deadline - time.monotonic()
            if left <= 0:
                raise RunFailed(f"ranks {ranks} sent nothing before the run's time limit")
            wait([self.conns[r] for r in ranks] + [self.procs[r].sentinel for r in ranks], timeout=min(0.5, left))

    def barrier(self, tag: str, deadline: float) -> list[Any]:
        payloads: dict[int, Any] = {}
        while len(payloads) < len(self.procs):
            msg = self.next_message([r for r in range(len(self.procs)) if r not in payloads], deadline)
            kind, rank = msg[0], msg[1]
            if kind == "error":
                self.tracebacks[rank] = msg[3]
                raise RunFailed(f"rank {rank} failed before {tag!r}: {msg[2]}")
            if kind != "at" or msg[2] != tag:
                raise RunFailed(f"rank {rank} sent {msg[:3]!r} where {tag!r} was expected")
            payloads[rank] = msg[3]
        return [payloads[r] for r in range(len(self.procs))]

    def go(self, tag: str, payloads: list[Any] | None = None) -> None:
        for r, conn in enumerate(self.conns):
            conn.send(("go", tag, None if payloads is None else payloads[r]))

    def kill(self, rank: int) -> None:
        pid = self.procs[rank].pid
        if pid is not None and self.procs[rank].is_alive():
            os.kill(pid, signal.SIGKILL)

    def close(self, timeout: float = 30.0) -> list[int | None]:
        """Wait for every rank to end (killing those still there after `timeout`); exit codes."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
        for r, p in enumerate(self.procs):
            if p.is_alive():
                self.kill(r)
                p.join(5)
        for c in self.conns:
            c.close()
        return [p.exitcode for p in self.procs]


# ----------------------------------------------------------------------------- the runs


def pool_name(tag: str) -> str:
    return f"tp{os.getpid()}x{time.time_ns() % 10**7}{tag}"


def make_jobs(args: argparse.Namespace, mapping: DeviceMapping, pools: dict[str, str], *,
              fault: Fault | None = None) -> list[RankJob]:
    cost = CostShape(context=args.context, replays=args.replays, min_seconds=args.min_seconds)
    return [RankJob(rank=r, backend=args.backend, device=mapping.devices[r] if mapping.devices else None, pools=pools,
                    parts=tuple(args.parts), steps=args.steps if fault is None else 0, seed=args.seed, cost=cost,
                    fault=fault, delay_s=args.delay, timeout_s=args.peer_timeout) for r in range(2)]


def published_counter(backend: str) -> Any:
    """The step counter of the CPU backend's read ordering (None on the GPU)."""
    if backend == "nvidia":
        return None
    # One aligned 64-bit word written by rank 0 only: no lock needed.
    return torch.multiprocessing.get_context("spawn").Value("q", -1, lock=False)


def main_run(args: argparse.Namespace, mapping: DeviceMapping) -> dict:
    """Parts a-d in one pair of rank processes, following `main_plan`."""
    pools = {p: pool_name(p) for p in ("a", "b", "c")}
    gpu = args.backend == "nvidia"
    plan = main_plan(args.parts, gpu)
    out: dict[str, Any] = {"pools": pools, "plan": plan, "ranks": {}, "error": None}
    ranks = Ranks(make_jobs(args, mapping, pools), published_counter(args.backend))
    deadline = time.monotonic() + args.time_limit
    try:
        for tag in plan:
            payloads = ranks.barrier(tag, deadline)
            out["ranks"][tag] = payloads
            go: list[Any] | None = None
            if tag == "setup":
                go = [{"peer": payloads[1]["creator"]}, {"peer": payloads[0]["creator"]}]
            elif tag == "c_before":
                out["shm_before"], out["shmem_before"] = shm_used_bytes(), meminfo_shmem()
            elif tag == "c_mapped":  # both ranks hold the whole pool
                out["shm_during"], out["shmem_during"] = shm_used_bytes(), meminfo_shmem()
            elif tag.startswith("d_") and not tag.endswith(":done") and not tag.startswith("d_private"):
                start = time.monotonic() + 0.3
                go = [start, start]
            ranks.go(tag, go)
            if args.verbose:
                print(f"  [{time.strftime('%H:%M:%S')}] {tag}", file=sys.stderr, flush=True)
        for r in range(2):
            msg = ranks.next_message([r], deadline)
            if msg[0] != "exit":
                raise RunFailed(f"rank {r} sent {msg[:3]!r} after the last tag")
    except RunFailed as exc:
        out["error"] = str(exc)
        out["tracebacks"] = ranks.tracebacks
        for r in range(2):
            ranks.kill(r)
    out["exit_codes"] = ranks.close()
    out["leftovers"] = leftover_files(list(pools.values()))
    remove_leftovers(out["leftovers"])
    return out


def fault_run(args: argparse.Namespace, mapping: DeviceMapping, key: str, fault: Fault) -> dict:
    """One fault of part e in a fresh pair of ranks."""
    name = pool_name("e")
    shm_before = shm_used_bytes()
    ranks = Ranks(make_jobs(args, mapping, {"e": name}, fault=fault), published_counter(args.backend))
    survivor = 1 - fault.victim
    out: dict[str, Any] = {"fault": key, "victim": fault.victim, "at_step": fault.at_step, "pool": name,
                           "killed": None, "survivor_line": None, "errors": []}
    deadline = time.monotonic() + args.time_limit
    killed_at = None
    try:
        infos = ranks.barrier("setup", deadline)
        ranks.go("setup", [{"peer": infos[1]["creator"]}, {"peer": infos[0]["creator"]}])
        live = [0, 1]
        while live and (out["killed"] is None or out["survivor_line"] is None):
            try:
                msg = ranks.next_message(live, deadline)
            except RunFailed as exc:
                if exc.rank == fault.victim and out["killed"] is not None:
                    live.remove(fault.victim)  # its pipe closed: it died as asked
                    continue
                raise
            kind, rank = msg[0], msg[1]
            if kind == "kill-me" and rank == fault.victim:
                ranks.kill(rank)
                killed_at = time.monotonic()
                out["killed"] = msg[2]
            elif kind == "survivor" and rank == survivor:
                out["survivor_line"], out["survivor_details"] = msg[2], msg[3]
                out["detected_after_s"] = None if killed_at is None else time.monotonic() - killed_at
            elif kind == "error":
                out["errors"].append(f"rank {rank}: {msg[2]}")
                ranks.tracebacks[rank] = msg[3]
                break
            elif kind == "exit":
                live.remove(rank)
            else:
                out["errors"].append(f"rank {rank} sent {msg[:3]!r}")
                break
    except RunFailed as exc:
        out["errors"].append(str(exc))
    codes = ranks.close(timeout=30.0)
    out["exit_codes"] = codes
    out["survivor_exit"] = exit_description(codes[survivor])
    out["tracebacks"] = ranks.tracebacks
    out["leftovers"] = leftover_files([name])
    after = shm_used_bytes()
    out["shm_growth_after"] = None if shm_before is None or after is None else after - shm_before
    remove_leftovers(out["leftovers"])  # after the growth is measured: the verdict sees what the run left
    return out


# ----------------------------------------------------------------------------- verdicts and tables


class Report:
    def __init__(self) -> None:
        self.failures: list[str] = []
        self.checks = 0

    def check(self, ok: bool, what: str) -> bool:
        self.checks += 1
        if not ok:
            self.failures.append(what)
        return ok


def yes(ok: bool) -> str:
    return "yes" if ok else "NO"


def report_main(run: dict, args: argparse.Namespace, mapping: DeviceMapping, rep: Report) -> dict:
    """Verdicts of parts a-d and their tables (printed); returns the verdicts for the JSON."""
    got = run["ranks"]
    verdicts: dict[str, Any] = {}
    if run["error"]:
        rep.check(False, f"main run: {run['error']}")
        print(f"\nmain run FAILED: {run['error']}")
        for r, tb in run.get("tracebacks", {}).items():
            print(f"--- rank {r} traceback\n{tb}", file=sys.stderr)
    setup = got.get("setup")
    if setup:
        rows = [[s["rank"], s["pid"], s["device"], s.get("gpu", "-"), s.get("pci_bus_id", "-"),
                 s.get("numa_node", "-")] for s in setup]
        print("\n" + format_table("ranks", ["rank", "pid", "device", "GPU", "PCI bus", "NUMA node"], rows))
    gpu = args.backend == "nvidia"
    if "a:done" in got:
        a = got["a:done"]
        same = a[0]["digests"] == a[1]["digests"]
        ok = (rep.check(same, "a: the ranks gathered different bytes") &
              rep.check(a[1]["misses"] > 0, "a: rank 1 read nothing from the shared pool (no misses)") &
              rep.check(all(x["steps"] == args.steps for x in a), "a: a rank ran fewer steps than asked") &
              rep.check(not gpu or all(x["graph"] for x in a), "a: a rank did not replay CUDA graphs"))
        rows = [[r, setup[r]["device"] if setup else "-", x["steps"], yes(x["graph"]) if gpu else "eager",
                 x["gathered_entries"], f"{x['gathered_bytes'] / MIB:.1f}", x["hits"], x["misses"], x["resident"],
                 x["spills"], x["released_pages"], "yes", yes(same), f"{x['seconds']:.1f}"]
                for r, x in enumerate(a)]
        print("\n" + format_table(
            "a. two ranks, one pool: a drifting workload against reference_cpu, every step",
            ["rank", "device", "steps", "CUDA graphs", "entries gathered", "MiB gathered", "hits", "misses",
             "resident", "spills", "pages released", "= reference_cpu", "= other rank", "s"], rows))
        verdicts["a"] = ok
    elif "a" in args.parts:
        verdicts["a"] = rep.check(False, "a: did not complete")
    if "b" in args.parts:
        if not gpu:
            print("\nb. delayed write: skipped (reference_cpu copies at submission: there is no delay to wait for)")
        elif "b:done" in got:
            r0, r1 = got["b:done"]
            ok = (rep.check(r1["stale_when_enqueued"], "b: rank 0's write had landed before rank 1 enqueued its read "
                                                       "(the delay did not hold it back)") &
                  rep.check(r1["read_new"], "b: rank 1 read old rows: it did not wait for rank 0's write") &
                  rep.check(r1["completed"] == [7] and r0["completed"] == [7],
                            "b: the spill was not acknowledged once on each rank") &
                  rep.check(r1["waited_ms"] >= 100.0, "b: rank 1's read finished at once (no wait)"))
            sub = got["b_submitted"][0]["submitted_at"]
            rows = [["rank 0's copy held back on its GPU by", f"{args.delay * 1000:.0f} ms of GPU time"],
                    ["rank 1 enqueued its read after rank 0's submission by", f"{(r1['enqueued_at'] - sub) * 1000:.1f} ms"],
                    ["host rows still the old ones when rank 1 enqueued", yes(r1["stale_when_enqueued"])],
                    ["rank 1's read then took", f"{r1['waited_ms']:.1f} ms (waiting on rank 0's IPC event)"],
                    ["rank 1 read the new rows", yes(r1["read_new"])],
                    ["spill acknowledged on rank 0 / rank 1", f"{r0['completed']} / {r1['completed']}"]]
            print("\n" + format_table("b. delayed write: rank 1 waits for rank 0's held-back copy", ["", ""], rows))
            verdicts["b"] = ok
        else:
            verdicts["b"] = rep.check(False, "b: did not complete")
    if "c_measure" in got:
        verdicts["c"] = report_memory(run, mapping, rep)
    elif "c" in args.parts:
        verdicts["c"] = rep.check(False, "c: did not complete")
    if "d" in args.parts:
        if not gpu:
            print("\nd. cost: skipped (the swap-in cost is a GPU figure)")
        elif "d_128_both:done" in got:
            verdicts["d"] = report_cost(got, args, mapping, rep)
        else:
            verdicts["d"] = rep.check(False, "d: did not complete")
    if gpu and "end" in got and mapping.devices:
        ctxs = [e["active_contexts"] for e in got["end"]]
        ok = all(c == [mapping.devices[r]] for r, c in enumerate(ctxs))
        rep.check(ok, f"a rank holds a CUDA context on another rank's GPU: {ctxs}")
        print(f"\nCUDA primary contexts held at the end: rank 0 on {ctxs[0]}, rank 1 on {ctxs[1]} "
              f"({'each rank on its own GPU only' if ok else 'NOT only its own GPU'})")
        verdicts["contexts"] = ok
    rep.check(not run["leftovers"], f"main run left {run['leftovers']} in /dev/shm")
    return verdicts


def report_memory(run: dict, mapping: DeviceMapping, rep: Report) -> bool:
    ranks = run["ranks"]["c_measure"]
    file_bytes = ranks[0]["file_bytes"]
    maps = [MappingMemory(**r["mapping"]) for r in ranks]
    delta = None if run.get("shm_before") is None or run.get("shm_during") is None else \
        run["shm_during"] - run["shm_before"]
    verdict = judge_memory(file_bytes, maps, delta)
    rows = []
    for r, (x, m) in enumerate(zip(ranks, maps, strict=True)):
        p, b = x["process"], x["process_before"]
        rows.append([r, f"{m.size / MIB:.1f}", f"{m.rss / MIB:.1f}", f"{m.pss / MIB:.1f}",
                     f"{p.get('VmRSS', 0) / MIB:.1f}", f"{(p.get('VmRSS', 0) - b.get('VmRSS', 0)) / MIB:+.1f}",
                     f"{p.get('RssShmem', 0) / MIB:.1f}", f"{p.get('Pss_Shmem', 0) / MIB:.1f}",
                     f"{x['map_register_s']:.2f}"])
    print("\n" + format_table(
        f"c. memory: one pool of {ranks[0]['pool_bytes'] / MIB:.1f} MiB ({file_bytes / MIB:.1f} MiB file) held by "
        "both ranks",
        ["rank", "mapped MiB", "mapping Rss", "mapping Pss", "VmRSS", "VmRSS growth", "RssShmem", "Pss_Shmem",
         "map+register s"], rows))
    shmem = None if run.get("shmem_before") is None or run.get("shmem_during") is None else \
        run["shmem_during"] - run["shmem_before"]
    if shmem is not None:
        print(f"  machine Shmem (/proc/meminfo) grew by {shmem / MIB:.1f} MiB")
    private = [x for x in (run["ranks"].get("d_private0:done", [None])[0],
                           run["ranks"].get("d_private1:done", [None, None])[1]) if x]
    for x in private:
        print(f"  a private pool of the same size grew its process's VmRSS by {x['rss_growth'] / MIB:.1f} MiB "
              "(per process: two private pools would cost twice)")
    for what, ok, figures in verdict.checks:
        print(f"  {'ok  ' if ok else 'FAIL'} {what}: {figures}")
        rep.check(ok, f"c: {what}: {figures}")
    return verdict.passed


def report_cost(got: dict, args: argparse.Namespace, mapping: DeviceMapping, rep: Report) -> bool:
    tol = args.cost_tolerance
    private = [got["d_private0:done"][0]["timings"], got["d_private1:done"][1]["timings"]]
    rows, ok_all = [], True
    for b in SWAP_IN_BATCHES:
        for r in range(2):
            pv = private[r][b]["plain"]
            alone = got[f"d_{b}_alone{r}:done"][r]
            both = got[f"d_{b}_both:done"][r]["plain"]
            sh, so = alone["plain"], alone["ordered"]
            figs = [pv, private[r][b]["ordered"], sh, so, both]
            misses_ok = all(f["misses_ok"] for f in figs)
            alone_ok = sh["us"] <= pv["us"] * (1 + tol)
            both_ok = both["us"] <= pv["us"] * (1 + tol)
            gate_both = mapping.one_gpu_per_rank
            ok = misses_ok and alone_ok and (both_ok or not gate_both)
            ok_all &= rep.check(misses_ok, f"d: batch {b} rank {r}: the measured misses are not the intended ones") & \
                rep.check(alone_ok, f"d: batch {b} rank {r}: shared pool {sh['us']:.2f} us > private "
                                    f"{pv['us']:.2f} us x {1 + tol:.2f}") & \
                rep.check(both_ok or not gate_both, f"d: batch {b} rank {r}: both ranks at once {both['us']:.2f} us > "
                                                    f"private {pv['us']:.2f} us x {1 + tol:.2f}")
            rows.append([b, r, f"{pv['us']:.2f}", f"{sh['us']:.2f}", f"{sh['us'] / pv['us']:.3f}",
                         f"{so['us']:.2f}", f"{both['us']:.2f}", f"{both['us'] / pv['us']:.3f}",
                         f"{sh['misses_per_row_step']:.0f}/{sh['intended_misses']}", yes(ok)])
    note = ("both ranks at once gated too: one GPU per rank" if mapping.one_gpu_per_rank else
            "both ranks at once not gated: the ranks share one GPU, so they queue for it")
    print("\n" + format_table(
        f"d. cost: swap-in per layer-step, us (median of >= {args.replays} CUDA graph replays; context "
        f"{args.context}; tolerance {tol:.0%}; {note})",
        ["batch", "rank", "private", "shared", "ratio", "shared, ordered", "shared, both ranks", "ratio",
         "misses/row-step", "ok"], rows))
    print("  private: a private pool of the same geometry on the rank's GPU, timed in the rank's process while the "
          "other rank idles (the one-process, one-GPU figure); shared: the shared pool, the other rank idle; "
          "ordered: with wait_for_host_writes before each replay (rank 1: a wait on rank 0's IPC event); both "
          "ranks: both timing at once")
    return ok_all


def report_faults(runs: list[dict], rep: Report, *, gpu: bool) -> dict:
    rows, verdicts = [], {}
    for f in runs:
        ok = (rep.check(f["killed"] is not None, f"e/{f['fault']}: the victim never reached its kill point") &
              rep.check(f["survivor_line"] is not None, f"e/{f['fault']}: the survivor did not report the death") &
              rep.check(not f["errors"], f"e/{f['fault']}: {'; '.join(f['errors'])}") &
              rep.check(not f["leftovers"], f"e/{f['fault']}: left {f['leftovers']} in /dev/shm") &
              rep.check(f["exit_codes"][1 - f["victim"]] in (0, 3),
                        f"e/{f['fault']}: the survivor ended with {f['survivor_exit']}"))
        growth = f["shm_growth_after"]
        if gpu and growth is not None:  # a dedicated machine: /dev/shm is back where it was
            ok &= rep.check(growth < 4 << 20, f"e/{f['fault']}: /dev/shm grew by {growth / MIB:.1f} MiB for good")
        verdicts[f["fault"]] = ok
        rows.append([f["fault"], f"rank {f['victim']}", (f["killed"] or "-"),
                     f["survivor_line"] or ("; ".join(f["errors"]) or "-"),
                     "-" if f.get("detected_after_s") is None else f"{f['detected_after_s']:.2f}",
                     f["survivor_exit"], ", ".join(f["leftovers"]) or "none",
                     "-" if growth is None else f"{growth / MIB:+.1f}", yes(ok)])
    print("\n" + format_table("e. faults: each in a fresh pair of ranks",
                              ["fault", "killed", "where", "the survivor's line", "s to report", "survivor exit",
                               "left in /dev/shm", "/dev/shm MiB after", "ok"], rows))
    for f in runs:
        for r, tb in f.get("tracebacks", {}).items():
            print(f"--- {f['fault']}: rank {r} traceback\n{tb}", file=sys.stderr)
    return verdicts


# ----------------------------------------------------------------------------- entry


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    # One line a value argparse refuses (the stock parser printed its usage first).
    ap = CliParser(prog="bench_tp_shared", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a short run: fewer steps, an 8K context, fewer replays")
    ap.add_argument("--json", metavar="FILE", help="also write every figure and verdict to FILE")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated parts to run (default: all of a-e)")
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"faults of part e (default: all of {', '.join(FAULTS)})")
    ap.add_argument("--backend", default="nvidia", choices=("nvidia", "reference_cpu"))
    ap.add_argument("--devices", help="CUDA device of each rank, e.g. 0,1 or 0,0 (default: rank r on r %% count)")
    ap.add_argument("--steps", type=int, help="decode steps of part a (default 96, --quick 16)")
    ap.add_argument("--seed", type=int, default=20)
    ap.add_argument("--context", type=int, help="tokens per request of part d (default 32768, --quick 8192)")
    ap.add_argument("--replays", type=int, help="timed replays per figure (default 30, --quick 10)")
    ap.add_argument("--min-seconds", type=float, help="time each figure at least this long (default 0.5, --quick 0.2)")
    ap.add_argument("--cost-tolerance", type=float, default=0.10,
                    help="shared-pool swap-in may be this much slower than the private pool (default 0.10)")
    ap.add_argument("--delay", type=float, default=0.75, help="GPU seconds rank 0's copies are held back (b, e)")
    ap.add_argument("--peer-timeout", type=float, default=120.0, help="seconds a rank waits for its peer")
    ap.add_argument("--time-limit", type=float, help="seconds per run of ranks (default 600, --quick 180)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each tag of the main run as it completes")
    args = ap.parse_args(argv)

    def bad(msg: str) -> None:
        ap.exit(2, f"bench_tp_shared: error: {msg}\n")

    args.parts = [p for p in args.parts.split(",") if p]
    if not args.parts or any(p not in PARTS for p in args.parts):
        bad(f"--parts {','.join(args.parts)!r}: expected a comma-separated subset of {','.join(PARTS)}")
    args.faults = [f for f in args.faults.split(",") if f]
    if any(f not in FAULTS for f in args.faults):
        bad(f"--faults {','.join(args.faults)!r}: expected a comma-separated subset of {','.join(FAULTS)}")
    q = args.quick
    args.steps = args.steps if args.steps is not None else (16 if q else 96)
    args.context = args.context if args.context is not None else (8192 if q else 32768)
    args.replays = args.replays if args.replays is not None else (10 if q else 30)
    args.min_seconds = args.min_seconds if args.min_seconds is not None else (0.2 if q else 0.5)
    args.time_limit = args.time_limit if args.time_limit is not None else (180.0 if q else 600.0)
    from tp_shared_workload import WorkloadShape

    max_steps = WorkloadShape().max_steps
    if not 1 <= args.steps <= max_steps:
        bad(f"--steps {args.steps}: expected 1..{max_steps} (the workload's contexts have room for that many)")
    try:
        CostShape(context=args.context).check()
    except ValueError as exc:
        bad(f"--context {args.context}: {exc}")
    for name, lo in (("replays", 1), ("min_seconds", 0.0), ("delay", 0.05), ("peer_timeout", 1.0),
                     ("time_limit", 10.0), ("cost_tolerance", 0.0)):
        # NaN compares false either way (`nan < lo` let it through, and a deadline of nan never came)
        if not lo <= getattr(args, name) < math.inf:
            bad(f"--{name.replace('_', '-')} {getattr(args, name)}: expected a finite number, at least {lo}")
    if not 0 <= args.seed <= MAX_SEED:  # torch's manual_seed overflowed in each rank, after the pools were made
        bad(f"--seed {args.seed}: expected an integer in [0, {MAX_SEED}]")
    try:
        args.devices = parse_devices(args.devices) if args.devices else None
    except ValueError as exc:
        bad(str(exc))
    if args.backend != "nvidia" and args.devices:
        bad("--devices applies to --backend nvidia only")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for k, v in NO_MULTICAST.items():
        os.environ.setdefault(k, v)
    gpu = args.backend == "nvidia"
    if gpu:
        from hisparse_nvidia.plugin import probe

        why = probe()
        if why is not None:
            print(f"bench_tp_shared: error: the nvidia backend cannot run here: {why}; expected a GPU machine, or "
                  "--backend reference_cpu", file=sys.stderr)
            return 2
        try:
            mapping = choose_mapping(2, torch.cuda.device_count(), args.devices)
        except ValueError as exc:
            print(f"bench_tp_shared: error: {exc}", file=sys.stderr)
            return 2
    else:
        mapping = DeviceMapping((), "backend reference_cpu")
    started = time.time()
    print(f"hisparse tensor-parallel shared host pool (issue 20), {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, "
          f"backend {args.backend}, torch {torch.__version__}{' (quick)' if args.quick else ''}")
    print(mapping.describe())
    size = shm_size_bytes()
    if size is not None:
        print(f"/dev/shm: {size[0] / MIB:.0f} MiB, {size[1] / MIB:.0f} MiB free")
    rep = Report()
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "backend": args.backend,
                              "torch": torch.__version__, "mapping": asdict(mapping),
                              "args": dict(vars(args))}
    try:
        main_parts = [p for p in args.parts if p != "e"]
        if main_parts:
            run = main_run(args, mapping)
            result["main"] = run
            result["verdicts"] = report_main(run, args, mapping, rep)
        if "e" in args.parts:
            runs = []
            for key in args.faults:
                fault = FAULTS[key]
                if fault.kind == "in-flight" and not gpu:
                    print(f"\ne. {key}: skipped (reference_cpu has no writes in flight: it copies at submission)")
                    continue
                runs.append(fault_run(args, mapping, key, fault))
            result["faults"] = runs
            result["fault_verdicts"] = report_faults(runs, rep, gpu=gpu)
    except KeyboardInterrupt:
        print("bench_tp_shared: interrupted", file=sys.stderr)
        return 130
    except HiSparseError as exc:
        rep.check(False, f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
    result["failures"] = rep.failures
    result["passed"] = not rep.failures
    result["seconds"] = time.time() - started
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    verdict = "PASS" if not rep.failures else "FAIL"
    print(f"\n{verdict}: {rep.checks - len(rep.failures)} of {rep.checks} checks passed in {result['seconds']:.0f} s "
          f"({mapping.describe()})")
    for f in rep.failures:
        print(f"  FAIL {f}")
    return 0 if not rep.failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
