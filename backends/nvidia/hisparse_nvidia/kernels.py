"""Which kernel builds a runtime needs, their launch shapes, and loading them on a device.

Kernels are specialised only by size class (threads per block, entries and LRU positions per
thread, 16-byte vectors per row), never by the exact geometry, so a handful of builds serve every
configuration and the disk cache stays small. `runtime_builds` lists the builds of one
`RuntimeConfig`; `all_builds_for_ci` the representative set that CI compiles for sm_90.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from hisparse_core.errors import InvalidInputError
from hisparse_core.geometry import BF16_MLA, FP8_DS_MLA, RuntimeConfig

from hisparse_nvidia.compiler import KernelBuild, compile_kernel

#: Override of the version-2 resolver's threads per block (a power of two in [128, 1024]) for tuning.
ENV_RESOLVE_THREADS = "HISPARSE_RESOLVE_THREADS"
#: Resolver version: 3 (resolve3.cu, one thread-block cluster per request; the default on sm_90
#: and newer) or 2 (resolve2.cu, one block per request; the default before Hopper, which has no
#: clusters, and the benchmark's baseline).
ENV_RESOLVER = "HISPARSE_RESOLVER"
RESOLVER_VERSION = 2
CLUSTER_RESOLVER_VERSION = 3
#: Resolver version 4 (resolve4.cu): one block per request like version 2, compiled for one
#: geometry (every size a constant); the default.
GEOMETRY_RESOLVER_VERSION = 4
#: Oldest compute capability (major * 10 + minor) with thread-block clusters.
CLUSTER_MIN_ARCH = 90
#: Forces the version-3 resolver's blocks per cluster (1, 2, 4 or 8 per group row) for tuning.
ENV_RESOLVE_CLUSTER = "HISPARSE_RESOLVE_CLUSTER"
#: Largest portable cluster.
MAX_CLUSTER = 8
#: Shared memory the version-2 resolver may take for a load factor of 1/4 (else 1/2).
_RESOLVE2_SPARSE_HASH_LIMIT = 160 * 1024
#: Shared memory (bytes) version 4 may fill with optional rows (page tables, position hints;
#: otherwise gathered per entry); overridable for tuning and tests.
ENV_RESOLVE_SMEM = "HISPARSE_RESOLVE_SMEM"
RESOLVE4_SMEM_BUDGET = 200 * 1024
#: Threads per block of the copy kernels, 16-byte loads each thread keeps in flight, and the load
#: flavour (see cuda/common.cuh); each overridable by environment for tuning.
ENV_COPY_THREADS = "HISPARSE_COPY_THREADS"
ENV_COPY_UNROLL = "HISPARSE_COPY_UNROLL"
ENV_COPY_LOAD = "HISPARSE_COPY_LOAD"
COPY_THREADS = 256
COPY_UNROLL = 4
COPY_LOAD = 0
MAINTAIN_THREADS = 256
#: Bytes of static shared memory the resolver declares beyond its dynamic part (upper bound).
_RESOLVE_STATIC_SMEM_SLACK = 64


class FastDiv(ctypes.Structure):
    """Kernel argument `HsDiv` (cuda/common.cuh): divide non-negative ints by `d` with a
    multiply-high and a shift, q = (umulhi(n, m) + n) >> s."""

    _fields_ = [("d", ctypes.c_int32), ("m", ctypes.c_uint32), ("s", ctypes.c_uint32)]

    @classmethod
    def of(cls, d: int) -> FastDiv:
        if d < 1 or d >= 2**31:
            raise InvalidInputError(f"divisor {d} out of range [1, 2^31)")
        s = (d - 1).bit_length()
        m = ((1 << 32) * ((1 << s) - d)) // d + 1
        return cls(d, m, s)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@dataclass(frozen=True, slots=True)
class ResolverShape:
    """Launch shape of the resolver for one geometry."""

    threads: int
    entries_per_thread: int
    lru_per_thread: int
    hash_bits: int
    dynamic_smem: int
    multi_row: bool = True
    version: int = RESOLVER_VERSION
    #: Version 3: blocks per cluster, blocks per group row, 16-byte vectors per row (fused gather).
    cluster: int = 1
    row_blocks: int = 1
    row_vec: int = 0
    #: Version 4 is built for one geometry: its -D definitions beyond the thread count and hash size
    #: (sizes of the RuntimeConfig and which rows it copies into shared memory).
    defines: tuple[tuple[str, int], ...] = ()

    @property
    def build(self) -> KernelBuild:
        if self.version == GEOMETRY_RESOLVER_VERSION:
            return KernelBuild.of("resolve4.cu", {"HS_NT": self.threads, "HS_TBITS": self.hash_bits, **dict(self.defines)})
        if self.version == 3:
            return KernelBuild.of("resolve3.cu", {"HS_NT": self.threads, "HS_C": self.cluster, "HS_CR": self.row_blocks,
                                                  "HS_EPT": self.entries_per_thread, "HS_CPT": self.lru_per_thread,
                                                  "HS_VEC": self.row_vec})
        return KernelBuild.of("resolve2.cu", {"HS_NT": self.threads, "HS_EPT": self.entries_per_thread,
                                       "HS_CPT": self.lru_per_thread, "HS_MULTI": int(self.multi_row)})

    @property
    def static_smem(self) -> int:
        if self.version == GEOMETRY_RESOLVER_VERSION:  # five per-warp counters, two per-row counters
            return 4 * 4 * (self.threads // 32) + 8 * dict(self.defines)["HS_RPR"] + 16 + _RESOLVE_STATIC_SMEM_SLACK
        if self.version == 3:  # per-warp partials of every block: int4 + three i32 arrays
            return 28 * self.cluster * (self.threads // 32) + _RESOLVE_STATIC_SMEM_SLACK
        return 4 * 5 * (self.threads // 32) + _RESOLVE_STATIC_SMEM_SLACK  # five per-warp counter arrays


def resolver_shape(config: RuntimeConfig, threads: int | None = None, version: int | None = None) -> ResolverShape:
    """Threads, per-thread work and shared memory of the one-block resolver (version 2) for `config`."""
    if version is None:
        version = RESOLVER_VERSION
    if version != 2:
        raise InvalidInputError(f"resolver_shape describes version 2, got {version}")
    union = config.rows_per_request * config.top_k
    h = config.hot_rows
    if threads is None:
        env = os.environ.get(ENV_RESOLVE_THREADS)
        threads = int(env) if env else min(1024, max(128, _next_pow2(-(-max(union, h) // 4))))
    if threads not in (128, 256, 512, 1024):
        raise InvalidInputError(f"resolver threads per block must be 128, 256, 512 or 1024, got {threads}")
    # pairs (8 bytes a bucket), hm, order (padded to 4 bytes), htab, two per-row bounds.
    rest = 4 * h + 2 * (h + (h & 1)) + 4 * (config.hot_blocks + 2 * (config.rows_per_request + 1))
    hash_slots = max(4, _next_pow2(4 * union))
    if 8 * hash_slots + rest > _RESOLVE2_SPARSE_HASH_LIMIT:
        hash_slots = max(4, _next_pow2(2 * union))
    smem = 8 * hash_slots + rest
    return ResolverShape(threads, -(-union // threads), -(-h // threads), hash_slots.bit_length() - 1,
                         -(-smem // 16) * 16, config.rows_per_request > 1, 2)


def resolver4_shape(config: RuntimeConfig, threads: int | None = None,
                    max_smem: int = RESOLVE4_SMEM_BUDGET) -> ResolverShape:
    """The version-4 resolver's launch shape for `config`.

    One block per group: 1024 threads for the production sizes (a thread holds about one top-k
    entry and two LRU positions, or more once a block has 1024 threads); hash buckets for a load
    factor of at most 1/2 (only hint misses are hashed). The request's page-table rows and then its
    position hints are read whole into shared memory while it stays within `max_smem` (and they
    are whole 16-byte vectors); otherwise the kernel gathers them per entry. The kernel's index
    arithmetic is 32-bit, so the tables it addresses must stay below 2^31 entries.
    """
    rpr, k, h, bs, p = config.rows_per_request, config.top_k, config.hot_rows, config.block_size, config.max_pages
    union = rpr * k
    for name, n in (("max_requests * hot_rows", config.max_requests * h),
                    ("max_requests * max_pages * block_size", config.max_requests * p * bs),
                    ("max_batch_rows * top_k", config.max_batch_rows * k)):
        if n >= 2**31:
            raise InvalidInputError(f"{name} = {n} must stay below 2^31 for the resolver's 32-bit indexing")
    if threads is None:
        env = os.environ.get(ENV_RESOLVE_THREADS)
        threads = int(env) if env else min(1024, max(128, _next_pow2(-(-max(union, h) // 2))))
    if threads not in (128, 256, 512, 1024):
        raise InvalidInputError(f"resolver threads per block must be 128, 256, 512 or 1024, got {threads}")
    ept, cpt = -(-union // threads), -(-h // threads)
    if ept > 32 or cpt > 32:
        raise InvalidInputError(f"RuntimeConfig(top_k={k}, rows_per_request={rpr}, hot_rows={h}) needs more than "
                                f"32 entries or LRU positions per thread of a 1024-thread block")
    budget_env = os.environ.get(ENV_RESOLVE_SMEM)
    max_smem = int(budget_env) if budget_env else max_smem
    slots = max(4, _next_pow2(2 * union))
    # pairs, hm, htab, order (i16, padded), marks (padded)
    smem = 8 * slots + 4 * h + 4 * config.hot_blocks + 2 * (h + (h & 1)) + 4 * -(-h // 4)
    smem = -(-smem // 16) * 16
    tables = p % 4 == 0 and smem + 8 * p <= max_smem
    smem += 8 * p if tables else 0
    hints = (p * bs) % 8 == 0 and smem + 2 * p * bs <= max_smem
    smem += 2 * p * bs if hints else 0
    defines = (("HS_K", k), ("HS_H", h), ("HS_BS", bs), ("HS_RPR", rpr), ("HS_P", p), ("HS_TSMEM", int(tables)),
               ("HS_HSMEM", int(hints)))
    return ResolverShape(threads, ept, cpt, slots.bit_length() - 1, smem, rpr > 1, GEOMETRY_RESOLVER_VERSION,
                         defines=defines)


def cluster_resolver_shapes(config: RuntimeConfig) -> list[ResolverShape]:
    """The version-3 resolver's launch shapes for `config`, fewest blocks per cluster first.

    A cluster holds `rows_per_request * row_blocks` blocks (at most 8), `row_blocks` of them per
    row of a group. Threads per block are chosen so a thread holds about one top-k entry and two
    LRU positions; each block's part of the hash set has room for the whole union, so an insert
    always finds a bucket whatever the keys' hashes, and every block holds the whole hot map.
    """
    rpr, k, h = config.rows_per_request, config.top_k, config.hot_rows
    if rpr > MAX_CLUSTER:
        raise InvalidInputError(f"rows_per_request={rpr} exceeds the {MAX_CLUSTER} blocks of a cluster")
    union = rpr * k
    shapes = []
    row_blocks = 1
    while rpr * row_blocks <= MAX_CLUSTER:
        c = rpr * row_blocks
        cap = 1 << ((2048 // c).bit_length() - 1)  # c * threads / 32 <= 64 published partials
        threads = min(1024, cap, max(64, _next_pow2(max(-(-k // row_blocks), -(-h // (2 * c))))))
        ept = -(-k // (row_blocks * threads))
        cpt = -(-h // (c * threads))
        rest = 4 * (-(-h // 4) * 4) + 4 * cpt * threads + 16 * ept * threads + 16 + 4 * config.hot_blocks
        if c == 1:
            slots = _next_pow2(4 * union)
            if 8 * slots + rest > _RESOLVE2_SPARSE_HASH_LIMIT:
                slots = _next_pow2(2 * union)
        else:
            slots = _next_pow2(max(union + 1, -(-4 * union // c)))
        smem = 8 * slots + rest
        shapes.append(ResolverShape(threads, ept, cpt, slots.bit_length() - 1, -(-smem // 16) * 16, rpr > 1, 3, c,
                                    row_blocks, config.row_format.row_bytes // 16))
        row_blocks *= 2
    return shapes


def pick_cluster_shape(shapes: list[ResolverShape], batch_rows: int, rows_per_request: int, num_sms: int,
                       forced_row_blocks: int | None = None) -> ResolverShape:
    """The shape for a call of `batch_rows` rows: the widest cluster when every group still gets
    its own multiprocessors, else the narrowest (one block per group row).

    Why not something in between: each cluster barrier costs 1.2-3K cycles (its release is a
    GPU-scope memory barrier), so a cluster pays off only when it spreads one group's work over
    several otherwise idle SMs; once the batch fills the GPU, narrower is faster (measured on an
    H200, docs/gpu-validation.md). `forced_row_blocks` (from `HISPARSE_RESOLVE_CLUSTER`) picks
    the shape with that many blocks per group row instead."""
    if forced_row_blocks is not None:
        for shape in shapes:
            if shape.row_blocks == forced_row_blocks:
                return shape
        raise InvalidInputError(f"{ENV_RESOLVE_CLUSTER}={forced_row_blocks}: expected one of "
                                f"{[s.row_blocks for s in shapes]}")
    groups = -(-batch_rows // rows_per_request) if rows_per_request > 1 else batch_rows
    return shapes[-1] if groups * shapes[-1].cluster <= num_sms else shapes[0]


@dataclass(frozen=True, slots=True)
class CopyShape:
    """Launch shape of the copy kernels."""

    row_bytes: int
    threads: int = COPY_THREADS
    unroll: int = COPY_UNROLL
    load: int = COPY_LOAD

    @classmethod
    def from_env(cls, row_bytes: int) -> CopyShape:
        return cls(row_bytes, int(os.environ.get(ENV_COPY_THREADS, COPY_THREADS)),
                   int(os.environ.get(ENV_COPY_UNROLL, COPY_UNROLL)), int(os.environ.get(ENV_COPY_LOAD, COPY_LOAD)))

    @property
    def build(self) -> KernelBuild:
        if self.row_bytes % 16:
            raise InvalidInputError(f"row_bytes={self.row_bytes} must be a multiple of 16")
        if self.threads not in (128, 256, 512, 1024) or self.unroll not in (1, 2, 4, 8) or self.load not in range(4):
            raise InvalidInputError(f"unsupported copy kernel shape {self}")
        return KernelBuild.of("copy.cu", {"HS_VEC": self.row_bytes // 16, "HS_GNT": self.threads,
                                          "HS_UNROLL": self.unroll, "HS_LOAD": self.load})


def copy_build(row_bytes: int) -> KernelBuild:
    return CopyShape(row_bytes).build


MAINTAIN_BUILD = KernelBuild.of("maintain.cu")


def resolver_builds(config: RuntimeConfig, version: int) -> list[KernelBuild]:
    if version == GEOMETRY_RESOLVER_VERSION:
        return [resolver4_shape(config).build]
    if version == CLUSTER_RESOLVER_VERSION:
        return [s.build for s in cluster_resolver_shapes(config)]
    return [resolver_shape(config).build]


def runtime_builds(config: RuntimeConfig, version: int = GEOMETRY_RESOLVER_VERSION) -> list[KernelBuild]:
    resolvers = resolver_builds(config, version)
    return [*resolvers, CopyShape.from_env(config.row_format.row_bytes).build, MAINTAIN_BUILD]


def all_builds_for_ci() -> list[KernelBuild]:
    """Every size class the tests and the benchmark use, for the CPU compile check."""
    small = RuntimeConfig(max_batch_rows=4, max_requests=4, top_k=12, hot_rows=48, block_size=4, max_pages=8,
                          rows_per_request=3)
    prod = RuntimeConfig(max_batch_rows=128, max_requests=128, top_k=2048, hot_rows=4096, block_size=64,
                         max_pages=512)
    mtp = RuntimeConfig(max_batch_rows=64, max_requests=16, top_k=2048, hot_rows=10240, block_size=64,
                        max_pages=2048, rows_per_request=4)
    builds = {resolver_shape(c).build for c in (small, prod, mtp)}
    builds |= {resolver_shape(prod, t).build for t in (256, 512)}
    builds |= {s.build for c in (small, prod, mtp) for s in cluster_resolver_shapes(c)}
    builds |= {resolver4_shape(c).build for c in (small, prod, mtp)}
    builds |= {resolver4_shape(prod, max_smem=0).build, resolver4_shape(prod, max_smem=100 * 1024).build}  # gathers
    builds |= {copy_build(f.row_bytes) for f in (FP8_DS_MLA, BF16_MLA)}
    builds |= {CopyShape(FP8_DS_MLA.row_bytes, load=v).build for v in (1, 2, 3)}
    builds.add(MAINTAIN_BUILD)
    return sorted(builds, key=lambda b: (b.source, b.defines))


class LoadedKernels:
    """Compiled and loaded kernels of one build on one device (shared by runtimes)."""

    _lock = threading.Lock()
    _cache: dict[tuple[int, KernelBuild], object] = {}

    @classmethod
    def module(cls, device_index: int, arch: int, build: KernelBuild):  # noqa: ANN206 - driver.Module
        from hisparse_nvidia.driver import Module

        key = (device_index, build)
        with cls._lock:
            mod = cls._cache.get(key)
            if mod is None:
                compiled = compile_kernel(build, arch)
                mod = cls._cache[key] = Module(compiled.image)
            return mod


def describe_builds(builds: Iterable[KernelBuild]) -> list[str]:
    return [f"{b.source} {dict(b.defines)}" for b in builds]
