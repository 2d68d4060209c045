"""Fit the synthetic indexer's locality to target LRU miss rates.

`python -m hisparse_core.replay.calibrate` refits `DEFAULT_LOCALITY` against the published
GLM-5.1 / LongBenchV2 figures at top-k 2048 (30% miss with a hot buffer of 1x top-k, 13.4% at
2x, 6.7% at 4x) and prints the fitted parameters and the miss rates they measure.

The objective is deterministic (common random numbers: one seed for every evaluation); the
search is Nelder-Mead over (logit persistence, log jitter, logit refresh).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from hisparse_core.replay.indexer import DEFAULT_LOCALITY, LocalityParams, SyntheticIndexer
from hisparse_core.replay.lru_sim import lru_miss_rates

#: Published LRU miss rates at top-k 2048 (HiSparse paper, GLM-5.1 on LongBenchV2), keyed by
#: hot-buffer size as a multiple of top-k.
PUBLISHED_MISS_RATES: dict[int, float] = {1: 0.30, 2: 0.134, 4: 0.067}


def measure_miss_rates(params: LocalityParams, *, top_k: int = 2048, context: int = 32768,
                       multiples: Sequence[int] = (1, 2, 4), steps: int = 160, warmup: int = 32,
                       seed: int = 0) -> dict[int, float]:
    """LRU miss rate per hot-buffer multiple for one request decoding `steps` tokens after a
    prompt of `context` tokens (all top-k entries through the hot buffer)."""
    indexer = SyntheticIndexer(top_k, 1, params, seed=seed, request_id=0)
    seq = [indexer.step(context + t)[0] for t in range(steps)]
    rates = lru_miss_rates(seq, [m * top_k for m in multiples], warmup=warmup)
    return {m: rates.by_hot_rows[m * top_k] for m in multiples}


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _to_params(x: np.ndarray, base: LocalityParams) -> LocalityParams:
    return replace(base, persistence=min(_sigmoid(float(x[0])), 0.9999), jitter=math.exp(float(x[1])),
                   refresh=_sigmoid(float(x[2])))


def nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, *, step: float = 0.5, iters: int = 60,
                on_eval: Callable[[int, float], None] | None = None) -> tuple[np.ndarray, float]:
    """Minimise `f` from `x0` (standard reflection/expansion/contraction/shrink)."""
    n = x0.size
    simplex = [x0.astype(float)] + [x0 + step * np.eye(n)[i] for i in range(n)]
    values = [f(x) for x in simplex]
    evals = len(values)
    for _ in range(iters):
        order = np.argsort(values)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        centroid = np.mean(simplex[:-1], axis=0)
        xr = centroid + (centroid - simplex[-1])
        fr = f(xr)
        evals += 1
        if fr < values[0]:
            xe = centroid + 2.0 * (centroid - simplex[-1])
            fe = f(xe)
            evals += 1
            simplex[-1], values[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = xr, fr
        else:
            xc = centroid + 0.5 * (simplex[-1] - centroid)
            fc = f(xc)
            evals += 1
            if fc < values[-1]:
                simplex[-1], values[-1] = xc, fc
            else:
                simplex = [simplex[0]] + [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
                evals += n
        if on_eval is not None:
            on_eval(evals, min(values))
    best = int(np.argmin(values))
    return simplex[best], values[best]


@dataclass(frozen=True, slots=True)
class Calibration:
    params: LocalityParams
    measured: dict[int, float]
    targets: dict[int, float]
    error: float


def calibrate(targets: Mapping[int, float] = PUBLISHED_MISS_RATES, *, start: LocalityParams = DEFAULT_LOCALITY,
              top_k: int = 2048, context: int = 32768, steps: int = 160, warmup: int = 32, seed: int = 0,
              iters: int = 40, on_eval: Callable[[int, float], None] | None = None) -> Calibration:
    """Fit persistence, jitter and refresh so the LRU miss rates match `targets`
    (hot-buffer multiple -> miss rate); the error is the summed squared log ratio."""
    multiples = sorted(targets)

    def measure(p: LocalityParams) -> dict[int, float]:
        return measure_miss_rates(p, top_k=top_k, context=context, multiples=multiples, steps=steps,
                                  warmup=warmup, seed=seed)

    def objective(x: np.ndarray) -> float:
        got = measure(_to_params(x, start))
        return sum(math.log(max(got[m], 1e-6) / targets[m]) ** 2 for m in multiples)

    x0 = np.array([_logit(start.persistence), math.log(max(start.jitter, 1e-3)), _logit(max(start.refresh, 1e-4))])
    x, err = nelder_mead(objective, x0, iters=iters, on_eval=on_eval)
    params = _to_params(x, start)
    return Calibration(params, measure(params), dict(targets), err)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hisparse_core.replay.calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--top-k", type=int, default=2048)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--warmup", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iters", type=int, default=40)
    args = ap.parse_args(argv)
    from hisparse_core.progress import ProgressBar

    with ProgressBar(args.iters, "calibrate") as bar:
        cal = calibrate(top_k=args.top_k, context=args.context, steps=args.steps, warmup=args.warmup,
                        seed=args.seed, iters=args.iters,
                        on_eval=lambda n, best: bar.update(1, note=f"{n} evals, best err {best:.4f}"))
    p = cal.params
    print(f"LocalityParams(persistence={p.persistence:.4f}, jitter={p.jitter:.4f}, refresh={p.refresh:.5f}, "
          f"pool_multiple={p.pool_multiple}, recent_fraction={p.recent_fraction:g})")
    for m in sorted(cal.targets):
        print(f"  hot buffer {m}x top-k: miss {cal.measured[m]:.2%} (target {cal.targets[m]:.2%})")
    print(f"  error (sum of squared log ratios): {cal.error:.5f}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
