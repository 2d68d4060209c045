#!/usr/bin/env python3
"""Latency of synchronisation and data exchange between the blocks of a thread-block cluster.

Explains the resolver v3 design (one cluster per request): each mode runs 2000 rounds in every
block of one or more clusters of 256-thread blocks; the table gives cycles per round measured on
cluster 0's first block, beside the block barrier (`__syncthreads`) measured in the same run.

    python bench/bench_cluster_sync.py [--clusters 1 16]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import torch

MODES = [
    (0, "block barrier (__syncthreads), baseline"),
    (1, "cluster barrier, release/acquire"),
    (2, "cluster barrier, relaxed arrive (no ordering)"),
    (3, "GPU-scope fence + block barrier"),
    (4, "remote st + cluster barrier rel/acq"),
    (5, "all-to-all st.async word + mbarrier wait"),
    (6, "dependent remote ld.shared::cluster"),
    (7, "dependent remote 64-bit CAS"),
]


def build(cluster: int) -> bytes:
    from hisparse_nvidia.compiler import compile_source

    text = Path(__file__).with_name("cluster_sync.cu").read_text()
    image, _log = compile_source(text, "cluster_sync.cu", ["--gpu-architecture=sm_90", f"-DHS_C={cluster}"])
    return image


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clusters", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cluster_sync: no CUDA device", file=sys.stderr)
        return 2
    from hisparse_nvidia import driver

    dev = torch.device("cuda", torch.cuda.current_device())
    driver.ensure_context(dev)
    out = torch.zeros(1, dtype=torch.int64, device=dev)
    sink = torch.zeros(1, dtype=torch.int32, device=dev)
    stream = torch.cuda.current_stream(dev).cuda_stream
    print(f"cluster sync probe: {torch.cuda.get_device_name(dev)}, 256 threads per block, {args.iters} rounds; "
          "cycles per round (block 0 of cluster 0)\n")
    head = f"{'mode':48}" + "".join(f"{f'C={c} x{n}':>12}" for c in (2, 8) for n in args.clusters)
    print(head)
    print("-" * len(head))
    fns = {c: driver.Module(build(c)).function("probe") for c in (2, 8)}
    for mode, name in MODES:
        cells = []
        for c in (2, 8):
            for n in args.clusters:
                fns[c].launch((c * n, 1, 1), 256, 0, stream,
                              [ctypes.c_int32(mode), ctypes.c_int32(args.iters), ctypes.c_void_p(out.data_ptr()),
                               ctypes.c_void_p(sink.data_ptr())])
                torch.cuda.synchronize(dev)
                cells.append(out.item() / args.iters)
        print(f"{name:48}" + "".join(f"{x:12.0f}" for x in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
