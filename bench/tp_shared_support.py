"""Torch-free helpers of `bench/bench_tp_shared.py`: which GPU each rank runs on, what one shared
host pool costs in host memory, the memory verdict, and small reporting helpers.

Tested on the CPU by `tests/nvidia_backend/test_nvidia_tp_shared.py`.
"""

from __future__ import annotations

import glob
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from hisparse_core import shm

#: The batch sizes of the swap-in cost (part d).
SWAP_IN_BATCHES = (1, 32, 128)


def main_plan(parts: Sequence[str], gpu: bool) -> list[str]:
    """The tags both ranks of the main run reach, in order (each rank does a tag's work first,
    then waits there for the parent). Parts b and d need a GPU."""
    plan = ["setup"]
    if "a" in parts:
        plan += ["a", "a:done", "a:released"]  # rank 0 keeps its IPC event until rank 1 is done
    if "b" in parts and gpu:
        plan += ["b", "b_submitted", "b:done", "b:released"]
    cost = "d" in parts and gpu
    if cost:
        plan += ["d_private0", "d_private0:done", "d_private1", "d_private1:done"]
    if "c" in parts or cost:
        plan += ["c_before", "c_mapped", "c_measure"]
    if cost:
        for b in SWAP_IN_BATCHES:
            for phase in ("alone0", "alone1", "both"):
                plan += [f"d_{b}_{phase}", f"d_{b}_{phase}:done"]
    return plan + ["end"]


# ----------------------------------------------------------------------------- device mapping


@dataclass(frozen=True, slots=True)
class DeviceMapping:
    """The CUDA device of each rank (empty for a CPU backend) and why it was chosen."""

    devices: tuple[int, ...]
    reason: str

    @property
    def one_gpu_per_rank(self) -> bool:
        return bool(self.devices) and len(set(self.devices)) == len(self.devices)

    def describe(self) -> str:
        if not self.devices:
            return f"device mapping: every rank on the CPU ({self.reason})"
        ranks = ", ".join(f"rank {r} -> cuda:{d}" for r, d in enumerate(self.devices))
        return f"device mapping: {ranks} ({self.reason})"


def parse_devices(text: str) -> tuple[int, ...]:
    """`"0,1"` -> (0, 1); raises ValueError naming the bad value."""
    try:
        devices = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--devices {text!r}: expected comma-separated CUDA device indices, e.g. 0,1 or 0,0") from None
    if any(d < 0 for d in devices):
        raise ValueError(f"--devices {text!r}: expected device indices >= 0")
    return devices


def choose_mapping(world_size: int, device_count: int, forced: Sequence[int] | None = None) -> DeviceMapping:
    """Rank r on GPU `r % device_count` unless `forced`; raises ValueError (one line) where none fits."""
    if world_size < 1:
        raise ValueError(f"world size {world_size}: expected at least 1 rank")
    if device_count <= 0:
        raise ValueError("no CUDA device is visible (torch.cuda.device_count() is 0); expected at least 1: run on a "
                         "GPU machine, or pass --backend reference_cpu")
    if forced is not None:
        forced = tuple(forced)
        if len(forced) != world_size:
            raise ValueError(f"--devices names {len(forced)} device(s); expected {world_size}, one per rank")
        for d in forced:
            if not 0 <= d < device_count:
                raise ValueError(f"--devices: CUDA device {d} does not exist; {device_count} visible "
                                 f"(0..{device_count - 1})")
        shared = len(set(forced)) < len(forced)
        return DeviceMapping(forced, "forced by --devices: " + ("ranks share a GPU" if shared else "one GPU per rank"))
    devices = tuple(r % device_count for r in range(world_size))
    if device_count >= world_size:
        why = f"{device_count} GPUs visible: one GPU per rank, rank r on GPU r"
    elif device_count == 1:
        why = (f"1 GPU visible: all {world_size} ranks share GPU 0, the two-process stand-in for tensor "
               "parallelism; one GPU per rank needs two CUDA GPUs")
    else:
        why = f"{device_count} GPUs visible for {world_size} ranks: rank r on GPU r % {device_count}"
    return DeviceMapping(devices, why)


