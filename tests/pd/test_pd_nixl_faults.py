"""P/D import faults over NIXL with real processes: each fails only its request, with a clear
reason, releases every lease and leaves other imports running.

The decoder is restricted to UCX's tcp transport (`UCX_TLS=tcp`, set only while its agent is
created): a tcp read needs the prefill process to serve it, so a stopped (SIGSTOP) prefill
really leaves reads in flight. With the default shared-memory transports a loopback read is
done by the decoder's own thread and cannot be left hanging.
"""

from __future__ import annotations

import dataclasses
import json
import random
import signal
import time
from collections.abc import Iterator

import pytest
import torch
from pd_decoder import Decoder, make_decoder, prompt
from pd_peer import PrefillPeer, wait_notices

from hisparse_core.coordinator import ImportTarget
from hisparse_core.pd.errors import StaleHandshakeError
from hisparse_core.pd.handshake import PrefillHandshake, RemotePrefill
from hisparse_core.pd.nixl_transport import nixl_available
from hisparse_core.pd.receiver import ReceiverConfig

_NIXL = nixl_available()
pytestmark = [pytest.mark.nixl, pytest.mark.skipif(_NIXL is not None, reason=f"nixl unavailable: {_NIXL}")]

LAYERS, BS, PAGES, HOST_BLOCKS, GPU_BLOCKS, HOT, MAX_LEN = 3, 16, 48, 120, 10, 2, 256
WIDTH = 656
TIMEOUT_S = 2.0


@pytest.fixture
def decoder(monkeypatch: pytest.MonkeyPatch) -> Iterator[Decoder]:
    from hisparse_core.pd.nixl_transport import NixlDecoderTransport

    monkeypatch.setenv("UCX_TLS", "tcp")
    d = make_decoder(lambda pool, stg: NixlDecoderTransport(pool), num_layers=LAYERS, block_size=BS,
                     host_blocks=HOST_BLOCKS, gpu_blocks=GPU_BLOCKS, max_model_len=MAX_LEN, hot_blocks=HOT,
                     receiver_config=ReceiverConfig(timeout_s=TIMEOUT_S))
    monkeypatch.delenv("UCX_TLS")
    yield d
    leftover = d.close()
    assert leftover == [], f"imports still open at the end of the test: {leftover}"
    assert d.transport.live_reads == 0 and d.transport.num_registrations == 0  # type: ignore[attr-defined]


def handshake(peer: PrefillPeer, engine: str) -> PrefillHandshake:
    return PrefillHandshake.from_bytes(peer.handshakes[engine])


