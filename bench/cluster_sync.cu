// Latencies of the ways blocks of a thread-block cluster can synchronise and exchange data
// (bench/bench_cluster_sync.py). Every mode runs `iters` rounds; thread 0 of block 0 of cluster 0
// records clock64() before and after. HS_C blocks per cluster.
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u32 rank_() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ u32 map_(u32 a, u32 r) {
    u32 o;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(o) : "r"(a), "r"(r));
    return o;
}
__device__ __forceinline__ u32 sa_(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void csync_() {
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

extern "C" __global__ void __cluster_dims__(HS_C, 1, 1) probe(int mode, int iters, u64* out, int* sink) {
    __shared__ __align__(8) u64 bars[2];
    __shared__ __align__(16) int buf[2][64];
    __shared__ int chain[256];
    __shared__ u64 casw;
    const u32 me = rank_();
    const int tid = threadIdx.x;
    for (int i = tid; i < 256; i += blockDim.x) chain[i] = (i + 1) & 255;
    if (tid == 0) casw = 0;
    if (tid == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sa_(&bars[0])) : "memory");
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sa_(&bars[1])) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    csync_();
    const bool timer = blockIdx.x == 0 && tid == 0;
    u64 t0 = clock64();
    int acc = 0;
    const u32 peer = (me + 1) % HS_C;
    for (int it = 0; it < iters; ++it) {
        if (mode == 0) {  // block barrier (one SM)
            __syncthreads();
        } else if (mode == 1) {  // cluster barrier, release/acquire
            csync_();
        } else if (mode == 2) {  // cluster barrier without the release (no ordering of remote stores)
            asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
            asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
        } else if (mode == 3) {  // a GPU-scope fence alone
            asm volatile("fence.acq_rel.gpu;" ::: "memory");
            __syncthreads();
        } else if (mode == 4) {  // one remote store per thread, then the release/acquire barrier
            asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(map_(sa_(&buf[it & 1][tid & 63]), peer)), "r"(it)
                         : "memory");
            csync_();
        } else if (mode == 5) {  // all-to-all push of one word per block pair with st.async + mbarrier
            const int b = it & 1;
            const u32 bar = sa_(&bars[b]);
            if (tid == 0) {
                asm volatile("mbarrier.arrive.expect_tx.relaxed.cta.shared::cta.b64 _, [%0], %1;" ::"r"(bar),
                             "r"(4 * HS_C)
                             : "memory");
            }
            if (tid < HS_C) {
                asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(
                                 map_(sa_(&buf[b][me]), tid)),
                             "r"(it), "r"(map_(bar, tid))
                             : "memory");
            }
            u32 ok = 0;
            const u32 parity = (it >> 1) & 1;
            while (!ok) {
                asm volatile(
                    "{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2; "
                    "selp.u32 %0, 1, 0, p; }"
                    : "=r"(ok)
                    : "r"(bar), "r"(parity)
                    : "memory");
            }
            acc += buf[b][(me + 1) % HS_C];
        } else if (mode == 6) {  // dependent remote loads (latency of one DSMEM load)
            u32 v;
            asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(map_(sa_(&chain[acc & 255]), peer))
                         : "memory");
            acc = static_cast<int>(v);
        } else if (mode == 7) {  // dependent remote 64-bit CAS
            u64 old;
            asm volatile("atom.shared::cluster.cas.b64 %0, [%1], %2, %3;"
                         : "=l"(old)
                         : "r"(map_(sa_(&casw), peer) + 8u * static_cast<u32>(acc & 0)), "l"(0ull),
                           "l"(static_cast<u64>(acc))
                         : "memory");
            acc += static_cast<int>(old & 1);
        }
    }
    u64 t1 = clock64();
    if (timer) {
        out[0] = t1 - t0;
    }
    if (acc == 0x7fffffff) sink[0] = acc;
    csync_();  // nobody leaves while a peer may still touch its shared memory
}
