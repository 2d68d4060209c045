"""Throughput of the P/D host import: 1 GiB of KV pages read over NIXL from a prefill process on
loopback into a decoder's hisparse host pool, against baselines measured in the same run.

    python bench/bench_pd_import.py [--gib 1] [--layers 8] [--block-size 64] [--repeats 3]
                                    [--ucx-tls tcp] [--json]

Cases (each repeated; best and median reported; every case's bytes are checked on sampled pages):

- `memcpy`: torch `copy_` of the same number of bytes between two warm tensors in this process
  (the memory-bandwidth ceiling of one thread).
- `nixl contiguous`: one NIXL READ of the prefill side's layer regions, one descriptor per layer
  (the transport ceiling, no plan, no receiver).
- `import contiguous`: the real path (`HostImportReceiver` over `NixlDecoderTransport`) with the
  request's pages and host blocks both in order, so the plan merges them into one run per layer.
- `import scattered`: the same pages in random order into random host blocks: one descriptor per
  page and layer, as after a busy prefill and a fragmented host pool.
- `import staged`: scattered, through a bounded 2 x 64 MiB staging buffer (read, then copy).

The decoder's host pool is written once before timing (a long-running decoder's pool is resident;
first-touch page faults are not what this measures). Needs nixl==1.5.1 (`pip install 'hisparse[nixl]'`).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

GIB = 1 << 30
MIB = 1 << 20
#: Pages the untimed warm-up import reads (connection setup and first-use costs stay out of the timings).
WARMUP_PAGES = 4


def _prefill_main(conn: Any, num_layers: int, num_pages: int, block_size: int, env: dict[str, str]) -> None:
    """The prefill process: random pages, a NIXL server, sampled pages on request."""
    os.environ.update(env)
    import torch

    from hisparse_core.geometry import FP8_DS_MLA
    from hisparse_core.pd.nixl_transport import NixlConfig, NixlPrefillServer

    fmt = FP8_DS_MLA
    layers = []
    for _ in range(num_layers):
        t = torch.empty((num_pages, block_size, fmt.width), dtype=torch.uint8)
        t.random_(0, 256)
        layers.append(t)
    # No NIXL progress thread (it busy-polls a core the decoder could use): this loop drives progress.
    server = NixlPrefillServer("bench-prefill", 1, layers, block_size=block_size, row_format=fmt,
                               config=NixlConfig(progress_thread=False))
    conn.send(server.handshake().to_bytes())
    while True:
        if not conn.poll(0.0005):
            server.progress()
            continue
        cmd, *args = conn.recv()
        if cmd == "remote":
            conn.send(server.remote_prefill(*args).to_bytes())
        elif cmd == "pages":
            idx = torch.tensor(args[0], dtype=torch.long)
            conn.send(torch.stack([layer[idx].clone() for layer in layers]))
        elif cmd == "notices":
            conn.send(len(server.take_notices()))
        else:
            server.close()
            conn.send("bye")
            return


@dataclass
class Case:
    name: str
    reads: int
    descriptors: int
    seconds: list[float]
    nbytes: int

    @property
    def best(self) -> float:
        return self.nbytes / min(self.seconds) / GIB

    @property
    def median(self) -> float:
        return self.nbytes / statistics.median(self.seconds) / GIB


def main(argv: list[str] | None = None) -> int:
    from hisparse_core.capacity import check_host_memory, host_limit
    from hisparse_core.cli.options import MAX_BLOCK_SIZE, MAX_LAYERS, CliParser, float_in, int_in
    from hisparse_core.errors import CapacityError
    from hisparse_core.geometry import FP8_DS_MLA
    from hisparse_core.replay.report import counted
    from hisparse_core.units import significant

    # Bounded at parse time: `--gib nan` or `--layers 0` ended in a traceback (ValueError,
    # ZeroDivisionError), and `--block-size -1` or `--repeats 0` after the prefill process was started.
    ap = CliParser(prog="bench_pd_import", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float_in(0.0, 1024.0, lo_open=True), default=1.0,
                    help="bytes of KV pages to import (default 1 GiB)")
    ap.add_argument("--layers", type=int_in(1, MAX_LAYERS), default=8)
    ap.add_argument("--block-size", type=int_in(1, MAX_BLOCK_SIZE), default=64)
    ap.add_argument("--repeats", type=int_in(1, 1000), default=3)
    ap.add_argument("--ucx-tls", default=None, help="restrict UCX transports on both sides (e.g. tcp)")
    ap.add_argument("--json", action="store_true", help="print the table as JSON")
    args = ap.parse_args(argv)
    page_bytes = args.block_size * FP8_DS_MLA.row_bytes
    num_pages = -(-int(args.gib * GIB) // (args.layers * page_bytes))
    if num_pages < WARMUP_PAGES:  # the warm-up import alone reads that many
        smallest = significant(((WARMUP_PAGES - 1) * args.layers * page_bytes + 1) / GIB, up=True)
        ap.error(f"argument --gib: {args.gib:g} holds {counted(num_pages, 'page')} of --layers {args.layers} x "
                 f"--block-size {args.block_size} rows; expected --gib >= {smallest:g} ({WARMUP_PAGES} pages)")
    # Held at once: the prefill side's pages, the decoder's pool and the memcpy case's two copies.
    total = args.layers * num_pages * page_bytes
    try:
        check_host_memory(4 * total, f"--gib {args.gib:g} (the prefill's pages, the decoder's pool and the memcpy "
                                     "case's two copies: 4x the pages)",
                          remedy=f"lower --gib to at most {(host_limit() or 0) / 4 / GIB:.3g}")
    except CapacityError as exc:
        ap.error(str(exc))

    import torch

    from hisparse_core.host_pool import HostPoolSpec
    from hisparse_core.pd.handshake import PrefillHandshake, RemotePrefill
    from hisparse_core.pd.messages import HostImportJob
    from hisparse_core.pd.nixl_transport import NixlDecoderTransport, nixl_available
    from hisparse_core.pd.plan import host_descriptors, remote_descriptors
    from hisparse_core.pd.receiver import HostImportReceiver, ReceiverConfig
    from hisparse_core.pd.staging import StagingBuffer
    from hisparse_reference_cpu.backend import ReferenceCpuBackend

    reason = nixl_available()
    if reason is not None:
        print(f"bench_pd_import: {reason}", file=sys.stderr)
        return 2
    env = {"UCX_TLS": args.ucx_tls} if args.ucx_tls else {}
    os.environ.update(env)

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_prefill_main, args=(child, args.layers, num_pages, args.block_size, env), daemon=True)
    proc.start()
    child.close()

    pool = ReferenceCpuBackend().create_host_pool(HostPoolSpec(args.layers, num_pages + 1, args.block_size, FP8_DS_MLA))
    for layer in range(args.layers):
        pool.layer_view(layer).fill_(1)  # resident, like a running decoder's pool
    staging = StagingBuffer.allocate(2, 64 * MIB)
    transport = NixlDecoderTransport(pool, staging=staging)
    cases: list[Case] = []
    try:
        hs = PrefillHandshake.from_bytes(conn.recv())
        conn_rx = HostImportReceiver(transport, pool, config=ReceiverConfig(timeout_s=600))
        staged_rx = HostImportReceiver(transport, pool, staging=staging, config=ReceiverConfig(timeout_s=600))
        conn_rx.add_peer(hs)

        def check(pages: list[int], blocks: list[int]) -> None:
            pick = random.sample(range(len(pages)), min(64, len(pages)))
            want = conn_exchange("pages", [pages[i] for i in pick])
            for layer in range(args.layers):
                got = pool.layer_view(layer).view(-1, args.block_size, FP8_DS_MLA.width)[[blocks[i] for i in pick]]
                if not torch.equal(got, want[layer]):
                    raise AssertionError(f"layer {layer}: imported pages differ from the prefill side's bytes")

        def conn_exchange(*cmd: Any) -> Any:
            conn.send(cmd)
            return conn.recv()

        n_req = [0]

        def run_import(rx: HostImportReceiver, pages: list[int], blocks: list[int]) -> tuple[float, int]:
            n_req[0] += 1
            rid = f"bench-{n_req[0]}"
            remote = RemotePrefill.from_bytes(conn_exchange("remote", rid, pages, len(pages) * args.block_size))
            before = transport.stats().reads_posted
            t0 = time.perf_counter()
            rx.start(HostImportJob(remote, tuple(blocks)))
            while True:
                report = rx.poll()
                if not report.is_empty():
                    break
            dt = time.perf_counter() - t0
            if report.failed:
                raise RuntimeError(f"import failed: {report.failed[0].reason}")
            return dt, transport.stats().reads_posted - before

        # Warm up: connection setup and first-use costs stay out of the timings.
        run_import(conn_rx, list(range(WARMUP_PAGES)), list(range(1, WARMUP_PAGES + 1)))

        src = torch.empty(total, dtype=torch.uint8).random_(0, 256)
        dst = torch.empty_like(src).fill_(1)
        secs = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            secs.append(time.perf_counter() - t0)
        assert torch.equal(dst[:: 4093], src[:: 4093])
        cases.append(Case("local memcpy (torch copy_)", 0, 1, secs, total))
        del src, dst

        # One READ of every layer's whole region into the host pool (blocks 1..num_pages).
        from hisparse_core.pd.plan import HostLayout, PageRun

        runs = [PageRun(layer, 0, 1, num_pages) for layer in range(args.layers)]
        local = host_descriptors(HostLayout.of_pool(pool), runs)
        remote_d = remote_descriptors(hs, runs)
        secs = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            h = transport.post_read(hs.engine_id, local, remote_d)
            while transport.check(h).state.value == "in_flight":
                pass
            secs.append(time.perf_counter() - t0)
            assert transport.check(h).state.value == "done"
            transport.release(h)
        check(list(range(num_pages)), list(range(1, num_pages + 1)))
        cases.append(Case("NIXL READ, one descriptor per layer", 1, args.layers, secs, total))

        layouts = {
            "host import, contiguous pages": (list(range(num_pages)), list(range(1, num_pages + 1)), conn_rx),
            "host import, scattered pages": (random.sample(range(num_pages), num_pages),
                                             random.sample(range(1, num_pages + 1), num_pages), conn_rx),
            "host import, scattered, staged 2x64 MiB": (random.sample(range(num_pages), num_pages),
                                                        random.sample(range(1, num_pages + 1), num_pages), staged_rx),
        }
        for name, (pages, blocks, rx) in layouts.items():
            secs, reads = [], 0
            for _ in range(args.repeats):
                for layer in range(args.layers):
                    pool.layer_view(layer).fill_(1)  # nothing left from the previous case
                dt, reads = run_import(rx, pages, blocks)
                secs.append(dt)
            check(pages, blocks)
            coalesced = sum(1 for i in range(1, num_pages) if pages[i] == pages[i - 1] + 1
                            and blocks[i] == blocks[i - 1] + 1)
            cases.append(Case(name, reads, args.layers * (num_pages - coalesced), secs, total))
        conn_rx.close()
        staged_rx.close()
    finally:
        transport.close()
        try:
            conn.send(("exit",))
            conn.recv()
        except (EOFError, OSError):
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        pool.release()

    memcpy = cases[0].best
    rows = [{"case": c.name, "reads": c.reads, "descriptors": c.descriptors, "best_gib_s": round(c.best, 3),
             "median_gib_s": round(c.median, 3), "vs_memcpy": round(c.best / memcpy, 3)} for c in cases]
    header = (f"P/D host import of {total / GIB:.3f} GiB of pages ({args.layers} layers x {num_pages} pages x "
              f"{page_bytes} B), prefill process -> decoder over NIXL/UCX on loopback, "
              f"UCX_TLS={args.ucx_tls or '<UCX default>'}, best/median of {args.repeats}")
    if args.json:
        print(json.dumps({"header": header, "cases": rows}, indent=2))
        return 0
    print(header)
    print(f"{'case':<42} {'reads':>6} {'descs':>7} {'best GiB/s':>11} {'median GiB/s':>13} {'vs memcpy':>10}")
    for r in rows:
        print(f"{r['case']:<42} {r['reads']:>6} {r['descriptors']:>7} {r['best_gib_s']:>11.2f} "
              f"{r['median_gib_s']:>13.2f} {r['vs_memcpy']:>9.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
