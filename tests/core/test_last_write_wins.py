"""`hisparse_core.vllm_ops.last_write_wins`: one scatter of a fixed-shape row copy is deterministic and
equals applying the taken entries one after the other (the later wins)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_core.vllm_ops import last_write_wins


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.booleans()), min_size=1, max_size=40))
def test_one_scatter_equals_writing_the_taken_entries_in_order(entries: list[tuple[int, bool]]) -> None:
    dst = torch.tensor([d for d, _ in entries], dtype=torch.int64)
    take = torch.tensor([t for _, t in entries])
    data = torch.randint(1, 1 << 30, (len(entries),))
    eff, pick, any_take = last_write_wins(dst, take)
    want = torch.zeros(8, dtype=torch.int64)
    for i, (d, t) in enumerate(entries):  # sequential: the later taken entry wins
        if t:
            want[d] = data[i]
    if not bool(any_take):
        assert not bool(take.any())
        return
    # every write to one row carries the same bytes, so the scatter's order cannot matter
    for d in set(eff.tolist()):
        assert len({int(data[p]) for e, p in zip(eff.tolist(), pick.tolist(), strict=True) if e == d}) == 1
    got = torch.zeros(8, dtype=torch.int64)
    got[eff] = data[pick]
    assert torch.equal(got, want)
    assert set(eff.tolist()) == {d for d, t in entries if t}  # no row beyond the taken destinations
