"""Benchmarks only: each decode step's top-k from the replay's calibrated per-layer locality model.

Random weights make the model's indexer pick nearly fresh positions every step, which is neither
of the regimes real models show (`hisparse_core.replay.locality`: `benign`, GLM-5.1 LongBench v2;
`code`, DeepSeek-V3.2 SWE-bench). `enable(..., synthetic_topk="benign" | "code")` makes the engine
build a `ModelTopk`: the indexer still runs every step (its cost stays in the step) and attention
still reads exactly the rows the resolver returns, but in a decode step (one new token per row)
every index group's leader takes its top-k from the model instead of the indexer's output (the
group's followers take the leader's, as always). Prefill chunks keep the indexer's choice.

Each request of a session gets a `LayeredIndexer` (seeded by `seed` and the request's batch row);
index group `g`'s leader layer `l` of an `L`-layer model stands for reference layer
`round(l * 60 / (L - 1))` of the 61-layer profile (`reference="spread"`, the default: a 4-layer
model stands for 0, 20, 40, 60, whose neighbours are 20 layers apart), or for the reference layers
given, one per index group (`enable(..., synthetic_topk_layers="20,21,22,23")`: adjacent layers of
the plateau band, whose top-k overlap 87-90% as a real model's neighbours do). The positions of `lookahead` decode steps are made on the host at the first decode step
of a session (and again whenever they run out; `make_ahead` does it before a benchmark's timed
steps) and copied to the device once; each step then
copies its slice into one static buffer on the device (a device-to-device copy, no host work),
the buffer the attention layers read, so a captured decode graph replays with each step's picks.

`run_indexer = False` (benchmarks of the indexer's own cost) skips the indexer in those decode
steps: it neither scores nor stores the step's key, which nothing reads while the model chooses.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from hisparse_core.errors import InvalidInputError
from hisparse_core.replay.locality import REGIMES, LayeredIndexer, parse_reference_layers, regime

logger = logging.getLogger(__name__)


class ModelTopk:
    """The decode top-k of one engine's sessions from a locality regime (see the module docstring)."""

    def __init__(self, regime_name: str, *, top_k: int, leaders: Sequence[int], num_layers: int, max_batch: int,
                 device: torch.device, seed: int = 0, lookahead: int = 32,
                 reference: str | Sequence[int] | None = None) -> None:
        if regime_name not in REGIMES:
            raise InvalidInputError(f"synthetic_topk={regime_name!r}: expected one of {sorted(REGIMES)} (or None: the "
                                    "model's own indexer)")
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead <= 0:
            raise InvalidInputError(f"synthetic_topk lookahead must be a positive int, got {lookahead!r}")
        self.name = regime_name
        self.regime = regime(regime_name)
        self.top_k = top_k
        try:
            self.layers = parse_reference_layers("synthetic_topk_layers", reference, leaders, num_layers)
        except ValueError as exc:
            raise InvalidInputError(str(exc)) from None
        self.seed = seed
        self.lookahead = lookahead
        self.device = device
        G = len(self.layers)
        #: what the leaders read in a decode step: [G, max_batch, 1, top_k] padded positions (-1: none)
        self.buffer = torch.full((G, max_batch, 1, top_k), -1, dtype=torch.int64, device=device)
        self._ahead: torch.Tensor | None = None       # [n, G, B, 1, top_k] the next n steps, on the device
        self._start = 0                               # padded length of the first step made ahead
        self._indexers: list[LayeredIndexer] = []
        self._session: object | None = None
        self.steps = 0
        #: False: decode steps skip the indexer (its keys of those steps are not written): the
        #: difference in step time is the indexer's cost (bench_serving.py --skip-indexer)
        self.run_indexer = True
        self._step: object | None = None              # the StepState `fill` last ran for
        logger.info("hisparse: decode top-k from the %s locality model (benchmarks only; the indexer still runs), "
                    "index-group leaders standing for reference layers %s", regime_name, self.layers)

    def _prepare(self, pads: Sequence[int], past: int) -> None:
        """Make the next `lookahead` steps' top-k for every row, from padded length `past`."""
        B, G, k, n = len(pads), len(self.layers), self.top_k, self.lookahead
        host = np.full((n, G, B, 1, k), -1, dtype=np.int64)
        for b, pad in enumerate(pads):
            ix = self._indexers[b]
            for t in range(n):
                length = past + t + 1 - pad                     # logical context, the new token included
                if length >= 1:
                    picks = ix.step(length).astype(np.int64)
                    host[t, :, b, 0] = np.where(picks >= 0, picks + pad, -1)
        self._ahead = torch.from_numpy(host).to(self.device)
        self._start = past

    def make_ahead(self, session: object, pads: Sequence[int], past: int) -> None:
        """Make the top-k of the session's next `lookahead` decode steps, the first at padded length
        `past` (`fill` calls it when it runs out; a benchmark calls it before timing, so no timed
        step pays the host work)."""
        if session is not self._session:
            self._session = session
            self._indexers = [LayeredIndexer(self.top_k, self.layers, self.regime, seed=self.seed, request_id=b)
                              for b in range(len(pads))]
            self._ahead = None
        if self._ahead is not None and past < self._start:
            raise InvalidInputError(f"synthetic_topk: a decode step at padded length {past}, before the steps "
                                    f"made ahead from {self._start} (contexts only grow in a session)")
        self._prepare(pads, past)

    def fill(self, session: object, step: object, pads: Sequence[int], past: int) -> None:
        """Before a decode forward of a session at padded length `past`: this step's top-k into
        `buffer` (made ahead; the host works only when the steps made ahead ran out)."""
        t = past - self._start
        if session is not self._session or self._ahead is None or not 0 <= t < self._ahead.shape[0]:
            self.make_ahead(session, pads, past)
            t = 0
        assert self._ahead is not None
        self.buffer[:, :len(pads)].copy_(self._ahead[t], non_blocking=True)
        self.steps += 1
        self._step = step

    def filled(self, step: object) -> bool:
        """Whether `fill` ran for this step (a decode step: every prompt in the cache, one new token)."""
        return step is self._step

    def take(self, group: int, batch: int) -> torch.Tensor:
        """Leader of `group`'s top-k `[batch, 1, top_k]` for this decode step (a view: static address)."""
        return self.buffer[group, :batch]
