"""The sparse-attention layer as hisparse runs it: the model's own projections and indexer, the KV
read through hisparse, attention on exactly the gathered rows.

Per layer and forward (`HiSparseAttention.forward`, installed per instance by `enable`):

1. The model's own modules give the query (`q_a_proj`, `q_a_layernorm`, `q_b_proj`) and the latent
   row (`kv_a_proj_with_mqa`, `kv_a_layernorm`, the family's `apply_rotary_pos_emb_interleave`):
   exactly what the model would pass to `cache.update`. The row is written into the request's
   resident page (positions whose KV is not final yet; prefix-hit positions are on host already).
2. The leader of an index group runs the model's indexer (its keys stay in `HiSparseCache`);
   followers take the leader's top-k (`prev_topk_indices`). Padded indices become logical
   positions; padding, future and out-of-context entries become -1.
3. Rows, read in their stored form (`kv_rows`) and decoded to the model's dtype (a layer of
   `resident_layers`: by position from its own store, `_resident_rows`; with
   `prefetch_next_group` its leader still starts the next group's prefetch on its top-k):
   - one query per row (decode): the leader calls `CacheRuntime.resolve(gather=True,
     validate=False)` (resident page, else hot row, else a miss copied from host into the hot
     buffer); followers `replay_plan([layer])`. No host synchronization. With
     `prefetch_next_group` the leader's resolve first waits (on the device) for the prefetch that
     ran its group's resolve on the previous group's top-k, then starts the next group's
     (`prefetch.py`).
   - a verification step of assisted generation (`StepState.verify`: the token before the
     candidates and the candidates, every prompt in the cache): the same resolve with one resolver
     row per query, a request's rows consecutive, so they resolve the union of their top-k against
     its hot state in one pass; each row's context ends at its own query (causal).
   - several queries per row (a prefill chunk): each query has its own top-k, so the rows are
     looked up directly: resident pages from the device cache, the rest (prefix-hit pages, pages
     released under the GPU budget) from the host pool's layer views (every non-resident page is
     clean there: its spill completed before it was released). Exact, and off the decode path.
4. Absorbed MLA over the gathered rows: the query's no-RoPE part goes through kv_b_proj's K part
   into latent space, scores against the latent (plus the RoPE part), `module.scaling`, softmax
   in float32 as the model does, the weighted latent goes back through kv_b_proj's V part and
   `o_proj`. Nothing is computed over the whole context, and K/V are never expanded.

When the cache passed to the layer is not a `HiSparseCache`, the model's own forward runs unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hisparse_core.errors import HiSparseError, InvalidInputError
from hisparse_core.runtime import ResolveInputs
from hisparse_transformers.cache import HiSparseCache
from hisparse_transformers.rows import RowMap

if TYPE_CHECKING:
    from hisparse_transformers.check import ExactnessChecker
    from hisparse_transformers.engine import HiSparseEngine
    from hisparse_transformers.families import DsaLayout
    from hisparse_transformers.session import StepState


class MissingRowError(HiSparseError, RuntimeError):
    """A position the indexer chose has neither a resident page nor a host copy (a bookkeeping bug)."""


def _logical_topk(topk: torch.Tensor, step: StepState) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded indexer output `[B, S, k]` -> logical positions with -1 where masked, and the mask."""
    t = topk.to(torch.int64) - step.pad.view(-1, 1, 1)
    q = step.qpos.unsqueeze(-1)
    valid = (t >= 0) & (t <= q) & (q >= 0)
    return torch.where(valid, t, torch.full_like(t, -1)), valid


def _decode_rows(engine: HiSparseEngine, step: StepState, group: int, position: int, topk: torch.Tensor | None,
                 cached: RowMap | None) -> RowMap:
    runtime = engine.runtimes[group]
    b, s = step.qpos.shape
    if position == 0:
        assert topk is not None
        # One resolver row per query (decode: one per batch row; verification: S per row, b-major).
        # Entries outside the row's context become -1: the left padding (negative once shifted),
        # positions after the row's own query (causal) and, where the indexer scored a
        # fixed-capacity key buffer (a captured step, graphs.py) and the context holds fewer than
        # top-k keys, slots past it. Padding rows (no query) are row_state -1 and ignored.
        flat = topk.reshape(b * s, topk.shape[-1]).to(torch.int32) - step.pad32
        flat = torch.where((flat < 0) | (flat >= step.seq_lens.unsqueeze(1)), -1, flat)
        k = runtime.config.top_k
        if flat.shape[1] < k:
            flat = torch.nn.functional.pad(flat, (0, k - flat.shape[1]), value=-1)
        flat = flat.contiguous()
        source, resident, hot = engine.tables_of(group)
        prefetch = engine.prefetch
        if prefetch is not None:
            prefetch.join(step, group)     # the prefetch on the previous group's top-k wrote this runtime
        runtime.resolve(ResolveInputs(flat, step.row_state, step.seq_lens, source, resident, hot), gather=True,
                        validate=False)
        if prefetch is not None:
            prefetch.launch(step, group, flat)
        logical = flat.to(torch.int64).view(b, s, -1)
        if step.verify:
            _count_union(engine, logical)
    else:
        assert cached is not None
        runtime.replay_plan([position])
        logical = cached.positions
    rows = runtime.result.rows[:b * s].to(torch.int64).view(b, s, -1)
    return RowMap(logical, rows >= 0, rows=rows)


