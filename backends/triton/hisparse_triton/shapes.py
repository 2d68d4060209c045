"""Launch shapes of the triton backend's kernels: compile-time constants, warps, grids and the
signature each kernel is compiled with, from a `RuntimeConfig` and the target's warp width.

One place for what the runtime launches and what CI compiles ahead of time for other targets
(tests/triton_backend/test_compile_targets.py builds every kernel for AMD CDNA and sm_90 from these
specs on a machine with no GPU). Imports no triton.

Portability rules the shapes keep:

- Threads per program are chosen in threads and divided by the target's warp width (32 on NVIDIA,
  64 on AMD CDNA), so no size assumes a 32-lane warp.
- Only power-of-two lane counts are compile-time constants (`*P`); every extent that varies with
  the configuration (top-k, hot rows, block size, row words) is a runtime argument that Triton
  does not specialize, so the conformance suite's many small geometries share a few builds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hisparse_core.errors import InvalidInputError
from hisparse_core.geometry import RuntimeConfig

#: Plan entries (or copied rows) one program of a copy kernel moves per iteration on a GPU.
COPY_ENTRIES = 16
#: The same under Triton's interpreter, which runs programs one after another and pays per op, not
#: per element: few wide programs (a whole plan row each).
INTERPRETED_COPY_ENTRIES = 4096
#: Threads of one copy program (4 warps on NVIDIA, 2 wavefronts on AMD CDNA).
COPY_THREADS = 128
#: The largest lane count of one resolver program (a group's entries, or its hot rows, padded).
MAX_LANES = 1 << 16
#: Threads of the resolver program: at most this many (CUDA's and HIP's block limit).
MAX_THREADS = 1024
#: Compiled builds pad small geometries to at least these lanes (entries, hot rows, hash buckets,
#: batch rows of the plan copy), so that the many small geometries of a test run share a few
#: builds instead of compiling one each; a masked lane costs nothing but an idle thread. The
#: interpreter pays per element and keeps the exact powers of two.
MIN_LANES = dict(KP=64, HP=256, TP=1024, BP=64, PT=64)
#: The resolvers (`kernels.RESOLVERS`): "gather" (the default) reads a state row's tables whole and
#: looks them up in registers, "scratch" is the first design (every lookup a global access). The
#: environment variable `HISPARSE_TRITON_RESOLVER` picks one when a runtime is built (A/B timing).
RESOLVERS = ("gather", "scratch")
RESOLVER_ENV = "HISPARSE_TRITON_RESOLVER"
#: The gather resolver keeps a page-table row in registers up to this many pages (two such rows:
#: 32 KiB of shared memory when looked up), and a hot-map row or hash table up to this many lanes
#: (one 32 KiB lookup at a time), within CDNA's 64 KiB of LDS.
MAX_TABLE_LANES = 4096
MAX_ROW_LANES = 8192
#: Further knobs for A/B timing, read when a runtime is built: threads of one resolver program (a
#: power of two, 64-1024; default from the shape), and plan-copy programs per multiprocessor.
THREADS_ENV = "HISPARSE_TRITON_RESOLVER_THREADS"
PLAN_PER_SM_ENV = "HISPARSE_TRITON_PLAN_PER_SM"
#: 1: the gather resolver copies its group's plan itself on `resolve(gather=True)`, and no plan-copy
#: kernel is launched for layer 0 (`kernels.resolve_gather_kernel`, FUSE). 0, the default: the
#: plan-copy kernel copies it. Fusing saves the launch (1.2-1.5 us on hit and resident steps, call
#: G3) but one program per request copies its plan chunk after chunk, a host round trip each, so
#: it loses on every step with misses, at every batch (G3: 34 misses x 8, 34.4 us against 28.1;
#: 2048 x 1, 269 against 81; all-miss x 128, 4450 against 3792). A step's misses are not known when
#: the launch is chosen, so the default is the launch.
FUSE_ENV = "HISPARSE_TRITON_FUSE_COPY"
#: 1 (the default): the gather resolver's `LEAN` build, fewer dependent global round trips on a
#: step (`kernels.resolve_gather_kernel`); 0: the build of call G3, for A/B timing.
LEAN_ENV = "HISPARSE_TRITON_LEAN"
#: Plan entries one plan-copy program moves per chunk on a GPU (default `COPY_ENTRIES`): fewer
#: split a small batch's plan over more programs (more multiprocessors reading the host at once).
PLAN_ENTRIES_ENV = "HISPARSE_TRITON_PLAN_ENTRIES"
PLAN_ENTRIES = (4, 8, 16, 32)
#: 1: the gather resolver's candidates claim hash buckets with one compare-and-swap a round instead
#: of a read, a store, a barrier, a read back and a barrier (`kernels.resolve_gather_kernel`, CAS),
#: aimed at small batches' miss steps; 0, the default (on the H200, call K1, 0-1.9 us slower in every
#: cell).
CAS_ENV = "HISPARSE_TRITON_CAS"
#: 1: the gather resolver's prefix sums over a group's entries and over the hot rows are two-level
#: (rows of one warp's lanes: a scan within each row, the row totals' exclusive sums as one masked
#: sum) instead of one `tl.associative_scan` across the program, whose lowering walks every warp's
#: partial sum in each thread. The resolver is bound by the instructions it issues (call G1 of the
#: 14th session, 34 misses x 8: 2,350 instructions a warp at 15.8 cycles each, 20.9 us); its sm_90
#: build (Triton 3.6) has 2,928 SASS instructions, 1,880 with two-level scans (the miss path about
#: 2,200 -> 1,550, the hit path 1,300 -> 930). 0, the fixed default; the auto choice picks 1 at every batch
#: size (`auto.py`). (Call K4, timed only with SHIFT and
#: ROW_COPY: no gain on miss steps, docs/backends.md).
SCAN_ENV = "HISPARSE_TRITON_SCAN"
#: 1: where the block size is a power of two, the gather resolver takes a position's or a slot's
#: block and offset with a shift and a mask (`SB`, the shift a runtime argument) instead of a
#: division by the runtime block size (about 20 instructions a lane, four such divisions on a miss
#: step); one more build per configuration (power of two or not). 0, the fixed default (timed with SCAN,
#: K4); the auto choice picks 1 at every batch size.
SHIFT_ENV = "HISPARSE_TRITON_SHIFT"
#: 1: at batches where every batch row gets at least `ROW_COPY_MIN_PROGRAMS` plan-copy programs, the
#: plan copy is `kernels.copy_plan_rows_kernel` (programs assigned to rows; a row's count read beside
#: its first plan entries, one round trip before the host reads instead of two; rows read along the
#: host's 128-byte lines, `row_copy_meta`); larger batches keep
#: `copy_plan_kernel` (chunks round robin, balanced however the misses fall). 0, the default (call
#: K4, with SCAN and SHIFT: 7-8 us more on batch-8 steps without a miss).
ROW_COPY_ENV = "HISPARSE_TRITON_ROW_COPY"
ROW_COPY_MIN_PROGRAMS = 8
#: 1 (NVIDIA sm_90 and later only; refused elsewhere): the plan copy is a programmatic dependent
#: launch (`launch_pdl`): the resolver lets it start once its programs have begun, and the copy waits
#: in `gdc_wait` for the resolver's end, so the copy's launch overlaps the resolver instead of
#: following it. 0, the fixed default; the auto choice picks 1 at small batches on NVIDIA sm_90 and later
#: (call K4: 0.6-2.3 us saved on most miss steps up to batch 64, 93 us
#: lost at 274 misses and batch 128).
PDL_ENV = "HISPARSE_TRITON_PDL"
#: 1: the plan copy (`kernels.copy_plan_kernel`, `VEC`) takes a device row's block and offset in 32-bit
#: arithmetic and moves `COPY_VEC` words per load and store where a row's words and the device blocks'
#: stride allow (else one), instead of 64-bit divisions by the run-time block size (a called routine
#: per entry) and one word per access; by shift and mask where the block size is a power of two. sm_90
#: (Triton 3.6, 656-byte rows, 16 entries a chunk): 1,776 -> 528 SASS instructions, 182 -> 79 registers.
#: Its few busy programs at small batches (17 of 264 at 34 misses x 8) are bound by the instructions
#: each warp issues in turn. `copy_plan_rows_kernel` (`ROW_COPY_ENV`) is unchanged. 0, the fixed default;
#: the auto choice picks 1 at every batch size (calls C4 and D1 (seventeenth session)).
LEAN_COPY_ENV = "HISPARSE_TRITON_LEAN_COPY"
#: Words (int32) one access of the lean plan copy moves: 16 bytes, the widest global access of
#: NVIDIA's and AMD CDNA's instruction sets.
COPY_VEC = 4
#: N (2, 4, 8 or 16): the gather resolver as `kernels.resolve_split_kernel`, N programs a batch row: each
#: does the data-parallel work of 1/N of its group's entries (page-table lookups, hint checks, resident
#: and hinted outputs, marks) and lists its candidates; the group's last program to finish does the
#: rest (hash table, held-slot lookups, scans over the LRU order, victims, plan), over the candidates
#: as a list rather than over every entry. Aimed at small batches, where one program a request keeps
#: only B multiprocessors busy (call K1: 34 misses x 8, 8 programs on 132 SMs, issue-bound). 0, the
#: fixed default (the auto choice picks 8 at small batches, with 512 threads): on the H200 (fifteenth session, calls G3 and G6; docs/backends.md) no gain at the default
#: threads; at 256-512 threads, against SCAN and SHIFT alone, 1.1-2.3 us saved on 34-miss steps at
#: B = 1 and 8, +0.9 to -1.3 us at 274 misses B = 8, 0.9-1.3 us lost on resident steps.
SPLIT_ENV = "HISPARSE_TRITON_SPLIT"
SPLITS = (2, 4, 8, 16)
#: 1 (with `SPLIT_ENV`): the split resolver's hot-row work spread too. Its last program stops after the
#: candidates' hash table; `kernels.resolve_split_hot_kernel` (N programs a batch row, each a slice of
#: the LRU order: held-slot lookups, marks, hits, compacted evictable segments; the last of them the
#: per-request part: misses ranked against victims, outputs, plan, hot map) and
#: `kernels.resolve_split_lru_kernel` (N programs a batch row: the new LRU order, slice by slice) follow
#: it, two more launches. The last program of a request was about 80% of a 34-miss batch-8 step's
#: instructions (sm_90 SASS, one program over the 4096 hot rows). 0, the default. Not yet timed on a GPU.
SPLIT_TAIL_ENV = "HISPARSE_TRITON_SPLIT_TAIL"
#: 1 (with `SPLIT_ENV`, not with `SPLIT_TAIL_ENV`): the split resolver's last program keeps a candidate
#: list of at most one chunk (one candidate a thread) in registers from the claim to the table's
#: clearing (`kernels.resolve_split_kernel`, KEEP): its buckets, rows, entries and positions are not
#: stored to the list scratch and read back in each pass, and the first references are read once, so
#: the last program's path at 34 and 274 misses at B = 8 has five dependent global round trips fewer
#: (of about fifteen). Longer lists take the chunked passes. 0, the default; not yet timed on a GPU.
SPLIT_KEEP_ENV = "HISPARSE_TRITON_SPLIT_KEEP"
#: N (32, 64 or 128; 0, the fixed default: off; the auto default picks 128 from half its small-batch line up to
#: it, `auto.SPEC_PICKS`): behind the split resolver, layer 0's plan copy is
#: `kernels.copy_spec_kernel`, N entries of a batch row a program: it reads the host rows of the
#: entries likely to miss (hint not holding the row) while the resolver runs (a programmatic dependent
#: launch where the target has one) and, once it has ended, writes those that missed (the resolver's
#: miss mask, written for it) at their victims' rows, and any other miss after them, `N // 4` rows at
#: a time. The nvidia backend's copy after a small batch's resolve reads its likely misses the same
#: way (`hisparse_gather_spec`, docs/backends.md); on the H200 (call D4) triton's plan copy waited for
#: the resolver, 274 misses B = 8 52.9 us against nvidia's 34.1 (the copy alone 29.2). Batches the
#: one-program resolver serves keep the plan copy; later layers (`replay_plan`) too. Timed in call E2.
SPEC_COPY_ENV = "HISPARSE_TRITON_SPEC_COPY"
#: 1 (NVIDIA sm_90 and later, with `PDL_ENV` and the split resolver): the split resolver is itself a
#: programmatic dependent launch of the kernel before it (on a decode step, the previous step's layer-0
#: copy), and the copies behind it let the next kernel launch once their own wait is over: a step's
#: resolver is placed on the multiprocessors while the copy before it still runs, and waits in `gdc_wait`
#: for that copy's end and flush before any read or write (so every input is final, whatever kernel wrote
#: it). It then lets its copy launch, which therefore reads final inputs too. The aim: the resolver's
#: launch latency off a small batch's critical path (a resident batch-8 step is 6.9 us against
#: nvidia's 4.4, two launches). 0, the default: in call F4 (nineteenth session) within 0.1-0.3 us of the
#: default up to 274 misses and 0.4-1.4 us faster at 2048 misses (B = 4-16); its chained lockstep tests
#: have not completed on a GPU.
PDL_CHAIN_ENV = "HISPARSE_TRITON_PDL_CHAIN"
SPEC_ENTRIES = (32, 64, 128)
#: Host rows one program of the speculative copy holds at once: a quarter of its entries (a batch-8
#: step with 274 misses has about 9 candidates in 64 entries) on a GPU; few under the interpreter, so
#: that tests walk the rows past them too.
SPEC_SLOT_SHARE = 4
INTERPRETED_SPEC_ENTRIES = 8
INTERPRETED_SPEC_SLOTS = 2
#: Candidates the split resolver's last program handles at once: one a thread compiled (a smaller
#: list costs a thread the same); a few under the interpreter, so that tests walk several chunks.
INTERPRETED_SPLIT_CHUNK = 4
#: ... and at most this many chunks a group's entries long under the interpreter, whose cost is per
#: chunk (a pass over a chunk is some thirty numpy calls): top-k 2048 at 4 a chunk took about 30 s a
#: conformance example, 300 chunks a pass.
INTERPRETED_SPLIT_CHUNKS = 32
#: Lanes of one row of the two-level scans under the interpreter (no warps; small, so that the
#: small geometries of the tests still scan several rows).
INTERPRETED_SCAN_ROW = 4
#: The most rows a two-level scan may have: its row offsets come from an [rows, rows] matrix, and
#: Triton caps a tensor at 2^20 elements (a 10240-row hot buffer, 16384 lanes, at the interpreter's
#: 4-lane rows would be 4096 rows).
MAX_SCAN_ROWS = 1024
#: Triton 3.6's ROCm lowering of a scattered `atomic_cas` with several lanes a thread fails
#: ("'llvm.extractvalue' op Type mismatch"); 3.9 compiles it. No release between was tried.
CAS_MIN_TRITON_ROCM = (3, 9)
#: The split resolver's build CI compiles for every target (`kernel_specs`), with SCAN and SHIFT.
SPLIT_BUILD = 8


def cas_compiles(version: str, *, rocm: bool) -> bool:
    """Whether Triton `version` compiles the CAS build for ROCm (`rocm`) or CUDA."""
    if not rocm:
        return True
    major, minor = (int("".join(c for c in part if c.isdigit()) or 0) for part in version.split(".")[:2])
    return (major, minor) >= CAS_MIN_TRITON_ROCM
#: Plan entries the fused copy moves per iteration of one resolver program (rows of a tile).
FUSED_COPY_ENTRIES = 32
#: Plan-copy programs per multiprocessor: its tile holds ~180 registers a thread, so two programs
#: of 128 threads fit an SM; more programs than that run as a second wave, which a step without
#: misses pays for nothing (3.3 us instead of one wave's launch, G1's profile).
PLAN_PER_SM = 2


@dataclass(frozen=True, slots=True)
class Tuning:
    """The environment's choices: resolver variant, resolver threads (None: the shape's), plan-copy
    programs per multiprocessor, and the switches; unset ones at their fixed defaults (the runtime's
    default picks some per batch size instead: `auto.choose`)."""

    resolver: str
    threads: int | None
    plan_per_sm: int
    fuse: bool = False
    lean: bool = True
    plan_entries: int = COPY_ENTRIES
    cas: bool = False
    scan: bool = False
    shift: bool = False
    row_copy: bool = False
    pdl: bool = False
    split: int = 0
    split_tail: bool = False
    lean_copy: bool = False
    split_keep: bool = False
    spec_copy: int = 0
    pdl_chain: bool = False


def tuning(env: dict[str, str]) -> Tuning:
    """The knobs `env` sets (`RESOLVER_ENV`, `THREADS_ENV`, `PLAN_PER_SM_ENV`, `FUSE_ENV`, `LEAN_ENV`,
    `PLAN_ENTRIES_ENV`, `CAS_ENV`, `SCAN_ENV`, `SHIFT_ENV`, `ROW_COPY_ENV`, `PDL_ENV`, `SPLIT_ENV`, `SPLIT_TAIL_ENV`,
    `LEAN_COPY_ENV`, `SPLIT_KEEP_ENV`, `SPEC_COPY_ENV`, `PDL_CHAIN_ENV`); one clear error per bad value."""
    threads = env.get(THREADS_ENV) or None
    if threads is not None and (not threads.isdigit() or int(threads) not in (64, 128, 256, 512, 1024)):
        raise InvalidInputError(f"{THREADS_ENV}={threads!r} is not a thread count; expected 64, 128, 256, 512 or 1024")
    per_sm = env.get(PLAN_PER_SM_ENV) or str(PLAN_PER_SM)
    if not per_sm.isdigit() or not 1 <= int(per_sm) <= 32:
        raise InvalidInputError(f"{PLAN_PER_SM_ENV}={per_sm!r} is not a program count; expected an integer 1-32")
    entries = env.get(PLAN_ENTRIES_ENV) or str(COPY_ENTRIES)
    if entries not in tuple(map(str, PLAN_ENTRIES)):
        raise InvalidInputError(f"{PLAN_ENTRIES_ENV}={entries!r} is not an entry count; expected one of "
                                f"{', '.join(map(str, PLAN_ENTRIES))}")
    resolver = resolver_variant(env.get(RESOLVER_ENV))
    fuse = env.get(FUSE_ENV) or "0"
    lean = env.get(LEAN_ENV) or "1"
    cas = env.get(CAS_ENV) or "0"
    scan = env.get(SCAN_ENV) or "0"
    shift = env.get(SHIFT_ENV) or "0"
    row_copy = env.get(ROW_COPY_ENV) or "0"
    pdl = env.get(PDL_ENV) or "0"
    lean_copy = env.get(LEAN_COPY_ENV) or "0"
    for key, value in ((FUSE_ENV, fuse), (LEAN_ENV, lean), (CAS_ENV, cas), (SCAN_ENV, scan), (SHIFT_ENV, shift),
                       (ROW_COPY_ENV, row_copy), (PDL_ENV, pdl), (LEAN_COPY_ENV, lean_copy)):
        if value not in ("0", "1"):
            raise InvalidInputError(f"{key}={value!r} is not a switch; expected 0 or 1")
    if fuse == "1" and resolver != "gather":
        raise InvalidInputError(f"{FUSE_ENV}={fuse!r} needs the gather resolver; {RESOLVER_ENV} is {resolver!r}")
    for key, value in ((CAS_ENV, cas), (SCAN_ENV, scan), (SHIFT_ENV, shift), (PDL_ENV, pdl)):
        if value == "1" and resolver != "gather":
            raise InvalidInputError(f"{key}={value!r} needs the gather resolver; {RESOLVER_ENV} is {resolver!r}")
    split = env.get(SPLIT_ENV) or "0"
    if split not in ("0", *map(str, SPLITS)):
        raise InvalidInputError(f"{SPLIT_ENV}={split!r} is not a program count; expected 0 (off) or one of "
                                f"{', '.join(map(str, SPLITS))}")
    if split != "0":
        if resolver != "gather":
            raise InvalidInputError(f"{SPLIT_ENV}={split!r} needs the gather resolver; {RESOLVER_ENV} is {resolver!r}")
        for key, value, off in ((FUSE_ENV, fuse, "0"), (CAS_ENV, cas, "0"), (LEAN_ENV, lean, "1")):
            if value != off:
                raise InvalidInputError(f"{key}={value!r} does not combine with {SPLIT_ENV}={split!r} (the split "
                                        f"resolver has no such build); expected {key}={off} or {SPLIT_ENV}=0")
    split_tail = env.get(SPLIT_TAIL_ENV) or "0"
    keep = env.get(SPLIT_KEEP_ENV) or "0"
    for key, value in ((SPLIT_TAIL_ENV, split_tail), (SPLIT_KEEP_ENV, keep)):
        if value not in ("0", "1"):
            raise InvalidInputError(f"{key}={value!r} is not a switch; expected 0 or 1")
        if value == "1" and split == "0":
            raise InvalidInputError(f"{key}={value!r} needs the split resolver; {SPLIT_ENV} is 0 (off), "
                                    f"expected one of {', '.join(map(str, SPLITS))}")
    spec = env.get(SPEC_COPY_ENV) or "0"
    if spec not in ("0", *map(str, SPEC_ENTRIES)):
        raise InvalidInputError(f"{SPEC_COPY_ENV}={spec!r} is not an entry count; expected 0 (off) or one of "
                                f"{', '.join(map(str, SPEC_ENTRIES))}")
    if spec != "0" and split_tail == "1":
        raise InvalidInputError(f"{SPEC_COPY_ENV}={spec!r} does not combine with {SPLIT_TAIL_ENV}='1' (the copy follows "
                                f"the split resolver's own kernel); expected {SPEC_COPY_ENV}=0 or {SPLIT_TAIL_ENV}=0")
    if keep == "1" and split_tail == "1":
        raise InvalidInputError(f"{SPLIT_KEEP_ENV}={keep!r} does not combine with {SPLIT_TAIL_ENV}='1' (the hot-row "
                                f"kernels read the list scratch); expected {SPLIT_KEEP_ENV}=0 or {SPLIT_TAIL_ENV}=0")
    chain = env.get(PDL_CHAIN_ENV) or "0"
    if chain not in ("0", "1"):
        raise InvalidInputError(f"{PDL_CHAIN_ENV}={chain!r} is not a switch; expected 0 or 1")
    if chain == "1" and resolver != "gather":
        raise InvalidInputError(f"{PDL_CHAIN_ENV}={chain!r} needs the gather resolver's split build; {RESOLVER_ENV} "
                                f"is {resolver!r}")
    if chain == "1" and (pdl == "0" and env.get(PDL_ENV)):
        raise InvalidInputError(f"{PDL_CHAIN_ENV}={chain!r} chains programmatic dependent launches; {PDL_ENV} is "
                                f"'0', expected {PDL_ENV}=1 (or unset) or {PDL_CHAIN_ENV}=0")
    if chain == "1" and split_tail == "1":
        raise InvalidInputError(f"{PDL_CHAIN_ENV}={chain!r} does not combine with {SPLIT_TAIL_ENV}='1' (the copy "
                                f"follows the hot-row kernels there); expected {PDL_CHAIN_ENV}=0 or {SPLIT_TAIL_ENV}=0")
    return Tuning(resolver, int(threads) if threads else None, int(per_sm), fuse == "1", lean == "1", int(entries),
                  cas == "1", scan == "1", shift == "1", row_copy == "1", pdl == "1", int(split), split_tail == "1",
                  lean_copy == "1", keep == "1", int(spec), chain == "1")


def pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True, slots=True)
class KernelSpec:
    """One kernel build: its name in `kernels.KERNELS`, the Triton signature of every runtime
    argument (`*i32`, `i32`, ...; constexprs as `constexpr`), the constexpr values and the warps."""

    kernel: str
    signature: dict[str, str]
    constexprs: dict[str, int]
    num_warps: int
    grid_note: str = field(default="")


@dataclass(frozen=True, slots=True)
class ResolverShape:
    kp: int
    gp: int
    hp: int
    tp: int  # buckets of each program's scratch table (the scratch resolver's table)
    threads: int
    variant: str = "gather"
    tg: int = 0  # the gather resolver's table: twice a group's entries
    pt: int = 0  # page-table lanes read whole (0: gathered from global memory)
    lean: bool = True  # the gather resolver's LEAN build, where its lanes fit (`constexprs`)
    cas: bool = False  # the gather resolver claims buckets by compare-and-swap (`CAS_ENV`)
    scan_row: int = 0  # lanes of one row of the two-level prefix sums (`SCAN_ENV`; 0: one scan)
    shift: bool = False  # block and offset by shift and mask (`SHIFT_ENV`, a power-of-two block size)
    split: int = 0  # programs a batch row (`SPLIT_ENV`; 0: the one-program gather resolver)
    chunk: int = 0  # candidates the split resolver's last program takes at once
    tail: bool = False  # the split resolver's hot rows spread too (`SPLIT_TAIL_ENV`)
    hot_threads: int = 0  # threads of a program of the hot-row kernels (`tail`)
    hot_chunk: int = 0  # candidates the hot-row kernel's last program takes at once
    keep: bool = False  # a one-chunk candidate list stays in registers (`SPLIT_KEEP_ENV`)

    @property
    def kernel(self) -> str:
        if self.split:
            return "resolve_split_kernel"
        return "resolve_gather_kernel" if self.variant == "gather" else "resolve_kernel"

    @property
    def constexprs(self) -> dict[str, int]:
        if self.split:
            hp_ok = self.hp <= MAX_ROW_LANES
            return dict(KP=self.kp, GP=self.gp, HP=self.hp, TP=self.tg, LOG_TP=self.tg.bit_length() - 1,
                        HG=int(hp_ok), LR=int(self.tg <= MAX_ROW_LANES), NS=self.split,
                        ES=self.gp * self.kp // self.split, CP=self.chunk, PW=self.pw,
                        SH=max(1, self.hp // self.scan_row) if self.scan_row else 1, SB=int(self.shift),
                        TAIL=int(self.tail), PDL=0, KEEP=int(self.keep))
        if self.variant == "scratch":
            return dict(KP=self.kp, GP=self.gp, HP=self.hp, TP=self.tp, LOG_TP=self.tp.bit_length() - 1)
        fits = self.hp <= MAX_ROW_LANES and self.gp * self.kp <= MAX_ROW_LANES
        return dict(KP=self.kp, GP=self.gp, HP=self.hp, TP=self.tg, LOG_TP=self.tg.bit_length() - 1, PT=self.pt,
                    HG=int(self.hp <= MAX_ROW_LANES), LR=int(self.tg <= MAX_ROW_LANES), LEAN=int(self.lean and fits),
                    CAS=int(self.cas), SH=max(1, self.hp // self.scan_row) if self.scan_row else 1,
                    SK=max(1, self.kp // self.scan_row) if self.scan_row else 1, SB=int(self.shift), PDL=0)

    @property
    def pw(self) -> int:
        """Words of one split program's counts row (`scr_part`): a group's rows, host entries and
        candidates; with `tail`, the first program's row also holds its request's candidates (-1: no
        host entry) and the probe rounds, later the victims taken."""
        return pow2(self.gp + (4 if self.tail else 2))

    @property
    def hot_programs(self) -> int:
        """Programs a batch row of the hot-row kernels (`tail`): the split's, at most one a hot row."""
        return min(self.split, self.hp)

    @property
    def hot_constexprs(self) -> dict[str, int]:
        """`kernels.resolve_split_hot_kernel`'s constexprs (without MASK)."""
        nh = self.hot_programs
        hs = self.hp // nh
        return dict(KP=self.kp, GP=self.gp, HP=self.hp, TP=self.tg, LOG_TP=self.tg.bit_length() - 1, NS=self.split,
                    CP=self.hot_chunk, PW=self.pw, NH=nh, HS=hs, SH=self._hot_scan_rows(hs), SB=int(self.shift))

    @property
    def lru_constexprs(self) -> dict[str, int]:
        """`kernels.resolve_split_lru_kernel`'s constexprs."""
        nh = self.hot_programs
        hs = self.hp // nh
        return dict(GP=self.gp, HP=self.hp, NS=self.split, PW=self.pw, NH=nh, HS=hs, SH=self._hot_scan_rows(hs), PDL=0)

    def _hot_scan_rows(self, hs: int) -> int:
        return max(1, hs // self.scan_row) if self.scan_row else 1

    def fuse_constexprs(self, config: RuntimeConfig, *, fused: bool, interpreted: bool) -> dict[str, int]:
        """The gather resolver's copy constexprs: FUSE, row words (padded), entries per iteration."""
        if self.variant != "gather" or self.split:
            return {}
        if not fused:
            return dict(FUSE=0, WP=1, EB=1)
        _, words = row_words(config.row_format.row_bytes)
        eb = min(INTERPRETED_COPY_ENTRIES, pow2(config.top_k)) if interpreted else FUSED_COPY_ENTRIES
        return dict(FUSE=1, WP=pow2(words), EB=eb)

    def num_warps(self, warp_size: int) -> int:
        return max(1, self.threads // warp_size)

    def hot_warps(self, warp_size: int) -> int:
        return max(1, self.hot_threads // warp_size)


def resolver_variant(name: str | None) -> str:
    """The resolver `name` picks (None or empty: the default); one clear error for any other name."""
    if not name:
        return RESOLVERS[0]
    if name not in RESOLVERS:
        raise InvalidInputError(f"{RESOLVER_ENV}={name!r} is not a triton resolver; expected one of {', '.join(RESOLVERS)}")
    return name


def resolver_shape(config: RuntimeConfig, *, compiled: bool = True, variant: str = "gather",
                   threads: int | None = None, lean: bool = True, cas: bool = False,
                   scan: bool = False, shift: bool = False, warp_size: int = 1, split: int = 0,
                   split_tail: bool = False, split_keep: bool = False) -> ResolverShape:
    """Padded lanes of one group, its hash table (at least twice the rows it can hold), threads
    (`threads`, or about four lanes a thread); `split` programs a batch row (at most one a group's
    entry), each taking an equal share of the group's padded entries; `split_tail`: the hot-row
    kernels' programs as many (at most one a hot row), a slice of the hot rows each, one lane a
    thread (at least 128 threads, at most the resolver's); `split_keep`: the split resolver keeps a
    one-chunk candidate list in registers (without the tail)."""
    k, h, g = config.top_k, config.hot_rows, config.rows_per_request
    floor = MIN_LANES if compiled else dict.fromkeys(MIN_LANES, 1)
    kp, gp, hp = max(pow2(k), floor["KP"]), pow2(g), max(pow2(h), floor["HP"])
    if gp * kp > MAX_LANES or hp > MAX_LANES:
        raise InvalidInputError(
            f"RuntimeConfig(top_k={k}, rows_per_request={g}, hot_rows={h}) is too large for the triton resolver: a "
            f"group's entries ({gp * kp} padded) and the hot rows ({hp} padded) must each be at most {MAX_LANES}")
    tp = max(pow2(2 * (g * k + h)), floor["TP"])
    # About four lanes of the widest vector a thread (CUDA's resolver: one entry, two LRU positions).
    threads = threads or min(MAX_THREADS, max(128, pow2(max(gp * kp, hp)) // 4))
    tg = max(pow2(2 * g * k), floor["TP"])  # only the candidates (a group's entries at most) are hashed
    pages = pow2(config.max_pages)
    pt = max(pages, floor["PT"]) if pages <= MAX_TABLE_LANES else 0
    variant = resolver_variant(variant)
    scan_row = (max(warp_size if compiled else INTERPRETED_SCAN_ROW, hp // MAX_SCAN_ROWS)
                if scan and variant == "gather" else 0)
    bs = config.block_size
    ns = min(split, gp * kp) if variant == "gather" else 0
    interpreted_chunk = max(INTERPRETED_SPLIT_CHUNK, gp * kp // INTERPRETED_SPLIT_CHUNKS)
    chunk = min(threads if compiled else interpreted_chunk, gp * kp) if ns else 0
    tail = bool(ns and split_tail)
    hot_threads = min(threads, max(128, hp // min(ns, hp))) if tail else 0
    hot_chunk = min(hot_threads if compiled else interpreted_chunk, gp * kp) if tail else 0
    return ResolverShape(kp, gp, hp, tp, threads, variant, min(tg, tp), pt, lean, cas and variant == "gather",
                         scan_row, shift and variant == "gather" and bs & (bs - 1) == 0, ns, chunk, tail,
                         hot_threads, hot_chunk, bool(ns and split_keep and not tail))


def hint_dtype_name(config: RuntimeConfig) -> str:
    """The slot hints are int16 where every slot fits (hot_rows <= 32767), else int32."""
    return "i16" if config.hot_rows <= 32767 else "i32"


def row_words(row_bytes: int) -> tuple[str, int]:
    """Rows move as int32 words where the row size allows, else bytes: (signature type, words)."""
    return ("i32", row_bytes // 4) if row_bytes % 4 == 0 else ("u8", row_bytes)


def kernel_specs(config: RuntimeConfig, warp_size: int, *, lru_dtype: str = "i32",
                 variants: tuple[str, ...] = RESOLVERS, cuda: bool = False,
                 tunings: tuple[Tuning, ...] = ()) -> list[KernelSpec]:
    """Every kernel the runtime launches for `config`, as compiled for a GPU of `warp_size` lanes
    (one resolver build per variant of `variants`). `lru_dtype` is `i16` for vLLM's op set, whose
    LRU is int16 (and which writes the miss mask). `tunings` (the auto choice's profiles,
    `auto.choose`): their resolvers and plan copies too, and a split tuning's speculative copy with the
    resolver build that writes its miss mask (`SPEC_COPY_ENV`) (a split tuning's split resolver only: its
    one-program resolver serves batches past a wave of split programs, which the auto choice gives
    the other profile); ValueError for a
    tuning with a knob the auto choice never picks and these builds leave out (the split tail, the
    fused copy, the row-assigned copy)."""
    resolvers = [resolver_shape(config, variant=v) for v in variants]
    if "gather" in variants:  # the CAS and SCAN variants' builds (unfused), so their targets are known to compile
        resolvers.append(resolver_shape(config, variant="gather", cas=True))
        resolvers.append(resolver_shape(config, variant="gather", scan=True, shift=True, warp_size=warp_size))
        resolvers.append(resolver_shape(config, variant="gather", scan=True, shift=True, warp_size=warp_size,
                                        split=SPLIT_BUILD))
        resolvers.append(resolver_shape(config, variant="gather", scan=True, shift=True, warp_size=warp_size,
                                        split=SPLIT_BUILD, split_tail=True))
        resolvers.append(resolver_shape(config, variant="gather", scan=True, shift=True, warp_size=warp_size,
                                        split=SPLIT_BUILD, split_keep=True))
    word, words = row_words(config.row_format.row_bytes)
    i32p = "*i32"
    resolve_sig = dict.fromkeys(("topk", "row_state", "seq_lens", "source_table", "resident_table", "hot_table", "hot_map"), i32p)
    resolve_sig |= {"lru": f"*{lru_dtype}", "stats": "*i64"}
    resolve_sig |= dict.fromkeys(("out_rows", "out_counts", "plan_host", "plan_device", "plan_counts"), i32p)
    resolve_sig |= {"pos_slot": f"*{hint_dtype_name(config)}", "miss_mask": i32p}
    resolve_sig |= dict.fromkeys(("tbl_key", "tbl_first", "tbl_slot", "scr_victim", "scr_mark"), i32p)
    resolve_sig |= dict.fromkeys(("B", "P", "HB", "R", "K", "G_MAX", "BS", "H", "host_limit"), "i32")
    mask = dict(MASK=int(lru_dtype == "i16"))
    copy_warps = max(1, COPY_THREADS // warp_size)
    plan = plan_copy_meta(config, interpreted=False)
    plan_sig = {"plan_host": i32p, "plan_device": i32p, "plan_counts": i32p, "src": f"*{word}", "dst": f"*{word}",
                "dst_block_stride": "i32", "stats": "*i64"}
    plan_sig |= dict.fromkeys(("B", "K", "row_bytes", "host_rows", "dev_rows", "W", "BS", "NP", "LBS"), "i32")
    plan_sig |= dict.fromkeys(plan, "constexpr")
    # `LEAN_COPY_ENV`: 4 words an access where rows allow; block and offset by shift (production blocks of 64 rows)
    lean = plan | dict(VEC=COPY_VEC if word == "i32" and words % COPY_VEC == 0 else 1,
                       SB=int(config.block_size & (config.block_size - 1) == 0))
    rows_plan = row_copy_meta(config, plan)
    rows_plan_sig = {k: v for k, v in plan_sig.items() if k not in ("VEC", "SB", "LBS")} | dict.fromkeys(rows_plan, "constexpr")
    rows_sig = {"pairs": i32p, "n": "i32", "src": f"*{word}", "src_block_stride": "i32", "dst": f"*{word}",
                "dst_block_stride": "i32", "W": "i32", "BS": "i32", "WP": "constexpr", "EB": "constexpr"}
    inval_sig = {"state_rows": i32p, "host_rows": i32p, "hot_map": i32p, "R": "i32", "H": "i32", "HP": "constexpr"}
    vcopy_sig = {"src_rows": "*i64", "pick": "*i64", "dst_rows": "*i64", "any_take": i32p, "host": f"*{word}",
                 "hot": f"*{word}", "n": "i32", "host_rows": "i32", "W": "i32", "BS": "i32", "block_stride": "i32",
                 "WP": "constexpr", "EB": "constexpr"}
    vinval_sig = {"dgi": i32p, "state_of_req": i32p, "req_ids": i32p, "written": "*i64", "S": "i32", "NR": "i32",
                  "H": "i32", "HP": "constexpr"}
    inval_warps = max(1, min(MAX_THREADS, pow2(config.hot_rows) // 4) // warp_size)
    gather_sig = {"src": f"*{word}", "dst": f"*{word}"} | dict.fromkeys(
        ("dst_block_stride", "W", "row_bytes", "dev_rows", "LBS"), "i32")
    scalars = ("B", "P", "HB", "R", "K", "G_MAX", "BS", "H", "host_limit")
    split_sig = {k: v for k, v in resolve_sig.items() if k not in scalars}  # the split resolver's, in its order
    split_sig |= dict.fromkeys(("scr_part", "scr_ticket", "scr_crow", "scr_cee", "scr_cpos", "scr_cbkt", "scr_cat"), i32p)
    split_sig |= dict.fromkeys((*scalars, "LBS"), "i32")
    hot_sig = dict.fromkeys(("row_state", "hot_table", "hot_map"), i32p) | {"lru": f"*{lru_dtype}", "stats": "*i64"}
    hot_sig |= dict.fromkeys(("out_rows", "plan_host", "plan_device", "plan_counts"), i32p)
    hot_sig |= {"pos_slot": f"*{hint_dtype_name(config)}", "miss_mask": i32p}
    hot_sig |= dict.fromkeys(("tbl_key", "tbl_first", "tbl_slot", "scr_victim", "scr_mark", "scr_part", "scr_ticket",
                              "scr_crow", "scr_cee", "scr_cpos", "scr_cbkt", "scr_cat", "scr_hcnt", "scr_ord", "scr_hit"),
                             i32p)
    hot_sig |= dict.fromkeys(("B", "HB", "R", "K", "G_MAX", "BS", "H", "P", "LBS"), "i32")
    lru_sig = {"row_state": i32p, "lru": f"*{lru_dtype}"} | dict.fromkeys(
        ("scr_mark", "scr_part", "scr_hcnt", "scr_ord", "scr_hit"), i32p) | dict.fromkeys(("B", "R", "H"), "i32")
    spec_sig = dict.fromkeys(("topk", "row_state", "seq_lens", "source_table", "resident_table", "hot_map"), i32p)
    spec_sig |= {"pos_slot": f"*{hint_dtype_name(config)}"} | dict.fromkeys(("miss_mask", "out_rows", "plan_counts"), i32p)
    spec_sig |= {"src": f"*{word}", "dst": f"*{word}", "dst_block_stride": "i32", "stats": "*i64"}
    spec_sig |= dict.fromkeys(("B", "K", "P", "R", "H", "BS", "LBS", "host_limit", "row_bytes", "host_rows", "dev_rows",
                               "W", "NC"), "i32")
    resolver_specs = []
    pdl_specs = []
    if cuda and "gather" in variants:  # the PDL builds (`PDL_ENV`): NVIDIA targets only
        pdl_specs = [KernelSpec("copy_plan_kernel", plan_sig, plan | dict(PDL=1), copy_warps),
                     KernelSpec("copy_plan_rows_kernel", rows_plan_sig, rows_plan | dict(PDL=1), copy_warps)]
        r = resolver_shape(config, variant="gather", scan=True, shift=True, warp_size=warp_size)
        consts = r.constexprs | mask | r.fuse_constexprs(config, fused=False, interpreted=False) | dict(PDL=1)
        pdl_specs.append(KernelSpec(r.kernel, resolve_sig | gather_sig | dict.fromkeys(consts, "constexpr"), consts,
                                    r.num_warps(warp_size)))
        # The split resolver's (without TAIL) and the LRU kernel's (with it): the kernels the copy follows.
        sr = resolver_shape(config, variant="gather", scan=True, shift=True, warp_size=warp_size, split=SPLIT_BUILD)
        consts = sr.constexprs | mask | dict(PDL=1)
        pdl_specs.append(KernelSpec(sr.kernel, split_sig | dict.fromkeys(consts, "constexpr"), consts,
                                    sr.num_warps(warp_size)))
        sr = resolver_shape(config, variant="gather", scan=True, shift=True, warp_size=warp_size, split=SPLIT_BUILD,
                            split_tail=True)
        lru = sr.lru_constexprs | dict(PDL=1)
        pdl_specs.append(KernelSpec("resolve_split_lru_kernel", lru_sig | dict.fromkeys(lru, "constexpr"), lru,
                                    sr.hot_warps(warp_size)))
        pdl_specs.append(KernelSpec("copy_plan_kernel", plan_sig, lean | dict(PDL=1), copy_warps))
        # `PDL_CHAIN_ENV` (PDL = 2): the split resolver (the auto choice's small-batch build, with the miss mask
        # of the speculative copy) waits for the kernel before it, and the copies behind it let the next one launch.
        sr = resolver_shape(config, variant="gather", threads=512, scan=True, shift=True, warp_size=warp_size,
                            split=SPLIT_BUILD)
        consts = sr.constexprs | dict(MASK=1, PDL=2)
        pdl_specs.append(KernelSpec(sr.kernel, split_sig | dict.fromkeys(consts, "constexpr"), consts,
                                    sr.num_warps(warp_size)))
        chained = plan_copy_meta(config, interpreted=False, entries=4) | {k: lean[k] for k in ("VEC", "SB")} | dict(PDL=2)
        pdl_specs.append(KernelSpec("copy_plan_kernel", plan_sig, chained, copy_warps))
        smeta = spec_copy_meta(config, interpreted=False, entries=SPEC_ENTRIES[-1]) | dict(PDL=2, VEC=lean["VEC"])
        pdl_specs.append(KernelSpec("copy_spec_kernel", spec_sig | dict.fromkeys(smeta, "constexpr"), smeta, copy_warps))
    for r in resolvers:
        fusable = r.variant == "gather" and lru_dtype == "i32" and not r.cas and not r.split
        for fused in ((False, True) if fusable else (False,)):
            consts = r.constexprs | mask | r.fuse_constexprs(config, fused=fused, interpreted=False)
            sig = split_sig if r.split else resolve_sig | (gather_sig if r.variant == "gather" else {})
            resolver_specs.append(KernelSpec(r.kernel, sig | dict.fromkeys(consts, "constexpr"), consts,
                                             r.num_warps(warp_size)))
        if r.tail:
            hot = r.hot_constexprs | mask
            resolver_specs.append(KernelSpec("resolve_split_hot_kernel", hot_sig | dict.fromkeys(hot, "constexpr"), hot,
                                             r.hot_warps(warp_size)))
            lru = r.lru_constexprs
            resolver_specs.append(KernelSpec("resolve_split_lru_kernel", lru_sig | dict.fromkeys(lru, "constexpr"), lru,
                                             r.hot_warps(warp_size)))
    for t in tunings:
        if t.split_tail or t.fuse or t.row_copy:
            raise ValueError(f"kernel_specs builds no split tail, fused or row-assigned copy for a tuning; got {t}")
        r = resolver_shape(config, variant=t.resolver, threads=t.threads, lean=t.lean, cas=t.cas, scan=t.scan,
                           shift=t.shift, warp_size=warp_size, split=t.split, split_keep=t.split_keep)
        pdl = dict(PDL=int(t.pdl)) if r.variant == "gather" else {}
        # The speculative copy (`SPEC_COPY_ENV`) reads the split resolver's miss mask: that build writes it.
        spec = bool(t.spec_copy and r.split)
        consts = r.constexprs | (dict(MASK=1) if spec else mask) | r.fuse_constexprs(config, fused=False,
                                                                                  interpreted=False) | pdl
        sig = split_sig if r.split else resolve_sig | (gather_sig if r.variant == "gather" else {})
        resolver_specs.append(KernelSpec(r.kernel, sig | dict.fromkeys(consts, "constexpr"), consts,
                                         r.num_warps(warp_size)))
        tuned_plan = plan_copy_meta(config, interpreted=False, entries=t.plan_entries) | dict(PDL=int(t.pdl))
        resolver_specs.append(KernelSpec("copy_plan_kernel", plan_sig, tuned_plan | (
            {k: lean[k] for k in ("VEC", "SB")} if t.lean_copy else {}), copy_warps))
        if spec:
            smeta = spec_copy_meta(config, interpreted=False, entries=t.spec_copy) | dict(
                PDL=int(t.pdl), VEC=lean["VEC"])
            resolver_specs.append(KernelSpec("copy_spec_kernel", spec_sig | dict.fromkeys(smeta, "constexpr"), smeta,
                                             copy_warps))
    return [
        *resolver_specs,
        KernelSpec("copy_plan_kernel", plan_sig, plan, copy_warps),
        KernelSpec("copy_plan_kernel", plan_sig, lean, copy_warps),
        KernelSpec("copy_plan_rows_kernel", rows_plan_sig, rows_plan, copy_warps),
        *pdl_specs,
        KernelSpec("copy_rows_kernel", rows_sig, dict(WP=pow2(words), EB=COPY_ENTRIES), copy_warps),
        KernelSpec("invalidate_written_kernel", inval_sig, dict(HP=pow2(config.hot_rows)), inval_warps),
        KernelSpec("vllm_copy_kernel", vcopy_sig, dict(WP=pow2(words), EB=COPY_ENTRIES), copy_warps),
        KernelSpec("vllm_invalidate_kernel", vinval_sig, dict(HP=pow2(config.hot_rows)), inval_warps),
    ]


def row_copy_meta(config: RuntimeConfig, plan: dict[str, int]) -> dict[str, int]:
    """`copy_plan_rows_kernel`'s constexprs: the plan copy's `plan` with the words of a 128-byte host
    line (`LW`) and lanes for a row read from the start of its first line (`WP`)."""
    word, words = row_words(config.row_format.row_bytes)
    lw = 128 // (4 if word == "i32" else 1)
    return {k: v for k, v in plan.items() if k not in ("VEC", "SB")} | dict(WP=pow2(words + lw - 1), LW=lw)


def spec_copy_meta(config: RuntimeConfig, *, interpreted: bool, entries: int) -> dict[str, int]:
    """Constexprs of the speculative copy (`SPEC_COPY_ENV`): row words (padded), entries a program
    (`entries` on a GPU), rows it holds at once, batch rows (padded); VEC and SB as the lean plan copy's
    (the runtime sets VEC from the bound caches)."""
    _, words = row_words(config.row_format.row_bytes)
    se = min(INTERPRETED_SPEC_ENTRIES, pow2(config.top_k)) if interpreted else entries
    sc = min(INTERPRETED_SPEC_SLOTS, se) if interpreted else se // SPEC_SLOT_SHARE
    bs = config.block_size
    return dict(WP=pow2(words), SE=se, SC=sc, BP=plan_copy_meta(config, interpreted=interpreted)["BP"], PDL=0,
                VEC=0, SB=int(bs & (bs - 1) == 0))


def plan_copy_meta(config: RuntimeConfig, *, interpreted: bool, entries: int = COPY_ENTRIES) -> dict[str, int]:
    """Constexprs of the plan copy: row words (padded), entries per iteration (`entries` on a GPU),
    batch rows (padded)."""
    _, words = row_words(config.row_format.row_bytes)
    eb = min(INTERPRETED_COPY_ENTRIES, pow2(config.top_k)) if interpreted else entries
    bp = pow2(config.max_batch_rows) if interpreted else max(pow2(config.max_batch_rows), MIN_LANES["BP"])
    return dict(WP=pow2(words), EB=eb, BP=bp, PDL=0, VEC=0, SB=0)
