// vLLM's four HiSparse ops (`torch.ops._C_cache_ops.hisparse_*`) as the nvidia backend's own
// kernels. Semantics: hisparse_core/vllm_ops.py (every output byte-identical to reference_cpu);
// host side: hisparse_nvidia/vllm_ops.py. Every size is a run-time argument (vLLM passes any
// top-k, hot size and block size), except the row width of the copies (HS_VEC 16-byte vectors).
//
// hisparse_vllm_resolve: one block per batch row; the block of a group's first row (a group is a
//   maximal run of consecutive non-padding rows with one state row) resolves the whole group.
//   1. Classify every entry (resident row / invalid / host row g); outputs of the first two are
//      final. A host entry's g is parked in hot_out as -(g + 2).
//   2. Insert the host rows into an open-addressed hash of 64-bit buckets {g, first entry}
//      (atomicMin keeps the first reference); the hash lives in shared memory when the group's
//      host entries fit, else in the group's rows of a global scratch (never a wrong answer, only
//      a slower one). A host entry's parked value becomes -(bucket + 2).
//   3. Walk the LRU (each thread a contiguous run of positions): a slot whose hot-map row is in
//      the hash is a hit, marked in its bucket as HELD | position (atomicMax: the last hit
//      position in LRU order wins, as in the reference; the marker is HELD | position << 15 | slot);
//      the rest are evictable. A block scan
//      packs evictable slots forward and hit slots backward into `ord`.
//   4. Misses (buckets still holding their first entry) in first-reference order, row by row
//      (a block scan of each row's first references): miss m takes evictable E[m]; the plan entry
//      goes to the row that first referenced it.
//   5. Outputs of host entries, then the new LRU order E[used:] + E[:used] + hits.
//
// hisparse_vllm_mark + hisparse_vllm_copy (gather_compact, gather_plan): the mark kernel picks the
//   taken entries, appends them to a list (warp-aggregated) and marks each destination row with
//   the largest {epoch, entry} (atomicMax); the copy kernel moves each listed entry whose mark is
//   its own (so of entries naming one destination the last wins, as in the reference), 16-byte
//   slots aligned on the host side's 128-byte lines, a grid-stride loop over the list. Its last
//   block resets the list and advances the epoch, so marks of an earlier call never match.
//
// hisparse_vllm_gather (the default for both gathers): the mark and the copy in one launch around
//   one grid barrier; see there. hisparse_vllm_gather_local (HISPARSE_VLLM_GATHER_LOCAL): the same launch,
//   serving calls of at most VG_LOCAL entries without marks or barrier (each block dedups on its own).
//
// hisparse_vllm_invalidate: one block per written token clears every slot of its state row that
//   holds the written row.
#include "common.cuh"
#include "row_copy.cuh"

#define VR_EMPTY 0xffffffffffffffffull
#define VR_HELD 0x80000000u
#define VR_B 2  // entries of a row a thread classifies in one round of loads
#define VR_W 4  // LRU positions a thread reads in one round of loads
// HS_VR_FAST (HISPARSE_VLLM_RESOLVE=1): power-of-two hash tables indexed by mask, and a thread's LRU
// slots and parked entries kept in registers between the walk and the LRU order, and between the
// classification and the outputs, where one round of loads covers them (no second global read).
#ifndef HS_VR_FAST
#define HS_VR_FAST 1
#endif
// HS_VR_FAST 2 (HISPARSE_VLLM_RESOLVE=2) adds a lean start: the first round of the block's row (its
// top-k entries, then their page-table entries) is loaded before the group is known, the shared
// hash is cleared under the group barrier rather than behind one of its own, and a one-row group
// counts its valid and host entries in one block reduction (one barrier, not six). A resident step
// then costs some three dependent loads and two barriers before its stores. A row that continues
// its group learns so (rows r - 1 and r read together) before any load but its top-k row.
#define VR_LEAN (HS_VR_FAST >= 2)
// HS_VR_FAST 3 (HISPARSE_VLLM_RESOLVE=3) is 2 with shorter chains on steps with host entries:
// - the request ids and state rows of rows r - 1, r and warp 0's rows come in two rounds, and every
//   load whose address the state row gives (page-table entries, the LRU positions in one 8-byte load
//   a thread, the hot-block row, the state row's whole hot-map row in 16-byte vectors) is issued in
//   the third, before the group barrier (the classification after it waits on that round anyway):
//   three dependent rounds before the first store, not five;
// - the LRU walk looks the hot-map rows up in that shared copy (one coalesced round trip in all, not
//   a scattered one after the LRU loads);
// - a bucket's low word is marked held and its first reference kept with 32-bit atomics (native
//   max / min; the 64-bit ones are compare-and-swap loops); its high word (the host row) never
//   changes once claimed, so the word alone orders them as the 64-bit compare did;
// - each thread writes its LRU positions' new places from registers straight after the scan (a
//   slot's place follows from its rank among the hits or the evictables), skipping slots that stay
//   where they are; the packed order goes through shared memory only on steps with misses, so a
//   step without misses crosses four barriers after the group barrier, none after the scan.
#define VR_DIRECT (HS_VR_FAST >= 3)
// HS_VR_FAST 4 (HISPARSE_VLLM_RESOLVE=4) is 3 with a lean path for a one-row group (every row of vLLM's
// decode without speculative rows) whose shape fits one round of loads a thread: every thread reads row
// r + 1's state row with rows r - 1 and r, so such a block knows its group alone: no group barrier, no
// warp 0 scan of 32 rows; and every state row is loaded in one round, speculatively with the request
// ids (see there). One barrier while the page-table, LRU and hot-map loads are in flight (the cleared
// table), then:
// - resident step: classify, one barrier that sums the counts, done;
// - step with host entries: the inserts straight after the classification (a thread's first probes
//   issued together, a compare-and-swap with no load before it), the summing barrier (which orders
//   them before the walk), the walk (a thread's four first probes issued together), one barrier whose
//   ballot/popc counts rank the hits: two barriers after the loads where build 3 crosses four (plus
//   its group barrier); 32-bit indices;
// - misses: ranked in entry order by ballot/popc counts (two barriers, build 3 four);
// - host entries' parked values stay in registers (no parked store to hot_out);
// - a hash of four buckets a union row where shared memory allows (load 1/4: shorter probe runs),
//   cleared with 16-byte stores.
// Other groups (several rows, larger shapes, unaligned rows) take build 3's path in the same kernel.
#define VR_FAST4 (HS_VR_FAST >= 4)
// HS_VR_FAST 5 (four entries and eight LRU positions a thread, half the threads) was slower than 4 on
// every hit and miss cell on the H200 (sixteenth session, call C1) and was removed.
// HS_VR_FAST 6 (HISPARSE_VLLM_RESOLVE=6) is 4 with a shorter instruction stream on the lean path, whose
// hit step issues over twice the native resolver's instructions a warp (sm_90 SASS: the hash's inserts and
// walk, which native's position hints skip, four outputs an entry, a four-row prologue, bounds the
// compiler could not fold):
// - the rows r - 1 .. r + 30 are read one a lane in every warp (a request id and a speculative state
//   row each, as build 4's four rows a thread) and rows r - 1, r and r + 1 shuffled from lanes 0-2, so
//   a thread issues two loads and three shuffles where build 4 issued eight loads and their checks;
// - the thread index is bounded by the block size for the compiler, so the bounds that shape builds
//   make constant (entries and LRU positions a thread, hot blocks, hot-map vectors) fold;
// - the page-table rows' addresses are computed once (64-bit), their columns in 32 bits, and a shape
//   build clears the shared hash in whole unrolled rounds;
// - a step with misses crosses one barrier after the walk's where build 4 crosses two: each miss's entry
//   outputs the hot row it computed, and the barrier that publishes them (s_val) is crossed only where an
//   entry repeats a miss another entry records.
// Outputs, LRU order, hot map and plan are build 4's, byte for byte; other groups take build 3's path.
#define VR_FAST6 (HS_VR_FAST >= 6)
#if HS_VR_FAST == 5 || HS_VR_FAST > 6
#error "HS_VR_FAST (HISPARSE_VLLM_RESOLVE) is 0 to 4 or 6"
#endif
// VR_PDL (HISPARSE_VLLM_RESOLVE_PDL=1, the default; kernels.py defines it): the resolver waits for the
// previous grid (griddepcontrol.wait) before its first global access, for a launch with programmatic
// stream serialization.
#ifndef VR_PDL
#define VR_PDL 0
#endif
#define VR_HBT 512  // hot blocks of a request the lean build keeps in shared memory (at most)
// Shape builds (HISPARSE_VLLM_RESOLVE_SHAPE=1): VR_K, VR_H, VR_BS, VR_SBS, VR_RBS, VR_SB and VR_NT
// are the call's top-k, hot rows, hot block size, source and resident block sizes, shared buckets
// and threads, so divisions, power-of-two tests, bounds and loop trips fold at compile time. The
// host builds one module per shape (the resolver only) and launches it only with those values.
#if defined(VR_K) && !(defined(VR_H) && defined(VR_BS) && defined(VR_SBS) && defined(VR_RBS) && defined(VR_SB) && \
                       defined(VR_NT))
#error "a shape build defines VR_K, VR_H, VR_BS, VR_SBS, VR_RBS, VR_SB and VR_NT"
#endif

// The state row of request req; -1 for a padding row.
__device__ __forceinline__ i32 vr_state(i32 req, const i32* rsi, i32 nr, i32 S) {
    i32 q = req;
    if (rsi != nullptr) q = (req >= 0 && req < nr) ? rsi[req] : -1;
    return (q < 0 || q >= S) ? -1 : q;
}

// (request, state row) of batch row r; q = -1 for a padding row.
__device__ __forceinline__ void vr_row(i32 r, const i32* request_ids, const i32* rsi, i32 nr, i32 S, i32& req,
                                       i32& q) {
    req = request_ids != nullptr ? request_ids[r] : r;
    if (rsi != nullptr) {
        q = (req >= 0 && req < nr) ? rsi[req] : -1;
    } else {
        q = req;
    }
    if (q < 0 || q >= S) q = -1;
}

// Block-wide exclusive prefix sum of v (every thread calls it); `total` is the sum over the block.
// kOnce: the only call of its type in the launch (its shared words are not reused: no last barrier).
template <typename T, bool kOnce = false>
__device__ __forceinline__ T vr_scan(T v, T& total) {
    __shared__ T s_w[32];
    const i32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    T x = v;
#pragma unroll
    for (i32 o = 1; o < 32; o <<= 1) {
        const T y = __shfl_up_sync(HS_FULL_MASK, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) s_w[warp] = x;
    __syncthreads();
    if (warp == 0) {
        T y = lane < nw ? s_w[lane] : 0;
#pragma unroll
        for (i32 o = 1; o < 32; o <<= 1) {
            const T z = __shfl_up_sync(HS_FULL_MASK, y, o);
            if (lane >= o) y += z;
        }
        s_w[lane] = y;
    }
    __syncthreads();
    const T before = (warp > 0 ? s_w[warp - 1] : 0) + x - v;
    total = s_w[nw - 1];
    if (!kOnce) __syncthreads();  // s_w may be reused at once
    return before;
}

// Block-wide sums of a and b (every thread calls it; once a launch: its shared words are not reused).
__device__ __forceinline__ void vr_sum2(i32 a, i32 b, i32& ta, i32& tb) {
    __shared__ i32 s_two[2][32];
    const i32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    a = __reduce_add_sync(HS_FULL_MASK, a);
    b = __reduce_add_sync(HS_FULL_MASK, b);
    if (lane == 0) {
        s_two[0][warp] = a;
        s_two[1][warp] = b;
    }
    __syncthreads();
    ta = __reduce_add_sync(HS_FULL_MASK, lane < nw ? s_two[0][lane] : 0);
    tb = __reduce_add_sync(HS_FULL_MASK, lane < nw ? s_two[1][lane] : 0);
}

__device__ __forceinline__ u32 vr_hash(i32 key, u32 size) {
    const u32 h = static_cast<u32>(key) * 2654435761u;
#if HS_VR_FAST
    // Fibonacci hashing: the top bits (the low bits of g * odd follow g's low bits only)
    if ((size & (size - 1)) == 0) return size == 1 ? 0u : h >> __clz(size - 1);
#endif
    return h % size;
}

constexpr u32 vr_pow2ceil(u32 x) {
    u32 t = 1;
    while (t < x) t <<= 1;
    return t;
}

// Buckets of a table for `need` of them: the next power of two where `room` allows (mask indexing).
__device__ __forceinline__ u32 vr_buckets(i64 need, i64 room) {
#if HS_VR_FAST
    u32 t = 1;
    while (t < need) t <<= 1;
    if (t <= room) return t;
#endif
    return static_cast<u32>(need);
}

// A bucket {host row g in the high word, first referencing entry x in the low word}.
__device__ __forceinline__ u64 vr_key(i32 g, i32 x) {
    return (static_cast<u64>(static_cast<u32>(g)) << 32) | static_cast<u32>(x);
}

// Inserts host row g first referenced by group entry x (the smallest x wins), probing from bucket b on;
// returns its bucket. `fresh` counts the rows this thread inserted first.
// Build 3 on keeps the first reference and marks a bucket held with 32-bit atomics on its low word, while
// buckets are claimed with a 64-bit compare-and-swap. PTX promises no ordering between atomics of
// different sizes on overlapping bytes, and none is needed: a 32-bit atomic only ever acts on a bucket
// already claimed, whose high word (the host row) never changes again, so a racing 64-bit CAS fails on
// that word whatever low word it reads, and every probe compares the high word alone.
__device__ __forceinline__ u32 vr_insert_at(u64* tab, u32 T, i32 g, i32 x, i32& fresh, u32 b) {
    const u64 key = vr_key(g, x);
    while (true) {
        u64 cur = tab[b];
        if (cur == VR_EMPTY) {
            cur = atomicCAS(reinterpret_cast<unsigned long long*>(tab + b), VR_EMPTY, key);
            if (cur == VR_EMPTY) {
                ++fresh;
                return b;
            }
        }
        if (static_cast<i32>(cur >> 32) == g) {
#if VR_DIRECT
            atomicMin(reinterpret_cast<u32*>(tab + b), static_cast<u32>(x));  // the low word (little-endian)
#else
            atomicMin(reinterpret_cast<unsigned long long*>(tab + b), key);
#endif
            return b;
        }
        b = b + 1 == T ? 0 : b + 1;
    }
}

__device__ __forceinline__ u32 vr_insert(u64* tab, u32 T, i32 g, i32 x, i32& fresh) {
    return vr_insert_at(tab, T, g, x, fresh, vr_hash(g, T));
}

#if HS_VR_FAST >= 4
// The lean path's shared-memory accesses through 32-bit shared-window addresses kept in registers: under
// the resolver's register pressure the compiler otherwise rebuilds the window address (an S2R and three
// more instructions) at nearly every access. vr_sa's result is opaque, so it is computed once.
__device__ __forceinline__ u32 vr_sa(const void* p) {
    u32 a = static_cast<u32>(__cvta_generic_to_shared(p));
    asm volatile("" : "+r"(a));
    return a;
}
__device__ __forceinline__ u32 vr_lds(u32 a) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a) : "memory");
    return v;
}
__device__ __forceinline__ u64 vr_cas(u32 a, u64 cmp, u64 v) {
    u64 old;
    asm volatile("atom.shared.cas.b64 %0, [%1], %2, %3;" : "=l"(old) : "r"(a), "l"(cmp), "l"(v) : "memory");
    return old;
}
__device__ __forceinline__ u32 vr_amax(u32 a, u32 v) {
    u32 old;
    asm volatile("atom.shared.max.u32 %0, [%1], %2;" : "=r"(old) : "r"(a), "r"(v) : "memory");
    return old;
}
__device__ __forceinline__ void vr_amin(u32 a, u32 v) {
    asm volatile("red.shared.min.u32 [%0], %1;" ::"r"(a), "r"(v) : "memory");
}
#endif

