"""The rank processes of `bench/bench_tp_shared.py` (spawned; one per tensor-parallel rank).

A rank talks to the parent over one pipe. In the main run both ranks walk the same list of tags
(`tp_shared_support.main_plan`): before each tag a rank does that tag's work, then reports the
tag with its results and waits for the parent's go (which the parent gives once both ranks are
there). Fault runs only meet at "setup"; then the victim asks to be killed at its chosen point
and the survivor reports, in one line, how it learned that its peer died.

Rank 0 creates and writes every shared pool; rank 1 maps it, registers its own mapping on its
own device and reads after rank 0's writes: on the NVIDIA backend through rank 0's CUDA IPC event
(`NvidiaTransferEngine.wait_for_host_writes`), on reference_cpu (synchronous copies) through a
step counter rank 0 bumps after submitting its writes.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
from tp_shared_cost import CostShape, SwapIn, fill_random
from tp_shared_support import SWAP_IN_BATCHES, main_plan, mapping_memory, process_memory
from tp_shared_workload import Executor, Schedule, WorkloadShape, compare

from hisparse_core import shm
from hisparse_core.errors import HiSparseError, ProtocolError
from hisparse_core.geometry import RuntimeConfig
from hisparse_core.host_pool import OS_PAGE, HostPoolSpec
from hisparse_core.runtime import ResolveInputs
from hisparse_core.types import PageTransfer, RowMirror
from hisparse_reference_cpu.backend import ReferenceCpuBackend

#: Rank 1 waits this long after learning that rank 0 died before it calls its stuck reads lost
#: (a write that was about to land gets the chance to).
DEAD_WRITER_GRACE_S = 2.0


@dataclass(frozen=True, slots=True)
class Fault:
    """Kill `victim` at step `at_step`: "mid-step" (rank 1, its reads enqueued behind rank 0's IPC
    event), "before-publish" (rank 0, forward done, its host writes not submitted) or "in-flight"
    (rank 0, its host writes published but held back on the GPU). The survivor runs `extra_steps`
    more steps where it can."""

    victim: int
    kind: str
    at_step: int = 3
    extra_steps: int = 2


@dataclass(frozen=True, slots=True)
class RankJob:
    rank: int
    backend: str  # "nvidia" or "reference_cpu"
    device: int | None
    pools: dict[str, str]  # part -> shared pool name
    parts: tuple[str, ...] = ()
    steps: int = 24
    seed: int = 20
    cost: CostShape | None = None
    memory_mib: int = 64  # the memory part's pool on the CPU backend
    fault: Fault | None = None
    delay_s: float = 0.75  # GPU time rank 0's held-back copies wait (parts b, e)
    timeout_s: float = 120.0

    @property
    def gpu(self) -> bool:
        return self.backend == "nvidia"


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


class Link:
    """This rank's end of the pipe to the parent."""

    def __init__(self, conn: Connection, rank: int) -> None:
        self.conn = conn
        self.rank = rank

    def send(self, kind: str, *items: Any) -> None:
        self.conn.send((kind, self.rank, *items))

    def sync(self, tag: str, payload: Any = None) -> Any:
        self.send("at", tag, payload)
        msg = self.conn.recv()
        if msg[0] != "go" or msg[1] != tag:
            raise ProtocolError(f"rank {self.rank} waited for the parent's go of {tag!r}, got {msg[:2]!r}")
        return msg[2]


# ----------------------------------------------------------------------------- the rank's device


class RankEnv:
    """The rank's backend on its device, and the reference it is checked against."""

    def __init__(self, job: RankJob) -> None:
        self.job = job
        self.rank = job.rank
        self.oracle_backend = ReferenceCpuBackend(completion_lag=0)
        if job.gpu:
            from hisparse_nvidia.backend import NvidiaBackend

            assert job.device is not None
            torch.cuda.set_device(job.device)  # as a TP worker does: every later default is this GPU
            self.backend: Any = NvidiaBackend(job.device)
        else:
            self.backend = ReferenceCpuBackend(completion_lag=1)
        self.device = self.backend.device

    def describe(self) -> dict:
        c = shm.Creator.current()
        out: dict[str, Any] = {"rank": self.rank, "pid": c.pid, "creator": (c.pid, c.start, c.pidns),
                               "device": str(self.device)}
        if self.job.gpu:
            out.update(gpu_identity(self.device))
        return out

    def gpu_sleep(self, seconds: float) -> None:
        """Hold this rank's current stream for about `seconds` of GPU time (torch.cuda._sleep)."""
        from cuda.bindings import driver as cu

        from hisparse_nvidia import driver

        khz = driver.device_attribute(self.device, cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CLOCK_RATE)
        torch.cuda._sleep(int(seconds * khz * 1000))


