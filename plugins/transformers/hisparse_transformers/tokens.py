"""A request's token ids as the coordinator reads them, without a device read every step.

Generated tokens arrive as device tensors (the input of the next forward). The coordinator asks
for `len(token_ids)` every step but reads the ids only for the pages it seals (to hash them), so
the device tensors are copied to the host only then: once a page, not once a token.

A CUDA slice starts its copy to pinned host memory as it arrives, ordered after the work that
produced it (the sampling of the step before) and before the forward that consumes it, and the
read waits for that copy alone: an engine that reads ids while the device still runs a later
forward (a step planned ahead) does not wait for that forward.
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
        self._pending: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self._pending_len = 0

    def extend_device(self, ids: torch.Tensor) -> None:
        """Append a 1-D tensor of ids (any device); it is read back only when an id is needed."""
        if ids.numel():
            flat = ids.detach().reshape(-1)
            if flat.is_cuda:
                host = flat.to("cpu", non_blocking=True)       # pinned; valid once `done` has passed
                done = torch.cuda.Event()
                done.record()
                self._pending.append((host, done))
            else:
                self._pending.append((flat, None))
            self._pending_len += flat.numel()

    def _flush(self) -> None:
        if self._pending:
            for _, done in self._pending:
                if done is not None:
                    done.synchronize()
            self._ids.extend(int(v) for v in torch.cat([p.to("cpu") for p, _ in self._pending]).tolist())
            self._pending.clear()
            self._pending_len = 0

    def truncate(self, length: int) -> None:
        """Keep the first `length` ids (a rollback); pending device slices are cut, not read."""
        while self._pending and len(self) - self._pending[-1][0].numel() >= length:
            host, _ = self._pending.pop()
            self._pending_len -= host.numel()
        if self._pending:
            host, done = self._pending[-1]
            cut = len(self) - length
            if cut > 0:
                self._pending[-1] = (host[:host.numel() - cut], done)
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
