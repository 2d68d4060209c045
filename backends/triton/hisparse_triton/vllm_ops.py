"""vLLM's HiSparse op set on the triton backend (semantics: hisparse_core/vllm_ops.py), for any
device Triton compiles for, or Triton's interpreter on the CPU.

- `hisparse_resolve_residency` launches the triton resolver (`kernels.resolve_kernel`) on vLLM's
  own state: `device_global_indices` (int32) is the hot map and `lru_slots` (int16) the LRU order,
  read and written in place. The tables vLLM indexes by batch request (source, hot) are scattered
  into rows per state row, resident blocks equal to the null block become -1, and host rows at or
  past the host cache are null (`host_limit`). The kernel keeps vLLM's rules for a corrupt LRU (a
  slot outside the buffer holds nothing and, as a victim, degrades its miss to -1) and writes the
  miss mask where one is given. Outputs are then mapped into vLLM's buffers (attention rows through
  `attention_block_stride`; plan entries past a row's count are left as they were).
- `hisparse_gather_compact` / `hisparse_gather_plan`: `hisparse_core.vllm_ops.last_write_wins`
  decides, for destinations named twice, whose bytes every write carries; `kernels.vllm_copy_kernel`
  then moves the rows (zero-filling a source past the host cache).
- `hisparse_invalidate_written_slots`: `kernels.vllm_invalidate_kernel`, one program per token.

Every step is a fixed-shape device op or a Triton kernel: no host synchronization, capturable in a
CUDA graph. On a GPU `host_cache` must be host memory the device can address (pinned or
registered); the kernels read it in place.
"""

from __future__ import annotations

from typing import Any

import torch

from hisparse_core import vllm_ops as spec
from hisparse_core.geometry import ROW_FORMATS, RowFormat, RuntimeConfig, register_row_format
from hisparse_core.runtime import ResolveInputs


def _words(t: torch.Tensor) -> torch.Tensor:
    """A view of `t`'s rows (last dimension) as int32 words where the row bytes and strides allow,
    else as bytes."""
    b = t.view(torch.uint8)
    if b.shape[-1] % 4 == 0 and b.data_ptr() % 4 == 0 and all(s % 4 == 0 for s in b.stride()[:-1]):
        return b.view(torch.int32)
    return b


