"""Hypothesis stateful test: random engines and workers against `HiSparseCoordinator`.

The machine simulates the bytes too: GPU blocks and host blocks hold per-row values derived from
the token prefix (so shared prefixes give equal rows), the engine's forward writes resident rows,
and the simulated workers execute each command (host copies, restores, mirrors, spill fences)
and acknowledge transfers late, out of order and one worker at a time. After every rule:

- every page of every running request reads back the right rows from where the worker tables
  say it lives (resident block, or host through the hot buffer), and the host copy is complete;
- GPU and host lease counts equal what the coordinator's live objects account for (no leaks),
  and a spilled page's GPU block stays leased until every worker acknowledged the enqueue;
- a block is published only after every worker reported its spill complete (or its import
  completed), and a prefix hit returns blocks holding exactly that prefix's rows;
- capacity is never exceeded.

Teardown finishes everything, acknowledges everything and checks that every lease came back.
"""

from __future__ import annotations

import os
from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from hypothesis_profiles import examples

from hisparse_core.coordinator import HiSparseCoordinator, ImportTarget, SimpleGpuBlockPool, StepRequest
from hisparse_core.coordinator.pages import LEASED_STATES, Lifecycle
from hisparse_core.errors import CapacityError, InvalidInputError, ProtocolError
from hisparse_core.types import OffloadCommand, WorkerMetadata

from .harness import small_config

BS = 4
MAX_LEN = 32
DOCS = [tuple((d * 5 + i) % 11 for i in range(MAX_LEN)) for d in range(3)]


def row_value(group: int, tokens: tuple[int, ...] | list[int], pos: int) -> tuple[int, int]:
    return group, hash(tuple(tokens[:pos + 1]))


class Req:
    def __init__(self, rid: str, tokens: list[int], state_index: int, num_computed: int, groups: int) -> None:
        self.rid = rid
        self.tokens = tokens
        self.state_index = state_index
        self.num_computed = num_computed
        self.prompt_len = len(tokens)
        self.table: list[list[int]] = [[] for _ in range(groups)]
        self.handed = 0          # table pages handed to the coordinator (below: coordinator's)
        self.scheduled_once = False
        self.worker_state = -1   # the state row the worker tables hold this request in (as of its last step)


