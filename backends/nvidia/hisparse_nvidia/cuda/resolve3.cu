// The fused resolver, version 3 (docs/resolver-contract.md): one thread-block *cluster* per
// request (Hopper, sm_90). Same results as version 2 (resolve2.cu), plus an optional fused gather
// of the leader layer.
//
// Why a cluster: versions 1 and 2 gave a request one block (one SM), which then issues every
// instruction of 2048 entries and 4096 LRU positions alone; measured, the SM is bound by
// instructions issued (docs/gpu-validation.md). Here the request's work is split over HS_C blocks
// on HS_C SMs, which share the state through distributed shared memory (DSMEM):
//
// - Entries: block c holds the union entries of one row of the group (rho = c / HS_CR) and a
//   1 / HS_CR slice of that row's top-k, so per-row counts are sums over whole blocks and the
//   union's first-reference order is (block, warp, lane, item) order.
// - LRU positions: block c walks positions [c * PC, (c + 1) * PC); every block holds the whole
//   hot map (16 KB at 4096 hot rows, read from L2), so the walk reads what a slot holds locally.
// - The hash set of the union's host rows is partitioned by key: the top bits of a row's hash
//   name the block that holds its bucket. Buckets are 64-bit {first-reference j (later
//   -(slot + 1)), host row}: insert with a remote 64-bit CAS, a repeated key lowers j with a
//   CAS loop (a 64-bit atom.min is emulated by ptxas on the local block only, see hs_lower64).
// - Counts (valid, resident, host, unique; hits; misses) are published per warp into every
//   block's shared memory before a cluster barrier, so after it each warp reads its prefixes and
//   the totals locally, without a block barrier of its own.
//
// Phases and cluster barriers (B0 is split: arrive after emptying the buckets, wait before the
// first insert):
//   loads, classify | B0 | insert, publish | B1 | (no host entry: write outputs, exit)
//   walk: mark hit buckets, publish | B2 | (every unique row held: outputs of hits, skip to B5)
//   evictable ranks, flag misses, publish | B3 | victims (remote read of the evictable list),
//   hot map, plan | arrive B5 | outputs, LRU stores | wait B5, exit.
// A group where some row repeats a miss adds a barrier (B4) before the repeats read its slot; the
// fused gather waits at B5, stages its pairs from the finding blocks, and arrives/waits at B6.
// Measured costs of each step are in docs/gpu-validation.md (phase clocks).
//
// Compile-time constants (-D by the host):
//   HS_NT   threads per block (multiple of 32, at most 1024)
//   HS_C    blocks per cluster (1..8); HS_CR blocks per row of the group (HS_C % HS_CR == 0)
//   HS_EPT  entries per thread: ceil(top_k / (HS_CR * HS_NT))
//   HS_CPT  LRU positions per thread: ceil(hot_rows / (HS_C * HS_NT))
//   HS_VEC  16-byte vectors per row (for the fused gather)
//   HS_C * HS_NT / 32 <= 64 (published partials: two per lane)
//
// Dynamic shared memory, in this order (the host computes the same size):
//   pairs[Tc]  u64 buckets of this block's part of the hash set (Tc = 2^hash_bits)
//   hmf[H4]    i32 the state row's whole hot map (H4 = H rounded up to 4)
//   evl[PC]    i32 evictable slots of this block's positions, by evictable rank
//   gl[EC]     int2 (host row, device row) of the misses this block found, for the fused gather
//   gl2[EC+2]  int2 the pairs this block copies in the fused gather
//   htab[HB]   i32 the state row's hot_table row
#include "common.cuh"

#ifndef HS_NT
#error "HS_NT must be defined"
#endif
#ifndef HS_C
#error "HS_C must be defined"
#endif
#ifndef HS_CR
#define HS_CR HS_C
#endif
#ifndef HS_EPT
#error "HS_EPT must be defined"
#endif
#ifndef HS_CPT
#error "HS_CPT must be defined"
#endif
#ifndef HS_VEC
#define HS_VEC 41
#endif

#define HS_NW (HS_NT / 32)
#define HS_NP (HS_C * HS_NW)
#define HS_EC (HS_EPT * HS_NT)
#define HS_PC (HS_CPT * HS_NT)
#define HS_EMPTY 0xffffffffffffffffull
#define HS_ROW_BYTES (HS_VEC * 16)

