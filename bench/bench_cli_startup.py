"""Start-up time of the `hisparse` command as a whole process, beside `python -c pass`.

Each command runs `--repeat` times in a fresh interpreter (the same one that runs this script);
the table gives the median and the fastest wall time, and whether the process imported torch
(`python -X importtime`). Target (issue 18): `hisparse --help` and `hisparse backends` under
0.5 s, with no torch.

Run: python bench/bench_cli_startup.py [--repeat 7]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS: list[tuple[str, list[str]]] = [
    ("python -c pass", ["-c", "pass"]),
    ("hisparse --help", ["-m", "hisparse_core", "--help"]),
    ("hisparse --version", ["-m", "hisparse_core", "--version"]),
    ("hisparse backends", ["-m", "hisparse_core", "backends"]),
    ("hisparse run --help", ["-m", "hisparse_core", "run", "--help"]),
    ("hisparse run --hot inf", ["-m", "hisparse_core", "run", "--hot", "inf"]),
]


def wall(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *argv], capture_output=True, check=False)
    return time.perf_counter() - start


def imports_torch(argv: list[str]) -> bool:
    proc = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True, text=True, check=False)
    return any(line.rstrip().endswith("| torch") for line in proc.stderr.splitlines())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    rows = []
    for label, argv in COMMANDS:
        times = [wall(argv) for _ in range(args.repeat)]  # interleaving would mix caches; each warms its own
        rows.append((label, statistics.median(times), min(times), imports_torch(argv)))
    print(f"{'command':26} {'median s':>9} {'min s':>7}  torch")
    for label, med, low, torch in rows:
        print(f"{label:26} {med:9.3f} {low:7.3f}  {'yes' if torch else 'no'}")


if __name__ == "__main__":
    main()
