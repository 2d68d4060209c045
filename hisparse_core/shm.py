"""The /dev/shm file protocol of a shared host pool, shared by every backend. Torch-free.

A shared pool is one file `/dev/shm/hisparse_<name><suffix>`: one page of header (magic, creator,
geometry, a table of which ranks have mapped it, and whatever else the backend keeps there), then
the rows. Why no crash can leave its RAM behind:

1. **Creating.** Rank 0 builds the file without a name (`O_TMPFILE` in /dev/shm), sizes it,
   writes the header and maps it (`create`). A process killed here leaves nothing: an unnamed
   file dies with its last descriptor.
2. **Published.** Rank 0 links it at its name (`PoolFile.publish`) so the peers can find it, and
   marks itself in the rank table.
3. **Mapped by all.** Each peer maps it (`attach`) and marks its rank (`PoolFile.mark_mapped`),
   under an exclusive `flock` of the file. Whoever completes the table removes the name. From
   then on the memory is held only by the ranks' mappings, and the kernel frees it when the last
   of them goes, however they end (kill -9 included).

Only between 2 and 3 (a peer that never comes, or dies before mapping) does the file have a name.
That window is closed three ways: rank 0 removes the name at `release` and at interpreter exit
(a finalizer), a peer that finds the creator dead removes it, and every start of a shared pool on
the machine first sweeps /dev/shm of files whose creator is dead (`sweep_stale`), whatever their
name (the vLLM connector names pools after a fresh engine id, so a leaked name is never reused).

The creator is identified by pid, process start time and pid namespace (`Creator`): a reused pid
does not make a dead creator look alive, and a file from another pid namespace, whose creator
cannot be judged from here, is never removed. Every removal is "lock the file, check that the name
still links this very file, unlink", so a file that replaced a stale one is never removed by
mistake. Files of another user are never touched.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import stat
import struct
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hisparse_core.errors import CapacityError, InvalidInputError, ProtocolError

if TYPE_CHECKING:  # it loads torch; the protocol does not need it
    from hisparse_core.host_pool import HostPoolSpec

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
#: Every pool file starts with one page of header; the rows start at this offset.
HEADER_PAGE = 4096
#: The rank table: one byte per rank (1 once that rank has mapped the file).
RANKS_OFFSET = 1024
#: Most ranks one shared pool can have (the rank table fills the rest of the header page).
MAX_WORLD_SIZE = HEADER_PAGE - RANKS_OFFSET
#: Marks the header layout of this module, whatever the backend's magic (the sweep keys on it).
TAG = b"HSPOOL02"
FILE_PREFIX = "hisparse_"
#: Magics of the earlier layout (pid right after the magic, no start time): swept when dead.
LEGACY_MAGICS = frozenset({b"HISPARSE-POOL-v1", b"HISPARSE-NVPOOL1"})

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_IDENTITY = struct.Struct("<16s8sqQQ")  # magic, tag, pid, start time, pid namespace


def shm_path(name: str, suffix: str) -> str:
    """The /dev/shm file that backs the shared pool called `name` (`suffix`: the backend's, e.g. ".pool")."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidInputError(
            f"shared host pool name {name!r} is not a valid file name part; expected 1-128 of [A-Za-z0-9_.-]")
    return os.path.join(SHM_DIR, f"{FILE_PREFIX}{name}{suffix}")


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (one owned by another user counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_start(pid: int) -> int | None:
    """Start time of process `pid` in clock ticks since boot (/proc/<pid>/stat), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count fields after the last ')'.
    fields = text.rsplit(b")", 1)[-1].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


@dataclass(frozen=True, slots=True)
class Creator:
    """Who created a pool file: pid, start time (0: unknown) and pid namespace inode (0: unknown)."""

    pid: int
    start: int
    pidns: int

    @classmethod
    def current(cls) -> Creator:
        pid = os.getpid()
        return cls(pid, process_start(pid) or 0, _pid_namespace())

    def state(self) -> str:
        """"alive", "dead", or "unknown" (another pid namespace: it cannot be judged from here)."""
        ours = _pid_namespace()
        if self.pidns and ours and self.pidns != ours:
            return "unknown"
        if not pid_alive(self.pid):
            return "dead"
        if self.start:
            now = process_start(self.pid)
            if now is not None and now != self.start:
                return "dead"  # the pid was reused by a younger process
        return "alive"

    def describe(self) -> str:
        return f"pid {self.pid}" + (f" (start time {self.start})" if self.start else "")


@dataclass(frozen=True, slots=True)
class Geometry:
    """What a pool file holds: equal geometries describe the same pool."""

    world_size: int
    num_layers: int
    num_blocks: int
    block_size: int
    width: int
    row_format: str
    nbytes: int

    def describe(self) -> str:
        return (f"world_size={self.world_size} layers={self.num_layers} blocks={self.num_blocks} "
                f"block_size={self.block_size} width={self.width} format={self.row_format} nbytes={self.nbytes}")


def geometry_of(spec: HostPoolSpec) -> Geometry:
    fmt = spec.row_format
    return Geometry(spec.world_size, spec.num_layers, spec.num_blocks, spec.block_size, fmt.width, fmt.name,
                    spec.nbytes)


class PoolHeader:
    """One backend's header: its 16-byte magic, then this module's layout (`TAG`, creator,
    geometry). The rest of the header page is free for the backend, below `RANKS_OFFSET`."""

    def __init__(self, magic: bytes) -> None:
        if len(magic) != 16:
            raise ValueError(f"magic must be 16 bytes, got {len(magic)}")
        self.magic = magic
        self._struct = struct.Struct(_IDENTITY.format + "qqqqq32sq")
        assert self._struct.size <= RANKS_OFFSET

    @property
    def size(self) -> int:
        return self._struct.size

    def pack(self, spec: HostPoolSpec, creator: Creator) -> bytes:
        g = geometry_of(spec)
        return self._struct.pack(self.magic, TAG, creator.pid, creator.start, creator.pidns, g.world_size,
                                 g.num_layers, g.num_blocks, g.block_size, g.width, g.row_format.encode(), g.nbytes)

    def unpack(self, raw: bytes) -> tuple[Creator, Geometry]:
        f = self._struct.unpack(raw[:self.size])
        fmt = f[10].rstrip(b"\0").decode(errors="replace")
        return Creator(f[2], f[3], f[4]), Geometry(f[5], f[6], f[7], f[8], f[9], fmt, f[11])


@dataclass(frozen=True, slots=True)
class Found:
    """What `inspect` found at a path.

    `kind`: "absent"; "pool" (this layout and this backend's magic: `creator` and `geometry` set);
    "other" (a hisparse pool of another backend or an earlier version: `creator` set where it can be
    read); "foreign" (not a hisparse pool file at all: `detail` says what it is).
    """

    kind: str
    inode: int = 0
    size: int = 0
    creator: Creator | None = None
    geometry: Geometry | None = None
    detail: str = ""


def _identity(raw: bytes) -> tuple[bytes, Creator | None]:
    """(magic, creator) of any hisparse pool header (either layout); creator None if not one."""
    magic = raw[:16]
    if len(raw) >= _IDENTITY.size and raw[16:24] == TAG:
        _, _, pid, start, pidns = _IDENTITY.unpack(raw[:_IDENTITY.size])
        return magic, Creator(pid, start, pidns)
    if magic in LEGACY_MAGICS and len(raw) >= 24:
        return magic, Creator(struct.unpack("<q", raw[16:24])[0], 0, 0)
    return magic, None


def creator_of(path: str) -> Creator | None:
    """The creator named by the file at `path` if it is a hisparse pool file of this layout, else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        raw = os.pread(fd, _IDENTITY.size, 0)
    finally:
        os.close(fd)
    return _identity(raw)[1] if raw[16:24] == TAG else None


def inspect(path: str, header: PoolHeader) -> Found:
    """Read what is at `path` without changing anything."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return Found("absent")
    except OSError as exc:
        return Found("foreign", detail=f"cannot be opened ({exc.strerror})")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return Found("foreign", st.st_ino, detail="not a regular file")
        raw = os.pread(fd, header.size, 0)
    finally:
        os.close(fd)
    magic, creator = _identity(raw)
    if creator is None:
        what = f"{st.st_size} bytes, starting {raw[:16]!r}" if raw else "an empty file"
        return Found("foreign", st.st_ino, st.st_size, detail=what)
    if magic != header.magic or len(raw) < header.size or raw[16:24] != TAG:
        version = "an earlier hisparse version" if magic in LEGACY_MAGICS else "another hisparse backend or version"
        return Found("other", st.st_ino, st.st_size, creator, detail=f"a pool of {version} (magic {magic!r})")
    found_creator, geometry = header.unpack(raw)
    return Found("pool", st.st_ino, st.st_size, found_creator, geometry)


@contextlib.contextmanager
def _locked(fd: int) -> Iterator[None]:
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def _links(path: str, fd: int) -> bool:
    """Whether `path` names the very file open as `fd`."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_ino, st.st_dev) == (own.st_ino, own.st_dev)


def _unlink_locked(path: str, fd: int) -> bool:
    """Remove `path` if it still names the file open as `fd`; True if removed. Caller holds the lock."""
    if not _links(path, fd):
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _remove_if_stale(path: str) -> Creator | None:
    """Remove the hisparse pool file at `path` if its creator is dead; returns that creator."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None
        _, creator = _identity(os.pread(fd, _IDENTITY.size, 0))
        if creator is None or creator.state() != "dead":
            return None
        with _locked(fd):
            return creator if _unlink_locked(path, fd) else None
    finally:
        os.close(fd)


def sweep_stale(directory: str = SHM_DIR) -> dict[str, Creator]:
    """Remove every hisparse pool file in `directory` whose creator is dead (see the module
    docstring for what is never removed); returns path -> its dead creator."""
    removed: dict[str, Creator] = {}
    try:
        names = [n for n in os.listdir(directory) if n.startswith(FILE_PREFIX)]
    except OSError:
        return removed
    for n in names:
        path = os.path.join(directory, n)
        creator = _remove_if_stale(path)
        if creator is not None:
            removed[path] = creator
            logger.warning("removed %s, a shared host pool file left behind by dead %s", path, creator.describe())
    return removed


def check_world_size(spec: HostPoolSpec) -> None:
    if spec.world_size > MAX_WORLD_SIZE:
        raise InvalidInputError(f"shared host pool {spec.name!r}: world_size={spec.world_size} is more ranks than "
                                f"the pool header's rank table holds; expected at most {MAX_WORLD_SIZE}")


class PoolFile:
    """This process's descriptor of one shared pool file (rank 0's from `create`, a peer's from
    `attach`). The backend maps `fd` (at `HEADER_PAGE` for the rows), then calls `publish`
    (rank 0) or `mark_mapped` (a peer), and `close` at release. A finalizer closes it at
    interpreter exit if `close` was never called."""

    def __init__(self, fd: int, path: str, spec: HostPoolSpec, *, creator: Creator, owner: bool,
                 named_tmp: str | None = None) -> None:
        self.fd = fd
        self.path = path
        self.spec = spec
        self.creator = creator
        self.owner = owner  # rank 0: removes the name at close whatever the peers did
        self.inode = os.fstat(fd).st_ino
        self._named_tmp = named_tmp  # fallback where O_TMPFILE is not supported
        self._finalizer = weakref.finalize(self, _close, fd, path, owner, creator, os.getpid(), named_tmp)

    @property
    def linked(self) -> bool:
        """Whether the pool's name still leads to this file (False once every rank mapped it)."""
        return self._finalizer.alive and _links(self.path, self.fd)

    def publish(self) -> None:
        """Rank 0: give the built file its name, then mark rank 0 mapped (a pool of one rank is
        never named at all)."""
        if self.spec.world_size > 1:
            self._link()
        if self._named_tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._named_tmp)
            self._named_tmp = None
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _close, self.fd, self.path, self.owner, self.creator,
                                               os.getpid(), None)
        self.mark_mapped(0)

    def _link(self) -> None:
        for _ in range(2):
            try:
                if self._named_tmp is not None:
                    os.link(self._named_tmp, self.path)
                else:
                    dir_fd = os.open(os.path.dirname(self.path), os.O_RDONLY | os.O_DIRECTORY)
                    try:
                        os.link(f"/proc/self/fd/{self.fd}", os.path.basename(self.path), dst_dir_fd=dir_fd,
                                follow_symlinks=True)
                    finally:
                        os.close(dir_fd)
                return
            except FileExistsError:
                # A file appeared since `create` looked: stale (removed, so try again) or taken.
                if _remove_if_stale(self.path) is None:
                    refuse_taken(self.path, self.spec, _inspect_any(self.path))
        raise InvalidInputError(f"shared host pool {self.spec.name!r} ({self.path}) kept reappearing while "
                                "rank 0 published it; expected one rank 0 per pool name")

    def mark_mapped(self, rank: int) -> None:
        """Record that `rank` has mapped the file; the rank that completes the table removes the name."""
        n = self.spec.world_size
        with _locked(self.fd):
            table = bytearray(os.pread(self.fd, n, RANKS_OFFSET))
            if table[rank]:
                raise ProtocolError(
                    f"shared host pool {self.spec.name!r} ({self.path}): rank {rank} has already mapped it; "
                    f"expected each rank 0..{n - 1} once (two processes claim rank {rank}, or this is an "
                    "earlier deployment's pool): give every rank of a deployment its own rank and a fresh name")
            table[rank] = 1
            os.pwrite(self.fd, bytes(table[rank:rank + 1]), RANKS_OFFSET + rank)
            if all(table) and _unlink_locked(self.path, self.fd):
                logger.debug("shared host pool %s: every rank mapped it; the name is removed", self.path)

    def missing_ranks(self) -> list[int]:
        table = os.pread(self.fd, self.spec.world_size, RANKS_OFFSET)
        return [r for r, mapped in enumerate(table) if not mapped]

    def close(self) -> None:
        """Release: rank 0 (or any rank, once the creator is dead) removes a name still left, and
        the descriptor is closed. Idempotent; the mappings live on until they are unmapped."""
        self._finalizer()


