// The fused resolver (docs/resolver-contract.md): one thread block per batch row; the block of a
// group's first row resolves the whole group (the speculative rows of one request) as one union.
// What makes it fast (docs/gpu-validation.md has the measurements):
//
// - A slot hint per logical position. The runtime keeps `pos_slot[q, t]`, the slot last filled for
//   position t of state row q. A host entry whose hinted slot holds exactly its host row is a hit
//   found with one lookup: no hashing. A hint is only ever believed after that check, so a stale
//   hint (the slot refilled, invalidated or reset since) costs nothing but the slow path. Hints
//   are gathered after the classification, for host entries only.
// - The slow path is exact. Entries whose hint fails are *candidates*; they are hashed (64-bit
//   buckets {host row, first referencing entry}) and every held slot is looked up in that hash
//   during the LRU walk, so a candidate held in another slot (two pages of the request mapped to
//   one host block, or a page remapped since its row was loaded) is still a hit, as the contract
//   says. Candidates not found held are the misses, in first-reference order.
// - With no candidate (every host entry a hint hit, or none a host entry) the outputs are final
//   after barrier 2 and written then; the LRU walk and its prefix sums give the new order
//   directly (barrier 3), and unchanged positions are not rewritten.
// - Every size is a compile-time constant (the runtime compiles one build per RuntimeConfig), so
//   divisions, bounds and loop trips fold away and index arithmetic is 32-bit; a thread owns
//   consecutive entries and LRU positions and moves them with vector loads and stores. The block
//   is bound by the load/store pipe (a random gather costs about a cycle per cache line), so the
//   page-table rows are read whole into shared memory when they fit.
// - Plan entries past a row's count are -1 between launches, so a resolve clears only the entries
//   the last one wrote (it reads the old plan_counts first); a step without misses writes one
//   output array, not three.
//
// Compile-time constants (-D, from kernels.resolver_shape):
//   HS_NT threads per block (multiple of 32, at most 1024)   HS_K top_k   HS_H hot_rows
//   HS_BS block_size   HS_RPR rows_per_request   HS_P max_pages   HS_TBITS log2 of the hash
//   buckets   HS_TSMEM 1 to read the page-table rows into shared memory   HS_C blocks per group
//   (a thread-block cluster; default 1)
//
// Dynamic shared memory, in this order (kernels.resolver_shape computes the same size):
//   pairs[T]   u64 hash buckets of the candidates: high word the host row (all ones: empty), low
//              word the first referencing entry j, replaced by -(slot + 1) once the row is found
//              held
//   hm[H]      i32 hot_map row of the state row in slot order (padded to 16 bytes)
//   rtab[P], stab[P] i32 its resident_table and source_table rows (HS_TSMEM builds)
//   htab[HB]   i32 its hot_table row
//   order[H]   i16 slow path: hit slots packed forward from 0 in LRU order, evictable slots packed
//              backward from H-1 in LRU order (E[m] = order[H-1-m]); padded to 4 bytes
//   mark[H]    u8  1 for a slot an entry's hint found holding its row (padded to 4 bytes)
//   hint_in[U - LEAD] i16 (HS_C > 1, from a 16-byte boundary) the hints the helpers pushed
//
// Cluster builds (HS_C > 1, small batches): gathering 2,048 scattered hints is most of what the
// load/store pipe of one SM does on a step without misses, so the group's leader block (cluster
// rank 0) gathers only the first LEAD = U / HS_C entries' hints, and each other block of the
// cluster gathers one further share and pushes it into the leader's hint_in (st.async, counted on
// the leader's mbarrier). A hint is still believed only after the leader's hot-map check, so
// results are those of a one-block build. A cluster launch has blocks for the batch rows only;
// the helpers then write the output rows past the batch as padding (hs_pad_rows).
//
// Miss mask (builds with HS_K % 32 == 0): on a step with misses, the block sets bit E of
// miss_mask for each miss entry E = r * K + j (the group's words cleared first), so the
// speculative gather (copy.cu) can tell which of the rows it fetched early are the plan's.
//
// Victims flag (`victims`, when not null): the group's block stores victims[q] = 1 and a
// fence.sc before it refills any slot of q (hot map and position hints), 0 on a step without
// candidates; the speculative gather pairs it with its own fence to leave early where no entry
// can be a miss (copy.cu).
//
// Publishing the plan (`follow` = 1, when the plan copy of copy.cu follows): the block of a group
// marks plan_ready of its rows -1 (fenced) before barrier 1, and only then lets the dependent grid
// start; once the group's plan entries are written it stores each row's count there with release
// semantics. A padding row of the batch stores 0 first. So the copy starts on a request's plan as
// soon as its group is resolved, and never reads a count or plan entry older than this launch.
#include "common.cuh"

#if !defined(HS_NT) || !defined(HS_K) || !defined(HS_H) || !defined(HS_BS) || !defined(HS_RPR) || \
    !defined(HS_P) || !defined(HS_TBITS) || !defined(HS_TSMEM)
#error "resolve.cu needs HS_NT, HS_K, HS_H, HS_BS, HS_RPR, HS_P, HS_TBITS and HS_TSMEM"
#endif
#if HS_TSMEM && HS_P % 4
#error "page-table rows read whole into shared memory must be whole 16-byte vectors"
#endif

#ifndef HS_C
#define HS_C 1
#endif

#define HS_NW (HS_NT / 32)
#define HS_U (HS_RPR * HS_K)
#define HS_EPT ((HS_U + HS_NT - 1) / HS_NT)
#define HS_CPT ((HS_H + HS_NT - 1) / HS_NT)
#define HS_HB (HS_H / HS_BS)
#define HS_T (1 << HS_TBITS)
#define HS_EMPTY 0xffffffffffffffffull
#define HS_MASK (HS_K % 32 == 0)

static_assert(HS_NT % 32 == 0 && HS_NT <= 1024, "threads per block");
static_assert(HS_NW <= 32, "warp totals are reduced by one warp");
static_assert(HS_H % HS_BS == 0, "hot_rows is a multiple of block_size");
static_assert(HS_EPT <= 32 && HS_CPT <= 32, "per-thread flags are 32-bit masks");
static_assert(HS_T >= 2 * HS_U && HS_T % 2 == 0, "hash load factor at most 1/2");
static_assert(HS_RPR <= 32, "rows per request");

