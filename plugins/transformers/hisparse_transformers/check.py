"""The row check: every row an attention layer reads through hisparse is the model's own latent.

With `enable(..., check=True)` the patched attention also keeps an all-resident copy of each
layer's latent rows, in logical positions, exactly as the model computed them. Each time a layer
has gathered its rows (decode: through the resolver's resident/hot/miss path; prefill: from the
resident pages and the host pool), every used entry is compared with that copy. A difference
raises `RowMismatch` naming the layer, the batch row, the logical position and the physical row.

Rows served from a prefix hit were computed by an earlier batch, so the comparison allows the
float noise of recomputing the same row in another batch shape (`tolerance_for`); a corrupted row
is far outside it. End-to-end exactness (tokens and logits against the model's own generate) is
the tests' and `hisparse generate`'s job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hisparse_core.errors import HiSparseError

if TYPE_CHECKING:
    from hisparse_transformers.attention import RowMap
    from hisparse_transformers.engine import Session, StepState


class RowMismatch(HiSparseError, AssertionError):
    """A gathered row differs from the model's own latent for that layer and position."""

    def __init__(self, message: str, *, layer: int, row: int, position: int, physical: int | None) -> None:
        super().__init__(message)
        self.layer = layer
        self.row = row
        self.position = position
        self.physical = physical


def tolerance_for(dtype: torch.dtype) -> tuple[float, float]:
    """(absolute, relative) difference allowed between a stored row and the model's latent."""
    if dtype == torch.float32 or dtype == torch.float64:
        return 1e-5, 1e-4
    return 1e-2, 2e-2


@dataclass(slots=True)
class CheckTotals:
    entries: int = 0
    max_abs_diff: float = 0.0


class ExactnessChecker:
    """Keeps the all-resident copy of the current session and compares every gathered row with it."""

    def __init__(self) -> None:
        self._session: Session | None = None
        self._ref: dict[int, torch.Tensor] = {}
        self.totals = CheckTotals()

    def _buffer(self, layer: int, session: Session, like: torch.Tensor, length: int) -> torch.Tensor:
        if self._session is not session:
            self._session, self._ref = session, {}
        buf = self._ref.get(layer)
        if buf is None or buf.shape[1] < length:
            grown = like.new_zeros((like.shape[0], max(length, 2 * (buf.shape[1] if buf is not None else 0), 64),
                                    like.shape[-1]))
            if buf is not None:
                grown[:, :buf.shape[1]] = buf
            buf = self._ref[layer] = grown
        return buf

    def record(self, layer: int, session: Session, step: StepState, latent: torch.Tensor) -> None:
        """`latent` `[B, S, W]`: this forward's rows of `layer`, at the step's query positions."""
        qpos = step.qpos
        buf = self._buffer(layer, session, latent, int(qpos.max()) + 1 if qpos.numel() else 1)
        b, s = (qpos >= 0).nonzero(as_tuple=True)
        buf[b, qpos[b, s]] = latent[b, s]

    def check(self, layer: int, session: Session, kv: torch.Tensor, rmap: RowMap) -> None:
        """`kv` `[B, S, K, >= W]`: the gathered rows; compare every used entry with the copy."""
        ref = self._ref[layer] if self._session is session else None
        if ref is None:
            raise RowMismatch(f"layer {layer}: rows read before any were written", layer=layer, row=-1, position=-1,
                              physical=None)
        width = ref.shape[-1]
        pos = rmap.positions.clamp(min=0)
        bidx = torch.arange(pos.shape[0], device=pos.device).view(-1, 1, 1).expand_as(pos)
        want = ref[bidx, pos].to(torch.float64)
        got = kv[..., :width].to(torch.float64)
        atol, rtol = tolerance_for(ref.dtype)
        diff = (got - want).abs()
        bad = ((diff > atol + rtol * want.abs()).any(-1) | ~torch.isfinite(got).all(-1)) & rmap.valid
        used = diff.amax(-1)[rmap.valid]
        if used.numel():
            self.totals.max_abs_diff = max(self.totals.max_abs_diff, float(used.max()))
        self.totals.entries += int(rmap.valid.sum())
        if bool(bad.any()):
            b, s, i = (int(v) for v in bad.nonzero()[0])
            position = int(rmap.positions[b, s, i])
            physical, where = self._where(rmap, b, s, i)
            request = session.requests[b].request_id
            raise RowMismatch(
                f"layer {layer}, batch row {b} ({request}), position {position}: the row read {where} differs from "
                f"the model's own latent by {float(diff[b, s, i].max()):.3g} (max abs); {int(bad.sum())} bad entries "
                "in this layer's read", layer=layer, row=b, position=position, physical=physical)

    @staticmethod
    def _where(rmap: RowMap, b: int, s: int, i: int) -> tuple[int | None, str]:
        if rmap.rows is not None:
            row = int(rmap.rows[b, s, i])
            return row, f"through the resolver (device row {row})"
        assert rmap.host_mask is not None and rmap.host_rows is not None and rmap.dev_rows is not None
        if bool(rmap.host_mask[b, s, i]):
            return int(rmap.host_rows[b, s, i]), f"from the host pool (host row {int(rmap.host_rows[b, s, i])})"
        return int(rmap.dev_rows[b, s, i]), f"from a resident page (device row {int(rmap.dev_rows[b, s, i])})"
