"""CPU checks of the NVIDIA backend: every kernel compiles for sm_90 with NVRTC; the plugin is light.

Runs on machines without a GPU (CI). Skips only when cuda-python or its NVRTC is not installed.
"""

from __future__ import annotations

import importlib.util
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


def test_resolver_shapes() -> None:
    from hisparse_core.errors import InvalidInputError
    from hisparse_core.geometry import RuntimeConfig
    from hisparse_nvidia.kernels import resolver_shape

    cfg = RuntimeConfig(max_batch_rows=1, max_requests=1, top_k=2048, hot_rows=4096, block_size=64, max_pages=512)
    prod = resolver_shape(cfg)
    assert prod.version == 2 and prod.build.source == "resolve2.cu"
    assert (prod.threads, prod.entries_per_thread, prod.lru_per_thread, prod.hash_bits) == (1024, 2, 4, 13)
    assert prod.dynamic_smem <= 100 * 1024  # one block per SM with room to spare on Hopper (227 KB)
    mtp = RuntimeConfig(max_batch_rows=64, max_requests=16, top_k=2048, hot_rows=10240, block_size=64,
                        max_pages=2048, rows_per_request=4)
    big = resolver_shape(mtp)
    assert big.dynamic_smem + big.static_smem <= 227 * 1024 and big.hash_bits == 14
    with pytest.raises(InvalidInputError):
        resolver_shape(RuntimeConfig(max_batch_rows=1, max_requests=1, top_k=8, hot_rows=8, block_size=8,
                                     max_pages=1), threads=100)


def test_cluster_resolver_shapes_and_choice() -> None:
    from hisparse_core.errors import InvalidInputError
    from hisparse_core.geometry import RuntimeConfig
    from hisparse_nvidia.kernels import cluster_resolver_shapes, pick_cluster_shape

    cfg = RuntimeConfig(max_batch_rows=128, max_requests=128, top_k=2048, hot_rows=4096, block_size=64, max_pages=512)
    shapes = cluster_resolver_shapes(cfg)
    assert [(s.cluster, s.threads, s.entries_per_thread, s.lru_per_thread) for s in shapes] == [
        (1, 1024, 2, 4), (2, 1024, 1, 2), (4, 512, 1, 2), (8, 256, 1, 2)]
    for s in shapes:
        assert s.version == 3 and s.build.source == "resolve3.cu"
        assert (1 << s.hash_bits) > cfg.top_k  # a block's part of the hash set holds the whole union
        assert s.cluster * s.threads // 32 <= 64  # published per-warp partials: two per lane
        assert s.dynamic_smem + s.static_smem <= 227 * 1024
    # the widest cluster while every request gets its own SMs, else one block per request
    assert [pick_cluster_shape(shapes, b, 1, 132).cluster for b in (1, 16, 17, 64, 128)] == [8, 8, 1, 1, 1]
    assert pick_cluster_shape(shapes, 64, 1, 132, forced_row_blocks=2).cluster == 2
    with pytest.raises(InvalidInputError, match="HISPARSE_RESOLVE_CLUSTER=3"):
        pick_cluster_shape(shapes, 1, 1, 132, forced_row_blocks=3)
    # speculative rows: a cluster holds rows_per_request * row_blocks blocks
    mtp = RuntimeConfig(max_batch_rows=64, max_requests=16, top_k=2048, hot_rows=10240, block_size=64,
                        max_pages=2048, rows_per_request=3)
    assert [(s.cluster, s.row_blocks) for s in cluster_resolver_shapes(mtp)] == [(3, 1), (6, 2)]
    with pytest.raises(InvalidInputError, match="rows_per_request=9"):
        cluster_resolver_shapes(RuntimeConfig(max_batch_rows=9, max_requests=1, top_k=8, hot_rows=72, block_size=8,
                                              max_pages=2, rows_per_request=9))