#define HS_LEAD (HS_U / HS_C)  // entries whose hints the leader gathers itself
#define HS_PUSH 8              // hints a helper thread pushes in one 16-byte store
static_assert(HS_C == 1 || (HS_C <= 8 && HS_K % HS_PUSH == 0 && HS_U % (HS_C * HS_PUSH) == 0 &&
                            HS_LEAD % HS_EPT == 0 && HS_LEAD / HS_PUSH <= HS_NT),
              "cluster builds: shares of whole 16-byte pushes, a leader thread's entries in one share");

// Entries move in vectors of HS_EV i32 (a thread's entries never straddle a vector boundary of a
// row when HS_EV divides both HS_EPT and HS_K); LRU positions in vectors of HS_LV i16.
#define HS_EV ((HS_EPT % 4 == 0 && HS_K % 4 == 0) ? 4 : ((HS_EPT % 2 == 0 && HS_K % 2 == 0) ? 2 : 1))
#define HS_LV ((HS_CPT % 4 == 0 && HS_H % 4 == 0) ? 4 : ((HS_CPT % 2 == 0 && HS_H % 2 == 0) ? 2 : 1))

// Knuth multiplicative hash of a non-negative host row into a table of 2^(32 - shift) buckets
// (the high bits of the product, which mix every key bit).
__device__ __forceinline__ u32 hs_hash(i32 key, u32 shift) {
    return (static_cast<u32>(key) * 2654435761u) >> shift;
}

// The group that batch row r starts (docs/resolver-contract.md): its length n >= 1, with its
// state row in q. 0 (q = -1) when row r is past B or a padding row, which its own block writes as
// padding; -1 when row r belongs to the group of an earlier row, whose block writes it.
__device__ __forceinline__ i32 hs_group_at(const i32* row_state, i32 r, i32 B, i32 rpr, i32& q) {
    q = -1;
    if (r >= B) return 0;
    const i32 state = row_state[r];
    if (state < 0) return 0;
    const i32 before = r > 0 ? row_state[r - 1] : -1;
    i32 back = 0;
    if (before == state) {
        back = 1;
        while (back < rpr && r - back - 1 >= 0 && row_state[r - back - 1] == state) ++back;
    }
    if (back == 0) {
        q = state;
        i32 n = 1;
        while (n < rpr && r + n < B && row_state[r + n] == state) ++n;
        return n;
    }
    return back < rpr ? -1 : 0;  // a run longer than rows_per_request: padding (trusted input only)
}

// hs_group_at, with both row-state loads of a one-row-per-request build in one round trip.
__device__ __forceinline__ i32 hs_group(const i32* row_state, i32 r, i32 B, i32& q) {
    if constexpr (HS_RPR == 1) {
        const i32 state = r < B ? row_state[r] : -1;
        const i32 before = r > 0 && r < B ? row_state[r - 1] : -1;
        q = state;
        if (state >= 0 && before != state) return 1;
        q = -1;
        return 0;  // padding, or a repeat of the row before: padding too (trusted input)
    } else {
        return hs_group_at(row_state, r, B, HS_RPR, q);
    }
}

#if HS_C > 1
__device__ __forceinline__ u32 hs_cluster_rank() {
    u32 x;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(x));
    return x;
}

// The address of the same shared variable in the leader block (rank 0).
__device__ __forceinline__ u32 hs_leader_addr(const void* p) {
    u32 x;
    asm volatile("mapa.shared::cluster.u32 %0, %1, 0;"
                 : "=r"(x) : "r"(static_cast<u32>(__cvta_generic_to_shared(p))));
    return x;
}

__device__ __forceinline__ void hs_cluster_arrive() { asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory"); }
__device__ __forceinline__ void hs_cluster_wait() { asm volatile("barrier.cluster.wait;" ::: "memory"); }

__device__ __forceinline__ void hs_mbar_wait(u64* bar) {
    const u32 a = static_cast<u32>(__cvta_generic_to_shared(bar));
    u32 done = 0;
    while (!done) {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(a) : "memory");
    }
}

__shared__ __align__(8) u64 hs_bar;  // the leader's: completes when every helper's hints landed

// Rows [B, Bmax) of a cluster launch (B * HS_C blocks) are written as padding by the helpers,
// one warp a row; a row already in that state (no valid entry, so every output -1, and no plan
// entry) is left as it is.
__device__ __forceinline__ void hs_pad_rows(i32 warp_id, i32 warps, i32 B, i32 Bmax, i32* __restrict__ out_rows,
                                            i32* __restrict__ out_valid, i32* __restrict__ plan_host,
                                            i32* __restrict__ plan_device, i32* __restrict__ plan_counts) {
    const i32 lane = threadIdx.x & 31;
    const int4 m1 = make_int4(-1, -1, -1, -1);
#pragma unroll 1
    for (i32 pr = B + warp_id; pr < Bmax; pr += warps) {
        const i32 valid = out_valid[pr];
        const i32 old = plan_counts[pr];
        if (valid == 0 && old == 0) continue;
#pragma unroll 1
        for (i32 i = lane * 4; i < HS_K; i += 128) {  // K % 8 == 0 in cluster builds
            *reinterpret_cast<int4*>(out_rows + pr * HS_K + i) = m1;
            if (i < old) {
                *reinterpret_cast<int4*>(plan_host + pr * HS_K + i) = m1;
                *reinterpret_cast<int4*>(plan_device + pr * HS_K + i) = m1;
            }
        }
        __syncwarp();  // every lane has read the old counts
        if (lane == 0) {
            out_valid[pr] = 0;
            plan_counts[pr] = 0;
        }
    }
}

