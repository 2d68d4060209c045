"""Two `hisparse run --json` documents of one workload side by side: the figures the resolver
contract fixes must be equal (exit 1 naming each that is not), and the speed figures are shown.

    python3 bench/compare_runs.py RUN.json BASELINE.json [--expect-backend nvidia]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

#: Summary figures that depend only on the workload (docs/resolver-contract.md, replay/acks.py).
EXACT = ("steps", "decode_rows", "hits", "misses", "hit_rate", "resident_entries", "rows_h2d", "bytes_h2d",
         "bytes_d2h", "prefix_hit_tokens", "prefill_tokens_computed", "requests_admitted", "requests_finished",
         "max_concurrency_hisparse_measured", "host_pool_peak_blocks", "attention_entries_checked", "pages")
SPEED = ("steps_per_s", "step_ms_mean", "decode_device_ms", "decode_mode", "graph_sizes", "wall_s")
#: Config entries that may differ between two runs of one workload: how the decode step ran
#: (the backend's graphs, `--eager`, `--validate`), not what it replays.
NOT_WORKLOAD = ("decode_mode", "graph_sizes", "cuda_graphs", "validate")


def _load(path: str) -> dict | str:
    """The `hisparse run --json` document at `path`, or why it is none (one line)."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as exc:
        return f"{path}: cannot read it ({exc.strerror or exc})"
    except ValueError as exc:
        return f"{path}: not JSON ({exc}); expected the output of hisparse run --json"
    if isinstance(doc, dict) and doc.get("check") == "fail":
        return f"{path}: the run failed its check, so it has no figures"
    parts = [doc.get(k) for k in ("backend", "config", "summary")] if isinstance(doc, dict) else []
    if isinstance(doc, dict) and isinstance(parts[2], dict) and {"all", "steady"} <= parts[2].keys():
        # `hisparse bench --json` has a backend, config and summary too, of other figures
        return f"{path}: a hisparse bench --json document, not a run's; expected the output of hisparse run --json"
    if not parts or not all(isinstance(p, dict) for p in parts) or not {"name", "device"} <= parts[0].keys() \
            or not {*EXACT, *SPEED, "phase_ms"} <= parts[2].keys() or not isinstance(parts[2]["phase_ms"], dict):
        return f"{path}: not a hisparse run --json document (no backend, config and summary)"
    return doc


def _text(v: object) -> str:
    if isinstance(v, dict):
        return " ".join(f"{k}={x}" for k, x in v.items())
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def _ms(v: object) -> str:
    return f"{v:.2f}" if isinstance(v, int | float) else "-" if v is None else str(v)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run")
    p.add_argument("baseline")
    p.add_argument("--expect-backend", help="fail unless RUN used this backend")
    args = p.parse_args()
    if args.expect_backend is not None and not args.expect_backend.strip():  # `"$UNSET"`: no check at all
        print(f"compare_runs: --expect-backend {args.expect_backend!r}: expected a backend name, such as nvidia")
        return 2
    loaded = [_load(path) for path in (args.run, args.baseline)]
    # one file named twice (`x.json x.json`, `x.json ./x.json`) has one problem: say it once
    problems: dict[str, str] = {}
    for path, d in zip((args.run, args.baseline), loaded, strict=True):
        if isinstance(d, str):
            problems.setdefault(os.path.realpath(path), d)
    if problems:
        for why in problems.values():
            print(f"compare_runs: {why}")
        return 2
    if os.path.samefile(args.run, args.baseline):  # equal to itself in every figure: a pass of nothing
        print(f"compare_runs: {args.run} and {args.baseline} are the same file; expected two runs of one workload")
        return 2
    docs: list[dict] = loaded  # type: ignore[assignment]
    names = [d["backend"]["name"] for d in docs]
    configs = [{k: v for k, v in d["config"].items() if k not in NOT_WORKLOAD} for d in docs]
    differ = sorted(k for k in configs[0].keys() | configs[1].keys() if configs[0].get(k) != configs[1].get(k))
    if differ:  # different workloads: their figures may differ, which says nothing of either backend
        print(f"compare_runs: the two runs replay different workloads: {args.run} vs {args.baseline} differ in "
              + ", ".join(f"{k} ({configs[0].get(k)!r} vs {configs[1].get(k)!r})" for k in differ))
        return 2
    rows = [("backend", *names), ("device", *(d["backend"].get("gpu", d["backend"]["device"]) for d in docs))]
    bad = []
    for key in EXACT:
        a, b = (d["summary"][key] for d in docs)
        rows.append((key, _text(a), _text(b) + ("" if a == b else "   <-- differs")))
        if a != b:
            bad.append(key)
    for key in SPEED:
        rows.append((key, *(_text(d["summary"][key]) for d in docs)))
    # each run's own phases: one of another hisparse release may time others
    phases = dict.fromkeys([*docs[0]["summary"]["phase_ms"], *docs[1]["summary"]["phase_ms"]])
    for phase in phases:
        rows.append((f"ms/step {phase}", *(_ms(d["summary"]["phase_ms"].get(phase)) for d in docs)))
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print(f"{r[0].ljust(width[0])}  {r[1].ljust(width[1])}  {r[2]}")
    if args.expect_backend and names[0] != args.expect_backend:
        print(f"compare_runs: {args.run} ran on {names[0]!r}, expected {args.expect_backend!r}")
        return 1
    if bad:
        print(f"compare_runs: {names[0]} and {names[1]} differ in {', '.join(bad)}")
        return 1
    if not docs[0]["summary"]["attention_entries_checked"]:  # equal figures of nothing are no pass
        print("compare_runs: nothing compared: neither run read the KV (0 attention entries checked); expected runs "
              "that decode (--decode-tokens 2 or more, and --steps to reach them)")
        return 2
    print(f"compare_runs: every contract figure of {names[0]} equals {names[1]}'s")
    return 0


if __name__ == "__main__":
    try:
        from hisparse_core.cli.options import run_script
    except ModuleNotFoundError:  # a Python without hisparse (not the venv's): the comparison needs only json
        sys.exit(main())
    sys.exit(run_script(main))
