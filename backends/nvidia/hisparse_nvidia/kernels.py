"""Which kernel builds a runtime needs, their launch shapes, and loading them on a device.

The resolver is compiled for one geometry (every size of the `RuntimeConfig` a constant: that is
what makes it fast), so a deployment builds it once per configuration and the disk cache keeps
it; the copy kernels are specialised only by size class (threads per block, 16-byte vectors per
row). `runtime_builds` lists the builds of one `RuntimeConfig`; `all_builds_for_ci` the
representative set that CI compiles for sm_90.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from hisparse_core.errors import InvalidInputError
from hisparse_core.geometry import BF16_MLA, FP8_DS_MLA, RuntimeConfig
from hisparse_nvidia.compiler import KernelBuild, compile_kernel

#: Override of the resolver's threads per block (128, 256, 512 or 1024) for tuning.
ENV_RESOLVE_THREADS = "HISPARSE_RESOLVE_THREADS"
#: Shared memory (bytes) the resolver may fill, the page-table rows included (else gathered per
#: entry); overridable for tuning and tests.
ENV_RESOLVE_SMEM = "HISPARSE_RESOLVE_SMEM"
RESOLVE_SMEM_BUDGET = 220 * 1024  # of the 227 KB a Hopper block may take
#: Blocks per group of the resolver (a thread-block cluster, sm_90+) for batches small enough that
#: every group still gets its own SMs; 1 turns the cluster build off.
ENV_RESOLVE_CLUSTER = "HISPARSE_RESOLVE_CLUSTER"
RESOLVE_CLUSTER = 8
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


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def env_int(name: str) -> int | None:
    """The integer value of the environment variable `name`, None when unset or empty."""
    value = os.environ.get(name)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise InvalidInputError(f"{name}={value!r}: expected an integer") from None


def env_int_in(name: str, default: int, lo: int, hi: int, expected: str) -> int:
    """`env_int(name)`, `default` when unset; a value outside [lo, hi] is one line naming it and
    `expected` (what the knob takes, in words)."""
    value = env_int(name)
    value = default if value is None else value
    if not lo <= value <= hi:
        raise InvalidInputError(f"{name}={value}: expected {expected}")
    return value


def env_int_of(name: str, default: int, allowed: tuple[int, ...], expected: str) -> int:
    """`env_int(name)`, `default` when unset; a value not in `allowed` is one line naming it and
    `expected`."""
    value = env_int(name)
    value = default if value is None else value
    if value not in allowed:
        raise InvalidInputError(f"{name}={value}: expected {expected}")
    return value


def resolve_threads() -> int | None:
    """`HISPARSE_RESOLVE_THREADS`: the resolver's threads per block, None when unset (the shape's)."""
    threads = env_int(ENV_RESOLVE_THREADS)
    if threads is not None and threads not in (128, 256, 512, 1024):
        raise InvalidInputError(f"{ENV_RESOLVE_THREADS}={threads}: expected 128, 256, 512 or 1024 threads per block")
    return threads


def resolve_smem() -> int:
    """`HISPARSE_RESOLVE_SMEM` (default `RESOLVE_SMEM_BUDGET`): bytes the resolver may fill; the
    device's own limit is checked where the runtime is built."""
    return env_int_in(ENV_RESOLVE_SMEM, RESOLVE_SMEM_BUDGET, 0, 2**31 - 1, "0 or more bytes of shared memory")


def resolve_cluster() -> int:
    """`HISPARSE_RESOLVE_CLUSTER` (default `RESOLVE_CLUSTER`): blocks per group of the small-batch build."""
    return env_int_of(ENV_RESOLVE_CLUSTER, RESOLVE_CLUSTER, (1, 2, 4, 8), "1, 2, 4 or 8 blocks per group")


def copy_threads() -> int:
    """`HISPARSE_COPY_THREADS` (default `COPY_THREADS`)."""
    return env_int_of(ENV_COPY_THREADS, COPY_THREADS, (128, 256, 512, 1024),
                      "128, 256, 512 or 1024 threads per block")


def copy_unroll() -> int:
    """`HISPARSE_COPY_UNROLL` (default `COPY_UNROLL`)."""
    return env_int_of(ENV_COPY_UNROLL, COPY_UNROLL, (1, 2, 4, 8), "1, 2, 4 or 8 loads in flight a thread")