// A helper block (cluster rank > 0) of the group starting at batch row r: gathers the position
// hints of entries [rank * LEAD, (rank + 1) * LEAD) of the union (-1 for masked, out-of-context
// or other groups' entries) and pushes them into the leader's hint_in. It makes the leader's
// decision about the row (group start, padding, another group's row) and pushes nothing unless
// the leader resolves the group, so the leader waits exactly when pushes come.
__device__ __forceinline__ void hs_help(u32 rank, const i32* __restrict__ topk, const i32* __restrict__ row_state,
                                        const i32* __restrict__ seq_lens, const i16* __restrict__ pos_slot,
                                        i16* hint_in, i32 r, i32 B) {
    const i32 tid = threadIdx.x;
    __builtin_assume(tid >= 0 && tid < HS_NT);
    const bool mine = tid < HS_LEAD / HS_PUSH;
    const i32 j0 = static_cast<i32>(rank) * HS_LEAD + tid * HS_PUSH;  // < U for pushing threads
    const i32 rho = j0 / HS_K;  // a push's entries are in one row (K % HS_PUSH == 0)
    i32 t[HS_PUSH];
    i32 len = 0;
    if (mine && r + rho < B) {
        const int4* p = reinterpret_cast<const int4*>(topk + (r + rho) * HS_K + (j0 - rho * HS_K));
#pragma unroll
        for (i32 v = 0; v < HS_PUSH / 4; ++v) {
            const int4 x = p[v];
            t[4 * v] = x.x; t[4 * v + 1] = x.y; t[4 * v + 2] = x.z; t[4 * v + 3] = x.w;
        }
        len = seq_lens[r + rho];
    } else {
#pragma unroll
        for (i32 i = 0; i < HS_PUSH; ++i) t[i] = -1;
    }
    i32 q;
    const i32 n = hs_group(row_state, r, B, q);
    if (n <= 0) return;  // the leader does not resolve from this row: it waits for no push
    hs_cluster_arrive();
    u32 w[HS_PUSH / 2];
    if (mine) {
        const i32 qP = q * HS_P;
        i32 h[HS_PUSH];
#pragma unroll
        for (i32 i = 0; i < HS_PUSH; ++i) {
            const i32 x = t[i];
            h[i] = rho < n && x >= 0 && x < len && x / HS_BS < HS_P ? pos_slot[qP * HS_BS + x] : -1;
        }
#pragma unroll
        for (i32 i = 0; i < HS_PUSH / 2; ++i) w[i] = (static_cast<u32>(h[2 * i]) & 0xffffu) | (static_cast<u32>(h[2 * i + 1]) << 16);
    }
    hs_cluster_wait();  // the leader's mbarrier is initialized
    if (mine) {
        const u32 dst = hs_leader_addr(hint_in + (j0 - HS_LEAD));
        const u32 bar = hs_leader_addr(&hs_bar);
        asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];"
                     :: "r"(dst), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]), "r"(bar) : "memory");
    }
}
#endif

template <int N>
__device__ __forceinline__ void hs_ld_i32(const i32* p, i32* v) {
    if constexpr (N == 4) {
        const int4 x = *reinterpret_cast<const int4*>(p);
        v[0] = x.x; v[1] = x.y; v[2] = x.z; v[3] = x.w;
    } else if constexpr (N == 2) {
        const int2 x = *reinterpret_cast<const int2*>(p);
        v[0] = x.x; v[1] = x.y;
    } else {
        v[0] = *p;
    }
}

template <int N>
__device__ __forceinline__ void hs_st_i32(i32* p, const i32* v) {
    if constexpr (N == 4) {
        *reinterpret_cast<int4*>(p) = make_int4(v[0], v[1], v[2], v[3]);
    } else if constexpr (N == 2) {
        *reinterpret_cast<int2*>(p) = make_int2(v[0], v[1]);
    } else {
        *p = v[0];
    }
}

template <int N>
__device__ __forceinline__ void hs_ld_i16(const i16* p, i32* v) {
    if constexpr (N == 4) {
        const uint2 x = *reinterpret_cast<const uint2*>(p);
        v[0] = static_cast<i32>(x.x & 0xffffu); v[1] = static_cast<i32>(x.x >> 16);
        v[2] = static_cast<i32>(x.y & 0xffffu); v[3] = static_cast<i32>(x.y >> 16);
    } else if constexpr (N == 2) {
        const u32 x = *reinterpret_cast<const u32*>(p);
        v[0] = static_cast<i32>(x & 0xffffu); v[1] = static_cast<i32>(x >> 16);
    } else {
        v[0] = static_cast<i32>(static_cast<unsigned short>(*p));
    }
}

template <int N>
__device__ __forceinline__ void hs_st_i16(i16* p, const i32* v) {
    if constexpr (N == 4) {
        *reinterpret_cast<uint2*>(p) = make_uint2(static_cast<u32>(v[0]) | (static_cast<u32>(v[1]) << 16),
                                                  static_cast<u32>(v[2]) | (static_cast<u32>(v[3]) << 16));
    } else if constexpr (N == 2) {
        *reinterpret_cast<u32*>(p) = static_cast<u32>(v[0]) | (static_cast<u32>(v[1]) << 16);
    } else {
        *p = static_cast<i16>(v[0]);
    }
}

// Exclusive prefix of x over the lanes below the caller; the warp's sum in `total`.
__device__ __forceinline__ i32 hs_warp_prefix(i32 x, i32& total) {
    const i32 lane = threadIdx.x & 31;
    i32 incl = x;
#pragma unroll
    for (i32 d = 1; d < 32; d <<= 1) {
        const i32 y = __shfl_up_sync(HS_FULL_MASK, incl, d);
        if (lane >= d) incl += y;
    }
    total = __shfl_sync(HS_FULL_MASK, incl, 31);
    return incl - x;
}

// After a barrier that follows the per-warp publication of `totals`: the sum over the warps
// before the caller's, and over every warp in `total`.
__device__ __forceinline__ i32 hs_block_prefix(const i32* totals, i32& total) {
    const i32 lane = threadIdx.x & 31;
    const i32 x = lane < HS_NW ? totals[lane] : 0;
    total = __reduce_add_sync(HS_FULL_MASK, x);
    return __reduce_add_sync(HS_FULL_MASK, lane < (static_cast<i32>(threadIdx.x) >> 5) ? x : 0);
}