def _close(fd: int, path: str, owner: bool, creator: Creator, pid: int, named_tmp: str | None) -> None:
    if os.getpid() != pid:
        return  # a forked child inherited the finalizer: the file is its parent's business
    try:
        if owner or creator.state() == "dead":
            with _locked(fd):
                _unlink_locked(path, fd)
        if named_tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(named_tmp)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def _inspect_any(path: str) -> Found:
    """`inspect` without knowing the backend's magic: "absent", "other" or "foreign"."""
    return inspect(path, PoolHeader(b"\0" * 16))


def refuse_taken(path: str, spec: HostPoolSpec, found: Found) -> None:
    """Before creating: raise unless `path` is free (stale files are swept before this is asked)."""
    if found.kind == "absent":
        return
    if found.kind == "foreign":
        raise InvalidInputError(
            f"shared host pool {spec.name!r}: {path} exists and is not a hisparse pool ({found.detail}); "
            f"expected no file there: remove it (rm {path}) or choose another pool name")
    assert found.creator is not None
    state = found.creator.state()
    if state == "dead":
        return  # removed by the caller
    where = "live" if state == "alive" else "another pid namespace's"
    raise InvalidInputError(
        f"shared host pool {spec.name!r} ({path}) is in use by {where} process {found.creator.pid}; "
        f"expected a name no running instance uses: choose another pool name, or stop that process")


