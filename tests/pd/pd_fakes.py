"""An in-process `ImportTransport` that really moves bytes (ctypes.memmove between registered
tensors) and lets a test decide when a peer hangs, fails or refuses. It also records the one
thing the receiver must never do: cancel a read that is in flight to a peer still connected (its
late write could land in a host block already handed to someone else)."""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hisparse_core.geometry import FP8_DS_MLA, RowFormat
from hisparse_core.pd.errors import ImportTransferError
from hisparse_core.pd.handshake import KvRegion, PrefillHandshake, RemotePrefill
from hisparse_core.pd.messages import ReadNotice
from hisparse_core.pd.plan import Descriptor
from hisparse_core.pd.transport import ImportTransport, PeerTable, ReadHandle, ReadState, ReadStatus, TransportStats


class MemPrefill:
    """A prefill engine in this process: random KV pages and their handshake."""

    def __init__(self, engine_id: str, num_layers: int, num_pages: int, block_size: int, *, epoch: int = 1,
                 fmt: RowFormat = FP8_DS_MLA) -> None:
        self.engine_id, self.epoch, self.block_size = engine_id, epoch, block_size
        self.layers = [torch.randint(0, 256, (num_pages, block_size, fmt.row_bytes), dtype=torch.uint8)
                       for _ in range(num_layers)]
        regions = tuple(KvRegion(i, t.data_ptr(), num_pages, t.stride(0)) for i, t in enumerate(self.layers))
        self.handshake = PrefillHandshake(engine_id, epoch, f"mem-{engine_id}-{epoch}", b"mem", block_size,
                                          fmt.name, fmt.row_bytes, regions)

    def remote(self, rid: str, pages: Sequence[int], num_tokens: int) -> RemotePrefill:
        return RemotePrefill(rid, self.engine_id, self.epoch, tuple(pages), num_tokens)

    def pages(self, pages: Sequence[int]) -> torch.Tensor:
        idx = torch.tensor(list(pages))
        return torch.stack([t[idx] for t in self.layers])


@dataclass
class _Read:
    engine_id: str
    local: list[Descriptor]
    remote: list[Descriptor]
    done: bool = False


@dataclass
class MemTransport(ImportTransport):
    hung: set[str] = field(default_factory=set)        # reads to these engines stay in flight
    failing: dict[str, str] = field(default_factory=dict)  # reads to these engines end FAILED
    refusing: dict[str, str] = field(default_factory=dict)  # posts to these engines raise
    unsafe_cancels: list[int] = field(default_factory=list)
    notices: list[tuple[str, ReadNotice]] = field(default_factory=list)
    max_in_flight_seen: int = 0

    def __post_init__(self) -> None:
        self._peers = PeerTable()
        self._reads: dict[int, _Read] = {}
        self._ids = itertools.count()
        self._posted = self._bytes = self._released = 0
        self._closed = False

    def add_peer(self, handshake: PrefillHandshake) -> PrefillHandshake | None:
        is_new, replaced = self._peers.admit(handshake)
        if is_new:
            self._peers.put(handshake)
        return replaced

    def remove_peer(self, engine_id: str) -> None:
        self._peers.pop(engine_id)

    def peer(self, engine_id: str) -> PrefillHandshake | None:
        return self._peers.get(engine_id)

    def post_read(self, engine_id: str, local: Sequence[Descriptor], remote: Sequence[Descriptor]) -> ReadHandle:
        hs = self._peers.get(engine_id)
        if hs is None:
            raise ImportTransferError(f"no peer {engine_id!r}")
        if engine_id in self.refusing:
            raise ImportTransferError(self.refusing[engine_id])
        rid = next(self._ids)
        self._reads[rid] = _Read(engine_id, list(local), list(remote))
        self._posted += 1
        nbytes = sum(d[1] for d in local)
        self._bytes += nbytes
        self.max_in_flight_seen = max(self.max_in_flight_seen, sum(not r.done for r in self._reads.values()))
        return ReadHandle(rid, engine_id, hs.epoch, nbytes, rid)

    def check(self, handle: ReadHandle) -> ReadStatus:
        read = self._reads[handle.read_id]
        if read.engine_id in self.failing:
            read.done = True
            return ReadStatus(ReadState.FAILED, self.failing[read.engine_id])
        if read.engine_id in self.hung or self._peers.get(read.engine_id) is None:
            return ReadStatus(ReadState.IN_FLIGHT)
        if not read.done:
            for (la, n, _), (ra, m, _) in zip(read.local, read.remote, strict=True):
                assert n == m
                ctypes.memmove(la, ra, n)
            read.done = True
        return ReadStatus(ReadState.DONE)

    def release(self, handle: ReadHandle) -> bool:
        read = self._reads.pop(handle.read_id, None)
        if read is None:
            return True
        held = self._peers.get(read.engine_id)
        if not read.done and held is not None and held.epoch == handle.epoch:
            self.unsafe_cancels.append(handle.read_id)
        self._released += 1
        return True

    def notify(self, engine_id: str, notice: ReadNotice) -> bool:
        self.notices.append((engine_id, notice))
        return True

    def stats(self) -> TransportStats:
        return TransportStats(self._posted, self._bytes, self._released, len(self._peers))

    @property
    def live_reads(self) -> int:
        return len(self._reads)

    def close(self) -> None:
        for engine_id in self._peers.engine_ids():
            self._peers.pop(engine_id)
        self._reads.clear()
        self._closed = True


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now
