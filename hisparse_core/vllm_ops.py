"""vLLM's HiSparse op set as a backend capability (`Capability.VLLM_OPS`).

vLLM's own sparse-attention HiSparse (`vllm/v1/hisparse/runtime.py`, vLLM 0.30 and later) calls
four ops in `torch.ops._C_cache_ops` that only vLLM's CUDA build compiles. A backend that declares
`Capability.VLLM_OPS` returns a `VllmHiSparseOps` from `Backend.vllm_ops()`; `hisparse_vllm.ops`
registers the four ops with `torch.library` and sends every call to it. Nothing here imports vLLM.

The argument names and order are those of vLLM 0.32.0's call sites (`SCHEMAS`). Semantics, as
vLLM's kernels define them (every backend must match `hisparse_reference_cpu.vllm_ops` bit for bit;
the conformance suite's `test_vllm_ops.py` checks it):

Addressing. A batch row `r` of `topk` belongs to request `req = request_ids[r]` (the batch request
index; `r` itself when `request_ids` is None) and to state row `q = request_state_indices[req]`
(`req` when None). `req` outside `[0, len(request_state_indices))` or `q` outside `[0, S)` (`S =
device_global_indices.shape[0]`) makes `r` a padding row: it publishes -1 in `hot_out`,
`attention_indices` and `resolved`, 0 in `valid_counts` and `swap_counts`, and reads or writes no
other state. `source_block_table` and `hot_block_table` are indexed by `req`,
`resident_block_table`, `device_global_indices` and `lru_slots` by `q`.

Classifying entry `i` of row `r`, `t = topk[r, i]` (`bs = hot_cache.shape[1]`):

- host row `g`: with a source table, `g = source_block_table[req, t // source_block_size] *
  source_block_size + t % source_block_size` where `t >= 0`, the column is inside the table and the
  block is >= 0, else -1; without one `g = t`. A `g >= host_cache.shape[0]` becomes -1.
- resident row: where a resident table is given, `t >= 0`, the column is inside it and the block `b`
  is neither `resident_null_block` nor negative: `b * resident_block_size + t % resident_block_size`.
- `valid_counts[r]` counts the entries that are resident or have `g >= 0`. `resolved[r, i] = g`.
- a resident entry outputs its row; an entry with `g < 0` outputs -1; the rest are host entries.

Hot lookup, per group (a maximal run of consecutive non-padding rows with one state row `q`): the
union `U` of the group's host rows in first-reference order (rows in order, entries in index order).
No host entry: the LRU and hot map are untouched (the resident fast path). Otherwise walk
`lru_slots[q]` from position 0 (least recently used): slot `s` holds `device_global_indices[q, s]`
when `0 <= s < region_stride`, else nothing (an out-of-range slot is never read). Slots holding a
row of `U` are hits `Hs`, the rest evictable `E`, both in LRU order. The misses `M` (rows of `U`
not held) in first-reference order; miss `m` takes victim `E[m]`: `device_global_indices[q, E[m]]
= M[m]` and its entries output `hot_row(E[m])`, where `hot_row(s) = hot_block_table[req, s // bs]
* bs + s % bs`. A victim outside `[0, region_stride)`, or a miss with no victim left, degrades to
invalid: its entries output -1, the hot map is not written and its plan entry has destination -1.
New LRU order: `E[|M|:] + E[:|M|] + Hs`. Each miss is recorded in the plan of the row that first
referenced it, packed in miss order: `swap_host[r, j] = M[m]`, `swap_dev[r, j] = hot_row(E[m])`,
`swap_counts[r]` = misses recorded in `r` (plan entries past it are left as they were);
`miss_mask[r, i] = 1` on the first-referencing entry of each miss written to the hot map, else 0.
`stats[0] += |U| - |M|` (hits), `stats[1] += |M|` (misses). `hot_out` holds the physical rows,
`attention_indices` the same rows as `(row // bs) * attention_block_stride + row % bs` (-1 stays).

`gather_compact` copies, per row `r`, plan entries `j < min(max(swap_counts[r], 0), top_k)` from
host row `g` to hot row `d`, skipping `g < 0`, `d < 0` and `d >= hot rows`, zero-filling `d` where
`g >= host rows`. `gather_plan` does the same for every entry with `miss_mask != 0` (none of a
padding row: `request_state_indices[r] < 0`) and writes `attention_indices` as above (-1 for
padding rows and negative destinations). `invalidate_written_slots` clears, for every token `j`
whose request `req_id_per_token[j]` and state row are in range and whose `written_slots[j] >= 0`,
every slot of that state row holding `written_slots[j]` (all duplicates); the LRU is not touched.

Shapes, dtypes and devices are checked before anything runs (`check_*` below, which every backend
calls first): one `InvalidInputError` naming the argument and what was expected. Values are never
read on the host (the decode path and CUDA-graph capture), so out-of-range values degrade as above.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from hisparse_core.errors import InvalidInputError

RESOLVE = "hisparse_resolve_residency"
GATHER_COMPACT = "hisparse_gather_compact"
GATHER_PLAN = "hisparse_gather_plan"
INVALIDATE = "hisparse_invalidate_written_slots"
OP_NAMES = (RESOLVE, GATHER_COMPACT, GATHER_PLAN, INVALIDATE)
NAMESPACE = "_C_cache_ops"

#: Schemas of the four ops, argument for argument as vLLM 0.32.0's runtime passes them (all
#: positionally, so no defaults). Arguments marked `(x!)` are written.
SCHEMAS: dict[str, str] = {
    RESOLVE: (
        "hisparse_resolve_residency(Tensor host_cache, Tensor hot_cache, Tensor hot_block_table, Tensor topk, "
        "Tensor(a!) hot_out, Tensor(b!) device_global_indices, Tensor(c!) lru_slots, Tensor? request_state_indices, "
        "int region_stride, int max_union_rows, Tensor(d!)? miss_mask, Tensor(e!)? stats, "
        "Tensor(f!)? attention_indices, int attention_block_stride, Tensor? request_ids, Tensor? source_block_table, "
        "int source_block_size, Tensor(g!)? resolved, Tensor(h!)? valid_counts, Tensor(i!)? swap_host, "
        "Tensor(j!)? swap_dev, Tensor(k!)? swap_counts, Tensor? resident_block_table, int resident_block_size, "
        "int resident_null_block) -> ()"),
    GATHER_COMPACT: (
        "hisparse_gather_compact(Tensor host_cache, Tensor(a!) hot_cache, Tensor miss_global, Tensor miss_hot, "
        "Tensor miss_counts) -> ()"),
    GATHER_PLAN: (
        "hisparse_gather_plan(Tensor host_cache, Tensor(a!) hot_cache, Tensor global_indices, Tensor hot_indices, "
        "Tensor miss_mask, Tensor? request_state_indices, Tensor(b!)? attention_indices, "
        "int attention_block_stride) -> ()"),
    INVALIDATE: (
        "hisparse_invalidate_written_slots(Tensor(a!) device_global_indices, Tensor request_state_indices, "
        "Tensor req_id_per_token, Tensor written_slots) -> ()"),
}


def last_write_wins(dst: torch.Tensor, take: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each entry of a fixed-shape row copy writes, and whose bytes, so that one scatter of all
    entries is deterministic: of the taken entries (`take`) with the same destination `dst`, the
    last one wins, and every such entry writes the winner's bytes; an entry not taken rewrites the
    first taken entry's destination with that destination's winner. Returns (destination, index of
    the entry whose bytes it writes, whether any entry is taken: 0-dim). Shapes are fixed and
    nothing is read on the host, so it runs inside a CUDA graph capture. `dst` is int64 [n], n > 0.
    """
    n = dst.numel()
    key = torch.where(take, dst, torch.full_like(dst, -1))
    sorted_key, order = torch.sort(key, stable=True)  # equal destinations keep entry order
    last = torch.ones_like(take)
    last[:-1] = sorted_key[:-1] != sorted_key[1:]
    at = torch.arange(n, device=dst.device)
    end = torch.flip(torch.cummin(torch.flip(torch.where(last, at, n), [0]), 0).values, [0])
    pick = torch.empty_like(order)
    pick[order] = order.index_select(0, end)
    first = torch.argmax(take.to(torch.int32)).view(1)  # one element: a 0-dim index reads on the host
    return (torch.where(take, dst, dst.index_select(0, first)), torch.where(take, pick, pick.index_select(0, first)),
            take.any())


