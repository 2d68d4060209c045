"""The reference runtime against a tiny list-and-dict model of docs/resolver-contract.md.

Hypothesis drives random geometries through many steps: drifting working sets, speculative
groups, padding rows, masked/null/resident/host mixes, residency and source changes,
invalidations, resets, gathers and replays. After every step the runtime must equal the model
exactly (outputs, plan, hot maps, LRU orders, counters) and every host entry's output row must
hold its host row's bytes in each layer that was gathered or replayed.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from hypothesis_profiles import examples
from refcpu_support import bound_runtime, i32

from hisparse_core.geometry import BF16_MLA, FP8_DS_MLA, RuntimeConfig
from hisparse_core.runtime import ResolveInputs


class Model:
    """The contract over plain lists: hot map and LRU per state row, counters, last outputs."""

    def __init__(self, cfg: RuntimeConfig) -> None:
        self.cfg = cfg
        self.hot_map = {q: [-1] * cfg.hot_rows for q in range(cfg.max_requests)}
        self.lru = {q: list(range(cfg.hot_rows)) for q in range(cfg.max_requests)}
        self.counters = {"resident": 0, "hits": 0, "misses": 0, "h2d_bytes": 0, "d2h_bytes": 0}
        k, b = cfg.top_k, cfg.max_batch_rows
        self.rows = [[-1] * k for _ in range(b)]
        self.plan = [[] for _ in range(b)]  # per batch row: list of (host row, device row)
        self.sources: dict[tuple[int, int], int] = {}  # (batch row, entry) -> host row of host entries

    def resolve(self, topk: list[list[int]], row_state: list[int], seq_lens: list[int], source: list[list[int]],
                resident: list[list[int]], hot: list[list[int]]) -> None:
        cfg, bs = self.cfg, self.cfg.block_size
        self.rows = [[-1] * cfg.top_k for _ in range(cfg.max_batch_rows)]
        self.plan = [[] for _ in range(cfg.max_batch_rows)]
        self.sources = {}

        def hot_row(q: int, slot: int) -> int:
            return hot[q][slot // bs] * bs + slot % bs

        r = 0
        while r < len(row_state):
            q = row_state[r]
            end = r
            while end < len(row_state) and row_state[end] == q:
                end += 1
            if q != -1:
                first_ref: dict[int, int] = {}  # host row -> first batch row, insertion = first-reference order
                entries = []
                for b in range(r, end):
                    for i, t in enumerate(topk[b]):
                        if t < 0 or t >= seq_lens[b]:
                            continue
                        page, off = divmod(t, bs)
                        if resident[q][page] != -1:
                            self.rows[b][i] = resident[q][page] * bs + off
                            self.counters["resident"] += 1
                        elif source[q][page] != -1:
                            g = source[q][page] * bs + off
                            entries.append((b, i, g))
                            if g not in first_ref:
                                first_ref[g] = b
                if first_ref:
                    hmap, order = self.hot_map[q], self.lru[q]
                    hit_slots = [s for s in order if hmap[s] in first_ref]
                    evictable = [s for s in order if hmap[s] not in first_ref]
                    held = {hmap[s] for s in hit_slots}
                    misses = [g for g in first_ref if g not in held]
                    for m, g in enumerate(misses):
                        hmap[evictable[m]] = g
                        self.plan[first_ref[g]].append((g, hot_row(q, evictable[m])))
                    self.lru[q] = evictable[len(misses):] + evictable[:len(misses)] + hit_slots
                    where = {g: s for s, g in enumerate(hmap) if g != -1}
                    for b, i, g in entries:
                        self.rows[b][i] = hot_row(q, where[g])
                        self.sources[(b, i)] = g
                    self.counters["hits"] += len(first_ref) - len(misses)
                    self.counters["misses"] += len(misses)
            r = end

    def plan_size(self) -> int:
        return sum(len(p) for p in self.plan)


@st.composite
def geometries(draw: st.DrawFn) -> tuple[RuntimeConfig, int, int]:
    bs = draw(st.sampled_from([1, 2, 4]))
    k = draw(st.integers(1, 6))
    rpr = draw(st.integers(1, 3))
    hot_rows = -(-rpr * k // bs) * bs + bs * draw(st.integers(0, 2))
    r = draw(st.integers(1, 4))
    p = draw(st.integers(1, 6))
    cfg = RuntimeConfig(max_batch_rows=draw(st.integers(1, 6)), max_requests=r, top_k=k, hot_rows=hot_rows,
                        block_size=bs, max_pages=p, row_format=draw(st.sampled_from([FP8_DS_MLA, BF16_MLA])),
                        num_layers=draw(st.integers(1, 3)), rows_per_request=rpr)
    host_blocks = draw(st.integers(1, r * p + 2))
    resident_blocks = draw(st.integers(1, 6))
    return cfg, host_blocks, resident_blocks


class RuntimeMachine(RuleBasedStateMachine):
    """One random geometry per run; the engine tables drift between steps."""

    @initialize(geo=geometries(), seed=st.integers(0, 2**31 - 1), data=st.data())
    def setup(self, geo: tuple[RuntimeConfig, int, int], seed: int, data: st.DataObject) -> None:
        cfg, host_blocks, resident_blocks = geo
        self.cfg = cfg
        self.host_blocks = host_blocks
        self.resident_blocks = resident_blocks
        hot_blocks_total = cfg.max_requests * cfg.hot_blocks
        self.num_device_blocks = resident_blocks + hot_blocks_total
        self.rt, self.host, self.dev = bound_runtime(cfg, host_blocks=host_blocks,
                                                     device_blocks=self.num_device_blocks, seed=seed)
        self.model = Model(cfg)
        pick = st.integers(-1, host_blocks - 1)
        self.source = [[data.draw(pick) for _ in range(cfg.max_pages)] for _ in range(cfg.max_requests)]
        self.resident = [[-1] * cfg.max_pages for _ in range(cfg.max_requests)]
        # Hot buffers: a permutation of the device blocks after the resident ones.
        perm = data.draw(st.permutations(range(resident_blocks, self.num_device_blocks)))
        self.hot = [list(perm[q * cfg.hot_blocks:(q + 1) * cfg.hot_blocks]) for q in range(cfg.max_requests)]
        self.center = [0] * cfg.max_requests  # each request's working-set centre, drifts over time
        # Which host row each device row was last loaded from, per layer (by gathers and replays).
        self.content: list[dict[int, int]] = [{} for _ in range(cfg.num_layers)]
        # Half the runs gather every resolve, so the contract's "after gather" guarantee applies.
        self.always_gather = data.draw(st.booleans())

    # -------------------------------------------------------------- table drift

    @rule(data=st.data())
    def drift_tables(self, data: st.DataObject) -> None:
        cfg = self.cfg
        for _ in range(data.draw(st.integers(1, 4))):
            q = data.draw(st.integers(0, cfg.max_requests - 1))
            p = data.draw(st.integers(0, cfg.max_pages - 1))
            what = data.draw(st.sampled_from(["resident", "unresident", "source", "nosource"]))
            if what == "resident":
                self.resident[q][p] = data.draw(st.integers(0, self.resident_blocks - 1))
            elif what == "unresident":
                self.resident[q][p] = -1
            elif what == "source":
                self.source[q][p] = data.draw(st.integers(0, self.host_blocks - 1))
            else:
                self.source[q][p] = -1
        q = data.draw(st.integers(0, cfg.max_requests - 1))
        self.center[q] = data.draw(st.integers(0, cfg.max_context - 1))

    # -------------------------------------------------------------- resolve

    @rule(data=st.data(), gather=st.booleans(), validate=st.booleans())
    def resolve(self, data: st.DataObject, gather: bool, validate: bool) -> None:
        cfg = self.cfg
        states = data.draw(st.permutations(range(cfg.max_requests)))
        row_state: list[int] = []
        for q in states[:data.draw(st.integers(0, cfg.max_requests))]:
            n = data.draw(st.integers(1, cfg.rows_per_request))
            if len(row_state) + n > cfg.max_batch_rows:
                break
            if row_state and data.draw(st.booleans()) and len(row_state) + n < cfg.max_batch_rows:
                row_state.append(-1)  # a padding row between requests
            row_state += [q] * n
        if not row_state or (len(row_state) < cfg.max_batch_rows and data.draw(st.booleans())):
            row_state.append(-1)
        seq_lens, topk = [], []
        for q in row_state:
            if q == -1:
                # Padding rows carry garbage that must be ignored.
                seq_lens.append(data.draw(st.integers(-5, cfg.max_context + 5)))
                topk.append(data.draw(st.lists(st.integers(-5, 99), min_size=cfg.top_k, max_size=cfg.top_k)))
                continue
            n = data.draw(st.integers(0, cfg.max_context))
            seq_lens.append(n)
            choices = [st.just(-1)]
            if n:
                c = min(self.center[q], n - 1)
                near = st.integers(max(0, c - 3), min(n - 1, c + 3))
                choices += [st.integers(0, n - 1), near, near]
            if not validate:
                choices.append(st.integers(-3, n + 3))  # out of context: masked without validation
            topk.append(data.draw(st.lists(st.one_of(choices), min_size=cfg.top_k, max_size=cfg.top_k)))
        inputs = ResolveInputs(i32(topk), i32(row_state), i32(seq_lens), i32(self.source), i32(self.resident),
                               i32(self.hot))
        gather = gather or self.always_gather
        self.rt.resolve(inputs, gather=gather, validate=validate)
        self.model.resolve(topk, row_state, seq_lens, self.source, self.resident, self.hot)
        if gather:
            self.loaded([0])
        self.check_result()
        if self.always_gather:
            for (b, i), g in self.model.sources.items():
                assert self.content[0].get(self.model.rows[b][i]) == g, (b, i, g)

    def loaded(self, layers: list[int]) -> None:
        self.model.counters["h2d_bytes"] += len(layers) * self.model.plan_size() * self.cfg.row_format.row_bytes
        for layer in layers:
            for plan in self.model.plan:
                for h, d in plan:
                    self.content[layer][d] = h

    @precondition(lambda self: hasattr(self, "cfg"))
    @rule(data=st.data())
    def copy_plan(self, data: st.DataObject) -> None:
        n = self.cfg.num_layers
        if data.draw(st.booleans()):
            layers = data.draw(st.lists(st.integers(0, n - 1), max_size=n))
            self.rt.replay_plan(layers)
        elif data.draw(st.booleans()):
            layers = list(range(1, n))
            self.rt.replay_plan()
        else:
            layers = [data.draw(st.integers(0, n - 1))]
            self.rt.gather_misses(layers[0])
        self.loaded(layers)

    # -------------------------------------------------------------- invalidation and reset

    @rule(data=st.data())
    def invalidate_written(self, data: st.DataObject) -> None:
        cfg = self.cfg
        pairs = []
        for _ in range(data.draw(st.integers(0, 5))):
            q = data.draw(st.integers(-1, cfg.max_requests - 1))
            held = [g for g in self.model.hot_map[q] if g != -1] if q >= 0 else []
            rows = st.sampled_from(held) if held and data.draw(st.booleans()) else st.integers(
                0, self.host_blocks * cfg.block_size - 1)
            pairs.append((q, data.draw(rows)))
        self.rt.invalidate_written_slots(i32([q for q, _ in pairs]).reshape(-1),
                                         i32([g for _, g in pairs]).reshape(-1))
        for q, g in pairs:
            if q >= 0:
                self.model.hot_map[q] = [-1 if x == g else x for x in self.model.hot_map[q]]

    @rule(data=st.data())
    def invalidate_blocks(self, data: st.DataObject) -> None:
        blocks = data.draw(st.lists(st.integers(0, self.host_blocks - 1), max_size=3))
        self.rt.invalidate_host_blocks(blocks)
        bs = self.cfg.block_size
        for q, hmap in self.model.hot_map.items():
            self.model.hot_map[q] = [-1 if x != -1 and x // bs in blocks else x for x in hmap]

    @rule(data=st.data())
    def reset(self, data: st.DataObject) -> None:
        cfg = self.cfg
        if data.draw(st.booleans()):
            rows = data.draw(st.lists(st.integers(0, cfg.max_requests - 1), max_size=cfg.max_requests))
            self.rt.reset_state(rows)
        else:
            rows = list(range(cfg.max_requests))
            self.rt.reset_state()
        for q in rows:
            self.model.hot_map[q] = [-1] * cfg.hot_rows
            self.model.lru[q] = list(range(cfg.hot_rows))

    @rule()
    def reset_stats(self) -> None:
        self.rt.reset_stats()
        self.model.counters = dict.fromkeys(self.model.counters, 0)

    # -------------------------------------------------------------- checks

    def check_result(self) -> None:
        res, m = self.rt.result, self.model
        assert res.rows.tolist() == m.rows
        assert res.valid_counts.tolist() == [sum(x != -1 for x in row) for row in m.rows]
        assert res.plan_counts.tolist() == [len(p) for p in m.plan]
        k = self.cfg.top_k
        assert res.plan_host.tolist() == [[h for h, _ in p] + [-1] * (k - len(p)) for p in m.plan]
        assert res.plan_device.tolist() == [[d for _, d in p] + [-1] * (k - len(p)) for p in m.plan]

    @invariant()
    def same_state(self) -> None:
        if not hasattr(self, "cfg"):
            return
        for q in range(self.cfg.max_requests):
            hot_map, lru = self.rt.hot_state(q)
            assert hot_map.dtype == torch.int32 and lru.dtype == torch.int32
            assert hot_map.tolist() == self.model.hot_map[q], q
            assert lru.tolist() == self.model.lru[q], q
            assert sorted(lru.tolist()) == list(range(self.cfg.hot_rows))
        s = self.rt.stats()
        assert {k: getattr(s, k) for k in self.model.counters} == self.model.counters

    @invariant()
    def loaded_rows_hold_host_bytes(self) -> None:
        if not hasattr(self, "cfg"):
            return
        width = self.cfg.row_format.width
        for layer, content in enumerate(self.content):
            if not content:
                continue
            flat = self.dev[layer].view(-1, width).view(torch.uint8)
            host = self.host[layer].view(torch.uint8)
            dst = torch.tensor(list(content), dtype=torch.long)
            src = torch.tensor(list(content.values()), dtype=torch.long)
            assert torch.equal(flat[dst], host[src]), layer


RuntimeMachine.TestCase.settings = settings(
    max_examples=examples(60), stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TestRuntimeAgainstModel = RuntimeMachine.TestCase
