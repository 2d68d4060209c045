"""NIXL transport of the P/D host import (`pip install 'hisparse[nixl]'`, pinning nixl==1.5.1).

Importing this module does not import NIXL; the first agent does, and a missing NIXL raises
`BackendUnavailableError` with the install hint.

- `NixlPrefillServer`: the prefill side. Registers every layer's KV pages, publishes a
  `PrefillHandshake` carrying the agent's connection metadata, hands out per-request
  `RemotePrefill`s, and collects the decoder's `ReadNotice`s (pages it may free). Reads are
  one-sided: the decoder's NIC/UCX pulls the bytes; the server only keeps the registration alive.
- `NixlDecoderTransport`: the decoder side, an `ImportTransport`. Registers the host pool (as
  DRAM) and an optional staging buffer at construction, loads peers' metadata from handshakes,
  and posts READs.

Metadata travels inside the handshake (no listener thread, no metadata server): whoever carries
`PrefillHandshake.to_bytes()` from prefill to decoder (a side channel, the router, a test pipe)
is the only rendezvous.
"""

from __future__ import annotations

import itertools
import logging
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType
from typing import Any

import torch

from hisparse_core.errors import BackendUnavailableError, InvalidInputError, ProtocolError
from hisparse_core.geometry import RowFormat
from hisparse_core.host_pool import HostPool
from hisparse_core.pd.errors import ImportTransferError
from hisparse_core.pd.handshake import KvRegion, PrefillHandshake, RemotePrefill
from hisparse_core.pd.messages import ReadNotice
from hisparse_core.pd.plan import Descriptor
from hisparse_core.pd.staging import StagingBuffer
from hisparse_core.pd.transport import ImportTransport, PeerTable, ReadHandle, ReadState, ReadStatus, TransportStats

logger = logging.getLogger(__name__)

NIXL_VERSION = "1.5.1"
_INSTALL_HINT = f"pip install 'hisparse[nixl]' (nixl=={NIXL_VERSION})"


def load_nixl() -> ModuleType:
    """`nixl._api`, imported on first use. Raises `BackendUnavailableError` if NIXL is missing."""
    try:
        import nixl._api as api  # noqa: PLC0415 - optional extra, imported lazily on purpose
    except ImportError as e:
        raise BackendUnavailableError(f"NIXL is not importable ({e}); install it with {_INSTALL_HINT}") from None
    try:
        found = metadata.version("nixl")
    except metadata.PackageNotFoundError:
        found = "unknown"
    if found != NIXL_VERSION:
        logger.warning("nixl %s is installed; hisparse is tested with nixl==%s", found, NIXL_VERSION)
    return api


def nixl_available() -> str | None:
    """None when NIXL can be imported here, else the reason."""
    try:
        load_nixl()
    except BackendUnavailableError as e:
        return str(e)
    return None


@dataclass(frozen=True, slots=True)
class NixlConfig:
    """- `backends`: NIXL backend plugins to instantiate (UCX moves DRAM and VRAM).
    - `num_threads`: UCX worker threads (0: the plugin's default).
    - `progress_thread`: run NIXL's progress thread. It busy-polls a core, so None (the default)
      means: off on the decoder, whose receiver drives progress on every `poll`; on for a prefill
      server, which otherwise needs its owner to call `progress()` every engine step (needed
      when the transport makes the target serve reads, as UCX's tcp does)."""

    backends: tuple[str, ...] = ("UCX",)
    num_threads: int = 0
    progress_thread: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.backends, tuple) or not self.backends or not all(
                isinstance(b, str) and b for b in self.backends):
            raise InvalidInputError(f"NixlConfig.backends must be a non-empty tuple of names, got {self.backends!r}")
        if isinstance(self.num_threads, bool) or not isinstance(self.num_threads, int) or self.num_threads < 0:
            raise InvalidInputError(f"NixlConfig.num_threads must be an int >= 0, got {self.num_threads!r}")
        if self.progress_thread is not None and not isinstance(self.progress_thread, bool):
            raise InvalidInputError(f"NixlConfig.progress_thread must be a bool or None, got {self.progress_thread!r}")


