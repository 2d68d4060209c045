"""vLLM's HiSparse op set in plain PyTorch on CPU tensors (semantics: hisparse_core/vllm_ops.py).

The oracle of `Capability.VLLM_OPS`: every other backend's op set must match it bit for bit. Each
op checks its arguments first (a bad one raises and nothing is written), then computes every
output before it writes any, so a call is all or nothing. Copies move bytes through `uint8`
views, so they are exact for every row format.
"""

from __future__ import annotations

import torch

from hisparse_core import vllm_ops as spec


def _bytes_rows(host: torch.Tensor, hot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Byte views: host `[host_rows, row_bytes]` and the hot cache's blocks `[blocks, bs, row_bytes]`."""
    row_bytes = hot.shape[2] * hot.element_size()
    return host.view(torch.uint8).view(host.shape[0], row_bytes), hot.view(torch.uint8), row_bytes


def _copy_rows(host: torch.Tensor, hot: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy host rows `src` into hot rows `dst` (both int64, already filtered to `dst` in range);
    a source past the host rows zero-fills its destination."""
    if dst.numel() == 0:
        return
    host_b, hot_b, _ = _bytes_rows(host, hot)
    bs = hot.shape[1]
    present = src < host_b.shape[0]
    data = torch.zeros((dst.numel(), host_b.shape[1]), dtype=torch.uint8)
    data[present] = host_b[src[present]]
    # One destination named twice: the later entry wins, and both writes carry its bytes.
    dst, pick, _ = spec.last_write_wins(dst, torch.ones_like(dst, dtype=torch.bool))
    hot_b[dst // bs, dst % bs] = data.index_select(0, pick)


def _attention(rows: torch.Tensor, bs: int, stride: int) -> torch.Tensor:
    return torch.where(rows < 0, -1, (rows // bs) * stride + rows % bs)


class ReferenceVllmOps(spec.VllmHiSparseOps):
    """The four ops on CPU tensors."""

    @property
    def device_type(self) -> str:
        return "cpu"

    def resolve(self, call: spec.ResolveCall) -> None:
        host_cache, hot_cache, hot_block_table = call.host_cache, call.hot_cache, call.hot_block_table
        topk, hot_out, device_global_indices = call.topk, call.hot_out, call.device_global_indices
        lru_slots, request_state_indices = call.lru_slots, call.request_state_indices
        region_stride, miss_mask, stats = call.region_stride, call.miss_mask, call.stats
        attention_indices, attention_block_stride = call.attention_indices, call.attention_block_stride
        request_ids, source_block_table = call.request_ids, call.source_block_table
        source_block_size, resolved, valid_counts = call.source_block_size, call.resolved, call.valid_counts
        swap_host, swap_dev, swap_counts = call.swap_host, call.swap_dev, call.swap_counts
        resident_block_table, resident_block_size = call.resident_block_table, call.resident_block_size
        resident_null_block = call.resident_null_block
        n, k = topk.shape
        s, h = lru_slots.shape
        bs = hot_cache.shape[1]
        host_rows = host_cache.shape[0]
        t = topk.long()

        req = request_ids[:n].long() if request_ids is not None else torch.arange(n)
        if request_state_indices is not None:
            nr = request_state_indices.numel()
            req_ok = (req >= 0) & (req < nr)
            state = torch.where(req_ok, request_state_indices.long()[req.clamp(0, max(nr - 1, 0))] if nr else -1, -1)
        else:
            state = req
        padding = (state < 0) | (state >= s)

        if source_block_table is not None:
            sbs = source_block_size
            rs, p = source_block_table.shape
            col = torch.where(t >= 0, t // sbs, -1)
            ok = ((req >= 0) & (req < rs))[:, None] & (col >= 0) & (col < p)
            block = source_block_table.long()[req.clamp(0, max(rs - 1, 0))[:, None], col.clamp(0, max(p - 1, 0))] \
                if rs and p else torch.full_like(t, -1)
            g = torch.where(ok & (block >= 0), block * sbs + t % sbs, -1)
        else:
            g = t.clone()
        g = torch.where(g >= host_rows, -1, g)

        res_row = torch.full_like(t, -1)
        if resident_block_table is not None:
            rbs = resident_block_size
            rr, rp = resident_block_table.shape
            col = torch.where(t >= 0, t // rbs, -1)
            ok = ((state >= 0) & (state < rr))[:, None] & (col >= 0) & (col < rp)
            if rr and rp:
                block = resident_block_table.long()[state.clamp(0, rr - 1)[:, None], col.clamp(0, rp - 1)]
                is_res = ok & (block != resident_null_block) & (block >= 0)
                res_row = torch.where(is_res, block * rbs + t % rbs, -1)

        out = torch.where(res_row >= 0, res_row, -1)
        valid = ((res_row >= 0) | (g >= 0)).sum(dim=1)
        pending = (res_row < 0) & (g >= 0)
        mm = torch.zeros_like(t)
        counts = torch.zeros(n, dtype=torch.int64)
        plan_rows: dict[int, list[tuple[int, int]]] = {}
        new_dgi = device_global_indices.clone()
        new_lru = lru_slots.clone()
        hits_total = misses_total = 0
        hbt = hot_block_table.long()

        def hot_row(r: int, slot: int) -> int:
            return int(hbt[int(req[r]), slot // bs]) * bs + slot % bs

        r = 0
        while r < n:
            if bool(padding[r]):
                r += 1
                continue
            q = int(state[r])
            stop = r + 1
            while stop < n and not bool(padding[stop]) and int(state[stop]) == q:
                stop += 1
            flat = [(rr, i) for rr in range(r, stop) for i in range(k) if bool(pending[rr, i])]
            if flat:
                union: list[int] = []
                first: dict[int, tuple[int, int]] = {}
                entries: dict[int, list[tuple[int, int]]] = {}
                for rr, i in flat:
                    gv = int(g[rr, i])
                    if gv not in first:
                        first[gv] = (rr, i)
                        union.append(gv)
                        entries[gv] = []
                    entries[gv].append((rr, i))
                order = [int(x) for x in new_lru[q].tolist()]
                dgi_row = [int(x) for x in new_dgi[q].tolist()]
                held_by: dict[int, int] = {}
                hit_slots, evictable = [], []
                for slot in order:
                    cached = dgi_row[slot] if 0 <= slot < region_stride else -1
                    if cached >= 0 and cached in first:
                        hit_slots.append(slot)
                        held_by[cached] = slot
                    else:
                        evictable.append(slot)
                for gv, slot in held_by.items():
                    for rr, i in entries[gv]:
                        out[rr, i] = hot_row(rr, slot)
                misses = [gv for gv in union if gv not in held_by]
                used = min(len(misses), len(evictable))
                for m, gv in enumerate(misses):
                    owner = first[gv][0]
                    slot = evictable[m] if m < used else -1
                    if 0 <= slot < region_stride:
                        dev_row = hot_row(owner, slot)
                        new_dgi[q, slot] = gv
                        for rr, i in entries[gv]:
                            out[rr, i] = dev_row
                        mm[first[gv]] = 1
                    else:
                        dev_row = -1
                        for rr, i in entries[gv]:
                            out[rr, i] = -1
                    plan_rows.setdefault(owner, []).append((gv, dev_row))
                new_lru[q] = torch.tensor(evictable[used:] + evictable[:used] + hit_slots, dtype=torch.int16)
                hits_total += len(union) - len(misses)
                misses_total += len(misses)
            r = stop

        for owner, plan in plan_rows.items():
            counts[owner] = len(plan)

        # Every output is known: write them (padding rows publish -1 / 0 and nothing else).
        pad = padding[:, None]
        hot_out.copy_(torch.where(pad, -1, out).to(torch.int32))
        if attention_indices is not None:
            attention_indices[:n] = _attention(torch.where(pad, -1, out), bs, attention_block_stride).to(torch.int32)
        if resolved is not None:
            resolved.copy_(torch.where(pad, -1, g).to(torch.int32))
        if valid_counts is not None:
            valid_counts[:n] = torch.where(padding, 0, valid).to(torch.int32)
        if miss_mask is not None:
            miss_mask.copy_(torch.where(pad, miss_mask.long(), mm).to(torch.int32))
        if swap_counts is not None:
            assert swap_host is not None and swap_dev is not None
            swap_counts[:n] = counts.to(torch.int32)
            for owner, plan in plan_rows.items():
                swap_host[owner, :len(plan)] = torch.tensor([p[0] for p in plan], dtype=torch.int32)
                swap_dev[owner, :len(plan)] = torch.tensor([p[1] for p in plan], dtype=torch.int32)
        device_global_indices.copy_(new_dgi)
        lru_slots.copy_(new_lru)
        if stats is not None:
            # vLLM's counters are uint64, which has no CPU add: the same bits as int64 (counts < 2^63).
            counters = stats.view(torch.int64)
            counters[0] += hits_total
            counters[1] += misses_total

    def gather_compact(self, host_cache: torch.Tensor, hot_cache: torch.Tensor, miss_global: torch.Tensor,
                       miss_hot: torch.Tensor, miss_counts: torch.Tensor) -> None:
        spec.check_gather_compact(host_cache, hot_cache, miss_global, miss_hot, miss_counts)
        n, k = miss_global.shape
        hot_rows = hot_cache.shape[0] * hot_cache.shape[1]
        count = miss_counts[:n].long().clamp(0, k)
        take = torch.arange(k)[None, :] < count[:, None]
        src, dst = miss_global.long(), miss_hot.long()
        take &= (src >= 0) & (dst >= 0) & (dst < hot_rows)
        _copy_rows(host_cache, hot_cache, src[take], dst[take])

    def gather_plan(self, host_cache: torch.Tensor, hot_cache: torch.Tensor, global_indices: torch.Tensor,
                    hot_indices: torch.Tensor, miss_mask: torch.Tensor, request_state_indices: torch.Tensor | None,
                    attention_indices: torch.Tensor | None, attention_block_stride: int) -> None:
        spec.check_gather_plan(host_cache, hot_cache, global_indices, hot_indices, miss_mask, request_state_indices,
                               attention_indices, attention_block_stride)
        n = global_indices.shape[0]
        bs = hot_cache.shape[1]
        hot_rows = hot_cache.shape[0] * bs
        padding = (request_state_indices[:n].long() < 0) if request_state_indices is not None \
            else torch.zeros(n, dtype=torch.bool)
        src, dst = global_indices.long(), hot_indices.long()
        take = ~padding[:, None] & (miss_mask != 0) & (src >= 0) & (dst >= 0) & (dst < hot_rows)
        att = None
        if attention_indices is not None:
            att = torch.where(padding[:, None], -1, _attention(dst, bs, attention_block_stride)).to(torch.int32)
        _copy_rows(host_cache, hot_cache, src[take], dst[take])
        if att is not None and attention_indices is not None:
            attention_indices.copy_(att)

    def invalidate_written_slots(self, device_global_indices: torch.Tensor, request_state_indices: torch.Tensor,
                                 req_id_per_token: torch.Tensor, written_slots: torch.Tensor) -> None:
        spec.check_invalidate(device_global_indices, request_state_indices, req_id_per_token, written_slots)
        s = device_global_indices.shape[0]
        nr = request_state_indices.numel()
        req = req_id_per_token.long()
        ok = (req >= 0) & (req < nr)
        state = torch.where(ok, request_state_indices.long()[req.clamp(0, max(nr - 1, 0))] if nr else -1, -1)
        ok &= (state >= 0) & (state < s) & (written_slots >= 0)
        dgi = device_global_indices
        for q, w in zip(state[ok].tolist(), written_slots[ok].tolist(), strict=True):
            dgi[q][dgi[q] == w] = -1
