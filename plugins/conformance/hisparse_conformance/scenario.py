"""Random resolver scenarios: geometry, page tables, and decode steps whose top-k drifts.

Everything here is plain CPU data drawn from one `random.Random`, so a backend and the reference
see identical inputs. A scenario mimics a serving engine: each request has a context that grows
by a token or two per step, pages are resident, host-only or null (no copy yet), some requests
share prefix host blocks, and the indexer's top-k keeps a tunable share of last step's positions
(`locality`) so the hot buffers see both hits and evictions. Between steps the engine may spill
resident pages, invalidate written rows, recycle host blocks or reset a finished request.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import strategies as st

from hisparse_core.geometry import FP8_DS_MLA, RowFormat, RuntimeConfig


@dataclass(frozen=True, slots=True)
class Layout:
    """A runtime geometry plus the sizes of the storage it is bound to."""

    config: RuntimeConfig
    host_blocks: int
    num_device_blocks: int


@dataclass(slots=True)
class Tables:
    """The engine's persistent `[R, P]` / `[R, H / bs]` tables, as lists (CPU truth)."""

    source: list[list[int]]
    resident: list[list[int]]
    hot: list[list[int]]

    def copy(self) -> Tables:
        return Tables([r[:] for r in self.source], [r[:] for r in self.resident], [r[:] for r in self.hot])


@dataclass(frozen=True, slots=True)
class Step:
    """One resolve call's per-batch inputs, plus the table contents at that call."""

    topk: list[list[int]]
    row_state: list[int]
    seq_lens: list[int]
    tables: Tables


@dataclass(frozen=True, slots=True)
class Maintenance:
    """Engine work between two resolve calls (applied to every runtime and to the model)."""

    written: tuple[tuple[int, int], ...] = ()  # (state row, host row) pairs for invalidate_written_slots
    recycled_blocks: tuple[int, ...] = ()  # for invalidate_host_blocks
    reset_rows: tuple[int, ...] = ()  # for reset_state

    def is_empty(self) -> bool:
        return not (self.written or self.recycled_blocks or self.reset_rows)


@dataclass(frozen=True, slots=True)
class ScenarioParams:
    """Knobs of one random scenario; hypothesis draws and shrinks these."""

    block_size: int
    top_k: int
    extra_hot_blocks: int
    max_requests: int
    max_pages: int
    rows_per_request: int
    extra_batch_rows: int
    num_layers: int
    steps: int
    locality: float  # share of last step's positions a row keeps
    resident_share: float
    null_share: float
    prefix_share: float  # share of a request's pages that reuse another request's host blocks
    mask_share: float
    padding_share: float
    maintenance_share: float
    seed: int
    row_format: RowFormat = FP8_DS_MLA


@dataclass(frozen=True, slots=True)
class Scenario:
    """A layout, its tables before the first step, and each step with the engine work after it."""

    layout: Layout
    tables: Tables
    steps: tuple[tuple[Step, Maintenance], ...]


@st.composite
def scenario_params(draw: st.DrawFn, *, rows_per_request: int | None = None, num_layers: int | None = None,
                    max_top_k: int = 12, max_steps: int = 14, row_format: RowFormat = FP8_DS_MLA) -> ScenarioParams:
    """Small geometries (so a hand-written model keeps up) that still evict every few steps."""
    def share(hi: float) -> float:
        return draw(st.sampled_from([0.0, hi / 4, hi / 2, hi]))

    return ScenarioParams(
        block_size=draw(st.sampled_from([1, 2, 4, 8])),
        top_k=draw(st.integers(1, max_top_k)),
        extra_hot_blocks=draw(st.integers(0, 2)),
        max_requests=draw(st.integers(1, 4)),
        max_pages=draw(st.integers(1, 10)),
        rows_per_request=rows_per_request if rows_per_request is not None else draw(st.integers(1, 3)),
        extra_batch_rows=draw(st.integers(0, 2)),
        num_layers=num_layers if num_layers is not None else draw(st.integers(1, 3)),
        steps=draw(st.integers(1, max_steps)),
        locality=draw(st.sampled_from([0.0, 0.5, 0.8, 0.95, 1.0])),
        resident_share=share(0.6),
        null_share=share(0.2),
        prefix_share=share(0.5),
        mask_share=share(0.3),
        padding_share=share(0.4),
        maintenance_share=share(0.5),
        seed=draw(st.integers(0, 2**32 - 1)),
        row_format=row_format,
    )


