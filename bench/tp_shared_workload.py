"""The drifting decode workload of `bench/bench_tp_shared.py`, the same in every process.

`Schedule` plays the engine role for one seed and gives every rank (and the reference inside each
rank) the same plan for each step: which pages become resident, which released ones the engine
reuses (their blocks are overwritten, so a stale read shows), the new row of every decoding
request, its mirror and, when the row fills its page, the page's spill; the pages released two
steps after their spill; and each batch row's drifting top-k. Prefill is step 0.

`Executor` carries a plan out on one backend: the host pool (shared, or the oracle's private one),
one runtime of `layers` layers, the transfer engine and the device caches. Per step, in engine
order: drain and release (start of step), table and input updates, the forward's row writes, the
ordering hook (a peer waits for rank 0's host writes), resolve + follower replay (one CUDA graph
replay where the backend can), then the after-forward mirrors and spills, and a poll. Nothing
after the ordering hook blocks the host on the device, so a peer whose reads wait on a dead rank
0 can still say so. `compare` checks a
rank's executor against the reference's, byte for byte.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hisparse_core.backend import Backend
from hisparse_core.geometry import RuntimeConfig
from hisparse_core.host_pool import HostPool, HostPoolSpec
from hisparse_core.runtime import ResolveInputs
from hisparse_core.types import PageTransfer, RowMirror


@dataclass(frozen=True, slots=True)
class WorkloadShape:
    """Geometry of the drifting workload: small enough for a per-step check of every byte."""

    requests: int = 4
    top_k: int = 256
    block_size: int = 64
    max_pages: int = 32
    layers: int = 2
    hot_rows: int = 512
    spare_blocks: int = 8
    locality: float = 0.7  # share of a row's previous top-k kept
    recent: int = 16  # the newest positions are always picked (a sliding window's tail)
    release_lag: int = 2  # steps between a page's spill and its release

    def runtime_config(self) -> RuntimeConfig:
        return RuntimeConfig(max_batch_rows=self.requests, max_requests=self.requests, top_k=self.top_k,
                             hot_rows=self.hot_rows, block_size=self.block_size, max_pages=self.max_pages,
                             num_layers=self.layers)

    def pool_spec(self, *, shared: bool = False, name: str | None = None, rank: int = 0,
                  world_size: int = 1) -> HostPoolSpec:
        return HostPoolSpec(num_layers=self.layers, num_blocks=self.requests * self.max_pages,
                            block_size=self.block_size, shared=shared, name=name, rank=rank, world_size=world_size)

    @property
    def hot_blocks(self) -> int:
        return self.hot_rows // self.block_size

    @property
    def device_blocks(self) -> int:
        return self.requests * (self.hot_blocks + self.max_pages) + self.spare_blocks

    @property
    def max_steps(self) -> int:
        """Decode steps the contexts have room for (prefill takes at most 5/8 of a context)."""
        return self.max_pages * self.block_size * 3 // 8


@dataclass(slots=True)
class StepPlan:
    step: int
    drain: bool  # the engine waits for completions before this step's releases
    releases: list[tuple[int, int]]  # (request, page) no longer resident
    reused: list[int]  # released device blocks the engine reuses now (overwritten)
    allocations: list[tuple[int, int, int]]  # (request, page, device block) made resident
    writes: list[int]  # device rows (flat) written by the forward, all layers
    mirrors: list[RowMirror]
    spills: list[PageTransfer]
    topk: torch.Tensor  # [B, K] int32
    row_state: torch.Tensor
    seq_lens: torch.Tensor
    expect_completed: list[int] = field(default_factory=list)  # spill ids that must be done by the drain


def row_bytes_for(seed: int, step: int, rows: int, layers: int, row_bytes: int) -> torch.Tensor:
    """The bytes the forward writes at `step`: [layers, rows, row_bytes] uint8, one seed per step."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, 256, (layers, rows, row_bytes), dtype=torch.uint8, generator=gen)


