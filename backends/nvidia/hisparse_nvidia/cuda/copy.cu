// Row copies between the registered host pool and the device caches, for every layer asked.
//
// Compile-time constants:
//   HS_VEC     16-byte vectors per row (row_bytes / 16)
//   HS_GNT     threads per block
//   HS_UNROLL  independent 16-byte loads each thread keeps in flight
//
// Work is flattened to 16-byte chunks: consecutive threads move consecutive chunks of a row, so a
// warp's loads coalesce, and a row's chunks spread over every block of the grid's x dimension.
// That is what keeps one request's misses fast at batch 1: the host picks gridDim.x so that a
// few hundred rows are spread over enough blocks to keep ~100 KB of PCIe reads in flight.
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
// either buffer (only possible with unvalidated inputs) are skipped.
template <class Pair>
__device__ __forceinline__ void hs_copy_rows(i32 n, const Pair& pair, const HsRows& src, const HsRows& dst, i32 bs) {
    const i64 total = static_cast<i64>(n) * HS_VEC;
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
                const u32 cc = static_cast<u32>(c);  // n * HS_VEC < 2^32 (checked by the host)
                const i32 e = static_cast<i32>(cc / HS_VEC);
                const i32 k = static_cast<i32>(cc - static_cast<u32>(e) * HS_VEC);
                i32 s, d;
                pair(e, s, d);
                if (s >= 0 && s < src.limit && d >= 0 && d < dst.limit) {
                    v[u] = hs_load16(src.at(s, bs) + k * 16);
                    to[u] = dst.at(d, bs) + k * 16;
                }
            }
        }
#pragma unroll
        for (i32 u = 0; u < HS_UNROLL; ++u) {
            if (to[u] != nullptr) hs_store16(to[u], v[u]);
        }
    }
}

struct HsPlanPair {
    const i32* host;
    const i32* device;
    __device__ __forceinline__ void operator()(i32 e, i32& s, i32& d) const {
        s = host[e];
        d = device[e];
    }
};

struct HsListPair {
    const i32* pairs;  // [n, 2]: (source row, destination row)
    __device__ __forceinline__ void operator()(i32 e, i32& s, i32& d) const {
        s = pairs[2 * e];
        d = pairs[2 * e + 1];
    }
};

// Copies the miss plan (host row -> hot row) of batch row blockIdx.y into layer
// layer_begin + blockIdx.z. Grid: (blocks per row, batch rows, layers).
extern "C" __global__ void __launch_bounds__(HS_GNT) hisparse_gather_plan(
    const i32* __restrict__ plan_host, const i32* __restrict__ plan_device, const i32* __restrict__ plan_counts,
    i32 K, const i64* __restrict__ host_bases, const i64* __restrict__ dev_bases,
    const i64* __restrict__ dev_block_strides, i32 layer_begin, i32 bs, i64 host_rows, i64 dev_rows,
    u64* __restrict__ stats) {
    const i32 r = blockIdx.y;
    const i32 layer = layer_begin + blockIdx.z;
    // The layer addresses are written at bind time, never by the resolver: read them first, so
    // their round trip overlaps the wait below.
    const HsRows src = hs_rows(HS_KIND_HOST, layer, host_bases, dev_bases, dev_block_strides, host_rows, dev_rows);
    const HsRows dst = hs_rows(HS_KIND_DEVICE, layer, host_bases, dev_bases, dev_block_strides, host_rows, dev_rows);
    // Launched with programmatic stream serialization, this grid may start while the resolver
    // still runs: wait for it (a no-op for an ordinary launch) before reading its plan.
    asm volatile("griddepcontrol.wait;" ::: "memory");
    const i32 n = plan_counts[r];
    if (n <= 0) return;
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        atomicAdd(&stats[3], static_cast<u64>(n) * HS_ROW_BYTES);
    }
    HsPlanPair pair{plan_host + static_cast<i64>(r) * K, plan_device + static_cast<i64>(r) * K};
    hs_copy_rows(min(n, K), pair, src, dst, bs);
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
