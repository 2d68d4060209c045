"""The Triton kernels of the triton backend, and the launches that name a kernel when it fails.

- `resolve_kernel`: one program per batch row of the output workspace. A row that starts a group
  resolves the whole group (up to `rows_per_request` consecutive rows of one state row); a
  padding row, or a row past the batch, writes padding; any other row of a group does nothing.
  The group's host rows and the rows its hot buffer holds go into one open-addressing hash table
  (the program's rows of the `tbl_*` scratch, empty between calls): an atomic min per bucket
  gives each row's first reference, the bucket's slot a hit. Victims, the new LRU order and the
  miss plan follow from prefix sums over the LRU order and over the entries in first-reference
  order. Everything that needs an element of another lane goes through the program's scratch
  rows (a store, a barrier, a gather), the one cross-lane move every Triton version has.
  No `tl.sort`: a bitonic sort is O(n log^2 n) compare-and-swap stages, which the interpreter
  runs op by op (seconds per call at top-k 2048) and which the GPU does not need either; hashing
  is O(n) work per probe round, a few rounds per call.
- `resolve_gather_kernel` (the default, "gather"; `resolve_kernel` is "scratch",
  `shapes.RESOLVER_ENV` picks): the same results, shaped for a GPU program (its docstring).
- `resolve_split_kernel` (`shapes.SPLIT_ENV`, default off): the gather resolver's results from several
  programs a batch row at small batches (its docstring); with `shapes.SPLIT_TAIL_ENV` its hot rows too, in
  `resolve_split_hot_kernel` and `resolve_split_lru_kernel` behind it.
- `copy_plan_kernel`: the plan copy of one layer, host rows into their hot rows; `copy_plan_rows_kernel`
  the same with programs assigned to batch rows (small batches, `shapes.ROW_COPY_ENV`).
- `copy_rows_kernel`: row copies between any two of host pool and device cache (mirrors, spills,
  restores, host block copies) for one layer.
- `invalidate_written_kernel`: forgets the hot copies of rows written this step.

The copy kernels take the entries one program moves as a constexpr: few per program on a GPU
(parallelism), a whole plan row under the interpreter (which pays per op and runs programs one
after another); the runtime picks by device.

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
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

#: An empty bucket of the resolver's hash table (host rows are >= 0).
EMPTY = tl.constexpr(-1)
#: "No entry references this bucket's row" in the table of first references (above any entry index).
NO_ENTRY = tl.constexpr(1 << 30)

# The kernels call none of triton.language's own @jit helpers (`tl.sum`, `tl.cumsum`, `tl.zeros`,
# ...). Under the interpreter each such call re-patches triton.language (about 1 ms of CPU), and
# Triton 3.6's interpreter cannot call them at all once triton.language was imported before
# `TRITON_INTERPRET` was set (torch imports triton). `tl.reduce` and `tl.associative_scan` with the
# standard combine functions are what `tl.sum` and `tl.cumsum` lower to when compiled, and the
# interpreter runs them as one numpy call.
_SUM = tl.standard._sum_combine
_MIN = tl.standard._elementwise_min
_MAX = tl.standard._elementwise_max


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
def _block_split(x, BS, LBS, SB: tl.constexpr):  # noqa: ANN001, ANN202 - a Triton device function
    """Block and offset of rows `x` (>= 0 wherever used) in blocks of `BS` rows: with `SB` (BS = 2^LBS)
    a shift and a mask, else a division (by a runtime BS about 20 instructions a lane)."""
    if SB:
        blk = x >> LBS
        off = x & (BS - 1)
    else:
        blk = x // BS
        off = x % BS
    return blk, off


@triton.jit
def _exclusive_ranks(x, SH: tl.constexpr, HP: tl.constexpr):  # noqa: ANN001, ANN202 - a Triton device function
    """Exclusive prefix sums of the [HP] int32 vector `x`. SH > 1 (HISPARSE_TRITON_SCAN): a scan within
    each of SH rows of one warp's width, plus the sums of the rows before (one masked reduction),
    so no scan crosses warps; else one scan over the block."""
    if SH > 1:
        rows = tl.arange(0, SH)
        x2 = tl.reshape(x, (SH, HP // SH))
        tot = tl.reduce(x2, 1, _SUM)
        off = tl.reduce(tl.where(rows[None, :] < rows[:, None], tot[None, :], 0), 1, _SUM)
        ranks = tl.reshape(tl.associative_scan(x2, 1, _SUM) - x2 + off[:, None], (HP,))
    else:
        ranks = tl.associative_scan(x, 0, _SUM) - x
    return ranks


@triton.jit(do_not_specialize=["B", "P", "HB", "R", "K", "G_MAX", "BS", "H", "host_limit"])
def resolve_kernel(topk, row_state, seq_lens, source_table, resident_table, hot_table, hot_map, lru, stats,
                   out_rows, out_counts, plan_host, plan_device, plan_counts, pos_slot, miss_mask,
                   tbl_key, tbl_first, tbl_slot, scr_victim, scr_mark,
                   B, P, HB, R, K, G_MAX, BS, H, host_limit,
                   KP: tl.constexpr, GP: tl.constexpr, HP: tl.constexpr, TP: tl.constexpr, LOG_TP: tl.constexpr,
                   MASK: tl.constexpr):
    b = tl.program_id(0)
    in_batch = b < B
    q = tl.load(row_state + b, mask=in_batch, other=-1)
    q = tl.where(q < R, q, -1)  # trusted input out of range: a padding row, never a stray access
    prev = tl.load(row_state + b - 1, mask=in_batch & (b > 0), other=-2)
    starts = (q >= 0) & (prev != q)
    ctx = P * BS  # positions per state row of the slot hints

    jj = tl.arange(0, GP)
    cc = tl.arange(0, KP)
    kmask = cc < K
    if q < 0:
        # Padding row (or a row past the batch): -1 and count 0 everywhere. Outputs a row already
        # holds are not rewritten: a row with no valid entry has every output -1, and plan entries
        # past a row's count are -1 between calls.
        old_valid = tl.load(out_counts + b)
        old_plan = tl.load(plan_counts + b)
        if old_valid != 0:
            tl.store(out_rows + b * K + cc, tl.full((KP,), -1, tl.int32), mask=kmask)
            tl.store(out_counts + b, 0)
        if old_plan != 0:
            tl.store(plan_host + b * K + cc, tl.full((KP,), -1, tl.int32), mask=cc < old_plan)
            tl.store(plan_device + b * K + cc, tl.full((KP,), -1, tl.int32), mask=cc < old_plan)
            tl.store(plan_counts + b, 0)
    elif starts:
        # The group: rows b .. b+G-1 share state row q (G <= rows_per_request).
        rs = tl.load(row_state + b + jj, mask=(jj < G_MAX) & (b + jj < B), other=-2)
        g_len = tl.minimum(tl.reduce(tl.where(rs == q, GP, jj), 0, _MIN), G_MAX)
        row = b + jj  # [GP]
        rmask = jj < g_len
        emask = rmask[:, None] & kmask[None, :]  # [GP, KP]
        entry_ptr = row[:, None] * K + cc[None, :]
        old_plan = tl.load(plan_counts + row, mask=rmask, other=0)
        t = tl.load(topk + entry_ptr, mask=emask, other=-1)
        sl = tl.load(seq_lens + row, mask=rmask, other=0)
        in_ctx = emask & (t >= 0) & (t < sl[:, None]) & (t < ctx)
        pos = tl.where(in_ctx, t, 0)
        page = pos // BS
        off = pos % BS
        res_blk = tl.load(resident_table + q * P + page, mask=in_ctx, other=-1)
        is_res = in_ctx & (res_blk >= 0)
        src_blk = tl.load(source_table + q * P + page, mask=in_ctx & (res_blk < 0), other=-1)
        host_row64 = src_blk.to(tl.int64) * BS + off
        is_host = in_ctx & (res_blk < 0) & (src_blk >= 0) & (host_row64 < host_limit)
        host_row = host_row64.to(tl.int32)  # < host_limit <= 2^31 (bind checks)
        tl.store(out_rows + entry_ptr, tl.where(is_res, res_blk * BS + off, -1), mask=emask & ~is_host)
        tl.store(out_counts + row, tl.reduce((is_res | is_host).to(tl.int32), 1, _SUM), mask=rmask)
        n_res = tl.reduce(tl.reduce(is_res.to(tl.int32), 1, _SUM), 0, _SUM)
        n_host = tl.reduce(tl.reduce(is_host.to(tl.int32), 1, _SUM), 0, _SUM)
        tl.atomic_add(stats + 0, n_res.to(tl.int64))
        if n_host == 0:
            # The resident fast path: no plan, hot state untouched.
            if MASK:
                tl.store(miss_mask + entry_ptr, tl.full((GP, KP), 0, tl.int32), mask=emask)
            clear = emask & (cc[None, :] < old_plan[:, None])
            tl.store(plan_host + entry_ptr, tl.full((GP, KP), -1, tl.int32), mask=clear)
            tl.store(plan_device + entry_ptr, tl.full((GP, KP), -1, tl.int32), mask=clear)
            tl.store(plan_counts + row, tl.full((GP,), 0, tl.int32), mask=rmask & (old_plan != 0))
        else:
            ee = jj[:, None] * KP + cc[None, :]  # entry index in first-reference order
            # Slot hints: the slot last filled for this position. A hint is believed only where the
            # slot holds exactly the entry's host row (hot-map values are unique in a state row), so
            # a stale hint costs nothing but the hashing below. Hinted hits mark their slot.
            hint_ptr = pos_slot + q.to(tl.int64) * ctx + pos
            hint = tl.load(hint_ptr, mask=is_host, other=-1).to(tl.int32)
            hint_ok = is_host & (hint >= 0) & (hint < H)
            hint_hit = hint_ok & (tl.load(hot_map + q * H + hint, mask=hint_ok, other=-1) == host_row)
            cand = is_host & ~hint_hit
            n_cand = tl.reduce(tl.reduce(cand.to(tl.int32), 1, _SUM), 0, _SUM)
            mk = scr_mark + b * HP
            tl.store(mk + hint, tl.full((GP, KP), 1, tl.int32), mask=hint_hit)

            # The hot state of q in LRU order: lane i is LRU position i, holding slot order[i].
            ii = tl.arange(0, HP)
            smask = ii < H
            order = tl.load(lru + q * H + ii, mask=smask, other=0).to(tl.int32)
            # A slot outside the hot buffer (only a corrupt LRU of vLLM's op set) holds nothing.
            slot_ok = smask & (order >= 0) & (order < H)
            held_row = tl.load(hot_map + q * H + order, mask=slot_ok, other=-1)
            held = slot_ok & (held_row >= 0)

            # The candidates (host entries whose hint failed) go into an open-addressing hash table
            # of host rows (this program's rows of tbl_*, empty between calls). Each round every
            # pending lane reads its bucket, claims it if empty, and after a barrier reads it back:
            # its own row there means placed (a row another lane claimed alike), another row means
            # the next bucket. Claims only ever fill empty buckets, so a bucket keeps its row; the
            # table has room for twice the rows, so probing ends. Then every held slot looks its
            # row up: found means a candidate's row is held there (a hit the hint missed).
            tk = tbl_key + b * TP
            tf = tbl_first + b * TP
            ts = tbl_slot + b * TP
            # Fibonacci hashing (inline: a @jit helper costs the interpreter a re-patch per call).
            e_bkt = (((host_row.to(tl.int64) * 2654435769) & 0xFFFFFFFF) >> (32 - LOG_TP)).to(tl.int32)
            s_bkt = (((held_row.to(tl.int64) * 2654435769) & 0xFFFFFFFF) >> (32 - LOG_TP)).to(tl.int32)
            # One loop for both phases (Triton 3.6 miscompiles two loops here): candidates claim
            # until all are placed, then held slots look up, one bucket a round. A lookup stops at
            # its own row or at an empty bucket; where it stopped tells which (read after the loop).
            e_pend = cand
            # (no candidate: nothing to look up; a vector compare keeps the mask boolean in the interpreter)
            s_look = held & ((held_row * 0 + n_cand) > 0)
            s_pend = s_look
            n_e = n_cand
            n_s = tl.reduce(s_pend.to(tl.int32), 0, _SUM)
            while n_e + n_s > 0:
                e_cur = tl.load(tk + e_bkt, mask=e_pend, other=0)
                tl.store(tk + e_bkt, host_row, mask=e_pend & (e_cur == EMPTY))
                tl.debug_barrier()
                e_now = tl.load(tk + e_bkt, mask=e_pend, other=0)
                s_act = s_pend & ((s_bkt * 0 + n_e) == 0)  # lookups start once every candidate is placed
                s_cur = tl.load(tk + s_bkt, mask=s_act, other=EMPTY)
                tl.debug_barrier()  # every lane has read before the next round claims
                e_pend = e_pend & (e_now != host_row)
                e_bkt = tl.where(e_pend, (e_bkt + 1) & (TP - 1), e_bkt)
                s_next = s_act & (s_cur != held_row) & (s_cur != EMPTY)
                s_pend = tl.where(s_act, s_next, s_pend)
                s_bkt = tl.where(s_next, (s_bkt + 1) & (TP - 1), s_bkt)
                n_e = tl.reduce(tl.reduce(e_pend.to(tl.int32), 1, _SUM), 0, _SUM)
                n_s = tl.reduce(s_pend.to(tl.int32), 0, _SUM)
            tl.atomic_min(tf + e_bkt, ee, mask=cand)
            found = s_look & (tl.load(tk + s_bkt, mask=s_look, other=EMPTY) == held_row)
            tl.store(ts + s_bkt, order, mask=found)
            tl.debug_barrier()
            # Volatile: the atomics updated L2 behind any L1 copy (a plain load may hit a stale line).
            first = cand & (tl.load(tf + e_bkt, mask=cand, other=-1, volatile=True) == ee)
            hit_slot = tl.load(ts + e_bkt, mask=first, other=-1)
            hit_u = first & (hit_slot >= 0)
            marked = tl.load(mk + order, mask=slot_ok, other=0) != 0
            hit_pos = slot_ok & (marked | found)
            # Hits: the distinct held rows referenced (a slot holds one row); marks cleared for the next call.
            tl.store(mk + order, tl.full((HP,), 0, tl.int32), mask=slot_ok & marked)

            # Misses in first-reference order; victims in LRU order among the evictable slots.
            mflag = first & ~hit_u
            mf = mflag.to(tl.int32)
            row_miss = tl.reduce(mf, 1, _SUM)  # [GP]
            n_miss = tl.reduce(row_miss, 0, _SUM)
            in_row = tl.associative_scan(mf, 1, _SUM) - mf
            m_rank = tl.associative_scan(row_miss, 0, _SUM)[:, None] - row_miss[:, None] + in_row
            evict_pos = smask & ~hit_pos
            ev = evict_pos.to(tl.int32)
            e_rank = tl.associative_scan(ev, 0, _SUM) - ev
            n_evict = tl.reduce(ev, 0, _SUM)
            h_rank = ii - e_rank  # hits before LRU position i
            n_hit = tl.reduce(hit_pos.to(tl.int32), 0, _SUM)
            tl.atomic_add(stats + 1, n_hit.to(tl.int64))
            tl.atomic_add(stats + 2, n_miss.to(tl.int64))
            n_used = tl.minimum(n_miss, n_evict)  # misses beyond the evictable slots get no victim
            vb = scr_victim + b * HP
            tl.store(vb + e_rank, order, mask=evict_pos & (e_rank < n_miss))
            tl.debug_barrier()
            victim = tl.load(vb + m_rank, mask=mflag & (m_rank < n_used), other=-1)
            # A victim outside the hot buffer (or none) degrades its miss: entries -1, nothing cached.
            vok = mflag & (victim >= 0) & (victim < H)
            tl.store(ts + e_bkt, victim, mask=mflag)  # a missed row's bucket had no slot
            tl.debug_barrier()

            # Every host entry reads its row's slot (hinted, or its bucket's); misses go to their
            # row's plan in miss order; candidates leave their slot as the position's next hint.
            slot = tl.where(hint_hit, hint, tl.load(ts + e_bkt, mask=cand, other=-1))
            e_ok = is_host & (slot >= 0) & (slot < H)
            hot_blk = tl.load(hot_table + q * HB + slot // BS, mask=e_ok, other=0)
            tl.store(out_rows + entry_ptr, tl.where(e_ok, hot_blk * BS + slot % BS, -1), mask=is_host)
            tl.store(hint_ptr, slot, mask=cand & e_ok)
            vblk = tl.load(hot_table + q * HB + victim // BS, mask=vok, other=0)
            plan_ptr = row[:, None] * K + in_row
            tl.store(plan_host + plan_ptr, host_row, mask=mflag)
            tl.store(plan_device + plan_ptr, tl.where(vok, vblk * BS + victim % BS, -1), mask=mflag)
            if MASK:
                tl.store(miss_mask + entry_ptr, vok.to(tl.int32), mask=emask)
            tail = emask & (cc[None, :] >= row_miss[:, None]) & (cc[None, :] < old_plan[:, None])
            tl.store(plan_host + entry_ptr, tl.full((GP, KP), -1, tl.int32), mask=tail)
            tl.store(plan_device + entry_ptr, tl.full((GP, KP), -1, tl.int32), mask=tail)
            tl.store(plan_counts + row, row_miss, mask=rmask & (row_miss != old_plan))
            # New hot map and LRU order: untouched evictable, then the filled in miss order, then
            # hits. Positions that keep their slot are not rewritten.
            tl.store(hot_map + q * H + victim, host_row, mask=vok)
            new_pos = tl.where(hit_pos, n_evict + h_rank,
                               tl.where(e_rank < n_used, n_evict - n_used + e_rank, e_rank - n_used))
            tl.store(lru + q * H + new_pos, order, mask=smask & (new_pos >= 0) & (new_pos < H) & (new_pos != ii))
            # Leave the table empty for the next call: only the buckets this call used.
            tl.debug_barrier()
            tl.store(tk + e_bkt, tl.full((GP, KP), EMPTY, tl.int32), mask=cand)
            tl.store(tf + e_bkt, tl.full((GP, KP), NO_ENTRY, tl.int32), mask=cand)
            tl.store(ts + e_bkt, tl.full((GP, KP), -1, tl.int32), mask=cand)
            tl.store(ts + s_bkt, tl.full((HP,), -1, tl.int32), mask=found)


@triton.jit(do_not_specialize=["B", "P", "HB", "R", "K", "G_MAX", "BS", "H", "host_limit", "dst_block_stride", "W",
                               "row_bytes", "dev_rows", "LBS"])
def resolve_gather_kernel(topk, row_state, seq_lens, source_table, resident_table, hot_table, hot_map, lru, stats,
                          out_rows, out_counts, plan_host, plan_device, plan_counts, pos_slot, miss_mask,
                          tbl_key, tbl_first, tbl_slot, scr_victim, scr_mark,
                          B, P, HB, R, K, G_MAX, BS, H, host_limit,
                          src, dst, dst_block_stride, W, row_bytes, dev_rows, LBS,
                          KP: tl.constexpr, GP: tl.constexpr, HP: tl.constexpr, TP: tl.constexpr,
                          LOG_TP: tl.constexpr, MASK: tl.constexpr, PT: tl.constexpr, HG: tl.constexpr,
                          LR: tl.constexpr, FUSE: tl.constexpr, WP: tl.constexpr, EB: tl.constexpr,
                          LEAN: tl.constexpr, CAS: tl.constexpr = 0, SH: tl.constexpr = 1, SK: tl.constexpr = 1,
                          SB: tl.constexpr = 0, PDL: tl.constexpr = 0):
    """`resolve_kernel`'s results, with fewer scattered global accesses on the path of a GPU program:

    - the state row's page-table rows (`PT` lanes, 0: gathered from global memory), hot-map row and
      LRU row are read whole (contiguous) and looked up in registers with `tl.gather` (shared memory
      once compiled) where they fit (`HG`);
    - the slot marks are scattered to the program's scratch row once, read back whole;
    - a step whose every host entry is a hint hit (`n_cand == 0`, the steady decode step) skips the
      hash table, the miss ranks and the victim list: its only work is the marks and one scan of
      the LRU order;
    - the candidates' table (`TP` buckets, twice the group's entries) is probed by the held slots in
      exactly `max displacement + 1` rounds, from registers (`LR`) or global memory: a row in the
      table sits at most that far from its home bucket, so no probe sequence needs an empty bucket;
    - with `FUSE`, the program copies its group's plan itself (layer 0: host rows `src` into the
      device cache `dst`, `EB` entries of `WP` words at a time, as `copy_plan_kernel` does), so a
      step needs no plan-copy launch: a step without misses copies nothing and launches nothing;
    - with `LEAN` (a group's entries and hot rows within `MAX_ROW_LANES`), fewer dependent global
      round trips: the hot-table row is read whole with the page-table rows and looked up in
      registers; a candidate's held slot is read beside its first reference; a duplicate of a missed
      row finds its victim through its first reference's miss rank (gathered in registers), not
      through a store of the victim into the table, a barrier and a read back; the counters and the
      first-reference minimum are relaxed atomics (an acq_rel one waits for every store the thread
      has in flight; the barriers already order what is read back);
    - with `CAS` (`shapes.CAS_ENV`), a candidate claims its bucket with one compare-and-swap a round
      (placed where the bucket was empty or already held its row) instead of a read, a store, a
      barrier, a read back and a second barrier: a filled bucket never changes, so lanes of one row
      walk the same buckets and stop at the same one, as in the default claim;
    - with `SH` / `SK` > 1 (`shapes.SCAN_ENV`), the prefix sums over the hot rows / a row's entries are
      two-level: `SH` (`SK`) rows of one warp's lanes, a scan within each row and the row totals'
      exclusive sums as one masked sum, instead of one scan across every warp of the program;
    - with `SB` (`shapes.SHIFT_ENV`, a block size `BS = 2^LBS`), block and offset of a position or a
      slot are a shift and a mask, not a division by the runtime `BS`;
    - with `PDL` (`shapes.PDL_ENV`, sm_90 and later only), the plan copy launched behind it may start
      (and wait in `gdc_wait`) as soon as every program has begun, instead of after the last one ends."""
    if PDL:
        gdc_launch_dependents()
    b = tl.program_id(0)
    in_batch = b < B
    q = tl.load(row_state + b, mask=in_batch, other=-1)
    q = tl.where(q < R, q, -1)  # trusted input out of range: a padding row, never a stray access
    prev = tl.load(row_state + b - 1, mask=in_batch & (b > 0), other=-2)
    starts = (q >= 0) & (prev != q)
    ctx = P * BS  # positions per state row of the slot hints

    jj = tl.arange(0, GP)
    cc = tl.arange(0, KP)
    kmask = cc < K
    # The rows a group starting here can span, read beside the state row (one round trip, not two).
    row = b + jj  # [GP]
    r_ok = (jj < G_MAX) & (row < B)
    rs = tl.load(row_state + row, mask=r_ok, other=-2)
    entry_ptr = row[:, None] * K + cc[None, :]
    t_all = tl.load(topk + entry_ptr, mask=r_ok[:, None] & kmask[None, :], other=-1)
    sl_all = tl.load(seq_lens + row, mask=r_ok, other=0)
    plan_all = tl.load(plan_counts + row, mask=r_ok, other=0)
    if q < 0:
        old_valid = tl.load(out_counts + b)
        old_plan = tl.load(plan_counts + b)
        if old_valid != 0:
            tl.store(out_rows + b * K + cc, tl.full((KP,), -1, tl.int32), mask=kmask)
            tl.store(out_counts + b, 0)
        if old_plan != 0:
            tl.store(plan_host + b * K + cc, tl.full((KP,), -1, tl.int32), mask=cc < old_plan)
            tl.store(plan_device + b * K + cc, tl.full((KP,), -1, tl.int32), mask=cc < old_plan)
            tl.store(plan_counts + b, 0)
    elif starts:
        g_len = tl.minimum(tl.reduce(tl.where(rs == q, GP, jj), 0, _MIN), G_MAX)
        rmask = jj < g_len
        emask = rmask[:, None] & kmask[None, :]  # [GP, KP]
        old_plan = tl.where(rmask, plan_all, 0)
        t = tl.where(emask, t_all, -1)
        sl = tl.where(rmask, sl_all, 0)
        in_ctx = emask & (t >= 0) & (t < sl[:, None]) & (t < ctx)
        pos = tl.where(in_ctx, t, 0)
        page, off = _block_split(pos, BS, LBS, SB)
        if LEAN:
            hh = tl.arange(0, HP)
            hot_row = tl.load(hot_table + q * HB + hh, mask=hh < HB, other=0)  # HB <= H <= HP
        if PT > 0:
            pp = tl.arange(0, PT)
            res_row = tl.load(resident_table + q * P + pp, mask=pp < P, other=-1)
            src_row = tl.load(source_table + q * P + pp, mask=pp < P, other=-1)
            page1 = tl.reshape(page, (GP * KP,))
            res_blk = tl.where(in_ctx, tl.reshape(tl.gather(res_row, page1, 0), (GP, KP)), -1)
            src_blk = tl.where(in_ctx & (res_blk < 0), tl.reshape(tl.gather(src_row, page1, 0), (GP, KP)), -1)
        else:
            res_blk = tl.load(resident_table + q * P + page, mask=in_ctx, other=-1)
            src_blk = tl.load(source_table + q * P + page, mask=in_ctx & (res_blk < 0), other=-1)
        is_res = in_ctx & (res_blk >= 0)
        host_row64 = src_blk.to(tl.int64) * BS + off
        is_host = in_ctx & (res_blk < 0) & (src_blk >= 0) & (host_row64 < host_limit)
        host_row = host_row64.to(tl.int32)  # < host_limit <= 2^31 (bind checks)
        tl.store(out_rows + entry_ptr, tl.where(is_res, res_blk * BS + off, -1), mask=emask & ~is_host)
        tl.store(out_counts + row, tl.reduce((is_res | is_host).to(tl.int32), 1, _SUM), mask=rmask)
        n_res = tl.reduce(tl.reduce(is_res.to(tl.int32), 1, _SUM), 0, _SUM)
        n_host = tl.reduce(tl.reduce(is_host.to(tl.int32), 1, _SUM), 0, _SUM)
        if LEAN:
            tl.atomic_add(stats + 0, n_res.to(tl.int64), sem="relaxed")
        else:
            tl.atomic_add(stats + 0, n_res.to(tl.int64))
        if n_host == 0:
            if MASK:
                tl.store(miss_mask + entry_ptr, tl.full((GP, KP), 0, tl.int32), mask=emask)
            clear = emask & (cc[None, :] < old_plan[:, None])
            tl.store(plan_host + entry_ptr, tl.full((GP, KP), -1, tl.int32), mask=clear)
            tl.store(plan_device + entry_ptr, tl.full((GP, KP), -1, tl.int32), mask=clear)
            tl.store(plan_counts + row, tl.full((GP,), 0, tl.int32), mask=rmask & (old_plan != 0))
        else:
            ee = jj[:, None] * KP + cc[None, :]  # entry index in first-reference order
            ii = tl.arange(0, HP)
            skr = tl.arange(0, SK)  # and over a row's entries (SK > 1)
            smask = ii < H
            order = tl.load(lru + q * H + ii, mask=smask, other=0).to(tl.int32)
            slot_ok = smask & (order >= 0) & (order < H)
            hint_ptr = pos_slot + q.to(tl.int64) * ctx + pos
            hint = tl.load(hint_ptr, mask=is_host, other=-1).to(tl.int32)
            hint_ok = is_host & (hint >= 0) & (hint < H)
            if HG:
                hm_row = tl.load(hot_map + q * H + ii, mask=smask, other=-1)
                hinted = tl.reshape(tl.gather(hm_row, tl.reshape(tl.where(hint_ok, hint, 0), (GP * KP,)), 0),
                                    (GP, KP))
            else:
                hinted = tl.load(hot_map + q * H + hint, mask=hint_ok, other=-1)
            hint_hit = hint_ok & (hinted == host_row)
            cand = is_host & ~hint_hit
            n_cand = tl.reduce(tl.reduce(cand.to(tl.int32), 1, _SUM), 0, _SUM)
            mk = scr_mark + b * HP
            tl.store(mk + hint, tl.full((GP, KP), 1, tl.int32), mask=hint_hit)
            hot_base = hot_table + q * HB
            if n_cand == 0:
                # Every host entry a hint hit: no miss; evictable positions first, then the hits.
                tl.debug_barrier()
                if HG:
                    mk_row = tl.load(mk + ii, mask=smask, other=0)
                    hit_pos = slot_ok & (tl.gather(mk_row, tl.where(slot_ok, order, 0), 0) != 0)
                    tl.store(mk + ii, tl.full((HP,), 0, tl.int32), mask=smask & (mk_row != 0))
                else:
                    hit_pos = slot_ok & (tl.load(mk + order, mask=slot_ok, other=0) != 0)
                    tl.store(mk + order, tl.full((HP,), 0, tl.int32), mask=hit_pos)
                hit_i = hit_pos.to(tl.int32)
                h_rank = _exclusive_ranks(hit_i, SH, HP)
                n_hit = tl.reduce(hit_i, 0, _SUM)
                if LEAN:
                    tl.atomic_add(stats + 1, n_hit.to(tl.int64), sem="relaxed")
                else:
                    tl.atomic_add(stats + 1, n_hit.to(tl.int64))
                new_pos = tl.where(hit_pos, H - n_hit + h_rank, ii - h_rank)
                tl.store(lru + q * H + new_pos, order, mask=smask & (new_pos != ii))
                hint_blk, hint_off = _block_split(hint, BS, LBS, SB)  # (hint >= 0 wherever it is used)
                if LEAN:
                    hb_idx = tl.reshape(tl.where(hint_hit, hint_blk, 0), (GP * KP,))
                    hot_blk = tl.where(hint_hit, tl.reshape(tl.gather(hot_row, hb_idx, 0), (GP, KP)), 0)
                else:
                    hot_blk = tl.load(hot_base + hint_blk, mask=hint_hit, other=0)
                tl.store(out_rows + entry_ptr, tl.where(hint_hit, hot_blk * BS + hint_off, -1), mask=is_host)
                if MASK:
                    tl.store(miss_mask + entry_ptr, tl.full((GP, KP), 0, tl.int32), mask=emask)
                clear = emask & (cc[None, :] < old_plan[:, None])
                tl.store(plan_host + entry_ptr, tl.full((GP, KP), -1, tl.int32), mask=clear)
                tl.store(plan_device + entry_ptr, tl.full((GP, KP), -1, tl.int32), mask=clear)
                tl.store(plan_counts + row, tl.full((GP,), 0, tl.int32), mask=rmask & (old_plan != 0))
            else:
                if HG:
                    held_row = tl.where(slot_ok, tl.gather(hm_row, tl.where(slot_ok, order, 0), 0), -1)
                else:
                    held_row = tl.load(hot_map + q * H + order, mask=slot_ok, other=-1)
                held = slot_ok & (held_row >= 0)
                tk = tbl_key + b * TP
                tf = tbl_first + b * TP
                ts = tbl_slot + b * TP
                e_home = (((host_row.to(tl.int64) * 2654435769) & 0xFFFFFFFF) >> (32 - LOG_TP)).to(tl.int32)
                s_home = (((held_row.to(tl.int64) * 2654435769) & 0xFFFFFFFF) >> (32 - LOG_TP)).to(tl.int32)
                # Candidates claim buckets: read, claim if empty, read back after a barrier (own row:
                # placed; another: next bucket). Claims only fill empty buckets, so probing ends.
                e_bkt = e_home
                e_pend = cand
                n_e = n_cand
                if CAS:
                    while n_e > 0:
                        # atomic_cas takes no mask: a settled lane compares its own bucket (ee < TP) with
                        # a key no bucket holds (-2), which never writes.
                        cas_at = tl.where(e_pend, tk + e_bkt, tk + (ee & (TP - 1)))
                        e_old = tl.atomic_cas(cas_at, tl.where(e_pend, EMPTY, -2), tl.where(e_pend, host_row, -2),
                                              sem="relaxed")
                        e_pend = e_pend & (e_old != EMPTY) & (e_old != host_row)
                        e_bkt = tl.where(e_pend, (e_bkt + 1) & (TP - 1), e_bkt)
                        n_e = tl.reduce(tl.reduce(e_pend.to(tl.int32), 1, _SUM), 0, _SUM)
                    tl.debug_barrier()  # every claim is in the table before a held slot reads it
                else:
                    while n_e > 0:
                        e_cur = tl.load(tk + e_bkt, mask=e_pend, other=0)
                        tl.store(tk + e_bkt, host_row, mask=e_pend & (e_cur == EMPTY))
                        tl.debug_barrier()
                        e_now = tl.load(tk + e_bkt, mask=e_pend, other=0)
                        tl.debug_barrier()  # every lane has read before the next round claims
                        e_pend = e_pend & (e_now != host_row)
                        e_bkt = tl.where(e_pend, (e_bkt + 1) & (TP - 1), e_bkt)
                        n_e = tl.reduce(tl.reduce(e_pend.to(tl.int32), 1, _SUM), 0, _SUM)
                if LEAN:
                    tl.atomic_min(tf + e_bkt, ee, mask=cand, sem="relaxed")
                else:
                    tl.atomic_min(tf + e_bkt, ee, mask=cand)
                disp = tl.where(cand, (e_bkt - e_home) & (TP - 1), 0)
                rounds = tl.reduce(tl.reduce(disp, 1, _MAX), 0, _MAX) + 1
                # Every held slot looks its row up in the buckets a row of the table can be in.
                if LR:
                    tt = tl.arange(0, TP)
                    if CAS:  # the claims were atomics at L2: read past any L1 line
                        tab = tl.load(tk + tt, volatile=True)
                    else:
                        tab = tl.load(tk + tt)
                found = held & (held_row < 0)  # all false, in the layout of the held slots
                s_bkt = s_home
                for r in range(0, rounds):
                    bk = (s_home + r) & (TP - 1)
                    if LR:
                        key = tl.gather(tab, bk, 0)
                    elif CAS:
                        key = tl.load(tk + bk, mask=held & ~found, other=EMPTY, volatile=True)
                    else:
                        key = tl.load(tk + bk, mask=held & ~found, other=EMPTY)
                    now = held & ~found & (key == held_row)
                    s_bkt = tl.where(now, bk, s_bkt)
                    found = found | now
                tl.store(ts + s_bkt, order, mask=found)
                tl.debug_barrier()
                # Volatile: the atomics updated L2 behind any L1 copy (a plain load may hit a stale line).
                f_ee = tl.load(tf + e_bkt, mask=cand, other=-1, volatile=True)  # the row's first reference
                first = cand & (f_ee == ee)
                if LEAN:  # every candidate's slot in the same round trip (a found row's, else -1)
                    hit_slot = tl.load(ts + e_bkt, mask=cand, other=-1)
                else:
                    hit_slot = tl.load(ts + e_bkt, mask=first, other=-1)
                hit_u = first & (hit_slot >= 0)
                if HG:
                    mk_row = tl.load(mk + ii, mask=smask, other=0)
                    marked = slot_ok & (tl.gather(mk_row, tl.where(slot_ok, order, 0), 0) != 0)
                    tl.store(mk + ii, tl.full((HP,), 0, tl.int32), mask=smask & (mk_row != 0))
                else:
                    marked = slot_ok & (tl.load(mk + order, mask=slot_ok, other=0) != 0)
                    tl.store(mk + order, tl.full((HP,), 0, tl.int32), mask=marked)
                hit_pos = slot_ok & (marked | found)

                mflag = first & ~hit_u
                mf = mflag.to(tl.int32)
                row_miss = tl.reduce(mf, 1, _SUM)  # [GP]
                n_miss = tl.reduce(row_miss, 0, _SUM)
                evict_pos = smask & ~hit_pos
                ev = evict_pos.to(tl.int32)
                if SK > 1:
                    m3 = tl.reshape(mf, (GP, SK, KP // SK))
                    m_tot = tl.reduce(m3, 2, _SUM)  # [GP, SK]
                    m_off = tl.reduce(tl.where(skr[None, None, :] < skr[None, :, None], m_tot[:, None, :], 0), 2, _SUM)
                    in_row = tl.reshape(tl.associative_scan(m3, 2, _SUM) - m3 + m_off[:, :, None], (GP, KP))
                else:
                    in_row = tl.associative_scan(mf, 1, _SUM) - mf
                e_rank = _exclusive_ranks(ev, SH, HP)
                m_rank = tl.associative_scan(row_miss, 0, _SUM)[:, None] - row_miss[:, None] + in_row
                n_evict = tl.reduce(ev, 0, _SUM)
                h_rank = ii - e_rank  # hits before LRU position i
                if LEAN:  # a hit is a held position (< H) that is not evictable: one block-wide sum fewer
                    n_hit = H - n_evict
                else:
                    n_hit = tl.reduce(hit_pos.to(tl.int32), 0, _SUM)
                if LEAN:
                    tl.atomic_add(stats + 1, n_hit.to(tl.int64), sem="relaxed")
                else:
                    tl.atomic_add(stats + 1, n_hit.to(tl.int64))
                if LEAN:
                    tl.atomic_add(stats + 2, n_miss.to(tl.int64), sem="relaxed")
                else:
                    tl.atomic_add(stats + 2, n_miss.to(tl.int64))
                n_used = tl.minimum(n_miss, n_evict)  # misses beyond the evictable slots get no victim
                vb = scr_victim + b * HP
                tl.store(vb + e_rank, order, mask=evict_pos & (e_rank < n_miss))
                tl.debug_barrier()
                if LEAN:
                    # A candidate of a missed row (no held slot) takes the victim of its row's first
                    # reference: that entry's miss rank, gathered from the ranks in registers.
                    row_missed = cand & (hit_slot < 0)
                    f_idx = tl.reshape(tl.where(row_missed, f_ee, 0), (GP * KP,))
                    f_rank = tl.reshape(tl.gather(tl.reshape(m_rank, (GP * KP,)), f_idx, 0), (GP, KP))
                    victim = tl.load(vb + f_rank, mask=row_missed & (f_rank < n_used), other=-1)
                    vok = mflag & (victim >= 0) & (victim < H)
                    slot = tl.where(hint_hit, hint, tl.where(cand, tl.where(hit_slot >= 0, hit_slot, victim), -1))
                else:
                    victim = tl.load(vb + m_rank, mask=mflag & (m_rank < n_used), other=-1)
                    vok = mflag & (victim >= 0) & (victim < H)
                    tl.store(ts + e_bkt, victim, mask=mflag)  # a missed row's bucket had no slot
                    tl.debug_barrier()
                    slot = tl.where(hint_hit, hint, tl.load(ts + e_bkt, mask=cand, other=-1))
                e_ok = is_host & (slot >= 0) & (slot < H)
                slot_blk, slot_off = _block_split(slot, BS, LBS, SB)  # (slot >= 0 where e_ok, victim >= 0 where vok)
                vic_blk, vic_off = _block_split(victim, BS, LBS, SB)
                if LEAN:
                    hot_blk = tl.where(e_ok, tl.reshape(tl.gather(
                        hot_row, tl.reshape(tl.where(e_ok, slot_blk, 0), (GP * KP,)), 0), (GP, KP)), 0)
                else:
                    hot_blk = tl.load(hot_base + slot_blk, mask=e_ok, other=0)
                tl.store(out_rows + entry_ptr, tl.where(e_ok, hot_blk * BS + slot_off, -1), mask=is_host)
                tl.store(hint_ptr, slot, mask=cand & e_ok)
                if LEAN:
                    vblk = tl.where(vok, tl.reshape(tl.gather(
                        hot_row, tl.reshape(tl.where(vok, vic_blk, 0), (GP * KP,)), 0), (GP, KP)), 0)
                else:
                    vblk = tl.load(hot_base + vic_blk, mask=vok, other=0)
                plan_ptr = row[:, None] * K + in_row
                tl.store(plan_host + plan_ptr, host_row, mask=mflag)
                tl.store(plan_device + plan_ptr, tl.where(vok, vblk * BS + vic_off, -1), mask=mflag)
                if MASK:
                    tl.store(miss_mask + entry_ptr, vok.to(tl.int32), mask=emask)
                tail = emask & (cc[None, :] >= row_miss[:, None]) & (cc[None, :] < old_plan[:, None])
                tl.store(plan_host + entry_ptr, tl.full((GP, KP), -1, tl.int32), mask=tail)
                tl.store(plan_device + entry_ptr, tl.full((GP, KP), -1, tl.int32), mask=tail)
                tl.store(plan_counts + row, row_miss, mask=rmask & (row_miss != old_plan))
                tl.store(hot_map + q * H + victim, host_row, mask=vok)
                new_pos = tl.where(hit_pos, n_evict + h_rank,
                                   tl.where(e_rank < n_used, n_evict - n_used + e_rank, e_rank - n_used))
                tl.store(lru + q * H + new_pos, order, mask=smask & (new_pos >= 0) & (new_pos < H) & (new_pos != ii))
                tl.debug_barrier()
                if FUSE:
                    # Miss u of the group (rows in order) is entry u - start of its row's plan, read
                    # back packed (the barrier above: every lane's plan entries are written).
                    if n_miss > 0:
                        if LEAN:
                            tl.atomic_add(stats + 3, n_miss.to(tl.int64) * row_bytes, sem="relaxed")
                        else:
                            tl.atomic_add(stats + 3, n_miss.to(tl.int64) * row_bytes)
                    r_start = tl.associative_scan(row_miss, 0, _SUM) - row_miss  # [GP]
                    ww = tl.arange(0, WP)
                    wm = ww < W
                    for c in range(0, n_miss, EB):
                        u = c + tl.arange(0, EB)
                        mine = (r_start[None, :] <= u[:, None]) & (jj[None, :] < g_len)  # [EB, GP]
                        ur = tl.reduce(mine.to(tl.int32), 1, _SUM) - 1  # the row of miss u
                        u0 = tl.reduce(tl.where(jj[None, :] == ur[:, None], r_start[None, :], 0), 1, _SUM)
                        m = u < n_miss
                        at = (b + ur) * K + u - u0
                        h = tl.load(plan_host + at, mask=m, other=-1).to(tl.int64)
                        d = tl.load(plan_device + at, mask=m, other=-1).to(tl.int64)
                        m = m & (h >= 0) & (h < host_limit) & (d >= 0) & (d < dev_rows)
                        mm = m[:, None] & wm[None, :]
                        vals = tl.load(src + h[:, None] * W + ww[None, :], mask=mm)
                        daddr = (d // BS) * dst_block_stride + (d % BS) * W
                        tl.store(dst + daddr[:, None] + ww[None, :], vals, mask=mm)
                tl.store(tk + e_bkt, tl.full((GP, KP), EMPTY, tl.int32), mask=cand)
                tl.store(tf + e_bkt, tl.full((GP, KP), NO_ENTRY, tl.int32), mask=cand)
                tl.store(ts + e_bkt, tl.full((GP, KP), -1, tl.int32), mask=cand)
                tl.store(ts + s_bkt, tl.full((HP,), -1, tl.int32), mask=found)


@triton.jit
def _fib_bucket(x, LOG_TP: tl.constexpr):  # noqa: ANN001, ANN202 - a Triton device function
    """Fibonacci hashing of int32 host rows `x` into 2^LOG_TP buckets (the gather resolver's hash)."""
    return (((x.to(tl.int64) * 2654435769) & 0xFFFFFFFF) >> (32 - LOG_TP)).to(tl.int32)


@triton.jit
def _split_list_at(counts, u, base, NS: tl.constexpr, ES: tl.constexpr, PW: tl.constexpr):  # noqa: ANN001, ANN202
    """Where candidate `u` of a request's list sits in its programs' segments: slice s's segment
    starts at `base + s * ES` and holds its `counts[s * PW]` candidates from list index (the counts
    of the slices before) on. The slices are walked as scalars (a [lanes, NS] compare and reduce
    costs a thread about ten times the instructions)."""
    o = tl.load(counts) * 0
    s_u = u * 0
    o_u = u * 0
    for s2 in tl.static_range(NS):
        ok = o <= u  # the last slice starting at or before u holds it (an empty slice starts where the next does)
        s_u = tl.where(ok, s2, s_u)
        o_u = tl.where(ok, o, o_u)
        o += tl.load(counts + s2 * PW, volatile=True)
    return base + s_u * ES + u - o_u


@triton.jit
def _split_claim(tk, tf, counts, scr_crow, scr_cee, scr_cbkt, scr_cat, lst, n_cand,  # noqa: ANN001, ANN202
                 NS: tl.constexpr, ES: tl.constexpr, PW: tl.constexpr, CP: tl.constexpr, TP: tl.constexpr,
                 LOG_TP: tl.constexpr):
    """The split resolver's candidates (list `lst`, `n_cand` long, segments counted at `counts`) claim
    buckets of the hash table `tk` as the gather resolver's do, CP at a time in list order; the first
    reference of each row goes to `tf`, each candidate's bucket and segment address to the list
    scratch. Returns the probe rounds a held row's lookup needs (the largest displacement, plus one)."""
    uu = tl.arange(0, CP)
    rounds = n_cand * 0
    for c0 in range(0, n_cand, CP):
        u = c0 + uu
        um = u < n_cand
        e_bkt, at, crow, cee, home = _split_claim_chunk(tk, tf, counts, scr_crow, scr_cee, lst, u, um, NS, ES, PW,
                                                        TP, LOG_TP)
        tl.store(scr_cbkt + lst + u, e_bkt, mask=um)
        tl.store(scr_cat + lst + u, at, mask=um)
        rounds = tl.maximum(rounds, tl.reduce(tl.where(um, (e_bkt - home) & (TP - 1), 0), 0, _MAX) + 1)
    return rounds


@triton.jit
def _split_claim_chunk(tk, tf, counts, scr_crow, scr_cee, lst, u, um,  # noqa: ANN001, ANN202
                       NS: tl.constexpr, ES: tl.constexpr, PW: tl.constexpr, TP: tl.constexpr, LOG_TP: tl.constexpr):
    """Candidates `u` (where `um`) of list `lst` claim their buckets of `tk` and their rows' first
    references in `tf`; returns each one's bucket, segment address, row, entry and home bucket."""
    at = _split_list_at(counts, u, lst, NS, ES, PW)
    crow = tl.load(scr_crow + at, mask=um, other=0, volatile=True)
    cee = tl.load(scr_cee + at, mask=um, other=0, volatile=True)
    home = _fib_bucket(crow, LOG_TP)
    e_bkt = home
    e_pend = um
    n_e = tl.reduce(um.to(tl.int32), 0, _SUM)
    while n_e > 0:
        e_cur = tl.load(tk + e_bkt, mask=e_pend, other=0)
        tl.store(tk + e_bkt, crow, mask=e_pend & (e_cur == EMPTY))
        tl.debug_barrier()
        e_now = tl.load(tk + e_bkt, mask=e_pend, other=0)
        tl.debug_barrier()  # every lane has read before the next round claims
        e_pend = e_pend & (e_now != crow)
        e_bkt = tl.where(e_pend, (e_bkt + 1) & (TP - 1), e_bkt)
        n_e = tl.reduce(e_pend.to(tl.int32), 0, _SUM)
    tl.atomic_min(tf + e_bkt, cee, mask=um, sem="relaxed")
    return e_bkt, at, crow, cee, home


@triton.jit
def _split_publish(um, missed, m, v, victim, f_ee, cee, crow, cpos, q, b, gg, r_start, ctx,  # noqa: ANN001, ANN202
                   hot_table, hot_map, out_rows, pos_slot, plan_host, plan_device, miss_mask, HB, K, BS, H, LBS,
                   KP: tl.constexpr, MASK: tl.constexpr, SB: tl.constexpr):
    """A chunk of a split resolver's candidates published (the split kernel's tail and the hot-row
    tail's alike): each one's slot (its row's, or its miss rank's victim), outputs, hint, plan entry,
    miss mask and the victim's new hot-map row."""
    mflag = missed & (f_ee == cee)
    vok = mflag & (victim >= 0) & (victim < H)
    slot = tl.where(missed, victim, v)
    e_ok = um & (slot >= 0) & (slot < H)
    slot_blk, slot_off = _block_split(slot, BS, LBS, SB)
    vic_blk, vic_off = _block_split(victim, BS, LBS, SB)
    slot_hot = tl.load(hot_table + q * HB + slot_blk, mask=e_ok, other=0)
    vblk = tl.load(hot_table + q * HB + vic_blk, mask=vok, other=0)
    g_u = cee // KP
    entry = (b + g_u) * K + cee % KP
    tl.store(out_rows + entry, tl.where(e_ok, slot_hot * BS + slot_off, -1), mask=um)
    tl.store(pos_slot + q.to(tl.int64) * ctx + cpos, slot, mask=e_ok)
    in_row = m - tl.reduce(tl.where(gg[None, :] == g_u[:, None], r_start[None, :], 0), 1, _SUM)
    plan_ptr = (b + g_u) * K + in_row
    tl.store(plan_host + plan_ptr, crow, mask=mflag)
    tl.store(plan_device + plan_ptr, tl.where(vok, vblk * BS + vic_off, -1), mask=mflag)
    if MASK:
        tl.store(miss_mask + entry, vok.to(tl.int32), mask=um)
    tl.store(hot_map + q * H + victim, crow, mask=vok)


@triton.jit
def _split_clear_table(tk, tf, ts, scr_cbkt, lst, n_cand, uu, CP: tl.constexpr):  # noqa: ANN001, ANN202
    """The candidates' hash table left empty for the next call: every bucket in use is a candidate's."""
    for c0 in range(0, n_cand, CP):
        u = c0 + uu
        um = u < n_cand
        e_bkt = tl.load(scr_cbkt + lst + u, mask=um, other=0)
        tl.store(tk + e_bkt, tl.full((CP,), EMPTY, tl.int32), mask=um)
        tl.store(tf + e_bkt, tl.full((CP,), NO_ENTRY, tl.int32), mask=um)
        tl.store(ts + e_bkt, tl.full((CP,), -1, tl.int32), mask=um)


@triton.jit(do_not_specialize=["B", "P", "HB", "R", "K", "G_MAX", "BS", "H", "host_limit", "LBS"])
def resolve_split_kernel(topk, row_state, seq_lens, source_table, resident_table, hot_table, hot_map, lru, stats,
                         out_rows, out_counts, plan_host, plan_device, plan_counts, pos_slot, miss_mask,
                         tbl_key, tbl_first, tbl_slot, scr_victim, scr_mark,
                         scr_part, scr_ticket, scr_crow, scr_cee, scr_cpos, scr_cbkt, scr_cat,
                         B, P, HB, R, K, G_MAX, BS, H, host_limit, LBS,
                         KP: tl.constexpr, GP: tl.constexpr, HP: tl.constexpr, TP: tl.constexpr,
                         LOG_TP: tl.constexpr, MASK: tl.constexpr, HG: tl.constexpr, LR: tl.constexpr,
                         NS: tl.constexpr, ES: tl.constexpr, CP: tl.constexpr, PW: tl.constexpr,
                         SH: tl.constexpr = 1, SB: tl.constexpr = 0, TAIL: tl.constexpr = 0, PDL: tl.constexpr = 0,
                         KEEP: tl.constexpr = 0):
    """`resolve_gather_kernel`'s results from `NS` programs a batch row (`shapes.SPLIT_ENV`), for small
    batches, where one program a request leaves most multiprocessors idle:

    - every program of a group takes `ES` of its entries (a contiguous range in first-reference
      order) and does what is data-parallel over them: page-table lookups, the slot hint and its
      check against the hot map, the outputs of resident, null and hinted entries, the marks of
      hinted slots, the plan rows it covers cleared up to their old count; its candidates (host
      entries whose hint failed) go, in order, to its segment of the request's scratch list, its
      counts to its row of `scr_part`;
    - the group's last program to finish (a ticket counter per request, taken after a barrier with
      acquire-release order, so every other program's stores are visible to it; no program waits
      for another, so any grid is safe) does what needs the whole group: the counts, the hash table
      of the candidates, the held slots' lookups, the marks, the scans over the LRU order, victims,
      the candidates' outputs, plan, hot map and LRU order, as the gather resolver does;
    - the candidates are handled as a list, `CP` at a time (one lane a thread), not as lanes of
      every entry: a step with few misses pays for its misses, not for its top-k.

    With `TAIL` (`shapes.SPLIT_TAIL_ENV`) the last program stops after the hash table and leaves the
    hot rows to `resolve_split_hot_kernel` and `resolve_split_lru_kernel`, launched behind it. With
    `KEEP` (`shapes.SPLIT_KEEP_ENV`, not with `TAIL`), a list of at most `CP` candidates stays in
    registers from the claim to the table's clearing: its buckets, rows, entries, positions and first
    references are not stored to and reloaded from the list scratch (five dependent global round
    trips fewer on the last program's path); longer lists take the chunked passes.

    The grid is `B * NS` programs and one more for each workspace row past the batch (padding).
    Data another program wrote is read volatile (past any L1 line). The ticket is reset by the
    last program, so it is 0 between calls. `PDL`: as in `resolve_gather_kernel` (without `TAIL`, the
    plan copy is the kernel behind it; with it, `resolve_split_lru_kernel` triggers the copy). `PDL` = 2
    (`shapes.PDL_CHAIN_ENV`): this kernel is itself a programmatic dependent launch; it waits for the kernel
    before it to end and flush before any access (the copy before it reads the plan it rewrites, and a
    kernel before it may have written its inputs), and only then lets its copy launch, so that the copy's
    early reads see final inputs."""
    if PDL > 1:
        gdc_wait()
    if PDL:
        gdc_launch_dependents()
    # Programs [0, B * NS) are NS to a batch row; each one after them pads one workspace row past B.
    pid = tl.program_id(0)
    split = pid < B * NS
    b = tl.where(split, pid // NS, B + pid - B * NS)
    s = tl.where(split, pid % NS, 0)
    in_batch = b < B
    q = tl.load(row_state + b, mask=in_batch, other=-1)
    q = tl.where(q < R, q, -1)  # trusted input out of range: a padding row, never a stray access
    prev = tl.load(row_state + b - 1, mask=in_batch & (b > 0), other=-2)
    starts = (q >= 0) & (prev != q)
    ctx = P * BS
    gg = tl.arange(0, GP)
    if q < 0:
        if s == 0:
            cc = tl.arange(0, KP)
            kmask = cc < K
            old_valid = tl.load(out_counts + b)
            old_plan = tl.load(plan_counts + b)
            if old_valid != 0:
                tl.store(out_rows + b * K + cc, tl.full((KP,), -1, tl.int32), mask=kmask)
                tl.store(out_counts + b, 0)
            if old_plan != 0:
                tl.store(plan_host + b * K + cc, tl.full((KP,), -1, tl.int32), mask=cc < old_plan)
                tl.store(plan_device + b * K + cc, tl.full((KP,), -1, tl.int32), mask=cc < old_plan)
                tl.store(plan_counts + b, 0)
    elif starts:
        rs = tl.load(row_state + b + gg, mask=(gg < G_MAX) & (b + gg < B), other=-2)
        g_len = tl.minimum(tl.reduce(tl.where(rs == q, GP, gg), 0, _MIN), G_MAX)
        # This program's entries: flat index f = row of the group * KP + column.
        f = s * ES + tl.arange(0, ES)
        g = f // KP
        c = f % KP
        emask = (g < g_len) & (c < K)
        entry_ptr = (b + g) * K + c
        t = tl.load(topk + entry_ptr, mask=emask, other=-1)
        sl = tl.load(seq_lens + b + g, mask=emask, other=0)
        old_plan = tl.load(plan_counts + b + g, mask=emask, other=0)
        in_ctx = emask & (t >= 0) & (t < sl) & (t < ctx)
        pos = tl.where(in_ctx, t, 0)
        page, off = _block_split(pos, BS, LBS, SB)
        # Both tables and the hint in one round trip (the source row is used only where not resident).
        res_blk = tl.load(resident_table + q * P + page, mask=in_ctx, other=-1)
        src_blk = tl.load(source_table + q * P + page, mask=in_ctx, other=-1)
        hint_ptr = pos_slot + q.to(tl.int64) * ctx + pos
        hint = tl.load(hint_ptr, mask=in_ctx, other=-1).to(tl.int32)
        is_res = in_ctx & (res_blk >= 0)
        host_row64 = src_blk.to(tl.int64) * BS + off
        is_host = in_ctx & (res_blk < 0) & (src_blk >= 0) & (host_row64 < host_limit)
        host_row = host_row64.to(tl.int32)
        hint_ok = is_host & (hint >= 0) & (hint < H)
        hint_blk, hint_off = _block_split(hint, BS, LBS, SB)
        hinted = tl.load(hot_map + q * H + hint, mask=hint_ok, other=-1)
        hot_blk = tl.load(hot_table + q * HB + hint_blk, mask=hint_ok, other=0)
        hint_hit = hint_ok & (hinted == host_row)
        cand = is_host & ~hint_hit
        out = tl.where(is_res, res_blk * BS + off, tl.where(hint_hit, hot_blk * BS + hint_off, -1))
        tl.store(out_rows + entry_ptr, out, mask=emask & ~cand)
        tl.store(scr_mark + b * HP + hint, tl.full((ES,), 1, tl.int32), mask=hint_hit)
        if MASK:
            tl.store(miss_mask + entry_ptr, tl.full((ES,), 0, tl.int32), mask=emask & ~cand)
        # The plan rows this program covers, cleared up to their old count; the last program writes
        # the new plan over them.
        clear = emask & (c < old_plan)
        tl.store(plan_host + entry_ptr, tl.full((ES,), -1, tl.int32), mask=clear)
        tl.store(plan_device + entry_ptr, tl.full((ES,), -1, tl.int32), mask=clear)
        ci = cand.to(tl.int32)
        seg = (b * NS + s) * ES + tl.associative_scan(ci, 0, _SUM) - ci
        tl.store(scr_crow + seg, host_row, mask=cand)
        tl.store(scr_cee + seg, f, mask=cand)
        tl.store(scr_cpos + seg, pos, mask=cand)
        part = scr_part + (b * NS + s) * PW
        valid_g = tl.reduce(((g[:, None] == gg[None, :]) & (is_res | is_host)[:, None]).to(tl.int32), 0, _SUM)
        tl.store(part + gg, valid_g)
        tl.store(part + GP, tl.reduce(is_host.to(tl.int32), 0, _SUM))
        tl.store(part + GP + 1, tl.reduce(ci, 0, _SUM))
        tl.atomic_add(stats + 0, tl.reduce(is_res.to(tl.int32), 0, _SUM).to(tl.int64), sem="relaxed")
        tl.debug_barrier()  # every thread's stores precede the ticket's release
        ticket = tl.atomic_add(scr_ticket + b, 1, sem="acq_rel")
        if ticket == NS - 1:
            ss = tl.arange(0, NS)
            pr = scr_part + (b * NS + ss) * PW
            rmask = gg < g_len
            counts = tl.load(pr[:, None] + gg[None, :], volatile=True)  # [NS, GP]
            tl.store(out_counts + b + gg, tl.reduce(counts, 0, _SUM), mask=rmask)
            n_host = tl.reduce(tl.load(pr + GP, volatile=True), 0, _SUM)
            n_cand = tl.reduce(tl.load(pr + GP + 1, volatile=True), 0, _SUM)
            old_plan_g = tl.load(plan_counts + b + gg, mask=rmask, other=0)
            if TAIL:
                # The hot rows are `resolve_split_hot_kernel`'s: here only the table of the candidates,
                # and what the next kernels need (-1: no host entry, hot state untouched).
                info = scr_part + b * NS * PW + GP + 2
                if n_host == 0:
                    tl.store(plan_counts + b + gg, tl.full((GP,), 0, tl.int32), mask=rmask & (old_plan_g != 0))
                    tl.store(info, -1)
                else:
                    rounds = _split_claim(tbl_key + b * TP, tbl_first + b * TP, scr_part + b * NS * PW + GP + 1,
                                          scr_crow, scr_cee, scr_cbkt, scr_cat, b * NS * ES, n_cand, NS, ES, PW, CP,
                                          TP, LOG_TP)
                    tl.store(info, n_cand)
                    tl.store(info + 1, rounds)
            else:
                if n_host == 0:
                    tl.store(plan_counts + b + gg, tl.full((GP,), 0, tl.int32), mask=rmask & (old_plan_g != 0))
                else:
                    ii = tl.arange(0, HP)
                    smask = ii < H
                    order = tl.load(lru + q * H + ii, mask=smask, other=0).to(tl.int32)
                    slot_ok = smask & (order >= 0) & (order < H)
                    mk = scr_mark + b * HP
                    if HG:
                        mk_row = tl.load(mk + ii, mask=smask, other=0, volatile=True)
                        marked = slot_ok & (tl.gather(mk_row, tl.where(slot_ok, order, 0), 0) != 0)
                        tl.store(mk + ii, tl.full((HP,), 0, tl.int32), mask=smask & (mk_row != 0))
                    else:
                        marked = slot_ok & (tl.load(mk + order, mask=slot_ok, other=0, volatile=True) != 0)
                        tl.store(mk + order, tl.full((HP,), 0, tl.int32), mask=marked)
                    if n_cand == 0:
                        hit_i = marked.to(tl.int32)
                        h_rank = _exclusive_ranks(hit_i, SH, HP)
                        n_hit = tl.reduce(hit_i, 0, _SUM)
                        tl.atomic_add(stats + 1, n_hit.to(tl.int64), sem="relaxed")
                        new_pos = tl.where(marked, H - n_hit + h_rank, ii - h_rank)
                        tl.store(lru + q * H + new_pos, order, mask=smask & (new_pos != ii))
                        tl.store(plan_counts + b + gg, tl.full((GP,), 0, tl.int32), mask=rmask & (old_plan_g != 0))
                    else:
                        if HG:
                            hm_row = tl.load(hot_map + q * H + ii, mask=smask, other=-1)
                            held_row = tl.where(slot_ok, tl.gather(hm_row, tl.where(slot_ok, order, 0), 0), -1)
                        else:
                            held_row = tl.load(hot_map + q * H + order, mask=slot_ok, other=-1)
                        held = slot_ok & (held_row >= 0)
                        tk = tbl_key + b * TP
                        tf = tbl_first + b * TP
                        ts = tbl_slot + b * TP
                        lst = b * NS * ES  # the request's list scratch (list index u)
                        uu = tl.arange(0, CP)
                        if KEEP:
                            one = n_cand <= CP
                            many = uu * 0 + n_cand > CP  # lanes wide (the interpreter masks by lanes only)
                        else:
                            one = False
                        # 1. The candidates claim buckets (as the gather resolver's), CP at a time, in list
                        #    order; each keeps its bucket and its segment address for the later passes (in
                        #    registers where the list is one chunk: `one`).
                        if one:
                            k_bkt, k_at, k_crow, k_cee, k_home = _split_claim_chunk(
                                tk, tf, scr_part + b * NS * PW + GP + 1, scr_crow, scr_cee, lst, uu, uu < n_cand, NS,
                                ES, PW, TP, LOG_TP)
                            k_cpos = tl.load(scr_cpos + k_at, mask=uu < n_cand, other=0, volatile=True)
                            rounds = tl.reduce(tl.where(uu < n_cand, (k_bkt - k_home) & (TP - 1), 0), 0, _MAX) + 1
                        else:
                            k_bkt = uu * 0
                            k_crow = k_bkt
                            k_cee = k_bkt
                            k_cpos = k_bkt
                            rounds = _split_claim(tk, tf, scr_part + b * NS * PW + GP + 1, scr_crow, scr_cee, scr_cbkt,
                                                  scr_cat, lst, n_cand, NS, ES, PW, CP, TP, LOG_TP)
                        k_fee = k_bkt
                        # 2. Every held slot looks its row up (a row sits at most `rounds - 1` past its home).
                        if LR:
                            tab = tl.load(tk + tl.arange(0, TP))
                        found = held & (held_row < 0)
                        s_home = _fib_bucket(held_row, LOG_TP)
                        s_bkt = s_home
                        for r in range(0, rounds):
                            bk = (s_home + r) & (TP - 1)
                            if LR:
                                key = tl.gather(tab, bk, 0)
                            else:
                                key = tl.load(tk + bk, mask=held & ~found, other=EMPTY)
                            now = held & ~found & (key == held_row)
                            s_bkt = tl.where(now, bk, s_bkt)
                            found = found | now
                        tl.store(ts + s_bkt, order, mask=found)
                        tl.debug_barrier()
                        # 3. First references, misses and their ranks in list order; a missed row's bucket
                        #    takes -2 - its miss rank (a held row's holds its slot).
                        n_miss = n_cand * 0
                        row_miss = gg * 0
                        for c0 in range(0, n_cand, CP):
                            u = c0 + uu
                            um = u < n_cand
                            if KEEP:  # a one-chunk list from registers (no load issues: its mask is off)
                                lm = um & many
                                e_bkt = tl.where(one, k_bkt, tl.load(scr_cbkt + lst + u, mask=lm, other=0))
                                at = tl.load(scr_cat + lst + u, mask=lm, other=0)
                                cee = tl.where(one, tl.where(um, k_cee, -1),
                                               tl.load(scr_cee + at, mask=lm, other=-1, volatile=True))
                            else:
                                e_bkt = tl.load(scr_cbkt + lst + u, mask=um, other=0)
                                at = tl.load(scr_cat + lst + u, mask=um, other=0)
                                cee = tl.load(scr_cee + at, mask=um, other=-1, volatile=True)
                            f_ee = tl.load(tf + e_bkt, mask=um, other=-2, volatile=True)
                            if KEEP:
                                k_fee = f_ee
                            hit_slot = tl.load(ts + e_bkt, mask=um, other=-1)
                            mflag = um & (f_ee == cee) & (hit_slot < 0)
                            mf = mflag.to(tl.int32)
                            m_rank = n_miss + tl.associative_scan(mf, 0, _SUM) - mf
                            tl.store(ts + e_bkt, -2 - m_rank, mask=mflag)
                            g_u = cee // KP
                            row_miss += tl.reduce(((g_u[:, None] == gg[None, :]) & mflag[:, None]).to(tl.int32), 0, _SUM)
                            n_miss += tl.reduce(mf, 0, _SUM)
                        hit_pos = slot_ok & (marked | found)
                        evict_pos = smask & ~hit_pos
                        ev = evict_pos.to(tl.int32)
                        e_rank = _exclusive_ranks(ev, SH, HP)
                        n_evict = tl.reduce(ev, 0, _SUM)
                        h_rank = ii - e_rank
                        tl.atomic_add(stats + 1, (H - n_evict).to(tl.int64), sem="relaxed")
                        tl.atomic_add(stats + 2, n_miss.to(tl.int64), sem="relaxed")
                        n_used = tl.minimum(n_miss, n_evict)
                        vb = scr_victim + b * HP
                        tl.store(vb + e_rank, order, mask=evict_pos & (e_rank < n_miss))
                        new_pos = tl.where(hit_pos, n_evict + h_rank,
                                           tl.where(e_rank < n_used, n_evict - n_used + e_rank, e_rank - n_used))
                        tl.store(lru + q * H + new_pos, order, mask=smask & (new_pos >= 0) & (new_pos < H) & (new_pos != ii))
                        r_start = tl.associative_scan(row_miss, 0, _SUM) - row_miss
                        tl.debug_barrier()
                        # 4. Every candidate's slot (its row's, or its row's victim), outputs, hint, plan.
                        for c0 in range(0, n_cand, CP):
                            u = c0 + uu
                            um = u < n_cand
                            if KEEP:
                                lm = um & many
                                e_bkt = tl.where(one, k_bkt, tl.load(scr_cbkt + lst + u, mask=lm, other=0))
                                at = tl.load(scr_cat + lst + u, mask=lm, other=0)
                                crow = tl.where(one, k_crow, tl.load(scr_crow + at, mask=lm, other=0, volatile=True))
                                cee = tl.where(one, k_cee, tl.load(scr_cee + at, mask=lm, other=0, volatile=True))
                                cpos = tl.where(one, k_cpos, tl.load(scr_cpos + at, mask=lm, other=0, volatile=True))
                                v = tl.load(ts + e_bkt, mask=um, other=-1)
                                f_ee = tl.where(one, k_fee, tl.load(tf + e_bkt, mask=lm, other=-2, volatile=True))
                            else:
                                e_bkt = tl.load(scr_cbkt + lst + u, mask=um, other=0)
                                at = tl.load(scr_cat + lst + u, mask=um, other=0)
                                crow = tl.load(scr_crow + at, mask=um, other=0, volatile=True)
                                cee = tl.load(scr_cee + at, mask=um, other=0, volatile=True)
                                cpos = tl.load(scr_cpos + at, mask=um, other=0, volatile=True)
                                v = tl.load(ts + e_bkt, mask=um, other=-1)
                                f_ee = tl.load(tf + e_bkt, mask=um, other=-2, volatile=True)
                            missed = um & (v < 0)
                            m = -2 - v
                            victim = tl.load(vb + m, mask=missed & (m < n_used), other=-1)
                            _split_publish(um, missed, m, v, victim, f_ee, cee, crow, cpos, q, b, gg, r_start, ctx, hot_table, hot_map,
                                           out_rows, pos_slot, plan_host, plan_device, miss_mask, HB, K, BS, H, LBS, KP, MASK, SB)
                        tl.store(plan_counts + b + gg, row_miss, mask=rmask & (row_miss != old_plan_g))
                        tl.debug_barrier()
                        # 5. The table left empty for the next call: only the buckets this call used.
                        if one:
                            um = uu < n_cand
                            tl.store(tk + k_bkt, tl.full((CP,), EMPTY, tl.int32), mask=um)
                            tl.store(tf + k_bkt, tl.full((CP,), NO_ENTRY, tl.int32), mask=um)
                            tl.store(ts + k_bkt, tl.full((CP,), -1, tl.int32), mask=um)
                        else:
                            _split_clear_table(tk, tf, ts, scr_cbkt, lst, n_cand, uu, CP)
                        tl.store(ts + s_bkt, tl.full((HP,), -1, tl.int32), mask=found)
            tl.store(scr_ticket + b, 0)


@triton.jit(do_not_specialize=["B", "HB", "R", "K", "G_MAX", "BS", "H", "P", "LBS"])
def resolve_split_hot_kernel(row_state, hot_table, hot_map, lru, stats, out_rows, plan_host, plan_device, plan_counts,
                             pos_slot, miss_mask, tbl_key, tbl_first, tbl_slot, scr_victim, scr_mark,
                             scr_part, scr_ticket, scr_crow, scr_cee, scr_cpos, scr_cbkt, scr_cat,
                             scr_hcnt, scr_ord, scr_hit,
                             B, HB, R, K, G_MAX, BS, H, P, LBS,
                             KP: tl.constexpr, GP: tl.constexpr, HP: tl.constexpr, TP: tl.constexpr,
                             LOG_TP: tl.constexpr, MASK: tl.constexpr, NS: tl.constexpr, CP: tl.constexpr,
                             PW: tl.constexpr, NH: tl.constexpr, HS: tl.constexpr, SH: tl.constexpr = 1,
                             SB: tl.constexpr = 0):
    """The hot rows of `resolve_split_kernel`'s TAIL build (`shapes.SPLIT_TAIL_ENV`), launched behind it:

    - `NH` programs a batch row, program s taking LRU positions [s * HS, (s + 1) * HS) of its request:
      the slots there, their marks and held rows, each held row's lookup in the candidates' table
      (a found row's bucket takes its slot), hit or evictable; its evictable slots in LRU order go to
      its segment of `scr_victim` (the first `n_cand` of them: no more can be victims), its counts to
      `scr_hcnt`, its slots and hit flags to `scr_ord` / `scr_hit` for `resolve_split_lru_kernel`;
    - the request's last program to finish (the ticket, as in `resolve_split_kernel`) does what is
      per request: the candidates' first references and miss ranks, the victims (the m-th evictable
      slot in LRU order, found through the segments' counts), outputs, hints, plan, hot map, the
      table left empty, and `n_used` (victims taken) for the LRU kernel.

    Reads only what `resolve_split_kernel` left (its candidate list, table and per-request counts,
    -1 where no host entry touched the hot state); no program waits for another."""
    pid = tl.program_id(0)
    b = pid // NH
    s = pid % NH
    in_batch = b < B
    q = tl.load(row_state + b, mask=in_batch, other=-1)
    q = tl.where(q < R, q, -1)
    prev = tl.load(row_state + b - 1, mask=in_batch & (b > 0), other=-2)
    info = scr_part + b * NS * PW + GP + 2
    n_cand = tl.load(info, mask=(q >= 0) & (prev != q), other=-1)
    if n_cand >= 0:
        rounds = tl.load(info + 1)
        tk = tbl_key + b * TP
        tf = tbl_first + b * TP
        ts = tbl_slot + b * TP
        ii = s * HS + tl.arange(0, HS)
        smask = ii < H
        order = tl.load(lru + q * H + ii, mask=smask, other=0).to(tl.int32)
        slot_ok = smask & (order >= 0) & (order < H)
        marked = slot_ok & (tl.load(scr_mark + b * HP + order, mask=slot_ok, other=0) != 0)
        held_row = tl.load(hot_map + q * H + order, mask=slot_ok, other=-1)
        held = slot_ok & (held_row >= 0)
        found = held & (held_row < 0)
        s_home = _fib_bucket(held_row, LOG_TP)
        s_bkt = s_home
        for r in range(0, rounds):  # a row sits at most `rounds - 1` past its home
            bk = (s_home + r) & (TP - 1)
            key = tl.load(tk + bk, mask=held & ~found, other=EMPTY)
            now = held & ~found & (key == held_row)
            s_bkt = tl.where(now, bk, s_bkt)
            found = found | now
        tl.store(ts + s_bkt, order, mask=found)
        hit = slot_ok & (marked | found)
        evict = smask & ~hit
        ev = evict.to(tl.int32)
        e_rank = _exclusive_ranks(ev, SH, HS)
        tl.store(scr_victim + b * HP + s * HS + e_rank, order, mask=evict & (e_rank < n_cand))
        tl.store(scr_ord + b * HP + ii, order, mask=smask)
        tl.store(scr_hit + b * HP + ii, hit.to(tl.int32), mask=smask)
        hc = scr_hcnt + (b * NH + s) * 2
        tl.store(hc, tl.reduce(ev, 0, _SUM))
        tl.store(hc + 1, tl.reduce(hit.to(tl.int32), 0, _SUM))
        tl.debug_barrier()  # every thread's stores precede the ticket's release
        ticket = tl.atomic_add(scr_ticket + b, 1, sem="acq_rel")
        if ticket == NH - 1:
            gg = tl.arange(0, GP)
            rs = tl.load(row_state + b + gg, mask=(gg < G_MAX) & (b + gg < B), other=-2)
            g_len = tl.minimum(tl.reduce(tl.where(rs == q, GP, gg), 0, _MIN), G_MAX)
            rmask = gg < g_len
            old_plan_g = tl.load(plan_counts + b + gg, mask=rmask, other=0)
            ctx = P * BS
            hh = scr_hcnt + (b * NH + tl.arange(0, NH)) * 2
            n_evict = tl.reduce(tl.load(hh, volatile=True), 0, _SUM)
            tl.atomic_add(stats + 1, tl.reduce(tl.load(hh + 1, volatile=True), 0, _SUM).to(tl.int64), sem="relaxed")
            lst = b * NS * (GP * KP // NS)
            uu = tl.arange(0, CP)
            # First references, misses and their ranks in list order; a missed row's bucket takes
            # -2 - its miss rank (a held row's holds its slot).
            n_miss = n_cand * 0
            row_miss = gg * 0
            for c0 in range(0, n_cand, CP):
                u = c0 + uu
                um = u < n_cand
                e_bkt = tl.load(scr_cbkt + lst + u, mask=um, other=0)
                at = tl.load(scr_cat + lst + u, mask=um, other=0)
                cee = tl.load(scr_cee + at, mask=um, other=-1)
                f_ee = tl.load(tf + e_bkt, mask=um, other=-2)
                hit_slot = tl.load(ts + e_bkt, mask=um, other=-1, volatile=True)
                mflag = um & (f_ee == cee) & (hit_slot < 0)
                mf = mflag.to(tl.int32)
                m_rank = n_miss + tl.associative_scan(mf, 0, _SUM) - mf
                tl.store(ts + e_bkt, -2 - m_rank, mask=mflag)
                g_u = cee // KP
                row_miss += tl.reduce(((g_u[:, None] == gg[None, :]) & mflag[:, None]).to(tl.int32), 0, _SUM)
                n_miss += tl.reduce(mf, 0, _SUM)
            tl.atomic_add(stats + 2, n_miss.to(tl.int64), sem="relaxed")
            n_used = tl.minimum(n_miss, n_evict)
            tl.store(info + 1, n_used)
            r_start = tl.associative_scan(row_miss, 0, _SUM) - row_miss
            tl.debug_barrier()
            # Every candidate's slot (its row's, or its row's victim), outputs, hint, plan.
            for c0 in range(0, n_cand, CP):
                u = c0 + uu
                um = u < n_cand
                e_bkt = tl.load(scr_cbkt + lst + u, mask=um, other=0)
                at = tl.load(scr_cat + lst + u, mask=um, other=0)
                crow = tl.load(scr_crow + at, mask=um, other=0)
                cee = tl.load(scr_cee + at, mask=um, other=0)
                cpos = tl.load(scr_cpos + at, mask=um, other=0)
                v = tl.load(ts + e_bkt, mask=um, other=-1, volatile=True)
                f_ee = tl.load(tf + e_bkt, mask=um, other=-2)
                missed = um & (v < 0)
                m = -2 - v
                vat = _split_list_at(scr_hcnt + b * NH * 2, m, b * HP, NH, HS, 2)
                victim = tl.load(scr_victim + vat, mask=missed & (m < n_used), other=-1, volatile=True)
                _split_publish(um, missed, m, v, victim, f_ee, cee, crow, cpos, q, b, gg, r_start, ctx, hot_table, hot_map,
                               out_rows, pos_slot, plan_host, plan_device, miss_mask, HB, K, BS, H, LBS, KP, MASK, SB)
            tl.store(plan_counts + b + gg, row_miss, mask=rmask & (row_miss != old_plan_g))
            tl.debug_barrier()
            # The table left empty for the next call: every bucket in use is a candidate's.
            _split_clear_table(tk, tf, ts, scr_cbkt, lst, n_cand, uu, CP)
            tl.store(scr_ticket + b, 0)


@triton.jit(do_not_specialize=["B", "R", "H"])
def resolve_split_lru_kernel(row_state, lru, scr_mark, scr_part, scr_hcnt, scr_ord, scr_hit, B, R, H,
                             GP: tl.constexpr, HP: tl.constexpr, NS: tl.constexpr, PW: tl.constexpr,
                             NH: tl.constexpr, HS: tl.constexpr, SH: tl.constexpr = 1, PDL: tl.constexpr = 0):
    """The new LRU order of `resolve_split_hot_kernel`'s requests, `NH` programs a batch row as there,
    behind it: program s moves the slots of LRU positions [s * HS, (s + 1) * HS) (read from `scr_ord`,
    so no program reads a position another rewrites) to the gather resolver's new positions: the
    evictable slots not taken first, the victims next, the hits last, each in their old order; and
    clears the marks of slots [s * HS, (s + 1) * HS). `PDL`: the plan copy behind it may launch once
    every program has begun (it waits in `gdc_wait` for this kernel's end)."""
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    b = pid // NH
    s = pid % NH
    in_batch = b < B
    q = tl.load(row_state + b, mask=in_batch, other=-1)
    q = tl.where(q < R, q, -1)
    prev = tl.load(row_state + b - 1, mask=in_batch & (b > 0), other=-2)
    info = scr_part + b * NS * PW + GP + 2
    n_cand = tl.load(info, mask=(q >= 0) & (prev != q), other=-1)
    if n_cand >= 0:
        n_used = tl.load(info + 1)
        ss = tl.arange(0, NH)
        cnt = tl.load(scr_hcnt + (b * NH + ss) * 2)
        n_evict = tl.reduce(cnt, 0, _SUM)
        e_before = tl.reduce(tl.where(ss < s, cnt, 0), 0, _SUM)
        ii = s * HS + tl.arange(0, HS)
        smask = ii < H
        order = tl.load(scr_ord + b * HP + ii, mask=smask, other=0)
        hit = smask & (tl.load(scr_hit + b * HP + ii, mask=smask, other=0) != 0)
        ev = (smask & ~hit).to(tl.int32)
        e_rank = e_before + _exclusive_ranks(ev, SH, HS)
        h_rank = ii - e_rank
        new_pos = tl.where(hit, n_evict + h_rank, tl.where(e_rank < n_used, n_evict - n_used + e_rank, e_rank - n_used))
        tl.store(lru + q * H + new_pos, order, mask=smask & (new_pos >= 0) & (new_pos < H) & (new_pos != ii))
        tl.store(scr_mark + b * HP + ii, tl.full((HS,), 0, tl.int32), mask=smask)


@triton.jit(do_not_specialize=["B", "K", "row_bytes", "host_rows", "dev_rows", "W", "BS", "NP", "LBS"])
def copy_plan_kernel(plan_host, plan_device, plan_counts, src, dst, dst_block_stride, stats, B, K, row_bytes,
                     host_rows, dev_rows, W, BS, NP, LBS,
                     WP: tl.constexpr, EB: tl.constexpr, BP: tl.constexpr, PDL: tl.constexpr = 0,
                     VEC: tl.constexpr = 0, SB: tl.constexpr = 0):
    """A fixed grid of NP programs shares every row's plan: chunks of EB entries, numbered across
    the batch (row by row), go to programs round robin, so a step with few misses launches no idle
    program per row and one with many keeps every program busy. With `PDL` (a programmatic dependent
    launch) it waits for the kernel before it (the resolver) to end and flush before reading.

    With `VEC` > 0 (`shapes.LEAN_COPY_ENV`; `W` a multiple of `VEC`, which the runtime checks), a device
    row's block and offset are 32-bit arithmetic (a row index is below 2^31; the 64-bit division by
    the runtime `BS` is a called routine per entry, 16 calls in the sm_90 build) and every row offset
    is declared a multiple of `VEC` words, so the compiler moves `VEC` words per load and store (16
    bytes for int32 words) instead of one: the copy's programs are few and each is bound by the
    instructions its warps issue one after another (sm_90, Triton 3.6: 1,776 SASS instructions,
    182 registers). With `SB` too (`BS = 2^LBS`), block and offset are a shift and a mask (each
    thread holds 8 of a chunk's 16 rows: 8 divisions by the runtime `BS` otherwise). `LBS` is read
    only with `SB`. `PDL` = 2 (`shapes.PDL_CHAIN_ENV`): once its wait is over, it lets the next kernel (a
    resolver launched as a programmatic dependent, which waits for this kernel's end) launch."""
    if PDL:
        gdc_wait()
    if PDL > 1:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    rr = tl.arange(0, BP)
    counts = tl.load(plan_counts + rr, mask=rr < B, other=0)
    counts = tl.minimum(tl.maximum(counts, 0), K)
    chunks = (counts + EB - 1) // EB
    cstart = tl.associative_scan(chunks, 0, _SUM) - chunks
    total = tl.reduce(chunks, 0, _SUM)
    if (pid == 0) & (total > 0):
        tl.atomic_add(stats + 3, tl.reduce(counts, 0, _SUM).to(tl.int64) * row_bytes)
    w = tl.arange(0, WP)
    wm = w < W
    for c in range(pid, total, NP):
        mine = (cstart <= c) & (c < cstart + chunks)
        r = tl.reduce(tl.where(mine, rr, -1), 0, _MAX)
        c0 = tl.reduce(tl.where(mine, cstart, -1), 0, _MAX)
        n = tl.reduce(tl.where(mine, counts, 0), 0, _MAX)
        e = (c - c0) * EB + tl.arange(0, EB)
        m = e < n
        if VEC:
            h32 = tl.load(plan_host + r * K + e, mask=m, other=0)
            d32 = tl.load(plan_device + r * K + e, mask=m, other=0)
            m = m & (h32 >= 0) & (h32 < host_rows) & (d32 >= 0) & (d32 < dev_rows)
            wv = (W // VEC) * VEC  # == W; its factor VEC is what lets the mask below cover whole vectors
            mm = m[:, None] & (w < wv)[None, :]
            saddr = tl.multiple_of(h32.to(tl.int64) * wv, VEC)
            blk, off = _block_split(d32, BS, LBS, SB)
            daddr = tl.multiple_of(blk.to(tl.int64) * dst_block_stride + (off * wv).to(tl.int64), VEC)
            vals = tl.load(src + saddr[:, None] + w[None, :], mask=mm)
            tl.store(dst + daddr[:, None] + w[None, :], vals, mask=mm)
        else:
            h = tl.load(plan_host + r * K + e, mask=m, other=0).to(tl.int64)
            d = tl.load(plan_device + r * K + e, mask=m, other=0).to(tl.int64)
            m = m & (h >= 0) & (h < host_rows) & (d >= 0) & (d < dev_rows)  # trusted input: never a stray access
            mm = m[:, None] & wm[None, :]
            vals = tl.load(src + h[:, None] * W + w[None, :], mask=mm)
            daddr = (d // BS) * dst_block_stride + (d % BS) * W
            tl.store(dst + daddr[:, None] + w[None, :], vals, mask=mm)


@triton.jit
def _copy_plan_chunk(src, dst, dst_block_stride, h, d, m, w, wm, W, BS, LW: tl.constexpr):  # noqa: ANN001, ANN202
    """Host rows `h` to device rows `d` where `m`, `W` words a row, lane `w` a word; `LW` > 0: read
    along the host's lines of LW words from the line a row's first word is in (`copy_plan_rows_kernel`)."""
    daddr = (d // BS) * dst_block_stride + (d % BS) * W
    if LW:
        base = (h * W // LW) * LW  # the first host line of the row
        col = w[None, :] - (h * W - base)[:, None]  # the row's word at lane w
        mm = m[:, None] & (col >= 0) & (col < W)
        vals = tl.load(src + base[:, None] + w[None, :], mask=mm)
        tl.store(dst + daddr[:, None] + col, vals, mask=mm)
    else:
        mm = m[:, None] & wm[None, :]
        vals = tl.load(src + h[:, None] * W + w[None, :], mask=mm)
        tl.store(dst + daddr[:, None] + w[None, :], vals, mask=mm)


@triton.jit(do_not_specialize=["B", "K", "row_bytes", "host_rows", "dev_rows", "W", "BS", "NP"])
def copy_plan_rows_kernel(plan_host, plan_device, plan_counts, src, dst, dst_block_stride, stats, B, K, row_bytes,
                          host_rows, dev_rows, W, BS, NP,
                          WP: tl.constexpr, EB: tl.constexpr, BP: tl.constexpr, PDL: tl.constexpr = 0,
                          LW: tl.constexpr = 0):
    """`copy_plan_kernel`'s copy for small batches: `NP // B` programs a batch row (at least one), the
    j-th of a row taking its chunks j, j + NP // B, ... of EB entries. A program reads its row's count
    beside its first chunk's plan entries (entries past a row's count are -1 between calls), so the
    first host reads wait on one round trip, not on the counts of the batch and then the plan. With
    `LW` (words of a 128-byte host line; `WP` then covers `W + LW - 1` words), a row is read along the
    host's lines from the line its first word is in, so no load of a warp's consecutive lanes splits a
    line (the nvidia backend's gather measured 6-7 points of the copy engine's bandwidth for that).
    `PDL`: as in `copy_plan_kernel`."""
    if PDL:
        gdc_wait()
    if PDL > 1:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    per = tl.maximum(NP // B, 1)
    w = tl.arange(0, WP)
    wm = w < W
    for r in range(pid // per, B, tl.maximum(NP // per, 1)):
        e = (pid % per) * EB + tl.arange(0, EB)
        m = e < K
        h = tl.load(plan_host + r * K + e, mask=m, other=-1).to(tl.int64)
        d = tl.load(plan_device + r * K + e, mask=m, other=-1).to(tl.int64)
        n = tl.minimum(tl.maximum(tl.load(plan_counts + r), 0), K)
        m = m & (e < n) & (h >= 0) & (h < host_rows) & (d >= 0) & (d < dev_rows)  # trusted input: never a stray access
        _copy_plan_chunk(src, dst, dst_block_stride, h, d, m, w, wm, W, BS, LW)
        for c in range(pid % per + per, (n + EB - 1) // EB, per):
            e = c * EB + tl.arange(0, EB)
            m = e < n
            h = tl.load(plan_host + r * K + e, mask=m, other=0).to(tl.int64)
            d = tl.load(plan_device + r * K + e, mask=m, other=0).to(tl.int64)
            m = m & (h >= 0) & (h < host_rows) & (d >= 0) & (d < dev_rows)
            _copy_plan_chunk(src, dst, dst_block_stride, h, d, m, w, wm, W, BS, LW)
    if pid == 0:  # the bytes counter, after this program's own copy
        rr = tl.arange(0, BP)
        counts = tl.minimum(tl.maximum(tl.load(plan_counts + rr, mask=rr < B, other=0), 0), K)
        total = tl.reduce(counts, 0, _SUM)
        if total > 0:
            tl.atomic_add(stats + 3, total.to(tl.int64) * row_bytes)


@triton.jit
def _spec_load(src, host, m, w, W, VEC: tl.constexpr):  # noqa: ANN001, ANN202 - a Triton device function
    """Host rows `host` where `m`, `W` words a row at lanes `w` (with `VEC`, whole vectors of VEC words):
    `(values, lane mask)`."""
    if VEC:
        wv = (W // VEC) * VEC  # == W (the runtime checks); its factor VEC lets the mask cover whole vectors
        mm = m[:, None] & (w < wv)[None, :]
        vals = tl.load(src + tl.multiple_of(host.to(tl.int64) * wv, VEC)[:, None] + w[None, :], mask=mm)
    else:
        mm = m[:, None] & (w < W)[None, :]
        vals = tl.load(src + (host.to(tl.int64) * W)[:, None] + w[None, :], mask=mm)
    return vals, mm


@triton.jit
def _spec_store(dst, dst_block_stride, dev, vals, mm, w, W, BS, LBS, VEC: tl.constexpr, SB: tl.constexpr):  # noqa: ANN001, ANN202
    """`vals` (from `_spec_load`, lane mask `mm`) into device rows `dev` (>= 0 wherever `mm`)."""
    blk, off = _block_split(tl.maximum(dev, 0), BS, LBS, SB)
    if VEC:
        wv = (W // VEC) * VEC
        daddr = tl.multiple_of(blk.to(tl.int64) * dst_block_stride + (off * wv).to(tl.int64), VEC)
    else:
        daddr = blk.to(tl.int64) * dst_block_stride + (off * W).to(tl.int64)
    tl.store(dst + daddr[:, None] + w[None, :], vals, mask=mm)


@triton.jit
def _spec_pick(sel, rank, base, vals, SC: tl.constexpr):  # noqa: ANN001, ANN202
    """Slot j of `SC`: the value of `vals` (>= 0 where used) at the entry where `sel` and `rank == base + j`
    (-1: no such entry). A [SC, lanes] compare and reduce: no entry crosses lanes through memory."""
    jj = tl.arange(0, SC)
    hit = sel[None, :] & (rank[None, :] == (base + jj)[:, None])
    return tl.reduce(tl.where(hit, vals[None, :], -1), 1, _MAX)


@triton.jit(do_not_specialize=["B", "K", "P", "R", "H", "BS", "LBS", "host_limit", "row_bytes", "host_rows",
                               "dev_rows", "W", "NC", "dst_block_stride"])
def copy_spec_kernel(topk, row_state, seq_lens, source_table, resident_table, hot_map, pos_slot, miss_mask, out_rows,
                     plan_counts, src, dst, dst_block_stride, stats, B, K, P, R, H, BS, LBS, host_limit, row_bytes,
                     host_rows, dev_rows, W, NC,
                     WP: tl.constexpr, SE: tl.constexpr, SC: tl.constexpr, BP: tl.constexpr, PDL: tl.constexpr = 0,
                     VEC: tl.constexpr = 0, SB: tl.constexpr = 0):
    """The plan copy of layer 0 behind the split resolver, started while it runs (`shapes.SPEC_COPY_ENV`):
    `NC` programs a batch row, each over `SE` of the row's entries (every `NC`-th).

    - Before `gdc_wait` (with `PDL`, while the resolver runs): the entries the resolver will take as
      candidates (host entries whose slot hint does not hold their row, read from the hint and hot-map
      state as it stands) are the likely misses; the first `SC` of them have their host rows read into
      registers, so the host reads overlap the resolver instead of following it.
    - After it: the resolver's miss mask (1 where an entry is its row's first reference of a missed row
      with a victim, exactly the entries of the plan) and output rows (the victim's device row) say
      what to write: the rows read early where their entry missed, then every other missed entry
      (past `SC`, or one the early read did not predict: that state changes under the resolver) read
      and written `SC` at a time.

    Host data is not written during a step, so a row read early is the row the plan copy would read:
    the device cache ends as `copy_plan_kernel` leaves it, whatever the early read saw. Program 0 adds
    the plan's bytes to the counter, as `copy_plan_kernel` does. `PDL` = 2: as in `copy_plan_kernel` (the
    resolver it follows launched it only after its own wait, so the inputs it reads early are final)."""
    pid = tl.program_id(0)
    r = pid // NC
    # A program's entries are every NC-th of the row, not a block of SE: a step's misses often sit
    # together in the top-k (a decode's new positions), and a block holding more than SC of them would
    # read the rest after the resolver ends (34 misses at B = 8 on an H100: 2 a row, 3.3 us).
    e = pid % NC + NC * tl.arange(0, SE)
    q = tl.load(row_state + r)
    q = tl.where(q < R, q, -1)  # trusted input out of range: a padding row, never a stray access
    em = (e < K) & (e * 0 + q >= 0)  # lanes wide (the interpreter masks by lanes only)
    ctx = P * BS
    t = tl.load(topk + r * K + e, mask=em, other=-1)
    sl = tl.load(seq_lens + r)
    in_ctx = em & (t >= 0) & (t < sl) & (t < ctx)
    pos = tl.where(in_ctx, t, 0)
    page, off = _block_split(pos, BS, LBS, SB)
    res_blk = tl.load(resident_table + q * P + page, mask=in_ctx, other=-1)
    src_blk = tl.load(source_table + q * P + page, mask=in_ctx, other=-1)
    hint = tl.load(pos_slot + q.to(tl.int64) * ctx + pos, mask=in_ctx, other=-1).to(tl.int32)
    host64 = src_blk.to(tl.int64) * BS + off
    is_host = in_ctx & (res_blk < 0) & (src_blk >= 0) & (host64 < host_limit) & (host64 < host_rows)
    host = tl.where(is_host, host64, 0).to(tl.int32)
    hint_ok = is_host & (hint >= 0) & (hint < H)
    hinted = tl.load(hot_map + q * H + hint, mask=hint_ok, other=-1)
    cand = is_host & ~(hint_ok & (hinted == host))
    ci = cand.to(tl.int32)
    rank = tl.associative_scan(ci, 0, _SUM) - ci
    w = tl.arange(0, WP)
    early_host = _spec_pick(cand, rank, 0, host, SC)
    early_ent = _spec_pick(cand, rank, 0, e, SC)
    early = early_host >= 0
    vals, mm = _spec_load(src, early_host, early, w, W, VEC)  # in flight across the wait
    if PDL:
        gdc_wait()
    if PDL > 1:
        gdc_launch_dependents()
    # One round trip after the wait: the early rows' entries and every entry of the program, side by side.
    e_miss = tl.load(miss_mask + r * K + early_ent, mask=early, other=0) != 0
    e_dev = tl.load(out_rows + r * K + early_ent, mask=early, other=-1)
    missed = tl.load(miss_mask + r * K + e, mask=is_host, other=0) != 0
    dev = tl.load(out_rows + r * K + e, mask=is_host, other=-1)
    # The early rows whose entry missed, at its device row.
    e_ok = early & e_miss & (e_dev >= 0) & (e_dev < dev_rows)
    _spec_store(dst, dst_block_stride, e_dev, vals, mm & e_ok[:, None], w, W, BS, LBS, VEC, SB)
    # Every other missed entry (past the early ones, or not predicted), SC at a time.
    rest = missed & (dev >= 0) & (dev < dev_rows) & ~(cand & (rank < SC))
    fi = rest.to(tl.int32)
    n_rest = tl.reduce(fi, 0, _SUM)
    if n_rest > 0:
        f_rank = tl.associative_scan(fi, 0, _SUM) - fi
        for f0 in range(0, n_rest, SC):
            h2 = _spec_pick(rest, f_rank, f0, host, SC)
            d2 = _spec_pick(rest, f_rank, f0, dev, SC)
            v2, mm2 = _spec_load(src, h2, (h2 >= 0) & (d2 >= 0), w, W, VEC)
            _spec_store(dst, dst_block_stride, d2, v2, mm2, w, W, BS, LBS, VEC, SB)
    if pid == 0:  # the bytes counter, as the plan copy counts them
        rr = tl.arange(0, BP)
        counts = tl.minimum(tl.maximum(tl.load(plan_counts + rr, mask=rr < B, other=0), 0), K)
        total = tl.reduce(counts, 0, _SUM)
        if total > 0:
            tl.atomic_add(stats + 3, total.to(tl.int64) * row_bytes)


@triton.jit(do_not_specialize=["n", "src_block_stride", "dst_block_stride", "W", "BS"])
def copy_rows_kernel(pairs, n, src, src_block_stride, dst, dst_block_stride, W, BS,
                     WP: tl.constexpr, EB: tl.constexpr):
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


@triton.jit(do_not_specialize=["R", "H"])
def invalidate_written_kernel(state_rows, host_rows, hot_map, R, H, HP: tl.constexpr):
    i = tl.program_id(0)
    q = tl.load(state_rows + i)
    g = tl.load(host_rows + i)
    if (q >= 0) & (q < R) & (g >= 0):
        ss = tl.arange(0, HP)
        hv = tl.load(hot_map + q * H + ss, mask=ss < H, other=-1)
        tl.store(hot_map + q * H + ss, tl.full((HP,), -1, tl.int32), mask=(ss < H) & (hv == g))


@triton.jit(do_not_specialize=["n", "host_rows", "W", "BS", "block_stride"])
def vllm_copy_kernel(src_rows, pick, dst_rows, any_take, host, hot, n, host_rows, W, BS, block_stride,
                     WP: tl.constexpr, EB: tl.constexpr):
    """vLLM's row copies (`hisparse_gather_compact`, `hisparse_gather_plan`) after
    `hisparse_core.vllm_ops.last_write_wins`: entry e writes the bytes of host row
    `src_rows[pick[e]]` (zeros where that is past the host pool) into hot row `dst_rows[e]`, so every
    write to one row carries the same bytes; nothing when no entry is taken (`any_take[0] == 0`)."""
    e = tl.program_id(0) * EB + tl.arange(0, EB)
    m = (e < n) & (tl.load(any_take + e * 0) != 0)  # a vector load: the flag for every lane
    p = tl.load(pick + e, mask=m, other=0)
    src = tl.load(src_rows + p, mask=m, other=0).to(tl.int64)
    d = tl.load(dst_rows + e, mask=m, other=0).to(tl.int64)
    w = tl.arange(0, WP)
    wm = w < W
    present = m & (src >= 0) & (src < host_rows)
    vals = tl.load(host + src[:, None] * W + w[None, :], mask=present[:, None] & wm[None, :], other=0)
    daddr = (d // BS) * block_stride + (d % BS) * W
    tl.store(hot + daddr[:, None] + w[None, :], vals, mask=m[:, None] & wm[None, :])


@triton.jit(do_not_specialize=["S", "NR", "H"])
def vllm_invalidate_kernel(dgi, state_of_req, req_ids, written, S, NR, H, HP: tl.constexpr):
    """`hisparse_invalidate_written_slots`, one program per written token: every slot of its state
    row holding the written host row becomes -1 (duplicates too)."""
    j = tl.program_id(0)
    req = tl.load(req_ids + j)
    w = tl.load(written + j).to(tl.int64)
    ok = (req >= 0) & (req < NR)
    q = tl.load(state_of_req + req, mask=ok, other=-1)
    if ok & (q >= 0) & (q < S) & (w >= 0):
        ss = tl.arange(0, HP)
        hv = tl.load(dgi + q * H + ss, mask=ss < H, other=-1)
        tl.store(dgi + q * H + ss, tl.full((HP,), -1, tl.int32), mask=(ss < H) & (hv.to(tl.int64) == w))


KERNELS: dict[str, Callable[..., Any]] = {
    "resolve_kernel": resolve_kernel, "resolve_gather_kernel": resolve_gather_kernel,
    "resolve_split_kernel": resolve_split_kernel, "resolve_split_hot_kernel": resolve_split_hot_kernel,
    "resolve_split_lru_kernel": resolve_split_lru_kernel, "copy_plan_kernel": copy_plan_kernel,
    "copy_plan_rows_kernel": copy_plan_rows_kernel, "copy_spec_kernel": copy_spec_kernel,
    "copy_rows_kernel": copy_rows_kernel, "invalidate_written_kernel": invalidate_written_kernel,
    "vllm_copy_kernel": vllm_copy_kernel, "vllm_invalidate_kernel": vllm_invalidate_kernel,
}
