"""`enable(..., prefetch_next_group=True)` (prefetch.py): the next index group's resolve runs on
this group's top-k. Outputs are those of a run without it (the exactness checker compares every row
attention reads), only the LRU order and the misses differ; under the locality model's coupled
top-k the next group's critical-path misses drop; a bad value is one line."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from tf_support import GEN, SHAPES, enable_kwargs, forced_logits, gpu_reason, random_prompts, tiny_model

import hisparse_transformers
from hisparse_core.errors import InvalidInputError
from hisparse_transformers.tiny import TinyShape

pytest.importorskip("transformers")

#: DeepSeek-V3.2 (one layer a group) and GLM-5 with two groups of a leader and a follower: the
#: prefetch's plan must reach the follower too (the group's layers share one hot map).
CASES = {"deepseek_v32": SHAPES["deepseek_v32"], "glm_moe_dsa": TinyShape(layers=4, index_share=2)}


def _generate(model: torch.nn.Module, family: str, prefetch: bool) -> tuple[Any, Any]:
    ids, mask = random_prompts([100, 77, 60], seed=4)
    shape = CASES[family]
    row = (shape.kv_lora + shape.rope) * 4
    budget = 66 * shape.layers * 4 * row / 2**30       # 66 pages: pages go back to host and return through misses
    with hisparse_transformers.enable(model, **enable_kwargs(family, prefetch_next_group=prefetch,
                                                             gpu_kv_gib=budget)) as hs:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=14, **GEN)
        return out, hs.stats()


@pytest.mark.parametrize("family", sorted(CASES))
def test_prefetch_leaves_outputs_unchanged(family: str) -> None:
    model = tiny_model(family, shape=CASES[family], seed=5)
    off, s_off = _generate(model, family, False)
    on, s_on = _generate(model, family, True)
    assert torch.equal(off.sequences, on.sequences)
    for a, b in zip(off.logits, on.logits, strict=True):
        assert torch.equal(a, b)
    # check=True compared every row both runs read with the model's own latent
    assert s_on.checked_entries == s_off.checked_entries > 0 and s_on.checked_max_abs_diff == 0.0
    assert s_off.prefetch_misses == 0 and s_on.prefetch_misses > 0
    assert s_on.prefetch_h2d_bytes > 0 and s_on.misses > s_on.prefetch_misses


def _next_group_misses(model: torch.nn.Module, prefetch: bool, layers: str = "30,31", regime: str = "code",
                       resident: str = "") -> tuple[int, int, list[torch.Tensor]]:
    """(group 1's critical-path misses, its prefetches' misses, the logits) of teacher-forced decode
    steps whose top-k comes from the locality model, the two groups standing for `layers`
    (default adjacent reference layers: coupled top-k)."""
    family = "deepseek_v32"
    ids, mask = random_prompts([120, 96, 110], seed=7)
    continuation = torch.randint(0, 128, (3, 24), generator=torch.Generator().manual_seed(3))
    kw = enable_kwargs(family, check=False, synthetic_topk=regime, prefetch_next_group=prefetch, max_context=160,
                       synthetic_topk_layers=layers, resident_layers=resident,
                       # 60 blocks of the hisparse layers' pages (4 tokens of 24 fp32), and the resident layer's store
                       gpu_kv_gib=(60 * 4 * (2 - len(resident)) * 24 * 4 + (3 * 160 * 24 * 4 if resident else 0)) / 2**30)
    with hisparse_transformers.enable(model, **kw) as hs:
        engine = hs.engine
        assert engine.topk_model is not None
        assert engine.topk_model.layers == [int(x) for x in layers.split(",")]
        cache = hs.new_cache(ids, mask)
        logits = forced_logits(model, ids, mask, continuation, cache, 8)
        looked = engine.runtimes[1].stats()          # before the session's end takes the counters
        pre = int(engine.prefetch.counts[1]) if engine.prefetch is not None else 0
        cache.finish()
    return looked.misses - pre, pre, logits


def test_prefetch_cuts_the_next_groups_critical_misses() -> None:
    model = tiny_model("deepseek_v32", shape=SHAPES["deepseek_v32"], seed=5)
    off, none, want = _next_group_misses(model, False)
    on, pre, got = _next_group_misses(model, True)
    print(f"group 1 critical-path misses: {off} without the prefetch, {on} with it (+{pre} prefetched)")
    assert none == 0 and pre > 0
    assert off > 0 and on < 0.7 * off, (off, on, pre)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("regime", ["code", "benign"])
@pytest.mark.parametrize("layers", ["0,60", "20,21"])
def test_prefetch_leaves_logits_unchanged_under_spread_and_adjacent_layers(layers: str, regime: str) -> None:
    """Nothing in the prefetch assumes how far apart the groups' reference layers are: under spread
    (0, 60) and adjacent (20, 21) layers, both regimes, the logits with it are those without; it
    copies rows either way (and under adjacent layers takes some of group 1's critical misses)."""
    model = tiny_model("deepseek_v32", shape=SHAPES["deepseek_v32"], seed=5)
    off, none, want = _next_group_misses(model, False, layers, regime)
    on, pre, got = _next_group_misses(model, True, layers, regime)
    print(f"{regime} {layers}: group 1 critical misses {off} -> {on} (+{pre} prefetched)")
    assert none == 0 and pre > 0 and off > 0, (off, on, pre)
    assert layers == "0,60" or on < off, (off, on, pre)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)


