"""The reference transfer engine: bytes, counters and exactly-once id reporting."""

from __future__ import annotations

import os
import uuid

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from refcpu_support import random_rows, small_config

from hisparse_core.errors import InvalidInputError, ProtocolError
from hisparse_core.geometry import BF16_MLA, FP8_DS_MLA, RowFormat
from hisparse_core.host_pool import HostPoolSpec
from hisparse_core.types import HostBlockCopy, PageTransfer, RowMirror
from hisparse_reference_cpu.backend import ReferenceCpuBackend
from hisparse_reference_cpu.transfer import ReferenceTransferEngine

BS, HOST_BLOCKS, DEVICE_BLOCKS = 4, 8, 6


class Worker:
    """Two runtimes (index groups of 2 and 1 layers) over one 3-layer pool, as a worker binds them."""

    def __init__(self, fmt: RowFormat, seed: int, lag: int, *, shared_rank: int | None = None,
                 name: str | None = None) -> None:
        backend = ReferenceCpuBackend(completion_lag=lag)
        shared = shared_rank is not None
        self.pool = backend.create_host_pool(HostPoolSpec(
            num_layers=3, num_blocks=HOST_BLOCKS, block_size=BS, row_format=fmt, shared=shared, name=name,
            rank=shared_rank or 0, world_size=2 if shared else 1))
        gen = torch.Generator().manual_seed(seed)
        for view in self.pool.layer_views():
            view.copy_(random_rows(tuple(view.shape), fmt, gen))
        self.dev = [random_rows((DEVICE_BLOCKS, BS, fmt.width), fmt, gen) for _ in range(3)]
        self.runtimes = []
        for group, layers in enumerate(([0, 1], [2])):
            rt = backend.create_runtime(small_config(row_format=fmt, num_layers=len(layers)))
            rt.bind([self.pool.layer_view(l) for l in layers], [self.dev[l] for l in layers], resident_group=group)
            self.runtimes.append(rt)
        self.engine = backend.create_transfer_engine(self.pool, self.runtimes)
        self.fmt = fmt

    def host(self, layer: int) -> torch.Tensor:
        return self.pool.layer_view(layer).view(torch.uint8)

    def device(self, layer: int) -> torch.Tensor:
        return self.dev[layer].view(-1, self.fmt.width).view(torch.uint8)


@settings(max_examples=25, deadline=None)
@given(fmt=st.sampled_from([FP8_DS_MLA, BF16_MLA]), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_copies_land_exactly_and_are_counted(fmt: RowFormat, seed: int, data: st.DataObject) -> None:
    w = Worker(fmt, seed, lag=0)
    with w.pool:
        # Expected host and device bytes, updated copy by copy in submission order.
        host = [w.host(l).clone() for l in range(3)]
        dev = [w.device(l).clone() for l in range(3)]
        group_layers = ([0, 1], [2])
        for _ in range(data.draw(st.integers(1, 6))):
            kind = data.draw(st.sampled_from(["mirror", "page", "copy"]))
            if kind == "mirror":
                srcs = tuple(data.draw(st.integers(0, DEVICE_BLOCKS * BS - 1)) for _ in range(2))
                dst = data.draw(st.integers(0, HOST_BLOCKS * BS - 1))
                room = min(BS - srcs[0] % BS, BS - srcs[1] % BS, BS - dst % BS)
                n = data.draw(st.integers(1, room))
                w.engine.submit_row_mirrors([RowMirror(srcs, dst, n)])
                for g, layers in enumerate(group_layers):
                    for l in layers:
                        host[l][dst:dst + n] = dev[l][srcs[g]:srcs[g] + n]
            elif kind == "page":
                t = PageTransfer(data.draw(st.integers(0, 10**6)), data.draw(st.integers(0, HOST_BLOCKS - 1)),
                                 tuple(data.draw(st.integers(0, DEVICE_BLOCKS - 1)) for _ in range(2)),
                                 restore=data.draw(st.booleans()))
                w.engine.submit_pages([t])
                w.engine.drain()
                hb = slice(t.host_block_id * BS, (t.host_block_id + 1) * BS)
                for g, layers in enumerate(group_layers):
                    db = slice(t.resident_block_ids[g] * BS, (t.resident_block_ids[g] + 1) * BS)
                    for l in layers:
                        if t.restore:
                            dev[l][db] = host[l][hb]
                        else:
                            host[l][hb] = dev[l][db]
            else:
                src, dst = data.draw(st.lists(st.integers(0, HOST_BLOCKS - 1), min_size=2, max_size=2, unique=True))
                w.engine.submit_host_copies([HostBlockCopy(src, dst)])
                w.engine.drain()
                for l in range(3):
                    host[l][dst * BS:(dst + 1) * BS] = host[l][src * BS:(src + 1) * BS].clone()
            for l in range(3):
                assert torch.equal(w.host(l), host[l]) and torch.equal(w.device(l), dev[l])


def test_byte_counters() -> None:
    w = Worker(FP8_DS_MLA, 1, lag=0)
    rb = FP8_DS_MLA.row_bytes
    w.engine.submit_row_mirrors([RowMirror((0, 4), 8, 3), RowMirror((9, 1), 1, 1)])
    w.engine.submit_pages([PageTransfer(1, 2, (0, 1)), PageTransfer(2, 3, (4, 5), restore=True)])
    w.engine.submit_host_copies([HostBlockCopy(0, 1)])  # host to host: not counted
    s0, s1 = (rt.stats() for rt in w.runtimes)
    assert (s0.d2h_bytes, s0.h2d_bytes) == ((3 + 1) * 2 * rb + BS * 2 * rb, BS * 2 * rb)
    assert (s1.d2h_bytes, s1.h2d_bytes) == ((3 + 1) * rb + BS * rb, BS * rb)
    w.pool.release()


@settings(max_examples=40, deadline=None)
@given(lag=st.integers(0, 3), script=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3)), max_size=12),
       drain_at_end=st.booleans())
