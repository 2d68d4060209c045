"""The /dev/shm pool-file protocol (`hisparse_core.shm`), in a scratch folder: creator identity,
publication and the rank table that removes the name, the sweep of stale files, and what a peer
says about a file it cannot use. Process-level faults (kill -9 at each phase) are in
tests/reference_cpu/test_pool_faults.py."""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

import pytest

from hisparse_core import shm
from hisparse_core.errors import CapacityError, InvalidInputError, ProtocolError
from hisparse_core.host_pool import HostPoolSpec

HEADER = shm.PoolHeader(b"HISPARSE-TEST-v2")
FILE_BYTES = shm.HEADER_PAGE + 8192
#: A pid that no process has (above any pid_max), so its creator is dead.
DEAD = shm.Creator(2**31 - 2, 1, 0)


def spec(rank: int = 0, world_size: int = 2, blocks: int = 3) -> HostPoolSpec:
    return HostPoolSpec(num_layers=2, num_blocks=blocks, block_size=4, shared=True, name="t", rank=rank,
                        world_size=world_size)


def write_pool(path: Path, creator: shm.Creator, the_spec: HostPoolSpec | None = None,
               size: int = FILE_BYTES, header: shm.PoolHeader = HEADER) -> None:
    raw = header.pack(the_spec or spec(), creator)
    path.write_bytes(raw + b"\0" * (size - len(raw)))


