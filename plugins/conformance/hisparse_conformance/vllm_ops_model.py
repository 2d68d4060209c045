"""A straightforward model of vLLM's four HiSparse ops (hisparse_core/vllm_ops.py), in plain Python
lists, and random cases to run it and a backend's `VllmHiSparseOps` on.

Independent of every backend's code: loops over rows and entries, dicts and lists, written from the
semantics in `hisparse_core.vllm_ops`'s docstring. Cases mix padding rows, masked entries, resident,
null and out-of-range pages, repeated rows, hits from a warm state, speculative groups, a source
row past the host pool (zero-fill) and, optionally, out-of-range LRU slots, calls without request ids
and tables (row r is request r and an entry's host row its top-k value, as vLLM's own kernel tests
call the resolve) and region strides that are not a multiple of the hot block size.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

NAMES = ("hot_out", "attention", "resolved", "valid", "miss_mask", "swap_host", "swap_dev", "swap_counts", "dgi",
         "lru", "stats", "hot", "plan_hot", "plan_attention", "inv_dgi")


@dataclass
class Case:
    host: torch.Tensor  # [host_rows, W] uint8
    hot: torch.Tensor  # [blocks, bs, W] uint8 (blocks strided)
    hot_bt: torch.Tensor
    topk: torch.Tensor
    dgi: torch.Tensor
    lru: torch.Tensor
    rsi: torch.Tensor
    request_ids: torch.Tensor | None  # None: no tables (row r is request r, host row = top-k value)
    source_bt: torch.Tensor | None
    resident_bt: torch.Tensor | None
    sbs: int
    null_block: int
    att_stride: int
    max_union_rows: int
    outputs: dict[str, torch.Tensor]  # initial contents of the written output buffers
    written_req: torch.Tensor
    written_slots: torch.Tensor

    def resolve_args(self, device: torch.device | str = "cpu", *, miss_mask: bool = True) -> list[Any]:
        """The 25 arguments of `hisparse_resolve_residency`, fresh copies (host_cache stays on the CPU);
        `miss_mask=False` passes None for it, as vLLM 0.32's runtime does."""
        def d(t: torch.Tensor) -> torch.Tensor:
            return t.clone().to(device)

        def opt(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else d(t)

        o = self.outputs
        hot = self.hot.to(device) if torch.device(device).type != "cpu" else self.hot.clone()
        return [self.host, hot, d(self.hot_bt), d(self.topk), d(o["hot_out"]), d(self.dgi), d(self.lru),
                d(self.rsi), self.lru.shape[1], self.max_union_rows, d(o["miss_mask"]) if miss_mask else None,
                d(o["stats"]),
                d(o["attention"]), self.att_stride, opt(self.request_ids), opt(self.source_bt), self.sbs,
                d(o["resolved"]), d(o["valid"]), d(o["swap_host"]), d(o["swap_dev"]), d(o["swap_counts"]),
                opt(self.resident_bt), self.hot.shape[1] if self.resident_bt is not None else 0, self.null_block]


def _random_outputs(n: int, k: int, rng: random.Random, g: torch.Generator) -> dict[str, torch.Tensor]:
    """The output buffers' initial contents: garbage an op must overwrite (or leave, where it says so)."""
    return {
        "hot_out": torch.randint(-5, 100, (n, k), dtype=torch.int32, generator=g),
        "attention": torch.randint(-5, 100, (n + 1, k), dtype=torch.int32, generator=g),
        "resolved": torch.randint(-5, 100, (n, k), dtype=torch.int32, generator=g),
        "valid": torch.randint(-5, 100, (n + 1,), dtype=torch.int32, generator=g),
        "miss_mask": torch.randint(0, 2, (n, k), dtype=torch.int32, generator=g),
        "swap_host": torch.randint(-5, 100, (n, k), dtype=torch.int32, generator=g),
        "swap_dev": torch.randint(-5, 100, (n, k), dtype=torch.int32, generator=g),
        "swap_counts": torch.randint(-5, 100, (n,), dtype=torch.int32, generator=g),
        "stats": torch.tensor([rng.randrange(100), rng.randrange(100)], dtype=torch.uint64),
    }


def _random_lru(s: int, h: int, corrupt: bool, rng: random.Random, g: torch.Generator) -> torch.Tensor:
    """Every state row's LRU order, a permutation; `corrupt`: one slot of one row out of range."""
    lru = torch.stack([torch.randperm(h, generator=g) for _ in range(s)]).to(torch.int16)
    if corrupt:
        q = rng.randrange(s)
        lru[q, rng.randrange(h)] = rng.choice([-3, h, h + 7])
    return lru


def _random_writes(requests: int, dgi: torch.Tensor, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """The invalidation's tokens: each a request (some out of range) and a slot the hot map holds, or -1."""
    nw = rng.randint(0, 4)
    written_req = torch.tensor([rng.randrange(-1, requests + 1) for _ in range(nw)], dtype=torch.int32)
    written_slots = torch.tensor([rng.choice([-1] + [int(x) for x in dgi.flatten() if x >= 0] or [0])
                                  for _ in range(nw)], dtype=torch.int64)
    return written_req, written_slots


def _random_topk(n: int, k: int, rng: random.Random, repeat_below: float, limit: int) -> torch.Tensor:
    """`[n, k]` top-k values: 10% masked (-1), up to `repeat_below` a repeat of a value drawn before
    (a hit within the row, or across the group), the rest new in [0, `limit`)."""
    topk = torch.full((n, k), -1, dtype=torch.int32)
    drawn: list[int] = []
    for r in range(n):
        for i in range(k):
            roll = rng.random()
            if roll < 0.1:
                continue
            if roll < repeat_below and drawn:
                topk[r, i] = rng.choice(drawn)
                continue
            t = rng.randrange(limit)
            topk[r, i] = t
            drawn.append(t)
    return topk


def random_case(seed: int, *, corrupt_lru: bool = False, rows_per_request: int = 1, tables: bool = True,
                any_stride: bool = False) -> Case:
    """A random case. `tables=False`: no request ids, source or resident table; `any_stride`: the
    region stride (hot slots a state row has) is not rounded up to a multiple of the hot block size.
    With the defaults, a seed gives the same case as it always has (fixed-seed tests rely on it)."""
    if not tables:
        return _case_without_tables(seed, corrupt_lru=corrupt_lru, rows_per_request=rows_per_request,
                                    any_stride=any_stride)
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    bs = rng.choice([1, 2, 4])
    k = rng.choice([1, 3, 8, 16])
    h = rows_per_request * k + rng.randint(0, k)
    h = h if any_stride else bs * -(-h // bs)
    s = rng.randint(2, 5)  # state rows
    nreq = rng.randint(1, s)
    pages = rng.randint(2, 8)
    width = 16 * rng.choice([1, 2])
    host_blocks = nreq * pages + 2
    host_rows = host_blocks * bs
    blocks = 1 + nreq * pages + nreq * (h // bs) + 2
    # Strided blocks: a slab with room for another layer between blocks.
    slab = torch.randint(0, 256, (blocks * 2 * bs * width,), dtype=torch.uint8, generator=g)
    hot = torch.as_strided(slab, (blocks, bs, width), (2 * bs * width, width, 1), bs * width)
    host = torch.randint(0, 256, (host_rows, width), dtype=torch.uint8, generator=g)
    states = rng.sample(range(s), nreq)
    rsi = torch.tensor(states + [-1] * rng.randint(0, 2), dtype=torch.int32)  # extra requests are padding
    source_bt = torch.tensor([[rng.choice([-1] + [rng.randrange(1, host_blocks)] * 6) for _ in range(pages)]
                              for _ in range(rsi.numel())], dtype=torch.int32)
    if rng.random() < 0.5:
        source_bt[0, 0] = host_blocks + 3  # rows past the host pool: null
    resident_bt = torch.tensor([[rng.choice([0, 0, 0, rng.randrange(1, blocks)]) for _ in range(pages + 1)]
                                for _ in range(s)], dtype=torch.int32)
    hot_cols = -(-h // bs) + rng.randint(0, 1)
    hot_bt = torch.tensor([[rng.randrange(blocks) for _ in range(hot_cols)] for _ in range(rsi.numel())],
                          dtype=torch.int32)
    dgi = torch.tensor([[rng.choice([-1, rng.randrange(host_rows + bs)]) for _ in range(h)] for _ in range(s)],
                       dtype=torch.int32)
    for q in range(s):  # non-negative hot-map values unique per row
        seen: set[int] = set()
        for j in range(h):
            v = int(dgi[q, j])
            if v in seen:
                dgi[q, j] = -1
            seen.add(v)
    lru = _random_lru(s, h, corrupt_lru, rng, g)
    req_ids: list[int] = []
    for req in rng.sample(range(rsi.numel()), rsi.numel()):
        for _ in range(rng.randint(1, rows_per_request)):
            req_ids.append(req)
    req_ids += [-1] * rng.randint(0, 1)
    n = len(req_ids)
    topk = _random_topk(n, k, rng, 0.2, pages * bs + bs)  # may run past the source table
    request_ids = torch.tensor(req_ids, dtype=torch.int32)
    outputs = _random_outputs(n, k, rng, g)
    written_req, written_slots = _random_writes(rsi.numel(), dgi, rng)
    return Case(host, hot, hot_bt, topk, dgi, lru, rsi, request_ids, source_bt, resident_bt, bs,
                0, 2 * bs + rng.randint(0, 3), min(h, rows_per_request * k), outputs, written_req, written_slots)


def _case_without_tables(seed: int, *, corrupt_lru: bool, rows_per_request: int, any_stride: bool) -> Case:
    """`random_case(tables=False)`: each batch row is its own request, so rows of one state row in a
    run are a group through `request_state_indices` alone."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    bs = rng.choice([1, 2, 4, 8])
    k = rng.choice([1, 3, 8, 16])
    h = rows_per_request * k + rng.randint(0, k)
    h = h if any_stride else bs * -(-h // bs)
    s = rng.randint(2, 5)
    width = 16 * rng.choice([1, 2])
    host_rows = rng.randint(k, 6 * k + 8)
    states = rng.sample(range(s), rng.randint(1, s))
    rsi_rows: list[int] = []
    for q in states:
        rsi_rows += [q] * rng.randint(1, rows_per_request)
        if rng.random() < 0.2:
            rsi_rows.append(rng.choice([-1, s, s + 2]))  # padding: no state row, or one past them
    n = len(rsi_rows)
    hot_cols = -(-h // bs) + rng.randint(0, 1)
    blocks = 1 + n * hot_cols + 2
    slab = torch.randint(0, 256, (blocks * 2 * bs * width,), dtype=torch.uint8, generator=g)
    hot = torch.as_strided(slab, (blocks, bs, width), (2 * bs * width, width, 1), bs * width)
    host = torch.randint(0, 256, (host_rows, width), dtype=torch.uint8, generator=g)
    # Rows of one state row share their hot-table row, as a request's rows do (where a group's rows
    # named different hot tables, which one a miss's device row comes from is not pinned down).
    per_state = [[rng.randrange(blocks) for _ in range(hot_cols)] for _ in range(s + 3)]
    hot_bt = torch.tensor([per_state[q] for q in rsi_rows], dtype=torch.int32)
    dgi = torch.full((s, h), -1, dtype=torch.int32)
    for q in range(s):  # non-negative hot-map values unique per row; some past the host cache
        vals = rng.sample(range(host_rows + bs), min(h, host_rows + bs))
        for j in range(h):
            if j < len(vals) and rng.random() < 0.6:
                dgi[q, j] = vals[j]
    lru = _random_lru(s, h, corrupt_lru, rng, g)
    topk = _random_topk(n, k, rng, 0.25, host_rows + bs)  # may run past the host cache: null
    outputs = _random_outputs(n, k, rng, g)
    written_req, written_slots = _random_writes(n, dgi, rng)
    rsi = torch.tensor(rsi_rows, dtype=torch.int32)
    return Case(host, hot, hot_bt, topk, dgi, lru, rsi, None, None, None, 0, 0, 2 * bs + rng.randint(0, 3),
                min(h, rows_per_request * k), outputs, written_req, written_slots)


def run_ops(ops: Any, case: Case, device: torch.device | str = "cpu", *,
            miss_mask: bool = True) -> dict[str, torch.Tensor]:
    """Resolve, then gather_compact of its plan, gather_plan of its miss mask (into a second copy of the
    hot cache) and an invalidation, through `ops` (a `VllmHiSparseOps` or the registered torch ops).
    `miss_mask=False`: the resolve gets None for it and gather_plan the case's initial mask."""
    a = case.resolve_args(device, miss_mask=miss_mask)
    ops.resolve_residency(*a)
    if a[10] is None:
        a[10] = case.outputs["miss_mask"].clone().to(device)
    host, hot, swap_host, swap_dev, swap_counts = a[0], a[1], a[19], a[20], a[21]
    plan_hot = hot.clone() if torch.device(device).type == "cpu" else hot.clone()
    ops.gather_compact(host, hot, swap_host, swap_dev, swap_counts)
    plan_att = torch.full_like(a[4], 7)
    # Padding rows of the resolve (by request id; without ids no row is padding for gather_plan).
    plan_state = (torch.where(a[14] >= 0, 0, -1).to(torch.int32) if a[14] is not None
                  else torch.zeros(a[4].shape[0], dtype=torch.int32, device=a[4].device))
    ops.gather_plan(host, plan_hot, a[17], a[4], a[10], plan_state, plan_att, case.att_stride)
    inv = a[5].clone()
    ops.invalidate_written_slots(inv, a[7], case.written_req.to(device), case.written_slots.to(device))
    out = {"hot_out": a[4], "attention": a[12], "resolved": a[17], "valid": a[18], "miss_mask": a[10],
           "swap_host": a[19], "swap_dev": a[20], "swap_counts": a[21], "dgi": a[5], "lru": a[6],
           "stats": a[11].view(torch.int64),
           "hot": hot, "plan_hot": plan_hot, "plan_attention": plan_att, "inv_dgi": inv}
    return {k: v.cpu().contiguous() for k, v in out.items()}


def invalidate_model(dgi: list[list[int]], rsi: list[int], written_req: list[int],
                     written_slots: list[int]) -> list[list[int]]:
    """`hisparse_invalidate_written_slots` on lists: each written token's host row leaves every slot of
    its request's state row that holds it (every copy, where a row is held twice); a request outside
    `rsi`, a state row outside `dgi`, or a negative slot changes nothing. Returns a new table."""
    inv = [row[:] for row in dgi]
    for req, w in zip(written_req, written_slots, strict=True):
        q = rsi[req] if 0 <= req < len(rsi) else -1
        if 0 <= q < len(inv) and w >= 0:
            inv[q] = [-1 if v == w else v for v in inv[q]]
    return inv


def run_model(case: Case, *, miss_mask: bool = True) -> dict[str, torch.Tensor]:
    """The same sequence as `run_ops`, on lists."""
    o = {k: v.tolist() for k, v in case.outputs.items()}
    topk = case.topk.tolist()
    n, k = case.topk.shape
    s, h = case.lru.shape
    bs = case.hot.shape[1]
    host_rows = case.host.shape[0]
    dgi = case.dgi.tolist()
    lru = case.lru.tolist()
    rsi = case.rsi.tolist()
    req_ids = case.request_ids.tolist() if case.request_ids is not None else list(range(n))
    src = case.source_bt.tolist() if case.source_bt is not None else None
    res = case.resident_bt.tolist() if case.resident_bt is not None else []
    hbt = case.hot_bt.tolist()
    hot_rows = case.hot.shape[0] * bs

    def state_of(req: int) -> int:
        return rsi[req] if 0 <= req < len(rsi) else -1

    def attn(row: int) -> int:
        return -1 if row < 0 else (row // bs) * case.att_stride + row % bs

    def hot_row(req: int, slot: int) -> int:
        return hbt[req][slot // bs] * bs + slot % bs

    g = [[-1] * k for _ in range(n)]
    resident = [[-1] * k for _ in range(n)]
    out = [[-1] * k for _ in range(n)]
    mm = [[0] * k for _ in range(n)]
    counts = [0] * n
    padding = [not 0 <= state_of(req_ids[r]) < s for r in range(n)]
    for r in range(n):
        req, q = req_ids[r], state_of(req_ids[r])
        for i in range(k):
            t = topk[r][i]
            if src is None:
                g[r][i] = t if t >= 0 else -1
            elif t >= 0 and 0 <= req < len(src) and t // case.sbs < len(src[req]) and src[req][t // case.sbs] >= 0:
                g[r][i] = src[req][t // case.sbs] * case.sbs + t % case.sbs
            if g[r][i] >= host_rows:
                g[r][i] = -1
            if t >= 0 and 0 <= q < len(res) and t // bs < len(res[q]):
                b = res[q][t // bs]
                if b != case.null_block and b >= 0:
                    resident[r][i] = b * bs + t % bs
            out[r][i] = resident[r][i]
    hits = misses = 0
    r = 0
    while r < n:
        if padding[r]:
            r += 1
            continue
        q = state_of(req_ids[r])
        stop = r + 1
        while stop < n and not padding[stop] and state_of(req_ids[stop]) == q:
            stop += 1
        union: list[int] = []
        first: dict[int, tuple[int, int]] = {}
        for rr in range(r, stop):
            for i in range(k):
                if resident[rr][i] < 0 and g[rr][i] >= 0 and g[rr][i] not in first:
                    first[g[rr][i]] = (rr, i)
                    union.append(g[rr][i])
        if union:
            hit_slots, evictable, holder = [], [], {}
            for slot in lru[q]:
                cached = dgi[q][slot] if 0 <= slot < h else -1
                if cached in first:
                    hit_slots.append(slot)
                    holder[cached] = slot
                else:
                    evictable.append(slot)
            miss_list = [x for x in union if x not in holder]
            victim = {}
            for m, x in enumerate(miss_list):
                slot = evictable[m] if m < len(evictable) else -1
                owner = first[x][0]
                if 0 <= slot < h:
                    dgi[q][slot] = x
                    victim[x] = slot
                    mm[first[x][0]][first[x][1]] = 1
                    dev = hot_row(req_ids[owner], slot)
                else:
                    dev = -1
                o["swap_host"][owner][counts[owner]] = x
                o["swap_dev"][owner][counts[owner]] = dev
                counts[owner] += 1
            for rr in range(r, stop):
                for i in range(k):
                    x = g[rr][i]
                    if resident[rr][i] < 0 and x >= 0:
                        slot = holder.get(x, victim.get(x, -1))
                        out[rr][i] = hot_row(req_ids[rr], slot) if slot >= 0 else -1
            used = min(len(miss_list), len(evictable))
            lru[q] = evictable[used:] + evictable[:used] + hit_slots
            hits += len(union) - len(miss_list)
            misses += len(miss_list)
        r = stop
    for r in range(n):
        if padding[r]:
            o["hot_out"][r] = [-1] * k
            o["attention"][r] = [-1] * k
            o["resolved"][r] = [-1] * k
            o["valid"][r] = 0
            o["swap_counts"][r] = 0
            continue
        o["hot_out"][r] = out[r]
        o["attention"][r] = [attn(x) for x in out[r]]
        o["resolved"][r] = g[r]
        o["valid"][r] = sum(1 for i in range(k) if resident[r][i] >= 0 or g[r][i] >= 0)
        o["miss_mask"][r] = mm[r]
        o["swap_counts"][r] = counts[r]
    o["stats"] = [o["stats"][0] + hits, o["stats"][1] + misses]

    host_b = case.host.tolist()
    hot = case.hot.clone()
    plan_hot = case.hot.clone()

    def put(cache: torch.Tensor, src_row: int, dst: int) -> None:
        data = host_b[src_row] if src_row < host_rows else [0] * case.host.shape[1]
        cache[dst // bs, dst % bs] = torch.tensor(data, dtype=torch.uint8)

    for r in range(n):
        for j in range(min(max(o["swap_counts"][r], 0), k)):
            x, dst = o["swap_host"][r][j], o["swap_dev"][r][j]
            if x >= 0 and 0 <= dst < hot_rows:
                put(hot, x, dst)
    plan_att = [[7] * k for _ in range(n)]
    plan_mask = o["miss_mask"] if miss_mask else case.outputs["miss_mask"].tolist()
    for r in range(n):
        pad = req_ids[r] < 0
        for i in range(k):
            dst = o["hot_out"][r][i]
            plan_att[r][i] = -1 if pad else attn(dst)
            x = o["resolved"][r][i]
            if not pad and plan_mask[r][i] != 0 and x >= 0 and 0 <= dst < hot_rows:
                put(plan_hot, x, dst)
    inv = invalidate_model(dgi, rsi, case.written_req.tolist(), case.written_slots.tolist())

    i32 = torch.int32
    return {"hot_out": torch.tensor(o["hot_out"], dtype=i32).view(n, k),
            "attention": torch.tensor(o["attention"], dtype=i32).view(n + 1, k),
            "resolved": torch.tensor(o["resolved"], dtype=i32).view(n, k),
            "valid": torch.tensor(o["valid"], dtype=i32),
            "miss_mask": torch.tensor(o["miss_mask"], dtype=i32).view(n, k),
            "swap_host": torch.tensor(o["swap_host"], dtype=i32).view(n, k),
            "swap_dev": torch.tensor(o["swap_dev"], dtype=i32).view(n, k),
            "swap_counts": torch.tensor(o["swap_counts"], dtype=i32),
            "dgi": torch.tensor(dgi, dtype=i32).view(s, h), "lru": torch.tensor(lru, dtype=torch.int16).view(s, h),
            "stats": torch.tensor(o["stats"], dtype=torch.int64), "hot": hot.contiguous(),
            "plan_hot": plan_hot.contiguous(), "plan_attention": torch.tensor(plan_att, dtype=i32).view(n, k),
            "inv_dgi": torch.tensor(inv, dtype=i32).view(s, h)}
