"""The import plan: which prefill pages go to which host blocks, per layer.

Pure arithmetic on validated inputs; nothing here touches memory or a transport. A plan is built
once per request from the prefill handshake, the request's `RemotePrefill` and the host blocks
the coordinator leased, and every index is checked against what each side actually holds before
any descriptor exists. Consecutive pages that are contiguous on both sides are merged into one
`PageRun`, so a request whose pages are contiguous costs one descriptor per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hisparse_core.errors import InvalidCommandError, InvalidInputError
from hisparse_core.host_pool import HostPool, HostPoolSpec
from hisparse_core.pd.errors import DescriptorRangeError, StaleHandshakeError
from hisparse_core.pd.handshake import PrefillHandshake, RemotePrefill

#: A transport descriptor: (address, length in bytes, device id).
Descriptor = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class PageRun:
    """`num_pages` consecutive pages of one layer: prefill pages `remote_page..` land in host
    blocks `host_block..`, contiguous on both sides."""

    layer: int
    remote_page: int
    host_block: int
    num_pages: int

    def __post_init__(self) -> None:
        for name in ("layer", "remote_page", "host_block"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidCommandError(f"PageRun.{name} must be an int >= 0, got {v!r}")
        if isinstance(self.num_pages, bool) or not isinstance(self.num_pages, int) or self.num_pages < 1:
            raise InvalidCommandError(f"PageRun.num_pages must be an int >= 1, got {self.num_pages!r}")


@dataclass(frozen=True, slots=True)
class HostLayout:
    """Addresses of the decoder's host pool: layer l's row 0 is at `layer_bases[l]`, and host
    block b of layer l starts `b * block_size * row_bytes` bytes after it."""

    layer_bases: tuple[int, ...]
    num_blocks: int
    block_size: int
    row_bytes: int

    @classmethod
    def of_pool(cls, pool: HostPool) -> HostLayout:
        views = pool.layer_views()
        for layer, view in enumerate(views):
            if not view.is_contiguous():
                raise InvalidInputError(f"host pool layer {layer} view is not contiguous; expected dense rows")
        spec = pool.spec
        return cls(tuple(v.data_ptr() for v in views), spec.num_blocks, spec.block_size, spec.row_format.row_bytes)

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.row_bytes

    @property
    def layer_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def block_address(self, layer: int, block: int) -> int:
        return self.layer_bases[layer] + block * self.block_bytes


@dataclass(frozen=True, slots=True)
class ImportPlan:
    """Every read one request's host import makes, as page runs in layer-major order."""

    request_id: str
    engine_id: str
    epoch: int
    num_tokens: int
    num_layers: int
    page_bytes: int
    remote_pages: tuple[int, ...]
    host_blocks: tuple[int, ...]
    runs: tuple[PageRun, ...]

    @property
    def num_pages(self) -> int:
        return len(self.host_blocks)

    @property
    def total_bytes(self) -> int:
        return self.num_layers * self.num_pages * self.page_bytes

    @property
    def tail_page(self) -> int:
        """Logical index of the last page (the one restored to the GPU after the import)."""
        return self.num_pages - 1

    @property
    def tail_host_block(self) -> int:
        return self.host_blocks[-1]

    def chunks(self, max_bytes: int) -> tuple[tuple[PageRun, ...], ...]:
        """The runs cut into chunks of at most `max_bytes` each (a staging buffer's capacity).

        Runs are split at page edges where needed; order is preserved.
        """
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < self.page_bytes:
            raise InvalidInputError(
                f"chunk capacity must be an int >= one page ({self.page_bytes} B), got {max_bytes!r}")
        cap = max_bytes // self.page_bytes
        chunks: list[tuple[PageRun, ...]] = []
        current: list[PageRun] = []
        room = cap
        for run in self.runs:
            done = 0
            while done < run.num_pages:
                take = min(room, run.num_pages - done)
                current.append(PageRun(run.layer, run.remote_page + done, run.host_block + done, take))
                done += take
                room -= take
                if room == 0:
                    chunks.append(tuple(current))
                    current, room = [], cap
        if current:
            chunks.append(tuple(current))
        return tuple(chunks)


def check_geometry(handshake: PrefillHandshake, spec: HostPoolSpec) -> None:
    """Raise `InvalidCommandError` unless the prefill pages and the host pool have one geometry."""
    mine = (spec.num_layers, spec.block_size, spec.row_format.name, spec.row_format.row_bytes)
    theirs = (handshake.num_layers, handshake.block_size, handshake.row_format, handshake.row_bytes)
    if mine != theirs:
        raise InvalidCommandError(
            f"prefill {handshake.engine_id!r} pages are (layers, block_size, row_format, row_bytes)={theirs}; "
            f"the decoder host pool expects {mine}")