class CoordinatorMachine(RuleBasedStateMachine):
    @initialize(workers=st.integers(1, 3), groups=st.integers(1, 2), host_blocks=st.integers(12, 48),
                gpu_blocks=st.integers(24, 48))
    def setup(self, workers: int, groups: int, host_blocks: int, gpu_blocks: int) -> None:
        self.config = small_config(host_blocks=host_blocks, num_resident_groups=groups, max_model_len=MAX_LEN,
                                   pressure_watermark_blocks=6)
        self.G = groups
        self.W = workers
        self.gpu = SimpleGpuBlockPool(gpu_blocks)
        self.coord = HiSparseCoordinator(self.config, self.gpu)
        self.reqs: dict[str, Req] = {}
        self.next_id = 0
        self.free_states: list[int] = []
        self.next_state = 0
        self.hog: list[int] = []
        # simulated memory
        self.gpu_mem: dict[int, list[object]] = {}
        self.host_mem: dict[tuple[int, int], list[object]] = {}
        self.residency: dict[int, dict[int, tuple[int, ...]]] = {}
        self.source: dict[int, dict[int, int]] = {}
        self.hot: dict[int, tuple[int, ...]] = {}
        # worker acknowledgement state
        self.transfers: dict[int, tuple[int, tuple[int, ...], bool]] = {}  # id -> (host, gpu, restore)
        self.unreported_enq: list[set[int]] = [set() for _ in range(workers)]
        self.unreported_done: list[set[int]] = [set() for _ in range(workers)]
        self.enq_count: Counter[int] = Counter()
        self.done_count: Counter[int] = Counter()
        self.copies: set[int] = set()
        self.durable: set[int] = set()
        self.imports: dict[str, tuple[list[int], tuple[int, ...]]] = {}
        self.landings: list[Req] = []
        self.host_imports_done = 0
        self.detached_seen = False
        self.writers: dict[int, list[str]] = {}   # GPU block -> who wrote it (failure messages)
        host = self.coord._host
        real_publish, real_allocate = host.publish, host.allocate

        def publish(block: int, h: bytes) -> bool:
            assert block in self.durable, f"host block {block} published before its completion acknowledgement"
            return real_publish(block, h)

        def allocate(count: int) -> list[int]:
            out = real_allocate(count)
            self.durable.difference_update(out)
            for b in out:
                for g in range(self.G):
                    self.host_mem[(g, b)] = [None] * BS
            return out

        host.publish = publish  # type: ignore[method-assign]
        host.allocate = allocate  # type: ignore[method-assign]

    # -- helpers ----------------------------------------------------------------------

    def _new_rid(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _new_state(self) -> int:
        if self.free_states:
            return self.free_states.pop()
        self.next_state += 1
        return self.next_state - 1

    def _engine_release(self, r: Req) -> None:
        """Blocks the engine still holds (never handed to the coordinator) go back to the pool."""
        held = [b for row in r.table for b in row[r.handed:] if b >= 0]
        if held:
            self.gpu.release(held)
        self.free_states.append(r.state_index)

    def _tokens(self, data: st.DataObject) -> list[int]:
        doc = data.draw(st.sampled_from(DOCS))
        shared = data.draw(st.sampled_from([0, 3, 4, 8, 12, 16, 16, 20, 24]))
        extra = data.draw(st.sampled_from([[], [], [1], [2, 3], [4, 5, 6, 7, 8]]))
        toks = list(doc[:shared]) + extra
        return toks or [1]

    def _execute(self, cmd: OffloadCommand | None, writes: list[tuple[Req, int, int]]) -> None:
        for u in self.coord.take_table_updates():
            row = self.source.setdefault(u.state_index, {})
            row.update(zip(u.pages, u.host_block_ids, strict=True))
            if u.hot_block_ids is not None:
                self.hot[u.state_index] = u.hot_block_ids
        if cmd is not None:
            for c in cmd.host_block_copies:
                for g in range(self.G):
                    self.host_mem[(g, c.dst_block_id)] = list(self.host_mem[(g, c.src_block_id)])
                self.copies.add(c.dst_block_id)
            for u in cmd.residency_updates:
                row = self.residency.setdefault(u.state_index, {})
                for i, p in enumerate(u.pages):
                    row[p] = tuple(u.block_ids[g][i] for g in range(self.G))
            for t in cmd.page_transfers:
                if t.restore:
                    assert not t.after_forward
                    for g, b in enumerate(t.resident_block_ids):
                        self.gpu_mem[b] = list(self.host_mem[(g, t.host_block_id)])
                        self.writers.setdefault(b, []).append(f"restore {t.transfer_id} from host {t.host_block_id}")
        for r in self.landings:        # device-side P/D imports
            if self.reqs.get(r.rid) is not r:
                continue
            for g, row in enumerate(r.table):
                for pos in range(r.num_computed):
                    self.gpu_mem.setdefault(row[pos // BS], [None] * BS)[pos % BS] = row_value(g, r.tokens, pos)
                    self.writers.setdefault(row[pos // BS], []).append(f"{r.rid} landing pos {pos}")
        self.landings.clear()
        for r, start, end in writes:   # the forward
            for pos in range(start, end):
                p, off = divmod(pos, BS)
                for g in range(self.G):
                    self.gpu_mem.setdefault(r.table[g][p], [None] * BS)[off] = row_value(g, r.tokens, pos)
                    self.writers.setdefault(r.table[g][p], []).append(f"{r.rid} pos {pos}")
        if cmd is None:
            return
        for m in cmd.row_mirrors:
            hb, hoff = divmod(m.destination_start, BS)
            assert hoff + m.num_rows <= BS
            for g, s in enumerate(m.source_starts):
                gb, goff = divmod(s, BS)
                assert goff == hoff
                for i in range(m.num_rows):
                    self.host_mem[(g, hb)][hoff + i] = self.gpu_mem[gb][goff + i]
        for t in cmd.page_transfers:
            self.transfers[t.transfer_id] = (t.host_block_id, t.resident_block_ids, t.restore)
            for w in range(self.W):
                self.unreported_enq[w].add(t.transfer_id)
            if not t.restore:
                assert t.after_forward
                for g, b in enumerate(t.resident_block_ids):
                    assert self.host_mem[(g, t.host_block_id)] == self.gpu_mem[b], \
                        f"spill {t.transfer_id}: the mirrors did not carry page contents to host block {t.host_block_id}"
        self.recycled = set(cmd.recycled_host_blocks)

    def _snapshot(self) -> tuple[object, ...]:
        return (self.coord.stats(), [self.gpu.lease_count(b) for b in range(self.gpu.num_blocks)],
                list(self.coord._host._leases), len(self.coord._transfers), sorted(self.coord._requests))

    def _report(self, meta: WorkerMetadata) -> None:
        # The coordinator publishes inside the call, so a spill's block counts as durable as soon
        # as this report brings its completions to every worker.
        landing = [tid for tid, n in meta.completed.items() if self.done_count[tid] + n == self.W]
        added = {self.transfers[tid][0] for tid in landing if not self.transfers[tid][2]} - self.durable
        self.durable |= added
        try:
            self.coord.update_from_workers(meta, self.W)
        except Exception:
            self.durable -= added
            raise
        for tid, n in meta.enqueued.items():
            self.enq_count[tid] += n
        for tid, n in meta.completed.items():
            self.done_count[tid] += n
        for tid in landing:
            del self.transfers[tid]

    # -- rules: admission ---------------------------------------------------------------

    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        tokens = self._tokens(data)
        cap = data.draw(st.sampled_from([None, len(tokens) - 1, 0]))
        rid = self._new_rid()
        hit_view = self.coord.lookup_prefix(tokens, max_tokens=cap)
        whole = self.coord.lookup_prefix(tokens)
        for i, b in enumerate(whole.host_block_ids):
            assert b in self.durable
            for g in range(self.G):
                assert self.host_mem[(g, b)] == [row_value(g, tokens, i * BS + o) for o in range(BS)]
        before = self._snapshot()
        try:
            hit = self.coord.add_request(rid, tokens, max_prefix_tokens=cap)
        except CapacityError:
            assert self._snapshot() == before
            return
        assert hit >= hit_view.num_tokens
        assert hit // BS * BS == hit_view.num_tokens or hit > hit_view.num_tokens - BS
        # prefix hits hold exactly this prefix's rows, and only durable (completed) blocks
        assert whole.host_block_ids[:len(hit_view.host_block_ids)] == hit_view.host_block_ids
        r = Req(rid, tokens, self._new_state(), hit, self.G)
        first = self.coord.first_resident_page(rid)
        for row in r.table:
            row.extend([-1] * first)
        r.handed = first
        self.reqs[rid] = r

    @rule(data=st.data())
    def pd_import(self, data: st.DataObject) -> None:
        tokens = self._tokens(data)
        n = len(tokens)
        rid = self._new_rid()
        # Other device groups (the indexer) that need room either way; the largest choice leaves
        # exactly the host-backed footprint, so a long import can only land on host.
        squeeze = self.gpu.num_free_blocks - self.config.hot_blocks_per_request - 2 * self.G
        other = data.draw(st.sampled_from([0, max(0, squeeze), 10_000]))
        target = self.coord.choose_import_target(rid, n, other_device_blocks=other)
        assert self.coord.choose_import_target(rid, n, other_device_blocks=other) in (target, ImportTarget.WAIT)
        if target is ImportTarget.WAIT:
            with pytest.raises(InvalidInputError):   # nothing was chosen, so nothing to drop
                self.coord.finish_request(rid)
            return
        if target is ImportTarget.HOST:
            before = self._snapshot()
            try:
                blocks = self.coord.begin_host_import(rid, tokens, n)
            except CapacityError:
                assert self._snapshot() == before
                self.coord.finish_request(rid)
                return
            self.imports[rid] = (tokens, blocks)
            return
        # DEVICE: land every page in resident blocks, then admit with no prefix hit.
        pages = -(-n // BS)
        if self.gpu.num_free_blocks < pages * self.G:
            self.coord.finish_request(rid)
            return
        assert self.coord.add_request(rid, tokens, max_prefix_tokens=0) == 0
        r = Req(rid, tokens, self._new_state(), n, self.G)
        for row in r.table:
            row.extend(self.gpu.acquire(pages))
        # The KV lands during the next step, after the worker applied that step's residency updates
        # (a block this allocation took from a released page is reported lost in that command).
        self.landings.append(r)
        self.reqs[rid] = r

    @precondition(lambda self: self.imports)
    @rule(data=st.data(), ok=st.booleans())
    def end_import(self, data: st.DataObject, ok: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.imports)))
        tokens, blocks = self.imports.pop(rid)
        n = len(tokens)
        if not ok:
            self.coord.fail_host_import(rid)
            return
        for i, b in enumerate(blocks):   # the remote write landed
            for g in range(self.G):
                self.host_mem[(g, b)] = [row_value(g, tokens, i * BS + o) if i * BS + o < n else None
                                         for o in range(BS)]
        self.durable.update(blocks[:n // BS])
        self.coord.complete_host_import(rid)
        self.host_imports_done += 1
        r = Req(rid, tokens, self._new_state(), n, self.G)
        first = self.coord.first_resident_page(rid)
        assert first == n // BS
        for row in r.table:
            row.extend([-1] * first)
        r.handed = first
        self.reqs[rid] = r

    # -- rules: steps -------------------------------------------------------------------

    @rule(data=st.data(), steps=st.integers(1, 8))
    def steps(self, data: st.DataObject, steps: int) -> None:
        for _ in range(steps):
            self._step(data)
            if data.draw(st.integers(0, 3)):
                self.acknowledge(data)

    @rule(data=st.data(), admissions=st.integers(1, 3), steps=st.integers(4, 12))
    def busy_period(self, data: st.DataObject, admissions: int, steps: int) -> None:
        """A burst of arrivals with shared prefixes, then steps that mostly acknowledge promptly."""
        for _ in range(admissions):
            self.admit(data)
        self.steps(data, steps)

    def _room(self, r: Req, end: int, host_free: int) -> bool:
        """Whether the host blocks left and the GPU pool can back a step bringing `r` to `end` tokens."""
        missing = -(-end // BS) - len(r.table[0])
        return (self.coord.host_blocks_needed(r.rid, end) <= host_free
                and missing * self.G <= self.gpu.num_free_blocks)

    def _step(self, data: st.DataObject) -> None:
        running = sorted(self.reqs)
        views: list[StepRequest] = []
        writes: list[tuple[Req, int, int]] = []
        host_free = self.coord.num_free_host_blocks
        chosen: list[str] = []
        # The engine schedules requests one at a time, each drawn from those the pools can still
        # back by one more token (a full request, at MAX_LEN, waits until it leaves), until it stops
        # (after five on average, as st.lists would) or none is left. Drawing from a list of all
        # running requests and skipping those without room wasted a third of the picks.
        while True:
            room = [rid for rid in running if rid not in chosen and self.reqs[rid].num_computed < MAX_LEN
                    and self._room(self.reqs[rid], self.reqs[rid].num_computed + 1, host_free)]
            if not room or not data.draw(st.integers(0, 5)):
                break
            rid = data.draw(st.sampled_from(room))
            chosen.append(rid)
            r = self.reqs[rid]
            if r.num_computed < r.prompt_len:
                n = min(data.draw(st.integers(1, 9)), r.prompt_len - r.num_computed)
            else:
                n = 1
            while not self._room(r, r.num_computed + n, host_free):   # a prompt chunk shrinks to fit
                n -= 1
            while len(r.tokens) < r.num_computed + n:
                r.tokens.append(data.draw(st.integers(0, 10)))
            end = r.num_computed + n
            pages = -(-end // BS)
            missing = pages - len(r.table[0])
            host_free -= self.coord.host_blocks_needed(rid, end)
            for row in r.table:
                if missing > 0:
                    row.extend(self.gpu.acquire(missing))
            views.append(StepRequest(rid, r.state_index, r.num_computed, n, tuple(r.tokens),
                                     tuple(tuple(row) for row in r.table)))
            writes.append((r, r.num_computed, end))
        leaving = [rid for rid in running if rid not in chosen and data.draw(st.integers(0, 9)) == 0]
        finished = tuple(rid for rid in leaving if data.draw(st.booleans()))
        preempted = tuple(rid for rid in leaving if rid not in finished)
        for rid in leaving:
            r = self.reqs.pop(rid)
            self._engine_release(r)
        cmd = self.coord.schedule_step(views, finished=finished, preempted=preempted)
        # The step took no host block beyond what host_blocks_needed promised (leaving gives some back).
        assert self.coord.num_free_host_blocks >= host_free
        for r, _, end in writes:
            r.handed = max(r.handed, -(-end // BS))
            r.scheduled_once = True
            r.worker_state = r.state_index
        self._execute(cmd, writes)
        for r, _, end in writes:
            r.num_computed = end

    def _oversized_core(self, order: list[Req]) -> list[tuple[Req, int]] | None:
        """Requests of `order` in turn, each grown as far as the GPU blocks left can back (to MAX_LEN at
        most), until together they need more host blocks than are free; None if they never do."""
        gpu_left, need, core = self.gpu.num_free_blocks, 0, []
        for r in order:
            hi = min(MAX_LEN, (len(r.table[0]) + gpu_left // self.G) * BS)
            if hi <= r.num_computed:
                continue
            gpu_left -= max(0, -(-hi // BS) - len(r.table[0])) * self.G
            core.append((r, hi))
            need += self.coord.host_blocks_needed(r.rid, hi)
            if need > self.coord.num_free_host_blocks:
                return core
        return None

    def _oversized_possible(self) -> bool:
        return self._oversized_core([self.reqs[rid] for rid in sorted(self.reqs)]) is not None

    @precondition(_oversized_possible)
    @rule(data=st.data())
    def oversized_step(self, data: st.DataObject) -> None:
        """A step that needs more host blocks than the pool has is refused and changes nothing.

        Drawn directly: requests in a drawn order, grown until the step is oversized, then any
        of the others, then each one's end lowered within the margin that keeps it oversized."""
        order = [self.reqs[rid] for rid in data.draw(st.permutations(sorted(self.reqs)))]
        # The precondition found a core in sorted order; a drawn order may run out of GPU blocks first.
        core = self._oversized_core(order) or self._oversized_core(sorted(order, key=lambda r: r.rid))
        assert core is not None
        members = dict(core)
        gpu_left = self.gpu.num_free_blocks - sum(max(0, -(-hi // BS) - len(r.table[0])) * self.G
                                                  for r, hi in core)
        for r in order:   # any of the others too, at a drawn end the GPU blocks left can back
            if r in members or not data.draw(st.booleans()):
                continue
            hi = min(MAX_LEN, (len(r.table[0]) + gpu_left // self.G) * BS)
            if hi <= r.num_computed:
                continue
            members[r] = data.draw(st.integers(r.num_computed + 1, hi))
            gpu_left -= max(0, -(-members[r] // BS) - len(r.table[0])) * self.G
        free = self.coord.num_free_host_blocks
        need = sum(self.coord.host_blocks_needed(r.rid, end) for r, end in members.items())
        for r, hi in core:   # lower the core's ends while the step still needs more than is free
            full = self.coord.host_blocks_needed(r.rid, hi)
            lo = next(e for e in range(r.num_computed + 1, hi + 1)
                      if need - full + self.coord.host_blocks_needed(r.rid, e) > free)
            members[r] = data.draw(st.integers(lo, hi))
            need += self.coord.host_blocks_needed(r.rid, members[r]) - full
        assert need > free
        grown: list[tuple[Req, int]] = []
        views: list[StepRequest] = []
        try:
            for r in (r for r in order if r in members):   # the step lists them in the drawn order
                end = members[r]
                missing = -(-end // BS) - len(r.table[0])
                grown.append((r, len(r.table[0])))
                for row in r.table:
                    if missing > 0:
                        row.extend(self.gpu.acquire(missing))
                toks = tuple(r.tokens) + (0,) * max(0, end - len(r.tokens))
                views.append(StepRequest(r.rid, r.state_index, r.num_computed, end - r.num_computed, toks,
                                         tuple(tuple(row) for row in r.table)))
            before = self._snapshot() + (self._host_state(),)
            with pytest.raises(CapacityError):
                self.coord.schedule_step(views)
            assert self._snapshot() + (self._host_state(),) == before
            event("oversized step refused")
        finally:   # the engine gives back what it allocated for the refused step
            for r, length in grown:
                for row in r.table:
                    if len(row) > length:
                        self.gpu.release(row[length:])
                        del row[length:]

    def _host_state(self) -> tuple[object, ...]:
        host = self.coord._host
        recs = tuple((rid, list(r.host), list(r.gpu), bytes(r.state), r.num_mirrored, r.num_sealed, r.state_index)
                     for rid, r in sorted(self.coord._requests.items()))
        return list(host._free), list(host._cached), dict(host._by_hash), recs, self.coord._table_updates

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        r = self.reqs.pop(rid)
        self._engine_release(r)
        if data.draw(st.booleans()):
            self.coord.finish_request(rid)
        else:
            self.coord.preempt_request(rid)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def move_state_row(self, data: st.DataObject) -> None:
        r = self.reqs[data.draw(st.sampled_from(sorted(self.reqs)))]
        self.next_state += 1   # the old row is not handed to anyone else while the worker still reads it
        r.state_index = self.next_state - 1

    @rule(grab=st.integers(-30, 30))
    def pressure(self, grab: int) -> None:
        if grab > 0:
            self.hog.extend(self.gpu.acquire(min(grab, self.gpu.num_free_blocks)))
        elif self.hog:
            give = self.hog[:(-grab) or 1]
            del self.hog[:len(give)]
            self.gpu.release(give)

    # -- rules: workers -----------------------------------------------------------------

    @rule(data=st.data())
    def acknowledge(self, data: st.DataObject) -> None:
        workers = data.draw(st.lists(st.integers(0, self.W - 1), min_size=1, unique=True))
        meta = WorkerMetadata()
        for w in workers:
            enq = sorted(self.unreported_enq[w])
            enq = data.draw(st.lists(st.sampled_from(enq), unique=True)) if enq else []
            done_pool = sorted(self.unreported_done[w])
            done = data.draw(st.lists(st.sampled_from(done_pool), unique=True)) if done_pool else []
            self.unreported_enq[w].difference_update(enq)
            self.unreported_done[w].difference_update(done)
            self.unreported_done[w].update(enq)
            meta = meta.aggregate(WorkerMetadata.report(enq, done))
        copies = sorted(self.copies) if data.draw(st.booleans()) else []
        self.copies.difference_update(copies)
        meta = meta.aggregate(WorkerMetadata.report(completed_host_copies=copies))
        self._report(meta)

    @rule(data=st.data())
    def bad_acknowledgement(self, data: st.DataObject) -> None:
        before = self._snapshot()
        # An excess count needs a transfer in flight to exceed.
        kind = data.draw(st.sampled_from(["unknown", "copy"] + (["excess"] if self.transfers else [])))
        if kind == "unknown":
            meta = WorkerMetadata.report(enqueued=[10_000_000])
        elif kind == "excess":
            tid = data.draw(st.sampled_from(sorted(self.transfers)))
            meta = WorkerMetadata({tid: self.W - self.enq_count[tid] + 1})
        else:
            meta = WorkerMetadata.report(completed_host_copies=[9_999_999])
        with pytest.raises(ProtocolError):
            self.coord.update_from_workers(meta, self.W)
        assert self._snapshot() == before

    @rule(data=st.data())
    def bad_engine_input(self, data: st.DataObject) -> None:
        before = self._snapshot()
        # Rewriting sealed rows needs a request with a sealed page.
        sealed = [r for r in self.reqs.values() if self.coord._requests[r.rid].num_sealed > 0]
        kind = data.draw(st.sampled_from(["schedule", "finish", "preempt"] + (["rewrite"] if sealed else [])))
        rewritten = data.draw(st.sampled_from(sealed)) if kind == "rewrite" else None
        with pytest.raises(InvalidInputError):
            if kind == "schedule":
                self.coord.schedule_step([StepRequest("nobody", 0, 0, 1, (1,), ((0,),) * self.G)])
            elif kind == "finish":
                self.coord.finish_request("nobody")
            elif kind == "preempt":
                self.coord.schedule_step([], preempted=["nobody"])
            else:
                assert rewritten is not None
                r = rewritten
                self.coord.schedule_step([StepRequest(r.rid, r.state_index, 0, 1, tuple(r.tokens),
                                                      tuple(tuple(row) for row in r.table))])
        assert self._snapshot() == before

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def reads_are_correct(self) -> None:
        for r in self.reqs.values():
            if not r.scheduled_once:
                continue
            si = r.worker_state
            rec = self.coord._requests.get(r.rid)
            for p in range(-(-r.num_computed // BS)):
                rows = min(BS, r.num_computed - p * BS)
                expect = [[row_value(g, r.tokens, p * BS + o) for o in range(rows)] for g in range(self.G)]
                hb = self.source[si][p]
                for g in range(self.G):
                    assert self.host_mem[(g, hb)][:rows] == expect[g], f"{r.rid} page {p}: host copy is stale"
                res = self.residency[si][p]
                if res[0] >= 0:
                    for g, b in enumerate(res):
                        # A page lost since the last step (its block handed out between steps) is
                        # reported in the next command, before anything can write the block.
                        lost = rec is not None and self.coord._policy.is_lost_pending(rec, p)
                        assert lost or self.gpu.is_readable(b), f"{r.rid} page {p}: resident block {b} was reused"
                        assert self.gpu_mem[b][:rows] == expect[g], (f"{r.rid} page {p}: resident block {b} stale; writers {self.writers.get(b)}; "
                                                                   f"got {self.gpu_mem[b][:rows]} want {expect[g]} tokens {r.tokens} computed {r.num_computed}")
                else:
                    assert len(self.hot.get(si, ())) == self.config.hot_blocks_per_request, \
                        f"{r.rid} page {p} reads from host without a hot buffer"

    @invariant()
    def tables_agree(self) -> None:
        """The coordinator's view of each page agrees with the engine's table and the worker's rows."""
        for r in self.reqs.values():
            rec = self.coord._requests.get(r.rid)
            if rec is None or not r.scheduled_once:
                continue
            for p, blocks in enumerate(rec.gpu):
                if blocks is not None:
                    assert blocks == tuple(row[p] for row in r.table), (r.rid, p, blocks)
                if r.worker_state == rec.state_index and p < -(-r.num_computed // BS):
                    worker = self.residency[r.worker_state][p]
                    if blocks is None:   # (a page lost since the last step is reported in the next command)
                        assert worker[0] == -1 or self.coord._policy.is_lost_pending(rec, p), (r.rid, p, worker)

    @invariant()
    def leases_balance(self) -> None:
        c = self.coord
        gpu_expected: Counter[int] = Counter(self.hog)
        host_expected: Counter[int] = Counter()
        for r in self.reqs.values():
            gpu_expected.update(b for row in r.table for b in row[r.handed:] if b >= 0)
        for rec in list(c._requests.values()) + list(c._detached):
            assert rec.lifecycle is (Lifecycle.RUNNING if rec.request_id in c._requests else Lifecycle.DETACHED)
            for p, blocks in enumerate(rec.gpu):
                if blocks is not None and rec.state[p] in LEASED_STATES:
                    gpu_expected.update(blocks)
            gpu_expected.update(rec.hot or ())
            host_expected.update(b for b in rec.host if b >= 0)
        for imp in c._pd.in_flight.values():
            gpu_expected.update(imp.hot)
            host_expected.update(imp.host_blocks)
        for t in c._transfers.pending():
            if not t.enqueue_applied:
                gpu_expected.update(t.gpu_blocks)
            host_expected[t.host_block] += 1
        for copy in c._copies._pending.values():
            host_expected.update((copy.src, copy.dst))
        gpu_actual = Counter({b: self.gpu.lease_count(b) for b in range(self.gpu.num_blocks)
                              if self.gpu.lease_count(b)})
        host_actual = Counter({b: n for b, n in enumerate(c._host._leases) if n})
        assert gpu_actual == gpu_expected
        assert host_actual == host_expected
        c._host.check_invariants()
        assert c._host.num_leased <= c._host.capacity
        assert self.gpu.num_leased_blocks <= self.gpu.num_blocks

    @invariant()
    def note_detached(self) -> None:
        self.detached_seen = self.detached_seen or bool(self.coord._detached)

    @invariant()
    def spill_sources_stay_leased(self) -> None:
        for tid, (_, blocks, _) in self.transfers.items():
            if self.enq_count[tid] < self.W:
                for b in blocks:
                    assert self.gpu.lease_count(b) > 0, f"GPU block {b} of transfer {tid} freed before its enqueue"

    def teardown(self) -> None:
        if not hasattr(self, "coord"):
            return
        for rid in list(self.imports):
            self.coord.fail_host_import(rid)
        for rid, r in list(self.reqs.items()):
            self._engine_release(r)
            self.coord.finish_request(rid)
        self._execute(self.coord.schedule_step([]), [])
        for _ in range(3):   # bounded: after a failed rule the bookkeeping may never converge
            if not (self.transfers or self.copies):
                break
            meta = WorkerMetadata()
            for w in range(self.W):
                enq = sorted(self.unreported_enq[w])
                done = sorted(self.unreported_done[w] | set(enq))
                self.unreported_enq[w].clear()
                self.unreported_done[w].clear()
                meta = meta.aggregate(WorkerMetadata.report(enq, done))
            meta = meta.aggregate(WorkerMetadata.report(completed_host_copies=sorted(self.copies)))
            self.copies.clear()
            self._report(meta)
        assert not self.transfers and not self.copies, f"acknowledgements never drained: {sorted(self.transfers)}"
        if self.hog:
            self.gpu.release(self.hog)
        s = self.coord.stats()
        for name in ("released_pages", "lost_pages", "restores", "evicted_blocks", "prefix_hit_tokens"):
            event(f"{name} > 0" if getattr(s, name) else f"{name} == 0")
        event(f"detached publications > 0: {self.detached_seen}")
        event(f"host imports completed > 0: {self.host_imports_done > 0}")
        assert not self.coord.has_pending_work(), s
        assert s.host_blocks_used == 0 and s.running_requests == 0 and s.detached_requests == 0, s
        assert self.gpu.num_free_blocks == self.gpu.num_blocks, "GPU lease leaked"
        self.coord._policy.check_idle()


CoordinatorMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("HISPARSE_COORD_EXAMPLES", examples(100))), stateful_step_count=80, deadline=None,
    report_multiple_bugs=False,
    phases=[p for p in Phase if p is not Phase.shrink or not os.environ.get("HISPARSE_COORD_NO_SHRINK")],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_coordinator_state_machine = CoordinatorMachine.TestCase
