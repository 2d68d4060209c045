"""`RowMap`, the rows of one forward's top-k: built by an index group's leader (attention.py),
reused by its followers, read by the checker (check.py). Plain data: it imports nothing of the
package."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class RowMap:
    """Where the rows of one forward's top-k live, shared by the layers of an index group.

    Decode (`rows` set): the resolver's output rows `[B, 1, K]`. Prefill: device rows and host
    rows per entry `[B, S, K]`, with `host_mask` marking the entries read from the host pool.
    `positions` `[B, S, K]` are the logical positions (-1 masked), `valid` where an entry is used.
    """

    positions: torch.Tensor
    valid: torch.Tensor
    rows: torch.Tensor | None = None
    dev_rows: torch.Tensor | None = None
    host_rows: torch.Tensor | None = None
    host_mask: torch.Tensor | None = None
    num_host: int = 0
