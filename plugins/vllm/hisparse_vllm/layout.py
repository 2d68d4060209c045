"""How vLLM's KV caches map onto the hisparse host pool.

vLLM hands the worker one tensor per attention layer. On the CPU backend (layout "LBHNC") a layer
is `[num_blocks, num_kv_heads, block_size, 2 * head_size]`: each block (page) is contiguous, but
inside it the K and V rows of one token are spread over every head (head-major, K half then V
half). GPU layouts differ again. A token's K+V bytes of one layer are therefore *not* one
contiguous row in any vLLM layout, while a page of one layer is always one contiguous run of
`page_size_bytes`.

The mapping, used by both connector roles:

- Host pool row format: `uint8` rows of `row_bytes = page_size_bytes / block_size` bytes (named
  `vllm_page_<row_bytes>B`). Row `r` of a page is bytes `[r * row_bytes, (r + 1) * row_bytes)`
  of that page; it is NOT token r. Whole pages are the unit that means something.
- Host pool layers: every attention layer of every KV-cache group, in group order then layer
  order. One host block holds one page of every layer.
- Device view of a layer: the same bytes, viewed as `[num_blocks, block_size, row_bytes]`
  `uint8` (no copy), so page transfers copy exactly vLLM's page bytes.
- Resident group `g` is vLLM KV-cache group `g` (each page has one block id per group).

Consequences: page spills and restores are exact (they copy pages); row mirrors of a partial
page would copy page bytes, not token rows, so the worker side drops them and relies on the
spill of the sealed page, which copies the whole page (see `worker_side.py`). Only sealed,
spilled pages are ever published or loaded, so nothing reads a partially mirrored page.

Tensor parallelism: MLA caches (`MLAAttentionSpec`) are replicated across TP ranks, so every rank
holds the same pages and the ranks may share one physical pool (rank 0 writes) of the whole
`host_pool_gib`. Standard attention shards KV heads across ranks: each rank's page is a different
shard, so each rank keeps a private pool of `host_pool_gib / tp_size`; together they hold the
configured capacity, and every rank has the same number of host blocks (block ids are shared).

Only full-attention groups (`FullAttentionSpec`, `MLAAttentionSpec`) with one block size and one
page size are supported; anything else fails at start-up naming the group.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from hisparse_core import capacity
from hisparse_core.coordinator import CoordinatorConfig
from hisparse_core.errors import InvalidInputError
from hisparse_core.geometry import RowFormat, register_row_format
from hisparse_core.units import significant

_SUPPORTED_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")


@dataclass(frozen=True, slots=True)
class HostTierLayout:
    """The host-pool geometry of one engine's KV caches (the same in the scheduler and workers)."""

    block_size: int
    page_bytes: int  # one page of one layer
    num_device_blocks: int
    group_layers: tuple[tuple[str, ...], ...]  # layer names per vLLM KV-cache group
    replicated: bool = False  # every rank holds the same pages (MLA)
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.page_bytes % self.block_size:
            raise InvalidInputError(f"KV page of {self.page_bytes} bytes is not divisible by block_size="
                                    f"{self.block_size}; expected whole rows per token slot")
        if self.row_bytes % 16:
            raise InvalidInputError(f"KV page rows of {self.row_bytes} bytes (page {self.page_bytes} B / block_size "
                                    f"{self.block_size}) are not a multiple of 16 bytes, which hisparse row "
                                    "formats require")

    @classmethod
    def from_kv_cache_config(cls, kv_cache_config: object, tp_size: int = 1) -> HostTierLayout:
        """Derive the layout from vLLM's `KVCacheConfig`; raises `InvalidInputError` naming the
        group that cannot be served."""
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        if not groups:
            raise InvalidInputError("KVCacheConfig has no KV-cache groups; the host tier needs attention layers")
        block_size = page_bytes = None
        names: list[tuple[str, ...]] = []
        kinds: set[str] = set()
        for g, group in enumerate(groups):
            spec = group.kv_cache_spec
            kind = type(spec).__name__
            if kind not in _SUPPORTED_SPECS:
                raise InvalidInputError(
                    f"KV-cache group {g} ({len(group.layer_names)} layers) is a {kind}; the hisparse host tier "
                    f"serves full-attention groups only ({', '.join(_SUPPORTED_SPECS)})")
            if block_size is None:
                block_size, page_bytes = spec.block_size, spec.page_size_bytes
            elif (spec.block_size, spec.page_size_bytes) != (block_size, page_bytes):
                raise InvalidInputError(
                    f"KV-cache group {g} has block_size={spec.block_size}, page_size_bytes={spec.page_size_bytes}; "
                    f"expected {block_size} and {page_bytes} like group 0 (one host pool row format)")
            names.append(tuple(group.layer_names))
            kinds.add(kind)
        assert block_size is not None and page_bytes is not None
        return cls(block_size, page_bytes, int(kv_cache_config.num_blocks), tuple(names),  # type: ignore[attr-defined]
                   replicated=kinds == {"MLAAttentionSpec"}, tp_size=tp_size)

    # ----------------------------------------------------------------- derived geometry

    @property
    def row_bytes(self) -> int:
        return self.page_bytes // self.block_size

    @property
    def row_format(self) -> RowFormat:
        """The registered `uint8` row format of one page slice (see the module docstring)."""
        return register_row_format(RowFormat(f"vllm_page_{self.row_bytes}B", torch.uint8, self.row_bytes))

    @property
    def num_groups(self) -> int:
        return len(self.group_layers)

    @property
    def num_layers(self) -> int:
        return sum(len(layers) for layers in self.group_layers)

    def max_pages(self, max_model_len: int) -> int:
        return -(-max_model_len // self.block_size)

    def rank_budget_gib(self, host_pool_gib: float) -> float:
        """Host bytes (GiB) one rank's pool gets: all of it when ranks hold the same pages, else a
        1/tp_size share (each rank stores its shard of every page)."""
        return host_pool_gib if self.replicated or self.tp_size == 1 else host_pool_gib / self.tp_size

    def coordinator_config(self, host_pool_gib: float, max_model_len: int) -> CoordinatorConfig:
        """The coordinator's configuration, with this rank's share of `host_pool_gib`. Also sizes
        the workers' pools (`host_num_blocks`), so both roles agree on the block count.

        `pressure_watermark_blocks=0`: the coordinator never releases a running request's
        resident pages, and `hot_blocks_per_request=0`: no hot buffer is leased, because vLLM's
        attention reads only resident pages.
        """
        return CoordinatorConfig(
            host_pool_gib=self.rank_budget_gib(host_pool_gib), num_layers=self.num_layers, block_size=self.block_size,
            row_bytes=self.row_bytes, max_model_len=max_model_len, hot_blocks_per_request=0,
            num_resident_groups=self.num_groups, pressure_watermark_blocks=0)

    def check_capacity(self, host_pool_gib: float, max_model_len: int) -> CoordinatorConfig:
        """The coordinator config, after checking the pool holds one `max_model_len` request plus
        the active tail (and the null block); raises `InvalidInputError` naming `host_pool_gib`."""
        cfg = self.coordinator_config(host_pool_gib, max_model_len)
        need = cfg.min_host_blocks + 1
        if cfg.host_num_blocks < need:
            # The pool is whole blocks of a truncated byte budget: round up, then past any float shortfall.
            least = significant(need * cfg.host_block_stride / 2**30 * host_pool_gib / cfg.host_pool_gib, up=True)
            while self.coordinator_config(least, max_model_len).host_num_blocks < need:
                least = significant(least * (1 + 1e-4), up=True)
            raise InvalidInputError(
                f"kv_connector_extra_config['host_pool_gib']={host_pool_gib}"
                f"{'' if cfg.host_pool_gib == host_pool_gib else f' ({cfg.host_pool_gib:.6g} per TP rank)'} "
                f"holds {cfg.host_num_blocks} host blocks "
                f"of {cfg.host_block_stride} B ({self.num_layers} layers x {self.block_size} tokens x "
                f"{self.row_bytes} B); it needs at least {need} (one max_model_len={max_model_len} request, the "
                f"{cfg.active_tail_pages}-page active tail and the null block): host_pool_gib >= {least:.4g}")
        return cfg

    def check_host_memory(self, host_pool_gib: float, max_model_len: int, pools_on_node: int,
                          available: int | None = None) -> None:
        """Refuse, before anything is allocated, a pool this node cannot hold: the `pools_on_node`
        pools of this node (1 when the TP ranks share one) may take at most 95% of the available
        host RAM (`hisparse_core.capacity`, upstream vLLM's rule). Raises `CapacityError` naming
        `host_pool_gib` and the largest value that fits."""
        cfg = self.coordinator_config(host_pool_gib, max_model_len)
        stride = cfg.host_block_stride
        per_pool = cfg.host_num_blocks * stride
        avail = capacity.available_host_bytes() if available is None else available
        if avail is None or per_pool == 0:  # no whole block: check_capacity refuses it as too small
            return
        # The largest size whose pools fit: one block more than fits, rounded down, then below any float excess.
        fits = int(avail * capacity.HOST_FRACTION) // (pools_on_node * stride)
        most = significant((fits + 1) * stride / 2**30 * host_pool_gib / cfg.host_pool_gib, up=False)
        while self.coordinator_config(most, max_model_len).host_num_blocks > fits:
            most = significant(most * (1 - 1e-4), up=False)
        pools = "" if pools_on_node == 1 else f" ({pools_on_node} private TP-rank pools on this node)"
        capacity.check_host_memory(per_pool * pools_on_node, f"kv_connector_extra_config['host_pool_gib']="
                                   f"{host_pool_gib}{pools}", available=avail,
                                   remedy=f"expected host_pool_gib <= {most:.4g}")

    # ----------------------------------------------------------------- worker side

    def device_views(self, kv_caches: Mapping[str, torch.Tensor]) -> list[list[torch.Tensor]]:
        """Per group, per layer: the layer's cache as `[num_blocks, block_size, row_bytes]` uint8.

        Raises `InvalidInputError` if a layer is missing, not contiguous, or not the expected size.
        """
        out: list[list[torch.Tensor]] = []
        expected = self.num_device_blocks * self.page_bytes
        for g, layers in enumerate(self.group_layers):
            views: list[torch.Tensor] = []
            for name in layers:
                t = kv_caches.get(name)
                if t is None:
                    raise InvalidInputError(f"register_kv_caches got no tensor for layer {name!r} of KV-cache group "
                                            f"{g}; got {sorted(kv_caches)[:4]}...")
                if not t.is_contiguous():
                    raise InvalidInputError(
                        f"KV cache of layer {name!r} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); "
                        "the host tier needs each layer's pages in one run (a layer-major layout such as LBHNC)")
                nbytes = t.numel() * t.element_size()
                if nbytes != expected:
                    raise InvalidInputError(
                        f"KV cache of layer {name!r} has {nbytes} bytes; expected {self.num_device_blocks} blocks x "
                        f"{self.page_bytes} B = {expected}")
                views.append(t.view(-1).view(torch.uint8).view(self.num_device_blocks, self.block_size,
                                                                self.row_bytes))
            out.append(views)
        return out
