"""The per-step correctness check: sparse attention over resolved rows vs over the all-resident copy.

For one layer and a batch of decode rows: gather the rows the backend resolved (physical rows of
the device cache) and the same positions from each request's all-resident reference copy, in
top-k order. The gathered bytes must be identical, and a synthetic single-query attention
(softmax(K q / sqrt(d)) K, the row values read as float32: uint8 bytes for fp8_ds_mla rows, the
values for bf16 rows) must give equal outputs. Any difference raises `AttentionMismatch` naming
the request, layer, position and physical row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hisparse_core.errors import HiSparseError


class AttentionMismatch(HiSparseError, AssertionError):
    """Resolved rows or attention outputs differ from the all-resident reference."""

    def __init__(self, message: str, *, request: str, layer: int, position: int | None, row: int | None) -> None:
        super().__init__(message)
        self.request = request
        self.layer = layer
        self.position = position
        self.row = row


def _attend(keys: torch.Tensor, valid: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    x = keys.to(torch.float32)                                   # [B, K, W]
    scores = torch.bmm(x, queries.unsqueeze(-1)).squeeze(-1) / math.sqrt(x.shape[-1])
    scores = scores.masked_fill(~valid, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    weights = torch.nan_to_num(weights, nan=0.0)                 # rows with no valid entry
    return torch.bmm(weights.unsqueeze(1), x).squeeze(1)         # [B, W]


def check_layer(device_rows: torch.Tensor, rows: torch.Tensor, topk: torch.Tensor,
                references: Sequence[torch.Tensor], queries: torch.Tensor, request_ids: Sequence[str],
                layer: int) -> int:
    """Check one layer for a batch; returns the number of entries compared.

    `device_rows` `[num_device_rows, width]`: the layer's device cache, flat. `rows` `[B, K]`:
    the resolved physical rows (-1 masked). `topk` `[B, K]`: the logical positions asked for.
    `references[b]` `[tokens, width]`: the all-resident copy of this layer for batch row b's
    request. `queries` `[B, width]` float32. Everything is on the device cache's device, and the
    check runs there: only its verdicts (and a mismatch's coordinates) are read back.
    """
    rows = rows.to(torch.int64)
    topk = topk.to(torch.int64)
    valid = topk >= 0
    lost = valid & (rows < 0)
    if bool(lost.any()):
        b, i = lost.nonzero()[0].tolist()
        raise AttentionMismatch(
            f"request {request_ids[b]} layer {layer}: position {int(topk[b, i])} resolved to no row (-1)",
            request=request_ids[b], layer=layer, position=int(topk[b, i]), row=None)
    got = device_rows[rows.clamp(min=0)]                                        # [B, K, W]
    want = torch.empty_like(got)
    for b, ref in enumerate(references):
        torch.index_select(ref, 0, topk[b].clamp(min=0), out=want[b])
    width_bytes = got.shape[-1] * got.element_size()
    diff = (got.view(torch.uint8).view(*got.shape[:2], width_bytes)
            != want.view(torch.uint8).view(*want.shape[:2], width_bytes)).any(-1) & valid
    if bool(diff.any()):
        b, i = diff.nonzero()[0].tolist()
        bad = int(diff.sum())
        raise AttentionMismatch(
            f"request {request_ids[b]} layer {layer}: position {int(topk[b, i])} (physical row {int(rows[b, i])}) "
            f"holds other bytes than the all-resident copy; {bad} mismatching entries in this layer's batch",
            request=request_ids[b], layer=layer, position=int(topk[b, i]), row=int(rows[b, i]))
    out_got = _attend(got, valid, queries)
    out_want = _attend(want, valid, queries)
    if not torch.equal(out_got, out_want):
        b = int((out_got != out_want).any(-1).nonzero()[0, 0])
        raise AttentionMismatch(
            f"request {request_ids[b]} layer {layer}: sparse attention output differs from the all-resident "
            f"output although the gathered rows are identical", request=request_ids[b], layer=layer,
            position=None, row=None)
    return int(valid.sum())
