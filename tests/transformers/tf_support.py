"""Shared set-up of the transformers tests: tiny random models, a tight hisparse engine, and the
comparison of a hisparse generate with the model's own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hisparse_transformers.tiny import TinyShape, random_prompts, tiny_model

#: 2 layers (DeepSeek-V3.2: 2 index groups) / 3 layers (GLM-5: a full layer with one shared
#: follower, then a full layer): the smallest that has every structure, fast on 2 cores.
SHAPES = {"deepseek_v32": TinyShape(layers=2), "glm_moe_dsa": TinyShape(layers=3, index_share=2)}
BLOCK = 4
TOP_K = SHAPES["deepseek_v32"].index_topk   # 16; the hot buffer is 16 rows, contexts reach 121 tokens


def block_bytes(family: str, dtype: torch.dtype = torch.float32) -> int:
    s = SHAPES[family]
    row = (s.kv_lora + s.rope) * torch.empty((), dtype=dtype).element_size()
    return s.layers * BLOCK * row


def tight_gpu_gib(family: str, blocks: int = 66) -> float:
    """A GPU budget of `blocks` pages: 3 requests of up to 121 tokens need 93 all resident, so
    pages are released to host-only and read back through the hot buffer."""
    return blocks * block_bytes(family) / 2**30


def enable_kwargs(family: str, **over: Any) -> dict[str, Any]:
    kw: dict[str, Any] = dict(host_pool_gib=0.01, gpu_kv_gib=tight_gpu_gib(family), block_size=BLOCK, hot_rows=16,
                              max_batch=3, max_context=256, prefill_chunk=8, check=True)
    kw.update(over)
    return kw


GEN = dict(do_sample=False, output_logits=True, return_dict_in_generate=True)


@dataclass
class Compared:
    tokens_equal: bool
    max_logit_diff: float
    steps: int


def compare(ours: Any, theirs: Any) -> Compared:
    diffs = [float((a - b).abs().max()) for a, b in zip(ours.logits, theirs.logits, strict=True)]
    return Compared(torch.equal(ours.sequences, theirs.sequences), max(diffs), len(diffs))


def baseline(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, new: int, chunk: int) -> Any:
    """The model's own generate (its own attention and DynamicCache), with transformers' chunked
    prefill of the same chunk size (chunking changes how the indexer's top-k breaks exact ties)."""
    from transformers import DynamicCache

    return model.generate(ids, attention_mask=mask, max_new_tokens=new, prefill_chunk_size=chunk,
                          past_key_values=DynamicCache(config=model.config), **GEN)


__all__ = ["BLOCK", "Compared", "GEN", "SHAPES", "TOP_K", "TinyShape", "baseline", "compare", "enable_kwargs",
           "random_prompts", "tight_gpu_gib", "tiny_model"]