// x / d and x % d of x >= 0, d >= 1: a shift and a mask where d is a power of two (block sizes are,
// in every deployment seen) instead of a division of some twenty instructions.
__device__ __forceinline__ i32 vr_div(i32 x, i32 d) {
#if HS_VR_FAST
    if ((d & (d - 1)) == 0) return x >> (__ffs(d) - 1);
#endif
    return x / d;
}

__device__ __forceinline__ i32 vr_mod(i32 x, i32 d) {
#if HS_VR_FAST
    if ((d & (d - 1)) == 0) return x & (d - 1);
#endif
    return x % d;
}

__device__ __forceinline__ i32 vr_hot_row(const i32* hbt, i64 hbt_stride, i32 req, i32 slot, i32 bs) {
    return static_cast<i32>(static_cast<i64>(hbt[static_cast<i64>(req) * hbt_stride + vr_div(slot, bs)]) * bs +
                            vr_mod(slot, bs));
}

__device__ __forceinline__ i32 vr_attention(i32 row, i32 bs, i64 stride) {
    return row < 0 ? -1 : static_cast<i32>(static_cast<i64>(vr_div(row, bs)) * stride + vr_mod(row, bs));
}

// Grid: (batch rows, 1, 1); block: a multiple of 32 threads with at most 32 entries of a row and
// 32 LRU positions each; dynamic shared memory: 12 * smem_buckets + 2 * H (rounded to 16) bytes (build 3
// reads the hot-map row into shared memory where the size also covers 4 * H bytes from the first 16-byte
// boundary past the buckets).
// gtab / gval: [rows, 2 * K] buckets of global scratch, only touched by groups whose host entries
// do not fit the shared table.
extern "C" __global__ void __launch_bounds__(1024) hisparse_vllm_resolve(
    const i32* __restrict__ hbt, i64 hbt_stride, i32 hbt_rows, const i32* __restrict__ topk, i32 n, i32 K,
    const i32* __restrict__ request_ids, const i32* __restrict__ rsi, i32 nr, const i32* __restrict__ sbt,
    i64 sbt_stride, i32 sbt_rows, i32 sbt_cols, i32 sbs, const i32* __restrict__ rbt, i64 rbt_stride, i32 rbt_rows,
    i32 rbt_cols, i32 rbs, i32 null_block, i64 host_rows, i32* hot_out, i32* __restrict__ att, i64 att_stride,
    i32 bs, i32* __restrict__ resolved, i32* __restrict__ valid, i32* __restrict__ miss_mask,
    i32* __restrict__ swap_host, i32* __restrict__ swap_dev, i32* __restrict__ swap_counts, i32* dgi, i16* lru,
    i32 S, i32 H, u64* __restrict__ stats, u64* gtab, i32* gval, i32 smem_buckets) {
    extern __shared__ __align__(16) unsigned char vr_smem[];
#ifdef VR_K
    K = VR_K;
    H = VR_H;
    bs = VR_BS;
    sbs = VR_SBS;
    rbs = VR_RBS;
    smem_buckets = VR_SB;
#endif
    u64* s_tab = reinterpret_cast<u64*>(vr_smem);
    i32* s_val = reinterpret_cast<i32*>(s_tab + smem_buckets);
    i16* ord = reinterpret_cast<i16*>(s_val + smem_buckets);
    __shared__ i32 s_group;
#if VR_PDL
    // Launched as a programmatic dependent of the stream's previous kernel (HISPARSE_VLLM_RESOLVE_PDL=1):
    // the block was placed while that kernel finished; every global access below waits for its grid
    // to complete and its writes to be visible (a no-op where the launch did not overlap).
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    // The next kernel (a gather's mark kernel, launched to overlap) waits for this grid before reading.
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#ifdef VR_NT
    const i32 r = blockIdx.x, tid = threadIdx.x, nt = VR_NT;
#else
    const i32 r = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
#endif
#if VR_FAST6
    __builtin_assume(tid >= 0 && tid < nt);  // the launch's block size (shape builds: a constant)
#endif
#if VR_LEAN
    // The first round of row r's entries, issued before anything else (their addresses need nothing).
    i32 tv0[VR_B];
#pragma unroll
    for (i32 u = 0; u < VR_B; ++u) tv0[u] = tid + u * nt < K ? topk[static_cast<i64>(r) * K + tid + u * nt] : -1;
#endif
    i32 req, q;
#if VR_DIRECT
    // Rows r - 1 and r, and warp 0's rows r - 1 .. r + 30 (the group's extent), in two rounds: every
    // request id first, then every state row.
    i32 pq = -2, wq = -1;  // row r - 1's state row (-2: none; never a q below); warp 0's row's
#if VR_FAST6
    i32 nq;  // row r + 1's state row (-1: none)
    // Lane j of every warp reads row r - 1 + j as build 4 reads each of its four rows (the state row of
    // the row's own index loaded with its request id); rows r - 1, r and r + 1 come from lanes 0-2.
    {
        const i32 lane = tid & 31;
        const i32 rr = r - 1 + lane;
        const bool in = rr >= 0 && rr < n;
        const i32 rq = in ? (request_ids != nullptr ? request_ids[rr] : rr) : -1;
        const i32 sp = (rsi != nullptr && in && rr < nr) ? rsi[rr] : -1;
        i32 st = rq;
        if (rsi != nullptr) {  // block-uniform
            st = -1;
            if (rq == rr) {
                st = sp;
            } else if (in && rq >= 0 && rq < nr) {
                st = rsi[rq];
            }
        }
        st = (st < 0 || st >= S) ? -1 : st;  // as vr_state
        req = __shfl_sync(HS_FULL_MASK, rq, 1);
        q = __shfl_sync(HS_FULL_MASK, st, 1);
        const i32 before = __shfl_sync(HS_FULL_MASK, st, 0);
        if (r > 0) pq = before;
        nq = __shfl_sync(HS_FULL_MASK, st, 2);
        if (tid < 32 && tid != 1 && in) wq = st;
    }
#elif VR_FAST4
    i32 nq;  // row r + 1's state row (-1: none)
    // Rows r, r - 1, r + 1 and warp 0's row: every request id in one round, then every state row in one
    // more, each round's loads issued together (vr_state's branches made the compiler wait for each state
    // row before it loaded the next: a round trip a row). The state row of a row's own index is loaded
    // with its request id: where the request id is the row (vLLM's decode: one row a request, request ids
    // 0, 1, 2, ...), the page-table, LRU and hot-map loads need one round trip less; elsewhere the state
    // row of the request id is loaded as before.
    {
        const i32 rr = r - 1 + tid;
        const bool wl = tid < 32 && tid != 1 && rr >= 0 && rr < n;
        const i32 rows[4] = {r, r - 1, r + 1, rr};
        const bool has[4] = {true, r > 0, r + 1 < n, wl};
        i32 rq[4], st[4], sp[4];
#pragma unroll
        for (i32 k = 0; k < 4; ++k) {
            rq[k] = has[k] ? (request_ids != nullptr ? request_ids[rows[k]] : rows[k]) : -1;
            sp[k] = (rsi != nullptr && has[k] && rows[k] < nr) ? rsi[rows[k]] : -1;  // rows[k] >= 0 where has[k]
        }
        if (rsi != nullptr) {  // block-uniform
#pragma unroll
            for (i32 k = 0; k < 4; ++k) {
                st[k] = -1;
                if (rq[k] == rows[k]) {
                    st[k] = sp[k];
                } else if (has[k] && rq[k] >= 0 && rq[k] < nr) {
                    st[k] = rsi[rq[k]];
                }
            }
        } else {
#pragma unroll
            for (i32 k = 0; k < 4; ++k) st[k] = rq[k];
        }
#pragma unroll
        for (i32 k = 0; k < 4; ++k) st[k] = (st[k] < 0 || st[k] >= S) ? -1 : st[k];  // as vr_state
        req = rq[0];
        q = st[0];
        if (r > 0) pq = st[1];
        nq = st[2];
        if (wl) wq = st[3];
    }
#else
    {
        const i32 rr = r - 1 + tid;
        const bool wl = tid < 32 && tid != 1 && rr >= 0 && rr < n;
        req = request_ids != nullptr ? request_ids[r] : r;
        const i32 preq = r > 0 ? (request_ids != nullptr ? request_ids[r - 1] : r - 1) : -1;
        const i32 wreq = wl ? (request_ids != nullptr ? request_ids[rr] : rr) : -1;
        q = vr_state(req, rsi, nr, S);
        if (r > 0) pq = vr_state(preq, rsi, nr, S);
        if (wl) wq = vr_state(wreq, rsi, nr, S);
    }
#endif
#else
    vr_row(r, request_ids, rsi, nr, S, req, q);
#if VR_LEAN
    i32 preq, pq = -2;  // row r - 1's state row, read with row r's (-2: none; never a q below)
    if (r > 0) vr_row(r - 1, request_ids, rsi, nr, S, preq, pq);
#endif
#endif
    if (q < 0) {  // padding: -1 / 0 in the row's outputs, nothing else
        for (i32 i = tid; i < K; i += nt) {
            const i64 e = static_cast<i64>(r) * K + i;
            hot_out[e] = -1;
            if (att != nullptr) att[e] = -1;
            if (resolved != nullptr) resolved[e] = -1;
        }
        if (tid == 0) {
            if (valid != nullptr) valid[r] = 0;
            if (swap_counts != nullptr) swap_counts[r] = 0;
        }
        return;
    }
#if VR_LEAN
    // A row that continues its group leaves before its page-table, hot-block and LRU loads: rows r - 1
    // and r are read in the same rounds of loads (no round trip more for a first row). Only the
    // coalesced top-k loads above were issued; the group's first block reads those rows next.
    if (pq == q) return;  // block-uniform: resolved by the block of its group's first row
    // The request's hot-block row, for the hot rows of a one-row group's hits and misses.
    __shared__ i32 s_hbt[VR_HBT];
    const i32 nhb = vr_div(H + bs - 1, bs);
    const bool hcache = nhb <= VR_HBT;
    const i64 hat = static_cast<i64>(min(max(req, 0), hbt_rows - 1)) * hbt_stride;
#if VR_DIRECT
    // One entry a thread where one round covers the row, stored under the group barrier.
    const bool hreg = hcache && nhb <= nt;
    const i32 hb0 = hreg && tid < nhb ? hbt[hat + tid] : 0;
#else
    if (hcache) {
        for (i32 c = tid; c < nhb; c += nt) s_hbt[c] = hbt[hat + c];
    }
#endif
    // Their page-table entries (row r is the group's first row whenever this block resolves), and the
    // shared hash of a one-row group cleared, all before the group barrier.
    i32 sb0[VR_B], rb0[VR_B];
#if VR_FAST6
    {  // each row's address once (64-bit), its columns 32-bit; the row tests are block-uniform
        const i32* srow = sbt != nullptr && req >= 0 && req < sbt_rows ? sbt + static_cast<i64>(req) * sbt_stride
                                                                        : nullptr;
        const i32* rrow = rbt != nullptr && q < rbt_rows ? rbt + static_cast<i64>(q) * rbt_stride : nullptr;
#pragma unroll
        for (i32 u = 0; u < VR_B; ++u) {
            const i32 t = tv0[u];
            const i32 scol = vr_div(t, sbs), rcol = vr_div(t, rbs);  // used only where t >= 0
            sb0[u] = srow != nullptr && t >= 0 && scol < sbt_cols ? srow[scol] : -1;
            rb0[u] = rrow != nullptr && t >= 0 && rcol < rbt_cols ? rrow[rcol] : null_block;
        }
    }
#else
#pragma unroll
    for (i32 u = 0; u < VR_B; ++u) {
        const i32 t = tv0[u];
        sb0[u] = -1;
        rb0[u] = null_block;
        const i32 scol = t >= 0 ? vr_div(t, sbs) : -1;
        if (sbt != nullptr && req >= 0 && req < sbt_rows && scol >= 0 && scol < sbt_cols) {
            sb0[u] = sbt[static_cast<i64>(req) * sbt_stride + scol];
        }
        const i32 rcol = t >= 0 ? vr_div(t, rbs) : -1;
        if (rbt != nullptr && q < rbt_rows && rcol >= 0 && rcol < rbt_cols) {
            rb0[u] = rbt[static_cast<i64>(q) * rbt_stride + rcol];
        }
    }
#endif
#if VR_FAST4
    // Four buckets a row where a power of two that large fits (the lean path's probe runs), else two.
    u32 T1 = static_cast<i64>(2) * K <= smem_buckets ? vr_buckets(static_cast<i64>(2) * K, smem_buckets) : 0u;
    if (static_cast<i64>(4) * K <= smem_buckets) {
        const u32 t4 = vr_buckets(static_cast<i64>(4) * K, smem_buckets);
        if ((t4 & (t4 - 1)) == 0) T1 = t4;
    }
#else
    const u32 T1 = static_cast<i64>(2) * K <= smem_buckets ? vr_buckets(static_cast<i64>(2) * K, smem_buckets) : 0u;
#endif
#if VR_FAST4
    // Two buckets a 16-byte store (T1 is even: 2 * K, 4 * K or a power of two above them).
#if VR_FAST6 && defined(VR_K)
    // A shape build knows T1 and nt: whole rounds, unrolled (the loop above kept a remainder round).
    {
        constexpr u32 kRounds = (vr_pow2ceil(4u * VR_K) + 2u * VR_NT - 1u) / (2u * VR_NT);  // T1 never exceeds it
#pragma unroll
        for (u32 c = 0; c < kRounds; ++c) {
            const u32 b = 2u * (c * VR_NT + static_cast<u32>(tid));
            if (b < T1) *reinterpret_cast<uint4*>(s_tab + b) = make_uint4(~0u, ~0u, ~0u, ~0u);
        }
    }
#else
    for (u32 b = 2 * tid; b < T1; b += 2 * nt) *reinterpret_cast<uint4*>(s_tab + b) = make_uint4(~0u, ~0u, ~0u, ~0u);
#endif
#else
    for (u32 b = tid; b < T1; b += nt) s_tab[b] = VR_EMPTY;
#endif
    // The first round of this thread's LRU positions (a step with host entries walks them; issued now,
    // they arrive with the page-table entries, and the walk waits for the hot-map rows alone).
    const i32 cpt = (H + nt - 1) / nt;
    const i32 p0 = min(tid * cpt, H), p1 = min(p0 + cpt, H);
    i32 sl0[VR_W];
    {
        const i16* lru_row = lru + static_cast<i64>(q) * H;
#if VR_DIRECT
        // One 8-byte load a thread where its positions are 4 aligned slots (block-uniform test).
        if (cpt == 4 && VR_W == 4 && H % 4 == 0 && (reinterpret_cast<u64>(lru_row) & 7) == 0) {
            uint2 v = make_uint2(0xffffffffu, 0xffffffffu);
            if (p0 < p1) v = *reinterpret_cast<const uint2*>(lru_row + p0);
            sl0[0] = static_cast<i16>(v.x & 0xffffu);
            sl0[1] = static_cast<i16>(v.x >> 16);
            sl0[2] = static_cast<i16>(v.y & 0xffffu);
            sl0[3] = static_cast<i16>(v.y >> 16);
        } else
#endif
        {
#pragma unroll
            for (i32 u = 0; u < VR_W; ++u) sl0[u] = p0 + u < p1 ? lru_row[p0 + u] : -1;
        }
    }
#if VR_DIRECT
    // The state row's hot-map row, whole, for the walk's lookups: 4 * H bytes from the first 16-byte
    // boundary past the hash buckets, over s_val and the LRU order, which are first written after the
    // walk (where the launch has room for it: the host grows it where it can); one 16-byte vector a
    // thread where one round covers the row.
    u32 dyn_smem;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
    const u32 dgi_off = (8u * static_cast<u32>(smem_buckets) + 15u) & ~15u;
    const bool sdgi = static_cast<u64>(dgi_off) + 4ull * static_cast<u32>(H) <= dyn_smem;
    i32* s_dgi = reinterpret_cast<i32*>(vr_smem + dgi_off);
    const i32* dgi_row = dgi + static_cast<i64>(q) * H;
    const bool dvec = sdgi && H % 4 == 0 && 4 * nt >= H && (reinterpret_cast<u64>(dgi_row) & 15) == 0;
    int4 dg0 = make_int4(-1, -1, -1, -1);
    if (dvec && 4 * tid < H) dg0 = *reinterpret_cast<const int4*>(dgi_row + 4 * tid);
#if VR_FAST4
    // The lean path of a one-row group (VR_FAST4 above): rows r - 1, r and r + 1 are known to every
    // thread, so the block needs no group barrier. Same outputs as the path below, step for step.
    if (nq != q && T1 != 0u && K <= VR_B * nt && cpt <= VR_W && dvec && hreg) {  // block-uniform
        static_assert(VR_B == 2 && VR_W <= 7, "the lean path packs two entries and 3-bit hit counts a thread");
        // The cleared table, while the page-table, LRU and hot-map loads are in flight: the inserts follow
        // the classification at once, and the barrier that sums the counts also orders them before the walk.
        __syncthreads();
        const u32 T = T1;
        // Shared addresses: bucket b's low word (first reference, then the held mark) at a_tab + 8 * b,
        // its high word (the host row) 4 bytes on; hot-map row entries at a_dgi, hot blocks at a_hbt.
        const u32 a_tab = vr_sa(s_tab), a_dgi = vr_sa(s_dgi), a_hbt = vr_sa(s_hbt);
        const i32 lane = tid & 31, warp = tid >> 5, nw = (nt + 31) >> 5;
        const u32 lt = (1u << lane) - 1u;
        const i32 base = r * K;  // i32: the host refuses calls of 2^30 entries or more
        i32* dgi_q = dgi + static_cast<i64>(q) * H;
        i16* lru_q = lru + static_cast<i64>(q) * H;
        auto hot_row = [&](i32 slot) -> i32 {
            const i32 blk = static_cast<i32>(vr_lds(a_hbt + 4u * static_cast<u32>(vr_div(slot, bs))));
            return static_cast<i32>(static_cast<i64>(blk) * bs + vr_mod(slot, bs));
        };
        // ---- classify (entries i = tid + u * nt); a host entry's row stays in a register --------
        i32 gv[VR_B];
        bool host[VR_B];
        i32 nvalid = 0, nhost = 0;
#pragma unroll
        for (i32 u = 0; u < VR_B; ++u) {
            const i32 i = tid + u * nt;
            host[u] = false;
            gv[u] = -1;
            if (i >= K) continue;
            const i32 e = base + i;
            const i32 t = tv0[u];
            i64 g = t;
            if (sbt != nullptr) g = sb0[u] >= 0 ? static_cast<i64>(sb0[u]) * sbs + vr_mod(t, sbs) : -1;
            if (g >= host_rows) g = -1;
            i64 res = -1;
            if (rbt != nullptr && rb0[u] != null_block && rb0[u] >= 0) res = static_cast<i64>(rb0[u]) * rbs + vr_mod(t, rbs);
            nvalid += (res >= 0 || g >= 0) ? 1 : 0;
            if (resolved != nullptr) resolved[e] = static_cast<i32>(g);
            if (miss_mask != nullptr) miss_mask[e] = 0;
            if (res >= 0 || g < 0) {
                const i32 out = res >= 0 ? static_cast<i32>(res) : -1;
                hot_out[e] = out;
                if (att != nullptr) att[e] = vr_attention(out, bs, att_stride);
            } else {
                host[u] = true;
                gv[u] = static_cast<i32>(g);
                ++nhost;
            }
        }
        // ---- inserts ----------------------------------------------------------------------------
        u32 bk[VR_B];
        u64 cur[VR_B];
        i32 fresh = 0;
#pragma unroll
        for (i32 u = 0; u < VR_B; ++u) bk[u] = host[u] ? vr_hash(gv[u], T) : 0u;
#pragma unroll
        for (i32 u = 0; u < VR_B; ++u) {  // first probes, issued together: a claim needs no load before it
            cur[u] = host[u] ? vr_cas(a_tab + 8u * bk[u], VR_EMPTY, vr_key(gv[u], tid + u * nt)) : 0ull;
        }
#pragma unroll
        for (i32 u = 0; u < VR_B; ++u) {
            if (!host[u]) continue;
            const i32 x = tid + u * nt;
            if (cur[u] == VR_EMPTY) {
                ++fresh;
            } else if (static_cast<i32>(cur[u] >> 32) == gv[u]) {
                vr_amin(a_tab + 8u * bk[u], static_cast<u32>(x));  // low word: see vr_insert_at
            } else {
                bk[u] = vr_insert_at(s_tab, T, gv[u], x, fresh, bk[u] + 1 == T ? 0u : bk[u] + 1);
            }
        }
        if (4 * tid < H) *reinterpret_cast<int4*>(s_dgi + 4 * tid) = dg0;
        if (tid < nhb) s_hbt[tid] = hb0;
        i32 tvalid, P;
        vr_sum2(nvalid, nhost, tvalid, P);  // its barrier orders the inserts before the walk, publishes both rows
        if (tid == 0 && valid != nullptr) valid[r] = tvalid;
        if (P == 0) {  // no host entry: the LRU and hot map stay as they are
            if (tid == 0 && swap_counts != nullptr) swap_counts[r] = 0;
            return;
        }
        i32 cached[VR_W];
        u32 hb[VR_W];
#pragma unroll
        for (i32 u = 0; u < VR_W; ++u) {
            const bool in = sl0[u] >= 0 && sl0[u] < H;
            cached[u] = static_cast<i32>(vr_lds(a_dgi + 4u * static_cast<u32>(in ? sl0[u] : 0)));  // slot 0 exists
            if (!in) cached[u] = -1;
            hb[u] = cached[u] >= 0 ? vr_hash(cached[u], T) : 0u;
        }
        // ---- the walk: the high words (host rows) of the first buckets, issued together -----------
        u32 key[VR_W];
#pragma unroll
        for (i32 u = 0; u < VR_W; ++u) {
            key[u] = vr_lds(a_tab + 8u * hb[u] + 4u);  // hb[u] = 0 where cached[u] < 0
            if (cached[u] < 0) key[u] = 0xffffffffu;
        }
        i32 hbk[VR_W];  // the bucket holding the slot's row, -1 where it is not a union row
#pragma unroll
        for (i32 u = 0; u < VR_W; ++u) {
            hbk[u] = -1;
            if (cached[u] < 0) continue;
            u32 b = hb[u], k = key[u];
            while (k != 0xffffffffu) {  // an empty bucket ends the run (no key has an all-ones high word)
                if (static_cast<i32>(k) == cached[u]) {
                    hbk[u] = static_cast<i32>(b);
                    break;
                }
                b = b + 1 == T ? 0u : b + 1;
                k = vr_lds(a_tab + 8u * b + 4u);
            }
        }
        u32 was[VR_W];
#pragma unroll
        for (i32 u = 0; u < VR_W; ++u) {  // the last hit position in LRU order wins (low word: see vr_insert_at)
            was[u] = VR_HELD;
            if (hbk[u] >= 0) {
                was[u] = vr_amax(a_tab + 8u * static_cast<u32>(hbk[u]),
                                 VR_HELD | (static_cast<u32>(p0 + u) << 15) | static_cast<u32>(sl0[u]));
            }
        }
        u32 hitbits = 0;
        i32 hits = 0, held = 0;
#pragma unroll
        for (i32 u = 0; u < VR_W; ++u) {
            if (hbk[u] < 0) continue;
            hitbits |= 1u << u;
            ++hits;
            held += (was[u] & VR_HELD) ? 0 : 1;
        }
        // ---- ranks of the hits (positions are contiguous a thread, in thread order): ballot/popc ---
        u32 whits, wpre;
        {
            const u32 h0 = __ballot_sync(HS_FULL_MASK, hits & 1), h1 = __ballot_sync(HS_FULL_MASK, hits & 2),
                      h2 = __ballot_sync(HS_FULL_MASK, hits & 4);
            wpre = __popc(h0 & lt) + 2 * __popc(h1 & lt) + 4 * __popc(h2 & lt);
            whits = __popc(h0) + 2 * __popc(h1) + 4 * __popc(h2);
        }
        const u32 wheld = __reduce_add_sync(HS_FULL_MASK, static_cast<u32>(held));
        const u32 wfresh = __reduce_add_sync(HS_FULL_MASK, static_cast<u32>(fresh));
        __shared__ u32 s4_w[2][32];
        if (lane == 0) {
            s4_w[0][warp] = whits | (wheld << 16);  // hit positions <= H < 2^15, held buckets <= K < 2^15
            s4_w[1][warp] = wfresh;
        }
        __syncthreads();  // every walk's marks done; the warps' counts
        i32 hbefore, nH, nHeld, U;
        {
            const u32 x = lane < nw ? s4_w[0][lane] : 0u;
            const u32 before = __reduce_add_sync(HS_FULL_MASK, lane < warp ? x : 0u);
            const u32 all = __reduce_add_sync(HS_FULL_MASK, x);
            U = static_cast<i32>(__reduce_add_sync(HS_FULL_MASK, lane < nw ? s4_w[1][lane] : 0u));
            hbefore = static_cast<i32>((before & 0xffffu) + wpre);
            nH = static_cast<i32>(all & 0xffffu);
            nHeld = static_cast<i32>(all >> 16);
        }
        const i32 misses = U - nHeld;  // union rows not held
        const i32 nE = H - nH;
        // ---- the new LRU order E[used:] + E[:used] + hits, straight from registers -----------------
        {
            const i32 used = min(misses, nE);
            i32 hr = hbefore, er = p0 - hbefore;
#pragma unroll
            for (i32 u = 0; u < VR_W; ++u) {
                if (p0 + u >= p1) break;
                i32 to;
                if ((hitbits >> u) & 1u) {
                    to = nE + hr++;
                } else {
                    const i32 e = er++;
                    to = e >= used ? e - used : e + nE - used;
                }
                if (to != p0 + u) lru_q[to] = static_cast<i16>(sl0[u]);
            }
        }
        // ---- misses in first-reference order (entries in index order: u = 0's, then u = 1's) ------
#if VR_FAST6
        // Each host entry's bucket word is read once: held (its slot), its own first reference (a miss it
        // records), or another entry's unheld first reference (a repeat of a miss). Only a step with such a
        // repeat waits on a barrier for the misses' hot rows (through s_val); otherwise each miss's entry
        // outputs the hot row it computed (one barrier after the walk's, where build 4 crosses two).
        u32 lo[VR_B];
#pragma unroll
        for (i32 u = 0; u < VR_B; ++u) lo[u] = host[u] ? vr_lds(a_tab + 8u * bk[u]) : 0u;
        i32 own[VR_B] = {-1, -1};  // the hot row of a miss this thread records
#endif
        i32 M = 0;
        if (misses > 0) {  // block-uniform
            {
                i32 er = p0 - hbefore;  // the evictable slots in LRU order: E[m] = ord[m]
#pragma unroll
                for (i32 u = 0; u < VR_W; ++u) {
                    if (p0 + u >= p1) break;
                    if (!((hitbits >> u) & 1u)) ord[er++] = static_cast<i16>(sl0[u]);
                }
            }
            bool first[VR_B];
#if VR_FAST6
            bool repeat = false;
#endif
#pragma unroll
            for (i32 u = 0; u < VR_B; ++u) {  // a miss (no HELD bit) first referenced here
#if VR_FAST6
                first[u] = host[u] && lo[u] == static_cast<u32>(tid + u * nt);
                repeat |= host[u] && !(lo[u] & VR_HELD) && !first[u];
#else
                first[u] = host[u] && vr_lds(a_tab + 8u * bk[u]) == static_cast<u32>(tid + u * nt);
#endif
            }
            const u32 f0 = __ballot_sync(HS_FULL_MASK, first[0]), f1 = __ballot_sync(HS_FULL_MASK, first[1]);
#if VR_FAST6
            const bool wrep = __any_sync(HS_FULL_MASK, repeat);
            __shared__ u32 s6_m[2][32];
            if (lane == 0) {
                s6_m[0][warp] = static_cast<u32>(__popc(f0)) | (static_cast<u32>(__popc(f1)) << 16);
                s6_m[1][warp] = wrep ? 1u : 0u;
            }
            __syncthreads();  // the evictable order, the warps' first references and repeats
            const u32 x = lane < nw ? s6_m[0][lane] : 0u;
#else
            __shared__ u32 s4_m[32];
            if (lane == 0) s4_m[warp] = static_cast<u32>(__popc(f0)) | (static_cast<u32>(__popc(f1)) << 16);
            __syncthreads();  // the evictable order and the warps' first references
            const u32 x = lane < nw ? s4_m[lane] : 0u;
#endif
            const u32 before = __reduce_add_sync(HS_FULL_MASK, lane < warp ? x : 0u);
            const u32 all = __reduce_add_sync(HS_FULL_MASK, x);
#if VR_FAST6
            const bool repeats = __reduce_or_sync(HS_FULL_MASK, lane < nw ? s6_m[1][lane] : 0u) != 0u;
#endif
            const i32 tot0 = static_cast<i32>(all & 0xffffu);
            M = tot0 + static_cast<i32>(all >> 16);
            const i32 rank[VR_B] = {static_cast<i32>(before & 0xffffu) + __popc(f0 & lt),
                                    tot0 + static_cast<i32>(before >> 16) + __popc(f1 & lt)};
#pragma unroll
            for (i32 u = 0; u < VR_B; ++u) {
                if (!first[u]) continue;
                const i32 m = rank[u], e = base + tid + u * nt;
                const i32 slot = m < nE ? static_cast<i32>(ord[m]) : -1;
                i32 dev = -1;
                if (slot >= 0 && slot < H) {
                    dev = hot_row(slot);
                    dgi_q[slot] = gv[u];
                    if (miss_mask != nullptr) miss_mask[e] = 1;
                }
#if VR_FAST6
                own[u] = dev;
                if (repeats) s_val[bk[u]] = dev;
#else
                s_val[bk[u]] = dev;
#endif
                if (swap_counts != nullptr) {
                    swap_host[base + m] = gv[u];
                    swap_dev[base + m] = dev;
                }
            }
            if (tid == 0 && swap_counts != nullptr) swap_counts[r] = M;
#if VR_FAST6
            if (repeats) __syncthreads();  // block-uniform: every miss's hot row is in s_val
#else
            __syncthreads();  // every miss's hot row is in s_val
#endif
        } else if (tid == 0 && swap_counts != nullptr) {
            swap_counts[r] = 0;
        }
        // ---- outputs of host entries ------------------------------------------------------------
#pragma unroll
        for (i32 u = 0; u < VR_B; ++u) {
            if (!host[u]) continue;
            const i32 e = base + tid + u * nt;
#if VR_FAST6
            i32 out;
            if (lo[u] & VR_HELD) {
                out = hot_row(static_cast<i32>(lo[u] & 0x7fffu));
            } else if (lo[u] == static_cast<u32>(tid + u * nt)) {
                out = own[u];
            } else {
                out = s_val[bk[u]];  // a repeat of a miss: written before the barrier above
            }
#else
            const u32 lo = vr_lds(a_tab + 8u * bk[u]);
            const i32 out = (lo & VR_HELD) ? hot_row(static_cast<i32>(lo & 0x7fffu)) : s_val[bk[u]];
#endif
            hot_out[e] = out;
            if (att != nullptr) att[e] = vr_attention(out, bs, att_stride);
        }
        if (tid == 0 && stats != nullptr) {
            atomicAdd(reinterpret_cast<unsigned long long*>(stats), static_cast<unsigned long long>(U - M));
            atomicAdd(reinterpret_cast<unsigned long long*>(stats) + 1, static_cast<unsigned long long>(M));
        }
        return;
    }
#endif
#endif
#else
    const i32 cpt = (H + nt - 1) / nt;
    const i32 p0 = min(tid * cpt, H), p1 = min(p0 + cpt, H);
#endif
#if HS_VR_FAST
    // Warp 0 reads rows r - 1 .. r + 30 at once (one round of dependent loads, not one per row).
    if (tid < 32) {
        const i32 rr = r - 1 + tid;
        i32 qq = -1;
#if VR_DIRECT
        qq = wq;
#else
        i32 rq2;
        if (rr >= 0 && rr < n && tid != 1) vr_row(rr, request_ids, rsi, nr, S, rq2, qq);
#endif
        const u32 same = __ballot_sync(HS_FULL_MASK, tid == 1 || (rr >= 0 && rr < n && qq == q));
        if (tid == 0) {
            // Consecutive rows from r with state row q (bit 1 is r; bit 31 of same >> 1 is clear).
            i32 g = __ffs(~(same >> 1)) - 1;
            while (g >= 31 && r + g < n) {  // a group past r + 30: on row by row
                i32 rq, qq2;
                vr_row(r + g, request_ids, rsi, nr, S, rq, qq2);
                if (qq2 != q) break;
                ++g;
            }
            s_group = (same & 1u) ? 0 : g;  // 0: r - 1 is of the same group
        }
    }
#if VR_DIRECT
    // The hot-map and hot-block rows go into shared memory under the group barrier (its classification
    // waits on the same round of loads; held in registers past it they would spill).
    if (dvec && 4 * tid < H) *reinterpret_cast<int4*>(s_dgi + 4 * tid) = dg0;
    if (hreg && tid < nhb) s_hbt[tid] = hb0;
#endif
    __syncthreads();
    if (s_group == 0) return;  // resolved by the block of its group's first row
#else
    if (r > 0) {
        i32 preq, pq;
        vr_row(r - 1, request_ids, rsi, nr, S, preq, pq);
        if (pq == q) return;  // resolved by the block of its group's first row
    }
    if (tid == 0) {
        i32 g = 1;
        while (r + g < n) {
            i32 rq, qq;
            vr_row(r + g, request_ids, rsi, nr, S, rq, qq);
            if (qq != q) break;
            ++g;
        }
        s_group = g;
    }
    __syncthreads();
#endif
    const i32 G = s_group;
    const i64 base = static_cast<i64>(r) * K;  // the group's entries are [base, base + G * K)
    i32* dgi_q = dgi + static_cast<i64>(q) * H;
    i16* lru_q = lru + static_cast<i64>(q) * H;

    // ---- 1. classify -----------------------------------------------------------------------
    // Where the shared table holds every entry of the group (twice over), host rows are hashed as
    // they are classified; otherwise their rows are parked in hot_out and hashed in step 2.
    const bool early = static_cast<i64>(2) * G * K <= smem_buckets;
    u32 T = early ? vr_buckets(static_cast<i64>(2) * G * K, smem_buckets) : 0u;
    // Parked values of this thread's entries (i = tid + u * nt) where one round covers the group.
    const bool regs = HS_VR_FAST && early && G == 1 && K <= VR_B * nt;
    i32 park[VR_B];
#pragma unroll
    for (i32 u = 0; u < VR_B; ++u) park[u] = 0;
#if VR_LEAN
    if (early && T > T1) {  // a group of several rows: the rest of its table
        for (u32 b = T1 + tid; b < T; b += nt) s_tab[b] = VR_EMPTY;
        __syncthreads();
    }
#else
    if (early) {
        for (u32 b = tid; b < T; b += nt) s_tab[b] = VR_EMPTY;
        __syncthreads();
    }
#endif
    i32 pending = 0, fresh = 0;
    for (i32 a = 0; a < G; ++a) {
        const i32 rr = r + a;
        const i32 rq = request_ids != nullptr ? request_ids[rr] : rr;
        i32 cnt = 0;
        for (i32 i0 = tid; i0 < K; i0 += VR_B * nt) {
            // VR_B entries a round: their top-k loads, then their page-table loads, issued together.
            i32 tv[VR_B], sb[VR_B], rb[VR_B];
#if VR_LEAN
            if (a == 0 && i0 == tid) {  // loaded before the group barrier
#pragma unroll
                for (i32 u = 0; u < VR_B; ++u) {
                    tv[u] = tv0[u];
                    sb[u] = sb0[u];
                    rb[u] = rb0[u];
                }
            } else
#endif
            {
#pragma unroll
            for (i32 u = 0; u < VR_B; ++u) {
                const i32 i = i0 + u * nt;
                tv[u] = i < K ? topk[base + static_cast<i64>(a) * K + i] : -1;
            }
#pragma unroll
            for (i32 u = 0; u < VR_B; ++u) {
                const i32 t = tv[u];
                sb[u] = -1;
                rb[u] = null_block;
                const i32 scol = t >= 0 ? vr_div(t, sbs) : -1;
                if (sbt != nullptr && rq >= 0 && rq < sbt_rows && scol >= 0 && scol < sbt_cols) {
                    sb[u] = sbt[static_cast<i64>(rq) * sbt_stride + scol];
                }
                const i32 rcol = t >= 0 ? vr_div(t, rbs) : -1;
                if (rbt != nullptr && q < rbt_rows && rcol >= 0 && rcol < rbt_cols) {
                    rb[u] = rbt[static_cast<i64>(q) * rbt_stride + rcol];
                }
            }
            }
#pragma unroll
            for (i32 u = 0; u < VR_B; ++u) {
            const i32 i = i0 + u * nt;
            if (i >= K) break;
            const i64 e = base + static_cast<i64>(a) * K + i;
            const i32 t = tv[u];
            i64 g = t;
            if (sbt != nullptr) g = sb[u] >= 0 ? static_cast<i64>(sb[u]) * sbs + vr_mod(t, sbs) : -1;
            if (g >= host_rows) g = -1;
            i64 res = -1;
            if (rbt != nullptr && rb[u] != null_block && rb[u] >= 0) res = static_cast<i64>(rb[u]) * rbs + vr_mod(t, rbs);
            cnt += (res >= 0 || g >= 0) ? 1 : 0;
            if (resolved != nullptr) resolved[e] = static_cast<i32>(g);
            if (miss_mask != nullptr) miss_mask[e] = 0;
            if (res >= 0 || g < 0) {
                const i32 out = res >= 0 ? static_cast<i32>(res) : -1;
                hot_out[e] = out;
                park[u] = out;
                if (att != nullptr) att[e] = vr_attention(out, bs, att_stride);
            } else {
                ++pending;
                const i32 pv = early ? -static_cast<i32>(vr_insert(s_tab, T, static_cast<i32>(g), a * K + i, fresh)) - 2
                                     : static_cast<i32>(-(g + 2));
                hot_out[e] = pv;
                park[u] = pv;
            }
            }
        }
        if (VR_LEAN && G == 1) {  // counted with the host entries below
            pending += cnt << 16;  // both < 2^16 (K <= 32768)
            continue;
        }
        i32 total;
        vr_scan(cnt, total);
        if (tid == 0 && valid != nullptr) valid[rr] = total;
    }
    i32 P;
    if (VR_LEAN && G == 1) {
        i32 nvalid;
        vr_sum2(pending >> 16, pending & 0xffff, nvalid, P);
        pending &= 0xffff;
        if (tid == 0 && valid != nullptr) valid[r] = nvalid;
    } else {
        vr_scan(pending, P);
    }
    if (P == 0) {  // no host entry: the LRU and hot map stay as they are
        for (i32 a = tid; a < G; a += nt) {
            if (swap_counts != nullptr) swap_counts[r + a] = 0;
        }
        return;
    }

    // ---- 2. the group's host rows in a hash (unless step 1 did it) ----------------------------
    u64* tab = s_tab;
    i32* tval = s_val;
    if (!early) {
        const bool in_smem = static_cast<i64>(2) * P <= smem_buckets;
        T = vr_buckets(static_cast<i64>(2) * P, in_smem ? smem_buckets : static_cast<i64>(2) * G * K);
        tab = in_smem ? s_tab : gtab + base * 2;
        tval = in_smem ? s_val : gval + base * 2;
        for (u32 b = tid; b < T; b += nt) tab[b] = VR_EMPTY;
        __syncthreads();
        for (i32 x = tid; x < G * K; x += nt) {
            const i64 e = base + x;
            const i32 v = hot_out[e];
            if (v > -2) continue;
            hot_out[e] = -static_cast<i32>(vr_insert(tab, T, -(v + 2), x, fresh)) - 2;
        }
    }
    // Lean: the hot-map rows of this thread's first LRU positions are read before the barrier that
    // ends the inserts (they do not depend on them), and the distinct host rows are counted in the
    // scan of the hits below (one barrier here, not three).
    const bool lean_scan = VR_LEAN && H < 32768;
#if VR_LEAN
    i32 cached0[VR_W];
#if VR_DIRECT
    // The rows not stored under the group barrier (more than one round of them) are read now (the
    // barrier below publishes them).
    if (sdgi && !dvec) {
        for (i32 c = tid; c < H; c += nt) s_dgi[c] = dgi_q[c];
    }
    if (hcache && !hreg) {
        for (i32 c = tid; c < nhb; c += nt) s_hbt[c] = hbt[hat + c];
    }
    if (!sdgi) {
#pragma unroll
        for (i32 u = 0; u < VR_W; ++u) cached0[u] = (sl0[u] >= 0 && sl0[u] < H) ? dgi_q[sl0[u]] : -1;
    }
#else
#pragma unroll
    for (i32 u = 0; u < VR_W; ++u) cached0[u] = (sl0[u] >= 0 && sl0[u] < H) ? dgi_q[sl0[u]] : -1;
#endif
#endif
    i32 U = 0;
    if (lean_scan) {
        __syncthreads();  // orders the inserts before the walk
    } else {
        vr_scan(fresh, U);  // distinct host rows (its barriers also order the inserts before the walk)
    }
#if VR_DIRECT
    if (sdgi) {
#pragma unroll
        for (i32 u = 0; u < VR_W; ++u) cached0[u] = (sl0[u] >= 0 && sl0[u] < H) ? s_dgi[sl0[u]] : -1;
    }
#endif

    // ---- 3. the LRU walk -----------------------------------------------------------------------
    u32 hitbits = 0;
    i32 hits = 0, held = 0;  // hit positions; buckets this thread found held first
    i32 slc[VR_W];  // the first round's slots (all of them where cpt <= VR_W)
    for (i32 pb = p0; pb < p1; pb += VR_W) {
        i32 sl[VR_W], cached[VR_W];
#if VR_LEAN
        if (pb == p0) {
#pragma unroll
            for (i32 u = 0; u < VR_W; ++u) {
                sl[u] = sl0[u];
                cached[u] = cached0[u];
            }
        } else
#endif
        {
#pragma unroll
            for (i32 u = 0; u < VR_W; ++u) sl[u] = pb + u < p1 ? lru_q[pb + u] : -1;
#pragma unroll
            for (i32 u = 0; u < VR_W; ++u) {
                const bool in = sl[u] >= 0 && sl[u] < H;
#if VR_DIRECT
                cached[u] = in ? (sdgi ? s_dgi[sl[u]] : dgi_q[sl[u]]) : -1;
#else
                cached[u] = in ? dgi_q[sl[u]] : -1;
#endif
            }
        }
        if (pb == p0) {
#pragma unroll
            for (i32 u = 0; u < VR_W; ++u) slc[u] = sl[u];
        }
#if VR_DIRECT
        // A bucket of the shared table is probed and marked with shared-memory instructions (the
        // table pointer is generic where it may be the global one).
        auto probe = [&](u64* t, i32 c, i32 p, i32 slot) -> bool {
            u32 b = vr_hash(c, T);
            while (true) {
                const u64 cur = t[b];
                if (cur == VR_EMPTY) return false;
                if (static_cast<i32>(cur >> 32) == c) {
                    // The last hit position in LRU order wins (its slot is what the entries output); a
                    // 32-bit atomic on a claimed bucket's low word (see vr_insert_at).
                    const u32 was = atomicMax(reinterpret_cast<u32*>(t + b),  // the low word (little-endian)
                                              VR_HELD | (static_cast<u32>(p) << 15) | static_cast<u32>(slot));
                    held += (was & VR_HELD) ? 0 : 1;
                    return true;
                }
                b = b + 1 == T ? 0 : b + 1;
            }
        };
        const bool tsm = tab == s_tab;  // block-uniform
#pragma unroll
        for (i32 u = 0; u < VR_W; ++u) {
            if (cached[u] < 0) continue;
            const i32 p = pb + u;
            if (tsm ? probe(s_tab, cached[u], p, sl[u]) : probe(tab, cached[u], p, sl[u])) {
                hitbits |= 1u << (p - p0);
                ++hits;
            }
        }
#else
#pragma unroll
        for (i32 u = 0; u < VR_W; ++u) {
            if (cached[u] < 0) continue;
            const i32 p = pb + u;
            u32 b = vr_hash(cached[u], T);
            while (true) {
                const u64 cur = tab[b];
                if (cur == VR_EMPTY) break;
                if (static_cast<i32>(cur >> 32) == cached[u]) {
                    // The last hit position in LRU order wins (its slot is what the entries output).
                    const u64 was = atomicMax(reinterpret_cast<unsigned long long*>(tab + b),
                                              (cur & 0xffffffff00000000ull) | VR_HELD |
                                                  (static_cast<u32>(p) << 15) | static_cast<u32>(sl[u]));
                    held += (static_cast<u32>(was) & VR_HELD) ? 0 : 1;
                    hitbits |= 1u << (p - p0);
                    ++hits;
                    break;
                }
                b = b + 1 == T ? 0 : b + 1;
            }
        }
#endif
    }
    i32 nHeld, nH, hbefore;
    if (lean_scan) {
        // One scan of the three: buckets held <= hit positions <= H < 2^15, so the fields never carry.
        i64 all;
        hbefore = static_cast<i32>(
            vr_scan<i64, true>(static_cast<i64>(hits | (held << 16)) | (static_cast<i64>(fresh) << 32), all) & 0xffff);
        nH = static_cast<i32>(all & 0xffff);
        nHeld = static_cast<i32>((all >> 16) & 0xffff);
        U = static_cast<i32>(all >> 32);
    } else {
        vr_scan(held, nHeld);
        hbefore = vr_scan(hits, nH);
    }
    const i32 misses = U - nHeld;  // union rows not held
    const i32 nE = H - nH;
    // Direct: one round covered this thread's positions (slots in slc), and every read of the LRU row
    // came before the scan's barriers, so the new order E[used:] + E[:used] + hits is written from
    // registers now: evictable e goes to e - used (e >= used) or e + nE - used, hit h to nE + h (miss
    // m takes E[m] and the misses are misses = M in all). A slot that keeps its place is not stored.
    const bool direct = VR_DIRECT && cpt <= VR_W;  // block-uniform
    if (direct) {
        const i32 used = min(misses, nE);
        i32 hr = hbefore, er = p0 - hbefore;
#pragma unroll
        for (i32 u = 0; u < VR_W; ++u) {
            if (p0 + u >= p1) break;
            i32 to;
            if ((hitbits >> u) & 1u) {
                to = nE + hr++;
            } else {
                const i32 e = er++;
                to = e >= used ? e - used : e + nE - used;
            }
            if (to != p0 + u) lru_q[to] = static_cast<i16>(slc[u]);
        }
    }
    if (!direct || misses > 0) {  // the packed order in shared memory: the misses' evictable slots
        i32 hr = hbefore, er = p0 - hbefore;
        if (HS_VR_FAST && cpt <= VR_W) {
#pragma unroll
            for (i32 u = 0; u < VR_W; ++u) {
                if (p0 + u >= p1) break;
                const i16 s = static_cast<i16>(slc[u]);
                if ((hitbits >> u) & 1u) {
                    ord[H - 1 - hr++] = s;
                } else {
                    ord[er++] = s;
                }
            }
        } else {
            for (i32 p = p0; p < p1; ++p) {
                const i16 s = lru_q[p];
                if ((hitbits >> (p - p0)) & 1u) {
                    ord[H - 1 - hr++] = s;
                } else {
                    ord[er++] = s;
                }
            }
        }
        __syncthreads();
    }

    // The hot row of `slot` for request rq (a one-row group's from the shared copy of its hot blocks).
    auto hot_row = [&](i32 rq, i32 slot) -> i32 {
#if VR_LEAN
        if (hcache && G == 1) return static_cast<i32>(static_cast<i64>(s_hbt[vr_div(slot, bs)]) * bs + vr_mod(slot, bs));
#endif
        return vr_hot_row(hbt, hbt_stride, min(max(rq, 0), hbt_rows - 1), slot, bs);
    };

    // ---- 4. misses in first-reference order, row by row ---------------------------------------
    const i32 ept = (K + nt - 1) / nt;
    i32 m_before = 0;
    for (i32 a = 0; a < G && misses > 0; ++a) {
        const i32 rr = r + a;
        const i32 rq = request_ids != nullptr ? request_ids[rr] : rr;
        const i32 i0 = min(tid * ept, K), i1 = min(i0 + ept, K);
        u32 firstbits = 0;
        i32 c = 0;
        for (i32 i = i0; i < i1; ++i) {
            const i32 x = a * K + i;
            const i32 v = hot_out[base + x];
            if (v > -2) continue;
            const u32 lo = static_cast<u32>(tab[-(v + 2)]);
            if (lo == static_cast<u32>(x)) {  // a miss (no HELD bit) first referenced here
                firstbits |= 1u << (i - i0);
                ++c;
            }
        }
        i32 row_misses;
        const i32 before = vr_scan(c, row_misses);
        i32 j = before;
        for (i32 i = i0; i < i1; ++i) {
            if (!((firstbits >> (i - i0)) & 1u)) continue;
            const i64 e = base + static_cast<i64>(a) * K + i;
            const u32 b = static_cast<u32>(-(hot_out[e] + 2));
            const i32 g = static_cast<i32>(tab[b] >> 32);
            const i32 m = m_before + j;
            const i32 slot = m < nE ? static_cast<i32>(ord[m]) : -1;
            i32 dev = -1;
            if (slot >= 0 && slot < H) {
                dev = hot_row(rq, slot);
                dgi_q[slot] = g;
                if (miss_mask != nullptr) miss_mask[e] = 1;
            }
            tval[b] = dev;
            if (swap_counts != nullptr) {
                swap_host[static_cast<i64>(rr) * K + j] = g;
                swap_dev[static_cast<i64>(rr) * K + j] = dev;
            }
            ++j;
        }
        if (tid == 0 && swap_counts != nullptr) swap_counts[rr] = row_misses;
        m_before += row_misses;
    }
    if (misses == 0) {
        for (i32 a = tid; a < G; a += nt) {
            if (swap_counts != nullptr) swap_counts[r + a] = 0;
        }
    }
    if (!VR_LEAN || misses > 0) __syncthreads();  // every miss's hot row is in tval (none written without a miss)

    // ---- 5. outputs of host entries, then the new LRU order --------------------------------------
    auto emit = [&](i32 x, i32 v) {
        if (v > -2) return;
        const i64 e = base + x;
        const u32 b = static_cast<u32>(-(v + 2));
        const u32 lo = static_cast<u32>(tab[b]);
        i32 out;
        if (lo & VR_HELD) {
            const i32 rr = r + x / K;
            const i32 rq = request_ids != nullptr ? request_ids[rr] : rr;
            out = hot_row(rq, static_cast<i32>(lo & 0x7fffu));
        } else {
            out = tval[b];
        }
        hot_out[e] = out;
        if (att != nullptr) att[e] = vr_attention(out, bs, att_stride);
    };
    if (regs) {  // one round covered the group: this thread's parked values are in park[]
#pragma unroll
        for (i32 u = 0; u < VR_B; ++u) {
            if (tid + u * nt < K) emit(tid + u * nt, park[u]);
        }
    } else {
        for (i32 x = tid; x < G * K; x += nt) emit(x, hot_out[base + x]);
    }
    const i32 M = m_before;
    const i32 used = min(M, nE);
    for (i32 p = tid; p < H && !direct; p += nt) {
        i16 s;
        if (p < nE - used) {
            s = ord[used + p];
        } else if (p < nE) {
            s = ord[p - (nE - used)];
        } else {
            s = ord[H - 1 - (p - nE)];
        }
        lru_q[p] = s;
    }
    if (tid == 0 && stats != nullptr) {
        atomicAdd(reinterpret_cast<unsigned long long*>(stats), static_cast<unsigned long long>(U - M));
        atomicAdd(reinterpret_cast<unsigned long long*>(stats) + 1, static_cast<unsigned long long>(M));
    }
}

