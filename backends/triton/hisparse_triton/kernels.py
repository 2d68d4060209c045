"""The Triton kernels of the triton backend, and the launches that name a kernel when it fails.

- `resolve_kernel`: one program per batch row of the output workspace. A row that starts a group
  resolves the whole group (up to `rows_per_request` consecutive rows of one state row); a
  padding row, or a row past the batch, writes padding; any other row of a group does nothing.
  The group's union is found by sorting its host entries by (host row, entry index), so the first
  of each run is the row's first reference; hits by binary search of the request's hot map
  (sorted the same way); victims, the new LRU order and the miss plan by prefix sums over the
  LRU order and over the entries in first-reference order. Everything that needs an element of
  another lane goes through the program's own rows of the scratch buffers (a store, a barrier,
  a gather), which is the one cross-lane move every Triton version has.
- `copy_plan_kernel`: the plan copy of one layer, host rows into their hot rows.
- `copy_rows_kernel`: row copies between any two of host pool and device cache (mirrors, spills,
  restores, host block copies) for one layer.
- `invalidate_written_kernel`: forgets the hot copies of rows written this step.

Every kernel reads and writes rows as words (`int32` where the row size allows, else bytes), so
copies are exact for every row format. The kernels take only fixed-shape tensors and read no value
on the host: launched on a CUDA stream they can be captured in a CUDA graph.

This module imports triton at import time; `TRITON_INTERPRET=1` must be set before it is first
imported for the kernels to run in Triton's interpreter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import triton
import triton.language as tl

#: Keys of lanes that are not host entries sort after every host entry.
SENTINEL_SHIFT = tl.constexpr(46)


class KernelError(RuntimeError):
    """A Triton kernel failed to compile or launch; the message names it and the Triton version."""


def launch(kernel: Any, name: str, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:  # noqa: ANN401
    """Launch `kernel[grid](*args, **meta)`; a compile or launch failure raises `KernelError`
    naming `name`, the Triton version and the compile-time constants."""
    try:
        kernel[grid](*args, **meta)
    except Exception as exc:  # noqa: BLE001 - Triton raises many types (CompilationError, OutOfResources, ...)
        consts = ", ".join(f"{k}={v}" for k, v in sorted(meta.items()))
        raise KernelError(f"triton kernel {name} ({consts}) failed with Triton {triton.__version__}: "
                          f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
                          ) from exc


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def resolve_kernel(topk, row_state, seq_lens, source_table, resident_table, hot_table, hot_map, lru, stats,
                   out_rows, out_counts, plan_host, plan_device, plan_counts,
                   scr_keys, scr_hot, scr_flag, scr_rank, scr_victim, scr_slot, scr_hit,
                   B, P, HB, R,
                   K: tl.constexpr, KP: tl.constexpr, G_MAX: tl.constexpr, GP: tl.constexpr,
                   BS: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, LOG_NP: tl.constexpr,
                   LOG_HP: tl.constexpr):
    NP: tl.constexpr = GP * KP
    b = tl.program_id(0)
    in_batch = b < B
    q = tl.load(row_state + b, mask=in_batch, other=-1)
    q = tl.where(q < R, q, -1)  # trusted input out of range: a padding row, never a stray access
    prev = tl.load(row_state + b - 1, mask=in_batch & (b > 0), other=-2)
    starts = (q >= 0) & (prev != q)

    jj = tl.arange(0, GP)
    cc = tl.arange(0, KP)
    kmask = cc < K
    if q < 0:
        # Padding row (or a row past the batch): -1 and count 0 everywhere.
        tl.store(out_rows + b * K + cc, tl.full((KP,), -1, tl.int32), mask=kmask)
        tl.store(plan_host + b * K + cc, tl.full((KP,), -1, tl.int32), mask=kmask)
        tl.store(plan_device + b * K + cc, tl.full((KP,), -1, tl.int32), mask=kmask)
        tl.store(out_counts + b, 0)
        tl.store(plan_counts + b, 0)
    elif starts:
        # The group: rows b .. b+G-1 share state row q (G <= rows_per_request).
        rs = tl.load(row_state + b + jj, mask=(jj < G_MAX) & (b + jj < B), other=-2)
        g_len = tl.minimum(tl.min(tl.where(rs == q, GP, jj), axis=0), G_MAX)
        row = b + jj  # [GP]
        rmask = jj < g_len
        emask = rmask[:, None] & kmask[None, :]  # [GP, KP]
        t = tl.load(topk + row[:, None] * K + cc[None, :], mask=emask, other=-1)
        sl = tl.load(seq_lens + row, mask=rmask, other=0)
        in_ctx = emask & (t >= 0) & (t < sl[:, None]) & (t < P * BS)
        pos = tl.where(in_ctx, t, 0)
        page = pos // BS
        off = pos % BS
        res_blk = tl.load(resident_table + q * P + page, mask=in_ctx, other=-1)
        is_res = in_ctx & (res_blk >= 0)
        src_blk = tl.load(source_table + q * P + page, mask=in_ctx & (res_blk < 0), other=-1)
        is_host = in_ctx & (res_blk < 0) & (src_blk >= 0)
        host_row = src_blk.to(tl.int64) * BS + off
        out = tl.where(is_res, res_blk * BS + off, -1)
        entry_ptr = row[:, None] * K + cc[None, :]
        tl.store(out_rows + entry_ptr, out, mask=emask & ~is_host)
        tl.store(out_counts + row, tl.sum((is_res | is_host).to(tl.int32), axis=1), mask=rmask)
        n_res = tl.sum(tl.sum(is_res.to(tl.int64), axis=1), axis=0)
        n_host = tl.sum(tl.sum(is_host.to(tl.int32), axis=1), axis=0)
        tl.atomic_add(stats + 0, n_res)
        if n_host == 0:
            # The resident fast path: no plan, hot state untouched.
            tl.store(plan_host + entry_ptr, tl.full((GP, KP), -1, tl.int32), mask=emask)
            tl.store(plan_device + entry_ptr, tl.full((GP, KP), -1, tl.int32), mask=emask)
            tl.store(plan_counts + row, tl.zeros((GP,), tl.int32), mask=rmask)
        else:
            ee = jj[:, None] * KP + cc[None, :]  # entry index in first-reference order
            sentinel = tl.full((GP, KP), 1, tl.int64) << SENTINEL_SHIFT
            key2 = tl.where(is_host, host_row * NP + ee, sentinel + ee)
            skey = tl.sort(tl.reshape(key2, (NP,)))
            lane = tl.arange(0, NP)
            kbase = scr_keys + b * NP
            tl.store(kbase + lane, skey)
            # Hot map of q, sorted by (host row, slot); empty slots last.
            ss = tl.arange(0, HP)
            smask = ss < H
            hv = tl.load(hot_map + q * H + ss, mask=smask, other=-1)
            hkey = tl.where(hv >= 0, hv.to(tl.int64) * HP + ss, (tl.full((HP,), 1, tl.int64) << SENTINEL_SHIFT) + ss)
            shkey = tl.sort(hkey)
            hbase = scr_hot + b * HP
            tl.store(hbase + ss, shkey)
            order = tl.load(lru + q * H + ss, mask=smask, other=0)
            tl.debug_barrier()

            s_host = skey < (tl.full((NP,), 1, tl.int64) << SENTINEL_SHIFT)
            s_row = skey // NP
            s_idx = (skey % NP).to(tl.int32)
            prev_key = tl.load(kbase + lane - 1, mask=lane > 0, other=-NP)
            first = s_host & (s_row != prev_key // NP)
            # Each distinct row against the hot map: the lower bound of (row, 0) among the sorted keys.
            lo = tl.zeros((NP,), tl.int32)
            hi = tl.full((NP,), HP, tl.int32)
            target = s_row * HP
            for _ in tl.static_range(LOG_HP + 1):
                mid = (lo + hi) // 2
                v = tl.load(hbase + mid, mask=lo < hi, other=0)
                right = (lo < hi) & (v < target)
                lo = tl.where(right, mid + 1, lo)
                hi = tl.where((lo < hi) & ~right, mid, hi)
            found = tl.load(hbase + lo, mask=lo < HP, other=-1)
            hit_u = first & (found >= 0) & (found // HP == s_row)
            hit_slot_u = (found % HP).to(tl.int32)
            # Each hot slot against the union: the lower bound of (value, 0) among the entry keys.
            lo2 = tl.zeros((HP,), tl.int32)
            hi2 = tl.full((HP,), NP, tl.int32)
            target2 = hv.to(tl.int64) * NP
            for _ in tl.static_range(LOG_NP + 1):
                mid2 = (lo2 + hi2) // 2
                v2 = tl.load(kbase + mid2, mask=lo2 < hi2, other=0)
                right2 = (lo2 < hi2) & (v2 < target2)
                lo2 = tl.where(right2, mid2 + 1, lo2)
                hi2 = tl.where((lo2 < hi2) & ~right2, mid2, hi2)
            found2 = tl.load(kbase + lo2, mask=lo2 < NP, other=-1)
            slot_hit = smask & (hv >= 0) & (found2 >= 0) & (found2 // NP == hv)
            tl.store(scr_hit + b * HP + ss, slot_hit.to(tl.int32))
            # Misses flagged at their first reference (the sorted lanes cover every entry index once).
            fbase = scr_flag + b * NP
            tl.store(fbase + s_idx, (first & ~hit_u).to(tl.int32))
            tl.debug_barrier()

            hit_pos = tl.load(scr_hit + b * HP + order, mask=smask, other=0) != 0
            evict_pos = smask & ~hit_pos
            e_incl = tl.cumsum(evict_pos.to(tl.int32), axis=0)
            h_incl = tl.cumsum(hit_pos.to(tl.int32), axis=0)
            n_evict = tl.sum(evict_pos.to(tl.int32), axis=0)
            e_rank = e_incl - evict_pos.to(tl.int32)
            h_rank = h_incl - hit_pos.to(tl.int32)
            mflag = tl.load(fbase + ee) != 0  # [GP, KP], natural order
            mf = mflag.to(tl.int32)
            row_miss = tl.sum(mf, axis=1)  # [GP]
            n_miss = tl.sum(row_miss, axis=0)
            row_base = tl.cumsum(row_miss, axis=0) - row_miss
            in_row = tl.cumsum(mf, axis=1) - mf
            m_rank = row_base[:, None] + in_row  # rank of each miss in first-reference order
            tl.store(scr_rank + b * NP + ee, m_rank)
            # Victim m is the m-th evictable slot in LRU order.
            tl.store(scr_victim + b * HP + e_rank, order, mask=evict_pos & (e_rank < n_miss))
            n_union = tl.sum(first.to(tl.int32), axis=0)
            tl.atomic_add(stats + 1, (n_union - n_miss).to(tl.int64))
            tl.atomic_add(stats + 2, n_miss.to(tl.int64))
            tl.debug_barrier()

            # Slot of each distinct row, at the first lane of its run; then every lane of the run.
            miss_rank_u = tl.load(scr_rank + b * NP + s_idx, mask=first & ~hit_u, other=0)
            victim_u = tl.load(scr_victim + b * HP + miss_rank_u, mask=first & ~hit_u, other=0)
            slot_u = tl.where(hit_u, hit_slot_u, victim_u)
            tl.store(scr_slot + b * NP + lane, slot_u, mask=first)
            victim = tl.load(scr_victim + b * HP + m_rank, mask=mflag, other=0)
            tl.debug_barrier()

            run_start = tl.associative_scan(tl.where(first, lane, 0), 0, _max_combine)
            slot = tl.load(scr_slot + b * NP + run_start, mask=s_host, other=0)
            hot_blk = tl.load(hot_table + q * HB + slot // BS, mask=s_host, other=0)
            s_j = s_idx // KP
            s_c = s_idx % KP
            tl.store(out_rows + (b + s_j) * K + s_c, hot_blk * BS + slot % BS, mask=s_host)
            # The plan: miss m in its row's plan, packed in miss order; -1 after the count.
            vblk = tl.load(hot_table + q * HB + victim // BS, mask=mflag, other=0)
            plan_ptr = row[:, None] * K + in_row
            tl.store(plan_host + plan_ptr, host_row.to(tl.int32), mask=mflag)
            tl.store(plan_device + plan_ptr, vblk * BS + victim % BS, mask=mflag)
            tail = emask & (cc[None, :] >= row_miss[:, None])
            tl.store(plan_host + entry_ptr, tl.full((GP, KP), -1, tl.int32), mask=tail)
            tl.store(plan_device + entry_ptr, tl.full((GP, KP), -1, tl.int32), mask=tail)
            tl.store(plan_counts + row, row_miss, mask=rmask)
            # New hot map and LRU order: untouched evictable, then the filled in miss order, then hits.
            tl.store(hot_map + q * H + victim, host_row.to(tl.int32), mask=mflag)
            new_pos = tl.where(hit_pos, n_evict + h_rank,
                               tl.where(e_rank < n_miss, n_evict - n_miss + e_rank, e_rank - n_miss))
            tl.store(lru + q * H + new_pos, order, mask=smask)


@triton.jit
def copy_plan_kernel(plan_host, plan_device, plan_counts, src, dst, dst_block_stride, stats, K, row_bytes,
                     host_rows, dev_rows, W: tl.constexpr, WP: tl.constexpr, EB: tl.constexpr, BS: tl.constexpr):
    r = tl.program_id(0)
    chunk = tl.program_id(1)
    n = tl.load(plan_counts + r)
    e = chunk * EB + tl.arange(0, EB)
    m = e < n
    h = tl.load(plan_host + r * K + e, mask=m, other=0).to(tl.int64)
    d = tl.load(plan_device + r * K + e, mask=m, other=0).to(tl.int64)
    m = m & (h >= 0) & (h < host_rows) & (d >= 0) & (d < dev_rows)  # trusted input: never a stray access
    w = tl.arange(0, WP)
    mm = m[:, None] & (w < W)[None, :]
    vals = tl.load(src + h[:, None] * W + w[None, :], mask=mm)
    daddr = (d // BS) * dst_block_stride + (d % BS) * W
    tl.store(dst + daddr[:, None] + w[None, :], vals, mask=mm)
    if chunk == 0:
        tl.atomic_add(stats + 3, n.to(tl.int64) * row_bytes)


@triton.jit
def copy_rows_kernel(pairs, n, src, src_block_stride, dst, dst_block_stride,
                     W: tl.constexpr, WP: tl.constexpr, EB: tl.constexpr, BS: tl.constexpr):
    e = tl.program_id(0) * EB + tl.arange(0, EB)
    m = e < n
    s = tl.load(pairs + 2 * e, mask=m, other=0).to(tl.int64)
    d = tl.load(pairs + 2 * e + 1, mask=m, other=0).to(tl.int64)
    w = tl.arange(0, WP)
    mm = m[:, None] & (w < W)[None, :]
    saddr = (s // BS) * src_block_stride + (s % BS) * W
    daddr = (d // BS) * dst_block_stride + (d % BS) * W
    vals = tl.load(src + saddr[:, None] + w[None, :], mask=mm)
    tl.store(dst + daddr[:, None] + w[None, :], vals, mask=mm)


@triton.jit
def invalidate_written_kernel(state_rows, host_rows, hot_map, R, H: tl.constexpr, HP: tl.constexpr):
    i = tl.program_id(0)
    q = tl.load(state_rows + i)
    g = tl.load(host_rows + i)
    if (q >= 0) & (q < R) & (g >= 0):
        ss = tl.arange(0, HP)
        hv = tl.load(hot_map + q * H + ss, mask=ss < H, other=-1)
        tl.store(hot_map + q * H + ss, tl.full((HP,), -1, tl.int32), mask=(ss < H) & (hv == g))


KERNELS: dict[str, Callable[..., Any]] = {
    "resolve_kernel": resolve_kernel, "copy_plan_kernel": copy_plan_kernel,
    "copy_rows_kernel": copy_rows_kernel, "invalidate_written_kernel": invalidate_written_kernel,
}
