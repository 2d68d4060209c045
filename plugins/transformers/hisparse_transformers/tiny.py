"""Tiny random DSA models (DeepSeek-V3.2, GLM-5) for `hisparse generate`, the tests and examples.

Built from transformers' own config and model classes with random weights: nothing is downloaded.
The shape is the smallest that runs both families on a CPU in well under a second per few tokens
(hidden 64, 4 heads, kv_lora 16 + rope 8, indexer 2 heads x 16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # transformers loads lazily, inside tiny_model
    from transformers import GenerationMixin, PreTrainedModel

    class CausalLM(PreTrainedModel, GenerationMixin):
        """What each family's *ForCausalLM class is (no single transformers type names both)."""


FAMILY_CLASSES = {
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
}


@dataclass(frozen=True, slots=True)
class TinyShape:
    layers: int = 4
    index_topk: int = 16
    vocab: int = 128
    hidden: int = 64
    heads: int = 4
    q_lora: int = 32
    kv_lora: int = 16
    nope: int = 16
    rope: int = 8
    v: int = 16
    index_heads: int = 8
    index_head_dim: int = 16
    max_position: int = 4096
    index_share: int = 2                    # GLM-5: layers per full indexer ("full", then shared ones)


def tiny_model(family: str = "deepseek_v32", *, shape: TinyShape | None = None, seed: int = 0,
               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               attn_implementation: str = "eager") -> CausalLM:
    """A random-weight model of `family` in eval mode, deterministic for a given seed and device: the
    weights are drawn on `device`, so a CUDA device's generator gives other weights than the CPU's
    (`tiny_model(seed=s).to("cuda")` is the CPU's model on the GPU)."""
    import transformers

    if family not in FAMILY_CLASSES:
        raise ValueError(f"unknown family {family!r}; expected one of {sorted(FAMILY_CLASSES)}")
    s = shape or TinyShape()
    config_cls, model_cls = (getattr(transformers, n) for n in FAMILY_CLASSES[family])
    kwargs: dict[str, object] = dict(
        vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=2 * s.hidden, moe_intermediate_size=32,
        num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.heads, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
        q_lora_rank=s.q_lora, kv_lora_rank=s.kv_lora, qk_nope_head_dim=s.nope, qk_rope_head_dim=s.rope,
        v_head_dim=s.v, index_n_heads=s.index_heads, index_head_dim=s.index_head_dim, index_topk=s.index_topk,
        max_position_embeddings=s.max_position, pad_token_id=0, bos_token_id=1, eos_token_id=None,
        tie_word_embeddings=False)
    if family == "glm_moe_dsa":
        kwargs["indexer_types"] = ["full" if i % s.index_share == 0 else "shared" for i in range(s.layers)]
    config = config_cls(**kwargs)
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = model_cls(config).to(device=device, dtype=dtype).eval()
    # Random init gives nearly flat logits; a larger embedding spread makes greedy choices decisive.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    return model


def random_prompts(lengths: list[int], *, vocab: int = 128, seed: int = 0, pad_id: int = 0,
                   prefix: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded `input_ids` and `attention_mask` for prompts of `lengths` (ids 2..vocab-1), each
    starting with `prefix` if given."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        head = list(prefix or [])[:n]
        tail = torch.randint(2, vocab, (n - len(head),), generator=g).tolist()
        rows.append(head + tail)
    width = max(lengths)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids, mask
