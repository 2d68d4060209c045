// Row copies between the registered host pool and the device caches, for every layer asked.
//
// Compile-time constants:
//   HS_VEC     16-byte vectors per row (row_bytes / 16)
//   HS_GNT     threads per block
//   HS_UNROLL  independent 16-byte loads each thread keeps in flight
//
// Rows are cut along the 128-byte lines of their host side: a row is HS_SLOTS 16-byte slots, 8 per
// line over the HS_ROW_LINES lines a row can touch, and the slots outside the row stay idle. So a
// warp's load or store covers 4 whole lines and no host line is split between two requests: 6-7
// points more of the copy engine's bandwidth for random 656-byte rows (83% -> 87-89% read
// request by request, bench/bench_host_reads.py).
//
// Work is flattened: consecutive threads take consecutive slots, and the plan copy runs through
// the rows of every request in batch order (request-major) with a grid-stride loop, so the reads in
// flight at any moment cover one or two requests' host regions. Spreading every request over the
// whole time (a grid dimension per request) touches all of them at once and runs into the host's
// address translation: 71-77% of the copy engine for the same rows. Both properties were measured
// in bench/bench_host_reads.py. Batch 1 still spreads one request's rows over every block.
//
// Addressing: a host row g of layer l lives at host_bases[l] + g * row_bytes (the pool's
// device-mapped address); a device row d at dev_bases[l] + (d / bs) * dev_block_strides[l] +
// (d % bs) * row_bytes (a layer's [num_blocks, bs, width] cache, blocks possibly strided).
#include "common.cuh"

#ifndef HS_VEC
#error "HS_VEC must be defined"
#endif
#ifndef HS_GNT
#define HS_GNT 256
#endif
#ifndef HS_UNROLL
#define HS_UNROLL 4
#endif
#define HS_ROW_BYTES (HS_VEC * 16)
// Lines of 128 bytes a row starting at a 16-byte aligned address can touch, and its slots.
#define HS_ROW_LINES ((HS_ROW_BYTES + 111) / 128 + 1)
#define HS_SLOTS (HS_ROW_LINES * 8)

// Row location kinds for hisparse_copy_rows.
#define HS_KIND_HOST 0
#define HS_KIND_DEVICE 1

struct HsRows {
    unsigned char* base;
    i64 block_stride;  // bytes between device blocks (unused for host rows)
    i64 limit;         // rows addressable
    i32 kind;

    __device__ __forceinline__ unsigned char* at(i32 row, i32 bs) const {
        if (kind == HS_KIND_HOST) return base + static_cast<i64>(row) * HS_ROW_BYTES;
        const i32 blk = row / bs;
        return base + blk * block_stride + static_cast<i64>(row - blk * bs) * HS_ROW_BYTES;
    }
};

__device__ __forceinline__ HsRows hs_rows(i32 kind, i32 layer, const i64* host_bases, const i64* dev_bases,
                                          const i64* dev_block_strides, i64 host_rows, i64 dev_rows) {
    HsRows out;
    out.kind = kind;
    if (kind == HS_KIND_HOST) {
        out.base = reinterpret_cast<unsigned char*>(host_bases[layer]);
        out.block_stride = 0;
        out.limit = host_rows;
    } else {
        out.base = reinterpret_cast<unsigned char*>(dev_bases[layer]);
        out.block_stride = dev_block_strides[layer];
        out.limit = dev_rows;
    }
    return out;
}

// Moves `n` rows; pair(e, src_row, dst_row) names row e's source and destination. Rows outside
// either buffer (only possible with unvalidated inputs) are skipped. Slots are aligned on the
// host side's lines (the source's when both sides are on the device).
template <class Pair>
__device__ __forceinline__ void hs_copy_rows(i32 n, const Pair& pair, const HsRows& src, const HsRows& dst, i32 bs) {
    const bool align_dst = dst.kind == HS_KIND_HOST && src.kind != HS_KIND_HOST;
    const i64 total = static_cast<i64>(n) * HS_SLOTS;
    const i64 stride = static_cast<i64>(gridDim.x) * HS_GNT;
    for (i64 first = static_cast<i64>(blockIdx.x) * HS_GNT + threadIdx.x; first < total;
         first += stride * HS_UNROLL) {
        uint4 v[HS_UNROLL];
        unsigned char* to[HS_UNROLL];
#pragma unroll
        for (i32 u = 0; u < HS_UNROLL; ++u) {
            const i64 c = first + u * stride;
            to[u] = nullptr;
            if (c < total) {
                const u32 cc = static_cast<u32>(c);  // n * HS_SLOTS < 2^32 (checked by the host)
                const i32 e = static_cast<i32>(cc / HS_SLOTS);
                const i32 j = static_cast<i32>(cc - static_cast<u32>(e) * HS_SLOTS);
                i32 s, d;
                pair(e, s, d);
                if (s >= 0 && s < src.limit && d >= 0 && d < dst.limit) {
                    const unsigned char* from = src.at(s, bs);
                    unsigned char* into = dst.at(d, bs);
                    const i32 skew = static_cast<i32>(reinterpret_cast<u64>(align_dst ? into : from) & 127);
                    const i32 pos = j * 16 - skew;
                    if (pos >= 0 && pos < HS_ROW_BYTES) {
                        v[u] = hs_load16(from + pos);
                        to[u] = into + pos;
                    }
                }
            }
        }
#pragma unroll
        for (i32 u = 0; u < HS_UNROLL; ++u) {
            if (to[u] != nullptr) hs_store16(to[u], v[u]);
        }
    }
}

