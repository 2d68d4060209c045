"""P/D host import over NIXL between two processes on loopback, then decoding through reference_cpu.

A prefill process fills real KV pages with fresh random bytes and serves them; this process is the
decoder: coordinator, reference_cpu host pool registered with NIXL as DRAM, receiver, scheduler.
After the import, the tail page is restored to a resident GPU block and resolving top-k positions
through `reference_cpu` must gather exactly the prefill side's bytes, host-backed and tail alike.
"""

from __future__ import annotations

import dataclasses
import random
import time

import pytest
import torch
from pd_decoder import Decoder, make_decoder, prompt
from pd_peer import PrefillPeer, wait_notices

from hisparse_core.coordinator import ImportTarget, StepRequest
from hisparse_core.geometry import RuntimeConfig
from hisparse_core.pd.handshake import PrefillHandshake, RemotePrefill
from hisparse_core.pd.nixl_transport import nixl_available
from hisparse_core.pd.receiver import ReceiverConfig
from hisparse_core.pd.staging import StagingBuffer
from hisparse_core.runtime import ResolveInputs
from hisparse_reference_cpu.backend import ReferenceCpuBackend

_NIXL = nixl_available()
pytestmark = [pytest.mark.nixl, pytest.mark.skipif(_NIXL is not None, reason=f"nixl unavailable: {_NIXL}")]

LAYERS, BS, PAGES, HOST_BLOCKS, GPU_BLOCKS, HOT, MAX_LEN, TOP_K = 3, 16, 48, 40, 8, 2, 256, 16
WIDTH = 656


def nixl_decoder(*, staging: StagingBuffer | None = None) -> Decoder:
    from hisparse_core.pd.nixl_transport import NixlDecoderTransport

    return make_decoder(lambda pool, stg: NixlDecoderTransport(pool, staging=stg), num_layers=LAYERS, block_size=BS,
                        host_blocks=HOST_BLOCKS, gpu_blocks=GPU_BLOCKS, max_model_len=MAX_LEN, hot_blocks=HOT,
                        staging=staging, receiver_config=ReceiverConfig(timeout_s=20.0))


