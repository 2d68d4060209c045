"""`ReferenceRuntime`: the per-cache runtime in plain PyTorch on CPU tensors, the correctness oracle.

Every method checks all of its arguments first and only then changes state, so a raising call
is a no-op. Copies move bytes through `uint8` views, so they are exact for every row format.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hisparse_core import copy_checks
from hisparse_core.checks import check_bind_arguments, check_int, check_ints, check_range, check_tensor
from hisparse_core.errors import InvalidInputError
from hisparse_core.geometry import RuntimeConfig
from hisparse_core.resolve_checks import check_resolve_shapes, check_resolve_values
from hisparse_core.runtime import CacheRuntime, ResolveInputs, ResolveResult, RuntimeStats
from hisparse_core.types import HostBlockCopy, PageTransfer, RowMirror
from hisparse_reference_cpu.resolver import resolve_batch

CPU = torch.device("cpu")


class ReferenceRuntime(CacheRuntime):
    """Hot maps, LRU orders, result workspace and counters of one index group, on the CPU."""

    def __init__(self, config: RuntimeConfig) -> None:
        if not isinstance(config, RuntimeConfig):
            raise InvalidInputError(f"config must be a RuntimeConfig, got {type(config).__name__}")
        self.config = config
        r, h, b, k = config.max_requests, config.hot_rows, config.max_batch_rows, config.top_k
        self._hot_map = torch.full((r, h), -1, dtype=torch.int32)
        self._lru = torch.arange(h, dtype=torch.int32).repeat(r, 1)
        self._result = ResolveResult(
            rows=torch.full((b, k), -1, dtype=torch.int32),
            valid_counts=torch.zeros(b, dtype=torch.int32),
            plan_host=torch.full((b, k), -1, dtype=torch.int32),
            plan_device=torch.full((b, k), -1, dtype=torch.int32),
            plan_counts=torch.zeros(b, dtype=torch.int32),
        )
        self._stats = RuntimeStats()
        self._bound: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # as given to bind
        self._host: list[torch.Tensor] = []  # per layer [host_rows, row_bytes] uint8
        self._dev: list[torch.Tensor] = []  # per layer [num_device_blocks * bs, row_bytes] uint8
        self._resident_group = 0

    # ----------------------------------------------------------------- storage

    @property
    def device(self) -> torch.device:
        return CPU

    @property
    def bound(self) -> bool:
        return bool(self._host)

    @property
    def host_rows(self) -> int:
        return self._require_bound().shape[0]

    @property
    def num_device_blocks(self) -> int:
        self._require_bound()
        return self._dev[0].shape[0] // self.config.block_size

    @property
    def host_layers(self) -> list[torch.Tensor]:
        """The host views given to `bind`."""
        self._require_bound()
        return list(self._bound[0])

    @property
    def device_layers(self) -> list[torch.Tensor]:
        """The device caches given to `bind`."""
        self._require_bound()
        return list(self._bound[1])

    @property
    def resident_group(self) -> int:
        return self._resident_group

    def bind(self, host_layers: Sequence[torch.Tensor], device_layers: Sequence[torch.Tensor],
             *, resident_group: int = 0) -> None:
        cfg = self.config
        fmt, n = cfg.row_format, cfg.num_layers
        check_bind_arguments(host_layers, device_layers, n, resident_group, bound=self.bound)
        host0 = check_tensor("host_layers[0]", host_layers[0], (None, fmt.width), fmt.dtype, CPU)
        dev0 = check_tensor("device_layers[0]", device_layers[0], (None, cfg.block_size, fmt.width), fmt.dtype, CPU)
        if host0.shape[0] == 0 or host0.shape[0] % cfg.block_size:
            raise InvalidInputError(
                f"host_layers[0] has {host0.shape[0]} rows; expected a positive multiple of "
                f"block_size={cfg.block_size}")
        if dev0.shape[0] == 0:
            raise InvalidInputError("device_layers[0] has 0 blocks; expected at least 1")
        for l in range(n):
            for name, t, shape in (("host_layers", host_layers[l], tuple(host0.shape)),
                                   ("device_layers", device_layers[l], tuple(dev0.shape))):
                check_tensor(f"{name}[{l}]", t, shape, fmt.dtype, CPU)
                if not t.is_contiguous():
                    raise InvalidInputError(f"{name}[{l}] is not contiguous; expected contiguous rows")
        self._bound = (list(host_layers), list(device_layers))
        self._host = [t.view(torch.uint8) for t in host_layers]
        self._dev = [t.view(-1, fmt.width).view(torch.uint8) for t in device_layers]
        self._resident_group = resident_group

    def _require_bound(self) -> torch.Tensor:
        if not self._host:
            raise InvalidInputError("runtime is not bound; call bind(host_layers, device_layers) first")
        return self._host[0]

    # ----------------------------------------------------------------- resolve

    def resolve(self, inputs: ResolveInputs, *, gather: bool = True, validate: bool = True) -> ResolveResult:
        self._require_bound()
        cfg = self.config
        check_resolve_shapes(inputs, cfg, CPU)
        if validate:
            check_resolve_values(inputs, cfg, num_device_blocks=self.num_device_blocks,
                         host_blocks=self.host_rows // cfg.block_size)
        try:
            res = resolve_batch(inputs.topk, inputs.row_state, inputs.seq_lens, inputs.source_table,
                                inputs.resident_table, inputs.hot_table, self._hot_map, self._lru,
                                block_size=cfg.block_size, max_batch_rows=cfg.max_batch_rows)
        except IndexError as exc:
            raise InvalidInputError(f"unvalidated inputs index outside their tables: {exc}") from exc
        if gather:
            self._check_plan_rows(res.plan_host, res.plan_device, res.plan_counts)

        for q, row in res.hot_map.items():
            self._hot_map[q] = row
        for q, row in res.lru.items():
            self._lru[q] = row
        out = self._result
        out.rows.copy_(res.rows)
        out.valid_counts.copy_(res.valid_counts)
        out.plan_host.copy_(res.plan_host)
        out.plan_device.copy_(res.plan_device)
        out.plan_counts.copy_(res.plan_counts)
        self._count(resident=res.resident, hits=res.hits, misses=res.misses)
        if gather:
            self._copy_plan(0)
        return out

    @property
    def result(self) -> ResolveResult:
        return self._result

    # ----------------------------------------------------------------- plan copies

    def gather_misses(self, layer: int = 0) -> None:
        self._require_bound()
        check_int("layer", layer, 0, self.config.num_layers)
        self._check_plan_rows(self._result.plan_host, self._result.plan_device, self._result.plan_counts)
        self._copy_plan(layer)

    def replay_plan(self, layers: Sequence[int] | None = None) -> None:
        self._require_bound()
        n = self.config.num_layers
        chosen = list(range(1, n)) if layers is None else check_ints("layers", layers, 0, n)
        self._check_plan_rows(self._result.plan_host, self._result.plan_device, self._result.plan_counts)
        for layer in chosen:
            self._copy_plan(layer)

    def _plan_entries(self, plan_host: torch.Tensor, plan_device: torch.Tensor,
                      plan_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        used = torch.arange(plan_host.shape[1])[None, :] < plan_counts[:, None]
        return plan_host[used].long(), plan_device[used].long()

    def _check_plan_rows(self, plan_host: torch.Tensor, plan_device: torch.Tensor,
                         plan_counts: torch.Tensor) -> None:
        # Only reachable with unvalidated inputs: a plan row outside the bound storage.
        src, dst = self._plan_entries(plan_host, plan_device, plan_counts)
        check_range("miss plan host row", src, 0, self.host_rows)
        check_range("miss plan device row", dst, 0, self._dev[0].shape[0])

    def _copy_plan(self, layer: int) -> None:
        src, dst = self._plan_entries(self._result.plan_host, self._result.plan_device, self._result.plan_counts)
        self._dev[layer][dst] = self._host[layer][src]
        self._count(h2d_bytes=src.numel() * self.config.row_format.row_bytes)

    # ----------------------------------------------------------------- page and row copies

    def check_mirrors(self, mirrors: Sequence[RowMirror]) -> list[tuple[int, int, int]]:
        """Validate mirrors; returns `(device_row, host_row, num_rows)` per mirror."""
        self._require_bound()
        return copy_checks.check_mirrors(mirrors, resident_group=self._resident_group,
                                         block_size=self.config.block_size, device_rows=self._dev[0].shape[0],
                                         host_rows=self.host_rows)

    def mirror_rows(self, mirrors: Sequence[RowMirror]) -> None:
        spans = self.check_mirrors(mirrors)
        for src, dst, n in spans:
            for layer in range(self.config.num_layers):
                self._host[layer][dst:dst + n] = self._dev[layer][src:src + n]
            self._count(d2h_bytes=n * self._layer_row_bytes())

    def check_pages(self, transfers: Sequence[PageTransfer], *, restore: bool | None) -> list[tuple[int, int]]:
        """Validate page transfers; returns `(device_block, host_block)` per transfer.

        `restore` is the direction every transfer must have (None: either)."""
        self._require_bound()
        return copy_checks.check_pages(transfers, restore=restore, resident_group=self._resident_group,
                                       device_blocks=self.num_device_blocks,
                                       host_blocks=self.host_rows // self.config.block_size)

    def spill_pages(self, transfers: Sequence[PageTransfer]) -> None:
        pages = self.check_pages(transfers, restore=False)
        bs = self.config.block_size
        for dev, host in pages:
            for layer in range(self.config.num_layers):
                self._host[layer][host * bs:(host + 1) * bs] = self._dev[layer][dev * bs:(dev + 1) * bs]
            self._count(d2h_bytes=bs * self._layer_row_bytes())

    def restore_pages(self, transfers: Sequence[PageTransfer]) -> None:
        pages = self.check_pages(transfers, restore=True)
        bs = self.config.block_size
        for dev, host in pages:
            for layer in range(self.config.num_layers):
                self._dev[layer][dev * bs:(dev + 1) * bs] = self._host[layer][host * bs:(host + 1) * bs]
            self._count(h2d_bytes=bs * self._layer_row_bytes())

    def check_host_copies(self, copies: Sequence[HostBlockCopy]) -> list[tuple[int, int]]:
        """Validate host block copies; returns `(src_block, dst_block)` per copy."""
        self._require_bound()
        return copy_checks.check_host_copies(copies, host_blocks=self.host_rows // self.config.block_size)

    def copy_host_blocks(self, copies: Sequence[HostBlockCopy]) -> None:
        pairs = self.check_host_copies(copies)
        bs = self.config.block_size
        for src, dst in pairs:
            for layer in range(self.config.num_layers):
                self._host[layer][dst * bs:(dst + 1) * bs] = self._host[layer][src * bs:(src + 1) * bs]

    def _layer_row_bytes(self) -> int:
        return self.config.num_layers * self.config.row_format.row_bytes

    # ----------------------------------------------------------------- hot state

    def invalidate_written_slots(self, state_rows: torch.Tensor, host_rows: torch.Tensor) -> None:
        self._require_bound()
        states = check_tensor("state_rows", state_rows, (None,), torch.int32, CPU)
        rows = check_tensor("host_rows", host_rows, (states.shape[0],), torch.int32, CPU)
        check_range("state_rows", states, -1, self.config.max_requests)
        live = states >= 0
        bad = live & ((rows < 0) | (rows >= self.host_rows))
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise InvalidInputError(f"host_rows[{i}]={int(rows[i])} is out of range; expected a host row in "
                                    f"[0, {self.host_rows}) where state_rows[{i}] >= 0")
        for q, g in zip(states[live].tolist(), rows[live].tolist(), strict=False):
            self._hot_map[q][self._hot_map[q] == g] = -1

    def invalidate_host_blocks(self, block_ids: Sequence[int]) -> None:
        self._require_bound()
        blocks = check_ints("block_ids", block_ids, 0, self.host_rows // self.config.block_size)
        if not blocks:
            return
        held_block = torch.div(self._hot_map, self.config.block_size, rounding_mode="floor")
        stale = (self._hot_map >= 0) & torch.isin(held_block, torch.tensor(blocks, dtype=torch.int32))
        self._hot_map[stale] = -1

    def reset_state(self, state_rows: Sequence[int] | None = None) -> None:
        r = self.config.max_requests
        chosen = list(range(r)) if state_rows is None else check_ints("state_rows", state_rows, 0, r)
        for q in chosen:
            self._hot_map[q] = -1
            self._lru[q] = torch.arange(self.config.hot_rows, dtype=torch.int32)

    def hot_state(self, state_row: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = check_int("state_row", state_row, 0, self.config.max_requests)
        return self._hot_map[q].clone(), self._lru[q].clone()

    # ----------------------------------------------------------------- counters

    def stats(self) -> RuntimeStats:
        return self._stats

    def reset_stats(self) -> None:
        self._stats = RuntimeStats()

    def _count(self, *, resident: int = 0, hits: int = 0, misses: int = 0, h2d_bytes: int = 0,
               d2h_bytes: int = 0) -> None:
        s = self._stats
        self._stats = RuntimeStats(s.resident + resident, s.hits + hits, s.misses + misses,
                                   s.h2d_bytes + h2d_bytes, s.d2h_bytes + d2h_bytes)

