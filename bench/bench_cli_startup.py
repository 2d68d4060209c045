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

#: (label, the interpreter's arguments, the exit status it must end with).
COMMANDS: list[tuple[str, list[str], int]] = [
    ("python -c pass", ["-c", "pass"], 0),
    ("hisparse --help", ["-m", "hisparse_core", "--help"], 0),
    ("hisparse --version", ["-m", "hisparse_core", "--version"], 0),
    ("hisparse backends", ["-m", "hisparse_core", "backends"], 0),
    ("hisparse run --help", ["-m", "hisparse_core", "run", "--help"], 0),
    ("hisparse run --hot inf", ["-m", "hisparse_core", "run", "--hot", "inf"], 2),
]


class Failed(Exception):
    """A command ended with another exit status than its own: its time is no start-up's."""


def wall(label: str, argv: list[str], status: int) -> float:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, check=False)
    took = time.perf_counter() - start
    if proc.returncode != status:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise Failed(f"{label} exited {proc.returncode}, expected {status}: {last}")
    return took


def imports_torch(argv: list[str]) -> bool:
    proc = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True, text=True, check=False)
    return any(line.rstrip().endswith("| torch") for line in proc.stderr.splitlines())


def main(argv: list[str] | None = None) -> int:
    from hisparse_core.cli.options import CliParser, int_in

    parser = CliParser(prog="bench_cli_startup", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int_in(1, 1000), default=7)
    args = parser.parse_args(argv)
    rows = []
    try:
        for label, command, status in COMMANDS:
            # interleaving would mix caches; each warms its own
            times = [wall(label, command, status) for _ in range(args.repeat)]
            rows.append((label, statistics.median(times), min(times), imports_torch(command)))
    except Failed as exc:
        print(f"bench_cli_startup: error: {exc}", file=sys.stderr)
        return 1
    print(f"{'command':26} {'median s':>9} {'min s':>7}  torch")
    for label, med, low, torch in rows:
        print(f"{label:26} {med:9.3f} {low:7.3f}  {'yes' if torch else 'no'}")
    return 0


if __name__ == "__main__":
    from hisparse_core.cli.options import run_script

    raise SystemExit(run_script(main))