#ifndef VR_K  // a shape build holds the resolver alone
// The taken entries of a gather, appended to `list` (list_n[0] their number), each destination
// marked with the largest {epoch, entry} naming it.
//   mode 0 (gather_compact): grid (rows); entries j < clamp(counts[r], 0, K) of row r.
//   mode 1 (gather_plan): grid (ceil(rows * K / blockDim)); entries with mask != 0 of non-padding
//     rows (rsi[r] >= 0 where rsi is given); also writes att (when given) for every entry.
// Taken: source >= 0 and 0 <= destination < hot_rows.
extern "C" __global__ void __launch_bounds__(HS_GNT) hisparse_vllm_mark(
    i32 mode, const i32* __restrict__ src, const i32* __restrict__ dst, const i32* __restrict__ counts,
    const i32* __restrict__ mask, const i32* __restrict__ rsi, i32* __restrict__ att, i64 att_stride, i32 bs, i32 n,
    i32 K, i64 hot_rows, u64* owner, const u64* __restrict__ epoch, i32* list, i32* list_n) {
    asm volatile("griddepcontrol.wait;" ::: "memory");  // launched to overlap the resolver: its plan
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const u64 ep = epoch[0] << 32;
    const i32 lane = threadIdx.x & 31;
    i32 lo, hi;
    if (mode == 0) {
        // Request-major: row r's entries take list positions [sum of the earlier rows' counts, + its
        // count), -1 where not taken, so the copy reads one or two requests' host rows at a time.
        const i32 r = blockIdx.x;
        i32 part = 0;
        for (i32 x = threadIdx.x; x < r; x += HS_GNT) part += min(max(counts[x], 0), K);
        i32 at0;
        vr_scan(part, at0);
        const i32 c = min(max(counts[r], 0), K);
        if (threadIdx.x == 0 && c > 0) atomicAdd(list_n, c);
        for (i32 j = threadIdx.x; j < c; j += HS_GNT) {
            const i32 e = r * K + j;
            const i32 g = src[e], d = dst[e];
            const bool take = g >= 0 && d >= 0 && d < hot_rows;
            list[at0 + j] = take ? e : -1;
            if (take) atomicMax(reinterpret_cast<unsigned long long*>(owner + d), ep | static_cast<u32>(e));
        }
        return;
    } else {
        lo = blockIdx.x * HS_GNT;
        hi = min(lo + HS_GNT, n * K);
    }
    for (i32 e0 = lo; e0 < hi; e0 += HS_GNT) {
        const i32 e = e0 + static_cast<i32>(threadIdx.x);
        bool take = false;
        i32 d = -1;
        if (e < hi) {
            const i32 g = src[e];
            d = dst[e];
            take = g >= 0 && d >= 0 && d < hot_rows;
            if (mode == 1) {
                const bool pad = rsi != nullptr && rsi[e / K] < 0;
                take = take && !pad && mask[e] != 0;
                if (att != nullptr) att[e] = (pad || d < 0) ? -1 : vr_attention(d, bs, att_stride);
            }
        }
        const u32 ballot = __ballot_sync(HS_FULL_MASK, take);
        if (ballot == 0) continue;
        i32 at = 0;
        if (lane == __ffs(ballot) - 1) at = atomicAdd(list_n, __popc(ballot));
        at = __shfl_sync(HS_FULL_MASK, at, __ffs(ballot) - 1);
        if (take) {
            list[at + __popc(ballot & ((1u << lane) - 1u))] = e;
            atomicMax(reinterpret_cast<unsigned long long*>(owner + d), ep | static_cast<u32>(e));
        }
    }
}

