"""`check=True` counts the queries whose top-k was decided at a tie (issue 43): the comparison with
the indexer re-run on hisparse's own inputs breaks an exact tie the same way (nothing differs to
count), so the boundary is read off the reference scores: a key left out at exactly the k-th
score (an exact tie), or within the float bound of it (a near-tie that float noise upstream can
swap in the model's own generate)."""

from __future__ import annotations

import pytest
import torch
from tf_support import SHAPES, enable_kwargs, random_prompts, tiny_model

import hisparse_transformers
from hisparse_transformers.check import boundary_ties, near_tie_bound

pytest.importorskip("transformers")

NEG = float("-inf")


def _one(row: list[float], chosen: list[int], query: bool = True) -> tuple[bool, bool]:
    scores = torch.tensor([[row]], dtype=torch.float32)
    exact, near = boundary_ties(torch.tensor([[chosen]]), scores, torch.tensor([[query]]))
    return bool(exact), bool(near)


def test_boundary_ties_by_hand() -> None:
    assert _one([3.0, 2.0, 2.0, 1.0, NEG], [0, 1]) == (True, False)         # key 2 ties the k-th exactly
    assert _one([3.0, 2.0, 2.0 - 1e-6, 1.0, NEG], [0, 1]) == (False, True)  # 1e-6 < 1e-5 x 3: a near-tie
    assert _one([3.0, 2.0, 1.9, 1.0, NEG], [0, 1]) == (False, False)        # a clear cut
    assert _one([3.0, 2.0, NEG, NEG, NEG], [0, 1]) == (False, False)        # masked keys are not ties
    assert _one([3.0, 2.0, 2.0, 1.0, NEG], [0, 1], query=False) == (False, False)
    assert _one([0.0, 0.0, 0.0, NEG, NEG], [2, 0]) == (True, False)         # all scores 0: every cut is a tie
    assert near_tie_bound(torch.float32) == 1e-5 and near_tie_bound(torch.bfloat16) > 1e-3


def test_exact_ties_are_reported_though_the_rerun_breaks_them_alike() -> None:
    """A zero indexer scores every key exactly 0: every top-k over more than k keys is decided at a
    tie. Eager decode scores rows of the model's own length, so the re-run picks the same keys (no
    order tie) — what `check=True` used to report as 0 ties."""
    family = "deepseek_v32"
    model = tiny_model(family, shape=SHAPES[family], seed=4)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.indexer.weights_proj.weight.zero_()
    ids, mask = random_prompts([30, 41, 17], seed=2)
    with hisparse_transformers.enable(model, **enable_kwargs(family, cuda_graphs=False)) as hs:
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        s = hs.stats()
    assert s.checked_topk_queries > 0 and s.checked_topk_ties == 0, s
    assert s.checked_topk_boundary_ties > 0 and s.checked_topk_near_ties == 0, s
