#!/usr/bin/env python3
"""What limits zero-copy reads of the host pool: access pattern, row alignment, host page size,
and whether rows read once stay in the GPU's L2 for a later kernel.

Every figure sits beside the copy engine's contiguous pinned copy of the same bytes, measured in
the same run. Part A moves 262,144 rows (172 MB for 656-byte rows) per launch, event-timed,
median of `--reps`; part B times one request's 274 misses per step inside a CUDA graph of
`--steps` steps, each step on a fresh random row set.

    python bench/bench_host_reads.py [--reps 7] [--steps 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import statistics
import sys

import torch

ROWS = 262_144
POOL_ROWS = 128 * 32768  # the kernel benchmark's pool: 128 requests of 32K tokens
MISSES = 274
THREADS = 256

SOURCE = r"""
#include "common.cuh"
#ifndef VEC
#error "VEC must be defined"
#endif
#define UNROLL 4

// Moves n rows (VEC 16-byte chunks each) from src + rows[e] * stride to a contiguous dst;
// consecutive threads take consecutive chunks of the grid's x dimension.
__device__ __forceinline__ void move_flat(const unsigned char* __restrict__ src, i64 stride,
                                          const i32* __restrict__ rows, i32 n, unsigned char* __restrict__ dst) {
    const i64 total = static_cast<i64>(n) * VEC;
    const i64 gs = static_cast<i64>(gridDim.x) * 256;
    for (i64 first = static_cast<i64>(blockIdx.x) * 256 + threadIdx.x; first < total; first += gs * UNROLL) {
        uint4 v[UNROLL];
#pragma unroll
        for (i32 u = 0; u < UNROLL; ++u) {
            const i64 c = first + u * gs;
            if (c < total) {
                const i32 e = static_cast<i32>(c / VEC);
                const i32 k = static_cast<i32>(c - static_cast<i64>(e) * VEC);
                v[u] = hs_load16(src + static_cast<i64>(rows[e]) * stride + k * 16);
            }
        }
#pragma unroll
        for (i32 u = 0; u < UNROLL; ++u) {
            const i64 c = first + u * gs;
            if (c < total) hs_store16(dst + c * 16, v[u]);
        }
    }
}

// All n rows over the whole grid (the flat shape of the gather until call 37).
extern "C" __global__ void __launch_bounds__(256) read_rows(
    const unsigned char* __restrict__ src, i64 stride, const i32* __restrict__ rows, i32 n,
    unsigned char* __restrict__ dst) {
    move_flat(src, stride, rows, n, dst);
}

// Line-aligned: each row is cut along the source's 128-byte lines (LINES lines of 8 chunks, the
// pieces outside the row idle), so a warp's load covers 4 whole lines and no line is split
// between two loads.
#define LINES ((VEC * 16 + 127) / 128 + 1)
extern "C" __global__ void __launch_bounds__(256) read_rows_lines(
    const unsigned char* __restrict__ src, i64 stride, const i32* __restrict__ rows, i32 n,
    unsigned char* __restrict__ dst) {
    const i64 total = static_cast<i64>(n) * LINES * 8;
    const i64 gs = static_cast<i64>(gridDim.x) * 256;
    for (i64 first = static_cast<i64>(blockIdx.x) * 256 + threadIdx.x; first < total; first += gs * UNROLL) {
        uint4 v[UNROLL];
        i64 to[UNROLL];
#pragma unroll
        for (i32 u = 0; u < UNROLL; ++u) {
            const i64 c = first + u * gs;
            to[u] = -1;
            if (c < total) {
                const i32 e = static_cast<i32>(c / (LINES * 8));
                const i32 j = static_cast<i32>(c - static_cast<i64>(e) * (LINES * 8));
                const i64 at = static_cast<i64>(rows[e]) * stride;
                const i32 pos = j * 16 - static_cast<i32>(at & 127);
                if (pos >= 0 && pos < VEC * 16) {
                    v[u] = hs_load16(src + at + pos);
                    to[u] = static_cast<i64>(e) * VEC * 16 + pos;
                }
            }
        }
#pragma unroll
        for (i32 u = 0; u < UNROLL; ++u) {
            if (to[u] >= 0) hs_store16(dst + to[u], v[u]);
        }
    }
}