// Entry e of the request-major plan: the request whose range holds e (binary search over the
// exclusive prefix of the plan counts, `start[0..rows]`), then its entry e - start[r].
struct HsPlanPair {
    const i32* host;
    const i32* device;
    const i32* start;
    i32 rows;
    i32 K;
    __device__ __forceinline__ void operator()(i32 e, i32& s, i32& d) const {
        i32 lo = 0, hi = rows;  // start[lo] <= e < start[hi]
        while (hi - lo > 1) {
            const i32 mid = (lo + hi) >> 1;
            if (start[mid] <= e) lo = mid;
            else hi = mid;
        }
        const i64 at = static_cast<i64>(lo) * K + (e - start[lo]);
        s = host[at];
        d = device[at];
    }
};

struct HsListPair {
    const i32* pairs;  // [n, 2]: (source row, destination row)
    __device__ __forceinline__ void operator()(i32 e, i32& s, i32& d) const {
        s = pairs[2 * e];
        d = pairs[2 * e + 1];
    }
};

// Copies the miss plan (host row -> hot row) of batch rows [0, rows) into layer
// layer_begin + blockIdx.z. Grid: (blocks, 1, layers); dynamic shared memory: (rows + 1) * 4 bytes.
extern "C" __global__ void __launch_bounds__(HS_GNT) hisparse_gather_plan(
    const i32* __restrict__ plan_host, const i32* __restrict__ plan_device, const i32* __restrict__ plan_counts,
    i32 rows, i32 K, const i64* __restrict__ host_bases, const i64* __restrict__ dev_bases,
    const i64* __restrict__ dev_block_strides, i32 layer_begin, i32 bs, i64 host_rows, i64 dev_rows,
    u64* __restrict__ stats) {
    extern __shared__ i32 s_start[];  // [rows + 1]: where each batch row's entries begin
    const i32 layer = layer_begin + blockIdx.z;
    // The layer addresses are written at bind time, never by the resolver: read them first, so
    // their round trip overlaps the wait below.
    const HsRows src = hs_rows(HS_KIND_HOST, layer, host_bases, dev_bases, dev_block_strides, host_rows, dev_rows);
    const HsRows dst = hs_rows(HS_KIND_DEVICE, layer, host_bases, dev_bases, dev_block_strides, host_rows, dev_rows);
    // Launched with programmatic stream serialization, this grid may start while the resolver
    // still runs: wait for it (a no-op for an ordinary launch) before reading its plan. The next
    // kernel may be scheduled now: ours wait for this grid before touching memory.
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (threadIdx.x < 32) {  // one warp scans the counts
        const i32 lane = threadIdx.x;
        i32 carry = 0;
        for (i32 base = 0; base < rows; base += 32) {
            const i32 r = base + lane;
            const i32 c = r < rows ? min(max(plan_counts[r], 0), K) : 0;
            i32 incl = c;
#pragma unroll
            for (i32 o = 1; o < 32; o <<= 1) {
                const i32 t = __shfl_up_sync(HS_FULL_MASK, incl, o);
                if (lane >= o) incl += t;
            }
            if (r < rows) s_start[r] = carry + incl - c;
            carry += __shfl_sync(HS_FULL_MASK, incl, 31);
        }
        if (lane == 0) s_start[rows] = carry;
    }
    __syncthreads();
    const i32 n = s_start[rows];
    if (n <= 0) return;
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        atomicAdd(&stats[3], static_cast<u64>(n) * HS_ROW_BYTES);
    }
    HsPlanPair pair{plan_host, plan_device, s_start, rows, K};
    hs_copy_rows(n, pair, src, dst, bs);
}