def test_a_resident_group_prefetches_its_successor() -> None:
    """Group 0 resident (no resolve of its own): group 1 is still prefetched from group 0's top-k
    (adjacent reference layers), its critical misses fall, and the logits are those without it."""
    model = tiny_model("deepseek_v32", shape=SHAPES["deepseek_v32"], seed=5)
    off, none, want = _next_group_misses(model, False, "30,31", "code", resident="0")
    on, pre, got = _next_group_misses(model, True, "30,31", "code", resident="0")
    print(f"group 0 resident: group 1 critical misses {off} -> {on} (+{pre} prefetched)")
    assert none == 0 and pre > 0 and off > 0 and on < 0.7 * off, (off, on, pre)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)


def test_bad_prefetch_next_group_is_one_line() -> None:
    model = tiny_model("deepseek_v32", shape=SHAPES["deepseek_v32"], seed=5)
    with pytest.raises(InvalidInputError, match=r"prefetch_next_group must be True or False, or a tuple .* got 'yes'"):
        hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", prefetch_next_group="yes"))
    assert getattr(model, "_hisparse_handle", None) is None or model._hisparse_handle.closed
    three = tiny_model("deepseek_v32", shape=TinyShape(layers=3), seed=5)
    for bad, msg in (((2,), r"group 2 has no next index group; expected source groups in \[0, 2\)"),
                     ([0, 0], r"tuple of distinct index groups"), ((True,), r"tuple of distinct index groups"),
                     ((-1,), r"tuple of distinct index groups"), ("0,1", r"got '0,1'")):
        with pytest.raises(InvalidInputError, match=msg) as info:
            hisparse_transformers.enable(three, **enable_kwargs("deepseek_v32", prefetch_next_group=bad))
        assert "\n" not in str(info.value) and "prefetch_next_group" in str(info.value)
        assert getattr(three, "_hisparse_handle", None) is None or three._hisparse_handle.closed


