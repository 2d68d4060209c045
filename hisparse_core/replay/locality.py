"""A per-layer top-k model calibrated to published traces of real DSA models.

Two regimes (the figures and sources: ../shared/research/locality.md):

- `benign`: GLM-5.1 on LongBench v2 at top-k 2048 (the HiSparse paper): miss 30% with a buffer
  of one top-k, and at a 2k buffer LRU 13.4%, FIFO 17.2%, random 16.1%, Belady 8.2%; LRU at a
  4k buffer 6.7%. Only aggregates are published, so every layer shares one profile.
- `code`: DeepSeek-V3.2 on one SWE-bench prompt (NVIDIA's GVR): consecutive steps' top-k overlap
  by about 44% (35-50%) in layers 20-60 and by about 1.5% in layers 0-1, below chance.

Model, per request (one `LayeredIndexer`), per indexer layer `l` and decode step `t`. Every
quantity is a fraction of top-k `k` or of the context, so the process is the same at any `k`
(see Scale below):

- sinks, the first `sink_fraction * k` positions, and the recent window, the newest
  `recent_fraction * k`, are picked every step;
- content: a pool of `pool_multiple * k` candidate tokens in blocks of `k / blocks_per_topk`
  aligned positions (block clustering). A block carries a slow score per layer (AR(1),
  coefficient `persistence`, variance 1), each token a static offset (`block_spread`) and a
  per-step jitter (`jitter`). Each step a block is, with probability `refresh`, replaced by a
  fresh aligned block of the history (the drifting content set). A layer's score chains to the
  one below: `s_l = a^d s_{l-1} + sqrt(1 - a^{2d}) u_l` (`d` layers apart, `a` =
  `layer_coupling`), so every layer has the same temporal statistics and adjacent layers pick
  mostly the same tokens (IndexCache: 70-100%);
- fresh churn: a share `churn_l` of layer `l`'s content picks, chosen by a per-token uniform drawn
  afresh each step (chained across layers like the scores, with `churn_coupling`), gives way to
  positions drawn uniformly from the history; a share `repel_l` of those draws avoids the layer's
  previous picks (the below-chance overlap of GVR's first layers). A dropped content token usually
  comes back the next step (a buffer catches it); a fresh one rarely comes back.

A layer's expected consecutive overlap is `(sinks + window - 1 + (1 - churn)^2 * O_c * m) / k`,
with `m` its content picks and `O_c` the content process's own overlap (`CONTENT_OVERLAP`,
measured by `calibrate_locality`): `churn_for_overlap` inverts it, which is how the code regime's
per-layer targets become churn rates. GVR publishes overlaps only: how the changed 56% splits
between drift (which comes back) and fresh tokens (which do not) is not published; the code
regime puts all of it beyond the benign process into fresh churn, the pessimistic reading for a
buffer.

Scale: the published figures are at `k` = 2048; tests run the same process at `k` = 256 with
the same block count per top-k (so the same number of independent units), the same pool, sink,
window and context multiples; `calibrate_locality --top-k 2048` measures both (docs/results.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: Reference depth of the code regime's layer profile (DeepSeek-V3.2).
REFERENCE_LAYERS = 61


@dataclass(frozen=True, slots=True)
class ContentProcess:
    """The drifting, block-clustered content set (see the module docstring)."""

    persistence: float
    jitter: float
    refresh: float
    block_spread: float
    pool_multiple: float = 4.0
    blocks_per_topk: int = 128

    def __post_init__(self) -> None:
        if not 0.0 <= self.persistence < 1.0:
            raise ValueError(f"persistence must be in [0, 1), got {self.persistence}")
        if self.jitter < 0.0 or self.block_spread < 0.0:
            raise ValueError(f"jitter and block_spread must be >= 0, got {self.jitter}, {self.block_spread}")
        if not 0.0 <= self.refresh <= 1.0:
            raise ValueError(f"refresh must be in [0, 1], got {self.refresh}")
        if self.pool_multiple < 1.0 or self.blocks_per_topk < 1:
            raise ValueError(f"pool_multiple must be >= 1 and blocks_per_topk >= 1, got {self.pool_multiple}, "
                             f"{self.blocks_per_topk}")


@dataclass(frozen=True, slots=True)
class LayerProfile:
    """One layer's share of the top-k that is sticky (sinks, window) or fresh (churn, repel)."""

    sink_fraction: float
    recent_fraction: float
    churn: float
    repel: float = 0.0

    def __post_init__(self) -> None:
        for name in ("sink_fraction", "recent_fraction", "churn", "repel"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"layer profile {name} must be in [0, 1], got {v}")
        if self.sink_fraction + self.recent_fraction > 1.0:
            raise ValueError("sinks and recent window exceed the top-k")


