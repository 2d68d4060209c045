"""CPU checks of the NVIDIA backend: every kernel compiles for sm_90 with NVRTC; the plugin is light.

Runs on machines without a GPU (CI). Skips only when cuda-python or its NVRTC is not installed.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest


def _nvrtc_reason() -> str | None:
    if importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None:
        return "cuda-python not installed"
    try:
        from hisparse_nvidia.compiler import nvrtc_version

        nvrtc_version()
    except Exception as exc:  # noqa: BLE001 - libnvrtc missing raises from cuda.pathfinder
        return f"NVRTC unavailable: {exc}"
    return None


needs_nvrtc = pytest.mark.skipif(_nvrtc_reason() is not None, reason=str(_nvrtc_reason()))


def _build_ids():  # noqa: ANN202
    from hisparse_nvidia.kernels import all_builds_for_ci

    return [pytest.param(b, id=f"{b.source}-" + "-".join(f"{k}{v}" for k, v in b.defines)) for b in all_builds_for_ci()]


@needs_nvrtc
@pytest.mark.parametrize("build", _build_ids())
def test_kernel_compiles_for_sm90(build) -> None:  # noqa: ANN001
    from hisparse_nvidia.compiler import compile_kernel

    out = compile_kernel(build, 90, use_cache=False)
    assert out.kind == "cubin" and out.target == "sm_90"
    assert out.image[:4] == b"\x7fELF"
    assert "warning" not in out.log.lower(), out.log


@needs_nvrtc
def test_every_kernel_source_is_built() -> None:
    from hisparse_nvidia.compiler import kernel_sources
    from hisparse_nvidia.kernels import all_builds_for_ci

    assert {b.source for b in all_builds_for_ci()} == set(kernel_sources())


@needs_nvrtc
def test_vllm_ops_builds_hold_every_kernel() -> None:
    # Every vLLM-op kernel the host launches by name (hisparse_vllm_gather_local and _local4k,
    # HISPARSE_VLLM_GATHER_LOCAL, among them) is in the builds CI compiles above, not only in a build a GPU run would meet first.
    from hisparse_nvidia.compiler import compile_kernel
    from hisparse_nvidia.kernels import all_builds_for_ci, vllm_ops_build

    build = vllm_ops_build(656)
    assert build in all_builds_for_ci()
    image = compile_kernel(build, 90).image
    for name in ("resolve", "mark", "copy", "gather", "gather_local", "gather_local4k", "invalidate"):
        assert f"hisparse_vllm_{name}\0".encode() in image, name


@needs_nvrtc
def test_vllm_resolver_pdl_build_waits_first() -> None:
    # HISPARSE_VLLM_RESOLVE_PDL=1 (the default) and 0: both resolver builds are in the CI set; 1's PTX holds
    # the wait, as the kernel's first griddepcontrol instruction, and 0's does not.
    from hisparse_nvidia.compiler import compile_source, kernel_text
    from hisparse_nvidia.kernels import all_builds_for_ci, vllm_resolve_shape_build

    def resolver_ptx(pdl: int) -> str:
        build = vllm_resolve_shape_build(6, 2048, 4096, 64, 64, 64, 8192, 1024, pdl)
        assert build in all_builds_for_ci()
        image, _ = compile_source(kernel_text(build.source), build.source, build.options("compute_90"), "ptx")
        return image.decode().split(".entry hisparse_vllm_resolve", 1)[1]

    with_wait, plain = resolver_ptx(1), resolver_ptx(0)
    assert with_wait.index("griddepcontrol.wait") < with_wait.index("griddepcontrol.launch_dependents")
    assert "griddepcontrol.wait" not in plain
    # Before the wait only the kernel's parameters are read (no load, store or atomic on memory the
    # previous grid may still be writing).
    before = with_wait[:with_wait.index("griddepcontrol.wait")]
    ops = set(re.findall(r"^\s*(?:@!?%\w+\s+)?([a-z]+(?:\.[a-z0-9]+)*)", before, re.M))
    touching = {op for op in ops if op.split(".")[0] in ("ld", "st", "atom", "red", "cp", "prefetch")
                and not op.startswith("ld.param")}
    assert not touching, touching


@needs_nvrtc
def test_disk_cache_round_trip(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    from hisparse_nvidia.compiler import ENV_CACHE, compile_kernel
    from hisparse_nvidia.kernels import MAINTAIN_BUILD

    monkeypatch.setenv(ENV_CACHE, str(tmp_path))
    first = compile_kernel(MAINTAIN_BUILD, 90)
    second = compile_kernel(MAINTAIN_BUILD, 90)
    assert not first.cached and second.cached and first.image == second.image
    assert len(list(tmp_path.iterdir())) == 1


@needs_nvrtc
def test_unknown_architecture_falls_back_to_ptx() -> None:
    from hisparse_nvidia.compiler import compile_kernel
    from hisparse_nvidia.kernels import MAINTAIN_BUILD

    out = compile_kernel(MAINTAIN_BUILD, 999, use_cache=False)
    assert out.kind == "ptx" and out.target.startswith("compute_")


def test_plugin_imports_nothing_heavy() -> None:
    code = ("import sys, hisparse_nvidia.plugin; heavy = [m for m in ('torch', 'cuda', 'numpy') if m in sys.modules]; "
            "print(heavy); assert not heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_probe_gives_a_reason_or_none() -> None:
    from hisparse_nvidia.plugin import probe

    reason = probe()
    assert reason is None or isinstance(reason, str) and reason


def test_resolver_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    from hisparse_core.errors import InvalidInputError
    from hisparse_core.geometry import RuntimeConfig
    from hisparse_nvidia.kernels import ENV_RESOLVE_SMEM, resolver_shape

    cfg = RuntimeConfig(max_batch_rows=1, max_requests=1, top_k=2048, hot_rows=4096, block_size=64, max_pages=512)
    prod = resolver_shape(cfg)
    assert prod.build.source == "resolve.cu"
    assert (prod.threads, prod.entries_per_thread, prod.lru_per_thread, prod.hash_bits) == (1024, 2, 4, 12)
    assert dict(prod.build.defines)["HS_K"] == 2048 and dict(prod.build.defines)["HS_P"] == 512
    assert prod.tables_in_smem  # 4 KB of page tables
    assert prod.dynamic_smem + prod.static_smem <= 100 * 1024
    none = resolver_shape(cfg, max_smem=0)
    assert not none.tables_in_smem and none.dynamic_smem == prod.dynamic_smem - 8 * 512
    monkeypatch.setenv(ENV_RESOLVE_SMEM, "0")
    assert resolver_shape(cfg) == none
    monkeypatch.setenv(ENV_RESOLVE_SMEM, "lots")
    with pytest.raises(InvalidInputError, match="HISPARSE_RESOLVE_SMEM='lots'"):
        resolver_shape(cfg)
    monkeypatch.delenv(ENV_RESOLVE_SMEM)
    # Speculative rows: the union of 4 rows, a 10K-row hot buffer, 128K-token contexts.
    mtp = RuntimeConfig(max_batch_rows=64, max_requests=16, top_k=2048, hot_rows=10240, block_size=64,
                        max_pages=2048, rows_per_request=4)
    big = resolver_shape(mtp)
    assert big.dynamic_smem + big.static_smem <= 227 * 1024 and big.hash_bits == 14 and big.tables_in_smem
    # Rows that are not whole 16-byte vectors are gathered.
    odd = resolver_shape(RuntimeConfig(max_batch_rows=3, max_requests=2, top_k=7, hot_rows=21, block_size=3,
                                       max_pages=5, rows_per_request=2))
    assert not odd.tables_in_smem
    with pytest.raises(InvalidInputError, match="rows_per_request=33"):
        resolver_shape(RuntimeConfig(max_batch_rows=33, max_requests=1, top_k=8, hot_rows=264, block_size=8,
                                     max_pages=1, rows_per_request=33))
    with pytest.raises(InvalidInputError, match="threads"):
        resolver_shape(RuntimeConfig(max_batch_rows=1, max_requests=1, top_k=8, hot_rows=8, block_size=8,
                                     max_pages=1), threads=100)
    with pytest.raises(InvalidInputError, match="2\\^31"):
        resolver_shape(RuntimeConfig(max_batch_rows=1, max_requests=4096, top_k=8, hot_rows=64, block_size=64,
                                     max_pages=8192))


def test_resolver_cluster_shapes() -> None:
    """Cluster builds: each helper pushes whole 8-hint vectors, a leader thread's entries lie in one
    share, and the leader's shared memory grows by the pushed hints (2 bytes an entry)."""
    from hisparse_core.errors import InvalidInputError
    from hisparse_core.geometry import RuntimeConfig
    from hisparse_nvidia.kernels import cluster_width_allowed, resolver_shape

    cfg = RuntimeConfig(max_batch_rows=1, max_requests=1, top_k=2048, hot_rows=4096, block_size=64, max_pages=512)
    one = resolver_shape(cfg)
    for width in (2, 4, 8):
        shape = resolver_shape(cfg, cluster=width)
        assert dict(shape.build.defines)["HS_C"] == width and shape.cluster == width
        assert shape.dynamic_smem == one.dynamic_smem + 2 * (2048 - 2048 // width)
    assert "HS_C" not in dict(one.build.defines) and one.cluster == 1  # one-block builds keep their cache keys
    odd = RuntimeConfig(max_batch_rows=1, max_requests=1, top_k=12, hot_rows=48, block_size=4, max_pages=8)
    assert not cluster_width_allowed(odd, 2, 128)  # 12 entries are not whole 8-hint pushes
    assert cluster_width_allowed(odd, 1, 128)
    with pytest.raises(InvalidInputError, match="cluster of 2 blocks"):
        resolver_shape(odd, cluster=2)
    assert not cluster_width_allowed(cfg, 16, 1024)  # at most 8 blocks (a portable cluster)


def test_copy_slots_cover_every_row_once() -> None:
    """The copy kernels cut a row along its host side's 128-byte lines into `slots_per_row` slots;
    slot j of a row starting at byte offset o (16-aligned) moves bytes [16j - o, 16j - o + 16) when
    inside the row. Every 16-byte chunk must be moved by exactly one slot, for every row size and
    offset, or a copy would silently skip bytes."""
    from hisparse_nvidia.kernels import CopyShape

    for row_bytes in range(16, 4097, 16):
        slots = CopyShape(row_bytes).slots_per_row
        assert slots % 8 == 0
        for offset in range(0, 128, 16):
            moved = [16 * j - offset for j in range(slots) if 0 <= 16 * j - offset < row_bytes]
            assert moved == list(range(0, row_bytes, 16)), (row_bytes, offset)
    assert CopyShape(656).slots_per_row == 48  # fp8_ds_mla: 6 lines at most


@needs_nvrtc
def test_bench_floor_kernels_compile_for_sm90() -> None:
    """bench/hit_floor.cu (the hit step's dependency floor and the empty dependent kernel that
    bench_nvidia.py times) builds as the bench builds it, so a GPU call does not find it broken."""
    from pathlib import Path

    from hisparse_nvidia.compiler import KernelBuild, compile_source

    src = Path(__file__).resolve().parents[2] / "bench" / "hit_floor.cu"
    build = KernelBuild.of("hit_floor.cu", {"HS_NT": 1024, "HS_K": 2048, "HS_H": 4096, "HS_BS": 64, "HS_P": 512})
    image, log = compile_source(src.read_text(), build.source, build.options("sm_90"))
    assert image[:4] == b"\x7fELF" and "warning" not in log.lower(), log


@needs_nvrtc
@pytest.mark.parametrize("k,h", [(1, 1), (31, 65), (2048, 4096), (2048, 10240), (8192, 32768)])
def test_vllm_resolver_launch_shape(k: int, h: int) -> None:
    """vLLM's resolver: at most 32 entries of a row and 32 LRU positions a thread (its bit masks), and
    its shared memory (hash beside the LRU order) within what a Hopper block may take."""
    from hisparse_nvidia.vllm_ops import RESOLVE_SMEM_BUDGET, resolve_smem_buckets, resolve_threads

    t = resolve_threads(k, h)
    assert t in (128, 256, 512, 1024) and -(-k // t) <= 32 and -(-h // t) <= 32
    for want in (128, 256, 512, 1024):  # HISPARSE_VLLM_RESOLVE_THREADS: that many where the call allows
        w = resolve_threads(k, h, want)
        assert w in (128, 256, 512, 1024) and -(-k // w) <= 32 and -(-h // w) <= 32
        assert w == want or (w > want and -(-max(k, h) // (w // 2)) > 32)
    for union in (k, min(h, 4 * k), h):
        buckets = resolve_smem_buckets(union, h, k)
        assert 0 <= buckets <= 2 * union and 12 * buckets + 2 * h <= RESOLVE_SMEM_BUDGET <= 227 * 1024
