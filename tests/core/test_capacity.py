"""Capacity is checked before anything is allocated: one `CapacityError` line with the figures, in
the capacity helpers, in every in-tree backend's `create_host_pool`, in the worker (for a backend
that would just allocate) and through `hisparse run` / `hisparse bench` (exit 2, no traceback)."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest
import torch

from hisparse_core import capacity
from hisparse_core.cli import main
from hisparse_core.errors import CapacityError
from hisparse_core.geometry import FP8_DS_MLA, RuntimeConfig
from hisparse_core.host_pool import HostPoolSpec
from hisparse_core.worker import CacheGroup, HiSparseWorker
from hisparse_reference_cpu.backend import ReferenceCpuBackend

GIB = 1 << 30


def test_available_host_memory_is_read() -> None:
    avail, total = capacity.available_host_bytes(), capacity.total_host_bytes()
    assert avail is not None and total is not None and 0 < avail <= total


def test_at_most_95_percent_of_the_available_ram_may_be_taken() -> None:
    avail = 10 * GIB
    capacity.check_host_memory(int(avail * 0.95), "a pool", available=avail)
    with pytest.raises(CapacityError) as info:
        capacity.check_host_memory(int(avail * 0.95) + 1, "a pool", available=avail)
    message = str(info.value)
    assert message.startswith(f"a pool needs 9.50 GiB ({int(avail * 0.95) + 1} B) of host RAM; 10.00 GiB is "
                              "available")
    assert "at most 95% of it (9.50 GiB) may be taken: lower the budget" in message and "\n" not in message


def test_shm_space_is_checked_against_the_folder(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    capacity.check_shm_space(1 << 20, "a shared pool", str(tmp_path))
    with pytest.raises(CapacityError, match=rf"a shared pool needs a .* file in {tmp_path}, which has .* free.*--shm-size"):
        capacity.check_shm_space(free + (1 << 30), "a shared pool", str(tmp_path))


def test_device_memory_of_the_cpu_is_host_ram() -> None:
    with pytest.raises(CapacityError, match="GPU KV needs 1.00 TiB .* of host RAM"):
        capacity.check_device_memory(torch.device("cpu"), 1 << 40, "GPU KV")
    capacity.check_device_memory(torch.device("cpu"), 1 << 20, "GPU KV")
    capacity.check_device_memory(torch.device("meta"), 1 << 60, "anything")  # not askable: not checked


@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared"])
def test_reference_cpu_refuses_a_pool_larger_than_the_ram_before_allocating(shared: bool) -> None:
    blocks = (1 << 40) // (2 * 64 * FP8_DS_MLA.row_bytes)  # just under 1 TiB: 1024.00 GiB
    spec = HostPoolSpec(num_layers=2, num_blocks=blocks, block_size=64, shared=shared,
                        name=f"capacity{os.getpid()}" if shared else None, world_size=2 if shared else 1)
    with pytest.raises(CapacityError, match=r"host pool 'capacity\d+' of|host pool of") as info:
        ReferenceCpuBackend().create_host_pool(spec)
    assert "1024.00 GiB" in str(info.value) and "lower the host pool budget" in str(info.value)
    assert not any(n.startswith(f"hisparse_capacity{os.getpid()}") for n in os.listdir("/dev/shm"))


def test_a_peer_maps_memory_rank_0_holds_so_nothing_is_checked() -> None:
    huge = HostPoolSpec(num_layers=2, num_blocks=1 << 30, block_size=64, shared=True, name="x", rank=1,
                        world_size=2)
    capacity.check_host_pool(huge)  # no error: a peer allocates nothing


def test_the_worker_checks_before_a_backend_that_would_just_allocate() -> None:
    calls: list[HostPoolSpec] = []

    class Careless(ReferenceCpuBackend):
        def create_host_pool(self, spec: HostPoolSpec):  # type: ignore[no-untyped-def]
            calls.append(spec)
            return super().create_host_pool(spec)

    group = CacheGroup(RuntimeConfig(max_batch_rows=1, max_requests=1, top_k=4, hot_rows=8, block_size=4,
                                     max_pages=2))
    with pytest.raises(CapacityError, match="host pool of .* needs 1024.00 GiB"):
        HiSparseWorker(Careless(), [group], host_pool_bytes=1 << 40)
    assert calls == []


def _twice_the_ram() -> int:
    avail = capacity.available_host_bytes()
    assert avail is not None
    return 2 * avail // GIB + 1


@pytest.mark.parametrize("command", ["run", "bench"])
def test_the_cli_turns_a_budget_that_does_not_fit_into_one_line(command: str) -> None:
    gib = _twice_the_ram()
    if command == "run":
        argv = ["run", "--host", f"{gib}GiB"]
    else:  # bench sizes its pool from the workload: 4 layers x pages of 64 rows of 656 B per request
        per_request = 4 * -(-100_000 // 64) * 64 * 656
        argv = ["bench", "--context", "100000", "--requests", str(gib * GIB // per_request + 1)]
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        assert main(["--log-level", "ERROR", *argv, "--backend", "reference_cpu", "--no-progress"]) == 2
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1, lines
    # Each names its own flags: run's --host (checked before torch), bench's --context and --requests.
    said = {"run": ("hisparse run: error: --host ", "lower --host to at most "),
            "bench": ("hisparse bench: error: the host pool of ", "lower --requests to at most ")}[command]
    assert lines[0].startswith(said[0]) and "of host RAM" in lines[0] and said[1] in lines[0], lines[0]
    assert "Traceback" not in err.getvalue() and out.getvalue() == ""