def _mem_type(t: torch.Tensor) -> str:
    return "DRAM" if t.device.type == "cpu" else "VRAM"


def _span(t: torch.Tensor) -> Descriptor:
    """The bytes a (possibly strided) tensor spans, as one descriptor."""
    if t.numel() == 0:
        raise InvalidInputError("cannot register an empty tensor")
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return (t.data_ptr(), (last + 1) * t.element_size(), t.device.index or 0)


class _Agent:
    """One NIXL agent and the memory it registered; `close` undoes both."""

    def __init__(self, role: str, config: NixlConfig, *, default_progress_thread: bool) -> None:
        api = load_nixl()
        self.name = f"hisparse-{role}-{uuid.uuid4().hex[:12]}"
        progress = default_progress_thread if config.progress_thread is None else config.progress_thread
        cfg = api.nixl_agent_config(enable_prog_thread=progress, backends=list(config.backends),
                                    num_threads=config.num_threads)
        self.agent: Any = api.nixl_agent(self.name, cfg)
        missing = [b for b in config.backends if b not in self.agent.backends]
        if missing:
            raise BackendUnavailableError(f"NIXL agent {self.name!r} could not instantiate backend(s) {missing}; "
                                          f"available plugins: {self.agent.get_plugin_list()}")
        self._registrations: list[Any] = []
        logger.info("NIXL agent %s up with backends %s (UCX_TLS=%s); progress thread %s", self.name,
                    list(config.backends), os.environ.get("UCX_TLS", "<UCX default>"),
                    "on" if progress else "off: progress is driven by poll()/progress() calls")

    def progress(self) -> dict[str, list[bytes]]:
        """Drive the backend once (what the progress thread would do); returns new notifications."""
        return self.agent.get_new_notifs()

    def register(self, spans: Sequence[Descriptor], mem_type: str) -> None:
        descs = self.agent.get_reg_descs([(a, n, dev, "") for a, n, dev in spans], mem_type)
        self.agent.register_memory(descs)
        self._registrations.append(descs)

    @property
    def num_registrations(self) -> int:
        return len(self._registrations)

    def close(self) -> None:
        while self._registrations:
            descs = self._registrations.pop()
            try:
                self.agent.deregister_memory(descs)
            except Exception as e:  # noqa: BLE001 - report every NIXL failure by name, keep closing
                logger.error("NIXL agent %s: deregistering memory failed: %s: %s", self.name, type(e).__name__, e)
        self.agent = None


