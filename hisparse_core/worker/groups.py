"""Which caches a worker serves, and the host pool geometry that follows from them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hisparse_core.errors import CapacityError, InvalidInputError
from hisparse_core.geometry import RowFormat, RuntimeConfig
from hisparse_core.host_pool import HostPoolSpec


@dataclass(frozen=True, slots=True)
class CacheGroup:
    """One per-cache runtime of a worker: an index group of `config.num_layers` layers.

    `resident_group` selects which entry of `RowMirror.source_starts` and
    `PageTransfer.resident_block_ids` addresses this group's device caches (several groups may
    share one resident group when their layers share block ids, as every attention layer of one
    vLLM KV-cache group does). `name` is for logs and error messages only.

    The worker gives group i the host-pool layers that follow group i-1's, in order, so the pool
    has `sum(g.config.num_layers)` layers.
    """

    config: RuntimeConfig
    resident_group: int = 0
    name: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.config, RuntimeConfig):
            raise InvalidInputError(f"CacheGroup.config must be a RuntimeConfig, got {type(self.config).__name__}")
        if isinstance(self.resident_group, bool) or not isinstance(self.resident_group, int) \
                or self.resident_group < 0:
            raise InvalidInputError(f"CacheGroup.resident_group must be an int >= 0, got {self.resident_group!r}")


def check_groups(groups: Sequence[CacheGroup]) -> tuple[CacheGroup, ...]:
    """Validate a worker's groups: at least one, and one block size and row format for all of
    them (the host pool is a single layer-major buffer of one row format)."""
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence) or not groups:
        raise InvalidInputError(f"groups must be a non-empty sequence of CacheGroup, got {groups!r}")
    for i, g in enumerate(groups):
        if not isinstance(g, CacheGroup):
            raise InvalidInputError(f"groups[{i}] must be a CacheGroup, got {type(g).__name__}")
    first = groups[0].config
    for i, g in enumerate(groups[1:], start=1):
        if g.config.block_size != first.block_size:
            raise InvalidInputError(
                f"groups[{i}] ({g.name or 'unnamed'}) has block_size={g.config.block_size}; expected "
                f"{first.block_size} like groups[0]: one host pool serves every group")
        if g.config.row_format != first.row_format:
            raise InvalidInputError(
                f"groups[{i}] ({g.name or 'unnamed'}) has row format {g.config.row_format.name!r}; expected "
                f"{first.row_format.name!r} like groups[0]: one host pool serves every group")
    return tuple(groups)


def host_layer_ranges(groups: Sequence[CacheGroup]) -> list[range]:
    """The host-pool layers of each group, consecutive in group order."""
    out: list[range] = []
    start = 0
    for g in groups:
        out.append(range(start, start + g.config.num_layers))
        start += g.config.num_layers
    return out


def host_blocks_for_budget(budget_bytes: int, num_layers: int, block_size: int, row_format: RowFormat) -> int:
    """Whole host blocks a byte budget holds; `CapacityError` if not even one fits.

    The scheduler sizes its logical host block pool with the same function, so both sides agree
    on the block count without talking to each other.
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise InvalidInputError(f"host pool budget must be a positive number of bytes, got {budget_bytes!r}")
    blocks = HostPoolSpec.blocks_for_budget(budget_bytes, num_layers, block_size, row_format)
    if blocks < 1:
        stride = num_layers * block_size * row_format.row_bytes
        raise CapacityError(
            f"host pool budget of {budget_bytes} bytes holds no block; one block of {num_layers} layers x "
            f"{block_size} rows x {row_format.row_bytes} B needs {stride} bytes")
    return blocks
