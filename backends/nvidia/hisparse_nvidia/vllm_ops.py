"""vLLM's HiSparse op set on a CUDA device (semantics: hisparse_core/vllm_ops.py), not yet run on a GPU.

`hisparse_resolve_residency` runs hisparse's fused resolver (`NvidiaRuntime`, resolve.cu) through a
layout adapter: vLLM's hot map and LRU (`device_global_indices` int32 `[S, H]`, `lru_slots` int16
`[S, H]`) have the runtime's own layout, so the kernel works on vLLM's tensors directly (the
runtime's state tensors are pointed at them for the launch); the tables vLLM indexes by batch
request (source, hot) are scattered into per-state-row tables, resident blocks equal to the null
block become -1, source blocks past the host pool become -1, and the outputs are copied into
vLLM's buffers (attention rows mapped through `attention_block_stride`). Every step is a
fixed-shape device op: no host synchronization, capturable in a CUDA graph.

Where the fused kernel's contract is narrower than vLLM's, the adapter keeps vLLM's answer safe
rather than exact, and says so:

- a state row whose LRU holds an out-of-range slot is published as padding for that call (vLLM
  resolves its other entries); nothing is read out of bounds;
- `miss_mask` as an output is not served (vLLM 0.32 passes None): asking for it raises;
- `source_block_size` must equal the hot block size (vLLM's layout guarantees it).

The copies (`gather_compact`, `gather_plan`) read the pinned host pool through its device address
(UVA) with PyTorch gathers, fixed shape; `invalidate_written_slots` is a scatter-min. They match
vLLM's semantics exactly (zero-fill, skips, every duplicate).
"""

from __future__ import annotations

from typing import Any

import torch

from hisparse_core import vllm_ops as spec
from hisparse_core.errors import InvalidInputError
from hisparse_core.geometry import ROW_FORMATS, RowFormat, RuntimeConfig, register_row_format

_I32_MAX = 2**31 - 1


class _UvaView:
    """`__cuda_array_interface__` of a registered host tensor at its device address."""

    def __init__(self, host: torch.Tensor, address: int) -> None:
        self.__cuda_array_interface__ = {"data": (address, False), "shape": (host.shape[0], host.shape[1]
                                                                             * host.element_size()),
                                         "typestr": "|u1", "version": 3, "strides": None}


