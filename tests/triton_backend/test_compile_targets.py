"""Every triton-backend kernel compiles for AMD CDNA (gfx942: MI300X, gfx90a: MI250X) at the
production geometries, and for sm_90 at the production one, with no GPU present, and fits CDNA's
64 KiB of LDS.

One child process (`python -m hisparse_triton.compile_targets`, `TRITON_INTERPRET` unset, its own
Triton cache, half the CPUs' worth of workers) builds them all; identical builds compile once. It
starts when collection ends (this folder's conftest.py, whose `builds` fixture waits for it), so it
runs beside the rest of the test run. Nothing here runs a kernel: the AMD builds have never run on
AMD hardware.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
              pytest.mark.slow]  # about 5 minutes of CPU: 178 distinct builds for gfx942, gfx90a and sm_90

REPO = Path(__file__).parents[2]


def test_every_kernel_compiles_for_cdna_and_sm90(builds: list[dict]) -> None:
    from hisparse_triton.compile_targets import TARGET_GEOMETRIES, TARGETS, geometries

    got = {(b["target"], b["geometry"], b["kernel"]) for b in builds}
    names = {"resolve_kernel", "resolve_gather_kernel", "resolve_split_kernel", "resolve_split_hot_kernel",
             "resolve_split_lru_kernel", "copy_plan_kernel", "copy_plan_rows_kernel", "copy_spec_kernel", "copy_rows_kernel",
             "invalidate_written_kernel", "vllm_copy_kernel", "vllm_invalidate_kernel"}
    want = {(t, g, k) for t in TARGETS for g in TARGET_GEOMETRIES.get(t, tuple(geometries())) for k in names}
    assert want <= got, sorted(want - got)
    for b in builds:
        assert b["binary"] == ("hsaco" if TARGETS[b["target"]][0] == "hip" else "cubin"), b


def test_shared_memory_fits_cdna_lds(builds: list[dict]) -> None:
    from hisparse_triton.compile_targets import CDNA_LDS_BYTES

    for b in builds:
        if b["target"].startswith("gfx"):
            assert b["shared_bytes"] <= CDNA_LDS_BYTES, b


def test_no_size_assumes_a_32_lane_warp(builds: list[dict]) -> None:
    """Warps are threads divided by the target's warp width: the same threads on AMD (64 lanes) as
    on NVIDIA (32 lanes), so an AMD build has half the warps."""
    by = {(b["target"], b["geometry"], b["kernel"]): b for b in builds}
    compared = 0
    for (target, geo, kernel), b in by.items():
        assert b["warp_size"] == (64 if target.startswith("gfx") else 32)
        nv = by.get(("sm90", geo, kernel))
        if nv is not None:
            assert b["num_warps"] * b["warp_size"] == nv["num_warps"] * 32, b
            compared += 1
    assert compared >= 3 * 6, compared  # every kernel at the production geometry, on all three targets


def test_no_inline_assembly() -> None:
    """No kernel carries inline assembly of its own (which would tie it to one instruction set); Triton's
    grid-dependency calls (`gdc_*`, PTX inside Triton) appear only under the `PDL` constexpr."""
    source = (REPO / "backends/triton/hisparse_triton/kernels.py").read_text()
    assert "inline_asm" not in source and "asm(" not in source
    lines = source.splitlines()
    calls = [i for i, line in enumerate(lines) if "gdc_wait()" in line or "gdc_launch_dependents()" in line]
    assert calls and all(lines[i - 1].strip() in ("if PDL:", "if PDL > 1:") for i in calls), calls


def test_pdl_builds_are_nvidia_only(builds: list[dict]) -> None:
    """The PDL builds (programmatic dependent launch, `HISPARSE_TRITON_PDL`) compile for sm_90 and
    are never built for an AMD target."""
    pdl = [(b["target"], b["kernel"]) for b in builds if b["constexprs"].get("PDL")]
    assert {k for t, k in pdl if t == "sm90"} == {"resolve_gather_kernel", "resolve_split_kernel", "resolve_split_lru_kernel",
                                                  "copy_plan_kernel", "copy_plan_rows_kernel", "copy_spec_kernel"}
    assert all(t == "sm90" for t, _ in pdl), pdl


def test_lean_plan_copy_builds_for_every_target(builds: list[dict]) -> None:
    """The lean plan copy (`HISPARSE_TRITON_LEAN_COPY`, `VEC`) compiles for every target at every
    geometry, 4 words an access where the rows' words allow (656- and 576-byte rows both do)."""
    from hisparse_triton.compile_targets import TARGET_GEOMETRIES, TARGETS, geometries

    got = {(b["target"], b["geometry"]) for b in builds
           if b["kernel"] == "copy_plan_kernel" and b["constexprs"].get("VEC") == 4 and not b["constexprs"].get("PDL")}
    want = {(t, g) for t in TARGETS for g in TARGET_GEOMETRIES.get(t, tuple(geometries()))}
    assert got == want, sorted(want ^ got)