def create(path: str, header: PoolHeader, spec: HostPoolSpec, file_bytes: int) -> PoolFile:
    """Rank 0: sweep stale files, then build an unnamed file of `file_bytes` with the header written.

    Raises `InvalidInputError` if the name is taken by a live pool or by a file that is not a
    hisparse pool, `CapacityError` if /dev/shm cannot hold the file.
    """
    check_world_size(spec)
    sweep_stale(os.path.dirname(path))
    refuse_taken(path, spec, _inspect_any(path))
    _remove_if_stale(path)
    creator = Creator.current()
    folder = os.path.dirname(path)
    named_tmp = None
    try:
        fd = os.open(folder, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except (OSError, AttributeError) as exc:
        if isinstance(exc, OSError) and exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
        named_tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(named_tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        try:
            os.ftruncate(fd, file_bytes)
        except OSError as exc:
            raise CapacityError(f"shared host pool {spec.name!r}: could not size {path} to {file_bytes} bytes "
                                f"in {folder}: {exc.strerror}") from exc
        os.pwrite(fd, header.pack(spec, creator), 0)
        return PoolFile(fd, path, spec, creator=creator, owner=True, named_tmp=named_tmp)
    except BaseException:
        os.close(fd)
        if named_tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(named_tmp)
        raise


def attach(path: str, header: PoolHeader, spec: HostPoolSpec, file_bytes: int, timeout_s: float,
           sleep: Callable[[float], None] | None = None) -> PoolFile:
    """A peer: wait for rank 0 to publish the pool at `path`, check it, and open it.

    Fails fast, with what was found and the remedy, where waiting cannot help: a file that is not a
    hisparse pool, one of another backend or version, another geometry or size, a creator that
    died after publishing. Stale files of dead creators present before this call are swept first;
    one at this very `path` means rank 0 published this pool and died before this peer started
    (the vLLM connector names every pool after a fresh engine id, so an earlier run does not leave
    one there): the peer fails at once, saying so, instead of waiting `timeout_s` for a rank 0 that
    is gone. (Started again, with the file gone, it waits as usual.)
    """
    check_world_size(spec)
    swept = sweep_stale(os.path.dirname(path))
    if (dead := swept.get(path)) is not None:
        raise ProtocolError(
            f"rank {spec.rank}: rank 0 ({dead.describe()}) published the shared host pool {spec.name!r} at {path} "
            "and is dead (it died before this rank started; its file was removed): restart the deployment (every "
            "rank); if that file was left by an earlier run under the same pool name, start this rank again")
    want = geometry_of(spec)
    pause = sleep or time.sleep
    deadline = time.monotonic() + timeout_s
    while True:
        found = inspect(path, header)
        if found.kind == "foreign":
            raise InvalidInputError(
                f"rank {spec.rank}: {path} is not a hisparse shared pool ({found.detail}); remove it "
                f"(rm {path}) and restart rank 0, or give every rank another pool name")
        if found.kind == "other":
            raise InvalidInputError(
                f"rank {spec.rank}: {path} holds {found.detail}, not this backend's pool; expected every rank "
                "to run the same hisparse version and backend")
        if found.kind == "pool":
            assert found.creator is not None and found.geometry is not None
            if found.creator.state() == "dead":
                removed = _remove_if_stale(path)
                raise ProtocolError(
                    f"rank {spec.rank}: rank 0 ({found.creator.describe()}) published the shared host pool "
                    f"{spec.name!r} at {path} and died before this rank mapped it"
                    f"{'; its file was removed' if removed else ''}: restart the deployment (every rank)")
            if found.geometry != want:
                raise InvalidInputError(
                    f"rank {spec.rank}: the shared host pool {spec.name!r} at {path} was created by "
                    f"{found.creator.describe()} with {found.geometry.describe()}; this rank expected "
                    f"{want.describe()}: give every rank the same pool geometry")
            if found.size != file_bytes:
                raise InvalidInputError(
                    f"rank {spec.rank}: {path} has {found.size} bytes; a pool of this geometry has {file_bytes}: "
                    f"the file is damaged or not from this hisparse version; remove it (rm {path}) and restart")
            opened = _open_if_same(path, found.inode)
            if opened is not None:
                return PoolFile(opened, path, spec, creator=found.creator, owner=False)
        if time.monotonic() > deadline:
            raise ProtocolError(
                f"rank {spec.rank} waited {timeout_s}s for rank 0 to publish the shared host pool {spec.name!r} "
                f"at {path}, and no file appeared: start rank 0 with the same pool name, or check that it "
                "did not fail")
        pause(0.01)


def _open_if_same(path: str, inode: int) -> int | None:
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    if os.fstat(fd).st_ino != inode:  # replaced between the look and the open: look again
        os.close(fd)
        return None
    return fd