# ----------------------------------------------------------------------------- host memory


@dataclass(frozen=True, slots=True)
class SmapsEntry:
    """One mapping of /proc/<pid>/smaps: its range, backing file (device, inode) and sizes in bytes."""

    start: int
    end: int
    dev: str
    inode: int
    path: str
    fields: dict[str, int]


def parse_smaps(text: str) -> list[SmapsEntry]:
    """The entries of a /proc/<pid>/smaps text (sizes converted from kB to bytes)."""
    entries: list[SmapsEntry] = []
    current: SmapsEntry | None = None
    for line in text.splitlines():
        head, _, rest = line.partition(" ")
        if "-" in head and ":" not in head:
            parts = line.split(None, 5)
            start, end = (int(x, 16) for x in parts[0].split("-"))
            current = SmapsEntry(start, end, parts[3], int(parts[4]), parts[5] if len(parts) > 5 else "", {})
            entries.append(current)
        elif current is not None and head.endswith(":"):
            value = rest.split()
            if len(value) == 2 and value[1] == "kB":
                current.fields[head[:-1]] = int(value[0]) * 1024
    return entries


@dataclass(frozen=True, slots=True)
class MappingMemory:
    """What the mappings of one file cost this process: `rss` resident here, `pss` this process's
    proportional share (a page mapped by n processes counts 1/n), `size` the mapped length."""

    size: int
    rss: int
    pss: int
    shared: int
    private: int
    vmas: int

    def as_dict(self) -> dict[str, int]:
        return {"size": self.size, "rss": self.rss, "pss": self.pss, "shared": self.shared, "private": self.private,
                "vmas": self.vmas}


def mapping_memory(address: int, smaps_text: str | None = None) -> MappingMemory:
    """The memory of every mapping of the file mapped at `address` in this process (all of its
    VMAs: a registration or madvise may split one mmap). Raises ValueError if nothing maps it."""
    if smaps_text is None:
        with open("/proc/self/smaps") as f:
            smaps_text = f.read()
    entries = parse_smaps(smaps_text)
    hit = next((e for e in entries if e.start <= address < e.end), None)
    if hit is None:
        raise ValueError(f"no mapping of this process contains address {address:#x}")
    same = [e for e in entries if e.inode and (e.dev, e.inode) == (hit.dev, hit.inode)] if hit.inode else [hit]

    def total(*keys: str) -> int:
        return sum(e.fields.get(k, 0) for e in same for k in keys)

    return MappingMemory(size=sum(e.end - e.start for e in same), rss=total("Rss"), pss=total("Pss"),
                         shared=total("Shared_Clean", "Shared_Dirty"), private=total("Private_Clean", "Private_Dirty"),
                         vmas=len(same))