__device__ __forceinline__ i32 hs_hot_row(const i32* htab, i32 s) {
    return htab[s / HS_BS] * HS_BS + s % HS_BS;
}

#if HS_C > 1
#define HS_CLUSTER __cluster_dims__(HS_C, 1, 1)
#else
#define HS_CLUSTER
#endif

extern "C" __global__ void HS_CLUSTER __launch_bounds__(HS_NT, 1) hisparse_resolve(
    const i32* __restrict__ topk,            // [B, K]
    const i32* __restrict__ row_state,       // [B]
    const i32* __restrict__ seq_lens,        // [B]
    const i32* __restrict__ source_table,    // [R, P]
    const i32* __restrict__ resident_table,  // [R, P]
    const i32* __restrict__ hot_table,       // [R, HB]
    i32* __restrict__ hot_map,               // [R, H]
    i16* __restrict__ lru,                   // [R, H]
    i16* __restrict__ pos_slot,              // [R, P * BS]: slot last filled for a position, or -1
    u32* __restrict__ miss_mask,             // [Bmax * K / 32] (HS_K % 32 == 0 builds)
    i32* __restrict__ out_rows,              // [Bmax, K]
    i32* __restrict__ out_valid,             // [Bmax]
    i32* __restrict__ plan_host,             // [Bmax, K]
    i32* __restrict__ plan_device,           // [Bmax, K]
    i32* __restrict__ plan_counts,           // [Bmax]
    u64* __restrict__ stats,                 // [5]: resident, hits, misses, h2d, d2h
    i32 B,
    i32 Bmax,                                // rows of the outputs (cluster builds: launched for B rows)
    u64* __restrict__ prof,                  // diagnostics: phase clocks of block 0, or null
    i32* __restrict__ plan_ready,            // [Bmax]: rows [0, B) published for a following copy
    i32 follow,                              // 1: a plan copy follows that reads plan_ready
    i32* victims) {                          // [R]: 1 while this launch may refill q's slots, or null
    // Programmatic dependent launch: wait for the previous kernel of the stream before touching
    // memory, then let the copy that follows start its launch. A speculative or ordinary copy
    // waits for this grid. A following plan copy (`follow`) does not: it copies each request's
    // plan once plan_ready says it is written, so every block first marks its rows' plan_ready
    // pending (-1), or final, and only then lets it start.
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (!follow) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const i32 r = blockIdx.x / HS_C;  // the batch row: a cluster of HS_C blocks per row
    const i32 tid = threadIdx.x;
    __builtin_assume(tid >= 0 && tid < HS_NT);  // the launch's block size: folds per-thread bounds
    extern __shared__ __align__(16) unsigned char hs_smem[];
    u64* pairs = reinterpret_cast<u64*>(hs_smem);
    i32* hm = reinterpret_cast<i32*>(pairs + HS_T);
    i32* rtab = hm + (HS_H + 3) / 4 * 4;  // HS_TSMEM builds
    i32* stab = rtab + (HS_TSMEM ? HS_P : 0);
    i32* htab = stab + (HS_TSMEM ? HS_P : 0);
    i16* order = reinterpret_cast<i16*>(htab + HS_HB);
    unsigned char* mark = reinterpret_cast<unsigned char*>(order + HS_H + (HS_H & 1));
#if HS_C > 1
    i16* hint_in = reinterpret_cast<i16*>(hs_smem + (mark + (HS_H + 3) / 4 * 4 - hs_smem + 15) / 16 * 16);
    const u32 rank = hs_cluster_rank();
    if (rank != 0) {  // a helper publishes no row of the batch
        if (follow) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
        hs_help(rank, topk, row_state, seq_lens, pos_slot, hint_in, r, B);
        const i32 helper = r * (HS_C - 1) + static_cast<i32>(rank) - 1;
        hs_pad_rows(helper * HS_NW + (tid >> 5), B * (HS_C - 1) * HS_NW, B, Bmax, out_rows, out_valid, plan_host,
                    plan_device, plan_counts);
        return;
    }
#endif
    const i32 lane = tid & 31;
    const i32 warp = tid >> 5;
    const bool profiling = prof != nullptr && r == 0 && tid == 0;
#define HS_MARK(k) \
    if (profiling) prof[k] = clock64()
    HS_MARK(0);

    // ---- Round trip 1: row states, the top-k entries this thread owns, context lengths --------
    // Entry j = tid * EPT + e of the union is entry j % K of row r + j / K. Rows past the group
    // are loaded speculatively (multi-row builds) and dropped once the group is known.
    const i32 j0 = tid * HS_EPT;
    i32 t_r[HS_EPT];
    i32 len_r[HS_EPT];
    i32 old_r[HS_EPT];  // plan entries of the entry's row the last resolve wrote (the rest are -1)
    const i32 len0 = r < B ? seq_lens[r] : 0;
    const i32 old0 = plan_counts[r];
    const i32 valid0 = out_valid[r];
#pragma unroll
    for (i32 e = 0; e < HS_EPT; e += HS_EV) {
        const i32 j = j0 + e;
        const i32 rho = j / HS_K;
        if (j < HS_U && r + rho < B) {
            hs_ld_i32<HS_EV>(topk + (r + rho) * HS_K + (j - rho * HS_K), t_r + e);
        } else {
#pragma unroll
            for (i32 v = 0; v < HS_EV; ++v) t_r[e + v] = -1;
        }
    }
#pragma unroll
    for (i32 e = 0; e < HS_EPT; ++e) {
        const i32 rho = (j0 + e) / HS_K;
        len_r[e] = (HS_RPR == 1 || rho == 0) ? len0 : (r + rho < B ? seq_lens[r + rho] : 0);
        old_r[e] = (HS_RPR == 1 || rho == 0) ? old0 : (r + rho < B ? plan_counts[r + rho] : 0);
    }

    i32 q;
    const i32 n = hs_group(row_state, r, B, q);
    HS_MARK(1);
    if (n < 0) return;  // written by the block of the group's first row
    if (q < 0) {        // padding row (or past B): -1 everywhere, counts 0
        if (follow) {   // its count (0) is final before the copy may start; it reads no entry then
            if (tid == 0 && r < B) {
                plan_ready[r] = 0;
                __threadfence();
            }
            __syncthreads();
            asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
        }
        if (valid0 == 0 && old0 == 0) return;  // already so: no valid entry, no plan entry
        const i32 m1[4] = {-1, -1, -1, -1};
#pragma unroll 1
        for (i32 i = tid * 4; i < HS_K; i += HS_NT * 4) {
            if constexpr (HS_K % 4 == 0) {
                hs_st_i32<4>(out_rows + r * HS_K + i, m1);
                if (i < old0) {
                    hs_st_i32<4>(plan_host + r * HS_K + i, m1);
                    hs_st_i32<4>(plan_device + r * HS_K + i, m1);
                }
            } else {
                for (i32 v = i; v < i + 4 && v < HS_K; ++v) {
                    out_rows[r * HS_K + v] = -1;
                    if (v < old0) {
                        plan_host[r * HS_K + v] = -1;
                        plan_device[r * HS_K + v] = -1;
                    }
                }
            }
        }
        __syncthreads();  // every thread has read the old counts
        if (tid == 0) {
            out_valid[r] = 0;
            plan_counts[r] = 0;
        }
        return;
    }
#if HS_C > 1
    // The helpers push (HS_U - LEAD) hints once this block's mbarrier is initialized (the cluster
    // barrier); the block never exits before they landed (hs_drain), since they write its memory.
    // Its one arrival, which also expects the bytes, comes after barrier 1: until then the phase
    // cannot complete, whatever has landed (the transaction count may go below zero meanwhile).
    if (tid == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;"
                     :: "r"(static_cast<u32>(__cvta_generic_to_shared(&hs_bar))) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    hs_cluster_arrive();
#define hs_drain() \
    if (tid == 0) hs_mbar_wait(&hs_bar)
#else
#define hs_drain()
#endif

    __shared__ i32 s_wvalid[HS_NW];
    __shared__ i32 s_wres[HS_NW];
    __shared__ i32 s_whit[HS_NW];
    __shared__ i32 s_wmiss[HS_NW];
    __shared__ i32 s_rvalid[HS_RPR];  // per group row (multi-row builds)
    __shared__ i32 s_rmiss[HS_RPR];
    __shared__ i32 s_dup;
    __shared__ i32 s_any_host;

    if (follow && tid == 0) {  // published (fenced) before barrier 1, which lets the copy start
        for (i32 i = 0; i < n; ++i) plan_ready[r + i] = -1;
    }
    const i32 total = n * HS_K;
    const i32 qH = q * HS_H;   // < 2^31: checked by the host (max_requests * hot_rows)
    const i32 qP = q * HS_P;   // likewise max_requests * max_pages * block_size
    const i32 p0 = tid * HS_CPT;

    // ---- Round trip 2: hot map, LRU order, page tables, hot_table row --------------------------
    // A random gather costs a cache line per lane, and the load/store unit is what bounds this
    // kernel: page-table rows that fit in shared memory are read whole with coalesced 16-byte
    // loads instead, and the entries look them up there. Position hints are gathered after the
    // classification, for host entries only (a resident step never reads one).
    constexpr i32 HMV = HS_H % 4 == 0 ? 4 : 1;
    constexpr i32 HM_ROUNDS = (HS_H / HMV + HS_NT - 1) / HS_NT;
    i32 hm_r[HM_ROUNDS * HMV];
#pragma unroll
    for (i32 c = 0; c < HM_ROUNDS; ++c) {
        const i32 i = (c * HS_NT + tid) * HMV;
        if (i < HS_H) hs_ld_i32<HMV>(hot_map + qH + i, hm_r + c * HMV);
    }
    i32 slot_r[HS_CPT];
#pragma unroll
    for (i32 c = 0; c < HS_CPT; c += HS_LV) {
        if (p0 + c < HS_H) {
            hs_ld_i16<HS_LV>(lru + qH + p0 + c, slot_r + c);
        } else {
#pragma unroll
            for (i32 v = 0; v < HS_LV; ++v) slot_r[c + v] = 0;
        }
    }
    constexpr i32 T_ROUNDS = HS_TSMEM ? (HS_P / 4 + HS_NT - 1) / HS_NT : 0;  // int4 of each table row
    int4 rt_r[T_ROUNDS + 1];
    int4 st_r[T_ROUNDS + 1];
#pragma unroll
    for (i32 c = 0; c < T_ROUNDS; ++c) {
        const i32 i = c * HS_NT + tid;
        if (i < HS_P / 4) {
            rt_r[c] = reinterpret_cast<const int4*>(resident_table + qP)[i];
            st_r[c] = reinterpret_cast<const int4*>(source_table + qP)[i];
        }
    }
    const i32 ht = tid < HS_HB ? hot_table[q * HS_HB + tid] : 0;
    i32 res_r[HS_EPT];  // gathered (builds without HS_TSMEM)
    i32 src_r[HS_EPT];
#pragma unroll
    for (i32 e = 0; e < HS_EPT; ++e) {
        const i32 t = t_r[e];
        res_r[e] = -1;
        src_r[e] = -1;
        if constexpr (!HS_TSMEM) {
            if (j0 + e < total && t >= 0 && t < len_r[e] && t / HS_BS < HS_P) {
                res_r[e] = resident_table[qP + t / HS_BS];
                src_r[e] = source_table[qP + t / HS_BS];
            }
        }
    }
    // Empty buckets and marks while the loads are in flight.
    {
        int4* pv = reinterpret_cast<int4*>(pairs);
#pragma unroll
        for (i32 c = 0; c < (HS_T / 2 + HS_NT - 1) / HS_NT; ++c) {
            if ((HS_T / 2) % HS_NT == 0 || c * HS_NT + tid < HS_T / 2) pv[c * HS_NT + tid] = make_int4(-1, -1, -1, -1);
        }
        u32* mv = reinterpret_cast<u32*>(mark);
        constexpr i32 MW = (HS_H + 3) / 4;  // words of marks (the last one padded)
#pragma unroll
        for (i32 c = 0; c < (MW + HS_NT - 1) / HS_NT; ++c) {
            if (c * HS_NT + tid < MW) mv[c * HS_NT + tid] = 0u;
        }
    }
    if (tid == 0) {
        s_dup = 0;
        s_any_host = 0;
    }
    if (HS_RPR > 1 && tid < HS_RPR) {
        s_rvalid[tid] = 0;
        s_rmiss[tid] = 0;
    }
#pragma unroll
    for (i32 c = 0; c < HM_ROUNDS; ++c) {
        const i32 i = (c * HS_NT + tid) * HMV;
        if (i < HS_H) hs_st_i32<HMV>(hm + i, hm_r + c * HMV);
    }
#pragma unroll
    for (i32 c = 0; c < T_ROUNDS; ++c) {
        const i32 i = c * HS_NT + tid;
        if (i < HS_P / 4) {
            reinterpret_cast<int4*>(rtab)[i] = rt_r[c];
            reinterpret_cast<int4*>(stab)[i] = st_r[c];
        }
    }
    if (tid < HS_HB) htab[tid] = ht;
#pragma unroll 1
    for (i32 i = tid + HS_NT; i < HS_HB; i += HS_NT) htab[i] = hot_table[q * HS_HB + i];
#if HS_C > 1
    hs_cluster_wait();  // long complete: the helpers arrived at their start
#endif
    HS_MARK(2);
    if (follow && tid == 0) __threadfence();
    __syncthreads();  // barrier 1
    if (follow) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    HS_MARK(3);
#if HS_C > 1
    if (tid == 0) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                     :: "r"(static_cast<u32>(__cvta_generic_to_shared(&hs_bar))),
                        "r"(static_cast<u32>(2 * (HS_U - HS_LEAD))) : "memory");
    }
