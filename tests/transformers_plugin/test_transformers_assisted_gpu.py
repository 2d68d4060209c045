"""Assisted generation on a GPU with the nvidia backend (skipped without one): the CPU exactness
tests of test_transformers_assisted.py in fp32 on CUDA. Greedy prompt lookup (k = 1, 3, 5) and a
draft model through hisparse give the tokens of the model's own assisted generation and of plain
greedy decoding on the same GPU, under GPU pressure (pages released, misses), with prefix reuse;
verification rows resolve as one union (rows shared), rejected candidates are rolled back (and
poisoned on the device and the host: a later read would change the tokens). Without the row check,
verification steps are captured in a CUDA graph per width (tokens a row) and replayed, as the
one-token steps are."""

from __future__ import annotations

import copy

import pytest
import torch
from test_transformers_assisted import ASSISTED, NEW, poison_rolled_back_rows, prompts, tight_kwargs
from tf_support import NVIDIA_ONLY, tiny_model

import hisparse_transformers

pytestmark = NVIDIA_ONLY


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("family", sorted(ASSISTED))
def test_prompt_lookup_on_gpu_matches_the_model_and_greedy(family: str, k: int) -> None:
    model = tiny_model(family, shape=ASSISTED[family], seed=3, device="cuda")
    model.set_experts_implementation("batched_mm")   # float32 grouped_mm reads its offsets on the host
    inputs = [p.cuda() for p in prompts()]
    greedy = [model.generate(p, max_new_tokens=NEW, do_sample=False) for p in inputs]
    own = [model.generate(p, max_new_tokens=NEW, do_sample=False, prompt_lookup_num_tokens=k) for p in inputs]
    with hisparse_transformers.enable(model, **tight_kwargs(family, k, backend="nvidia", check=k == 3)) as hs:
        poison_rolled_back_rows(hs)
        ours = [model.generate(p, max_new_tokens=NEW, do_sample=False, prompt_lookup_num_tokens=k) for p in inputs]
        s = hs.stats()
    print(f"{family} k={k} fp32 cuda: {s.verify_steps} verification steps ({s.verify_rows} rows, "
          f"{s.union_shared_entries} of {s.union_entries} entries shared), {s.rollbacks} rollbacks "
          f"({s.rolled_back_tokens} rows), hits {s.hits} misses {s.misses} released {s.released_pages}, "
          f"decode {s.decode_mode}, checked {s.checked_entries}")
    for a, b, c in zip(ours, own, greedy, strict=True):
        assert torch.equal(b, c), "the model's own assisted generation differs from its greedy decoding"
        assert torch.equal(a, c), "hisparse's assisted generation differs from greedy"
    assert s.backend == "nvidia" and s.verify_steps > 0 and s.union_shared_entries > 0 and s.rollbacks > 0, s
    assert s.released_pages > 0 and s.misses > 0 and s.prefix_hit_tokens >= 60, s
    assert k != 3 or (s.checked_entries > 0 and s.checked_max_abs_diff <= 1e-5), s
    assert "capture failed" not in s.decode_mode, s


@pytest.mark.parametrize("family", sorted(ASSISTED))
def test_captured_verification_steps_match_greedy(family: str, caplog: pytest.LogCaptureFixture) -> None:
    """Prompt lookup (k = 3) with captured verification steps: each width's first step runs the
    static computation eagerly, the later ones replay its graph; the tokens stay greedy's."""
    import logging

    model = tiny_model(family, shape=ASSISTED[family], seed=3, device="cuda")
    model.set_experts_implementation("batched_mm")
    inputs = [p.cuda() for p in prompts()]
    greedy = [model.generate(p, max_new_tokens=NEW, do_sample=False) for p in inputs]
    with caplog.at_level(logging.INFO, logger="hisparse_transformers.graphs"), \
            hisparse_transformers.enable(model, **tight_kwargs(family, 3, backend="nvidia", check=False)) as hs:
        poison_rolled_back_rows(hs)
        ours = [model.generate(p, max_new_tokens=NEW, do_sample=False, prompt_lookup_num_tokens=3) for p in inputs]
        s = hs.stats()
    captured = [r.getMessage() for r in caplog.records if "verification step of" in r.getMessage()]
    print(f"{family}: {s.verify_steps} verification steps, {s.graph_captures} captures, decode {s.decode_mode}; "
          + "; ".join(captured))
    for a, c in zip(ours, greedy, strict=True):
        assert torch.equal(a, c), "hisparse's captured assisted generation differs from greedy"
    assert s.decode_mode == "cuda graph" and captured and s.rollbacks > 0 and s.misses > 0, s


def test_draft_model_on_gpu_matches_greedy() -> None:
    family = "deepseek_v32"
    model = tiny_model(family, shape=ASSISTED[family], seed=3, device="cuda")
    model.set_experts_implementation("batched_mm")
    draft = copy.deepcopy(model)
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        for p in draft.parameters():
            p.add_((torch.randn(p.shape, generator=g) * 0.005).to(p.device))
    draft.generation_config.num_assistant_tokens = 3
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    p = prompts()[0].cuda()
    want = model.generate(p, max_new_tokens=NEW, do_sample=False)
    with hisparse_transformers.enable(model, **tight_kwargs(family, 3, backend="nvidia", check=False)) as hs:
        got = model.generate(p, max_new_tokens=NEW, do_sample=False, assistant_model=draft)
        s = hs.stats()
    assert torch.equal(got, want)
    assert s.rollbacks > 0 and s.verify_rows - s.verify_steps - s.rolled_back_tokens > 0, s
    assert "capture failed" not in s.decode_mode, s
