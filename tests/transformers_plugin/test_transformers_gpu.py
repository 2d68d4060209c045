"""The transformers integration on a GPU with the nvidia backend (skipped without one).

- fp32: the same check as on the CPU: tokens identical to the model's own eager generate on the
  same GPU, every step's logits within 1e-4, pages released to host and read back.
- bf16: greedy tokens cannot be expected to match between two bf16 computations of attention (one
  rounds expanded K/V, the other the absorbed query), so the logits are compared teacher-forced
  against the fp32 model with the same (bf16-representable) weights. The stated bf16 tolerance:
  hisparse's error is at most twice transformers' own bf16 error, plus 0.05.
- The planted host fault is named on the GPU too.
- CUDA graphs (`graphs.py`, on by default here): the captured decode against the model's own
  generate in fp32 (tokens identical, logits within 1e-4; 32 indexer heads, so no exactly tied
  scores decide the top-k: see test_transformers_graphs.py), captured again when the key buffers
  grow; bf16 within the same stated tolerance; a model whose MoE cannot be captured (experts
  reading their routing on the host) falls back to eager with one warning and the same outputs.
"""

from __future__ import annotations

import logging

import pytest
import torch
from tf_support import (
    BLOCK,
    GEN,
    NO_TIES,
    NVIDIA_ONLY,
    SHAPES,
    baseline,
    bf16_errors,
    compare,
    enable_kwargs,
    random_prompts,
    tight_gpu_gib,
    tiny_model,
)

import hisparse_transformers
from hisparse_transformers.check import RowMismatch
from hisparse_transformers.demo import BF16_FACTOR, BF16_SLACK

pytestmark = NVIDIA_ONLY


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_fp32_on_gpu_matches_the_model(family: str) -> None:
    model = tiny_model(family, shape=SHAPES[family], seed=3, device="cuda")
    ids, mask = random_prompts([40, 57, 23], seed=1)
    ids, mask = ids.cuda(), mask.cuda()
    theirs = baseline(model, ids, mask, 64, chunk=8)
    with hisparse_transformers.enable(model, **enable_kwargs(family, backend="nvidia")) as hs:
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=64, **GEN)
        s = hs.stats()
    got = compare(ours, theirs)
    print(f"{family} fp32 cuda: tokens identical {got.tokens_equal}, max abs logit diff {got.max_logit_diff:.3g}, "
          f"hits {s.hits} misses {s.misses} released {s.released_pages}")
    assert got.tokens_equal and got.max_logit_diff <= 1e-4, got
    assert s.misses > 0 and s.lost_pages > 0 and s.backend == "nvidia"


def test_planted_fault_on_gpu() -> None:
    family = "deepseek_v32"
    model = tiny_model(family, shape=SHAPES[family], seed=3, device="cuda")
    ids, mask = random_prompts([24, 30], seed=11)
    with hisparse_transformers.enable(model, **enable_kwargs(family, gpu_kv_gib=1e-3, backend="nvidia")) as hs:
        model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=4, do_sample=False)
        prefix = ids[1, -30:].tolist()[:16]
        hit = hs.engine.coordinator.lookup_prefix(prefix)
        group, pos = hs.engine.layout.group_of(1)
        hs.engine.host_views[group][pos][hit.host_block_ids[0] * BLOCK] *= -3.0
        ids2, mask2 = random_prompts([20], seed=12, prefix=prefix)
        with pytest.raises(RowMismatch, match=r"layer 1, batch row 0 .*position 0"):
            model.generate(ids2.cuda(), attention_mask=mask2.cuda(), max_new_tokens=2, do_sample=False)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graph"])
