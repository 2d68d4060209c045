"""vLLM's HiSparse op set on a CUDA device (semantics: hisparse_core/vllm_ops.py), served by the
nvidia backend's own kernels (cuda/vllm_ops.cu, compiled with NVRTC like the rest of the backend).

- `hisparse_resolve_residency`: one launch of `hisparse_vllm_resolve` on vLLM's tensors in place
  (hot map, LRU, outputs); every case of vLLM's contract is served, `miss_mask` included: padding
  rows, union groups, out-of-range LRU slots, tables absent or present. It is a programmatic
  dependent launch behind the stream's previous kernel (it waits for that grid before any global
  access); `HISPARSE_VLLM_RESOLVE_PDL=0` launches it after that kernel has drained.
- `hisparse_gather_compact` / `hisparse_gather_plan`: one `hisparse_vllm_gather` launch (mark the
  taken entries, each destination by its last entry, then copy them around one grid barrier; 16-byte
  zero-copy reads of the registered host pool over UVA, zero-fill for an absent source row; a call
  with nothing to copy ends without waiting), or (`HISPARSE_VLLM_GATHER=0`) `hisparse_vllm_mark`
  then `hisparse_vllm_copy`, each launched to overlap the kernel before it (programmatic dependent
  launch; each waits for its predecessor's writes). `HISPARSE_VLLM_GATHER_LOCAL` launches
  `hisparse_vllm_gather_local` (or `_local4k`) in place of the fused kernel: calls of at most
  `LOCAL_GATHER_ENTRIES` (`_4K`) entries without marks or barrier (every block finds each destination's
  last entry itself).
- `hisparse_invalidate_written_slots`: one `hisparse_vllm_invalidate` launch.

Every launch goes on the current stream with fixed shapes and no host synchronization (values are
never read on the host), so vLLM's calls capture in a CUDA graph. Scratch the kernels keep between
launches (the copy's epoch, list and destination marks, the resolver's spill-over hash) is
allocated on the first call of a shape and reused; calls of one op set are ordered on one stream
(vLLM's copy stream), which is what makes the shared scratch safe.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import torch

from hisparse_core import vllm_ops as spec
from hisparse_core.errors import InvalidInputError
from hisparse_nvidia import driver
from hisparse_nvidia.compiler import KernelBuild
from hisparse_nvidia.kernels import VLLM_COPY_THREADS as COPY_THREADS
from hisparse_nvidia.kernels import (
    LoadedKernels,
    vllm_carveout,
    vllm_gather_local,
    vllm_gather_per_sm,
    vllm_gather_variant,
    vllm_ops_build,
    vllm_resolve_pdl,
    vllm_resolve_shape,
    vllm_resolve_shape_build,
    vllm_resolve_threads,
    vllm_resolve_variant,
)

#: Blocks per SM of the copy grid (at most; fewer where the call has fewer slots to move).
COPY_BLOCKS_PER_SM = 4
#: Rows of a gather_compact call the fused gather takes (its row prefix sums fill 4 bytes a row of the
#: 48 KiB of shared memory a launch gets without opting in); larger calls take the two-kernel path.
FUSED_GATHER_MAX_ROWS = 12000
#: Entries of a gather the barrier-free path takes at most (VG_LOCAL and VG_LOCAL_4K in cuda/vllm_ops.cu,
#: the latter gather_compact's bound with HISPARSE_VLLM_GATHER_LOCAL 3 and 4).
LOCAL_GATHER_ENTRIES = 2048
LOCAL_GATHER_ENTRIES_4K = 4096


def local_gather_bytes(entries: int) -> int:
    """Dynamic shared memory the barrier-free path adds to the fused gather's for a bound of `entries`: two
    4-byte words for each of 2 x that many hash buckets, a host row and a destination for each entry."""
    return 24 * entries


def local_gather_launch(local: int) -> tuple[str, int, int]:
    """(kernel, its `local` argument, added dynamic shared memory) of HISPARSE_VLLM_GATHER_LOCAL=`local` (1-4)."""
    entries = LOCAL_GATHER_ENTRIES_4K if local >= 3 else LOCAL_GATHER_ENTRIES
    name = "hisparse_vllm_gather_local4k" if local >= 3 else "hisparse_vllm_gather_local"
    return name, 2 if local in (2, 4) else 1, local_gather_bytes(entries)
#: Shared memory the resolver may take for its hash (12 bytes a bucket) and LRU order (2 bytes a slot).
RESOLVE_SMEM_BUDGET = 222 * 1024


def resolve_threads(k: int, h: int, want: int = 0) -> int:
    """Threads per block of the resolver: each thread holds at most 32 entries of a row and 32 LRU
    positions (the kernel's bit masks); at least 128, at most 1024. `want` (a power of two from 128,
    `HISPARSE_VLLM_RESOLVE_THREADS`) replaces the automatic choice (two of each a thread) where the
    call allows it, else the least that does."""
    need = -(-max(k, h) // 32)
    t = want if want else 128
    while t < need or (not want and t < min(1024, -(-max(k, h) // 2))):
        t *= 2
    return min(t, 1024)


def resolve_smem_buckets(max_union_rows: int, h: int, k: int, build: int = 3) -> int:
    """Hash buckets of the resolver's shared table: twice the union vLLM declares (load at most 1/2),
    within `RESOLVE_SMEM_BUDGET` beside the LRU order; groups with more host entries spill over into
    global scratch. Builds 4 and 6 (HISPARSE_VLLM_RESOLVE=4, 6) take a power of two up to four a union row
    where that fits, never fewer than the others, and no more than its kernel uses: a one-row group
    of top-k `k` hashes into the power of two from 4 k (its lean path, load 1/4), a group of several
    rows into the one from twice its entries (build 3's path). So two-row groups of top-k 2048 take
    8192 buckets, as build 3 does, not 16384; one- and four-row groups keep their sizes."""
    fit = (RESOLVE_SMEM_BUDGET - 2 * h - 16) // 12
    two = max(0, min(2 * max_union_rows, fit))
    if build < 4:
        return two
    four = min(4 * max_union_rows, fit)
    used = _pow2ceil(max(2 * max_union_rows, 4 * k))
    return max(two, min(1 << (four.bit_length() - 1) if four > 0 else 0, used))


def _pow2ceil(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def resolve_smem_bytes(buckets: int, h: int, build: int, optin: int) -> int:
    """Dynamic shared memory of a resolver launch: the buckets and the LRU order; build 3 reads the
    state row's hot-map row (4 * h bytes, from the first 16-byte boundary past the buckets, over their
    values and the LRU order) into shared memory wherever the launch has, or can be given within
    `RESOLVE_SMEM_BUDGET` and the device's `optin` bytes a block, room for it (the kernel checks the
    size it got)."""
    base = -(-(12 * buckets + 2 * h) // 16) * 16
    with_row = -(-8 * buckets // 16) * 16 + 4 * h
    return max(base, with_row) if build >= 3 and with_row <= min(optin, RESOLVE_SMEM_BUDGET) else base


def _i32(v: int) -> ctypes.c_int32:
    return ctypes.c_int32(int(v))


def _i64(v: int) -> ctypes.c_int64:
    return ctypes.c_int64(int(v))


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(0 if t is None else t.data_ptr())


class NvidiaVllmOps(spec.VllmHiSparseOps):
    """The four ops on CUDA tensors, through the kernels of cuda/vllm_ops.cu."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self._lock = threading.Lock()
        self._modules: dict[int, Any] = {}
        self._host_addr: dict[tuple[int, int], int] = {}
        self._scratch: dict[tuple[Any, ...], Any] = {}

    @property
    def device_type(self) -> str:
        return "cuda"

    # ----------------------------------------------------------------------------- helpers

    def _function(self, device: torch.device, row_bytes: int, name: str, build: KernelBuild | None = None) -> Any:
        """Kernel `name` of vllm_ops.cu's build for rows of `row_bytes`, or of `build` where given."""
        arch, _, _ = self._backend._device_props()
        driver.ensure_context(device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        return LoadedKernels.module(index, arch, build or vllm_ops_build(row_bytes)).function(name)

    def _host_address(self, host: torch.Tensor) -> int:
        """The device address of `host` (registered or pinned host memory), looked up once per buffer."""
        key = (host.data_ptr(), host.numel() * host.element_size())
        addr = self._host_addr.get(key)
        if addr is None:
            from hisparse_nvidia.host_pool import device_address_of_host

            found = device_address_of_host(*key)
            if found is None:
                raise InvalidInputError("host_cache is not registered host memory; vLLM pins its HiSparse pool with "
                                        "cudaHostRegister (or allocate it pinned)")
            addr = self._host_addr[key] = found
        return addr

    def _buffer(self, key: tuple[Any, ...], make: Any) -> Any:
        with self._lock:
            buf = self._scratch.get(key)
            if buf is None:
                buf = self._scratch[key] = make()
            return buf

    def _copy_state(self, dev: torch.device, hot_rows: int, entries: int) -> tuple[torch.Tensor, ...]:
        """(epoch, list count + finished-block counter, list, destination marks) of the copy kernels.
        The marks and their epoch are keyed by the hot cache's row count (a call's last block clears
        the marks it keeps the epoch of, before the epoch's 32 bits in a mark wrap), the list by the
        call's entries."""
        ctl = self._buffer(("ctl", dev), lambda: torch.zeros(2, dtype=torch.int32, device=dev))
        lst = self._buffer(("list", dev, entries), lambda: torch.empty(max(1, entries), dtype=torch.int32, device=dev))
        epoch, owner = self._buffer(("owner", dev, hot_rows), lambda: (
            torch.ones(1, dtype=torch.int64, device=dev), torch.zeros(max(1, hot_rows), dtype=torch.int64, device=dev)))
        return epoch, ctl, lst, owner

    def _gather(self, mode: int, host: torch.Tensor, hot: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                counts: torch.Tensor | None, mask: torch.Tensor | None, rsi: torch.Tensor | None,
                att: torch.Tensor | None, att_stride: int) -> None:
        n, k = src.shape
        if n * k == 0:
            return
        # Every tuning variable is read (and a bad value refused) before anything is allocated or set.
        variant, per_sm, carveout = vllm_gather_variant(), vllm_gather_per_sm(), vllm_carveout()
        local = vllm_gather_local(variant)
        vllm_resolve_variant()  # the module's build: read when the kernel is looked up
        row_bytes = hot.shape[2] * hot.element_size()
        slots = ((row_bytes + 111) // 128 + 1) * 8
        if n * k >= 2**31 or n * k * slots >= 2**32:  # entry indices are i32, the copies' 16-byte slots u32
            raise InvalidInputError(f"gather of {n} x {k} entries of {row_bytes} bytes: at most "
                                    f"{min(2**31, 2**32 // slots) - 1} entries a call")
        dev = hot.device
        bs = hot.shape[1]
        hot_rows = hot.shape[0] * bs
        epoch, ctl, lst, owner = self._copy_state(dev, hot_rows, n * k)
        stream = torch.cuda.current_stream(dev).cuda_stream
        _, sms, _ = self._backend._device_props()
        need = max(1, -(-(n * k * slots) // (COPY_THREADS * 4)))
        common = [_i32(mode), _ptr(src), _ptr(dst), _ptr(counts), _ptr(mask), _ptr(rsi), _ptr(att), _i64(att_stride),
                  _i32(bs), _i32(n), _i32(k), _i64(hot_rows)]
        if variant == 2 and (mode == 1 or n < FUSED_GATHER_MAX_ROWS):
            name, local_arg, local_smem = local_gather_launch(local) if local else ("hisparse_vllm_gather", 0, 0)
            fn = self._function(dev, row_bytes, name)
            fn.prefer_carveout(carveout)
            most = sms * per_sm
            smem = 4 * ((n if mode == 0 else most) + 1) + local_smem  # row or block prefix sums
            if local:
                fn.allow_dynamic_smem(smem)
            blocks = min(most, need, self._resident_blocks(fn, dev, sms, smem, carveout))
            part, bar = self._buffer(("gather", dev, most), lambda: (torch.zeros(most, dtype=torch.int32, device=dev),
                                                                     torch.zeros(8, dtype=torch.int32, device=dev)))
            fn.launch((blocks, 1, 1), COPY_THREADS, smem, stream, common + [
                ctypes.c_void_p(self._host_address(host)), _i64(host.shape[0]), _ptr(hot),
                _i64(hot.stride(0) * hot.element_size()), _ptr(owner), _ptr(epoch), _ptr(lst), _ptr(part), _ptr(bar)]
                + ([_i32(local_arg)] if local else []), overlap_previous=True)
            return
        mark = self._function(dev, row_bytes, "hisparse_vllm_mark")
        copy = self._function(dev, row_bytes, "hisparse_vllm_copy")
        grid = n if mode == 0 else -(-(n * k) // COPY_THREADS)
        mark.launch((grid, 1, 1), COPY_THREADS, 0, stream,
                    common + [_ptr(owner), _ptr(epoch), _ptr(lst), _ptr(ctl)], overlap_previous=True)
        blocks = min(sms * COPY_BLOCKS_PER_SM, need)
        copy.launch((blocks, 1, 1), COPY_THREADS, 0, stream,
                    [_ptr(src), _ptr(dst), ctypes.c_void_p(self._host_address(host)), _i64(host.shape[0]),
                     _ptr(hot), _i64(hot.stride(0) * hot.element_size()), _i32(bs), _ptr(owner), _ptr(epoch),
                     _ptr(lst), _ptr(ctl), ctypes.c_void_p(ctl.data_ptr() + 4), _i64(hot_rows)], overlap_previous=True)

    def _resident_blocks(self, fn: Any, dev: torch.device, sms: int, smem: int, carveout: int) -> int:
        """Blocks of `fn` that are all resident at once on the device (the fused gather's grid barrier
        needs every block running), looked up once per function object (one per build), shared memory
        size and carveout."""
        key = ("resident", dev, id(fn), fn.name, smem, carveout)
        with self._lock:
            got = self._scratch.get(key)
        if got is None:
            got = max(1, fn.max_active_blocks(COPY_THREADS, smem)) * sms
            with self._lock:
                self._scratch[key] = got
        return int(got)

    # ----------------------------------------------------------------------------- the ops

    def resolve(self, call: spec.ResolveCall) -> None:
        host_cache, hot_cache, hot_block_table = call.host_cache, call.hot_cache, call.hot_block_table
        topk, hot_out, device_global_indices = call.topk, call.hot_out, call.device_global_indices
        lru_slots, request_state_indices = call.lru_slots, call.request_state_indices
        max_union_rows, miss_mask, stats = call.max_union_rows, call.miss_mask, call.stats
        attention_indices, attention_block_stride = call.attention_indices, call.attention_block_stride
        request_ids, source_block_table = call.request_ids, call.source_block_table
        source_block_size, resolved, valid_counts = call.source_block_size, call.resolved, call.valid_counts
        swap_host, swap_dev, swap_counts = call.swap_host, call.swap_dev, call.swap_counts
        resident_block_table, resident_block_size = call.resident_block_table, call.resident_block_size
        resident_null_block = call.resident_null_block
        n, k = topk.shape
        s, h = lru_slots.shape
        if n == 0:
            return
        want_threads, carveout = vllm_resolve_threads(), vllm_carveout()  # refused here, before any work
        build, per_shape, pdl = vllm_resolve_variant(), vllm_resolve_shape(), vllm_resolve_pdl()
        if n * k * 2 >= 2**31:
            raise InvalidInputError(f"{spec.RESOLVE}: topk has {n} x {k} entries; at most 2^30 - 1 a call")
        dev = hot_cache.device
        bs = hot_cache.shape[1]
        row_bytes = hot_cache.shape[2] * hot_cache.element_size()
        threads = resolve_threads(k, h, want_threads)
        buckets = resolve_smem_buckets(max_union_rows, h, k, build)
        smem = resolve_smem_bytes(buckets, h, build, self._backend._device_props()[2])
        gtab, gval = self._buffer(("hash", dev, n, k), lambda: (
            torch.empty(2 * n * k, dtype=torch.int64, device=dev), torch.empty(2 * n * k, dtype=torch.int32,
                                                                               device=dev)))
        sbt, rbt = source_block_table, resident_block_table
        shape = vllm_resolve_shape_build(build, k, h, bs, source_block_size if sbt is not None else 1,
                                         resident_block_size if rbt is not None else 1, buckets, threads, pdl) \
            if per_shape else vllm_ops_build(row_bytes, pdl)
        fn = self._function(dev, row_bytes, "hisparse_vllm_resolve", shape)
        fn.allow_dynamic_smem(smem)
        fn.prefer_carveout(carveout)
        nr = request_state_indices.numel() if request_state_indices is not None else 0
        fn.launch((n, 1, 1), threads, smem, torch.cuda.current_stream(dev).cuda_stream, [
            _ptr(hot_block_table), _i64(hot_block_table.stride(0)), _i32(hot_block_table.shape[0]), _ptr(topk),
            _i32(n), _i32(k), _ptr(request_ids), _ptr(request_state_indices), _i32(nr),
            _ptr(sbt), _i64(sbt.stride(0) if sbt is not None else 0), _i32(sbt.shape[0] if sbt is not None else 0),
            _i32(sbt.shape[1] if sbt is not None else 0), _i32(source_block_size if sbt is not None else 1),
            _ptr(rbt), _i64(rbt.stride(0) if rbt is not None else 0), _i32(rbt.shape[0] if rbt is not None else 0),
            _i32(rbt.shape[1] if rbt is not None else 0), _i32(resident_block_size if rbt is not None else 1),
            _i32(resident_null_block), _i64(host_cache.shape[0]), _ptr(hot_out), _ptr(attention_indices),
            _i64(attention_block_stride), _i32(bs), _ptr(resolved), _ptr(valid_counts), _ptr(miss_mask),
            _ptr(swap_host), _ptr(swap_dev), _ptr(swap_counts), _ptr(device_global_indices), _ptr(lru_slots),
            _i32(s), _i32(h), _ptr(stats), _ptr(gtab), _ptr(gval), _i32(buckets)], overlap_previous=bool(pdl))

    def gather_compact(self, host_cache: torch.Tensor, hot_cache: torch.Tensor, miss_global: torch.Tensor,
                       miss_hot: torch.Tensor, miss_counts: torch.Tensor) -> None:
        spec.check_gather_compact(host_cache, hot_cache, miss_global, miss_hot, miss_counts)
        self._gather(0, host_cache, hot_cache, miss_global, miss_hot, miss_counts, None, None, None, 0)

    def gather_plan(self, host_cache: torch.Tensor, hot_cache: torch.Tensor, global_indices: torch.Tensor,
                    hot_indices: torch.Tensor, miss_mask: torch.Tensor, request_state_indices: torch.Tensor | None,
                    attention_indices: torch.Tensor | None, attention_block_stride: int) -> None:
        spec.check_gather_plan(host_cache, hot_cache, global_indices, hot_indices, miss_mask, request_state_indices,
                               attention_indices, attention_block_stride)
        self._gather(1, host_cache, hot_cache, global_indices, hot_indices, None, miss_mask, request_state_indices,
                     attention_indices, attention_block_stride)

    def invalidate_written_slots(self, device_global_indices: torch.Tensor, request_state_indices: torch.Tensor,
                                 req_id_per_token: torch.Tensor, written_slots: torch.Tensor) -> None:
        spec.check_invalidate(device_global_indices, request_state_indices, req_id_per_token, written_slots)
        s, h = device_global_indices.shape
        tokens = written_slots.numel()
        if tokens == 0 or s == 0 or h == 0:
            return
        dev = device_global_indices.device
        fn = self._function(dev, 16, "hisparse_vllm_invalidate")
        fn.launch((tokens, 1, 1), COPY_THREADS, 0, torch.cuda.current_stream(dev).cuda_stream, [
            _ptr(device_global_indices), _i32(s), _i32(h), _ptr(request_state_indices),
            _i32(request_state_indices.numel()), _ptr(req_id_per_token), _ptr(written_slots)])
