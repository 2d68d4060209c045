"""A request's token ids as the coordinator reads them, without a device read every step.

Generated tokens arrive as device tensors (the input of the next forward). The coordinator asks
for `len(token_ids)` every step but reads the ids only for the pages it seals (to hash them), so
the device tensors are copied to the host only then: once a page, not once a token.

A step's ids of the whole batch (`StagedIds`, `[B, S]`) start one copy to pinned host memory as
they arrive, ordered after the work that produced them (the sampling of the step before) and
before the forward that consumes them, and every request of the batch keeps a reference to its
row (one copy and one event a step, not one a request: these are CUDA calls on the step's critical
path). A read waits for that copy alone: an engine that reads ids while the device still runs a
later forward (a step planned ahead) does not wait for that forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

import torch


class StagedIds:
    """One step's ids of every batch row (`[B, S]`, any device), copied to the host once; the rows
    are read on the host only when a request first needs one of them."""

    __slots__ = ("_host", "_done", "_rows")

    def __init__(self, ids: torch.Tensor) -> None:
        if ids.dim() != 2:
            raise ValueError(f"staged ids are [batch, tokens], got shape {tuple(ids.shape)}")
        ids = ids.detach()
        self._done: torch.cuda.Event | None = None
        if ids.is_cuda:
            self._host = ids.to("cpu", non_blocking=True)       # pinned; valid once `_done` has passed
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._host = ids.clone()     # the caller may reuse its buffer before the ids are read
        self._rows: list[list[int]] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self._host.shape[0], self._host.shape[1]

    def row(self, b: int, lo: int, hi: int) -> list[int]:
        """Ids `lo:hi` of batch row `b` (the first read waits for the copy)."""
        if self._rows is None:
            if self._done is not None:
                self._done.synchronize()
            self._rows = self._host.tolist()
        return self._rows[b][lo:hi]


class LazyTokens(Sequence[int]):
    """Known host ids followed by pending rows of staged steps, read on first use."""

    __slots__ = ("_ids", "_pending", "_pending_len")

    def __init__(self, ids: Sequence[int] = ()) -> None:
        self._ids: list[int] = list(ids)
        self._pending: list[tuple[StagedIds, int, int, int]] = []     # (step, batch row, lo, hi)
        self._pending_len = 0

    def extend_staged(self, staged: StagedIds, row: int, start: int) -> None:
        """Append ids `start:` of batch row `row` of a staged step (read only when an id is needed)."""
        n = staged.shape[1]
        lo, hi, _ = slice(start, n).indices(n)
        if hi > lo:
            self._pending.append((staged, row, lo, hi))
            self._pending_len += hi - lo

    def _flush(self) -> None:
        if self._pending:
            for staged, b, lo, hi in self._pending:
                self._ids.extend(staged.row(b, lo, hi))
            self._pending.clear()
            self._pending_len = 0

    def truncate(self, length: int) -> None:
        """Keep the first `length` ids (a rollback); pending rows are cut, not read."""
        while self._pending and len(self) - (self._pending[-1][3] - self._pending[-1][2]) >= length:
            _, _, lo, hi = self._pending.pop()
            self._pending_len -= hi - lo
        if self._pending:
            staged, b, lo, hi = self._pending[-1]
            cut = len(self) - length
            if cut > 0:
                self._pending[-1] = (staged, b, lo, hi - cut)
                self._pending_len -= cut
        elif length < len(self._ids):
            del self._ids[length:]

    def __len__(self) -> int:
        return len(self._ids) + self._pending_len

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        self._flush()
        return self._ids[index]

    def tolist(self) -> list[int]:
        self._flush()
        return list(self._ids)
