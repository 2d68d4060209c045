"""P/D wire types: round trips, versioning, validation messages. No NIXL needed."""

from __future__ import annotations

import json
import os
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hisparse_core.errors import InvalidCommandError
from hisparse_core.pd.errors import StaleHandshakeError
from hisparse_core.pd.handshake import PD_PROTOCOL_VERSION, KvRegion, PrefillHandshake, RemotePrefill
from hisparse_core.pd.messages import FailedRecv, HostImportJob, ReadNotice, RecvReport


def handshake(**kw: object) -> PrefillHandshake:
    base: dict[str, object] = dict(
        engine_id="prefill-0", epoch=3, agent_name="agent-x", agent_metadata=os.urandom(64), block_size=64,
        row_format="fp8_ds_mla", row_bytes=656,
        regions=tuple(KvRegion(layer, 0x10000 + layer * 0x1000000, 100, 64 * 656) for layer in range(3)))
    base.update(kw)
    return PrefillHandshake(**base)  # type: ignore[arg-type]


def test_handshake_round_trips_through_json_bytes() -> None:
    hs = handshake()
    data = hs.to_bytes()
    json.loads(data)  # plain JSON
    back = PrefillHandshake.from_bytes(data)
    assert back == hs
    assert back.page_bytes == 64 * 656 and back.num_layers == 3 and back.num_pages == 100


@given(st.binary(min_size=1, max_size=300), st.integers(0, 2**40), st.lists(st.integers(1, 5000), min_size=1,
                                                                             max_size=6))
def test_handshake_round_trip_any_metadata(meta: bytes, epoch: int, pages: list[int]) -> None:
    regions = tuple(KvRegion(i, 4096 * (i + 1), n, 16 * 656 + 32 * i) for i, n in enumerate(pages))
    hs = handshake(agent_metadata=meta, epoch=epoch, block_size=16, regions=regions)
    assert PrefillHandshake.from_bytes(hs.to_bytes()) == hs


def test_handshake_from_another_version_is_stale() -> None:
    d = handshake().to_dict()
    d["version"] = PD_PROTOCOL_VERSION + 1
    with pytest.raises(StaleHandshakeError, match=f"version {PD_PROTOCOL_VERSION + 1}.*speaks version "
                                                  f"{PD_PROTOCOL_VERSION}"):
        PrefillHandshake.from_bytes(json.dumps(d).encode())
    del d["version"]
    with pytest.raises(StaleHandshakeError, match="version None"):
        PrefillHandshake.from_dict(d)


def test_handshake_rejects_malformed_input_by_name() -> None:
    with pytest.raises(InvalidCommandError, match="not a JSON document"):
        PrefillHandshake.from_bytes(b"\xff\x00")
    d = handshake().to_dict()
    d["kind"] = "something.else"
    with pytest.raises(InvalidCommandError, match="kind is 'something.else'"):
        PrefillHandshake.from_dict(d)
    d = handshake().to_dict()
    del d["regions"]
    with pytest.raises(InvalidCommandError, match="missing field 'regions'"):
        PrefillHandshake.from_dict(d)
    with pytest.raises(InvalidCommandError, match=r"regions\[1\] is for layer 2; expected layer 1"):
        handshake(regions=(KvRegion(0, 4096, 4, 64 * 656), KvRegion(2, 8192, 4, 64 * 656)))
    with pytest.raises(InvalidCommandError, match=r"regions\[1\] is an int; expected KvRegion"):
        handshake(regions=(KvRegion(0, 4096, 4, 64 * 656), 7))
    with pytest.raises(InvalidCommandError, match="page_stride=100 is smaller than a page"):
        handshake(regions=(KvRegion(0, 4096, 4, 100),))
    with pytest.raises(InvalidCommandError, match="mem_type is 'HBM'"):
        KvRegion(0, 4096, 4, 4096, mem_type="HBM")
    with pytest.raises(InvalidCommandError, match="epoch must be >= 0, got -1"):
        handshake(epoch=-1)
    with pytest.raises(StaleHandshakeError):
        handshake(version=0)


def test_remote_prefill_round_trip_and_checks() -> None:
    r = RemotePrefill("req-1", "prefill-0", 3, (7, 2, 9), 150)
    assert RemotePrefill.from_bytes(r.to_bytes()) == r
    with pytest.raises(InvalidCommandError, match="repeats a page"):
        RemotePrefill("req-1", "prefill-0", 3, (7, 7), 100)
    with pytest.raises(InvalidCommandError, match="num_tokens must be >= 1"):
        RemotePrefill("req-1", "prefill-0", 3, (7,), 0)
    d = r.to_dict()
    d["version"] = 99
    with pytest.raises(StaleHandshakeError, match="version 99"):
        RemotePrefill.from_dict(d)


def test_job_report_and_notice() -> None:
    r = RemotePrefill("req-1", "prefill-0", 3, (7, 2, 9), 150)
    job = HostImportJob(r, (4, 5, 6))
    assert HostImportJob.from_dict(json.loads(json.dumps(job.to_dict()))) == job
    with pytest.raises(InvalidCommandError, match="2 host blocks for 3 prefill pages"):
        HostImportJob(r, (4, 5))
    rep = RecvReport(("a",), (FailedRecv("b", "peer died"),))
    assert RecvReport.from_dict(json.loads(json.dumps(rep.to_dict()))) == rep
    with pytest.raises(InvalidCommandError, match="names a request twice"):
        RecvReport(("a",), (FailedRecv("a", "x"),))
    n = ReadNotice("req-1", ok=False)
    assert ReadNotice.from_bytes(n.to_bytes()) == n
    with pytest.raises(InvalidCommandError, match="not a read notice"):
        ReadNotice.from_bytes(b'{"kind": "nope"}')


def test_wire_modules_do_not_import_torch_or_nixl() -> None:
    import subprocess

    code = ("import sys, hisparse_core.pd, hisparse_core.pd.handshake, hisparse_core.pd.messages, "
            "hisparse_core.pd.importer; print(sorted(m for m in ('torch', 'nixl') if m in sys.modules)); "
            "import hisparse_core.pd.nixl_transport; print('nixl' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "False"]
