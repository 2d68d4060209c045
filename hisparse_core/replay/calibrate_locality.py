"""Fit and check the per-layer locality model (`hisparse_core.replay.locality`).

`python -m hisparse_core.replay.calibrate_locality --fit` refits the benign content process
(persistence, jitter, refresh, block spread) to the published GLM-5.1 / LongBench v2 figures
(`BENIGN_TARGETS`); without `--fit` it measures the shipped model: the benign figures, the code
regime's consecutive overlap per layer band, adjacent-layer overlap, and the content process's own
overlap (`CONTENT_OVERLAP`). `--top-k 2048` measures at the published scale (Scale in the
locality module: the tests run at 256).

The objective is deterministic (common random numbers: the same seeds for every evaluation);
the search is Nelder-Mead (`calibrate.nelder_mead`) over (logit persistence, log jitter, logit
refresh, log spread).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from hisparse_core.replay.calibrate import nelder_mead
from hisparse_core.replay.locality import (
    REGIMES,
    ContentProcess,
    LayeredIndexer,
    Regime,
    code_overlap_target,
    regime,
)
from hisparse_core.replay.policies import miss_counts

#: Published GLM-5.1 / LongBench v2 miss rates at top-k 2048 (the HiSparse paper):
#: (policy, buffer as a multiple of top-k) -> miss rate.
BENIGN_TARGETS: dict[tuple[str, int], float] = {
    ("lru", 1): 0.30, ("lru", 2): 0.134, ("fifo", 2): 0.172, ("random", 2): 0.161, ("belady", 2): 0.082,
    ("lru", 4): 0.067,
}
#: GVR (DeepSeek-V3.2, SWE-bench, 68,665-token prompt): consecutive overlap by layer band.
CODE_BANDS: dict[str, tuple[range, float]] = {"layers 0-1": (range(0, 2), 0.015),
                                              "layers 20-60": (range(20, 61), 0.44)}
#: Context as a multiple of top-k: 16 (32K at 2048) for the benign fit, 68665 / 2048 for GVR's prompt.
BENIGN_CONTEXT_MULTIPLE = 16.0
CODE_CONTEXT_MULTIPLE = 68665 / 2048
#: Steps that fill a buffer before its misses count.
WARMUP = 40


@dataclass(frozen=True, slots=True)
class Trace:
    """The top-k sequences of a few requests, per indexer layer: `steps[request][layer]` is a
    list of 1-D arrays, one per step."""

    layers: list[int]
    steps: list[list[list[np.ndarray]]]
    top_k: int


def trace(reg: Regime, layers: Sequence[int], *, top_k: int, context_multiple: float, steps: int,
          requests: int = 1, seed: int = 0) -> Trace:
    context = round(context_multiple * top_k)
    out = []
    for r in range(requests):
        ix = LayeredIndexer(top_k, layers, reg, seed=seed, request_id=r)
        seq = [ix.step(context + t) for t in range(steps)]
        out.append([[s[g] for s in seq] for g in range(len(layers))])
    return Trace(list(layers), out, top_k)


def policy_miss(tr: Trace, policy: str, multiple: float, *, layers: Sequence[int] | None = None,
                warmup: int = WARMUP) -> float:
    """Misses per lookup of `policy` with a buffer of `multiple` x top-k, pooled over the trace's
    requests and the given indexer layers (positions in `tr.layers`; default all)."""
    miss = looked = 0
    for req in tr.steps:
        for g in (range(len(tr.layers)) if layers is None else layers):
            m, n = miss_counts(req[g], policy, round(multiple * tr.top_k), warmup=warmup)
            miss += m
            looked += n
    return miss / looked


def consecutive_overlap(tr: Trace, g: int) -> float:
    """Mean share of a step's top-k that the step before also picked, layer `g`, all requests."""
    k = tr.top_k
    vals = [np.intersect1d(req[g][t], req[g][t - 1]).size / k for req in tr.steps for t in range(1, len(req[g]))]
    return float(np.mean(vals))


def adjacent_overlap(tr: Trace, g: int) -> float:
    """Mean share of layer `g`'s top-k that layer `g - 1` picks at the same step."""
    k = tr.top_k
    return float(np.mean([np.intersect1d(req[g][t], req[g - 1][t]).size / k for req in tr.steps
                          for t in range(len(req[g]))]))


def benign_figures(reg: Regime, *, top_k: int = 256, steps: int = 200, requests: int = 3, seed: int = 0,
                   warmup: int = WARMUP) -> dict[tuple[str, int], float]:
    tr = trace(reg, [30], top_k=top_k, context_multiple=BENIGN_CONTEXT_MULTIPLE, steps=steps,
               requests=requests, seed=seed)
    return {key: policy_miss(tr, key[0], key[1], warmup=warmup) for key in BENIGN_TARGETS}


def code_figures(*, top_k: int = 256, steps: int = 60, requests: int = 2, seed: int = 0) -> dict[str, float]:
    """Mean consecutive overlap per GVR band, over the band's every layer (one 61-layer trace)."""
    tr = trace(regime("code"), list(range(61)), top_k=top_k, context_multiple=CODE_CONTEXT_MULTIPLE, steps=steps,
               requests=requests, seed=seed)
    return {band: float(np.mean([consecutive_overlap(tr, g) for g in layers]))
            for band, (layers, _) in CODE_BANDS.items()}


