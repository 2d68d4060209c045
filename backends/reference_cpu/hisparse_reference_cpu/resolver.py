"""The resolver contract (docs/resolver-contract.md) as a pure function on CPU tensors.

`resolve_batch` reads the persistent hot state but never writes it: it returns the outputs and
the new hot-map and LRU rows of every touched state row, and the runtime commits them only after
the whole call succeeded. That keeps a failing call a no-op without any undo logic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hisparse_core.errors import InvalidInputError
from hisparse_core.row_groups import groups_of


@dataclass(frozen=True, slots=True)
class Resolution:
    """Everything one resolve call produces, before it is committed to the runtime."""

    rows: torch.Tensor  # [Bmax, K] int32
    valid_counts: torch.Tensor  # [Bmax] int32
    plan_host: torch.Tensor  # [Bmax, K] int32
    plan_device: torch.Tensor  # [Bmax, K] int32
    plan_counts: torch.Tensor  # [Bmax] int32
    hot_map: dict[int, torch.Tensor]  # state row -> new hot map row [H] int32
    lru: dict[int, torch.Tensor]  # state row -> new LRU order [H] int32
    resident: int
    hits: int
    misses: int


def _first_reference_unique(host_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct values of `host_rows` in order of first occurrence, and each one's first index."""
    values, inverse = torch.unique(host_rows, return_inverse=True)
    first = torch.full_like(values, host_rows.numel())
    first.scatter_reduce_(0, inverse, torch.arange(host_rows.numel()), reduce="amin")
    order = torch.argsort(first)
    return values[order], first[order]


def _hot_rows(hot_table_row: torch.Tensor, slots: torch.Tensor, bs: int) -> torch.Tensor:
    """Device rows of hot slots: `hot_table[q, s // bs] * bs + s % bs`."""
    return hot_table_row[slots // bs] * bs + slots % bs


def resolve_batch(topk: torch.Tensor, row_state: torch.Tensor, seq_lens: torch.Tensor,
                  source_table: torch.Tensor, resident_table: torch.Tensor, hot_table: torch.Tensor,
                  hot_map: torch.Tensor, lru: torch.Tensor, *, block_size: int,
                  max_batch_rows: int) -> Resolution:
    """Resolve one batch against the hot state (`hot_map`, `lru`: `[R, H]`), which is only read.

    Inputs are assumed shape-checked. Out-of-context positions are masked (with validation on
    they were rejected earlier). Raises `InvalidInputError` if trusted inputs make a group's misses
    outnumber its evictable slots (only possible with unvalidated, over-long groups).
    """
    bs = block_size
    k = topk.shape[1]
    rows = torch.full((max_batch_rows, k), -1, dtype=torch.int64)
    plan_host = torch.full((max_batch_rows, k), -1, dtype=torch.int64)
    plan_device = torch.full((max_batch_rows, k), -1, dtype=torch.int64)
    plan_counts = torch.zeros(max_batch_rows, dtype=torch.int64)
    new_map: dict[int, torch.Tensor] = {}
    new_lru: dict[int, torch.Tensor] = {}
    resident = hits = misses = 0

    for grp in groups_of(row_state):
        q = grp.state
        t = topk[grp.start:grp.stop].long()
        in_ctx = (t >= 0) & (t < seq_lens[grp.start:grp.stop, None].long())
        pos = torch.where(in_ctx, t, 0)
        page, offset = pos // bs, pos % bs
        res_block = resident_table[q].long()[page]
        src_block = source_table[q].long()[page]
        is_res = in_ctx & (res_block >= 0)
        is_host = in_ctx & ~is_res & (src_block >= 0)

        out = torch.full_like(t, -1)
        out[is_res] = (res_block * bs + offset)[is_res]
        resident += int(is_res.sum())

        # Row-major flattening of the group is exactly first-reference order.
        flat_idx = is_host.flatten().nonzero().squeeze(1)
        if flat_idx.numel():
            entry_rows = (src_block * bs + offset).flatten()[flat_idx]
            union, first = _first_reference_unique(entry_rows)
            first_batch_row = flat_idx[first] // k  # relative to grp.start

            cur_map = new_map.get(q, hot_map[q]).long()
            order = new_lru.get(q, lru[q]).long()
            is_hit = torch.isin(cur_map[order], union)
            hit_slots, evictable = order[is_hit], order[~is_hit]
            is_miss = ~torch.isin(union, cur_map)
            miss_rows = union[is_miss]
            m = miss_rows.numel()
            if m > evictable.numel():
                raise InvalidInputError(
                    f"state row {q}: the group of batch rows [{grp.start}, {grp.stop}) misses {m} host rows "
                    f"but only {evictable.numel()} hot slots are evictable; the group is longer than "
                    f"rows_per_request allows")
            victims = evictable[:m]
            filled = cur_map.clone()
            filled[victims] = miss_rows
            new_map[q] = filled.to(torch.int32)
            new_lru[q] = torch.cat([evictable[m:], victims, hit_slots]).to(torch.int32)

            # Non-negative hot-map values are unique, so a sorted search finds each row's slot.
            sorted_rows, sorted_slots = torch.sort(filled)
            slot = sorted_slots[torch.searchsorted(sorted_rows, entry_rows)]
            out.view(-1)[flat_idx] = _hot_rows(hot_table[q].long(), slot, bs)

            miss_dev = _hot_rows(hot_table[q].long(), victims, bs)
            miss_owner = first_batch_row[is_miss]
            for j in range(grp.stop - grp.start):
                mine = miss_owner == j
                n = int(mine.sum())
                plan_host[grp.start + j, :n] = miss_rows[mine]
                plan_device[grp.start + j, :n] = miss_dev[mine]
                plan_counts[grp.start + j] = n
            hits += union.numel() - m
            misses += m

        rows[grp.start:grp.stop] = out

    valid_counts = (rows != -1).sum(dim=1)
    return Resolution(rows.to(torch.int32), valid_counts.to(torch.int32), plan_host.to(torch.int32),
                      plan_device.to(torch.int32), plan_counts.to(torch.int32), new_map, new_lru,
                      resident, hits, misses)