// The epoch a call's last block leaves for the next call. Marks keep the epoch's low 32 bits, so on
// the call before they would wrap (every 2^32 calls) that block first clears every mark: a mark of
// an old epoch must never outrank a new one under atomicMax. Every thread of the last block calls it.
__device__ __forceinline__ u64 vg_next_epoch(const u64* epoch, u64* owner, i64 owner_rows) {
    const u64 now = __ldcg(epoch);
    if (static_cast<u32>(now + 1) != 0u) return now + 1;
    for (i64 d = threadIdx.x; d < owner_rows; d += blockDim.x) owner[d] = 0;
    return 1;
}

// Copies the listed entries whose destination mark is their own: host row src[e] (zero-fill where
// src[e] >= host_rows) into hot row dst[e]. Grid-stride over list_n[0] * HS_SLOTS 16-byte slots.
// ctl[0] counts finished blocks; the last resets list_n and advances the epoch.
// Slot j of host row g bound for hot row d: its 16 bytes and where they go (`to` left as it was for a
// slot past the row; slots follow the host side's 128-byte lines); no source row (g >= host_rows)
// gives zeros, not stale bytes.
__device__ __forceinline__ void vg_slot(const unsigned char* host, i64 host_rows, unsigned char* hot, i64 block_stride,
                                        i32 bs, i32 d, i64 g, i32 j, uint4& v, unsigned char*& to) {
    unsigned char* into = hot + static_cast<i64>(d / bs) * block_stride + static_cast<i64>(d % bs) * HS_ROW_BYTES;
    if (g < host_rows) {
        const unsigned char* from = host + g * HS_ROW_BYTES;
        const i32 pos = j * 16 - static_cast<i32>(reinterpret_cast<u64>(from) & 127);
        if (pos >= 0 && pos < HS_ROW_BYTES) {
            v = hs_load16(from + pos);
            to = into + pos;
        }
    } else if (j < HS_VEC) {
        v = make_uint4(0, 0, 0, 0);
        to = into + j * 16;
    }
}

