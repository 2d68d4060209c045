"""`HiSparseCache`: the transformers `Cache` a hisparse generate runs with.

It is a `DynamicCache` built from the model's config (so transformers' generate, mask creation and
`is_sliding`/`is_linear` introspection see the layer structure they expect), but the latent KV is
not in it: the patched attention writes each layer's rows into hisparse's resident pages and reads
them back through the resolver. What stays here:

- the padded sequence length (what `get_seq_length` and the mask sizes report);
- the indexer keys, an ordinary device cache `[batch, capacity, index_head_dim]` per indexer layer
  (what transformers' `DynamicIndexedLayer.update_indexer` keeps by concatenation; with
  `indexer_keys="fp8"` e4m3 values and their scales `[batch, capacity, index_head_dim / 128]`,
  handed to the indexer dequantized, `index_keys.py`), grown by a
  quarter at a time up to the engine's longest context. A captured decode step (`graphs.py`) puts
  the cache in static mode: the step's key goes to a position held in a device tensor and the
  indexer reads every slot of the capacity, the step's mask hiding those outside the context;
- the hisparse session of the batch (its requests and the step in progress).

`crop` (assisted generation drops the candidates the model rejected) rolls the batch back through
`HiSparseEngine.rollback` and shortens the length and the indexer keys to match.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import DynamicCache

from hisparse_core.errors import HiSparseError
from hisparse_transformers.index_keys import dequantize_fp8, quantize_fp8

if TYPE_CHECKING:
    from hisparse_transformers.engine import HiSparseEngine
    from hisparse_transformers.session import Session


class UnsupportedCacheOperation(HiSparseError, RuntimeError):
    """Beam search, cache cropping and similar operations that reorder or rewrite cached rows."""


def crop_count(value: object) -> int:
    """The int a `crop` argument stands for: an int, or a 0-dim integer tensor on any device.

    A device tensor costs one host sync here. It cannot be avoided: the cache's length and the
    engine's page tables are host state that the next forward's planning reads; and it is cheap,
    since transformers has already synchronized on the same count (it slices `input_ids` with it)
    in the verification step that calls `crop`, which is never part of the captured decode step."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 and not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool:
            return int(value.item())
    elif isinstance(value, int) and not isinstance(value, bool):
        return value
    raise UnsupportedCacheOperation(f"crop takes an int (or a 0-dim integer tensor), got {value!r}")


_NO_COPY = ("a HiSparseCache cannot be copied or pickled (copy.deepcopy, pickle): its rows live in hisparse's pages "
            "and it serves one batch; expected a fresh handle.new_cache() per generate (a later batch whose prompts "
            "share a prefix takes it from the host pool)")


