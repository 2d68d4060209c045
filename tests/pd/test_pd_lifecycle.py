"""Import lifecycle without NIXL: the coordinator's target choice and leases, the receiver's
landing, cancellation, timeouts and failures, over an in-process transport that moves real bytes."""

from __future__ import annotations

import random

import pytest
import torch
from pd_decoder import Decoder, make_decoder, prompt
from pd_fakes import FakeClock, MemPrefill, MemTransport

from hisparse_core.coordinator import ImportTarget
from hisparse_core.errors import InvalidInputError, ProtocolError
from hisparse_core.pd.errors import StaleHandshakeError
from hisparse_core.pd.messages import FailedRecv, RecvReport
from hisparse_core.pd.receiver import ReceiverConfig
from hisparse_core.pd.staging import StagingBuffer

LAYERS, BS, HOST_BLOCKS, GPU_BLOCKS, MAX_LEN = 2, 4, 40, 12, 64


def decoder(*, staging: StagingBuffer | None = None, timeout_s: float = 5.0, clock: FakeClock | None = None,
            max_reads: int = 16, max_read_bytes: int = 1 << 20) -> tuple[Decoder, MemTransport]:
    transports: list[MemTransport] = []

    def make(pool, stg):  # noqa: ANN001, ANN202
        transports.append(MemTransport())
        return transports[0]

    d = make_decoder(make, num_layers=LAYERS, block_size=BS, host_blocks=HOST_BLOCKS, gpu_blocks=GPU_BLOCKS,
                     max_model_len=MAX_LEN, staging=staging, clock=clock or FakeClock(),
                     receiver_config=ReceiverConfig(timeout_s=timeout_s, max_reads_in_flight=max_reads,
                                                    max_read_bytes=max_read_bytes))
    return d, transports[0]