#if HS_NP > 64
#error "HS_C * HS_NT / 32 must be at most 64"
#endif
#if HS_C % HS_CR != 0
#error "HS_CR must divide HS_C"
#endif

// ---- Cluster primitives (a cluster of one block degenerates to block barriers) ---------------

__device__ __forceinline__ u32 hs_rank() {
#if HS_C > 1
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
#else
    return 0;
#endif
}

// Distributed shared memory is addressed with explicit shared::cluster instructions on 32-bit
// addresses (no generic pointers into another block's shared memory).
__device__ __forceinline__ u32 hs_saddr(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// The address of this block's shared byte `addr` in block `rank`'s shared memory.
__device__ __forceinline__ u32 hs_map(u32 addr, u32 rank) {
#if HS_C > 1
    u32 out;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(addr), "r"(rank));
    return out;
#else
    return addr;
#endif
}

#if HS_C > 1
#define HS_SPACE "shared::cluster"
#else
#define HS_SPACE "shared"
#endif

__device__ __forceinline__ i32 hs_ld32(u32 a) {
    i32 v;
    asm volatile("ld." HS_SPACE ".u32 %0, [%1];" : "=r"(v) : "r"(a) : "memory");
    return v;
}

__device__ __forceinline__ int2 hs_ld64x2(u32 a) {
    int2 v;
    asm volatile("ld." HS_SPACE ".v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(a) : "memory");
    return v;
}

__device__ __forceinline__ void hs_st32(u32 a, i32 v) {
    asm volatile("st." HS_SPACE ".u32 [%0], %1;" ::"r"(a), "r"(v) : "memory");
}

__device__ __forceinline__ void hs_st128(u32 a, int4 v) {
    asm volatile("st." HS_SPACE ".v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(a), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

__device__ __forceinline__ u64 hs_cas64(u32 a, u64 expect, u64 value) {
    u64 old;
    asm volatile("atom." HS_SPACE ".cas.b64 %0, [%1], %2, %3;" : "=l"(old) : "r"(a), "l"(expect), "l"(value) : "memory");
    return old;
}

// Lowers the first-reference index of a bucket whose key is already `word`'s key. A CAS loop:
// 64-bit atom.min has no native shared-memory form, and the emulation ptxas emits for it runs on
// the *calling* block's shared memory, which loses the update when the bucket is remote.
__device__ __forceinline__ void hs_lower64(u32 a, u64 seen, u64 word) {
    while (static_cast<u32>(seen) > static_cast<u32>(word)) {
        const u64 now = hs_cas64(a, seen, word);
        if (now == seen) break;
        seen = now;
    }
}

__device__ __forceinline__ void hs_arrive() {
#if HS_C > 1
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void hs_wait() {
#if HS_C > 1
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
    __syncthreads();
#endif
}

__device__ __forceinline__ void hs_cluster_sync() {
    hs_arrive();
    hs_wait();
}

// ---- Published per-warp partials -------------------------------------------------------------

// Lane k < HS_C of every warp stores the warp's value into block k's array at this warp's index.
__device__ __forceinline__ void hs_publish(i32* arr, i32 value, u32 rank) {
    const i32 lane = threadIdx.x & 31;
    if (lane < HS_C) hs_st32(hs_map(hs_saddr(arr + rank * HS_NW + (threadIdx.x >> 5)), lane), value);
}

__device__ __forceinline__ void hs_publish4(int4* arr, int4 value, u32 rank) {
    const i32 lane = threadIdx.x & 31;
    if (lane < HS_C) hs_st128(hs_map(hs_saddr(arr + rank * HS_NW + (threadIdx.x >> 5)), lane), value);
}

// Sum of parts[lo, hi) and of parts[0, me) over the HS_NP published partials. Warp-uniform.
struct HsSums {
    i32 total;
    i32 before;
};

__device__ __forceinline__ HsSums hs_sums(const i32* parts, i32 me) {
    const i32 lane = threadIdx.x & 31;
    const i32 a = lane < HS_NP ? parts[lane] : 0;
    const i32 b = lane + 32 < HS_NP ? parts[lane + 32] : 0;
    HsSums s;
    s.total = __reduce_add_sync(HS_FULL_MASK, a + b);
    s.before = __reduce_add_sync(HS_FULL_MASK, (lane < me ? a : 0) + (lane + 32 < me ? b : 0));
    return s;
}

// out[c] = parts[0] + ... + parts[c * HS_NW - 1]: what the blocks before block c published.
// Warp-uniform.
__device__ __forceinline__ void hs_block_prefixes(const i32* parts, i32 (&out)[HS_C]) {
    const i32 lane = threadIdx.x & 31;
    const i32 a = lane < HS_NP ? parts[lane] : 0;
    const i32 b = lane + 32 < HS_NP ? parts[lane + 32] : 0;
    i32 ia = a, ib = b;
#pragma unroll
    for (i32 d = 1; d < 32; d <<= 1) {
        const i32 ya = __shfl_up_sync(HS_FULL_MASK, ia, d);
        const i32 yb = __shfl_up_sync(HS_FULL_MASK, ib, d);
        if (lane >= d) {
            ia += ya;
            ib += yb;
        }
    }
    const i32 ta = __shfl_sync(HS_FULL_MASK, ia, 31);
#pragma unroll
    for (i32 c = 0; c < HS_C; ++c) {
        const i32 idx = c * HS_NW;
        out[c] = idx < 32 ? __shfl_sync(HS_FULL_MASK, ia - a, idx & 31) : ta + __shfl_sync(HS_FULL_MASK, ib - b, idx & 31);
    }
}

// The block holding item x of a list laid out block after block, block c's part starting at
// first[c] (non-decreasing): the last block whose part starts at or before x. Sets `start`.
__device__ __forceinline__ u32 hs_holder(const i32 (&first)[HS_C], i32 x, i32& start) {
    u32 b = 0;
    start = first[0];
#pragma unroll
    for (i32 c = 1; c < HS_C; ++c) {
        if (first[c] <= x) {
            b = static_cast<u32>(c);
            start = first[c];
        }
    }
    return b;
}

// Exclusive in-warp prefix of x (uniform call).
__device__ __forceinline__ i32 hs_warp_excl(i32 x) {
    const i32 lane = threadIdx.x & 31;
    i32 incl = x;
#pragma unroll
    for (i32 d = 1; d < 32; d <<= 1) {
        const i32 y = __shfl_up_sync(HS_FULL_MASK, incl, d);
        if (lane >= d) incl += y;
    }
    return incl - x;
}

// The block holding host row g's bucket and the bucket's index there (any cluster size: the
// product hash * HS_C splits into an owner, its high word, and a uniform fraction).
__device__ __forceinline__ u32 hs_bucket(i32 g, u32 shift, u32& owner) {
    const u32 hh = static_cast<u32>(g) * 2654435761u;
    owner = HS_C > 1 ? __umulhi(hh, HS_C) : 0u;
    return (hh * HS_C) >> shift;
}

// Sum over parts[stride * i + comp] for i in [lo, hi) of the HS_NP partials. Warp-uniform.
__device__ __forceinline__ i32 hs_sum_of(const i32* parts, i32 stride, i32 comp, i32 lo, i32 hi) {
    const i32 lane = threadIdx.x & 31;
    const i32 a = lane < HS_NP && lane >= lo && lane < hi ? parts[stride * lane + comp] : 0;
    const i32 b = lane + 32 < HS_NP && lane + 32 >= lo && lane + 32 < hi ? parts[stride * (lane + 32) + comp] : 0;
    return __reduce_add_sync(HS_FULL_MASK, a + b);
}

__device__ __forceinline__ i32 hs_range_sum(const i32* parts, i32 lo, i32 hi) {
    return hs_sum_of(parts, 1, 0, lo, hi);
}

// Writes a padding row (every entry -1, counts 0), this block's share of it.
__device__ __forceinline__ void hs_pad_row(i32 row, i32 K, u32 rank, i32* out_rows, i32* out_valid,
                                           i32* plan_host, i32* plan_device, i32* plan_counts) {
    const i64 base = static_cast<i64>(row) * K;
#pragma unroll 1
    for (i32 i = rank * HS_NT + threadIdx.x; i < K; i += HS_C * HS_NT) {
        out_rows[base + i] = -1;
        plan_host[base + i] = -1;
        plan_device[base + i] = -1;
    }
    if (rank == 0 && threadIdx.x == 0) {
        out_valid[row] = 0;
        plan_counts[row] = 0;
    }
}

#if HS_C > 1
#define HS_CLUSTER __cluster_dims__(HS_C, 1, 1)
#else
#define HS_CLUSTER
#endif

extern "C" __global__ void HS_CLUSTER __launch_bounds__(HS_NT) hisparse_resolve(
    const i32* __restrict__ topk,            // [B, K]
    const i32* __restrict__ row_state,       // [B]
    const i32* __restrict__ seq_lens,        // [B]
    const i32* __restrict__ source_table,    // [R, P]
    const i32* __restrict__ resident_table,  // [R, P]
    const i32* __restrict__ hot_table,       // [R, HB]
    i32* __restrict__ hot_map,               // [R, H]
    i16* __restrict__ lru,                   // [R, H]
    i32* __restrict__ out_rows,              // [Bmax, K]
    i32* __restrict__ out_valid,             // [Bmax]
    i32* __restrict__ plan_host,             // [Bmax, K]
    i32* __restrict__ plan_device,           // [Bmax, K]
    i32* __restrict__ plan_counts,           // [Bmax]
    u64* __restrict__ stats,                 // [5]: resident, hits, misses, h2d, d2h
    i32 B, i32 Bmax, HsDiv Kd, i32 H, i32 P, HsDiv bsd, i32 rpr, i32 hash_bits,
    const unsigned char* gather_host,        // leader layer's host rows (device-mapped), or null
    unsigned char* gather_dev,               // leader layer's device cache
    i64 gather_stride,                       // bytes between its device blocks
    i64 host_rows, i64 dev_rows,
    u64* __restrict__ prof) {                // diagnostics: phase clocks of cluster 0's block 0, or null
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const u32 rank = hs_rank();
    const i32 r = blockIdx.x / HS_C;  // the cluster's batch row
    const i32 tid = threadIdx.x;
    const i32 warp = tid >> 5;
    const i32 K = Kd.d;
    const i32 bs = bsd.d;
    const bool profiling = prof != nullptr && blockIdx.x == 0 && tid == 0;
#define HS_MARK(k) \
    if (profiling) prof[k] = clock64()
    HS_MARK(0);

    // Clusters past the batch write the padding rows B..Bmax-1 between them.
    if (r >= B) {
#pragma unroll 1
        for (i32 row = r; row < Bmax; row += gridDim.x / HS_C - B) {
            hs_pad_row(row, K, rank, out_rows, out_valid, plan_host, plan_device, plan_counts);
        }
        return;
    }

    extern __shared__ __align__(16) unsigned char hs_smem[];
    const i32 T = 1 << hash_bits;
    u64* pairs = reinterpret_cast<u64*>(hs_smem);
    i32* hmf = reinterpret_cast<i32*>(pairs + T);
    i32* evl = hmf + ((H + 3) & ~3);
    int2* gl = reinterpret_cast<int2*>(evl + HS_PC);
    i32* htab = reinterpret_cast<i32*>(gl + 2 * HS_EC + 2);

    __shared__ int4 p_count[HS_NP];  // per warp: valid, resident, host entries, unique host rows
    __shared__ i32 p_hit[HS_NP];
    __shared__ i32 p_miss[HS_NP];
    __shared__ i32 p_dup[HS_NP];
    i32* p_count_i = reinterpret_cast<i32*>(p_count);

    // Empty this block's buckets, and let the others know once they are (release).
    {
        int4* pv = reinterpret_cast<int4*>(pairs);
#pragma unroll 1
        for (i32 i = tid; i < (T >> 1); i += HS_NT) pv[i] = make_int4(-1, -1, -1, -1);
    }
    hs_arrive();  // B0 (its wait comes before the first insert)

    // ---- This block's top-k slice and context length, loaded before the group is known ----------
    // (in the same round trip as row_state; a row past the group is loaded and then dropped)
    const i32 rho = static_cast<i32>(rank) / HS_CR;                          // the group row of this block
    const i32 i0 = (static_cast<i32>(rank) % HS_CR) * HS_EC + tid * HS_EPT;  // first top-k index
    const i32 row = r + rho;
    const i64 rbase = static_cast<i64>(row) * K;
    i32 t_r[HS_EPT];
#pragma unroll
    for (i32 e = 0; e < HS_EPT; ++e) {
        const i32 i = i0 + e;
        t_r[e] = row < B && i < K ? topk[rbase + i] : -1;
    }
    const i32 len_any = row < B ? seq_lens[row] : 0;

    // ---- Which group does this cluster resolve? ------------------------------------------------
    i32 q;
    const i32 n = hs_group_at(row_state, r, B, rpr, q);
    if (n < 0) {  // written by the cluster of the group's first row
        hs_wait();  // B0: no block leaves while another may still be starting
        return;
    }
    if (q < 0) {
        hs_pad_row(r, K, rank, out_rows, out_valid, plan_host, plan_device, plan_counts);
        hs_wait();
        return;
    }

    // ---- Every per-state load at once ------------------------------------------------------
    const bool row_in = rho < n;
    const i32 len = row_in ? len_any : 0;  // entries of rows past the group classify as masked
    const i64 qH = static_cast<i64>(q) * H;
    const i64 qP = static_cast<i64>(q) * P;
    const i32 HB = bsd.div(H);
    const i32 pos0 = static_cast<i32>(rank) * HS_PC + tid * HS_CPT;  // first LRU position (and slot)
    i32 slot_r[HS_CPT];
#pragma unroll
    for (i32 k = 0; k < HS_CPT; ++k) {
        const i32 pos = pos0 + k;
        slot_r[k] = pos < H ? static_cast<i32>(lru[qH + pos]) : -1;
    }
    if ((H & 3) == 0) {
        const int4* src = reinterpret_cast<const int4*>(hot_map + qH);
#pragma unroll 1
        for (i32 i = tid; i < (H >> 2); i += HS_NT) reinterpret_cast<int4*>(hmf)[i] = src[i];
    } else {
#pragma unroll 1
        for (i32 i = tid; i < H; i += HS_NT) hmf[i] = hot_map[qH + i];
    }
#pragma unroll 1
    for (i32 i = tid; i < HB; i += HS_NT) htab[i] = hot_table[static_cast<i64>(q) * HB + i];
    i32 v_r[HS_EPT];  // output row if resident, -1 masked or null, -(2 + host row) host entry
#pragma unroll
    for (i32 e = 0; e < HS_EPT; ++e) {
        const i32 t = t_r[e];
        i32 v = -1;
        if (t >= 0 && t < len) {
            const i32 p = bsd.div(t);
            const i32 o = t - p * bs;
            if (p < P) {
                const i32 res = resident_table[qP + p];
                const i32 src = source_table[qP + p];
                v = res >= 0 ? res * bs + o : (src >= 0 ? -2 - (src * bs + o) : -1);
            }
        }
        v_r[e] = v;
    }

    // ---- Insert the host rows into the distributed hash set -----------------------------------
    HS_MARK(1);
    hs_wait();  // B0: every block's buckets are empty and every block runs
    HS_MARK(2);
    const u32 shift = 32u - static_cast<u32>(hash_bits);
    const u32 tmask = static_cast<u32>(T - 1);
    const i32 jbase = rho * K + i0;  // union index of entry 0 of this thread
    const u32 pairs_a = hs_saddr(pairs);
    u32 bucket_r[HS_EPT];  // shared::cluster address of each host entry's bucket
    i32 n_valid_t = 0, n_res_t = 0, n_host_t = 0, n_win_t = 0;
#pragma unroll
    for (i32 e = 0; e < HS_EPT; ++e) {
        const i32 v = v_r[e];
        bucket_r[e] = 0;
        n_valid_t += v != -1;
        n_res_t += v >= 0;
        if (v <= -2) {
            ++n_host_t;
            const i32 g = -2 - v;
            const u32 j = static_cast<u32>(jbase + e);
            const u64 word = (static_cast<u64>(static_cast<u32>(g)) << 32) | j;
            u32 owner;
            u32 h = hs_bucket(g, shift, owner);
            const u32 table = hs_map(pairs_a, owner);
            while (true) {
                const u64 prev = hs_cas64(table + 8 * h, HS_EMPTY, word);
                if (prev == HS_EMPTY) {
                    ++n_win_t;
                    break;
                }
                if (static_cast<i32>(prev >> 32) == g) {
                    hs_lower64(table + 8 * h, prev, word);
                    break;
                }
                h = (h + 1) & tmask;
            }
            bucket_r[e] = table + 8 * h;
        }
    }
    HS_MARK(3);
    hs_publish4(p_count, make_int4(__reduce_add_sync(HS_FULL_MASK, n_valid_t), __reduce_add_sync(HS_FULL_MASK, n_res_t),
                                  __reduce_add_sync(HS_FULL_MASK, n_host_t), __reduce_add_sync(HS_FULL_MASK, n_win_t)),
               rank);
    hs_cluster_sync();  // B1
    HS_MARK(4);

    const i32 me = static_cast<i32>(rank) * HS_NW + warp;  // this warp's index in the partials
    const i32 row_lo = rho * HS_CR * HS_NW;                 // partials of this block's group row
    const i32 row_hi = row_lo + HS_CR * HS_NW;
    const i32 n_host = hs_sum_of(p_count_i, 4, 2, 0, HS_NP);
    const i32 n_res = hs_sum_of(p_count_i, 4, 1, 0, HS_NP);
    const i32 n_uniq = hs_sum_of(p_count_i, 4, 3, 0, HS_NP);
    const i32 row_valid = hs_sum_of(p_count_i, 4, 0, row_lo, row_hi);
    const bool leader = rank % HS_CR == 0 && tid == 0;  // writes its group row's counts

    if (n_host == 0) {
        // ---- Resident fast path: nothing touches the hot state -------------------------------
#pragma unroll
        for (i32 e = 0; e < HS_EPT; ++e) {
            const i32 i = i0 + e;
            if (row_in && i < K) {
                out_rows[rbase + i] = v_r[e];
                plan_host[rbase + i] = -1;
                plan_device[rbase + i] = -1;
            }
        }
        if (leader && row_in) {
            out_valid[row] = row_valid;
            plan_counts[row] = 0;
        }
        if (rank == 0 && tid == 0 && n_res) atomicAdd(&stats[0], static_cast<u64>(n_res));
        HS_MARK(11);
        return;  // no block touches another's shared memory after B1
    }

    // ---- Walk: a slot is a hit if the row it holds is a key ----------------------------------
    u32 hflags = 0;
    {
        i32 g_r[HS_CPT];
#pragma unroll
        for (i32 k = 0; k < HS_CPT; ++k) g_r[k] = slot_r[k] >= 0 ? hmf[slot_r[k]] : -1;
        u32 tab_r[HS_CPT];
        u32 h_r[HS_CPT];
        i32 k0[HS_CPT];
#pragma unroll
        for (i32 k = 0; k < HS_CPT; ++k) {
            const i32 g = g_r[k];
            tab_r[k] = 0;
            h_r[k] = 0;
            k0[k] = -1;
            if (g >= 0) {
                u32 owner;
                h_r[k] = hs_bucket(g, shift, owner);
                tab_r[k] = hs_map(pairs_a, owner);
                // keys are the high words (+4): stable after B1 while the low words are being marked.
                // Each block's part of the set is at most 1/4 full (usually far less), so the first
                // bucket settles almost every lookup: one remote load.
                k0[k] = hs_ld32(tab_r[k] + 8 * h_r[k] + 4);
            }
        }
#pragma unroll
        for (i32 k = 0; k < HS_CPT; ++k) {
            const i32 g = g_r[k];
            i32 hb = -1;
            if (g >= 0 && k0[k] != -1) {
                if (k0[k] == g) {
                    hb = static_cast<i32>(h_r[k]);
                } else {  // a longer probe sequence
                    u32 h = (h_r[k] + 1) & tmask;
                    i32 key;
                    while ((key = hs_ld32(tab_r[k] + 8 * h + 4)) != -1) {
                        if (key == g) {
                            hb = static_cast<i32>(h);
                            break;
                        }
                        h = (h + 1) & tmask;
                    }
                }
            }
            if (hb >= 0) {
                hs_st32(tab_r[k] + 8 * hb, -(slot_r[k] + 1));
                hflags |= 1u << k;
            }
        }
    }
    HS_MARK(5);
    const i32 n_hit_t = __popc(hflags);
    const i32 h_excl_w = hs_warp_excl(n_hit_t);
    hs_publish(p_hit, __reduce_add_sync(HS_FULL_MASK, n_hit_t), rank);
    hs_cluster_sync();  // B2
    HS_MARK(6);

    // ---- Evictable ranks; outputs of hits; flag the misses ------------------------------------
    const HsSums hs = hs_sums(p_hit, me);
    const i32 n_hits = hs.total;
    const i32 n_ev = H - n_hits;
    const i32 hit_pre = hs.before + h_excl_w;  // hit positions before pos0
    // Every unique host row is held: no victim, no miss plan, no third barrier (uniform).
    const bool no_miss = n_uniq == n_hits;
    if (!no_miss) {
        // local evictable rank = local position - local hits before it
        const i32 hits_blk = hs.before - hs_range_sum(p_hit, static_cast<i32>(rank) * HS_NW, me);
        i32 hr = hit_pre - hits_blk;  // hits of this block before pos0
#pragma unroll
        for (i32 k = 0; k < HS_CPT; ++k) {
            if (slot_r[k] >= 0) {
                const bool hit = (hflags >> k) & 1u;
                if (!hit) evl[tid * HS_CPT + k - hr] = slot_r[k];
                hr += hit;
            }
        }
    }
    u32 mflags = 0;
    bool dup_t = false;
    i32 out_r[HS_EPT];
    i32 gslot_r[HS_EPT];
#pragma unroll
    for (i32 e = 0; e < HS_EPT; ++e) {
        out_r[e] = v_r[e];
        gslot_r[e] = 0;
        if (v_r[e] <= -2) {
            const i32 w = hs_ld32(bucket_r[e]);
            if (w == jbase + e) {
                mflags |= 1u << e;
            } else if (w < 0) {
                const i32 s = -w - 1;
                const i32 sb = bsd.div(s);
                out_r[e] = htab[sb] * bs + (s - sb * bs);
            } else {
                dup_t = true;  // repeats a miss first referenced by another entry
            }
        }
    }
    HS_MARK(7);
    const i32 n_miss_t = __popc(mflags);
    const i32 m_excl_w = hs_warp_excl(n_miss_t);
    if (!no_miss) {
        hs_publish(p_miss, __reduce_add_sync(HS_FULL_MASK, n_miss_t), rank);
        hs_publish(p_dup, static_cast<i32>(__any_sync(HS_FULL_MASK, dup_t)), rank);
        hs_cluster_sync();  // B3
    }
    HS_MARK(8);

    // ---- Victims, hot map, plan, outputs ------------------------------------------------------
    const HsSums ms = no_miss ? HsSums{0, 0} : hs_sums(p_miss, me);
    const i32 n_misses = ms.total;
    const i32 row_mbound = no_miss ? 0 : hs_range_sum(p_miss, 0, row_lo);   // misses before this group row
    const i32 row_misses = no_miss ? 0 : hs_range_sum(p_miss, row_lo, row_hi);  // misses of this group row
    const bool any_dup = !no_miss && hs_range_sum(p_dup, 0, HS_NP) != 0;
    // Evictable slots before each block c (positions before it, clamped to H, minus its hits
    // before it), held by every thread for the victim lookup.
    i32 ev_lo[HS_C];
    if (!no_miss) {
        hs_block_prefixes(p_hit, ev_lo);  // hits before each block
#pragma unroll
        for (i32 c = 0; c < HS_C; ++c) ev_lo[c] = min(c * HS_PC, H) - ev_lo[c];
    }
    i32 m = ms.before + m_excl_w;  // misses before this thread's first entry
    const i32 blk_miss_before = no_miss ? 0 : ms.before - hs_range_sum(p_miss, 0, static_cast<i32>(rank) * HS_NW);
    i32 lm = blk_miss_before + m_excl_w;  // this block's misses before this thread's first entry
#pragma unroll
    for (i32 e = 0; e < HS_EPT; ++e) {
        if ((mflags >> e) & 1u) {
            i32 lo;
            const u32 b = hs_holder(ev_lo, m, lo);  // the block holding E[m]
            const i32 s = hs_ld32(hs_map(hs_saddr(evl + (m - lo)), b));
            const i32 g = -2 - v_r[e];
            hot_map[qH + s] = g;
            const i32 sb = bsd.div(s);
            const i32 dev = htab[sb] * bs + (s - sb * bs);
            const i64 at = rbase + (m - row_mbound);
            plan_host[at] = g;
            plan_device[at] = dev;
            out_r[e] = dev;
            gslot_r[e] = -(s + 1);
            gl[lm] = make_int2(g, dev);
            ++m;
            ++lm;
        }
    }
    if (any_dup) {
#pragma unroll
        for (i32 e = 0; e < HS_EPT; ++e) {
            if ((mflags >> e) & 1u) hs_st32(bucket_r[e], gslot_r[e]);
        }
        hs_cluster_sync();  // B4: repeats may read their slot
#pragma unroll
        for (i32 e = 0; e < HS_EPT; ++e) {
            if (v_r[e] <= -2 && !((mflags >> e) & 1u) && out_r[e] <= -2) {
                const i32 s = -hs_ld32(bucket_r[e]) - 1;
                const i32 sb = bsd.div(s);
                out_r[e] = htab[sb] * bs + (s - sb * bs);
            }
        }
    }
    HS_MARK(9);
    // B5: after it no block reads another's shared memory, except the fused gather's pair lists
    // (read between B5 and B6)
    hs_arrive();

    // ---- Outputs, LRU order, counts --------------------------------------------------------
#pragma unroll
    for (i32 e = 0; e < HS_EPT; ++e) {
        const i32 i = i0 + e;
        if (row_in && i < K) {
            out_rows[rbase + i] = out_r[e];
            if (i >= row_misses) {
                plan_host[rbase + i] = -1;
                plan_device[rbase + i] = -1;
            }
        }
    }
    {
        const i32 keep = n_ev - n_misses;
        i32 hr = hit_pre;
#pragma unroll
        for (i32 k = 0; k < HS_CPT; ++k) {
            const i32 pos = pos0 + k;
            if (pos < H) {
                const bool hit = (hflags >> k) & 1u;
                const i32 er = pos - hr;  // evictable rank
                const i32 at = hit ? n_ev + hr : (er < n_misses ? keep + er : er - n_misses);
                lru[qH + at] = static_cast<i16>(slot_r[k]);
                hr += hit;
            }
        }
    }
    if (leader && row_in) {
        out_valid[row] = row_valid;
        plan_counts[row] = row_misses;
    }
    if (rank == 0 && tid == 0) {
        if (n_res) atomicAdd(&stats[0], static_cast<u64>(n_res));
        if (n_uniq - n_misses) atomicAdd(&stats[1], static_cast<u64>(n_uniq - n_misses));
        if (n_misses) atomicAdd(&stats[2], static_cast<u64>(n_misses));
        if (gather_host != nullptr && n_misses) atomicAdd(&stats[3], static_cast<u64>(n_misses) * HS_ROW_BYTES);
    }

    // ---- Fused gather of the leader layer ------------------------------------------------------
    // Block b copies misses [b * M / C, (b + 1) * M / C) of the cluster (whole rows; misses of one
    // request often come from a few neighbouring top-k slices, i.e. from one or two blocks, so
    // copying where they were found would leave the other SMs idle). Their (host row, device
    // row) pairs are first staged from the finding blocks' lists into this block's gl2.
    if (gather_host != nullptr && n_misses > 0) {
        hs_wait();  // B5: every block's gl is complete
        const i32 mb = static_cast<i32>(rank) * n_misses / HS_C;
        const i32 nb = (static_cast<i32>(rank) + 1) * n_misses / HS_C - mb;
        i32 mb_lo[HS_C];  // misses found before each block
        hs_block_prefixes(p_miss, mb_lo);
        int2* gl2 = gl + HS_EC;
#pragma unroll 1
        for (i32 x = tid; x < nb; x += HS_NT) {
            const i32 mm = mb + x;
            i32 lo;
            const u32 owner = hs_holder(mb_lo, mm, lo);  // the block that found miss mm
            gl2[x] = hs_ld64x2(hs_map(hs_saddr(gl + (mm - lo)), owner));
        }
        hs_arrive();  // B6: no shared memory of another block is read after this
        __syncthreads();  // gl2 complete
        const i32 total = nb * HS_VEC;
#pragma unroll 1
        for (i32 first = tid; first < total; first += 4 * HS_NT) {
            uint4 v[4];
            unsigned char* to[4];
#pragma unroll
            for (i32 u = 0; u < 4; ++u) {
                const i32 c = first + u * HS_NT;
                to[u] = nullptr;
                if (c < total) {
                    const i32 e = c / HS_VEC;
                    const i32 kk = c - e * HS_VEC;
                    const int2 pr = gl2[e];
                    if (pr.x < host_rows && pr.y < dev_rows) {
                        v[u] = hs_load16(gather_host + static_cast<i64>(pr.x) * HS_ROW_BYTES + kk * 16);
                        const i32 blk = bsd.div(pr.y);
                        to[u] = gather_dev + blk * gather_stride + static_cast<i64>(pr.y - blk * bs) * HS_ROW_BYTES +
                                kk * 16;
                    }
                }
            }
#pragma unroll
            for (i32 u = 0; u < 4; ++u) {
                if (to[u] != nullptr) hs_store16(to[u], v[u]);
            }
        }
    }
    HS_MARK(10);
    hs_wait();  // B5, or B6 after a fused gather
    HS_MARK(11);
}
