"""`enable(..., decode_chunks=C)` (chunks.py): a decode step's indexer and swap-in run part by part
of the batch. Tokens, logits, every row attention reads (the exactness checker), hits and misses
equal those of the whole batch at once, under the model's own indexer and the locality model,
with fp8 indexer keys, with followers, eager and captured (GPU); bad values are one line."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tf_support import GEN, SHAPES, enable_kwargs, forced_logits, gpu_reason, random_prompts, tiny_model

import hisparse_transformers
from hisparse_core.errors import InvalidInputError
from hisparse_transformers.chunks import split_batch
from hisparse_transformers.tiny import TinyShape

pytest.importorskip("transformers")

#: DeepSeek-V3.2 (one layer a group) and GLM-5 with two groups of a leader and a follower: a part's
#: plan must reach the follower, whose attention reads the rows before any other part resolves.
CASES = {"deepseek_v32": SHAPES["deepseek_v32"], "glm_moe_dsa": TinyShape(layers=4, index_share=2)}


@given(batch=st.integers(1, 300), parts=st.integers(1, 40))
def test_split_batch_covers_the_batch_in_even_consecutive_parts(batch: int, parts: int) -> None:
    bounds = split_batch(batch, parts)
    assert len(bounds) == min(batch, parts)
    assert bounds[0][0] == 0 and bounds[-1][1] == batch
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    sizes = [hi - lo for lo, hi in bounds]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def _generate(model: torch.nn.Module, family: str, chunks: int, **over: Any) -> tuple[Any, Any]:
    ids, mask = random_prompts([100, 77, 60], seed=4)
    ids, mask = ids.to(model.device), mask.to(model.device)
    shape = CASES[family]
    row = (shape.kv_lora + shape.rope) * 4
    budget = 66 * shape.layers * 4 * row / 2**30       # 66 pages: pages go back to host and return through misses
    with hisparse_transformers.enable(model, **enable_kwargs(family, decode_chunks=chunks, gpu_kv_gib=budget,
                                                             **over)) as hs:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=14, **GEN)
        return out, hs.stats()


@pytest.mark.parametrize("keys", ["model", "fp8"])
@pytest.mark.parametrize("chunks", [2, 3])
@pytest.mark.parametrize("family", sorted(CASES))
def test_chunked_decode_equals_the_whole_batch(family: str, chunks: int, keys: str) -> None:
    model = tiny_model(family, shape=CASES[family], seed=5)
    whole, s_whole = _generate(model, family, 1, indexer_keys=keys)
    parts, s_parts = _generate(model, family, chunks, indexer_keys=keys)
    assert torch.equal(whole.sequences, parts.sequences)
    for a, b in zip(whole.logits, parts.logits, strict=True):
        assert torch.equal(a, b)
    # check=True compared every row both runs read with the model's own latent, and every top-k
    # with the model's indexer over the whole batch
    assert s_parts.checked_entries == s_whole.checked_entries > 0 and s_parts.checked_max_abs_diff == 0.0
    # each part's resolve is the batch's restricted to its requests: the same hits and misses
    assert (s_parts.resident, s_parts.hits, s_parts.misses) == (s_whole.resident, s_whole.hits, s_whole.misses)
    assert s_whole.misses > 0


def _forced(model: torch.nn.Module, chunks: int, regime: str) -> tuple[list[torch.Tensor], tuple[int, int]]:
    """Teacher-forced logits and group 1's (hits, misses) with the top-k from the locality model."""
    ids, mask = random_prompts([120, 96, 110], seed=7)
    continuation = torch.randint(0, 128, (3, 24), generator=torch.Generator().manual_seed(3))
    kw = enable_kwargs("deepseek_v32", check=False, synthetic_topk=regime, decode_chunks=chunks, max_context=160,
                       gpu_kv_gib=60 * 4 * 2 * 24 * 4 / 2**30)
    with hisparse_transformers.enable(model, **kw) as hs:
        cache = hs.new_cache(ids, mask)
        logits = forced_logits(model, ids, mask, continuation, cache, 8)
        looked = hs.engine.runtimes[1].stats()
        cache.finish()
    return logits, (looked.hits, looked.misses)


@pytest.mark.parametrize("regime", ["code", "benign"])
def test_chunked_decode_under_the_locality_model(regime: str) -> None:
    """Benchmarks take the top-k from the locality model and still run the indexer part by part."""
    model = tiny_model("deepseek_v32", shape=SHAPES["deepseek_v32"], seed=5)
    want, counts = _forced(model, 1, regime)
    got, chunked = _forced(model, 2, regime)
    assert counts == chunked and counts[1] > 0
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bad", [0, -2, True, 2.0, "2", None])
def test_bad_decode_chunks_is_one_line(bad: object) -> None:
    model = tiny_model("deepseek_v32", shape=SHAPES["deepseek_v32"], seed=5)
    with pytest.raises(InvalidInputError, match=r"decode_chunks must be an int >= 1 .*got") as info:
        hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", decode_chunks=bad))
    assert "\n" not in str(info.value) and getattr(model, "_hisparse_handle", None) is None


def test_decode_chunks_with_the_prefetch_is_refused() -> None:
    model = tiny_model("deepseek_v32", shape=SHAPES["deepseek_v32"], seed=5)
    with pytest.raises(InvalidInputError, match=r"decode_chunks=2 with prefetch_next_group=True: .* expected "):
        hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", decode_chunks=2,
                                                            prefetch_next_group=True))


@pytest.mark.parametrize("family", sorted(CASES))
@pytest.mark.gpu
@pytest.mark.skipif(gpu_reason() is not None, reason=f"nvidia backend unavailable: {gpu_reason()}")
def test_chunked_decode_in_a_captured_graph_equals_the_whole_batch(family: str) -> None:
    """On the GPU the parts' resolves run on a side stream inside the captured decode graph."""
    model = tiny_model(family, shape=CASES[family], seed=5, device="cuda")
    whole, s_whole = _generate(model, family, 1, check=False, backend="nvidia", cuda_graphs=True)
    parts, s_parts = _generate(model, family, 3, check=False, backend="nvidia", cuda_graphs=True)
    assert s_whole.decode_mode == s_parts.decode_mode == "cuda graph", (s_whole.decode_mode, s_parts.decode_mode)
    # The parts' indexer runs are matrix products of other batch sizes, which cuBLAS may sum in another
    # order: scores can differ in their last bits, so the logits are compared to fp32 rounding.
    assert torch.equal(whole.sequences, parts.sequences)
    diff = max(float((a - b).abs().max()) for a, b in zip(whole.logits, parts.logits, strict=True))
    print(f"{family} decode_chunks=3 in a cuda graph: max abs logit diff {diff:.3g}, hits {s_parts.hits} / "
          f"{s_whole.hits}, misses {s_parts.misses} / {s_whole.misses}")
    assert diff <= 1e-4 and s_parts.misses > 0 and s_whole.misses > 0
