"""A peer of a shared triton pool orders its reads behind rank 0's interprocess device event: the
host waits only until rank 0 has enqueued the epoch, the stream waits on the event; without such
events it falls back to the host-side wait. No GPU needed: the event calls are replaced and the
header page is a plain byte tensor."""

from __future__ import annotations

import pytest
import torch

from hisparse_triton import ipc

HANDLE = bytes(range(64))
GPU = torch.device("cuda", 0)


class FakeEvent:
    def __init__(self) -> None:
        self.records: list[object] = []

    def record(self, stream: object = None) -> None:
        self.records.append(stream)


class FakeStream:
    def __init__(self) -> None:
        self.waited: list[object] = []

    def wait_event(self, event: object) -> None:
        self.waited.append(event)


@pytest.fixture
def header() -> torch.Tensor:
    return torch.zeros(4096, dtype=torch.uint8)


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    made: dict[str, object] = {"writer": FakeEvent(), "opened": []}
    monkeypatch.setattr(ipc, "create_event", lambda device: (made["writer"], HANDLE))

    def open_event(device: torch.device, handle: bytes) -> FakeEvent:
        assert device == GPU and handle == HANDLE
        ev = FakeEvent()
        made["opened"].append(ev)  # type: ignore[attr-defined]
        return ev

    monkeypatch.setattr(ipc, "open_event", open_event)
    return made


def test_peer_stream_waits_on_rank0_event_once_the_epoch_is_enqueued(header: torch.Tensor,
                                                                    events: dict[str, object]) -> None:
    writer = ipc.EventChannel(header, GPU, writer=True)
    peer = ipc.EventChannel(header, GPU, writer=False)
    assert writer.available and peer.published == 0
    copy_stream, peer_stream = FakeStream(), FakeStream()
    steps: list[int] = []

    def step() -> None:  # one bounded host wait; rank 0 enqueues epoch 2 meanwhile
        steps.append(1)
        writer.record(copy_stream, 2)

    assert peer.wait(2, peer_stream, done=lambda: 0, step=step)
    assert steps == [1]  # waited for the enqueue, not for completion (done stays 0)
    assert events["writer"].records == [copy_stream]  # type: ignore[attr-defined]
    (opened,) = events["opened"]  # type: ignore[misc]
    assert peer_stream.waited == [opened]
    assert peer.wait(1, peer_stream, done=lambda: 0, step=lambda: pytest.fail("no wait needed"))
    assert events["opened"] == [opened]  # opened once


def test_without_interprocess_events_the_peer_waits_on_the_host(header: torch.Tensor,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(device: torch.device) -> None:
        raise RuntimeError("interprocess events are not supported")

    monkeypatch.setattr(ipc, "create_event", refuse)
    writer = ipc.EventChannel(header, GPU, writer=True)
    assert not writer.available
    writer.record(FakeStream(), 5)  # nothing published
    peer = ipc.EventChannel(header, GPU, writer=False)
    done = [0]

    def step() -> None:
        done[0] += 1

    stream = FakeStream()
    assert not peer.wait(3, stream, done=lambda: done[0], step=step)
    assert done[0] == 3 and stream.waited == []
