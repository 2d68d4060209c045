"""Count-only models of one state row's hot buffer under different replacement policies.

Every policy sees the same access stream as `lru_sim.LruHotBuffer` (one step's distinct keys,
negative keys masked, every key through the buffer) and obeys the same rule the resolver contract
sets for a step: a key looked up this step is never evicted by a miss of the same step, so a
step's misses can only take slots of keys the step does not read. They differ in which of those
slots go first:

- `lru`: the contract's LRU (`lru_sim.LruHotBuffer`, what every backend implements today);
- `fifo`: the oldest insertion, hits do not refresh;
- `random`: a uniformly random evictable slot (seeded);
- `clock`: second chance; a hit sets the slot's reference bit, the hand clears set bits and
  evicts the first clear one; a slot is inserted with its bit clear, so a key must be re-read to
  survive one sweep (a miss that is never read again is the first to go);
- `lfu`: frequency-aware, the slot with the fewest reads, exponentially decayed by `decay` per
  step (ties: least recently used);
- `belady`: the offline optimum for this access rule: the evictable key read again furthest in
  the future (or never). It needs the whole future, so it is a bound, not a policy to ship.

`miss_rates(steps, policies, hot_rows)` measures them on one top-k sequence.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

from hisparse_core.replay.lru_sim import LruHotBuffer

POLICIES = ("lru", "fifo", "random", "clock", "lfu", "belady")


class HotBufferModel(Protocol):
    """One state row's buffer: `access` looks up one step's keys and returns `(hits, misses)`."""

    def access(self, keys: Iterable[int]) -> tuple[int, int]: ...


def _unique(keys: Iterable[int]) -> list[int]:
    return list(dict.fromkeys(int(k) for k in keys if k >= 0))


class FifoHotBuffer:
    def __init__(self, hot_rows: int) -> None:
        self.hot_rows = hot_rows
        self._order: OrderedDict[int, None] = OrderedDict()

    def access(self, keys: Iterable[int]) -> tuple[int, int]:
        unique = _unique(keys)
        order = self._order
        hit_set = {k for k in unique if k in order}
        misses = [k for k in unique if k not in hit_set]
        overflow = len(order) + len(misses) - self.hot_rows
        if overflow > 0:
            victims = [k for k in order if k not in hit_set][:overflow]
            for k in victims:
                del order[k]
        for k in misses:
            order[k] = None
        return len(hit_set), len(misses)


class RandomHotBuffer:
    def __init__(self, hot_rows: int, seed: int = 0) -> None:
        self.hot_rows = hot_rows
        self._keys: list[int] = []
        self._where: dict[int, int] = {}
        self._rng = np.random.default_rng([seed, 0x7A11D])

    def access(self, keys: Iterable[int]) -> tuple[int, int]:
        unique = _unique(keys)
        hit_set = {k for k in unique if k in self._where}
        misses = [k for k in unique if k not in hit_set]
        overflow = len(self._keys) + len(misses) - self.hot_rows
        if overflow > 0:
            evictable = [k for k in self._keys if k not in hit_set]
            for i in sorted(self._rng.choice(len(evictable), size=overflow, replace=False).tolist(), reverse=True):
                self._drop(evictable[i])
        for k in misses:
            self._where[k] = len(self._keys)
            self._keys.append(k)
        return len(hit_set), len(misses)

    def _drop(self, key: int) -> None:
        i = self._where.pop(key)
        last = self._keys.pop()
        if last != key:
            self._keys[i] = last
            self._where[last] = i


class ClockHotBuffer:
    def __init__(self, hot_rows: int) -> None:
        self.hot_rows = hot_rows
        self._slot_key = [-1] * hot_rows
        self._ref = [False] * hot_rows
        self._where: dict[int, int] = {}
        self._hand = 0

    def access(self, keys: Iterable[int]) -> tuple[int, int]:
        unique = _unique(keys)
        where = self._where
        hit_set = {k for k in unique if k in where}
        misses = [k for k in unique if k not in hit_set]
        free = [s for s in range(self.hot_rows) if self._slot_key[s] < 0] if len(where) < self.hot_rows else []
        need = len(misses) - len(free)
        victims: list[int] = []
        n = self.hot_rows
        while len(victims) < need:
            s = self._hand
            self._hand = (s + 1) % n
            key = self._slot_key[s]
            if key < 0 or key in hit_set or s in victims:
                continue
            if self._ref[s]:
                self._ref[s] = False
                continue
            victims.append(s)
        slots = free[:len(misses)] + victims
        for s in victims:
            del where[self._slot_key[s]]
        for key, s in zip(misses, slots, strict=True):
            self._slot_key[s] = key
            self._ref[s] = False
            where[key] = s
        for key in hit_set:
            self._ref[where[key]] = True
        return len(hit_set), len(misses)


class LfuHotBuffer:
    def __init__(self, hot_rows: int, decay: float = 0.9) -> None:
        self.hot_rows = hot_rows
        self.decay = decay
        self._score: dict[int, float] = {}   # reads, decayed, in units of the current step's weight
        self._last: dict[int, int] = {}
        self._t = 0
        self._weight = 1.0                   # 1 / decay**t: reads are added at growing weight (no rescale pass)

    def access(self, keys: Iterable[int]) -> tuple[int, int]:
        unique = _unique(keys)
        score, last = self._score, self._last
        hit_set = {k for k in unique if k in score}
        misses = [k for k in unique if k not in hit_set]
        overflow = len(score) + len(misses) - self.hot_rows
        if overflow > 0:
            victims = heapq.nsmallest(overflow, (k for k in score if k not in hit_set),
                                      key=lambda k: (score[k], last[k]))
            for k in victims:
                del score[k], last[k]
        w = self._weight
        for k in unique:
            score[k] = score.get(k, 0.0) + w
            last[k] = self._t
        self._t += 1
        self._weight = w / self.decay
        if self._weight > 1e200:  # renormalise before overflow
            for k in score:
                score[k] /= self._weight
            self._weight = 1.0
        return len(hit_set), len(misses)


class BeladyHotBuffer:
    """Needs the future: build with the whole sequence, then call `access` with each step in order."""

    def __init__(self, hot_rows: int, steps: Sequence[np.ndarray]) -> None:
        self.hot_rows = hot_rows
        self._steps = [_unique(s.tolist()) for s in steps]
        self._next: list[dict[int, int]] = [{} for _ in self._steps]
        upcoming: dict[int, int] = {}
        never = len(self._steps) + 1
        for t in range(len(self._steps) - 1, -1, -1):
            self._next[t] = {k: upcoming.get(k, never) for k in self._steps[t]}
            for k in self._steps[t]:
                upcoming[k] = t
        self._t = 0
        self._held: dict[int, int] = {}   # key -> its next read

    def access(self, keys: Iterable[int]) -> tuple[int, int]:
        del keys  # the sequence given at construction
        t = self._t
        unique, nxt = self._steps[t], self._next[t]
        held = self._held
        hit_set = {k for k in unique if k in held}
        misses = [k for k in unique if k not in hit_set]
        overflow = len(held) + len(misses) - self.hot_rows
        if overflow > 0:
            cand = [k for k in held if k not in hit_set]
            far = np.fromiter((held[k] for k in cand), dtype=np.int64, count=len(cand))
            for i in np.argpartition(-far, overflow - 1)[:overflow].tolist():
                del held[cand[i]]
        for k in unique:
            held[k] = nxt[k]
        self._t += 1
        return len(hit_set), len(misses)


def make_buffer(policy: str, hot_rows: int, steps: Sequence[np.ndarray], *, seed: int = 0) -> HotBufferModel:
    """A fresh buffer of `policy` (one of `POLICIES`)."""
    if policy == "lru":
        return LruHotBuffer(hot_rows)
    if policy == "fifo":
        return FifoHotBuffer(hot_rows)
    if policy == "random":
        return RandomHotBuffer(hot_rows, seed)
    if policy == "clock":
        return ClockHotBuffer(hot_rows)
    if policy == "lfu":
        return LfuHotBuffer(hot_rows)
    if policy == "belady":
        return BeladyHotBuffer(hot_rows, steps)
    raise ValueError(f"unknown replacement policy {policy!r}; expected one of {list(POLICIES)}")


def miss_counts(steps: Sequence[np.ndarray], policy: str, hot_rows: int, *, warmup: int = 0,
                seed: int = 0) -> tuple[int, int]:
    """(misses, lookups) of `policy` with `hot_rows` slots over one row's top-k sequence, the
    first `warmup` steps filling the buffer uncounted."""
    if warmup >= len(steps):
        raise ValueError(f"warmup={warmup} leaves none of the {len(steps)} steps to measure")
    buf = make_buffer(policy, hot_rows, steps, seed=seed)
    looked = missed = 0
    for t, keys in enumerate(steps):
        hits, misses = buf.access(keys)
        if t >= warmup:
            looked += hits + misses
            missed += misses
    return missed, looked


def miss_rates(steps: Sequence[np.ndarray], policies: Sequence[str], hot_rows: int, *, warmup: int = 0,
               seed: int = 0) -> dict[str, float]:
    """Miss rate per policy (misses per looked-up entry) over one row's top-k sequence."""
    out = {}
    for p in policies:
        m, n = miss_counts(steps, p, hot_rows, warmup=warmup, seed=seed)
        out[p] = m / n if n else 0.0
    return out
