"""The captured decode step's computation, on the CPU: static inputs, fixed-capacity indexer keys
with the in-graph mask, and the fallback when capture fails.

A CUDA graph only records what the static computation does (`graphs.py`), so running that
computation eagerly (`capture=False`) shows on the CPU that it matches the model's own generate;
the GPU tests (test_transformers_gpu.py) show that capture and replay match it.

The indexer of these models scores a key exactly 0 when every indexer head's dot product is
negative; with the 8-head test shape that happens often enough that exactly tied scores decide the
k-th place, and which of them the top-k takes depends on the length of the scored row (on the CPU).
The static computation scores the whole capacity of the key buffers, so its top-k is the model's up
to the order of exact ties. These tests use 32 indexer heads, where a zero score has a chance of
2^-32 per key, so the top-k sets are the same and the outputs must be too.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch
from tf_support import GEN, NO_TIES, SHAPES, baseline, compare, enable_kwargs, random_prompts, tight_gpu_gib, tiny_model

import hisparse_transformers
from hisparse_core.errors import InvalidInputError

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=sorted(NO_TIES))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(family: str) -> torch.nn.Module:
    return tiny_model(family, shape=NO_TIES[family], seed=4)


def capacity(handle: hisparse_transformers.HiSparseHandle) -> int:
    graph = handle.graphs.last
    return graph.capacity if graph is not None else 0


def test_static_decode_matches_the_model(family: str, model: torch.nn.Module) -> None:
    """The whole decode through the static computation; the key buffers grow mid-decode (where a
    captured batch is captured again); pages are released to host and read back."""
    ids, mask = random_prompts([150, 201, 97], seed=2)       # 256-slot key buffers after the prefill
    theirs = baseline(model, ids, mask, 64, chunk=32)
    kw = enable_kwargs(family, check=False, max_context=512, prefill_chunk=32, gpu_kv_gib=tight_gpu_gib(family, 150))
    with hisparse_transformers.enable(model, **kw) as hs:
        hs.graphs.enabled, hs.graphs.capture = True, False
        seen: list[int] = []
        hs.on_step = lambda handle, step: seen.append(capacity(handle)) if step.num_new == 1 else None
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=64, **GEN)
        s = hs.stats()
    got = compare(ours, theirs)
    assert got.tokens_equal and got.steps == 64 and got.max_logit_diff <= 1e-4, got
    assert s.decode_mode == "static eager" and s.misses > 0 and s.released_pages > 0, s
    assert len(seen) == 63 and seen[0] == 256 and seen[-1] > 256, seen


def test_a_failed_capture_falls_back_to_eager(family: str, model: torch.nn.Module,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """Capture forced where it cannot happen (a CPU model, on a machine with or without CUDA): one
    WARNING naming the failure, and the decode goes on eagerly with the same outputs."""
    ids, mask = random_prompts([30, 41], seed=3)
    theirs = baseline(model, ids, mask, 12, chunk=8)
    with hisparse_transformers.enable(model, **enable_kwargs(family, check=False)) as hs:
        hs.graphs.enabled, hs.graphs.capture = True, True
        with caplog.at_level(logging.WARNING, logger="hisparse_transformers.graphs"):
            ours = model.generate(ids, attention_mask=mask, max_new_tokens=12, **GEN)
        s = hs.stats()
    got = compare(ours, theirs)
    assert got.tokens_equal and got.max_logit_diff <= 1e-4, got
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "could not be captured" in warnings[0].getMessage(), warnings
    assert " at graphs.py:" in warnings[0].getMessage() and "in _capture)" in warnings[0].getMessage(), warnings
    assert s.decode_mode.startswith("eager (capture failed: ") and s.graph_captures == 0, s
    assert gc.isenabled(), "garbage collection stays off after a failed capture"


def test_graph_choice_is_logged_and_explicit_requests_checked(caplog: pytest.LogCaptureFixture) -> None:
    family = "deepseek_v32"
    model = tiny_model(family, shape=SHAPES[family], seed=0)
    with caplog.at_level(logging.INFO, logger="hisparse_transformers.graphs"), \
            hisparse_transformers.enable(model, **enable_kwargs(family, check=False)) as hs:
        assert not hs.graphs.enabled and "not a CUDA device" in hs.graphs.reason
    assert any("decode steps run eagerly (the model runs on cpu" in r.getMessage() for r in caplog.records)
    with hisparse_transformers.enable(model, **enable_kwargs(family, check=True)) as hs:
        assert hs.stats().decode_mode.startswith("eager (")
    with hisparse_transformers.enable(model, **enable_kwargs(family, cuda_graphs=False)) as hs:
        assert hs.stats().decode_mode == "eager (cuda_graphs=False)"
    for bad, match in ((True, r"cuda_graphs=True, but the model runs on cpu"), ("yes", r"cuda_graphs must be True")):
        with pytest.raises(InvalidInputError, match=match) as err:
            hisparse_transformers.enable(model, **enable_kwargs(family, cuda_graphs=bad))
        assert "\n" not in str(err.value)
        assert "generate" not in model.__dict__ and "forward" not in model.model.__dict__


def test_an_moe_that_picks_experts_on_the_host_is_not_captured(caplog: pytest.LogCaptureFixture) -> None:
    family = "deepseek_v32"
    model = tiny_model(family, shape=NO_TIES[family], seed=4)
    model.set_experts_implementation("eager")
    ids, mask = random_prompts([20, 13], seed=3)
    theirs = baseline(model, ids, mask, 6, chunk=8)
    with hisparse_transformers.enable(model, **enable_kwargs(family, check=False)) as hs:
        hs.graphs.enabled, hs.graphs.capture = True, True
        with caplog.at_level(logging.WARNING, logger="hisparse_transformers.graphs"):
            ours = model.generate(ids, attention_mask=mask, max_new_tokens=6, **GEN)
        s = hs.stats()
    assert compare(ours, theirs).tokens_equal
    assert "experts_implementation='eager'" in s.decode_mode and "set_experts_implementation" in s.decode_mode, s
    assert [r for r in caplog.records if "model.layers.1.mlp.experts" in r.getMessage()], caplog.records


def test_a_float32_grouped_mm_moe_is_named_as_the_likely_cause() -> None:
    """torch's grouped_mm on float32 weights loops over the groups reading their offsets on the host
    (the H200's captures failed there): a failed capture's warning names those experts and the fix."""
    from hisparse_transformers.graphs import grouped_mm_host_loop

    model = tiny_model("deepseek_v32", shape=NO_TIES["deepseek_v32"], seed=4)
    model.set_experts_implementation("grouped_mm")
    why = grouped_mm_host_loop(model)
    assert why is not None and why.startswith("model.layers.1.mlp.experts ") and "float32" in why, why
    assert "set_experts_implementation('batched_mm')" in why, why
    model.set_experts_implementation("batched_mm")
    assert grouped_mm_host_loop(model) is None
    model.set_experts_implementation("grouped_mm")
    assert grouped_mm_host_loop(model.to(torch.bfloat16)) is None
    assert grouped_mm_host_loop(None) is None


def test_verification_steps_take_the_static_path(family: str, model: torch.nn.Module,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """Assisted generation through the static computation: its one-token steps and its verification
    steps (several tokens a row, one set of static buffers per width) take the static path, nothing
    says a step ran eagerly, and the tokens are plain greedy's."""
    g = torch.Generator().manual_seed(5)
    head = torch.randint(2, 128, (40,), generator=g)
    prompt = torch.cat([head, head[5:25]]).view(1, -1)    # repeats itself: prompt lookup proposes
    theirs = model.generate(prompt, max_new_tokens=12, do_sample=False)
    kw = enable_kwargs(family, check=False, max_context=256, prefill_chunk=32, speculative_tokens=3, max_batch=1,
                       hot_rows=4 * NO_TIES[family].index_topk, gpu_kv_gib=0.05)
    widths: list[int] = []
    with hisparse_transformers.enable(model, **kw) as hs:
        hs.graphs.enabled, hs.graphs.capture = True, False
        hs.on_step = lambda handle, step: widths.append(handle.graphs.last.width) \
            if handle.graphs.last is not None and handle.graphs.last.width == step.num_new else None
        with caplog.at_level(logging.INFO, logger="hisparse_transformers.graphs"):
            # only what generate logs: enable's own line ("decode steps run eagerly (the model runs on
            # cpu ...)") is caught too where the log level lets INFO through (pytest --log-level)
            caplog.clear()
            ours = model.generate(prompt, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3)
        s = hs.stats()
    assert torch.equal(ours, theirs)
    eager = [r.getMessage() for r in caplog.records if "eagerly" in r.getMessage()]
    assert s.verify_steps > 1 and not eager, (s, eager)
    # the first verification comes with the prompt in one forward (run as prefill chunks, then the
    # candidates' step: a prefill forward, eager by design); every later one took the static path
    assert sum(w > 1 for w in widths) == s.verify_steps - 1, (widths, s.verify_steps)