class Schedule:
    """The engine role for one seed: identical plans in every process."""

    def __init__(self, shape: WorkloadShape, seed: int) -> None:
        self.shape = shape
        self.seed = seed
        self._rng = random.Random(seed)
        s = shape
        r, p, bs = s.requests, s.max_pages, s.block_size
        self.source = torch.tensor([[q * p + j for j in range(p)] for q in range(r)], dtype=torch.int32)
        self.resident = torch.full((r, p), -1, dtype=torch.int32)
        self.hot = torch.tensor([[q * s.hot_blocks + j for j in range(s.hot_blocks)] for q in range(r)],
                                dtype=torch.int32)
        self._free = list(range(r * s.hot_blocks, s.device_blocks))
        self._released: list[int] = []  # device blocks given back, reused before fresh ones
        self.lengths = [self._rng.randint(p * bs // 2, p * bs * 5 // 8) for _ in range(r)]
        self._spilled: list[tuple[int, int, int, int]] = []  # (step, request, page, transfer id)
        self._next_id = 1
        self._previous: dict[int, list[int]] = {}
        self.step_no = -1
        self.released_pages = 0

    @property
    def spills_submitted(self) -> int:
        return self._next_id - 1

    def _allocate(self) -> int:
        return self._released.pop(0) if self._released else self._free.pop(0)

    def _spill(self, q: int, page: int, step: int) -> PageTransfer:
        ident = self._next_id
        self._next_id += 1
        self._spilled.append((step, q, page, ident))
        return PageTransfer(ident, int(self.source[q, page]), (int(self.resident[q, page]),))

    def _topk(self, q: int, length: int) -> list[int]:
        s, rng = self.shape, self._rng
        keep = [t for t in self._previous.get(q, []) if 0 <= t < length and rng.random() < s.locality]
        picked = dict.fromkeys(keep + list(range(max(0, length - s.recent), length)))
        while len(picked) < min(s.top_k, length):
            picked.setdefault(rng.randrange(length), None)
        row = list(picked)[:s.top_k]
        if rng.random() < 0.3 and len(row) > 1:
            row[rng.randrange(len(row))] = rng.choice(row)  # a repeat shares its slot
        row = [-1 if rng.random() < 0.03 else t for t in row]
        rng.shuffle(row)
        self._previous[q] = row
        return row + [-1] * (s.top_k - len(row))

    def prefill(self) -> StepPlan:
        """Step 0: every request's prompt written into fresh resident pages, mirrored, full pages spilled."""
        s = self.shape
        self.step_no = 0
        allocations, writes, mirrors, spills = [], [], [], []
        for q, length in enumerate(self.lengths):
            for page in range(-(-length // s.block_size)):
                block = self._allocate()
                self.resident[q, page] = block
                allocations.append((q, page, block))
                n = min(s.block_size, length - page * s.block_size)
                writes += [block * s.block_size + o for o in range(n)]
                mirrors.append(RowMirror((block * s.block_size,), int(self.source[q, page]) * s.block_size, n))
                if n == s.block_size:
                    spills.append(self._spill(q, page, 0))
        return StepPlan(0, False, [], [], allocations, writes, mirrors, spills, *self._no_batch())

    def _no_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.shape
        i32 = torch.int32
        return (torch.full((s.requests, s.top_k), -1, dtype=i32), torch.full((s.requests,), -1, dtype=i32),
                torch.zeros(s.requests, dtype=i32))

    def next_step(self) -> StepPlan:
        s, rng = self.shape, self._rng
        self.step_no += 1
        step = self.step_no
        if step > s.max_steps:
            raise ValueError(f"the workload has room for {s.max_steps} decode steps; step {step} was asked")
        # Start of step: pages spilled `release_lag` steps ago leave the GPU, except each
        # request's newest sealed page (its blocks are given back and reused later).
        due = [(q, page, ident) for st, q, page, ident in self._spilled if st <= step - s.release_lag]
        releases, expect = [], []
        for q, page, ident in due:
            newest_sealed = self.lengths[q] // s.block_size - 1
            if page < newest_sealed:
                releases.append((q, page))
                expect.append(ident)
                self._released.append(int(self.resident[q, page]))
                self.resident[q, page] = -1
                self.released_pages += 1
        gone = set(releases)
        self._spilled = [x for x in self._spilled if (x[1], x[2]) not in gone]
        # The engine hands the released blocks out again: their old bytes are gone at once.
        reused = [int(b) for b in self._released[len(self._released) - len(releases):]]
        # The forward: each decoding request writes one row.
        decoding = [q for q in range(s.requests) if rng.random() < 0.9] or [0]
        allocations, writes, mirrors, spills = [], [], [], []
        for q in decoding:
            pos = self.lengths[q]
            page, off = divmod(pos, s.block_size)
            if self.resident[q, page] < 0:
                block = self._allocate()
                self.resident[q, page] = block
                allocations.append((q, page, block))
            block = int(self.resident[q, page])
            writes.append(block * s.block_size + off)
            mirrors.append(RowMirror((block * s.block_size + off,), int(self.source[q, page]) * s.block_size + off, 1))
            self.lengths[q] = pos + 1
            if off == s.block_size - 1:
                spills.append(self._spill(q, page, step))
        # The batch: one row per decoding request, padding rows elsewhere, in a shuffled order.
        order = decoding + [-1] * (s.requests - len(decoding))
        rng.shuffle(order)
        topk, states, lens = self._no_batch()
        for b, q in enumerate(order):
            if q >= 0:
                topk[b] = torch.tensor(self._topk(q, self.lengths[q]), dtype=torch.int32)
                states[b] = q
                lens[b] = self.lengths[q]
        return StepPlan(step, bool(releases), releases, reused, allocations, writes, mirrors, spills, topk, states,
                        lens, expect)


def initial_bytes(shape: WorkloadShape, seed: int, row_bytes: int) -> torch.Tensor:
    """The device caches' first contents: [layers, device_blocks, block_size, row_bytes] uint8."""
    gen = torch.Generator().manual_seed(seed * 7919 + 17)
    return torch.randint(0, 256, (shape.layers, shape.device_blocks, shape.block_size, row_bytes), dtype=torch.uint8,
                         generator=gen)


class Executor:
    """One backend carrying out the plans: pool, runtime, transfer engine and device caches.

    `before_reads(executor, step)` runs right before the step's resolve (a peer waits there for
    rank 0's host writes); `after_writes(executor, step)` right after the step's mirrors and
    spills were submitted.
    `graph`: capture the resolve and the follower replay once in a CUDA graph and replay it.
    """

    def __init__(self, backend: Backend, pool: HostPool, shape: WorkloadShape, seed: int, *, graph: bool,
                 validate: bool = False, before_reads: Callable[[Executor, int], None] | None = None,
                 after_writes: Callable[[Executor, int], None] | None = None) -> None:
        self.backend = backend
        self.pool = pool
        self.shape = shape
        self.seed = seed
        self.dev = backend.device
        cfg = shape.runtime_config()
        fmt = cfg.row_format
        self.row_bytes = fmt.row_bytes
        data = initial_bytes(shape, seed, fmt.row_bytes)
        self.caches = []
        for layer in range(shape.layers):
            c = torch.empty((shape.device_blocks, shape.block_size, fmt.width), dtype=fmt.dtype, device=self.dev)
            c.view(torch.uint8).copy_(data[layer].to(self.dev))
            self.caches.append(c)
        self.rt = backend.create_runtime(cfg)
        self.rt.bind(pool.layer_views(), self.caches)
        self.engine = backend.create_transfer_engine(pool, [self.rt])
        i32 = torch.int32
        b, k = shape.requests, shape.top_k
        self.source = torch.zeros((b, shape.max_pages), dtype=i32, device=self.dev)
        self.resident = torch.full((b, shape.max_pages), -1, dtype=i32, device=self.dev)
        self.hot = torch.zeros((b, shape.hot_blocks), dtype=i32, device=self.dev)
        self.topk = torch.full((b, k), -1, dtype=i32, device=self.dev)
        self.row_state = torch.full((b,), -1, dtype=i32, device=self.dev)
        self.seq_lens = torch.zeros(b, dtype=i32, device=self.dev)
        self.inputs = ResolveInputs(self.topk, self.row_state, self.seq_lens, self.source, self.resident, self.hot)
        self._before = before_reads
        self._after = after_writes
        self._validate = validate
        self.graph = None
        if graph:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.rt.resolve(self.inputs, gather=True, validate=False)
                self.rt.replay_plan()
        self.completed: list[int] = []
        self.enqueued: list[int] = []

    def _record(self, progress) -> None:  # noqa: ANN001 - TransferProgress
        self.enqueued += progress.enqueued
        self.completed += progress.completed

    def run(self, plan: StepPlan, schedule: Schedule, *, before_mirrors: Callable[[], None] | None = None,
            after_submit: Callable[[], None] | None = None) -> None:
        """Carry out `plan`; `schedule` holds the tables as they are after it. `before_mirrors` runs
        between the resolve and the mirrors (a GPU delay, or a fault), `after_submit` once the
        step's host writes are submitted."""
        s = self.shape
        if plan.drain:
            self._record(self.engine.drain())
            missing = [i for i in plan.expect_completed if i not in self.completed]
            if missing:
                raise AssertionError(f"step {plan.step}: spills {missing} are released but were never reported "
                                     "completed")
        if plan.reused:
            gen = torch.Generator().manual_seed(self.seed * 31 + plan.step)
            junk = torch.randint(0, 256, (s.layers, len(plan.reused), s.block_size, self.row_bytes), dtype=torch.uint8,
                                 generator=gen).to(self.dev)
            idx = torch.tensor(plan.reused, device=self.dev)
            for layer, c in enumerate(self.caches):
                c.view(torch.uint8)[idx] = junk[layer]
        self.source.copy_(schedule.source)
        self.resident.copy_(schedule.resident)
        self.hot.copy_(schedule.hot)
        if plan.writes:
            data = row_bytes_for(self.seed, plan.step, len(plan.writes), s.layers, self.row_bytes).to(self.dev)
            idx = torch.tensor(plan.writes, device=self.dev)
            for layer, c in enumerate(self.caches):
                c.view(torch.uint8).view(-1, self.row_bytes)[idx] = data[layer]
        if plan.step > 0:
            # The inputs go in before the ordering wait: a copy from pageable memory synchronizes
            # the stream, which must not hold the host behind rank 0's event.
            self.topk.copy_(plan.topk)
            self.row_state.copy_(plan.row_state)
            self.seq_lens.copy_(plan.seq_lens)
            if self._before is not None:
                self._before(self, plan.step)
            if self.graph is not None:
                self.graph.replay()
            else:
                self.rt.resolve(self.inputs, gather=True, validate=self._validate)
                self.rt.replay_plan()
        if before_mirrors is not None:
            before_mirrors()
        self.engine.submit_row_mirrors(plan.mirrors)
        if plan.spills:
            self.engine.submit_pages(plan.spills)
        if self._after is not None:
            self._after(self, plan.step)
        if after_submit is not None:
            after_submit()
        self._record(self.engine.poll())

    def finish(self) -> None:
        self._record(self.engine.drain())

    def gathered(self, plan: StepPlan) -> torch.Tensor:
        """The bytes the step's attention reads: every layer's device rows at the resolved rows
        of the batch (masked entries left out), [layers, entries, row_bytes] on the CPU."""
        rows = self.rt.result.rows[:plan.topk.shape[0]].reshape(-1).to(self.dev).long()
        rows = rows[rows >= 0]
        return torch.stack([c.view(torch.uint8).view(-1, self.row_bytes)[rows] for c in self.caches]).cpu()

    def host_rows(self, lengths: list[int]) -> list[torch.Tensor]:
        """Each request's first `lengths[q]` host rows, per layer."""
        out = []
        s = self.shape
        rows = s.max_pages * s.block_size
        for layer in range(s.layers):
            view = self.pool.layer_view(layer).view(torch.uint8)
            out.append(torch.cat([view[q * rows:q * rows + n] for q, n in enumerate(lengths)]))
        return out


def digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.contiguous().numpy().tobytes(), digest_size=12).hexdigest()


def compare(subject: Executor, oracle: Executor, plan: StepPlan, *, writer: bool, host_lengths: list[int]) -> dict:
    """Raise AssertionError (one line) unless `subject` matches `oracle` after `plan`: the
    resolve's outputs, every gathered byte, the device caches, the hot maps and LRU orders, the
    counters (a peer moves no bytes to host: its d2h counter is not compared) and each request's
    first `host_lengths[q]` host rows. Returns the step's figures."""
    what = f"step {plan.step}"
    got, want = subject.rt.result, oracle.rt.result
    for name in ("rows", "valid_counts", "plan_counts", "plan_host", "plan_device"):
        g, w = getattr(got, name).cpu(), getattr(want, name)
        if not torch.equal(g, w):
            at = (g != w).nonzero()[0].tolist()
            raise AssertionError(f"{what}: result.{name} differs first at {at}: {g[tuple(at)]} vs the reference's "
                                 f"{w[tuple(at)]}")
    gathered = subject.gathered(plan)
    if not torch.equal(gathered, oracle.gathered(plan)):
        raise AssertionError(f"{what}: the gathered rows differ from the reference's")
    for layer, (c, r) in enumerate(zip(subject.caches, oracle.caches, strict=True)):
        if not torch.equal(c.view(torch.uint8).cpu(), r.view(torch.uint8)):
            raise AssertionError(f"{what}: device cache of layer {layer} differs from the reference's")
    for q in range(subject.shape.requests):
        gm, gl = subject.rt.hot_state(q)
        wm, wl = oracle.rt.hot_state(q)
        if not (torch.equal(gm, wm) and torch.equal(gl, wl)):
            raise AssertionError(f"{what}: hot map or LRU order of request {q} differs from the reference's")
    gs, ws = subject.rt.stats(), oracle.rt.stats()
    fields = ("resident", "hits", "misses", "h2d_bytes") + (("d2h_bytes",) if writer else ())
    for f in fields:
        if getattr(gs, f) != getattr(ws, f):
            raise AssertionError(f"{what}: stats.{f} is {getattr(gs, f)}, the reference's {getattr(ws, f)}")
    for layer, (g, w) in enumerate(zip(subject.host_rows(host_lengths), oracle.host_rows(host_lengths), strict=True)):
        if not torch.equal(g, w):
            bad = int((g != w).any(1).nonzero()[0, 0])
            raise AssertionError(f"{what}: host row {bad} (of those written) of layer {layer} differs from the "
                                 "reference's")
    return {"step": plan.step, "gathered_entries": int(gathered.shape[1]),
            "gathered_bytes": int(gathered.numel()), "digest": digest(gathered)}