def _count_union(engine: HiSparseEngine, logical: torch.Tensor) -> None:
    """Add a verification step's [entries, distinct positions per request] to the engine's device
    counters: entries beyond the distinct ones are rows the union shared between a request's rows."""
    flat = logical.reshape(logical.shape[0], -1)
    ordered = flat.sort(dim=-1).values
    valid = ordered >= 0
    first = torch.ones_like(valid)
    first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    # the counters live on the engine's first device; a group on another device adds across
    engine.union_counts += torch.stack([valid.sum(), (valid & first).sum()]).to(engine.union_counts.device)


def _prefill_rows(engine: HiSparseEngine, step: StepState, group: int, topk: torch.Tensor) -> RowMap:
    bs = engine.config.block_size
    logical, valid = _logical_topk(topk, step)
    t = logical.clamp(min=0)
    page, offset = t // bs, t % bs
    assert step.state_rows is not None
    states = step.state_rows.to(torch.int64).view(-1, 1, 1).expand_as(t)
    source_table, resident_table, _ = engine.tables_of(group)
    resident = resident_table[states, page].to(torch.int64)
    source = source_table[states, page].to(torch.int64)
    on_device = valid & (resident >= 0)
    host_mask = valid & (resident < 0) & (source >= 0)
    lost = valid & ~on_device & ~host_mask
    if bool(lost.any()):
        b, s, i = (int(v) for v in lost.nonzero()[0])
        raise MissingRowError(f"request row {b}: position {int(logical[b, s, i])} has no resident page and no host "
                              "copy")
    dev_rows = torch.where(on_device, resident * bs + offset, torch.zeros_like(resident))
    host_rows = torch.where(host_mask, source * bs + offset, torch.zeros_like(source))
    num_host = int(host_mask.sum())
    return RowMap(logical, valid, dev_rows=dev_rows, host_rows=host_rows, host_mask=host_mask, num_host=num_host)


def _resident_rows(engine: HiSparseEngine, step: StepState, topk: torch.Tensor) -> RowMap:
    """A resident layer's rows (`resident_layers`): its store holds every position of every state
    row, so an entry's row is `state * capacity + position`; no resolve, no hot buffer, no host
    read. A decode or verification step masks as `_decode_rows` does, from the step tensors a
    captured graph refreshes (row_state, seq_lens, pad32: device ops of fixed shapes only)."""
    cap = engine.resident_capacity
    if step.num_new > 1 and not step.verify:
        logical, valid = _logical_topk(topk, step)
        assert step.state_rows is not None
        base = step.state_rows.to(torch.int64).view(-1, 1, 1) * cap
        return RowMap(logical, valid, rows=torch.where(valid, base + logical, torch.full_like(logical, -1)))
    b, s = step.qpos.shape
    k = engine.layout.index_topk
    flat = topk.reshape(b * s, topk.shape[-1]).to(torch.int32) - step.pad32
    bad = (flat < 0) | (flat >= step.seq_lens.unsqueeze(1)) | (step.row_state.unsqueeze(1) < 0)
    flat = torch.where(bad, -1, flat)
    if flat.shape[1] < k:
        # as the resolver's rows are: padded to top-k (the same K, so the same reductions)
        flat = torch.nn.functional.pad(flat, (0, k - flat.shape[1]), value=-1)
    logical = flat.to(torch.int64)
    rows = torch.where(logical >= 0, step.row_state.to(torch.int64).unsqueeze(1) * cap + logical, -1)
    return RowMap(logical.view(b, s, -1), (rows >= 0).view(b, s, -1), rows=rows.view(b, s, -1))