class HiSparseCache(DynamicCache):
    """A fresh cache for one generate; get one from `HiSparseHandle.new_cache()` (or let the
    patched `generate` make one). One batch per cache: it cannot be reused after its generate."""

    def __init__(self, engine: HiSparseEngine, config: Any) -> None:
        super().__init__(config=config)
        self.hisparse_engine = engine
        self.session: Session | None = None
        self.prompts: tuple[list[list[int]], list[int]] | None = None
        self.max_new_tokens: int | None = None
        self.candidates = 0                  # an assisted generate's candidate tokens, reserved past max_new_tokens
        #: per row, the rope position of its first token (None: not one offset); None: read at the first forward
        self.rope_offsets: list[int | None] | None = None
        self._length = 0
        self._indexer: dict[int, torch.Tensor] = {}
        self._scales: dict[int, torch.Tensor] = {}   # indexer_keys="fp8": each layer's key scales
        self._fp8 = engine.config.indexer_keys == "fp8"
        self._indexer_len: dict[int, int] = {}
        self._static_position: torch.Tensor | None = None   # [1] int64 padded position (static mode)
        self.indexer_generation = 0                            # bumped whenever a key buffer is replaced
        self.decode_graphs: dict[int, Any] = {}                # the batch's DecodeGraph per tokens a row (graphs.py)
        self.generating = False      # the patched generate runs this cache (else: direct forwards)
        self.assisted = False        # an assisted generate (verification steps of several tokens, then crop)
        self.split_forward = False   # the forward in progress runs as several engine steps (handle.py)

    # ---------------------------------------------------------------- what transformers asks

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self._length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._length + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._length

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        raise UnsupportedCacheOperation(
            f"layer {layer_idx} called cache.update on a HiSparseCache: its attention is not patched by "
            "hisparse_transformers.enable (a different model, or disable() ran)")

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Append this forward's indexer keys `[B, S, D]`; return all of them `[B, T, D]` (fp8:
        dequantized, fp32).

        In static mode (`static_indexer`) the one key of a decode step goes to the static position
        and the whole buffer `[B, capacity, D]` comes back: fixed addresses and shapes for a
        captured graph."""
        keys, scales = quantize_fp8(indexer_key_states) if self._fp8 else (indexer_key_states, None)
        b, s, d = keys.shape
        n = self._indexer_len.get(layer_idx, 0)
        if self._static_position is not None:
            # Python runs once, at capture: the lengths are set by `static_filled` after every step.
            buf = self._indexer[layer_idx]
            if scales is None:
                buf.index_copy_(1, self._static_position, keys)
                return buf
            # index_copy_ has no float8 kernel: the same bytes through uint8 views
            buf.view(torch.uint8).index_copy_(1, self._static_position, keys.view(torch.uint8))
            self._scales[layer_idx].index_copy_(1, self._static_position, scales)
            return dequantize_fp8(buf, self._scales[layer_idx])
        buf = self._grown(layer_idx, keys, n + s, scales)
        buf[:, n:n + s] = keys
        self._indexer_len[layer_idx] = n + s
        if scales is None:
            return buf[:, :n + s]
        self._scales[layer_idx][:, n:n + s] = scales
        return dequantize_fp8(buf[:, :n + s], self._scales[layer_idx][:, :n + s])

    def _grown(self, layer_idx: int, like: torch.Tensor, need: int, scales_like: torch.Tensor | None = None
               ) -> torch.Tensor:
        """Layer `layer_idx`'s key buffer with room for `need` keys (a new one, the old keys copied,
        when it is full; with fp8 keys its scale buffer too, shaped as `scales_like`)."""
        buf = self._indexer.get(layer_idx)
        old = buf.shape[1] if buf is not None else 0
        if buf is not None and old >= need:
            return buf
        limit = max(need, self.hisparse_engine.max_pages * self.hisparse_engine.config.block_size)
        cap = min(limit, max(need, -(-(old + old // 4) // 256) * 256, 64))
        # normal tensors even in inference mode: the batch's next forward may run outside it
        with torch.inference_mode(False):
            n = self._indexer_len.get(layer_idx, 0)
            grown = like.new_empty((like.shape[0], cap, like.shape[-1]))
            if buf is not None:
                grown[:, :n] = buf[:, :n]
            if self._fp8:
                sbuf = self._scales.get(layer_idx)
                source = sbuf if sbuf is not None else scales_like
                assert source is not None
                scaled = source.new_empty((source.shape[0], cap, source.shape[-1]))
                if sbuf is not None:
                    scaled[:, :n] = sbuf[:, :n]
                self._scales[layer_idx] = scaled
        self._indexer[layer_idx] = grown
        self.indexer_generation += 1
        return grown

    def static_indexer(self, position: torch.Tensor | None, need: int = 0) -> int:
        """Enter static mode with the next key at `position` (`[1]` int64 on the device), every key
        buffer holding at least `need` keys; `None` leaves it. Returns the buffers' capacity (all
        indexer layers share it: they grow in step)."""
        self._static_position = None
        if position is None:
            return 0
        for layer_idx, buf in list(self._indexer.items()):
            self._grown(layer_idx, buf, need, self._scales.get(layer_idx))
        caps = {buf.shape[1] for buf in self._indexer.values()}
        if len(caps) != 1:
            raise HiSparseError(f"indexer key buffers of different capacities {sorted(caps)}; expected one (every "
                                "indexer layer sees every forward)")
        self._static_position = position
        return caps.pop()

    def static_filled(self, length: int) -> None:
        """A static-mode step wrote the key at padded position `length - 1` of every indexer layer."""
        for layer_idx in self._indexer:
            self._indexer_len[layer_idx] = length

    @property
    def indexer_bytes(self) -> int:
        """Device bytes of the indexer keys written so far (the part of the KV hisparse leaves on the GPU;
        fp8: their scales included)."""
        stores = [self._indexer, self._scales]
        return sum(x[i][:, :n].numel() * x[i].element_size() for x in stores for i, n in self._indexer_len.items()
                   if i in x)

    def advance(self, num_new: int) -> None:
        self._length += num_new

    # ---------------------------------------------------------------- what it cannot do

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise UnsupportedCacheOperation(_NO_COPY)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise UnsupportedCacheOperation(_NO_COPY)

    def _unsupported(self, what: str) -> UnsupportedCacheOperation:
        return UnsupportedCacheOperation(f"{what} is not supported by hisparse: each batch row is one hisparse "
                                         "request whose rows live in its own pages (use num_beams=1 and "
                                         "num_return_sequences=1)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise self._unsupported("beam search (reorder_cache)")

    @property
    def is_croppable(self) -> bool:
        return True

    def crop(self, tokens_to_remove: int | torch.Tensor) -> None:
        """Drop the last `-tokens_to_remove` tokens (transformers' convention; a positive value is
        the legacy absolute length to keep). Only the suffix of the last forward can go.

        An int or a 0-dim integer tensor: assisted generation in transformers 5.17/5.18 passes
        `-(candidate_length - n_matches)` with `n_matches` a tensor on the model's device."""
        count = crop_count(tokens_to_remove)
        n = -count if count <= 0 else max(0, self._length - count)
        if n == 0:
            return
        if self.session is None:
            raise UnsupportedCacheOperation(f"crop({count}) before any forward: the cache holds nothing")
        self.hisparse_engine.rollback(self.session, n)
        self._length -= n
        for layer_idx, length in self._indexer_len.items():
            self._indexer_len[layer_idx] = max(0, length - n)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise self._unsupported("repeating the batch (batch_repeat_interleave)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise self._unsupported("selecting batch rows (batch_select_indices)")

    def set_prompts(self, prompts: Sequence[Sequence[int]], pads: Sequence[int],
                    max_new_tokens: int | None = None, candidates: int = 0) -> None:
        """The batch's prompts (logical ids, padding stripped) and left padding, before the first
        forward; `max_new_tokens` bounds what admission reserves (None: up to `max_context`), and
        `candidates` (an assisted generate's) adds what a verification step writes past it."""
        self.prompts = ([list(p) for p in prompts], list(pads))
        self.max_new_tokens = max_new_tokens
        self.candidates = candidates

    @property
    def prompt_width(self) -> int:
        """The padded width of the prompts given to `set_prompts` (0 before)."""
        if self.prompts is None:
            return 0
        return max((pad + len(p) for p, pad in zip(*self.prompts, strict=True)), default=0)

    def finish(self) -> None:
        """End this cache's batch (the patched generate does it): its requests finish, their state rows
        and GPU leases go back, and the pages they published stay in the host pool for prefix hits."""
        self.decode_graph = None     # its graph's memory pool goes back now, not when the cache is dropped
        if self.session is not None:
            self.hisparse_engine.close_session(self.session, indexer_bytes=self.indexer_bytes)
