"""The tuning variables of the nvidia backend's vLLM op set (CPU only: no kernel runs here): their
defaults, the removed fused-gather path refused, and bad values rejected in one line naming the
variable and the value."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_core.errors import InvalidInputError

pytest.importorskip("cuda.bindings", reason="cuda-python not installed: pip install 'hisparse[nvidia]'")

from hisparse_nvidia.kernels import (  # noqa: E402
    VLLM_COPY_THREADS,
    vllm_carveout,
    vllm_gather_local,
    vllm_gather_per_sm,
    vllm_gather_variant,
    vllm_ops_build,
    vllm_resolve_pdl,
    vllm_resolve_shape,
    vllm_resolve_shape_build,
    vllm_resolve_threads,
)


def _one_line_naming(err: pytest.ExceptionInfo, name: str, value: str) -> None:
    text = str(err.value)
    assert name in text and value in text and "\n" not in text, text


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HISPARSE_VLLM_GATHER", "HISPARSE_VLLM_GATHER_PER_SM", "HISPARSE_VLLM_RESOLVE",
                 "HISPARSE_VLLM_RESOLVE_THREADS", "HISPARSE_VLLM_CARVEOUT", "HISPARSE_VLLM_RESOLVE_SHAPE",
                 "HISPARSE_VLLM_RESOLVE_PDL"):
        monkeypatch.delenv(name, raising=False)
    assert vllm_resolve_shape() == 1  # the resolver compiled per call shape
    assert vllm_gather_variant() == 2
    assert vllm_gather_per_sm() == 1
    assert vllm_resolve_threads() == 0  # automatic
    assert vllm_carveout() == -1  # the driver's choice
    assert vllm_resolve_pdl() == 1  # the resolver a programmatic dependent of the kernel before it
    assert dict(vllm_ops_build(656).defines) == {"HS_VEC": 41, "HS_GNT": VLLM_COPY_THREADS, "HS_VR_FAST": 4}


@pytest.mark.parametrize("value", ["0", "2"])
def test_gather_paths_kept(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HISPARSE_VLLM_GATHER", value)
    assert vllm_gather_variant() == int(value)


@pytest.mark.parametrize("value", ["1", "3", "-1", "fused"])
def test_gather_removed_or_bad_path_refused(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HISPARSE_VLLM_GATHER", value)
    with pytest.raises(InvalidInputError) as err:
        vllm_gather_variant()
    _one_line_naming(err, "HISPARSE_VLLM_GATHER", value)


@pytest.mark.parametrize("value", ["0", "1", "2", "3", "4", "6"])
def test_resolver_builds_selectable(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HISPARSE_VLLM_RESOLVE", value)
    assert dict(vllm_ops_build(656).defines)["HS_VR_FAST"] == int(value)


def test_removed_resolver_build_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # Build 5 was measured slower and removed (sixteenth session, call C1): refused in one line that names
    # the builds there are, before any build is chosen.
    monkeypatch.setenv("HISPARSE_VLLM_RESOLVE", "5")
    with pytest.raises(InvalidInputError) as err:
        vllm_ops_build(656)
    _one_line_naming(err, "HISPARSE_VLLM_RESOLVE", "5")
    assert "expected 0 (" in str(err.value) and ", 4 (" in str(err.value) and "or 6 (" in str(err.value)


@pytest.mark.parametrize("value", ["0", "1"])
def test_resolver_shape_selectable(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HISPARSE_VLLM_RESOLVE_SHAPE", value)
    assert vllm_resolve_shape() == int(value)


@pytest.mark.parametrize(("variant", "want"), [(2, 1), (0, 0), (1, 0)])
def test_gather_local_default_follows_the_gather(variant: int, want: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # on with the fused gather (its path), off with the mark + copy pair (no such path), and not refused there
    monkeypatch.delenv("HISPARSE_VLLM_GATHER_LOCAL", raising=False)
    assert vllm_gather_local(variant) == want


@pytest.mark.parametrize("value", ["0", "1", "2", "3", "4"])
def test_gather_local_selectable(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HISPARSE_VLLM_GATHER_LOCAL", value)
    assert vllm_gather_local(2) == int(value)


@pytest.mark.parametrize("value", ["5", "-1", "on"])
def test_gather_local_bad_value_refused(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HISPARSE_VLLM_GATHER_LOCAL", value)
    with pytest.raises(InvalidInputError) as err:
        vllm_gather_local(2)
    _one_line_naming(err, "HISPARSE_VLLM_GATHER_LOCAL", value)


@pytest.mark.parametrize("local", ["1", "2", "3", "4"])
def test_gather_local_without_the_fused_gather_refused(local: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The barrier-free path lives in the fused gather's launch; with the mark + copy pair the call is
    # refused (before any device work: these are CPU tensors), not served by another path than asked.
    import torch

    from hisparse_nvidia.vllm_ops import NvidiaVllmOps

    monkeypatch.setenv("HISPARSE_VLLM_GATHER", "0")
    monkeypatch.setenv("HISPARSE_VLLM_GATHER_LOCAL", local)
    hot = torch.zeros((2, 4, 16), dtype=torch.uint8)
    idx = torch.zeros((1, 3), dtype=torch.int32)
    with pytest.raises(InvalidInputError) as err:
        NvidiaVllmOps(None)._gather(0, torch.zeros((8, 16), dtype=torch.uint8), hot, idx, idx,
                                    torch.ones(1, dtype=torch.int32), None, None, None, 0)
    _one_line_naming(err, "HISPARSE_VLLM_GATHER_LOCAL", local)
    assert torch.equal(hot, torch.zeros_like(hot))


def test_gather_local_bounds_match_the_kernel() -> None:
    # The host sizes the path's shared memory from its bounds; the kernel lays it out from VG_LOCAL and
    # VG_LOCAL_4K, and each value of the knob launches the kernel of its bound with its read mode.
    import re

    from hisparse_nvidia.compiler import kernel_text
    from hisparse_nvidia.vllm_ops import LOCAL_GATHER_ENTRIES, LOCAL_GATHER_ENTRIES_4K, local_gather_launch

    text = kernel_text("vllm_ops.cu")
    for name, want in (("VG_LOCAL", LOCAL_GATHER_ENTRIES), ("VG_LOCAL_4K", LOCAL_GATHER_ENTRIES_4K)):
        bound = re.search(rf"#define {name} (\d+)", text)
        assert bound is not None and int(bound.group(1)) == want, name
    assert "#define VG_LOCAL_BYTES(cap) (24 * (cap))" in text
    assert local_gather_launch(1) == ("hisparse_vllm_gather_local", 1, 24 * 2048)
    assert local_gather_launch(2) == ("hisparse_vllm_gather_local", 2, 24 * 2048)
    assert local_gather_launch(3) == ("hisparse_vllm_gather_local4k", 1, 24 * 4096)
    assert local_gather_launch(4) == ("hisparse_vllm_gather_local4k", 2, 24 * 4096)


def test_shape_build_names_every_size() -> None:
    got = dict(vllm_resolve_shape_build(3, 2048, 4096, 64, 16, 1, 4096, 1024, 1).defines)
    assert {k: got[k] for k in ("HS_VR_FAST", "VR_K", "VR_H", "VR_BS", "VR_SBS", "VR_RBS", "VR_SB", "VR_NT")} == {
        "HS_VR_FAST": 3, "VR_K": 2048, "VR_H": 4096, "VR_BS": 64, "VR_SBS": 16, "VR_RBS": 1, "VR_SB": 4096,
        "VR_NT": 1024}


@pytest.mark.parametrize("value", ["0", "128", "256", "512", "1024"])
def test_resolver_threads_selectable(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HISPARSE_VLLM_RESOLVE_THREADS", value)
    assert vllm_resolve_threads() == int(value)


@pytest.mark.parametrize("value", ["-1", "0", "50", "100"])
def test_carveout_selectable(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HISPARSE_VLLM_CARVEOUT", value)
    assert vllm_carveout() == int(value)


_READ = {"HISPARSE_VLLM_RESOLVE": lambda: vllm_ops_build(656), "HISPARSE_VLLM_GATHER_PER_SM": vllm_gather_per_sm,
         "HISPARSE_VLLM_RESOLVE_SHAPE": vllm_resolve_shape,
         "HISPARSE_VLLM_RESOLVE_THREADS": vllm_resolve_threads, "HISPARSE_VLLM_CARVEOUT": vllm_carveout,
         "HISPARSE_VLLM_RESOLVE_PDL": vllm_resolve_pdl}


@pytest.mark.parametrize("name,value", [("HISPARSE_VLLM_RESOLVE", "5"), ("HISPARSE_VLLM_RESOLVE", "7"),
                                        ("HISPARSE_VLLM_RESOLVE", "-1"), ("HISPARSE_VLLM_RESOLVE", "lean"),
                                        ("HISPARSE_VLLM_RESOLVE_SHAPE", "2"), ("HISPARSE_VLLM_RESOLVE_SHAPE", "yes"),
                                        ("HISPARSE_VLLM_GATHER_PER_SM", "0"),
                                        ("HISPARSE_VLLM_GATHER_PER_SM", "9"), ("HISPARSE_VLLM_RESOLVE_THREADS", "384"),
                                        ("HISPARSE_VLLM_RESOLVE_THREADS", "64"), ("HISPARSE_VLLM_RESOLVE_THREADS", "2048"),
                                        ("HISPARSE_VLLM_CARVEOUT", "101"), ("HISPARSE_VLLM_CARVEOUT", "-2"),
                                        ("HISPARSE_VLLM_CARVEOUT", "half"), ("HISPARSE_VLLM_RESOLVE_PDL", "2"),
                                        ("HISPARSE_VLLM_RESOLVE_PDL", "-1"), ("HISPARSE_VLLM_RESOLVE_PDL", "on")])
def test_bad_values_refused(name: str, value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(InvalidInputError) as err:
        _READ[name]()
    _one_line_naming(err, name, value)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 32767), st.integers(0, 40000), st.integers(1, 8192), st.sampled_from([0, 1, 2, 3, 4, 6]),
       st.sampled_from([48 * 1024, 99 * 1024, 227 * 1024]))
def test_resolver_shared_memory_covers_what_the_kernel_reads(h: int, union: int, k: int, build: int,
                                                             optin: int) -> None:
    # vllm_ops.cu takes the buckets and the LRU order from the launch's dynamic shared memory, and
    # build 3 reads the hot-map row into it from the first 16-byte boundary past the buckets
    # wherever %dynamic_smem_size covers that row. Build 4 takes at least build 3's buckets (a
    # power of two up to four a union row, for its lean path), never beyond the power of two its
    # kernel hashes into (from 4 k for a one-row group, from twice the union for larger ones).
    from hisparse_nvidia.vllm_ops import RESOLVE_SMEM_BUDGET, resolve_smem_buckets, resolve_smem_bytes

    b = resolve_smem_buckets(union, h, k, build)
    if build >= 4:
        two = resolve_smem_buckets(union, h, k, 3)
        used = 1 << (max(2 * union, 4 * k) - 1).bit_length()
        assert b >= two and (b == two or b & (b - 1) == 0) and b <= max(two, min(4 * union, used))
    got = resolve_smem_bytes(b, h, build, optin)
    row_end = -(-8 * b // 16) * 16 + 4 * h
    assert got >= 12 * b + 2 * h and got % 4 == 0
    if build >= 3 and row_end <= min(optin, RESOLVE_SMEM_BUDGET):
        assert got >= row_end
    else:
        assert got == -(-(12 * b + 2 * h) // 16) * 16
    assert got <= max(-(-(12 * b + 2 * h) // 16) * 16, min(optin, RESOLVE_SMEM_BUDGET))


@pytest.mark.parametrize(("rows", "h", "want"), [(1, 4096, 8192), (1, 10240, 8192), (2, 4096, 8192),
                                                 (2, 10240, 8192), (4, 4096, 16384), (4, 10240, 16384)])
def test_resolver_buckets_at_top_k_2048(rows: int, h: int, want: int) -> None:
    # Build 4's shared hash for groups of `rows` rows of top-k 2048: one-row groups four buckets an entry
    # (the lean path), two-row groups build 3's 8192 (their path hashes 2 x 4096 entries into 8192 buckets;
    # 16384 before, 204,800 bytes a block at 4096 hot rows), four-row groups as large as fits.
    from hisparse_nvidia.vllm_ops import resolve_smem_buckets

    assert resolve_smem_buckets(rows * 2048, h, 2048, 4) == want
    assert resolve_smem_buckets(rows * 2048, h, 2048, 3) == min(want, 2 * rows * 2048)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 32767), st.integers(1, 8192))
def test_resolver_buckets_of_one_row_groups_unchanged(h: int, k: int) -> None:
    # One-row groups (union = top-k) keep the size they had before the kernel's use bounded it: the largest
    # power of two up to four buckets an entry that fits, never fewer than build 3's.
    from hisparse_nvidia.vllm_ops import RESOLVE_SMEM_BUDGET, resolve_smem_buckets

    fit = (RESOLVE_SMEM_BUDGET - 2 * h - 16) // 12
    four = min(4 * k, fit)
    before = max(max(0, min(2 * k, fit)), 1 << (four.bit_length() - 1) if four > 0 else 0)
    assert resolve_smem_buckets(k, h, k, 4) == before


@pytest.mark.parametrize("value", ["0", "1"])
def test_resolver_pdl_selectable(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # 1 (the default) builds the resolver with VR_PDL (its wait before any global access); 0 builds it without,
    # as before the switch, so its modules (and their disk-cache keys) are those of earlier sessions. The
    # gathers' module never has it.
    monkeypatch.setenv("HISPARSE_VLLM_RESOLVE_PDL", value)
    pdl = vllm_resolve_pdl()
    assert pdl == int(value)
    assert ("VR_PDL" in dict(vllm_ops_build(656, pdl).defines)) == (pdl == 1)
    assert ("VR_PDL" in dict(vllm_resolve_shape_build(6, 2048, 4096, 64, 64, 64, 8192, 1024, pdl).defines)) == (pdl == 1)
    assert "VR_PDL" not in dict(vllm_ops_build(656).defines)