def arg_names(op: str) -> tuple[str, ...]:
    """The argument names of `SCHEMAS[op]`, in order."""
    inner = SCHEMAS[op].split("(", 1)[1].rsplit(")", 2)[0]
    return tuple(part.strip().split()[-1] for part in inner.split(","))


@dataclass(frozen=True, slots=True)
class ResolveCall:
    """One `hisparse_resolve_residency` call, its arguments in vLLM's order (`SCHEMAS[RESOLVE]`).
    Built by `checked`, so a backend's `VllmHiSparseOps.resolve` receives arguments that passed
    `check_resolve` once."""

    host_cache: torch.Tensor
    hot_cache: torch.Tensor
    hot_block_table: torch.Tensor
    topk: torch.Tensor
    hot_out: torch.Tensor
    device_global_indices: torch.Tensor
    lru_slots: torch.Tensor
    request_state_indices: torch.Tensor | None
    region_stride: int
    max_union_rows: int
    miss_mask: torch.Tensor | None
    stats: torch.Tensor | None
    attention_indices: torch.Tensor | None
    attention_block_stride: int
    request_ids: torch.Tensor | None
    source_block_table: torch.Tensor | None
    source_block_size: int
    resolved: torch.Tensor | None
    valid_counts: torch.Tensor | None
    swap_host: torch.Tensor | None
    swap_dev: torch.Tensor | None
    swap_counts: torch.Tensor | None
    resident_block_table: torch.Tensor | None
    resident_block_size: int
    resident_null_block: int

    @classmethod
    def checked(cls, *args: Any) -> ResolveCall:
        """The call of `args` (vLLM's 25 arguments, in order) after `check_resolve` accepted them."""
        if len(args) != len(cls.__slots__):
            raise _fail(RESOLVE, f"{len(args)} arguments; expected {len(cls.__slots__)} ({', '.join(cls.__slots__)})")
        check_resolve(*args)
        return cls(*args)