def copy_load() -> int:
    """`HISPARSE_COPY_LOAD` (default `COPY_LOAD`)."""
    return env_int_of(ENV_COPY_LOAD, COPY_LOAD, (0, 1, 2, 3), "0, 1, 2 or 3 (a load flavour of cuda/common.cuh)")


@dataclass(frozen=True, slots=True)
class ResolverShape:
    """Launch shape and build of the resolver for one geometry."""

    threads: int
    entries_per_thread: int
    lru_per_thread: int
    hash_bits: int
    dynamic_smem: int
    #: The build's -D definitions beyond the thread count and hash size: the sizes of the
    #: RuntimeConfig and whether the kernel reads the page-table rows whole into shared memory.
    defines: tuple[tuple[str, int], ...]

    @property
    def build(self) -> KernelBuild:
        return KernelBuild.of("resolve.cu", {"HS_NT": self.threads, "HS_TBITS": self.hash_bits, **dict(self.defines)})

    @property
    def static_smem(self) -> int:  # four per-warp counters, two per-row counters, two flags
        return 4 * 4 * (self.threads // 32) + 8 * dict(self.defines)["HS_RPR"] + 8 + _RESOLVE_STATIC_SMEM_SLACK

    @property
    def tables_in_smem(self) -> bool:
        return bool(dict(self.defines)["HS_TSMEM"])

    @property
    def cluster(self) -> int:
        """Blocks per group (1 for the one-block build)."""
        return dict(self.defines).get("HS_C", 1)


def cluster_width_allowed(config: RuntimeConfig, cluster: int, threads: int) -> bool:
    """Whether a resolver build with `cluster` blocks per group exists for `config` (see resolve.cu):
    each block takes a share of whole 8-hint pushes and a leader thread's entries lie in one share."""
    union = config.rows_per_request * config.top_k
    if cluster == 1:
        return True
    lead = union // cluster
    return (2 <= cluster <= 8 and config.top_k % 8 == 0 and union % (8 * cluster) == 0
            and lead % -(-union // threads) == 0 and lead // 8 <= threads)


def resolver_shape(config: RuntimeConfig, threads: int | None = None, max_smem: int | None = None,
                   cluster: int = 1) -> ResolverShape:
    """The resolver's launch shape for `config`.

    One block per group: 1024 threads for the production sizes (a thread holds about one top-k
    entry and two LRU positions, or more once a block has 1024 threads); hash buckets for a load
    factor of at most 1/2 (only entries whose position hint fails are hashed). The request's
    page-table rows are read whole into shared memory while that stays within `max_smem` (default
    `RESOLVE_SMEM_BUDGET`, or `HISPARSE_RESOLVE_SMEM`) and they are whole 16-byte vectors;
    otherwise the kernel gathers them per entry. Position hints are always gathered (for host
    entries only): reading a whole hint row measured no faster. The kernel's index
    arithmetic is 32-bit, so the tables it addresses must stay below 2^31 entries.

    `cluster` > 1 builds the thread-block-cluster variant for small batches: that many blocks per
    group, the helpers gathering shares of the position hints for the leader (its shared memory
    grows by the pushed hints, 2 bytes an entry).
    """
    rpr, k, h, bs, p = config.rows_per_request, config.top_k, config.hot_rows, config.block_size, config.max_pages
    union = rpr * k
    if rpr > 32:  # per-row counters are a warp's lanes
        raise InvalidInputError(f"rows_per_request={rpr}: the resolver handles at most 32 rows per request")
    for name, n in (("max_requests * hot_rows", config.max_requests * h),
                    ("max_requests * max_pages * block_size", config.max_requests * p * bs),
                    ("max_batch_rows * top_k", config.max_batch_rows * k)):
        if n >= 2**31:
            raise InvalidInputError(f"{name} = {n} must stay below 2^31 for the resolver's 32-bit indexing")
    if threads is None:
        threads = resolve_threads() or min(1024, max(128, _next_pow2(-(-max(union, h) // 2))))
    if threads not in (128, 256, 512, 1024):
        raise InvalidInputError(f"resolver threads per block must be 128, 256, 512 or 1024, got {threads}")
    ept, cpt = -(-union // threads), -(-h // threads)
    if ept > 32 or cpt > 32:
        raise InvalidInputError(f"RuntimeConfig(top_k={k}, rows_per_request={rpr}, hot_rows={h}) needs more than "
                                f"32 entries or LRU positions per thread of a {threads}-thread block")
    if max_smem is None:
        max_smem = resolve_smem()
    slots = max(4, _next_pow2(2 * union))
    # hash buckets, hm (padded to 16 bytes), htab, order (i16, padded to 4 bytes), marks (likewise)
    smem = 8 * slots + 4 * -(-h // 4) * 4 + 4 * config.hot_blocks + 2 * (h + (h & 1)) + 4 * -(-h // 4)
    smem = -(-smem // 16) * 16
    tables = p % 4 == 0 and smem + 8 * p <= max_smem
    smem += 8 * p if tables else 0
    defines: tuple[tuple[str, int], ...] = (("HS_K", k), ("HS_H", h), ("HS_BS", bs), ("HS_RPR", rpr), ("HS_P", p),
                                            ("HS_TSMEM", int(tables)))
    if cluster != 1:
        if not cluster_width_allowed(config, cluster, threads):
            raise InvalidInputError(
                f"resolver cluster of {cluster} blocks: needs 2-8 blocks, top_k % 8 == 0, rows_per_request * top_k "
                f"a multiple of 8 * blocks and shares of whole per-thread entries; got top_k={k}, "
                f"rows_per_request={rpr}, {threads} threads")
        smem += 2 * (union - union // cluster)
        defines += (("HS_C", cluster),)
    return ResolverShape(threads, ept, cpt, slots.bit_length() - 1, smem, defines)


@dataclass(frozen=True, slots=True)
class CopyShape:
    """Launch shape of the copy kernels."""

    row_bytes: int
    threads: int = COPY_THREADS
    unroll: int = COPY_UNROLL
    load: int = COPY_LOAD

    @classmethod
    def from_env(cls, row_bytes: int) -> CopyShape:
        """The shape `HISPARSE_COPY_THREADS`, `HISPARSE_COPY_UNROLL` and `HISPARSE_COPY_LOAD` set."""
        return cls(row_bytes, copy_threads(), copy_unroll(), copy_load())

    @property
    def slots_per_row(self) -> int:
        """16-byte slots a row takes in the copy kernels: 8 per 128-byte line it can touch (HS_SLOTS)."""
        return ((self.row_bytes + 111) // 128 + 1) * 8

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
#: Threads per block of the copy kernels of vLLM's op set (HS_GNT in vllm_ops.cu).
VLLM_COPY_THREADS = 256
#: vLLM's gathers (hisparse_nvidia.vllm_ops): 2 = one launch of hisparse_vllm_gather (a step with
#: nothing to copy ends in it; mark and copy around one grid barrier) whose copy takes chunks from a
#: ticket counter in list order (native's plan copy, copy.cu), 0 = hisparse_vllm_mark then
#: hisparse_vllm_copy (two launches). 1 (the fused launch with a static copy split, which left the
#: share of a gather_plan block without entries uncopied) is gone and refused, so that no earlier
#: command line silently times another path. Read at each gather call, for A/B timing in one process.
ENV_VLLM_GATHER = "HISPARSE_VLLM_GATHER"
VLLM_GATHER = 2


#: vLLM's resolver (hisparse_vllm_resolve, a build define HS_VR_FAST): 1 = power-of-two hash tables
#: indexed by mask, LRU slots and parked entries kept in registers between phases; 2 = 1 with a lean
#: start (the row's first entries and page-table entries loaded before the group barrier, the hash
#: cleared under it, one reduction for a one-row group's counts; a row that continues its group
#: leaves before those loads); 0 = the earlier build (modulo hash, second global reads). 3 = 2 with
#: the chains of steps with host entries cut (vllm_ops.cu, VR_DIRECT): the group barrier waits on two
#: rounds of loads, the hot-map row is read whole into shared memory, buckets are marked with 32-bit
#: atomics, and the new LRU order is written from registers (no shared round trip, no barrier after
#: the scan on a step without misses). On the H200 (call G5) 2 gained nothing on one-row steps
#: (resident within 0.1 us) and lost at B = 128 (hits 24.94 us against 23.83; four-row groups 68.1
#: against 49.1, before that exit); 3 against 1 in call K4: hits 0.75-2.4 us faster,
#: resident 0.04-0.3 us slower. 4 = 3 with a lean path for one-row groups (vllm_ops.cu, VR_FAST4: state rows
#: loaded in one round, speculatively with the request ids; no group barrier, inserts and walk probes issued
#: together, ballot/popc ranks, three barriers on a hit step where 3 crosses five, a hash of four buckets a
#: union row); the default since call G3 of the fifteenth session: with the per-shape build, one-row
#: hit steps 10.1-11.0 us against 15.6-20.6 for 3, resident 5.2-5.6 against 5.8-6.5, 274 misses at
#: B = 8 49.1 against 58.3; four-row groups take 3's path (at most 1.3 us slower, up to 2.8 faster).
#: A build 5 (4 with four entries and eight LRU positions a thread, half the threads) was slower than 4 on
#: every hit and miss cell in call C1 of the sixteenth session (hits 11.85-13.85 us against 9.92-10.93) and
#: was removed; 5 is refused like any value outside 0-4 and 6. 6 = 4 with a shorter instruction stream on
#: the one-row lean path (vllm_ops.cu, VR_FAST6: rows r - 1 .. r + 30 one a lane and shuffled, the
#: page-table rows addressed once, the hash cleared in unrolled rounds, the thread index bounded for the
#: compiler, one barrier fewer on a step with misses unless an entry repeats a miss); the same outputs
#: byte for byte. Not yet timed on a GPU: off until it is.
ENV_VLLM_RESOLVE = "HISPARSE_VLLM_RESOLVE"
VLLM_RESOLVE = 4
#: The resolver builds there are (HISPARSE_VLLM_RESOLVE); 5 was removed.
VLLM_RESOLVE_BUILDS = (0, 1, 2, 3, 4, 6)


def vllm_gather_variant() -> int:
    """`HISPARSE_VLLM_GATHER` (default `VLLM_GATHER`)."""
    got = env_int_in(ENV_VLLM_GATHER, VLLM_GATHER, 0, 2, "0 (mark + copy kernels) or 2 (one fused gather kernel)")
    if got == 1:
        raise InvalidInputError(f"{ENV_VLLM_GATHER}=1: that path (static copy split) was removed; "
                                "expected 0 (mark + copy kernels) or 2 (one fused gather kernel)")
    return got


#: Threads per block of vLLM's resolver: 0 = the automatic choice (vllm_ops.resolve_threads: enough
#: for two entries and two LRU positions a thread, up to 1024), else 128, 256, 512 or 1024, raised
#: where the call needs more (at most 32 entries and 32 LRU positions a thread). Read at each resolve
#: call, for A/B timing of the resident step's latency in one process.
ENV_VLLM_RESOLVE_THREADS = "HISPARSE_VLLM_RESOLVE_THREADS"
VLLM_RESOLVE_THREADS = 0


def vllm_resolve_threads() -> int:
    """`HISPARSE_VLLM_RESOLVE_THREADS` (default `VLLM_RESOLVE_THREADS`)."""
    expected = "0 (automatic), 128, 256, 512 or 1024 threads"
    got = env_int_in(ENV_VLLM_RESOLVE_THREADS, VLLM_RESOLVE_THREADS, 0, 1024, expected)
    if got not in (0, 128, 256, 512, 1024):
        raise InvalidInputError(f"{ENV_VLLM_RESOLVE_THREADS}={got}: expected {expected}")
    return got


#: Blocks per SM of the fused gather's grid (at most; never more than are co-resident). One: on the
#: H200 (call G5) 274 misses at B = 128 took 519.8 us a layer-step with one against 587.5 with two,
#: and no other cell moved by more than 0.4 us; one also leaves room where a tool (compute-sanitizer)
#: grows the kernel's registers beyond what the occupancy query saw.
ENV_VLLM_GATHER_PER_SM = "HISPARSE_VLLM_GATHER_PER_SM"
VLLM_GATHER_PER_SM = 1


def vllm_gather_per_sm() -> int:
    """`HISPARSE_VLLM_GATHER_PER_SM` (default `VLLM_GATHER_PER_SM`)."""
    return env_int_in(ENV_VLLM_GATHER_PER_SM, VLLM_GATHER_PER_SM, 1, 8, "1 to 8 blocks per SM")


#: The fused gather (HISPARSE_VLLM_GATHER=2) with a barrier-free path for small calls
#: (hisparse_vllm_gather_local in vllm_ops.cu): 0 = off; 1 = calls of at most 2048 entries are served by
#: each block of the launch on its own: it reads every taken entry, finds each destination's last entry
#: in its shared memory and copies its share, with no destination marks, grid barrier, tickets or epoch
#: (gather_compact reads the counts first, then the counted entries); 2 = 1, with gather_compact reading
#: every entry and its row's count in one round where rows x top-k <= 2048; 3 and 4 = 1 and 2 with
#: gather_compact's bound at 4096 counted entries (hisparse_vllm_gather_local4k: 96 KiB of shared memory
#: a block). gather_plan takes the path where rows x top-k <= 2048; larger calls take the marks and the
#: barrier in the same launch. The default is 1 with the fused gather (timed on the H200 against 0, 2, 3
#: and 4 in one call, docs/gpu-validation.md, sixteenth session: 34 misses at B = 1 19.2 -> 14.6 us, no
#: cell slower beyond noise) and 0 with the mark + copy pair, where the path does not exist. Read at each
#: gather call, for A/B timing in one process.
ENV_VLLM_GATHER_LOCAL = "HISPARSE_VLLM_GATHER_LOCAL"
VLLM_GATHER_LOCAL = 1


def vllm_gather_local(variant: int) -> int:
    """`HISPARSE_VLLM_GATHER_LOCAL` for the gather `variant` (`vllm_gather_variant()`): the default
    `VLLM_GATHER_LOCAL` with the fused gather (2), 0 with the others; a non-zero value set with another
    variant is refused (the path lives in the fused gather's launch)."""
    local = env_int_in(ENV_VLLM_GATHER_LOCAL, VLLM_GATHER_LOCAL if variant == 2 else 0, 0, 4,
                       "0 (off), 1 (gathers of at most 2048 entries without the grid barrier), 2 (1, gather_compact's "
                       "entries read with their counts in one round), 3 or 4 (1 or 2 up to 4096 counted entries)")
    if local and variant != 2:
        raise InvalidInputError(f"{ENV_VLLM_GATHER_LOCAL}={local} is a path of the fused gather: expected "
                                f"HISPARSE_VLLM_GATHER=2 with it, got {variant}")
    return local


#: Preferred shared-memory carveout (percent of an SM's most; -1 the driver's choice) of vLLM's
#: resolver and fused gather, one value for both: kernels whose carveouts differ cannot share an SM
#: until it drains and is reconfigured, and the gather is launched to overlap the resolver.
ENV_VLLM_CARVEOUT = "HISPARSE_VLLM_CARVEOUT"
VLLM_CARVEOUT = -1


def vllm_carveout() -> int:
    """`HISPARSE_VLLM_CARVEOUT` (default `VLLM_CARVEOUT`)."""
    return env_int_in(ENV_VLLM_CARVEOUT, VLLM_CARVEOUT, -1, 100, "-1 (the driver's choice) or 0 to 100 percent")


#: vLLM's resolver launched as a programmatic dependent launch (1, default) or not (0). With 1 the module is
#: built with VR_PDL (cuda/vllm_ops.cu: `griddepcontrol.wait` before the kernel's first global access) and
#: launched with programmatic stream serialization, so its blocks are placed while the kernel before it on
#: the stream finishes (in the bench's resolve -> gather chain the previous gather, which lets dependents
#: launch once its blocks have all started; in vLLM's forward the kernel that writes the layer's top-k);
#: with 0 the launch waits for that kernel to drain (native's resolver overlaps it:
#: HISPARSE_OVERLAP_LAUNCH). Outputs are unchanged: every load and store of the resolver follows the wait,
#: which returns once the previous grid has completed and its writes are visible. The default since the
#: H200's call F3 (nineteenth session, docs/gpu-validation.md): nowhere slower beyond a sample's spread,
#: 3.6-12 us faster at 274 misses from B = 32; its 0.2-0.4 us on resident and hit steps is within a shift
#: the bench's graph-floor row showed in the same variant, so not established. Its lockstep tests, vLLM's
#: 41 kernel tests and memcheck were clean. `0` is the switch back. Read at each resolve call, for A/B
#: timing in one process.
ENV_VLLM_RESOLVE_PDL = "HISPARSE_VLLM_RESOLVE_PDL"
VLLM_RESOLVE_PDL = 1


def vllm_resolve_pdl() -> int:
    """`HISPARSE_VLLM_RESOLVE_PDL` (default `VLLM_RESOLVE_PDL`)."""
    return env_int_in(ENV_VLLM_RESOLVE_PDL, VLLM_RESOLVE_PDL, 0, 1,
                      "0 (the resolver waits for the kernel before it) or 1 (a programmatic dependent launch)")


def vllm_resolve_variant() -> int:
    """`HISPARSE_VLLM_RESOLVE` (default `VLLM_RESOLVE`)."""
    expected = ("0 (the earlier resolver build), 1 (the faster one), 2 (the faster one with a lean start), "
                "3 (2 with direct LRU writes and the hot-map row in shared memory), 4 (3 with a lean path "
                "for one-row groups) or 6 (4 with a shorter instruction stream on that path)")
    got = env_int_in(ENV_VLLM_RESOLVE, VLLM_RESOLVE, 0, 6, expected)
    if got not in VLLM_RESOLVE_BUILDS:
        raise InvalidInputError(f"{ENV_VLLM_RESOLVE}={got}: that build was removed; expected {expected}")
    return got


#: vLLM's resolver built per call shape (1, default) or one build for every shape (0): a shape build
#: (vllm_resolve_shape_build) has the call's top-k, hot rows, block sizes, shared buckets and threads
#: as compile-time constants, so divisions, power-of-two tests, bounds and loop trips fold, as in the
#: native resolver; one NVRTC compile per shape met (vLLM's shapes are fixed per deployment; the
#: kernel cache keeps the cubin across processes). Read at each resolve call, for A/B timing in one
#: process. The default since call G3 of the fifteenth session (docs/gpu-validation.md).
ENV_VLLM_RESOLVE_SHAPE = "HISPARSE_VLLM_RESOLVE_SHAPE"
VLLM_RESOLVE_SHAPE = 1


def vllm_resolve_shape() -> int:
    """`HISPARSE_VLLM_RESOLVE_SHAPE` (default `VLLM_RESOLVE_SHAPE`)."""
    return env_int_in(ENV_VLLM_RESOLVE_SHAPE, VLLM_RESOLVE_SHAPE, 0, 1,
                      "0 (one resolver build for every shape) or 1 (a build per call shape)")


def vllm_resolve_shape_build(fast: int, k: int, h: int, bs: int, sbs: int, rbs: int, buckets: int,
                             threads: int, pdl: int) -> KernelBuild:
    """The resolver alone (cuda/vllm_ops.cu under VR_K) of build `fast` (HISPARSE_VLLM_RESOLVE) for one
    call shape: top-k `k`, `h` hot rows a state row, hot block size `bs`, source and resident block
    sizes `sbs` and `rbs` (1 where the call has no such table), `buckets` shared hash buckets and
    `threads` a block; `pdl` 1 adds VR_PDL (HISPARSE_VLLM_RESOLVE_PDL, 1 by default). Its copy kernels are left
    out, so the row width is irrelevant (16 bytes)."""
    defines = {"HS_VEC": 1, "HS_GNT": VLLM_COPY_THREADS, "HS_VR_FAST": fast, "VR_K": k, "VR_H": h, "VR_BS": bs,
               "VR_SBS": sbs, "VR_RBS": rbs, "VR_SB": buckets, "VR_NT": threads}
    if pdl:
        defines["VR_PDL"] = 1
    return KernelBuild.of("vllm_ops.cu", defines)


def vllm_ops_build(row_bytes: int, pdl: int = 0) -> KernelBuild:
    """The build of cuda/vllm_ops.cu (vLLM's op set, hisparse_nvidia.vllm_ops) for rows of `row_bytes`; `pdl` 1:
    its resolver waits for the previous grid first (VR_PDL, HISPARSE_VLLM_RESOLVE_PDL, 1 by default). VR_PDL
    touches the resolver alone, so the gathers' module is the build with `pdl` 0."""
    if row_bytes % 16:
        raise InvalidInputError(f"row_bytes={row_bytes} must be a multiple of 16")
    defines = {"HS_VEC": row_bytes // 16, "HS_GNT": VLLM_COPY_THREADS, "HS_VR_FAST": vllm_resolve_variant()}
    if pdl:
        defines["VR_PDL"] = 1
    return KernelBuild.of("vllm_ops.cu", defines)


def runtime_builds(config: RuntimeConfig) -> list[KernelBuild]:
    return [resolver_shape(config).build, CopyShape.from_env(config.row_format.row_bytes).build, MAINTAIN_BUILD]


def all_builds_for_ci() -> list[KernelBuild]:
    """Every build the tests and the benchmark use, for the CPU compile check."""
    small = RuntimeConfig(max_batch_rows=4, max_requests=4, top_k=12, hot_rows=48, block_size=4, max_pages=8,
                          rows_per_request=3)
    odd = RuntimeConfig(max_batch_rows=3, max_requests=2, top_k=7, hot_rows=21, block_size=3, max_pages=5,
                        rows_per_request=2)
    prod = RuntimeConfig(max_batch_rows=128, max_requests=128, top_k=2048, hot_rows=4096, block_size=64,
                         max_pages=512)
    mtp = RuntimeConfig(max_batch_rows=64, max_requests=16, top_k=2048, hot_rows=10240, block_size=64,
                        max_pages=2048, rows_per_request=4)
    builds = {resolver_shape(c).build for c in (small, odd, prod, mtp)}
    builds.add(resolver_shape(prod, max_smem=0).build)  # page tables gathered per entry
    builds.add(resolver_shape(prod, threads=512).build)
    builds |= {resolver_shape(prod, cluster=c).build for c in (2, 4, 8)}
    builds.add(resolver_shape(mtp, cluster=2).build)
    builds |= {copy_build(f.row_bytes) for f in (FP8_DS_MLA, BF16_MLA)}
    builds |= {CopyShape(FP8_DS_MLA.row_bytes, load=v).build for v in (1, 2, 3)}
    builds.add(MAINTAIN_BUILD)
    builds |= {vllm_ops_build(w) for w in (FP8_DS_MLA.row_bytes, 16)}  # fp8_ds_mla rows, vLLM's 16-byte test rows
    builds |= {KernelBuild.of("vllm_ops.cu", {"HS_VEC": FP8_DS_MLA.row_bytes // 16, "HS_GNT": VLLM_COPY_THREADS,
                                              "HS_VR_FAST": v}) for v in VLLM_RESOLVE_BUILDS}  # HISPARSE_VLLM_RESOLVE
    # HISPARSE_VLLM_RESOLVE_SHAPE=1 at the benchmark's shapes (1 and 4 rows a request), builds 1, 3, 4 and 6
    # (4 with the buckets vllm_ops.resolve_smem_buckets gives it there: four a union row where they fit), and
    # builds 4 and 6 for the GPU tests' two-row groups (8192 buckets: at 4096 hot rows the one-row build);
    # builds 4 and 6 with HISPARSE_VLLM_RESOLVE_PDL=1 (the default) and =0, builds 1 and 3 as the tests set them (0)
    builds |= {vllm_resolve_shape_build(v, 2048, h, 64, 64, 64, b, 1024, 0) for v in (1, 3)
               for h, b in ((4096, 4096), (10240, 16384))}
    builds |= {vllm_resolve_shape_build(v, 2048, h, 64, 64, 64, b, 1024, p) for v in (4, 6) for p in (0, 1)
               for h, b in ((4096, 8192), (10240, 16384), (10240, 8192))}
    # the whole module's resolver with VR_PDL (HISPARSE_VLLM_RESOLVE_SHAPE=0 at the default launch), builds 4 and 6
    builds |= {KernelBuild.of("vllm_ops.cu", {"HS_VEC": FP8_DS_MLA.row_bytes // 16, "HS_GNT": VLLM_COPY_THREADS,
                                              "HS_VR_FAST": v, "VR_PDL": 1}) for v in (4, 6)}
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
