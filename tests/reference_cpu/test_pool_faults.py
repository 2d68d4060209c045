"""A shared host pool leaves nothing in /dev/shm, whoever dies and whenever.

Two ranks of a reference_cpu shared pool run in forked processes. One of them (rank 0 or the
peer) is killed with SIGKILL at one phase of the pool's life:

- creating: rank 0 between building the file and publishing it; the peer while it waits for it;
- mapped: rank 0 right after publishing it; the peer after mapping it, before marking its rank;
- serving: both ranks have the pool, rows are being written and read.

The other rank then ends too, by releasing its pool or by SIGKILL as well. Afterwards /dev/shm
holds no file of ours, at once where the design promises it (see hisparse_core.shm), else after a
restart under a new name (whose start sweeps stale files), and that restart works. Also: a plain
interpreter exit without release(), and a failing test, leave nothing.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch

from hisparse_core import shm
from hisparse_core.errors import HiSparseError
from hisparse_core.host_pool import HostPoolSpec
from hisparse_reference_cpu.host_pool import ReferenceHostPool

pytestmark = pytest.mark.skipif(not os.path.isdir(shm.SHM_DIR), reason="shared pools live in /dev/shm")

CTX = mp.get_context("fork")
LAYERS, BLOCKS, BS = 2, 3, 4


def pool_spec(name: str, rank: int) -> HostPoolSpec:
    return HostPoolSpec(num_layers=LAYERS, num_blocks=BLOCKS, block_size=BS, shared=True, name=name, rank=rank,
                        world_size=2)


def ours(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"hisparse_{prefix}"))


def rows(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (BLOCKS * BS, 656), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _rank(name: str, rank: int, die_at: str | None, out: mp.SimpleQueue, go: Connection, seed: int) -> None:
    """One rank: build the pool (killing itself at `die_at` if given), serve, then wait for `go`
    and release. A peer reports "waiting" at its first poll for rank 0's file."""
    sleep = time.sleep

    def first_poll(seconds: float) -> None:
        if die_at == "creating":
            _die()
        if not polled:
            polled.append(1)
            out.put((rank, "waiting", ""))
        sleep(seconds)

    polled: list[int] = []
    time.sleep = first_poll  # type: ignore[assignment]
    if die_at == "creating" and rank == 0:
        shm.PoolFile.publish = lambda self: _die()  # type: ignore[method-assign]
    elif die_at == "mapped" and rank == 0:
        publish = shm.PoolFile.publish
        shm.PoolFile.publish = lambda self: (publish(self), _die())  # type: ignore[method-assign]
    elif die_at == "mapped":
        shm.PoolFile.mark_mapped = lambda self, r: _die()  # type: ignore[method-assign]
    try:
        pool = ReferenceHostPool(pool_spec(name, rank), peer_timeout_s=0.5)
    except HiSparseError as exc:
        out.put((rank, "error", f"{type(exc).__name__}: {exc}"))
        return
    finally:
        time.sleep = sleep
    view = pool.layer_view(1).view(torch.uint8)
    if rank == 0:
        view.copy_(rows(seed))
    out.put((rank, "serving", ""))
    go.poll(30)  # serving until told to end (or killed)
    if rank != 0:
        out.put((rank, "read", str(torch.equal(view, rows(seed)))))
    pool.release()
    out.put((rank, "released", ""))