def gpu_identity(device: torch.device) -> dict:
    """Name, PCI bus id and NUMA node of a GPU (what the cost figures depend on)."""
    from cuda.bindings import driver as cu

    from hisparse_nvidia import driver

    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(device)}
    try:
        driver.ensure_context(device)
        dev = driver.check("cuDeviceGet", cu.cuDeviceGet(device.index))
        bus = driver.check("cuDeviceGetPCIBusId", cu.cuDeviceGetPCIBusId(16, dev))
        bus = bus.decode().rstrip("\0") if isinstance(bus, bytes) else str(bus)
        out["pci_bus_id"] = bus
        with open(f"/sys/bus/pci/devices/{bus.lower()}/numa_node") as f:
            out["numa_node"] = int(f.read())
    except (OSError, ValueError, HiSparseError):
        pass
    return out


def active_contexts() -> list[int]:
    """CUDA devices on which this process holds an active primary context."""
    from cuda.bindings import driver as cu

    from hisparse_nvidia import driver

    active = []
    for i in range(torch.cuda.device_count()):
        dev = driver.check("cuDeviceGet", cu.cuDeviceGet(i))
        _flags, state = driver.check("cuDevicePrimaryCtxGetState", cu.cuDevicePrimaryCtxGetState(dev))
        if state:
            active.append(i)
    return active


# ----------------------------------------------------------------------------- read ordering


class GpuOrdering:
    """NVIDIA: every rank orders its reads with `wait_for_host_writes` (a peer: on rank 0's IPC
    event); a peer waits for its step's GPU work by polling, so that rank 0's death while the
    reads wait on its event is reported instead of hanging."""

    after_writes = None

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    def before_reads(self, ex: Executor, step: int) -> None:
        ex.engine.wait_for_host_writes()

    def settle(self, ex: Executor, step: int) -> None:
        if ex.pool.is_writer:
            return
        channel = ex.pool.channel
        event = torch.cuda.Event()
        event.record()
        now = time.monotonic()
        deadline, dead_at = now + self.timeout_s, None
        while not self._query(event, channel, step):
            now = time.monotonic()
            if channel is not None and channel.writer_dead():
                dead_at = now if dead_at is None else dead_at
                if now - dead_at > DEAD_WRITER_GRACE_S:
                    raise channel.writer_died(f"this rank's reads of step {step} waited on its IPC event (its "
                                              f"host-pool writes never landed)")
            if now > deadline:
                raise ProtocolError(f"the reads of step {step} did not finish in {self.timeout_s}s")
            time.sleep(0.001)


    @staticmethod
    def _query(event: torch.cuda.Event, channel: Any, step: int) -> bool:
        try:
            return bool(event.query())
        except RuntimeError as exc:  # the stream failed: say so in the peer's terms when rank 0 is gone
            if channel is not None and channel.writer_dead():
                raise channel.writer_died(f"this rank's reads of step {step} waited on its IPC event and failed "
                                          f"({one_line(exc)})") from exc
            raise


class CpuOrdering:
    """reference_cpu copies at submission: rank 0 bumps a shared step counter after submitting a
    step's host writes, and rank 1 waits for the previous step's before it reads (failing fast,
    as the NVIDIA peer does, when rank 0's process is gone)."""

    def __init__(self, rank: int, published: Any, creator: shm.Creator | None, timeout_s: float) -> None:
        self.rank = rank
        self.published = published
        self.creator = creator
        self.timeout_s = timeout_s

    def after_writes(self, ex: Executor, step: int) -> None:
        if self.rank == 0:
            self.published.value = step

    def before_reads(self, ex: Executor, step: int) -> None:
        if self.rank == 0:
            return
        need = step - 1
        deadline, next_look = time.monotonic() + self.timeout_s, 0.0
        while self.published.value < need:
            now = time.monotonic()
            if now > next_look:
                next_look = now + 0.1
                if self.creator is not None and self.creator.state() == "dead":
                    raise ProtocolError(f"rank 0 ({self.creator.describe()}) died before publishing the host-pool "
                                        f"writes of step {need} (it published step {self.published.value}): restart "
                                        "the deployment (every rank)")
            if now > deadline:
                raise ProtocolError(f"waited {self.timeout_s}s for rank 0 to publish the host-pool writes of step "
                                    f"{need}")
            time.sleep(0.0005)

    def settle(self, ex: Executor, step: int) -> None:
        pass


