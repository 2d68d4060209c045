// The fused resolver, version 2 (docs/resolver-contract.md): one thread block per batch row; the
// block of a group's first row resolves the whole group (the speculative rows of one request) as
// one union. The default before Hopper; resolve3.cu splits a request over a cluster.
//
// What changed against version 1 (the first kernel, removed since; docs/gpu-validation.md has the
// measurements):
// - Two dependent global round trips instead of four: (row_state, top-k, seq_lens) then every
//   per-state load at once (LRU order, the hot map in *slot* order into shared memory, the
//   hot_table row, the page tables). The walk then reads what a slot holds from shared memory.
// - Each thread owns consecutive union entries and consecutive LRU positions, so a block-wide
//   prefix is an in-warp shuffle scan plus one scan of the 32 warp totals, done redundantly by
//   every warp after the phase barrier: no serial warp-0 scan and no barrier of its own.
// - Hash buckets are 64-bit (first-reference index, key) pairs: an insert is one 64-bit CAS; a
//   repeated key lowers the index with a 64-bit atomicMin on the same word, so the winner needs no
//   second atomic and the values need no initialisation beyond the empty key.
// - Four block barriers for single-row groups (one for the resident fast path, which returns
//   right after learning that no entry is a host entry); multi-row groups add one per row-split.
//
// Compile-time constants (passed by the host as -D options):
//   HS_NT    threads per block (a multiple of 32, at most 1024)
//   HS_EPT   union entries per thread: ceil(rows_per_request * top_k / HS_NT)
//   HS_CPT   LRU positions per thread: ceil(hot_rows / HS_NT)
//   HS_MULTI 1 when rows_per_request > 1
//
// Dynamic shared memory, in this order (the host computes the same size):
//   pairs[T]  int2 hash buckets {x: first-reference entry j, later -(slot + 1) once the key has a
//             slot; y: host row key, -1 empty}, T = 2^hash_bits
//   hm[H]     i32  hot_map row of the state row in slot order
//   order[H]  i16  hit slots packed forward from 0 in LRU order, evictable slots packed backward
//                  from H-1 in LRU order (E[m] = order[H-1-m]); padded to 4 bytes
//   htab[HB]  i32  the state row's hot_table row (HB = hot_rows / block_size)
//   vbound[RPR+1] mbound[RPR+1] i32  valid entries / misses before each row of the group
#include "common.cuh"

#ifndef HS_NT
#error "HS_NT must be defined"
#endif
#ifndef HS_EPT
#error "HS_EPT must be defined"
#endif
#ifndef HS_CPT
#error "HS_CPT must be defined"
#endif
#ifndef HS_MULTI
#define HS_MULTI 1
#endif

#define HS_NW (HS_NT / 32)
#define HS_EMPTY 0xffffffffffffffffull

// In-warp part of a block-wide exclusive scan: returns the exclusive prefix of x within the
// warp; lane 31 stores the warp's total in totals[warp]. Uniform per warp.
__device__ __forceinline__ i32 hs_scan_warp(i32 x, i32* totals) {
    const i32 lane = threadIdx.x & 31;
    i32 incl = x;
#pragma unroll
    for (i32 d = 1; d < 32; d <<= 1) {
        const i32 y = __shfl_up_sync(HS_FULL_MASK, incl, d);
        if (lane >= d) incl += y;
    }
    if (lane == 31) totals[threadIdx.x >> 5] = incl;
    return incl - x;
}

// Block part, after a barrier that follows hs_scan_warp: the exclusive prefix of the calling
// warp's total; `total` gets the sum over every warp. Uniform per warp.
__device__ __forceinline__ i32 hs_scan_block(const i32* totals, i32& total) {
    const i32 lane = threadIdx.x & 31;
    const i32 x = lane < HS_NW ? totals[lane] : 0;
    i32 incl = x;
#pragma unroll
    for (i32 d = 1; d < 32; d <<= 1) {
        const i32 y = __shfl_up_sync(HS_FULL_MASK, incl, d);
        if (lane >= d) incl += y;
    }
    total = __shfl_sync(HS_FULL_MASK, incl, 31);
    return __shfl_sync(HS_FULL_MASK, incl - x, threadIdx.x >> 5);
}

