"""`enable(model, ...)`: one call that makes a loaded DSA model decode through hisparse.

After it, plain `model.generate(...)` runs through hisparse: the instance's `generate` hands
transformers' own generate a fresh `HiSparseCache` (and, unless the call or a generation config
sets one, `prefill_chunk_size`, so transformers' chunked prefill builds only `[chunk, T]` masks).
A `HiSparseCache` from `handle.new_cache()` may also be passed explicitly; any other cache (say a
`DynamicCache`), a forward without a cache and `generate(use_cache=False)` run the model's own attention, unchanged.
What a cache cannot serve is refused with one line before anything runs: `use_cache=False` with a
`HiSparseCache`, `output_attentions=True` (hisparse attends to the top-k rows only: no weights over
the context exist), `cache_implementation` (transformers would build its own cache). Each attention module is patched per instance
(`HiSparseAttention`), and a forward pre/post hook on the base model makes every forward one
hisparse engine step.

`handle.close()` (or leaving its `with` block, or `disable(model)`) restores the model and
releases the host pool.
"""

from __future__ import annotations

import copy
import inspect
import logging
import os
import time
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hisparse_core.backend import Backend
from hisparse_core.checks import as_index
from hisparse_core.errors import BackendError, HiSparseError, InvalidInputError
from hisparse_core.registry import ENV_BACKEND, get_registry, is_auto, select_backend
from hisparse_transformers.assisted import AssistedPlan, assisted_plan
from hisparse_transformers.attention import NO_COPY, HiSparseAttention
from hisparse_transformers.cache import HiSparseCache
from hisparse_transformers.check import ExactnessChecker
from hisparse_transformers.engine import EngineConfig, HiSparseEngine, resident_groups
from hisparse_transformers.families import DsaLayout, detect
from hisparse_transformers.graphs import DecodeGraphs
from hisparse_transformers.index_keys import check_key_format, quant_block
from hisparse_transformers.kv_rows import LatentRows
from hisparse_transformers.ranks import tensor_parallel
from hisparse_transformers.session import StepState
from hisparse_transformers.shards import place
from hisparse_transformers.stats import HiSparseStats
from hisparse_transformers.version import cache_kwarg, check_version

logger = logging.getLogger(__name__)

_ATTR = "_hisparse_handle"

#: Called after each engine step with (handle, step): for progress bars and tests.
StepCallback = Callable[["HiSparseHandle", StepState], None]


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _backend_env() -> bool:
    """Whether `HISPARSE_BACKEND` names a backend (unset, blank and `auto` leave the choice automatic)."""
    value = os.environ.get(ENV_BACKEND, "").strip()
    return bool(value) and not is_auto(value)


def _auto_backend_on(device: torch.device) -> Backend:
    """Automatic selection for a model on `device`: the highest-priority available backend that runs
    there (a CPU model on a GPU machine gets a CPU backend, not the GPU's); the log says which and
    why. `BackendUnavailableError` as `select_backend` where none is available at all."""
    first = select_backend(None)  # the registry's own automatic choice, logged as such
    if _same_device(torch.device(first.device), device):
        return first
    ranked = get_registry().choose(None).candidates
    skipped: list[str] = [f"{first.name} (runs on {first.device})"]
    for entry in ranked:
        if entry.name == first.name:
            continue
        try:
            candidate = select_backend(entry.name)
        except InvalidInputError:
            raise  # a bad setting of the backend's own (its check_settings): the user's to fix, not passed over
        except HiSparseError as exc:
            skipped.append(f"{entry.name} ({exc})")
            continue
        if _same_device(torch.device(candidate.device), device):
            if skipped:
                logger.info("hisparse: automatic backend for a model on %s: %s (passed over: %s)", device,
                            entry.name, "; ".join(skipped))
            return candidate
        skipped.append(f"{entry.name} (runs on {candidate.device})")
    return select_backend(None)  # none runs there: enable() names the mismatch


def left_padding(attention_mask: torch.Tensor) -> list[int]:
    """Left padding of each row of a 2-D 0/1 mask; `InvalidInputError` if a row is not left-padded."""
    mask = attention_mask.detach().to("cpu")
    # a float mask keeps its values: cast to ints, 0.5 would read as padding (transformers attends to it)
    mask = mask.to(torch.float64 if mask.is_floating_point() else torch.int64)
    if mask.dim() != 2:
        raise InvalidInputError(f"attention_mask has shape {tuple(mask.shape)}; expected [batch, tokens]")
    pads = []
    for b, row in enumerate(mask.tolist()):
        pad = next((i for i, v in enumerate(row) if v), len(row))
        # named by column, not printed whole: a row is as long as the prompt
        odd = next((i for i, v in enumerate(row) if v not in (0, 1)), None)
        gap = next((i for i, v in enumerate(row[pad:], pad) if v == 0), None)
        if odd is not None or gap is not None:
            what = (f"holds {row[odd]} at column {odd}" if odd is not None else
                    f"has a 0 at column {gap} after a 1 at column {pad} (of {len(row)})")
            raise InvalidInputError(f"attention_mask row {b} {what}; expected left padding (zeros, then ones): "
                                    "hisparse strips left padding only (tokenizer padding_side='left')")
        pads.append(pad)
    return pads


def rope_offsets(position_ids: torch.Tensor, pads: Sequence[int], width: int) -> list[int | None]:
    """Per row of a batch's first forward (`width` columns, the row's tokens from column `pads[b]`):
    the rope position of its first token where its tokens there take consecutive positions (0 where
    they are its logical ones, as generate's are), else None (not one offset; or no token of the
    row in this forward). A host read of the positions, once per batch."""
    pos = position_ids.detach().to("cpu", torch.int64)
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    if pos.dim() != 2 or pos.shape[1] != width or pos.shape[0] not in (1, len(pads)):
        return [None] * len(pads)
    out: list[int | None] = []
    for b, pad in enumerate(pads):
        row = pos[b if pos.shape[0] > 1 else 0, pad:]
        first = int(row[0]) if row.numel() else None
        out.append(first if first is not None and torch.equal(row, first + torch.arange(row.numel())) else None)
    return out


def moved_rope(position_ids: torch.Tensor | None, pads: Sequence[int], past: int, width: int,
               offsets: Sequence[int | None]) -> str | None:
    """Why a forward after a batch's first (`width` columns from padded position `past`) ropes a
    row's tokens other than from `offsets[b]` (`rope_offsets` of the first forward), else None.
    None position_ids: the model's default, the padded positions (offset `pads[b]`). Rows of offset
    None share no page and are not checked. A host read of the positions when they are given."""
    rows = [(b, pad, off) for b, (pad, off) in enumerate(zip(pads, offsets, strict=True))
            if off is not None and past + width > pad]
    if not rows:
        return None
    if position_ids is None:
        return next((f"row {b}'s tokens are roped from position {pad} (no position_ids: the padded positions)"
                     f" but the batch's first forward roped them from {off}" for b, pad, off in rows if pad != off),
                    None)
    pos = position_ids.detach().to("cpu", torch.int64)
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    if pos.dim() != 2 or pos.shape[1] != width or pos.shape[0] not in (1, len(pads)):
        return f"position_ids of shape {tuple(position_ids.shape)} are not one per row and token of this forward"
    for b, pad, off in rows:
        c0 = max(0, pad - past)
        row = pos[b if pos.shape[0] > 1 else 0, c0:]
        logical = past + c0 - pad + torch.arange(row.numel())
        bad = (row != off + logical).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            return (f"row {b}'s token at logical position {int(logical[i])} is roped at {int(row[i])}, but the "
                    f"batch's first forward roped that row from {off} (expected {off + int(logical[i])})")
    return None