extern "C" __global__ void __launch_bounds__(HS_GNT) hisparse_vllm_copy(
    const i32* __restrict__ src, const i32* __restrict__ dst, const unsigned char* host, i64 host_rows,
    unsigned char* hot, i64 block_stride, i32 bs, u64* owner, u64* epoch, const i32* list, i32* list_n,
    u32* ctl, i64 owner_rows) {
    asm volatile("griddepcontrol.wait;" ::: "memory");  // launched to overlap the mark kernel
    const i32 n = list_n[0];
    if (n == 0) return;  // nothing marked: nothing to reset
    const u64 ep = epoch[0] << 32;
    const u32 total = static_cast<u32>(n) * HS_SLOTS;
    const u32 stride = gridDim.x * HS_GNT;
    for (u32 first = blockIdx.x * HS_GNT + threadIdx.x; first < total; first += stride * HS_UNROLL) {
        uint4 v[HS_UNROLL];
        unsigned char* to[HS_UNROLL];
#pragma unroll
        for (i32 u = 0; u < HS_UNROLL; ++u) {
            const u32 c = first + u * stride;
            to[u] = nullptr;
            if (c >= total) continue;
            const i32 e = list[c / HS_SLOTS];
            if (e < 0) continue;  // a compact entry not taken
            const i32 j = static_cast<i32>(c % HS_SLOTS);
            const i32 d = dst[e];
            if (owner[d] != (ep | static_cast<u32>(e))) continue;  // a later entry writes this row
            const i64 g = src[e];
            unsigned char* into = hot + static_cast<i64>(d / bs) * block_stride + static_cast<i64>(d % bs) * HS_ROW_BYTES;
            if (g < host_rows) {
                const unsigned char* from = host + g * HS_ROW_BYTES;
                const i32 pos = j * 16 - static_cast<i32>(reinterpret_cast<u64>(from) & 127);
                if (pos >= 0 && pos < HS_ROW_BYTES) {
                    v[u] = hs_load16(from + pos);
                    to[u] = into + pos;
                }
            } else if (j < HS_VEC) {  // no source row: zeros, not stale bytes
                v[u] = make_uint4(0, 0, 0, 0);
                to[u] = into + j * 16;
            }
        }
#pragma unroll
        for (i32 u = 0; u < HS_UNROLL; ++u) {
            if (to[u] != nullptr) hs_store16(to[u], v[u]);
        }
    }
    __syncthreads();
    __shared__ u32 s_last;
    if (threadIdx.x == 0) {
        __threadfence();
        s_last = atomicAdd(ctl, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!s_last) return;  // block-uniform
    const u64 next = vg_next_epoch(epoch, owner, owner_rows);
    __syncthreads();  // every thread has read the epoch before it moves
    if (threadIdx.x == 0) {
        list_n[0] = 0;
        epoch[0] = next;
        ctl[0] = 0;
        __threadfence();
    }
}

// ---- hisparse_vllm_gather: mark + copy in ONE launch (HISPARSE_VLLM_GATHER=2, the default) -------
// The grid is capped on the host to blocks that are all co-resident (occupancy x SMs), so the one
// grid-wide barrier below cannot wait on a block that never runs: the kernel before it (the
// resolver) triggers its dependents only once all its blocks are resident and never waits on this
// grid, and this grid triggers its own dependents only once every block has arrived (a dependent
// launched earlier could take the SMs a late block of this grid needs).
// ctl: [0] finished copying blocks, [1] barrier arrivals, [2] barrier generation, [3] copying
// blocks (gather_plan), [4] the copy's ticket counter.
#define VG_DONE 0
#define VG_ARRIVED 1
#define VG_GEN 2
#define VG_COPIERS 3
#define VG_TICKET 4

// Arrives at the grid barrier; a block that copies (`copies`, block-uniform) waits there for every
// block, one that does not leaves at once. gather_plan counts its copying blocks first
// (`count_copiers`), so where no block took an entry nobody waits: one cheap launch.
__device__ __forceinline__ void vg_arrive(u32* ctl, bool copies, bool count_copiers) {
    __syncthreads();
    if (threadIdx.x == 0) {
        if (copies && count_copiers) atomicAdd(ctl + VG_COPIERS, 1u);
        volatile u32* gen = ctl + VG_GEN;
        const u32 g = *gen;  // read before arriving: it only moves once every block has arrived
        __threadfence();
        if (atomicAdd(ctl + VG_ARRIVED, 1u) == gridDim.x - 1) {
            atomicExch(ctl + VG_ARRIVED, 0u);
            __threadfence();
            atomicAdd(ctl + VG_GEN, 1u);
        } else if (copies) {
            while (*gen == g) __nanosleep(64);
        }
        __threadfence();
    }
    __syncthreads();
}

// The largest i in [0, m) with pre[i] <= k (pre non-decreasing, pre[0] = 0 <= k < pre[m]).
__device__ __forceinline__ i32 vg_segment(const i32* pre, i32 m, i32 k) {
    i32 lo = 0, hi = m;
    while (hi - lo > 1) {
        const i32 mid = (lo + hi) >> 1;
        if (pre[mid] <= k) lo = mid; else hi = mid;
    }
    return lo;
}

// pre[0..m] <- exclusive prefix sums of v(0..m-1) in shared memory (every thread calls it).
template <typename F>
__device__ __forceinline__ void vg_prefix(i32* pre, i32 m, F v) {
    i32 run = 0;
    for (i32 x0 = 0; x0 < m; x0 += HS_GNT) {
        const i32 x = x0 + static_cast<i32>(threadIdx.x);
        i32 tot;
        const i32 before = vr_scan(x < m ? v(x) : 0, tot);
        if (x < m) pre[x] = run + before;
        run += tot;
    }
    if (threadIdx.x == 0) pre[m] = run;
    __syncthreads();
}

// One pass of the copy: slots c = first + u * step (u < HS_UNROLL) below `slots`, the k-th listed
// entry's slot c % HS_SLOTS for k = c / HS_SLOTS. The host row is loaded together with the
// destination's mark (not after it: one round trip less before the PCIe read) and stored only where
// the mark is the entry's own, so of entries naming one destination the last wins.
__device__ __forceinline__ void vg_copy_pass(i32 mode, u32 first, u32 step, u32 slots, const i32* pre, i32 m, i32 K,
                                             i64 chunk, const i32* list, const i32* src, const i32* dst,
                                             i64 hot_rows, const u64* owner, u64 ep, const unsigned char* host,
                                             i64 host_rows, unsigned char* hot, i64 block_stride, i32 bs) {
    i32 e_r[HS_UNROLL], d_r[HS_UNROLL], g_r[HS_UNROLL];
#pragma unroll
    for (i32 u = 0; u < HS_UNROLL; ++u) {
        const u32 c = first + u * step;
        e_r[u] = -1;
        if (c >= slots) continue;
        const i32 k = static_cast<i32>(c / HS_SLOTS);
        const i32 s = vg_segment(pre, m, k);
        e_r[u] = mode == 0 ? s * K + (k - pre[s]) : __ldcg(list + s * chunk + (k - pre[s]));
    }
#pragma unroll
    for (i32 u = 0; u < HS_UNROLL; ++u) {
        d_r[u] = e_r[u] >= 0 ? dst[e_r[u]] : -1;
        g_r[u] = e_r[u] >= 0 ? src[e_r[u]] : -1;
    }
    uint4 v[HS_UNROLL];
    unsigned char* to[HS_UNROLL];
    u64 own[HS_UNROLL];
#pragma unroll
    for (i32 u = 0; u < HS_UNROLL; ++u) {
        const i32 d = d_r[u];
        const i64 g = g_r[u];
        to[u] = nullptr;
        own[u] = 0;
        if (d < 0 || d >= hot_rows || g < 0) continue;  // not taken
        own[u] = __ldcg(reinterpret_cast<const unsigned long long*>(owner + d));
        const i32 j = static_cast<i32>((first + u * step) % HS_SLOTS);
        vg_slot(host, host_rows, hot, block_stride, bs, d, g, j, v[u], to[u]);
    }
#pragma unroll
    for (i32 u = 0; u < HS_UNROLL; ++u) {
        if (to[u] != nullptr && own[u] == (ep | static_cast<u32>(e_r[u]))) hs_store16(to[u], v[u]);
    }
}

// ---- the barrier-free path of small gathers (hisparse_vllm_gather_local, HISPARSE_VLLM_GATHER_LOCAL) -----
// hisparse_vllm_gather's barrier orders every block's destination marks before any copy. Around it sit
// some ten dependent steps (the entries read, marks and their fence, the arrival, the spin, a ticket,
// the entries read again with their marks, the fence and count of finished blocks, the last block's
// epoch), which at a few dozen rows a request cost more than the copy's one PCIe round trip. A call of
// at most VG_LOCAL entries needs no exchange between blocks: every block reads all taken entries itself
// (from L2), finds each destination's last entry in a hash in its own shared memory, and copies its share
// of the 16-byte slots. Nothing is left behind for the next call (no marks, counters or epoch).
// kCap (VG_LOCAL or VG_LOCAL_4K): the entries of a call the path takes at most (gather_compact's counted
// entries); the one-round reads of every entry (vg_local_by_entry) take at most VG_LOCAL in either.
#define VG_LOCAL 2048              // hisparse_nvidia.vllm_ops.LOCAL_GATHER_ENTRIES
#define VG_LOCAL_4K 4096           // the bound of HISPARSE_VLLM_GATHER_LOCAL=3 and 4
#define VG_LR (VG_LOCAL / HS_GNT)  // entries a thread of the one-round reads
// dynamic shared memory of the path: 2 * kCap hash buckets (load at most 1/2; their keys, destination
// + 1, then their last entries), then each ranked entry's host row and destination (-1: no copy)
#define VG_LOCAL_BYTES(cap) (24 * (cap))
static_assert(VG_LOCAL % HS_GNT == 0 && VG_LOCAL % 1024 == 0 && VG_LOCAL_4K % VG_LOCAL == 0, "VG_LOCAL's layout");

// Empties kCap's buckets (every thread calls it; a barrier follows before the first insert).
template <i32 kCap>
__device__ __forceinline__ void vg_local_clear(unsigned char* smem) {
    static_assert((16 * kCap) % (16 * HS_GNT) == 0, "whole 16-byte rounds");
    uint4* p = reinterpret_cast<uint4*>(smem) + threadIdx.x;
#pragma unroll
    for (i32 i = 0; i < kCap / HS_GNT; ++i) p[i * HS_GNT] = make_uint4(0, 0, 0, 0);
}

// This block's share [lo, hi) of a call's T * HS_SLOTS slots: an even split over the grid, at least one
// slot a thread (so a small call's host reads are spread over several SMs, each with all of them in
// flight at once). False where the block has none (T = 0 included): block-uniform.
__device__ __forceinline__ bool vg_local_share(i32 T, u32& lo, u32& hi) {
    const u32 slots = static_cast<u32>(T) * HS_SLOTS;
    u32 per = (slots + gridDim.x - 1) / gridDim.x;
    per = (max(per, static_cast<u32>(HS_GNT)) + 31u) & ~31u;
    lo = blockIdx.x * per;
    hi = min(lo + per, slots);
    return lo < slots;
}

// Ranks of the taken entries tid + i * HS_GNT in entry order (every block the same); returns their
// number. Once a launch (its shared words are not reused).
__device__ __forceinline__ i32 vg_rank(const bool (&take)[VG_LR], i32 (&k)[VG_LR]) {
    __shared__ i32 s_cnt[VG_LOCAL / 32 + 1];  // taken entries of each (round, warp), i-major: entry order
    const i32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 bal[VG_LR];
#pragma unroll
    for (i32 i = 0; i < VG_LR; ++i) {
        bal[i] = __ballot_sync(HS_FULL_MASK, take[i]);
        if (lane == 0) s_cnt[i * (HS_GNT / 32) + warp] = __popc(bal[i]);
    }
    __syncthreads();
    if (warp == 0) {  // exclusive scan of the VG_LOCAL / 32 counts, VG_LOCAL / 1024 a lane
        constexpr i32 kPer = VG_LOCAL / 1024;
        i32 c[kPer], sum = 0;
#pragma unroll
        for (i32 j = 0; j < kPer; ++j) sum += c[j] = s_cnt[lane * kPer + j];
        i32 x = sum;
#pragma unroll
        for (i32 o = 1; o < 32; o <<= 1) {
            const i32 y = __shfl_up_sync(HS_FULL_MASK, x, o);
            if (lane >= o) x += y;
        }
        i32 run = x - sum;
#pragma unroll
        for (i32 j = 0; j < kPer; ++j) {
            s_cnt[lane * kPer + j] = run;
            run += c[j];
        }
        if (lane == 31) s_cnt[VG_LOCAL / 32] = x;
    }
    __syncthreads();
    const u32 below = (1u << lane) - 1u;
#pragma unroll
    for (i32 i = 0; i < VG_LR; ++i)
        k[i] = take[i] ? s_cnt[i * (HS_GNT / 32) + warp] + __popc(bal[i] & below) : -1;
    return s_cnt[VG_LOCAL / 32];
}

// The copy of T ranked entries within [lo, hi) of their slots: thread entries e[i] of rank k[i] (-1:
// none) with host row g[i] and destination d[i] (-1: not taken), kLR a thread. Every block hashes every
// taken destination with its largest entry, so of entries naming one destination only the last is
// copied, as in the reference.
template <i32 kCap, i32 kLR>
__device__ __forceinline__ void vg_local_copy(u32 lo, u32 hi, const i32 (&e)[kLR], const i32 (&k)[kLR],
                                              const i32 (&g)[kLR], const i32 (&d)[kLR],
                                              const unsigned char* host, i64 host_rows, unsigned char* hot,
                                              i64 block_stride, i32 bs, unsigned char* smem) {
    constexpr u32 kB = 2 * kCap;  // buckets, a power of two
    constexpr i32 kBits = kCap == VG_LOCAL_4K ? 13 : 12;
    static_assert((kCap == VG_LOCAL || kCap == VG_LOCAL_4K) && kB == 1u << kBits, "the hash's size");
    u32* key = reinterpret_cast<u32*>(smem);
    u32* last = key + kB;
    i32* s_g = reinterpret_cast<i32*>(last + kB);
    i32* s_d = s_g + kCap;
    u32 b[kLR];
#pragma unroll
    for (i32 i = 0; i < kLR; ++i) {
        b[i] = 0;
        if (k[i] < 0) continue;
        s_g[k[i]] = g[i];
        s_d[k[i]] = d[i];
        if (d[i] < 0) continue;
        const u32 want = static_cast<u32>(d[i]) + 1u;
        b[i] = (static_cast<u32>(d[i]) * 2654435761u) >> (32 - kBits);
        while (true) {
            const u32 cur = atomicCAS(key + b[i], 0u, want);
            if (cur == 0u || cur == want) break;
            b[i] = (b[i] + 1u) & (kB - 1u);
        }
        atomicMax(last + b[i], static_cast<u32>(e[i]));
    }
    __syncthreads();
#pragma unroll
    for (i32 i = 0; i < kLR; ++i) {
        if (k[i] >= 0 && d[i] >= 0 && last[b[i]] != static_cast<u32>(e[i])) s_d[k[i]] = -1;  // a later entry wins
    }
    __syncthreads();
    for (u32 first = lo + threadIdx.x; first < hi; first += HS_GNT * HS_UNROLL) {
        uint4 v[HS_UNROLL];
        unsigned char* to[HS_UNROLL];
#pragma unroll
        for (i32 u = 0; u < HS_UNROLL; ++u) {
            const u32 c = first + u * HS_GNT;
            to[u] = nullptr;
            if (c >= hi) continue;
            const i32 x = static_cast<i32>(c / HS_SLOTS), j = static_cast<i32>(c % HS_SLOTS);
            const i32 dd = s_d[x];
            if (dd < 0) continue;
            const i64 gg = s_g[x];
            vg_slot(host, host_rows, hot, block_stride, bs, dd, gg, j, v[u], to[u]);
        }
#pragma unroll
        for (i32 u = 0; u < HS_UNROLL; ++u) {
            if (to[u] != nullptr) hs_store16(to[u], v[u]);
        }
    }
}

// Both gathers where rows x top-k <= VG_LOCAL: one round of loads reads every entry (row, destination,
// and its row's count or its mask and state row), then the taken ones are ranked in entry order.
// gather_plan also writes att, entries tid + i * HS_GNT by block i % grid.
template <i32 kCap>
__device__ __forceinline__ void vg_local_by_entry(i32 mode, const i32* src, const i32* dst,
                                                  const i32* __restrict__ counts, const i32* __restrict__ mask,
                                                  const i32* __restrict__ rsi, i32* __restrict__ att, i64 att_stride,
                                                  i32 bs, i32 n, i32 K, i64 hot_rows, const unsigned char* host,
                                                  i64 host_rows, unsigned char* hot, i64 block_stride,
                                                  unsigned char* smem) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // no barrier on this path
    const i32 NE = n * K;
    i32 e[VG_LR], g[VG_LR], d[VG_LR], mk[VG_LR], rq[VG_LR];
#pragma unroll
    for (i32 i = 0; i < VG_LR; ++i) {
        e[i] = static_cast<i32>(threadIdx.x) + i * HS_GNT;
        const bool in = e[i] < NE;
        const i32 r = in ? e[i] / K : 0;
        g[i] = in ? src[e[i]] : -1;
        d[i] = in ? dst[e[i]] : -1;
        mk[i] = !in ? 0 : mode == 0 ? counts[r] : mask[e[i]];
        rq[i] = in && mode == 1 && rsi != nullptr ? rsi[r] : 0;
    }
    bool take[VG_LR];
#pragma unroll
    for (i32 i = 0; i < VG_LR; ++i) {
        const bool in = e[i] < NE;
        const bool pad = rq[i] < 0;
        const bool chosen = mode == 0 ? e[i] % K < min(max(mk[i], 0), K) : mk[i] != 0 && !pad;
        take[i] = in && chosen && g[i] >= 0 && d[i] >= 0 && d[i] < hot_rows;
        if (mode == 1 && in && att != nullptr && i % static_cast<i32>(gridDim.x) == static_cast<i32>(blockIdx.x))
            att[e[i]] = (pad || d[i] < 0) ? -1 : vr_attention(d[i], bs, att_stride);
    }
    i32 k[VG_LR];
    const i32 T = vg_rank(take, k);
    u32 lo, hi;
    if (!vg_local_share(T, lo, hi)) return;
    vg_local_copy<kCap>(lo, hi, e, k, g, d, host, host_rows, hot, block_stride, bs, smem);
}

