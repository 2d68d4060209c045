"""`HiSparseCache`: the transformers `Cache` a hisparse generate runs with.

It is a `DynamicCache` built from the model's config (so transformers' generate, mask creation and
`is_sliding`/`is_linear` introspection see the layer structure they expect), but the latent KV is
not in it: the patched attention writes each layer's rows into hisparse's resident pages and reads
them back through the resolver. What stays here:

- the padded sequence length (what `get_seq_length` and the mask sizes report);
- the indexer keys, an ordinary device cache `[batch, tokens, index_head_dim]` per indexer layer,
  grown by doubling (what transformers' `DynamicIndexedLayer.update_indexer` keeps by concatenation);
- the hisparse session of the batch (its requests and the step in progress).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import DynamicCache

from hisparse_core.errors import HiSparseError

if TYPE_CHECKING:
    from hisparse_transformers.engine import HiSparseEngine, Session


class UnsupportedCacheOperation(HiSparseError, RuntimeError):
    """Beam search, cache cropping and similar operations that reorder or rewrite cached rows."""


class HiSparseCache(DynamicCache):
    """A fresh cache for one generate; get one from `HiSparseHandle.new_cache()` (or let the
    patched `generate` make one). One batch per cache: it cannot be reused after its generate."""

    def __init__(self, engine: HiSparseEngine, config: Any) -> None:
        super().__init__(config=config)
        self.hisparse_engine = engine
        self.session: Session | None = None
        self.prompts: tuple[list[list[int]], list[int]] | None = None
        self._length = 0
        self._indexer: dict[int, torch.Tensor] = {}
        self._indexer_len: dict[int, int] = {}

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
        """Append this forward's indexer keys `[B, S, D]`; return all of them `[B, T, D]`."""
        keys = indexer_key_states
        b, s, d = keys.shape
        n = self._indexer_len.get(layer_idx, 0)
        buf = self._indexer.get(layer_idx)
        if buf is None or buf.shape[1] < n + s:
            cap = max(n + s, 2 * (buf.shape[1] if buf is not None else 0), 64)
            grown = keys.new_empty((b, cap, d))
            if buf is not None:
                grown[:, :n] = buf[:, :n]
            buf = self._indexer[layer_idx] = grown
        buf[:, n:n + s] = keys
        self._indexer_len[layer_idx] = n + s
        return buf[:, :n + s]

    @property
    def indexer_bytes(self) -> int:
        """Device bytes of the indexer keys written so far (the part of the KV hisparse leaves on the GPU)."""
        return sum(self._indexer[i][:, :n].numel() * self._indexer[i].element_size()
                   for i, n in self._indexer_len.items())

    def advance(self, num_new: int) -> None:
        self._length += num_new

    # ---------------------------------------------------------------- what it cannot do

    def _unsupported(self, what: str) -> UnsupportedCacheOperation:
        return UnsupportedCacheOperation(f"{what} is not supported by hisparse: each batch row is one hisparse "
                                         "request whose rows live in its own pages (use num_beams=1, "
                                         "num_return_sequences=1 and no assisted decoding)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise self._unsupported("beam search (reorder_cache)")

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise self._unsupported("cropping the cache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise self._unsupported("repeating the batch (batch_repeat_interleave)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise self._unsupported("selecting batch rows (batch_select_indices)")

    def set_prompts(self, prompts: Sequence[Sequence[int]], pads: Sequence[int]) -> None:
        """The batch's prompts (logical ids, padding stripped) and left padding, before the first forward."""
        self.prompts = ([list(p) for p in prompts], list(pads))

    def finish(self) -> None:
        """End this cache's batch (the patched generate does it): its requests finish, their state rows
        and GPU leases go back, and the pages they published stay in the host pool for prefix hits."""
        if self.session is not None:
            self.hisparse_engine.close_session(self.session, indexer_bytes=self.indexer_bytes)