class TritonVllmOps(spec.VllmHiSparseOps):
    """The four ops on the triton backend's device; `backend` builds the resolver's runtimes."""

    def __init__(self, backend: Any) -> None:  # noqa: ANN401 - TritonBackend (imported lazily)
        self._backend = backend
        # Per geometry: the resolver's runtime, and its per-state tables (source, resident, hot) and
        # context lengths, refilled every call.
        self._runtimes: dict[tuple[int, ...], tuple[Any, tuple[torch.Tensor, ...]]] = {}

    @property
    def device_type(self) -> str:
        return str(self._backend.device.type)

    # ----------------------------------------------------------------------------- helpers

    def _runtime(self, hot: torch.Tensor, n: int, k: int, s: int, h: int, pages: int,
                 union: int) -> tuple[Any, tuple[torch.Tensor, ...]]:
        from hisparse_triton.runtime import TritonRuntime

        bs = hot.shape[1]
        rows = max(1, union // k)
        key = (n, k, s, h, pages, bs, rows)
        got = self._runtimes.get(key)
        if got is None:
            fmt = next((f for f in ROW_FORMATS.values() if f.dtype == hot.dtype and f.width == hot.shape[2]), None)
            if fmt is None:  # vLLM's ops move rows as bytes: any row width is served
                fmt = register_row_format(RowFormat(f"vllm_{str(hot.dtype).removeprefix('torch.')}_{hot.shape[2]}",
                                                    hot.dtype, hot.shape[2]))
            # vLLM's region stride need not be a multiple of the block size: the runtime is sized to the
            # next multiple (the same hot blocks) and every launch walks the h slots vLLM's state has.
            cfg = RuntimeConfig(max_batch_rows=n, max_requests=s, top_k=k, hot_rows=-(-h // bs) * bs, block_size=bs,
                                max_pages=pages, row_format=fmt, num_layers=1, rows_per_request=rows)
            rt = TritonRuntime(cfg, self._backend.device)
            i32: dict[str, Any] = dict(dtype=torch.int32, device=hot.device)
            hb = -(-h // bs)
            tables = (torch.full((s + 1, pages), -1, **i32), torch.full((s, pages), -1, **i32),
                      torch.zeros((s + 1, hb), **i32), torch.full((n,), pages * bs, **i32))
            got = self._runtimes[key] = (rt, tables)
        return got

    def _copy(self, host: torch.Tensor, hot: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
              take: torch.Tensor) -> None:
        """Host rows `src` into hot rows `dst` where `take`, last write wins; a source past the host
        cache zero-fills."""
        from hisparse_triton import kernels, shapes

        src, dst, take = src.reshape(-1).long().contiguous(), dst.reshape(-1).long(), take.reshape(-1)
        n = dst.numel()
        if n == 0:
            return
        eff_dst, pick, any_take = spec.last_write_wins(dst, take)
        host_w, hot_w = _words(host), _words(hot)
        if host_w.dtype != hot_w.dtype:
            host_w, hot_w = host.view(torch.uint8), hot.view(torch.uint8)
        w = hot_w.shape[2]
        cpu = hot.device.type == "cpu"
        eb = min(n, shapes.INTERPRETED_COPY_ENTRIES) if cpu else shapes.COPY_ENTRIES
        eb = shapes.pow2(eb)
        meta: dict[str, int] = {} if cpu else dict(num_warps=max(1, shapes.COPY_THREADS // _warp(hot.device)))
        kernels.launch(kernels.vllm_copy_kernel, "vllm_copy_kernel", (-(-n // eb),), src, pick.contiguous(),
                       eff_dst.contiguous(), any_take.to(torch.int32).reshape(1), host_w, hot_w, n, host.shape[0], w,
                       hot.shape[1], hot_w.stride(0), WP=shapes.pow2(w), EB=eb, **meta)

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
        resident_block_table, resident_null_block = call.resident_block_table, call.resident_null_block
        bs = hot_cache.shape[1]
        # check_resolve (which the op layer calls first) gives request_ids and source_block_table together.
        tables = source_block_table is not None and request_ids is not None
        if tables and source_block_size != bs:
            raise spec._fail(spec.RESOLVE, f"the triton backend serves a source table of the hot block size {bs} "
                                           f"(vLLM 0.32 passes it so); got source_block_size={source_block_size}")
        n, k = topk.shape
        s, h = lru_slots.shape
        dev = hot_cache.device
        host_rows = host_cache.shape[0]
        t = topk.long()
        # Without tables (vLLM's kernel tests call so) row r is request r and an entry's host row is its
        # top-k value: the resolver gets an identity source table over the host cache's blocks, so its
        # positions, hints and host rows are the host rows themselves.
        req = request_ids[:n].long() if request_ids is not None else torch.arange(n, device=dev)
        if request_state_indices is not None:
            nr = request_state_indices.numel()
            ok = (req >= 0) & (req < nr)
            state = (torch.where(ok, request_state_indices.long()[req.clamp(0, nr - 1)], -1) if nr
                     else torch.full_like(req, -1))
        else:
            state = req
        state = torch.where((state >= 0) & (state < s), state, -1)
        slot = torch.where(state >= 0, state, s)  # padding rows scatter into a spare row

        # The host row of each entry (`resolved`); the kernel finds the same through the per-state
        # source table below and nulls rows at or past the host cache (host_limit).
        if tables:
            assert source_block_table is not None
            rs, sp = source_block_table.shape
            req_ok = (req >= 0) & (req < rs)
            col = torch.where(t >= 0, t // bs, -1)
            blk = (source_block_table.long()[req.clamp(0, max(rs - 1, 0))[:, None], col.clamp(0, max(sp - 1, 0))]
                   if rs and sp else torch.full_like(t, -1))
            g = torch.where(req_ok[:, None] & (col >= 0) & (col < sp) & (blk >= 0), blk * bs + t % bs, -1)
            g = torch.where(g >= host_rows, -1, g)
        else:
            sp = -(-host_rows // bs)
            g = torch.where((t >= 0) & (t < host_rows), t, -1)

        res_pages = resident_block_table.shape[1] if resident_block_table is not None else 0
        pages = max(sp, res_pages, 1)
        rt, (src_h, res_h, hot_h, lens) = self._runtime(hot_cache, n, k, s, h, pages, max_union_rows)
        if not tables:
            src_h.copy_(torch.arange(pages, dtype=torch.int32, device=dev).expand_as(src_h))
        else:
            src_h.fill_(-1)
            if rs and sp:
                assert source_block_table is not None
                src_rows = torch.where(req_ok[:, None], source_block_table.long()[req.clamp(0, rs - 1)], -1)
                src_h[:, :sp].index_copy_(0, slot, src_rows.to(torch.int32))
        res_h.fill_(-1)
        if resident_block_table is not None:
            rbt = resident_block_table[:s]
            res_h[:rbt.shape[0], :rbt.shape[1]] = torch.where((rbt != resident_null_block) & (rbt >= 0), rbt, -1)
        hb = hot_h.shape[1]
        hot_h.index_copy_(0, slot, hot_block_table[req.clamp(0, hot_block_table.shape[0] - 1), :hb].to(torch.int32))

        inputs = ResolveInputs(topk=topk, row_state=state.to(torch.int32), seq_lens=lens,
                               source_table=src_h[:s], resident_table=res_h, hot_table=hot_h[:s])
        rt._stats.zero_()
        out = rt.launch_resolve(inputs, n, hot_map=device_global_indices, lru=lru_slots, stats=rt._stats,
                                miss_mask=miss_mask, host_limit=host_rows, hot_rows=h)
        rows = out.rows[:n]
        hot_out.copy_(rows)
        if attention_indices is not None:
            attention_indices[:n] = torch.where(rows < 0, -1, (rows // bs) * attention_block_stride + rows % bs)
        if valid_counts is not None:
            valid_counts[:n] = out.valid_counts[:n]
        if swap_counts is not None:
            assert swap_host is not None and swap_dev is not None
            cnt = out.plan_counts[:n]
            keep = torch.arange(k, device=dev)[None, :] >= cnt[:, None]
            swap_host.copy_(torch.where(keep, swap_host, out.plan_host[:n]))
            swap_dev.copy_(torch.where(keep, swap_dev, out.plan_device[:n]))
            swap_counts[:n] = cnt
        if resolved is not None:
            resolved.copy_(torch.where(state[:, None] >= 0, g, -1).to(torch.int32))
        if stats is not None:
            stats.view(torch.int64)[:2] += rt._stats[1:3]

    def gather_compact(self, host_cache: torch.Tensor, hot_cache: torch.Tensor, miss_global: torch.Tensor,
                       miss_hot: torch.Tensor, miss_counts: torch.Tensor) -> None:
        spec.check_gather_compact(host_cache, hot_cache, miss_global, miss_hot, miss_counts)
        n, k = miss_global.shape
        hot_rows = hot_cache.shape[0] * hot_cache.shape[1]
        count = miss_counts[:n].long().clamp(0, k)
        take = torch.arange(k, device=hot_cache.device)[None, :] < count[:, None]
        take &= (miss_global >= 0) & (miss_hot >= 0) & (miss_hot < hot_rows)
        self._copy(host_cache, hot_cache, miss_global, miss_hot, take)

    def gather_plan(self, host_cache: torch.Tensor, hot_cache: torch.Tensor, global_indices: torch.Tensor,
                    hot_indices: torch.Tensor, miss_mask: torch.Tensor, request_state_indices: torch.Tensor | None,
                    attention_indices: torch.Tensor | None, attention_block_stride: int) -> None:
        spec.check_gather_plan(host_cache, hot_cache, global_indices, hot_indices, miss_mask, request_state_indices,
                               attention_indices, attention_block_stride)
        n = global_indices.shape[0]
        bs = hot_cache.shape[1]
        hot_rows = hot_cache.shape[0] * bs
        pad = (request_state_indices[:n] < 0) if request_state_indices is not None \
            else torch.zeros(n, dtype=torch.bool, device=hot_cache.device)
        take = ~pad[:, None] & (miss_mask != 0) & (global_indices >= 0) & (hot_indices >= 0) & (hot_indices < hot_rows)
        att = None
        if attention_indices is not None:
            d = hot_indices
            att = torch.where(pad[:, None] | (d < 0), -1, (d // bs) * attention_block_stride + d % bs)
        self._copy(host_cache, hot_cache, global_indices, hot_indices, take)
        if att is not None and attention_indices is not None:
            attention_indices.copy_(att)

    def invalidate_written_slots(self, device_global_indices: torch.Tensor, request_state_indices: torch.Tensor,
                                 req_id_per_token: torch.Tensor, written_slots: torch.Tensor) -> None:
        from hisparse_triton import kernels, shapes

        spec.check_invalidate(device_global_indices, request_state_indices, req_id_per_token, written_slots)
        s, h = device_global_indices.shape
        nr = request_state_indices.numel()
        tokens = written_slots.numel()
        if tokens == 0 or nr == 0 or s == 0:
            return
        dev = device_global_indices.device
        meta: dict[str, int] = {} if dev.type == "cpu" else \
            dict(num_warps=max(1, min(shapes.MAX_THREADS, shapes.pow2(h) // 4) // _warp(dev)))
        kernels.launch(kernels.vllm_invalidate_kernel, "vllm_invalidate_kernel", (tokens,), device_global_indices,
                       request_state_indices, req_id_per_token, written_slots, s, nr, h, HP=shapes.pow2(h), **meta)


def _warp(device: torch.device) -> int:
    from hisparse_triton.runtime import warp_size

    return warp_size(device)
