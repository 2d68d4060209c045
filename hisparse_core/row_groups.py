"""Groups of a resolve batch: maximal runs of consecutive batch rows sharing one state row.

A group is the unit the resolver contract (docs/resolver-contract.md) resolves against one
request's hot state; both validation and resolvers walk them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Group:
    """A maximal run `[start, stop)` of consecutive batch rows sharing state row `state`."""

    start: int
    stop: int
    state: int


def groups_of(row_state: torch.Tensor) -> list[Group]:
    """Maximal runs of equal, non-padding (-1) state rows of a CPU `row_state`, in batch order."""
    states = row_state.tolist()
    out: list[Group] = []
    start = 0
    while start < len(states):
        stop = start + 1
        while stop < len(states) and states[stop] == states[start]:
            stop += 1
        if states[start] != -1:
            out.append(Group(start, stop, states[start]))
        start = stop
    return out