// Copies a list of (source row, destination row) pairs in layer layer_begin + blockIdx.z, between
// the kinds given (host or device). Row mirrors and page spills are device -> host, restores
// host -> device, copy-on-write host -> host. stat_index >= 0 adds stat_bytes once per layer.
extern "C" __global__ void __launch_bounds__(HS_GNT) hisparse_copy_rows(
    const i32* __restrict__ pairs, i32 n, i32 src_kind, i32 dst_kind, const i64* __restrict__ host_bases,
    const i64* __restrict__ dev_bases, const i64* __restrict__ dev_block_strides, i32 layer_begin, i32 bs,
    i64 host_rows, i64 dev_rows, u64* __restrict__ stats, i32 stat_index, i64 stat_bytes) {
    const i32 layer = layer_begin + blockIdx.z;
    if (stat_index >= 0 && blockIdx.x == 0 && threadIdx.x == 0) {
        atomicAdd(&stats[stat_index], static_cast<u64>(stat_bytes));
    }
    const HsRows src = hs_rows(src_kind, layer, host_bases, dev_bases, dev_block_strides, host_rows, dev_rows);
    const HsRows dst = hs_rows(dst_kind, layer, host_bases, dev_bases, dev_block_strides, host_rows, dev_rows);
    HsListPair pair{pairs};
    hs_copy_rows(n, pair, src, dst, bs);
}

