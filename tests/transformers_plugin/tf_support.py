"""Shared set-up of the transformers tests: tiny random models, a tight hisparse engine, and the
comparison of a hisparse generate with the model's own."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch

from hisparse_transformers.forced import forced_logits
from hisparse_transformers.tiny import TinyShape, random_prompts, tiny_model

#: 2 layers (DeepSeek-V3.2: 2 index groups) / 3 layers (GLM-5: a full layer with one shared
#: follower, then a full layer): the smallest that has every structure, fast on 2 cores.
SHAPES = {"deepseek_v32": TinyShape(layers=2), "glm_moe_dsa": TinyShape(layers=3, index_share=2)}
BLOCK = 4
TOP_K = SHAPES["deepseek_v32"].index_topk   # 16; the hot buffer is 16 rows, contexts reach 121 tokens
#: The same with 32 indexer heads: a key scores exactly 0 (every head's dot product negative) with a
#: chance of 2^-32, so exact ties never decide the top-k (test_transformers_graphs.py says why that matters).
NO_TIES = {f: replace(s, index_heads=32) for f, s in SHAPES.items()}


def gpu_reason() -> str | None:
    """Why the nvidia backend cannot run here (None: it can)."""
    try:
        from hisparse_nvidia.plugin import probe
    except ImportError as exc:  # pragma: no cover
        return f"hisparse_nvidia not importable: {exc}"
    return probe()


#: `pytestmark` of the modules that run the real models on the nvidia backend.
NVIDIA_ONLY = [pytest.mark.gpu, pytest.mark.skipif(gpu_reason() is not None,
                                                   reason=f"nvidia backend unavailable: {gpu_reason()}")]


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

    from hisparse_transformers.version import cache_kwarg

    return model.generate(ids, attention_mask=mask, max_new_tokens=new, prefill_chunk_size=chunk,
                          **{cache_kwarg(model): DynamicCache(config=model.config)}, **GEN)


__all__ = ["BLOCK", "Compared", "GEN", "NO_TIES", "SHAPES", "TOP_K", "TinyShape", "baseline", "compare", "e4m3",
           "enable_kwargs", "random_prompts", "reference_fp8", "tight_gpu_gib", "tiny_model"]


def bf16_errors(family: str, device: str, backend: str, new: int = 24, check: bool = True) -> dict[str, Any]:
    """Teacher-forced max abs logit error against the fp32 model of the same (bf16-representable)
    weights: transformers' own bf16 attention, and hisparse's in bf16."""
    import copy

    from transformers import DynamicCache

    import hisparse_transformers

    model = tiny_model(family, shape=SHAPES[family], seed=3, dtype=torch.bfloat16, device=device)
    ref = copy.deepcopy(model).float()
    ids, mask = random_prompts(LENGTHS_BF16, seed=1)
    ids, mask = ids.to(device), mask.to(device)
    from hisparse_transformers.version import cache_kwarg

    tokens = ref.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, prefill_chunk_size=8,
                          **{cache_kwarg(ref): DynamicCache(config=ref.config)})[:, ids.shape[1]:]
    want = forced_logits(ref, ids, mask, tokens, DynamicCache(config=ref.config), 8)
    theirs = forced_logits(model, ids, mask, tokens, DynamicCache(config=model.config), 8)
    bb = block_bytes(family, torch.bfloat16)
    with hisparse_transformers.enable(model, **enable_kwargs(family, gpu_kv_gib=66 * bb / 2**30, backend=backend,
                                                             check=check)) as hs:
        cache = hs.new_cache(ids, mask)
        ours = forced_logits(model, ids, mask, tokens, cache, 8)
        cache.finish()
        s = hs.stats()
        misses, mode = s.misses, s.decode_mode
    err = lambda got: max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))  # noqa: E731
    return {"transformers_bf16": err(theirs), "hisparse_bf16": err(ours),
            "logit_scale": max(float(w.abs().max()) for w in want), "misses": misses, "decode_mode": mode}


LENGTHS_BF16 = [40, 57, 23]


def e4m3(x: float) -> float:
    """`x` rounded to the nearest float8 e4m3fn value (ties to even; |x| <= 448 here)."""
    if x == 0.0:
        return 0.0
    mant, exp = math.frexp(abs(x))            # abs(x) = mant * 2**exp, mant in [0.5, 1)
    step = 2.0 ** max(exp - 1 - 3, -9)        # 3 mantissa bits; below 2**-6 the subnormal step 2**-9
    return math.copysign(round(abs(x) / step) * step, x)


def reference_fp8(keys: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantized keys, scales) in float64, one block of `block` values at a time."""
    flat = keys.double().reshape(-1, block)
    out, scales = torch.empty_like(flat), torch.empty(flat.shape[0], dtype=torch.float64)
    for i, row in enumerate(flat.tolist()):
        amax = max(max(abs(v) for v in row), 1e-4)
        scale = 2.0 ** math.ceil(math.log2(amax / 448.0))      # the smallest power of two >= amax / 448
        scales[i] = scale
        out[i] = torch.tensor([e4m3(v / scale) * scale for v in row], dtype=torch.float64)
    return out.reshape(keys.shape), scales.reshape(*keys.shape[:-1], -1)