def dead_child_creator() -> shm.Creator:
    """The identity of a real process that has exited and been reaped."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return shm.Creator(pid, 1, shm.Creator.current().pidns)


def test_shm_path_validates_the_name() -> None:
    assert shm.shm_path("a.b-c_1", ".pool") == os.path.join(shm.SHM_DIR, "hisparse_a.b-c_1.pool")
    for bad in ("../x", "a/b", "", "x" * 200):
        with pytest.raises(InvalidInputError, match="not a valid file name part"):
            shm.shm_path(bad, ".pool")


def test_creator_identity_survives_pid_reuse_and_other_namespaces() -> None:
    me = shm.Creator.current()
    assert me.pid == os.getpid() and me.start > 0 and me.state() == "alive"
    assert shm.process_start(os.getpid()) == me.start
    assert shm.Creator(me.pid, me.start + 1, me.pidns).state() == "dead"  # same pid, a younger process
    assert dead_child_creator().state() == "dead"
    assert DEAD.state() == "dead"
    assert shm.Creator(DEAD.pid, 1, me.pidns + 1).state() == "unknown"  # another pid namespace: never judged


def test_inspect_tells_a_pool_from_other_versions_and_foreign_files(tmp_path: Path) -> None:
    path = tmp_path / "hisparse_x.pool"
    assert shm.inspect(str(path), HEADER).kind == "absent"
    me = shm.Creator.current()
    write_pool(path, me)
    found = shm.inspect(str(path), HEADER)
    assert (found.kind, found.creator, found.geometry, found.size) == ("pool", me, shm.geometry_of(spec()),
                                                                       FILE_BYTES)
    write_pool(path, me, header=shm.PoolHeader(b"HISPARSE-OTHER-2"))
    other = shm.inspect(str(path), HEADER)
    assert other.kind == "other" and other.creator == me and "HISPARSE-OTHER-2" in other.detail
    path.write_bytes(b"HISPARSE-POOL-v1" + struct.pack("<q", 1234) + b"\0" * 100)  # the earlier layout
    legacy = shm.inspect(str(path), HEADER)
    assert legacy.kind == "other" and legacy.creator == shm.Creator(1234, 0, 0) and "earlier" in legacy.detail
    path.write_bytes(b"some other program's data")
    assert shm.inspect(str(path), HEADER).kind == "foreign"
    path.write_bytes(b"")
    assert shm.inspect(str(path), HEADER).detail == "an empty file"


@pytest.mark.parametrize("tmpfile", [True, False], ids=["O_TMPFILE", "named-temporary"])
def test_the_name_exists_only_until_every_rank_has_mapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          tmpfile: bool) -> None:
    if not tmpfile:
        monkeypatch.delattr(os, "O_TMPFILE", raising=False)
    path = str(tmp_path / "hisparse_p.pool")
    s0 = spec(world_size=3)
    f0 = shm.create(path, HEADER, s0, FILE_BYTES)
    assert not os.path.exists(path)  # creating: nothing to see
    assert os.listdir(tmp_path) == ([] if tmpfile else [f"hisparse_p.pool.{os.getpid()}.tmp"])
    f0.publish()
    assert os.listdir(tmp_path) == ["hisparse_p.pool"] and f0.linked and f0.missing_ranks() == [1, 2]
    f1 = shm.attach(path, HEADER, spec(1, 3), FILE_BYTES, 1.0)
    f1.mark_mapped(1)
    assert f0.linked and f0.missing_ranks() == [2]
    f2 = shm.attach(path, HEADER, spec(2, 3), FILE_BYTES, 1.0)
    with pytest.raises(ProtocolError, match="rank 1 has already mapped it"):
        f2.mark_mapped(1)
    f2.mark_mapped(2)
    assert os.listdir(tmp_path) == [] and not f0.linked  # every rank mapped: the name is gone
    os.pwrite(f1.fd, b"shared", shm.HEADER_PAGE)
    assert os.pread(f2.fd, 6, shm.HEADER_PAGE) == b"shared"  # still one file, through its descriptors
    for f in (f2, f1, f0, f0):
        f.close()


def test_a_pool_of_one_rank_is_never_named_and_release_removes_a_name_left(tmp_path: Path) -> None:
    path = str(tmp_path / "hisparse_one.pool")
    alone = shm.create(path, HEADER, spec(world_size=1), FILE_BYTES)
    alone.publish()
    assert os.listdir(tmp_path) == []
    alone.close()
    waiting = shm.create(path, HEADER, spec(), FILE_BYTES)
    waiting.publish()  # rank 1 never comes
    assert os.path.exists(path)
    waiting.close()
    assert not os.path.exists(path)


def test_the_sweep_removes_only_files_of_dead_creators(tmp_path: Path) -> None:
    me = shm.Creator.current()
    dead, live, foreign = tmp_path / "hisparse_dead.pool", tmp_path / "hisparse_live.pool", tmp_path / "hisparse_f"
    write_pool(dead, dead_child_creator())
    write_pool(live, me)
    write_pool(tmp_path / "hisparse_reused.pool", shm.Creator(me.pid, me.start + 7, me.pidns))
    write_pool(tmp_path / "hisparse_elsewhere.pool", shm.Creator(DEAD.pid, 1, me.pidns + 1))
    write_pool(tmp_path / "hisparse_old.pool.123.tmp", DEAD, header=shm.PoolHeader(b"HISPARSE-NVPOOL2"))
    (tmp_path / "hisparse_legacy.nvpool").write_bytes(b"HISPARSE-NVPOOL1" + struct.pack("<q", DEAD.pid) + bytes(99))
    foreign.write_bytes(b"not ours")
    write_pool(tmp_path / "unrelated.pool", DEAD)  # not a hisparse_ name: never looked at
    removed = shm.sweep_stale(str(tmp_path))
    assert sorted(os.path.basename(p) for p in removed) == [
        "hisparse_dead.pool", "hisparse_legacy.nvpool", "hisparse_old.pool.123.tmp", "hisparse_reused.pool"]
    assert sorted(os.listdir(tmp_path)) == ["hisparse_elsewhere.pool", "hisparse_f", "hisparse_live.pool",
                                            "unrelated.pool"]


def test_create_refuses_a_live_pool_and_a_foreign_file_and_replaces_a_stale_one(tmp_path: Path) -> None:
    path = tmp_path / "hisparse_n.pool"
    write_pool(path, shm.Creator(os.getppid(), shm.process_start(os.getppid()) or 0, shm.Creator.current().pidns))
    with pytest.raises(InvalidInputError, match=f"in use by live process {os.getppid()}; .*choose another pool name"):
        shm.create(str(path), HEADER, spec(), FILE_BYTES)
    path.write_bytes(b"x" * 10)
    with pytest.raises(InvalidInputError, match=rf"is not a hisparse pool \(10 bytes.*rm {path}"):
        shm.create(str(path), HEADER, spec(), FILE_BYTES)
    write_pool(path, DEAD)
    created = shm.create(str(path), HEADER, spec(), FILE_BYTES)
    created.publish()
    assert shm.inspect(str(path), HEADER).creator == shm.Creator.current()  # (an inode number may be reused)
    created.close()


def test_a_file_that_appears_while_publishing_is_handled(tmp_path: Path) -> None:
    path = tmp_path / "hisparse_race.pool"
    created = shm.create(str(path), HEADER, spec(), FILE_BYTES)
    write_pool(path, DEAD)  # a stale file appeared after create looked: replaced
    created.publish()
    assert shm.inspect(str(path), HEADER).creator == shm.Creator.current()
    created.close()
    again = shm.create(str(path), HEADER, spec(), FILE_BYTES)
    write_pool(path, shm.Creator(os.getppid(), 0, 0))  # a live one: refused
    with pytest.raises(InvalidInputError, match="in use by live process"):
        again.publish()
    again.close()
    assert shm.inspect(str(path), HEADER).creator == shm.Creator(os.getppid(), 0, 0)  # not ours: left alone


def test_create_reports_a_file_the_folder_cannot_size(tmp_path: Path) -> None:
    with pytest.raises(CapacityError, match=r"could not size .* to \d+ bytes"):
        shm.create(str(tmp_path / "hisparse_big.pool"), HEADER, spec(), 1 << 62)
    assert os.listdir(tmp_path) == []


def test_world_size_is_bounded_by_the_rank_table(tmp_path: Path) -> None:
    big = HostPoolSpec(num_layers=1, num_blocks=1, block_size=1, shared=True, name="t",
                       world_size=shm.MAX_WORLD_SIZE + 1)
    with pytest.raises(InvalidInputError, match=f"world_size={shm.MAX_WORLD_SIZE + 1}.*at most {shm.MAX_WORLD_SIZE}"):
        shm.create(str(tmp_path / "hisparse_w.pool"), HEADER, big, FILE_BYTES)


# ------------------------------------------------------------------ what a peer says, and when


def attach_fails(path: Path, error: type[Exception], match: str, the_spec: HostPoolSpec | None = None) -> None:
    start = time.monotonic()
    with pytest.raises(error, match=match):
        shm.attach(str(path), HEADER, the_spec or spec(1), FILE_BYTES, 30.0)
    assert time.monotonic() - start < 5, "waiting cannot help here: the peer must fail fast"


def test_a_peer_fails_fast_on_a_file_it_cannot_use(tmp_path: Path) -> None:
    path = tmp_path / "hisparse_bad.pool"
    path.write_bytes(b"GARBAGE" * 100)
    attach_fails(path, InvalidInputError, rf"{path} is not a hisparse shared pool \(700 bytes, starting "
                                          rf"b'GARBAGEGARBAGEGA'\); remove it \(rm {path}\)")
    write_pool(path, shm.Creator.current(), header=shm.PoolHeader(b"HISPARSE-NVPOOL2"))
    attach_fails(path, InvalidInputError, "holds a pool of another hisparse backend or version.*same hisparse version")
    write_pool(path, shm.Creator.current(), spec(0, 2, blocks=5))
    attach_fails(path, InvalidInputError, r"created by pid \d+ .*with world_size=2 layers=2 blocks=5 .*expected "
                                          r"world_size=2 layers=2 blocks=3 .*same pool geometry")
    attach_fails(path, InvalidInputError, "world_size=2 .* expected world_size=4", spec(1, 4, blocks=5))
    write_pool(path, shm.Creator.current(), size=FILE_BYTES - 4096)
    attach_fails(path, InvalidInputError, rf"has {FILE_BYTES - 4096} bytes; a pool of this geometry has {FILE_BYTES}")


def test_a_creator_that_dies_after_publishing_fails_the_peer_fast_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "hisparse_orphan.pool"
    creator = dead_child_creator()
    real_sweep = shm.sweep_stale

    def sweep_then_crash(directory: str) -> dict[str, shm.Creator]:
        out = real_sweep(directory)
        write_pool(path, creator)  # rank 0 published after this peer started, then died
        return out

    monkeypatch.setattr(shm, "sweep_stale", sweep_then_crash)
    attach_fails(path, ProtocolError, rf"rank 0 \(pid {creator.pid} \(start time 1\)\) published .* and died before "
                                      "this rank mapped it; its file was removed: restart the deployment")
    assert not path.exists()


def test_a_peer_started_after_rank_0_died_fails_at_once(tmp_path: Path) -> None:
    """The peer's sweep finds the pool rank 0 published, its creator dead: the peer says so at
    once, with the whole default timeout left, and nothing stays behind."""
    path = tmp_path / "hisparse_old.pool"
    creator = dead_child_creator()
    write_pool(path, creator)
    t0 = time.monotonic()
    with pytest.raises(ProtocolError, match=rf"rank 1: rank 0 \(pid {creator.pid} \(start time 1\)\) published the "
                                            r"shared host pool 't' at .* and is dead \(it died before this rank "
                                            r"started; its file was removed\): restart the deployment"):
        shm.attach(str(path), HEADER, spec(1), FILE_BYTES, 60.0)
    assert time.monotonic() - t0 < 10.0
    assert not path.exists()


def test_a_stale_file_elsewhere_does_not_stop_a_peer_from_waiting(tmp_path: Path) -> None:
    """A dead creator's file under another name is swept, and the peer waits for its own rank 0."""
    other = tmp_path / "hisparse_other.pool"
    write_pool(other, dead_child_creator())
    with pytest.raises(ProtocolError, match=r"waited 0.2s .* and no file appeared: start rank 0"):
        shm.attach(str(tmp_path / "hisparse_mine.pool"), HEADER, spec(1), FILE_BYTES, 0.2)
    assert not other.exists()


def test_a_peer_waits_for_rank_0_and_attaches_once_it_publishes(tmp_path: Path) -> None:
    path = str(tmp_path / "hisparse_late.pool")
    published: list[shm.PoolFile] = []

    def publish_on_third_look(_seconds: float) -> None:
        if len(published) == 0 and not os.path.exists(path):
            sleeps.append(1)
            if len(sleeps) == 3:
                f = shm.create(path, HEADER, spec(), FILE_BYTES)
                f.publish()
                published.append(f)

    sleeps: list[int] = []
    peer = shm.attach(path, HEADER, spec(1), FILE_BYTES, 5.0, sleep=publish_on_third_look)
    assert len(sleeps) == 3 and peer.creator == shm.Creator.current()
    peer.mark_mapped(1)
    assert not os.path.exists(path)
    peer.close()
    published[0].close()
