#!/usr/bin/env python3
"""How long a registered host pool takes to let go: `release()`, and SIGTERM to process exit.

A cluster scheduler sends SIGTERM and kills the process after a grace period (often 30 s). A
pool of hundreds of GiB pinned with cuMemHostRegister can take longer than that to unregister.
Each way below runs in a fresh child process that maps and registers a private pool of `--gib`
GiB on GPU 0 (`NvidiaHostPool`, chunks of `--chunk-gib`), reports how long that took, and is then
sent SIGTERM by this script, which times it until the child is reaped:

- `release`: the child calls `pool.release()` (timed: chunked unregistration and unmap), then
  gets SIGTERM (handled: exit through the interpreter, as vLLM does).
- `exit`: SIGTERM with the pool still held (the default: no unregistration at exit; the driver
  unpins and the kernel unmaps a dying process's memory).
- `exit-unregister`: the same with `HISPARSE_UNREGISTER_AT_EXIT=1` (unregister at exit, in chunks,
  as before this was measured).
- `sigterm-default`: SIGTERM without a handler (the kernel ends the process at once).
- `sigkill`: SIGKILL, the floor.

    python bench/bench_pool_release.py [--gib 64] [--chunk-gib 32] [--ways release,exit,...] [--json out.json]

Needs an NVIDIA GPU and `--gib` of free RAM (the pool's capacity check refuses more than 95% of
what is available).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

WAYS = ("release", "exit", "exit-unregister", "sigterm-default", "sigkill")
GIB = 1 << 30


def child(way: str, gib: float, chunk_gib: float) -> int:
    """One measured process: register the pool, report, wait for the signal."""
    if way != "sigterm-default":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a graceful shutdown path, like vLLM's
    import torch

    from hisparse_core.host_pool import HostPoolSpec
    from hisparse_nvidia import host_pool as nv_pool
    from hisparse_nvidia.backend import NvidiaBackend

    nv_pool.REGISTER_CHUNK_BYTES = int(chunk_gib * GIB) // (2 << 20) * (2 << 20)
    row_bytes, block_size, layers = 656, 64, 61
    blocks = int(gib * GIB) // (row_bytes * block_size * layers)
    spec = HostPoolSpec(num_layers=layers, num_blocks=blocks, block_size=block_size)
    backend = NvidiaBackend(0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pool = backend.create_host_pool(spec)
    register_s = time.perf_counter() - t0
    release_s = None
    if way == "release":
        t0 = time.perf_counter()
        pool.release()
        release_s = time.perf_counter() - t0
    print(json.dumps({"event": "ready", "nbytes": spec.nbytes, "register_s": register_s, "release_s": release_s}),
          flush=True)
    while True:
        time.sleep(3600)


def measure(way: str, gib: float, chunk_gib: float) -> dict[str, object]:
    env = dict(os.environ)
    env.pop("HISPARSE_UNREGISTER_AT_EXIT", None)
    if way == "exit-unregister":
        env["HISPARSE_UNREGISTER_AT_EXIT"] = "1"
    proc = subprocess.Popen([sys.executable, __file__, "--child", way, "--gib", str(gib), "--chunk-gib",
                             str(chunk_gib)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    report: dict[str, object] = {"way": way}
    for line in proc.stdout:
        if line.startswith("{"):
            report.update(json.loads(line))
            break
    else:
        proc.wait()
        report["error"] = f"child exited with {proc.returncode} before registering"
        return report
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGKILL if way == "sigkill" else signal.SIGTERM)
    proc.wait()
    report["signal_to_exit_s"] = time.perf_counter() - t0
    report["exit_code"] = proc.returncode
    return report


def main(argv: list[str] | None = None) -> int:
    from hisparse_core.cli.options import CliParser, check_output_path, float_in

    parser = CliParser(prog="bench_pool_release", description=__doc__.split("\n\n")[0])
    # At least one block of the 61-layer pool, and a chunk of at least the 2 MiB registration unit
    # (a chunk that rounds down to 0 bytes never ends the registration loop).
    parser.add_argument("--gib", type=float_in(0.01, 65536.0), default=64.0, help="pool size in GiB (default 64)")
    parser.add_argument("--chunk-gib", type=float_in(0.002, 65536.0), default=32.0,
                        help="largest cuMemHostRegister call in GiB (default 32, the backend's)")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of {', '.join(WAYS)}")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, args.gib, args.chunk_gib)
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    bad = sorted(set(ways) - set(WAYS))
    if bad or not ways:
        parser.error(f"argument --ways: expected some of {', '.join(WAYS)}, got {args.ways!r}")
    if args.json is not None and (why := check_output_path("--json", args.json)):  # written after every way ran
        parser.error(why)
    # Each way's child registers its pool on GPU 0: without one, each ended in a traceback of its own.
    try:
        from hisparse_nvidia.plugin import probe

        why = probe()
    except ImportError as exc:
        why = f"the nvidia backend cannot be imported ({exc})"
    if why is not None:
        print(f"bench_pool_release: error: needs an NVIDIA GPU: {why}", file=sys.stderr)
        return 2
    rows = []
    print(f"registered host pool of {args.gib:g} GiB, cuMemHostRegister chunks of {args.chunk_gib:g} GiB", flush=True)
    print(f"{'way':<18}{'register s':>12}{'release s':>12}{'signal->exit s':>16}{'exit code':>11}", flush=True)
    for way in ways:
        r = measure(way, args.gib, args.chunk_gib)
        rows.append(r)
        if "error" in r:
            print(f"{way:<18}  {r['error']}", flush=True)
            continue
        release = f"{r['release_s']:.2f}" if r["release_s"] is not None else "-"
        print(f"{way:<18}{r['register_s']:>12.2f}{release:>12}{r['signal_to_exit_s']:>16.2f}{r['exit_code']:>11}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gib": args.gib, "chunk_gib": args.chunk_gib, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
