"""The triton backend against reference_cpu: geometries the conformance suite does not draw (top-k
and hot rows far from powers of two, three-row groups), trusted input that must stay inside its
tensors, the kernel-failure message and registry selection.

Skipped whole when triton is not installed. Without a GPU the module runs the kernels in Triton's
interpreter: `TRITON_INTERPRET=1` is set for this module's tests only (Triton reads it when a
kernel is defined, so the kernels module is imported under it), and the rest of the session never
sees it. With a GPU, the kernels run compiled on it.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hisparse_conformance.lockstep import Lockstep  # noqa: E402
from hisparse_conformance.scenario import ScenarioParams, as_tensor, build_scenario  # noqa: E402
from hisparse_core.geometry import RuntimeConfig  # noqa: E402
from hisparse_core.host_pool import HostPoolSpec  # noqa: E402
from hisparse_core.runtime import ResolveInputs  # noqa: E402
from hisparse_reference_cpu.backend import ReferenceCpuBackend  # noqa: E402

KERNELS = "hisparse_triton.kernels"


def _kernels_interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(sys.modules[KERNELS].resolve_kernel, InterpretedFunction)


@pytest.fixture(scope="module", autouse=True)
def interpreter() -> Iterator[None]:
    """`TRITON_INTERPRET=1` while this module runs, when there is no GPU to compile for."""
    if torch.cuda.is_available():
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        if KERNELS in sys.modules and not _kernels_interpreted():
            importlib.reload(sys.modules[KERNELS])  # imported compiled earlier: define them interpreted
        importlib.import_module(KERNELS)
        yield


def test_interpreter_setting_stays_in_this_module() -> None:
    if torch.cuda.is_available():
        pytest.skip("compiled for a GPU here")
    assert os.environ.get("TRITON_INTERPRET") == "1" and _kernels_interpreted()


def test_interpreter_setting_is_gone_after_the_module() -> None:
    """A session that ran this module hands later tests (and their child processes) an environment
    without `TRITON_INTERPRET`."""
    if torch.cuda.is_available():
        pytest.skip("compiled for a GPU here")
    code = ("import os, sys, pytest; "
            f"rc = pytest.main([{__file__ + '::test_interpreter_setting_stays_in_this_module'!r}, '-q', "
            "'-p', 'no:cacheprovider']); "
            "sys.exit(rc or (3 if 'TRITON_INTERPRET' in os.environ else 0))")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTEST_ADDOPTS")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode} (3: the setting leaked)\n{proc.stdout[-3000:]}"


@pytest.fixture(scope="module")
def backend(interpreter: None):  # noqa: ANN201 - TritonBackend
    from hisparse_triton.backend import TritonBackend

    return TritonBackend()


@given(top_k=st.integers(13, 24), rows=st.integers(1, 3), seed=st.integers(0, 2**32 - 1),
       locality=st.sampled_from([0.0, 0.5, 0.9]), block_size=st.sampled_from([1, 3, 8]))
@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
def test_lockstep_with_odd_geometries(backend, top_k: int, rows: int, seed: int, locality: float,  # noqa: ANN001
                                      block_size: int) -> None:
    p = ScenarioParams(block_size=block_size, top_k=top_k, extra_hot_blocks=1, max_requests=2, max_pages=8,
                       rows_per_request=rows, extra_batch_rows=1, num_layers=2, steps=4, locality=locality,
                       resident_share=0.3, null_share=0.1, prefix_share=0.25, mask_share=0.15, padding_share=0.2,
                       maintenance_share=0.25, seed=seed)
    sc = build_scenario(p)
    _lockstep_with_reference(backend, sc, seed)


def _runtime(backend, *, max_requests: int = 2):  # noqa: ANN001, ANN202
    cfg = RuntimeConfig(max_batch_rows=2, max_requests=max_requests, top_k=4, hot_rows=4, block_size=2, max_pages=4)
    pool = backend.create_host_pool(HostPoolSpec(num_layers=1, num_blocks=8, block_size=2))
    pool.layer_view(0).copy_(torch.randint(0, 256, pool.layer_view(0).shape, dtype=torch.uint8))
    dev = torch.randint(0, 256, (6, 2, 656), dtype=torch.uint8).to(backend.device)
    rt = backend.create_runtime(cfg)
    rt.bind([pool.layer_view(0)], [dev])
    return rt, pool, dev


def test_trusted_out_of_range_input_stays_inside_its_tensors(backend) -> None:  # noqa: ANN001
    rt, pool, dev = _runtime(backend)
    before = dev.clone()
    # State row 7 does not exist, seq_len beyond the pages, table entries far out of range.
    d = backend.device
    inputs = ResolveInputs(
        topk=as_tensor([[0, 1, 50, 7], [0, 2, 3, 6]], d), row_state=as_tensor([7, 1], d),
        seq_lens=as_tensor([99, 99], d), source_table=as_tensor([[1 << 20, -1, 3, 2], [0, 1 << 28, 2, 3]], d),
        resident_table=as_tensor([[-1, -1, -1, -1], [-1, -1, -1, -1]], d),
        hot_table=as_tensor([[0, 1], [1 << 20, 2]], d))
    out = rt.resolve(inputs, gather=True, validate=False)
    assert out.rows[0].tolist() == [-1] * 4  # the unknown state row reads as padding
    # Plan rows outside the pool or the cache were not copied; nothing else changed but plan rows.
    plan = [(h, d) for h, d, c in zip(out.plan_host[1].tolist(), out.plan_device[1].tolist(),
                                      [int(out.plan_counts[1])] * 4, strict=True)][:int(out.plan_counts[1])]
    touched = {d for _, d in plan if 0 <= d < 12}
    flat, was = dev.view(12, 656).cpu(), before.view(12, 656).cpu()
    for d in range(12):
        if d not in touched:
            assert torch.equal(flat[d], was[d]), f"device row {d} changed"
    pool.release()


def test_resident_fast_path_in_this_session(backend) -> None:  # noqa: ANN001
    """An all-resident group takes the kernel's fast path. In-process (triton.language imported
    before `TRITON_INTERPRET` was set, as torch imports triton) it must call none of Triton's @jit
    helpers, which Triton 3.6's interpreter then cannot run."""
    rt, pool, _ = _runtime(backend)
    d = backend.device
    inputs = ResolveInputs(
        topk=as_tensor([[0, 3, 5, -1], [1, 1, 6, 2]], d), row_state=as_tensor([0, 1], d), seq_lens=as_tensor([8, 7], d),
        source_table=as_tensor([[-1] * 4, [-1] * 4], d), resident_table=as_tensor([[4, 1, 5, 0], [2, 3, 0, 1]], d),
        hot_table=as_tensor([[0, 1], [2, 3]], d))
    out = rt.resolve(inputs)
    assert out.rows.tolist() == [[8, 3, 11, -1], [5, 5, 2, 6]]
    assert out.valid_counts.tolist() == [3, 4] and out.plan_counts.tolist() == [0, 0]
    assert rt.hot_state(0)[1].tolist() == [0, 1, 2, 3]  # LRU untouched
    pool.release()