class NixlPrefillServer:
    """The prefill side: registers its KV pages and serves the decoder's reads.

    `kv_layers[l]` is layer l's page tensor `[num_pages, block_size, width]` of
    `row_format.dtype`, with every page's rows dense (any page stride). `epoch` must grow each
    time the engine restarts and registers again.
    """

    def __init__(self, engine_id: str, epoch: int, kv_layers: Sequence[torch.Tensor], *, block_size: int,
                 row_format: RowFormat, config: NixlConfig | None = None) -> None:
        regions = _describe_layers(kv_layers, block_size, row_format)
        self.engine_id = engine_id
        self.epoch = epoch
        self._layers = list(kv_layers)  # keep the pages alive while they are registered
        self._agent = _Agent(f"prefill-{engine_id}-e{epoch}", config or NixlConfig(), default_progress_thread=True)
        try:
            for t in kv_layers:
                self._agent.register([_span(t)], _mem_type(t))
            metadata = self._agent.agent.get_agent_metadata()
            self._handshake = PrefillHandshake(engine_id, epoch, self._agent.name, metadata, block_size,
                                               row_format.name, row_format.row_bytes, regions)
        except BaseException:
            self._agent.close()
            raise
        self._outstanding: set[str] = set()
        self._notices: list[ReadNotice] = []
        logger.info("prefill %s serving %d layers x %d pages (%.1f MiB registered)", self._handshake.describe(),
                    len(regions), self._handshake.num_pages,
                    sum(_span(t)[1] for t in kv_layers) / (1 << 20))

    def handshake(self) -> PrefillHandshake:
        return self._handshake

    def remote_prefill(self, request_id: str, page_ids: Sequence[int], num_tokens: int) -> RemotePrefill:
        """The per-request parameters a decoder needs; the pages stay readable until the decoder's
        notice (see `take_notices`)."""
        self._require_open()
        remote = RemotePrefill(request_id, self.engine_id, self.epoch, tuple(page_ids), num_tokens)
        n = self._handshake.num_pages
        bad = [p for p in remote.page_ids if p >= n]
        if bad:
            raise InvalidInputError(f"request {request_id!r} names pages {bad} beyond the {n} registered pages")
        self._outstanding.add(request_id)
        return remote

    @property
    def num_registrations(self) -> int:
        return self._agent.num_registrations

    @property
    def outstanding(self) -> frozenset[str]:
        """Requests handed out and not yet released by a decoder notice."""
        return frozenset(self._outstanding)

    def progress(self) -> None:
        """Drive the transport once and collect the decoders' notices. Call it every engine step
        when the agent runs without a progress thread (`NixlConfig.progress_thread=False`)."""
        self._require_open()
        for sender, messages in self._agent.progress().items():
            for raw in messages:
                try:
                    notice = ReadNotice.from_bytes(raw)
                except Exception as e:  # noqa: BLE001 - a malformed notice is logged, not fatal
                    logger.warning("prefill %s: ignoring a malformed notice from %s: %s", self.engine_id, sender, e)
                    continue
                self._outstanding.discard(notice.request_id)
                self._notices.append(notice)

    def take_notices(self) -> list[ReadNotice]:
        """Notices received since the last call; their requests' pages may be freed."""
        self.progress()
        out, self._notices = self._notices, []
        return out

    @property
    def closed(self) -> bool:
        return self._agent.agent is None

    def close(self) -> None:
        """Deregister the pages and drop the agent; a decoder's later reads fail. Idempotent."""
        if self.closed:
            return
        self._agent.close()
        self._layers.clear()
        logger.info("prefill %s@epoch%d stopped serving (%d request(s) never released)", self.engine_id,
                    self.epoch, len(self._outstanding))

    def _require_open(self) -> None:
        if self.closed:
            raise InvalidInputError(f"prefill server {self.engine_id!r} epoch {self.epoch} is closed")

    def __enter__(self) -> NixlPrefillServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _describe_layers(kv_layers: Sequence[torch.Tensor], block_size: int, row_format: RowFormat) -> tuple[KvRegion, ...]:
    if not kv_layers:
        raise InvalidInputError("kv_layers must hold one page tensor per layer; got none")
    regions = []
    for layer, t in enumerate(kv_layers):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[1:] != (block_size, row_format.width):
            raise InvalidInputError(
                f"kv_layers[{layer}] must be [num_pages, {block_size}, {row_format.width}], got "
                f"{tuple(getattr(t, 'shape', ()))}")
        if t.dtype != row_format.dtype:
            raise InvalidInputError(f"kv_layers[{layer}] is {t.dtype}; expected {row_format.dtype}")
        if t.stride(2) != 1 or t.stride(1) != row_format.width or t.stride(0) < block_size * row_format.width:
            raise InvalidInputError(f"kv_layers[{layer}] pages must each be dense rows; got strides {t.stride()}")
        regions.append(KvRegion(layer, t.data_ptr(), t.shape[0], t.stride(0) * t.element_size(), _mem_type(t),
                                t.device.index or 0))
    return tuple(regions)


