"""Static configuration of the scheduler-side coordinator, and the host-pool sizing derived from it."""

from __future__ import annotations

from dataclasses import dataclass

from hisparse_core.errors import InvalidInputError
from hisparse_core.units import significant

GIB = 1 << 30


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidInputError(f"CoordinatorConfig.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    """What the coordinator needs to know about the model, the host budget and the policy.

    - `host_pool_gib`: usable host-cache capacity per data-parallel replica (not per node).
    - `num_layers`: sparse-attention layers whose KV lives in the host pool.
    - `block_size`: tokens per page; host, resident and hot pages alike.
    - `row_bytes`: bytes of one token's row in one layer (656 for fp8_ds_mla).
    - `max_model_len`: longest request; the pool must hold one plus the active tail.
    - `num_resident_groups`: resident GPU cache groups; each page has one GPU block per group.
    - `hot_blocks_per_request`: GPU blocks a request's hot buffer leases once it reads from host;
      0 where attention reads resident pages only (no hot buffer is leased).
    - `active_tail_pages`: the newest pages of a request are never released (upstream uses 2).
    - `stride_alignment`: the host block stride is rounded up to this many bytes (the OS page for
      a shared pool, 1 for a private one) before dividing the budget.
    - `pressure_watermark_blocks`: free GPU blocks below which the policy starts releasing clean
      pages; None means max(hot_blocks_per_request, 10% of the GPU pool).
    - `max_releases_per_step`: bound on pages released in one step, so a pressure spike costs a
      few steps of bounded work instead of one long stall.
    - `enabled`: with False the coordinator builds no command and tracks nothing.
    """

    host_pool_gib: float
    num_layers: int
    block_size: int
    row_bytes: int
    max_model_len: int
    hot_blocks_per_request: int
    num_resident_groups: int = 1
    active_tail_pages: int = 2
    stride_alignment: int = 1
    pressure_watermark_blocks: int | None = None
    max_releases_per_step: int = 256
    enabled: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.host_pool_gib, bool) or not isinstance(self.host_pool_gib, int | float) \
                or not self.host_pool_gib > 0:
            raise InvalidInputError(f"CoordinatorConfig.host_pool_gib must be a positive number, got "
                                    f"{self.host_pool_gib!r}")
        for name in ("num_layers", "block_size", "row_bytes", "max_model_len", "num_resident_groups",
                     "stride_alignment", "max_releases_per_step"):
            _positive(name, getattr(self, name))
        hot = self.hot_blocks_per_request
        if isinstance(hot, bool) or not isinstance(hot, int) or hot < 0:
            raise InvalidInputError(f"CoordinatorConfig.hot_blocks_per_request must be an int >= 0, got {hot!r}")
        if isinstance(self.active_tail_pages, bool) or not isinstance(self.active_tail_pages, int) \
                or self.active_tail_pages < 1:
            raise InvalidInputError(f"CoordinatorConfig.active_tail_pages must be an int >= 1, got "
                                    f"{self.active_tail_pages!r}")
        if self.pressure_watermark_blocks is not None:
            w = self.pressure_watermark_blocks
            if isinstance(w, bool) or not isinstance(w, int) or w < 0:
                raise InvalidInputError(f"CoordinatorConfig.pressure_watermark_blocks must be an int >= 0 "
                                        f"or None, got {w!r}")
        if not isinstance(self.enabled, bool):
            raise InvalidInputError(f"CoordinatorConfig.enabled must be a bool, got {self.enabled!r}")

    @property
    def host_block_stride(self) -> int:
        """Bytes of one host block over every sparse layer, rounded up to `stride_alignment`.

        Same arithmetic as `HostPoolSpec.blocks_for_budget`, kept here so the scheduler process
        does not import torch.
        """
        raw = self.num_layers * self.block_size * self.row_bytes
        a = self.stride_alignment
        return -(-raw // a) * a

    @property
    def host_budget_bytes(self) -> int:
        return int(self.host_pool_gib * GIB)

    @property
    def host_num_blocks(self) -> int:
        """Whole host blocks the budget holds, the null block included."""
        return self.host_budget_bytes // self.host_block_stride

    @property
    def max_pages_per_request(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def min_host_blocks(self) -> int:
        """Usable blocks (null excluded) needed for one `max_model_len` request plus the active tail."""
        return self.max_pages_per_request + self.active_tail_pages

    def watermark_for(self, num_gpu_blocks: int) -> int:
        if self.pressure_watermark_blocks is not None:
            return self.pressure_watermark_blocks
        return max(self.hot_blocks_per_request, num_gpu_blocks // 10)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def least_gib(need_bytes: int) -> float:
    """The smallest size in GiB, written with 4 significant digits, whose whole bytes (`int(gib *
    GIB)`, as `host_budget_bytes` takes them) reach `need_bytes` > 0: what a "too small" line can
    suggest and have accepted when it is given back."""
    gib = significant(need_bytes / GIB, up=True)
    while int(gib * GIB) < need_bytes:  # float rounding of the product: the next 4-digit size
        gib = significant(gib * (1 + 1e-4), up=True)
    return gib