class Ranks:
    def __init__(self, name: str, victim: int, phase: str) -> None:
        self.name, self.victim, self.phase = name, victim, phase
        self.out: mp.SimpleQueue = CTX.SimpleQueue()
        # Pipes, not an mp.Event: setting an Event whose waiter was killed blocks forever.
        self._go = {rank: CTX.Pipe(duplex=False) for rank in (0, 1)}
        self.seed = int.from_bytes(os.urandom(4), "little")
        self.procs: dict[int, mp.Process] = {}
        self.seen: list[tuple[int, str, str]] = []

    def start(self, rank: int) -> mp.Process:
        die_at = self.phase if rank == self.victim else None
        p = CTX.Process(target=_rank, args=(self.name, rank, die_at, self.out, self._go[rank][0], self.seed),
                        daemon=True)
        p.start()
        self.procs[rank] = p
        return p

    def wait_for(self, rank: int, what: str) -> str:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            while not self.out.empty():
                self.seen.append(self.out.get())
            for i, (r, event, detail) in enumerate(self.seen):
                assert event != "error" or what == "error", f"rank {r}: {detail}"
                if (r, event) == (rank, what):
                    del self.seen[i]
                    return detail
            time.sleep(0.005)
        raise AssertionError(f"rank {rank} never reported {what!r}; reports: {self.seen}")

    def go(self, rank: int) -> None:
        self._go[rank][1].send(True)

    def killed(self, rank: int) -> None:
        self.procs[rank].join(30)
        assert self.procs[rank].exitcode == -signal.SIGKILL

    def stop(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
            p.join(30)


def _run_fault(ranks: Ranks) -> int:
    """Drive one case up to the victim's death; returns the surviving rank, or -1 if it already failed."""
    victim, phase = ranks.victim, ranks.phase
    survivor = 1 - victim
    if victim == 0 and phase == "creating":
        ranks.start(0)
        ranks.killed(0)
        ranks.start(1)
        assert "no file appeared" in ranks.wait_for(1, "error")
        return -1
    if victim == 0 and phase == "mapped":
        # The peer is already polling when rank 0 publishes and dies; it is stopped meanwhile, so
        # it cannot map the file in the instant between the two.
        peer = ranks.start(1)
        ranks.wait_for(1, "waiting")
        os.kill(peer.pid, signal.SIGSTOP)
        ranks.start(0)
        ranks.killed(0)
        os.kill(peer.pid, signal.SIGCONT)
        message = ranks.wait_for(1, "error")
        assert "published the shared host pool" in message and "died before this rank mapped it" in message, message
        return -1
    if victim == 1 and phase == "creating":
        ranks.start(1)
        ranks.killed(1)
        ranks.start(0)
        ranks.wait_for(0, "serving")
        return survivor
    if victim == 1 and phase == "mapped":
        ranks.start(0)
        ranks.wait_for(0, "serving")
        ranks.start(1)
        ranks.killed(1)
        return survivor
    ranks.start(0)
    ranks.wait_for(0, "serving")
    ranks.start(1)
    ranks.wait_for(1, "serving")
    ranks.procs[victim].kill()
    ranks.killed(victim)
    return survivor


def _restart_works(name: str) -> None:
    """Rank 0 here, the peer in a forked child, under a new name: the peer reads rank 0's rows."""
    ranks = Ranks(name, victim=-1, phase="")
    pool = ReferenceHostPool(pool_spec(name, 0))
    try:
        pool.layer_view(1).view(torch.uint8).copy_(rows(ranks.seed))
        ranks.start(1)
        ranks.wait_for(1, "serving")
        ranks.go(1)
        assert ranks.wait_for(1, "read") == "True"
        ranks.wait_for(1, "released")
    finally:
        pool.release()
        ranks.stop()


@pytest.mark.parametrize("victim, phase, end", [
    (0, "creating", None), (0, "mapped", None), (0, "serving", "release"), (0, "serving", "kill"),
    (1, "creating", "release"), (1, "creating", "kill"), (1, "mapped", "release"), (1, "mapped", "kill"),
    (1, "serving", "release"), (1, "serving", "kill"),
])
def test_kill_9_at_any_phase_leaves_nothing(victim: int, phase: str, end: str | None) -> None:
    prefix = f"faults{os.getpid()}{uuid.uuid4().hex[:8]}"
    ranks = Ranks(f"{prefix}-a", victim, phase)
    try:
        survivor = _run_fault(ranks)
        if phase == "serving":
            assert ours(prefix) == [], "every rank mapped the pool, so its name must already be gone"
        if survivor >= 0 and end == "release":
            ranks.go(survivor)
            if survivor == 1:
                assert ranks.wait_for(1, "read") == "True"  # rank 0's rows outlive rank 0
            ranks.wait_for(survivor, "released")
            assert ours(prefix) == []
        elif survivor >= 0:
            ranks.procs[survivor].kill()
            ranks.procs[survivor].join(30)
        if victim == 0 and phase in ("creating", "mapped"):
            assert ours(prefix) == [], "an unpublished file has no name; a dead creator's is removed by the peer"
    finally:
        ranks.stop()
    # Whatever is left (only a named file whose creator was killed before the peer mapped it) goes
    # at the next start of any shared pool, under any name.
    _restart_works(f"{prefix}-b")
    assert ours(prefix) == []


def _python(code: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HISPARSE_", "PYTEST_"))}
    return subprocess.run([sys.executable, *args] if args else [sys.executable, "-c", code], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def test_an_exit_without_release_leaves_nothing(tmp_path: Path) -> None:
    prefix = f"exit{os.getpid()}{uuid.uuid4().hex[:8]}"
    code = textwrap.dedent(f"""
        import os, sys
        from hisparse_core.host_pool import HostPoolSpec
        from hisparse_reference_cpu.host_pool import ReferenceHostPool, shm_path
        pool = ReferenceHostPool(HostPoolSpec(num_layers=1, num_blocks=2, block_size=4, shared=True,
                                              name="{prefix}", world_size=2))
        assert os.path.exists(shm_path("{prefix}"))  # published; the peer never comes
        sys.exit(0)  # no release()
    """)
    done = _python(code, tmp_path)
    assert done.returncode == 0, done.stderr
    assert ours(prefix) == []


def test_a_failing_test_leaves_nothing(tmp_path: Path) -> None:
    prefix = f"failing{os.getpid()}{uuid.uuid4().hex[:8]}"
    (tmp_path / "test_fails.py").write_text(textwrap.dedent(f"""
        from hisparse_core.host_pool import HostPoolSpec
        from hisparse_reference_cpu.host_pool import ReferenceHostPool

        def test_fails_holding_a_pool():
            pool = ReferenceHostPool(HostPoolSpec(num_layers=1, num_blocks=2, block_size=4, shared=True,
                                                  name="{prefix}", world_size=2))
            assert pool.released, "fails with the pool held (and kept alive by the traceback)"
    """))
    done = _python("", tmp_path, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_fails.py")
    assert done.returncode == 1 and "1 failed" in done.stdout, done.stdout[-2000:]
    assert ours(prefix) == []
