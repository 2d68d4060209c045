// The fused resolver (docs/resolver-contract.md): one thread block per batch row; the block of a
// group's first row resolves the whole group (the speculative rows of one request) as one union.
//
// The kernel is short on purpose. Measured on an H200, a block spends most of its time fetching
// instructions: each new 128-byte line of straight-line code costs an instruction-cache miss that
// every warp of the block waits for, so time grows with the bytes of code executed rather than
// with the work. Hence: only the global loads are unrolled (to overlap their latencies); every
// other phase is a rolled loop over per-item state kept in shared memory; helpers used twice are
// calls, not inlined copies.
//
// Compile-time constants (passed by the host as -D options):
//   HS_NT    threads per block (a multiple of 32, at most 1024)
//   HS_EPT   union entries per thread: ceil(rows_per_request * top_k / HS_NT)
//   HS_CPT   LRU positions per thread: ceil(hot_rows / HS_NT)
//   HS_MULTI 1 when rows_per_request > 1 (groups of several rows); 0 compiles the per-row
//            bookkeeping of multi-row groups out
// Everything else (top_k, hot_rows, block_size, ...) is a run-time argument, so one build serves
// every geometry of the same size class.
//
// Dynamic shared memory, in this order (the host computes the same size):
//   keys[T]    i32  open-addressing hash of the union's host rows (-1: empty), T = 2^hash_bits
//   vals[T]    i32  per key: first-reference index (>= 0), then -(slot + 1) once it has a slot
//   ent[U]     i32  per union entry j (U = rows_per_request * top_k): its output row if resident,
//                   -1 if masked or null, -(2 + host row) for a host entry, which the hashing
//                   phase turns into -(2 + bucket)
//   held[H]    i32  per LRU position: the host row its slot holds; after the walk the same bytes
//                   hold order[H] (i16): hit slots packed forward from 0 in LRU order, evictable
//                   slots packed backward from H-1 in LRU order (E[m] = order[H-1-m])
//   slot[H]    i16  per LRU position: its slot
//   htab[HB]   i32  the state row's hot_table row (HB = hot_rows / block_size)
//   rowv[RPR] rowm[RPR] rowo[RPR] i32  valid entries, misses first referenced, and the
//                   exclusive prefix of rowm, per row of the group
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
#define HS_SCAN_SLOTS ((HS_CPT > HS_EPT ? HS_CPT : HS_EPT) * HS_NW)

// Exclusive scan of the per-warp counters by warp 0 (a call: one copy of the code for both uses).
__device__ __noinline__ i32 hs_scan_counts(i32* counts, i32 n) { return hs_warp_exclusive_scan(counts, n); }

