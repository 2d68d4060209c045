"""The rank processes of the tensor-parallel tests (spawned, one per rank; torch.distributed).

Each rank loads the saved tiny model with transformers' own `tp_plan="auto"` (q_b_proj, kv_b_proj
and the MLPs split across the ranks, the MLA latent and the indexer replicated), enables hisparse
(tensor parallel: detected from the tp_plan) and runs the scenarios it is given, in order; each
scenario's result (or its error's one line) goes back to the parent through its pipe
(`run_ranks`, in the test process, starts both ranks and collects what they send).
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import signal
import socket
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any


@dataclass(frozen=True)
class Scenario:
    name: str
    enable: dict[str, Any]                      # enable() keyword arguments (both ranks)
    rank1: dict[str, Any] = field(default_factory=dict)   # rank 1's overrides (a disagreement)
    generate: bool = True
    kill_rank: int | None = None                # this rank kills itself (SIGKILL) at its `kill_step`-th step
    kill_step: int = 0


def _killer(at_step: int) -> Any:
    """An `on_step` callback that kills this process with SIGKILL after its `at_step`-th step."""
    steps = [0]

    def on_step(handle: Any, step: Any) -> None:
        steps[0] += 1
        if steps[0] == at_step:
            os.kill(os.getpid(), signal.SIGKILL)

    return on_step


def run_rank(rank: int, world: int, port: int, path: str, backend: str, device: str, scenarios: list[Scenario],
             prompts: tuple[Any, Any], new: int, chunk: int, results: Any, tp_plan: bool = True) -> None:
    """`results`: this rank's end of a pipe (a `Connection`; no lock a killed rank could hold).

    `device` "cpu" (gloo) or "cuda". `tp_plan`: load with transformers' `tp_plan="auto"` (on CUDA:
    NCCL, rank r on GPU r); False: every rank runs the whole model (the ranks of one GPU, gloo for
    hisparse's exchange; the scenarios pass `tp=True`)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    dist_backend = "nccl" if device == "cuda" and tp_plan else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank if tp_plan else 0)
    dist.init_process_group(dist_backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        import transformers

        import hisparse_transformers

        if tp_plan:
            model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
        model.eval()
        dev = next(model.parameters()).device
        ids, mask = (t.to(dev) for t in prompts)
        for sc in scenarios:
            kw = dict(sc.enable, backend=backend)
            if rank == 1:
                kw.update(sc.rank1)
            out: dict[str, Any] = {"rank": rank, "scenario": sc.name}
            try:
                with hisparse_transformers.enable(model, **kw) as hs:
                    if sc.kill_rank == rank:
                        hs.on_step = _killer(sc.kill_step)
                    worker = hs.engine.worker
                    pool = worker.host_pool
                    f = getattr(pool, "shm_file", None) or getattr(pool, "_file", None)  # nvidia keeps it private
                    out.update(shared=worker.host_pool_spec.shared, writer=pool.is_writer,
                               pool_name=worker.host_pool_spec.name, inode=f.inode if f is not None else None,
                               linked=f.linked if f is not None else None)
                    if sc.generate:
                        gen = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                             output_logits=True, return_dict_in_generate=True, prefill_chunk_size=chunk)
                        s = hs.stats()
                        out.update(tokens=gen.sequences.cpu().tolist(),
                                   logits=[x.float().cpu().numpy() for x in gen.logits], misses=s.misses,
                                   lost=s.lost_pages, released=s.released_pages, h2d=s.h2d_bytes,
                                   host_pool_bytes=s.host_pool_bytes, d2h=s.d2h_bytes)
            except Exception as exc:  # noqa: BLE001 - the parent asserts on the one line
                out["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                out["lines"] = len(str(exc).strip().splitlines())
            results.send(out)
    except Exception:  # noqa: BLE001
        results.send({"rank": rank, "scenario": "crash", "error": traceback.format_exc()})
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(path: str, scenarios: list[Scenario], prompts: tuple[Any, Any], *,
              backend: str = "reference_cpu", device: str = "cpu", tp_plan: bool = True, new: int = 6,
              chunk: int = 16, timeout_s: float = 240.0) -> list[dict[str, Any]]:
    """Both ranks (`tp_ranks.run_rank`) through every scenario; their results, in arrival order."""
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [ctx.Process(target=run_rank, args=(r, 2, port, path, backend, device, scenarios, prompts, new, chunk,
                                                pipes[r][1], tp_plan)) for r in range(2)]
    for p in procs:
        p.start()
    for _, sender in pipes:
        sender.close()
    want = 2 * len(scenarios) - sum(sc.kill_rank is not None for sc in scenarios)
    out: list[dict[str, Any]] = []
    open_ends = [receiver for receiver, _ in pipes]
    try:
        while len(out) < want:
            ready = wait(open_ends, timeout=timeout_s)
            assert ready, f"the ranks sent {len(out)} of {want} results in {timeout_s}s"
            for conn in ready:
                try:
                    got = conn.recv()
                except EOFError:             # that rank has ended
                    open_ends.remove(conn)
                    continue
                out.append(got)
                assert got["scenario"] != "crash", got["error"]
            assert open_ends, f"both ranks ended after {len(out)} of {want} results"
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return out
