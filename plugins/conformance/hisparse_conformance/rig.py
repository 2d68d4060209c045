"""A runtime of the backend under test, bound to its own host pool and device caches.

Two rigs built from the same layout and seed hold identical bytes, so a backend and the
reference can be driven in lockstep and compared after every call. Reads go through CPU copies
(`.cpu()`), so the same code serves any device.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

import pytest
import torch

from hisparse_conformance.model import Resolution
from hisparse_conformance.scenario import Layout, Maintenance, Step, Tables, as_tensor, random_bytes
from hisparse_core.backend import Backend, Capability
from hisparse_core.geometry import BF16_MLA, FP8_DS_MLA, RowFormat
from hisparse_core.host_pool import HostPool, HostPoolSpec
from hisparse_core.runtime import CacheRuntime, ResolveInputs, ResolveResult, RuntimeStats


@dataclass(frozen=True, slots=True)
class Outcome:
    """A `ResolveResult` (or the model's `Resolution`) as plain lists, every `max_batch_rows` row."""

    rows: list[list[int]]
    valid_counts: list[int]
    plan_host: list[list[int]]
    plan_device: list[list[int]]
    plan_counts: list[int]

    @classmethod
    def of(cls, result: ResolveResult | Resolution) -> Outcome:
        if isinstance(result, Resolution):
            return cls(result.rows, result.valid_counts, result.plan_host, result.plan_device, result.plan_counts)
        return cls(*(t.cpu().tolist() for t in (result.rows, result.valid_counts, result.plan_host,
                                                 result.plan_device, result.plan_counts)))

    def plan(self) -> list[tuple[int, int]]:
        return [(h, d) for r, n in enumerate(self.plan_counts)
                for h, d in zip(self.plan_host[r][:n], self.plan_device[r][:n], strict=True)]


def usable_format(backend: Backend) -> RowFormat:
    """A row format the backend declares (fp8_ds_mla preferred), for tests where bytes are incidental."""
    for fmt, capability in ((FP8_DS_MLA, Capability.FP8_DS_MLA), (BF16_MLA, Capability.BF16_MLA)):
        if capability in backend.capabilities:
            return fmt
    pytest.skip(f"backend declares neither {Capability.FP8_DS_MLA} nor {Capability.BF16_MLA}")


def stats_tuple(stats: RuntimeStats) -> tuple[int, int, int, int, int]:
    return (stats.resident, stats.hits, stats.misses, stats.h2d_bytes, stats.d2h_bytes)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything a failed call must leave untouched."""

    hot: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (hot map, LRU) per state row
    stats: tuple[int, int, int, int, int]
    outcome: Outcome
    device_digest: tuple[str, ...]  # per layer: a hash of the device cache bytes
    host_digest: tuple[str, ...]


def first_difference(what: str, got: object, want: object) -> str | None:
    """None if equal, else where the two nested lists/tuples first differ."""
    if got == want:
        return None
    if isinstance(got, (list, tuple)) and isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return f"{what}: length {len(got)} != expected {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            found = first_difference(f"{what}[{i}]", g, w)
            if found:
                return found
        return None
    return None if got == want else f"{what}: got {got!r}, expected {want!r}"


def outcome_difference(got: Outcome, want: Outcome) -> str | None:
    for name in ("rows", "valid_counts", "plan_counts", "plan_host", "plan_device"):
        found = first_difference(name, getattr(got, name), getattr(want, name))
        if found:
            return found
    return None


def _kind(obj: object) -> str:
    """How a failure names what a backend returned: None, or the type it is."""
    return "None" if obj is None else f"a {type(obj).__name__}"


_FIELDS = ("rows", "valid_counts", "plan_host", "plan_device", "plan_counts")


def _storage(result: ResolveResult) -> tuple[tuple[int, tuple[int, ...], torch.dtype], ...]:
    """Where each tensor of a `ResolveResult` lives: (data_ptr, shape, dtype) per field."""
    return tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in (getattr(result, name) for name in _FIELDS))


def _digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.detach().cpu().contiguous().view(torch.uint8).numpy().data).hexdigest()


class Rig:
    """One bound runtime: a host pool filled with random bytes, random device caches, and the
    engine's persistent table tensors on the backend's device."""

    def __init__(self, backend: Backend, layout: Layout, *, seed: int, resident_group: int = 0) -> None:
        cfg = layout.config
        self.backend = backend
        self.layout = layout
        self.config = cfg
        self.device = backend.device
        fmt = cfg.row_format
        self.pool: HostPool = backend.create_host_pool(
            HostPoolSpec(num_layers=cfg.num_layers, num_blocks=layout.host_blocks, block_size=cfg.block_size,
                         row_format=fmt))
        assert isinstance(self.pool, HostPool), (
            f"contract: Backend.create_host_pool returns a hisparse_core.HostPool; it returned {_kind(self.pool)}")
        try:
            self.host_layers = self.pool.layer_views()
            host_rows = layout.host_blocks * cfg.block_size
            for layer, view in enumerate(self.host_layers):
                view.view(torch.uint8).copy_(random_bytes((host_rows, fmt.row_bytes), seed, 1, layer))
            self.device_layers = []
            for layer in range(cfg.num_layers):
                data = random_bytes((layout.num_device_blocks, cfg.block_size, fmt.row_bytes), seed, 2, layer)
                cache = torch.empty((layout.num_device_blocks, cfg.block_size, fmt.width), dtype=fmt.dtype,
                                    device=self.device)
                cache.view(torch.uint8).copy_(data.to(self.device))
                self.device_layers.append(cache)
            self.runtime: CacheRuntime = backend.create_runtime(cfg)
            assert isinstance(self.runtime, CacheRuntime), (
                f"contract: Backend.create_runtime returns a hisparse_core.CacheRuntime; it returned "
                f"{_kind(self.runtime)}")
            self.runtime.bind(self.host_layers, self.device_layers, resident_group=resident_group)
            self.workspace = _storage(self.runtime.result)
        except BaseException:
            self.pool.release()
            raise
        self.source_table = torch.full((cfg.max_requests, cfg.max_pages), -1, dtype=torch.int32, device=self.device)
        self.resident_table = torch.full_like(self.source_table, -1)
        self.hot_table = torch.zeros((cfg.max_requests, cfg.hot_blocks), dtype=torch.int32, device=self.device)

    def __enter__(self) -> Rig:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self.pool.release()

    # -- driving -------------------------------------------------------------------------------

    def load_tables(self, tables: Tables) -> None:
        """Update the persistent tables in place, as the engine does between steps."""
        self.source_table.copy_(as_tensor(tables.source))
        self.resident_table.copy_(as_tensor(tables.resident))
        self.hot_table.copy_(as_tensor(tables.hot))

    def inputs(self, step: Step) -> ResolveInputs:
        self.load_tables(step.tables)
        return ResolveInputs(as_tensor(step.topk, self.device), as_tensor(step.row_state, self.device),
                             as_tensor(step.seq_lens, self.device), self.source_table, self.resident_table,
                             self.hot_table)

    def resolve(self, step: Step, *, gather: bool = True, validate: bool = True) -> Outcome:
        returned = self.runtime.resolve(self.inputs(step), gather=gather, validate=validate)
        assert isinstance(returned, ResolveResult), (
            f"contract: resolve returns the runtime's result workspace (runtime.result, a ResolveResult); it returned "
            f"{_kind(returned)}")
        self.check_workspace(returned)
        return Outcome.of(returned)

    def check_workspace(self, returned: ResolveResult | None = None) -> None:
        """`runtime.result` (and `returned`, what a resolve returned) are still the tensors that
        `runtime.result` held when the runtime was bound: readers keep them, and a captured CUDA graph
        writes them."""
        clause = ("contract: resolve fills the runtime's result workspace in place, the tensors runtime.result "
                  "held when the runtime was bound (ResolveResult: runtime-owned tensors of fixed shape, "
                  "rewritten in place, so a captured CUDA graph stays valid)")
        for who, result in (("runtime.result", self.runtime.result), ("what resolve returned", returned)):
            if result is None:
                continue
            for name, now, bound in zip(_FIELDS, _storage(result), self.workspace, strict=True):
                assert now == bound, (f"{clause}; after this call {who}.{name} is not the bound workspace's "
                                      f"{name} (data_ptr, shape, dtype: {now}, expected {bound})")

    def apply(self, work: Maintenance) -> None:
        if work.written:
            self.runtime.invalidate_written_slots(as_tensor([q for q, _ in work.written], self.device),
                                                  as_tensor([g for _, g in work.written], self.device))
        if work.recycled_blocks:
            self.runtime.invalidate_host_blocks(list(work.recycled_blocks))
        if work.reset_rows:
            self.runtime.reset_state(list(work.reset_rows))

    # -- reading -------------------------------------------------------------------------------

    def hot(self, state_row: int) -> tuple[list[int], list[int]]:
        hot_map, lru = self.runtime.hot_state(state_row)
        return hot_map.tolist(), lru.tolist()

    def stats(self) -> tuple[int, int, int, int, int]:
        return stats_tuple(self.runtime.stats())

    def snapshot(self) -> Snapshot:
        hot = tuple((tuple(m), tuple(lru)) for m, lru in (self.hot(q) for q in range(self.config.max_requests)))
        return Snapshot(hot, self.stats(), Outcome.of(self.runtime.result),
                        tuple(_digest(c) for c in self.device_layers), tuple(_digest(h) for h in self.host_layers))

    def device_cache_bytes(self, layer: int) -> torch.Tensor:
        """A CPU copy of one layer's whole device cache, as bytes."""
        return self.device_layers[layer].view(torch.uint8).cpu()

    def host_bytes(self, layer: int, rows: Sequence[int]) -> torch.Tensor:
        """`[len(rows), row_bytes]` uint8 copy of host rows."""
        index = torch.tensor(list(rows), dtype=torch.long)
        return self.host_layers[layer].view(torch.uint8)[index].cpu()

    def device_bytes(self, layer: int, rows: Sequence[int]) -> torch.Tensor:
        """`[len(rows), row_bytes]` uint8 copy of flat device rows."""
        flat = self.device_layers[layer].view(torch.uint8).reshape(-1, self.config.row_format.row_bytes)
        index = torch.tensor(list(rows), dtype=torch.long, device=self.device)
        return flat[index].cpu()

    def write_device_rows(self, layer: int, rows: Sequence[int], data: torch.Tensor) -> None:
        flat = self.device_layers[layer].view(torch.uint8).reshape(-1, self.config.row_format.row_bytes)
        index = torch.tensor(list(rows), dtype=torch.long, device=self.device)
        flat[index] = data.to(self.device)

    def write_host_rows(self, layer: int, rows: Sequence[int], data: torch.Tensor) -> None:
        index = torch.tensor(list(rows), dtype=torch.long)
        self.host_layers[layer].view(torch.uint8)[index] = data.to(self.host_layers[layer].device)