#endif
    const i32 base = r * HS_K;  // < 2^31: checked by the host (max_batch_rows * top_k)

    // Per-row sums of a multi-row group: per-warp ballots added into shared counters.
    auto row_sums = [&](u32 flags, i32* sums) {
#pragma unroll 1
        for (i32 rho = 0; rho < n; ++rho) {
            i32 c = 0;
#pragma unroll
            for (i32 e = 0; e < HS_EPT; ++e) {
                c += __popc(__ballot_sync(HS_FULL_MASK, ((flags >> e) & 1u) && (j0 + e) / HS_K == rho));
            }
            if (lane == 0 && c) atomicAdd(&sums[rho], c);
        }
    };
    i32 pad[HS_EV];
#pragma unroll
    for (i32 v = 0; v < HS_EV; ++v) pad[v] = -1;

    // ---- Classify; a host entry whose hinted slot holds its row is a hit, the rest are hashed ---
    // v: the output row if resident, -1 if masked or null, -(2 + host row) for a host entry.
    i32 v_r[HS_EPT];
    i32 out_r[HS_EPT];
    u32 b_r[HS_EPT];
    i32 hint_r[HS_EPT];
    u32 vflags = 0;
    u32 cflags = 0;  // candidates
    i32 n_res_t = 0;
#pragma unroll
    for (i32 e = 0; e < HS_EPT; ++e) {
        const i32 t = t_r[e];
        i32 res = res_r[e];
        i32 src = src_r[e];
        if constexpr (HS_TSMEM) {
            if (j0 + e < total && t >= 0 && t < len_r[e] && t / HS_BS < HS_P) {
                res = rtab[t / HS_BS];
                src = stab[t / HS_BS];
            }
        }
        const i32 o = t % HS_BS;
        const i32 v = res >= 0 ? res * HS_BS + o : (src >= 0 ? -2 - (src * HS_BS + o) : -1);
        v_r[e] = v;
        out_r[e] = v;
        b_r[e] = 0;
        if (v != -1) vflags |= 1u << e;
        n_res_t += v >= 0;
        // Every hint of the thread in flight at once; in cluster builds, only the leader's share.
        hint_r[e] = v <= -2 && (HS_C == 1 || j0 < HS_LEAD) ? pos_slot[qP * HS_BS + t] : -1;
    }
