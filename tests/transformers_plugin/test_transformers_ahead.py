"""Each decode step planned while the device runs the one before (`HiSparseEngine.plan_ahead`,
`hisparse_core.coordinator.ahead`): the same tokens and logits, bit for bit, and the same
coordinator figures as planning every step between forwards, under GPU pressure (pages released
and read back from host), host pressure (published blocks evicted) and prefix reuse; a failure
while planning surfaces at the next forward with the request named, and nothing leaks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tf_support import GEN, SHAPES, enable_kwargs, random_prompts, tiny_model

import hisparse_transformers
from hisparse_core.errors import CapacityError
from hisparse_transformers.tiny import TinyShape

pytest.importorskip("transformers")

FAMILY = "deepseek_v32"


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model(FAMILY, shape=SHAPES[FAMILY], seed=3)


def _host_gib(blocks: int) -> float:
    s: TinyShape = SHAPES[FAMILY]
    return (blocks + 1) * s.layers * 4 * (s.kv_lora + s.rope) * 4 / 2**30


def _two_batches(model: torch.nn.Module, plan_ahead: bool) -> tuple[list[Any], dict[str, int]]:
    ids, mask = random_prompts([40, 57, 23], seed=1)
    ids2, mask2 = random_prompts([48, 33, 60], seed=7, prefix=ids[1, :32].tolist())
    # 70 host blocks: the second batch evicts published blocks of the first (host pressure).
    with hisparse_transformers.enable(model, **enable_kwargs(FAMILY, host_pool_gib=_host_gib(70), check=False)) as hs:
        hs.engine.plan_ahead = plan_ahead
        outs = [model.generate(ids, attention_mask=mask, max_new_tokens=40, **GEN),
                model.generate(ids2, attention_mask=mask2, max_new_tokens=12, **GEN)]
        s = hs.stats()
        a = hs.engine.ahead
        figures = dict(spills=s.spills, released=s.released_pages, lost=s.lost_pages, hits=s.hits, misses=s.misses,
                       h2d=s.h2d_bytes, d2h=s.d2h_bytes, prefix=s.prefix_hit_tokens,
                       evicted=hs.engine.coordinator.stats().evicted_blocks, claimed=a.claimed, cancelled=a.cancelled)
        assert hs.engine.gpu.num_leased_blocks == 0
    return outs, figures


def test_planned_decode_gives_the_same_tokens_logits_and_figures(model: torch.nn.Module) -> None:
    today, fig_today = _two_batches(model, plan_ahead=False)
    ours, fig_ours = _two_batches(model, plan_ahead=True)
    for a, b in zip(ours, today, strict=True):
        assert torch.equal(a.sequences, b.sequences)
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits, strict=True))
    assert fig_today["claimed"] == 0 and fig_ours["claimed"] >= 40, fig_ours
    # No step is planned past the last forward: it would write past what admission reserved
    # (prompt + max_new_tokens - 1), and generate stops there. (It used to be planned and then
    # cancelled, sealing and spilling the page the last forward completed.)
    assert fig_ours["cancelled"] == 0
    extra = fig_ours["spills"] - fig_today["spills"]
    assert 0 <= extra <= 2 and fig_ours["d2h"] >= fig_today["d2h"]
    # Those pages are published, so a full host pool evicts as many more cached blocks.
    assert fig_ours["evicted"] - fig_today["evicted"] == extra
    for k in ("released", "lost", "hits", "misses", "h2d", "prefix"):
        assert fig_ours[k] == fig_today[k], (k, fig_ours, fig_today)
    assert fig_ours["released"] and fig_ours["misses"] and fig_ours["evicted"], fig_ours
    assert fig_ours["prefix"] > 0


def test_a_planning_failure_names_the_request_and_leaks_nothing(model: torch.nn.Module) -> None:
    ids, mask = random_prompts([40, 57, 23], seed=2)
    with hisparse_transformers.enable(model, **enable_kwargs(FAMILY, check=False)) as hs:
        engine = hs.engine
        acquire = engine.gpu.acquire
        calls = {"n": 0}

        def flaky(count: int) -> list[int]:
            # Fail the first allocation of a step planned ahead after a few decode steps.
            if engine.ahead.planned >= 5:
                calls["n"] += 1
                if calls["n"] == 2:
                    raise CapacityError(f"planted: {count} blocks refused")
            return acquire(count)

        engine.gpu.acquire = flaky  # type: ignore[method-assign]
        with pytest.raises(CapacityError, match=r"no GPU block for request hf-\d+'s next page \(planted") as err:
            model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
        assert any("planning step" in n for n in err.value.__notes__)
        assert engine.gpu.num_leased_blocks == 0 and engine.session is None
        engine.gpu.acquire = acquire  # type: ignore[method-assign]
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        assert out.shape[1] == ids.shape[1] + 4
    assert engine.closed


def test_a_step_that_cannot_fit_after_releases_is_refused_before_any_lease(model: torch.nn.Module) -> None:
    """GPU blocks too few even after the policy released every clean page (here: 46 of the 58
    blocks of the smallest pool leased by someone else): the step is refused before it leases a
    block (a lease of a released block would lose that page for nothing), in one line naming the
    budget, and nothing leaks."""
    from tf_support import tight_gpu_gib

    ids, mask = random_prompts([70, 90, 50], seed=4)
    with hisparse_transformers.enable(model, **enable_kwargs(FAMILY, gpu_kv_gib=tight_gpu_gib(FAMILY, 58),
                                                             check=False)) as hs:
        engine = hs.engine
        hog = engine.gpu.acquire(46)
        make_room = engine.coordinator.make_room
        seen: dict[str, int] = {}

        def recording(blocks: int) -> int:
            free = make_room(blocks)
            seen["lost"] = engine.coordinator.stats().lost_pages
            return free

        engine.coordinator.make_room = recording  # type: ignore[method-assign]
        with pytest.raises(CapacityError, match=r"GPU blocks and \d+ are free after releasing every clean page"):
            model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        assert seen, "the step asked the policy for room first"
        assert engine.coordinator.stats().lost_pages == seen["lost"], "the refused step lost a released page"
        assert engine.session is None and engine.gpu.num_leased_blocks == len(hog)
        engine.gpu.release(hog)
