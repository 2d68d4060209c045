"""Model-family adapters: which modules of a loaded model are its sparse-attention layers and how
they split into index groups (one hisparse runtime per group).

- DeepSeek-V3.2 (`deepseek_v32`): every layer runs its own indexer, so every layer is an index
  group of one.
- GLM-5 (`glm_moe_dsa`): `config.indexer_types[i]` is "full" (own indexer) or "shared" (reuses
  the previous full layer's top-k). An index group is a full layer and the shared layers after it;
  the followers replay the leader's miss plan. Its attention returns the top-k as a third value,
  which the decoder layer hands to the next layer as `prev_topk_indices`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from hisparse_core.errors import InvalidInputError

#: model_type -> attention class name of the family.
FAMILIES: dict[str, str] = {"deepseek_v32": "DeepseekV32Attention", "glm_moe_dsa": "GlmMoeDsaAttention"}


class NotADsaModelError(InvalidInputError):
    """The model is not one of the supported DeepSeek Sparse Attention families."""


@dataclass(frozen=True)
class DsaLayout:
    """The sparse-attention structure of one loaded model.

    `attentions[i]` is decoder layer i's attention module; `groups` lists the layer indices of each
    index group, leader first; `returns_topk` is True where the attention returns `(out, weights,
    topk)`; `modeling` is the family's modeling module (its functions are called, never copied).
    """

    family: str
    # transformers' attention modules of the family, read by attribute name (nn.Module types them as Tensor | Module)
    attentions: tuple[Any, ...]
    groups: tuple[tuple[int, ...], ...]
    returns_topk: bool
    modeling: ModuleType
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    num_heads: int
    index_topk: int
    index_head_dim: int

    @property
    def num_layers(self) -> int:
        return len(self.attentions)

    @property
    def width(self) -> int:
        """Values of one token's latent row: the normed kv_lora part and the roped key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def group_of(self, layer: int) -> tuple[int, int]:
        """(index group, position in the group) of decoder layer `layer`."""
        for g, layers in enumerate(self.groups):
            if layer in layers:
                return g, layers.index(layer)
        raise InvalidInputError(f"layer {layer} is in no index group; the model has {self.num_layers} layers")


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    base = getattr(model, "base_model", model)
    layers = getattr(base, "layers", None)
    return layers if isinstance(layers, torch.nn.ModuleList) else None


def _index_groups(family: str, config: object, num_layers: int) -> tuple[tuple[int, ...], ...]:
    if family == "deepseek_v32":
        return tuple((i,) for i in range(num_layers))
    types = list(getattr(config, "indexer_types", None) or [])
    if len(types) != num_layers or any(t not in ("full", "shared") for t in types):
        raise NotADsaModelError(f"config.indexer_types={types!r}; expected {num_layers} entries, each 'full' or "
                                "'shared'")
    if types[0] != "full":
        raise NotADsaModelError(f"config.indexer_types[0]={types[0]!r}; expected 'full': a shared layer needs a "
                                "previous full layer's top-k")
    groups: list[list[int]] = []
    for i, t in enumerate(types):
        if t == "full":
            groups.append([i])
        else:
            groups[-1].append(i)
    return tuple(tuple(g) for g in groups)


def detect(model: torch.nn.Module) -> DsaLayout:
    """The model's DSA layout; `NotADsaModelError` (one line, naming what was found) otherwise."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise NotADsaModelError(
            f"{type(model).__name__} (model_type={model_type!r}) is not a DeepSeek Sparse Attention model; expected "
            f"a transformers model of type {' or '.join(sorted(FAMILIES))}")
    layers = _decoder_layers(model)
    if layers is None or not len(layers):
        raise NotADsaModelError(f"{type(model).__name__}: found no decoder layers (base_model.layers); expected a "
                                f"{model_type} model")
    attentions: tuple[Any, ...] = tuple(getattr(layer, "self_attn", None) for layer in layers)  # None: rejected below
    want = FAMILIES[model_type]
    bad = [i for i, a in enumerate(attentions) if a is None or type(a).__name__ != want]
    if bad:
        got = type(attentions[bad[0]]).__name__
        raise NotADsaModelError(f"{type(model).__name__}: layer {bad[0]} attention is {got}; expected {want}")
    first = attentions[0]
    for name in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
                 "o_proj"):
        if getattr(first, name, None) is None:
            raise NotADsaModelError(f"{type(model).__name__}: attention has no {name}; expected the MLA layout of "
                                    f"{model_type} (q_lora_rank set)")
    if getattr(first.kv_b_proj, "bias", None) is not None:
        raise NotADsaModelError("kv_b_proj has a bias; absorbed MLA expects kv_b_proj(bias=False), as the model "
                                "defines it")
    modeling = sys.modules[type(first).__module__]
    if not hasattr(modeling, "apply_rotary_pos_emb_interleave"):
        raise NotADsaModelError(f"{modeling.__name__} has no apply_rotary_pos_emb_interleave; expected the "
                                f"{model_type} modeling module of transformers")
    groups = _index_groups(model_type, config, len(attentions))
    for g in groups:
        if getattr(attentions[g[0]], "indexer", None) is None:
            raise NotADsaModelError(f"layer {g[0]} leads an index group but has no indexer")
    indexer = attentions[0].indexer
    return DsaLayout(model_type, attentions, groups, model_type == "glm_moe_dsa", modeling,
                     first.kv_lora_rank, first.qk_rope_head_dim, first.qk_nope_head_dim, first.v_head_dim,
                     first.num_heads, indexer.index_topk, indexer.head_dim)
