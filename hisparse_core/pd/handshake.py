"""Handshake metadata of the P/D import path: what a prefill instance tells a decoder.

Two wire types, both frozen, slotted, validated on construction and versioned:

- `PrefillHandshake`: once per prefill engine generation. Names the engine, its generation
  (`epoch`, bumped whenever the engine restarts and registers its pages again), the transport
  agent and its opaque connection metadata, the page geometry, and one `KvRegion` per layer.
- `RemotePrefill`: once per request (vLLM carries it in `kv_transfer_params`). Names the engine
  and generation that computed the request and the prefill page of each logical page.

Both serialise to JSON (`to_bytes` / `from_bytes`); the version is checked before anything
else is read, so a peer speaking another version is rejected with `StaleHandshakeError` rather
than misread. Nothing here imports the transport.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

from hisparse_core.errors import InvalidCommandError, a_or_an
from hisparse_core.pd.errors import StaleHandshakeError

#: Version of the handshake and request wire format. A peer with another version is rejected.
PD_PROTOCOL_VERSION = 1

#: Memory kinds a region may live in (the transport's names).
MEM_TYPES = frozenset({"DRAM", "VRAM"})

_HANDSHAKE_KIND = "hisparse.pd.prefill_handshake"
_REQUEST_KIND = "hisparse.pd.remote_prefill"


def _int(owner: str, name: str, value: object, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidCommandError(f"{owner}.{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise InvalidCommandError(f"{owner}.{name} must be >= {minimum}, got {value}")
    return value


def _str(owner: str, name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidCommandError(f"{owner}.{name} must be a non-empty str, got {value!r}")
    return value


def _check_version(owner: str, d: Mapping[str, Any], kind: str) -> None:
    if not isinstance(d, Mapping):
        raise InvalidCommandError(f"{owner}: expected a mapping, got {type(d).__name__}")
    if d.get("kind") != kind:
        raise InvalidCommandError(f"{owner}: kind is {d.get('kind')!r}; expected {kind!r}")
    version = d.get("version")
    if version != PD_PROTOCOL_VERSION:
        raise StaleHandshakeError(
            f"{owner} has protocol version {version!r}; this decoder speaks version {PD_PROTOCOL_VERSION}")


def _loads(owner: str, data: bytes) -> Mapping[str, Any]:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidCommandError(f"{owner}.from_bytes expects bytes, got {type(data).__name__}")
    try:
        return json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidCommandError(f"{owner}.from_bytes: not a JSON document ({e})") from None


@dataclass(frozen=True, slots=True)
class KvRegion:
    """One layer's KV pages on the prefill side, as registered with the transport.

    Page p of this layer occupies `[base_address + p * page_stride, + page_bytes)`, where
    `page_bytes` is the handshake's `block_size * row_bytes`.
    """

    layer: int
    base_address: int
    num_pages: int
    page_stride: int
    mem_type: str = "DRAM"
    device_id: int = 0

    def __post_init__(self) -> None:
        _int("KvRegion", "layer", self.layer)
        _int("KvRegion", "base_address", self.base_address, minimum=1)
        _int("KvRegion", "num_pages", self.num_pages, minimum=1)
        _int("KvRegion", "page_stride", self.page_stride, minimum=1)
        _int("KvRegion", "device_id", self.device_id)
        if self.mem_type not in MEM_TYPES:
            raise InvalidCommandError(f"KvRegion.mem_type is {self.mem_type!r}; expected one of {sorted(MEM_TYPES)}")

    def page_address(self, page: int) -> int:
        return self.base_address + page * self.page_stride

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "base_address": self.base_address, "num_pages": self.num_pages,
                "page_stride": self.page_stride, "mem_type": self.mem_type, "device_id": self.device_id}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Self:
        try:
            return cls(d["layer"], d["base_address"], d["num_pages"], d["page_stride"],
                       d.get("mem_type", "DRAM"), d.get("device_id", 0))
        except KeyError as e:
            raise InvalidCommandError(f"KvRegion: missing field {e.args[0]!r}") from None


@dataclass(frozen=True, slots=True)
class PrefillHandshake:
    """What a prefill engine publishes so a decoder can read its KV pages.

    - `engine_id`: stable name of the prefill engine (requests refer to it).
    - `epoch`: generation of this engine's registration; a restarted engine publishes a larger
      one, and a decoder rejects a request whose epoch differs from the handshake it holds.
    - `agent_name` / `agent_metadata`: the transport agent and its opaque connection blob.
    - `block_size`, `row_format`, `row_bytes`: page geometry; must equal the decoder's host pool.
    - `regions`: one per layer, in layer order.
    """

    engine_id: str
    epoch: int
    agent_name: str
    agent_metadata: bytes
    block_size: int
    row_format: str
    row_bytes: int
    regions: tuple[KvRegion, ...]
    version: int = PD_PROTOCOL_VERSION

    def __post_init__(self) -> None:
        owner = "PrefillHandshake"
        _str(owner, "engine_id", self.engine_id)
        _int(owner, "epoch", self.epoch)
        _str(owner, "agent_name", self.agent_name)
        if not isinstance(self.agent_metadata, bytes) or not self.agent_metadata:
            raise InvalidCommandError(f"{owner}.agent_metadata must be non-empty bytes, got "
                                      f"{type(self.agent_metadata).__name__}")
        _int(owner, "block_size", self.block_size, minimum=1)
        _str(owner, "row_format", self.row_format)
        _int(owner, "row_bytes", self.row_bytes, minimum=1)
        if self.version != PD_PROTOCOL_VERSION:
            raise StaleHandshakeError(
                f"{owner} has protocol version {self.version!r}; expected {PD_PROTOCOL_VERSION}")
        if not isinstance(self.regions, tuple) or not self.regions:
            raise InvalidCommandError(f"{owner}.regions must be a non-empty tuple of KvRegion (one per layer)")
        for i, region in enumerate(self.regions):
            if not isinstance(region, KvRegion):
                raise InvalidCommandError(f"{owner}.regions[{i}] is {a_or_an(type(region).__name__)}; expected KvRegion")
            if region.layer != i:
                raise InvalidCommandError(f"{owner}.regions[{i}] is for layer {region.layer}; expected layer {i}")
            if region.page_stride < self.page_bytes:
                raise InvalidCommandError(
                    f"{owner}.regions[{i}].page_stride={region.page_stride} is smaller than a page "
                    f"({self.page_bytes} bytes = block_size {self.block_size} * row_bytes {self.row_bytes})")

    @property
    def num_layers(self) -> int:
        return len(self.regions)

    @property
    def page_bytes(self) -> int:
        return self.block_size * self.row_bytes

    @property
    def num_pages(self) -> int:
        """Pages every layer holds (the smallest region, should they differ)."""
        return min(r.num_pages for r in self.regions)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": _HANDSHAKE_KIND, "version": self.version, "engine_id": self.engine_id,
                "epoch": self.epoch, "agent_name": self.agent_name,
                "agent_metadata": base64.b64encode(self.agent_metadata).decode("ascii"),
                "block_size": self.block_size, "row_format": self.row_format, "row_bytes": self.row_bytes,
                "regions": [r.to_dict() for r in self.regions]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Self:
        _check_version("PrefillHandshake", d, _HANDSHAKE_KIND)
        try:
            metadata = base64.b64decode(d["agent_metadata"], validate=True)
            return cls(d["engine_id"], d["epoch"], d["agent_name"], metadata, d["block_size"], d["row_format"],
                       d["row_bytes"], tuple(KvRegion.from_dict(r) for r in d["regions"]), d["version"])
        except KeyError as e:
            raise InvalidCommandError(f"PrefillHandshake: missing field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, InvalidCommandError):
                raise
            raise InvalidCommandError(f"PrefillHandshake: malformed field ({e})") from None

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes) -> Self:
        return cls.from_dict(_loads("PrefillHandshake", data))

    def describe(self) -> str:
        return (f"{self.engine_id}@epoch{self.epoch} (agent {self.agent_name!r}, {self.num_layers} layers x "
                f"{self.num_pages} pages of {self.page_bytes} B)")


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """Where one request's KV sits on the prefill side.

    `page_ids[i]` is the prefill page holding logical page i (tokens `[i*block_size,
    (i+1)*block_size)`) in every layer; there are `cdiv(num_tokens, block_size)` of them.
    """

    request_id: str
    engine_id: str
    epoch: int
    page_ids: tuple[int, ...]
    num_tokens: int
    version: int = PD_PROTOCOL_VERSION

    def __post_init__(self) -> None:
        owner = "RemotePrefill"
        _str(owner, "request_id", self.request_id)
        _str(owner, "engine_id", self.engine_id)
        _int(owner, "epoch", self.epoch)
        _int(owner, "num_tokens", self.num_tokens, minimum=1)
        if self.version != PD_PROTOCOL_VERSION:
            raise StaleHandshakeError(
                f"{owner} for {self.request_id!r} has protocol version {self.version!r}; expected "
                f"{PD_PROTOCOL_VERSION}")
        if not isinstance(self.page_ids, tuple) or not self.page_ids:
            raise InvalidCommandError(f"{owner}.page_ids must be a non-empty tuple of ints")
        for p in self.page_ids:
            _int(owner, "page_ids", p)
        if len(set(self.page_ids)) != len(self.page_ids):
            raise InvalidCommandError(f"{owner}.page_ids of {self.request_id!r} repeats a page: {self.page_ids}")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": _REQUEST_KIND, "version": self.version, "request_id": self.request_id,
                "engine_id": self.engine_id, "epoch": self.epoch, "page_ids": list(self.page_ids),
                "num_tokens": self.num_tokens}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Self:
        _check_version("RemotePrefill", d, _REQUEST_KIND)
        try:
            return cls(d["request_id"], d["engine_id"], d["epoch"], tuple(d["page_ids"]), d["num_tokens"],
                       d["version"])
        except KeyError as e:
            raise InvalidCommandError(f"RemotePrefill: missing field {e.args[0]!r}") from None
        except TypeError as e:
            raise InvalidCommandError(f"RemotePrefill: malformed field ({e})") from None

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes) -> Self:
        return cls.from_dict(_loads("RemotePrefill", data))
