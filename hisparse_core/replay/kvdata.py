"""Deterministic synthetic KV rows, and the all-resident reference copy the replay checks against.

A row is a function of (content key, position, layer): requests that share a prompt prefix
share the content key of those positions, so they produce byte-identical rows there (as a model
would), and a prefix hit served from host must return exactly them. Every row carries its
position and content key in its first 8 elements (values 0..255, exact in uint8 and bf16), so
two different positions or keys can never produce the same row; the rest comes from a seeded
random table of rows. Both live on the engine's device (the backend's): the rows written into the
device caches and the reference copy are made there, so nothing crosses devices on the way.
"""

from __future__ import annotations

import torch

from hisparse_core.geometry import RowFormat

_TABLE_ROWS = 4096
_HEADER = 8


class RowSource:
    """Rows of one run: `rows(key, positions, layer)` -> `[n, width]` of the row format's dtype."""

    def __init__(self, fmt: RowFormat, num_layers: int, seed: int = 0, device: torch.device | str = "cpu") -> None:
        if fmt.width <= _HEADER:
            raise ValueError(f"row format {fmt.name!r} has {fmt.width} elements; need more than {_HEADER}")
        self.fmt = fmt
        self.num_layers = num_layers
        gen = torch.Generator().manual_seed(seed)
        if fmt.dtype == torch.uint8:
            self._table = torch.randint(0, 256, (_TABLE_ROWS, fmt.width), dtype=torch.uint8, generator=gen)
        else:  # float formats: standard normal values in the row dtype
            self._table = torch.randn((_TABLE_ROWS, fmt.width), generator=gen).to(fmt.dtype)
        self._table = self._table.to(device)

    @property
    def device(self) -> torch.device:
        return self._table.device

    def rows(self, key: int, positions: torch.Tensor, layer: int) -> torch.Tensor:
        """Rows at `positions` (a tensor on this source's device)."""
        pos = positions.to(torch.int64)
        idx = (pos * 2654435761 + key * 40503 + layer * 97 + 12345) % _TABLE_ROWS
        out = self._table[idx].clone()
        header = torch.stack([(pos >> s) & 0xFF for s in (0, 8, 16, 24)]
                             + [torch.full_like(pos, (key >> s) & 0xFF) for s in (0, 8, 16)]
                             + [torch.full_like(pos, layer & 0xFF)], dim=1)
        out[:, :_HEADER] = header.to(self.fmt.dtype)
        return out


class ReferenceKV:
    """The all-resident copy of one request: every row it ever wrote, in every layer, by position."""

    def __init__(self, fmt: RowFormat, num_layers: int, max_tokens: int, device: torch.device | str = "cpu") -> None:
        self.data = torch.zeros((num_layers, max_tokens, fmt.width), dtype=fmt.dtype, device=device)
        self.length = 0

    def write(self, layer: int, start: int, rows: torch.Tensor) -> None:
        self.data[layer, start:start + rows.shape[0]] = rows
        self.length = max(self.length, start + rows.shape[0])

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()
