"""The pinned host pool: where every request's full sparse-MLA KV lives."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import TracebackType

import torch

from hisparse_core.errors import InvalidInputError
from hisparse_core.geometry import FP8_DS_MLA, RowFormat

#: Shared pools round each block's stride up to the OS page so registrations split on block edges.
OS_PAGE = 4096


@dataclass(frozen=True, slots=True)
class HostPoolSpec:
    """What to allocate. The layout is layer-major: layer l is one contiguous region of
    `num_blocks * block_size` rows, so host row g of layer l is `base + (l * rows + g) * row_bytes`.

    `shared=True` asks for one physical pool shared by the tensor-parallel ranks of one node
    (`name` identifies it; `rank` 0 creates and writes it, the others map and read it).
    """

    num_layers: int
    num_blocks: int
    block_size: int
    row_format: RowFormat = FP8_DS_MLA
    shared: bool = False
    name: str | None = None
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        for field_name in ("num_layers", "num_blocks", "block_size", "world_size"):
            v = getattr(self, field_name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise InvalidInputError(f"HostPoolSpec.{field_name} must be a positive int, got {v!r}")
        if not 0 <= self.rank < self.world_size:
            raise InvalidInputError(f"HostPoolSpec.rank={self.rank} must be in [0, world_size={self.world_size})")
        if self.shared and not self.name:
            raise InvalidInputError("HostPoolSpec.shared=True needs a name that every rank agrees on")

    @property
    def rows_per_layer(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers (the logical block stride)."""
        return self.num_layers * self.block_size * self.row_format.row_bytes

    @property
    def nbytes(self) -> int:
        return self.num_layers * self.rows_per_layer * self.row_format.row_bytes

    @staticmethod
    def blocks_for_budget(budget_bytes: int, num_layers: int, block_size: int, row_format: RowFormat) -> int:
        """Whole blocks that fit a byte budget (the same in private and shared mode)."""
        stride = num_layers * block_size * row_format.row_bytes
        return budget_bytes // stride


class HostPool(ABC):
    """A host buffer the accelerator can read and write directly (pinned / registered).

    Created by `Backend.create_host_pool(spec)` in the worker process (`HiSparseWorker` owns its
    lifecycle). Per-layer views are handed to the runtimes; they stay valid until `release`.
    Contents are uninitialised until written. `release` is idempotent and must leave nothing
    behind (registrations, shared-memory files); a pool is also a context manager.
    """

    spec: HostPoolSpec

    @abstractmethod
    def layer_view(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s `[num_blocks * block_size, width]` rows of `spec.row_format.dtype`, on
        the CPU (a view, not a copy: writes through it are the pool's bytes).

        Raises `InvalidInputError` for a layer outside `[0, num_layers)` and on a released pool
        (`_check_layer` does both)."""

    @property
    def is_writer(self) -> bool:
        """True where this process writes the pool (always for private pools; rank 0 if shared)."""
        return not self.spec.shared or self.spec.rank == 0

    @property
    @abstractmethod
    def released(self) -> bool: ...

    @abstractmethod
    def release(self) -> None:
        """Unregister and free the buffer. Views must not be used afterwards.

        Called by `HiSparseWorker.shutdown` (and on leaving a `with` block). Idempotent, and
        leaves nothing behind (registrations, a shared pool's files)."""

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes

    def layer_views(self) -> list[torch.Tensor]:
        return [self.layer_view(layer) for layer in range(self.spec.num_layers)]

    def _check_layer(self, layer: int) -> None:
        if self.released:
            raise InvalidInputError("host pool was released; its views are gone")
        if not 0 <= layer < self.spec.num_layers:
            raise InvalidInputError(f"layer {layer} out of range; the pool has {self.spec.num_layers} layers")

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


class LayerMajorHostPool(HostPool):
    """A pool kept as one `[num_layers * rows_per_layer, width]` tensor: layer l is rows
    `[l * rows_per_layer, (l + 1) * rows_per_layer)`, as `HostPoolSpec` lays it out.

    A helper for backends, which allocate, register and free `_rows` themselves: set it in the
    constructor and to None in `release`. `_path` is the /dev/shm file of a shared pool this
    process created (None otherwise).
    """

    _rows: torch.Tensor | None
    _path: str | None

    def layer_view(self, layer: int) -> torch.Tensor:
        self._check_layer(layer)
        assert self._rows is not None
        n = self.spec.rows_per_layer
        return self._rows[layer * n:(layer + 1) * n]

    @property
    def released(self) -> bool:
        return self._rows is None

    @property
    def path(self) -> str | None:
        """The /dev/shm file of a shared pool created by this process (None otherwise)."""
        return self._path