def test_kernel_failure_names_kernel_and_triton_version(backend) -> None:  # noqa: ANN001
    import triton

    from hisparse_triton import kernels

    with pytest.raises(kernels.KernelError) as err:
        # HP below H: the resolver's hot-row lanes cannot hold the hot map (an arange of a non-power of 2).
        kernels.launch(kernels.invalidate_written_kernel, "invalidate_written_kernel", (1,),
                       *(torch.zeros(n, dtype=torch.int32, device=backend.device) for n in (1, 1, 3)), 1, H=3, HP=3)
    msg = str(err.value)
    assert "invalidate_written_kernel" in msg and f"Triton {triton.__version__}" in msg and "HP=3" in msg


def test_selected_by_name_under_the_interpreter(backend) -> None:  # noqa: ANN001
    from hisparse_core.registry import get_registry, select_backend

    if backend.device.type != "cpu":
        pytest.skip("compiled for a GPU here")
    get_registry(reload=True)
    try:
        chosen = select_backend("triton")
        assert chosen.name == "triton" and chosen.device == torch.device("cpu")
        assert select_backend().name != "triton"  # auto keeps the interpreter out
    finally:
        get_registry(reload=True)


def test_shared_pool_round_trip(backend, tmp_path) -> None:  # noqa: ANN001
    spec = HostPoolSpec(num_layers=2, num_blocks=4, block_size=2, shared=True, name=f"trtest{os.getpid()}",
                        rank=0, world_size=1)
    with backend.create_host_pool(spec) as pool:
        assert pool.is_writer and pool.done_epoch == 0
        pool.mark_done(3)
        assert pool.done_epoch == 3
        pool.layer_view(1).fill_(7)
        assert int(pool.layer_view(1).view(torch.uint8).sum()) == 7 * pool.layer_view(1).numel()
    assert not os.path.exists(f"/dev/shm/hisparse_trtest{os.getpid()}.trpool")


def _vllm_ops_match_the_model(backend, seed: int) -> None:  # noqa: ANN001
    """vLLM's op set on `backend` against the conformance model over `seed`'s cases, with and without
    a corrupt LRU, one and two rows a request, the miss mask written; with vLLM's tables, and without
    them at a region stride that need not be a multiple of the hot block size (as vLLM's own kernel
    tests call the resolve)."""
    from hisparse_conformance.vllm_ops_model import random_case, run_model, run_ops

    for tables in (True, False):
        for corrupt in (False, True):
            for rows in (1, 2):
                kw = dict(corrupt_lru=corrupt, rows_per_request=rows, tables=tables, any_stride=not tables)
                case = random_case(seed, **kw)
                if backend.device.type != "cpu":
                    case.host = case.host.pin_memory()
                got = run_ops(backend.vllm_ops(), case, backend.device, miss_mask=True)
                want = run_model(random_case(seed, **kw), miss_mask=True)
                for name in ("hot_out", "attention", "resolved", "valid", "miss_mask", "swap_counts", "dgi", "lru",
                             "stats", "hot", "plan_hot", "plan_attention", "inv_dgi"):
                    assert torch.equal(got[name].cpu(), want[name]), (name, tables, corrupt, rows)


