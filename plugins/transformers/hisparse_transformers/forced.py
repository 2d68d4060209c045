"""Teacher-forced logits: the same continuation fed to several models (or caches), so that their
logits can be compared step for step where free-running greedy decoding would let them part ways
(two bf16 computations of attention pick different tokens sooner or later)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hisparse_transformers.version import cache_kwarg


def forced_logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, continuation: torch.Tensor,
                  cache: Any, chunk: int,  # noqa: ANN401 - a transformers cache of any kind
                  on_step: Callable[[], None] | None = None) -> list[torch.Tensor]:
    """Prefill the left-padded prompts `ids` (`mask`) in `chunk`-token forwards, then feed
    `continuation` `[B, n]` one token a step. Entry i of the result (float32 `[B, vocab]`) predicts
    `continuation[:, i]`, as generate's step-i logits do. `on_step` is called once a logits entry
    (a progress bar's tick)."""
    key = cache_kwarg(model)
    tick = on_step if on_step is not None else (lambda: None)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = None
    with torch.no_grad():
        for a in range(0, ids.shape[1], chunk):
            b = min(ids.shape[1], a + chunk)
            out = model(input_ids=ids[:, a:b], attention_mask=mask[:, :b], position_ids=pos[:, a:b], use_cache=True,
                        **{key: cache})
        if out is None:
            raise ValueError("forced_logits needs a prompt of at least one token")
        logits = [out.logits[:, -1].float()]
        tick()
        last = pos[:, -1:]
        for i in range(continuation.shape[1] - 1):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            last = last + 1
            out = model(input_ids=continuation[:, i:i + 1], attention_mask=mask, position_ids=last, use_cache=True,
                        **{key: cache})
            logits.append(out.logits[:, -1].float())
            tick()
    return logits