// Copies the miss plan of batch rows [0, rows) into layer 0 like hisparse_gather_plan, but starts
// the host reads while the resolver still runs (small batches: the grid covers every entry's slots
// in one pass). Launched right behind the resolver with programmatic stream serialization:
//   1. before the resolver finishes, each host entry whose hinted slot does not hold its row (a
//      likely miss, read without synchronization from the hot state the resolver is changing) has
//      its slots loaded into registers;
//   2. after griddepcontrol.wait (the resolver's writes visible), the entries whose miss_mask bit
//      the resolver set are the plan's misses: each goes to its out_rows row, from the registers
//      when step 1 guessed it, else loaded now. Guesses only decide what is read early; what is
//      written is decided by the resolver's final outputs, so a wrong guess costs time, never bytes.
// Grid: (blocks, 1, 1) with blocks * HS_GNT * HS_UNROLL >= rows * K * HS_SLOTS (the host sizes it
// so): one pass, each thread's HS_UNROLL tasks (entry, slot) known from the start.
// pos_slot and hot_map are not __restrict__: the resolver writes them while step 1 reads them, so
// they must not go through the read-only path.
extern "C" __global__ void __launch_bounds__(HS_GNT) hisparse_gather_spec(
    const i32* __restrict__ topk, const i32* __restrict__ row_state, const i32* __restrict__ seq_lens,
    const i32* __restrict__ source_table, const i32* __restrict__ resident_table, const i16* pos_slot,
    const i32* hot_map, const i32* __restrict__ out_rows, const i32* __restrict__ plan_counts,
    const u32* __restrict__ miss_mask, i32 rows, i32 K, i32 bs, i32 P, i32 H, const i64* __restrict__ host_bases,
    const i64* __restrict__ dev_bases, const i64* __restrict__ dev_block_strides, i64 host_rows, i64 dev_rows,
    u64* __restrict__ stats) {
    // The next kernel may be scheduled now: ours wait for this grid before touching memory.
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const HsRows src = hs_rows(HS_KIND_HOST, 0, host_bases, dev_bases, dev_block_strides, host_rows, dev_rows);
    const HsRows dst = hs_rows(HS_KIND_DEVICE, 0, host_bases, dev_bases, dev_block_strides, host_rows, dev_rows);
    const u32 total = static_cast<u32>(rows) * static_cast<u32>(K) * HS_SLOTS;  // < 2^32 (checked by the host)
    const u32 stride = gridDim.x * HS_GNT;
    const u32 first = blockIdx.x * HS_GNT + threadIdx.x;

    // ---- 1. Early reads of likely misses ------------------------------------------------------
    // Three round trips before the host read: the entry (row state, position, length); its
    // page-table entries and position hint; the hinted slot's row. Every load of a round trip is
    // issued unconditionally (index 0 stands in for an invalid one) so that the task's four chains
    // overlap instead of running one after the other.
    i32 E_r[HS_UNROLL], q_r[HS_UNROLL], t_r[HS_UNROLL], len_r[HS_UNROLL];
#pragma unroll
    for (i32 u = 0; u < HS_UNROLL; ++u) {
        const u32 c = first + u * stride;
        E_r[u] = c < total ? static_cast<i32>(c / HS_SLOTS) : -1;
        const i32 E = max(E_r[u], 0);
        const i32 r = E / K;
        q_r[u] = row_state[r];
        t_r[u] = topk[E];
        len_r[u] = seq_lens[r];
    }
    i64 page_r[HS_UNROLL];
#pragma unroll
    for (i32 u = 0; u < HS_UNROLL; ++u) {
        const i32 q = q_r[u], t = t_r[u];
        const bool ok = E_r[u] >= 0 && q >= 0 && t >= 0 && t < len_r[u] && t / bs < P;
        if (!ok) q_r[u] = -1;
        page_r[u] = ok ? static_cast<i64>(q) * P + t / bs : 0;
    }
    i32 b_r[HS_UNROLL], res_r[HS_UNROLL], hint_r[HS_UNROLL];
#pragma unroll
    for (i32 u = 0; u < HS_UNROLL; ++u) {
        b_r[u] = source_table[page_r[u]];
        res_r[u] = resident_table[page_r[u]];
        hint_r[u] = pos_slot[q_r[u] >= 0 ? page_r[u] * bs + t_r[u] % bs : 0];
    }
    i32 g_r[HS_UNROLL];  // host row of the task's entry (-1: not a host entry or past the end)
    i32 hm_r[HS_UNROLL];
#pragma unroll
    for (i32 u = 0; u < HS_UNROLL; ++u) {
        const i32 b = b_r[u];
        const bool host = q_r[u] >= 0 && res_r[u] < 0 && b >= 0 && static_cast<i64>(b) * bs + t_r[u] % bs < src.limit;
        g_r[u] = host ? b * bs + t_r[u] % bs : -1;
        const i32 hint = hint_r[u];
        hm_r[u] = hot_map[host && hint >= 0 && hint < H ? static_cast<i64>(q_r[u]) * H + hint : 0];
        if (!(host && hint >= 0 && hint < H)) hm_r[u] = -2;  // no usable hint: a likely miss
    }
    uint4 v[HS_UNROLL];
    bool have[HS_UNROLL];
#pragma unroll
    for (i32 u = 0; u < HS_UNROLL; ++u) {
        have[u] = false;
        const i32 g = g_r[u];
        if (g >= 0 && hm_r[u] != g) {
            const u32 c = first + u * stride;
            const unsigned char* from = src.at(g, bs);
            const i32 pos = static_cast<i32>(c % HS_SLOTS) * 16 - static_cast<i32>(reinterpret_cast<u64>(from) & 127);
            if (pos >= 0 && pos < HS_ROW_BYTES) {
                v[u] = hs_load16(from + pos);
                have[u] = true;
            }
        }
    }

    // ---- 2. The resolver's misses ---------------------------------------------------------------
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        i64 n = 0;
        for (i32 r = 0; r < rows; ++r) n += min(max(plan_counts[r], 0), K);
        if (n) atomicAdd(&stats[3], static_cast<u64>(n) * HS_ROW_BYTES);
    }
    // One round trip: each task's row count, mask word and output row, issued together.
    i32 cnt[HS_UNROLL], d_r[HS_UNROLL];
    u32 word[HS_UNROLL];
#pragma unroll
    for (i32 u = 0; u < HS_UNROLL; ++u) {
        const i32 E = max(E_r[u], 0);
        cnt[u] = plan_counts[E / K];
        word[u] = miss_mask[E >> 5];
        d_r[u] = out_rows[E];
    }
    unsigned char* to[HS_UNROLL];
#pragma unroll
    for (i32 u = 0; u < HS_UNROLL; ++u) {
        const i32 E = E_r[u], g = g_r[u], d = d_r[u];
        to[u] = nullptr;
        if (g >= 0 && cnt[u] > 0 && ((word[u] >> (E & 31)) & 1u) && d >= 0 && d < dst.limit) {
            const unsigned char* from = src.at(g, bs);
            const i32 pos = static_cast<i32>((first + u * stride) % HS_SLOTS) * 16 -
                            static_cast<i32>(reinterpret_cast<u64>(from) & 127);
            if (pos >= 0 && pos < HS_ROW_BYTES) {
                if (!have[u]) v[u] = hs_load16(from + pos);
                to[u] = dst.at(d, bs) + pos;
            }
        }
    }
#pragma unroll
    for (i32 u = 0; u < HS_UNROLL; ++u) {
        if (to[u] != nullptr) hs_store16(to[u], v[u]);
    }
}