@functools.cache
def _group_prefetches(sources: bool | tuple[int, ...], layers: str = "0,20,40") -> tuple[list[int], list[int],
                                                                                         list[torch.Tensor]]:
    """(prefetch copies into each group, misses of each group's runtime, logits) of teacher-forced
    decode steps of a 3-layer DeepSeek-V3.2 under the code regime's locality model, the groups
    standing for reference `layers` (default spread: group 0 churns like GVR's layer 0)."""
    shape = TinyShape(layers=3)
    model = tiny_model("deepseek_v32", shape=shape, seed=5)
    ids, mask = random_prompts([120, 96, 110], seed=7)
    continuation = torch.randint(0, 128, (3, 24), generator=torch.Generator().manual_seed(3))
    kw = enable_kwargs("deepseek_v32", check=False, synthetic_topk="code", prefetch_next_group=sources,
                       max_context=160, synthetic_topk_layers=layers,
                       gpu_kv_gib=60 * 4 * 3 * 24 * 4 / 2**30)     # 60 pages: most positions come back as misses
    with hisparse_transformers.enable(model, **kw) as hs:
        engine = hs.engine
        cache = hs.new_cache(ids, mask)
        logits = forced_logits(model, ids, mask, continuation, cache, 8)
        pre = [int(c) for c in engine.prefetch.counts] if engine.prefetch is not None else [0] * 3
        misses = [engine.runtimes[g].stats().misses for g in range(3)]
        cache.finish()
    return pre, misses, logits


@pytest.mark.parametrize("sources", [(), (0,), (1,), (0, 1)])
def test_prefetch_from_chosen_groups_only(sources: tuple[int, ...]) -> None:
    """`prefetch_next_group=(g, ...)`: only those groups' successors are prefetched (copies land in
    g + 1 and nowhere else), and the logits are those of the model's own attention run without
    any prefetch (every row attention reads is the resolved one, whatever was prefetched)."""
    _, off_misses, want = _group_prefetches(False)
    pre, misses, got = _group_prefetches(sources)
    print(f"sources {sources}: prefetched {pre}, misses {misses} (off {off_misses})")
    assert [g for g in range(3) if pre[g]] == sorted(g + 1 for g in sources), pre
    assert misses[0] == off_misses[0]              # group 0 is never a target: its LRU sees the same lookups
    for g in range(1, 3):
        if g - 1 not in sources:
            assert misses[g] == off_misses[g], (g, misses, off_misses)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)


def test_true_is_every_pair() -> None:
    every, misses_every, _ = _group_prefetches(True)
    both, misses_both, _ = _group_prefetches((0, 1))
    assert every == both and misses_every == misses_both and every[1] > 0 and every[2] > 0


