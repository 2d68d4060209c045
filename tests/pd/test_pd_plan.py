"""The import plan: every prefill page lands in its host block, in every layer; bad indices are
caught before a descriptor exists. Descriptors are executed here on numpy byte arrays."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_core.errors import InvalidCommandError, InvalidInputError
from hisparse_core.geometry import BF16_MLA, FP8_DS_MLA
from hisparse_core.host_pool import HostPoolSpec
from hisparse_core.pd.errors import DescriptorRangeError, StaleHandshakeError
from hisparse_core.pd.handshake import KvRegion, PrefillHandshake, RemotePrefill
from hisparse_core.pd.plan import (
    HostLayout,
    build_import_plan,
    host_descriptors,
    remote_descriptors,
    staging_descriptors,
)

ROW = FP8_DS_MLA.row_bytes
REMOTE_BASE = 1 << 20  # addresses are offsets into the arrays below, shifted so none is 0


def make_handshake(num_layers: int, num_pages: int, block_size: int, pad: int, epoch: int = 1) -> PrefillHandshake:
    page = block_size * ROW
    stride = page + pad
    regions = tuple(KvRegion(layer, REMOTE_BASE + layer * num_pages * stride, num_pages, stride)
                    for layer in range(num_layers))
    return PrefillHandshake("p0", epoch, "agent", b"md", block_size, FP8_DS_MLA.name, ROW, regions)


def execute(descs_remote, descs_local, remote_mem: np.ndarray, local_mem: np.ndarray, local_base: int) -> None:
    for (ra, n, _), (la, m, _) in zip(descs_remote, descs_local, strict=True):
        assert n == m
        local_mem[la - local_base:la - local_base + n] = remote_mem[ra - REMOTE_BASE:ra - REMOTE_BASE + n]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), num_layers=st.integers(1, 3), block_size=st.integers(1, 3), pad=st.sampled_from([0, 0, 16]),
       num_pages=st.integers(1, 12))
def test_plan_moves_each_page_to_its_block(data: st.DataObject, num_layers: int, block_size: int, pad: int,
                                           num_pages: int) -> None:
    host_blocks_total = num_pages + 4
    hs = make_handshake(num_layers, num_pages, block_size, pad)
    n = data.draw(st.integers(1, num_pages))
    pages = data.draw(st.permutations(range(num_pages)))[:n]
    if data.draw(st.booleans()):
        start = data.draw(st.integers(0, num_pages - n))
        pages = list(range(start, start + n))  # contiguous: coalesces when dense
    blocks = data.draw(st.permutations(range(1, host_blocks_total)))[:n]
    if data.draw(st.booleans()):
        b0 = data.draw(st.integers(1, host_blocks_total - n))
        blocks = list(range(b0, b0 + n))
    tokens = data.draw(st.integers((n - 1) * block_size + 1, n * block_size))
    spec = HostPoolSpec(num_layers, host_blocks_total, block_size, FP8_DS_MLA)
    plan = build_import_plan(hs, RemotePrefill("r", "p0", 1, tuple(pages), tokens), spec, blocks)

    stride = hs.regions[0].page_stride
    remote_mem = np.frombuffer(os.urandom(num_layers * num_pages * stride), dtype=np.uint8).copy()
    local_base = 1 << 30
    layout = HostLayout(tuple(local_base + layer * host_blocks_total * block_size * ROW for layer in range(num_layers)),
                        host_blocks_total, block_size, ROW)
    local_mem = np.zeros(num_layers * host_blocks_total * block_size * ROW, dtype=np.uint8)
    cap = data.draw(st.integers(hs.page_bytes, 3 * hs.page_bytes + 5))
    chunks = plan.chunks(cap)
    assert sum(r.num_pages for c in chunks for r in c) == num_layers * n
    for chunk in chunks:
        assert sum(r.num_pages for r in chunk) * hs.page_bytes <= cap
        execute(remote_descriptors(hs, chunk), host_descriptors(layout, chunk), remote_mem, local_mem, local_base)
    page = hs.page_bytes
    for layer in range(num_layers):
        for p, b in zip(pages, blocks, strict=True):
            src = remote_mem[layer * num_pages * stride + p * stride:][:page]
            dst = local_mem[(layer * host_blocks_total + b) * page:][:page]
            assert np.array_equal(src, dst), (layer, p, b)
    assert plan.total_bytes == num_layers * n * page
    assert plan.tail_host_block == blocks[-1]
    if pad == 0 and pages == list(range(pages[0], pages[0] + n)) and blocks == list(range(blocks[0], blocks[0] + n)):
        assert len(plan.runs) == num_layers  # one descriptor per layer
    if pad:
        assert all(r.num_pages == 1 for r in plan.runs)  # strided pages never merge


def test_staging_descriptors_pack_runs() -> None:
    hs = make_handshake(2, 8, 2, 0)
    spec = HostPoolSpec(2, 10, 2, FP8_DS_MLA)
    plan = build_import_plan(hs, RemotePrefill("r", "p0", 1, (3, 4, 1), 5), spec, (5, 6, 9))
    chunk = plan.chunks(3 * hs.page_bytes)[0]
    descs = staging_descriptors(5000, 3 * hs.page_bytes, hs.page_bytes, chunk)
    assert [d[0] for d in descs] == [5000, 5000 + 2 * hs.page_bytes]
    assert sum(d[1] for d in descs) == 3 * hs.page_bytes
    with pytest.raises(InvalidInputError, match="exceeds the staging capacity"):
        staging_descriptors(5000, 2 * hs.page_bytes, hs.page_bytes, chunk)
    with pytest.raises(InvalidInputError, match="at least one page|>= one page"):
        plan.chunks(hs.page_bytes - 1)


def test_out_of_range_page_is_caught_before_any_descriptor() -> None:
    hs = make_handshake(3, 8, 2, 0)
    spec = HostPoolSpec(3, 10, 2, FP8_DS_MLA)
    with pytest.raises(DescriptorRangeError, match=r"page 1 names prefill page 8.*registered 8 pages in layer 0"):
        build_import_plan(hs, RemotePrefill("r", "p0", 1, (2, 8), 4), spec, (1, 2))
    with pytest.raises(DescriptorRangeError, match=r"host block 10 \(page 1\) is outside the host pool"):
        build_import_plan(hs, RemotePrefill("r", "p0", 1, (2, 3), 4), spec, (1, 10))


def test_stale_epoch_geometry_and_length_mismatches() -> None:
    hs = make_handshake(3, 8, 2, 0, epoch=4)
    spec = HostPoolSpec(3, 10, 2, FP8_DS_MLA)
    with pytest.raises(StaleHandshakeError, match="epoch 3, but the decoder holds the handshake of epoch 4"):
        build_import_plan(hs, RemotePrefill("r", "p0", 3, (1,), 2), spec, (1,))
    with pytest.raises(InvalidCommandError, match="prefilled by 'p9'"):
        build_import_plan(hs, RemotePrefill("r", "p9", 4, (1,), 2), spec, (1,))
    with pytest.raises(InvalidCommandError, match=r"2 prefill pages for 2 tokens; expected cdiv\(2, 2\) = 1"):
        build_import_plan(hs, RemotePrefill("r", "p0", 4, (1, 2), 2), spec, (1, 2))
    with pytest.raises(InvalidCommandError, match="host pool expects"):
        build_import_plan(hs, RemotePrefill("r", "p0", 4, (1,), 2), HostPoolSpec(3, 10, 2, BF16_MLA), (1,))
    with pytest.raises(InvalidCommandError, match="host pool expects"):
        build_import_plan(hs, RemotePrefill("r", "p0", 4, (1,), 2), HostPoolSpec(2, 10, 2, FP8_DS_MLA), (1,))
    with pytest.raises(InvalidCommandError, match="repeat a block"):
        build_import_plan(hs, RemotePrefill("r", "p0", 4, (1, 2), 4), spec, (3, 3))
