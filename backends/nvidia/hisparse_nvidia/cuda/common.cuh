// Shared helpers of the hisparse NVIDIA kernels. Compiled at run time by NVRTC (no system
// headers), so the fixed-width types are declared here.
#pragma once

typedef int i32;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;
typedef short i16;

#define HS_FULL_MASK 0xffffffffu

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

// Relaxed loads and stores at GPU scope: coherent in L2 (never an L1 copy), and strong, so that
// fence.sc orders them against another grid's (the resolver's victims flag, see copy.cu). The
// loads carry no memory clobber, so the compiler may still issue a round trip's loads together;
// one that must follow a fence or barrier is hs_ld_relaxed_ordered.
__device__ __forceinline__ i32 hs_ld_relaxed(const i32* p) {
    i32 v;
    asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ i32 hs_ld_relaxed(const i16* p) {
    i16 v;
    asm volatile("ld.relaxed.gpu.global.s16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}

// The same, ordered after everything before it in program order (a fence, a barrier).
__device__ __forceinline__ i32 hs_ld_relaxed_ordered(const i32* p) {
    i32 v;
    asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void hs_st_relaxed(i32* p, i32 v) {
    asm volatile("st.relaxed.gpu.global.s32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void hs_fence_sc() {
    asm volatile("fence.sc.gpu;" ::: "memory");
}
