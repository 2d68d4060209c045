"""Tensor-parallel ranks of one model replica: what they agree on, and what they exchange each step.

Under tensor parallelism (`tp_plan`, or processes that each run the replicated model on the same
batch) every rank runs its own generate loop, so every rank runs its own coordinator. The MLA
latent is the same on every rank (`kv_a_proj_with_mqa` is replicated), which is why the ranks can
map one shared host pool (`share_host_pool`): rank 0 writes the mirrors and spills, the peers'
engines write nothing and read after rank 0 (hisparse_core/worker/worker.py). One pool is only
right if every rank's coordinator makes the same decisions, host block ids included, so:

- at `enable`, the ranks compare what their pools would be (`agree`: geometry, backend, pool
  name); a rank that differs is named on every rank, in one line, before anything is allocated;
- rank 0 creates the pool before any peer maps it (`in_order`), so a peer never maps a file that
  rank 0 did not create for this run (a name in use by a live process fails on rank 0, and every
  peer reports rank 0's line instead of waiting or joining someone else's pool);
- after every step the ranks exchange their workers' reports (`exchange`) and every coordinator
  applies all of them, counted against every rank's workers: the same acknowledgements at the
  same step on every rank, so the same decisions. A transfer is complete only once rank 0 (the
  writer) has reported it, which also orders a peer's later reads of the pool after rank 0's writes.

The exchange is one small `all_gather_object` a step over a gloo group (the host-side reports;
the decode kernels are not involved).
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from hisparse_core.errors import CapacityError, HiSparseError, InvalidInputError, ProtocolError
from hisparse_core.shm import pid_alive
from hisparse_core.types import WorkerMetadata

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


@dataclass(frozen=True, slots=True)
class _Status:
    error: str | None = None
    kind: str = ""


class Ranks:
    """This process's place among the tensor-parallel ranks of one replica (see the module docstring).

    `group`: the torch.distributed process group the ranks exchange host objects over (gloo), or
    None for the default group. `pool_name`: the name of the shared pool (device 0's; further
    devices of a `device_map` add `_d<index>`), agreed by `agree`.
    """

    def __init__(self, rank: int, world_size: int, *, share_host_pool: bool, pool_name: str | None,
                 group: Any = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.share_host_pool = share_host_pool
        self.pool_name = pool_name
        self.group = group
        self.pids: list[int] = []          # every rank's process id (`agree`), to name a dead peer
        self.broken: str | None = None     # why the exchange failed; no collective is tried after it

    # ------------------------------------------------------------------ collectives

    def _gather(self, obj: T) -> list[T]:
        import torch.distributed as dist

        if self.broken is not None:
            raise ProtocolError(self.broken)
        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except Exception as exc:  # noqa: BLE001 - a peer gone: one line naming it, instead of gloo's
            dead = [f"rank {r} (pid {pid})" for r, pid in enumerate(self.pids) if r != self.rank and _gone(pid)]
            who = (f"tensor-parallel {', '.join(dead)} died" if dead else
                   "a tensor-parallel peer stopped answering (it failed or hangs)")
            self.broken = (f"rank {self.rank}: {who}, so this replica cannot go on ({_one_line(exc)}); restart every "
                           "rank (the shared host pool is freed with its last mapping: nothing is left in /dev/shm)")
            raise ProtocolError(self.broken) from None
        return out

    def agree(self, facts: dict[str, str]) -> None:
        """Every rank passes what its pool would be; raise (on every rank, naming the first rank that
        differs from rank 0 and the fact) unless all are equal. Fixes the pool name: rank 0's, or a
        fresh one rank 0 chose where none was given."""
        mine = dict(facts, pool_name=self.pool_name or "", pid=str(os.getpid()))
        if self.rank == 0 and self.share_host_pool and not self.pool_name:
            mine["chosen_name"] = f"hf_{os.getpid()}_{secrets.token_hex(4)}"
        everyone = self._gather(mine)
        self.pids = [int(e["pid"]) for e in everyone]
        ref = everyone[0]
        for r, got in enumerate(everyone[1:], start=1):
            for key, want in ref.items():
                if key in ("chosen_name", "pid"):
                    continue
                if got.get(key) != want:
                    raise InvalidInputError(
                        f"tensor-parallel rank {r} disagrees with rank 0 on the host pool: {key}={got.get(key)!r} on "
                        f"rank {r}, {want!r} on rank 0; expected every rank to call enable() with the same model, "
                        "budgets, sizes, backend and pool_name")
        if self.share_host_pool and not self.pool_name:
            self.pool_name = ref["chosen_name"]

    def in_order(self, build: Callable[[], T], cleanup: Callable[[T], None]) -> T:
        """`build()` on rank 0 first, then on the peers; if it fails on any rank, every rank raises:
        the failing rank its own error, the others one line naming that rank and its error (what
        was built elsewhere is cleaned up with `cleanup`)."""
        built: T | None = None
        own: Exception | None = None
        if self.rank == 0:
            try:
                built = build()
            except Exception as exc:  # noqa: BLE001 - reported to every rank, then raised here
                own = exc
        first = self._gather(_status(own))[0]
        if own is not None:
            raise own
        if first.error is not None:
            raise _as_error(first, "rank 0 could not create its hisparse engine, so this rank maps no pool: "
                                   f"{first.error}")
        if self.rank != 0:
            try:
                built = build()
            except Exception as exc:  # noqa: BLE001 - reported to every rank, then raised here
                own = exc
        everyone = self._gather(_status(own))
        if own is not None:
            raise own
        failed = next(((r, s) for r, s in enumerate(everyone) if s.error is not None), None)
        if failed is not None:
            if built is not None:
                cleanup(built)
            r, s = failed
            raise _as_error(s, f"tensor-parallel rank {r} could not create its hisparse engine: {s.error}")
        assert built is not None
        return built

    def exchange(self, reports: Sequence[WorkerMetadata]) -> list[WorkerMetadata]:
        """Every rank's workers' reports, rank 0's first."""
        return [m for rank_reports in self._gather(list(reports)) for m in rank_reports]

    def pool_for(self, device: int) -> str:
        assert self.pool_name is not None
        return self.pool_name if device == 0 else f"{self.pool_name}_d{device}"

    def describe(self) -> str:
        pool = f"one shared host pool {self.pool_name!r}, rank 0 writes" if self.share_host_pool else \
            "a private host pool per rank"
        return f"tensor-parallel rank {self.rank} of {self.world_size}: {pool}"


