"""What the import path needs from a transport (NIXL today), and the peer table it keeps.

The receiver speaks only this interface: post a one-sided READ of remote byte ranges into local
registered ones, check it, release it (cancelling it if still in flight), and notify the peer.
Descriptors are `(address, length, device id)` tuples built by `hisparse_core.pd.plan`.
"""

from __future__ import annotations

import enum
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from hisparse_core.errors import ProtocolError
from hisparse_core.pd.errors import StaleHandshakeError
from hisparse_core.pd.handshake import PrefillHandshake
from hisparse_core.pd.messages import ReadNotice
from hisparse_core.pd.plan import Descriptor

logger = logging.getLogger(__name__)


class ReadState(enum.Enum):
    IN_FLIGHT = "in_flight"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class ReadStatus:
    state: ReadState
    error: str | None = None


@dataclass(frozen=True, slots=True, eq=False)
class ReadHandle:
    """One posted read. `token` is the transport's own handle object."""

    read_id: int
    engine_id: str
    epoch: int
    nbytes: int
    token: object


@dataclass(frozen=True, slots=True)
class TransportStats:
    reads_posted: int
    bytes_posted: int
    reads_released: int
    peers: int


class ImportTransport(ABC):
    """A decoder-side transport: local memory registered at construction, peers added by handshake."""

    @abstractmethod
    def add_peer(self, handshake: PrefillHandshake) -> PrefillHandshake | None:
        """Connect to a prefill engine. Returns the handshake it replaced (an older epoch of the same
        engine), if any. Raises `StaleHandshakeError` for an epoch older than the one held."""

    @abstractmethod
    def remove_peer(self, engine_id: str) -> None:
        """Disconnect from an engine (no-op if unknown). Reads still in flight to it fail."""

    @abstractmethod
    def peer(self, engine_id: str) -> PrefillHandshake | None:
        """The handshake held for an engine, or None."""

    @abstractmethod
    def post_read(self, engine_id: str, local: Sequence[Descriptor], remote: Sequence[Descriptor]) -> ReadHandle:
        """Start reading `remote[i]` into `local[i]`. Raises `ImportTransferError` when the transport
        refuses or the peer is gone; then nothing is in flight."""

    @abstractmethod
    def check(self, handle: ReadHandle) -> ReadStatus:
        """Non-blocking state of a posted read."""

    @abstractmethod
    def release(self, handle: ReadHandle) -> bool:
        """Free a read's resources, cancelling it if still in flight. Returns False (and keeps the
        handle) if the transport cannot cancel it yet: its destination may still be written, so the
        caller must not reuse that memory and should retry later."""

    def progress(self) -> None:  # noqa: B027 - optional: a transport with its own thread keeps this no-op
        """Drive the transport once (the receiver calls it on every `poll`). A transport with its
        own progress thread needs nothing here."""

    @abstractmethod
    def notify(self, engine_id: str, notice: ReadNotice) -> bool:
        """Tell the peer it may free a request's pages. Best effort: False if it could not be sent."""

    @abstractmethod
    def stats(self) -> TransportStats: ...

    @abstractmethod
    def close(self) -> None:
        """Release every read, peer, registration and the agent. Idempotent."""


class PeerTable:
    """Handshakes by engine id, with the generation rules every transport applies."""

    def __init__(self) -> None:
        self._peers: dict[str, PrefillHandshake] = {}

    def admit(self, handshake: PrefillHandshake) -> tuple[bool, PrefillHandshake | None]:
        """Check `handshake` against the one held for its engine.

        Returns `(is_new, replaced)`: `is_new` is False when the same handshake is already held;
        `replaced` is the older generation it supersedes. Raises `StaleHandshakeError` for an older
        epoch and `ProtocolError` for a different handshake under the same epoch. Changes nothing.
        """
        held = self._peers.get(handshake.engine_id)
        if held is None:
            return True, None
        if handshake.epoch < held.epoch:
            raise StaleHandshakeError(
                f"handshake from {handshake.engine_id!r} has epoch {handshake.epoch}, older than the held epoch "
                f"{held.epoch}; expected epoch >= {held.epoch} (a restarted engine publishes a newer one)")
        if handshake.epoch == held.epoch:
            if handshake == held:
                return False, None
            raise ProtocolError(
                f"handshake from {handshake.engine_id!r} epoch {handshake.epoch} differs from the one held for that "
                f"epoch (agent {held.agent_name!r} vs {handshake.agent_name!r}); expected a new epoch for a new "
                f"registration")
        return True, held

    def put(self, handshake: PrefillHandshake) -> None:
        self._peers[handshake.engine_id] = handshake

    def pop(self, engine_id: str) -> PrefillHandshake | None:
        return self._peers.pop(engine_id, None)

    def get(self, engine_id: str) -> PrefillHandshake | None:
        return self._peers.get(engine_id)

    def engine_ids(self) -> list[str]:
        return list(self._peers)

    def __len__(self) -> int:
        return len(self._peers)