def make_layout(p: ScenarioParams) -> Layout:
    bs, k = p.block_size, p.top_k
    hot_blocks = -(-p.rows_per_request * k // bs) + p.extra_hot_blocks
    config = RuntimeConfig(
        max_batch_rows=p.max_requests * p.rows_per_request + p.extra_batch_rows,
        max_requests=p.max_requests, top_k=k, hot_rows=hot_blocks * bs, block_size=bs,
        max_pages=p.max_pages, row_format=p.row_format, num_layers=p.num_layers,
        rows_per_request=p.rows_per_request)
    resident_blocks = p.max_requests * p.max_pages
    # A spare block or two, so no table entry's range check passes by accident of exact sizing.
    return Layout(config, host_blocks=p.max_requests * p.max_pages + 2,
                  num_device_blocks=p.max_requests * hot_blocks + resident_blocks + 2)


def make_tables(layout: Layout, rng: random.Random, *, resident_share: float, null_share: float,
                prefix_share: float) -> Tables:
    """Distinct, shuffled block ids: hot buffers and resident pages never alias, host blocks
    are private except where a request reuses an earlier request's prefix."""
    cfg = layout.config
    device = list(range(layout.num_device_blocks))
    rng.shuffle(device)
    hot = [[device.pop() for _ in range(cfg.hot_blocks)] for _ in range(cfg.max_requests)]
    host = list(range(layout.host_blocks))
    rng.shuffle(host)
    source: list[list[int]] = []
    resident: list[list[int]] = []
    for q in range(cfg.max_requests):
        src_row, res_row = [], []
        for page in range(cfg.max_pages):
            if q and page < cfg.max_pages // 2 and rng.random() < prefix_share:
                src = source[rng.randrange(q)][page]  # shared prefix (may itself be -1)
            else:
                src = host.pop()
            res = device.pop() if rng.random() < resident_share else -1
            if rng.random() < null_share:
                src, res = -1, -1
            src_row.append(src)
            res_row.append(res)
        source.append(src_row)
        resident.append(res_row)
    return Tables(source, resident, hot)


def _fresh_positions(rng: random.Random, seq_len: int, count: int, exclude: set[int]) -> list[int]:
    pool = [t for t in range(seq_len) if t not in exclude]
    return rng.sample(pool, min(count, len(pool)))


def _row_topk(rng: random.Random, previous: list[int], seq_len: int, k: int, locality: float,
              mask_share: float) -> list[int]:
    """Keep a `locality` share of last step's positions, refill with fresh ones, mask some,
    repeat a few (the contract allows repeats; they share a slot), pad with -1."""
    kept = [t for t in previous if 0 <= t < seq_len and rng.random() < locality]
    row = kept + _fresh_positions(rng, seq_len, k - len(kept), set(kept))
    if row and rng.random() < 0.15:
        row[rng.randrange(len(row))] = rng.choice(row)
    row = [-1 if rng.random() < mask_share else t for t in row]
    rng.shuffle(row)
    return row + [-1] * (k - len(row))


def _maintenance(rng: random.Random, layout: Layout, tables: Tables, share: float) -> Maintenance:
    if rng.random() >= share:
        return Maintenance()
    cfg = layout.config
    bs = cfg.block_size
    host_rows = [(q, src * bs + o) for q in range(cfg.max_requests) for src in tables.source[q] if src >= 0
                 for o in range(bs)]
    written = tuple(rng.sample(host_rows, min(len(host_rows), rng.randint(0, 4))))
    if written and rng.random() < 0.3:
        written = (*written, (-1, written[0][1]))  # -1 state rows are skipped
    blocks = sorted({src for row in tables.source for src in row if src >= 0})
    recycled = tuple(rng.sample(blocks, min(len(blocks), rng.randint(0, 2))))
    resets = tuple(rng.sample(range(cfg.max_requests), rng.randint(0, 1)))
    return Maintenance(written, recycled, resets)


def _spill_some(rng: random.Random, tables: Tables) -> None:
    """A resident page that has a host copy may stop being resident (a spill)."""
    for q, row in enumerate(tables.resident):
        for page, blk in enumerate(row):
            if blk >= 0 and tables.source[q][page] >= 0 and rng.random() < 0.05:
                row[page] = -1


def build_scenario(p: ScenarioParams) -> Scenario:
    rng = random.Random(p.seed)
    layout = make_layout(p)
    cfg = layout.config
    tables = make_tables(layout, rng, resident_share=p.resident_share, null_share=p.null_share,
                         prefix_share=p.prefix_share)
    initial = tables.copy()
    context = cfg.max_context
    seq = [rng.randint(0, context) for _ in range(cfg.max_requests)]
    previous: dict[tuple[int, int], list[int]] = {}
    steps: list[tuple[Step, Maintenance]] = []
    for _ in range(p.steps):
        steps.append((_draw_step(rng, p, layout, tables, seq, previous),
                      _maintenance(rng, layout, tables, p.maintenance_share)))
        seq = [min(context, s + rng.randint(0, 2)) for s in seq]
        _spill_some(rng, tables)
    return Scenario(layout, initial, tuple(steps))


def _draw_step(rng: random.Random, p: ScenarioParams, layout: Layout, tables: Tables, seq: list[int],
               previous: dict[tuple[int, int], list[int]]) -> Step:
    cfg = layout.config
    requests = rng.sample(range(cfg.max_requests), rng.randint(1, cfg.max_requests))
    topk: list[list[int]] = []
    row_state: list[int] = []
    seq_lens: list[int] = []
    for q in requests:
        if topk and len(topk) < cfg.max_batch_rows and rng.random() < p.padding_share:
            pad_len = rng.randint(0, cfg.max_context)
            topk.append(padding_topk(rng, cfg.top_k, pad_len))
            row_state.append(-1)
            seq_lens.append(pad_len)
        n = rng.randint(1, cfg.rows_per_request)
        if len(topk) + n > cfg.max_batch_rows:
            break
        # Verification rows of one request see one more token each (within the context).
        base = max(0, seq[q] - (n - 1))
        for j in range(n):
            length = min(cfg.max_context, base + j)
            row = _row_topk(rng, previous.get((q, j), []), length, cfg.top_k, p.locality, p.mask_share)
            previous[(q, j)] = row
            topk.append(row)
            row_state.append(q)
            seq_lens.append(length)
    if not topk:  # always at least one row
        topk, row_state, seq_lens = [padding_topk(rng, cfg.top_k, 0)], [-1], [0]
    return Step(topk, row_state, seq_lens, tables.copy())


def padding_topk(rng: random.Random, k: int, seq_len: int) -> list[int]:
    """A padding row's top-k is whatever the graph buffer held; kept within its own length so the
    row is valid under either reading of how strictly padding rows are validated."""
    return [rng.randint(-1, seq_len - 1) for _ in range(k)]


def out_of_context(step: Step, config: RuntimeConfig, rng: random.Random) -> Step:
    """`step` with some masked entries (-1) of live rows moved out of context: past their seq_len,
    past max_context, or below -1 (what `resolve(validate=False)` and `prefetch` mask, not refuse)."""
    topk = [row[:] for row in step.topk]
    for r, row in enumerate(topk):
        if step.row_state[r] < 0:
            continue
        for i in range(len(row)):
            if row[i] == -1 and rng.random() < 0.7:
                row[i] = rng.choice([step.seq_lens[r] + rng.randint(0, config.block_size),
                                     config.max_context + rng.randint(0, 3), -rng.randint(2, 9)])
    return Step(topk, step.row_state, step.seq_lens, step.tables)


def as_tensor(values: list[int] | list[list[int]], device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def random_bytes(shape: tuple[int, ...], *seed: int) -> torch.Tensor:
    """Bytes determined by the (non-negative) seed words; numpy's generator is an order of
    magnitude faster than torch.randint here."""
    count = 1
    for n in shape:
        count *= n
    raw = bytearray(np.random.default_rng(list(seed)).bytes(count))
    return torch.frombuffer(raw, dtype=torch.uint8, count=count).reshape(shape) if count else \
        torch.empty(shape, dtype=torch.uint8)
