"""The row check: every row an attention layer reads through hisparse is the model's own latent.

With `enable(..., check=True)` the patched attention also keeps an all-resident copy of each
layer's latent rows, in logical positions, exactly as the model computed them. Each time a layer
has gathered its rows (decode: through the resolver's resident/hot/miss path; prefill: from the
resident pages and the host pool), every used entry is compared with that copy. A difference
raises `RowMismatch` naming the layer, the batch row, the logical position and the physical row.

With `kv_rows="fp8"` a row is read back as stored (e4m3 values and their scales), so each value
may differ from the model's latent by the rounding `LatentRows.error_bound` allows; a row of
another position or a corrupted one is far outside it too.

Rows served from a prefix hit were computed by an earlier batch, so the comparison allows the
float noise of recomputing the same row in another batch shape (`tolerance_for`); a corrupted row
is far outside it.

The top-k check: each index-group leader's top-k is compared with what the model's own indexer
picks from the same inputs over its own key cache (a transformers `DynamicCache` the checker
keeps, keys concatenated as the model's own generate keeps them), with the scores that indexer
computed (read off its `topk` call). Per query the two sets are

- the same: a pass;
- different only among entries whose score equals the k-th score exactly: a tie (counted in
  `totals.topk_ties`, logged). `torch.topk` orders exactly tied scores by implementation detail
  (on the CPU, by the length of the scored row), so hisparse is exact up to that order;
- different otherwise: `TopkMismatch`, naming the layer, row and query position.

That comparison re-runs the indexer on hisparse's own inputs, so it cannot see a choice the
model's own generate makes differently from the same scores: with equal scores at the k-th place
both runs here break the tie alike (nothing differs to count), while the model's own generate,
scoring its own cache (rows of another length or layout), may keep another of the tied keys. So
the checker also counts, from the reference scores alone, the queries whose top-k was decided at
the boundary:

- `topk_boundary_ties`: a key left out scores exactly the k-th score (an exact tie straddles the
  cut; with few indexer heads many keys score exactly 0, every head's dot product negative);
- `topk_near_ties`: otherwise, a key left out scores within `near_tie_bound` of the k-th score,
  closer than the float noise earlier layers add (fp32: 1e-5 of the row's largest score). A
  different summation order upstream can swap such keys, so the model's own generate may pick
  the other one, and its logits then differ by more than float noise though no row was wrong.

Both are reported (`HiSparseStats.checked_topk_boundary_ties`, `checked_topk_near_ties`, one log
line); neither fails the check: hisparse attends exactly to the keys its indexer picked.

End-to-end exactness (tokens and logits against the model's own generate) is the tests' and
`hisparse generate`'s job.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

from hisparse_core.errors import HiSparseError
from hisparse_transformers.index_keys import dequantize_fp8, quantize_fp8

if TYPE_CHECKING:
    from hisparse_transformers.kv_rows import LatentRows
    from hisparse_transformers.rows import RowMap
    from hisparse_transformers.session import Session, StepState


logger = logging.getLogger(__name__)


class RowMismatch(HiSparseError, AssertionError):
    """A gathered row differs from the model's own latent for that layer and position."""

    def __init__(self, message: str, *, layer: int, row: int, position: int, physical: int | None) -> None:
        super().__init__(message)
        self.layer = layer
        self.row = row
        self.position = position
        self.physical = physical


class TopkMismatch(HiSparseError, AssertionError):
    """A leader's top-k differs from the model's own indexer by more than the order of exact ties."""

    def __init__(self, message: str, *, layer: int, row: int, position: int) -> None:
        super().__init__(message)
        self.layer = layer
        self.row = row
        self.position = position


class _TopkScores(TorchFunctionMode):
    """Records the scores the indexer hands to its `topk` (the last call inside the block)."""

    def __init__(self) -> None:
        super().__init__()
        self.scores: torch.Tensor | None = None

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if func is torch.Tensor.topk or func is torch.topk:
            self.scores = args[0]
        return func(*args, **(kwargs or {}))


def _selected(indices: torch.Tensor, length: int) -> torch.Tensor:
    """`[B, S, k]` indices -> `[B, S, length]` bool, True where chosen (indices >= length dropped)."""
    idx = indices.to(torch.int64)
    idx = torch.where((idx >= 0) & (idx < length), idx, torch.full_like(idx, length))
    out = torch.zeros((*idx.shape[:-1], length + 1), dtype=torch.bool, device=idx.device)
    return out.scatter_(-1, idx, True)[..., :length]