def test_each_id_is_reported_enqueued_once_then_completed_once(lag: int, script: list[tuple[int, int]],
                                                                drain_at_end: bool) -> None:
    w = Worker(FP8_DS_MLA, 2, lag=lag)
    next_id, next_dst = 0, 1
    submitted_at: dict[int, int] = {}  # page id -> poll count at submission
    copies_at: list[tuple[int, int]] = []  # (dst block, poll count at submission)
    enq_at: dict[int, int] = {}
    done_at: dict[int, int] = {}
    copies_done: list[tuple[int, int]] = []
    polls = 0
    reported_copies: list[int] = []
    outstanding: set[int] = set()  # host copy destinations not yet acknowledged

    def record(progress, final: bool) -> None:  # type: ignore[no-untyped-def]
        for i in progress.enqueued:
            assert i not in enq_at, f"id {i} enqueued twice"
            enq_at[i] = polls
        for i in progress.completed:
            assert i in enq_at and i not in done_at, f"id {i} completed twice or before its enqueue"
            done_at[i] = polls
            if not final:
                assert polls - enq_at[i] == lag
        for d in progress.completed_host_copies:
            assert d in outstanding, f"host copy {d} completed twice"
            outstanding.remove(d)
        reported_copies.extend(progress.completed_host_copies)
        copies_done.extend((d, polls) for d in progress.completed_host_copies)

    for pages, copies in script:
        for _ in range(pages):
            w.engine.submit_pages([PageTransfer(next_id, next_id % HOST_BLOCKS, (0, 1))])
            submitted_at[next_id] = polls
            next_id += 1
        for _ in range(copies):
            dst = next_dst
            next_dst = next_dst % (HOST_BLOCKS - 1) + 1
            if dst in outstanding:
                continue
            w.engine.submit_host_copies([HostBlockCopy(0, dst)])
            copies_at.append((dst, polls))
            outstanding.add(dst)
        polls += 1
        record(w.engine.poll(), final=False)
    if drain_at_end:
        polls += 1
        record(w.engine.drain(), final=True)
    else:
        for _ in range(lag + 1):
            polls += 1
            record(w.engine.poll(), final=False)
    assert set(enq_at) == set(done_at) == set(submitted_at)
    for i, at in submitted_at.items():
        if not drain_at_end or enq_at[i] < polls:
            assert enq_at[i] == at + 1  # the first poll after submission
    assert sorted(reported_copies) == sorted(d for d, _ in copies_at)
    # Later submissions never complete first.
    order = sorted(submitted_at, key=lambda i: submitted_at[i])
    assert [done_at[i] for i in order] == sorted(done_at[i] for i in order)
    assert w.engine.poll() == type(w.engine.poll())()
    w.pool.release()


