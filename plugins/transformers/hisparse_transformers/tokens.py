"""A request's token ids as the coordinator reads them, without a device read every step.

Generated tokens arrive as device tensors (the input of the next forward). The coordinator asks
for `len(token_ids)` every step but reads the ids only for the pages it seals (to hash them), so
the device tensors are copied to the host only then: once a page, not once a token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

import torch


class LazyTokens(Sequence[int]):
    """Known host ids followed by pending device slices, flushed on first read."""

    __slots__ = ("_ids", "_pending", "_pending_len")

    def __init__(self, ids: Sequence[int] = ()) -> None:
        self._ids: list[int] = list(ids)
        self._pending: list[torch.Tensor] = []
        self._pending_len = 0

    def extend_device(self, ids: torch.Tensor) -> None:
        """Append a 1-D tensor of ids (any device); it is read back only when an id is needed."""
        if ids.numel():
            self._pending.append(ids.detach().reshape(-1))
            self._pending_len += ids.numel()

    def _flush(self) -> None:
        if self._pending:
            self._ids.extend(int(v) for v in torch.cat([p.to("cpu") for p in self._pending]).tolist())
            self._pending.clear()
            self._pending_len = 0

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
