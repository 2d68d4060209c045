"""The worker's residency tables: which device block holds each page of each request state row.

One int32 tensor `[max_requests, max_pages]` per resident group, on the backend's device; -1
means the page is not resident (it is read from host through the hot buffer). The scheduler's
`ResidencyUpdate`s are the only writer; attention reads the tables as `ResolveInputs.resident_table`.
The engine's own block table stays append-only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hisparse_core.errors import InvalidCommandError, InvalidInputError
from hisparse_core.types import ResidencyUpdate


class ResidencyTables:
    """Per resident group, the resident block of every (state row, page)."""

    def __init__(self, num_groups: int, max_requests: int, max_pages: int, device: torch.device) -> None:
        for name, v in (("num_groups", num_groups), ("max_requests", max_requests), ("max_pages", max_pages)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise InvalidInputError(f"ResidencyTables {name} must be a positive int, got {v!r}")
        self._tables = [torch.full((max_requests, max_pages), -1, dtype=torch.int32, device=device)
                        for _ in range(num_groups)]
        self.max_requests = max_requests
        self.max_pages = max_pages

    @property
    def num_groups(self) -> int:
        return len(self._tables)

    def table(self, group: int) -> torch.Tensor:
        if not 0 <= group < len(self._tables):
            raise InvalidInputError(f"resident group {group} out of range; this worker has {len(self._tables)}")
        return self._tables[group]

    def apply(self, updates: Sequence[ResidencyUpdate]) -> None:
        """Write every update; all are checked first, so a bad one changes nothing."""
        for i, u in enumerate(updates):
            if not 0 <= u.state_index < self.max_requests:
                raise InvalidCommandError(
                    f"residency_updates[{i}].state_index={u.state_index} out of range; expected "
                    f"[0, {self.max_requests})")
            if len(u.block_ids) != len(self._tables):
                raise InvalidCommandError(
                    f"residency_updates[{i}] has block ids for {len(u.block_ids)} resident groups; expected "
                    f"{len(self._tables)}")
            bad = [p for p in u.pages if p >= self.max_pages]
            if bad:
                raise InvalidCommandError(
                    f"residency_updates[{i}] names page {bad[0]}; expected pages < max_pages={self.max_pages}")
        for u in updates:
            if not u.pages:
                continue
            pages = torch.tensor(u.pages, dtype=torch.long)
            for table, ids in zip(self._tables, u.block_ids, strict=False):
                table[u.state_index, pages.to(table.device)] = torch.tensor(ids, dtype=torch.int32,
                                                                            device=table.device)

    def reset(self, state_rows: Sequence[int] | None = None) -> None:
        """Mark every page of the given state rows (default: all) not resident."""
        if state_rows is None:
            for t in self._tables:
                t.fill_(-1)
            return
        rows = list(state_rows)
        bad = [r for r in rows if not 0 <= r < self.max_requests]
        if bad:
            raise InvalidInputError(f"state row {bad[0]} out of range; expected [0, {self.max_requests})")
        for t in self._tables:
            t[rows] = -1
