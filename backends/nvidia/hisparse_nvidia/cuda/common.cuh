// Shared helpers of the hisparse NVIDIA kernels. Compiled at run time by NVRTC (no system
// headers), so the fixed-width types are declared here.
#pragma once

typedef int i32;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;
typedef short i16;

#define HS_FULL_MASK 0xffffffffu

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

// 16-byte loads/stores that bypass L1 (each byte is moved once per launch). Host rows are read
// through their registered, device-mapped address (zero copy over PCIe). HS_LOAD picks the load:
//   0  ld.global.cg                 (cache in L2 only)
//   1  ld.global.nc.L1::no_allocate (read-only path)
//   2  ld.global.cg.L2::128B        (L2 fetches whole 128-byte lines)
//   3  ld.global.cg.L2::256B        (L2 fetches 256-byte blocks)
#ifndef HS_LOAD
#define HS_LOAD 0
#endif
__device__ __forceinline__ uint4 hs_load16(const void* p) {
    uint4 v;
#if HS_LOAD == 1
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#elif HS_LOAD == 2
    asm volatile("ld.global.cg.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#elif HS_LOAD == 3
    asm volatile("ld.global.cg.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#else
    v = __ldcg(reinterpret_cast<const uint4*>(p));
#endif
    return v;
}

__device__ __forceinline__ void hs_store16(void* p, uint4 v) {
    __stcg(reinterpret_cast<uint4*>(p), v);
}
