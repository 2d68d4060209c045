// Hot-state maintenance: invalidation of written rows and recycled host blocks, and resets.
// None of these touch the LRU order except reset (which restores 0..H-1).
#include "common.cuh"

#define HS_MNT 256

// For pair blockIdx.x: the slot of state row state_rows[i] that holds host row host_rows[i]
// (if any) becomes empty. Pairs with a negative state row are skipped.
extern "C" __global__ void __launch_bounds__(HS_MNT) hisparse_invalidate_written(
    const i32* __restrict__ state_rows, const i32* __restrict__ host_rows, i32* __restrict__ hot_map, i32 H,
    i32 R) {
    const i32 q = state_rows[blockIdx.x];
    if (q < 0 || q >= R) return;
    const i32 g = host_rows[blockIdx.x];
    i32* row = hot_map + static_cast<i64>(q) * H;
    for (i32 s = threadIdx.x; s < H; s += HS_MNT) {
        if (row[s] == g) row[s] = -1;
    }
}

// Every slot of every state row whose host row lies in one of the `nb` blocks of
// `sorted_blocks` (ascending) becomes empty.
extern "C" __global__ void __launch_bounds__(HS_MNT) hisparse_invalidate_blocks(
    const i32* __restrict__ sorted_blocks, i32 nb, i32* __restrict__ hot_map, i64 total, i32 bs) {
    for (i64 i = static_cast<i64>(blockIdx.x) * HS_MNT + threadIdx.x; i < total;
         i += static_cast<i64>(gridDim.x) * HS_MNT) {
        const i32 v = hot_map[i];
        if (v < 0) continue;
        const i32 blk = v / bs;
        i32 lo = 0, hi = nb;
        while (lo < hi) {
            const i32 mid = (lo + hi) >> 1;
            if (sorted_blocks[mid] < blk) lo = mid + 1; else hi = mid;
        }
        if (lo < nb && sorted_blocks[lo] == blk) hot_map[i] = -1;
    }
}

// State row rows[blockIdx.x] returns to empty: hot map -1, LRU order 0..H-1.
extern "C" __global__ void __launch_bounds__(HS_MNT) hisparse_reset_rows(
    const i32* __restrict__ rows, i32* __restrict__ hot_map, i16* __restrict__ lru, i32 H) {
    const i64 base = static_cast<i64>(rows[blockIdx.x]) * H;
    for (i32 s = threadIdx.x; s < H; s += HS_MNT) {
        hot_map[base + s] = -1;
        lru[base + s] = static_cast<i16>(s);
    }
}
