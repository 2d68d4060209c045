"""generate(use_cache=False) on an enabled model says once a handle that the model's own attention
runs, not once a generate. Before, each such generate logged the same INFO line again (a loop of
1,000 generates: 1,000 lines)."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("transformers")

from tf_support import SHAPES, enable_kwargs, random_prompts, tiny_model  # noqa: E402

import hisparse_transformers  # noqa: E402

LINE = "generate(use_cache=False) keeps no KV cache"


def test_use_cache_false_is_said_once_a_handle(caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_model("deepseek_v32", shape=SHAPES["deepseek_v32"], seed=0)
    ids, mask = random_prompts([12, 9])
    caplog.set_level(logging.INFO, logger="hisparse_transformers")
    for _ in range(2):   # a fresh handle says it again, once
        with hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", check=False)):
            for _ in range(3):
                out = model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False, use_cache=False)
                assert isinstance(out, torch.Tensor) and out.shape == (2, 13)
    said = [r for r in caplog.records if LINE in r.getMessage()]
    assert len(said) == 2, [r.getMessage() for r in said]