@pytest.mark.gpu
@pytest.mark.skipif(gpu_reason() is not None, reason=f"nvidia backend unavailable: {gpu_reason()}")
@pytest.mark.parametrize("family", sorted(CASES))
@pytest.mark.parametrize("mode", ["cuda graph", "eager, checked"])
def test_prefetch_on_the_gpu_leaves_outputs_unchanged(family: str, mode: str) -> None:
    """On the nvidia backend the prefetch runs on a side stream beside the group's attention:
    decode steps replayed from a CUDA graph (fork and join captured), or eager with every row
    attention reads compared with the model's own latent; the same tokens and logits either way."""
    shape = CASES[family]
    m: Any = tiny_model(family, shape=shape, seed=11, device="cuda")
    m.set_experts_implementation("batched_mm")   # float32 grouped_mm reads its offsets on the host
    ids, mask = random_prompts([97, 110, 103], seed=3)
    ids, mask = ids.cuda(), mask.cuda()
    budget = 66 * shape.layers * 4 * (shape.kv_lora + shape.rope) * 4 / 2**30
    graphs = mode == "cuda graph"
    outs, stats = [], []
    for prefetch in (False, True):
        kw = enable_kwargs(family, backend="nvidia", check=not graphs, cuda_graphs=graphs, gpu_kv_gib=budget,
                           prefetch_next_group=prefetch)
        with hisparse_transformers.enable(m, **kw) as hs:
            gen: Any = m.generate
            outs.append(gen(ids, attention_mask=mask, max_new_tokens=12, prefill_chunk_size=8, **GEN))
            stats.append(hs.stats())
    off, on = stats
    assert on.decode_mode == off.decode_mode and (on.decode_mode == "cuda graph") == graphs, on.decode_mode
    assert off.misses > 0 and on.prefetch_misses > 0 and off.prefetch_misses == 0
    if not graphs:
        assert on.checked_entries == off.checked_entries > 0 and on.checked_max_abs_diff == 0.0
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    for a, b in zip(outs[0].logits, outs[1].logits, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(gpu_reason() is not None, reason=f"nvidia backend unavailable: {gpu_reason()}")
@pytest.mark.parametrize("family", sorted(CASES))
def test_prefetch_out_of_a_resident_group_on_the_gpu(family: str) -> None:
    """Group 0 resident (its whole KV in a store, no resolve): its leader still launches group 1's
    prefetch on the side stream, captured in the decode graph; the same tokens and logits as
    without the prefetch, and the prefetch copied rows."""
    shape = CASES[family]
    first = [0] if family == "deepseek_v32" else [0, 1]        # group 0's layers
    m: Any = tiny_model(family, shape=shape, seed=11, device="cuda")
    m.set_experts_implementation("batched_mm")
    ids, mask = random_prompts([97, 110, 103], seed=3)
    ids, mask = ids.cuda(), mask.cuda()
    row = (shape.kv_lora + shape.rope) * 4
    budget = (66 * (shape.layers - len(first)) * 4 * row + len(first) * 3 * 256 * row) / 2**30
    outs, stats = [], []
    for prefetch in (False, True):
        kw = enable_kwargs(family, backend="nvidia", check=False, cuda_graphs=True, gpu_kv_gib=budget,
                           prefetch_next_group=prefetch, resident_layers=first)
        with hisparse_transformers.enable(m, **kw) as hs:
            gen: Any = m.generate
            outs.append(gen(ids, attention_mask=mask, max_new_tokens=12, prefill_chunk_size=8, **GEN))
            stats.append(hs.stats())
    off, on = stats
    assert on.decode_mode == off.decode_mode == "cuda graph", on.decode_mode
    assert off.misses > 0 and on.prefetch_misses > 0 and off.prefetch_misses == 0
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    for a, b in zip(outs[0].logits, outs[1].logits, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(gpu_reason() is not None, reason=f"nvidia backend unavailable: {gpu_reason()}")
def test_prefetch_from_chosen_groups_in_a_captured_graph() -> None:
    """`prefetch_next_group=(1,)` on a 3-layer DeepSeek-V3.2 on the nvidia backend, decode steps
    replayed from a CUDA graph: only group 2 is prefetched (group 1 gets no side-stream resolve),
    and the tokens and logits are those without any prefetch."""
    m: Any = tiny_model("deepseek_v32", shape=TinyShape(layers=3), seed=11, device="cuda")
    m.set_experts_implementation("batched_mm")
    ids, mask = random_prompts([97, 110, 103], seed=3)
    ids, mask = ids.cuda(), mask.cuda()
    shape = TinyShape(layers=3)
    budget = 66 * shape.layers * 4 * (shape.kv_lora + shape.rope) * 4 / 2**30
    outs, per_group = [], []
    for prefetch in (False, (1,)):
        kw = enable_kwargs("deepseek_v32", backend="nvidia", check=False, cuda_graphs=True, gpu_kv_gib=budget,
                           prefetch_next_group=prefetch)
        with hisparse_transformers.enable(m, **kw) as hs:
            gen: Any = m.generate
            outs.append(gen(ids, attention_mask=mask, max_new_tokens=12, prefill_chunk_size=8, **GEN))
            assert hs.stats().decode_mode == "cuda graph"
            per_group.append(list(hs.engine.totals.prefetch_misses))
    assert per_group[0] == [0, 0, 0] and per_group[1][:2] == [0, 0] and per_group[1][2] > 0, per_group
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    for a, b in zip(outs[0].logits, outs[1].logits, strict=True):
        assert torch.equal(a, b)