class NvidiaVllmOps(spec.VllmHiSparseOps):
    """The four ops on CUDA tensors; `backend` builds the fused resolver's runtimes."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self._runtimes: dict[tuple[Any, ...], Any] = {}
        self._host_views: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def device_type(self) -> str:
        return "cuda"

    # ----------------------------------------------------------------------------- helpers

    def _host_view(self, host: torch.Tensor) -> torch.Tensor:
        """`host` as a CUDA uint8 `[rows, row_bytes]` tensor aliasing its memory (zero-copy reads)."""
        key = (host.data_ptr(), host.numel())
        view = self._host_views.get(key)
        if view is None:
            from hisparse_nvidia.host_pool import device_address_of_host

            addr = device_address_of_host(host.data_ptr(), host.numel() * host.element_size())
            if addr is None:
                raise InvalidInputError("host_cache is not registered host memory; vLLM pins its HiSparse pool with "
                                        "cudaHostRegister (or allocate it pinned)")
            view = torch.as_tensor(_UvaView(host, addr), device="cuda")
            self._host_views[key] = view
        return view

    def _copy(self, host: torch.Tensor, hot: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
              take: torch.Tensor) -> None:
        """Fixed-shape copy of host rows `src` into hot rows `dst` where `take`; `src` past the host rows
        zero-fills; of taken entries with one destination the last wins (`spec.last_write_wins`), as in
        the reference. Entries not taken rewrite a taken entry's row with its bytes (or row 0 with
        its current bytes), so every write to a row carries the same bytes."""
        src, dst, take = src.reshape(-1).long(), dst.reshape(-1).long(), take.reshape(-1)
        if dst.numel() == 0:
            return
        bs = hot.shape[1]
        host_b = self._host_view(host)
        hot_b = hot.view(torch.uint8)
        present = src < host_b.shape[0]
        data = host_b[src.clamp(0, host_b.shape[0] - 1)] * present[:, None].to(torch.uint8)
        eff_dst, pick, any_take = spec.last_write_wins(dst, take)
        eff_dst = torch.where(any_take, eff_dst, 0)
        eff_data = torch.where(any_take, data.index_select(0, pick), hot_b[0, 0].unsqueeze(0))
        hot_b[eff_dst // bs, eff_dst % bs] = eff_data

    def _runtime(self, host: torch.Tensor, hot: torch.Tensor, n: int, k: int, s: int, h: int, pages: int) -> Any:
        bs = hot.shape[1]
        key = (host.data_ptr(), hot.data_ptr(), n, k, s, h, pages, bs)
        rt = self._runtimes.get(key)
        if rt is None:
            fmt = next((f for f in ROW_FORMATS.values() if f.dtype == hot.dtype and f.width == hot.shape[2]), None)
            if fmt is None:  # vLLM's ops move rows as bytes: any row of whole 16-byte vectors is served
                row_bytes = hot.shape[2] * hot.element_size()
                if row_bytes % 16:
                    raise InvalidInputError(f"{spec.RESOLVE}: hot_cache rows are {hot.shape[2]} x {hot.dtype} = "
                                            f"{row_bytes} bytes; expected a multiple of 16 bytes")
                fmt = register_row_format(RowFormat(f"vllm_{str(hot.dtype).removeprefix('torch.')}_{hot.shape[2]}",
                                                    hot.dtype, hot.shape[2]))
            cfg = RuntimeConfig(max_batch_rows=n, max_requests=s, top_k=k, hot_rows=h, block_size=bs,
                                max_pages=pages, row_format=fmt, num_layers=1,
                                rows_per_request=max(1, h // k))
            rt = self._backend.create_runtime(cfg)
            rt.bind([host], [hot])
            rt._vllm_last = torch.zeros(2, dtype=torch.int64, device=hot.device)
            rt._vllm_tables = (torch.full((s + 1, pages), -1, dtype=torch.int32, device=hot.device),
                               torch.full((s, pages), -1, dtype=torch.int32, device=hot.device),
                               torch.zeros((s + 1, -(-h // bs)), dtype=torch.int32, device=hot.device))
            self._runtimes[key] = rt
        return rt

    # ----------------------------------------------------------------------------- the ops

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
        spec.check_resolve(host_cache, hot_cache, hot_block_table, topk, hot_out, device_global_indices, lru_slots,
                           request_state_indices, region_stride, max_union_rows, miss_mask, stats,
                           attention_indices, attention_block_stride, request_ids, source_block_table,
                           source_block_size, resolved, valid_counts, swap_host, swap_dev, swap_counts,
                           resident_block_table, resident_block_size, resident_null_block)
        bs = hot_cache.shape[1]
        if miss_mask is not None:
            raise InvalidInputError(f"{spec.RESOLVE}: miss_mask as an output is not served by the nvidia backend "
                                    "(vLLM 0.32 passes None); pass None")
        if source_block_table is None or request_ids is None:
            raise InvalidInputError(f"{spec.RESOLVE}: the nvidia backend needs request_ids and source_block_table "
                                    "(vLLM 0.32 passes both)")
        if source_block_size != bs:
            raise InvalidInputError(f"{spec.RESOLVE}: source_block_size={source_block_size}; the nvidia backend "
                                    f"expects the hot block size {bs}")
        n, k = topk.shape
        s, h = lru_slots.shape
        dev = hot_cache.device
        pages = max(source_block_table.shape[1],
                    resident_block_table.shape[1] if resident_block_table is not None else 0)
        rt = self._runtime(host_cache, hot_cache, n, k, s, h, pages)
        src_h, res_h, hot_h = rt._vllm_tables
        host_blocks = host_cache.shape[0] // bs

        req = request_ids[:n].long()
        if request_state_indices is not None:
            nr = request_state_indices.numel()
            ok = (req >= 0) & (req < nr)
            state = torch.where(ok, request_state_indices.long()[req.clamp(0, max(nr - 1, 0))], -1) if nr \
                else torch.full_like(req, -1)
        else:
            state = req
        corrupt = ((lru_slots < 0) | (lru_slots >= region_stride)).any(dim=1)
        state = torch.where((state >= 0) & (state < s), state, -1)
        state = torch.where((state >= 0) & ~corrupt[state.clamp(0)], state, -1)
        slot = torch.where(state >= 0, state, s)
        rs = source_block_table.shape[0]
        src_rows = source_block_table.long()[req.clamp(0, rs - 1)]
        src_rows = torch.where(((req >= 0) & (req < rs))[:, None], src_rows, -1)
        src_rows = torch.where((src_rows >= 0) & (src_rows < host_blocks), src_rows, -1)
        src_h.fill_(-1)
        src_h[:, :src_rows.shape[1]].index_copy_(0, slot, src_rows.to(torch.int32))
        res_h.fill_(-1)
        if resident_block_table is not None:
            rbt = resident_block_table[:s]
            res_h[:rbt.shape[0], :rbt.shape[1]] = torch.where((rbt != resident_null_block) & (rbt >= 0), rbt, -1)
        hot_rows_tbl = hot_block_table[req.clamp(0, hot_block_table.shape[0] - 1), :hot_h.shape[1]]
        hot_h.index_copy_(0, slot, hot_rows_tbl.to(torch.int32))
        from hisparse_core.runtime import ResolveInputs

        inputs = ResolveInputs(topk=topk, row_state=state.to(torch.int32),
                               seq_lens=torch.full((n,), pages * bs, dtype=torch.int32, device=dev),
                               source_table=src_h[:s], resident_table=res_h, hot_table=hot_h[:s])
        rt._hot_map, rt._lru = device_global_indices, lru_slots  # same layout: the kernel updates vLLM's state
        out = rt.resolve(inputs, gather=False, validate=False)
        rows = out.rows[:n]
        hot_out.copy_(rows)
        if attention_indices is not None:
            attention_indices[:n] = torch.where(rows < 0, -1, (rows // bs) * attention_block_stride + rows % bs)
        if valid_counts is not None:
            valid_counts[:n] = out.valid_counts[:n]
        if swap_counts is not None:
            assert swap_host is not None and swap_dev is not None
            swap_host.copy_(out.plan_host[:n])
            swap_dev.copy_(out.plan_device[:n])
            swap_counts[:n] = out.plan_counts[:n]
        if resolved is not None:
            t = topk.long()
            col = torch.where(t >= 0, t // bs, 0).clamp(max=pages - 1)
            blk = src_h[slot][torch.arange(n, device=dev)[:, None], col].long()
            g = torch.where((t >= 0) & (t < pages * bs) & (blk >= 0), blk * bs + t % bs, -1)
            resolved.copy_(torch.where(state[:, None] >= 0, g, -1).to(torch.int32))
        if stats is not None:
            now = rt._stats[1:3]
            stats.view(torch.int64)[:2] += now - rt._vllm_last
            rt._vllm_last.copy_(now)

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
        if attention_indices is not None:
            d = hot_indices
            attention_indices.copy_(torch.where(pad[:, None] | (d < 0), -1, (d // bs) * attention_block_stride + d % bs))
        self._copy(host_cache, hot_cache, global_indices, hot_indices, take)

    def invalidate_written_slots(self, device_global_indices: torch.Tensor, request_state_indices: torch.Tensor,
                                 req_id_per_token: torch.Tensor, written_slots: torch.Tensor) -> None:
        spec.check_invalidate(device_global_indices, request_state_indices, req_id_per_token, written_slots)
        s, h = device_global_indices.shape
        nr = request_state_indices.numel()
        if written_slots.numel() == 0 or nr == 0 or s == 0:
            return
        req = req_id_per_token.long()
        ok = (req >= 0) & (req < nr)
        state = torch.where(ok, request_state_indices.long()[req.clamp(0, nr - 1)], -1)
        ok &= (state >= 0) & (state < s) & (written_slots >= 0)
        q = state.clamp(0, s - 1)
        hit = (device_global_indices[q].long() == written_slots[:, None]) & ok[:, None]
        flat = (q[:, None] * h + torch.arange(h, device=q.device)[None, :]).reshape(-1)
        vals = torch.where(hit, -1, _I32_MAX).to(torch.int32).reshape(-1)
        device_global_indices.view(-1).scatter_reduce_(0, flat, vals, reduce="amin", include_self=True)
