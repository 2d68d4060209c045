"""Shared test support.

Its presence puts `tests/` on `sys.path` (pytest's rootdir-relative "prepend" import mode), so
every test folder can import `strict_device`, the CPU-emulated accelerator that fails on any CPU
tensor mixed into a device table, as CUDA does.

Session-wide guard: a test run leaves nothing of ours behind, on success or failure.

At the end of the session it looks for what appeared since the start and fails the run (then
removes it) if it finds:

- /dev/shm files of hisparse shared pools (this layout) whose creator is dead or is this process;
- `pymp-*` folders of multiprocessing in the temporary folder that no live process still uses
  (none of its sockets is bound), other than this process's own (removed at its exit).

Pools of live processes and folders in use are left alone: on a shared machine they may belong to
another test run.

Hypothesis runs under the profile `HISPARSE_HYPOTHESIS_PROFILE` names (`hypothesis_profiles.py`):
derandomized by default and in CI, so the README's test command draws the same examples on every
machine; `long` is the randomized bug hunt with 10 times the state machines' examples.
"""

from __future__ import annotations

import glob
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
from hypothesis_profiles import ENV as PROFILE_ENV
from hypothesis_profiles import register as register_hypothesis_profiles

from hisparse_core import shm

HYPOTHESIS_PROFILE = register_hypothesis_profiles()


def pytest_report_header() -> str:
    return (f"hypothesis profile: {HYPOTHESIS_PROFILE} (set by {PROFILE_ENV}; ci = derandomized, "
            f"long = randomized with 10x the state machines' examples)")


def _shm_files() -> set[str]:
    return set(glob.glob(os.path.join(shm.SHM_DIR, f"{shm.FILE_PREFIX}*")))


def _pymp_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "pymp-*")))


def _bound_unix_paths() -> set[str]:
    try:
        with open("/proc/net/unix") as f:
            return {parts[-1] for parts in (line.split() for line in f.readlines()[1:]) if len(parts) >= 8}
    except OSError:
        return set()


def _leftovers(shm_before: set[str], pymp_before: set[str]) -> list[str]:
    found = []
    for path in sorted(_shm_files() - shm_before):
        creator = shm.creator_of(path)
        if creator is not None and (creator.pid == os.getpid() or creator.state() == "dead"):
            found.append(f"{path} (a shared pool file of {creator.describe()}, "
                         f"{'this process' if creator.pid == os.getpid() else 'dead'})")
            if creator.pid != os.getpid():
                shm.sweep_stale()
            else:
                os.unlink(path)
    own = multiprocessing.process.current_process()._config.get("tempdir")  # type: ignore[attr-defined]
    bound = _bound_unix_paths()
    for path in sorted(_pymp_dirs() - pymp_before - {own}):
        if any(b.startswith(path + os.sep) for b in bound):
            continue  # a live process still serves from it
        found.append(f"{path} (a multiprocessing temporary folder)")
        shutil.rmtree(path, ignore_errors=True)
    return found


@pytest.fixture(scope="session", autouse=True)
def leaves_nothing_behind() -> Iterator[None]:
    shm_before, pymp_before = _shm_files(), _pymp_dirs()
    yield
    left = _leftovers(shm_before, pymp_before)
    if left:
        pytest.fail("the test run left behind (now removed): " + "; ".join(left), pytrace=False)