def fit_benign(start: ContentProcess, *, top_k: int, steps: int, requests: int, iters: int) -> ContentProcess:
    base = REGIMES["benign"]

    def params(x: np.ndarray) -> ContentProcess:
        return replace(start, persistence=min(1.0 / (1.0 + math.exp(-float(x[0]))), 0.9999),
                       jitter=math.exp(float(x[1])), refresh=1.0 / (1.0 + math.exp(-float(x[2]))),
                       block_spread=math.exp(float(x[3])))

    def objective(x: np.ndarray) -> float:
        got = benign_figures(replace(base, content=params(x)), top_k=top_k, steps=steps, requests=requests)
        return sum(((got[key] - t) / 0.01) ** 2 for key, t in BENIGN_TARGETS.items())

    def logit(p: float) -> float:
        return math.log(p / (1.0 - p))

    x0 = np.array([logit(start.persistence), math.log(start.jitter), logit(start.refresh),
                   math.log(max(start.block_spread, 1e-3))])
    x, err = nelder_mead(objective, x0, step=0.3, iters=iters,
                         on_eval=lambda n, best: print(f"  {n} evals, best {best:.3f}", file=sys.stderr))
    return params(x)


def main(argv: Sequence[str] | None = None) -> int:
    from hisparse_core.cli.options import MAX_REQUESTS, MAX_STEPS, MAX_TOP_K, CliParser, HelpFormatter, int_in

    ap = CliParser(prog="python -m hisparse_core.replay.calibrate_locality", description=__doc__,
                   formatter_class=HelpFormatter)
    ap.add_argument("--fit", action="store_true", help="refit the benign content process first")
    # 2 at least: at top-k 1 the sink takes the whole top-k, leaving the content process nothing.
    ap.add_argument("--top-k", type=int_in(2, MAX_TOP_K), default=256, help="positions per step (default: 256)")
    ap.add_argument("--steps", type=int_in(WARMUP + 1, MAX_STEPS, f"a step count past the {WARMUP} warm-up steps"),
                    default=200, help=f"steps per request of the benign figures, the first {WARMUP} uncounted "
                                      "(default: 200)")
    ap.add_argument("--requests", type=int_in(1, MAX_REQUESTS), default=3,
                    help="requests of the benign figures (default: 3)")
    ap.add_argument("--iters", type=int_in(1, 100_000), default=None,
                    help="Nelder-Mead iterations of --fit (default: 40)")
    args = ap.parse_args(argv)
    if args.iters is not None and not args.fit:
        ap.error("argument --iters: not allowed without --fit: only the fit iterates; expected --fit, or no --iters")
    args.iters = 40 if args.iters is None else args.iters
    reg = REGIMES["benign"]
    if args.fit:
        content = fit_benign(reg.content, top_k=args.top_k, steps=args.steps, requests=args.requests,
                             iters=args.iters)
        reg = replace(reg, content=content)
        print(f"fitted {content}")
    got = benign_figures(reg, top_k=args.top_k, steps=args.steps, requests=args.requests)
    print(f"benign, top-k {args.top_k}, context {BENIGN_CONTEXT_MULTIPLE:g} x top-k, {args.requests} requests x "
          f"{args.steps} steps:")
    for (policy, mult), target in BENIGN_TARGETS.items():
        print(f"  {policy:>6} at {mult}x top-k: miss {got[(policy, mult)]:.2%} (published {target:.1%})")
    tr = trace(reg, [30], top_k=args.top_k, context_multiple=BENIGN_CONTEXT_MULTIPLE, steps=60)
    ov = consecutive_overlap(tr, 0)
    prof = reg.profile(30)
    k = args.top_k
    s, w = math.ceil(prof.sink_fraction * k), round(prof.recent_fraction * k)
    print(f"  consecutive overlap {ov:.2%}; the content process's own: {(ov * k - s - (w - 1)) / (k - s - w):.4f}")
    if not args.fit:
        code = code_figures(top_k=args.top_k)
        print(f"code, top-k {args.top_k}, context {CODE_CONTEXT_MULTIPLE:.2f} x top-k, 61 layers:")
        for band, (_, target) in CODE_BANDS.items():
            print(f"  {band}: consecutive overlap {code[band]:.2%} (published {target:.1%})")
        tr = trace(regime("code"), list(range(61)), top_k=args.top_k, context_multiple=CODE_CONTEXT_MULTIPLE,
                   steps=20)
        adj = [adjacent_overlap(tr, g) for g in range(21, 61)]
        print(f"  adjacent-layer overlap, layers 20-60: {min(adj):.0%}-{max(adj):.0%} (IndexCache: 70-100%); "
              f"per-layer targets {min(code_overlap_target(x) for x in range(20, 61)):.0%}-"
              f"{max(code_overlap_target(x) for x in range(20, 61)):.0%}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    from hisparse_core.cli.options import run_script

    sys.exit(run_script(main))