def _gather(engine: HiSparseEngine, group: int, position: int, rmap: RowMap) -> torch.Tensor:
    """The rows of one layer `[B, S, K, >= lora + rope]` in the model's dtype, decoded from their
    stored form (`kv_rows`; masked entries hold some row, never read)."""
    flat = engine.flat_layers[group][position]
    if rmap.rows is not None:
        rows = rmap.rows.clamp(min=0)
        return engine.rows.decode(flat.index_select(0, rows.view(-1)).view(*rows.shape, flat.shape[-1]))
    assert rmap.dev_rows is not None and rmap.host_rows is not None and rmap.host_mask is not None
    kv = flat[rmap.dev_rows]
    if rmap.num_host:
        host = engine.host_views[group][position]
        picked = host[rmap.host_rows[rmap.host_mask].to(host.device)]
        kv[rmap.host_mask] = picked.to(kv.device, non_blocking=False)
        engine.totals.prefill_host_rows += rmap.num_host
    return engine.rows.decode(kv)


def absorbed_attention(module: Any, q_pass: torch.Tensor, q_rot: torch.Tensor, kv: torch.Tensor,
                       valid: torch.Tensor) -> torch.Tensor:
    """MLA on gathered latent rows, without expanding K/V.

    `q_pass` `[B, H, S, nope]`, `q_rot` `[B, H, S, rope]` (RoPE applied), `kv` `[B, S, K, >= lora + rope]`,
    `valid` `[B, S, K]`. Returns the attention output before `o_proj`, `[B, S, H * v]`.
    """
    lora, rope = module.kv_lora_rank, module.qk_rope_head_dim
    nope, vdim = module.qk_nope_head_dim, module.v_head_dim
    # This rank's heads: all of them, or its share where a tp_plan split kv_b_proj (colwise; the
    # weight is then a DTensor whose local shard holds this rank's heads).
    weight = module.kv_b_proj.weight
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    heads = local.shape[0] // (nope + vdim)
    w = local.view(heads, nope + vdim, lora)
    w_uk, w_uv = w[:, :nope], w[:, nope:]
    q_abs = torch.einsum("bhsn,hnc->bshc", q_pass, w_uk)                           # [B, S, H, lora]
    query = torch.cat([q_abs, q_rot.transpose(1, 2)], dim=-1)                      # [B, S, H, lora + rope]
    latent = kv[..., :lora + rope]
    scores = torch.matmul(query, latent.transpose(-1, -2)) * module.scaling       # [B, S, H, K]
    scores = scores.masked_fill(~valid.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    probs = torch.nan_to_num(probs, nan=0.0).to(query.dtype)                       # queries with no entry: padding
    out_latent = torch.matmul(probs, latent[..., :lora])                           # [B, S, H, lora]
    out = torch.einsum("bshc,hvc->bshv", out_latent, w_uv)                         # [B, S, H, v]
    return out.reshape(out.shape[0], out.shape[1], heads * vdim)


#: Why a model with hisparse enabled is not copied (`copy.deepcopy`, `pickle`, `torch.save`): its
#: patched layers and hooks hold the engine, whose host pool and device caches have one owner.
NO_COPY = ("a model with hisparse enabled cannot be copied or pickled (copy.deepcopy, pickle, torch.save): its patched "
           "attention layers and hooks hold the hisparse engine (host pool, device caches); expected hs.close() or "
           "hisparse_transformers.disable(model) first, then enable each copy on its own (save_pretrained works "
           "while enabled)")


class HiSparseAttention:
    """The per-instance forward of one patched attention module (see the module docstring)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise InvalidInputError(NO_COPY)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise InvalidInputError(NO_COPY)

    @staticmethod
    def live_patch(module: Any) -> HiSparseAttention | None:
        """The patch of an engine still open on `module`, in either slot `__init__` may take, or None."""
        for slot in ("forward", "_old_forward"):
            found = module.__dict__.get(slot)
            if isinstance(found, HiSparseAttention) and not found.engine.closed:
                return found
        return None

    def __init__(self, module: Any, layout: DsaLayout, engine: HiSparseEngine, layer: int,
                 checker: ExactnessChecker | None = None) -> None:
        self.module = module  # one of layout.attentions: its projections and sizes are read by name
        # Where accelerate hooked the module (a device_map down to the attention), its hook moves the
        # inputs to the layer's device and then calls `_old_forward`: that is what gets replaced.
        hooked = getattr(module, "_hf_hook", None) is not None and "_old_forward" in module.__dict__
        self.slot = "_old_forward" if hooked else "forward"
        self.original: Callable[..., Any] = getattr(module, self.slot)
        self.layout = layout
        self.engine = engine
        self.layer = layer
        self.checker = checker  # enable(check=True): every row this layer reads is compared
        self.group, self.position = layout.group_of(layer)
        self.rope = layout.modeling.apply_rotary_pos_emb_interleave

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if not isinstance(cache, HiSparseCache) or cache.hisparse_engine is not self.engine:
            return self.original(*args, **kwargs)
        names = ("hidden_states", "position_embeddings", "attention_mask")
        given = dict(zip(names, args, strict=False))
        # The model's own call arguments, passed through as the model gave them.
        hidden: Any = kwargs.get("hidden_states", given.get("hidden_states"))
        position_embeddings: Any = kwargs.get("position_embeddings", given.get("position_embeddings"))
        attention_mask: Any = kwargs.get("attention_mask", given.get("attention_mask"))
        return self.forward(cache, hidden, position_embeddings, attention_mask, kwargs.get("position_ids"),
                            kwargs.get("prev_topk_indices"))

    def forward(self, cache: HiSparseCache, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor, position_ids: torch.Tensor | None,
                prev_topk: torch.Tensor | None) -> Any:
        m, engine = self.module, self.engine
        session = cache.session
        step = session.step if session is not None else None
        if session is None or step is None:
            raise HiSparseError(f"layer {self.layer}: a HiSparseCache forward outside a hisparse step (call the model "
                                "itself, not its decoder layers)")
        step = engine.local_step(step, self.group)  # its tensors on this layer's device
        b, s = hidden.shape[:2]
        q_resid = m.q_a_layernorm(m.q_a_proj(hidden))
        q = m.q_b_proj(q_resid).view(b, s, -1, m.qk_head_dim).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        compressed = m.kv_a_proj_with_mqa(hidden)
        kv_pass, k_rot = torch.split(compressed, [m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        k_pass = m.kv_a_layernorm(kv_pass).view(b, 1, s, m.kv_lora_rank)
        k_rot = k_rot.view(b, 1, s, m.qk_rope_head_dim)
        cos, sin = position_embeddings
        q_rot, k_rot = self.rope(q_rot, k_rot, cos, sin)
        latent = torch.cat([k_pass, k_rot], dim=-1).view(b * s, -1)                 # the rows cache.update gets
        engine.write_rows(self.group, self.position, latent)
        checker = self.checker
        if checker is not None:
            checker.record(self.layer, session, step, latent.view(b, s, -1))

        if self.position == 0:
            model = engine.topk_model
            if model is not None and model.filled(step):
                # Benchmarks: the choice comes from the locality model (`model_topk.py`). The
                # indexer runs unless `run_indexer` is off (its cost measured by leaving it out).
                if model.run_indexer:
                    m.indexer(hidden, q_resid, position_embeddings, attention_mask[:, 0, :, :], position_ids, cache)
                topk = model.take(self.group, b)
            else:
                topk = m.indexer(hidden, q_resid, position_embeddings, attention_mask[:, 0, :, :], position_ids, cache)
            if checker is not None:
                checker.check_topk(self.layer, session, step, m.indexer,
                                   (hidden, q_resid, position_embeddings, attention_mask[:, 0, :, :], position_ids),
                                   topk)
        else:
            if prev_topk is None:
                raise HiSparseError(f"layer {self.layer} shares its index group's top-k but got no prev_topk_indices")
            topk = prev_topk
        cached = step.group_cache.get(self.group)
        if engine.is_resident(self.group):
            rmap = _resident_rows(engine, step, topk) if self.position == 0 or cached is None else cached
            if engine.prefetch is not None and self.position == 0 and (s == 1 or step.verify):
                # no resolve here, but the next group's prefetch runs on this group's top-k all the same
                engine.prefetch.launch(step, self.group, rmap.positions.reshape(b * s, -1).to(torch.int32))
        elif s == 1 or step.verify:
            rmap = _decode_rows(engine, step, self.group, self.position, topk, cached)
        elif self.position == 0 or cached is None:
            rmap = _prefill_rows(engine, step, self.group, topk)
        else:
            rmap = cached
        if self.position == 0:
            step.group_cache[self.group] = rmap
        kv = _gather(engine, self.group, self.position, rmap)
        if checker is not None:
            checker.check(self.layer, session, kv, rmap)
        out = m.o_proj(absorbed_attention(m, q_pass, q_rot, kv, rmap.valid))
        if self.layout.returns_topk:
            return out, None, topk
        return out, None