class VllmHiSparseOps(ABC):
    """What a backend implements to serve vLLM's four HiSparse ops (module docstring: semantics).

    Called by the `torch.library` kernels that `hisparse_vllm.ops` registers, from vLLM's
    `HiSparseRuntime` on its copy stream (the current stream when the call runs): the leader layer
    calls `hisparse_resolve_residency` then `hisparse_gather_compact` for itself and each follower,
    prefill staging calls `hisparse_gather_plan`, the connector worker calls
    `hisparse_invalidate_written_slots` after each step's writes. Every tensor belongs to vLLM; the
    op only reads or writes it in place and keeps no reference past the call (a backend may cache
    per-pointer derived state, e.g. pointer tables, keyed by `data_ptr()`). `device` is where
    `hot_cache` and the index tensors live; `host_cache` is host memory the device can read
    (pinned or registered). `resolve_residency` validates its arguments here, once, and hands the
    backend a `ResolveCall` (`resolve`); the other methods run the `check_*` of their op first. Work
    is enqueued on the current stream without a host synchronization (CUDA-graph capturable on accelerators).
    """

    @property
    @abstractmethod
    def device_type(self) -> str:
        """Device type the op set serves (`cpu`, `cuda`, ...)."""

    def resolve_residency(self, host_cache: torch.Tensor, hot_cache: torch.Tensor, hot_block_table: torch.Tensor,
                          topk: torch.Tensor, hot_out: torch.Tensor, device_global_indices: torch.Tensor,
                          lru_slots: torch.Tensor, request_state_indices: torch.Tensor | None, region_stride: int,
                          max_union_rows: int, miss_mask: torch.Tensor | None, stats: torch.Tensor | None,
                          attention_indices: torch.Tensor | None, attention_block_stride: int,
                          request_ids: torch.Tensor | None, source_block_table: torch.Tensor | None,
                          source_block_size: int, resolved: torch.Tensor | None, valid_counts: torch.Tensor | None,
                          swap_host: torch.Tensor | None, swap_dev: torch.Tensor | None,
                          swap_counts: torch.Tensor | None, resident_block_table: torch.Tensor | None,
                          resident_block_size: int, resident_null_block: int) -> None:
        """`hisparse_resolve_residency`: its arguments are validated once (`ResolveCall.checked`), then
        `resolve` serves the call."""
        self.resolve(ResolveCall.checked(host_cache, hot_cache, hot_block_table, topk, hot_out, device_global_indices,
                                         lru_slots, request_state_indices, region_stride, max_union_rows, miss_mask,
                                         stats, attention_indices, attention_block_stride, request_ids,
                                         source_block_table, source_block_size, resolved, valid_counts, swap_host,
                                         swap_dev, swap_counts, resident_block_table, resident_block_size,
                                         resident_null_block))

    @abstractmethod
    def resolve(self, call: ResolveCall) -> None:
        """Serves one `hisparse_resolve_residency` call: what a backend implements (since the
        thirteenth session, in place of overriding `resolve_residency`, which is no longer abstract).

        Called by `resolve_residency` (so by vLLM's runtime through the registered op, or by a test)
        after `ResolveCall.checked` accepted every argument: dtypes, devices, shapes and the ranges the
        semantics need are guaranteed, so an implementation re-checks nothing and raises only for
        limits of its own (one line naming the argument, before enqueuing any work). The tensors in
        `call` belong to the caller; the implementation writes the outputs the call names (`hot_out`,
        `device_global_indices`, `lru_slots`, and whichever of `miss_mask`, `stats`,
        `attention_indices`, `resolved`, `valid_counts`, `swap_*` are not None) in place, on the
        current stream, without a host synchronization. Semantics: the module docstring and
        reference_cpu (`hisparse_reference_cpu.vllm_ops`), which the conformance suite's
        `test_vllm_ops.py` compares byte for byte."""

    @abstractmethod
    def gather_compact(self, host_cache: torch.Tensor, hot_cache: torch.Tensor, miss_global: torch.Tensor,
                       miss_hot: torch.Tensor, miss_counts: torch.Tensor) -> None:
        """`hisparse_gather_compact`."""

    @abstractmethod
    def gather_plan(self, host_cache: torch.Tensor, hot_cache: torch.Tensor, global_indices: torch.Tensor,
                    hot_indices: torch.Tensor, miss_mask: torch.Tensor, request_state_indices: torch.Tensor | None,
                    attention_indices: torch.Tensor | None, attention_block_stride: int) -> None:
        """`hisparse_gather_plan`."""

    @abstractmethod
    def invalidate_written_slots(self, device_global_indices: torch.Tensor, request_state_indices: torch.Tensor,
                                 req_id_per_token: torch.Tensor, written_slots: torch.Tensor) -> None:
        """`hisparse_invalidate_written_slots`."""


