"""Replacement policies and per-layer residency under the calibrated per-layer locality model.

For each regime (`benign`: GLM-5.1 LongBench v2; `code`: DeepSeek-V3.2 SWE-bench, GVR) this
replays the top-k sequences of `hisparse_core.replay.locality.LayeredIndexer` through a hot
buffer of each policy of `hisparse_core.replay.policies` (LRU, the contract's; FIFO; random;
CLOCK; decayed-frequency LFU; Belady's offline bound) and prints the miss rate per layer band,
each also as a ratio to LRU's in the same run. Then per-layer residency: the misses per step of
a 61-layer model with LRU everywhere, and with the worst layers kept fully resident (by
configuration: layers 0-1; by policy: `hisparse_core.residency.choose_resident_layers` on the
measured hit rates), with the share of the KV that stays on the GPU.

CPU only, seeded; the default top-k 256 is the published process at reduced scale (the
locality module's docstring, Scale); `--top-k 2048` is the published scale (minutes).

Last, the replay engine itself (`--no-replay` to skip): the code regime on 4 layers, none resident
against layer 0 resident at the same hisparse pool; misses and H2D bytes per step, step time.

Run:  python bench/bench_locality.py [--top-k 256] [--steps 160] [--hot 2] [--requests 2]
      python bench/bench_locality.py --no-policies --backend nvidia --top-k 2048   (the replay on a GPU)
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from hisparse_core.replay.calibrate_locality import (
    BENIGN_CONTEXT_MULTIPLE,
    CODE_CONTEXT_MULTIPLE,
    Trace,
    policy_miss,
    trace,
)
from hisparse_core.replay.locality import regime
from hisparse_core.replay.policies import POLICIES
from hisparse_core.residency import choose_resident_layers

BANDS = {"benign": {"all layers": [0, 20, 40, 60]},
         "code": {"layers 0-1": [0, 1], "layers 2-19": [2, 8, 14], "layers 20-60": [20, 30, 40, 50, 60]}}


def band_rows(tr: Trace, bands: dict[str, list[int]], hot: float, warmup: int) -> list[str]:
    out = []
    for band, layers in bands.items():
        g = [tr.layers.index(x) for x in layers]
        rates = {p: policy_miss(tr, p, hot, layers=g, warmup=warmup) for p in POLICIES}
        lru = rates["lru"]
        cells = " ".join(f"{rates[p]:7.2%} ({rates[p] / lru:4.2f}x)" if lru else f"{rates[p]:7.2%}" for p in POLICIES)
        out.append(f"  {band:<13} {cells}")
    return out


def main(argv: list[str] | None = None) -> int:
    from hisparse_core.cli.options import (
        MAX_HOT,
        MAX_REQUESTS,
        MAX_SEED,
        MAX_STEPS,
        MAX_TOP_K,
        CliParser,
        check_backend_name,
        float_in,
        int_in,
    )

    ap = CliParser(prog="bench_locality", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--top-k", type=int_in(1, MAX_TOP_K), default=256)
    ap.add_argument("--steps", type=int_in(1, MAX_STEPS), default=160)
    ap.add_argument("--warmup", type=int_in(0, MAX_STEPS - 1), default=40)
    ap.add_argument("--hot", type=float_in(1.0, MAX_HOT, what="a multiple of top-k"), default=2.0,
                    help="hot buffer as a multiple of top-k")
    ap.add_argument("--requests", type=int_in(1, MAX_REQUESTS), default=2)
    ap.add_argument("--resident-budget", type=int_in(0, 61), default=2,
                    help="layers the residency policy may keep resident")
    ap.add_argument("--seed", type=int_in(0, MAX_SEED), default=0)
    ap.add_argument("--policies", action=argparse.BooleanOptionalAction, default=True,
                    help="measure the replacement policies and the residency model (CPU; --no-policies: the replay "
                         "engine only)")
    ap.add_argument("--replay", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the replay engine with and without a resident layer")
    ap.add_argument("--backend", default="reference_cpu", help="the replay engine's backend")
    args = ap.parse_args(argv)
    if args.steps <= args.warmup:
        ap.error(f"argument --steps: expected an integer in [--warmup + 1 = {args.warmup + 1}, {MAX_STEPS}], "
                 f"got {args.steps}")
    if not args.policies and not args.replay:
        ap.error("argument --no-replay: not allowed with --no-policies: nothing would be measured; expected one of "
                 "the two at most")
    if args.replay and (why := check_backend_name(args.backend) or replay_problem(args)):
        ap.exit(2, f"bench_locality: error: {why}\n")
    t0 = time.perf_counter()
    if args.policies:
        policies_and_residency(args)
    if args.replay:
        replay_residency(args)
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


def policies_and_residency(args: argparse.Namespace) -> None:
    header = "  " + " " * 13 + " ".join(f"{p:>16}" for p in POLICIES)
    print(f"miss rate per lookup (ratio to LRU), hot buffer {args.hot:g}x top-k {args.top_k}, "
          f"{args.requests} requests x {args.steps - args.warmup} measured steps")
    traces = {}
    for name, ctx in (("benign", BENIGN_CONTEXT_MULTIPLE), ("code", CODE_CONTEXT_MULTIPLE)):
        layers = sorted({x for band in BANDS[name].values() for x in band})
        if name == "code":
            layers = list(range(61))
        tr = traces[name] = trace(regime(name), layers, top_k=args.top_k, context_multiple=ctx, steps=args.steps,
                                  requests=args.requests, seed=args.seed)
        print(f"{name} (context {ctx:.1f} x top-k)")
        print(header)
        for line in band_rows(tr, BANDS[name], args.hot, args.warmup):
            print(line)

    # Per-layer residency, code regime, all 61 layers, LRU.
    tr = traces["code"]
    per_layer = [policy_miss(tr, "lru", args.hot, layers=[g], warmup=args.warmup) for g in range(61)]
    k = args.top_k
    total = sum(per_layer) * k
    chosen = choose_resident_layers([1.0 - m for m in per_layer], budget=args.resident_budget)
    print(f"per-layer residency, code regime, 61 layers, LRU {args.hot:g}x: misses per step per request "
          f"(top-k {k}; scale by 2048/{k} for the published top-k)")
    print(f"  none resident:            {total:9.1f} misses/step  (1.00x), 0.0% of the KV on the GPU")
    for label, layers in (("layers 0-1 (config)", [0, 1]), (f"policy, budget {args.resident_budget}", chosen)):
        rest = sum(m for g, m in enumerate(per_layer) if g not in layers) * k
        print(f"  {label:<24}  {rest:9.1f} misses/step  ({rest / total:.2f}x), {len(layers) / 61:.1%} of the KV on "
              f"the GPU (layers {sorted(layers)})")


def replay_configs(args: argparse.Namespace) -> list[Any]:
    """The replay's two runs (`RunConfig`s): none resident, then layer 0 resident with the same
    hisparse pool (the 3 other layers' blocks) plus its own pages. Raises `HiSparseError`."""
    from hisparse_core.replay.engine import RunConfig

    k = args.top_k
    base = dict(requests=args.requests * 2, context=32 * k, decode_tokens=24, steps=60, top_k=k, block_size=16,
                layers=4, index_share=1, host_bytes=1 << 30, arrival_every=0, prefix_groups=0, topk_model="code",
                concurrency=args.requests * 2,
                seed=args.seed)
    probe = RunConfig(**base)  # type: ignore[arg-type]
    # a pool holding the pages of half the requests and a fifth: the next admission makes the coordinator
    # release pages, which are then read through the hot buffer
    pages = -(-probe.max_tokens // 16)
    per_request = pages * 4 * 16 * probe.fmt.row_bytes
    pool = max(per_request * (probe.requests // 2) + per_request // 5, per_request * 3 // 2)
    # every request at once holds all its pages (and the active tail) in the host pool: 1 GiB held them
    # only up to a point (--requests 200 at --top-k 512 failed mid-run, `host pool has 25574 ... blocks`)
    base["host_bytes"] = max(1 << 30, (probe.requests * (pages + probe.tail_pages) + 1) * per_request // pages)
    res = RunConfig(**{**base, "resident_layers": (0,)}).resident_kv_bytes  # type: ignore[arg-type]
    return [RunConfig(**{**base, "resident_layers": layers, "gpu_kv_bytes": budget})  # type: ignore[arg-type]
            for layers, budget in (((), pool), ((0,), pool * 3 // 4 + res))]


class _Checked(Exception):
    """Raised by `replay_problem` once a replay's budgets have passed the engine's checks."""


def replay_problem(args: argparse.Namespace) -> str | None:
    """Why the replay cannot run here (its budgets follow from --requests and --top-k), in this
    script's flags, or None; checked before the policy tables, with nothing allocated (the engine's
    own checks, stopped where they pass). The engine's refusals, which name `hisparse run`'s flags,
    were a traceback after the policy tables."""
    from hisparse_core.errors import HiSparseError
    from hisparse_core.registry import select_backend
    from hisparse_core.replay.engine import ReplayEngine

    def passed() -> None:
        raise _Checked

    try:
        configs = replay_configs(args)
        backend = select_backend(args.backend)
        for config in configs:
            try:
                ReplayEngine(config, backend, on_checked=passed)
            except _Checked:
                pass
    except HiSparseError as exc:
        return (f"--requests {args.requests} and --top-k {args.top_k} make a replay of {2 * args.requests} requests "
                f"of {32 * args.top_k}+24 tokens that cannot run here ({exc}); expected a smaller --requests or "
                "--top-k, or --no-replay")
    return None


def replay_residency(args: argparse.Namespace) -> None:
    """The replay engine (the real coordinator, worker and backend, every entry checked against the
    all-resident copy off) under the code regime, 4 layers standing for reference layers 0, 20, 40,
    60: none resident, then layer 0 resident with the same hisparse pool (the 3 other layers'
    blocks) plus its own pages. Misses and host-to-device bytes per decode step, step time (host
    Python, mostly), and the decode step's time on the device."""
    from hisparse_core.registry import select_backend
    from hisparse_core.replay.run import run_replay

    k = args.top_k
    configs = replay_configs(args)
    backend = select_backend(args.backend)
    print(f"replay engine ({backend.name}), code regime, 4 layers (reference 0/20/40/60), top-k {k}, "
          f"{configs[0].requests} requests of {configs[0].context}+24 tokens, hot 2x:")
    print("  resident      misses/step  H2D KiB/step  step ms  decode device ms  (ratios)  hit rate (hisparse layers)")
    first = None
    for config in configs:
        layers = config.resident_layers
        s = run_replay(config, backend).summary()
        steps = max(1, int(s["decode_steps"]))  # type: ignore[call-overload]
        row = (s["misses"] / steps, s["bytes_h2d"] / steps / 1024, s["step_ms_mean"],  # type: ignore[operator]
               s["decode_device_ms"])
        first = first or row
        if not first[0]:
            print(f"  {str(list(layers)):<12}  no misses: the pool held every page (nothing to compare)")
            return
        print(f"  {str(list(layers)):<12}  {row[0]:11.1f}  {row[1]:12.1f}  {row[2]:7.1f}  {row[3]:16.2f}  "
              f"({row[0] / first[0]:.2f}x misses, {row[2] / first[2]:.2f}x step, {row[3] / first[3]:.2f}x device)  "
              f"{s['hit_rate']:.1%}")


if __name__ == "__main__":
    from hisparse_core.cli.options import run_script

    sys.exit(run_script(main))