extern "C" __global__ void __launch_bounds__(HS_NT, 1) hisparse_resolve(
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
    i32 B, HsDiv Kd, i32 H, i32 P, HsDiv bsd, i32 rpr, i32 hash_bits,
    u64* __restrict__ prof) {                // diagnostics: phase clocks of block 0, or null
    // Programmatic dependent launch: wait for the previous kernel of the stream before touching
    // memory, then let the gather that follows start its launch (it waits for this grid).
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const i32 r = blockIdx.x;
    const i32 tid = threadIdx.x;
    const i32 lane = tid & 31;
    const i32 K = Kd.d;
    const i32 bs = bsd.d;
    const bool profiling = prof != nullptr && r == 0 && tid == 0;
#define HS_MARK(k) \
    if (profiling) prof[k] = clock64()
    HS_MARK(0);

    // ---- Round trip 1: the top-k entries this thread may own, with the group's rows ----------
    // Entries j = tid * HS_EPT + e of the union (j = rho * K + i for row r + rho). Rows past the
    // group are loaded speculatively (for multi-row groups) and dropped once the group is known.
    i32 t_r[HS_EPT];
    i32 len_r[HS_EPT];
    const i32 len0 = r < B ? seq_lens[r] : 0;
#pragma unroll
    for (i32 e = 0; e < HS_EPT; ++e) {
        const i32 j = tid * HS_EPT + e;
        const i32 rho = HS_MULTI ? Kd.div(j) : 0;
        t_r[e] = -1;
        len_r[e] = len0;
        if (j < rpr * K && r + rho < B) {
            t_r[e] = topk[static_cast<i64>(r + rho) * K + (j - rho * K)];
            if (HS_MULTI && rho > 0) len_r[e] = seq_lens[r + rho];
        }
    }

    // ---- Which rows does this block write? --------------------------------------------------
    i32 q;
    const i32 n = hs_group_at(row_state, r, B, rpr, q);
    if (n < 0) return;  // written by the block of the group's first row
    if (q < 0) {
        const i64 base = static_cast<i64>(r) * K;
#pragma unroll 1
        for (i32 i = tid; i < K; i += HS_NT) {
            out_rows[base + i] = -1;
            plan_host[base + i] = -1;
            plan_device[base + i] = -1;
        }
        if (tid == 0) {
            out_valid[r] = 0;
            plan_counts[r] = 0;
        }
        return;
    }

    extern __shared__ __align__(16) unsigned char hs_smem[];
    const i32 T = 1 << hash_bits;
    const u32 shift = 32u - static_cast<u32>(hash_bits);
    const u32 tmask = static_cast<u32>(T - 1);
    const i32 HB = bsd.div(H);
    int2* pairs = reinterpret_cast<int2*>(hs_smem);
    u64* pairs64 = reinterpret_cast<u64*>(hs_smem);
    i32* hm = reinterpret_cast<i32*>(pairs + T);
    i16* order = reinterpret_cast<i16*>(hm + H);
    i32* htab = reinterpret_cast<i32*>(order + H + (H & 1));
    i32* vbound = htab + HB;
    i32* mbound = vbound + rpr + 1;

    __shared__ i32 s_wvalid[HS_NW];
    __shared__ i32 s_wres[HS_NW];
    __shared__ i32 s_wuniq[HS_NW];
    __shared__ i32 s_whit[HS_NW];
    __shared__ i32 s_wmiss[HS_NW];
    __shared__ i32 s_dup;

    const bool multi = HS_MULTI && n > 1;  // uniform
    const i64 qH = static_cast<i64>(q) * H;
    const i64 qP = static_cast<i64>(q) * P;
    const i32 total = n * K;
    const i32 j0 = tid * HS_EPT;
    const i32 p0 = tid * HS_CPT;

    // ---- Round trip 2: every per-state load at once ------------------------------------------
    i32 slot_r[HS_CPT];
    i32 hm_r[HS_CPT];
    i32 ht_r[HS_CPT];
#pragma unroll
    for (i32 c = 0; c < HS_CPT; ++c) {
        slot_r[c] = p0 + c < H ? static_cast<i32>(lru[qH + p0 + c]) : 0;
        const i32 i = c * HS_NT + tid;
        hm_r[c] = i < H ? hot_map[qH + i] : -1;
        ht_r[c] = i < HB ? hot_table[static_cast<i64>(q) * HB + i] : 0;
    }
    i32 res_r[HS_EPT];
    i32 src_r[HS_EPT];
    i32 o_r[HS_EPT];
#pragma unroll
    for (i32 e = 0; e < HS_EPT; ++e) {
        const i32 j = j0 + e;
        const i32 t = t_r[e];
        res_r[e] = -1;
        src_r[e] = -1;
        o_r[e] = 0;
        if (j < total && t >= 0 && t < len_r[e]) {
            const i32 p = bsd.div(t);
            o_r[e] = t - p * bs;
            if (p < P) {
                res_r[e] = resident_table[qP + p];
                src_r[e] = source_table[qP + p];
            }
        }
    }
    // Empty buckets while the loads are in flight (T >= 2 pairs: a whole number of int4).
    {
        int4* pv = reinterpret_cast<int4*>(pairs);
#pragma unroll 1
        for (i32 i = tid; i < (T >> 1); i += HS_NT) pv[i] = make_int4(-1, -1, -1, -1);
    }
    if (tid == 0) s_dup = 0;

    // Classify: output row if resident, -1 if masked or null, -(2 + host row) for a host entry.
    i32 v_r[HS_EPT];
    u32 vflags = 0;
    i32 n_res_t = 0;
    bool any_host_t = false;
#pragma unroll
    for (i32 e = 0; e < HS_EPT; ++e) {
        const i32 res = res_r[e];
        const i32 src = src_r[e];
        const i32 v = res >= 0 ? res * bs + o_r[e] : (src >= 0 ? -2 - (src * bs + o_r[e]) : -1);
        v_r[e] = v;
        if (v != -1) vflags |= 1u << e;
        n_res_t += v >= 0;
        any_host_t |= v <= -2;
    }
    const i32 v_excl_w = hs_scan_warp(__popc(vflags), s_wvalid);
    {
        const i32 wres = __reduce_add_sync(HS_FULL_MASK, n_res_t);
        if (lane == 0) s_wres[tid >> 5] = wres;
    }
    const bool any_host = __syncthreads_or(any_host_t);  // barrier 1
    HS_MARK(1);
    i32 n_valid;
    const i32 v_pre = hs_scan_block(s_wvalid, n_valid) + v_excl_w;  // valid entries before j0
    const i64 base = static_cast<i64>(r) * K;

    if (!any_host) {
        // ---- Resident fast path: nothing touches the hot state ------------------------------
        if (multi) {
#pragma unroll
            for (i32 e = 0; e < HS_EPT; ++e) {
                const i32 j = j0 + e;
                const i32 rho = Kd.div(j);
                if (j < total && j > 0 && j == rho * K) vbound[rho] = v_pre + __popc(vflags & ((1u << e) - 1u));
            }
            if (tid == 0) {
                vbound[0] = 0;
                vbound[n] = n_valid;
            }
            __syncthreads();
        }
#pragma unroll
        for (i32 e = 0; e < HS_EPT; ++e) {
            const i32 j = j0 + e;
            if (j < total) {
                out_rows[base + j] = v_r[e];
                plan_host[base + j] = -1;
                plan_device[base + j] = -1;
            }
        }
        if (multi) {
#pragma unroll 1
            for (i32 rho = tid; rho < n; rho += HS_NT) {
                out_valid[r + rho] = vbound[rho + 1] - vbound[rho];
                plan_counts[r + rho] = 0;
            }
        } else if (tid == 0) {
            out_valid[r] = n_valid;
            plan_counts[r] = 0;
        }
        if (tid < 32) {
            const i32 n_resident = __reduce_add_sync(HS_FULL_MASK, lane < HS_NW ? s_wres[lane] : 0);
            if (lane == 0 && n_resident) atomicAdd(&stats[0], static_cast<u64>(n_resident));
        }
        HS_MARK(7);
        return;
    }

    // ---- Hash the union's host rows: 64-bit buckets {first j, key} -------------------------
    u32 b_r[HS_EPT];
    i32 n_win = 0;
#pragma unroll
    for (i32 e = 0; e < HS_EPT; ++e) {
        b_r[e] = 0;
        const i32 v = v_r[e];
        if (v <= -2) {
            const i32 g = -2 - v;
            const u32 j = static_cast<u32>(j0 + e);
            const u64 word = (static_cast<u64>(static_cast<u32>(g)) << 32) | j;
            u32 h = hs_hash(g, shift);
            while (true) {
                const u64 prev = atomicCAS(&pairs64[h], HS_EMPTY, word);
                if (prev == HS_EMPTY) {
                    ++n_win;
                    break;
                }
                if (static_cast<i32>(prev >> 32) == g) {
                    if (static_cast<u32>(prev) > j) atomicMin(&pairs64[h], word);
                    break;
                }
                h = (h + 1) & tmask;
            }
            b_r[e] = h;
        }
    }
    {
        const i32 wu = __reduce_add_sync(HS_FULL_MASK, n_win);
        if (lane == 0) s_wuniq[tid >> 5] = wu;
    }
#pragma unroll
    for (i32 c = 0; c < HS_CPT; ++c) {
        const i32 i = c * HS_NT + tid;
        if (i < H) hm[i] = hm_r[c];
        if (i < HB) htab[i] = ht_r[c];
    }
    if (multi) {
#pragma unroll
        for (i32 e = 0; e < HS_EPT; ++e) {
            const i32 j = j0 + e;
            const i32 rho = Kd.div(j);
            if (j < total && j > 0 && j == rho * K) vbound[rho] = v_pre + __popc(vflags & ((1u << e) - 1u));
        }
        if (tid == 0) {
            vbound[0] = 0;
            vbound[n] = n_valid;
        }
    }
    __syncthreads();  // barrier 2
    HS_MARK(2);

    // ---- Walk the LRU order: a slot is a hit if the row it holds is a key ---------------------
    // The first two buckets of every position are read together (at load factor <= 1/2 they
    // settle almost every lookup), so a thread's lookups overlap instead of chaining.
    u32 hflags = 0;
    {
        i32 gk[HS_CPT];
        u32 hk[HS_CPT];
        i32 k0[HS_CPT];
        i32 k1[HS_CPT];
#pragma unroll
        for (i32 c = 0; c < HS_CPT; ++c) gk[c] = p0 + c < H ? hm[slot_r[c]] : -1;
#pragma unroll
        for (i32 c = 0; c < HS_CPT; ++c) {
            hk[c] = gk[c] >= 0 ? hs_hash(gk[c], shift) : 0u;
            k0[c] = pairs[hk[c]].y;
            k1[c] = pairs[(hk[c] + 1) & tmask].y;
        }
#pragma unroll
        for (i32 c = 0; c < HS_CPT; ++c) {
            const i32 g = gk[c];
            i32 hb = -1;
            if (g >= 0 && k0[c] != -1) {
                if (k0[c] == g) {
                    hb = static_cast<i32>(hk[c]);
                } else if (k1[c] == g) {
                    hb = static_cast<i32>((hk[c] + 1) & tmask);
                } else if (k1[c] != -1) {  // rare: a longer probe sequence
                    u32 h = (hk[c] + 2) & tmask;
                    i32 key;
                    while ((key = pairs[h].y) != -1) {
                        if (key == g) {
                            hb = static_cast<i32>(h);
                            break;
                        }
                        h = (h + 1) & tmask;
                    }
                }
            }
            if (hb >= 0) {
                pairs[hb].x = -(slot_r[c] + 1);
                hflags |= 1u << c;
            }
        }
    }
    const i32 h_excl_w = hs_scan_warp(__popc(hflags), s_whit);
    __syncthreads();  // barrier 3
    HS_MARK(3);

    // ---- Pack the slots (hits forward, evictable backward); flag the misses -----------------
    i32 n_hits;
    {
        i32 hr = hs_scan_block(s_whit, n_hits) + h_excl_w;  // hit positions before this one
#pragma unroll
        for (i32 c = 0; c < HS_CPT; ++c) {
            const i32 pos = p0 + c;
            if (pos < H) {
                const bool hit = (hflags >> c) & 1u;
                order[hit ? hr : H - 1 - (pos - hr)] = static_cast<i16>(slot_r[c]);
                hr += hit;
            }
        }
    }
    u32 mflags = 0;
    i32 w_r[HS_EPT];
    bool dup = false;
#pragma unroll
    for (i32 e = 0; e < HS_EPT; ++e) {
        w_r[e] = 0;
        if (v_r[e] <= -2) {
            const i32 w = pairs[b_r[e]].x;
            w_r[e] = w;
            if (w == j0 + e) {
                mflags |= 1u << e;
            } else if (w >= 0) {
                dup = true;  // a repeat of a miss first referenced elsewhere
            }
        }
    }
    if (dup) atomicOr(&s_dup, 1);
    const i32 m_excl_w = hs_scan_warp(__popc(mflags), s_wmiss);
    __syncthreads();  // barrier 4
    HS_MARK(4);

    // ---- Misses take the oldest evictable slots; new LRU order; outputs ---------------------
    i32 n_misses;
    i32 m = hs_scan_block(s_wmiss, n_misses) + m_excl_w;  // misses before j0
    if (multi) {
#pragma unroll
        for (i32 e = 0; e < HS_EPT; ++e) {
            const i32 j = j0 + e;
            const i32 rho = Kd.div(j);
            if (j < total && j > 0 && j == rho * K) mbound[rho] = m + __popc(mflags & ((1u << e) - 1u));
        }
        if (tid == 0) {
            mbound[0] = 0;
            mbound[n] = n_misses;
        }
        __syncthreads();
    }
    HS_MARK(5);
#pragma unroll
    for (i32 e = 0; e < HS_EPT; ++e) {
        const i32 j = j0 + e;
        if (j < total) {
            const i32 rho = multi ? Kd.div(j) : 0;
            const i32 v = v_r[e];
            i32 out = v;
            bool write = true;
            if (v <= -2) {
                const i32 w = w_r[e];
                i32 s;
                if ((mflags >> e) & 1u) {
                    s = order[H - 1 - m];
                    const i32 g = -2 - v;
                    hot_map[qH + s] = g;
                    pairs[b_r[e]].x = -(s + 1);
                    const i32 sb = bsd.div(s);
                    const i32 dev = htab[sb] * bs + (s - sb * bs);
                    const i64 at = static_cast<i64>(r + rho) * K + (m - (multi ? mbound[rho] : 0));
                    plan_host[at] = g;
                    plan_device[at] = dev;
                    ++m;
                    out = dev;
                } else if (w < 0) {
                    s = -w - 1;
                    const i32 sb = bsd.div(s);
                    out = htab[sb] * bs + (s - sb * bs);
                } else {
                    write = false;  // a repeat of a miss: after the barrier below
                }
            }
            if (write) out_rows[base + j] = out;
            const i32 cnt = multi ? mbound[rho + 1] - mbound[rho] : n_misses;
            if (j - rho * K >= cnt) {
                plan_host[base + j] = -1;
                plan_device[base + j] = -1;
            }
        }
    }
    {
        const i32 n_evictable = H - n_hits;
        const i32 keep = n_evictable - n_misses;
#pragma unroll
        for (i32 c = 0; c < HS_CPT; ++c) {
            const i32 pos = p0 + c;
            if (pos < H) {
                const i32 at = pos < keep ? H - 1 - (n_misses + pos)
                                          : (pos < n_evictable ? H - 1 - (pos - keep) : pos - n_evictable);
                lru[qH + pos] = order[at];
            }
        }
    }
    HS_MARK(6);
    if (s_dup) {  // uniform: written before barrier 4
        __syncthreads();
#pragma unroll
        for (i32 e = 0; e < HS_EPT; ++e) {
            const i32 j = j0 + e;
            if (j < total && v_r[e] <= -2 && !((mflags >> e) & 1u) && w_r[e] >= 0) {
                const i32 s = -pairs[b_r[e]].x - 1;
                const i32 sb = bsd.div(s);
                out_rows[base + j] = htab[sb] * bs + (s - sb * bs);
            }
        }
    }

    // ---- Counts --------------------------------------------------------------------------------
    if (multi) {
#pragma unroll 1
        for (i32 rho = tid; rho < n; rho += HS_NT) {
            out_valid[r + rho] = vbound[rho + 1] - vbound[rho];
            plan_counts[r + rho] = mbound[rho + 1] - mbound[rho];
        }
    } else if (tid == 0) {
        out_valid[r] = n_valid;
        plan_counts[r] = n_misses;
    }
    if (tid < 32) {
        const i32 n_resident = __reduce_add_sync(HS_FULL_MASK, lane < HS_NW ? s_wres[lane] : 0);
        const i32 n_unique = __reduce_add_sync(HS_FULL_MASK, lane < HS_NW ? s_wuniq[lane] : 0);
        if (lane == 0) {
            if (n_resident) atomicAdd(&stats[0], static_cast<u64>(n_resident));
            if (n_unique - n_misses) atomicAdd(&stats[1], static_cast<u64>(n_unique - n_misses));
            if (n_misses) atomicAdd(&stats[2], static_cast<u64>(n_misses));
        }
    }
    HS_MARK(7);
}