def _gone(pid: int) -> bool:
    """Whether process `pid` (on this host) has ended: gone, or a zombie not reaped yet."""
    if not pid_alive(pid):
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] in (b"Z", b"X")
    except OSError:
        return True


def _status(exc: BaseException | None) -> _Status:
    return _Status() if exc is None else _Status(_one_line(exc), type(exc).__name__)


def _as_error(status: _Status, message: str) -> HiSparseError:
    kind = {"ProtocolError": ProtocolError, "CapacityError": CapacityError}.get(status.kind, InvalidInputError)
    return kind(message)


_GLOO: dict[int, Any] = {}


def _gloo_group() -> Any:
    """A gloo group over every rank for the host-side exchange (made once per default group: a
    collective every rank reaches in `enable`)."""
    import torch.distributed as dist

    key = id(dist.group.WORLD)
    if key not in _GLOO:
        _GLOO[key] = dist.new_group(backend="gloo")
    return _GLOO[key]


def tensor_parallel(model: Any, tp: bool | None, share_host_pool: bool, pool_name: str | None) -> Ranks | None:
    """The ranks of this replica, or None for one process.

    `tp=None`: tensor parallel where the model was loaded with a `tp_plan` over more than one rank
    (transformers sets `model._tp_size`); True: the ranks of torch.distributed's default group are
    this replica's tensor-parallel ranks (each runs the same batch); False: one process, whatever
    torch.distributed says."""
    if tp is False:
        return None
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    size = int(getattr(model, "_tp_size", None) or 0)
    if tp is None and size <= 1:
        return None
    if not initialized:
        raise InvalidInputError("tp=True needs torch.distributed initialized (torchrun, or init_process_group) with "
                                "one process per tensor-parallel rank")
    world = dist.get_world_size()
    if tp is None and size != world:
        raise InvalidInputError(f"the model's tp_plan spans {size} ranks but torch.distributed has {world}; expected "
                                "one tensor-parallel group over every process")
    if world == 1:
        return None
    group = None if dist.get_backend() == "gloo" else _gloo_group()
    ranks = Ranks(dist.get_rank(), world, share_host_pool=share_host_pool, pool_name=pool_name, group=group)
    return ranks


__all__ = ["Ranks", "tensor_parallel"]