# ------------------------------------------------------------------------------------- checks

_CPU = torch.device("cpu")


def _fail(op: str, msg: str) -> InvalidInputError:
    return InvalidInputError(f"{op}: {msg}")


def _tensor(op: str, name: str, t: object, *, dims: int, dtypes: tuple[torch.dtype, ...], device: torch.device,
            contiguous: bool = True) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise _fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise _fail(op, f"{name} has dtype {t.dtype}; expected {' or '.join(str(d) for d in dtypes)}")
    if t.device != device and not (device.type == t.device.type and device.index is None):
        raise _fail(op, f"{name} is on {t.device}; expected {device}")
    if t.dim() != dims:
        raise _fail(op, f"{name} has shape {list(t.shape)}; expected a {dims}-D tensor")
    if contiguous and not t.is_contiguous():
        raise _fail(op, f"{name} with shape {list(t.shape)} and strides {t.stride()} must be contiguous")
    return t


def _rows_major(op: str, name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise _fail(op, f"{name} with strides {t.stride()} must be row-major (last stride 1)")


def _shape(op: str, name: str, t: torch.Tensor, want: tuple[int, ...]) -> None:
    if tuple(t.shape) != want:
        raise _fail(op, f"{name} has shape {list(t.shape)}; expected {list(want)}")


def _at_least(op: str, name: str, t: torch.Tensor, n: int, what: str) -> None:
    if t.numel() < n:
        raise _fail(op, f"{name} has {t.numel()} entries; expected at least {n} ({what})")


def _int(op: str, name: str, v: object, lo: int, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _fail(op, f"{name} must be an int, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        raise _fail(op, f"{name}={v} is out of range; expected [{lo}, {'inf' if hi is None else hi}]")
    return v


def check_caches(op: str, host_cache: object, hot_cache: object) -> tuple[torch.Tensor, torch.Tensor]:
    """`host_cache` `[host_rows, W]` contiguous on the CPU; `hot_cache` `[blocks, bs, W]` of the same
    dtype with contiguous rows of 16-byte multiples inside each block (blocks may be strided)."""
    hot = hot_cache
    if not isinstance(hot, torch.Tensor):
        raise _fail(op, f"hot_cache must be a torch.Tensor, got {type(hot).__name__}")
    if hot.dim() != 3:
        raise _fail(op, f"hot_cache has shape {list(hot.shape)}; expected [num_blocks, block_size, row_width]")
    host = _tensor(op, "host_cache", host_cache, dims=2, dtypes=(hot.dtype,), device=_CPU)
    if host.shape[1] != hot.shape[2]:
        raise _fail(op, f"host_cache rows are {host.shape[1]} wide; expected hot_cache's row width {hot.shape[2]}")
    row_bytes = hot.shape[2] * hot.element_size()
    if row_bytes % 16:
        raise _fail(op, f"hot_cache rows are {row_bytes} bytes; expected a multiple of 16")
    if hot.shape[2] > 1 and hot.stride(2) != 1 or hot.shape[1] > 1 and hot.stride(1) != hot.shape[2]:
        raise _fail(op, f"hot_cache with strides {hot.stride()} must have contiguous rows within each block")
    if hot.shape[1] < 1:
        raise _fail(op, "hot_cache has block_size 0; expected at least 1")
    return host, hot


def check_resolve(host_cache: object, hot_cache: object, hot_block_table: object, topk: object, hot_out: object,
                  device_global_indices: object, lru_slots: object, request_state_indices: object,
                  region_stride: object, max_union_rows: object, miss_mask: object, stats: object,
                  attention_indices: object, attention_block_stride: object, request_ids: object,
                  source_block_table: object, source_block_size: object, resolved: object, valid_counts: object,
                  swap_host: object, swap_dev: object, swap_counts: object, resident_block_table: object,
                  resident_block_size: object, resident_null_block: object) -> None:
    """Every shape, dtype and device rule of `hisparse_resolve_residency` (reads no value)."""
    op = RESOLVE
    _, hot = check_caches(op, host_cache, hot_cache)
    dev, i32 = hot.device, (torch.int32,)
    bs = hot.shape[1]
    tk = _tensor(op, "topk", topk, dims=2, dtypes=i32, device=dev)
    n, k = tk.shape
    if k < 1:
        raise _fail(op, "topk has 0 columns; expected top_k >= 1")
    out = _tensor(op, "hot_out", hot_out, dims=2, dtypes=i32, device=dev)
    _shape(op, "hot_out", out, (n, k))
    dgi = _tensor(op, "device_global_indices", device_global_indices, dims=2, dtypes=i32, device=dev)
    lru = _tensor(op, "lru_slots", lru_slots, dims=2, dtypes=(torch.int16,), device=dev)
    s, h = lru.shape
    _shape(op, "device_global_indices", dgi, (s, h))
    _int(op, "region_stride", region_stride, h, h)
    if not k <= h <= 32768:
        raise _fail(op, f"lru_slots has {h} slots per state row; expected top_k={k} <= slots <= 32768")
    _int(op, "max_union_rows", max_union_rows, k, h)
    hbt = _tensor(op, "hot_block_table", hot_block_table, dims=2, dtypes=i32, device=dev, contiguous=False)
    _rows_major(op, "hot_block_table", hbt)
    if hbt.shape[1] * bs < h:
        raise _fail(op, f"hot_block_table has {hbt.shape[1]} blocks per row; expected at least {-(-h // bs)} "
                        f"to hold {h} hot slots of block_size {bs}")
    num_req = n
    if request_state_indices is not None:
        rsi = _tensor(op, "request_state_indices", request_state_indices, dims=1, dtypes=i32, device=dev)
        num_req = rsi.numel()
    if hbt.shape[0] < num_req:
        raise _fail(op, f"hot_block_table has {hbt.shape[0]} rows; expected at least {num_req} (one per request)")
    if (request_ids is None) != (source_block_table is None):
        raise _fail(op, "request_ids and source_block_table must be given together")
    if request_ids is not None:
        rid = _tensor(op, "request_ids", request_ids, dims=1, dtypes=i32, device=dev)
        _at_least(op, "request_ids", rid, n, "one per row of topk")
        sbt = _tensor(op, "source_block_table", source_block_table, dims=2, dtypes=i32, device=dev,
                      contiguous=False)
        _rows_major(op, "source_block_table", sbt)
        _int(op, "source_block_size", source_block_size, 1)
    for name, t in (("miss_mask", miss_mask), ("resolved", resolved)):
        if t is not None:
            _shape(op, name, _tensor(op, name, t, dims=2, dtypes=i32, device=dev), (n, k))
    if stats is not None:
        st = _tensor(op, "stats", stats, dims=1, dtypes=(torch.uint64, torch.int64), device=dev)
        _at_least(op, "stats", st, 2, "hits and misses")
    _int(op, "attention_block_stride", attention_block_stride, 0)
    if attention_indices is not None:
        att = _tensor(op, "attention_indices", attention_indices, dims=2, dtypes=i32, device=dev)
        if att.shape[0] < n or att.shape[1] != k:
            raise _fail(op, f"attention_indices has shape {list(att.shape)}; expected [>= {n}, {k}]")
        _int(op, "attention_block_stride", attention_block_stride, bs)
    if valid_counts is not None:
        _at_least(op, "valid_counts", _tensor(op, "valid_counts", valid_counts, dims=1, dtypes=i32, device=dev),
                  n, "one per row of topk")
    trio = (swap_host, swap_dev, swap_counts)
    if any(t is None for t in trio) and any(t is not None for t in trio):
        raise _fail(op, "swap_host, swap_dev and swap_counts must be given together")
    if swap_host is not None:
        for name, t in (("swap_host", swap_host), ("swap_dev", swap_dev)):
            _shape(op, name, _tensor(op, name, t, dims=2, dtypes=i32, device=dev), (n, k))
        _at_least(op, "swap_counts", _tensor(op, "swap_counts", swap_counts, dims=1, dtypes=i32, device=dev), n,
                  "one per row of topk")
    if resident_block_table is not None:
        if source_block_table is None:
            raise _fail(op, "resident_block_table needs request_ids and source_block_table")
        rbt = _tensor(op, "resident_block_table", resident_block_table, dims=2, dtypes=i32, device=dev,
                      contiguous=False)
        _rows_major(op, "resident_block_table", rbt)
        _int(op, "resident_block_size", resident_block_size, bs, bs)
        _int(op, "resident_null_block", resident_null_block, 0)


def check_gather_compact(host_cache: object, hot_cache: object, miss_global: object, miss_hot: object,
                         miss_counts: object) -> None:
    op = GATHER_COMPACT
    _, hot = check_caches(op, host_cache, hot_cache)
    dev = hot.device
    mg = _tensor(op, "miss_global", miss_global, dims=2, dtypes=(torch.int32,), device=dev)
    _shape(op, "miss_hot", _tensor(op, "miss_hot", miss_hot, dims=2, dtypes=(torch.int32,), device=dev),
           tuple(mg.shape))
    _at_least(op, "miss_counts", _tensor(op, "miss_counts", miss_counts, dims=1, dtypes=(torch.int32,), device=dev),
              mg.shape[0], "one per row of miss_global")


def check_gather_plan(host_cache: object, hot_cache: object, global_indices: object, hot_indices: object,
                      miss_mask: object, request_state_indices: object, attention_indices: object,
                      attention_block_stride: object) -> None:
    op = GATHER_PLAN
    _, hot = check_caches(op, host_cache, hot_cache)
    dev = hot.device
    gi = _tensor(op, "global_indices", global_indices, dims=2, dtypes=(torch.int32,), device=dev)
    for name, t in (("hot_indices", hot_indices), ("miss_mask", miss_mask)):
        _shape(op, name, _tensor(op, name, t, dims=2, dtypes=(torch.int32,), device=dev), tuple(gi.shape))
    if request_state_indices is not None:
        _at_least(op, "request_state_indices", _tensor(op, "request_state_indices", request_state_indices, dims=1,
                                                       dtypes=(torch.int32,), device=dev),
                  gi.shape[0], "one per row of global_indices")
    _int(op, "attention_block_stride", attention_block_stride, 0)
    if attention_indices is not None:
        _shape(op, "attention_indices", _tensor(op, "attention_indices", attention_indices, dims=2,
                                                dtypes=(torch.int32,), device=dev), tuple(gi.shape))
        _int(op, "attention_block_stride", attention_block_stride, hot.shape[1])


def check_invalidate(device_global_indices: object, request_state_indices: object, req_id_per_token: object,
                     written_slots: object) -> None:
    op = INVALIDATE
    if not isinstance(device_global_indices, torch.Tensor):
        raise _fail(op, f"device_global_indices must be a torch.Tensor, got {type(device_global_indices).__name__}")
    dev = device_global_indices.device
    _tensor(op, "device_global_indices", device_global_indices, dims=2, dtypes=(torch.int32,), device=dev)
    _tensor(op, "request_state_indices", request_state_indices, dims=1, dtypes=(torch.int32,), device=dev)
    rq = _tensor(op, "req_id_per_token", req_id_per_token, dims=1, dtypes=(torch.int32,), device=dev)
    ws = _tensor(op, "written_slots", written_slots, dims=1, dtypes=(torch.int64,), device=dev)
    if rq.numel() != ws.numel():
        raise _fail(op, f"req_id_per_token has {rq.numel()} entries and written_slots {ws.numel()}; expected equal")