// Adds, per row of the group, how many lanes of this warp have `flag` set. `rho` is the lane's
// row within the group, -1 for lanes without an entry. A warp's entries are consecutive, so the
// lanes with an entry are a prefix of the warp and their rows ascend: one ballot per row present
// (at most two when top_k >= 32). `multi` is false for single-row groups, the common case, which
// need one ballot. Uniform per warp: every lane must call it.
__device__ __forceinline__ void hs_count_per_row(i32* counters, i32 rho, bool flag, bool multi) {
    const u32 any = __ballot_sync(HS_FULL_MASK, flag && rho >= 0);
    if (any == 0) return;
    const i32 lane = threadIdx.x & 31;
    if (!multi) {
        if (lane == 0) atomicAdd(&counters[0], __popc(any));
        return;
    }
    const i32 first = __shfl_sync(HS_FULL_MASK, rho, 0);
    const i32 last = __reduce_max_sync(HS_FULL_MASK, rho);
#pragma unroll 1
    for (i32 row = first; row <= last; ++row) {
        const u32 set = __ballot_sync(HS_FULL_MASK, flag && rho == row);
        if (lane == 0 && set) atomicAdd(&counters[row], __popc(set));
    }
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
    // Launched with programmatic stream serialization, this grid may be scheduled while the
    // previous kernel of the stream (the indexer, or the last step's copies) still runs: wait for
    // it before touching memory (a no-op for an ordinary launch). Then let the gather that
    // follows start its launch; it too waits for this grid to complete before reading the plan.
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const i32 r = blockIdx.x;
    const i32 tid = threadIdx.x;
    const i32 lane = tid & 31;
    const i32 warp = tid >> 5;
    const i32 K = Kd.d;
    const i32 bs = bsd.d;
    const bool profiling = prof != nullptr && r == 0 && tid == 0;
#define HS_MARK(k) \
    if (profiling) prof[k] = clock64()
    HS_MARK(0);

    // ---- Which rows does this block write? ------------------------------------------------
    // A group's first row leads; the group is at most `rpr` rows of the run. Follower rows leave
    // the work to their leader. Rows past B, padding rows and rows past an over-long run (an
    // input that validation rejects) are written as padding.
    i32 q = -1;
    i32 n = 0;
    if (r < B) {
        const i32 state = row_state[r];
        const i32 before = r > 0 ? row_state[r - 1] : -1;  // loaded with `state`, not after it
        if (state >= 0) {
            i32 back = 0;
            if (before == state) {
                back = 1;
                while (back < rpr && r - back - 1 >= 0 && row_state[r - back - 1] == state) ++back;
            }
            if (back == 0) {
                q = state;
                n = 1;
                while (n < rpr && r + n < B && row_state[r + n] == state) ++n;
            } else if (back < rpr) {
                return;
            }
        }
    }
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
    const i32 U = rpr * K;
    i32* keys = reinterpret_cast<i32*>(hs_smem);
    i32* vals = keys + T;
    i32* ent = vals + T;
    i32* held = ent + U;
    i16* order = reinterpret_cast<i16*>(held);  // reuses held[] after the walk
    i16* slots = reinterpret_cast<i16*>(held + H);
    i32* htab = reinterpret_cast<i32*>(slots + H + (H & 1));
    i32* rowv = htab + HB;
    i32* rowm = rowv + rpr;
    i32* rowo = rowm + rpr;

    __shared__ i32 s_scan[HS_SCAN_SLOTS];
    __shared__ u32 s_bal[HS_SCAN_SLOTS];
    // Per-warp counts, summed by whoever needs them: one shared address written by all 32
    // warps would serialize their atomics.
    __shared__ i32 s_wres[HS_NW];
    __shared__ i32 s_wuniq[HS_NW];
    __shared__ i32 s_wvalid[HS_NW];
    __shared__ i32 s_hits;
    __shared__ i32 s_misses;

    const bool multi = HS_MULTI && n > 1;  // uniform
    const i64 qH = static_cast<i64>(q) * H;
    const i64 qP = static_cast<i64>(q) * P;
    const i32 total = n * K;

    // ---- Global loads, unrolled so their latencies overlap; results go to shared memory ----
    // Two dependent round trips: (LRU slots, top-k) then (what the slots hold, page tables).
    {
        i32 slot_r[HS_CPT];
        i32 held_r[HS_CPT];
        i32 t_r[HS_EPT];
        i32 len_r[HS_EPT];
#pragma unroll
        for (i32 c = 0; c < HS_CPT; ++c) {
            const i32 pos = c * HS_NT + tid;
            slot_r[c] = pos < H ? static_cast<i32>(lru[qH + pos]) : -1;
        }
#pragma unroll
        for (i32 e = 0; e < HS_EPT; ++e) {
            const i32 j = e * HS_NT + tid;
            t_r[e] = -1;
            len_r[e] = 0;
            if (j < total) {
                const i32 rho = multi ? Kd.div(j) : 0;
                t_r[e] = topk[static_cast<i64>(r + rho) * K + (j - rho * K)];
                len_r[e] = seq_lens[r + rho];
            }
        }
#pragma unroll
        for (i32 c = 0; c < HS_CPT; ++c) held_r[c] = slot_r[c] >= 0 ? hot_map[qH + slot_r[c]] : -1;
#pragma unroll
        for (i32 e = 0; e < HS_EPT; ++e) {
            const i32 j = e * HS_NT + tid;
            const i32 t = t_r[e];
            i32 v = -1;
            if (t >= 0 && t < len_r[e]) {
                const i32 p = bsd.div(t);
                const i32 o = t - p * bs;
                if (p < P) {
                    const i32 res = resident_table[qP + p];
                    const i32 src = source_table[qP + p];
                    v = res >= 0 ? res * bs + o : (src >= 0 ? -2 - (src * bs + o) : -1);
                }
            }
            if (j < total) ent[j] = v;
        }
#pragma unroll
        for (i32 c = 0; c < HS_CPT; ++c) {
            const i32 pos = c * HS_NT + tid;
            if (pos < H) {
                slots[pos] = static_cast<i16>(slot_r[c]);
                held[pos] = held_r[c];
            }
        }
    }
#pragma unroll 1
    for (i32 i = tid; i < T; i += HS_NT) {
        keys[i] = -1;
        vals[i] = HS_INT_MAX;
    }
#pragma unroll 1
    for (i32 i = tid; i < HB; i += HS_NT) htab[i] = hot_table[static_cast<i64>(q) * HB + i];
#pragma unroll 1
    for (i32 i = tid; i < n; i += HS_NT) {
        rowv[i] = 0;
        rowm[i] = 0;
    }
    __syncthreads();
    HS_MARK(1);

    // ---- Count valid and resident entries; hash the union's host rows ---------------------
    i32 res_acc = 0, uniq_acc = 0, valid_acc = 0;
#pragma unroll
    for (i32 e = 0; e < HS_EPT; ++e) {
        const i32 j = e * HS_NT + tid;
        const i32 v = j < total ? ent[j] : -1;
        if (multi) hs_count_per_row(rowv, j < total ? Kd.div(j) : -1, v != -1, true);
        bool fresh = false;
        if (v <= -2) {
            const i32 g = -2 - v;
            u32 h = hs_hash(g, shift);
            while (true) {
                const i32 prev = atomicCAS(&keys[h], -1, g);
                if (prev == -1 || prev == g) {
                    fresh = prev == -1;
                    break;
                }
                h = (h + 1) & tmask;
            }
            atomicMin(&vals[h], j);
            ent[j] = -2 - static_cast<i32>(h);
        }
        res_acc += __popc(__ballot_sync(HS_FULL_MASK, v >= 0));
        uniq_acc += __popc(__ballot_sync(HS_FULL_MASK, fresh));
        valid_acc += __popc(__ballot_sync(HS_FULL_MASK, v != -1));
    }
    if (lane == 0) {
        s_wres[warp] = res_acc;
        s_wuniq[warp] = uniq_acc;
        s_wvalid[warp] = valid_acc;
    }
    __syncthreads();
    HS_MARK(2);
    const i32 n_unique = __reduce_add_sync(HS_FULL_MASK, lane < HS_NW ? s_wuniq[lane] : 0);

    i32 n_misses = 0;
    if (n_unique > 0) {  // uniform: every host entry goes through the hot state
        // ---- Walk the LRU order: hit slots hold a row of the union ---------------------------
        // The first two buckets of every position are loaded together (at load factor 1/2 they
        // settle almost every lookup), so a thread's lookups overlap instead of chaining.
        i32 gk[HS_CPT];
        u32 hk[HS_CPT];
        i32 k0[HS_CPT];
        i32 k1[HS_CPT];
#pragma unroll
        for (i32 c = 0; c < HS_CPT; ++c) {
            const i32 pos = c * HS_NT + tid;
            gk[c] = pos < H ? held[pos] : -1;
        }
#pragma unroll
        for (i32 c = 0; c < HS_CPT; ++c) {
            hk[c] = gk[c] >= 0 ? hs_hash(gk[c], shift) : 0u;
            k0[c] = keys[hk[c]];
            k1[c] = keys[(hk[c] + 1) & tmask];
        }
#pragma unroll
        for (i32 c = 0; c < HS_CPT; ++c) {
            const i32 pos = c * HS_NT + tid;
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
                    while ((key = keys[h]) != -1) {
                        if (key == g) {
                            hb = static_cast<i32>(h);
                            break;
                        }
                        h = (h + 1) & tmask;
                    }
                }
            }
            if (hb >= 0) vals[hb] = -(static_cast<i32>(slots[pos]) + 1);
            const u32 bal = __ballot_sync(HS_FULL_MASK, hb >= 0);
            if (lane == 0) {
                s_bal[c * HS_NW + warp] = bal;
                s_scan[c * HS_NW + warp] = __popc(bal);
            }
        }
        __syncthreads();
        if (warp == 0) {
            const i32 hits = hs_scan_counts(s_scan, HS_CPT * HS_NW);
            if (lane == 0) s_hits = hits;
        }
        __syncthreads();
        HS_MARK(3);
        const u32 lt = hs_lanemask_lt();