# ----------------------------------------------------------------------------- part a (and faults)


class WorkloadRun:
    """Part a's workload on this rank: the shared pool, the rank's executor and its reference."""

    def __init__(self, env: RankEnv, name: str, published: Any) -> None:
        self.env, self.name, self.published = env, name, published
        self.shape = WorkloadShape()
        self.figures: list[dict] = []
        job, s = env.job, self.shape
        self.schedule = Schedule(s, job.seed)
        self.pool = env.backend.create_host_pool(s.pool_spec(shared=True, name=self.name, rank=env.rank,
                                                             world_size=2))
        self.oracle_pool = env.oracle_backend.create_host_pool(s.pool_spec())
        if job.gpu:
            self.ordering: Any = GpuOrdering(job.timeout_s)
        else:
            file = self.pool.shm_file
            self.ordering = CpuOrdering(env.rank, self.published, file.creator if env.rank else None, job.timeout_s)
        self.subject = Executor(env.backend, self.pool, s, job.seed, graph=job.gpu,
                                before_reads=self.ordering.before_reads, after_writes=self.ordering.after_writes)
        self.oracle = Executor(env.oracle_backend, self.oracle_pool, s, job.seed, graph=False, validate=True)
        self.step = -1
        self.started = time.monotonic()

    def run_step(self, *, before_mirrors: Callable[[], None] | None = None,
                 after_submit: Callable[[], None] | None = None) -> dict:
        sch = self.schedule
        before = list(sch.lengths) if self.step >= 0 else [0] * self.shape.requests
        plan = sch.prefill() if self.step < 0 else sch.next_step()
        self.step = plan.step
        self.subject.run(plan, sch, before_mirrors=before_mirrors, after_submit=after_submit)
        self.oracle.run(plan, sch)
        self.ordering.settle(self.subject, plan.step)
        # Rank 0 checks every host row written so far; a peer those of earlier steps (it has waited
        # for them, not yet for this step's).
        lengths = list(sch.lengths) if self.env.rank == 0 else before
        fig = compare(self.subject, self.oracle, plan, writer=self.env.rank == 0, host_lengths=lengths)
        self.figures.append(fig)
        return fig

    def finish(self) -> dict:
        self.subject.finish()
        self.oracle.finish()
        done = self.subject.completed
        spills = self.schedule.spills_submitted
        if sorted(done) != list(range(1, spills + 1)) or done != sorted(done):
            raise AssertionError(f"the {spills} spills were reported completed as {done[:12]}...; expected each once, "
                                 "in submission order")
        st = self.subject.rt.stats()
        steps = [f for f in self.figures if f["step"] > 0]
        return {"steps": len(steps), "graph": self.subject.graph is not None, "spills": spills,
                "released_pages": self.schedule.released_pages,
                "gathered_entries": sum(f["gathered_entries"] for f in steps),
                "gathered_bytes": sum(f["gathered_bytes"] for f in steps), "digests": [f["digest"] for f in steps],
                "hits": st.hits, "misses": st.misses, "resident": st.resident, "h2d_bytes": st.h2d_bytes,
                "d2h_bytes": st.d2h_bytes, "seconds": time.monotonic() - self.started}

    def release(self) -> None:
        for ex in (self.subject, self.oracle):
            ex.graph = None
        self.pool.release()
        self.oracle_pool.release()


# ----------------------------------------------------------------------------- part b


