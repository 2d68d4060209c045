"""The nvidia backend's vLLM op set (hisparse_nvidia.vllm_ops, cuda/vllm_ops.cu) against reference_cpu's,
byte for byte: random cases (padding rows, union groups of 2 and 4 rows, out-of-range LRU slots,
`miss_mask` passed or not), vLLM's call without source or resident tables, production shapes
(top-k 2048, hot 2x and 5x, a union spilling out of shared memory) over drifting steps, and a
captured CUDA graph replayed. Skips without a GPU."""

from __future__ import annotations

import pytest
import torch
from nvidia_support import gpu_reason

from hisparse_conformance.vllm_ops_model import NAMES, random_case, run_ops
from hisparse_reference_cpu.vllm_ops import ReferenceVllmOps

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_reason() is not None, reason=str(gpu_reason()))]

_OPS: list = []


def _ops():  # noqa: ANN202
    if not _OPS:
        from hisparse_nvidia.backend import NvidiaBackend

        _OPS.append(NvidiaBackend().vllm_ops())
    return _OPS[0]


def _pinned(case):  # noqa: ANN001, ANN202
    case.host = case.host.pin_memory()
    return case


def _plan_rows(got: dict, want: dict) -> None:
    for r in range(want["swap_counts"].shape[0]):
        c = max(0, int(want["swap_counts"][r]))
        assert torch.equal(got["swap_host"][r, :c], want["swap_host"][r, :c]), r
        assert torch.equal(got["swap_dev"][r, :c], want["swap_dev"][r, :c]), r


def _compare(got: dict, want: dict) -> None:
    for name in NAMES:
        if name in ("swap_host", "swap_dev"):
            continue
        assert torch.equal(got[name], want[name]), name
    _plan_rows(got, want)


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("rows_per_request", [1, 2, 4])
@pytest.mark.parametrize("miss_mask", [True, False])
def test_nvidia_vllm_ops_match_reference(seed: int, rows_per_request: int, miss_mask: bool) -> None:
    case = _pinned(random_case(seed, rows_per_request=rows_per_request, corrupt_lru=seed % 3 == 0))
    want = run_ops(ReferenceVllmOps(), case, miss_mask=miss_mask)
    got = run_ops(_ops(), case, "cuda", miss_mask=miss_mask)
    _compare(got, want)


def _set_build(monkeypatch: pytest.MonkeyPatch, build: str) -> None:
    """HISPARSE_VLLM_RESOLVE=the build's digits; the letters after them: "s" HISPARSE_VLLM_RESOLVE_SHAPE=1 (a
    build per shape), "p" HISPARSE_VLLM_RESOLVE_PDL=1 (a programmatic dependent launch); each switch is 0
    without its letter, so "4sp" is the default build and "4s" the launch that waits for the kernel before it."""
    digits = build.rstrip("sp")
    flags = build[len(digits):]
    monkeypatch.setenv("HISPARSE_VLLM_RESOLVE", digits)
    monkeypatch.setenv("HISPARSE_VLLM_RESOLVE_SHAPE", "1" if "s" in flags else "0")
    monkeypatch.setenv("HISPARSE_VLLM_RESOLVE_PDL", "1" if "p" in flags else "0")


#: The resolver as a programmatic dependent launch (HISPARSE_VLLM_RESOLVE_PDL=1, the default) on builds 4 (the
#: default build, "4sp") and 6, built per shape and (6p) once for every shape; "4s" and "6s" beside them in
#: the lists are the switch back (HISPARSE_VLLM_RESOLVE_PDL=0).
_PDL_BUILDS = ["4sp", "6sp", "6p"]