#pragma unroll
        for (i32 c = 0; c < HS_CPT; ++c) {  // held[] is dead: order[] may overwrite it
            const i32 pos = c * HS_NT + tid;
            if (pos < H) {
                const u32 bal = s_bal[c * HS_NW + warp];
                const i32 hit_rank = s_scan[c * HS_NW + warp] + __popc(bal & lt);
                const i32 at = (bal >> lane) & 1u ? hit_rank : H - 1 - (pos - hit_rank);
                order[at] = slots[pos];
            }
        }
        __syncthreads();
        HS_MARK(4);
        const i32 n_hits = s_hits;
        const i32 n_evictable = H - n_hits;

        // ---- Misses in first-reference order take the oldest evictable slots ---------------
#pragma unroll
        for (i32 e = 0; e < HS_EPT; ++e) {
            const i32 j = e * HS_NT + tid;
            const i32 v = j < total ? ent[j] : -1;
            const bool miss = v <= -2 && vals[-2 - v] == j;
            const u32 bal = __ballot_sync(HS_FULL_MASK, miss);
            if (lane == 0) {
                s_bal[e * HS_NW + warp] = bal;
                s_scan[e * HS_NW + warp] = __popc(bal);
            }
            if (multi) hs_count_per_row(rowm, j < total ? Kd.div(j) : -1, miss, true);
        }
        __syncthreads();
        if (warp == 0) {
            const i32 misses = hs_scan_counts(s_scan, HS_EPT * HS_NW);
            if (lane == 0) {
                s_misses = misses;
                if (!multi) rowm[0] = misses;
            }
        } else if (tid == 32 && multi) {
            i32 run = 0;
#pragma unroll 1
            for (i32 rho = 0; rho < n; ++rho) {
                rowo[rho] = run;
                run += rowm[rho];
            }
        }
        if (tid == 64 && !multi) rowo[0] = 0;
        __syncthreads();
        HS_MARK(5);
        n_misses = s_misses;