// gather_compact after its row prefix sums `pre` (T = pre[n] <= kCap counted entries): the k-th counted
// entry in request-major order is rank k; one round of loads reads the block's ranks' entries.
template <i32 kCap>
__device__ __forceinline__ void vg_local_compact(i32 T, const i32* pre, const i32* src, const i32* dst, i32 n,
                                                 i32 K, i64 hot_rows, const unsigned char* host, i64 host_rows,
                                                 unsigned char* hot, i64 block_stride, i32 bs, unsigned char* smem) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // no barrier on this path
    u32 lo, hi;
    if (!vg_local_share(T, lo, hi)) return;
    constexpr i32 kLR = kCap / HS_GNT;
    i32 e[kLR], k[kLR], g[kLR], d[kLR];
#pragma unroll
    for (i32 i = 0; i < kLR; ++i) {
        k[i] = static_cast<i32>(threadIdx.x) + i * HS_GNT;
        e[i] = -1;
        if (k[i] < T) {
            const i32 r = vg_segment(pre, n, k[i]);
            e[i] = r * K + (k[i] - pre[r]);
        } else {
            k[i] = -1;
        }
    }
#pragma unroll
    for (i32 i = 0; i < kLR; ++i) {
        g[i] = e[i] >= 0 ? src[e[i]] : -1;
        d[i] = e[i] >= 0 ? dst[e[i]] : -1;
    }
