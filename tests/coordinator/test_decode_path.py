"""The decode fast path (`StepPlanner._validate_bulk`, driven by each request's decode cursor)
plans every step exactly as the request-by-request checks do: a random workload (prefills,
decodes, speculative tokens with rejections, prefix hits, state-row moves, leaving requests, GPU
pressure, two resident groups, bad engine input) runs through two coordinators, one with the
fast path off, and their commands, table deltas, errors and stats agree step for step."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_core.coordinator import CoordinatorConfig, HiSparseCoordinator, SimpleGpuBlockPool, StepRequest
from hisparse_core.coordinator.step import StepPlanner
from hisparse_core.errors import CapacityError, InvalidInputError
from hisparse_core.types import WorkerMetadata


def _workload(seed: int, bulk: bool, counts: dict[str, int]) -> list[object]:
    rng = random.Random(seed)
    bs, groups = rng.choice([4, 8]), rng.choice([1, 2])
    max_len = bs * 12
    cfg = CoordinatorConfig(host_pool_gib=rng.choice([40, 200]) * bs * 16 / (1 << 30), num_layers=1, block_size=bs,
                            row_bytes=16, max_model_len=max_len, hot_blocks_per_request=2,
                            num_resident_groups=groups, pressure_watermark_blocks=rng.choice([2, 8]))
    gpu = SimpleGpuBlockPool(rng.choice([60, 300]))
    coord = HiSparseCoordinator(cfg, gpu)
    coord._step.bulk = bulk
    base = [rng.randrange(3) for _ in range(max_len)]
    reqs: dict[str, dict] = {}
    states = list(range(16))
    pending: set[int] = set()   # to enqueue
    enqueued: set[int] = set()  # to complete
    copies: set[int] = set()
    log: list[object] = []
    for step in range(120):
        op = rng.random()
        done = [rid for rid, r in reqs.items() if r["nc"] >= max_len - 3]
        if done or (op < 0.05 and reqs):
            rid = done[0] if done else rng.choice(sorted(reqs))
            coord.finish_request(rid) if rng.random() < 0.5 else coord.preempt_request(rid)
            states.append(reqs.pop(rid)["si"])
            continue
        if op < 0.15 and len(reqs) < 6:
            rid, n = f"r{step}", rng.randrange(1, max_len // 2)
            toks = base[:n] if rng.random() < 0.7 else [rng.randrange(3) for _ in range(n)]
            try:
                hit = coord.add_request(rid, toks, max_prefix_tokens=rng.choice([None, n - 1, 0]))
            except CapacityError as e:
                log.append(("error", type(e).__name__, str(e)))
                continue
            reqs[rid] = dict(tokens=toks, si=states.pop(), nc=hit, prompt=n, table=[[] for _ in range(groups)])
            continue
        if op < 0.2 and reqs:
            r = reqs[rng.choice(sorted(reqs))]
            states.append(r["si"])
            r["si"] = states.pop(0)
        if op < 0.35:
            enq = sorted(pending)
            enqueued.update(enq)
            pending.clear()
            done_ids = sorted(t for t in enqueued if rng.random() < 0.7)
            enqueued.difference_update(done_ids)
            coord.update_from_workers(WorkerMetadata.report(enq, done_ids, sorted(copies)), 1)
            copies.clear()
            continue
        views = []
        try:
            for rid, r in sorted(reqs.items()):
                nn = min(max_len - r["nc"], rng.choice([1, 1, 1, 3]) if r["nc"] >= r["prompt"] else r["prompt"] - r["nc"])
                pages = -(-(r["nc"] + nn) // bs)
                first = coord.first_resident_page(rid)
                for row in r["table"]:
                    row.extend([0] * (first - len(row)))
                missing = pages - len(r["table"][0])
                if missing > 0:
                    got = gpu.acquire(missing * groups)
                    for g, row in enumerate(r["table"]):
                        row.extend(got[g * missing:(g + 1) * missing])
                views.append(StepRequest(rid, r["si"], r["nc"], nn, list(r["tokens"]),
                                         tuple(tuple(row) for row in r["table"])))
        except CapacityError:
            continue
        if views and rng.random() < 0.1:
            i, v = rng.randrange(len(views)), views[0]
            views[i] = rng.choice([
                StepRequest(v.request_id, v.state_index, -1, 1, v.token_ids, v.resident_block_ids),
                StepRequest(v.request_id, float(v.state_index), v.num_computed_tokens, 1, v.token_ids,
                            v.resident_block_ids),
                StepRequest(v.request_id, v.state_index, v.num_computed_tokens, 1, [], v.resident_block_ids),
                StepRequest("ghost", v.state_index, v.num_computed_tokens, 1, v.token_ids, v.resident_block_ids),
                v])
        rng.shuffle(views)
        try:
            cmd = coord.schedule_step(views)
        except (InvalidInputError, CapacityError) as e:
            log.append(("error", type(e).__name__, str(e)))
            continue
        if cmd is not None:
            counts["mirrors"] += len(cmd.row_mirrors)
            pending.update(t.transfer_id for t in cmd.page_transfers)
            copies.update(c.dst_block_id for c in cmd.host_block_copies)
        log.append((cmd, coord.take_table_updates()))
        for v in views:
            r = reqs[v.request_id]
            r["nc"] += v.num_new_tokens if rng.random() < 0.7 else rng.randrange(1, v.num_new_tokens + 1)
            del r["tokens"][max(r["nc"] + 1, r["prompt"]):]
            r["tokens"].extend(rng.randrange(3) for _ in range(r["nc"] + 1 - len(r["tokens"])))
    log.append(coord.stats())
    return log


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_decode_fast_path_plans_like_request_by_request_checks(seed: int) -> None:
    counts = {"mirrors": 0}
    fast = _workload(seed, True, counts)
    assert fast == _workload(seed, False, {"mirrors": 0})
    assert counts["mirrors"] > 0


def test_the_fast_path_runs_and_names_bad_input_as_before(monkeypatch) -> None:
    taken = []
    real = StepPlanner._validate_bulk

    def spy(self, scheduled, leaving):  # type: ignore[no-untyped-def]
        out = real(self, scheduled, leaving)
        taken.append(out is not None and bool(out[0]))
        return out

    monkeypatch.setattr(StepPlanner, "_validate_bulk", spy)
    log = _workload(7, True, {"mirrors": 0})
    assert sum(taken) > 20, "the decode fast path was never taken"
    errors = [e for e in log if isinstance(e, tuple) and e and e[0] == "error"]
    assert errors and any("request" in e[2] for e in errors)