#: Fitted by `python -m hisparse_core.replay.calibrate_locality` (see that module and
#: docs/results.md for the figures it measures).
BENIGN_CONTENT = ContentProcess(persistence=0.8696, jitter=0.3371, refresh=0.01971, block_spread=0.6441)
#: The benign content process's own consecutive overlap (share of its picks kept from the step
#: before), measured by `calibrate_locality`; `churn_for_overlap` uses it.
CONTENT_OVERLAP = 0.691
STICKY = LayerProfile(sink_fraction=1 / 512, recent_fraction=1 / 32, churn=0.0)
#: GVR's first layers: no sticky core, all fresh, half the draws avoiding the previous step's picks
#: (overlap 1.5% where chance is k / 68665 = 3.0%).
CHURNING = LayerProfile(sink_fraction=0.0, recent_fraction=0.0, churn=1.0, repel=0.5)


def churn_for_overlap(target: float, sticky: LayerProfile = STICKY, content_overlap: float = CONTENT_OVERLAP) -> float:
    """The churn whose expected consecutive overlap is `target` (the formula in the module docstring)."""
    s, w = sticky.sink_fraction, sticky.recent_fraction  # fractions of top-k (sinks rounded up per step)
    m = 1.0 - s - w
    kept = (target - s - w) / (content_overlap * m)
    return min(1.0, max(0.0, 1.0 - math.sqrt(max(kept, 0.0))))


def code_overlap_target(layer: int) -> float:
    """GVR's consecutive overlap at `layer` of the 61-layer reference: 1.5% in layers 0-1, 35-50%
    (mean 44%) in layers 20-60, and between them a linear ramp (not published: an interpolation)."""
    if layer < 2:
        return 0.015
    plateau = 0.44 + 0.06 * math.sin(2.0 * math.pi * (layer - 20) / 13.0)
    if layer >= 20:
        return plateau
    return 0.15 + (layer - 2) / 18.0 * (0.44 - 0.15)


@dataclass(frozen=True, slots=True)
class Regime:
    """A named locality regime: the content process, the coupling of layers, a profile per layer."""

    name: str
    content: ContentProcess
    layer_coupling: float
    churn_coupling: float

    def profile(self, layer: int) -> LayerProfile:
        """The profile of reference layer `layer` (0-based, of `REFERENCE_LAYERS`)."""
        if self.name == "code":
            if layer < 2:
                return CHURNING
            return LayerProfile(STICKY.sink_fraction, STICKY.recent_fraction,
                                churn_for_overlap(code_overlap_target(layer)))
        return STICKY


REGIMES: dict[str, Regime] = {
    "benign": Regime("benign", BENIGN_CONTENT, layer_coupling=0.97, churn_coupling=0.9),
    "code": Regime("code", BENIGN_CONTENT, layer_coupling=0.97, churn_coupling=0.9),
}


def regime(name: str) -> Regime:
    if name not in REGIMES:
        raise ValueError(f"unknown locality regime {name!r}; expected one of {sorted(REGIMES)}")
    return REGIMES[name]