#pragma unroll
    for (i32 i = 0; i < kLR; ++i) {
        if (!(g[i] >= 0 && d[i] >= 0 && d[i] < hot_rows)) d[i] = -1;  // counted, not taken
    }
    vg_local_copy<kCap>(lo, hi, e, k, g, d, host, host_rows, hot, block_stride, bs, smem);
}

// Grid: (blocks <= co-resident blocks, 1, 1); block: HS_GNT; dynamic shared memory 4 * (m + 1)
// bytes, m = rows (mode 0) or blocks (mode 1).
//   mode 0 (gather_compact): every block sums the clamped counts first, so a call with nothing to
//     copy ends there (one launch, no barrier, no state touched). Entries are numbered request-major
//     (k-th taken entry over rows), marked, then after the barrier copied in that order by every block.
//   mode 1 (gather_plan): block b takes a contiguous chunk of entries, writes att, marks its taken
//     entries and lists them in entry order at list[b * chunk ...]; only blocks that took an entry
//     wait at the barrier and copy (none where nothing is taken: one cheap launch); the copy walks
//     every block's list in block order, so in entry (request-major) order.
//   The copying blocks take chunks of HS_GNT * HS_UNROLL slots from a ticket counter in order, as
//     native's plan copy (copy.cu) does, so the host reads in flight cover a narrow band of the list,
//     a block that starts late (an SM still busy with the resolver) does not hold the end back, and
//     in gather_plan the blocks that took no entry (gone at the barrier) leave no share uncopied.
// Of entries naming one destination the largest entry index wins (its mark), as in the reference;
// marks carry the epoch, which the last block to finish copying advances.
// kLocal: hisparse_vllm_gather_local (see there) with the bound kCap; `local` its kernel argument.
template <bool kLocal, i32 kCap = VG_LOCAL>
__device__ __forceinline__ void vg_gather(
    i32 mode, const i32* src, const i32* dst, const i32* __restrict__ counts, const i32* __restrict__ mask,
    const i32* __restrict__ rsi, i32* __restrict__ att, i64 att_stride, i32 bs, i32 n, i32 K, i64 hot_rows,
    const unsigned char* host, i64 host_rows, unsigned char* hot, i64 block_stride, u64* owner, u64* epoch,
    i32* list, i32* part, u32* ctl, i32 local) {
    extern __shared__ __align__(16) unsigned char vg_smem[];
    i32* pre = reinterpret_cast<i32*>(vg_smem + (kLocal ? VG_LOCAL_BYTES(kCap) : 0));
    __shared__ u32 s_ticket[2];
    if (kLocal) vg_local_clear<kCap>(vg_smem);  // before the wait: the table is the block's own
    asm volatile("griddepcontrol.wait;" ::: "memory");  // launched to overlap the resolver: its plan
    const i64 NE = static_cast<i64>(n) * K;
    if (kLocal && NE <= VG_LOCAL && (mode == 1 || local == 2)) {
        vg_local_by_entry<kCap>(mode, src, dst, counts, mask, rsi, att, att_stride, bs, n, K, hot_rows, host, host_rows,
                          hot, block_stride, vg_smem);
        return;
    }
    const u64 ep = epoch[0] << 32;
    const i32 tid = threadIdx.x;
    const i64 chunk = (NE + gridDim.x - 1) / gridDim.x;
    i32 m;
    bool copies = true;
    if (mode == 0) {
        m = n;
        bool any = false;  // a clamped count > 0 (K >= 1)
        for (i32 x = tid; x < n; x += HS_GNT) any |= counts[x] > 0;
        if (!__syncthreads_or(any)) return;  // every block sees it: nothing taken, nothing marked
        vg_prefix(pre, n, [&](i32 x) { return min(max(counts[x], 0), K); });
        const i32 total = pre[n];
        if (kLocal && total <= kCap) {  // grid-uniform: every block summed the same counts
            vg_local_compact<kCap>(total, pre, src, dst, n, K, hot_rows, host, host_rows, hot, block_stride, bs, vg_smem);
            return;
        }
        for (i32 k = blockIdx.x * HS_GNT + tid; k < total; k += gridDim.x * HS_GNT) {
            const i32 r = vg_segment(pre, n, k);
            const i32 e = r * K + (k - pre[r]);
            const i32 g = src[e], d = dst[e];
            if (g >= 0 && d >= 0 && d < hot_rows)
                atomicMax(reinterpret_cast<unsigned long long*>(owner + d), ep | static_cast<u32>(e));
        }
        vg_arrive(ctl, true, false);
    } else {
        const i64 lo = blockIdx.x * chunk, hi = min(lo + chunk, NE);
        i32 cnt = 0;
        for (i64 e0 = lo; e0 < hi; e0 += HS_GNT * HS_UNROLL) {
            // HS_UNROLL entries a thread: every load of the round issued before the first is used
            i32 g[HS_UNROLL], d[HS_UNROLL], mk[HS_UNROLL], rq[HS_UNROLL];
#pragma unroll
            for (i32 u = 0; u < HS_UNROLL; ++u) {
                const i64 e = e0 + u * HS_GNT + tid;
                const bool in = e < hi;
                g[u] = in ? src[e] : -1;
                d[u] = in ? dst[e] : -1;
                mk[u] = in ? mask[e] : 0;
                rq[u] = in && rsi != nullptr ? rsi[e / K] : 0;
            }
            bool take[HS_UNROLL], any = false;
#pragma unroll
            for (i32 u = 0; u < HS_UNROLL; ++u) {
                const i64 e = e0 + u * HS_GNT + tid;
                const bool pad = rq[u] < 0;
                take[u] = e < hi && g[u] >= 0 && d[u] >= 0 && d[u] < hot_rows && !pad && mk[u] != 0;
                any |= take[u];
                if (e < hi && att != nullptr) att[e] = (pad || d[u] < 0) ? -1 : vr_attention(d[u], bs, att_stride);
                if (take[u]) atomicMax(reinterpret_cast<unsigned long long*>(owner + d[u]), ep | static_cast<u32>(e));
            }
            if (!__syncthreads_or(any)) continue;  // block-uniform: nothing to list this round
#pragma unroll
            for (i32 u = 0; u < HS_UNROLL; ++u) {  // listed in entry order
                i32 tot;
                const i32 before = vr_scan(take[u] ? 1 : 0, tot);
                if (take[u]) list[lo + cnt + before] = static_cast<i32>(e0 + u * HS_GNT + tid);
                cnt += tot;
            }
        }
        if (tid == 0) part[blockIdx.x] = cnt;
        copies = cnt > 0;
        vg_arrive(ctl, copies, true);
        if (!copies) return;  // arrived; another block copies what there is (none may)
    }
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // every block has arrived
    const u32 copiers = mode == 0 ? gridDim.x : __ldcg(ctl + VG_COPIERS);
    m = mode == 0 ? n : static_cast<i32>(gridDim.x);
    if (mode == 1) vg_prefix(pre, m, [&](i32 x) { return __ldcg(part + x); });  // L2: other blocks wrote them
    const i32 total = pre[m];
    const u32 slots = static_cast<u32>(total) * HS_SLOTS;
    if (tid == 0) s_ticket[0] = atomicAdd(ctl + VG_TICKET, 1u);
    __syncthreads();
    for (u32 it = 0;; ++it) {
        const u32 t = s_ticket[it & 1u];
        const u32 c0 = t * (HS_GNT * HS_UNROLL);
        if (c0 >= slots) break;  // block-uniform
        if (tid == 0) s_ticket[(it & 1u) ^ 1u] = atomicAdd(ctl + VG_TICKET, 1u);  // overlaps the copy
        vg_copy_pass(mode, c0 + tid, HS_GNT, slots, pre, m, K, chunk, list, src, dst, hot_rows, owner, ep, host,
                     host_rows, hot, block_stride, bs);
        __syncthreads();
    }
    __shared__ u32 s_last;
    if (tid == 0) {
        __threadfence();
        s_last = atomicAdd(ctl + VG_DONE, 1u) == copiers - 1;  // the last copying block: resets for the next call
    }
    __syncthreads();
    if (!s_last) return;  // block-uniform
    const u64 next = vg_next_epoch(epoch, owner, hot_rows);
    __syncthreads();  // every thread has read the epoch before it moves
    if (tid == 0) {
        epoch[0] = next;
        ctl[VG_DONE] = 0;
        ctl[VG_COPIERS] = 0;
        ctl[VG_TICKET] = 0;
        __threadfence();
    }
}