@pytest.mark.parametrize("family", sorted(SHAPES))
def test_bf16_on_gpu_within_transformers_own_error(family: str, graphs: bool) -> None:
    e = bf16_errors(family, "cuda", "nvidia", new=64, check=not graphs)
    print(f"{family} bf16 cuda (teacher-forced, max abs logit error vs fp32): {e}")
    assert e["hisparse_bf16"] <= BF16_FACTOR * e["transformers_bf16"] + BF16_SLACK, e  # 2x + 0.05, as generate
    assert e["misses"] > 0
    assert (e["decode_mode"] == "cuda graph") == graphs, e


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_cuda_graph_decode_matches_the_model(family: str) -> None:
    model = tiny_model(family, shape=NO_TIES[family], seed=4, device="cuda")
    ids, mask = random_prompts([150, 201, 97], seed=2)
    ids, mask = ids.cuda(), mask.cuda()
    theirs = baseline(model, ids, mask, 64, chunk=32)
    kw = enable_kwargs(family, backend="nvidia", check=False, max_context=512, prefill_chunk=32,
                       gpu_kv_gib=tight_gpu_gib(family, 150))
    with hisparse_transformers.enable(model, **kw) as hs:
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=64, **GEN)
        s = hs.stats()
    got = compare(ours, theirs)
    print(f"{family} fp32 cuda graph: tokens identical {got.tokens_equal}, max abs logit diff {got.max_logit_diff:.3g}, "
          f"captures {s.graph_captures}, hits {s.hits} misses {s.misses}")
    assert got.tokens_equal and got.max_logit_diff <= 1e-4, got
    assert s.decode_mode == "cuda graph" and s.graph_captures == 2, s     # 256 key slots, then 512 (grown mid-decode)
    assert s.misses > 0 and s.released_pages > 0


def test_uncapturable_moe_runs_eagerly(caplog: pytest.LogCaptureFixture) -> None:
    family = "deepseek_v32"
    model = tiny_model(family, shape=NO_TIES[family], seed=4, device="cuda")
    model.set_experts_implementation("eager")          # picks its experts on the host (nonzero)
    ids, mask = random_prompts([30, 41], seed=3)
    ids, mask = ids.cuda(), mask.cuda()
    theirs = baseline(model, ids, mask, 12, chunk=8)
    with hisparse_transformers.enable(model, **enable_kwargs(family, backend="nvidia", check=False)) as hs:
        with caplog.at_level(logging.WARNING, logger="hisparse_transformers.graphs"):
            ours = model.generate(ids, attention_mask=mask, max_new_tokens=12, **GEN)
        s = hs.stats()
    got = compare(ours, theirs)
    assert got.tokens_equal and got.max_logit_diff <= 1e-4, got
    assert [r for r in caplog.records if "experts_implementation='eager'" in r.getMessage()], caplog.records
    assert s.decode_mode.startswith("eager (") and "set_experts_implementation" in s.decode_mode, s


def test_a_failed_capture_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    """A forward hook that reads a value on the host makes the capture fail: one warning, the decode
    goes on eagerly with the same outputs, and CUDA (its random generators too) works afterwards."""
    family = "glm_moe_dsa"
    model = tiny_model(family, shape=NO_TIES[family], seed=4, device="cuda")
    ids, mask = random_prompts([30, 41], seed=3)
    ids, mask = ids.cuda(), mask.cuda()
    theirs = baseline(model, ids, mask, 12, chunk=8)
    hook = model.model.layers[1].register_forward_hook(lambda m, a, out: float(out[0].float().sum()) and None)
    try:
        with hisparse_transformers.enable(model, **enable_kwargs(family, backend="nvidia", check=False)) as hs:
            with caplog.at_level(logging.WARNING, logger="hisparse_transformers.graphs"):
                ours = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                      output_logits=True, return_dict_in_generate=True)
            s = hs.stats()
    finally:
        hook.remove()
    got = compare(ours, theirs)
    assert got.tokens_equal and got.max_logit_diff <= 1e-4, got
    assert [r for r in caplog.records if "could not be captured" in r.getMessage()], caplog.records
    assert s.decode_mode.startswith("eager (capture failed"), s
    assert torch.randn(4, device="cuda").isfinite().all()
