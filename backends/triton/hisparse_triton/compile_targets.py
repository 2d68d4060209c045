"""Ahead-of-time builds of every triton-backend kernel for GPUs that need not be present.

Triton's own compiler builds a kernel for any target it has a backend for, with no device:
`triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("hip", "gfx942", 64))`
returns AMDGCN and an hsaco, `GPUTarget("cuda", 90, 32)` a cubin. This module builds every kernel of
`shapes.kernel_specs` at the production geometries (`GEOMETRIES`) for each target of `TARGETS`
and reports, per build, the shared memory (LDS on AMD) the compiler allotted and the warps.
CI runs it (tests/triton_backend/test_compile_targets.py) so the AMD path is known to compile and
to fit CDNA's 64 KiB of LDS per workgroup; it has never run on AMD hardware here.

    python -m hisparse_triton.compile_targets [--targets gfx942,gfx90a,sm90] [--json out.json]

Run it with `TRITON_INTERPRET` unset (the interpreter replaces the kernels by Python functions).
Builds go through Triton's cache (`TRITON_CACHE_DIR`), so identical builds compile once.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from dataclasses import asdict, dataclass

from hisparse_core.geometry import FP8_DS_MLA, RowFormat, RuntimeConfig, register_row_format

#: Shared memory one AMD CDNA workgroup can use (MI300X's and MI250X's LDS).
CDNA_LDS_BYTES = 64 * 1024
#: name -> (backend, arch, warp size); the warp width of the target, never assumed 32.
TARGETS: dict[str, tuple[str, str | int, int]] = {
    "gfx942": ("hip", "gfx942", 64),  # MI300X (CDNA3)
    "gfx90a": ("hip", "gfx90a", 64),  # MI250X (CDNA2)
    "sm90": ("cuda", 90, 32),  # H100 / H200
}
#: Targets built at only some geometries (CI time): the H200 runs sm_90 builds of every geometry
#: compiled, so CI checks that sm_90 compiles at the production one.
TARGET_GEOMETRIES: dict[str, tuple[str, ...]] = {"sm90": ("k2048_h4096_656B",)}
#: LDS limit each target is checked against (None: the compiler's own limit for the target).
SHARED_LIMIT: dict[str, int | None] = {"gfx942": CDNA_LDS_BYTES, "gfx90a": CDNA_LDS_BYTES, "sm90": None}


def _row_576() -> RowFormat:
    return register_row_format(RowFormat("bytes_576", FP8_DS_MLA.dtype, 576))


def geometries() -> dict[str, RuntimeConfig]:
    """The production geometries: top-k 2048, hot buffers of 4096 and 10240 rows, 656- and 576-byte
    rows, one row per request and speculative union rows (2 and 4 rows per request)."""
    row_576 = _row_576()

    def cfg(hot: int, rows: int, fmt: RowFormat) -> RuntimeConfig:
        return RuntimeConfig(max_batch_rows=128, max_requests=128, top_k=2048, hot_rows=hot, block_size=64,
                             max_pages=2048, row_format=fmt, rows_per_request=rows)

    return {
        "k2048_h4096_656B": cfg(4096, 1, FP8_DS_MLA),
        "k2048_h10240_656B": cfg(10240, 1, FP8_DS_MLA),
        "k2048_h4096_576B": cfg(4096, 1, row_576),
        "k2048_h10240_576B_union4": cfg(10240, 4, row_576),
        "k2048_h4096_656B_union2": cfg(4096, 2, FP8_DS_MLA),
    }


@dataclass(frozen=True, slots=True)
class Build:
    target: str
    geometry: str
    kernel: str
    constexprs: dict[str, int]
    num_warps: int
    warp_size: int
    shared_bytes: int
    seconds: float
    binary: str  # the kind of binary produced (hsaco, cubin)


def _compile(job: tuple[str, str, str, str, int]) -> tuple[int, float, str]:
    """One build in a worker process, of (target, kernel, signature JSON, constexprs JSON, warps):
    (shared bytes, seconds, binary kind)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hisparse_triton import kernels

    name, kernel, sig, constexprs, num_warps = job
    backend, arch, warp = TARGETS[name]
    t0 = time.perf_counter()
    compiled = triton.compile(ASTSource(kernels.KERNELS[kernel], json.loads(sig), json.loads(constexprs)),
                              target=GPUTarget(backend, arch, warp), options={"num_warps": num_warps})
    kind = "hsaco" if "hsaco" in compiled.asm else "cubin" if "cubin" in compiled.asm else "?"
    return int(compiled.metadata.shared), time.perf_counter() - t0, kind