class DelayedWrite:
    """Rank 0's copy held back on its GPU; rank 1 must wait for it (`nvidia_ipc_ranks.py`'s check,
    on the ranks' own devices)."""

    BS = 16
    HOST_BLOCK, SOURCE_BLOCK, TRANSFER = 2, 5, 7

    def __init__(self, env: RankEnv) -> None:
        bs = self.BS
        self.env = env
        self.cfg = RuntimeConfig(max_batch_rows=1, max_requests=1, top_k=bs, hot_rows=2 * bs, block_size=bs,
                                 max_pages=8)
        spec = HostPoolSpec(num_layers=1, num_blocks=8, block_size=bs, shared=True, name=env.job.pools["b"],
                            rank=env.rank, world_size=2)
        self.old = torch.randint(0, 256, (bs, 656), dtype=torch.uint8, generator=torch.Generator().manual_seed(98))
        self.new = torch.randint(0, 256, (bs, 656), dtype=torch.uint8, generator=torch.Generator().manual_seed(99))
        self.pool = env.backend.create_host_pool(spec)
        self.cache = torch.zeros((8, bs, 656), dtype=torch.uint8, device=env.device)
        self.rt = env.backend.create_runtime(self.cfg)
        self.rt.bind(self.pool.layer_views(), [self.cache])
        self.engine = env.backend.create_transfer_engine(self.pool, [self.rt])
        if env.rank == 0:
            self.host()[:] = self.old
            self.cache[self.SOURCE_BLOCK].copy_(self.new.to(env.device))
            torch.cuda.synchronize()

    def host(self) -> torch.Tensor:
        bs = self.BS
        return self.pool.layer_view(0).view(torch.uint8)[self.HOST_BLOCK * bs:(self.HOST_BLOCK + 1) * bs]

    def submit(self) -> None:
        bs = self.BS
        self.engine.submit_row_mirrors([RowMirror((self.SOURCE_BLOCK * bs,), self.HOST_BLOCK * bs, bs)])
        self.engine.submit_pages([PageTransfer(self.TRANSFER, self.HOST_BLOCK + 1, (self.SOURCE_BLOCK,))])

    def write_delayed(self) -> dict:
        self.env.gpu_sleep(self.env.job.delay_s)  # everything the copy stream runs next waits behind it
        self.submit()
        return {"submitted_at": time.monotonic()}

    def read(self) -> dict:
        bs, dev = self.BS, self.env.device
        self.submit()  # the same commands reach every rank; a peer writes nothing
        i32 = torch.int32
        inputs = ResolveInputs(
            torch.arange(self.HOST_BLOCK * bs, (self.HOST_BLOCK + 1) * bs, dtype=i32, device=dev)[None],
            torch.zeros(1, dtype=i32, device=dev), torch.full((1,), 8 * bs, dtype=i32, device=dev),
            torch.arange(8, dtype=i32, device=dev)[None], torch.full((1, 8), -1, dtype=i32, device=dev),
            torch.tensor([[0, 1]], dtype=i32, device=dev))
        self.engine.wait_for_host_writes()  # a GPU-side wait on rank 0's IPC event
        out = self.rt.resolve(inputs, validate=False)
        enqueued = time.monotonic()
        stale = bool(torch.equal(self.host().clone(), self.old))
        done = torch.cuda.Event()
        done.record()
        while not done.query():
            if time.monotonic() - enqueued > self.env.job.timeout_s:
                raise ProtocolError(f"rank 1's read did not finish in {self.env.job.timeout_s}s")
            time.sleep(0.0005)
        finished = time.monotonic()
        got = self.cache.view(-1, 656)[out.rows[0].long()].cpu()
        progress = self.engine.drain()
        return {"stale_when_enqueued": stale, "read_new": bool(torch.equal(got, self.new)),
                "waited_ms": (finished - enqueued) * 1000.0, "completed": list(progress.completed),
                "enqueued_at": enqueued}

    def release(self) -> None:
        self.pool.release()


# ----------------------------------------------------------------------------- parts c and d


def touch_pages(pool: Any) -> int:
    """Read one byte of every page of the pool on the CPU (so the whole pool is resident in this
    rank's own mapping however the backend mapped it); returns their sum."""
    return sum(int(v.view(torch.uint8).view(-1)[::OS_PAGE].sum()) for v in pool.layer_views())


