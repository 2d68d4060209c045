"""A stand-in for the DSA indexer: seeded top-k positions with tunable temporal locality.

Model (per request and index group). A *pool* of candidate positions, `pool_multiple * top_k`
of them, drawn from the request's history (everything but the recent window). Each candidate
carries a slow score, an AR(1) process with stationary variance 1 (`persistence` is its
per-step coefficient), and every step sees an independent jitter on top of it. The step's top-k
is the `recent_fraction * top_k` newest positions (local attention; 64 at top-k 2048) plus the
candidates with the highest slow+jitter scores. Each step every candidate is, with probability
`refresh`, replaced by a fresh random history position with a fresh score: the slow drift of
what the model attends to.

- Jitter makes positions near the selection threshold flicker in and out: a hot buffer of
  1x top-k misses them, 2x-4x catches them (the LRU gain).
- Persistence and refresh set how fast the working set itself moves: the misses no buffer size
  avoids.

`DEFAULT_LOCALITY` is fitted by `hisparse_core.replay.calibrate` so that a contract-exact LRU
lands near the published GLM-5.1 / LongBenchV2 miss rates at top-k 2048 (30% with a hot buffer
of 1x top-k, 13.4% at 2x, 6.7% at 4x). `LocalityParams.scaled(locality)` stretches time: 2.0
drifts half as fast (fewer misses), 0.5 twice as fast.

Each request draws from its own generator seeded by `(seed, request_id)`, so a request's top-k
sequence does not depend on which other requests share its batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True, slots=True)
class LocalityParams:
    """Knobs of the synthetic indexer (see the module docstring)."""

    persistence: float
    jitter: float
    refresh: float
    pool_multiple: float = 4.0
    recent_fraction: float = 1 / 32

    def __post_init__(self) -> None:
        if not 0.0 <= self.persistence < 1.0:
            raise ValueError(f"persistence must be in [0, 1), got {self.persistence}")
        if self.jitter < 0.0:
            raise ValueError(f"jitter must be >= 0, got {self.jitter}")
        if not 0.0 <= self.refresh <= 1.0:
            raise ValueError(f"refresh must be in [0, 1], got {self.refresh}")
        if self.pool_multiple < 1.0:
            raise ValueError(f"pool_multiple must be >= 1 (the pool must hold a top-k), got {self.pool_multiple}")
        if not 0.0 <= self.recent_fraction <= 1.0:
            raise ValueError(f"recent_fraction must be in [0, 1], got {self.recent_fraction}")

    def scaled(self, locality: float) -> LocalityParams:
        """The same process observed on a time axis stretched by `locality` (> 0).

        `locality` 1 is the identity; larger is more local (slower drift, smaller jitter),
        smaller is less local. As it goes to 0 every step's top-k becomes a fresh random draw.
        """
        if not locality > 0.0 or math.isinf(locality):
            raise ValueError(f"locality must be a finite number > 0, got {locality}")
        return replace(self, persistence=self.persistence ** (1.0 / locality),
                       refresh=1.0 - (1.0 - self.refresh) ** (1.0 / locality),
                       jitter=self.jitter / math.sqrt(locality))


#: Fitted by `python -m hisparse_core.replay.calibrate` (top-k 2048, context 32768, 160 steps of
#: which 32 warm-up, seed 0, 40 Nelder-Mead iterations from (0.9, 0.2, 0.02)). That fit measured
#: LRU miss rates of 30.05% / 13.37% / 6.69% with hot buffers of 1x / 2x / 4x top-k (targets 30%
#: / 13.4% / 6.7%); seeds 1 and 2 measure 30.3/13.4/6.7% and 30.0/13.2/6.6%.
DEFAULT_LOCALITY = LocalityParams(persistence=0.9033, jitter=0.2883, refresh=0.01636)


class SyntheticIndexer:
    """Top-k positions of one request, for each of its index groups, one decode step at a time."""

    def __init__(self, top_k: int, num_groups: int, params: LocalityParams = DEFAULT_LOCALITY, *,
                 seed: int = 0, request_id: int = 0) -> None:
        if top_k <= 0:
            raise ValueError(f"top_k must be > 0, got {top_k}")
        if num_groups <= 0:
            raise ValueError(f"num_groups must be > 0, got {num_groups}")
        self.top_k = top_k
        self.num_groups = num_groups
        self.params = params
        self.capacity = max(1, round(params.pool_multiple * top_k))
        self._rng = np.random.default_rng([seed, request_id, 0x1D5E])
        self._pos = np.zeros((num_groups, self.capacity), dtype=np.int64)
        self._slow = np.zeros((num_groups, self.capacity), dtype=np.float64)
        self._count = 0  # candidates in the pool (the same for every group)
        self._in_pool = np.zeros((num_groups, 0), dtype=bool)
        self._history = 0  # history length the pool has been grown to
        self._last_seq_len = 0

    def _ensure_in_pool_size(self, n: int) -> None:
        if self._in_pool.shape[1] < n:
            grown = np.zeros((self.num_groups, max(n, 2 * self._in_pool.shape[1])), dtype=bool)
            grown[:, :self._in_pool.shape[1]] = self._in_pool
            self._in_pool = grown

    def _grow(self, history: int) -> None:
        """Fill the pool from history: a random sample at first, then newly eligible positions."""
        target = min(self.capacity, history)
        if target <= self._count:
            self._history = max(self._history, history)
            return
        self._ensure_in_pool_size(history)
        rng, n = self._rng, self._count
        add = target - n
        for g in range(self.num_groups):
            if n == 0 and history > target:
                new = rng.choice(history, size=add, replace=False)
            else:  # the pool holds all of the old history: take the next positions in order
                new = np.arange(self._history, self._history + add)
            self._pos[g, n:target] = new
            self._in_pool[g, new] = True
        self._slow[:, n:target] = rng.standard_normal((self.num_groups, add))
        self._count = target
        self._history = history

    def _refresh(self, history: int) -> None:
        """Replace a Binomial(count, refresh) share of each group's candidates by fresh positions."""
        p, n, rng = self.params.refresh, self._count, self._rng
        if p <= 0.0 or history <= n:
            return
        self._ensure_in_pool_size(history)
        free_frac = (history - n) / history
        for g in range(self.num_groups):
            m = int(rng.binomial(n, p))
            if m == 0:
                continue
            idx = rng.choice(n, size=m, replace=False)
            draws = rng.integers(0, history, size=int(m / free_frac) + 16)
            fresh = draws[~self._in_pool[g, draws]]
            _, first = np.unique(fresh, return_index=True)
            fresh = fresh[np.sort(first)][:m]  # distinct, in draw order
            idx = idx[:fresh.size]  # a nearly full history may yield fewer: replace fewer
            self._in_pool[g, self._pos[g, idx]] = False
            self._pos[g, idx] = fresh
            self._in_pool[g, fresh] = True
            self._slow[g, idx] = rng.standard_normal(idx.size)

    def rewind(self, seq_len: int) -> None:
        """The context went back to `seq_len` tokens (rejected speculative rows were rolled back).
        Pooled positions past the new history stay in the pool (they come back as the context
        grows again); `step` leaves them out while they lie in the recent window or beyond."""
        if not 1 <= seq_len <= self._last_seq_len:
            raise ValueError(f"rewind to {seq_len} tokens; expected 1 <= seq_len <= {self._last_seq_len}")
        self._last_seq_len = seq_len

    def step(self, seq_len: int) -> np.ndarray:
        """Top-k of every index group for a context of `seq_len` tokens (the newest at
        `seq_len - 1`): int32 `[num_groups, top_k]`, distinct positions in `[0, seq_len)` ordered
        pool picks by score then the recent window newest first, -1 padded when the context is
        shorter than top-k."""
        if seq_len < self._last_seq_len:
            raise ValueError(f"seq_len went back from {self._last_seq_len} to {seq_len}; contexts only grow")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self._last_seq_len = seq_len
        k, rng, par = self.top_k, self._rng, self.params
        recent = min(round(par.recent_fraction * k), seq_len, k)
        history = seq_len - recent
        out = np.full((self.num_groups, k), -1, dtype=np.int32)
        if history > 0:
            if self._count:
                rho = par.persistence
                slow = self._slow[:, :self._count]
                slow *= rho
                slow += math.sqrt(1.0 - rho * rho) * rng.standard_normal(slow.shape)
            self._grow(history)
            if self._count == self.capacity:
                self._refresh(history)
            n = self._count
            picks = min(k - recent, n)
            score = self._slow[:, :n] + par.jitter * rng.standard_normal((self.num_groups, n))
            if picks < n:
                top = np.argpartition(-score, picks - 1, axis=1)[:, :picks]
            else:
                top = np.broadcast_to(np.arange(n), (self.num_groups, n))
            order = np.argsort(-np.take_along_axis(score, top, axis=1), axis=1, kind="stable")
            top = np.take_along_axis(top, order, axis=1)
            pool = np.take_along_axis(self._pos[:, :n], top, axis=1)
            # Only after a `rewind`: pooled positions at or past the history (the recent window's, or
            # rolled back) are left out, so positions stay distinct and inside the context.
            out[:, :picks] = np.where(pool < history, pool, -1)
        else:
            picks = 0
        out[:, picks:picks + recent] = np.arange(seq_len - 1, history - 1, -1, dtype=np.int32)
        return out
