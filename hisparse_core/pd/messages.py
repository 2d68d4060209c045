"""Wire types of a host import between the decoder's scheduler and its worker, and the notice the
decoder sends the prefill side when it is done with a request's pages.

- `HostImportJob` (scheduler to worker): read this request's prefill pages into these host blocks.
- `RecvReport` (worker to scheduler): receives that finished, and receives that failed with a
  reason (`FailedRecv`). Each request is reported once.
- `ReadNotice` (decoder to prefill): the decoder no longer reads the request's pages; the prefill
  side may free them. `ok` says whether the import succeeded.

Frozen, slotted, validated on construction; `to_dict` / `from_dict` round-trip through JSON.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

from hisparse_core.errors import InvalidCommandError
from hisparse_core.pd.errors import StaleHandshakeError
from hisparse_core.pd.handshake import PD_PROTOCOL_VERSION, RemotePrefill


def _ints(owner: str, name: str, values: object) -> None:
    if not isinstance(values, tuple) or not values:
        raise InvalidCommandError(f"{owner}.{name} must be a non-empty tuple of ints")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise InvalidCommandError(f"{owner}.{name} must hold ints >= 0, got {v!r}")


@dataclass(frozen=True, slots=True)
class HostImportJob:
    """Read `remote`'s pages into `host_blocks` (one per logical page, in page order)."""

    remote: RemotePrefill
    host_blocks: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.remote, RemotePrefill):
            raise InvalidCommandError(f"HostImportJob.remote must be a RemotePrefill, got {type(self.remote).__name__}")
        _ints("HostImportJob", "host_blocks", self.host_blocks)
        if len(self.host_blocks) != len(self.remote.page_ids):
            raise InvalidCommandError(
                f"HostImportJob for {self.remote.request_id!r} has {len(self.host_blocks)} host blocks for "
                f"{len(self.remote.page_ids)} prefill pages; expected one per page")

    @property
    def request_id(self) -> str:
        return self.remote.request_id

    def to_dict(self) -> dict[str, Any]:
        return {"remote": self.remote.to_dict(), "host_blocks": list(self.host_blocks)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Self:
        try:
            return cls(RemotePrefill.from_dict(d["remote"]), tuple(d["host_blocks"]))
        except KeyError as e:
            raise InvalidCommandError(f"HostImportJob: missing field {e.args[0]!r}") from None


@dataclass(frozen=True, slots=True)
class FailedRecv:
    """One request whose import failed, and why (for logs and the engine's error path)."""

    request_id: str
    reason: str

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidCommandError(f"FailedRecv.request_id must be a non-empty str, got {self.request_id!r}")
        if not isinstance(self.reason, str) or not self.reason:
            raise InvalidCommandError(f"FailedRecv.reason must be a non-empty str, got {self.reason!r}")


@dataclass(frozen=True, slots=True)
class RecvReport:
    """Receives that ended since the last report. A request is in at most one of the two."""

    finished: tuple[str, ...] = ()
    failed: tuple[FailedRecv, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.finished, tuple) or not all(isinstance(x, str) and x for x in self.finished):
            raise InvalidCommandError("RecvReport.finished must be a tuple of request ids")
        if not isinstance(self.failed, tuple) or not all(isinstance(x, FailedRecv) for x in self.failed):
            raise InvalidCommandError("RecvReport.failed must be a tuple of FailedRecv")
        ids = [*self.finished, *(f.request_id for f in self.failed)]
        if len(ids) != len(set(ids)):
            raise InvalidCommandError(f"RecvReport names a request twice: {sorted(ids)}")

    def is_empty(self) -> bool:
        return not (self.finished or self.failed)

    def merge(self, other: RecvReport) -> RecvReport:
        return RecvReport(self.finished + other.finished, self.failed + other.failed)

    @property
    def failed_ids(self) -> tuple[str, ...]:
        return tuple(f.request_id for f in self.failed)

    def to_dict(self) -> dict[str, Any]:
        return {"finished": list(self.finished),
                "failed": [{"request_id": f.request_id, "reason": f.reason} for f in self.failed]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Self:
        return cls(tuple(d.get("finished", ())),
                   tuple(FailedRecv(f["request_id"], f["reason"]) for f in d.get("failed", ())))


_NOTICE_KIND = "hisparse.pd.read_notice"


@dataclass(frozen=True, slots=True)
class ReadNotice:
    """Decoder to prefill: the decoder is done reading `request_id`'s pages (`ok`: it succeeded)."""

    request_id: str
    ok: bool
    version: int = PD_PROTOCOL_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidCommandError(f"ReadNotice.request_id must be a non-empty str, got {self.request_id!r}")
        if not isinstance(self.ok, bool):
            raise InvalidCommandError(f"ReadNotice.ok must be a bool, got {self.ok!r}")
        if self.version != PD_PROTOCOL_VERSION:
            raise StaleHandshakeError(f"ReadNotice has protocol version {self.version!r}; expected "
                                      f"{PD_PROTOCOL_VERSION}")

    def to_bytes(self) -> bytes:
        return json.dumps({"kind": _NOTICE_KIND, "version": self.version, "request_id": self.request_id,
                           "ok": self.ok}, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes) -> Self:
        try:
            d = json.loads(bytes(data).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise InvalidCommandError(f"ReadNotice.from_bytes: not a JSON document ({e})") from None
        if not isinstance(d, dict) or d.get("kind") != _NOTICE_KIND:
            raise InvalidCommandError(f"ReadNotice.from_bytes: not a read notice: {data[:80]!r}")
        if d.get("version") != PD_PROTOCOL_VERSION:
            raise StaleHandshakeError(f"ReadNotice has protocol version {d.get('version')!r}; expected "
                                      f"{PD_PROTOCOL_VERSION}")
        # Unchecked JSON values: __post_init__ rejects a missing or mistyped one with its own message.
        request_id: Any = d.get("request_id")
        ok: Any = d.get("ok")
        return cls(request_id, ok, d["version"])