def admit(d: Decoder, peer: PrefillPeer, engine: str, rid: str, num_tokens: int, salt: int) -> list[int]:
    pages = random.sample(range(PAGES), -(-num_tokens // BS))
    remote = RemotePrefill.from_bytes(peer.remote(engine, rid, pages, num_tokens))
    assert d.scheduler.admit(remote, prompt(num_tokens, salt)) is ImportTarget.HOST
    return pages


def assert_landed(d: Decoder, peer: PrefillPeer, engine: str, rid: str, pages: list[int]) -> None:
    assert rid in d.finished, (rid, d.failed)
    expected = peer.pages(engine, pages)
    for layer in range(LAYERS):
        host = d.pool.layer_view(layer).view(-1, BS, WIDTH)[list(d.jobs[rid].host_blocks)]
        assert torch.equal(host, expected[layer]), (rid, layer)


def assert_only_finished_hold_leases(d: Decoder) -> None:
    """Failed imports gave back every host block and hot-buffer block they leased."""
    pages = sum(len(d.jobs[rid].host_blocks) for rid in d.finished)
    assert d.coord.stats().host_blocks_used == pages
    assert d.gpu.num_free_blocks == GPU_BLOCKS - HOT * len(d.finished)
    assert d.coord.stats().pending_imports == 0


def test_descriptor_out_of_range_fails_before_any_read(decoder: Decoder, prefill_peers: dict[str, PrefillPeer]) -> None:
    d, peer = decoder, prefill_peers["main"]
    hs = handshake(peer, "dense")
    d.receiver.add_peer(hs)
    bad = RemotePrefill("oob", "dense", hs.epoch, tuple(range(36, 48)) + (PAGES,), 13 * BS)
    assert d.scheduler.admit(bad, prompt(13 * BS, 1)) is ImportTarget.HOST
    good = admit(d, peer, "dense", "good", 200, salt=2)
    d.run_until(["oob", "good"])
    reason = d.failed["oob"]
    assert "DescriptorRangeError" in reason and f"prefill page {PAGES}" in reason
    assert f"registered {PAGES} pages in layer 0" in reason
    assert d.transport.stats().reads_posted == 1  # only the good request's read was posted
    notices = wait_notices(peer, "dense", {"oob", "good"})
    assert (notices["oob"], notices["good"]) == (False, True)  # the prefill side may free both
    assert_landed(d, peer, "dense", "good", good)
    assert_only_finished_hold_leases(d)


def test_read_beyond_the_registered_region_is_a_transfer_error(decoder: Decoder,
                                                               prefill_peers: dict[str, PrefillPeer]) -> None:
    d, peer = decoder, prefill_peers["main"]
    hs = handshake(peer, "dense")
    # A handshake that claims twice the pages the prefill side registered: the plan accepts page 60,
    # NIXL refuses to read it.
    inflated = dataclasses.replace(hs, regions=tuple(dataclasses.replace(r, num_pages=2 * PAGES) for r in hs.regions))
    d.receiver.add_peer(inflated)
    beyond = RemotePrefill("beyond", "dense", hs.epoch, tuple(range(40, 52)) + (60,), 13 * BS)
    assert d.scheduler.admit(beyond, prompt(13 * BS, 3)) is ImportTarget.HOST
    good = admit(d, peer, "dense", "good", 230, salt=4)
    d.run_until(["beyond", "good"])
    assert d.failed["beyond"].startswith("read could not be posted: NIXL refused a read from dense@epoch")
    assert "NIXL_ERR_NOT_FOUND" in d.failed["beyond"]
    assert_landed(d, peer, "dense", "good", good)
    assert_only_finished_hold_leases(d)


def test_deregistered_prefill_fails_its_import_and_a_new_epoch_serves(decoder: Decoder,
                                                                       prefill_peers: dict[str, PrefillPeer]) -> None:
    d, peer = decoder, prefill_peers["main"]
    d.receiver.add_peer(handshake(peer, "epochs"))
    d.receiver.add_peer(handshake(peer, "dense"))
    warm = admit(d, peer, "epochs", "warm", 180, salt=5)
    d.run_until(["warm"])
    assert_landed(d, peer, "epochs", "warm", warm)
    gone = admit(d, peer, "epochs", "gone", 200, salt=6)
    assert peer.call("close", "epochs") == "closed"  # deregistered, agent dropped; the decoder still holds it
    good = admit(d, peer, "dense", "good", 210, salt=7)
    d.run_until(["gone", "good"])
    assert "gone" in d.failed and "'epochs'" in d.failed["gone"], d.failed
    assert_landed(d, peer, "dense", "good", good)
    d.receiver.add_peer(PrefillHandshake.from_bytes(peer.restart("epochs")))  # a new generation
    again = admit(d, peer, "epochs", "again", 170, salt=8)
    d.run_until(["again"])
    assert_landed(d, peer, "epochs", "again", again)
    del gone
    assert_only_finished_hold_leases(d)


def test_stale_handshakes_are_rejected(decoder: Decoder, prefill_peers: dict[str, PrefillPeer]) -> None:
    d, peer = decoder, prefill_peers["main"]
    raw = json.loads(peer.handshakes["epochs"])
    raw["version"] += 1
    with pytest.raises(StaleHandshakeError, match="protocol version"):
        PrefillHandshake.from_bytes(json.dumps(raw).encode())

    old = handshake(peer, "epochs")
    d.receiver.add_peer(old)
    d.receiver.add_peer(handshake(peer, "dense"))
    new = PrefillHandshake.from_bytes(peer.restart("epochs"))
    assert new.epoch == old.epoch + 1 and new.agent_name != old.agent_name
    early = admit(d, peer, "epochs", "early", 190, salt=9)  # prefilled by the new generation
    good = admit(d, peer, "dense", "good", 190, salt=10)
    d.run_until(["early", "good"])
    assert "StaleHandshakeError" in d.failed["early"]
    assert f"epoch {new.epoch}, but the decoder holds the handshake of epoch {old.epoch}" in d.failed["early"]
    assert_landed(d, peer, "dense", "good", good)
    posted = d.transport.stats().reads_posted

    d.receiver.add_peer(new)
    with pytest.raises(StaleHandshakeError, match=f"epoch {old.epoch}, older than the held epoch {new.epoch}"):
        d.receiver.add_peer(old)
    late = admit(d, peer, "epochs", "late", 205, salt=11)
    d.run_until(["late"])
    assert_landed(d, peer, "epochs", "late", late)
    assert d.transport.stats().reads_posted == posted + 1
    del early
    assert_only_finished_hold_leases(d)


def test_prefill_stops_answering_then_dies_mid_transfer(decoder: Decoder,
                                                        prefill_peers: dict[str, PrefillPeer]) -> None:
    d, main, victim = decoder, prefill_peers["main"], prefill_peers["victim"]
    d.receiver.add_peer(handshake(victim, "victim"))
    d.receiver.add_peer(handshake(main, "dense"))
    warm = admit(d, victim, "victim", "warm", 180, salt=12)  # connect while the victim runs
    d.run_until(["warm"])
    assert_landed(d, victim, "victim", "warm", warm)

    # 1. The prefill process stops answering: its import times out, its connection is dropped.
    silent = RemotePrefill.from_bytes(victim.remote("victim", "silent", list(range(15)), 240))
    victim.signal(signal.SIGSTOP)
    try:
        assert d.scheduler.admit(silent, prompt(240, 13)) is ImportTarget.HOST
        g1 = admit(d, main, "dense", "g1", 220, salt=14)
        t0 = time.monotonic()
        d.run_until(["silent", "g1"], timeout_s=TIMEOUT_S + 20)
        assert time.monotonic() - t0 >= TIMEOUT_S * 0.9
        assert d.failed["silent"].startswith(f"timed out after {TIMEOUT_S:g}s with 0/")
        assert d.transport.peer("victim") is None  # disconnected: nothing can land late
        assert_landed(d, main, "dense", "g1", g1)
        assert_only_finished_hold_leases(d)
    finally:
        victim.signal(signal.SIGCONT)

    # 2. The prefill process is killed while a read is in flight.
    d.receiver.add_peer(handshake(victim, "victim"))
    doomed = RemotePrefill.from_bytes(victim.remote("victim", "doomed", list(range(20, 36)), 250))
    victim.signal(signal.SIGSTOP)
    assert d.scheduler.admit(doomed, prompt(250, 15)) is ImportTarget.HOST
    g2 = admit(d, main, "dense", "g2", 235, salt=16)
    posted = d.transport.stats().reads_posted
    d.pump()
    assert d.transport.stats().reads_posted >= posted + 1 and d.receiver.phase("doomed") is not None
    victim.kill()  # SIGKILL mid-transfer
    d.run_until(["doomed", "g2"], timeout_s=TIMEOUT_S + 20)
    reason = d.failed["doomed"]
    assert "'victim'" in reason and ("NIXL_ERR_REMOTE_DISCONNECT" in reason or "timed out" in reason), reason
    assert_landed(d, main, "dense", "g2", g2)
    assert sorted(d.failed) == ["doomed", "silent"]
    assert_only_finished_hold_leases(d)