def test_host_import_then_reference_cpu_decode_reads_the_prefill_bytes(prefill_peers: dict[str, PrefillPeer]) -> None:
    peer, engine = prefill_peers["main"], "dense"
    d = nixl_decoder()
    try:
        d.receiver.add_peer(PrefillHandshake.from_bytes(peer.handshakes[engine]))
        num_tokens = 203  # 12 full pages and an 11-token tail
        n_pages = -(-num_tokens // BS)
        pages = random.sample(range(PAGES), n_pages)
        tokens = prompt(num_tokens, 11)
        remote = RemotePrefill.from_bytes(peer.remote(engine, "a", pages, num_tokens))
        assert d.scheduler.admit(remote, tokens) is ImportTarget.HOST  # 13 pages > 8 free GPU blocks
        d.run_until(["a"])
        assert d.finished == ["a"] and d.failed == {}
        job = d.jobs["a"]
        expected = peer.pages(engine, pages)  # [layers, pages, BS, WIDTH] as the prefill process holds them
        for layer in range(LAYERS):
            host = d.pool.layer_view(layer).view(-1, BS, WIDTH)[list(job.host_blocks)]
            assert torch.equal(host, expected[layer]), f"layer {layer} host blocks differ from the prefill pages"

        # The engine schedules the first decode step: only the tail page gets a resident block.
        assert d.coord.first_resident_page("a") == n_pages - 1
        tail_block = d.gpu.acquire(1)[0]
        table = (tuple([0] * (n_pages - 1) + [tail_block]),)
        cmd = d.coord.schedule_step([StepRequest("a", 0, num_tokens, 1, tuple(tokens + [123]), table)])
        assert cmd is not None
        restores = [t for t in cmd.page_transfers if t.restore]
        assert [(t.host_block_id, t.resident_block_ids) for t in restores] == [(job.host_blocks[-1], (tail_block,))]
        updates = d.coord.take_table_updates()

        runtime = ReferenceCpuBackend().create_runtime(RuntimeConfig(
            max_batch_rows=1, max_requests=1, top_k=TOP_K, hot_rows=HOT * BS, block_size=BS,
            max_pages=MAX_LEN // BS, num_layers=LAYERS))
        device = [torch.randint(0, 256, (GPU_BLOCKS, BS, WIDTH), dtype=torch.uint8) for _ in range(LAYERS)]
        runtime.bind(d.pool.layer_views(), device)
        runtime.restore_pages(restores)

        max_pages = MAX_LEN // BS
        source = torch.full((1, max_pages), -1, dtype=torch.int32)
        resident = torch.full((1, max_pages), -1, dtype=torch.int32)
        hot = torch.full((1, HOT), -1, dtype=torch.int32)
        for u in updates:
            source[u.state_index, list(u.pages)] = torch.tensor(u.host_block_ids, dtype=torch.int32)
            if u.hot_block_ids:
                hot[u.state_index] = torch.tensor(u.hot_block_ids, dtype=torch.int32)
        for r in cmd.residency_updates:
            resident[r.state_index, list(r.pages)] = torch.tensor(r.block_ids[0], dtype=torch.int32)
        assert source[0, :n_pages].tolist() == list(job.host_blocks)
        assert resident[0, :n_pages].tolist() == [-1] * (n_pages - 1) + [tail_block]

        for _ in range(3):
            positions = random.sample(range(num_tokens - 11), TOP_K - 3) + random.sample(range(192, num_tokens), 3)
            res = runtime.resolve(ResolveInputs(
                torch.tensor([positions], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                torch.tensor([num_tokens + 1], dtype=torch.int32), source, resident, hot))
            runtime.replay_plan()
            rows = res.rows[0].tolist()
            assert res.valid_counts[0].item() == TOP_K
            for i, pos in enumerate(positions):
                page, off = divmod(pos, BS)
                if page == n_pages - 1:
                    assert rows[i] == tail_block * BS + off  # the restored tail page is resident
                for layer in range(LAYERS):
                    got = device[layer].view(-1, WIDTH)[rows[i]]
                    assert torch.equal(got, expected[layer, page, off]), (layer, pos)
        assert runtime.stats().misses > 0 and runtime.stats().resident > 0
        assert wait_notices(peer, engine, {"a"})["a"] is True  # the prefill side may free the pages
        assert "a" not in peer.call("outstanding", engine)
    finally:
        failed = d.close()
    assert failed == []
    assert d.transport.live_reads == 0 and d.transport.num_registrations == 0  # type: ignore[attr-defined]


def test_staged_imports_of_strided_pages_land_exactly(prefill_peers: dict[str, PrefillPeer]) -> None:
    peer, engine = prefill_peers["main"], "strided"
    page_bytes = BS * WIDTH
    staging = StagingBuffer.allocate(2, 4 * page_bytes)
    d = nixl_decoder(staging=staging)
    try:
        d.receiver.add_peer(PrefillHandshake.from_bytes(peer.handshakes[engine]))
        want = {}
        for i, (rid, num_tokens) in enumerate((("s1", 190), ("s2", 150))):
            pages = random.sample(range(PAGES), -(-num_tokens // BS))
            remote = RemotePrefill.from_bytes(peer.remote(engine, rid, pages, num_tokens))
            assert d.scheduler.admit(remote, prompt(num_tokens, 20 + i)) is ImportTarget.HOST
            want[rid] = pages
        d.run_until(want)
        assert sorted(d.finished) == ["s1", "s2"]
        for rid, pages in want.items():
            expected = peer.pages(engine, pages)
            for layer in range(LAYERS):
                host = d.pool.layer_view(layer).view(-1, BS, WIDTH)[list(d.jobs[rid].host_blocks)]
                assert torch.equal(host, expected[layer]), (rid, layer)
        stats = d.transport.stats()
        assert stats.reads_posted == -(-12 * LAYERS // 4) + -(-10 * LAYERS // 4)  # one slot-sized chunk per read
        assert staging.free_slots == 2
        notices = wait_notices(peer, engine, set(want))
        assert (notices["s1"], notices["s2"]) == (True, True)
    finally:
        d.close()
    assert d.transport.live_reads == 0 and d.transport.num_registrations == 0  # type: ignore[attr-defined]


def test_server_and_transport_in_one_process_guard_their_inputs() -> None:
    from hisparse_core.errors import InvalidInputError, ProtocolError
    from hisparse_core.geometry import FP8_DS_MLA
    from hisparse_core.host_pool import HostPoolSpec
    from hisparse_core.pd.messages import ReadNotice
    from hisparse_core.pd.nixl_transport import NixlDecoderTransport, NixlPrefillServer

    layers = [torch.randint(0, 256, (6, BS, WIDTH), dtype=torch.uint8) for _ in range(2)]
    with pytest.raises(InvalidInputError, match=r"kv_layers\[0\] must be \[num_pages, 16, 656\]"):
        NixlPrefillServer("p", 1, [layers[0][:, :8]], block_size=BS, row_format=FP8_DS_MLA)
    server = NixlPrefillServer("p", 1, layers, block_size=BS, row_format=FP8_DS_MLA)
    pool = ReferenceCpuBackend().create_host_pool(HostPoolSpec(2, 8, BS))
    transport = NixlDecoderTransport(pool)
    try:
        assert server.num_registrations == 2 and transport.num_registrations == 1
        with pytest.raises(InvalidInputError, match="pages \\[6\\] beyond the 6 registered pages"):
            server.remote_prefill("r0", [1, 6], 20)
        server.remote_prefill("r1", [4, 5], 20)
        hs = server.handshake()
        assert transport.add_peer(hs) is None and transport.add_peer(hs) is None  # idempotent
        with pytest.raises(ProtocolError, match="differs from the one held"):
            transport.add_peer(dataclasses.replace(hs, agent_name="someone-else"))
        outside = [(pool.layer_view(0).data_ptr() - 4096, BS * WIDTH, 0)]
        with pytest.raises(InvalidInputError, match="outside every region"):
            transport.post_read("p", outside, [(hs.regions[0].page_address(0), BS * WIDTH, 0)])
        local = [(pool.layer_view(1).data_ptr() + 3 * BS * WIDTH, BS * WIDTH, 0)]
        handle = transport.post_read("p", local, [(hs.regions[1].page_address(5), BS * WIDTH, 0)])
        deadline = time.monotonic() + 10
        while transport.check(handle).state.value == "in_flight" and time.monotonic() < deadline:
            transport.progress()
        assert transport.check(handle).state.value == "done" and transport.release(handle)
        assert torch.equal(pool.layer_view(1).view(-1, BS, WIDTH)[3], layers[1][5])
        assert transport.notify("p", ReadNotice("r1", ok=True))
        deadline = time.monotonic() + 10
        while server.outstanding and time.monotonic() < deadline:
            server.progress()
            transport.progress()
        assert server.take_notices() == [ReadNotice("r1", ok=True)] and server.outstanding == frozenset()
    finally:
        transport.close()
        server.close()
        server.close()
    assert transport.num_registrations == 0 and transport.live_reads == 0 and server.num_registrations == 0