def file_bytes(spec: HostPoolSpec) -> int:
    return OS_PAGE + -(-spec.nbytes // OS_PAGE) * OS_PAGE


class MainRank:
    """The main run of one rank: the work done before each tag of `main_plan`."""

    def __init__(self, env: RankEnv, link: Link, published: Any) -> None:
        self.env = env
        self.link = link
        self.published = published
        self.rank = env.rank
        self.go: dict[str, Any] = {}
        self.delayed: DelayedWrite | None = None
        self.workload: WorkloadRun | None = None
        self.swap: SwapIn | None = None
        self.pool: Any = None
        self.pool_info: dict[str, Any] = {}

    def run(self) -> None:
        job = self.env.job
        for tag in main_plan(job.parts, job.gpu):
            payload = self.work(tag)
            self.go[tag] = self.link.sync(tag, payload)

    def work(self, tag: str) -> Any:  # noqa: C901 - one branch per tag, in plan order
        env, rank, job = self.env, self.rank, self.env.job
        if tag == "setup":
            return env.describe()
        if tag == "a:done":
            self.workload = WorkloadRun(env, job.pools["a"], self.published)
            for _ in range(job.steps + 1):
                self.workload.run_step()
            return self.workload.finish()
        if tag == "a:released":  # rank 1 is done with rank 0's IPC event: it may go now
            assert self.workload is not None
            self.workload.release()
            self.workload = None
            gc.collect()
            return None
        if tag == "b":
            self.delayed = DelayedWrite(env)
            return None
        if tag == "b_submitted":
            assert self.delayed is not None
            return self.delayed.write_delayed() if rank == 0 else None
        if tag == "b:done":
            assert self.delayed is not None
            out = self.delayed.read() if rank == 1 else {"completed": list(self.delayed.engine.drain().completed)}
            return out
        if tag == "b:released":
            assert self.delayed is not None
            self.delayed.release()
            self.delayed = None
            gc.collect()
            return None
        if tag.startswith("d_private") and tag.endswith(":done"):
            owner = int(tag[len("d_private")])
            return self.private_baseline() if owner == rank else None
        if tag == "c_mapped":
            return self.shared_pool()
        if tag == "c_measure":  # both ranks hold the whole pool now
            return {**self.pool_info, "mapping": mapping_memory(self.pool.layer_view(0).data_ptr()).as_dict(),
                    "process": process_memory()}
        if tag.startswith("d_") and tag.endswith(":done") and self.swap is not None:
            _, batch, phase = tag[:-len(":done")].split("_")
            start_at = self.go[tag[:-len(":done")]]
            if phase in ("both", f"alone{rank}"):
                out = {"plain": self.swap.time(int(batch), ordered=False, start_at=start_at)}
                if phase != "both":
                    out["ordered"] = self.swap.time(int(batch), ordered=True)
                return out
            return None
        if tag == "end":
            if self.pool is not None:
                self.swap = None
                self.pool.release()
                self.pool = None
            gc.collect()
            return {"active_contexts": active_contexts()} if job.gpu else {}
        return None

    def private_baseline(self) -> dict:
        """The one-process, one-GPU figure: a private pool of the same geometry on this GPU."""
        env, cost = self.env, self.env.job.cost
        assert cost is not None
        before = process_memory()
        pool = env.backend.create_host_pool(cost.pool_spec())
        fill_random(pool, env.device)
        swap = SwapIn(env.backend, pool, cost, env.job.seed)
        swap.publish_one_write(pool.spec.rows_per_layer - 1)
        after = process_memory()
        out = {b: {"plain": swap.time(b, ordered=False), "ordered": swap.time(b, ordered=True)} for b in SWAP_IN_BATCHES}
        del swap
        pool.release()
        gc.collect()
        return {"timings": out, "rss_growth": after.get("VmRSS", 0) - before.get("VmRSS", 0),
                "pool_bytes": cost.pool_spec().nbytes}

    def shared_pool(self) -> None:
        """Map (rank 0: create and fill) the shared pool of parts c and d, and touch all of it."""
        env, job = self.env, self.env.job
        before = process_memory()
        if job.gpu:
            assert job.cost is not None
            spec = job.cost.pool_spec(shared=True, name=job.pools["c"], rank=self.rank)
        else:
            blocks = (job.memory_mib << 20) // (64 * 656)
            spec = HostPoolSpec(num_layers=1, num_blocks=blocks, block_size=64, shared=True, name=job.pools["c"],
                                rank=self.rank, world_size=2)
        t = time.monotonic()
        self.pool = env.backend.create_host_pool(spec)
        mapped_s = time.monotonic() - t
        if self.rank == 0:
            if job.gpu:
                fill_random(self.pool, env.device)
            else:
                view = self.pool.layer_view(0).view(torch.uint8).view(-1)
                gen = torch.Generator().manual_seed(job.seed)
                for off in range(0, view.numel(), 16 << 20):
                    n = min(16 << 20, view.numel() - off)
                    view[off:off + n] = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        touch_pages(self.pool)
        if job.gpu and "d" in job.parts:
            assert job.cost is not None
            self.swap = SwapIn(env.backend, self.pool, job.cost, job.seed)
            self.swap.publish_one_write(spec.rows_per_layer - 1)  # rank 0 writes it; rank 1 counts the epoch
        self.pool_info = {"process_before": before, "file_bytes": file_bytes(spec), "pool_bytes": spec.nbytes,
                          "map_register_s": mapped_s}
        return None


# ----------------------------------------------------------------------------- part e


class FaultRank:
    """One rank of a fault run (see `Fault`)."""

    def __init__(self, env: RankEnv, link: Link, published: Any) -> None:
        self.env = env
        self.link = link
        self.published = published
        fault = env.job.fault
        assert fault is not None
        self.fault = fault
        self.detected: str | None = None

    def kill_me(self, where: str) -> None:
        if self.env.job.gpu:
            done = torch.cuda.Event()
            done.record()
            where += f" (its GPU work {'done' if done.query() else 'still in flight'})"
        self.link.send("kill-me", where)
        time.sleep(120)  # the parent's SIGKILL ends this
        raise ProtocolError(f"rank {self.env.rank} asked to be killed ({where}) and was not")

    def run(self, peer: shm.Creator) -> None:
        env, f = self.env, self.fault
        run = WorkloadRun(env, env.job.pools["e"], self.published)
        total = f.at_step + f.extra_steps
        try:
            while run.step < total:
                s = run.step + 1
                before, after = None, None
                if env.rank == f.victim and s == f.at_step:
                    if f.kind == "mid-step":
                        how = ("are enqueued behind rank 0's IPC event" if env.job.gpu else
                               "ran after rank 0's writes")
                        before = lambda s=s, how=how: self.kill_me(  # noqa: E731
                            f"rank 1 mid-step {s}: its resolve and gathers {how}, the step not finished")
                    elif f.kind == "before-publish":
                        before = lambda s=s: self.kill_me(  # noqa: E731
                            f"rank 0 mid-step {s}: its forward rows are written and its resolve ran; the step's "
                            "host writes are not submitted")
                    else:  # in-flight
                        before = lambda: env.gpu_sleep(max(2.0, env.job.delay_s))  # noqa: E731
                        after = lambda s=s: self.kill_me(  # noqa: E731
                            f"rank 0 mid-step {s}: the step's host-write epoch is published, its copies held "
                            "back on the GPU")
                elif env.rank == 0 and f.victim == 1 and s == f.at_step - 1 and env.job.gpu:
                    # Rank 1's reads of the next step wait on these held-back copies: its GPU work is
                    # in flight when it is killed.
                    before = lambda: env.gpu_sleep(max(1.5, env.job.delay_s))  # noqa: E731
                elif env.rank == 0 and f.victim == 1 and s == f.at_step:
                    after = lambda s=s: self._watch(peer, s)  # noqa: E731
                run.run_step(before_mirrors=before, after_submit=after)
            if env.rank == 0:
                out = run.finish()
                run.release()
                gc.collect()
                self.link.send("survivor", f"rank 0: {self.detected}; it ran steps {f.at_step}..{total} on, bit-exact "
                               "against reference_cpu, and released the pool",
                               {"steps": out["steps"], "detected_at_step": f.at_step})
                return
            raise ProtocolError(f"rank 1 ran all {total} steps although rank 0 was killed at step {f.at_step}")
        except HiSparseError as exc:
            if env.rank == f.victim:
                raise
            # The peer's report; then it ends as a worker that hit this error would (no release:
            # the interpreter's exit takes the mapping, the name is long gone).
            self.link.send("survivor", f"rank 1 at step {run.step}: {one_line(exc)}", {"step": run.step})
            self.link.conn.close()
            os._exit(3)

    def _watch(self, peer: shm.Creator, step: int) -> None:
        """Rank 0 learns of a dead peer from its pid and start time (a deployment's engine watchdog
        plays this part); it never waits on a peer otherwise."""
        deadline = time.monotonic() + 30.0
        while peer.state() != "dead":
            if time.monotonic() > deadline:
                raise ProtocolError(f"rank 1 ({peer.describe()}) was not killed within 30 s of step {step}")
            time.sleep(0.01)
        self.detected = (f"rank 1 ({peer.describe()}) died mid-step {step} (seen from its pid and start time; rank 0 "
                         "never waits on a peer)")


# ----------------------------------------------------------------------------- entry


def rank_main(job: RankJob, conn: Connection, published: Any) -> None:
    """Entry of a rank process (spawned by bench_tp_shared.py)."""
    link = Link(conn, job.rank)
    try:
        env = RankEnv(job)
        if job.fault is not None:
            go = link.sync("setup", env.describe())
            FaultRank(env, link, published).run(shm.Creator(*go["peer"]))
        else:
            MainRank(env, link, published).run()
        link.send("exit")
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then this rank ends
        try:
            link.send("error", one_line(exc), traceback.format_exc())
        except OSError:
            pass
        sys.exit(1)