#pragma unroll
        for (i32 e = 0; e < HS_EPT; ++e) {
            const u32 bal = s_bal[e * HS_NW + warp];
            if ((bal >> lane) & 1u) {
                const i32 j = e * HS_NT + tid;
                const i32 b = -2 - ent[j];
                const i32 m = s_scan[e * HS_NW + warp] + __popc(bal & lt);
                const i32 victim = order[H - 1 - m];
                const i32 g = keys[b];
                vals[b] = -(victim + 1);
                hot_map[qH + victim] = g;
                const i32 rho = multi ? Kd.div(j) : 0;
                const i64 at = static_cast<i64>(r + rho) * K + (m - rowo[rho]);
                const i32 vb = bsd.div(victim);
                plan_host[at] = g;
                plan_device[at] = htab[vb] * bs + (victim - vb * bs);
            }
        }
        // New order: untouched evictable slots, then the newly filled ones, then the hits.
        const i32 keep = n_evictable - n_misses;
#pragma unroll
        for (i32 c = 0; c < HS_CPT; ++c) {
            const i32 pos = c * HS_NT + tid;
            if (pos < H) {
                const i32 at = pos < keep ? H - 1 - (n_misses + pos)
                                          : (pos < n_evictable ? H - 1 - (pos - keep) : pos - n_evictable);
                lru[qH + pos] = order[at];
            }
        }
        __syncthreads();
        HS_MARK(6);
    }

    // ---- Outputs of every row of the group --------------------------------------------------
    const i64 base = static_cast<i64>(r) * K;
#pragma unroll
    for (i32 e = 0; e < HS_EPT; ++e) {
        const i32 j = e * HS_NT + tid;
        if (j < total) {
            i32 v = ent[j];
            if (v <= -2) {  // a host entry: its key's slot, from the walk or a victim
                const i32 s = -vals[-2 - v] - 1;
                const i32 sb = bsd.div(s);
                v = htab[sb] * bs + (s - sb * bs);
            }
            out_rows[base + j] = v;
        }
    }
#pragma unroll 1
    for (i32 j = tid; j < total; j += HS_NT) {
        const i32 rho = multi ? Kd.div(j) : 0;
        if (j - rho * K >= rowm[rho]) {
            plan_host[base + j] = -1;
            plan_device[base + j] = -1;
        }
    }
    if (multi) {
#pragma unroll 1
        for (i32 rho = tid; rho < n; rho += HS_NT) {
            out_valid[r + rho] = rowv[rho];
            plan_counts[r + rho] = rowm[rho];
        }
    }
    i32 n_resident = 0;
    if (warp == 0) {
        n_resident = __reduce_add_sync(HS_FULL_MASK, lane < HS_NW ? s_wres[lane] : 0);
        const i32 n_valid = __reduce_add_sync(HS_FULL_MASK, lane < HS_NW ? s_wvalid[lane] : 0);
        if (!multi && lane == 0) {
            out_valid[r] = n_valid;
            plan_counts[r] = rowm[0];
        }
    }
    HS_MARK(7);
    if (tid == 0) {
        if (n_resident) atomicAdd(&stats[0], static_cast<u64>(n_resident));
        if (n_unique) {
            atomicAdd(&stats[1], static_cast<u64>(n_unique - n_misses));
            if (n_misses) atomicAdd(&stats[2], static_cast<u64>(n_misses));
        }
    }
}
