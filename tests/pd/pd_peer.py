"""A prefill engine in its own process, driven over a pipe by the P/D tests and the bench.

The child fills real KV pages with fresh random bytes, serves them through `NixlPrefillServer`
and answers commands; `PrefillPeer` is the parent's handle on it. Replies are plain picklable
values (bytes, tensors, tuples).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

PEER_START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class PeerSpec:
    engine_id: str
    num_layers: int
    num_pages: int
    block_size: int
    row_format: str = "fp8_ds_mla"
    epoch: int = 1
    page_pad_rows: int = 0  # extra rows between pages (a strided, non-dense page layout)
    env: tuple[tuple[str, str], ...] = ()


def _make_pages(spec: PeerSpec) -> list[Any]:
    import torch

    from hisparse_core.geometry import row_format

    fmt = row_format(spec.row_format)
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1))
    rows = spec.block_size + spec.page_pad_rows
    layers = []
    for _ in range(spec.num_layers):
        raw = torch.randint(0, 256, (spec.num_pages, rows, fmt.row_bytes), dtype=torch.uint8, generator=gen)
        full = raw.view(fmt.dtype).view(spec.num_pages, rows, fmt.width)
        layers.append(full[:, :spec.block_size])  # padding rows stay outside every page
    return layers


def _serve(conn: Any, spec: PeerSpec) -> None:  # runs in the child
    for k, v in spec.env:
        os.environ[k] = v
    import torch

    from hisparse_core.geometry import row_format
    from hisparse_core.pd.nixl_transport import NixlPrefillServer

    fmt = row_format(spec.row_format)
    epoch = spec.epoch
    layers = _make_pages(spec)
    server = NixlPrefillServer(spec.engine_id, epoch, layers, block_size=spec.block_size, row_format=fmt)
    conn.send(("ready", server.handshake().to_bytes()))
    while True:
        cmd, *args = conn.recv()
        if cmd == "remote":
            rid, pages, num_tokens = args
            conn.send(server.remote_prefill(rid, pages, num_tokens).to_bytes())
        elif cmd == "pages":
            (pages,) = args
            idx = torch.tensor(list(pages), dtype=torch.long)
            conn.send(torch.stack([layer[idx].contiguous() for layer in layers]))
        elif cmd == "notices":
            conn.send([(n.request_id, n.ok) for n in server.take_notices()])
        elif cmd == "outstanding":
            conn.send(sorted(server.outstanding))
        elif cmd == "close":
            server.close()
            conn.send("closed")
        elif cmd == "restart":
            server.close()
            epoch += 1
            layers = _make_pages(spec)
            server = NixlPrefillServer(spec.engine_id, epoch, layers, block_size=spec.block_size, row_format=fmt)
            conn.send(server.handshake().to_bytes())
        elif cmd == "exit":
            server.close()
            conn.send("bye")
            return
        else:
            conn.send(("error", f"unknown command {cmd!r}"))


class PrefillPeer:
    """Parent-side handle of a prefill child process."""

    def __init__(self, spec: PeerSpec) -> None:
        ctx = mp.get_context("spawn")
        self.spec = spec
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, spec), daemon=True, name=f"prefill-{spec.engine_id}")
        self.process.start()
        child.close()
        self.handshake_bytes = b""

    def wait_ready(self) -> bytes:
        if not self._conn.poll(PEER_START_TIMEOUT_S):
            raise TimeoutError(f"prefill {self.spec.engine_id} did not start in {PEER_START_TIMEOUT_S}s")
        try:
            tag, hs = self._conn.recv()
        except EOFError:
            self.process.join(5)
            raise RuntimeError(f"prefill {self.spec.engine_id} exited with code {self.process.exitcode} before "
                               f"serving; see its traceback above") from None
        assert tag == "ready", tag
        self.handshake_bytes = hs
        return hs

    def call(self, *cmd: Any, timeout_s: float = 30.0) -> Any:
        self._conn.send(cmd)
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"prefill {self.spec.engine_id} did not answer {cmd[0]!r} in {timeout_s}s")
        return self._conn.recv()

    def remote(self, request_id: str, pages: Sequence[int], num_tokens: int) -> bytes:
        return self.call("remote", request_id, list(pages), num_tokens)

    def pages(self, pages: Sequence[int]) -> Any:
        return self.call("pages", list(pages))

    def kill(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.call("exit", timeout_s=10)
            except (TimeoutError, EOFError, BrokenPipeError, ConnectionError):
                pass
            self.process.join(10)
        if self.process.is_alive():
            self.kill()
        self._conn.close()


def start_peers(*specs: PeerSpec) -> list[PrefillPeer]:
    """Start several prefill children in parallel and wait until each serves."""
    peers = [PrefillPeer(s) for s in specs]
    try:
        for p in peers:
            p.wait_ready()
    except BaseException:
        for p in peers:
            p.kill()
        raise
    return peers