def compare_topk(ours: torch.Tensor, theirs: torch.Tensor, scores: torch.Tensor,
                 queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tied, differing) `[B, S]` bool: queries (where `queries`) whose chosen sets differ only
    among entries scored exactly the k-th score, and those that differ otherwise. `scores`
    `[B, S, T]` are the reference's; entries it masked (-inf) and indices >= T are ignored."""
    length = scores.shape[-1]
    finite = torch.isfinite(scores)
    mine = _selected(ours, length) & finite
    ref = _selected(theirs, length) & finite
    only_mine, only_ref = mine & ~ref, ref & ~mine
    differs = (only_mine | only_ref).any(-1) & queries
    kth = torch.where(ref, scores, torch.full_like(scores, float("inf"))).amin(-1, keepdim=True)
    at_kth = scores == kth
    tie = ((only_mine.sum(-1) == only_ref.sum(-1)) & ~(only_mine & ~at_kth).any(-1)
           & ~(only_ref & ~at_kth).any(-1))
    return differs & tie, differs & ~tie


def near_tie_bound(dtype: torch.dtype) -> float:
    """Relative (to the row's largest absolute score) distance from the k-th score within which a
    left-out key counts as a near-tie: above the float noise of recomputing the scores."""
    return 1e-5 if dtype in (torch.float32, torch.float64) else 2e-2


def boundary_ties(theirs: torch.Tensor, scores: torch.Tensor,
                  queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact, near) `[B, S]` bool: queries (where `queries`) whose reference top-k `theirs`
    leaves out a key scoring exactly its k-th score, and, of the rest, one scoring within
    `near_tie_bound` of it (`scores` `[B, S, T]`, masked entries -inf)."""
    length = scores.shape[-1]
    finite = torch.isfinite(scores)
    chosen = _selected(theirs, length) & finite
    kth = torch.where(chosen, scores, torch.full_like(scores, float("inf"))).amin(-1, keepdim=True)
    out = finite & ~chosen
    exact = (out & (scores == kth)).any(-1) & queries & chosen.any(-1)
    scale = torch.where(finite, scores.abs(), torch.zeros_like(scores)).amax(-1, keepdim=True)
    bound = near_tie_bound(scores.dtype) * scale
    near = (out & ((scores - kth).abs() <= bound)).any(-1) & queries & chosen.any(-1) & ~exact
    return exact, near


def tolerance_for(dtype: torch.dtype) -> tuple[float, float]:
    """(absolute, relative) difference allowed between a stored row and the model's latent."""
    if dtype == torch.float32 or dtype == torch.float64:
        return 1e-5, 1e-4
    return 1e-2, 2e-2


@dataclass(slots=True)
class CheckTotals:
    entries: int = 0
    max_abs_diff: float = 0.0
    topk_queries: int = 0        # leader queries whose top-k was compared with the model's own
    topk_ties: int = 0           # of them, those that differ only in the order of exactly tied scores
    topk_boundary_ties: int = 0  # of them, those whose k-th score ties exactly with a key left out
    topk_near_ties: int = 0      # of the rest, those with a key left out within near_tie_bound of the k-th score


def reference_cache(config: Any, indexer_keys: str) -> Any:
    """The checker's own key cache: transformers' `DynamicCache`; for fp8 keys one that keeps each
    key as quantized and dequantized (`index_keys.py`), the values hisparse's indexer scores."""
    from transformers.cache_utils import DynamicCache

    if indexer_keys == "model":
        return DynamicCache(config=config)

    class Fp8KeyCache(DynamicCache):  # type: ignore[misc]  # transformers is untyped here
        def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> Any:
            return super().update_indexer(dequantize_fp8(*quantize_fp8(indexer_key_states)), layer_idx)

    return Fp8KeyCache(config=config)


