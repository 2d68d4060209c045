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
#include "row_copy.cuh"

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

// One pass of a row copy: tasks first + u * stride (u < HS_UNROLL) below `end`, each a 16-byte
// slot (task / HS_SLOTS is the row, task % HS_SLOTS its slot); pair(e, src_row, dst_row) names row
// e's source and destination. Rows outside either buffer (only possible with unvalidated inputs)
// are skipped. Slots are aligned on the host side's lines (the source's when both sides are on the
// device). Every load of the pass is issued before the first store.
template <class Pair>
__device__ __forceinline__ void hs_copy_pass(u32 first, u32 stride, u32 end, const Pair& pair, const HsRows& src,
                                             const HsRows& dst, i32 bs) {
    const bool align_dst = dst.kind == HS_KIND_HOST && src.kind != HS_KIND_HOST;
    uint4 v[HS_UNROLL];
    unsigned char* to[HS_UNROLL];
#pragma unroll
    for (i32 u = 0; u < HS_UNROLL; ++u) {
        const u32 c = first + u * stride;
        to[u] = nullptr;
        if (c < end) {
            const i32 e = static_cast<i32>(c / HS_SLOTS);
            const i32 j = static_cast<i32>(c - static_cast<u32>(e) * HS_SLOTS);
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

// Moves `n` rows with a grid-stride loop over their slots (n * HS_SLOTS < 2^32, checked by the host).
template <class Pair>
__device__ __forceinline__ void hs_copy_rows(i32 n, const Pair& pair, const HsRows& src, const HsRows& dst, i32 bs) {
    const u32 total = static_cast<u32>(n) * HS_SLOTS;
    const u32 stride = gridDim.x * HS_GNT;
    for (u32 first = blockIdx.x * HS_GNT + threadIdx.x; first < total; first += stride * HS_UNROLL) {
        hs_copy_pass(first, stride, total, pair, src, dst, bs);
    }
}

// Entry e of the request-major plan: the request whose range holds e (binary search over the
// exclusive prefix of the plan counts, `start[0..rows]`), then its entry e - start[r]. The plan
// is read through L2 only (ld.global.cg): a copy that follows the resolver reads rows of it while
// the resolver still writes others.
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
        s = __ldcg(host + at);
        d = __ldcg(device + at);
    }
};

struct HsListPair {
    const i32* pairs;  // [n, 2]: (source row, destination row)
    __device__ __forceinline__ void operator()(i32 e, i32& s, i32& d) const {
        s = pairs[2 * e];
        d = pairs[2 * e + 1];
    }
};

__device__ __forceinline__ u64 hs_globaltimer() {
    u64 t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

// One block's record of a traced plan copy (see hisparse_gather_plan); the exit time is now.
__device__ __forceinline__ void hs_trace_block(u64* trace, u32 chunks, const u64* times) {
    u32 sm;
    asm volatile("mov.u32 %0, %smid;" : "=r"(sm));
    u64* row = trace + static_cast<u64>(blockIdx.x) * 5;
    row[0] = sm;
    row[1] = chunks;
    row[2] = times[0];
    row[3] = times[1];
    row[4] = hs_globaltimer();
}

__device__ __forceinline__ i32 hs_ld_acquire(const i32* p) {
    i32 v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// The plan copy: the miss plan (host row -> hot row) of batch rows [0, rows) into layers
// [layer_begin, layer_begin + layers). Persistent and self-balancing: the grid's blocks take
// chunks of HS_GNT * HS_UNROLL slots (16 KB) from a ticket counter, in request-major order over
// every layer's plan, so the reads in flight at any moment cover a narrow band of the plan (one or
// two requests' host regions) whatever the number of blocks or where they run. Where a block runs
// matters: right behind the resolver, whose blocks take a whole SM's registers, the blocks of a
// programmatically launched copy land first on the few SMs the resolver leaves free, several to
// an SM; a static split (every block its 1/gridDim of the slots) then ran at the pace of the
// most crowded SM (1.48x the copy engine at batch 128, 274 misses a request, docs/gpu-validation.md).
//
// `follow` = 0: an ordinary copy; `counts` is plan_counts, final once griddepcontrol.wait returns.
// `follow` = 1: launched right behind the resolver with programmatic stream serialization, and
// started while it runs. `counts` is the resolver's plan_ready: -1 while a row's plan is being
// written (every row's is marked so before the resolver lets this grid start), then its count,
// stored with release semantics after the row's plan entries. Warp 0 reads them with acquire loads
// in batch order, as far as its next chunk needs, so a request's rows are copied as soon as its
// group is resolved. The grid waits for the resolver's completion only before exiting, so that
// the next kernel of the stream, which waits for this grid, also sees the resolver complete.
//
// work[0] is the ticket counter, work[1] counts the blocks done; the last block resets both, so
// every launch starts from zero (plan copies of one runtime are ordered on one stream).
// trace (diagnostics, or null): per block [SM, chunks copied, entry, first chunk, exit], the
// times from %globaltimer in ns.
// Grid: (blocks, 1, 1); dynamic shared memory: at least (rows + 1) * 4 bytes (the host may ask for
// more, to limit the blocks an SM holds).
#define HS_CHUNK (HS_GNT * HS_UNROLL)
extern "C" __global__ void __launch_bounds__(HS_GNT) hisparse_gather_plan(
    const i32* plan_host, const i32* plan_device, const i32* counts, i32 rows, i32 K,
    const i64* __restrict__ host_bases, const i64* __restrict__ dev_bases, const i64* __restrict__ dev_block_strides,
    i32 layer_begin, i32 layers, i32 bs, i64 host_rows, i64 dev_rows, u64* __restrict__ stats, i32* work,
    i32 follow, u64* __restrict__ trace) {
    extern __shared__ i32 s_start[];  // [rows + 1]: where each scanned batch row's entries begin
    // By the iteration's parity, so that warp 0 writes the next iteration's values while the
    // other warps still read this one's: the batch rows whose counts are known, and the chunk.
    __shared__ i32 s_scanned[2];
    __shared__ u32 s_ticket[2];
    const i32 tid = threadIdx.x;
    const i32 lane = tid & 31;
    __shared__ u64 s_times[2];  // traced: the block's entry and first chunk (kept out of registers)
    if (trace != nullptr && tid == 0) {
        s_times[0] = hs_globaltimer();
        s_times[1] = 0;
    }
    // The layer addresses are written at bind time, never by the resolver: read them first, so
    // their round trip overlaps the wait.
    HsRows src = hs_rows(HS_KIND_HOST, layer_begin, host_bases, dev_bases, dev_block_strides, host_rows, dev_rows);
    HsRows dst = hs_rows(HS_KIND_DEVICE, layer_begin, host_bases, dev_bases, dev_block_strides, host_rows, dev_rows);
    // A no-op for an ordinary launch. The next kernel may be scheduled now: ours wait for this grid
    // before touching memory.
    if (!follow) asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (tid == 0) s_start[0] = 0;
    __syncthreads();
    // Warp 0: the counts as far as `need` slots (every count: 0xffffffff), in batch order, 128 rows
    // a round trip; a row whose plan is still pending ends the round.
    auto scan = [&](i32 done, u32 need) -> i32 {
        while (done < rows && static_cast<u32>(s_start[done]) * HS_SLOTS < need) {
            const i32 r0 = done + lane * 4;
            i32 c[4];
#pragma unroll
            for (i32 v = 0; v < 4; ++v) c[v] = r0 + v < rows ? hs_ld_acquire(counts + r0 + v) : 0;
            i32 first = 4;  // this lane's first pending row
#pragma unroll
            for (i32 v = 3; v >= 0; --v) {
                if (c[v] < 0) first = v;
            }
            // Rows final before the first pending one of the 128 (all 128 when none is pending).
            const i32 ready = static_cast<i32>(__reduce_min_sync(HS_FULL_MASK, first < 4 ? lane * 4 + first : 128u));
            i32 sum = 0;
#pragma unroll
            for (i32 v = 0; v < 4; ++v) {
                c[v] = lane * 4 + v < ready ? min(max(c[v], 0), K) : 0;
                sum += c[v];
            }
            i32 incl = sum;
#pragma unroll
            for (i32 o = 1; o < 32; o <<= 1) {
                const i32 y = __shfl_up_sync(HS_FULL_MASK, incl, o);
                if (lane >= o) incl += y;
            }
            i32 at = s_start[done] + incl - sum;
#pragma unroll
            for (i32 v = 0; v < 4; ++v) {
                at += c[v];
                if (lane * 4 + v < ready && r0 + v < rows) s_start[r0 + v + 1] = at;
            }
            done = min(done + ready, rows);
            __syncwarp();
            if (ready == 0) __nanosleep(200);
        }
        return done;
    };
    // Before any ticket: the counts up to the first miss. A plan without any (a step of hits) is
    // left at once, and then no block takes a ticket or counts itself done.
    if (tid < 32) {
        const i32 done = scan(0, 1);
        if (lane == 0) {
            s_scanned[1] = done;
            if (s_start[done] > 0) s_ticket[0] = atomicAdd(reinterpret_cast<u32*>(work), 1u);
        }
    }
    __syncthreads();
    if (s_start[s_scanned[1]] == 0) {  // every count known, and zero
        if (trace != nullptr && tid == 0) hs_trace_block(trace, 0, s_times);
        if (follow) asm volatile("griddepcontrol.wait;" ::: "memory");
        return;
    }
    if (trace != nullptr && tid == 0) s_times[1] = hs_globaltimer();
    u32 chunks = 0;  // thread 0: chunks this block copied (for the trace)
    u32 next = 0;  // thread 0: the ticket taken ahead, stored for the next iteration after the copy
    const bool whole = layers > 1;  // several layers: the chunks of a layer follow from the total
    for (u32 it = 0;; ++it) {
        const u32 odd = it & 1;
        if (tid < 32) {
            // Counts as far as this chunk needs (every count for a multi-layer copy).
            __syncwarp();  // thread 0 stored this iteration's ticket
            const i32 done = scan(s_scanned[odd ^ 1u], whole ? 0xffffffffu : (s_ticket[odd] + 1) * HS_CHUNK);
            if (lane == 0) {
                s_scanned[odd] = done;
                next = atomicAdd(reinterpret_cast<u32*>(work), 1u);  // its round trip overlaps the copy
            }
        }
        __syncthreads();
        const u32 t = s_ticket[odd];
        const i32 scanned = s_scanned[odd];
        const u32 known = static_cast<u32>(s_start[scanned]) * HS_SLOTS;  // slots of the scanned rows
        u32 c0 = t * HS_CHUNK;
        i32 z = 0;
        if (whole) {  // every count known: chunks of layer z follow those of layer z - 1
            const u32 per_layer = (known + HS_CHUNK - 1) / HS_CHUNK;
            if (per_layer == 0 || t >= per_layer * static_cast<u32>(layers)) break;
            z = static_cast<i32>(t / per_layer);
            c0 = (t - static_cast<u32>(z) * per_layer) * HS_CHUNK;
            if (z > 0) {
                src = hs_rows(HS_KIND_HOST, layer_begin + z, host_bases, dev_bases, dev_block_strides, host_rows,
                              dev_rows);
                dst = hs_rows(HS_KIND_DEVICE, layer_begin + z, host_bases, dev_bases, dev_block_strides, host_rows,
                              dev_rows);
            }
        } else if (c0 >= known) {
            break;  // every count is known (the scan stops short only at the end) and the plan is done
        }
        HsPlanPair pair{plan_host, plan_device, s_start, scanned, K};
        hs_copy_pass(c0 + static_cast<u32>(tid), HS_GNT, min(c0 + HS_CHUNK, known), pair, src, dst, bs);
        if (tid == 0) {
            s_ticket[odd ^ 1u] = next;  // read by all after the next barrier
            ++chunks;
        }
    }
    if (tid == 0) {
        if (trace != nullptr) hs_trace_block(trace, chunks, s_times);
        const u32 n = static_cast<u32>(s_start[rows]);  // every count is known on exit
        if (blockIdx.x == 0 && n) atomicAdd(&stats[3], static_cast<u64>(n) * HS_ROW_BYTES * layers);
        __threadfence();  // this block's tickets are taken before it counts itself done
        if (atomicAdd(reinterpret_cast<u32*>(work) + 1, 1u) == gridDim.x - 1) {
            work[0] = 0;
            work[1] = 0;
        }
    }
    if (follow) asm volatile("griddepcontrol.wait;" ::: "memory");
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

// The early exit of both speculative gathers (hisparse_gather_spec step 2 says why it is safe):
// whether a block may leave without waiting for the resolver. `likely`: this thread has a task
// that may be a miss; `held`: one found held at its hinted slot; `sure()`, called after the fence:
// the victims flags of this thread's held tasks' requests read 0. Every thread of the block calls it.
template <class Sure>
__device__ __forceinline__ bool hs_leave_early(bool likely, bool held, const Sure& sure) {
    if (__syncthreads_or(likely)) return false;
    if (!__syncthreads_or(held)) return true;
    if (threadIdx.x == 0) hs_fence_sc();
    __syncthreads();
    return __syncthreads_and(sure());
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
// A block none of whose tasks can be a miss leaves before step 2 (victims, when not null: see
// there), so on a resident step or one of hint hits the grid does not hold SMs behind the
// resolver; only block 0 waits for it.
// Grid: (blocks, 1, 1) with blocks * HS_GNT * HS_UNROLL >= rows * K * HS_SLOTS (the host sizes it
// so): one pass, each thread's HS_UNROLL tasks (entry, slot) known from the start.
// pos_slot and hot_map are not __restrict__: the resolver writes them while step 1 reads them, so
// they are read with relaxed GPU-scope loads (from L2, never the read-only path or an L1 copy).
extern "C" __global__ void __launch_bounds__(HS_GNT) hisparse_gather_spec(
    const i32* __restrict__ topk, const i32* __restrict__ row_state, const i32* __restrict__ seq_lens,
    const i32* __restrict__ source_table, const i32* __restrict__ resident_table, const i16* pos_slot,
    const i32* hot_map, const i32* __restrict__ out_rows, const i32* __restrict__ plan_counts,
    const u32* __restrict__ miss_mask, i32 rows, i32 K, i32 bs, i32 P, i32 H, const i64* __restrict__ host_bases,
    const i64* __restrict__ dev_bases, const i64* __restrict__ dev_block_strides, i64 host_rows, i64 dev_rows,
    u64* __restrict__ stats, const i32* victims) {
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
        hint_r[u] = hs_ld_relaxed(pos_slot + (q_r[u] >= 0 ? page_r[u] * bs + t_r[u] % bs : 0));
    }
    i32 g_r[HS_UNROLL];  // host row of the task's entry (-1: not a host entry or past the end)
    i32 hm_r[HS_UNROLL];
#pragma unroll
    for (i32 u = 0; u < HS_UNROLL; ++u) {
        const i32 b = b_r[u];
        const bool host = q_r[u] >= 0 && res_r[u] < 0 && b >= 0 && static_cast<i64>(b) * bs + t_r[u] % bs < src.limit;
        g_r[u] = host ? b * bs + t_r[u] % bs : -1;
        const i32 hint = hint_r[u];
        hm_r[u] = hs_ld_relaxed(hot_map + (host && hint >= 0 && hint < H ? static_cast<i64>(q_r[u]) * H + hint : 0));
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

    // ---- 2. Blocks that can hold no miss leave without waiting for the resolver ------------------
    // A task cannot be a miss if it is no host entry, or if its hinted slot held its host row and
    // the resolver had not begun refilling the request's slots. The second is the flag the
    // resolver sets, then fences (fence.sc), before it stores to a hot map or a hint: this block
    // reads the slots, fences, then reads the flags. If the resolver's fence came first, the flag
    // reads 1; if ours did, every slot read here preceded every refill, so what it held it held
    // at the step's start, and the resolver finds it there (its hint check is the same). Block 0
    // always waits, so the grid still ends after the resolver: the next kernel waits for this
    // grid alone. Resident steps read no flag; steps of hint hits read one round trip of them.
    if (victims != nullptr && blockIdx.x != 0) {
        u32 held = 0;
        bool likely = false;
#pragma unroll
        for (i32 u = 0; u < HS_UNROLL; ++u) {
            if (g_r[u] >= 0) {
                if (hm_r[u] == g_r[u]) {
                    held |= 1u << u;
                } else {
                    likely = true;
                }
            }
        }
        const auto sure = [&]() {
            bool all = true;
#pragma unroll
            for (i32 u = 0; u < HS_UNROLL; ++u) {
                if ((held >> u) & 1u) all &= hs_ld_relaxed_ordered(victims + q_r[u]) == 0;
            }
            return all;
        };
        if (hs_leave_early(likely, held != 0, sure)) return;
    }

    // ---- 3. The resolver's misses ---------------------------------------------------------------
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

// Block-wide compaction: the threads whose `flag` is set, in thread order, get consecutive indices
// from 0 (returned; -1 for the others) and `count` their number. Every thread of the block calls it.
__device__ __forceinline__ i32 hs_block_rank(bool flag, i32* s_warp, i32& count) {
    const i32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 ballot = __ballot_sync(HS_FULL_MASK, flag);
    if (lane == 0) s_warp[warp] = __popc(ballot);
    __syncthreads();
    i32 before = 0;
    count = 0;
#pragma unroll
    for (i32 w = 0; w < HS_GNT / 32; ++w) {
        const i32 c = s_warp[w];
        before += w < warp ? c : 0;
        count += c;
    }
    __syncthreads();  // s_warp may be reused at once
    return flag ? before + __popc(ballot & ((1u << lane) - 1u)) : -1;
}

// (host row, hot row) of the block's misses that were not read early: local entry indices in `list`.
struct HsLocalPair {
    const i32* list;
    const i32* g;
    const i32* d;
    __device__ __forceinline__ void operator()(i32 e, i32& s, i32& dst) const {
        const i32 i = list[e];
        s = g[i];
        dst = d[i];
    }
};

// The speculative gather by entries (the default; HISPARSE_SPEC_KERNEL=slots is hisparse_gather_spec
// above): the same contract and launch, but a block first classifies `epb` entries of one row
// (runs of `run`, every nb-th run, nb = ceil(K / epb)), one a thread of its first half (three round
// trips, as there), and only the block's likely misses become 16-byte tasks, HS_UNROLL a thread,
// read into registers before griddepcontrol.wait. After it, each classified entry reads the
// resolver's verdict (count, mask bit, output row) once; the
// early reads of misses are stored, and the misses not read early (guessed hits, or past what the
// registers hold) are copied then. A step without misses costs a grid of rows * K / HS_SEPB blocks
// that fits beside the resolver in one wave (64 blocks at batch 8 of top-k 2048), where the slot
// kernel's rows * K * HS_SLOTS / (HS_GNT * HS_UNROLL) blocks (768) took several. The early exit
// (victims) is the slot kernel's. `epb` (1..HS_SEPB) entries a block, in runs of `run` (a divisor of epb);
// grid: (rows * ceil(K / epb), 1, 1).
#define HS_SEPB (HS_GNT / 2)
#define HS_SEARLY ((HS_GNT * HS_UNROLL) / HS_SLOTS)  // likely misses a block reads early
extern "C" __global__ void __launch_bounds__(HS_GNT) hisparse_gather_spec_entries(
    const i32* __restrict__ topk, const i32* __restrict__ row_state, const i32* __restrict__ seq_lens,
    const i32* __restrict__ source_table, const i32* __restrict__ resident_table, const i16* pos_slot,
    const i32* hot_map, const i32* __restrict__ out_rows, const i32* __restrict__ plan_counts,
    const u32* __restrict__ miss_mask, i32 rows, i32 K, i32 bs, i32 P, i32 H, const i64* __restrict__ host_bases,
    const i64* __restrict__ dev_bases, const i64* __restrict__ dev_block_strides, i64 host_rows, i64 dev_rows,
    u64* __restrict__ stats, const i32* victims, i32 epb, i32 run) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const HsRows src = hs_rows(HS_KIND_HOST, 0, host_bases, dev_bases, dev_block_strides, host_rows, dev_rows);
    const HsRows dst = hs_rows(HS_KIND_DEVICE, 0, host_bases, dev_bases, dev_block_strides, host_rows, dev_rows);
    __shared__ i32 s_g[HS_SEPB];      // host row of each classified entry (-1: none)
    __shared__ i32 s_d[HS_SEPB];      // after the wait: its hot row where it is a miss (-1: none)
    __shared__ i32 s_list[HS_SEPB];   // likely misses, then the misses not read early (local indices)
    __shared__ i32 s_warp[HS_GNT / 32];
    const i32 tid = threadIdx.x;
    // A block's entries are runs of `run` consecutive entries of one row, every nb-th run, not epb
    // consecutive entries: a step's misses often sit together in the top-k (a decode's new positions),
    // and a cluster of them longer than HS_SEARLY in one block was read after the wait. A run of 8 keeps
    // the per-entry loads at one 32-byte sector per 8 entries, as consecutive entries have them.
    // run divides epb (the host's gcd); run == epb is the consecutive layout. rows * nb blocks;
    // rows * K < 2^31 (checked by the host).
    const i32 nb = (K + epb - 1) / epb;
    const i32 row = blockIdx.x / nb;
    const i32 k = ((tid / run) * nb + blockIdx.x % nb) * run + tid % run;
    const i32 E = row * K + k;
    const bool mine = tid < epb && row < rows && k < K;

    // ---- 1. Classify the block's entries (three round trips) ----------------------------------
    i32 q = -1, t = -1, len = 0;
    if (mine) {
        q = row_state[E / K];
        t = topk[E];
        len = seq_lens[E / K];
    }
    const bool ok = mine && q >= 0 && t >= 0 && t < len && t / bs < P;
    const i64 page = ok ? static_cast<i64>(q) * P + t / bs : 0;
    i32 g = -1, hint = -1, res = -1, b = -1;
    if (ok) {
        b = source_table[page];
        res = resident_table[page];
        hint = hs_ld_relaxed(pos_slot + page * bs + t % bs);
    }
    const bool host = ok && res < 0 && b >= 0 && static_cast<i64>(b) * bs + t % bs < src.limit;
    if (host) g = b * bs + t % bs;
    const bool hinted = host && hint >= 0 && hint < H;
    const i32 hm = hinted ? hs_ld_relaxed(hot_map + static_cast<i64>(q) * H + hint) : -2;
    const bool held = host && hm == g;
    const bool likely = host && hm != g;
    if (tid < HS_SEPB) s_g[tid] = g;

    // ---- 2. Blocks that can hold no miss leave without waiting (see hisparse_gather_spec) -----
    if (victims != nullptr && blockIdx.x != 0 &&
        hs_leave_early(likely, held, [&]() { return !held || hs_ld_relaxed_ordered(victims + q) == 0; })) {
        return;
    }

    // ---- 3. Early reads of the likely misses -----------------------------------------------------
    i32 n_likely;
    const i32 rank = hs_block_rank(likely, s_warp, n_likely);
    if (rank >= 0) s_list[rank] = tid;
    __syncthreads();
    const u32 early_tasks = static_cast<u32>(min(n_likely, HS_SEARLY)) * HS_SLOTS;
    uint4 v[HS_UNROLL];
    i32 at[HS_UNROLL];  // local entry of the task, -1: none
    i32 pos[HS_UNROLL];
#pragma unroll
    for (i32 u = 0; u < HS_UNROLL; ++u) {
        const u32 c = static_cast<u32>(tid) + static_cast<u32>(u) * HS_GNT;
        at[u] = -1;
        if (c < early_tasks) {
            const i32 i = s_list[c / HS_SLOTS];
            const unsigned char* from = src.at(s_g[i], bs);
            const i32 p = static_cast<i32>(c % HS_SLOTS) * 16 - static_cast<i32>(reinterpret_cast<u64>(from) & 127);
            if (p >= 0 && p < HS_ROW_BYTES) {
                v[u] = hs_load16(from + p);
                at[u] = i;
                pos[u] = p;
            }
        }
    }

    // ---- 4. The resolver's misses ---------------------------------------------------------------
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (blockIdx.x == 0 && tid == 0) {
        i64 n = 0;
        for (i32 r = 0; r < rows; ++r) n += min(max(plan_counts[r], 0), K);
        if (n) atomicAdd(&stats[3], static_cast<u64>(n) * HS_ROW_BYTES);
    }
    i32 d = -1;
    if (host) {
        const i32 cnt = plan_counts[E / K];
        const u32 word = miss_mask[E >> 5];
        const i32 dd = out_rows[E];
        if (cnt > 0 && ((word >> (E & 31)) & 1u) && dd >= 0 && dd < dst.limit) d = dd;
    }
    if (tid < HS_SEPB) s_d[tid] = d;
    __syncthreads();
#pragma unroll
    for (i32 u = 0; u < HS_UNROLL; ++u) {
        if (at[u] >= 0) {
            const i32 dd = s_d[at[u]];
            if (dd >= 0) hs_store16(dst.at(dd, bs) + pos[u], v[u]);
        }
    }
    // The misses not read early: guessed hits, and likely misses past the registers' share.
    const bool late = d >= 0 && !(likely && rank < HS_SEARLY);
    i32 n_late;
    const i32 lrank = hs_block_rank(late, s_warp, n_late);  // its barriers also order s_list's reuse
    if (lrank >= 0) s_list[lrank] = tid;
    __syncthreads();
    const u32 late_tasks = static_cast<u32>(n_late) * HS_SLOTS;
    const HsLocalPair pair{s_list, s_g, s_d};
    for (u32 first = tid; first < late_tasks; first += HS_GNT * HS_UNROLL) {
        hs_copy_pass(first, HS_GNT, late_tasks, pair, src, dst, bs);
    }
}
