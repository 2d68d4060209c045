"""The connector's scheduler role: `HiSparseCoordinator` driven by vLLM's scheduler hooks.

What it does on a stock vLLM engine (standard attention):

- **Admission** (`get_num_new_matched_tokens`): the longest prefix of the request published in
  the host pool, capped so at least one token is computed, beyond what vLLM's own GPU prefix
  cache holds, is offered as a synchronous load (issue 41): the workers load it before this
  step's forward, and vLLM puts the blocks in its GPU prefix cache at once. So a page is loaded
  once however many requests need it: a request admitted in the same step, or later while the
  blocks are cached, takes them from vLLM's prefix cache instead of loading its own copy, and
  holds no more GPU blocks than without the connector. (An asynchronous load would keep the
  blocks out of the prefix cache until it completes, vLLM's `delay_cache_blocks`, and hold them
  for a step without forward progress: requests admitted together each loaded and held a copy.)
  `shared_loaded_tokens` counts the pages taken that way from another request's load.
  Admission never waits for the host pool: vLLM's attention reads resident GPU pages only, so
  no request needs host capacity to run.
- **Host pool full** (`build_connector_meta`): when the pages a step writes do not fit the host
  pool (after evicting cached pages), the most recently admitted of those requests stops being
  cached: it leaves the coordinator (its sealed pages are still published) and runs on without
  host copies. The pool costs prefix hits, never concurrency; the first time, one WARNING gives
  the numbers and the `host_pool_gib` that would have cached every running request.
- **Prefix loads** (`update_state_after_alloc`): the request is admitted to the coordinator with
  that prefix (its host blocks are leased for it) and one restore per page is queued for this
  step's command, into the GPU blocks vLLM allocated (`loads.py`); the request runs in the same
  step. If it finishes before every worker acknowledged its loads, its blocks are freed only
  then (`finished_sending`, once).
- **Each step** (`build_connector_meta`): preemptions and admissions reach the coordinator, then
  `schedule_step` plans the step (host blocks for new pages, spills of pages sealed by the
  previous steps); the queued loads are prepended to its command.
- **Acknowledgements** (`update_connector_output`): the aggregated worker metadata is split into
  the coordinator's transfers and the loads; completed spills publish pages for prefix reuse.
- **Finishing** (`request_finished_all_groups`): the coordinator lets go of the request; if a
  spill, restore or load still uses one of its blocks, the blocks are freed only once every
  worker completed it (`finished_sending`, once).

Request identity stays here; the workers see transfer ids and block coordinates only.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Sequence
from typing import Any

from hisparse_core.coordinator import HiSparseCoordinator, PrefixHit, StepRequest
from hisparse_core.errors import CapacityError, ProtocolError
from hisparse_core.types import OffloadCommand, WorkerMetadata
from hisparse_vllm.config import ConnectorConfig
from hisparse_vllm.gpu_blocks import VllmGpuBlocks
from hisparse_vllm.layout import HostTierLayout
from hisparse_vllm.loads import LOAD_ID_BASE, LoadLedger, split_acks
from hisparse_vllm.metadata import HiSparseConnectorMetadata, HiSparseWorkerMetadata
from hisparse_vllm.stats import HiSparseConnectorStats

logger = logging.getLogger(__name__)


class _StateRows:
    """Worker state rows (residency-table rows) of scheduled requests, lowest free first."""

    def __init__(self, capacity: int) -> None:
        self._free = list(range(capacity - 1, -1, -1))
        self._rows: dict[str, int] = {}

    def row(self, request_id: str) -> int:
        row = self._rows.get(request_id)
        if row is None:
            if not self._free:
                raise CapacityError(f"no free worker state row for request {request_id!r}; all {len(self._rows)} "
                                    "rows (max_num_seqs) are held by scheduled requests")
            row = self._rows[request_id] = self._free.pop()
        return row

    def release(self, request_id: str) -> None:
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._free.append(row)
            self._free.sort(reverse=True)

    def __len__(self) -> int:
        return len(self._rows)


def _extra_key(request: Any) -> bytes | None:
    """What besides the token ids identifies a prefix: LoRA adapter, cache salt, multimodal inputs."""
    parts: list[str] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora:{getattr(lora, 'lora_name', '')}:{getattr(lora, 'lora_int_id', '')}")
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(f"salt:{salt}")
    for f in getattr(request, "mm_features", None) or ():
        parts.append(f"mm:{getattr(f, 'identifier', None) or getattr(f, 'mm_hash', '')}")
    if not parts:
        return None
    return hashlib.sha256("\x1f".join(parts).encode()).digest()


def _round_up(x: float, digits: int = 3) -> str:
    """`x` rounded up to `digits` significant digits, so the suggested size is never too small."""
    if x <= 0:
        return "0"
    scale = 10 ** (digits - 1 - math.floor(math.log10(x)))
    return f"{math.ceil(x * scale) / scale:.{digits}g}"


class SchedulerSide:
    """Scheduler-role state of the connector (one per engine core)."""

    def __init__(self, vllm_config: Any, config: ConnectorConfig, layout: HostTierLayout) -> None:
        pc = vllm_config.parallel_config  # pipeline parallelism is refused before this role is built (connector.py)
        self._config = config
        self._layout = layout
        self._bs = layout.block_size
        self._max_model_len = int(vllm_config.model_config.max_model_len)
        self._num_workers = int(pc.world_size)
        self._coord_config = layout.coordinator_config(config.host_pool_gib, self._max_model_len)
        self._state_rows = _StateRows(int(vllm_config.scheduler_config.max_num_seqs))
        self._coord: HiSparseCoordinator | None = None
        self._gpu: VllmGpuBlocks | None = None
        self._kv_manager: Any = None
        self._requests: dict[str, Any] = {}  # admitted by vLLM (update_state_after_alloc) until they leave
        self._incarnation: dict[str, int] = {}
        self._pending_hits: dict[str, tuple[int, PrefixHit]] = {}
        self._loads = LoadLedger()
        self._inflight: dict[int, tuple[frozenset[int], int]] = {}  # coordinator transfer -> (GPU blocks, done)
        self._delayed: dict[str, set[int]] = {}  # finished request -> transfers still reading its blocks
        self._delayed_loads: set[str] = set()  # finished requests whose loads are not acknowledged yet
        self._local_hits: dict[str, int] = {}  # request -> tokens vLLM's GPU prefix cache gave it at admission
        # GPU block (group 0's block of a page) -> the request that loaded a host page into it,
        # while the block holds that page: dropped when vLLM hands it out again (`_forget_reallocated`).
        self._loaded_blocks: dict[int, str] = {}
        self._shared_pages = 0  # pages a request took from another request's load (vLLM's prefix cache)
        self._logged_shared = False
        self._uncached: dict[str, int] = {}  # running without host copies -> its num_preemptions then
        self._admitted: dict[str, int] = {}  # coordinator admission order (latest stops caching first)
        self._admissions = 0
        self._warned_full = False
        self._reset_hot = False
        self._reported = {"host_prefix_matched_tokens": 0, "new_loaded_pages": 0, "resumed_pages": 0,
                          "evicted_blocks": 0, "shared_pages": 0}
        self._stats_due = False  # a reset changed the levels: report them at the next step
        self._resets = 0  # successful connector resets, reported so a front end sees its reset arrive

    # ----------------------------------------------------------------- binding

    def bind(self, kv_cache_manager: Any) -> None:
        if self._coord is not None:
            raise ProtocolError("bind_kv_cache_manager called twice; the coordinator is bound once")
        self._kv_manager = kv_cache_manager
        self._gpu = VllmGpuBlocks(kv_cache_manager.block_pool)
        self._coord = HiSparseCoordinator(self._coord_config, self._gpu)
        # The backend and why are the connector's own line ("HiSparseOffloadConnector (scheduler): ...").
        logger.info("hisparse connector scheduler: %d layers x %d-token pages (%d B per layer page) in %d KV-cache "
                    "group(s); %d worker(s)", self._layout.num_layers, self._bs, self._layout.page_bytes,
                    self._layout.num_groups, self._num_workers)

    @property
    def bound(self) -> bool:
        return self._coord is not None

    @property
    def coordinator(self) -> HiSparseCoordinator:
        if self._coord is None:
            raise ProtocolError("the scheduler has not bound its KV cache manager yet (bind_kv_cache_manager)")
        return self._coord

    @property
    def gpu_blocks(self) -> VllmGpuBlocks:
        _ = self.coordinator  # raises ProtocolError before the KV cache manager is bound
        assert self._gpu is not None
        return self._gpu

    @property
    def loads(self) -> LoadLedger:
        return self._loads

    # ----------------------------------------------------------------- admission

    def _max_pages(self, request: Any) -> int:
        limit = request.num_prompt_tokens + int(getattr(request, "max_tokens", 0) or 0)
        return -(-min(limit, self._max_model_len) // self._bs)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        coord = self.coordinator
        rid = request.request_id
        self._pending_hits.pop(rid, None)
        self._retire_stale_incarnation(request)
        self._local_hits[rid] = num_computed_tokens
        cap = (request.num_tokens - 1) // self._bs * self._bs
        hit = coord.lookup_prefix(request.all_token_ids, extra_key=_extra_key(request), max_tokens=cap)
        ext = hit.num_tokens - num_computed_tokens
        if ext <= 0:
            return 0, False
        self._pending_hits[rid] = (num_computed_tokens, hit)
        return ext, False  # synchronous: loaded before this step's forward (module docstring)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        self._retire_stale_incarnation(request)
        self._requests[rid] = request
        pending = self._pending_hits.pop(rid, None)
        block_ids = blocks.get_block_ids()
        self._count_shared(request, block_ids, self._local_hits.pop(rid, 0))
        if num_external_tokens == 0:
            return
        if pending is None:
            raise ProtocolError(f"request {rid!r}: {num_external_tokens} external tokens allocated without a prefix "
                                "offered by get_num_new_matched_tokens")
        local, hit = pending
        end = local + num_external_tokens
        if end != hit.num_tokens or local % self._bs:
            raise ProtocolError(f"request {rid!r}: vLLM allocated external tokens [{local}, {end}); the host prefix "
                                f"offered covers [{local}, {hit.num_tokens}) in whole {self._bs}-token pages")
        taken = self._admit(request, cap=end)
        host = self.coordinator.source_block_ids(rid) if taken >= end else hit.host_block_ids
        pages = [(host[p], tuple(group[p] for group in block_ids)) for p in range(local // self._bs, end // self._bs)]
        self._loads.plan(rid, pages, resumed=request.num_preemptions > 0)
        self._loaded_blocks.update((gpu[0], rid) for _, gpu in pages)
        logger.debug("request %s: loading %d host pages (tokens [%d, %d)) into GPU blocks", rid, len(pages), local,
                     end)

    def _count_shared(self, request: Any, block_ids: Sequence[Sequence[int]], local: int) -> None:
        """Pages of vLLM's GPU prefix hit that another request loaded from host: shared, not loaded again."""
        if not local or not block_ids or not self._loaded_blocks:
            return
        rid = request.request_id
        shared = sum(1 for b in block_ids[0][:local // self._bs] if self._loaded_blocks.get(b, rid) != rid)
        if not shared:
            return
        self._shared_pages += shared
        message = (f"request {rid}: {shared} page(s) another request loaded from the host pool "
                   "came from vLLM's GPU prefix cache, not loaded again")
        if self._logged_shared:
            logger.debug("%s", message)
        else:
            self._logged_shared = True
            logger.info("hisparse: %s (each host page loads once while requests share it; logged once, "
                        "vllm:hisparse_shared_loaded_tokens counts them)", message)

    def _forget_reallocated(self, scheduler_output: Any, computed: dict[str, int]) -> None:
        """A loaded GPU block that vLLM hands out again as a fresh block no longer holds the load."""
        if not self._loaded_blocks:
            return
        fresh: list[int] = []
        for new in scheduler_output.scheduled_new_reqs:
            if new.block_ids:
                fresh += new.block_ids[0][new.num_computed_tokens // self._bs:]
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", ()) or ()
        for rid, ids in zip(cached.req_ids, cached.new_block_ids, strict=False):
            if ids:
                fresh += ids[0][computed[rid] // self._bs:] if rid in resumed else ids[0]
        for b in fresh:
            self._loaded_blocks.pop(b, None)

    def _admit(self, request: Any, cap: int) -> int:
        coord, rid = self.coordinator, request.request_id
        tokens, key = request.all_token_ids, _extra_key(request)
        try:
            hit = coord.add_request(rid, tokens, extra_key=key, max_prefix_tokens=cap)
        except CapacityError as exc:
            # The prefix hit leases a hot buffer; without GPU room, admit without the hit (its
            # pages are then mirrored again as if computed here).
            logger.debug("request %s: host prefix not taken (%s); admitting without it", rid, exc)
            hit = coord.add_request(rid, tokens, extra_key=key, max_prefix_tokens=0)
        self._incarnation[rid] = request.num_preemptions
        self._admissions += 1
        self._admitted[rid] = self._admissions
        return hit

    def _retire_stale_incarnation(self, request: Any) -> None:
        """A request preempted since its admission leaves the coordinator before it is re-admitted;
        one that ran uncached may be cached again from its restart on."""
        rid = request.request_id
        if rid in self._incarnation and self._incarnation[rid] != request.num_preemptions:
            self._leave(rid, preempted=True)
        if rid in self._uncached and self._uncached[rid] != request.num_preemptions:
            del self._uncached[rid]

    def _stop_caching(self, rid: str) -> None:
        """The request runs on in vLLM without host copies: it leaves the coordinator as if it
        finished (its spills in flight still publish their pages), until it finishes or restarts."""
        request = self._requests[rid]
        self._leave(rid, preempted=False)
        self._requests[rid] = request
        self._uncached[rid] = request.num_preemptions

    def _leave(self, rid: str, *, preempted: bool) -> None:
        coord = self.coordinator
        if coord.has_request(rid):
            with self.gpu_blocks.handover():
                if preempted:
                    coord.preempt_request(rid)
                else:
                    coord.finish_request(rid)
        self._incarnation.pop(rid, None)
        self._admitted.pop(rid, None)
        self._requests.pop(rid, None)
        self._state_rows.release(rid)

    # ----------------------------------------------------------------- per step

    def build_connector_meta(self, scheduler_output: Any) -> HiSparseConnectorMetadata:
        coord = self.coordinator
        # This step reports the levels a reset changed (if vLLM logs stats at all: with stats off
        # nothing would ever clear the flag in `stats()`, and an idle engine would step forever).
        self._stats_due = False
        for rid in scheduler_output.preempted_req_ids or ():
            request = self._requests.get(rid)
            if request is not None:
                self._retire_stale_incarnation(request)
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        views: list[StepRequest] = []
        for rid, num_new in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(rid)
            if request is None:
                raise ProtocolError(f"request {rid!r} is scheduled but the connector never saw it admitted "
                                    "(update_state_after_alloc)")
            self._retire_stale_incarnation(request)
            if rid in self._uncached:
                continue
            nc = computed[rid]
            if not coord.has_request(rid):
                self._admit(request, cap=nc // self._bs * self._bs)
            views.append(StepRequest(rid, self._state_rows.row(rid), nc, num_new, request.all_token_ids,
                                     self._kv_manager.get_block_ids(rid)))
        self._forget_reallocated(scheduler_output, computed)
        views = self._fit_host_pool(views)
        command = coord.schedule_step(views)
        coord.take_table_updates()  # the source/hot tables serve sparse attention, absent here
        loads = self._loads.take_queued()
        if loads:
            scheduler_output.has_sync_kv_loads = True  # before the forward that reads them (vLLM sets it too)
            command = OffloadCommand(loads) if command is None else OffloadCommand(
                loads + command.page_transfers, command.row_mirrors, command.residency_updates,
                command.host_block_copies, command.recycled_host_blocks)
        if command is not None:
            for t in command.page_transfers:
                if t.transfer_id < LOAD_ID_BASE:  # the coordinator's spills and restores
                    self._inflight[t.transfer_id] = (frozenset(t.resident_block_ids), 0)
                    if t.restore:
                        # A coordinator restore fills a page this step's forward writes into, so the
                        # workers must run start_load_kv before the forward (as upstream does). Prefix
                        # loads need not: their request is not in this step's batch.
                        scheduler_output.has_sync_kv_loads = True
        reset, self._reset_hot = self._reset_hot, False
        return HiSparseConnectorMetadata(command, reset_hot_state=reset)

    def _fit_host_pool(self, views: list[StepRequest]) -> list[StepRequest]:
        """Stop caching the latest-admitted requests until the host blocks this step's new pages
        need fit the pool (free blocks plus evictable cached ones)."""
        coord = self.coordinator

        def needs(v: StepRequest) -> int:
            return coord.host_blocks_needed(v.request_id, v.num_computed_tokens + v.num_new_tokens)

        need = sum(needs(v) for v in views)
        if need <= coord.num_free_host_blocks:
            return views
        before = coord.stats()
        wanted, running = need, len(views)
        dropped: list[str] = []
        while views and need > coord.num_free_host_blocks:
            victim = max((v for v in views if needs(v)), key=lambda v: self._admitted.get(v.request_id, 0))
            self._stop_caching(victim.request_id)
            dropped.append(victim.request_id)
            views = [v for v in views if v.request_id != victim.request_id]
            need = sum(needs(v) for v in views)
        # Enough for every request vLLM holds to reach its full length, plus the null block.
        full = sum(self._max_pages(r) for r in self._requests.values()) + 1
        gib = full * self._coord_config.host_block_stride / 2**30 * self._config.host_pool_gib \
            / self._coord_config.host_pool_gib
        message = (f"hisparse host pool full: {running} scheduled requests lease {before.host_blocks_used} of "
                   f"{before.host_blocks_total} usable host blocks ({before.host_blocks_cached} more hold cached "
                   f"pages) and this step writes {wanted} new pages; request(s) {dropped} run on without host "
                   "copies (nothing waits: their later pages cannot be prefix hits, concurrency is unchanged). "
                   f"host_pool_gib={self._config.host_pool_gib} holds {before.host_blocks_total + 1} blocks; "
                   f"host_pool_gib >= {_round_up(gib)} would cache all {len(self._requests)} requests to their full "
                   "length")
        if self._warned_full:
            logger.debug("%s", message)
        else:
            self._warned_full = True
            logger.warning("%s (logged once; vllm:hisparse_requests_uncached counts them)", message)
        return views

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        if meta is None:
            return
        if not isinstance(meta, HiSparseWorkerMetadata):
            raise ProtocolError(f"expected HiSparseWorkerMetadata from the workers, got {type(meta).__name__}")
        coord_part, load_part = split_acks(meta.acks)
        if not coord_part.is_empty():
            self.coordinator.update_from_workers(coord_part, self._num_workers)
        done = self._count_completions(coord_part)
        loaded = set(self._loads.acknowledge(load_part, self._num_workers)) if not load_part.is_empty() else set()
        self._delayed_loads -= loaded
        sending: set[str] = set()
        for rid, pending in list(self._delayed.items()):
            pending -= done
            if not pending and rid not in self._delayed_loads:
                del self._delayed[rid]
                sending.add(rid)
        if sending:
            connector_output.finished_sending = set(connector_output.finished_sending or ()) | sending

    def _count_completions(self, acks: WorkerMetadata) -> set[int]:
        done: set[int] = set()
        for tid, n in acks.completed.items():
            entry = self._inflight.get(tid)
            if entry is None:
                continue
            blocks, count = entry
            count += n
            if count >= self._num_workers:
                del self._inflight[tid]
                done.add(tid)
            else:
                self._inflight[tid] = (blocks, count)
        return done

    # ----------------------------------------------------------------- finishing

    def request_finished(self, request: Any, block_ids: Sequence[Sequence[int]]) -> bool:
        """Returns True when vLLM must keep the blocks until `finished_sending` names the request."""
        rid = request.request_id
        self._requests.pop(rid, None)
        self._pending_hits.pop(rid, None)
        self._uncached.pop(rid, None)
        self._local_hits.pop(rid, None)
        self._leave(rid, preempted=False)
        blocks = {b for group in block_ids for b in group}
        pending = {tid for tid, (tb, _) in self._inflight.items() if tb & blocks}
        if self._loads.pending(rid):
            self._delayed_loads.add(rid)  # a load into its blocks is not acknowledged everywhere yet
        if pending or rid in self._delayed_loads:
            self._delayed[rid] = pending
            return True
        return False

    # ----------------------------------------------------------------- state

    def has_pending_work(self) -> bool:
        # `_stats_due` keeps an idle engine stepping once after a reset, so the stats that step
        # reports bring the gauges down (vLLM sends stats only with a step's outputs).
        return bool(self._coord is not None and self._coord.has_pending_work()) or bool(len(self._loads)) \
            or bool(self._delayed) or self._stats_due

    def has_pending_block_frees(self) -> bool:
        return bool(self._delayed) or (self._gpu is not None and self._gpu.num_pins_on_freed_blocks() > 0)

    def reset_cache(self) -> bool:
        """Forget every published host prefix. Only when idle (no request, transfer or load in
        flight): the coordinator is rebuilt empty, and the workers forget their hot state."""
        coord = self.coordinator
        stats = coord.stats()
        busy = {"requests": stats.running_requests + stats.detached_requests + stats.pending_imports,
                "transfers": stats.pending_transfers + stats.pending_host_copies, "loads": len(self._loads),
                "delayed frees": len(self._delayed)}
        if any(busy.values()):
            logger.warning("hisparse host cache not reset: still in flight %s", {k: v for k, v in busy.items() if v})
            return False
        assert self._gpu is not None
        self._coord = HiSparseCoordinator(self._coord_config, self._gpu)
        self._inflight.clear()
        self._loaded_blocks.clear()  # vLLM's GPU prefix cache is reset with it (reset_prefix_cache)
        self._reset_hot = True
        self._reported.update(host_prefix_matched_tokens=0, evicted_blocks=0)  # the new coordinator counts from 0
        self._stats_due = True
        self._resets += 1
        logger.info("hisparse host cache reset: %d published blocks forgotten", stats.published_blocks)
        return True

    def stats(self) -> HiSparseConnectorStats:
        s = self.coordinator.stats()
        loads = self._loads
        now = {"host_prefix_matched_tokens": s.prefix_hit_tokens,
               "new_loaded_pages": loads.loaded_pages - loads.resumed_pages, "resumed_pages": loads.resumed_pages,
               "evicted_blocks": s.evicted_blocks, "shared_pages": self._shared_pages}
        delta = {k: v - self._reported[k] for k, v in now.items()}
        self._reported = now
        out = HiSparseConnectorStats().record(
            host_pool_usage=s.host_usage, host_pool_cached=s.host_blocks_cached / s.host_blocks_total,
            host_blocks_used=s.host_blocks_used, host_blocks_cached=s.host_blocks_cached,
            pending_transfers=s.pending_transfers + len(self._loads), requests_uncached=len(self._uncached),
            host_blocks_total=s.host_blocks_total, reset_epoch=self._resets)
        if delta["host_prefix_matched_tokens"]:
            out.record(host_prefix_matched_tokens=delta["host_prefix_matched_tokens"])
        if delta["new_loaded_pages"]:
            out.record(prefix_loaded_tokens=delta["new_loaded_pages"] * self._bs)
        if delta["resumed_pages"]:
            out.record(preempted_loaded_tokens=delta["resumed_pages"] * self._bs)
        if delta["shared_pages"]:
            out.record(shared_loaded_tokens=delta["shared_pages"] * self._bs)
        if delta["evicted_blocks"]:
            out.record(host_evicted_blocks=delta["evicted_blocks"])
        return out