def test_duplicate_and_bad_submissions_raise_before_any_copy() -> None:
    w = Worker(FP8_DS_MLA, 3, lag=1)
    before = [w.host(l).clone() for l in range(3)]
    w.engine.submit_pages([PageTransfer(7, 0, (0, 0))])
    mid = [w.host(l).clone() for l in range(3)]
    with pytest.raises(ProtocolError, match="7"):
        w.engine.submit_pages([PageTransfer(8, 1, (1, 1)), PageTransfer(7, 2, (2, 2))])
    with pytest.raises(ProtocolError, match="9"):
        w.engine.submit_pages([PageTransfer(9, 1, (1, 1)), PageTransfer(9, 2, (2, 2))])
    with pytest.raises(InvalidInputError):
        w.engine.submit_pages([PageTransfer(10, 1, (1, 1)), PageTransfer(11, 2, (2, DEVICE_BLOCKS))])
    with pytest.raises(InvalidInputError):
        w.engine.submit_row_mirrors([RowMirror((0, 0), 0, 1), RowMirror((0,), 0, 1)])  # group 1 has no source
    with pytest.raises(ProtocolError):
        w.engine.submit_host_copies([HostBlockCopy(0, 3), HostBlockCopy(1, 3)])
    assert all(torch.equal(w.host(l), m) for l, m in enumerate(mid))
    assert not all(torch.equal(w.host(l), b) for l, b in enumerate(before))
    progress = w.engine.poll()
    assert progress.enqueued == (7,) and progress.completed == ()
    assert w.engine.poll().completed == (7,)
    w.engine.submit_pages([PageTransfer(7, 0, (0, 0))])  # an acknowledged id may be reused
    assert w.engine.drain().completed == (7,)
    w.pool.release()


def test_engine_needs_bound_reference_runtimes() -> None:
    backend = ReferenceCpuBackend()
    pool = backend.create_host_pool(HostPoolSpec(num_layers=1, num_blocks=2, block_size=4))
    with pytest.raises(InvalidInputError, match="not bound"):
        backend.create_transfer_engine(pool, [backend.create_runtime(small_config())])
    with pytest.raises(InvalidInputError, match="non-empty"):
        ReferenceTransferEngine(pool, [])

    class AcmeRuntime:  # another backend's runtime: named with its article ("is a AcmeRuntime" before)
        bound = True

    with pytest.raises(InvalidInputError, match=r"^runtimes\[0\] is an AcmeRuntime; expected a ReferenceRuntime$"):
        backend.create_transfer_engine(pool, [AcmeRuntime()])  # type: ignore[list-item]
    pool.release()
    with pytest.raises(InvalidInputError, match="released"):
        ReferenceTransferEngine(pool, [])


def test_only_the_writer_copies_into_a_shared_pool() -> None:
    name = f"test_{os.getpid()}_{uuid.uuid4().hex[:12]}"
    writer = Worker(FP8_DS_MLA, 4, lag=1, shared_rank=0, name=name)
    reader = Worker(FP8_DS_MLA, 5, lag=1, shared_rank=1, name=name)
    # The reader randomised the shared rows after the writer did; take a fresh baseline.
    base = [writer.host(l).clone() for l in range(3)]
    reader.engine.submit_row_mirrors([RowMirror((0, 0), 0, 2)])
    reader.engine.submit_pages([PageTransfer(1, 1, (1, 1))])
    reader.engine.submit_host_copies([HostBlockCopy(2, 3)])
    assert all(torch.equal(writer.host(l), b) for l, b in enumerate(base))
    assert reader.engine.poll().enqueued == (1,)
    progress = reader.engine.poll()
    assert progress.completed == (1,) and progress.completed_host_copies == (3,)
    writer.engine.submit_row_mirrors([RowMirror((0, 0), 0, 2)])
    assert torch.equal(reader.host(0)[:2], writer.device(0)[:2])  # the reader sees the writer's rows
    # A restore lands in each rank's own device cache.
    reader.engine.submit_pages([PageTransfer(2, 1, (3, 3), restore=True)])
    assert torch.equal(reader.device(2)[12:16], writer.host(2)[4:8])
    reader.pool.release()
    writer.pool.release()