#if HS_C > 1
    if (j0 >= HS_LEAD) {  // the thread's entries are in a helper's share
        bool host = false;
#pragma unroll
        for (i32 e = 0; e < HS_EPT; ++e) host |= v_r[e] <= -2;
        if (host) {
            hs_mbar_wait(&hs_bar);
#pragma unroll
            for (i32 e = 0; e < HS_EPT; ++e) {
                if (v_r[e] <= -2) hint_r[e] = hint_in[j0 + e - HS_LEAD];
            }
        }
    }
#endif
    bool any_host_t = false;
#pragma unroll
    for (i32 e = 0; e < HS_EPT; ++e) {
        const i32 v = v_r[e];
        if (v <= -2) {
            any_host_t = true;
            const i32 g = -2 - v;
            const i32 s = hint_r[e];
            if (static_cast<u32>(s) < static_cast<u32>(HS_H) && hm[s] == g) {
                mark[s] = 1;
                out_r[e] = hs_hot_row(htab, s);
            } else {
                cflags |= 1u << e;
                const u32 j = static_cast<u32>(j0 + e);
                const u64 word = (static_cast<u64>(static_cast<u32>(g)) << 32) | j;
                u32 h = hs_hash(g, 32 - HS_TBITS);
                while (true) {
                    const u64 prev = atomicCAS(&pairs[h], HS_EMPTY, word);
                    if (prev == HS_EMPTY) break;
                    if (static_cast<i32>(prev >> 32) == g) {
                        if (static_cast<u32>(prev) > j) atomicMin(&pairs[h], word);
                        break;
                    }
                    h = (h + 1) & (HS_T - 1);
                }
                b_r[e] = h;
            }
        }
    }
    {
        const i32 wv = __reduce_add_sync(HS_FULL_MASK, __popc(vflags));
        const i32 wr = __reduce_add_sync(HS_FULL_MASK, n_res_t);
        if (lane == 0) {
            s_wvalid[warp] = wv;
            s_wres[warp] = wr;
        }
    }
    if (any_host_t) s_any_host = 1;
    if constexpr (HS_RPR > 1) {
        if (n > 1) row_sums(vflags, s_rvalid);
    }
    const bool any_cand = __syncthreads_or(cflags != 0);  // barrier 2
    HS_MARK(4);
    // The speculative gather believes a host entry held at its hinted slot is a hit without waiting
    // for this grid, unless victims[q] reads 1: so the flag is set, and fenced (fence.sc, paired
    // with the gather's), before any store to q's hot map or hints (after barrier 4); a step that
    // refills nothing clears it. See hisparse_gather_spec in copy.cu.
    if (victims != nullptr && tid == 0) {
        hs_st_relaxed(victims + q, any_cand ? 1 : 0);
        if (any_cand) hs_fence_sc();
    }

    if (!any_cand) {
        // ---- No misses: every output is final (resident entries, hint hits); written now, so the
        // stores drain while the LRU walk runs. Without a host entry (the resident fast path) the
        // hot state is left exactly as it was.
#pragma unroll
        for (i32 e = 0; e < HS_EPT; e += HS_EV) {
            const i32 j = j0 + e;
            if (j < total) {
                hs_st_i32<HS_EV>(out_rows + base + j, out_r + e);
                if (j % HS_K < old_r[e]) {  // the vector's row: HS_EV divides K
                    hs_st_i32<HS_EV>(plan_host + base + j, pad);
                    hs_st_i32<HS_EV>(plan_device + base + j, pad);
                }
            }
        }
        if (warp == 0) {
            const i32 n_valid = __reduce_add_sync(HS_FULL_MASK, lane < HS_NW ? s_wvalid[lane] : 0);
            const i32 n_resident = __reduce_add_sync(HS_FULL_MASK, lane < HS_NW ? s_wres[lane] : 0);
            if (lane < n) {
                out_valid[r + lane] = n > 1 ? s_rvalid[lane] : n_valid;
                plan_counts[r + lane] = 0;
                if (follow) plan_ready[r + lane] = 0;  // no entry to read
            }
            if (lane == 0 && n_resident) atomicAdd(&stats[0], static_cast<u64>(n_resident));
        }
        if (!s_any_host) {
            HS_MARK(8);
            hs_drain();
            return;
        }
    }

    // ---- Walk the LRU order: hit slots are the marked ones, and (slow path) held slots whose row
    // is a candidate. The first two buckets of a lookup are read together (load factor <= 1/2).
    u32 hflags = 0;
