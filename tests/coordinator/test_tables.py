"""`apply_table_updates`: the batched write equals applying every update in order, on a device
where a CPU-built index or value would raise (`strict_device`)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strict_device import enable, memory_of

from hisparse_core.coordinator.outputs import TableUpdate
from hisparse_core.coordinator.tables import apply_table_updates

REQUESTS, PAGES, HOT = 5, 7, 3


@st.composite
def updates(draw: st.DrawFn) -> list[TableUpdate]:
    out = []
    for _ in range(draw(st.integers(0, 8))):
        pages = draw(st.lists(st.integers(0, PAGES - 1), max_size=PAGES))
        blocks = draw(st.lists(st.integers(0, 999), min_size=len(pages), max_size=len(pages)))
        hot = draw(st.none() | st.lists(st.integers(0, 99), max_size=HOT))
        out.append(TableUpdate(draw(st.integers(0, REQUESTS - 1)), tuple(pages), tuple(blocks),
                               None if hot is None else tuple(hot)))
    return out


@settings(max_examples=60, deadline=None)
@given(updates(), st.integers(0, 2**31 - 1))
def test_batched_write_equals_updates_applied_in_order(ups: list[TableUpdate], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    source0 = torch.randint(-1, 1000, (REQUESTS, PAGES), generator=gen, dtype=torch.int32)
    hot0 = torch.randint(-1, 100, (REQUESTS, HOT), generator=gen, dtype=torch.int32)
    want_source, want_hot = source0.clone(), hot0.clone()
    for u in ups:
        for p, b in zip(u.pages, u.host_block_ids, strict=True):
            want_source[u.state_index, p] = b
        if u.hot_block_ids is not None:
            want_hot[u.state_index] = -1
            want_hot[u.state_index, :len(u.hot_block_ids)] = torch.tensor(u.hot_block_ids, dtype=torch.int32)
    dev = enable()
    source, hot = source0.to(dev), hot0.to(dev)
    apply_table_updates(ups, source, hot)
    assert torch.equal(memory_of(source), want_source)
    assert torch.equal(memory_of(hot), want_hot)