def _weights_seen(model: torch.nn.Module) -> tuple[tuple[int, int, int], ...]:
    """Each parameter's identity, version counter (bumped by every in-place update: load_state_dict,
    an optimizer step, ops under no_grad) and storage: a change means rows computed before are not
    the model's now. Updates through `.data`, and those of a parameter made under inference_mode
    (it has no version counter), bypass the counter and are not seen."""
    return tuple((id(p), 0 if p.is_inference() else p._version, p.data_ptr()) for p in model.parameters())


def _check_prompt_tensors(where: str, input_ids: object, attention_mask: object, *, wider_mask: bool = False) -> None:
    """One line for prompts hisparse cannot read: `input_ids` not a 2-D tensor of token ids (an
    integer dtype) with a token a row, or an `attention_mask` (None: none) that is not a tensor of
    one row per prompt and a column per token (`wider_mask`: at least one, as generate tolerates)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        got = (f"input_ids of shape {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor) else
               "no input_ids" if input_ids is None else f"input_ids of type {type(input_ids).__name__}")
        raise InvalidInputError(f"{where} got {got}; expected a tensor of token ids of shape [batch, tokens] with at "
                                "least one prompt token a row")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise InvalidInputError(f"{where} got input_ids of dtype {input_ids.dtype}; expected token ids of an integer "
                                "dtype (torch.long)")
    if attention_mask is None:
        return
    shape = tuple(input_ids.shape)
    if not isinstance(attention_mask, torch.Tensor):
        raise InvalidInputError(f"{where} got an attention_mask of type {type(attention_mask).__name__}; expected a "
                                f"tensor of shape {shape}, as input_ids")
    given = tuple(attention_mask.shape)
    if len(given) != 2 or given[0] != shape[0] or (given[1] < shape[1] if wider_mask else given[1] != shape[1]):
        raise InvalidInputError(f"{where} got an attention_mask of shape {given} for input_ids of shape {shape}; "
                                f"expected an attention_mask of shape {shape} (one 0/1 a prompt token, left-padded)")


def _refuse_empty_rows(pads: Sequence[int], width: int) -> None:
    """One line for a prompt row that is all padding (generate and `new_cache` alike): a row of no
    prompt token decodes from nothing."""
    empty = next((b for b, pad in enumerate(pads) if pad >= width), None)
    if empty is not None:
        raise InvalidInputError(f"attention_mask row {empty} is all padding, so prompt row {empty} has no token; "
                                "expected at least one prompt token a row")


def _check_first_padding(mask: Any, pads: Sequence[int], num_new: int) -> None:
    """Refuse (one line) a batch's first direct forward whose attention_mask (None: no padding)
    left-pads a row otherwise than the prompts given to `new_cache` did: hisparse would attend as
    those say, the model as the mask says. A host read of a 2-D mask, once per batch."""
    if mask is None:
        got, width = [0] * len(pads), num_new
    elif isinstance(mask, torch.Tensor) and mask.dim() == 2:
        got, width = left_padding(mask), int(mask.shape[1])
    else:
        return          # a prepared mask: the model's own business
    for b, (pad, seen) in enumerate(zip(pads, got, strict=True)):
        if seen != min(pad, width):
            what = "attention_mask" if mask is not None else "forward (no attention_mask)"
            raise InvalidInputError(f"the first forward's {what} leaves row {b} {seen} columns of left padding, but "
                                    f"the prompts given to new_cache leave it {pad}; expected the same "
                                    "attention_mask for new_cache and the forwards")


def _held_spans(prompts: Sequence[Sequence[int]], pads: Sequence[int], past: int,
                width: int) -> list[tuple[int, int, int, int]]:
    """(row, first column, end column, first logical position) of each row's columns, in a forward
    of `width` columns from padded position `past`, that feed a prompt token hisparse holds already
    (`prompts[b]` left-padded by `pads[b]`); rows whose columns feed none are left out."""
    spans = []
    for b, (p, pad) in enumerate(zip(prompts, pads, strict=True)):
        lo, hi = max(0, pad - past), min(width, pad + len(p) - past)
        if hi > lo:
            spans.append((b, lo, hi, past + lo - pad))
    return spans


def _check_prompt_tokens(input_ids: torch.Tensor | None, prompts: Sequence[Sequence[int]], pads: Sequence[int],
                         past: int) -> None:
    """Refuse (one line) a direct forward whose `input_ids` (columns from padded position `past`)
    feed a position whose token hisparse holds already (`prompts[b]`: the prompts given to
    `new_cache`, or a batch's recorded tokens) another token: hisparse records and publishes the
    prompt's pages under the tokens it holds, so a later batch sharing them would take this
    forward's rows as theirs. A host read of the ids, only for forwards that reach into those
    tokens (never a decode step past them)."""
    if input_ids is None or input_ids.dim() != 2:
        return
    spans = _held_spans(prompts, pads, past, int(input_ids.shape[1]))
    if not spans:
        return
    ids = input_ids.detach().to("cpu", torch.int64)
    for b, lo, hi, start in spans:
        want = torch.tensor(prompts[b][start:start + hi - lo], dtype=torch.int64)
        bad = (ids[b, lo:hi] != want).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            raise InvalidInputError(f"the forward's input_ids feed row {b}'s prompt token at logical position "
                                    f"{start + i} as {int(ids[b, lo + i])}, but the prompts given to new_cache have "
                                    f"{int(want[i])} there; expected the same input_ids for new_cache and the "
                                    "forwards (hisparse publishes the prompt's pages under new_cache's tokens)")


def _check_prompt_embeds(embeds: Any, embedding: Any, prompts: Sequence[Sequence[int]], pads: Sequence[int],
                         past: int) -> None:
    """As `_check_prompt_tokens`, for a direct forward given `inputs_embeds` (no input_ids): over the
    positions whose token hisparse holds, they must be the model's own embeddings of those tokens
    (`embedding`, its input embedding module), since the rows they give are published under them.
    One embedding lookup and a host read of the verdict, only for forwards that reach into them."""
    if not isinstance(embeds, torch.Tensor) or embeds.dim() != 3 or not callable(embedding):
        return
    for b, lo, hi, start in _held_spans(prompts, pads, past, int(embeds.shape[1])):
        want = embedding(torch.tensor(prompts[b][start:start + hi - lo], dtype=torch.int64, device=embeds.device))
        if want.shape != embeds[b, lo:hi].shape or not torch.equal(want.to(embeds.dtype), embeds[b, lo:hi]):
            raise InvalidInputError(f"the forward's inputs_embeds for row {b}'s prompt positions {start}-"
                                    f"{start + hi - lo - 1} are not the model's embeddings of the prompts given to "
                                    "new_cache; expected those embeddings, or input_ids (hisparse publishes the "
                                    "prompt's pages under new_cache's tokens)")


class HiSparseHandle:
    """What `enable` returns: the engine of one model, its patches and its statistics."""

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise InvalidInputError(NO_COPY)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise InvalidInputError(NO_COPY)

    def __init__(self, model: torch.nn.Module, layout: DsaLayout, engine: HiSparseEngine,
                 cuda_graphs: bool | None = None, checker: ExactnessChecker | None = None) -> None:
        self.model: Any  # a transformers model: its generate is read and patched per instance
        self.model = model
        self.layout = layout
        self.engine = engine
        self.checker = checker  # enable(check=True): handed to every patched attention layer
        self.on_step: StepCallback | None = None
        self.generate_seconds = 0.0
        self._attn = [HiSparseAttention(m, layout, engine, i, checker) for i, m in enumerate(layout.attentions)]
        if checker is not None:
            engine.rollback_listeners.append(checker.rollback)
        self._base = getattr(model, "base_model", model)
        self._weight = layout.attentions[0].kv_a_proj_with_mqa.weight   # its dtype is the engine's (enable)
        self.graphs = DecodeGraphs(engine, cuda_graphs, model, checking=checker is not None)
        self.cache_kwarg = cache_kwarg(model)
        self._hooks: list[Any] = []
        self._held: dict[tuple[int, str], Any] = {}         # what the instances held before `_install`
        self._installed: dict[str, Any] = {}                # what `_install` put on the base model and the model
        self._generate: Callable[..., Any] | None = None
        self._warned_own_cache = False    # `_note_own_cache`: its WARNING is logged once a handle
        self._said_no_cache = False       # generate(use_cache=False): its INFO line is logged once a handle
        self._weights = _weights_seen(model)
        self.closed = False
        self._install()

    # ------------------------------------------------------------------ patches

    def _install(self) -> None:
        # what the instances held before (an accelerate hook's forward, a caller's own generate): put back at close
        self._held = {(id(obj), name): obj.__dict__[name] for obj, name in
                      [(a.module, a.slot) for a in self._attn] + [(self._base, "forward"), (self.model, "generate")]
                      if name in obj.__dict__}
        for a in self._attn:
            setattr(a.module, a.slot, a)
        original = self._base.forward

        def base_forward(*args: Any, **kwargs: Any) -> Any:
            cache = self._cache_of(kwargs)
            if cache is None:
                self._note_own_cache(kwargs)
                return original(*args, **kwargs)
            if cache.split_forward:
                return self._split_forward(original, cache, kwargs)
            return self.graphs.forward(original, cache, args, kwargs)

        self._base.forward = self._installed["forward"] = base_forward
        self._hooks.append(self._base.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
        self._hooks.append(self._base.register_forward_hook(self._post_forward, with_kwargs=True))
        if hasattr(self.model, "generate"):
            self._generate = self.model.generate
            self.model.generate = self._installed["generate"] = types.MethodType(_patched_generate, self.model)
        setattr(self.model, _ATTR, self)

    def _note_own_cache(self, kwargs: dict[str, Any]) -> None:
        """One WARNING (once a handle) where hisparse was enabled on a model with no `generate` (the
        base model inside a ...ForCausalLM) and a forward brings a cache of its own: the generate of
        the model around it builds a DynamicCache, which the base model cannot tell from one a caller
        passes to run the model's own attention, and nothing holds the model around it to patch its
        generate. So that generate runs without hisparse; the warning names the model to enable."""
        if self._warned_own_cache or "generate" in self._installed:
            return
        given = kwargs.get("cache", kwargs.get("past_key_values"))
        if given is None or isinstance(given, HiSparseCache):
            return
        self._warned_own_cache = True
        name = type(self.model).__name__
        outer = f"{name[:-len('Model')]}ForCausalLM" if name.endswith("Model") else "the ...ForCausalLM around it"
        logger.warning("hisparse: a forward of %s brought its own cache (%s), so it ran the model's own attention and "
                       "nothing went through hisparse: hisparse was enabled on %s, which has no generate, and the "
                       "generate of a model around it builds its own cache; expected enable() on the model whose "
                       "generate you call (the %s, not its .model), or hs.new_cache() passed to each forward",
                       name, type(given).__name__, name, outer)

    def _restore(self, obj: Any, name: str) -> None:
        """Put back the instance attribute `name` of `obj` as it was before `_install` (none: deleted)."""
        held = self._held.get((id(obj), name))
        if held is not None:
            setattr(obj, name, held)
        elif name in obj.__dict__:
            delattr(obj, name)

    def _uninstall(self) -> None:
        for a in self._attn:
            if a.module.__dict__.get(a.slot) is a:
                self._restore(a.module, a.slot)
        if self._base.__dict__.get("forward") is self._installed.get("forward"):
            self._restore(self._base, "forward")
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if "generate" in self._installed and self.model.__dict__.get("generate") is self._installed["generate"]:
            self._restore(self.model, "generate")
        if getattr(self.model, _ATTR, None) is self:
            delattr(self.model, _ATTR)

    # ------------------------------------------------------------------ the step hooks

    def _cache_of(self, kwargs: dict[str, Any]) -> HiSparseCache | None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        return cache if isinstance(cache, HiSparseCache) and cache.hisparse_engine is self.engine else None

    def _pre_forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        cache = self._cache_of(kwargs)
        if cache is None:
            return
        if _wants_attentions(module, kwargs):
            raise InvalidInputError(_NO_ATTENTIONS)
        if self._weight.dtype != self.engine.dtype:
            raise InvalidInputError(f"the model's weights are {self._weight.dtype} now, but hisparse was enabled on it "
                                    f"in {self.engine.dtype} (its KV stores and row format are that dtype's); expected "
                                    f"model.to({self.engine.dtype}) back, or hs.close() and enable again after the cast")
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        embeds: Any = kwargs.get("inputs_embeds")
        shape = input_ids.shape if input_ids is not None else embeds.shape
        mask = kwargs.get("attention_mask")
        # Assisted generation's first forward is the whole prompt and its first candidates (transformers
        # does not chunk it): `_split_forward` runs it as prefill-chunk engine steps, then one step of
        # the candidates (so a rollback of rejected ones stays inside the last step).
        cache.split_forward = (cache.assisted and cache.session is None and cache.prompts is not None and not args
                               and input_ids is not None and input_ids.dim() == 2
                               and (mask is None or (isinstance(mask, torch.Tensor) and mask.dim() == 2))
                               and int(shape[1]) > min(self.engine.config.prefill_chunk, cache.prompt_width))
        if not cache.split_forward:
            self._begin(cache, input_ids, kwargs, int(shape[0]), int(shape[1]))

    def _begin(self, cache: HiSparseCache, input_ids: torch.Tensor | None, kwargs: dict[str, Any], batch: int,
               num_new: int) -> None:
        """Open the batch's session at its first forward, then begin the engine step of `num_new` tokens."""
        opened, offsets_before = cache.session is None, cache.rope_offsets
        if not cache.generating and (cache.session is not None or cache.prompts is not None):
            # the tokens the engine holds for positions not computed yet: the rest of the prompts
            held: tuple[Sequence[Sequence[int]], Sequence[int], int] = (
                ([r.tokens for r in cache.session.requests], [r.pad for r in cache.session.requests],
                 cache.session.padded_len) if cache.session is not None else (*cache.prompts, 0))  # type: ignore[misc]
            if input_ids is not None:
                _check_prompt_tokens(input_ids, *held)
            else:
                embedding = getattr(self.model, "get_input_embeddings", None)
                with torch.no_grad():
                    _check_prompt_embeds(kwargs.get("inputs_embeds"), embedding() if callable(embedding) else None,
                                         *held)
        if cache.session is None:
            if cache.prompts is not None:
                prompts, pads = cache.prompts
            else:
                if input_ids is None:
                    raise InvalidInputError("the first forward with a HiSparseCache needs input_ids (or go through "
                                            "model.generate, which passes the prompts)")
                _check_prompt_tensors("the first forward with a HiSparseCache", input_ids, None)
                mask = kwargs.get("attention_mask")
                pads = left_padding(mask) if isinstance(mask, torch.Tensor) and mask.dim() == 2 else [0] * batch
                if any(pad >= num_new for pad in pads):
                    raise InvalidInputError("a row of the first forward is all padding, so its prompt is unknown; "
                                            "pass the prompts: handle.new_cache(input_ids, attention_mask)")
                rows = input_ids.detach().to("cpu").tolist()
                prompts = [row[pad:] for row, pad in zip(rows, pads, strict=False)]
            if len(prompts) != batch:
                raise InvalidInputError(f"the forward has {batch} rows but the batch has {len(prompts)} prompts; "
                                        "hisparse runs one request per row (num_beams=1, num_return_sequences=1)")
            if cache.prompts is not None and not cache.generating:
                _check_first_padding(kwargs.get("attention_mask"), pads, num_new)
            weights = _weights_seen(self.model)
            if weights != self._weights:
                self._weights = weights
                self.engine.weights_epoch += 1
                logger.info("hisparse: the model's weights changed since its last batch (a parameter updated in place "
                            "or replaced): pages published before are no prefix hits for later batches")
            # A row's latent carries its rope position: its pages are shared only with rows roped alike.
            offsets = cache.rope_offsets
            if offsets is None:
                pos = kwargs.get("position_ids")
                # the model's default positions are the padded ones (its cache's length + arange)
                offsets = list(pads) if pos is None else rope_offsets(pos, pads, num_new)
            cache.session = self.engine.open_session(prompts, pads, cache.max_new_tokens, cache.candidates,
                                                     rope_offsets=offsets)
            cache.rope_offsets = list(offsets)
            cache.session.owner = weakref.ref(cache)
            cache.session.speculative = cache.assisted
            cache.session.direct = not cache.generating
        elif cache.session.batch_size != batch:
            raise InvalidInputError(f"the forward has {batch} rows; this cache's batch has {cache.session.batch_size}")
        elif not cache.generating and cache.rope_offsets is not None and not cache.session.closed:
            # Pages are published under the rope offset of the batch's first forward: a direct forward
            # roping a row from another would publish rows roped elsewhere under it (generate's
            # positions follow the first forward's: transformers extends them by one a token).
            moved = moved_rope(kwargs.get("position_ids"), [r.pad for r in cache.session.requests],
                               cache.session.padded_len, num_new, cache.rope_offsets)
            if moved is not None:
                raise InvalidInputError(f"a direct forward that changes a row's rope offset mid-batch: {moved}; "
                                        "expected each forward of a batch to rope its rows as the first did (the "
                                        "same position_ids scheme), or a fresh cache")
        try:
            self.engine.begin_step(cache.session, input_ids, num_new)
        except BaseException:
            if opened:
                # The batch's first step was refused or failed to start: it never ran, so the batch
                # this forward opened is undone (its requests, their leases and blocks, the totals).
                session, cache.session, cache.rope_offsets = cache.session, None, offsets_before
                self.engine.discard_session(session)
            raise

    def _post_forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                      output: Any) -> None:
        cache = self._cache_of(kwargs)
        if cache is None or cache.session is None:
            return
        if cache.split_forward:
            cache.split_forward = False       # its steps ended in `_split_forward`
            return
        self._end(cache)

    def _end(self, cache: HiSparseCache) -> None:
        assert cache.session is not None
        step = cache.session.step
        self.engine.end_step(cache.session)
        if step is not None:
            cache.advance(step.num_new)
            if self.on_step is not None:
                self.on_step(self, step)

    def _split_forward(self, original: Callable[..., Any], cache: HiSparseCache, kwargs: dict[str, Any]) -> Any:
        """One forward longer than `prefill_chunk`, run as engine steps of `prefill_chunk` tokens
        (as transformers' chunked prefill would feed them); the chunks' hidden states are joined."""
        ids: torch.Tensor = kwargs["input_ids"]
        mask = kwargs.get("attention_mask")
        pos = kwargs.get("position_ids")
        chunk = self.engine.config.prefill_chunk
        past = cache.get_seq_length()
        width = min(cache.prompt_width, ids.shape[1])
        bounds = [(a, min(width, a + chunk)) for a in range(0, width, chunk)]
        if width < ids.shape[1]:
            bounds.append((width, ids.shape[1]))
        outputs: list[Any] = []
        try:
            for a, b in bounds:
                kw = dict(kwargs, input_ids=ids[:, a:b])
                if mask is not None:
                    kw["attention_mask"] = mask[:, :past + b]
                if pos is not None:
                    kw["position_ids"] = pos[..., a:b]
                self._begin(cache, kw["input_ids"], kw, ids.shape[0], b - a)
                outputs.append(original(**kw))
                self._end(cache)
        except BaseException:
            cache.split_forward = False       # the post-forward hook does not run after a failure
            raise
        out = outputs[-1]
        out["last_hidden_state"] = torch.cat([o.last_hidden_state for o in outputs], dim=1)
        if getattr(out, "hidden_states", None) is not None:
            out["hidden_states"] = tuple(torch.cat(parts, dim=1)
                                         for parts in zip(*(o.hidden_states for o in outputs), strict=True))
        return out

    # ------------------------------------------------------------------ user API

    def new_cache(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                  max_new_tokens: int | None = None) -> HiSparseCache:
        """A fresh cache for one generate. For direct forwards, give the batch's prompt `input_ids`
        (and left-padded `attention_mask`) here, run the forwards, then call `cache.finish()`;
        `max_new_tokens` (tokens fed after the prompt, plus one) bounds the host blocks admission
        asks for (None: every row up to `max_context`)."""
        self._require_open()
        if max_new_tokens is not None:
            new = as_index(max_new_tokens)        # a numpy integer or a 0-dim integer tensor is one
            if new is None or new < 0:
                raise InvalidInputError(f"max_new_tokens must be an int >= 0 or None, got {max_new_tokens!r}")
            max_new_tokens = new
        if input_ids is not None or attention_mask is not None:
            _check_prompt_tensors("new_cache", input_ids, attention_mask)
        cache = HiSparseCache(self.engine, self.model.config)
        if input_ids is not None:
            pads = left_padding(attention_mask) if attention_mask is not None else [0] * input_ids.shape[0]
            _refuse_empty_rows(pads, int(input_ids.shape[1]))
            rows = input_ids.detach().to("cpu").tolist()
            cache.set_prompts([row[pad:] for row, pad in zip(rows, pads, strict=False)], pads, max_new_tokens)
        return cache

    def stats(self) -> HiSparseStats:
        """Totals since `enable` (reads the device counters: not for the decode path)."""
        e = self.engine
        t = e.collect()
        cs = e.coordinator.stats()
        w = t.worker
        checker = self.checker
        union = [int(v) for v in e.union_counts.tolist()]
        return HiSparseStats(
            backend=e.backend.name, device=", ".join(str(d) for d in e.placement.devices), requests=t.requests, prefix_hit_tokens=t.prefix_hit_tokens,
            prefill_tokens=t.prefill_tokens, decode_tokens=t.decode_tokens,
            prefill_tokens_per_s=t.prefill_tokens / t.prefill_seconds if t.prefill_seconds else 0.0,
            decode_tokens_per_s=t.decode_tokens / t.decode_seconds if t.decode_seconds else 0.0,
            resident=w["resident"], hits=w["hits"], misses=w["misses"], h2d_bytes=w["h2d_bytes"],
            prefill_host_bytes=t.prefill_host_rows * e.fmt.row_bytes, d2h_bytes=w["d2h_bytes"], spills=cs.spills,
            released_pages=cs.released_pages, lost_pages=cs.lost_pages,
            gpu_kv_bytes_per_request=t.peak_blocks_per_request * e.block_bytes,
            gpu_kv_bytes_per_request_all_resident=t.peak_all_resident_blocks_per_request * e.block_bytes,
            indexer_bytes_per_request=t.peak_indexer_bytes_per_request, gpu_pool_bytes=e.gpu_blocks * e.block_bytes,
            host_pool_bytes=sum(w.host_pool_spec.nbytes for w in e.workers) if not e.closed else 0,
            checked_entries=checker.totals.entries if checker else 0,
            checked_max_abs_diff=checker.totals.max_abs_diff if checker else 0.0, decode_mode=self.graphs.mode,
            graph_captures=self.graphs.captures, checked_topk_queries=checker.totals.topk_queries if checker else 0,
            checked_topk_ties=checker.totals.topk_ties if checker else 0,
            checked_topk_boundary_ties=checker.totals.topk_boundary_ties if checker else 0,
            checked_topk_near_ties=checker.totals.topk_near_ties if checker else 0, verify_steps=t.verify_steps,
            verify_rows=t.verify_rows, union_entries=union[0], union_shared_entries=union[0] - union[1],
            rollbacks=t.rollbacks, rolled_back_tokens=t.rolled_back_tokens, resident_layers=e.resident_layers,
            resident_store_bytes=e.resident_bytes, prefetch_misses=sum(t.prefetch_misses),
            prefetch_h2d_bytes=sum(n * len(e.layout.groups[g]) * e.fmt.row_bytes for g, n in enumerate(t.prefetch_misses)),
            kv_rows=e.rows.kind, row_format=e.fmt.name, row_bytes=e.fmt.row_bytes)

    def close(self) -> None:
        """Restore the model and release the host pool. Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            self._uninstall()
        finally:
            self.engine.close()

    def __enter__(self) -> HiSparseHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _require_open(self) -> None:
        if self.closed:
            raise InvalidInputError("this hisparse handle was closed; call enable() again")


def _prompt_mask(model: torch.nn.Module, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """The attention mask generate would infer when none is given (padding tokens, unless pad ==
    eos), from the settings as generate resolves them (the call's, its generation_config's, the model's)."""
    pad = _setting(model, kwargs, "pad_token_id")
    eos = _setting(model, kwargs, "eos_token_id")
    eos_ids = set(eos if isinstance(eos, Sequence) else [eos]) if eos is not None else set()
    if pad is not None and pad not in eos_ids and bool((input_ids == pad).any()):
        return (input_ids != pad).to(torch.long)
    return torch.ones_like(input_ids, dtype=torch.long)


_NO_ATTENTIONS = ("output_attentions=True is not supported with hisparse: its attention reads only each query's "
                  "top-k rows, so there is no attention matrix over the context to return; drop output_attentions, "
                  "or pass a DynamicCache to run the model's own attention for this call")


def _wants_attentions(module: torch.nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether this forward asks for attention weights (its kwarg, else the model config's default)."""
    asked = kwargs.get("output_attentions")
    if asked is None:
        asked = getattr(getattr(module, "config", None), "output_attentions", False)
    return bool(asked)


def _setting(model: torch.nn.Module, kwargs: dict[str, Any], name: str) -> Any:
    """A generation setting as generate resolves it: the call's kwarg, else the `generation_config`
    passed, else the model's own (None where none sets it)."""
    if kwargs.get(name) is not None:
        return kwargs[name]
    for config in (kwargs.get("generation_config"), getattr(model, "generation_config", None)):
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def _source(kwargs: dict[str, Any], name: str) -> str:
    """Where `_setting` found `name`, for a refusal: nothing for the call's own keyword."""
    if kwargs.get(name) is not None:
        return ""
    given = getattr(kwargs.get("generation_config"), name, None) is not None
    return " (from the generation_config passed)" if given else " (from model.generation_config)"


def _check_lengths(model: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """One line for a `max_new_tokens` or `max_length` (the call's, else its generation config's)
    that is not a whole number >= 1: transformers runs 2.5 as 3 tokens, which admission would
    reserve as 2 and refuse mid-generate."""
    for name in ("max_new_tokens", "max_length"):
        value = _setting(model, kwargs, name)
        if value is None:
            continue
        whole = _whole(value)
        if whole is None or whole < 1:
            raise InvalidInputError(f"{name}={value!r}: expected an int >= 1")


def _whole(value: object) -> int | None:
    """`value` as the int transformers reads it as (an int, a whole float, a numpy integer or a
    one-element integer tensor), else None (a bool, a fraction, anything else)."""
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    return as_index(value)


def _prefill_chunk(handle: HiSparseHandle, model: torch.nn.Module, kwargs: dict[str, Any], width: int) -> int | None:
    """The `prefill_chunk_size` this generate hands transformers: the one it sets, as generate
    resolves it (the call's keyword, None included: no chunking; else the generation_config
    passed, else `model.generation_config`), as a plain int (a numpy integer or an integer tensor
    is one: transformers' own split takes only ints); else `enable`'s `prefill_chunk`. One line
    for a chunk that would feed a prefill forward of more prompt tokens than `enable`'s
    `prefill_chunk`, for which the GPU pool was sized: it would fail mid-prefill, its CapacityError
    naming `prefill_chunk`, which the user did not change."""
    c = handle.engine.config
    if "prefill_chunk_size" in kwargs:
        given, source = kwargs["prefill_chunk_size"], ""    # None: the whole prompt in one forward
    else:
        given = _setting(model, kwargs, "prefill_chunk_size")
        if given is None:
            return c.prefill_chunk                          # none set: hisparse passes its own
        source = _source(kwargs, "prefill_chunk_size")
    chunk = None if given is None else as_index(given)
    if given is not None and (chunk is None or chunk < 1):
        raise InvalidInputError(f"prefill_chunk_size={given!r}{source}: expected an int >= 1, or None (no chunking)")
    cap = min(c.prefill_chunk, c.max_context)
    tokens = width if chunk is None else min(chunk, width)
    if tokens > cap:
        raise InvalidInputError(f"prefill_chunk_size={chunk!r}{source} feeds prefill forwards of {tokens} prompt "
                                f"tokens, but hisparse sized its GPU pool for {cap} (enable(..., prefill_chunk={c.prefill_chunk})): "
                                f"expected prefill_chunk_size <= {cap}, or leave it out (hisparse passes its "
                                f"prefill_chunk), or enable(..., prefill_chunk >= {tokens})")
    return chunk


def _max_new_tokens(model: torch.nn.Module, kwargs: dict[str, Any], prompt_width: int) -> int:
    """The most tokens this generate produces, as transformers resolves it: `max_new_tokens` from
    wherever it is set (it takes precedence over a `max_length` set anywhere, the call's included),
    else `max_length` minus the padded prompt, else transformers' default `max_length` (20) taken
    as new tokens, capped at the model's `max_position_embeddings`."""
    new = _setting(model, kwargs, "max_new_tokens")
    if new is not None:
        return int(new)
    length = _setting(model, kwargs, "max_length")
    if length is not None:
        return max(0, int(length) - prompt_width)
    from transformers import GenerationConfig

    defaults = getattr(GenerationConfig, "_get_default_generation_params", None)
    default = int(defaults()["max_length"]) if callable(defaults) else int(GenerationConfig().max_length or 20)
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return max(0, min(prompt_width + default, limit) - prompt_width) if limit is not None else default


def _by_name(generate: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """`generate`'s arguments with each positional one after the prompts given by its name, so that
    a `generation_config` (or `assistant_model`) passed by position is read as the keyword is; as
    they came where the names do not fit (transformers then raises its own TypeError)."""
    if len(args) < 2:
        return args, kwargs
    try:
        named = list(inspect.signature(generate).parameters.values())[1:len(args)]
    except (TypeError, ValueError):
        return args, kwargs
    if len(named) < len(args) - 1 or any(p.kind is not p.POSITIONAL_OR_KEYWORD or p.name in kwargs for p in named):
        return args, kwargs
    return args[:1], {**kwargs, **{p.name: value for p, value in zip(named, args[1:], strict=True)}}


def _patched_generate(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    handle: HiSparseHandle = getattr(model, _ATTR)
    original = handle._generate
    assert original is not None
    args, kwargs = _by_name(original, args, kwargs)
    given = kwargs.get("cache", kwargs.get("past_key_values"))
    if given is not None and not isinstance(given, HiSparseCache):
        return original(*args, **kwargs)          # the caller asked for another cache: the model's own path
    handle._require_open()
    if _setting(model, kwargs, "is_assistant") is True:
        # transformers' assisted generation calls the draft's generate once a verification step and
        # crops the cache it returned before the next: a HiSparseCache serves one generate, and the
        # first crop would fail mid-generate ("this hisparse cache's generate has finished").
        raise InvalidInputError("hisparse is enabled on this model, which runs as another model's assistant_model "
                                "(generation_config.is_assistant): transformers keeps a draft's cache across the "
                                "target's verification steps, and a hisparse cache serves one generate; expected "
                                "hisparse_transformers.disable(draft) (the draft then runs with its own DynamicCache)")
    if _setting(model, kwargs, "use_cache") is False:
        if given is not None:
            raise InvalidInputError("use_cache=False with a HiSparseCache: a generate without a cache re-feeds the "
                                    "whole sequence every step, which a cache cannot serve; drop use_cache=False "
                                    "or the cache")
        # No cache: every step recomputes the whole sequence with the model's own attention (the
        # patched layers see no HiSparseCache), so the output is the model's own; hisparse holds nothing.
        if not handle._said_no_cache:   # once a handle, not once a generate of a loop
            handle._said_no_cache = True
            logger.info("hisparse: generate(use_cache=False) keeps no KV cache, so the model's own attention runs "
                        "(nothing goes through hisparse; said once)")
        return original(*args, **kwargs)
    if _wants_attentions(model, {"output_attentions": _setting(model, kwargs, "output_attentions")}):
        raise InvalidInputError(_NO_ATTENTIONS)
    for name in ("num_beams", "num_return_sequences"):
        value = _setting(model, kwargs, name)
        if value is not None and value != 1:
            raise InvalidInputError(f"{name}={value!r}{_source(kwargs, name)}: hisparse runs one request per prompt "
                                    "row and cannot copy or reorder a request's cached rows (beam search, several "
                                    f"sequences a prompt); expected {name}=1, or pass your own cache (a DynamicCache) "
                                    "to run the model's own attention for this call")
    implementation = _setting(model, kwargs, "cache_implementation")
    if implementation not in (None, "hybrid"):        # transformers itself drops "hybrid" (a hub default)
        raise InvalidInputError(f"cache_implementation={implementation!r}{_source(kwargs, 'cache_implementation')} "
                                "asks transformers to build its own cache, but hisparse supplies the cache; drop "
                                "cache_implementation (or pass your own cache to run the model's own attention)")
    plan = assisted_plan(model, kwargs, lambda name: _setting(model, kwargs, name))
    cache = given if given is not None else handle.new_cache()
    if cache.hisparse_engine is not handle.engine or cache.session is not None:
        raise InvalidInputError("this HiSparseCache belongs to another model or was used already; pass "
                                "handle.new_cache() (one per generate)")
    kwargs.pop("cache", None)
    kwargs.pop("past_key_values", None)
    kwargs[handle.cache_kwarg] = cache
    input_ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        got = f"input_ids of shape {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor) else "no input_ids"
        raise InvalidInputError(f"hisparse generate got {got}; expected input_ids of shape [batch, tokens] "
                                "(inputs_embeds alone carry no token ids for prefix identity)")
    if input_ids.shape[1] == 0:
        raise InvalidInputError(f"hisparse generate got input_ids of shape {tuple(input_ids.shape)}; expected at least "
                                "one prompt token a row")
    _check_prompt_tensors("hisparse generate", input_ids, kwargs.get("attention_mask"), wider_mask=True)
    if kwargs.get("inputs_embeds") is not None:
        # transformers' chunked prefill (which hisparse hands the prompt to) feeds input_ids and drops
        # them, and rows computed from them would be published under input_ids' tokens anyway.
        raise InvalidInputError("hisparse generate got inputs_embeds with input_ids: hisparse identifies a prompt's "
                                "pages by its token ids (prefix hits), and transformers' chunked prefill would "
                                "feed input_ids, not the embeddings; expected input_ids alone (or pass a "
                                "DynamicCache to run the model's own attention for this call)")
    _check_lengths(model, kwargs)
    chunk = _prefill_chunk(handle, model, kwargs, int(input_ids.shape[1]))
    if plan is not None:
        _check_assisted(handle, plan, int(input_ids.shape[0]))
    mask = kwargs.get("attention_mask")
    if mask is None:
        mask = kwargs["attention_mask"] = _prompt_mask(model, input_ids, kwargs)
    pads = left_padding(mask)
    _refuse_empty_rows(pads, int(input_ids.shape[1]))
    rows = input_ids.detach().to("cpu").tolist()
    new = _max_new_tokens(model, kwargs, int(input_ids.shape[1]))
    cache.generating = True
    # generate ropes each row's tokens at their logical positions (from the mask), unless given its own
    position_ids = kwargs.get("position_ids")
    cache.rope_offsets = ([0] * len(pads) if position_ids is None
                          else rope_offsets(position_ids, pads, int(input_ids.shape[1])))
    if plan is not None:
        cache.assisted = True
    # A verification step writes up to `candidates` tokens past the last token it keeps.
    cache.set_prompts([row[pad:] for row, pad in zip(rows, pads, strict=False)], pads, new,
                      plan.candidates if plan is not None else 0)
    # The chunk resolved above (the user's, as a plain int, or enable's), where transformers reads it.
    gen = kwargs.get("generation_config")
    if "prefill_chunk_size" in kwargs or gen is None:
        kwargs["prefill_chunk_size"] = chunk
    elif not (type(getattr(gen, "prefill_chunk_size", None)) is int and gen.prefill_chunk_size == chunk):
        # on a copy of the caller's config: a kwarg beside it is a transformers deprecation warning
        gen = kwargs["generation_config"] = copy.deepcopy(gen)
        gen.prefill_chunk_size = chunk
    t0 = time.perf_counter()
    try:
        return original(*args, **kwargs)
    finally:
        handle.generate_seconds += time.perf_counter() - t0
        cache.finish()


def _check_assisted(handle: HiSparseHandle, plan: AssistedPlan, batch: int) -> None:
    """Refuse (one line) an assisted generate this engine cannot serve."""
    if batch != 1:
        raise InvalidInputError(f"assisted generation ({plan.mode}) runs one prompt at a time in transformers (it "
                                f"refuses batch_size > 1); got a batch of {batch}: call generate once per prompt")
    e = handle.engine
    spec, k = e.config.speculative_tokens, plan.candidates
    if k > spec:
        top_k, bs = e.layout.index_topk, e.config.block_size
        fits = -(-(k + 1) * top_k // bs) * bs
        raise InvalidInputError(
            f"{plan.setting}={k} asks verification steps of {k + 1} rows per request, but hisparse was enabled on "
            f"this model for at most {spec} candidate tokens (speculative_tokens={spec}, a {e.hot_rows}-row hot "
            f"buffer holding the union of {e.spec_rows} rows of top-k {top_k}): expected {plan.setting} <= {spec}, or "
            f"enable(..., speculative_tokens={k}) (a hot buffer of >= {fits} rows)")


def _prefetch_sources(value: object) -> bool | tuple[int, ...]:
    """enable's `prefetch_next_group` as EngineConfig takes it (a sequence of groups becomes a tuple;
    anything else passes through, for EngineConfig to accept or refuse in one line)."""
    if isinstance(value, list | tuple | range):
        return tuple(value)
    return value  # type: ignore[return-value]  # refused by EngineConfig unless a bool


def enable(model: torch.nn.Module, *, host_pool_gib: float, gpu_kv_gib: float, backend: str | Backend | None = "auto",
           hot_rows: int | None = None, block_size: int = 64, max_batch: int = 8, max_context: int = 4096,
           prefill_chunk: int = 512, check: bool = False, cuda_graphs: bool | None = None,
           speculative_tokens: int = 0, tp: bool | None = None, share_host_pool: bool = True,
           pool_name: str | None = None, synthetic_topk: str | None = None,
           resident_layers: str | Sequence[int] = (), prefetch_next_group: bool | Sequence[int] = False,
           synthetic_topk_layers: str | Sequence[int] | None = None, indexer_keys: str = "model",
           kv_rows: str = "model") -> HiSparseHandle:
    """Make `model` (a transformers DeepSeek-V3.2 or GLM-5 DSA model) decode through hisparse.

    :param host_pool_gib: pinned host pool for the whole KV of every request (all sparse layers), per
        model replica: under `device_map` split over the devices' pools by their layers, under tensor
        parallelism one shared pool of this size (or, with `share_host_pool=False`, one per rank).
    :param gpu_kv_gib: GPU budget for resident pages and hot buffers (the engine's block pool), per
        device (under `device_map`, the device with the most attention layers sets the block count).
    :param backend: a hisparse backend name, or "auto" / None for the highest-priority available one,
        or a `Backend` instance. Under `device_map`, devices other than its own get an instance of
        the same class built for them (`type(backend)(device)`).
    :param hot_rows: hot-buffer rows per request (default: 2x the model's index_topk, (k + 2)x with
        `speculative_tokens` k; whole pages). It must hold the union of k + 1 rows of top-k.
    :param block_size: tokens per page.
    :param max_batch: most prompts per generate (state rows of the runtimes).
    :param max_context: longest padded sequence (prompt + new tokens) of a batch.
    :param prefill_chunk: prompt tokens per prefill forward (transformers' `prefill_chunk_size`).
    :param check: keep an all-resident copy and compare every row attention reads (`check.py`).
    :param speculative_tokens: most candidate tokens an assisted generate verifies a step
        (`prompt_lookup_num_tokens`, or the draft's `num_assistant_tokens`); 0: no assisted generation.
    :param cuda_graphs: capture each batch's decode step in a CUDA graph (`graphs.py`). None: where
        the model is on a CUDA device, the backend declares `cuda_graph` and `check` is off (the
        log says which was chosen and why); True: the same, and an error where it cannot; False: eager.
        A model spread over several devices decodes eagerly.
    :param tp: tensor parallelism (`ranks.py`): None where the model was loaded with a `tp_plan` over
        more than one process; True: every process of torch.distributed's default group is a rank of
        this replica (each runs the same batch); False: none.
    :param share_host_pool: under tensor parallelism, map one host pool on every rank (rank 0 writes);
        False: a private pool per rank (for layouts whose latent differs by rank).
    :param pool_name: the shared pool's name (the same on every rank); None: rank 0 picks a fresh one.
    :param synthetic_topk: benchmarks only. "benign" or "code": each decode step's top-k comes from
        the replay's calibrated per-layer locality model of that regime (`model_topk.py`); the
        indexer still runs and attention reads exactly the resolved rows. None: the indexer's own.
    :param synthetic_topk_layers: with `synthetic_topk`, the reference layers (of the 61-layer
        profile) the index groups stand for: None or "spread" (an L-layer model's leader l stands
        for round(l * 60 / (L - 1)): 0, 20, 40, 60 for 4 layers), or one per group, strictly
        ascending ("20,21,22,23" or [20, 21, 22, 23]: adjacent layers, as a real model's are).
    :param resident_layers: layers (whole index groups; "0,1" or [0, 1]) whose whole KV stays on
        the GPU: a store of max_batch x max_context rows each, taken from `gpu_kv_gib` before the
        block pool is sized; they never go through the host pool or a hot buffer (for layers whose
        top-k barely repeats, e.g. DeepSeek-V3.2's layers 0-1 on code). Prefix hits from the host
        pool are off with them. One device, one rank.
    :param prefetch_next_group: after each index group's decode resolve, run the next group's
        resolve on its top-k (on a side stream on CUDA, inline on the CPU), so the next group's
        misses are copied while this group's attention runs (`prefetch.py`). Outputs are the same;
        the hot buffers' LRU order, and so the misses, differ. A sequence of index groups (e.g.
        (1, 2)) prefetches only those groups' successors: leave out groups whose top-k barely
        repeats (they predict their successor no better; prefetching from them only costs copies).
    :param indexer_keys: how the cache stores the indexer keys, which stay on the GPU in every mode:
        "model" (the model's dtype, as transformers keeps them) or "fp8" (e4m3 values with an fp32
        scale per 128, as DeepSeek-V3.2 stores them: 132 bytes a token a layer against bf16's 256;
        the indexer scores them dequantized, `index_keys.py`). `check` compares the top-k against
        the model's indexer over keys stored the same way.
    :param kv_rows: how the latent rows are stored, on the GPU and in the host pool, and so what
        every host-to-device copy moves: "model" (the model's dtype, as transformers keeps them:
        1,152 B a token a layer for DeepSeek-V3.2 in bf16) or "fp8" (DeepSeek-V3.2's serving format,
        FlashMLA's fp8_ds_mla: e4m3 values with an fp32 scale per 128, the roped part in the
        model's dtype, 656 B in bf16; `kv_rows.py`). Lossy: attention reads them dequantized, so an
        fp8 run is exact against the model's own forward with its normed latent rounded the same
        way (`hisparse_transformers.kv_rows.model_reads_stored_rows`) up to rounding flips (a value
        float noise puts on the other side of an e4m3 boundary; docs/transformers.md), not against
        the model as it is. `check` allows each value that rounding.

    Returns the handle (a context manager). Bad input raises one `HiSparseError` naming the value
    and what was expected, with nothing left allocated or patched.
    """
    check_version()
    if not isinstance(model, torch.nn.Module):
        raise InvalidInputError(f"model must be a transformers model (torch.nn.Module), got {type(model).__name__}")
    existing = getattr(model, _ATTR, None)
    if existing is not None and not existing.closed:
        raise InvalidInputError("hisparse is already enabled on this model; close its handle (or disable(model)) "
                                "first")
    if not isinstance(check, bool):
        raise InvalidInputError(f"check must be True or False, got {check!r}")
    if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
        raise InvalidInputError(f"cuda_graphs must be True, False or None, got {cuda_graphs!r}")
    if tp is not None and not isinstance(tp, bool):
        raise InvalidInputError(f"tp must be True, False or None, got {tp!r}")
    if not isinstance(share_host_pool, bool):
        raise InvalidInputError(f"share_host_pool must be True or False, got {share_host_pool!r}")
    if pool_name is not None and not isinstance(pool_name, str):
        raise InvalidInputError(f"pool_name must be a str or None, got {pool_name!r}")
    if pool_name is not None:
        from hisparse_core.shm import shm_path

        try:   # the file name part of the shared pool, checked here rather than by rank 0 after the ranks agree
            shm_path(pool_name, "")
        except InvalidInputError:
            raise InvalidInputError(f"pool_name={pool_name!r}: expected 1-128 of [A-Za-z0-9_.-] (the shared host "
                                    "pool's name in /dev/shm), or None for a fresh name rank 0 picks") from None
    if backend is not None and not isinstance(backend, str | Backend):
        raise InvalidInputError(f"backend={backend!r}: expected a hisparse backend's name (hisparse backends lists "
                                "them), 'auto' or None, or a hisparse Backend instance")
    if synthetic_topk is not None:
        from hisparse_core.replay.locality import REGIMES

        if synthetic_topk not in REGIMES:
            raise InvalidInputError(f"synthetic_topk={synthetic_topk!r}: expected one of {sorted(REGIMES)} or None")
        if check or speculative_tokens:
            raise InvalidInputError(f"synthetic_topk={synthetic_topk!r} replaces the indexer's choice in benchmarks; "
                                    "expected check=False and speculative_tokens=0 with it")
    check_key_format(indexer_keys)
    layout = detect(model)
    for i, attention in enumerate(layout.attentions):
        if HiSparseAttention.live_patch(attention) is not None:
            raise InvalidInputError(f"hisparse is already enabled on layer {i}'s attention, through another model "
                                    "that holds it (the base model, or the model around it); close that handle (or "
                                    "disable() that model) first")
    if indexer_keys == "fp8":
        quant_block(layout.index_head_dim)   # one line where the key cannot be split in blocks
    weight = layout.attentions[0].kv_a_proj_with_mqa.weight
    rows = LatentRows.of(kv_rows, weight.dtype, layout.kv_lora_rank, layout.qk_rope_head_dim)   # one line if not
    if synthetic_topk_layers is not None:
        if synthetic_topk is None:
            raise InvalidInputError(f"synthetic_topk_layers={synthetic_topk_layers!r} needs synthetic_topk "
                                    "('benign' or 'code'); expected None without it")
        from hisparse_core.replay.locality import parse_reference_layers

        try:  # checked here, before anything is built (ModelTopk takes the same value)
            parse_reference_layers("synthetic_topk_layers", synthetic_topk_layers, [g[0] for g in layout.groups],
                                   layout.num_layers)
        except ValueError as exc:
            raise InvalidInputError(str(exc)) from None
    # validated here (one line naming resident_layers) before anything is built
    resident = tuple(x for g in resident_groups(layout.groups, resident_layers, layout.num_layers)
                     for x in layout.groups[g])
    config = EngineConfig(host_pool_gib=host_pool_gib, gpu_kv_gib=gpu_kv_gib, block_size=block_size,
                          hot_rows=hot_rows, max_batch=max_batch, max_context=max_context,
                          prefill_chunk=prefill_chunk, speculative_tokens=speculative_tokens,
                          resident_layers=resident, prefetch_next_group=_prefetch_sources(prefetch_next_group),
                          indexer_keys=indexer_keys, kv_rows=kv_rows)
    placement = place(layout.attentions, layout.groups)
    if resident and placement.spread:  # before any backend is built (the TP case below, once ranks are known)
        raise InvalidInputError(f"resident_layers={list(resident)} runs on one device and one rank; expected a model "
                                "on one device, or resident_layers=()")
    if isinstance(backend, Backend):
        chosen = backend
    elif (backend is None or is_auto(backend)) and not _backend_env():
        chosen = _auto_backend_on(weight.device)
    elif backend is None or is_auto(backend):
        chosen = select_backend(None)       # $HISPARSE_BACKEND: its error names the variable
    else:
        try:
            chosen = select_backend(backend)
        except BackendError as exc:
            raise type(exc)(f"backend={backend!r}: {exc}") from None
    backends = [_backend_on(chosen, dev, placement.spread) for dev in placement.devices]
    ranks = tensor_parallel(model, tp, share_host_pool, pool_name)
    if synthetic_topk is not None and (placement.spread or ranks is not None):
        raise InvalidInputError(f"synthetic_topk={synthetic_topk!r} runs on one device and one rank; expected a model "
                                "on one device without tensor parallelism")
    if resident and ranks is not None:
        raise InvalidInputError(f"resident_layers={list(resident)} runs on one device and one rank; expected a model "
                                "without tensor parallelism, or resident_layers=()")
    if ranks is not None:
        ranks.agree({"family": layout.family, "layers": str(layout.num_layers), "row": f"{weight.dtype}x{layout.width}",
                     "host_pool_gib": repr(float(host_pool_gib)), "gpu_kv_gib": repr(float(gpu_kv_gib)),
                     # the counts as EngineConfig holds them (plain ints), whatever integer type a rank passed
                     "block_size": str(config.block_size), "hot_rows": str(config.hot_rows),
                     "max_batch": str(config.max_batch), "max_context": str(config.max_context),
                     "prefill_chunk": str(config.prefill_chunk), "backend": chosen.name,
                     "speculative_tokens": str(config.speculative_tokens),
                     "prefetch_next_group": str(config.prefetch_next_group),
                     "share_host_pool": str(share_host_pool), "devices": str(len(placement.devices)),
                     "indexer_keys": indexer_keys, "kv_rows": kv_rows})
        logger.info("hisparse: %s", ranks.describe())

    def build() -> HiSparseEngine:
        return HiSparseEngine(layout, config, backends, dtype=weight.dtype, placement=placement, ranks=ranks)

    # Normal tensors even under torch.inference_mode(): generate updates them in place, in that mode
    # or out of it (an inference tensor cannot be updated outside it).
    with torch.inference_mode(False):
        engine = build() if ranks is None else ranks.in_order(build, HiSparseEngine.close)
        try:
            if synthetic_topk is not None:
                engine.use_model_topk(synthetic_topk, reference=synthetic_topk_layers)
            checker = ExactnessChecker(model.config, indexer_keys=indexer_keys, rows=rows) if check else None
            handle = HiSparseHandle(model, layout, engine, cuda_graphs, checker)
        except BaseException:
            engine.close()
            raise
    return handle


def _backend_on(chosen: Backend, device: torch.device, spread: bool) -> Backend:
    """`chosen`, or an instance of its class built for `device` (a model spread over devices)."""
    if _same_device(torch.device(chosen.device), device):
        return chosen
    if not spread:
        raise InvalidInputError(f"the model is on {device} but backend {chosen.name!r} runs on {chosen.device}; "
                                f"expected them on one device (model.to({str(chosen.device)!r}) or another backend)")
    try:
        other = type(chosen)(device)  # type: ignore[call-arg]  # a backend class that takes its device
    except TypeError:
        other = None
    if other is None or not _same_device(torch.device(other.device), device):
        raise InvalidInputError(f"the model's attention layers sit on {device} (among others), but backend "
                                f"{chosen.name!r} runs on {chosen.device} only; expected a backend that runs on every device of the "
                                "device_map (its class built with the device, as hisparse_nvidia's is)")
    return other


def disable(model: torch.nn.Module) -> None:
    """Undo `enable` on this model (close its handle); a no-op if hisparse is not enabled."""
    handle = getattr(model, _ATTR, None)
    if isinstance(handle, HiSparseHandle):
        handle.close()


__all__ = ["HiSparseError", "HiSparseHandle", "disable", "enable"]
