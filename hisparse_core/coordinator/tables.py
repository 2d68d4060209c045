"""Writing the coordinator's table deltas into an engine's device tables.

`HiSparseCoordinator.take_table_updates()` returns what changed in the source table (host block
of each page) and the hot table (hot-buffer blocks of each request) since the last call. Every
engine keeps those two tables as persistent int32 tensors on its device, the ones it passes to
`CacheRuntime.resolve` each step; this is the one place that writes them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from hisparse_core.coordinator.outputs import TableUpdate


def apply_table_updates(updates: Iterable[TableUpdate], source_table: torch.Tensor, hot_table: torch.Tensor) -> None:
    """Write `updates` into `source_table` `[max_requests, max_pages]` and `hot_table`
    `[max_requests, hot_blocks]`: one indexed write per table, with indices and values made on
    the tables' device (a later update of an entry wins, as applying them in order would).

    Not on the decode path: it runs once per step, before the worker's `start_step`.
    """
    source: dict[tuple[int, int], int] = {}
    hot: dict[int, list[int]] = {}
    width = hot_table.shape[1]
    for u in updates:
        source.update(((u.state_index, p), b) for p, b in zip(u.pages, u.host_block_ids, strict=True))
        if u.hot_block_ids is not None:
            hot[u.state_index] = list(u.hot_block_ids) + [-1] * (width - len(u.hot_block_ids))
    if source:
        dev = source_table.device
        (rows, pages), ids = zip(*source, strict=False), list(source.values())
        source_table[torch.tensor(rows, device=dev), torch.tensor(pages, device=dev)] = \
            torch.tensor(ids, dtype=torch.int32, device=dev)
    if hot:
        dev = hot_table.device
        hot_table[torch.tensor(list(hot), device=dev)] = torch.tensor(list(hot.values()), dtype=torch.int32, device=dev)
