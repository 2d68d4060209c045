"""A peer waiting on rank 0's host-pool writes fails at once when rank 0 is dead, instead of waiting
out the timeout, and names it; the channel opens and waits on rank 0's event in the rank's own
device context (no GPU needed: the driver calls are replaced, the header page is plain memory)."""

from __future__ import annotations

import ctypes
import os
import time

import pytest

pytest.importorskip("cuda.bindings", reason="cuda-python is not installed: pip install 'hisparse[nvidia]'")

from hisparse_core import shm  # noqa: E402
from hisparse_core.errors import ProtocolError  # noqa: E402
from hisparse_nvidia import ipc  # noqa: E402


@pytest.fixture
def header(monkeypatch: pytest.MonkeyPatch) -> ctypes.Array:
    monkeypatch.setattr(ipc.driver, "ipc_open_event", lambda handle: object())
    monkeypatch.setattr(ipc.driver, "stream_wait_event", lambda stream, event: None)
    return (ctypes.c_char * shm.HEADER_PAGE)()


def test_a_dead_writer_fails_the_wait_fast(header: ctypes.Array) -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    dead = shm.Creator(pid, 1, shm.Creator.current().pidns)
    channel = ipc.WriterChannel(ctypes.addressof(header), writer=False, create=False, creator=dead)
    start = time.monotonic()
    with pytest.raises(ProtocolError, match=rf"rank 0 \(pid {pid} \(start time 1\)\) died before publishing "
                                            r"host-pool writes of epoch 3 \(it published 0\): restart"):
        channel.wait(3, 0, timeout_s=60)
    assert time.monotonic() - start < 5


def test_a_live_writer_is_waited_for_until_the_timeout(header: ctypes.Array) -> None:
    channel = ipc.WriterChannel(ctypes.addressof(header), writer=False, create=False,
                                creator=shm.Creator.current())
    with pytest.raises(ProtocolError, match=r"waited 0.3s for rank 0 to publish host-pool writes of epoch 1"):
        channel.wait(1, 0, timeout_s=0.3)
    ctypes.c_uint64.from_address(ctypes.addressof(header) + ipc.WRITE_EPOCH_OFFSET).value = 2
    channel.wait(2, 0, timeout_s=0.3)  # published: returns at once


def test_the_event_is_opened_and_waited_on_in_the_ranks_own_device_context(
        header: ctypes.Array, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensor parallelism: rank 1 on GPU 1 opens rank 0's event in GPU 1's context (not in whichever
    context a PyTorch call left current), and makes it current again before each driver call."""
    import torch

    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(ipc.driver, "ensure_context", lambda device: calls.append(("context", device)))
    monkeypatch.setattr(ipc.driver, "ipc_open_event", lambda handle: calls.append(("open", None)) or "event")
    monkeypatch.setattr(ipc.driver, "stream_wait_event", lambda stream, event: calls.append(("wait", event)))
    gpu1 = torch.device("cuda", 1)
    channel = ipc.WriterChannel(ctypes.addressof(header), writer=False, create=False,
                                creator=shm.Creator.current(), device=gpu1)
    ctypes.c_uint64.from_address(ctypes.addressof(header) + ipc.WRITE_EPOCH_OFFSET).value = 1
    channel.wait(1, 0, timeout_s=1)
    assert calls == [("context", gpu1), ("open", None), ("context", gpu1), ("wait", "event")]
    calls.clear()
    ipc.WriterChannel(ctypes.addressof(header), writer=False, create=False)  # no device: the caller's context
    assert calls == [("open", None)]


def test_a_peer_that_cannot_open_the_event_says_where(header: ctypes.Array, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    def refuse(handle: bytes) -> None:
        raise ipc.driver.CudaError("cuIpcOpenEventHandle failed: CUDA_ERROR_INVALID_VALUE")

    monkeypatch.setattr(ipc.driver, "ensure_context", lambda device: None)
    monkeypatch.setattr(ipc.driver, "ipc_open_event", refuse)
    with pytest.raises(ipc.driver.CudaError, match=r"this rank on cuda:1 could not open rank 0's IPC event of the "
                                                   r"shared host pool \(cuIpcOpenEventHandle failed: .*\); expected "
                                                   r"every rank on one node with rank 0's GPU visible"):
        ipc.WriterChannel(ctypes.addressof(header), writer=False, create=False, device=torch.device("cuda", 1))


def test_a_dead_writer_is_named_by_the_peer(header: ctypes.Array) -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    dead = shm.Creator(pid, 1, shm.Creator.current().pidns)
    channel = ipc.WriterChannel(ctypes.addressof(header), writer=False, create=False, creator=dead)
    assert channel.writer_dead()
    ctypes.c_uint64.from_address(ctypes.addressof(header) + ipc.WRITE_EPOCH_OFFSET).value = 5
    ctypes.c_uint64.from_address(ctypes.addressof(header) + ipc.DONE_EPOCH_OFFSET).value = 4
    err = channel.writer_died("transfer 9 waited for its host-write epoch 5 to finish")
    assert str(err) == (f"rank 0 (pid {pid} (start time 1)) died while transfer 9 waited for its host-write epoch 5 "
                        "to finish (it published 5, finished 4): restart the deployment (every rank)")
    live = ipc.WriterChannel(ctypes.addressof(header), writer=False, create=False, creator=shm.Creator.current())
    assert not live.writer_dead()