class NixlDecoderTransport(ImportTransport):
    """The decoder side: the host pool (and staging buffer) registered with NIXL, reads to peers."""

    def __init__(self, host_pool: HostPool, *, staging: StagingBuffer | None = None,
                 config: NixlConfig | None = None) -> None:
        self._agent = _Agent("decode", config or NixlConfig(), default_progress_thread=False)
        self._local: list[tuple[int, int, str]] = []  # (start, end, mem type) of each registered region
        try:
            views = host_pool.layer_views()
            spans = [_span(v) for v in views]
            self._agent.register(spans, "DRAM")
            self._local += [(a, a + n, "DRAM") for a, n, _ in spans]
            if staging is not None:
                a, n, dev = _span(staging.tensor)
                self._agent.register([(a, n, dev)], staging.mem_type)
                self._local.append((a, a + n, staging.mem_type))
        except BaseException:
            self._agent.close()
            raise
        self._peers = PeerTable()
        self._remote_names: dict[str, str] = {}  # engine id -> loaded NIXL agent name
        self._live: dict[int, ReadHandle] = {}
        self._ids = itertools.count()
        self._posted = self._bytes = self._released = 0
        logger.info("decoder NIXL agent %s registered the host pool as DRAM (%d layers, %.1f MiB)%s",
                    self._agent.name, len(views), host_pool.nbytes / (1 << 20),
                    "" if staging is None else f" and a {staging.nbytes / (1 << 20):.1f} MiB "
                                               f"{staging.mem_type} staging buffer")

    @property
    def agent_name(self) -> str:
        return self._agent.name

    # -- peers ------------------------------------------------------------------------------

    def add_peer(self, handshake: PrefillHandshake) -> PrefillHandshake | None:
        self._require_open()
        is_new, replaced = self._peers.admit(handshake)
        if not is_new:
            return None
        if replaced is not None:
            self._unload(replaced.engine_id)
        try:
            loaded = self._agent.agent.add_remote_agent(handshake.agent_metadata)
        except Exception as e:  # noqa: BLE001 - NIXL raises plain exceptions; name them
            raise ProtocolError(f"NIXL rejected the agent metadata of {handshake.describe()}: "
                                f"{type(e).__name__}: {e}") from None
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != handshake.agent_name:
            self._agent.agent.remove_remote_agent(loaded)
            raise ProtocolError(f"handshake of {handshake.engine_id!r} names agent {handshake.agent_name!r} but its "
                                f"metadata is for agent {loaded!r}; expected the same agent")
        self._peers.put(handshake)
        self._remote_names[handshake.engine_id] = loaded
        logger.info("decoder %s connected to %s%s", self._agent.name, handshake.describe(),
                    "" if replaced is None else f", replacing epoch {replaced.epoch}")
        return replaced

    def remove_peer(self, engine_id: str) -> None:
        if self._peers.get(engine_id) is not None:
            self._unload(engine_id)

    def peer(self, engine_id: str) -> PrefillHandshake | None:
        return self._peers.get(engine_id)

    def _unload(self, engine_id: str) -> None:
        self._peers.pop(engine_id)
        name = self._remote_names.pop(engine_id, None)
        if name is not None and self._agent.agent is not None:
            try:
                self._agent.agent.remove_remote_agent(name)
            except Exception as e:  # noqa: BLE001
                logger.warning("removing NIXL peer %s failed: %s: %s", name, type(e).__name__, e)

    # -- reads ------------------------------------------------------------------------------

    def post_read(self, engine_id: str, local: Sequence[Descriptor], remote: Sequence[Descriptor]) -> ReadHandle:
        self._require_open()
        handshake = self._peers.get(engine_id)
        name = self._remote_names.get(engine_id)
        if handshake is None or name is None:
            raise ImportTransferError(f"no NIXL peer for prefill engine {engine_id!r}; expected add_peer first")
        if len(local) != len(remote) or not local:
            raise InvalidInputError(f"read needs as many local as remote descriptors (>0); got {len(local)} and "
                                    f"{len(remote)}")
        for i, (a, b) in enumerate(zip(local, remote, strict=True)):
            if a[1] != b[1]:
                raise InvalidInputError(f"descriptor {i}: local length {a[1]} != remote length {b[1]}")
        mem_local = self._local_mem_type(local)
        mem_remote = handshake.regions[0].mem_type
        agent = self._agent.agent
        try:
            local_list = agent.get_xfer_descs(list(local), mem_local)
            remote_list = agent.get_xfer_descs(list(remote), mem_remote)
            xfer = agent.initialize_xfer("READ", local_list, remote_list, name)
        except Exception as e:  # noqa: BLE001
            raise ImportTransferError(f"NIXL refused a read from {handshake.describe()}: {type(e).__name__}: {e}") \
                from None
        try:
            state = agent.transfer(xfer)
        except Exception as e:  # noqa: BLE001
            self._release_xfer(xfer)
            raise ImportTransferError(f"posting a read from {engine_id!r} failed: {type(e).__name__}: {e}") from None
        if state == "ERR":
            self._release_xfer(xfer)
            raise ImportTransferError(f"posting a read from {engine_id!r} failed: NIXL state ERR")
        handle = ReadHandle(next(self._ids), engine_id, handshake.epoch, sum(d[1] for d in local), xfer)
        self._live[handle.read_id] = handle
        self._posted += 1
        self._bytes += handle.nbytes
        return handle

    def _local_mem_type(self, local: Sequence[Descriptor]) -> str:
        """The memory type of the registered region every local descriptor lies in."""
        kinds = set()
        for addr, length, _ in local:
            for start, end, kind in self._local:
                if start <= addr and addr + length <= end:
                    kinds.add(kind)
                    break
            else:
                raise InvalidInputError(f"local descriptor [{addr:#x}, +{length}) is outside every region "
                                        f"{self._agent.name} registered; expected host pool or staging memory")
        if len(kinds) != 1:
            raise InvalidInputError(f"one read's local descriptors span memory types {sorted(kinds)}; expected one")
        return kinds.pop()

    def check(self, handle: ReadHandle) -> ReadStatus:
        if handle.read_id not in self._live:
            raise ProtocolError(f"read {handle.read_id} is not live on {self._agent.name}")
        try:
            state = self._agent.agent.check_xfer_state(handle.token)
        except Exception as e:  # noqa: BLE001 - e.g. nixlRemoteDisconnectError when the peer died
            return ReadStatus(ReadState.FAILED, f"{type(e).__name__}: {e}")
        if state == "DONE":
            return ReadStatus(ReadState.DONE)
        if state == "PROC":
            return ReadStatus(ReadState.IN_FLIGHT)
        return ReadStatus(ReadState.FAILED, f"NIXL transfer state {state}")

    def release(self, handle: ReadHandle) -> bool:
        if handle.read_id not in self._live:
            return True
        if not self._release_xfer(handle.token):
            return False
        del self._live[handle.read_id]
        self._released += 1
        return True

    def _release_xfer(self, xfer: Any) -> bool:
        try:
            self._agent.agent.release_xfer_handle(xfer)
        except Exception as e:  # noqa: BLE001 - NIXL could not cancel it (yet)
            logger.warning("NIXL could not release transfer %r yet: %s: %s", xfer, type(e).__name__, e)
            return False
        return True

    def progress(self) -> None:
        if self.closed:
            return
        for sender, messages in self._agent.progress().items():
            logger.debug("decoder %s ignores %d notification(s) from %s", self._agent.name, len(messages), sender)

    def notify(self, engine_id: str, notice: ReadNotice) -> bool:
        name = self._remote_names.get(engine_id)
        if name is None or self._agent.agent is None:
            return False
        try:
            self._agent.agent.send_notif(name, notice.to_bytes())
        except Exception as e:  # noqa: BLE001
            logger.info("notice to %r failed: %s: %s", engine_id, type(e).__name__, e)
            return False
        return True

    # -- lifecycle --------------------------------------------------------------------------

    @property
    def live_reads(self) -> int:
        return len(self._live)

    @property
    def num_registrations(self) -> int:
        return self._agent.num_registrations

    def stats(self) -> TransportStats:
        return TransportStats(self._posted, self._bytes, self._released, len(self._peers))

    @property
    def closed(self) -> bool:
        return self._agent.agent is None

    def close(self) -> None:
        if self.closed:
            return
        for engine_id in self._peers.engine_ids():  # disconnect first: nothing can land after this
            self._unload(engine_id)
        for handle in list(self._live.values()):
            if not self.release(handle):
                logger.error("closing %s with read %d still in flight; NIXL would not cancel it",
                             self._agent.name, handle.read_id)
        self._live.clear()
        self._agent.close()

    def _require_open(self) -> None:
        if self.closed:
            raise InvalidInputError("NIXL decoder transport is closed")

    def __enter__(self) -> NixlDecoderTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