def admit(d: Decoder, peer: MemPrefill, rid: str, num_tokens: int, *, salt: int = 0) -> tuple[list[int], object]:
    pages = random.sample(range(peer.layers[0].shape[0]), -(-num_tokens // BS))
    target = d.scheduler.admit(peer.remote(rid, pages, num_tokens), prompt(num_tokens, salt))
    return pages, target


def host_bytes(d: Decoder, blocks: list[int]) -> torch.Tensor:
    return torch.stack([d.pool.layer_view(layer).view(-1, BS, d.pool.spec.row_format.width)[blocks]
                        for layer in range(LAYERS)])


def leased_host_blocks(d: Decoder) -> int:
    return d.coord.stats().host_blocks_used


def test_targets_are_chosen_once_and_host_imports_land_exact_bytes() -> None:
    d, t = decoder()
    peer = MemPrefill("p0", LAYERS, 40, BS)
    d.receiver.add_peer(peer.handshake)
    assert d.scheduler.admit(peer.remote("small", [1, 2], 7), prompt(7, 1)) is ImportTarget.DEVICE
    blocker = d.gpu.acquire(GPU_BLOCKS - 3)  # hot (2) + tail (2) no longer fit
    pages, target = admit(d, peer, "big", 54, salt=2)
    assert target is ImportTarget.WAIT and d.scheduler.num_importing == 0
    d.gpu.release(blocker)
    assert d.scheduler.admit(peer.remote("big", pages, 54), prompt(54, 2)) is ImportTarget.HOST
    job = d.scheduler.take_jobs()[0]
    assert len(job.host_blocks) == 14 and leased_host_blocks(d) == 14
    d.receiver.start(job)
    report = d.scheduler.update(d.receiver.poll())
    assert report.finished == ("big",)
    assert torch.equal(host_bytes(d, list(job.host_blocks)), peer.pages(pages))
    assert d.coord.first_resident_page("big") == 13  # 13 full pages on host, the partial tail is restored
    assert t.notices[-1][1].ok and t.live_reads == 0 and t.unsafe_cancels == []


def test_staged_import_is_bounded_by_the_staging_slots() -> None:
    page = BS * 656
    staging = StagingBuffer.allocate(2, 3 * page)
    d, t = decoder(staging=staging)
    peer = MemPrefill("p0", LAYERS, 40, BS)
    d.receiver.add_peer(peer.handshake)
    pa, _ = admit(d, peer, "a", 61, salt=1)
    pb, _ = admit(d, peer, "b", 50, salt=2)
    d.run_until(["a", "b"])
    assert sorted(d.finished) == ["a", "b"]
    assert t.max_in_flight_seen <= 2
    assert t.stats().reads_posted == -(-16 * LAYERS // 3) + -(-13 * LAYERS // 3)
    blocks = {rid: list(d.jobs[rid].host_blocks) for rid in ("a", "b")}
    assert torch.equal(host_bytes(d, blocks["a"]), peer.pages(pa))
    assert torch.equal(host_bytes(d, blocks["b"]), peer.pages(pb))
    assert staging.free_slots == 2
    with pytest.raises(InvalidInputError, match="cannot hold one 10496 B page"):
        d.receiver.add_peer(MemPrefill("p1", LAYERS, 4, 16).handshake)


def test_staged_import_through_device_slots_lands_exact_bytes() -> None:
    """Staging slots on an accelerator (`strict_device`: mixing its tensors with CPU tensors raises,
    as on CUDA): reads land in device memory and are copied into the host pool."""
    from strict_device import STRICT, enable

    page = BS * 656
    staging = StagingBuffer.allocate(2, 3 * page, device=enable())
    assert staging.tensor.device == STRICT and staging.mem_type == "VRAM"
    d, t = decoder(staging=staging)
    peer = MemPrefill("p0", LAYERS, 40, BS)
    d.receiver.add_peer(peer.handshake)
    pa, _ = admit(d, peer, "a", 61, salt=1)
    d.run_until(["a"])
    assert d.finished == ["a"] and staging.free_slots == 2
    assert torch.equal(host_bytes(d, list(d.jobs["a"].host_blocks)), peer.pages(pa))
    assert t.unsafe_cancels == [] and t.live_reads == 0


def test_cancel_waits_for_the_read_in_flight_then_releases_every_lease() -> None:
    d, t = decoder()
    peer = MemPrefill("p0", LAYERS, 40, BS)
    d.receiver.add_peer(peer.handshake)
    admit(d, peer, "a", 60)
    d.pump()
    t.hung.add("p0")  # the next request's read stays in flight
    admit(d, peer, "b", 57, salt=3)
    free_gpu_before = d.gpu.num_free_blocks
    d.pump()
    assert d.scheduler.cancel("b")
    for _ in range(3):
        d.pump()
    assert "b" not in d.failed and t.unsafe_cancels == []  # never cancelled under a live connection
    t.hung.discard("p0")
    d.pump()
    assert d.failed["b"] == "cancelled"
    assert leased_host_blocks(d) == 15  # only "a" (15 pages) holds host blocks
    assert d.gpu.num_free_blocks == free_gpu_before + 2  # b's hot buffer is back
    assert d.finished == ["a"] and t.live_reads == 0


def test_cancel_before_the_worker_started_releases_at_once() -> None:
    d, _ = decoder()
    peer = MemPrefill("p0", LAYERS, 40, BS)
    d.receiver.add_peer(peer.handshake)
    admit(d, peer, "a", 60)
    assert leased_host_blocks(d) == 15
    assert d.scheduler.cancel("a") and not d.scheduler.cancel("zzz")
    assert leased_host_blocks(d) == 0 and d.gpu.num_free_blocks == GPU_BLOCKS
    d.pump()
    assert d.failed == {"a": "cancelled before the worker started it"}


def test_timeout_disconnects_the_silent_peer_and_other_peers_keep_going() -> None:
    clock = FakeClock()
    d, t = decoder(clock=clock, timeout_s=2.0)
    slow, good = MemPrefill("slow", LAYERS, 40, BS), MemPrefill("good", LAYERS, 40, BS)
    d.receiver.add_peer(slow.handshake)
    d.receiver.add_peer(good.handshake)
    t.hung.add("slow")
    admit(d, slow, "s1", 50, salt=1)
    d.pump()
    clock.now += 1.5
    assert admit(d, slow, "s2", 44, salt=2)[1] is ImportTarget.HOST  # posted later, its peer is silent too
    assert admit(d, good, "g", 60, salt=3)[1] is ImportTarget.HOST
    d.pump()
    assert d.finished == ["g"]
    clock.now += 1.0  # s1 passes its deadline with a read in flight
    d.pump()
    assert "timed out after 2s with 0/" in d.failed["s1"]
    assert "stopped answering reads (request s1 timed out" in d.failed["s2"]
    assert t.peer("slow") is None and t.peer("good") is not None
    assert t.unsafe_cancels == [] and t.live_reads == 0
    assert leased_host_blocks(d) == 15  # only "g"


def test_failed_and_refused_reads_fail_only_their_request() -> None:
    d, t = decoder()
    bad, good = MemPrefill("bad", LAYERS, 40, BS), MemPrefill("good", LAYERS, 40, BS)
    d.receiver.add_peer(bad.handshake)
    d.receiver.add_peer(good.handshake)
    t.failing["bad"] = "NIXL transfer state ERR"
    admit(d, bad, "x", 50, salt=1)
    admit(d, good, "g", 50, salt=2)
    d.run_until(["x", "g"])
    assert d.failed == {"x": "read from 'bad' failed: NIXL transfer state ERR"}
    t.failing.clear()
    t.refusing["bad"] = "nixlNotFoundError: NIXL_ERR_NOT_FOUND"
    admit(d, bad, "y", 50, salt=4)
    d.run_until(["y"])
    assert d.failed["y"].startswith("read could not be posted: nixlNotFoundError")
    assert d.finished == ["g"] and leased_host_blocks(d) == 13


def test_out_of_range_and_unknown_peer_are_rejected_without_posting() -> None:
    d, t = decoder()
    peer = MemPrefill("p0", LAYERS, 20, BS)
    d.receiver.add_peer(peer.handshake)
    d.scheduler.admit(peer.remote("oob", list(range(7, 20)) + [20], 54), prompt(54, 1))
    d.scheduler.admit(MemPrefill("ghost", LAYERS, 20, BS).remote("ghost", list(range(14)), 54), prompt(54, 2))
    d.run_until(["oob", "ghost"])
    assert "DescriptorRangeError" in d.failed["oob"] and "prefill page 20" in d.failed["oob"]
    assert "no handshake from prefill engine 'ghost'" in d.failed["ghost"]
    assert t.stats().reads_posted == 0 and leased_host_blocks(d) == 0 and d.gpu.num_free_blocks == GPU_BLOCKS


def test_new_epoch_fails_imports_of_the_old_one_and_old_handshakes_are_stale() -> None:
    d, t = decoder()
    old = MemPrefill("p0", LAYERS, 40, BS, epoch=1)
    d.receiver.add_peer(old.handshake)
    t.hung.add("p0")
    admit(d, old, "old", 50, salt=1)
    d.pump()
    new = MemPrefill("p0", LAYERS, 40, BS, epoch=2)
    d.receiver.add_peer(new.handshake)
    t.hung.clear()
    d.pump()
    assert "stale handshake" in d.failed["old"] and "epoch 1 -> 2" in d.failed["old"]
    with pytest.raises(StaleHandshakeError, match="epoch 1, older than the held epoch 2"):
        d.receiver.add_peer(old.handshake)
    admit(d, old, "late", 50, salt=2)  # prefilled by the dead generation
    pn, _ = admit(d, new, "fresh", 50, salt=3)
    d.run_until(["late", "fresh"])
    assert "StaleHandshakeError" in d.failed["late"]
    assert d.finished == ["fresh"] and t.unsafe_cancels == [] and leased_host_blocks(d) == 13


def test_scheduler_rejects_reports_it_did_not_ship() -> None:
    d, _ = decoder()
    with pytest.raises(ProtocolError, match="no shipped host import"):
        d.scheduler.update(RecvReport(("nobody",)))
    with pytest.raises(ProtocolError, match="no shipped host import"):
        d.scheduler.update(RecvReport((), (FailedRecv("nobody", "x"),)))


def test_close_fails_open_imports_and_releases_everything() -> None:
    d, t = decoder()
    peer = MemPrefill("p0", LAYERS, 40, BS)
    d.receiver.add_peer(peer.handshake)
    t.hung.add("p0")
    admit(d, peer, "a", 60)
    d.pump()
    failed = d.close()
    assert [f.request_id for f in failed] == ["a"] and "shutting down" in failed[0].reason
    assert leased_host_blocks(d) == 0 and d.gpu.num_free_blocks == GPU_BLOCKS
    assert t.unsafe_cancels == [] and t.live_reads == 0