@pytest.mark.parametrize("hot_multiple", [2, 5])
def test_vllm_ops_production_shapes_match_reference_cpu(backend, hot_multiple: int) -> None:  # noqa: ANN001
    """vLLM's decode shapes (top-k 2048, a hot buffer of 2x and, for MTP-3, 5x the top-k) through the
    triton op set without tables, a cold step then a warm one with half the entries new, against
    reference_cpu's ops byte for byte. 5x takes a 16384-lane resolver, whose two-level scans must stay
    within Triton's tensor limit (`shapes.MAX_SCAN_ROWS`), interpreted as compiled."""
    from hisparse_core.registry import select_backend

    ref = select_backend("reference_cpu").vllm_ops()
    top_k, bs = 2048, 8
    hot = top_k * hot_multiple
    host_rows = 8 * top_k
    gen = torch.Generator().manual_seed(hot_multiple)
    steps = [torch.randperm(host_rows, generator=gen)[:top_k]]
    steps.append(torch.cat([steps[0][: top_k // 2], torch.randperm(host_rows, generator=gen)[: top_k // 2]]))
    dev = backend.device
    state = {}
    for name, ops, device in (("triton", backend.vllm_ops(), dev), ("reference_cpu", ref, torch.device("cpu"))):
        i32 = dict(dtype=torch.int32, device=device)
        dgi = torch.full((1, hot), -1, **i32)
        lru = torch.arange(hot, dtype=torch.int16, device=device)[None].clone()
        host = torch.zeros(host_rows, 16, dtype=torch.uint8)
        hot_cache = torch.zeros(hot // bs, bs, 16, dtype=torch.uint8, device=device)
        outs = []
        for topk in steps:
            o = {k: torch.full((1, top_k), -999, **i32) for k in ("hot", "miss", "attn", "resolved", "sh", "sd")}
            valid, counts = torch.full((1,), -999, **i32), torch.full((1,), -999, **i32)
            ops.resolve_residency(host, hot_cache, torch.arange(hot // bs, **i32)[None], topk[None].to(**i32), o["hot"],
                                  dgi, lru, torch.zeros(1, **i32), hot, top_k, o["miss"], None, o["attn"], bs,
                                  None, None, 0, o["resolved"], valid, o["sh"], o["sd"], counts, None, 0, 0)
            outs.append({**{k: v.cpu() for k, v in o.items()}, "valid": valid.cpu(), "counts": counts.cpu(),
                         "dgi": dgi.cpu().clone(), "lru": lru.cpu().clone()})
        state[name] = outs
    for step, (got, want) in enumerate(zip(state["triton"], state["reference_cpu"], strict=True)):
        for key in want:
            assert torch.equal(got[key], want[key]), (step, key)
    fresh = len(set(steps[1].tolist()) - set(steps[0].tolist()))  # the warm step's misses
    assert int(state["triton"][0]["counts"][0]) == top_k and int(state["triton"][1]["counts"][0]) == fresh > 0


@pytest.mark.parametrize("seed", [3, 11, 26])
def test_vllm_ops_with_miss_mask_and_corrupt_lru_match_the_model(backend, seed: int) -> None:  # noqa: ANN001
    """What the conformance module leaves out (vLLM 0.32 passes neither): the miss mask as an output,
    and an LRU holding a slot outside the hot buffer (never read; as a victim its miss degrades)."""
    _vllm_ops_match_the_model(backend, seed)


@pytest.mark.parametrize("kernel,line", [("copy_plan_kernel", 0), ("copy_plan_rows_kernel", 0),
                                         ("copy_plan_rows_kernel", 4)])
@pytest.mark.parametrize("programs,entries", [(1, 4), (3, 2), (7, 4), (16, 2)])
def test_plan_copy_programs_share_the_chunks_of_every_row(backend, kernel: str, line: int, programs: int,  # noqa: ANN001
                                                          entries: int) -> None:
    """The GPU's plan copy: a fixed grid of programs takes chunks of `entries` plan entries, numbered
    across the batch, round robin (`copy_plan_kernel`), or `programs // rows` programs a row
    (`copy_plan_rows_kernel`; one a row, rows round robin, where programs are fewer than rows); the
    interpreter otherwise runs one program a whole row at a time), reading rows whole or along host
    lines of `line` words (rows of 6 words start anywhere in a line of 4). Every row's first `count`
    entries land, nothing else is written (plan entries past a count are -1, as between calls), and
    the bytes counter adds up."""
    from hisparse_triton import kernels

    g = torch.Generator().manual_seed(programs * 10 + entries)
    k, rows, words, bs = 8, 5, 6, 4
    host = torch.randint(-2**31, 2**31 - 1, (40, words), dtype=torch.int32, generator=g)
    dev = torch.zeros((12, bs, words), dtype=torch.int32)
    counts = torch.tensor([3, 0, 8, 1, 5], dtype=torch.int32)
    plan_host, plan_dev = _random_plans(counts, k, 48, g)
    stats = torch.zeros(5, dtype=torch.int64)
    d = backend.device
    dev_d = dev.to(d)
    args = [t.to(d) for t in (plan_host, plan_dev, counts)] + [host.to(d) if d.type != "cpu" else host, dev_d,
                                                                dev_d.stride(0), stats.to(d)]
    meta = dict(WP=8, EB=entries, BP=8) | (dict(WP=16, LW=line) if line else {})
    kernels.launch(kernels.KERNELS[kernel], kernel, (programs,), *args, rows, k, words * 4, 40, 48,
                   words, bs, programs, *((bs.bit_length() - 1,) if kernel == "copy_plan_kernel" else ()), **meta)
    want = torch.zeros_like(dev).view(48, words)
    for r in range(rows):
        for j in range(int(counts[r])):
            want[int(plan_dev[r, j])] = host[int(plan_host[r, j])]
    assert torch.equal(dev_d.cpu().view(48, words), want)
    assert int(args[-1][3]) == int(counts.sum()) * words * 4


@pytest.mark.parametrize("vec", [1, 2, 3])
@pytest.mark.parametrize("shift", [0, 1])
@pytest.mark.parametrize("programs,entries", [(1, 4), (5, 2)])
def test_lean_plan_copy_matches_the_plan_on_strided_blocks(backend, vec: int, shift: int, programs: int,  # noqa: ANN001
                                                           entries: int) -> None:
    """`copy_plan_kernel` with `VEC` (`HISPARSE_TRITON_LEAN_COPY`): 32-bit block arithmetic (by division,
    or with `SB` by shift and mask) and rows moved `VEC` words an access, on a device slab whose blocks
    are strided past their rows (rows of 6 words, blocks of 4 rows 30 words apart) and random
    destinations spread over every block: every row's first `count` entries land exactly, nothing
    else is written, the bytes counter adds up."""
    from hisparse_triton import kernels

    g = torch.Generator().manual_seed(vec * 1000 + shift * 100 + programs * 10 + entries)
    k, rows, words, bs, blocks = 8, 5, 6, 4, 12
    host = torch.randint(-2**31, 2**31 - 1, (40, words), dtype=torch.int32, generator=g)
    slab = torch.zeros(blocks * (bs * words + 6), dtype=torch.int32)  # blocks 30 words apart, 24 of them rows
    counts = torch.tensor([3, 0, 8, 1, 5], dtype=torch.int32)
    plan_host, plan_dev = _random_plans(counts, k, blocks * bs, g)
    d = backend.device
    slab_d = slab.to(d)
    dev_d = slab_d.view(blocks, bs * words + 6)[:, :bs * words].view(blocks, bs, words)
    stats = torch.zeros(5, dtype=torch.int64, device=d)
    kernels.launch(kernels.copy_plan_kernel, "copy_plan_kernel", (programs,),
                   *(t.to(d) for t in (plan_host, plan_dev, counts)), host.pin_memory() if d.type != "cpu" else host,
                   dev_d, dev_d.stride(0), stats, rows, k, words * 4, 40, blocks * bs, words, bs, programs,
                   bs.bit_length() - 1, WP=8, EB=entries, BP=8, VEC=vec, SB=shift)
    want = slab.clone()
    for r in range(rows):
        for j in range(int(counts[r])):
            row = int(plan_dev[r, j])
            at = (row // bs) * (bs * words + 6) + (row % bs) * words
            want[at:at + words] = host[int(plan_host[r, j])]
    assert torch.equal(slab_d.cpu(), want)
    assert int(stats[3]) == int(counts.sum()) * words * 4


@pytest.mark.parametrize(("stride_pad", "vec"), [(0, 4), (4, 4), (2, 1)])
def test_lean_copy_vectors_only_where_rows_and_blocks_allow(backend, stride_pad: int, vec: int) -> None:  # noqa: ANN001
    """`HISPARSE_TRITON_LEAN_COPY=1` (and the auto default at every batch size): the plan copy moves 4
    words an access where a row's words and every layer's block stride are multiples of 4, else one
    (`VEC` 1); off (`=0`, or `HISPARSE_TRITON_AUTO=0`), the build without `VEC`."""
    cfg = RuntimeConfig(max_batch_rows=2, max_requests=2, top_k=4, hot_rows=4, block_size=2, max_pages=4)
    words = cfg.row_format.row_bytes // 4
    host = torch.zeros((16, cfg.row_format.width), dtype=cfg.row_format.dtype)
    if backend.device.type != "cpu":
        host = host.pin_memory()
    slab = torch.zeros((4, 2 * words + stride_pad), dtype=torch.int32, device=backend.device)
    dev = slab[:, :2 * words].view(torch.uint8).view(4, 2, cfg.row_format.width).view(cfg.row_format.dtype)
    for env, want in (({"HISPARSE_TRITON_LEAN_COPY": "1"}, vec), ({}, vec), ({"HISPARSE_TRITON_LEAN_COPY": "0"}, 0),
                      ({"HISPARSE_TRITON_AUTO": "0"}, 0)):
        with pytest.MonkeyPatch.context() as mp:
            for key, value in env.items():
                mp.setenv(key, value)
            rt = backend.create_runtime(cfg)
        rt.bind([host], [dev])
        for rows in (1, 2):  # both batch sizes' profiles
            assert (rt._vec if rt._launches_for(rows).tuning.lean_copy else 0) == want, (stride_pad, env, rows)


#: The auto choice's picks (`hisparse_triton.auto`) as fixed settings.
_AUTO_SMALL = (("HISPARSE_TRITON_SPLIT", "8"), ("HISPARSE_TRITON_RESOLVER_THREADS", "512"), ("HISPARSE_TRITON_SCAN", "1"),
               ("HISPARSE_TRITON_SHIFT", "1"), ("HISPARSE_TRITON_LEAN_COPY", "1"), ("HISPARSE_TRITON_PDL", "1"),
               ("HISPARSE_TRITON_PLAN_ENTRIES", "4"), ("HISPARSE_TRITON_PLAN_PER_SM", "4"))
_AUTO_LARGE = (("HISPARSE_TRITON_SCAN", "1"), ("HISPARSE_TRITON_SHIFT", "1"), ("HISPARSE_TRITON_LEAN_COPY", "1"))


def test_auto_picks_are_the_ones_this_module_runs() -> None:
    """The fixed settings the variant lockstep test runs are the auto choice's picks."""
    from hisparse_triton import auto

    assert (auto.SMALL_PICKS, auto.LARGE_PICKS) == (_AUTO_SMALL, _AUTO_LARGE)


@pytest.mark.parametrize("env", [{"HISPARSE_TRITON_RESOLVER": "scratch"},
                                 {"HISPARSE_TRITON_RESOLVER": "gather", "HISPARSE_TRITON_FUSE_COPY": "1"},
                                 {"HISPARSE_TRITON_RESOLVER": "gather", "HISPARSE_TRITON_LEAN": "0"},
                                 {"HISPARSE_TRITON_RESOLVER": "gather", "HISPARSE_TRITON_CAS": "1"},
                                 {"HISPARSE_TRITON_CAS": "1", "HISPARSE_TRITON_LEAN": "0",
                                  "HISPARSE_TRITON_FUSE_COPY": "1"},
                                 {"HISPARSE_TRITON_SCAN": "1"},
                                 {"HISPARSE_TRITON_SCAN": "1", "HISPARSE_TRITON_LEAN": "0", "HISPARSE_TRITON_CAS": "1"},
                                 {"HISPARSE_TRITON_SHIFT": "1", "HISPARSE_TRITON_SCAN": "1"},
                                 {"HISPARSE_TRITON_SHIFT": "1", "HISPARSE_TRITON_LEAN": "0"},
                                 {"HISPARSE_TRITON_ROW_COPY": "1", "HISPARSE_TRITON_SCAN": "1", "HISPARSE_TRITON_SHIFT": "1"},
                                 {"HISPARSE_TRITON_ROW_COPY": "1", "HISPARSE_TRITON_RESOLVER": "scratch"},
                                 {"HISPARSE_TRITON_PDL": "1", "HISPARSE_TRITON_ROW_COPY": "1", "HISPARSE_TRITON_SCAN": "1",
                                  "HISPARSE_TRITON_SHIFT": "1"},
                                 {"HISPARSE_TRITON_SPLIT": "2"},
                                 {"HISPARSE_TRITON_SPLIT": "4", "HISPARSE_TRITON_SCAN": "1", "HISPARSE_TRITON_SHIFT": "1"},
                                 {"HISPARSE_TRITON_SPLIT": "16", "HISPARSE_TRITON_ROW_COPY": "1"},
                                 {"HISPARSE_TRITON_SPLIT": "2", "HISPARSE_TRITON_SPLIT_TAIL": "1"},
                                 {"HISPARSE_TRITON_SPLIT": "4", "HISPARSE_TRITON_SPLIT_TAIL": "1",
                                  "HISPARSE_TRITON_SCAN": "1", "HISPARSE_TRITON_SHIFT": "1"},
                                 {"HISPARSE_TRITON_SPLIT": "8", "HISPARSE_TRITON_SPLIT_TAIL": "1",
                                  "HISPARSE_TRITON_SCAN": "1", "HISPARSE_TRITON_SHIFT": "1"},
                                 {"HISPARSE_TRITON_SPLIT": "16", "HISPARSE_TRITON_SPLIT_TAIL": "1",
                                  "HISPARSE_TRITON_ROW_COPY": "1"},
                                 {"HISPARSE_TRITON_LEAN_COPY": "1"},
                                 {"HISPARSE_TRITON_LEAN_COPY": "1", "HISPARSE_TRITON_SPLIT": "8",
                                  "HISPARSE_TRITON_SCAN": "1", "HISPARSE_TRITON_SHIFT": "1"},
                                 {"HISPARSE_TRITON_LEAN_COPY": "1", "HISPARSE_TRITON_PDL": "1",
                                  "HISPARSE_TRITON_SPLIT": "8", "HISPARSE_TRITON_SCAN": "1", "HISPARSE_TRITON_SHIFT": "1"},
                                 {"HISPARSE_TRITON_LEAN_COPY": "1", "HISPARSE_TRITON_PDL": "1",
                                  "HISPARSE_TRITON_SPLIT": "8", "HISPARSE_TRITON_SPLIT_TAIL": "1"},
                                 dict(_AUTO_SMALL), {k: v for k, v in _AUTO_SMALL if k != "HISPARSE_TRITON_PDL"},
                                 dict(_AUTO_LARGE), {"HISPARSE_TRITON_AUTO": "1"},
                                 {"HISPARSE_TRITON_SPLIT": "2", "HISPARSE_TRITON_SPLIT_KEEP": "1"},
                                 {"HISPARSE_TRITON_SPLIT_KEEP": "1", **{k: v for k, v in _AUTO_SMALL
                                                                         if k != "HISPARSE_TRITON_PDL"}},
                                 {"HISPARSE_TRITON_SPLIT_KEEP": "1", **dict(_AUTO_SMALL)},
                                 {"HISPARSE_TRITON_PDL_CHAIN": "1", **dict(_AUTO_SMALL)},
                                 {"HISPARSE_TRITON_PDL_CHAIN": "1", "HISPARSE_TRITON_SPEC_COPY": "128",
                                  **dict(_AUTO_SMALL)}],
                         ids=["scratch", "gather_fused", "gather_not_lean", "gather_cas", "gather_cas_fused_not_lean",
                              "gather_scan", "gather_scan_cas_not_lean", "gather_shift_scan", "gather_shift_not_lean",
                              "gather_row_copy_scan_shift", "scratch_row_copy", "gather_pdl_row_copy_scan_shift",
                              "split2", "split4_scan_shift", "split16_row_copy", "split2_tail", "split4_tail_scan_shift",
                              "split8_tail_scan_shift", "split16_tail_row_copy", "lean_copy", "lean_copy_split8_scan_shift",
                              "lean_copy_pdl_split8_scan_shift", "lean_copy_pdl_split8_tail", "auto_small_picks",
                              "auto_small_picks_without_pdl", "auto_large_picks", "auto", "split2_keep",
                              "keep_auto_small_picks_without_pdl", "keep_auto_small_picks",
                              "chain_auto_small_picks", "chain_spec_auto_small_picks"])
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 3), locality=st.sampled_from([0.0, 0.9]))
@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
def test_lockstep_with_each_resolver_variant(backend, env: dict[str, str], seed: int, rows: int,  # noqa: ANN001
                                             locality: float) -> None:
    """The variants `HISPARSE_TRITON_RESOLVER` / `HISPARSE_TRITON_FUSE_COPY` / `HISPARSE_TRITON_LEAN` /
    `HISPARSE_TRITON_CAS` / `HISPARSE_TRITON_SCAN` / `HISPARSE_TRITON_SHIFT` / `HISPARSE_TRITON_ROW_COPY` /
    `HISPARSE_TRITON_PDL` / `HISPARSE_TRITON_SPLIT` pick, each alone (`HISPARSE_TRITON_AUTO=0`: nothing else
    picked per batch size), among them the auto choice's picks for small and large batches as fixed
    settings; and the auto choice itself (what the rest of this module and the suite run); PDL only
    where it is allowed (sm_90 and later)."""
    if ("HISPARSE_TRITON_PDL" in env or "HISPARSE_TRITON_PDL_CHAIN" in env) and not (backend.device.type == "cuda" and not torch.version.hip
                                             and torch.cuda.get_device_capability(backend.device)[0] >= 9):
        pytest.skip("programmatic dependent launch needs an NVIDIA GPU of compute capability 9.0 or later")
    p = ScenarioParams(block_size=4, top_k=16, extra_hot_blocks=1, max_requests=2, max_pages=8,
                       rows_per_request=rows, extra_batch_rows=1, num_layers=2, steps=4, locality=locality,
                       resident_share=0.3, null_share=0.1, prefix_share=0.25, mask_share=0.15, padding_share=0.2,
                       maintenance_share=0.25, seed=seed)
    sc = build_scenario(p)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HISPARSE_TRITON_AUTO", "0")
        for k, v in env.items():
            mp.setenv(k, v)
        _lockstep_with_reference(backend, sc, seed)


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("HISPARSE_TRITON_RESOLVER", "fast", "expected one of gather, scratch"),
    ("HISPARSE_TRITON_RESOLVER_THREADS", "96", "expected 64, 128, 256, 512 or 1024"),
    ("HISPARSE_TRITON_PLAN_PER_SM", "0", "expected an integer 1-32"),
    ("HISPARSE_TRITON_FUSE_COPY", "yes", "expected 0 or 1"),
    ("HISPARSE_TRITON_FUSE_COPY", "1", "needs the gather resolver"),
    ("HISPARSE_TRITON_LEAN", "2", "expected 0 or 1"),
    ("HISPARSE_TRITON_PLAN_ENTRIES", "12", "expected one of 4, 8, 16, 32"),
    ("HISPARSE_TRITON_CAS", "on", "expected 0 or 1"),
    ("HISPARSE_TRITON_CAS", "1", "needs the gather resolver"),
    ("HISPARSE_TRITON_SCAN", "2", "expected 0 or 1"),
    ("HISPARSE_TRITON_SCAN", "1", "needs the gather resolver"),
    ("HISPARSE_TRITON_SHIFT", "true", "expected 0 or 1"),
    ("HISPARSE_TRITON_SHIFT", "1", "needs the gather resolver"),
    ("HISPARSE_TRITON_ROW_COPY", "2", "expected 0 or 1"),
    ("HISPARSE_TRITON_PDL", "yes", "expected 0 or 1"),
    ("HISPARSE_TRITON_LEAN_COPY", "on", "expected 0 or 1"),
    ("HISPARSE_TRITON_PDL", "1", "needs the gather resolver"),
    ("HISPARSE_TRITON_SPLIT", "3", "expected 0 \\(off\\) or one of 2, 4, 8, 16"),
    ("HISPARSE_TRITON_SPLIT", "-8", "expected 0 \\(off\\) or one of 2, 4, 8, 16"),
    ("HISPARSE_TRITON_SPLIT_TAIL", "2", "expected 0 or 1"),
    ("HISPARSE_TRITON_SPLIT_TAIL", "1", "needs the split resolver; HISPARSE_TRITON_SPLIT is 0 \\(off\\), expected one of "
                                        "2, 4, 8, 16"),
    ("HISPARSE_TRITON_SPLIT_KEEP", "2", "expected 0 or 1"),
    ("HISPARSE_TRITON_SPLIT_KEEP", "1", "needs the split resolver; HISPARSE_TRITON_SPLIT is 0 \\(off\\), expected one of "
                                        "2, 4, 8, 16"),
    ("HISPARSE_TRITON_AUTO", "2", "expected 0 \\(the fixed defaults\\) or 1"),
])
def test_bad_tuning_variable_is_refused_with_one_line(backend, key: str, value: str, expected: str) -> None:  # noqa: ANN001
    from hisparse_core.errors import InvalidInputError

    cfg = RuntimeConfig(max_batch_rows=2, max_requests=2, top_k=4, hot_rows=4, block_size=2, max_pages=4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(key, value)
        if value == "1":  # fusing, CAS, SCAN and SHIFT are the gather resolver's: refused beside the scratch one
            mp.setenv("HISPARSE_TRITON_RESOLVER", "scratch")
        with pytest.raises(InvalidInputError, match=f"{key}={value!r}.*{expected}"):
            backend.create_runtime(cfg)


@pytest.mark.parametrize(("env", "line"), [
    ({"HISPARSE_TRITON_RESOLVER": "scratch"}, "HISPARSE_TRITON_SPLIT='8' needs the gather resolver; "
                                              "HISPARSE_TRITON_RESOLVER is 'scratch'"),
    ({"HISPARSE_TRITON_FUSE_COPY": "1"}, "HISPARSE_TRITON_FUSE_COPY='1' does not combine with HISPARSE_TRITON_SPLIT='8'"),
    ({"HISPARSE_TRITON_CAS": "1"}, "HISPARSE_TRITON_CAS='1' does not combine with HISPARSE_TRITON_SPLIT='8'"),
    ({"HISPARSE_TRITON_LEAN": "0"}, "HISPARSE_TRITON_LEAN='0' does not combine with HISPARSE_TRITON_SPLIT='8'"),
    ({"HISPARSE_TRITON_SPLIT_TAIL": "1", "HISPARSE_TRITON_SPLIT_KEEP": "1"},
     "HISPARSE_TRITON_SPLIT_KEEP='1' does not combine with HISPARSE_TRITON_SPLIT_TAIL='1'"),
])
def test_split_refuses_the_builds_it_has_not(backend, env: dict[str, str], line: str) -> None:  # noqa: ANN001
    """`HISPARSE_TRITON_SPLIT` is the gather resolver's, with no fused copy, CAS or non-LEAN
    build: each such combination is refused in one line naming both variables, before any work."""
    from hisparse_core.errors import InvalidInputError

    cfg = RuntimeConfig(max_batch_rows=2, max_requests=2, top_k=4, hot_rows=4, block_size=2, max_pages=4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HISPARSE_TRITON_SPLIT", "8")
        for k, v in env.items():
            mp.setenv(k, v)
        with pytest.raises(InvalidInputError) as err:
            backend.create_runtime(cfg)
    assert line in str(err.value) and "\n" not in str(err.value)


def _lockstep_with_reference(backend, sc, seed: int) -> None:  # noqa: ANN001
    """Every step of scenario `sc` resolved (layer 0 copied, the rest replayed) and its work applied on
    `backend` and reference_cpu alike; any difference fails with its first ten lines."""
    with Lockstep(backend, ReferenceCpuBackend(), sc.layout, seed=seed) as run:
        for step, work in sc.steps:
            problems = run.resolve(step, replay=True)
            problems += run.apply(work)
            assert not problems, "\n".join(problems[:10])


class _Launched(list[str]):
    """The names of the kernels launched, in order, and each kernel's launch parameters (`metas`)."""

    def __init__(self) -> None:
        super().__init__()
        self.metas: dict[str, list[dict[str, object]]] = {}


def _split_rows_and_launches(mp: pytest.MonkeyPatch, split_rows: Callable[[int], int]) -> _Launched:
    """Every `TritonRuntime` built from here on takes the split resolver, in each batch-size profile that
    has it, for batches of up to `split_rows(max_batch_rows)` rows (whatever the device: its own rule is
    a wave of programs on a GPU, half the workspace rows interpreted); returns the names of the kernels
    launched from here on."""
    from hisparse_triton.runtime import TritonRuntime

    mod = sys.modules[KERNELS]
    real_launch, real_init = mod.launch, TritonRuntime.__init__
    names = _Launched()

    def launch(kernel: object, name: str, *args: object, **meta: object) -> None:
        names.append(name)
        names.metas.setdefault(name, []).append(meta)
        real_launch(kernel, name, *args, **meta)

    def init(self: TritonRuntime, config: RuntimeConfig, device: torch.device) -> None:
        real_init(self, config, device)
        self._launches = [dataclasses.replace(x, split_rows=split_rows(config.max_batch_rows) if x.split_rows else 0)
                          for x in self._launches]

    mp.setattr(mod, "launch", launch)
    mp.setattr(TritonRuntime, "__init__", init)
    return names


@pytest.mark.parametrize("seed", [5, 17])
@pytest.mark.parametrize("tail", ["0", "1"], ids=["split", "split_tail"])
def test_split_resolver_on_vllm_ops_matches_the_model(backend, seed: int, tail: str) -> None:  # noqa: ANN001
    """The split resolver (and with `HISPARSE_TRITON_SPLIT_TAIL` its hot-row kernels) under vLLM's op
    set: int16 LRU, the miss mask, an LRU holding a slot outside the hot buffer, one and two rows a
    request. vLLM's calls fill their runtime's workspace, which the interpreter's rule (up to half the
    workspace rows) would hand to the one-program resolver: here every batch takes the split one, as
    on a GPU at these sizes, and the test checks that it (and the tail's kernels) ran."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HISPARSE_TRITON_SPLIT", "4")
        mp.setenv("HISPARSE_TRITON_SPLIT_TAIL", tail)
        names = _split_rows_and_launches(mp, lambda rows: rows)
        _vllm_ops_match_the_model(backend, seed)
    assert "resolve_split_kernel" in names and "resolve_gather_kernel" not in names, names
    assert ("resolve_split_hot_kernel" in names) == (tail == "1"), names


@pytest.mark.parametrize(("seed", "rows", "split", "tail"), [(1, 3, "4", "0"), (2, 1, "16", "0"), (1, 3, "4", "1"),
                                                              (2, 1, "16", "1"), (3, 2, "8", "1")])
def test_split_resolver_shares_a_state_with_the_one_program_resolver(backend, seed: int, rows: int,  # noqa: ANN001
                                                                     split: str, tail: str) -> None:
    """Batches of up to half the workspace take the split resolver (with `tail`, its hot-row kernels too)
    and larger ones the one-program resolver, on one runtime's state, in lockstep with reference_cpu
    (scenarios with batches on both sides of the line: the variant lockstep test's two random examples
    may have none; the tail's marks, table and ticket must be left as the one-program resolver expects)."""
    p = ScenarioParams(block_size=4, top_k=16, extra_hot_blocks=1, max_requests=2, max_pages=8,
                       rows_per_request=rows, extra_batch_rows=1, num_layers=2, steps=4, locality=0.9,
                       resident_share=0.3, null_share=0.1, prefix_share=0.25, mask_share=0.15, padding_share=0.2,
                       maintenance_share=0.25, seed=seed)
    sc = build_scenario(p)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HISPARSE_TRITON_SPLIT", split)
        mp.setenv("HISPARSE_TRITON_SPLIT_TAIL", tail)
        names = _split_rows_and_launches(mp, lambda b: max(1, b // 2))
        _lockstep_with_reference(backend, sc, seed)
    assert "resolve_split_kernel" in names and "resolve_gather_kernel" in names, names
    assert ("resolve_split_hot_kernel" in names) == (tail == "1"), names


# Seeds whose four steps hold batches below half the line (1 row here), half the line up to it, and past it (workspaces of 7 and 5 rows).
@pytest.mark.parametrize(("seed", "rows"), [(2, 3), (3, 2)])
def test_auto_default_runs_each_batch_profile_in_lockstep(backend, seed: int, rows: int) -> None:  # noqa: ANN001
    """With nothing set, batches of up to the small-batch line take the split resolver with two-level scans
    and shift-and-mask blocks, larger ones the one-program gather resolver with the same, and every plan copy
    is the lean one (16-byte accesses), with PDL at small batches where the GPU has it; batches from half the
    line up to it add the speculative layer-0 copy (128 entries a program on a GPU), smaller ones do not (here 1 row);
    in lockstep with reference_cpu on one state. The line is pinned at half the workspace (the interpreter's
    own): on a GPU it is a wave of 8 programs a row (16 rows on an H200), above every batch of this state, so
    that compiled runs, too, take all three profiles.

    Each launch is checked against the profile the runtime took for it (recorded as the runtime picks it by
    the call's rows): the split profiles' own one-program resolver launches the same build as the large
    profile's in the interpreter, so a resolver name alone cannot tell that the large profile ran."""
    from hisparse_triton import auto, kernels, launches
    from hisparse_triton.runtime import TritonRuntime

    p = ScenarioParams(block_size=4, top_k=16, extra_hot_blocks=1, max_requests=2, max_pages=8,
                       rows_per_request=rows, extra_batch_rows=1, num_layers=2, steps=4, locality=0.9,
                       resident_share=0.3, null_share=0.1, prefix_share=0.25, mask_share=0.15, padding_share=0.2,
                       maintenance_share=0.25, seed=seed)
    sc = build_scenario(p)
    events: list[tuple[str, object]] = []  # ("profile", (rows, Launches)) as picked, (kernel name, meta) as launched
    real_launch = kernels.launch
    real_pick = TritonRuntime._launches_for

    def launch(kernel: object, name: str, *args: object, **meta: object) -> None:
        events.append((name, meta))
        real_launch(kernel, name, *args, **meta)

    def pick(self: TritonRuntime, n: int) -> launches.Launches:
        x = real_pick(self, n)
        events.append(("profile", (n, x, self.config.max_batch_rows)))
        return x

    pdl = (backend.device.type == "cuda" and not torch.version.hip
           and torch.cuda.get_device_capability(backend.device)[0] >= 9)
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("HISPARSE_TRITON_")]:
            mp.delenv(key)
        mp.setattr(sys.modules[KERNELS], "launch", launch)
        mp.setattr(TritonRuntime, "_launches_for", pick)
        mp.setattr(auto, "small_rows", lambda multiprocessors, max_batch_rows: max(1, max_batch_rows // 2))
        _lockstep_with_reference(backend, sc, seed)
    ran: dict[str, set[str]] = {"one": set(), "spec": set(), "large": set()}
    last: tuple[int, launches.Launches, int] | None = None
    for name, what in events:
        if name == "profile":
            last = what  # type: ignore[assignment]
            continue
        if name not in ("resolve_split_kernel", "resolve_gather_kernel", "copy_plan_kernel", "copy_spec_kernel"):
            continue
        assert last is not None, name
        n, x, workspace = last
        meta = what
        assert isinstance(meta, dict)
        line = max(1, workspace // 2)
        small = n <= line
        which = "one" if n == 1 else "spec" if small else "large"
        # The profile is the one of the call's rows: the split tuning at 1 row and, with the speculative copy, from
        # 2 rows (half the line, at these workspaces) up to the line; the one-program one past it.
        assert x.max_rows == {"one": 1, "spec": line, "large": workspace}[which], (n, x.max_rows, line)
        assert x.tuning.split == (auto.AUTO_SPLIT if small else 0), (n, x.tuning)
        assert x.tuning.spec_copy == (128 if which == "spec" else 0) and bool(x.spec_meta) == (which == "spec"), (n, x)
        assert x.tuning.scan and x.tuning.shift and x.tuning.lean_copy, x.tuning
        assert x.tuning.pdl == (small and pdl) and x.tuning.plan_entries == (4 if small else 16), x.tuning
        if name == "resolve_split_kernel":
            assert small and {k: meta[k] for k in x.split_meta} == x.split_meta, (n, meta)
            assert meta["NS"] > 1 and meta["SH"] > 1 and meta["SB"] == 1 and meta["PDL"] == int(pdl), meta
            assert meta["MASK"] == (which == "spec"), (n, meta)  # the miss mask the speculative copy reads
        elif name == "resolve_gather_kernel":
            assert not small and {k: meta[k] for k in x.meta} == x.meta, (n, meta)
            assert meta["SH"] > 1 and meta["SK"] > 1 and meta["SB"] == 1 and meta["PDL"] == 0, meta
        elif name == "copy_spec_kernel":
            assert which == "spec" and {k: meta[k] for k in x.spec_meta if k != "VEC"} == \
                {k: v for k, v in x.spec_meta.items() if k != "VEC"}, (n, meta)
            assert meta["VEC"] == 4 and meta["SB"] == 1 and meta["PDL"] == int(pdl), (n, meta)
        else:
            assert meta["VEC"] == 4 and meta["SB"] == 1 and meta["PDL"] == int(small and pdl), (n, meta)
            assert meta["EB"] == x.plan_meta["EB"], (n, meta, x.plan_meta)
        ran[which].add(name)
    # Every profile resolved and copied, each with its own resolver and layer-0 copy (later layers: the plan copy).
    assert ran == {"one": {"resolve_split_kernel", "copy_plan_kernel"},
                   "spec": {"resolve_split_kernel", "copy_spec_kernel", "copy_plan_kernel"},
                   "large": {"resolve_gather_kernel", "copy_plan_kernel"}}, ran


@pytest.mark.parametrize(("seed", "locality"), [(4, 0.0), (9, 0.0), (4, 0.9), (9, 0.9)])
def test_split_keep_with_short_and_long_lists_matches_the_reference(backend, seed: int,  # noqa: ANN001
                                                                    locality: float) -> None:
    """`HISPARSE_TRITON_SPLIT_KEEP=1`: lists of at most one chunk stay in registers, longer ones take the
    chunked passes (a chunk is 4 candidates interpreted, one a thread compiled); steps with many misses
    (no locality) and few, in lockstep with reference_cpu, and the split kernel ran with KEEP."""
    p = ScenarioParams(block_size=4, top_k=16, extra_hot_blocks=1, max_requests=2, max_pages=8,
                       rows_per_request=2, extra_batch_rows=1, num_layers=2, steps=5, locality=locality,
                       resident_share=0.2, null_share=0.1, prefix_share=0.25, mask_share=0.15, padding_share=0.2,
                       maintenance_share=0.25, seed=seed)
    sc = build_scenario(p)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HISPARSE_TRITON_AUTO", "0")
        mp.setenv("HISPARSE_TRITON_SPLIT", "4")
        mp.setenv("HISPARSE_TRITON_SPLIT_KEEP", "1")
        names = _split_rows_and_launches(mp, lambda b: b)
        _lockstep_with_reference(backend, sc, seed)
    assert "resolve_split_kernel" in names and "resolve_gather_kernel" not in names, names
    assert all(m.get("KEEP") == 1 for m in names.metas["resolve_split_kernel"]), names.metas["resolve_split_kernel"][0]


@pytest.mark.parametrize(("env", "kernel"), [
    ({}, "resolve_gather_kernel"),
    ({"HISPARSE_TRITON_SPLIT": "4"}, "resolve_split_kernel"),
    ({"HISPARSE_TRITON_SPLIT": "4", "HISPARSE_TRITON_SPLIT_KEEP": "1"}, "resolve_split_kernel"),
    ({"HISPARSE_TRITON_SPLIT": "4", "HISPARSE_TRITON_SPLIT_TAIL": "1"}, "resolve_split_hot_kernel")],
    ids=["gather", "split4", "split4_keep", "split4_tail"])
@pytest.mark.parametrize("seed", [3, 8])
def test_stale_slot_hints_take_the_held_row_lookup(backend, env: dict[str, str], kernel: str,  # noqa: ANN001
                                                   seed: int) -> None:
    """A slot hint is believed only where its slot holds the entry's row, so any hints must give the
    reference's results. Before each step every hint is scrambled: a held row's entry then misses its
    hint and must be found by the held-slot lookup in the candidates' hash table (the path the other
    scenarios, whose hints are mostly right, barely reach: a lookup probing one bucket too few
    passed them)."""
    from hisparse_triton.runtime import TritonRuntime

    real_resolve = TritonRuntime.resolve
    gen = torch.Generator().manual_seed(seed)

    def resolve(self: TritonRuntime, inputs: ResolveInputs, **kw: object) -> object:
        h = self.config.hot_rows
        noise = torch.randint(-1, h, self._pos_slot.shape, generator=gen).to(self._pos_slot.dtype)
        self._pos_slot.copy_(noise.to(self._pos_slot.device))
        return real_resolve(self, inputs, **kw)  # type: ignore[arg-type]

    p = ScenarioParams(block_size=4, top_k=16, extra_hot_blocks=1, max_requests=2, max_pages=8,
                       rows_per_request=2, extra_batch_rows=1, num_layers=2, steps=5, locality=0.9,
                       resident_share=0.2, null_share=0.1, prefix_share=0.25, mask_share=0.15, padding_share=0.2,
                       maintenance_share=0.25, seed=seed)
    sc = build_scenario(p)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HISPARSE_TRITON_AUTO", "0")
        for k, v in env.items():
            mp.setenv(k, v)
        mp.setattr(TritonRuntime, "resolve", resolve)
        names = _split_rows_and_launches(mp, lambda b: b)
        _lockstep_with_reference(backend, sc, seed)
    # The build named is the one that resolved (and, with KEEP, was launched with it).
    assert kernel in names, names
    assert ("resolve_split_kernel" in names) is (kernel != "resolve_gather_kernel"), names
    if "HISPARSE_TRITON_SPLIT_KEEP" in env:
        assert all(m.get("KEEP") == 1 for m in names.metas["resolve_split_kernel"]), names.metas


@pytest.mark.parametrize(("seed", "locality", "rows", "early"),
                         [(4, 0.0, 1, True), (9, 0.9, 2, True), (4, 0.9, 1, False), (9, 0.0, 2, False)])
def test_spec_copy_matches_the_reference(backend, seed: int, locality: float, rows: int,  # noqa: ANN001
                                         early: bool) -> None:
    """`HISPARSE_TRITON_SPEC_COPY`: layer 0's copy behind the split resolver reads the likely misses' host
    rows first, then writes the resolver's misses. In lockstep with reference_cpu (outputs, hot state and
    device cache), with many misses and few, one and two rows a request; `early`: it predicts from the
    hint state as the resolver found it (the GPU's early read; interpreted, a copy), two rows a program
    at once and the rest after them; else from the state the resolver left, where no miss is predicted
    and every one takes the path after the wait (what a GPU's early read can see of a row the resolver
    is filling). The split kernel wrote the miss mask (MASK) and no plan-copy kernel copied layer 0. On an
    NVIDIA GPU of sm_90 or later the copy is a programmatic dependent launch, as the small-batch profile
    launches it: its early read sees the state while the resolver changes it."""
    from hisparse_triton.launches import Launches
    from hisparse_triton.runtime import TritonRuntime

    p = ScenarioParams(block_size=4, top_k=16, extra_hot_blocks=1, max_requests=2, max_pages=8,
                       rows_per_request=rows, extra_batch_rows=1, num_layers=2, steps=5, locality=locality,
                       resident_share=0.2, null_share=0.1, prefix_share=0.25, mask_share=0.15, padding_share=0.2,
                       maintenance_share=0.25, seed=seed)
    sc = build_scenario(p)
    metas: list[tuple[str, dict[str, object]]] = []
    real_spec = TritonRuntime._copy_spec

    def copy_spec(self: TritonRuntime, x: Launches, inputs: ResolveInputs, n: int, *, pos_slot: torch.Tensor,
                  hot_map: torch.Tensor) -> None:
        if not early:
            pos_slot, hot_map = self._pos_slot, self._hot_map
        real_spec(self, x, inputs, n, pos_slot=pos_slot, hot_map=hot_map)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HISPARSE_TRITON_AUTO", "0")
        mp.setenv("HISPARSE_TRITON_SPLIT", "4")
        mp.setenv("HISPARSE_TRITON_SPEC_COPY", "32")
        if (backend.device.type == "cuda" and not torch.version.hip
                and torch.cuda.get_device_capability(backend.device)[0] >= 9):
            mp.setenv("HISPARSE_TRITON_PDL", "1")  # compiled, the early read races the resolver as it would serve
        names = _split_rows_and_launches(mp, lambda b: b)
        mp.setattr(TritonRuntime, "_copy_spec", copy_spec)
        real_launch = sys.modules[KERNELS].launch

        def launch(kernel: object, name: str, *args: object, **meta: object) -> None:
            metas.append((name, meta))
            real_launch(kernel, name, *args, **meta)

        mp.setattr(sys.modules[KERNELS], "launch", launch)
        _lockstep_with_reference(backend, sc, seed)
    assert "copy_spec_kernel" in names and "resolve_gather_kernel" not in names, names
    # Layer 0 is the speculative copy's after every split resolve (layer 1 the plan copy's, replayed).
    order = [n for n in names if n in ("resolve_split_kernel", "copy_spec_kernel")]
    assert order == ["resolve_split_kernel", "copy_spec_kernel"] * (len(order) // 2), order
    assert all(m["MASK"] for n, m in metas if n == "resolve_split_kernel"), metas


def test_spec_copy_is_refused_where_nothing_splits() -> None:
    """`HISPARSE_TRITON_SPEC_COPY` follows the split resolver: one line when no batch size takes it, or
    with the split tail, or a bad entry count; nothing is built."""
    from hisparse_core.errors import InvalidInputError
    from hisparse_triton import auto, shapes

    with pytest.raises(InvalidInputError, match="HISPARSE_TRITON_SPEC_COPY='64' follows the split resolver"):
        auto.choose({"HISPARSE_TRITON_AUTO": "0", "HISPARSE_TRITON_SPEC_COPY": "64"}, max_batch_rows=8, small=4,
                    pdl=False)
    with pytest.raises(InvalidInputError, match="HISPARSE_TRITON_SPEC_COPY='64' does not combine"):
        shapes.tuning({"HISPARSE_TRITON_SPLIT": "8", "HISPARSE_TRITON_SPLIT_TAIL": "1",
                       "HISPARSE_TRITON_SPEC_COPY": "64"})
    with pytest.raises(InvalidInputError, match="HISPARSE_TRITON_SPEC_COPY='48' is not an entry count"):
        shapes.tuning({"HISPARSE_TRITON_SPEC_COPY": "48"})
    # With the auto choice the small batches' split takes it, larger ones keep the plan copy.
    choice = auto.choose({"HISPARSE_TRITON_SPEC_COPY": "64"}, max_batch_rows=8, small=4, pdl=False)
    assert [(p.tuning.split, p.tuning.spec_copy) for p in choice.profiles] == [(8, 64), (0, 64)]


def test_pdl_needs_sm90_and_is_refused_elsewhere(backend) -> None:  # noqa: ANN001
    """`HISPARSE_TRITON_PDL=1` is refused, with one line naming the device, where there is no NVIDIA
    GPU of compute capability 9.0 or later; on one, the runtime is built and resolves like the reference
    (the lockstep variants)."""
    from hisparse_core.errors import InvalidInputError

    cfg = RuntimeConfig(max_batch_rows=2, max_requests=2, top_k=4, hot_rows=4, block_size=2, max_pages=4)
    capable = (backend.device.type == "cuda" and not torch.version.hip
               and torch.cuda.get_device_capability(backend.device)[0] >= 9)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HISPARSE_TRITON_PDL", "1")
        if capable:
            backend.create_runtime(cfg)
        else:
            with pytest.raises(InvalidInputError, match="HISPARSE_TRITON_PDL='1' needs an NVIDIA GPU of compute "
                                                        "capability 9.0 or later.*; found "):
                backend.create_runtime(cfg)


@pytest.mark.parametrize(("version", "rocm", "compiles"), [
    ("3.6.0", True, False), ("3.8.1", True, False), ("3.9.0", True, True), ("3.10.0+git1a2b", True, True),
    ("3.6.0", False, True),
])
def test_cas_build_needs_triton_39_on_rocm(version: str, rocm: bool, compiles: bool) -> None:
    from hisparse_triton import shapes

    assert shapes.cas_compiles(version, rocm=rocm) is compiles


@pytest.mark.parametrize(("rocm_triton", "refused"), [("3.6.0", True), ("3.9.0", False), (None, False)])
def test_the_cas_build_is_refused_on_rocm_before_triton_39(rocm_triton: str | None, refused: bool) -> None:
    """The build that claims buckets by compare-and-swap fails to compile on ROCm under Triton 3.6: a
    runtime asking for it there is refused in one line naming the variable (CUDA: any Triton)."""
    from hisparse_core.errors import InvalidInputError
    from hisparse_triton import auto, shapes

    key = shapes.CAS_ENV
    tune = shapes.tuning({key: "1"})
    if refused:
        with pytest.raises(InvalidInputError, match=f"^{key}='1' needs Triton 3.9 or later on ROCm; found Triton "
                                                    f"{rocm_triton}$"):
            auto.check_target(tune, pdl=False, found=lambda: "a GPU", rocm_triton=rocm_triton)
    else:
        auto.check_target(tune, pdl=False, found=lambda: "a GPU", rocm_triton=rocm_triton)


def _random_plans(counts: torch.Tensor, k: int, dst_rows: int,
                  g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Plans of counts[r] entries for row r (the rest -1): host rows below 40, distinct device rows below
    dst_rows."""
    rows = counts.shape[0]
    plan_host = torch.full((rows, k), -1, dtype=torch.int32)
    plan_dev = torch.full((rows, k), -1, dtype=torch.int32)
    dsts = torch.randperm(dst_rows, generator=g)[:int(counts.sum())].to(torch.int32)
    at = 0
    for r in range(rows):
        c = int(counts[r])
        plan_host[r, :c] = torch.randint(0, 40, (c,), dtype=torch.int32, generator=g)
        plan_dev[r, :c] = dsts[at:at + c]
        at += c
    return plan_host, plan_dev


def test_the_runtime_line_is_logged_once_a_process_for_the_same_content(backend, caplog,  # noqa: ANN001
                                                                          monkeypatch) -> None:  # noqa: ANN001
    """`hisparse run --backend triton --layers 2 --index-share 1` builds a runtime a layer group: each
    logged the same `triton runtime on cpu ...` INFO line. Once now; a runtime of another size says its own."""
    import logging

    import hisparse_triton.runtime as runtime

    monkeypatch.setattr(runtime, "_logged", set())
    cfg = RuntimeConfig(max_batch_rows=2, max_requests=2, top_k=4, hot_rows=4, block_size=2, max_pages=4)
    with caplog.at_level(logging.INFO, logger="hisparse_triton.runtime"):
        backend.create_runtime(cfg)
        backend.create_runtime(cfg)
        backend.create_runtime(dataclasses.replace(cfg, top_k=3))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("triton runtime on ")]
    assert len(lines) == 2 and "top_k=4 " in lines[0] and "top_k=3 " in lines[1], lines
