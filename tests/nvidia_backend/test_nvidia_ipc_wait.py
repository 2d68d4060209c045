"""A peer waiting on rank 0's host-pool writes fails at once when rank 0 is dead, instead of waiting
out the timeout (no GPU needed: the driver calls are replaced, the header page is plain memory)."""

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