#pragma unroll
    for (i32 c = 0; c < HS_CPT; ++c) {
        if (p0 + c < HS_H && mark[slot_r[c]]) hflags |= 1u << c;
    }
    if (any_cand) {
        i32 gk[HS_CPT];
        u32 hk[HS_CPT];
        i32 k0[HS_CPT];
        i32 k1[HS_CPT];
#pragma unroll
        for (i32 c = 0; c < HS_CPT; ++c) gk[c] = p0 + c < HS_H ? hm[slot_r[c]] : -1;
#pragma unroll
        for (i32 c = 0; c < HS_CPT; ++c) {
            hk[c] = gk[c] >= 0 ? hs_hash(gk[c], 32 - HS_TBITS) : 0u;
            k0[c] = static_cast<i32>(pairs[hk[c]] >> 32);
            k1[c] = static_cast<i32>(pairs[(hk[c] + 1) & (HS_T - 1)] >> 32);
        }
#pragma unroll
        for (i32 c = 0; c < HS_CPT; ++c) {
            const i32 g = gk[c];
            i32 hb = -1;
            if (g >= 0 && k0[c] != -1) {
                if (k0[c] == g) {
                    hb = static_cast<i32>(hk[c]);
                } else if (k1[c] == g) {
                    hb = static_cast<i32>((hk[c] + 1) & (HS_T - 1));
                } else if (k1[c] != -1) {  // rare: a longer probe sequence
                    u32 h = (hk[c] + 2) & (HS_T - 1);
                    i32 key;
                    while ((key = static_cast<i32>(pairs[h] >> 32)) != -1) {
                        if (key == g) {
                            hb = static_cast<i32>(h);
                            break;
                        }
                        h = (h + 1) & (HS_T - 1);
                    }
                }
            }
            if (hb >= 0) {
                reinterpret_cast<i32*>(&pairs[hb])[0] = -(slot_r[c] + 1);  // low word (little endian)
                hflags |= 1u << c;
            }
        }
    }
    i32 h_warp;
    const i32 h_excl_w = hs_warp_prefix(__popc(hflags), h_warp);
    if (lane == 0) s_whit[warp] = h_warp;
    __syncthreads();  // barrier 3
    HS_MARK(5);
    i32 n_hits;
    i32 hr = hs_block_prefix(s_whit, n_hits) + h_excl_w;  // hit positions before this thread's first

    if (!any_cand) {
        // ---- Every host entry a hint hit: no misses; evictable slots first, then the hits ------
#pragma unroll
        for (i32 c = 0; c < HS_CPT; ++c) {
            const i32 pos = p0 + c;
            if (pos < HS_H) {
                const bool hit = (hflags >> c) & 1u;
                const i32 to = hit ? HS_H - n_hits + hr : pos - hr;
                if (to != pos) lru[qH + to] = static_cast<i16>(slot_r[c]);  // unchanged positions stay
                hr += hit;
            }
        }
        HS_MARK(6);
        if (tid == 0 && n_hits) atomicAdd(&stats[1], static_cast<u64>(n_hits));
        HS_MARK(8);
        hs_drain();
        return;
    }

    // ---- Slow path: pack the slots (hits forward, evictable backward); flag the misses -------
#pragma unroll
    for (i32 c = 0; c < HS_CPT; ++c) {
        const i32 pos = p0 + c;
        if (pos < HS_H) {
            const bool hit = (hflags >> c) & 1u;
            order[hit ? hr : HS_H - 1 - (pos - hr)] = static_cast<i16>(slot_r[c]);
            hr += hit;
        }
    }
    u32 mflags = 0;
    u32 dflags = 0;  // repeats of a miss first referenced by another entry