@pytest.mark.parametrize("build", ["0", "1", "2", "3", "4", "6", "1s", "3s", "4s", "6s", *_PDL_BUILDS])
@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("rows_per_request", [1, 4])
def test_other_resolver_builds_match_reference(seed: int, rows_per_request: int, build: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Every resolver build (HISPARSE_VLLM_RESOLVE 0 to 4 and 6; 2's rows that continue their group leave
    before their own loads; 4's lean path for one-row groups, 6's with its rows read one a lane; 1, 3, 4
    and 6 also built for the call's shape, whose sizes are compile-time constants; 4s is the default the
    other tests run) on random
    cases with union groups and padding rows."""
    _set_build(monkeypatch, build)
    case = _pinned(random_case(300 + seed, rows_per_request=rows_per_request, corrupt_lru=seed % 3 == 0))
    want = run_ops(ReferenceVllmOps(), case, miss_mask=seed % 2 == 0)
    got = run_ops(_ops(), case, "cuda", miss_mask=seed % 2 == 0)
    _compare(got, want)


def _resolve_both(args_cpu: list) -> tuple[list, list]:
    """Runs one resolve on reference_cpu (on `args_cpu`) and on nvidia (on CUDA copies); returns both lists."""
    args_gpu = [a.to("cuda") if isinstance(a, torch.Tensor) and i != 0 else a for i, a in enumerate(args_cpu)]
    ReferenceVllmOps().resolve_residency(*args_cpu)
    _ops().resolve_residency(*args_gpu)
    torch.cuda.synchronize()
    return args_cpu, args_gpu


def _assert_same(args_cpu: list, args_gpu: list) -> None:
    for i, (a, b) in enumerate(zip(args_cpu, args_gpu, strict=True)):
        if isinstance(a, torch.Tensor) and i != 0:
            if i in (19, 20):
                continue  # plan entries past each row's count are not part of the contract
            assert torch.equal(b.cpu(), a), i
    if args_cpu[21] is not None:
        for r in range(args_cpu[21].shape[0]):
            c = int(args_cpu[21][r])
            assert torch.equal(args_gpu[19][r, :c].cpu(), args_cpu[19][r, :c]), r
            assert torch.equal(args_gpu[20][r, :c].cpu(), args_cpu[20][r, :c]), r


def _no_table_args(seed: int, k: int, h: int, states: list[int], warm: bool) -> list:
    """vLLM's kernel-test call: no request ids, source or resident tables (topk are host rows)."""
    g = torch.Generator().manual_seed(seed)
    n = len(states)
    bs = 8
    host_rows = max(4096, 8 * k)
    bpr = -(-h // bs)
    hbt = torch.arange(n * bpr, dtype=torch.int32).reshape(n, bpr)
    topk = torch.stack([torch.randperm(host_rows, generator=g)[:k] for _ in range(n)]).to(torch.int32)
    topk[0, : min(3, k)] = -1 if k > 3 else topk[0, : min(3, k)]
    dgi = torch.full((n, h), -1, dtype=torch.int32)
    if warm:  # half of each row's top-k held, in random slots
        for r in range(n):
            slots = torch.randperm(h, generator=g)[: k // 2]
            dgi[r, slots] = topk[r, : k // 2].clamp(min=0)
    lru = torch.stack([torch.randperm(h, generator=g) for _ in range(n)]).to(torch.int16)
    host = torch.zeros(host_rows, 16, dtype=torch.uint8).pin_memory()
    hot = torch.zeros(n * bpr, bs, 16, dtype=torch.uint8)
    out = [torch.full((n, k), -999, dtype=torch.int32) for _ in range(6)]
    cnt = [torch.full((n,), -999, dtype=torch.int32) for _ in range(2)]
    return [host, hot, hbt, topk, out[0], dgi, lru, torch.tensor(states, dtype=torch.int32), h, k, out[1],
            torch.zeros(2, dtype=torch.int64), out[2], bs, None, None, 0, out[3], cnt[0], out[4], out[5], cnt[1],
            None, 0, 0]


@pytest.mark.parametrize("k", [1, 31, 32, 33, 64, 65, 128])
@pytest.mark.parametrize("warm", [False, True])
def test_no_tables_match_reference(k: int, warm: bool) -> None:
    args = _no_table_args(k + 100 * warm, k, 2 * k + 3, [0, -1, 2, 3, 3], warm)
    _assert_same(*_resolve_both(args))


def _lean_args(g: torch.Generator, topk: torch.Tensor, dgi: torch.Tensor, lru: torch.Tensor, states: list[int],
               h: int) -> list:
    """vLLM's kernel-test call (no tables) on the given top-k, hot map and LRU (copied)."""
    n, k = topk.shape
    bs = 4 if h < 1024 else 16  # the lean path needs the request's hot blocks one a thread (128 at 128 threads)
    hbt = torch.randperm(n * (h // bs), generator=g).to(torch.int32).reshape(n, h // bs)
    host = torch.zeros(4096, 16, dtype=torch.uint8).pin_memory()
    hot = torch.zeros(n * (h // bs), bs, 16, dtype=torch.uint8)
    out = [torch.full((n, k), -999, dtype=torch.int32) for _ in range(6)]
    cnt = [torch.full((n,), -999, dtype=torch.int32) for _ in range(2)]
    return [host, hot, hbt, topk.clone(), out[0], dgi.clone(), lru.clone(), torch.tensor(states, dtype=torch.int32), h,
            k, out[1], torch.zeros(2, dtype=torch.int64), out[2], bs, None, None, 0, out[3], cnt[0], out[4], out[5],
            cnt[1], None, 0, 0]


@pytest.mark.parametrize("build", ["3", "4", "4s", "6", "6s", "4sp", "6sp"])  # HISPARSE_VLLM_RESOLVE (see _set_build)
@pytest.mark.parametrize("k,h,threads", [(64, 64, 0), (64, 128, 0), (256, 512, 128), (200, 400, 128),
                                         (256, 1024, 128), (256, 2048, 128)])
@pytest.mark.parametrize("seed", range(3))
def test_duplicates_in_one_row_groups_match_reference(seed: int, k: int, h: int, threads: int, build: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """One-row groups (build 4's lean path where h % 4 == 0; 128 threads give each two entries and four LRU
    positions, 200 / 400 leave some without; 1024 and 2048 hot rows at 128 threads take more than four
    positions a thread, so build 3's path) over three steps: a cold step, the same top-k (hits), then a
    third of it fresh. The top-k repeats rows (first reference kept), the hot map holds some of its rows in
    two or three slots (each a hit, the last in LRU order is what the entries output), h = k leaves misses
    without a victim, padding rows sit between the groups."""
    _set_build(monkeypatch, build)
    monkeypatch.setenv("HISPARSE_VLLM_RESOLVE_THREADS", str(threads))
    g = torch.Generator().manual_seed(seed * 100 + k + h)
    states = [1, -1, 0, 3, 2, -1]
    n, s = len(states), 4
    topk = torch.stack([torch.randperm(4096, generator=g)[:k] for _ in range(n)]).to(torch.int32)
    rep = torch.rand((n, k), generator=g) < 0.15
    topk[:, 1:] = torch.where(rep[:, 1:], topk[:, :-1], topk[:, 1:])  # repeats of the entry before
    dgi = torch.full((s, h), -1, dtype=torch.int32)
    lru = torch.stack([torch.randperm(h, generator=g) for _ in range(s)]).to(torch.int16)
    for step in range(3):
        if step == 1:  # some held rows also in a second and a third slot
            for q in range(s):
                held = (dgi[q] >= 0).nonzero().flatten()
                for j in held[: max(1, held.numel() // 4)].tolist():
                    for _ in range(2):
                        dgi[q, int(torch.randint(0, h, (1,), generator=g))] = dgi[q, j]
        if step == 2:
            fresh = torch.randint(0, 4096, (n, k // 3), generator=g, dtype=torch.int32)
            topk[:, : k // 3] = fresh
        args = _lean_args(g, topk, dgi, lru, states, h)
        cpu, gpu = _resolve_both(args)
        _assert_same(cpu, gpu)
        dgi, lru = cpu[5], cpu[6]


def _production_args(seed: int, b: int, rpr: int, k: int, h: int, resident_frac: float) -> list:
    """top-k k over 32K contexts of 64-token pages, every request `rpr` consecutive batch rows, a part
    of the pages resident (null block 0), fp8_ds_mla rows."""
    g = torch.Generator().manual_seed(seed)
    bs, pages = 64, 512
    nreq = b
    n = b * rpr
    host_rows = nreq * pages * bs
    hbt = torch.arange(nreq * (h // bs), dtype=torch.int32).reshape(nreq, h // bs)
    src = (torch.arange(nreq * pages, dtype=torch.int32).reshape(nreq, pages))
    res = torch.where(torch.rand(nreq, pages, generator=g) < resident_frac,
                      torch.randint(1, 1000, (nreq, pages), generator=g, dtype=torch.int32), 0)
    topk = torch.stack([torch.randperm(pages * bs, generator=g)[:k] for _ in range(n)]).to(torch.int32)
    for r in range(1, n, rpr):  # later rows of a request share half their entries with its first row
        topk[r, : k // 2] = topk[r - 1, : k // 2] if rpr > 1 else topk[r, : k // 2]
    req = torch.arange(n, dtype=torch.int32) // rpr
    return [None, hbt, src, res, topk, req, host_rows]


def _production_step(state: dict, topk: torch.Tensor, k: int) -> list:
    n = topk.shape[0]
    out = [torch.full((n, k), -7, dtype=torch.int32) for _ in range(6)]
    cnt = [torch.full((n,), -7, dtype=torch.int32) for _ in range(2)]
    return [state["host"], state["hot"], state["hbt"], topk, out[0], state["dgi"], state["lru"], state["rsi"],
            state["h"], state["mur"], out[1], state["stats"], out[2], 64, state["req"], state["src"], 64, out[3],
            cnt[0], out[4], out[5], cnt[1], state["res"], 64, 0]


@pytest.mark.parametrize("build", ["1", "2", "3", "3s", "4", "4s", "6s", "4sp", "6sp"])  # see _set_build
@pytest.mark.parametrize("rpr,h,mur", [(1, 4096, 2048), (1, 10240, 2048), (2, 4096, 4096), (4, 10240, 8192),
                                       (4, 4096, 2048)])
def test_production_shapes_drifting_match_reference(rpr: int, h: int, mur: int, build: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    _set_build(monkeypatch, build)
    k, b = 2048, 3
    _, hbt, src, res, topk, req, host_rows = _production_args(rpr * 10 + h, b, rpr, k, h, 0.3)
    host = torch.empty((host_rows, 16), dtype=torch.uint8).pin_memory()
    hot = torch.zeros(hbt.numel() + 1, 64, 16, dtype=torch.uint8)
    st_cpu = {"host": host, "hot": hot, "hbt": hbt, "dgi": torch.full((b, h), -1, dtype=torch.int32),
              "lru": torch.arange(h, dtype=torch.int16).repeat(b, 1), "rsi": torch.tensor([2, 0, 1], dtype=torch.int32),
              "h": h, "mur": mur, "stats": torch.zeros(2, dtype=torch.int64), "req": req, "src": src, "res": res}
    st_gpu = {key: (v.to("cuda") if isinstance(v, torch.Tensor) and key != "host" else v) for key, v in st_cpu.items()}
    g = torch.Generator().manual_seed(h)
    for step in range(4):  # drifting: each step replaces a slice of every row's top-k
        if step:
            fresh = torch.randint(0, 512 * 64, (topk.shape[0], 300), generator=g, dtype=torch.int32)
            topk = torch.cat([topk[:, 300:], fresh], dim=1)
        a = _production_step(st_cpu, topk, k)
        ag = [x.to("cuda") if isinstance(x, torch.Tensor) and i not in (0, 5, 6, 11) else x for i, x in enumerate(a)]
        ag[1], ag[5], ag[6], ag[11] = st_gpu["hot"], st_gpu["dgi"], st_gpu["lru"], st_gpu["stats"]
        ReferenceVllmOps().resolve_residency(*a)
        _ops().resolve_residency(*ag)
        torch.cuda.synchronize()
        _assert_same(a, ag)


def _steady_state(seed: int, b: int, rpr: int, k: int, h: int, mur: int) -> tuple[dict, dict, torch.Tensor]:
    """CPU and CUDA state of `b` requests of `rpr` rows (state rows permuted), a hot buffer of `h` rows
    (any h: ceil(h / 64) hot blocks a request), top-k `k` over 512 pages of 64 rows, nothing resident;
    and a first top-k (a request's later rows share half their entries with its first)."""
    g = torch.Generator().manual_seed(seed)
    bs, pages = 64, 512
    n = b * rpr
    hb = -(-h // bs)
    hbt = torch.randperm(b * hb, generator=g).to(torch.int32).reshape(b, hb)
    src = torch.randperm(b * pages, generator=g).to(torch.int32).reshape(b, pages)
    topk = torch.stack([torch.randperm(pages * bs, generator=g)[:k] for _ in range(n)]).to(torch.int32)
    for r in range(1, n):
        if r % rpr:
            topk[r, : k // 2] = topk[r - 1, : k // 2]
    host = torch.empty((b * pages * bs, 16), dtype=torch.uint8).pin_memory()
    st_cpu = {"host": host, "hot": torch.zeros(b * hb + 1, bs, 16, dtype=torch.uint8), "hbt": hbt,
              "dgi": torch.full((b, h), -1, dtype=torch.int32),
              "lru": torch.stack([torch.randperm(h, generator=g) for _ in range(b)]).to(torch.int16),
              "rsi": torch.randperm(b, generator=g).to(torch.int32), "h": h, "mur": mur,
              "stats": torch.zeros(2, dtype=torch.int64), "req": torch.arange(n, dtype=torch.int32) // rpr,
              "src": src, "res": torch.zeros(b, pages, dtype=torch.int32)}
    st_gpu = {key: (v.to("cuda") if isinstance(v, torch.Tensor) and key != "host" else v) for key, v in st_cpu.items()}
    return st_cpu, st_gpu, topk


def _step_both(st_cpu: dict, st_gpu: dict, topk: torch.Tensor, k: int) -> None:
    a = _production_step(st_cpu, topk, k)
    ag = [x.to("cuda") if isinstance(x, torch.Tensor) and i not in (0, 5, 6, 11) else x for i, x in enumerate(a)]
    ag[1], ag[5], ag[6], ag[11] = st_gpu["hot"], st_gpu["dgi"], st_gpu["lru"], st_gpu["stats"]
    ag[22] = st_gpu["res"]
    ReferenceVllmOps().resolve_residency(*a)
    _ops().resolve_residency(*ag)
    torch.cuda.synchronize()
    _assert_same(a, ag)


@pytest.mark.parametrize("build", ["1", "3", "3s", "4", "4s", "6s", "4sp", "6sp"])  # see _set_build
@pytest.mark.parametrize("rpr,h,mur", [(1, 4096, 2048), (1, 4093, 2048), (2, 4096, 4096), (2, 10240, 4096),
                                       (4, 10240, 8192), (4, 4096, 4096)])
@pytest.mark.parametrize("seed", range(2))
def test_hit_and_resident_steps_match_reference(seed: int, rpr: int, h: int, mur: int, build: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The steps without misses, where build 3 writes the LRU order straight from registers (skipping
    slots that keep their place) and crosses no barrier after its scan: a cold step (misses), the same
    top-k again (every host entry a hit), again (the order already final: nothing moves), a step with a
    few fresh entries (hits and misses), a step where every page is resident (no host entry), then hits
    again; fresh random top-k, hot blocks and initial LRU orders, state rows permuted; h = 4093 takes the
    scalar copy of the hot-map row, 2 rows (union 4096) build 4's hash of 8192 shared buckets (build 3's
    size), 4 rows of h = 4096 a union larger than the hot buffer (misses past the evictable slots) hashed
    in global scratch, 4 rows of h = 10240 the LRU order through shared memory."""
    _set_build(monkeypatch, build)
    k, b = 2048, 3
    st_cpu, st_gpu, topk = _steady_state(1000 + seed * 10 + rpr, b, rpr, k, h, mur)
    g = torch.Generator().manual_seed(2000 + seed)
    steps = [topk, topk, topk]
    fresh = topk.clone()
    fresh[:, :37] = torch.randint(0, 512 * 64, (topk.shape[0], 37), generator=g, dtype=torch.int32)
    steps.append(fresh)
    for i, t in enumerate(steps + [fresh, fresh]):
        if i == 4:  # every page resident (blocks 1..999, vLLM's null block 0 never)
            res = torch.randint(1, 1000, st_cpu["res"].shape, generator=g, dtype=torch.int32)
        elif i == 5:
            res = torch.zeros_like(st_cpu["res"])
        else:
            res = st_cpu["res"]
        st_cpu["res"], st_gpu["res"] = res, res.to("cuda")
        _step_both(st_cpu, st_gpu, t, k)


@pytest.mark.parametrize("build", ["3", "4s", "6s", *_PDL_BUILDS])  # HISPARSE_VLLM_RESOLVE (see _set_build)
def test_resolve_and_gathers_capture_in_a_cuda_graph(build: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _set_build(monkeypatch, build)
    ops = _ops()
    case = _pinned(random_case(11, rows_per_request=2))
    args = case.resolve_args("cuda")
    fresh = [a.clone() if isinstance(a, torch.Tensor) and a.is_cuda else a for a in args]
    ops.resolve_residency(*args)  # warm-up: compiles and allocates the scratch outside capture
    ops.gather_compact(args[0], args[1], args[19], args[20], args[21])
    torch.cuda.synchronize()
    for a, f in zip(args, fresh, strict=True):
        if isinstance(a, torch.Tensor) and a.is_cuda:
            a.copy_(f)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.resolve_residency(*args)
        ops.gather_compact(args[0], args[1], args[19], args[20], args[21])
    for a, f in zip(args, fresh, strict=True):
        if isinstance(a, torch.Tensor) and a.is_cuda:
            a.copy_(f)
    graph.replay()
    torch.cuda.synchronize()
    ref = case.resolve_args("cpu")
    ReferenceVllmOps().resolve_residency(*ref)
    ReferenceVllmOps().gather_compact(ref[0], ref[1], ref[19], ref[20], ref[21])
    for i in (1, 4, 5, 6, 10, 11, 12, 17, 18, 21):
        assert torch.equal(args[i].cpu(), ref[i]), i


@pytest.mark.parametrize("build", ["6s", *_PDL_BUILDS])  # HISPARSE_VLLM_RESOLVE (see _set_build)
@pytest.mark.parametrize("seed", range(3))
def test_steps_chained_in_a_cuda_graph_match_reference(seed: int, build: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's decode chain replayed from one graph: resolve, gather_compact, resolve, ... over drifting
    steps (cold, hits and misses, hits). With HISPARSE_VLLM_RESOLVE_PDL=1 each resolver after the first is
    a programmatic dependent of the gather before it, which still reads the miss lists the resolver
    rewrites: every output, the hot map, LRU order, counters and hot rows must match reference_cpu's
    step for step (the last step's lists and the state after all of them)."""
    _set_build(monkeypatch, build)
    ops = _ops()
    k, b, h = 2048, 2, 4096
    st_cpu, st_gpu, topk = _steady_state(3000 + seed, b, 1, k, h, 2048)
    g = torch.Generator().manual_seed(4000 + seed)
    host_rows = st_cpu["host"].shape[0]
    st_cpu["host"].view(torch.int32).copy_(torch.randint(-2**31, 2**31 - 1, st_cpu["host"].view(torch.int32).shape,
                                                         generator=g, dtype=torch.int32))
    tops = [topk]
    for _ in range(3):
        nxt = tops[-1].clone()
        nxt[:, :97] = torch.randint(0, host_rows // b, (b, 97), generator=g, dtype=torch.int32)
        tops += [nxt, nxt]
    calls_gpu = []
    for t in tops:
        a = _production_step(st_cpu, t, k)
        ag = [x.to("cuda") if isinstance(x, torch.Tensor) and i not in (0, 5, 6, 11) else x for i, x in enumerate(a)]
        ag[1], ag[5], ag[6], ag[11], ag[22] = st_gpu["hot"], st_gpu["dgi"], st_gpu["lru"], st_gpu["stats"], st_gpu["res"]
        calls_gpu.append((a, ag))
    for a, _ in calls_gpu:  # the reference, step by step
        ReferenceVllmOps().resolve_residency(*a)
        ReferenceVllmOps().gather_compact(a[0], a[1], a[19], a[20], a[21])
    dgi0, lru0, stats0, hot0 = (st_gpu[x].clone() for x in ("dgi", "lru", "stats", "hot"))
    for _, ag in calls_gpu[:1]:  # warm-up outside capture (compiles, scratch), then the state put back
        ops.resolve_residency(*ag)
        ops.gather_compact(ag[0], ag[1], ag[19], ag[20], ag[21])
    torch.cuda.synchronize()
    for x, v in (("dgi", dgi0), ("lru", lru0), ("stats", stats0), ("hot", hot0)):
        st_gpu[x].copy_(v)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _, ag in calls_gpu:
            ops.resolve_residency(*ag)
            ops.gather_compact(ag[0], ag[1], ag[19], ag[20], ag[21])
    for x, v in (("dgi", dgi0), ("lru", lru0), ("stats", stats0), ("hot", hot0)):
        st_gpu[x].copy_(v)
    graph.replay()
    torch.cuda.synchronize()
    for a, ag in calls_gpu:
        _assert_same(a, ag)
    assert torch.equal(st_gpu["hot"].cpu(), st_cpu["hot"])


def _set_gather(monkeypatch: pytest.MonkeyPatch, variant: str) -> None:
    """HISPARSE_VLLM_GATHER=variant; "2-localL": the fused gather with HISPARSE_VLLM_GATHER_LOCAL=L (its
    barrier-free path for calls of at most 2048 entries)."""
    gather, _, local = variant.partition("-local")
    monkeypatch.setenv("HISPARSE_VLLM_GATHER", gather)
    monkeypatch.setenv("HISPARSE_VLLM_GATHER_LOCAL", local or "0")


_GATHER_PATHS = ["0", "2", "2-local1", "2-local2", "2-local3", "2-local4"]
_LOCAL = ["1", "2", "3", "4"]  # HISPARSE_VLLM_GATHER_LOCAL: bound 2048 (1, 2) or 4096 (3, 4); 2 and 4 one-round reads


def _gather_inputs(seed: int, n: int, k: int) -> dict:
    """Random gather arguments with duplicate destinations, untaken entries (negative source, destination
    out of range), absent source rows (zero fill), counts past top-k or negative, padding rows."""
    g = torch.Generator().manual_seed(seed)
    host_rows, blocks, bs, width = 40, 6, 4, 48
    hot_rows = blocks * bs

    def ints(lo: int, hi: int, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=g, dtype=torch.int32)

    return {"host": torch.randint(0, 256, (host_rows, width), generator=g, dtype=torch.uint8).pin_memory(),
            "hot": torch.randint(0, 256, (blocks, bs, width), generator=g, dtype=torch.uint8),
            "src": ints(-3, host_rows + 5, (n, k)), "dst": ints(-2, hot_rows + 2, (n, k)),
            "counts": ints(-1, k + 3, (n,)), "mask": ints(0, 2, (n, k)), "rsi": ints(-1, 3, (n,))}


def _reference_gathers(x: dict[str, torch.Tensor], n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """reference_cpu's gather_compact and gather_plan of inputs `x` (n rows of top-k k): the hot caches
    they leave and gather_plan's attention rows (written over 7s)."""
    ref = ReferenceVllmOps()
    want_c, want_p = x["hot"].clone(), x["hot"].clone()
    want_att = torch.full((n, k), 7, dtype=torch.int32)
    ref.gather_compact(x["host"], want_c, x["src"], x["dst"], x["counts"])
    ref.gather_plan(x["host"], want_p, x["src"], x["dst"], x["mask"], x["rsi"], want_att, 4)
    return want_c, want_p, want_att


@pytest.mark.parametrize("variant", _GATHER_PATHS)
@pytest.mark.parametrize("seed", range(12))
def test_gathers_last_write_wins_match_reference(seed: int, variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every gather path (HISPARSE_VLLM_GATHER 0: mark + copy kernels, 2: one fused kernel with a
    ticketed copy, and its barrier-free path for small calls) on inputs where several entries name one
    destination: the last entry's row lands, as in the reference."""
    _set_gather(monkeypatch, variant)
    n, k = [(1, 7), (3, 16), (9, 33), (64, 129)][seed % 4]
    x = _gather_inputs(seed, n, k)
    want_c, want_p, want_att = _reference_gathers(x, n, k)
    d = {name: t.cuda() for name, t in x.items() if name != "host"}
    got_c, got_p = d["hot"].clone(), d["hot"].clone()
    got_att = torch.full((n, k), 7, dtype=torch.int32, device="cuda")
    for _ in range(2):  # a second call: marks of the first must not match
        got_c.copy_(d["hot"])
        got_p.copy_(d["hot"])
        _ops().gather_compact(x["host"], got_c, d["src"], d["dst"], d["counts"])
        _ops().gather_plan(x["host"], got_p, d["src"], d["dst"], d["mask"], d["rsi"], got_att, 4)
        torch.cuda.synchronize()
        assert torch.equal(got_c.cpu(), want_c)
        assert torch.equal(got_p.cpu(), want_p)
        assert torch.equal(got_att.cpu(), want_att)


@pytest.mark.parametrize("variant", ["0", "2"])
def test_gathers_across_the_epoch_wrap_match_reference(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Destination marks keep the epoch's low 32 bits: the call before they wrap clears every mark, so
    the calls after it (epoch 1 again) still copy, last write winning. The epoch is set just below the
    wrap; without the clearing the marks of the new epochs lose to the old ones and nothing lands."""
    monkeypatch.setenv("HISPARSE_VLLM_GATHER", variant)
    monkeypatch.setenv("HISPARSE_VLLM_GATHER_LOCAL", "0")  # the marks' path: the barrier-free one has no epoch
    n, k = 9, 33
    x = _gather_inputs(77, n, k)
    ref = ReferenceVllmOps()
    want = x["hot"].clone()
    ref.gather_compact(x["host"], want, x["src"], x["dst"], x["counts"])
    d = {name: t.cuda() for name, t in x.items() if name != "host"}
    got = d["hot"].clone()
    epoch = _ops()._copy_state(got.device, got.shape[0] * got.shape[1], n * k)[0]
    epoch.fill_(2**32 - 3)
    for call in range(5):
        got.copy_(d["hot"])
        _ops().gather_compact(x["host"], got, d["src"], d["dst"], d["counts"])
        torch.cuda.synchronize()
        assert torch.equal(got.cpu(), want), f"call {call}, epoch {int(epoch.item())}"
    assert int(epoch.item()) == 3, int(epoch.item())  # 2^32 - 3, - 2, - 1, then 1 (marks cleared), 2, 3


@pytest.mark.parametrize("variant", _GATHER_PATHS)
@pytest.mark.parametrize("seed", range(4))
def test_gather_plan_alternating_empty_and_sparse_masks(seed: int, variant: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """gather_plan calls with nothing taken (the fused kernel's blocks all leave without waiting) between
    calls where only a few blocks take entries (only they copy): every call matches the reference, so
    the barrier, ticket and epoch state is left right by both kinds of call."""
    _set_gather(monkeypatch, variant)
    n, k = [(1, 2048), (8, 300), (33, 129), (128, 64)][seed]
    x = _gather_inputs(100 + seed, n, k)
    g = torch.Generator().manual_seed(200 + seed)
    ref = ReferenceVllmOps()
    want, want_att = x["hot"].clone(), torch.full((n, k), 7, dtype=torch.int32)
    d = {name: t.cuda() for name, t in x.items() if name != "host"}
    got, got_att = d["hot"].clone(), torch.full((n, k), 7, dtype=torch.int32, device="cuda")
    for step in range(6):
        mask = torch.zeros((n, k), dtype=torch.int32)
        if step % 2:
            hits = torch.randint(0, n * k, (1 + step,), generator=g)
            mask.view(-1)[hits] = 1
        ref.gather_plan(x["host"], want, x["src"], x["dst"], mask, x["rsi"], want_att, 4)
        _ops().gather_plan(x["host"], got, d["src"], d["dst"], mask.cuda(), d["rsi"], got_att, 4)
        torch.cuda.synchronize()
        assert torch.equal(got.cpu(), want), f"step {step}"
        assert torch.equal(got_att.cpu(), want_att), f"step {step}"


@pytest.mark.parametrize("local", _LOCAL)
@pytest.mark.parametrize("rows_per_request", [1, 2, 4])
@pytest.mark.parametrize("seed", range(12))
def test_local_gather_ops_match_reference(seed: int, rows_per_request: int, local: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's sequence (resolve, gather_compact of its plan, gather_plan of its mask, invalidation) with the
    fused gather's barrier-free path (HISPARSE_VLLM_GATHER_LOCAL) on the random cases: padding rows, union
    groups, zero-filled rows past the host pool, strided hot blocks."""
    _set_gather(monkeypatch, f"2-local{local}")
    case = _pinned(random_case(500 + seed, rows_per_request=rows_per_request, corrupt_lru=seed % 3 == 0))
    want = run_ops(ReferenceVllmOps(), case, miss_mask=seed % 2 == 0)
    got = run_ops(_ops(), case, "cuda", miss_mask=seed % 2 == 0)
    _compare(got, want)


def _local_inputs(seed: int, n: int, k: int, counts: list[int], distinct: bool) -> dict:
    """Gather arguments over 4400 hot rows (4-row blocks) and 300 host rows: destinations drawn from every
    hot row (`distinct`: up to 2048 different ones, probing the hash; fp8_ds_mla's 656-byte rows) or half
    of them from 40 rows (many entries naming one row; 48-byte rows), some out of range; sources some
    negative (not taken) and some past the host pool (zero fill); the given counts (past top-k and
    negative included)."""
    g = torch.Generator().manual_seed(seed)
    host_rows, blocks, bs, width = 300, 1100, 4, 656 if distinct else 48
    hot_rows = blocks * bs

    def ints(lo: int, hi: int, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=g, dtype=torch.int32)

    dst = ints(-1, hot_rows + 1, (n, k))
    if not distinct:
        dst = torch.where(torch.rand((n, k), generator=g) < 0.5, ints(0, 40, (n, k)), dst)
    return {"host": torch.randint(0, 256, (host_rows, width), generator=g, dtype=torch.uint8).pin_memory(),
            "hot": torch.randint(0, 256, (blocks, bs, width), generator=g, dtype=torch.uint8),
            "src": ints(-2, host_rows + 4, (n, k)), "dst": dst, "counts": torch.tensor(counts, dtype=torch.int32),
            "mask": ints(0, 2, (n, k)), "rsi": ints(-1, 3, (n,))}


# (rows, top-k, counts): rows x top-k at the path's bound (2048) and past it with the counted entries at
# the bounds (2048 and 4096: the path; 2049 and 4097: the marks and barrier in the same launch), few
# counted entries over many rows, a row counted past top-k (clamped) and negative counts.
_LOCAL_SHAPES = [(1, 2048, [2048]), (1, 2048, [5000]), (16, 128, [128] * 16), (16, 300, [128] * 15 + [128]),
                 (16, 300, [128] * 15 + [129]), (16, 300, [400] + [-3] * 14 + [1748]), (64, 129, [3, 0, -1, 9] * 16),
                 (1, 2049, [2049]), (3, 7, [9, -2, 4]), (16, 300, [256] * 16), (16, 300, [256] * 15 + [257])]


@pytest.mark.parametrize("local", _LOCAL)
@pytest.mark.parametrize("distinct", [True, False])
@pytest.mark.parametrize("shape", range(len(_LOCAL_SHAPES)))
def test_local_gather_bounds_match_reference(shape: int, distinct: bool, local: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Both gathers with HISPARSE_VLLM_GATHER_LOCAL at and around its bounds (rows x top-k 2048 for
    gather_plan and the one-round reads of 2 and 4; counted entries 2048 or 4096 for gather_compact),
    twice (a second call sees whatever the first left): byte-identical to the reference, last write
    winning."""
    _set_gather(monkeypatch, f"2-local{local}")
    n, k, counts = _LOCAL_SHAPES[shape]
    x = _local_inputs(shape * 10 + distinct, n, k, counts, distinct)
    want_c, want_p, want_att = _reference_gathers(x, n, k)
    d = {name: t.cuda() for name, t in x.items() if name != "host"}
    for _ in range(2):
        got_c, got_p = d["hot"].clone(), d["hot"].clone()
        got_att = torch.full((n, k), 7, dtype=torch.int32, device="cuda")
        _ops().gather_compact(x["host"], got_c, d["src"], d["dst"], d["counts"])
        _ops().gather_plan(x["host"], got_p, d["src"], d["dst"], d["mask"], d["rsi"], got_att, 4)
        torch.cuda.synchronize()
        assert torch.equal(got_c.cpu(), want_c)
        assert torch.equal(got_p.cpu(), want_p)
        assert torch.equal(got_att.cpu(), want_att)


@pytest.mark.parametrize("local", _LOCAL)
def test_local_gather_leaves_the_marks_epoch_to_larger_calls(local: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls of 2048 counted entries (the barrier-free path: no mark, no epoch step) between calls of 4800
    (past every bound: marks, barrier and the epoch in the same launch), across the marks' epoch wrap:
    every call matches the reference and only the larger calls move the epoch."""
    _set_gather(monkeypatch, f"2-local{local}")
    n, k = 16, 300
    small = _local_inputs(1, n, k, [128] * 16, False)
    large = _local_inputs(2, n, k, [300] * 16, False)
    ref = ReferenceVllmOps()
    want = {}
    for name, x in (("small", small), ("large", large)):
        want[name] = x["hot"].clone()
        ref.gather_compact(x["host"], want[name], x["src"], x["dst"], x["counts"])
    dev = {name: {key: t.cuda() for key, t in x.items() if key != "host"} for name, x in (("small", small),
                                                                                        ("large", large))}
    hot = dev["small"]["hot"]
    epoch = _ops()._copy_state(hot.device, hot.shape[0] * hot.shape[1], n * k)[0]
    epoch.fill_(2**32 - 2)
    for call, name in enumerate(["small", "large", "small", "large", "small", "large", "small"]):
        x, d = (small, dev["small"]) if name == "small" else (large, dev["large"])
        got = d["hot"].clone()
        _ops().gather_compact(x["host"], got, d["src"], d["dst"], d["counts"])
        torch.cuda.synchronize()
        assert torch.equal(got.cpu(), want[name]), f"call {call} ({name}), epoch {int(epoch.item())}"
    assert int(epoch.item()) == 2, int(epoch.item())  # 2^32 - 2, then - 1, then 1 (marks cleared), 2


@pytest.mark.parametrize("local", _LOCAL)
def test_local_gathers_capture_in_a_cuda_graph(local: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Resolve, gather_compact and gather_plan (into a second hot cache) with the barrier-free gather path,
    captured in a CUDA graph after a warm-up and replayed on the fresh inputs: byte-identical to the
    reference (union groups of two rows)."""
    _set_gather(monkeypatch, f"2-local{local}")
    ops = _ops()
    case = _pinned(random_case(12, rows_per_request=2))
    args = case.resolve_args("cuda")
    fresh = [a.clone() if isinstance(a, torch.Tensor) and a.is_cuda else a for a in args]
    plan_hot, plan_att = args[1].clone(), torch.full_like(args[4], 7)
    plan_state = torch.where(args[14] >= 0, 0, -1).to(torch.int32)

    def sequence() -> None:
        ops.resolve_residency(*args)
        ops.gather_compact(args[0], args[1], args[19], args[20], args[21])
        ops.gather_plan(args[0], plan_hot, args[17], args[4], args[10], plan_state, plan_att, case.att_stride)

    def restore() -> None:
        for a, f in zip(args, fresh, strict=True):
            if isinstance(a, torch.Tensor) and a.is_cuda:
                a.copy_(f)
        plan_hot.copy_(fresh[1])
        plan_att.fill_(7)

    sequence()  # warm-up: compiles and allocates the scratch outside capture
    torch.cuda.synchronize()
    restore()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sequence()
    restore()
    graph.replay()
    torch.cuda.synchronize()
    ref = case.resolve_args("cpu")
    ref_hot, ref_att = ref[1].clone(), torch.full_like(ref[4], 7)
    ReferenceVllmOps().resolve_residency(*ref)
    ReferenceVllmOps().gather_compact(ref[0], ref[1], ref[19], ref[20], ref[21])
    ReferenceVllmOps().gather_plan(ref[0], ref_hot, ref[17], ref[4], ref[10], torch.where(ref[14] >= 0, 0, -1).to(
        torch.int32), ref_att, case.att_stride)
    for i in (1, 4, 5, 6, 10, 11, 12, 17, 18, 21):
        assert torch.equal(args[i].cpu(), ref[i]), i
    assert torch.equal(plan_hot.cpu(), ref_hot)
    assert torch.equal(plan_att.cpu(), ref_att)
