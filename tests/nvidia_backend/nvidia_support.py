"""Helpers of the NVIDIA backend tests: a GPU runtime and the CPU reference on identical bytes.

`Twin` binds an `NvidiaRuntime` and a `ReferenceRuntime` to host pools and device caches holding
the same random bytes, drives both with the same calls and compares everything the contract
fixes: outputs, miss plan, hot maps, LRU orders, counters, and the bytes of every device and host
row. `random_tables` / `random_step` draw engine-like inputs (resident, host-only and null pages,
drifting top-k with repeats and masks, padding rows, speculative groups).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from hisparse_core.geometry import RuntimeConfig
from hisparse_core.host_pool import HostPoolSpec
from hisparse_core.runtime import ResolveInputs


def gpu_reason() -> str | None:
    try:
        from hisparse_nvidia.plugin import probe
    except ImportError as exc:  # pragma: no cover
        return f"hisparse_nvidia not importable: {exc}"
    return probe()


requires_gpu = pytest.mark.skipif(gpu_reason() is not None, reason=f"nvidia backend unavailable: {gpu_reason()}")


def random_bytes(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)


@dataclass(slots=True)
class Tables:
    source: torch.Tensor  # [R, P] int32 (CPU)
    resident: torch.Tensor
    hot: torch.Tensor  # [R, HB]


def random_tables(cfg: RuntimeConfig, host_blocks: int, num_device_blocks: int, rng: random.Random, *,
                  resident_share: float, null_share: float) -> Tables:
    """Distinct device blocks for hot buffers and resident pages; private host blocks."""
    device = list(range(num_device_blocks))
    rng.shuffle(device)
    hot = [[device.pop() for _ in range(cfg.hot_blocks)] for _ in range(cfg.max_requests)]
    host = list(range(host_blocks))
    rng.shuffle(host)
    source, resident = [], []
    for _ in range(cfg.max_requests):
        s_row, r_row = [], []
        for _ in range(cfg.max_pages):
            s = host.pop() if host else -1
            r = device.pop() if device and rng.random() < resident_share else -1
            if rng.random() < null_share:
                s, r = -1, -1
            s_row.append(s)
            r_row.append(r)
        source.append(s_row)
        resident.append(r_row)
    i32 = torch.int32
    return Tables(torch.tensor(source, dtype=i32), torch.tensor(resident, dtype=i32), torch.tensor(hot, dtype=i32))


@dataclass(slots=True)
class Step:
    topk: torch.Tensor  # [B, K] int32 CPU
    row_state: torch.Tensor
    seq_lens: torch.Tensor


def random_step(cfg: RuntimeConfig, rng: random.Random, previous: dict[tuple[int, int], list[int]], *,
                locality: float, mask_share: float = 0.05, padding_share: float = 0.2,
                requests: list[int] | None = None, batch_rows: int | None = None) -> Step:
    """A batch of up to `batch_rows` rows: padding rows, groups of 1..rows_per_request rows."""
    k, ctx = cfg.top_k, cfg.max_context
    b_max = batch_rows or cfg.max_batch_rows
    if requests is None:
        requests = rng.sample(range(cfg.max_requests), rng.randint(1, cfg.max_requests))
    topk: list[list[int]] = []
    states: list[int] = []
    lens: list[int] = []
    for q in requests:
        if topk and len(topk) < b_max and rng.random() < padding_share:
            topk.append([rng.randint(-1, ctx - 1) for _ in range(k)])
            states.append(-1)
            lens.append(ctx)
        n = rng.randint(1, cfg.rows_per_request)
        if len(topk) + n > b_max:
            break
        base = rng.randint(max(0, ctx - 8), ctx - (n - 1)) if ctx >= n else 0
        for j in range(n):
            length = min(ctx, base + j)
            prev = previous.get((q, j), [])
            kept = [t for t in prev if 0 <= t < length and rng.random() < locality]
            pool = k - len(kept)
            fresh = rng.sample(range(length), min(length, pool + len(kept))) if length else []
            fresh = [t for t in fresh if t not in set(kept)][:pool]
            row = kept + fresh
            if row and rng.random() < 0.3:
                row[rng.randrange(len(row))] = rng.choice(row)  # a repeat shares its slot
            row = [-1 if rng.random() < mask_share else t for t in row]
            rng.shuffle(row)
            row += [-1] * (k - len(row))
            previous[(q, j)] = row
            topk.append(row)
            states.append(q)
            lens.append(length)
    if not topk:
        topk, states, lens = [[-1] * k], [-1], [0]
    i32 = torch.int32
    return Step(torch.tensor(topk, dtype=i32), torch.tensor(states, dtype=i32), torch.tensor(lens, dtype=i32))


class Twin:
    """The backend under test and the reference, bound to identical host and device bytes."""

    def __init__(self, cfg: RuntimeConfig, *, host_blocks: int, num_device_blocks: int, seed: int) -> None:
        from hisparse_nvidia.backend import NvidiaBackend
        from hisparse_reference_cpu.backend import ReferenceCpuBackend

        self.cfg = cfg
        self.nv = NvidiaBackend()
        self.dev = self.nv.device
        self.ref_backend = ReferenceCpuBackend(completion_lag=0)
        spec = HostPoolSpec(num_layers=cfg.num_layers, num_blocks=host_blocks, block_size=cfg.block_size,
                            row_format=cfg.row_format)
        self.nv_pool = self.nv.create_host_pool(spec)
        self.ref_pool = self.ref_backend.create_host_pool(spec)
        fmt = cfg.row_format
        rows = host_blocks * cfg.block_size
        for layer in range(cfg.num_layers):
            data = random_bytes((rows, fmt.row_bytes), seed * 7919 + layer)
            self.nv_pool.layer_view(layer).view(torch.uint8).copy_(data)
            self.ref_pool.layer_view(layer).view(torch.uint8).copy_(data)
        self.nv_dev, self.ref_dev = [], []
        for layer in range(cfg.num_layers):
            data = random_bytes((num_device_blocks, cfg.block_size, fmt.row_bytes), seed * 104729 + layer)
            c = torch.empty((num_device_blocks, cfg.block_size, fmt.width), dtype=fmt.dtype, device=self.dev)
            c.view(torch.uint8).copy_(data.to(self.dev))
            self.nv_dev.append(c)
            r = torch.empty((num_device_blocks, cfg.block_size, fmt.width), dtype=fmt.dtype)
            r.view(torch.uint8).copy_(data)
            self.ref_dev.append(r)
        self.rt = self.nv.create_runtime(cfg)
        self.ref = self.ref_backend.create_runtime(cfg)
        self.rt.bind(self.nv_pool.layer_views(), self.nv_dev)
        self.ref.bind(self.ref_pool.layer_views(), self.ref_dev)
        self.tables: Tables | None = None
        self.dev_tables: Tables | None = None

    def close(self) -> None:
        self.nv_pool.release()
        self.ref_pool.release()

    def set_tables(self, tables: Tables) -> None:
        self.tables = tables
        if self.dev_tables is None:
            self.dev_tables = Tables(tables.source.to(self.dev), tables.resident.to(self.dev), tables.hot.to(self.dev))
        else:
            self.dev_tables.source.copy_(tables.source)
            self.dev_tables.resident.copy_(tables.resident)
            self.dev_tables.hot.copy_(tables.hot)

    def inputs(self, step: Step, *, device: bool) -> ResolveInputs:
        assert self.tables is not None and self.dev_tables is not None
        if device:
            t = self.dev_tables
            return ResolveInputs(step.topk.to(self.dev), step.row_state.to(self.dev), step.seq_lens.to(self.dev),
                                 t.source, t.resident, t.hot)
        t = self.tables
        return ResolveInputs(step.topk, step.row_state, step.seq_lens, t.source, t.resident, t.hot)

    def resolve(self, step: Step, *, gather: bool = True, validate: bool = False) -> None:
        self.rt.resolve(self.inputs(step, device=True), gather=gather, validate=validate)
        self.ref.resolve(self.inputs(step, device=False), gather=gather, validate=validate)

    # ------------------------------------------------------------------ comparisons

    def compare_result(self, what: str = "") -> None:
        got, want = self.rt.result, self.ref.result
        for name in ("rows", "valid_counts", "plan_counts", "plan_host", "plan_device"):
            g, w = getattr(got, name).cpu(), getattr(want, name)
            if not torch.equal(g, w):
                diff = (g != w).nonzero()[0].tolist()
                raise AssertionError(f"{what}: result.{name} differs first at {diff}: got {g[tuple(diff)]}, "
                                     f"expected {w[tuple(diff)]}")

    def compare_state(self, what: str = "") -> None:
        for q in range(self.cfg.max_requests):
            gm, gl = self.rt.hot_state(q)
            wm, wl = self.ref.hot_state(q)
            assert torch.equal(gm, wm), f"{what}: hot map of state row {q} differs"
            assert torch.equal(gl, wl), f"{what}: LRU order of state row {q} differs"
        assert self.rt.stats() == self.ref.stats(), f"{what}: stats {self.rt.stats()} != {self.ref.stats()}"

    def compare_bytes(self, what: str = "") -> None:
        for layer in range(self.cfg.num_layers):
            g = self.nv_dev[layer].view(torch.uint8).cpu()
            w = self.ref_dev[layer].view(torch.uint8)
            if not torch.equal(g, w):
                bad = (g != w).reshape(-1, self.cfg.block_size * self.cfg.row_format.row_bytes).any(1).nonzero()
                raise AssertionError(f"{what}: device cache of layer {layer} differs in blocks {bad[:8, 0].tolist()}")
            gh = self.nv_pool.layer_view(layer).view(torch.uint8)
            wh = self.ref_pool.layer_view(layer).view(torch.uint8)
            torch.cuda.synchronize(self.dev)
            assert torch.equal(gh, wh), f"{what}: host pool layer {layer} differs"

    def compare_all(self, what: str = "") -> None:
        self.compare_result(what)
        self.compare_state(what)
        self.compare_bytes(what)