#pragma unroll
    for (i32 e = 0; e < HS_EPT; ++e) {
        if ((cflags >> e) & 1u) {
            const i32 w = static_cast<i32>(static_cast<u32>(pairs[b_r[e]]));
            if (w == j0 + e) {
                mflags |= 1u << e;
            } else if (w >= 0) {
                dflags |= 1u << e;
            } else {
                out_r[e] = hs_hot_row(htab, -w - 1);  // held in a slot its hint did not name
            }
        }
    }
    if (dflags) s_dup = 1;
    i32 m_warp;
    const i32 m_excl_w = hs_warp_prefix(__popc(mflags), m_warp);
    if (lane == 0) s_wmiss[warp] = m_warp;
    if constexpr (HS_RPR > 1) {
        if (n > 1) row_sums(mflags, s_rmiss);
    }
    if constexpr (HS_MASK) {
#pragma unroll 1
        for (i32 i = tid; i < total / 32; i += HS_NT) miss_mask[base / 32 + i] = 0u;
    }
    __syncthreads();  // barrier 4
    HS_MARK(6);

    // ---- Misses take the oldest evictable slots; new LRU order; outputs ---------------------
    i32 n_misses;
    i32 m = hs_block_prefix(s_wmiss, n_misses) + m_excl_w;  // misses before j0
    i32 rho_t = j0 / HS_K;  // row of the thread's first entry; rows of later entries follow
    i32 mb = 0;             // misses in rows before rho_t
    i32 mcnt = n_misses;    // misses of row rho_t
    if constexpr (HS_RPR > 1) {
        if (n > 1) {
            for (i32 x = 0; x < rho_t && x < n; ++x) mb += s_rmiss[x];
            mcnt = rho_t < n ? s_rmiss[rho_t] : 0;
        }
    }
#pragma unroll
    for (i32 e = 0; e < HS_EPT; ++e) {
        const i32 j = j0 + e;
        if constexpr (HS_RPR > 1) {
            while (n > 1 && j < total && j / HS_K != rho_t) {  // the thread's entries cross a row boundary
                mb += mcnt;
                ++rho_t;
                mcnt = s_rmiss[rho_t];
            }
        }
        if ((mflags >> e) & 1u) {
            const i32 s = order[HS_H - 1 - m];
            const i32 g = -2 - v_r[e];
            hot_map[qH + s] = g;
            pos_slot[qP * HS_BS + t_r[e]] = static_cast<i16>(s);
            const i32 dev = hs_hot_row(htab, s);
            if (s_dup) reinterpret_cast<i32*>(&pairs[b_r[e]])[0] = -(s + 1);
            if constexpr (HS_MASK) atomicOr(&miss_mask[(base + j) >> 5], 1u << ((base + j) & 31));
            const i32 at = (r + rho_t) * HS_K + (m - mb);
            plan_host[at] = g;
            plan_device[at] = dev;
            out_r[e] = dev;
            ++m;
        }
        // Plan entries past the row's misses are -1 (the plan is packed from entry 0); those past
        // the last resolve's count already are.
        if (j < total && j - rho_t * HS_K >= mcnt && j - rho_t * HS_K < old_r[e]) {
            plan_host[base + j] = -1;
            plan_device[base + j] = -1;
        }
    }
    if (follow) {  // the group's plan is written: publish it before the outputs and the LRU order
        __syncthreads();
        if (warp == 0 && lane < n) {
            __threadfence();
            const i32 count = n > 1 ? s_rmiss[lane] : n_misses;
            asm volatile("st.release.gpu.global.s32 [%0], %1;" :: "l"(plan_ready + r + lane), "r"(count) : "memory");
        }
    }
#pragma unroll
    for (i32 e = 0; e < HS_EPT; e += HS_EV) {
        if (j0 + e < total) hs_st_i32<HS_EV>(out_rows + base + j0 + e, out_r + e);
    }
    {
        const i32 n_evictable = HS_H - n_hits;
        const i32 keep = n_evictable - n_misses;
        i32 nl[HS_CPT];
#pragma unroll
        for (i32 c = 0; c < HS_CPT; ++c) {
            const i32 pos = p0 + c;
            const i32 at = pos < keep ? HS_H - 1 - (n_misses + pos)
                                      : (pos < n_evictable ? HS_H - 1 - (pos - keep) : pos - n_evictable);
            nl[c] = pos < HS_H ? order[at] : 0;
        }
#pragma unroll
        for (i32 c = 0; c < HS_CPT; c += HS_LV) {
            if (p0 + c < HS_H) hs_st_i16<HS_LV>(lru + qH + p0 + c, nl + c);
        }
    }
    HS_MARK(7);
    if (s_dup) {  // uniform: written before barrier 4
        __syncthreads();
#pragma unroll
        for (i32 e = 0; e < HS_EPT; ++e) {
            if ((dflags >> e) & 1u) {
                const i32 s = -static_cast<i32>(static_cast<u32>(pairs[b_r[e]])) - 1;
                out_rows[base + j0 + e] = hs_hot_row(htab, s);
            }
        }
    }

    // ---- Counts --------------------------------------------------------------------------------
    if (warp == 0) {
        const i32 n_valid = __reduce_add_sync(HS_FULL_MASK, lane < HS_NW ? s_wvalid[lane] : 0);
        const i32 n_resident = __reduce_add_sync(HS_FULL_MASK, lane < HS_NW ? s_wres[lane] : 0);
        if (lane < n) {
            out_valid[r + lane] = n > 1 ? s_rvalid[lane] : n_valid;
            plan_counts[r + lane] = n > 1 ? s_rmiss[lane] : n_misses;
        }
        if (lane == 0) {
            if (n_resident) atomicAdd(&stats[0], static_cast<u64>(n_resident));
            if (n_hits) atomicAdd(&stats[1], static_cast<u64>(n_hits));
            if (n_misses) atomicAdd(&stats[2], static_cast<u64>(n_misses));
        }
    }
    HS_MARK(8);
    hs_drain();
}