def build_import_plan(handshake: PrefillHandshake, remote: RemotePrefill, spec: HostPoolSpec,
                      host_blocks: Sequence[int]) -> ImportPlan:
    """Plan `remote`'s import into `host_blocks` (one per logical page, in page order).

    Raises `StaleHandshakeError` if the request names another engine generation than the
    handshake, `DescriptorRangeError` for a prefill page or host block outside what its side
    holds, and `InvalidCommandError` for a geometry or length mismatch. Nothing is posted here.
    """
    rid = remote.request_id
    if remote.engine_id != handshake.engine_id:
        raise InvalidCommandError(
            f"request {rid!r} was prefilled by {remote.engine_id!r}; the handshake is for {handshake.engine_id!r}")
    if remote.epoch != handshake.epoch:
        raise StaleHandshakeError(
            f"request {rid!r} names {remote.engine_id!r} epoch {remote.epoch}, but the decoder holds the handshake "
            f"of epoch {handshake.epoch}; expected the same generation (re-handshake with the prefill engine)")
    check_geometry(handshake, spec)
    pages = remote.page_ids
    want = -(-remote.num_tokens // spec.block_size)
    if len(pages) != want:
        raise InvalidCommandError(
            f"request {rid!r} has {len(pages)} prefill pages for {remote.num_tokens} tokens; expected "
            f"cdiv({remote.num_tokens}, {spec.block_size}) = {want}")
    blocks = tuple(host_blocks)
    if len(blocks) != len(pages):
        raise InvalidCommandError(
            f"request {rid!r} got {len(blocks)} host blocks for {len(pages)} pages; expected one per page")
    for i, b in enumerate(blocks):
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < spec.num_blocks:
            raise DescriptorRangeError(
                f"request {rid!r} host block {b!r} (page {i}) is outside the host pool; expected "
                f"0 <= block < {spec.num_blocks}")
    if len(set(blocks)) != len(blocks):
        raise InvalidCommandError(f"request {rid!r} host blocks repeat a block: {blocks}")
    for region in handshake.regions:
        for i, p in enumerate(pages):
            if p >= region.num_pages:
                raise DescriptorRangeError(
                    f"request {rid!r} page {i} names prefill page {p}, but {handshake.engine_id!r} registered "
                    f"{region.num_pages} pages in layer {region.layer}; expected 0 <= page < {region.num_pages}")
    runs: list[PageRun] = []
    for region in handshake.regions:
        dense = region.page_stride == handshake.page_bytes
        start = 0
        for i in range(1, len(pages) + 1):
            if (i < len(pages) and dense and pages[i] == pages[i - 1] + 1 and blocks[i] == blocks[i - 1] + 1):
                continue
            runs.append(PageRun(region.layer, pages[start], blocks[start], i - start))
            start = i
    return ImportPlan(rid, remote.engine_id, remote.epoch, remote.num_tokens, handshake.num_layers,
                      handshake.page_bytes, pages, blocks, tuple(runs))


def remote_descriptors(handshake: PrefillHandshake, runs: Sequence[PageRun]) -> list[Descriptor]:
    """The prefill-side byte ranges of `runs`, one descriptor per run."""
    out: list[Descriptor] = []
    for run in runs:
        region = handshake.regions[run.layer]
        if run.remote_page + run.num_pages > region.num_pages:
            raise DescriptorRangeError(
                f"run of prefill pages [{run.remote_page}, {run.remote_page + run.num_pages}) in layer {run.layer} "
                f"exceeds the {region.num_pages} pages {handshake.engine_id!r} registered")
        length = (run.num_pages - 1) * region.page_stride + handshake.page_bytes
        out.append((region.page_address(run.remote_page), length, region.device_id))
    return out


def host_descriptors(layout: HostLayout, runs: Sequence[PageRun]) -> list[Descriptor]:
    """The host-pool byte ranges of `runs`, one descriptor per run."""
    out: list[Descriptor] = []
    for run in runs:
        if not 0 <= run.layer < len(layout.layer_bases):
            raise DescriptorRangeError(f"run layer {run.layer} is outside the host pool's "
                                       f"{len(layout.layer_bases)} layers")
        if run.host_block + run.num_pages > layout.num_blocks:
            raise DescriptorRangeError(
                f"run of host blocks [{run.host_block}, {run.host_block + run.num_pages}) exceeds the host pool's "
                f"{layout.num_blocks} blocks")
        out.append((layout.block_address(run.layer, run.host_block), run.num_pages * layout.block_bytes, 0))
    return out


def staging_descriptors(base_address: int, capacity: int, page_bytes: int, runs: Sequence[PageRun],
                        device_id: int = 0) -> list[Descriptor]:
    """Byte ranges of `runs` packed back to back into a staging buffer at `base_address`."""
    out: list[Descriptor] = []
    offset = 0
    for run in runs:
        length = run.num_pages * page_bytes
        if offset + length > capacity:
            raise InvalidInputError(f"chunk of {offset + length} B exceeds the staging capacity of {capacity} B")
        out.append((base_address + offset, length, device_id))
        offset += length
    return out
