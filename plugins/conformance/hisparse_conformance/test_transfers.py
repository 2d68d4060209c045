"""Row mirrors, page spills and restores, host block copies: exact bytes, counters, and the
transfer engine's acknowledgements (each id enqueued once, completed once, never before it was
submitted or enqueued, in submission order, everything by `drain`).

Expected bytes come from replaying the same operations, in submission order, on CPU copies.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from hypothesis import given
from hypothesis import strategies as st

from hisparse_conformance.contract import must_raise
from hisparse_conformance.examples import examples
from hisparse_conformance.rig import stats_tuple, usable_format
from hisparse_conformance.scenario import random_bytes
from hisparse_core.backend import Backend
from hisparse_core.errors import InvalidInputError, ProtocolError
from hisparse_core.geometry import RowFormat, RuntimeConfig
from hisparse_core.host_pool import HostPool, HostPoolSpec
from hisparse_core.runtime import CacheRuntime
from hisparse_core.transfer import TransferEngine, TransferProgress
from hisparse_core.types import HostBlockCopy, PageTransfer, RowMirror

GROUPS = 2  # resident groups named in every mirror and page transfer


@dataclass
class Worker:
    """One host pool shared by runtimes that own consecutive pool layers, each with its own
    device caches and resident group; plus a CPU model of every byte."""

    pool: HostPool
    runtimes: list[CacheRuntime]
    devices: list[list[torch.Tensor]]  # per runtime, per layer: [num_device_blocks, bs, width]
    first_layer: list[int]  # pool layer of each runtime's layer 0
    fmt: RowFormat
    block_size: int
    host_blocks: int
    device_blocks: int
    host_model: list[torch.Tensor] = field(default_factory=list)  # per pool layer, [rows, row_bytes]
    device_model: list[list[torch.Tensor]] = field(default_factory=list)
    counters: list[list[int]] = field(default_factory=list)  # per runtime: [h2d, d2h]

    def host_rows(self, layer: int) -> torch.Tensor:
        return self.pool.layer_view(layer).view(torch.uint8).cpu()

    def device_rows(self, rt: int, layer: int) -> torch.Tensor:
        return self.devices[rt][layer].view(torch.uint8).reshape(-1, self.fmt.row_bytes).cpu()

    def layers(self, rt: int) -> range:
        return range(self.runtimes[rt].config.num_layers)

    def mismatches(self) -> list[str]:
        # The copies were enqueued without a host synchronization; stats() is one (the contract's
        # only), so the counters are read before the host pool, which a CPU read does not order.
        counters = [list(stats_tuple(rt.stats())[3:]) for rt in self.runtimes]
        problems = []
        for layer, want in enumerate(self.host_model):
            if not torch.equal(self.host_rows(layer), want):
                problems.append(f"host pool layer {layer} differs from the expected bytes")
        for rt in range(len(self.runtimes)):
            for layer in self.layers(rt):
                if not torch.equal(self.device_rows(rt, layer), self.device_model[rt][layer]):
                    problems.append(f"runtime {rt} device layer {layer} differs from the expected bytes")
            if counters[rt] != self.counters[rt]:
                problems.append(f"runtime {rt} counters (h2d, d2h) = {tuple(counters[rt])}, "
                                f"expected {tuple(self.counters[rt])}")
        return problems

    # -- the CPU model of each operation, applied in submission order --------------------------

    def expect_mirrors(self, mirrors: Sequence[RowMirror], groups: Sequence[int]) -> None:
        for rt, g in enumerate(groups):
            for m in mirrors:
                src, dst, n = m.source_starts[g], m.destination_start, m.num_rows
                for layer in self.layers(rt):
                    self.host_model[self.first_layer[rt] + layer][dst:dst + n] = self.device_model[rt][layer][src:src + n]
                self.counters[rt][1] += n * self.fmt.row_bytes * len(self.layers(rt))

    def expect_pages(self, transfers: Sequence[PageTransfer], groups: Sequence[int]) -> None:
        bs = self.block_size
        for t in transfers:
            for rt, g in enumerate(groups):
                dev, host = t.resident_block_ids[g] * bs, t.host_block_id * bs
                for layer in self.layers(rt):
                    h = self.host_model[self.first_layer[rt] + layer]
                    d = self.device_model[rt][layer]
                    if t.restore:
                        d[dev:dev + bs] = h[host:host + bs]
                    else:
                        h[host:host + bs] = d[dev:dev + bs]
                self.counters[rt][0 if t.restore else 1] += bs * self.fmt.row_bytes * len(self.layers(rt))

    def expect_host_copies(self, copies: Sequence[HostBlockCopy]) -> None:
        bs = self.block_size
        for c in copies:
            for rt in range(len(self.runtimes)):
                for layer in self.layers(rt):
                    h = self.host_model[self.first_layer[rt] + layer]
                    h[c.dst_block_id * bs:(c.dst_block_id + 1) * bs] = h[c.src_block_id * bs:(c.src_block_id + 1) * bs]

    def release(self) -> None:
        self.pool.release()


def make_worker(backend: Backend, fmt: RowFormat, layer_counts: Sequence[int], groups: Sequence[int], *,
                seed: int, block_size: int = 4, host_blocks: int = 10, device_blocks: int = 8) -> Worker:
    spec = HostPoolSpec(num_layers=sum(layer_counts), num_blocks=host_blocks, block_size=block_size, row_format=fmt)
    pool = backend.create_host_pool(spec)
    worker = Worker(pool, [], [], [], fmt, block_size, host_blocks, device_blocks)
    try:
        for layer in range(spec.num_layers):
            data = random_bytes((spec.rows_per_layer, fmt.row_bytes), seed, 10, layer)
            pool.layer_view(layer).view(torch.uint8).copy_(data)
            worker.host_model.append(data.clone())
        first = 0
        for rt, (layers, group) in enumerate(zip(layer_counts, groups, strict=True)):
            cfg = RuntimeConfig(max_batch_rows=2, max_requests=2, top_k=block_size, hot_rows=block_size,
                                block_size=block_size, max_pages=4, row_format=fmt, num_layers=layers)
            caches, model = [], []
            for layer in range(layers):
                data = random_bytes((device_blocks, block_size, fmt.row_bytes), seed, 20 + rt, layer)
                cache = torch.empty((device_blocks, block_size, fmt.width), dtype=fmt.dtype, device=backend.device)
                cache.view(torch.uint8).copy_(data.to(backend.device))
                caches.append(cache)
                model.append(data.reshape(-1, fmt.row_bytes).clone())
            runtime = backend.create_runtime(cfg)
            runtime.bind([pool.layer_view(first + layer) for layer in range(layers)], caches, resident_group=group)
            worker.runtimes.append(runtime)
            worker.devices.append(caches)
            worker.device_model.append(model)
            worker.first_layer.append(first)
            worker.counters.append([0, 0])
            first += layers
    except BaseException:
        pool.release()
        raise
    return worker


# -- random operations that never touch one block twice within a call --------------------------


def random_mirrors(rng: random.Random, w: Worker) -> list[RowMirror]:
    bs = w.block_size
    out = []
    for dst_block in rng.sample(range(w.host_blocks), rng.randint(1, 3)):
        n = rng.randint(1, bs)
        dst = dst_block * bs + rng.randint(0, bs - n)
        starts = tuple(rng.randrange(w.device_blocks) * bs + rng.randint(0, bs - n) for _ in range(GROUPS))
        out.append(RowMirror(starts, dst, n))
    return out


def random_pages(rng: random.Random, w: Worker, ids: list[int], *, restore: bool | None = None) -> list[PageTransfer]:
    count = rng.randint(1, 3)
    hosts = rng.sample(range(w.host_blocks), count)
    devices = [rng.sample(range(w.device_blocks), count) for _ in range(GROUPS)]
    out = []
    for i in range(count):
        ids.append(ids[-1] + rng.randint(1, 5) if ids else rng.randint(0, 100))
        out.append(PageTransfer(ids[-1], hosts[i], tuple(devices[g][i] for g in range(GROUPS)),
                                after_forward=rng.random() < 0.5,
                                restore=rng.random() < 0.4 if restore is None else restore))
    return out


def random_host_copies(rng: random.Random, w: Worker, free: list[int]) -> list[HostBlockCopy]:
    """Copies into blocks from `free` (consumed: a destination is acknowledged by its block id, so
    the test never reuses one), from sources that are not destinations of the same call."""
    count = min(len(free), rng.randint(1, 2))
    dsts = [free.pop() for _ in range(count)]
    return [HostBlockCopy(rng.choice([b for b in range(w.host_blocks) if b not in dsts]), d) for d in dsts]


# -- runtime methods --------------------------------------------------------------------------


@examples(20)
@given(seed=st.integers(0, 2**32 - 1), layers=st.integers(1, 3), group=st.integers(0, GROUPS - 1))
def test_runtime_copies_are_byte_exact(hisparse_backend: Backend, seed: int, layers: int, group: int) -> None:
    """mirror_rows, spill_pages, restore_pages and copy_host_blocks move exactly the bytes named
    (every layer, this runtime's resident group), count d2h/h2d bytes, and leave the hot state be."""
    rng = random.Random(seed)
    w = make_worker(hisparse_backend, usable_format(hisparse_backend), [layers], [group], seed=seed)
    rt = w.runtimes[0]
    ids: list[int] = []
    free = list(range(w.host_blocks))
    rng.shuffle(free)
    try:
        hot_before = [rt.hot_state(q) for q in range(rt.config.max_requests)]
        for _ in range(6):
            op = rng.choice(["mirror", "spill", "restore", "copy"])
            if op == "mirror":
                mirrors = random_mirrors(rng, w)
                rt.mirror_rows(mirrors)
                w.expect_mirrors(mirrors, [group])
            elif op == "copy":
                copies = random_host_copies(rng, w, free) if free else []
                rt.copy_host_blocks(copies)
                w.expect_host_copies(copies)
            else:
                pages = random_pages(rng, w, ids, restore=op == "restore")
                (rt.restore_pages if op == "restore" else rt.spill_pages)(pages)
                w.expect_pages(pages, [group])
            problems = w.mismatches()
            assert not problems, f"after {op}: " + "; ".join(problems)
        for q, (hot_map, lru) in enumerate(hot_before):
            now = rt.hot_state(q)
            assert torch.equal(now[0], hot_map) and torch.equal(now[1], lru), f"hot state of row {q} changed"
    finally:
        w.release()


def test_spill_pages_rejects_restores(hisparse_backend: Backend) -> None:
    w = make_worker(hisparse_backend, usable_format(hisparse_backend), [1], [0], seed=5)
    try:
        restore = PageTransfer(1, 2, (3, 3), restore=True)
        spill = PageTransfer(2, 4, (5, 5))
        with must_raise(InvalidInputError, "spill_pages rejects a PageTransfer with restore=True"):
            w.runtimes[0].spill_pages([spill, restore])
        with must_raise(InvalidInputError, "restore_pages rejects a PageTransfer with restore=False"):
            w.runtimes[0].restore_pages([restore, spill])
        assert not w.mismatches(), "a rejected call must move no byte, not even for its valid elements"
    finally:
        w.release()


# -- the transfer engine ----------------------------------------------------------------------


@dataclass
class Ledger:
    """When (poll number) each id was submitted, enqueued and completed."""

    submitted: dict[int, int] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)
    enqueued: dict[int, int] = field(default_factory=dict)
    completed: dict[int, int] = field(default_factory=dict)
    copies_submitted: dict[int, int] = field(default_factory=dict)
    copies_completed: dict[int, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def record(self, progress: TransferProgress, poll: int) -> None:
        for ident in progress.enqueued:
            if ident not in self.submitted:
                self.problems.append(f"poll {poll}: enqueued id {ident} was never submitted")
            elif ident in self.enqueued:
                self.problems.append(f"poll {poll}: id {ident} reported enqueued again (first at poll "
                                     f"{self.enqueued[ident]})")
            else:
                self.enqueued[ident] = poll
        for ident in progress.completed:
            if ident not in self.submitted:
                self.problems.append(f"poll {poll}: completed id {ident} was never submitted")
            elif ident in self.completed:
                self.problems.append(f"poll {poll}: id {ident} reported completed again")
            elif ident not in self.enqueued:
                self.problems.append(f"poll {poll}: id {ident} completed before it was reported enqueued")
            else:
                self.completed[ident] = poll
        for block in progress.completed_host_copies:
            if block not in self.copies_submitted:
                self.problems.append(f"poll {poll}: host copy into block {block} completed but was never submitted")
            elif block in self.copies_completed:
                self.problems.append(f"poll {poll}: host copy into block {block} reported completed again")
            else:
                self.copies_completed[block] = poll

    def after_drain(self) -> list[str]:
        problems = list(self.problems)
        for ident in self.order:
            if ident not in self.enqueued or ident not in self.completed:
                problems.append(f"id {ident} not reported enqueued and completed by drain()")
        for block in self.copies_submitted:
            if block not in self.copies_completed:
                problems.append(f"host copy into block {block} not reported completed by drain()")
        done = [self.completed[i] for i in self.order if i in self.completed]
        if done != sorted(done):
            problems.append(f"ids completed out of submission order: {list(zip(self.order, done, strict=False))}")
        return problems


@examples(20)
@given(seed=st.integers(0, 2**32 - 1), layers=st.tuples(st.integers(1, 2), st.integers(1, 2)))
def test_engine_runs_everything_in_order_and_reports_each_id_once(
        hisparse_backend: Backend, seed: int, layers: tuple[int, int]) -> None:
    """Two runtimes (resident groups 1 and 0) on one pool: after drain every byte equals the
    in-order replay of the submissions, and every id was acknowledged exactly as promised."""
    rng = random.Random(seed)
    groups = [1, 0]
    w = make_worker(hisparse_backend, usable_format(hisparse_backend), list(layers), groups, seed=seed)
    try:
        engine: TransferEngine = hisparse_backend.create_transfer_engine(w.pool, w.runtimes)
        assert list(engine.runtimes) == w.runtimes, "engine.runtimes are the runtimes it was created with, in order"
        ledger = Ledger()
        ids: list[int] = []
        free = list(range(w.host_blocks))
        rng.shuffle(free)
        poll = 0
        ledger.record(engine.poll(), poll)  # nothing submitted yet: must report nothing
        assert not ledger.enqueued and not ledger.copies_completed, "a new engine has reported nothing"
        for _ in range(rng.randint(1, 6)):
            for op in rng.sample(["mirror", "pages", "copy"], rng.randint(1, 3)):
                if op == "mirror":
                    mirrors = random_mirrors(rng, w)
                    engine.submit_row_mirrors(mirrors)
                    w.expect_mirrors(mirrors, groups)
                elif op == "pages":
                    pages = random_pages(rng, w, ids)
                    engine.submit_pages(pages)
                    w.expect_pages(pages, groups)
                    for t in pages:
                        ledger.submitted[t.transfer_id] = poll
                        ledger.order.append(t.transfer_id)
                elif free:
                    copies = random_host_copies(rng, w, free)
                    engine.submit_host_copies(copies)
                    w.expect_host_copies(copies)
                    ledger.copies_submitted.update((c.dst_block_id, poll) for c in copies)
            for _ in range(rng.randint(0, 2)):
                poll += 1
                ledger.record(engine.poll(), poll)
        poll += 1
        ledger.record(engine.drain(), poll)
        problems = ledger.after_drain() + w.mismatches()
        assert not problems, "\n".join(problems)
        assert engine.poll() == TransferProgress(), "after drain() nothing is left: poll() must report no new enqueued or completed id"
        assert engine.drain() == TransferProgress(), "each id is reported once: a second drain() must report nothing"
    finally:
        w.release()


@examples(10)
@given(seed=st.integers(0, 2**32 - 1))
def test_an_id_still_unacknowledged_is_refused_before_any_copy(hisparse_backend: Backend, seed: int) -> None:
    """A transfer id, or a host copy's destination block, names one acknowledgement, so it must be
    unique among the work not yet reported completed: a call that repeats one (within the call, or
    one still in flight) raises `ProtocolError` and copies, counts and acknowledges nothing of its
    own; the work in flight is still acknowledged once."""
    rng = random.Random(seed)
    groups = [1, 0]
    w = make_worker(hisparse_backend, usable_format(hisparse_backend), [1, 1], groups, seed=seed)
    try:
        engine: TransferEngine = hisparse_backend.create_transfer_engine(w.pool, w.runtimes)
        ids: list[int] = []
        free = list(range(w.host_blocks))
        rng.shuffle(free)
        first = random_pages(rng, w, ids)
        engine.submit_pages(first)
        w.expect_pages(first, groups)
        copies = random_host_copies(rng, w, free)
        engine.submit_host_copies(copies)
        w.expect_host_copies(copies)
        in_flight = replace(random_pages(rng, w, ids)[0], transfer_id=rng.choice(first).transfer_id)
        twice = random_pages(rng, w, ids)
        twice = [*twice, replace(random_pages(rng, w, ids)[0], transfer_id=twice[0].transfer_id)]
        for bad in ([in_flight], twice):
            with must_raise(ProtocolError, f"submit_pages({bad}) repeats a transfer id that is not yet "
                                           "acknowledged: it must raise ProtocolError"):
                engine.submit_pages(bad)
        if free:
            src = [b for b in range(w.host_blocks) if b != copies[0].dst_block_id and b != free[-1]]
            for bad_copies in ([HostBlockCopy(rng.choice(src), copies[0].dst_block_id)],
                               [HostBlockCopy(rng.choice(src), free[-1]), HostBlockCopy(rng.choice(src), free[-1])]):
                with must_raise(ProtocolError, f"submit_host_copies({bad_copies}) repeats a destination block "
                                               "that is not yet acknowledged: it must raise ProtocolError"):
                    engine.submit_host_copies(bad_copies)
        done = engine.drain()
        want = sorted(t.transfer_id for t in first)
        assert sorted(done.enqueued) == want and sorted(done.completed) == want, (
            f"drain() after the refused calls acknowledges the first call's ids once: {want}, got {done}")
        assert sorted(done.completed_host_copies) == sorted(c.dst_block_id for c in copies), (
            f"drain() acknowledges the accepted host copies once: {copies}, got {done}")
        problems = w.mismatches()
        assert not problems, "a refused submission copied or counted something:\n" + "\n".join(problems)
    finally:
        w.release()


@examples(10)
@given(seed=st.integers(0, 2**32 - 1))
def test_a_submission_one_runtime_refuses_changes_nothing_anywhere(hisparse_backend: Backend, seed: int) -> None:
    """Every runtime of the engine checks a submission before any copies it: a mirror or page
    whose source or resident block is out of range for one runtime's resident group only (the other
    runtime's group is fine), or a host copy past the pool, raises `InvalidInputError`, and no
    runtime has copied, counted or acknowledged anything of that call."""
    rng = random.Random(seed)
    groups = [1, 0]  # runtime 0 reads resident group 1's blocks, runtime 1 group 0's
    w = make_worker(hisparse_backend, usable_format(hisparse_backend), [1, 1], groups, seed=seed)
    try:
        engine: TransferEngine = hisparse_backend.create_transfer_engine(w.pool, w.runtimes)
        beyond = w.device_blocks * w.block_size + rng.randrange(w.block_size)
        mirrors = random_mirrors(rng, w)
        bad_mirror = replace(mirrors[-1], source_starts=(beyond, mirrors[-1].source_starts[1]))
        with must_raise(InvalidInputError, "submit_row_mirrors with a source row past group 0's device cache "
                                           "(group 1's in range) must raise InvalidInputError"):
            engine.submit_row_mirrors([*mirrors[:-1], bad_mirror])
        ids: list[int] = []
        pages = random_pages(rng, w, ids)
        bad_page = replace(pages[-1], resident_block_ids=(w.device_blocks, pages[-1].resident_block_ids[1]))
        with must_raise(InvalidInputError, "submit_pages with a resident block past group 0's device cache "
                                           "(group 1's in range) must raise InvalidInputError"):
            engine.submit_pages([*pages[:-1], bad_page])
        with must_raise(InvalidInputError, "submit_host_copies with a source block past the host pool must raise "
                                           "InvalidInputError"):
            engine.submit_host_copies([HostBlockCopy(0, 1), HostBlockCopy(w.host_blocks, 2)])
        assert engine.drain() == TransferProgress(), "refused submissions are not acknowledged"
        problems = w.mismatches()
        assert not problems, "a refused submission copied or counted something:\n" + "\n".join(problems)
    finally:
        w.release()