def _kb_fields(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        value = rest.split()
        if len(value) == 2 and value[1] == "kB":
            out[key.strip()] = int(value[0]) * 1024
    return out


def process_memory(status_text: str | None = None, rollup_text: str | None = None) -> dict[str, int]:
    """This process's resident memory in bytes: VmRSS, RssAnon, RssShmem (/proc/self/status) and
    Pss, Pss_Shmem (/proc/self/smaps_rollup); keys that the kernel does not give are left out."""
    texts = []
    for text, path in ((status_text, "/proc/self/status"), (rollup_text, "/proc/self/smaps_rollup")):
        if text is None:
            try:
                with open(path) as f:
                    text = f.read()
            except OSError:
                text = ""
        texts.append(text)
    status, rollup = (_kb_fields(t) for t in texts)
    out = {k: status[k] for k in ("VmRSS", "RssAnon", "RssShmem") if k in status}
    out.update({k: rollup[k] for k in ("Pss", "Pss_Shmem") if k in rollup})
    return out


def shm_used_bytes(directory: str = shm.SHM_DIR) -> int | None:
    """Bytes in use in the filesystem of `directory` (tmpfs: the shared pools' pages), or None."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def shm_size_bytes(directory: str = shm.SHM_DIR) -> tuple[int, int] | None:
    """(size, free) of the filesystem of `directory`, or None."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def meminfo_shmem(text: str | None = None) -> int | None:
    """The machine's shared memory in bytes (`Shmem` of /proc/meminfo), or None."""
    if text is None:
        try:
            with open("/proc/meminfo") as f:
                text = f.read()
        except OSError:
            return None
    return _kb_fields(text).get("Shmem")


#: /dev/shm grows by the pool file once: at least this share of the file, less than this many files.
SHM_DELTA_MIN, SHM_DELTA_MAX = 0.9, 1.5
#: The ranks' proportional shares of the pool's pages add up to the file within this fraction.
PSS_SUM_TOLERANCE = 0.10
#: Each rank has (at least) this share of the whole file resident in its own mapping.
RSS_MIN_SHARE = 0.9


@dataclass(frozen=True, slots=True)
class MemoryVerdict:
    passed: bool
    checks: list[tuple[str, bool, str]]  # (what, passed, figures)


def judge_memory(file_bytes: int, mappings: Sequence[MappingMemory], shm_delta: int | None) -> MemoryVerdict:
    """Physical host memory is one pool, not one per rank:

    - /dev/shm grew by one file (`SHM_DELTA_MIN`..`SHM_DELTA_MAX` times its size; two pools would be 2x);
    - every rank has the whole pool resident in its own mapping (Rss >= `RSS_MIN_SHARE` of the file): the
      ranks really map it, nothing is served from a copy;
    - the ranks' Pss of the mapping add up to one file (within `PSS_SUM_TOLERANCE`): the same pages.
    """
    mib = float(1 << 20)
    checks: list[tuple[str, bool, str]] = []
    if shm_delta is None:
        checks.append(("/dev/shm grew by one pool", False, "statvfs of /dev/shm unavailable"))
    else:
        ratio = shm_delta / file_bytes
        checks.append(("/dev/shm grew by one pool", SHM_DELTA_MIN <= ratio < SHM_DELTA_MAX,
                       f"+{shm_delta / mib:.1f} MiB for a {file_bytes / mib:.1f} MiB file = {ratio:.2f}x "
                       f"(expected {SHM_DELTA_MIN}x..{SHM_DELTA_MAX}x)"))
    for r, m in enumerate(mappings):
        checks.append((f"rank {r} maps the whole pool", m.rss >= RSS_MIN_SHARE * file_bytes,
                       f"Rss {m.rss / mib:.1f} MiB of {file_bytes / mib:.1f} MiB"))
    pss = sum(m.pss for m in mappings)
    checks.append(("the ranks' Pss add up to one pool", abs(pss - file_bytes) <= PSS_SUM_TOLERANCE * file_bytes,
                   f"sum of Pss {pss / mib:.1f} MiB = {pss / file_bytes:.2f}x the file; sum of Rss "
                   f"{sum(m.rss for m in mappings) / mib:.1f} MiB"))
    return MemoryVerdict(all(ok for _, ok, _ in checks), checks)


# ----------------------------------------------------------------------------- faults and reports


def exit_description(exitcode: int | None) -> str:
    """A process's exit as words: "killed by SIGKILL", "exit status 3", "still running"."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit status {exitcode}"


def leftover_files(names: Sequence[str], directory: str = shm.SHM_DIR) -> list[str]:
    """Files in `directory` that belong to the shared pools called `names` (any backend's suffix)."""
    found: list[str] = []
    for name in names:
        found += glob.glob(os.path.join(directory, f"{shm.FILE_PREFIX}{glob.escape(name)}.*"))
    return sorted(found)


def remove_leftovers(paths: Sequence[str]) -> None:
    """Unlinks the files a run left (already recorded, and reported as a failure), so that a failed run
    does not keep a pool's memory in /dev/shm after the bench exits; says so on stderr, a line a file."""
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        print(f"bench_tp_shared: removed {path}, which the run left behind", file=sys.stderr)


def format_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table: a title line, the header, a rule and one line per row (columns padded)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [title, "  ".join(c.ljust(w) for c, w in zip(cells[0], widths, strict=True)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells[1:]]
    return "\n".join(lines)