def reference_layers(leaders: Sequence[int], num_layers: int) -> list[int]:
    """The reference layer (of `REFERENCE_LAYERS`) each indexer layer of an `num_layers`-layer model
    stands for: layer `l` -> `round(l * 60 / (num_layers - 1))` (a 4-layer model: 0, 20, 40, 60)."""
    if num_layers <= 1:
        return [REFERENCE_LAYERS // 2 for _ in leaders]
    return [round(x * (REFERENCE_LAYERS - 1) / (num_layers - 1)) for x in leaders]


SPREAD = "spread"


def parse_reference_layers(name: str, spec: str | Sequence[int] | None, leaders: Sequence[int],
                           num_layers: int) -> list[int]:
    """The reference layers the index groups (leader layers `leaders` of a `num_layers`-layer
    model) stand for: `'spread'` (or None) is `reference_layers` (a 4-layer model: 0, 20, 40, 60);
    else one reference layer per group, strictly ascending, in `[0, REFERENCE_LAYERS)`, as ints or
    a comma list (`'20,21,22,23'`: a contiguous run of the plateau band, adjacent like a real
    model's layers). Bad input raises `ValueError` naming `name`, the value and what was expected."""
    if spec is None or (isinstance(spec, str) and spec.strip() == SPREAD):
        return reference_layers(leaders, num_layers)
    n = len(leaders)
    want = (f"expected '{SPREAD}' or {n} strictly ascending reference layers in [0, {REFERENCE_LAYERS}) "
            f"separated by commas, one per index group")
    if isinstance(spec, str):
        parts = [x.strip() for x in spec.split(",")]
        bad = [x for x in parts if not x.isdigit()]
        if bad:
            raise ValueError(f"{name}={spec!r}: {bad[0]!r} is not a layer; {want}")
        out = [int(x) for x in parts]
    else:
        try:
            spec = list(spec)
        except TypeError:
            raise ValueError(f"{name}={spec!r}: not a list of layers; {want}") from None
        if any(isinstance(x, bool) or not isinstance(x, int | np.integer) for x in spec):
            raise ValueError(f"{name}={spec!r}: not all ints; {want}")
        out = [int(x) for x in spec]
    if len(out) != n:
        raise ValueError(f"{name}={spec!r}: {len(out)} layers for {n} index groups; {want}")
    if any(b <= a for a, b in zip(out, out[1:], strict=False)) or out[0] < 0 or out[-1] >= REFERENCE_LAYERS:
        raise ValueError(f"{name}={spec!r}: not strictly ascending in [0, {REFERENCE_LAYERS}); {want}")
    return out


class LayeredIndexer:
    """Top-k positions of one request for each of its indexer layers, one decode step at a time.

    `layers`: the reference layer (of `REFERENCE_LAYERS`) each indexer layer stands for, ascending;
    its profile and its distance to the one before (the coupling) follow from it. Same interface
    as `indexer.SyntheticIndexer`: `step(seq_len)` -> int32 `[len(layers), top_k]`, distinct
    positions in `[0, seq_len)`, -1 padded only when the context is shorter than top-k.
    """

    def __init__(self, top_k: int, layers: Sequence[int], regime_: Regime, *, seed: int = 0,
                 request_id: int = 0) -> None:
        if top_k <= 0:
            raise ValueError(f"top_k must be > 0, got {top_k}")
        if not layers or any(b <= a for a, b in zip(layers, layers[1:], strict=False)) or layers[0] < 0:
            raise ValueError(f"layers must be ascending reference layers >= 0, got {list(layers)}")
        self.top_k = k = top_k
        self.layers = list(layers)
        self.num_groups = len(layers)
        self.regime = regime_
        c = regime_.content
        self.profiles = [regime_.profile(layer) for layer in self.layers]
        self.block = max(1, round(k / c.blocks_per_topk))
        self.num_blocks = max(1, math.ceil(c.pool_multiple * k / self.block))
        gaps = [1] + [b - a for a, b in zip(self.layers, self.layers[1:], strict=False)]
        self._score_keep = np.array([regime_.layer_coupling ** d for d in gaps])
        self._churn_keep = np.array([regime_.churn_coupling ** d for d in gaps])
        self._rng = np.random.default_rng([seed, request_id, 0x10CA1])
        L, B, T = self.num_groups, self.num_blocks, self.block
        self._start = np.full(B, -1, dtype=np.int64)       # block start positions (-1: not drawn yet)
        self._slow = np.zeros((L, B))
        self._offset = np.zeros((B, T))
        self._prev: list[np.ndarray] = [np.empty(0, dtype=np.int64) for _ in range(L)]
        self._last_seq_len = 0

    def rewind(self, seq_len: int) -> None:
        """The context went back to `seq_len` tokens (rolled-back speculative rows)."""
        if not 1 <= seq_len <= self._last_seq_len:
            raise ValueError(f"rewind to {seq_len} tokens; expected 1 <= seq_len <= {self._last_seq_len}")
        self._last_seq_len = seq_len

    def _draw_blocks(self, count: int, seq_len: int, taken: np.ndarray) -> np.ndarray:
        """`count` distinct aligned block starts in `[0, seq_len)` not in `taken`."""
        slots = max(1, seq_len // self.block)
        count = min(count, max(0, slots - taken.size))
        out = np.empty(0, dtype=np.int64)
        while out.size < count:
            cand = self._rng.integers(0, slots, size=2 * (count - out.size) + 8) * self.block
            cand = cand[~np.isin(cand, taken) & ~np.isin(cand, out)]
            _, first = np.unique(cand, return_index=True)
            out = np.concatenate([out, cand[np.sort(first)][:count - out.size]])
        return out

    def _evolve(self, seq_len: int) -> None:
        c, rng = self.regime.content, self._rng
        L, B, T = self.num_groups, self.num_blocks, self.block
        empty = self._start < 0
        if empty.all():
            starts = self._draw_blocks(B, seq_len, np.empty(0, dtype=np.int64))
            self._start[:starts.size] = starts
            self._slow[:, :starts.size] = rng.standard_normal((L, starts.size))
            self._offset[:starts.size] = rng.standard_normal((starts.size, T))
            return
        rho = c.persistence
        self._slow *= rho
        self._slow += math.sqrt(1.0 - rho * rho) * rng.standard_normal((L, B))
        refresh = np.flatnonzero(empty | (rng.random(B) < c.refresh))
        if refresh.size:
            keep = self._start[np.setdiff1d(np.arange(B), refresh)]
            starts = self._draw_blocks(refresh.size, seq_len, keep)
            refresh = refresh[:starts.size]
            self._start[refresh] = starts
            self._slow[:, refresh] = rng.standard_normal((L, refresh.size))
            self._offset[refresh] = rng.standard_normal((refresh.size, T))

    def step(self, seq_len: int) -> np.ndarray:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if seq_len < self._last_seq_len:
            raise ValueError(f"seq_len went back from {self._last_seq_len} to {seq_len}; contexts only grow")
        self._last_seq_len = seq_len
        k, L, rng = self.top_k, self.num_groups, self._rng
        out = np.full((L, k), -1, dtype=np.int32)
        if seq_len <= k:
            out[:, :seq_len] = np.arange(seq_len - 1, -1, -1, dtype=np.int32)
            return out
        self._evolve(seq_len)
        c = self.regime.content
        B, T = self.num_blocks, self.block
        pos = (self._start[:, None] + np.arange(T)[None, :]).reshape(-1)             # [B*T]
        drawn = np.repeat(self._start >= 0, T)     # a short history leaves some blocks undrawn
        static = c.block_spread * self._offset.reshape(-1)
        jitter = rng.standard_normal((L, B * T))
        drops = rng.random((L, B * T))
        fresh_stream = rng.integers(0, seq_len, size=2 * k + 64)
        score = prev_score = prev_drop = None
        for g, prof in enumerate(self.profiles):
            u = np.repeat(self._slow[g], T) + c.jitter * jitter[g]
            a = self._score_keep[g]
            score = u if prev_score is None else a * prev_score + math.sqrt(1.0 - a * a) * u
            prev_score = score
            q = self._churn_keep[g]
            drop = drops[g] if prev_drop is None else np.where(rng.random(B * T) < q, prev_drop, drops[g])
            prev_drop = drop
            sinks = min(math.ceil(prof.sink_fraction * k), k)
            recent = min(round(prof.recent_fraction * k), k - sinks)
            hist_end = seq_len - recent
            valid = drawn & (pos >= sinks) & (pos < hist_end)
            m = k - sinks - recent
            idx = np.flatnonzero(valid)
            picks = min(m, idx.size)
            total = score[idx] + static[idx]
            if picks < idx.size:
                idx = idx[np.argpartition(-total, picks - 1)[:picks]]
            else:
                idx = idx[:picks]
            n_drop = round(prof.churn * picks)
            if n_drop >= idx.size:
                idx = idx[:0]
            elif n_drop:  # keep all but the n_drop smallest draws (a set: ordered by score below)
                idx = idx[np.argpartition(drop[idx], n_drop)[n_drop:]]
            kept = pos[idx]
            kept = kept[np.argsort(-(score[idx] + static[idx]), kind="stable")]
            need = m - kept.size
            fresh = self._fresh(g, need, sinks, hist_end, kept, fresh_stream, prof.repel)
            row = np.concatenate([kept, fresh, np.arange(seq_len - 1, hist_end - 1, -1), np.arange(sinks)])
            out[g, :row.size] = row
            self._prev[g] = row
        return out

    def _fresh(self, g: int, need: int, lo: int, hi: int, taken: np.ndarray, stream: np.ndarray,
               repel: float) -> np.ndarray:
        """`need` distinct positions in `[lo, hi)` outside `taken`: the step's shared stream first
        (adjacent layers churn to the same places), then draws of the layer's own; a share `repel`
        of candidates that the layer picked last step are skipped."""
        if need <= 0:
            return np.empty(0, dtype=np.int64)
        rng = self._rng
        out = np.empty(0, dtype=np.int64)
        cand = stream
        for _ in range(64):
            cand = cand[(cand >= lo) & (cand < hi)]
            bad = np.isin(cand, taken) | np.isin(cand, out)
            if repel > 0.0:
                bad |= np.isin(cand, self._prev[g]) & (rng.random(cand.size) < repel)
            cand = cand[~bad]
            _, first = np.unique(cand, return_index=True)
            out = np.concatenate([out, cand[np.sort(first)][:need - out.size]])
            if out.size >= need:
                return out
            cand = rng.integers(lo, hi, size=2 * (need - out.size) + 16)
        raise ValueError(f"cannot draw {need} fresh positions from [{lo}, {hi}) outside {taken.size} taken")