class ExactnessChecker:
    """Keeps the all-resident copy of the current session and compares every gathered row with it."""

    def __init__(self, model_config: Any = None, indexer_keys: str = "model", rows: LatentRows | None = None) -> None:
        self._rows = rows                     # the stored form (kv_rows="fp8": read back within its rounding)
        self._session: Session | None = None
        self._ref: dict[int, torch.Tensor] = {}
        self.totals = CheckTotals()
        self._config = model_config           # for the reference key cache (None: no top-k check)
        self._topk_session: Session | None = None
        self._ref_cache: Any = None
        self._ref_len: dict[int, int] = {}
        self._indexer_keys = indexer_keys     # the reference key cache stores them as hisparse's does

    def check_topk(self, layer: int, session: Session, step: StepState, indexer: Callable[..., torch.Tensor],
                   inputs: tuple[Any, ...], topk: torch.Tensor) -> None:
        """Compare a leader's `topk` `[B, S, k]` (padded indices) with the model's own indexer run on
        `inputs` (hidden, q_resid, position embeddings, mask `[B, S, >= T]`, position ids) over the
        checker's own key cache (see the module docstring)."""
        if self._config is None:
            return
        if self._topk_session is not session:
            self._topk_session, self._ref_cache, self._ref_len = session, reference_cache(self._config,
                                                                                          self._indexer_keys), {}
        hidden, q_resid, position_embeddings, mask, position_ids = inputs
        length = self._ref_len.get(layer, 0) + hidden.shape[1]
        self._ref_len[layer] = length
        capture = _TopkScores()
        with capture:
            theirs = indexer(hidden, q_resid, position_embeddings, mask[..., :length], position_ids, self._ref_cache)
        scores = capture.scores
        if scores is None:
            raise TopkMismatch(f"layer {layer}: the model's indexer made no topk call to compare with", layer=layer,
                               row=-1, position=-1)
        queries = step.qpos >= 0
        tied, differing = compare_topk(topk, theirs, scores, queries)
        self.totals.topk_queries += int(queries.sum())
        if bool(differing.any()):
            b, s = (int(v) for v in differing.nonzero()[0])
            position = int(step.qpos[b, s])
            mine = sorted(set(topk[b, s].tolist()) - set(theirs[b, s].tolist()))[:8]
            raise TopkMismatch(
                f"layer {layer}, batch row {b} ({session.requests[b].request_id}), query position {position}: the "
                f"top-k differs from the model's own indexer beyond tied scores (padded indices {mine} chosen "
                f"instead of theirs); {int(differing.sum())} queries differ in this step", layer=layer, row=b,
                position=position)
        exact, near = boundary_ties(theirs, scores, queries)
        n_exact, n_near = int(exact.sum()), int(near.sum())
        if n_exact or n_near:
            first = self.totals.topk_boundary_ties + self.totals.topk_near_ties == 0
            self.totals.topk_boundary_ties += n_exact
            self.totals.topk_near_ties += n_near
            b, s = (int(v) for v in (exact | near).nonzero()[0])
            (logger.info if first else logger.debug)(
                "hisparse check: layer %d, batch row %d, query position %d: the top-k was decided at a tie (%d queries "
                "this step with a key left out at exactly the k-th score, %d within %g of it): hisparse attends to "
                "the keys its indexer picked, but the model's own generate may pick another of them, and its logits "
                "then differ by more than float noise", layer, b, int(step.qpos[b, s]), n_exact, n_near,
                near_tie_bound(scores.dtype))
        ties = int(tied.sum())
        if ties:
            first = self.totals.topk_ties == 0
            self.totals.topk_ties += ties
            b, s = (int(v) for v in tied.nonzero()[0])
            (logger.info if first else logger.debug)(
                "hisparse check: layer %d, batch row %d, query position %d: the top-k differs from the model's own "
                "only in the order of exactly tied indexer scores (%d such queries this step; exact up to that "
                "order)", layer, b, int(step.qpos[b, s]), ties)

    def rollback(self, session: Session, num_tokens: int) -> None:
        """The batch dropped its last `num_tokens` padded positions (a rejected suffix): so does the
        reference key cache. (The latent copy is positional: the next forward overwrites it.)"""
        if self._topk_session is not session or self._ref_cache is None:
            return
        for layer in self._ref_cache.layers:
            keys = getattr(layer, "indexer_keys", None)
            if getattr(layer, "is_indexer_initialized", False) and keys is not None and keys.shape[1]:
                layer.indexer_keys = keys[:, :max(0, keys.shape[1] - num_tokens)]
        for layer_idx, length in self._ref_len.items():
            self._ref_len[layer_idx] = max(0, length - num_tokens)

    def _buffer(self, layer: int, session: Session, like: torch.Tensor, length: int) -> torch.Tensor:
        if self._session is not session:
            self._session, self._ref = session, {}
        buf = self._ref.get(layer)
        if buf is None or buf.shape[1] < length:
            # a normal tensor even in inference mode: the batch's next forward may run outside it
            with torch.inference_mode(False):
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
        buf[b, qpos[b, s]] = latent.detach()[b, s]      # the copy outlives the forward: no autograd graph

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
        allowed = atol + rtol * want.abs()
        if self._rows is not None and self._rows.kind != "model":
            allowed = allowed + self._rows.error_bound(want)
        diff = (got - want).abs()
        bad = ((diff > allowed).any(-1) | ~torch.isfinite(got).all(-1)) & rmap.valid
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
