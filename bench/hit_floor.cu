// The dependency floor of a hit step, for bench/bench_nvidia.py (never used by the runtime).
//
// One block of HS_NT threads per batch row, launched like the resolver (programmatic dependent
// launch, one kernel per step in a CUDA graph). It makes exactly the round trips any resolver with
// this data layout must make on a step whose every host entry is a hot hit, and none of the work:
//   1. the row's state, its top-k entries and its length;
//   2. (dependent on the state row and the positions) the request's hot map and LRU order, its
//      page-table row, and each entry's position hint;
//   3. a barrier; each entry checks its hint against the hot map and marks the slot;
//   4. a barrier; the LRU positions read their marks, a block-wide prefix sum orders hits last;
//   5. the output rows and the new LRU order are stored.
// With `grid_wait`, every block also waits for all the others before it leaves (step 6 below). It
// writes only its own scratch buffers. What the resolver takes beyond this is its work
// (validity checks, the candidate hash, counters, the cluster's exchanges); this is the part no
// resolver of this layout can remove.
#include "common.cuh"

#define HS_NW (HS_NT / 32)
#define HS_EPT (HS_K / HS_NT)
#define HS_CPT (HS_H / HS_NT)
static_assert(HS_K % HS_NT == 0 && HS_H % HS_NT == 0 && HS_EPT <= 4 && HS_CPT <= 4, "floor geometry");

extern "C" __global__ void __launch_bounds__(HS_NT, 1) hisparse_hit_floor(
    const i32* __restrict__ topk, const i32* __restrict__ row_state, const i32* __restrict__ seq_lens,
    const i32* __restrict__ source_table, const i32* __restrict__ hot_map, const i16* __restrict__ lru,
    const i16* __restrict__ pos_slot, i32* __restrict__ out_rows, i16* __restrict__ lru_out, u32* grid_wait) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    __shared__ i32 hm[HS_H];
    __shared__ i32 stab[HS_P];
    __shared__ unsigned char mark[HS_H];
    __shared__ i32 s_warp[HS_NW];
    const i32 r = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // 1.
    const i32 q = row_state[r];
    const i32 len = seq_lens[r];
    i32 t[HS_EPT];
#pragma unroll
    for (i32 e = 0; e < HS_EPT; ++e) t[e] = topk[r * HS_K + tid * HS_EPT + e];
    // 2.
    i32 h[HS_EPT];
#pragma unroll
    for (i32 e = 0; e < HS_EPT; ++e) h[e] = t[e] >= 0 && t[e] < len ? pos_slot[q * HS_P * HS_BS + t[e]] : -1;
    i32 m[HS_CPT], slot[HS_CPT];
#pragma unroll
    for (i32 c = 0; c < HS_CPT; ++c) {
        m[c] = hot_map[q * HS_H + c * HS_NT + tid];
        slot[c] = lru[q * HS_H + tid * HS_CPT + c];
    }
    const i32 st = tid < HS_P ? source_table[q * HS_P + tid] : 0;
#pragma unroll
    for (i32 c = 0; c < HS_CPT; ++c) {
        hm[c * HS_NT + tid] = m[c];
        mark[c * HS_NT + tid] = 0;
    }
    if (tid < HS_P) stab[tid] = st;
    __syncthreads();
    // 3.
    i32 out[HS_EPT];
#pragma unroll
    for (i32 e = 0; e < HS_EPT; ++e) {
        const i32 s = h[e];
        const bool hit = s >= 0 && s < HS_H && t[e] >= 0 && hm[s] == stab[t[e] / HS_BS] * HS_BS + t[e] % HS_BS;
        if (hit) mark[s] = 1;
        out[e] = hit ? s : -1;
    }
    __syncthreads();
    // 4.
    i32 x = 0;
#pragma unroll
    for (i32 c = 0; c < HS_CPT; ++c) x += mark[slot[c]];
    i32 incl = x;
#pragma unroll
    for (i32 d = 1; d < 32; d <<= 1) {
        const i32 y = __shfl_up_sync(HS_FULL_MASK, incl, d);
        if (lane >= d) incl += y;
    }
    if (lane == 31) s_warp[warp] = incl;
    __syncthreads();
    const i32 w = lane < HS_NW ? s_warp[lane] : 0;
    const i32 total = __reduce_add_sync(HS_FULL_MASK, w);
    i32 hr = __reduce_add_sync(HS_FULL_MASK, lane < warp ? w : 0) + incl - x;
    // 5.
#pragma unroll
    for (i32 e = 0; e < HS_EPT; ++e) out_rows[r * HS_K + tid * HS_EPT + e] = out[e];
#pragma unroll
    for (i32 c = 0; c < HS_CPT; ++c) {
        const i32 pos = tid * HS_CPT + c;
        const bool hit = mark[slot[c]];
        lru_out[q * HS_H + (hit ? HS_H - total + hr : pos - hr)] = static_cast<i16>(slot[c]);
        hr += hit;
    }
    // 6. (grid_wait != null) What a miss copy fused into the resolver adds on a step without misses:
    // no block may leave before every group's plan is known to be empty. Each block publishes its
    // count and waits for all of them (a generation barrier over the grid: [arrivals, generation];
    // only for grids that are resident at once, as the bench launches it).
    if (grid_wait != nullptr) {
        __syncthreads();  // the block's stores are issued
        if (tid == 0) {
            const u32 gen = *reinterpret_cast<volatile u32*>(grid_wait + 1);
            __threadfence();
            if (atomicAdd(grid_wait, 1u) == gridDim.x - 1) {
                grid_wait[0] = 0;
                __threadfence();
                atomicAdd(grid_wait + 1, 1u);
            } else {
                while (*reinterpret_cast<volatile u32*>(grid_wait + 1) == gen) {
                }
            }
        }
        __syncthreads();
    }
}

// The least any kernel that needs the resolver's results adds behind it: launched like the miss
// copy (programmatic dependent launch, the next kernel let in at once), it waits for the resolver
// and exits. Timed behind a hit resolve, it bounds every miss copy that is a kernel of its own.
extern "C" __global__ void hisparse_dependent_noop() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
}