// The runtime gather's shape until call 37: blockIdx.y is a request with `per` rows
// (rows[y * per + e]), its chunks spread over the gridDim.x blocks of that request.
extern "C" __global__ void __launch_bounds__(256) read_rows_2d(
    const unsigned char* __restrict__ src, i64 stride, const i32* __restrict__ rows, i32 per,
    unsigned char* __restrict__ dst) {
    move_flat(src, stride, rows + static_cast<i64>(blockIdx.y) * per, per,
              dst + static_cast<i64>(blockIdx.y) * per * VEC * 16);
}

// One block asks L2 to fetch every 128-byte line of n rows, then spins for `cycles`.
extern "C" __global__ void prefetch_rows(const unsigned char* __restrict__ src, i64 stride,
                                         const i32* __restrict__ rows, i32 n, i64 cycles) {
    constexpr i32 probes = (VEC * 16 + 127) / 128 + 1;
    for (i32 i = threadIdx.x; i < n * probes; i += blockDim.x) {
        const i32 e = i / probes;
        const i32 j = i - e * probes;
        const unsigned char* row = src + static_cast<i64>(rows[e]) * stride;
        const unsigned char* p = row + min(j * 128, VEC * 16 - 16);
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
    }
    const i64 t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}
"""


def _thp_state() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def _anon_huge_kb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return -1


class Buffer:
    """A device-mapped host buffer of `nbytes`: `kind` is "thp" (mmap with MADV_HUGEPAGE,
    registered), "4k" (mmap with MADV_NOHUGEPAGE, registered), "hostalloc" (cuMemHostAlloc) or
    "vmm" (cuMemCreate on host NUMA node 0, mapped for the GPU and the CPU at one address with
    the allocation's granularity)."""

    def __init__(self, kind: str, nbytes: int) -> None:
        from cuda.bindings import driver as cu

        from hisparse_nvidia import driver

        self.kind = kind
        self.nbytes = nbytes
        before = _anon_huge_kb()
        self._mm = None
        self.granularity = 4096
        if kind == "hostalloc":
            flags = cu.CU_MEMHOSTALLOC_PORTABLE | cu.CU_MEMHOSTALLOC_DEVICEMAP
            self.host = int(driver.check("cuMemHostAlloc", cu.cuMemHostAlloc(nbytes, flags)))
        elif kind == "vmm":
            prop = cu.CUmemAllocationProp()
            prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
            prop.location.id = 0
            gran = int(driver.check("cuMemGetAllocationGranularity", cu.cuMemGetAllocationGranularity(
                prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)))
            self.granularity = gran
            self.size = -(-nbytes // gran) * gran
            self._handle = driver.check("cuMemCreate", cu.cuMemCreate(self.size, prop, 0))
            self.host = int(driver.check("cuMemAddressReserve", cu.cuMemAddressReserve(self.size, gran, 0, 0)))
            driver.check("cuMemMap", cu.cuMemMap(self.host, self.size, 0, self._handle, 0))
            descs = []
            for loc_type, loc_id in ((cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE, torch.cuda.current_device()),
                                     (cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA, 0)):
                d = cu.CUmemAccessDesc()
                d.location.type = loc_type
                d.location.id = loc_id
                d.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                descs.append(d)
            driver.check("cuMemSetAccess", cu.cuMemSetAccess(self.host, self.size, descs, len(descs)))
            # The CPU reads and writes it at the same address.
            view = (ctypes.c_uint8 * 4096).from_address(self.host + nbytes - 4096)
            view[0] = 7
            assert view[0] == 7
        else:
            huge = 2 << 20
            self._mm = mmap.mmap(-1, nbytes + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            buf = ctypes.c_char.from_buffer(self._mm)
            start = ctypes.addressof(buf)
            del buf
            off = -start % huge
            self._mm.madvise(mmap.MADV_HUGEPAGE if kind == "thp" else mmap.MADV_NOHUGEPAGE, off, nbytes)
            self.host = start + off
            driver.host_register(self.host, nbytes)
        if kind == "vmm":
            self.dev = self.host
        else:
            self.dev = int(driver.check("cuMemHostGetDevicePointer", cu.cuMemHostGetDevicePointer(self.host, 0)))
        self.huge_mb = (_anon_huge_kb() - before) / 1024
        # Random bytes, written by the GPU through the mapping.
        chunk = 256 << 20
        for off in range(0, nbytes, chunk):
            n = min(chunk, nbytes - off)
            src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
            driver.check("cuMemcpyDtoH", cu.cuMemcpyDtoH(self.host + off, src.data_ptr(), n))

    def release(self) -> None:
        from cuda.bindings import driver as cu

        from hisparse_nvidia import driver

        if self.kind == "hostalloc":
            driver.check("cuMemFreeHost", cu.cuMemFreeHost(self.host))
        elif self.kind == "vmm":
            driver.check("cuMemUnmap", cu.cuMemUnmap(self.host, self.size))
            driver.check("cuMemAddressFree", cu.cuMemAddressFree(self.host, self.size))
            driver.check("cuMemRelease", cu.cuMemRelease(self._handle))
        else:
            driver.host_unregister(self.host)
            self._mm.close()


class Kernels:
    def __init__(self, vec: int, load: int = 0) -> None:
        from hisparse_nvidia import compiler, driver

        major = torch.cuda.get_device_capability()
        image, _ = compiler.compile_source(SOURCE, "host_reads.cu",
                                           [f"--gpu-architecture=sm_{major[0]}{major[1]}", "--std=c++17",
                                            "--device-as-default-execution-space", f"-DVEC={vec}",
                                            f"-DHS_LOAD={load}"])
        self._module = driver.Module(image)
        self.read = self._module.function("read_rows")
        self.read_2d = self._module.function("read_rows_2d")
        self.read_lines = self._module.function("read_rows_lines")
        self.prefetch = self._module.function("prefetch_rows")
        self.vec = vec


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def read(k: Kernels, buf: Buffer, stride: int, rows: torch.Tensor, dst: torch.Tensor, blocks: int,
         lines: bool = False) -> None:
    (k.read_lines if lines else k.read).launch((blocks, 1, 1), THREADS, 0, _stream(),
                  [ctypes.c_void_p(buf.dev), ctypes.c_int64(stride), ctypes.c_void_p(rows.data_ptr()),
                   ctypes.c_int32(rows.numel()), ctypes.c_void_p(dst.data_ptr())])


def read_2d(k: Kernels, buf: Buffer, stride: int, rows: torch.Tensor, dst: torch.Tensor, blocks: int) -> None:
    """rows [R, per]: R requests, `blocks` blocks each."""
    k.read_2d.launch((blocks, rows.shape[0], 1), THREADS, 0, _stream(),
                     [ctypes.c_void_p(buf.dev), ctypes.c_int64(stride), ctypes.c_void_p(rows.data_ptr()),
                      ctypes.c_int32(rows.shape[1]), ctypes.c_void_p(dst.data_ptr())])


def prefetch(k: Kernels, buf: Buffer, stride: int, rows: torch.Tensor, cycles: int) -> None:
    k.prefetch.launch((1, 1, 1), 1024, 0, _stream(),
                      [ctypes.c_void_p(buf.dev), ctypes.c_int64(stride), ctypes.c_void_p(rows.data_ptr()),
                       ctypes.c_int32(rows.numel()), ctypes.c_int64(cycles)])


def copy(buf: Buffer, dst: torch.Tensor, nbytes: int, offset: int = 0) -> None:
    from cuda.bindings import driver as cu

    from hisparse_nvidia import driver

    driver.check("cuMemcpyHtoDAsync", cu.cuMemcpyHtoDAsync(dst.data_ptr(), buf.host + offset, nbytes,
                                                            cu.CUstream(_stream())))


def timed(fn, reps: int) -> float:
    """Median microseconds of `fn()` (after one warm-up call)."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        z.record()
        z.synchronize()
        out.append(a.elapsed_time(z) * 1000.0)
    return statistics.median(out)


def graph_us(build, steps: int, reps: int) -> float:
    """Median microseconds per step of a CUDA graph of `steps` calls of `build(step)`."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for s in range(steps):
            build(s)
    return timed(g.replay, reps) / steps


def _try_buffer(kind: str, nbytes: int) -> Buffer | None:
    """The buffer, or None (reported) where this machine cannot make that kind."""
    try:
        return Buffer(kind, nbytes)
    except Exception as exc:  # noqa: BLE001 - report and go on
        print(f"  buffer {kind}: {exc}", flush=True)
        return None


def part_a(reps: int, gen: torch.Generator) -> list[dict]:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks = 8 * sms
    results: list[dict] = []
    row = 656
    thp = Buffer("thp", POOL_ROWS * row)
    print(f"pool 'thp' {thp.nbytes / 2**30:.2f} GiB, AnonHugePages +{thp.huge_mb:.0f} MB "
          f"(THP setting: {_thp_state()})", flush=True)
    nbytes = ROWS * row
    dst = torch.empty(2 * nbytes, dtype=torch.uint8, device="cuda")
    base_us = timed(lambda: copy(thp, dst, nbytes), reps)
    base_gbs = nbytes / base_us / 1e3

    def add(name: str, us: float, moved: int) -> None:
        gbs = moved / us / 1e3
        results.append({"case": name, "us": us, "GB/s": gbs, "of_copy": gbs / base_gbs})
        print(f"  {name:<58} {us:9.1f} us {gbs:6.1f} GB/s {gbs / base_gbs:6.1%}", flush=True)

    add("copy engine, contiguous (baseline)", base_us, nbytes)
    k656 = Kernels(41)
    dev = torch.device("cuda")
    in_order = torch.arange(ROWS, dtype=torch.int32, device=dev)
    add("SM, 656-B rows in order (contiguous)", timed(lambda: read(k656, thp, row, in_order, dst, blocks), reps), nbytes)
    perm = torch.randperm(ROWS, generator=gen).to(torch.int32).to(dev)
    add("SM, 656-B rows, random order within 172 MB", timed(lambda: read(k656, thp, row, perm, dst, blocks), reps), nbytes)
    spread = torch.randperm(POOL_ROWS, generator=gen)[:ROWS].to(torch.int32)
    spread_d = spread.to(dev)
    add("SM, 656-B rows, random over the 2.75 GB pool",
        timed(lambda: read(k656, thp, row, spread_d, dst, blocks), reps), nbytes)
    sorted_d = spread.sort().values.to(dev)
    add("SM, same rows sorted by address", timed(lambda: read(k656, thp, row, sorted_d, dst, blocks), reps), nbytes)
    wide = (torch.randperm(POOL_ROWS * row // 768, generator=gen)[:ROWS]).to(torch.int32).to(dev)
    add("SM, 656 B at 768-B stride (128-B aligned rows), random",
        timed(lambda: read(k656, thp, 768, wide, dst, blocks), reps), nbytes)
    k640 = Kernels(40)
    r640 = torch.randperm(POOL_ROWS * row // 640, generator=gen)[:ROWS].to(torch.int32).to(dev)
    add("SM, 640-B rows (5 whole lines), random", timed(lambda: read(k640, thp, 640, r640, dst, blocks), reps),
        ROWS * 640)
    k1152 = Kernels(72)
    n1152 = ROWS * 656 // 1152
    r1152 = torch.randperm(POOL_ROWS * row // 1152, generator=gen)[:n1152].to(torch.int32).to(dev)
    add("SM, 1152-B rows (9 whole lines), random", timed(lambda: read(k1152, thp, 1152, r1152, dst, blocks), reps),
        n1152 * 1152)
    for more in (2, 4):
        add(f"SM, random over 2.75 GB with {more}x the blocks",
            timed(lambda m=more: read(k656, thp, row, spread_d, dst, m * blocks), reps), nbytes)
    # 128 requests x 2048 misses, each request's rows random within its 32K-token region.
    per_req = torch.stack([r * 32768 + torch.randperm(32768, generator=gen)[:2048] for r in range(128)])
    per_req = per_req.to(torch.int32)
    req_d = per_req.to(dev).contiguous()
    req_sorted = per_req.sort(dim=1).values.to(dev).contiguous()
    for bpr in (2, 8):
        add(f"SM, 128 requests x 2048, {bpr} blocks per request (runtime shape)",
            timed(lambda b=bpr: read_2d(k656, thp, row, req_d, dst, b), reps), nbytes)
    for mult in (1, 2, 4, 8):
        add(f"SM, 128 requests x 2048, request-major, {mult}x{sms} blocks",
            timed(lambda m=mult: read(k656, thp, row, req_d.view(-1), dst, m * sms), reps), nbytes)
    for mult in (1, 8):
        add(f"SM, same, rows sorted within each request, {mult}x{sms} blocks",
            timed(lambda m=mult: read(k656, thp, row, req_sorted.view(-1), dst, m * sms), reps), nbytes)
    loads = {1: "ld.global.nc", 2: "L2::128B", 3: "L2::256B"}
    for load, name in loads.items():
        kl = Kernels(41, load)
        add(f"SM, 128 x 2048 request-major, 1x{sms} blocks, {name}",
            timed(lambda k=kl: read(k, thp, row, req_d.view(-1), dst, sms), reps), nbytes)
    for mult in (1, 4):
        add(f"SM, 128 x 2048 request-major, {mult}x{sms} blocks, line-aligned",
            timed(lambda m=mult: read(k656, thp, row, req_d.view(-1), dst, m * sms, lines=True), reps), nbytes)
    for load, name in loads.items():
        kl = Kernels(41, load)
        add(f"SM, 128 x 2048 request-major, 1x{sms} blocks, line-aligned, {name}",
            timed(lambda k=kl: read(k, thp, row, req_d.view(-1), dst, sms, lines=True), reps), nbytes)
    add("SM, 656-B rows in order, line-aligned",
        timed(lambda: read(k656, thp, row, in_order, dst, sms, lines=True), reps), nbytes)
    # 32 requests x 274 misses (the batch-32 scenario).
    b32 = torch.stack([r * 32768 + torch.randperm(32768, generator=gen)[:274] for r in range(32)]).to(torch.int32)
    b32_d = b32.to(dev).contiguous()
    n32 = b32.numel() * row
    add("copy engine, contiguous, 32 x 274 rows' bytes", timed(lambda: copy(thp, dst, n32), reps), n32)
    bpr32 = -(-2 * sms // 32)
    add(f"SM, 32 requests x 274, {bpr32} blocks per request (runtime shape)",
        timed(lambda: read_2d(k656, thp, row, b32_d, dst, bpr32), reps), n32)
    for mult in (1, 2, 8):
        add(f"SM, 32 requests x 274, request-major, {mult}x{sms} blocks",
            timed(lambda m=mult: read(k656, thp, row, b32_d.view(-1), dst, m * sms), reps), n32)
    for mult in (1, 8):
        add(f"SM, 32 requests x 274, request-major, {mult}x{sms} blocks, line-aligned",
            timed(lambda m=mult: read(k656, thp, row, b32_d.view(-1), dst, m * sms, lines=True), reps), n32)
    k3 = Kernels(41, 3)
    add(f"SM, 32 requests x 274, request-major, 1x{sms} blocks, line-aligned, L2::256B",
        timed(lambda: read(k3, thp, row, b32_d.view(-1), dst, sms, lines=True), reps), n32)
    thp.release()
    for kind in ("vmm", "4k", "hostalloc"):
        b = _try_buffer(kind, POOL_ROWS * row)
        if b is None:
            continue
        print(f"pool '{kind}': AnonHugePages +{b.huge_mb:.0f} MB, granularity {b.granularity >> 10} KiB", flush=True)
        add(f"copy engine, contiguous, from '{kind}'", timed(lambda b=b: copy(b, dst, nbytes), reps), nbytes)
        add(f"SM, 656-B rows, random over 2.75 GB, from '{kind}'",
            timed(lambda b=b: read(k656, b, row, spread_d, dst, blocks), reps), nbytes)
        if kind == "vmm":
            add("SM, 656-B rows in order, from 'vmm'",
                timed(lambda b=b: read(k656, b, row, in_order, dst, blocks), reps), nbytes)
            add("SM, 1152-B rows random, from 'vmm'",
                timed(lambda b=b: read(k1152, b, 1152, r1152, dst, blocks), reps), n1152 * 1152)
        b.release()
    return results


def part_b(reps: int, steps: int, gen: torch.Generator) -> list[dict]:
    """One request's misses per step (274 rows from a 32K-token region), fresh rows each step."""
    row = 656
    k = Kernels(41)
    results: list[dict] = []
    for kind in ("thp", "vmm"):
        buf = _try_buffer(kind, POOL_ROWS * row)
        if buf is None:
            continue
        print(f" from '{kind}':", flush=True)
        results += _part_b_one(buf, k, reps, steps, gen)
        buf.release()
    return results


def _part_b_one(buf: Buffer, k: Kernels, reps: int, steps: int, gen: torch.Generator) -> list[dict]:
    row = 656
    dev = torch.device("cuda")
    from cuda.bindings import driver as cu

    from hisparse_nvidia import driver

    clock_khz = driver.device_attribute(dev, cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CLOCK_RATE)
    sets = []
    for s in range(steps):
        req = s % 128
        sets.append((req * 32768 + torch.randperm(32768, generator=gen)[:MISSES]).to(torch.int32).to(dev))
    dst = torch.empty(MISSES * row * 2, dtype=torch.uint8, device=dev)
    nbytes = MISSES * row
    results: list[dict] = []

    def add(name: str, us: float) -> None:
        results.append({"case": name, "pool": buf.kind, "us_per_step": us})
        print(f"  {name:<58} {us:9.2f} us/step", flush=True)

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks = min(64, -(-2 * sms // 1))
    add("copy engine, 180 KB contiguous (baseline)",
        graph_us(lambda s: copy(buf, dst, nbytes, (s * 8 * nbytes) % (buf.nbytes - nbytes)), steps, reps))
    add("gather 274 rows", graph_us(lambda s: read(k, buf, row, sets[s], dst, blocks), steps, reps))
    add("gather 274 rows, line-aligned",
        graph_us(lambda s: read(k, buf, row, sets[s], dst, blocks, lines=True), steps, reps))
    add("gather the same 274 rows twice (both reads)",
        graph_us(lambda s: (read(k, buf, row, sets[s], dst, blocks), read(k, buf, row, sets[s], dst, blocks)),
                 steps, reps))
    for spin_us in (2.0, 4.0):
        cycles = int(spin_us * clock_khz / 1000)
        add(f"1-block kernel spinning {spin_us:.0f} us, then gather",
            graph_us(lambda s, c=cycles: (prefetch(k, buf, row, sets[s][:0], c),
                                          read(k, buf, row, sets[s], dst, blocks)), steps, reps))
        add(f"1-block kernel prefetching to L2 + spinning {spin_us:.0f} us, then gather",
            graph_us(lambda s, c=cycles: (prefetch(k, buf, row, sets[s], c),
                                          read(k, buf, row, sets[s], dst, blocks)), steps, reps))
    return results


def main(argv: list[str] | None = None) -> int:
    from hisparse_core.cli.options import CliParser, check_output_path, int_in

    # Bounded at parse time, as every bench's flags are: `--reps 0` was the median of no timing.
    ap = CliParser(prog="bench_host_reads", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int_in(1, 10_000), default=7)
    ap.add_argument("--steps", type=int_in(1, 10_000), default=40)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.json is not None and (why := check_output_path("--json", args.json)):  # written after every part ran
        ap.error(why)
    if not torch.cuda.is_available():
        print("bench_host_reads: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2  # a refusal, as every bench script's
    from hisparse_nvidia import driver

    torch.zeros(1, device="cuda")  # PyTorch creates the primary context; the driver calls use it
    driver.ensure_context(torch.device("cuda"))
    gen = torch.Generator().manual_seed(7)
    print(f"{torch.cuda.get_device_name()}: part A, {ROWS} rows per launch", flush=True)
    a = part_a(args.reps, gen)
    print(f"part B: {MISSES} misses of one request per step, graph of {args.steps} steps", flush=True)
    b = part_b(args.reps, args.steps, gen)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"a": a, "b": b, "thp": _thp_state()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
