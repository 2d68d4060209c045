"""Prefill engines in their own process, driven over a pipe by the P/D tests and the bench.

One child process hosts one or more prefill engines; each fills real KV pages with fresh random
bytes and serves them through its own `NixlPrefillServer`. `PrefillPeer` is the parent's handle.
Replies are plain picklable values (bytes, numpy arrays, lists), never tensors: torch sends a
tensor as a shared-memory descriptor through a multiprocessing helper (a `pymp-*` folder and a
listener thread in the sender), and a child that is then killed leaves that folder behind.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

PEER_START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class EngineSpec:
    engine_id: str
    num_layers: int
    num_pages: int
    block_size: int
    row_format: str = "fp8_ds_mla"
    epoch: int = 1
    page_pad_rows: int = 0  # extra rows between pages: a strided, non-dense page layout


def _make_pages(spec: EngineSpec) -> list[Any]:
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


class _Engine:
    def __init__(self, spec: EngineSpec, epoch: int) -> None:
        from hisparse_core.geometry import row_format
        from hisparse_core.pd.nixl_transport import NixlConfig, NixlPrefillServer

        self.spec, self.epoch = spec, epoch
        self.layers = _make_pages(spec)
        # No progress thread (it busy-polls a core): the serve loop drives progress, like an engine step.
        self.server = NixlPrefillServer(spec.engine_id, epoch, self.layers, block_size=spec.block_size,
                                        row_format=row_format(spec.row_format),
                                        config=NixlConfig(progress_thread=False))


def _serve(conn: Any, specs: tuple[EngineSpec, ...]) -> None:  # runs in the child
    import torch

    engines = {s.engine_id: _Engine(s, s.epoch) for s in specs}
    conn.send(("ready", {eid: e.server.handshake().to_bytes() for eid, e in engines.items()}))
    while True:
        if not conn.poll(0.0005):
            for e in engines.values():
                if not e.server.closed:
                    e.server.progress()
            continue
        cmd, *args = conn.recv()
        if cmd == "exit":
            for e in engines.values():
                e.server.close()
            conn.send("bye")
            return
        eng = engines[args[0]]
        if cmd == "remote":
            _, rid, pages, num_tokens = args
            conn.send(eng.server.remote_prefill(rid, pages, num_tokens).to_bytes())
        elif cmd == "pages":
            idx = torch.tensor(list(args[1]), dtype=torch.long)
            stacked = torch.stack([layer[idx].contiguous() for layer in eng.layers])
            conn.send((str(stacked.dtype).removeprefix("torch."), tuple(stacked.shape),
                       stacked.view(torch.uint8).numpy()))
        elif cmd == "notices":
            conn.send([(n.request_id, n.ok) for n in eng.server.take_notices()])
        elif cmd == "outstanding":
            conn.send(sorted(eng.server.outstanding))
        elif cmd == "close":  # deregister the pages and drop the agent; the engine stops serving
            eng.server.close()
            conn.send("closed")
        elif cmd == "restart":  # a new generation: new pages, new agent, epoch + 1
            eng.server.close()
            engines[args[0]] = eng = _Engine(eng.spec, eng.epoch + 1)
            conn.send(eng.server.handshake().to_bytes())
        else:
            conn.send(("error", f"unknown command {cmd!r}"))


class PrefillPeer:
    """Parent-side handle of a prefill child process hosting `specs`."""

    def __init__(self, *specs: EngineSpec, env: dict[str, str] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.specs = {s.engine_id: s for s in specs}
        self._conn, child = ctx.Pipe()
        saved = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})  # a spawned child copies the environment at start
        try:
            self.process = ctx.Process(target=_serve, args=(child, specs), daemon=True,
                                       name="prefill-" + "+".join(self.specs))
            self.process.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        child.close()
        self.handshakes: dict[str, bytes] = {}

    def wait_ready(self) -> None:
        if not self._conn.poll(PEER_START_TIMEOUT_S):
            raise TimeoutError(f"{self.process.name} did not start in {PEER_START_TIMEOUT_S}s")
        try:
            tag, handshakes = self._conn.recv()
        except EOFError:
            self.process.join(5)
            raise RuntimeError(f"{self.process.name} exited with code {self.process.exitcode} before serving; "
                               f"see its traceback above") from None
        assert tag == "ready", tag
        self.handshakes = handshakes

    def call(self, *cmd: Any, timeout_s: float = 30.0) -> Any:
        self._conn.send(cmd)
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"{self.process.name} did not answer {cmd[0]!r} in {timeout_s}s")
        return self._conn.recv()

    def remote(self, engine_id: str, request_id: str, pages: Sequence[int], num_tokens: int) -> bytes:
        return self.call("remote", engine_id, request_id, list(pages), num_tokens)

    def pages(self, engine_id: str, pages: Sequence[int]) -> Any:
        """The bytes of `pages` in every layer: a `[layers, pages, block_size, width]` tensor."""
        import torch

        dtype, shape, raw = self.call("pages", engine_id, list(pages))
        return torch.from_numpy(raw).view(getattr(torch, dtype)).view(shape)

    def restart(self, engine_id: str) -> bytes:
        self.handshakes[engine_id] = self.call("restart", engine_id)
        return self.handshakes[engine_id]

    def signal(self, sig: signal.Signals) -> None:
        os.kill(self.process.pid, sig)

    def kill(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)

    def stop(self) -> None:
        """Close every engine cleanly (deregistration included), then end the process."""
        if self.process.is_alive():
            try:
                self.call("exit", timeout_s=10)
            except (TimeoutError, EOFError, BrokenPipeError, ConnectionError):
                pass
            self.process.join(2)  # UCX teardown in a dying process is not what these tests measure
        self.kill()
        self._conn.close()


def wait_notices(peer: PrefillPeer, engine: str, want: set[str], timeout_s: float = 10.0) -> dict[str, bool]:
    """Read notices sent to `engine` (request id -> the read succeeded) until every id in `want` came, or time is up."""
    got: dict[str, bool] = {}
    deadline = time.monotonic() + timeout_s
    while not want <= set(got) and time.monotonic() < deadline:
        got.update(peer.call("notices", engine))
        time.sleep(0.01)
    return got


def start_peers(*peers: PrefillPeer) -> list[PrefillPeer]:
    """Wait until each (already spawned, starting in parallel) peer serves."""
    try:
        for p in peers:
            p.wait_ready()
    except BaseException:
        for p in peers:
            p.kill()
        raise
    return list(peers)