extern "C" __global__ void __launch_bounds__(HS_GNT) hisparse_vllm_gather(
    i32 mode, const i32* src, const i32* dst, const i32* __restrict__ counts, const i32* __restrict__ mask,
    const i32* __restrict__ rsi, i32* __restrict__ att, i64 att_stride, i32 bs, i32 n, i32 K, i64 hot_rows,
    const unsigned char* host, i64 host_rows, unsigned char* hot, i64 block_stride, u64* owner, u64* epoch,
    i32* list, i32* part, u32* ctl) {
    vg_gather<false>(mode, src, dst, counts, mask, rsi, att, att_stride, bs, n, K, hot_rows, host, host_rows, hot,
                     block_stride, owner, epoch, list, part, ctl, 0);
}

// hisparse_vllm_gather with a barrier-free path (HISPARSE_VLLM_GATHER_LOCAL): a call of at most VG_LOCAL
// entries (gather_compact: taken by the clamped counts; gather_plan: rows x top-k) is served without
// destination marks, grid barrier, tickets or epoch (see vg_local_copy); larger calls take
// hisparse_vllm_gather's path in the same launch. Same arguments, and `local`: 1 = gather_compact reads
// the counts first, then the counted entries (two rounds of loads); 2 = where rows x top-k <= VG_LOCAL it
// reads every entry with its row's count in one round (more L2 traffic, one round trip less). Dynamic
// shared memory: VG_LOCAL_BYTES(VG_LOCAL), then hisparse_vllm_gather's.
extern "C" __global__ void __launch_bounds__(HS_GNT) hisparse_vllm_gather_local(
    i32 mode, const i32* src, const i32* dst, const i32* __restrict__ counts, const i32* __restrict__ mask,
    const i32* __restrict__ rsi, i32* __restrict__ att, i64 att_stride, i32 bs, i32 n, i32 K, i64 hot_rows,
    const unsigned char* host, i64 host_rows, unsigned char* hot, i64 block_stride, u64* owner, u64* epoch,
    i32* list, i32* part, u32* ctl, i32 local) {
    vg_gather<true, VG_LOCAL>(mode, src, dst, counts, mask, rsi, att, att_stride, bs, n, K, hot_rows, host,
                              host_rows, hot, block_stride, owner, epoch, list, part, ctl, local);
}

// hisparse_vllm_gather_local with gather_compact's bound at VG_LOCAL_4K counted entries (twice the shared
// memory, 96 KiB, and twice the entries a thread; the one-round reads and gather_plan keep VG_LOCAL).
// Dynamic shared memory: VG_LOCAL_BYTES(VG_LOCAL_4K), then hisparse_vllm_gather's.
extern "C" __global__ void __launch_bounds__(HS_GNT) hisparse_vllm_gather_local4k(
    i32 mode, const i32* src, const i32* dst, const i32* __restrict__ counts, const i32* __restrict__ mask,
    const i32* __restrict__ rsi, i32* __restrict__ att, i64 att_stride, i32 bs, i32 n, i32 K, i64 hot_rows,
    const unsigned char* host, i64 host_rows, unsigned char* hot, i64 block_stride, u64* owner, u64* epoch,
    i32* list, i32* part, u32* ctl, i32 local) {
    vg_gather<true, VG_LOCAL_4K>(mode, src, dst, counts, mask, rsi, att, att_stride, bs, n, K, hot_rows, host,
                                 host_rows, hot, block_stride, owner, epoch, list, part, ctl, local);
}

// Grid: (tokens); clears every slot of the token's state row holding its written row.
extern "C" __global__ void __launch_bounds__(HS_GNT) hisparse_vllm_invalidate(
    i32* dgi, i32 S, i32 H, const i32* __restrict__ rsi, i32 nr, const i32* __restrict__ req_ids,
    const i64* __restrict__ written) {
    const i32 req = req_ids[blockIdx.x];
    if (req < 0 || req >= nr) return;
    const i32 q = rsi[req];
    const i64 w = written[blockIdx.x];
    if (q < 0 || q >= S || w < 0 || w > 0x7fffffffll) return;
    i32* row = dgi + static_cast<i64>(q) * H;
    for (i32 s = threadIdx.x; s < H; s += blockDim.x) {
        if (row[s] == static_cast<i32>(w)) row[s] = -1;
    }
}
#endif  // VR_K
