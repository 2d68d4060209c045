"""The decode forward of a batch captured in one CUDA graph and replayed every step; with assisted
generation, each width of verification forward (2 to k + 1 tokens a row) in a graph of its own.

A decode step of a DSA model is a few milliseconds of GPU work behind many more of Python and
launches: transformers' forward, the indexer, hisparse's resolve and attention, hundreds of small
kernels. Captured once per batch, the step is one launch. The engine's host work (`begin_step`:
coordinator, tables, worker; `end_step`: acknowledgements) stays outside the graph and runs every
step, so every decision the coordinator makes still reaches the device through the same tables.

What a captured step reads, all at fixed addresses (`DecodeGraph`):

- its inputs, copied into static buffers each step: `input_ids` and `position_ids` `[B, 1]`, the
  padded position of the new token, the step's row states, context lengths and write
  destinations (the tensors `begin_step` made are copied in, then the step points at the copies);
- the indexer keys in static mode (`HiSparseCache.static_indexer`): the new key is written at the
  static position and the indexer scores every slot of the buffers' capacity; the mask, built in
  the graph from the left padding and the position, hides the slots outside each row's context,
  so the model's own indexer picks the same top-k set (`_decode_rows` turns slots past the context
  into -1, as it does the padding). The key buffers grow by a quarter when full; the batch is then
  captured again (a log line says so);
- that mask, handed to the model as an already prepared mask mapping (the model's forward then
  skips its own mask creation, which sizes tensors by the context length).

The first decode step of a batch runs the same static computation eagerly (a warm-up that
initializes every library handle the capture needs); capture and replay begin with the second.
A verification step of S tokens a row (`StepState.verify`) takes the same path with buffers of
width S (`DecodeGraph.width`): `[B, S]` inputs, the S padded positions, `B x S` resolver rows
with their left padding and write rows copied in each step, the S new keys written at their
static positions, and a causal mask (each query sees its row's context up to its own position).
Each width has its own buffers and graph, captured at its second step; the crop that follows a
verification runs outside the graph, on the host lengths only.
A forward that is not a plain decode (prefill chunks, `output_attentions`, `inputs_embeds`, the
exactness checker on) runs eagerly. So does every decode of a model whose MoE picks its experts on
the host (transformers' "eager" experts implementation; its default, grouped_mm, captures), and of
a model whose capture failed (a hook reading a value on the host, say): one WARNING names the cause.
"""

from __future__ import annotations

import copy
import gc
import logging
import os
import time
import traceback
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hisparse_core.backend import Capability
from hisparse_core.errors import HiSparseError, InvalidInputError
from hisparse_transformers.cache import HiSparseCache

if TYPE_CHECKING:
    from hisparse_transformers.engine import HiSparseEngine
    from hisparse_transformers.session import Session, StepState

logger = logging.getLogger(__name__)

#: kwargs of a decode forward that the captured step can take (anything else runs eagerly).
_TAKEN = frozenset({"input_ids", "attention_mask", "position_ids", "past_key_values", "cache", "inputs_embeds",
                    "use_cache", "cache_position", "return_dict", "output_attentions", "output_hidden_states",
                    "logits_to_keep"})


class SameMaskForEveryLayerType(dict[str, torch.Tensor]):
    """A prepared mask mapping that gives one mask for whatever layer type the model asks for
    (transformers' DSA models key it by `config.layer_types[i]` or by "indexed_attention")."""

    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        self.mask = mask

    def __missing__(self, key: str) -> torch.Tensor:
        return self.mask


def graph_support(engine: HiSparseEngine, requested: bool | None, checking: bool = False) -> tuple[bool, str]:
    """(capture decode steps, why) for this engine; `requested=True` turns a no into an error.
    `checking`: the exactness checker is on (`enable(check=True)`)."""
    backend = engine.backend
    if requested is False:
        why = "cuda_graphs=False"
    elif engine.placement.spread:
        why = (f"the attention layers sit on {len(engine.placement.devices)} devices "
               f"({', '.join(str(d) for d in engine.placement.devices)}), and a captured step runs on one")
    elif engine.device.type != "cuda":
        why = f"the model runs on {engine.device}, not a CUDA device"
    elif Capability.CUDA_GRAPH not in backend.capabilities:
        why = f"backend {backend.name!r} does not declare {Capability.CUDA_GRAPH!r}"
    elif checking:
        why = "check=True reads every gathered row on the host, which a captured step cannot"
    else:
        return True, f"backend {backend.name!r} on {engine.device} declares {Capability.CUDA_GRAPH!r}"
    if requested:
        raise InvalidInputError(f"cuda_graphs=True, but {why}; expected a CUDA model with a backend that declares "
                                f"{Capability.CUDA_GRAPH!r} and check=False (or cuda_graphs=None to choose)")
    return False, why


