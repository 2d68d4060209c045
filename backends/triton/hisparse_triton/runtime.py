"""`TritonRuntime`: the per-cache runtime whose resolver and copies are Triton kernels (`kernels.py`).

State and workspaces are torch tensors on the runtime's device (a GPU, or the CPU under Triton's
interpreter). The hot map and LRU order are int32 `[max_requests, hot_rows]`; the resolver's
scratch rows, one per batch row of the workspace, are allocated once with the state.

- `resolve` checks shapes, dtypes and devices on the host (metadata only), then launches the
  resolver over `max_batch_rows` programs and, with `gather=True`, the plan copy of layer 0 over
  the batch's rows. With `validate=False` nothing is read back and every launch has a fixed
  grid, so the call can be captured in a CUDA graph; values are then trusted, but every load and
  store of the kernels stays inside its tensor (out-of-range state rows, pages and plan rows are
  masked), so bad trusted input cannot corrupt memory.
- Which resolver build and plan-copy shape a call launches depends on its batch rows (a host
  integer, fixed for a captured step): the runtime keeps the launches of each profile of
  `auto.choose` (`launches.Launches`) and takes the one of the call's row count.
- The other copies (mirrors, spills, restores, host block copies) launch one row-copy kernel per
  layer on the current stream; invalidations and resets are a kernel or a few torch ops.

Where it departs from the contract: with `validate=False`, a state row that appears in two groups
of one call is resolved by two programs at once, so its result is undefined (the reference
resolves the groups one after the other); `validate=True` rejects such a batch, as it must.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
import triton

from hisparse_core import checks, copy_checks
from hisparse_core.checks import check_bind_arguments, check_int, check_ints, check_range
from hisparse_core.errors import InvalidInputError
from hisparse_core.geometry import RuntimeConfig
from hisparse_core.resolve_checks import check_resolve_shapes, check_resolve_values
from hisparse_core.runtime import CacheRuntime, ResolveInputs, ResolveResult, RuntimeStats
from hisparse_core.types import HostBlockCopy, PageTransfer, RowMirror
from hisparse_triton import auto, kernels, launches, shapes

logger = logging.getLogger(__name__)

_pow2 = shapes.pow2
_logged: set[str] = set()


def _log_once(line: str) -> None:
    """Log `line` the first time this process builds a runtime with it (a model builds one a layer group)."""
    if line not in _logged:
        _logged.add(line)
        logger.info("%s", line)


def target_name(device: torch.device) -> str:
    """`device` as `auto.check_target`'s refusals name it (the GPU's model: asks the device)."""
    if device.type == "cpu":
        return auto.INTERPRETER
    return torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)


def warp_size(device: torch.device) -> int:
    """Lanes of one warp (wavefront) of `device`: 32 on NVIDIA, 64 on AMD CDNA (1 in the interpreter)."""
    if device.type != "cuda":
        return 1
    return int(getattr(torch.cuda.get_device_properties(device), "warp_size", 32))


def check_tensor(name: str, t: object, shape: tuple[int | None, ...], dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """`t` must be a contiguous tensor of `dtype` on `device` with `shape` (None: any extent)."""
    tensor = checks.check_tensor(name, t, shape, dtype, device)
    if not tensor.is_contiguous():
        raise InvalidInputError(f"{name} is not contiguous; expected a contiguous tensor (the kernels index it flat)")
    return tensor


class TritonRuntime(CacheRuntime):
    """Hot maps, LRU orders, result workspace, scratch and counters of one index group."""

    def __init__(self, config: RuntimeConfig, device: torch.device) -> None:
        if not isinstance(config, RuntimeConfig):
            raise InvalidInputError(f"config must be a RuntimeConfig, got {type(config).__name__}")
        self.config = config
        self._device = device
        r, h, b, k = config.max_requests, config.hot_rows, config.max_batch_rows, config.top_k
        cpu = device.type == "cpu"
        env = dict(os.environ)
        tune = shapes.tuning(env)  # the explicit settings, checked before any auto pick
        pdl = device.type == "cuda" and not torch.version.hip and torch.cuda.get_device_capability(device)[0] >= 9
        # What TritonBackend.check_settings said without the device, now against it.
        auto.check_target(tune, pdl=pdl, found=lambda: target_name(device),
                          rocm_triton=triton.__version__ if device.type == "cuda" and torch.version.hip else None)
        lanes = warp_size(device)
        sms = None if cpu else int(torch.cuda.get_device_properties(device).multi_processor_count)
        choice = auto.choose(env, max_batch_rows=b, small=auto.small_rows(sms, b), pdl=pdl)
        _log_once(choice.line)
        self._launches = [launches.build(config, p, lanes=lanes, multiprocessors=sms) for p in choice.profiles]
        first = self._launches[0]
        shape = first.shape
        self._gather_resolver = shape.variant == "gather"
        self._fuse = tune.fuse  # never an auto pick: the same at every batch size
        kp, gp, hp, tp = shape.kp, shape.gp, shape.hp, shape.tp
        i32: dict[str, Any] = dict(dtype=torch.int32, device=device)
        self._hot_map = torch.full((r, h), -1, **i32)
        self._lru = torch.arange(h, **i32).repeat(r, 1)
        self._result = ResolveResult(
            rows=torch.full((b, k), -1, **i32), valid_counts=torch.zeros(b, **i32),
            plan_host=torch.full((b, k), -1, **i32), plan_device=torch.full((b, k), -1, **i32),
            plan_counts=torch.zeros(b, **i32))
        self._stats = torch.zeros(5, dtype=torch.int64, device=device)
        # Slot hints: the slot last filled for each position of each state row (any value is safe:
        # the kernel believes a hint only where the slot holds the entry's host row).
        hint_dtype = torch.int16 if shapes.hint_dtype_name(config) == "i16" else torch.int32
        self._pos_slot = torch.full((r, config.max_pages * config.block_size), -1, dtype=hint_dtype, device=device)
        # The resolver's per-program hash tables (keys, first references, slots) and slot marks
        # start empty and every call leaves them so; the victim list is overwritten before it is read.
        self._scratch = dict(
            tbl_key=torch.empty((b, tp), **i32), tbl_first=torch.empty((b, tp), **i32),
            tbl_slot=torch.empty((b, tp), **i32), scr_victim=torch.zeros((b, hp), **i32),
            scr_mark=torch.zeros((b, hp), **i32))
        # The split resolver's (`shapes.SPLIT_ENV`), sized for every profile that splits: per-program
        # counts, a ticket per batch row (0 between calls), the candidate lists (segments by program,
        # then by list index); all but the ticket are written before they are read.
        ns, pw, nh, entries = launches.scratch_shape(self._launches)
        self._split: dict[str, torch.Tensor] = {} if not ns else dict(
            scr_part=torch.zeros((b, ns, pw), **i32), scr_ticket=torch.zeros(b, **i32),
            **{name: torch.zeros((b, entries), **i32) for name in ("scr_crow", "scr_cee", "scr_cpos", "scr_cbkt",
                                                                   "scr_cat")})
        # The hot-row kernels' (`shapes.SPLIT_TAIL_ENV`): per-program evictable and hit counts, a copy of the
        # LRU order and hit flags for the LRU kernel; all written before they are read.
        # The miss mask the split resolver writes for the speculative copy (`shapes.SPEC_COPY_ENV`), where a
        # profile has one: every entry of a resolved row is written before the copy reads it.
        self._spec_mask = torch.zeros((b, k) if any(x.spec_meta for x in self._launches) else (1, 1), **i32)
        self._tail: dict[str, torch.Tensor] = {} if not nh else dict(
            scr_hcnt=torch.zeros((b, nh, 2), **i32), scr_ord=torch.zeros((b, hp), **i32),
            scr_hit=torch.zeros((b, hp), **i32))
        self._clear_tables()
        row_bytes = config.row_format.row_bytes
        self._word = torch.int32 if row_bytes % 4 == 0 else torch.uint8
        self._words = row_bytes // self._word.itemsize
        self._last_rows = 0
        self._copy_entries = shapes.INTERPRETED_COPY_ENTRIES if cpu else shapes.COPY_ENTRIES
        self._copy_meta: dict[str, int] = {} if cpu else dict(num_warps=max(1, shapes.COPY_THREADS // lanes))
        self._vec = 0  # words a lean plan copy moves an access (`shapes.LEAN_COPY_ENV`), from the device caches at bind
        self._bound: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self._host: list[torch.Tensor] = []  # per layer [host_rows, words]
        self._dev: list[torch.Tensor] = []  # per layer [num_device_blocks, block_size, words]
        self._host_rows = 0
        self._dev_rows = 0
        self._resident_group = 0
        # Once a process for the same line: a model (or `hisparse run --index-share 1`) builds one runtime a
        # layer group, each of which logged it again.
        _log_once(f"triton runtime on {device} ({'; '.join(f'{x.shape.kernel} up to {x.max_rows} rows' for x in self._launches)}): "
                  f"top_k={k} rows_per_request={config.rows_per_request} hot_rows={h} block_size={config.block_size}; a "
                  f"group's entries take {gp * kp} lanes, its hot rows {hp}, its hash table {tp} buckets, {shape.threads} "
                  f"threads (warp of {lanes}); rows move as {self._words} {str(self._word).removeprefix('torch.')} words")

    def _clear_tables(self) -> None:
        s = self._scratch
        s["tbl_key"].fill_(kernels.EMPTY.value)
        s["tbl_first"].fill_(kernels.NO_ENTRY.value)
        s["tbl_slot"].fill_(-1)
        s["scr_mark"].zero_()
        if self._split:
            self._split["scr_ticket"].zero_()
        # A launch that failed part way may have left outputs of mixed calls: the kernel rewrites only
        # what changed, so restore the invariant (padding everywhere) it relies on.
        out = self._result
        out.rows.fill_(-1)
        out.valid_counts.zero_()
        out.plan_host.fill_(-1)
        out.plan_device.fill_(-1)
        out.plan_counts.zero_()

    # ----------------------------------------------------------------- storage

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def bound(self) -> bool:
        return bool(self._host)

    @property
    def host_rows(self) -> int:
        self._require_bound()
        return self._host_rows

    @property
    def num_device_blocks(self) -> int:
        self._require_bound()
        return self._dev_rows // self.config.block_size

    @property
    def resident_group(self) -> int:
        return self._resident_group

    @property
    def host_layers(self) -> list[torch.Tensor]:
        """The host views given to `bind`."""
        self._require_bound()
        return list(self._bound[0])

    @property
    def device_layers(self) -> list[torch.Tensor]:
        """The device caches given to `bind`."""
        self._require_bound()
        return list(self._bound[1])

    def bind(self, host_layers: Sequence[torch.Tensor], device_layers: Sequence[torch.Tensor],
             *, resident_group: int = 0) -> None:
        """Attach the host pool's layer views and the device caches (see `CacheRuntime.bind`).

        Host views are CPU tensors with contiguous rows; on a GPU they must be pinned
        (`TritonBackend.create_host_pool`, or `pin_memory()`), since the kernels read them in
        place. Device caches are `[num_blocks, block_size, width]` with contiguous rows inside a
        block; blocks may be strided (a packed multi-layer slab) by a whole number of words.
        """
        cfg = self.config
        fmt, n = cfg.row_format, cfg.num_layers
        check_bind_arguments(host_layers, device_layers, n, resident_group, bound=self.bound)
        cpu = torch.device("cpu")
        host_words: list[torch.Tensor] = []
        dev_words: list[torch.Tensor] = []
        rows = blocks = None
        ws = self._word.itemsize
        for layer in range(n):
            h = check_tensor(f"host_layers[{layer}]", host_layers[layer], (rows, fmt.width), fmt.dtype, cpu)
            rows = h.shape[0]
            if rows == 0 or rows % cfg.block_size:
                raise InvalidInputError(f"host_layers[{layer}] has {rows} rows; expected a positive multiple of "
                                        f"block_size={cfg.block_size}")
            if self._device.type == "cuda" and not h.is_pinned():
                raise InvalidInputError(f"host_layers[{layer}] is not pinned host memory; allocate the pool with "
                                        f"TritonBackend.create_host_pool (or pin it) so the kernels can read it")
            d = device_layers[layer]
            checks.check_tensor(f"device_layers[{layer}]", d, (blocks, cfg.block_size, fmt.width), fmt.dtype,
                                self._device)
            blocks = d.shape[0]
            if blocks == 0:
                raise InvalidInputError(f"device_layers[{layer}] has 0 blocks; expected at least 1")
            es = d.element_size()
            if d.stride(2) != 1 or d.stride(1) != fmt.width or (d.stride(0) * es) % ws or d.data_ptr() % ws:
                raise InvalidInputError(f"device_layers[{layer}] has strides {d.stride()}; expected contiguous rows "
                                        f"within each block and blocks {ws}-byte aligned")
            host_words.append(h.view(torch.uint8).view(self._word))
            dev_words.append(d.view(torch.uint8).view(self._word))
        assert rows is not None and blocks is not None
        if rows >= 2**31 or blocks * cfg.block_size >= 2**31:
            raise InvalidInputError("host or device caches exceed the 2^31-row addressing limit")
        self._bound = (list(host_layers), list(device_layers))
        self._host = host_words
        self._dev = dev_words
        self._host_rows = rows
        self._dev_rows = blocks * cfg.block_size
        # The lean plan copy's whole vectors where rows and every layer's block stride are multiples of one.
        vec = shapes.COPY_VEC if self._word == torch.int32 else 1
        self._vec = vec if self._words % vec == 0 and all(d.stride(0) % vec == 0 for d in dev_words) else 1
        self._resident_group = resident_group

    def _require_bound(self) -> None:
        if not self._host:
            raise InvalidInputError("runtime is not bound; call bind(host_layers, device_layers) first")

    # ----------------------------------------------------------------- resolve

    def resolve(self, inputs: ResolveInputs, *, gather: bool = True, validate: bool = True) -> ResolveResult:
        self._require_bound()
        cfg = self.config
        b = check_resolve_shapes(inputs, cfg, self._device, tensor_check=check_tensor)
        if validate:
            host = ResolveInputs(*(t.cpu() for t in (inputs.topk, inputs.row_state, inputs.seq_lens,
                                                     inputs.source_table, inputs.resident_table, inputs.hot_table)))
            check_resolve_values(host, cfg, num_device_blocks=self.num_device_blocks,
                                 host_blocks=self._host_rows // cfg.block_size)
        fused = gather and self._fuse
        x = self._launches_for(b)
        spec = gather and not fused and bool(x.spec_meta) and 0 < b <= x.split_rows
        # The speculative copy predicts from the hint state as the resolver found it: on a GPU it reads it
        # while the resolver runs; the interpreter runs one launch after the other, so it reads a copy.
        hints = (self._pos_slot, self._hot_map)
        if spec and self._device.type == "cpu":
            hints = (self._pos_slot.clone(), self._hot_map.clone())
        out = self.launch_resolve(inputs, b, hot_map=self._hot_map, lru=self._lru, stats=self._stats,
                                  miss_mask=self._spec_mask if spec else None, host_limit=self._host_rows, fused=fused)
        if spec:
            self._copy_spec(x, inputs, b, pos_slot=hints[0], hot_map=hints[1])
        elif gather and not fused:
            self._copy_plan(0)
        return out

    def launch_resolve(self, inputs: ResolveInputs, rows: int, *, hot_map: torch.Tensor, lru: torch.Tensor,
                       stats: torch.Tensor, miss_mask: torch.Tensor | None, host_limit: int,
                       fused: bool = False, hot_rows: int | None = None) -> ResolveResult:
        """Launch the resolver on checked inputs over `rows` batch rows, with the hot state `hot_map`
        (int32) and `lru` (int32 or int16) of this runtime's shape, counters `stats` (int64 [>= 3]),
        and `miss_mask` (int32 [rows, top_k], written where given). Host rows at or past
        `host_limit` are null. `fused` (a bound runtime whose resolver fuses the copy): the resolver
        also copies the plan of layer 0. For this runtime's own `resolve` and for vLLM's op set,
        whose state tensors are vLLM's. `hot_rows`: the slots of `hot_map` and `lru` a state row has,
        where they are fewer than the configuration's (vLLM's region stride need not be a multiple of
        the block size; the configuration's hot rows are the next multiple, and its hot blocks the same)."""
        cfg = self.config
        h = cfg.hot_rows if hot_rows is None else hot_rows
        if not cfg.hot_rows - cfg.block_size < h <= cfg.hot_rows:
            raise InvalidInputError(f"launch_resolve: hot_rows={h}; expected ({cfg.hot_rows - cfg.block_size}, "
                                    f"{cfg.hot_rows}] (the same hot blocks as the configuration's {cfg.hot_rows})")
        out = self._result
        mask = miss_mask is not None
        copy_args: tuple[Any, ...] = ()
        x = self._launches_for(rows)
        split = not fused and 0 < rows <= x.split_rows
        if split:  # the split resolver: its scratch, then the scalars and the block shift
            copy_args = (cfg.block_size.bit_length() - 1,)
        elif self._gather_resolver:
            if fused:
                dev = self._dev[0]
                copy_args = (self._host[0], dev, dev.stride(0), self._words, cfg.row_format.row_bytes, self._dev_rows)
            else:  # never read (FUSE=0)
                copy_args = (out.valid_counts, out.valid_counts, 0, 0, 0, 0)
            copy_args += (cfg.block_size.bit_length() - 1,)  # LBS: read only where the block size is 2^LBS (SB)
        try:
            if split:
                ns = x.split_meta["NS"]
                kernel, name, grid = kernels.resolve_split_kernel, "resolve_split_kernel", rows * ns + cfg.max_batch_rows - rows
                meta = x.split_meta
            else:
                name = x.shape.kernel
                kernel, grid, meta = kernels.KERNELS[name], cfg.max_batch_rows, x.meta
            kernels.launch(
                kernel, name, (grid,),
                inputs.topk, inputs.row_state, inputs.seq_lens, inputs.source_table, inputs.resident_table,
                inputs.hot_table, hot_map, lru, stats, out.rows, out.valid_counts, out.plan_host,
                out.plan_device, out.plan_counts, self._pos_slot, miss_mask if mask else out.valid_counts,
                *self._scratch.values(), *(self._split.values() if split else ()), rows, cfg.max_pages, cfg.hot_blocks,
                cfg.max_requests, cfg.top_k, cfg.rows_per_request, cfg.block_size, h, host_limit, *copy_args,
                MASK=mask, **meta, **({} if split else x.fuse_meta[fused]))
            if split and x.tail_meta is not None:
                self._launch_tail(x, inputs, rows, hot_map=hot_map, lru=lru, stats=stats, miss_mask=miss_mask, hot_rows=h)
        except kernels.KernelError:
            self._clear_tables()  # a launch that failed part way may have left buckets filled
            raise
        self._last_rows = rows
        return out

    def _launches_for(self, rows: int) -> launches.Launches:
        """The launches of a batch of `rows` rows (the host's row count: no device read)."""
        return next((x for x in self._launches if rows <= x.max_rows), self._launches[-1])

    def _launch_tail(self, x: launches.Launches, inputs: ResolveInputs, rows: int, *, hot_map: torch.Tensor,
                     lru: torch.Tensor, stats: torch.Tensor, miss_mask: torch.Tensor | None, hot_rows: int) -> None:
        """The split resolver's hot rows (`shapes.SPLIT_TAIL_ENV`): the hot-row kernel, then the LRU kernel,
        `hot_programs` programs a batch row each, on the resolver's stream."""
        assert x.tail_meta is not None
        cfg = self.config
        out = self._result
        hot_meta, lru_meta, nh = x.tail_meta
        sc, sp, tl_ = self._scratch, self._split, self._tail
        kernels.launch(
            kernels.resolve_split_hot_kernel, "resolve_split_hot_kernel", (rows * nh,),
            inputs.row_state, inputs.hot_table, hot_map, lru, stats, out.rows, out.plan_host, out.plan_device,
            out.plan_counts, self._pos_slot, miss_mask if miss_mask is not None else out.valid_counts,
            sc["tbl_key"], sc["tbl_first"], sc["tbl_slot"], sc["scr_victim"], sc["scr_mark"],
            sp["scr_part"], sp["scr_ticket"], sp["scr_crow"], sp["scr_cee"], sp["scr_cpos"], sp["scr_cbkt"],
            sp["scr_cat"], tl_["scr_hcnt"], tl_["scr_ord"], tl_["scr_hit"],
            rows, cfg.hot_blocks, cfg.max_requests, cfg.top_k, cfg.rows_per_request, cfg.block_size, hot_rows,
            cfg.max_pages, cfg.block_size.bit_length() - 1, MASK=miss_mask is not None, **hot_meta, **x.tail_warps)
        kernels.launch(
            kernels.resolve_split_lru_kernel, "resolve_split_lru_kernel", (rows * nh,),
            inputs.row_state, lru, sc["scr_mark"], sp["scr_part"], tl_["scr_hcnt"], tl_["scr_ord"], tl_["scr_hit"],
            rows, cfg.max_requests, hot_rows, **lru_meta, **x.tail_warps)

    @property
    def result(self) -> ResolveResult:
        return self._result

    # ----------------------------------------------------------------- plan copies

    def gather_misses(self, layer: int = 0) -> None:
        self._require_bound()
        check_int("layer", layer, 0, self.config.num_layers)
        self._copy_plan(layer)

    def replay_plan(self, layers: Sequence[int] | None = None) -> None:
        self._require_bound()
        n = self.config.num_layers
        chosen = list(range(1, n)) if layers is None else check_ints("layers", layers, 0, n)
        for layer in chosen:
            self._copy_plan(layer)

    def _copy_spec(self, x: launches.Launches, inputs: ResolveInputs, rows: int, *, pos_slot: torch.Tensor,
                   hot_map: torch.Tensor) -> None:
        """Layer 0's plan copy as `kernels.copy_spec_kernel`, right behind the split resolver of `rows`
        rows (which wrote `_spec_mask`); `pos_slot` and `hot_map`: the hint state it predicts from."""
        cfg = self.config
        out = self._result
        dev = self._dev[0]
        bs = cfg.block_size
        meta = x.spec_meta | dict(VEC=self._vec)
        nc = -(-cfg.top_k // meta["SE"])
        kernels.launch(
            kernels.copy_spec_kernel, "copy_spec_kernel", (rows * nc,),
            inputs.topk, inputs.row_state, inputs.seq_lens, inputs.source_table, inputs.resident_table, hot_map,
            pos_slot, self._spec_mask, out.rows, out.plan_counts, self._host[0], dev, dev.stride(0), self._stats,
            rows, cfg.top_k, cfg.max_pages, cfg.max_requests, cfg.hot_rows, bs, bs.bit_length() - 1, self._host_rows,
            cfg.row_format.row_bytes, self._host_rows, self._dev_rows, self._words, nc, **meta)

    def _copy_plan(self, layer: int) -> None:
        if self._last_rows == 0:
            return
        cfg = self.config
        out = self._result
        dev = self._dev[layer]
        # Programs assigned to rows where every row gets enough of them (any batch in the interpreter,
        # whose one program walks the rows); else chunks round robin.
        x = self._launches_for(self._last_rows)
        rows = x.tuning.row_copy and (self._device.type == "cpu"
                                      or self._last_rows * shapes.ROW_COPY_MIN_PROGRAMS <= x.plan_programs)
        name = "copy_plan_rows_kernel" if rows else "copy_plan_kernel"
        bs = cfg.block_size
        vec = self._vec if x.tuning.lean_copy else 0
        meta = x.row_plan_meta if rows else x.plan_meta | dict(VEC=vec, SB=int(vec > 0 and bs & (bs - 1) == 0))
        kernels.launch(
            kernels.KERNELS[name], name, (x.plan_programs,),
            out.plan_host, out.plan_device, out.plan_counts, self._host[layer], dev, dev.stride(0), self._stats,
            self._last_rows, cfg.top_k, cfg.row_format.row_bytes, self._host_rows, self._dev_rows, self._words,
            bs, x.plan_programs, *(() if rows else (bs.bit_length() - 1,)), **meta)

    # ----------------------------------------------------------------- page and row copies

    def check_mirrors(self, mirrors: Sequence[RowMirror]) -> list[tuple[int, int, int]]:
        """Validate mirrors; returns `(device_row, host_row, num_rows)` per mirror."""
        self._require_bound()
        return copy_checks.check_mirrors(mirrors, resident_group=self._resident_group,
                                         block_size=self.config.block_size, device_rows=self._dev_rows,
                                         host_rows=self._host_rows)

    def check_pages(self, transfers: Sequence[PageTransfer], *, restore: bool | None) -> list[tuple[int, int]]:
        """Validate page transfers; returns `(device_block, host_block)` per transfer.

        `restore` is the direction every transfer must have (None: either)."""
        self._require_bound()
        return copy_checks.check_pages(transfers, restore=restore, resident_group=self._resident_group,
                                       device_blocks=self.num_device_blocks,
                                       host_blocks=self._host_rows // self.config.block_size)

    def check_host_copies(self, copies: Sequence[HostBlockCopy]) -> list[tuple[int, int]]:
        """Validate host block copies; returns `(src_block, dst_block)` per copy."""
        self._require_bound()
        return copy_checks.check_host_copies(copies, host_blocks=self._host_rows // self.config.block_size)

    def mirror_rows(self, mirrors: Sequence[RowMirror]) -> None:
        spans = self.check_mirrors(mirrors)
        self._copy_pairs([(s + o, d + o) for s, d, n in spans for o in range(n)], "device", "host", 4)

    def spill_pages(self, transfers: Sequence[PageTransfer]) -> None:
        bs = self.config.block_size
        pages = self.check_pages(transfers, restore=False)
        self._copy_pairs([(dv * bs + o, h * bs + o) for dv, h in pages for o in range(bs)], "device", "host", 4)

    def restore_pages(self, transfers: Sequence[PageTransfer]) -> None:
        bs = self.config.block_size
        pages = self.check_pages(transfers, restore=True)
        self._copy_pairs([(h * bs + o, dv * bs + o) for dv, h in pages for o in range(bs)], "host", "device", 3)

    def copy_host_blocks(self, copies: Sequence[HostBlockCopy]) -> None:
        bs = self.config.block_size
        pairs = self.check_host_copies(copies)
        self._copy_pairs([(s * bs + o, d * bs + o) for s, d in pairs for o in range(bs)], "host", "host", -1)

    def _side(self, kind: str, layer: int) -> tuple[torch.Tensor, int]:
        """A layer's word tensor and its block stride in words."""
        if kind == "host":
            return self._host[layer], self.config.block_size * self._words
        dev = self._dev[layer]
        return dev, dev.stride(0)

    def _copy_pairs(self, pairs: list[tuple[int, int]], src: str, dst: str, stat: int) -> None:
        """Copy rows `pairs` (source, destination) in every layer on the current stream; `stat`: the
        counter that takes the bytes (-1: none)."""
        if not pairs:
            return
        cfg = self.config
        flat = torch.tensor(pairs, dtype=torch.int32).reshape(-1)
        if self._device.type != "cpu":
            flat = flat.pin_memory().to(self._device, non_blocking=True)
        n = len(pairs)
        # Compiled: one build for every count (masked lanes); interpreted: as few programs as possible.
        eb = min(self._copy_entries, _pow2(n)) if self._device.type == "cpu" else self._copy_entries
        for layer in range(cfg.num_layers):
            s, s_stride = self._side(src, layer)
            d, d_stride = self._side(dst, layer)
            kernels.launch(kernels.copy_rows_kernel, "copy_rows_kernel", (-(-n // eb),),
                           flat, n, s, s_stride, d, d_stride, self._words, cfg.block_size,
                           WP=_pow2(self._words), EB=eb, **self._copy_meta)
        if stat >= 0:
            self._stats[stat] += n * cfg.row_format.row_bytes * cfg.num_layers

    # ----------------------------------------------------------------- hot state

    def invalidate_written_slots(self, state_rows: torch.Tensor, host_rows: torch.Tensor, *,
                                 validate: bool = True) -> None:
        """See `CacheRuntime.invalidate_written_slots`. `validate=False` skips the value checks
        (a host synchronization on a GPU); out-of-range state rows are then ignored."""
        self._require_bound()
        states = check_tensor("state_rows", state_rows, (None,), torch.int32, self._device)
        rows = check_tensor("host_rows", host_rows, (states.shape[0],), torch.int32, self._device)
        if validate:
            s_cpu, r_cpu = states.cpu(), rows.cpu()
            check_range("state_rows", s_cpu, -1, self.config.max_requests)
            live = s_cpu >= 0
            bad = live & ((r_cpu < 0) | (r_cpu >= self._host_rows))
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                raise InvalidInputError(f"host_rows[{i}]={int(r_cpu[i])} is out of range; expected a host row in "
                                        f"[0, {self._host_rows}) where state_rows[{i}] >= 0")
        if states.shape[0] == 0:
            return
        h = self.config.hot_rows
        kernels.launch(kernels.invalidate_written_kernel, "invalidate_written_kernel", (states.shape[0],),
                       states, rows, self._hot_map, self.config.max_requests, h, HP=_pow2(h))

    def invalidate_host_blocks(self, block_ids: Sequence[int]) -> None:
        self._require_bound()
        blocks = check_ints("block_ids", block_ids, 0, self._host_rows // self.config.block_size)
        if not blocks:
            return
        ids = torch.tensor(sorted(set(blocks)), dtype=torch.int32)
        if self._device.type != "cpu":
            ids = ids.pin_memory().to(self._device, non_blocking=True)
        hm = self._hot_map
        held = torch.div(hm, self.config.block_size, rounding_mode="floor")
        hm.masked_fill_((hm >= 0) & torch.isin(held, ids), -1)

    def reset_state(self, state_rows: Sequence[int] | None = None) -> None:
        r = self.config.max_requests
        chosen = list(range(r)) if state_rows is None else check_ints("state_rows", state_rows, 0, r)
        if not chosen:
            return
        idx = torch.tensor(chosen, dtype=torch.int64)
        if self._device.type != "cpu":
            idx = idx.pin_memory().to(self._device, non_blocking=True)
        self._hot_map.index_fill_(0, idx, -1)
        self._lru.index_copy_(0, idx, torch.arange(self.config.hot_rows, dtype=torch.int32,
                                                   device=self._device).expand(len(chosen), -1).contiguous())

    def hot_state(self, state_row: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = check_int("state_row", state_row, 0, self.config.max_requests)
        self._synchronize()
        return self._hot_map[q].cpu().clone(), self._lru[q].cpu().clone()

    # ----------------------------------------------------------------- counters

    def stats(self) -> RuntimeStats:
        self._synchronize()
        s = self._stats.tolist()
        return RuntimeStats(resident=s[0], hits=s[1], misses=s[2], h2d_bytes=s[3], d2h_bytes=s[4])

    def reset_stats(self) -> None:
        self._stats.zero_()

    def _synchronize(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)  # work may sit on the transfer engine's stream