def build_all(targets: list[str], *, lru_i16: bool = True, jobs: int = 1) -> list[Build]:
    """Compile every kernel at every geometry for `targets`; identical builds are compiled once
    (the same spec is reported for each geometry that needs it), over `jobs` worker processes.
    `lru_i16` also builds the resolver on an int16 LRU (vLLM's op set) at the first geometry."""
    import triton

    from hisparse_triton import auto, kernels, shapes

    if not isinstance(kernels.resolve_kernel, triton.runtime.JITFunction):
        raise RuntimeError("the kernels were defined under TRITON_INTERPRET=1; unset it to compile for a target")
    # Each build's job is its own key: identical builds (the same spec at several geometries) compile once.
    wanted: list[tuple[str, str, shapes.KernelSpec, tuple[str, str, str, str, int]]] = []
    for name in targets:
        backend, _, warp = TARGETS[name]
        for geo, config in geometries().items():
            if geo not in TARGET_GEOMETRIES.get(name, (geo,)):
                continue
            # The auto choice's profiles at its three batch ranges (below half the line; half the line up to it, with
            # the speculative copy; past it), as a runtime picks them (PDL on NVIDIA only): a line of 2 rows has all three.
            tunings = tuple(p.tuning for p in auto.choose({}, max_batch_rows=config.max_batch_rows, small=2,
                                                          pdl=backend == "cuda").profiles)
            specs = shapes.kernel_specs(config, warp, cuda=backend == "cuda", tunings=tunings)
            if lru_i16 and geo == next(iter(geometries())):
                specs += [s for s in shapes.kernel_specs(config, warp, lru_dtype="i16") if s.kernel.startswith("resolve")]
            if not shapes.cas_compiles(triton.__version__, rocm=backend == "hip"):
                specs = [s for s in specs if not s.constexprs.get("CAS")]  # the runtime refuses it there
            for spec in specs:
                # The signature in argument order (the order the kernel takes them), the constexprs sorted.
                job = (name, spec.kernel, json.dumps(dict(spec.signature)),
                       json.dumps(dict(spec.constexprs), sort_keys=True), spec.num_warps)
                wanted.append((name, geo, spec, job))
    keys = list(dict.fromkeys(job for *_, job in wanted))
    if jobs > 1 and len(keys) > 1:
        # Fresh interpreters (spawn): a forked child would inherit the parent's Triton state.
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(min(jobs, len(keys))) as pool:
            results = pool.map(_compile, keys, chunksize=1)
    else:
        results = [_compile(k) for k in keys]
    done = dict(zip(keys, results, strict=True))
    out: list[Build] = []
    for name, geo, spec, key in wanted:
        shared, secs, kind = done[key]
        out.append(Build(name, geo, spec.kernel, dict(spec.constexprs), spec.num_warps, TARGETS[name][2], shared,
                         round(secs, 3), kind))
    return out


def over_limit(builds: list[Build]) -> list[str]:
    """One line per build whose shared memory exceeds its target's limit."""
    bad = []
    for b in builds:
        limit = SHARED_LIMIT.get(b.target)
        if limit is not None and b.shared_bytes > limit:
            bad.append(f"{b.kernel} at {b.geometry} for {b.target}: {b.shared_bytes} bytes of LDS, over {limit}")
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    ap.add_argument("--json", help="write the builds as JSON to this path")
    ap.add_argument("--jobs", default="auto",
                    help="worker processes compiling side by side (default: one per CPU this process may use)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_targets: TRITON_INTERPRET is set; unset it to compile for a target", file=sys.stderr)
        return 2
    targets = [t for t in args.targets.split(",") if t]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        print(f"compile_targets: --targets names {unknown}; expected some of {sorted(TARGETS)}", file=sys.stderr)
        return 2
    try:
        jobs = len(os.sched_getaffinity(0)) if args.jobs == "auto" else int(args.jobs)
    except ValueError:
        jobs = 0
    if jobs < 1:
        print(f"compile_targets: --jobs {args.jobs!r}; expected 'auto' or a positive integer", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    print(f"compile_targets: {', '.join(targets)} over {jobs} worker process{'es' if jobs > 1 else ''}", flush=True)
    builds = build_all(targets, jobs=jobs)
    for b in builds:
        print(f"{b.target:7} {b.geometry:26} {b.kernel:26} warps={b.num_warps:2} x {b.warp_size} "
              f"shared={b.shared_bytes:6} B  {b.binary} {b.seconds:.2f}s")
    print(f"{len(builds)} builds ({len({(b.target, b.kernel, str(b.constexprs), b.num_warps) for b in builds})} "
          f"distinct) in {time.perf_counter() - t0:.1f}s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([asdict(b) for b in builds], fh, indent=1)
    bad = over_limit(builds)
    for line in bad:
        print(f"over the LDS limit: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