class DecodeGraph:
    """The static buffers, and the captured graph, of one batch's steps of `width` tokens a row (per
    cache: one for decode, width 1, and one for each width of verification step, 2 to k + 1)."""

    def __init__(self, engine: HiSparseEngine, session: Session, *, capture: bool, width: int = 1) -> None:
        dev = engine.device
        b = session.batch_size
        self.engine = engine
        self.session = session
        self.capture = capture
        self.width = width
        # a decode step has one resolver row a batch row; a verification step one a query (b-major)
        rows = b if width == 1 else b * width
        self.input_ids = torch.zeros((b, width), dtype=torch.long, device=dev)
        self.position_ids = torch.zeros((b, width), dtype=torch.long, device=dev)
        self.offsets = torch.arange(width, dtype=torch.long, device=dev)
        self.position = torch.zeros((width,), dtype=torch.long, device=dev)   # padded positions of the new tokens
        self.row_state = torch.full((rows,), -1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros((rows,), dtype=torch.int32, device=dev)
        self.pad32 = torch.zeros((rows, 1), dtype=torch.int32, device=dev)    # verification: per resolver row
        self.write_src = torch.arange(b * width, dtype=torch.int64, device=dev)  # decode: row b writes its token
        self.write_dst = torch.zeros((b * width,), dtype=torch.int64, device=dev)
        self.write_res = torch.zeros((b * width,), dtype=torch.int64, device=dev)  # resident layers' store rows
        self.capacity = 0
        self.generation = -1
        self.slots: torch.Tensor | None = None                              # arange(capacity)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: Any = None
        self.steps = 0
        self.captures = 0

    def _load(self, step: StepState, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> None:
        if step.write_dst.shape != self.write_dst.shape:
            raise InvalidInputError(f"a step of {self.width} token(s) a row writes {step.write_dst.numel()} rows; "
                                    f"expected {self.write_dst.numel()}")
        self.input_ids.copy_(input_ids)
        # A decode step's position is one value; a verification step's its S consecutive ones.
        if self.width == 1:
            self.position.fill_(step.past)
        else:
            torch.add(self.offsets, step.past, out=self.position)
        if position_ids is None:            # the model's own default: the padded positions
            self.position_ids.copy_(self.position.expand_as(self.position_ids))
        else:
            self.position_ids.copy_(position_ids.reshape(-1, self.width).expand_as(self.position_ids))
        self.row_state.copy_(step.row_state)
        self.seq_lens.copy_(step.seq_lens)
        self.write_dst.copy_(step.write_dst)
        step.row_state, step.seq_lens = self.row_state, self.seq_lens
        step.write_dst = self.write_dst
        if self.width == 1:
            step.write_src = self.write_src
        else:
            # a verification step's rows and write order come from its schedule; its resolver rows
            # take the left padding per row
            self.write_src.copy_(step.write_src)
            step.write_src = self.write_src
            self.pad32.copy_(step.pad32)
            step.pad32 = self.pad32
        if step.write_res is not None:
            self.write_res.copy_(step.write_res)
            step.write_res = self.write_res

    def _forward(self, original: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
        assert self.slots is not None
        pads = self.session.pads.view(-1, 1, 1)
        slots = self.slots.view(1, 1, -1)
        # [B, S, capacity]: a query sees its row's context up to its own position (causal)
        visible = (slots >= pads) & (slots <= self.position.view(1, -1, 1))
        kw = dict(kwargs)
        kw["input_ids"] = self.input_ids
        kw["position_ids"] = self.position_ids
        kw["attention_mask"] = SameMaskForEveryLayerType(visible.unsqueeze(1))
        return original(**kw)

    def run(self, original: Callable[..., Any], kwargs: dict[str, Any], cache: HiSparseCache, step: StepState,
            on_failure: Callable[[BaseException], None]) -> Any:
        """One decode forward: static inputs loaded, then eager (warm-up, or no capture), capture
        (first time, or after the key buffers grew) or replay."""
        self._load(step, kwargs["input_ids"], kwargs.get("position_ids"))
        capacity = cache.static_indexer(self.position, need=step.past + self.width)
        try:
            if capacity != self.capacity or cache.indexer_generation != self.generation:
                self.capacity, self.generation = capacity, cache.indexer_generation
                self.slots = torch.arange(capacity, dtype=torch.long, device=self.engine.device)
                self.graph = self.output = None
            if not self.capture or self.steps == 0:
                out = self._forward(original, kwargs)
            else:
                if self.graph is None:
                    try:
                        self._capture(original, kwargs)
                    except Exception as exc:
                        if isinstance(exc, HiSparseError):
                            raise
                        # Nothing of the step ran (a capture only records): run it the model's way.
                        cache.static_indexer(None)
                        reset_capture_state()
                        on_failure(exc)
                        return original(**kwargs)
                assert self.graph is not None
                self.graph.replay()
                out = copy.copy(self.output)
                out["last_hidden_state"] = self.output.last_hidden_state.clone()
        finally:
            cache.static_indexer(None)
        cache.static_filled(step.past + self.width)
        self.steps += 1
        return out

    def _capture(self, original: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        # No garbage collection while capturing: a collected object that frees pinned host memory
        # makes torch's host allocator query CUDA events, which a capturing thread may not do (one
        # suspected cause of an intermittent "operation failed due to a previous error during
        # capture", not confirmed).
        collecting = gc.isenabled()
        gc.disable()
        try:
            if self.engine.device.type != "cuda":
                # A capture on a CUDA machine records none of a CPU model's work and replays nothing.
                raise RuntimeError(f"the model runs on {self.engine.device}, not a CUDA device")
            t0 = time.perf_counter()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.output = self._forward(original, kwargs)
        finally:
            if collecting:
                gc.enable()
        self.graph = graph
        self.captures += 1
        what = "decode step" if self.width == 1 else f"verification step of {self.width} tokens a row"
        logger.info("hisparse: %s of %d rows captured in a CUDA graph (indexer key capacity %d, %.0f ms%s)",
                    what, self.session.batch_size, self.capacity, 1e3 * (time.perf_counter() - t0),
                    "" if self.captures == 1 else f"; capture {self.captures} of this batch, after its key buffers "
                    "grew")


def uncapturable_moe(model: torch.nn.Module) -> str | None:
    """Why the model's MoE cannot be captured, if it cannot: transformers' "eager" experts
    implementation picks the experts it runs on the host (`nonzero`, a loop over them)."""
    for name, m in model.named_modules():
        impl = getattr(getattr(m, "config", None), "_experts_implementation", None)
        if type(m).__name__.endswith("Experts") and impl == "eager":
            return (f"{name} uses experts_implementation='eager', which picks its experts on the host; "
                    "model.set_experts_implementation('grouped_mm') (or 'batched_mm') makes it capturable")
    return None


#: Expert weight dtypes for which torch's `grouped_mm` takes its generic fallback, a loop over the groups
#: that reads their offsets on the host (ATen's `_grouped_mm_fallback`); its fused kernels take bfloat16.
_GROUPED_MM_HOST_LOOP = (torch.float32, torch.float64)


def grouped_mm_host_loop(model: torch.nn.Module | None) -> str | None:
    """The MoE experts a failed capture most likely tripped on: transformers' `grouped_mm` on float32
    weights runs torch's fallback, which copies the group offsets to the host (seen on the H200 with
    torch 2.11: the capture fails on that copy); `batched_mm` on the same weights captures."""
    for name, m in model.named_modules() if model is not None else ():
        impl = getattr(getattr(m, "config", None), "_experts_implementation", None)
        weight = next(m.parameters(recurse=False), None)
        if (type(m).__name__.endswith("Experts") and impl == "grouped_mm" and weight is not None
                and weight.dtype in _GROUPED_MM_HOST_LOOP):
            return (f"{name} runs experts_implementation='grouped_mm' on {str(weight.dtype).removeprefix('torch.')} "
                    "weights, which torch computes in a loop reading the group offsets on the host; "
                    "model.set_experts_implementation('batched_mm') (or bfloat16 weights) captures")
    return None


def reset_capture_state() -> None:
    """After an aborted capture: one empty capture, so the CUDA generators leave their capture state
    (an aborted capture leaves them in it, and the next random op outside a graph fails)."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The CUDA Graph is empty")    # empty on purpose
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                pass
    except Exception as exc:  # noqa: BLE001 - best effort; the failure itself was reported
        logger.debug("hisparse: resetting the capture state after a failed capture failed too: %s", exc)


class DecodeGraphs:
    """The captured decode of one enabled model: which forwards qualify, one `DecodeGraph` per batch."""

    def __init__(self, engine: HiSparseEngine, requested: bool | None, model: torch.nn.Module | None = None, *,
                 checking: bool = False) -> None:
        self.engine = engine
        self.model = model
        self.enabled, self.reason = graph_support(engine, requested, checking)
        self.capture = self.enabled           # False: the static computation eagerly (tests on the CPU)
        self.captures = 0
        self.last: DecodeGraph | None = None     # the batch that ran the latest decode step
        self._told: set[str] = set()
        logger.info("hisparse: decode steps %s (%s)", "captured in CUDA graphs" if self.enabled else "run eagerly",
                    self.reason)

    @property
    def mode(self) -> str:
        return ("cuda graph" if self.capture else "static eager") if self.enabled else f"eager ({self.reason})"

    def _ineligible(self, args: tuple[Any, ...], kwargs: dict[str, Any], session: Session | None) -> str | None:
        step = session.step if session is not None else None
        ids = kwargs.get("input_ids")
        if args:
            return "the model was called with positional arguments"
        if step is None or step.prefill or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            return ""                       # a prefill chunk: eager by design, nothing to tell
        width = ids.shape[1]
        if width != step.num_new or (width > 1 and not step.verify):
            return ""
        if width > 1 and step.write_dst.numel() != ids.shape[0] * width:
            return "a verification step whose rows do not all write (a row without a query)"
        if kwargs.get("inputs_embeds") is not None:
            return "a decode forward with inputs_embeds"
        if kwargs.get("output_attentions") or kwargs.get("output_hidden_states") or kwargs.get("return_dict") is False:
            return "a decode forward asking for attentions, hidden states or a tuple"
        extra = sorted(k for k, v in kwargs.items() if k not in _TAKEN and v is not None)
        if extra:
            return f"a decode forward with {', '.join(extra)}"
        mask = kwargs.get("attention_mask")
        if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
            return "a decode forward with a prepared (not 2-D) attention mask"
        pos = kwargs.get("position_ids")
        if pos is not None and (not isinstance(pos, torch.Tensor) or pos.numel() not in (width, ids.shape[0] * width)):
            return "position_ids that are not one per batch row and token"
        return None

    def forward(self, original: Callable[..., Any], cache: HiSparseCache, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        """The base model's forward with this cache: captured where the step qualifies."""
        if not self.enabled:
            return original(*args, **kwargs)
        session = cache.session
        why = self._ineligible(args, kwargs, session)
        if why is not None:
            if why and why not in self._told:
                self._told.add(why)
                logger.info("hisparse: %s runs eagerly (not captured)", why)
            return original(*args, **kwargs)
        assert session is not None and session.step is not None
        width = kwargs["input_ids"].shape[1]
        graph = cache.decode_graphs.get(width)
        if graph is None:
            moe = uncapturable_moe(self.model) if self.capture and self.model is not None else None
            if moe is not None:
                self.enabled, self.reason = False, moe
                logger.warning("hisparse: decode steps run eagerly: %s", moe)
                return original(*args, **kwargs)
            graph = cache.decode_graphs[width] = DecodeGraph(self.engine, session, capture=self.capture, width=width)
        self.last = graph
        before = graph.captures
        out = graph.run(original, kwargs, cache, session.step, self._failed)
        self.captures += graph.captures - before
        return out

    def _failed(self, exc: BaseException) -> None:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        self.enabled = False
        self.reason = f"capture failed: {type(exc).__name__}: {first}"
        logger.debug("hisparse: where the decode step's capture failed", exc_info=exc)
        hint = grouped_mm_host_loop(self.model) if "during CUDA graph capture" in first else None
        if hint is not None:
            self.reason += f" ({hint})"
        # Where it was raised, so that an intermittent failure can be placed from the default log (a
        # CUDA error there may belong to an earlier call of the capture: the DEBUG line has it all).
        frames = traceback.extract_tb(exc.__traceback__)
        at = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
        logger.warning("hisparse: the decode step could not be captured in a CUDA graph (%s: %s%s); decode runs "
                       "eagerly from now on. %s; pass cuda_graphs=False to skip the attempt", type(exc).__name__, first,
                       at, hint or "Something in the forward waits on the host (a hook reading a value, a module "
                       "choosing its work from device data)")
