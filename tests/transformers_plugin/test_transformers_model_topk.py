"""`enable(..., synthetic_topk=...)`: decode steps resolve the locality model's top-k (an
independent `LayeredIndexer` regenerates it here), the model's indexer still runs every step,
prefill keeps the indexer's choice, and bad combinations are one line before anything is built."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from tf_support import GEN, SHAPES, enable_kwargs, random_prompts, tiny_model

import hisparse_transformers
from hisparse_core.errors import InvalidInputError
from hisparse_core.replay.locality import LayeredIndexer, reference_layers, regime

pytest.importorskip("transformers")

FAMILY = "deepseek_v32"


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model(FAMILY, shape=SHAPES[FAMILY], seed=5)


@pytest.mark.parametrize("layers, want_ref", [(None, [0, 60]), ("spread", [0, 60]), ("20,21", [20, 21]),
                                              ([30, 45], [30, 45])])
def test_decode_steps_resolve_the_models_topk(model: torch.nn.Module, layers: Any, want_ref: list[int]) -> None:
    """Every index group resolves its own reference layer's picks: spread over the profile by
    default, or the reference layers given (`synthetic_topk_layers`)."""
    name = "code"
    lengths = [37, 21]
    ids, mask = random_prompts(lengths, seed=4)
    new = 6
    with hisparse_transformers.enable(model, **enable_kwargs(FAMILY, check=False, synthetic_topk=name,
                                                             synthetic_topk_layers=layers)) as hs:
        engine = hs.engine
        assert engine.topk_model is not None and engine.topk_model.layers == want_ref
        seen_by: list[list[torch.Tensor]] = [[] for _ in engine.runtimes]

        def spy_on(g: int) -> Any:
            resolve = engine.runtimes[g].resolve

            def spy(inputs: Any, **kw: Any) -> Any:
                seen_by[g].append(inputs.topk.clone())
                return resolve(inputs, **kw)
            return spy

        for g, runtime in enumerate(engine.runtimes):
            runtime.resolve = spy_on(g)  # type: ignore[method-assign]
        indexer_calls = {"n": 0}
        idx = model.model.layers[0].self_attn.indexer
        forward = idx.forward

        def counted(*a: Any, **k: Any) -> Any:
            indexer_calls["n"] += 1
            return forward(*a, **k)

        idx.forward = counted
        try:
            model.generate(ids, attention_mask=mask, max_new_tokens=new, **GEN)
        finally:
            del idx.forward
        assert engine.topk_model is not None and engine.topk_model.steps == new - 1
    # Every forward ran the indexer (prefill chunks and decode steps alike).
    assert indexer_calls["n"] >= new
    # The decode steps (generate's forwards after the prompt) resolved the model's picks.
    if layers is None:
        # the 2-layer model's two index groups stand for the profile's ends
        assert reference_layers([g[0] for g in engine.layout.groups], SHAPES[FAMILY].layers) == want_ref
    k = SHAPES[FAMILY].index_topk
    assert len(seen_by) == 2
    for g, seen in enumerate(seen_by):
        decode = seen[-(new - 1):]
        for row, n in enumerate(lengths):
            ix = LayeredIndexer(k, want_ref, regime(name), seed=0, request_id=row)
            for t, got in enumerate(decode):
                want = ix.step(n + t + 1)[g]
                assert np.array_equal(np.sort(got[row].cpu().numpy()), np.sort(want)), (g, row, t)


def test_decode_steps_can_leave_the_indexer_out(model: torch.nn.Module) -> None:
    """`run_indexer = False`: decode steps do not call the indexer; they still resolve the model's picks."""
    ids, mask = random_prompts([29, 18], seed=6)
    new = 5
    with hisparse_transformers.enable(model, **enable_kwargs(FAMILY, check=False, synthetic_topk="benign")) as hs:
        engine = hs.engine
        assert engine.topk_model is not None
        engine.topk_model.run_indexer = False
        calls = {"n": 0}
        idx = model.model.layers[0].self_attn.indexer
        forward = idx.forward

        def counted(*a: Any, **k: Any) -> Any:
            calls["n"] += 1
            return forward(*a, **k)

        idx.forward = counted
        try:
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, **GEN)
        finally:
            del idx.forward
        assert engine.topk_model.steps == new - 1
    # Only the prefill chunks (29 padded tokens in chunks of 8) ran the indexer.
    assert calls["n"] == 4, calls
    assert out.sequences.shape[1] == 29 + new


def test_bad_synthetic_topk_is_one_line(model: torch.nn.Module) -> None:
    for over, msg in ((dict(synthetic_topk="chat"), "expected one of"),
                      (dict(synthetic_topk="code", check=True), "check=False"),
                      (dict(synthetic_topk="code", speculative_tokens=1, hot_rows=32), "speculative_tokens=0"),
                      (dict(synthetic_topk_layers="20,21"), "synthetic_topk_layers='20,21' needs synthetic_topk"),
                      (dict(synthetic_topk="code", synthetic_topk_layers="20,21,22", check=False), "3 layers for 2 index groups"),
                      (dict(synthetic_topk="code", synthetic_topk_layers=[21, 20], check=False), "not strictly ascending"),
                      (dict(synthetic_topk="benign", synthetic_topk_layers="adjacent", check=False), "'adjacent' is not a layer"),
                      # a TypeError before
                      (dict(synthetic_topk="code", synthetic_topk_layers=20, check=False),
                       "synthetic_topk_layers=20: not a list of layers; expected 'spread' or 2")):
        with pytest.raises(InvalidInputError, match=msg):
            hisparse_transformers.enable(model, **enable_kwargs(FAMILY, **over))
    assert getattr(model, "_hisparse_handle", None) is None or model._hisparse_handle.closed