def test_the_auto_choice_builds_for_every_target(builds: list[dict]) -> None:
    """What a runtime picks per batch size by default (`hisparse_triton.auto`) compiles for every target at
    every geometry: at small batches the split resolver at 512 threads with two-level scans and shift-and-mask
    blocks and the lean plan copy of 4 entries a chunk, both with PDL on sm_90 only; from half the line up to
    it also the speculative layer-0 copy of 128 entries a program behind the split build that writes its
    miss mask, with PDL on sm_90 only; at larger batches the one-program resolver with the same scans and
    blocks."""
    from hisparse_triton.compile_targets import TARGET_GEOMETRIES, TARGETS, geometries

    for t in TARGETS:
        pdl = int(t == "sm90")
        for g in TARGET_GEOMETRIES.get(t, tuple(geometries())):
            mine = [b for b in builds if (b["target"], b["geometry"]) == (t, g)]
            assert any(b["kernel"] == "resolve_split_kernel" and b["num_warps"] * b["warp_size"] == 512
                       and b["constexprs"]["NS"] == 8 and b["constexprs"]["SB"] == 1 and b["constexprs"]["SH"] > 1
                       and b["constexprs"]["PDL"] == pdl for b in mine), (t, g)
            assert any(b["kernel"] == "copy_plan_kernel" and b["constexprs"]["EB"] == 4 and b["constexprs"]["VEC"] == 4
                       and b["constexprs"]["PDL"] == pdl for b in mine), (t, g)
            assert any(b["kernel"] == "resolve_gather_kernel" and b["constexprs"]["SK"] > 1 and b["constexprs"]["SB"] == 1
                       and b["constexprs"]["PDL"] == 0 and not b["constexprs"]["FUSE"] for b in mine), (t, g)
            assert any(b["kernel"] == "resolve_split_kernel" and b["num_warps"] * b["warp_size"] == 512
                       and b["constexprs"]["NS"] == 8 and b["constexprs"]["MASK"] == 1 and b["constexprs"]["SH"] > 1
                       and b["constexprs"]["PDL"] == pdl for b in mine), (t, g)
            assert any(b["kernel"] == "copy_spec_kernel" and b["constexprs"]["SE"] == 128 and b["constexprs"]["SC"] == 32
                       and b["constexprs"]["VEC"] == 4 and b["constexprs"]["SB"] == 1 and b["constexprs"]["PDL"] == pdl
                       for b in mine), (t, g)


def test_chain_builds_for_sm90_only(builds: list[dict]) -> None:
    """The chained builds (`HISPARSE_TRITON_PDL_CHAIN`, `PDL` = 2: the split resolver, the lean plan copy and the
    speculative copy) compile for sm_90 only."""
    chained = {(b["target"], b["kernel"]) for b in builds if b["constexprs"].get("PDL") == 2}
    assert chained == {("sm90", k) for k in ("resolve_split_kernel", "copy_plan_kernel", "copy_spec_kernel")}, chained
