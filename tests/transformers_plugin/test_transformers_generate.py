"""A real model's attention reads its KV through hisparse: DeepSeek-V3.2 and GLM-5 (tiny random
configs, fp32, reference_cpu), greedy generate compared with the model's own generate."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tf_support import (
    BLOCK,
    GEN,
    SHAPES,
    TOP_K,
    TinyShape,
    baseline,
    compare,
    enable_kwargs,
    random_prompts,
    tight_gpu_gib,
    tiny_model,
)

import hisparse_transformers
from hisparse_core.types import WorkerMetadata
from hisparse_transformers.check import RowMismatch

pytest.importorskip("transformers")

LENGTHS = [40, 57, 23]
NEW = 64


@pytest.fixture(scope="module", params=sorted(SHAPES))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(family: str) -> torch.nn.Module:
    return tiny_model(family, shape=SHAPES[family], seed=3)


def test_generate_matches_the_model_and_reuses_prefixes(family: str, model: torch.nn.Module) -> None:
    ids, mask = random_prompts(LENGTHS, seed=1)
    theirs = baseline(model, ids, mask, NEW, chunk=8)
    with hisparse_transformers.enable(model, **enable_kwargs(family)) as hs:
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, **GEN)
        got = compare(ours, theirs)
        assert got.tokens_equal, "hisparse tokens differ from the model's own generate"
        assert got.steps == NEW and got.max_logit_diff <= 1e-4, got
        s = hs.stats()
        # Contexts (up to 121 tokens) are longer than the hot buffer (16 rows) and the GPU budget
        # (66 pages for 93 all-resident ones) releases pages: they are read back from host.
        assert max(LENGTHS) + NEW > hs.engine.hot_rows
        assert s.released_pages > 0 and s.lost_pages > 0 and s.misses > 0 and s.hits > 0, s
        assert s.h2d_bytes >= s.misses * hs.engine.fmt.row_bytes and s.d2h_bytes > 0
        assert s.gpu_kv_bytes_per_request < s.gpu_kv_bytes_per_request_all_resident
        assert s.checked_entries > 0 and s.prefix_hit_tokens == 0

        # A second batch whose prompts share the first 32 tokens of row 1: whole pages come from the
        # host pool (prefix hits), read by the prefill straight from the host views, outputs unchanged.
        prefix = ids[1, :32].tolist()
        ids2, mask2 = random_prompts([48, 33, 60], seed=7, prefix=prefix)
        theirs2 = baseline(model, ids2, mask2, 16, chunk=8)
        ours2 = model.generate(ids2, attention_mask=mask2, max_new_tokens=16, **GEN)
        got2 = compare(ours2, theirs2)
        assert got2.tokens_equal and got2.max_logit_diff <= 1e-4, got2
        s2 = hs.stats()
        assert s2.prefix_hit_tokens == 3 * 32, s2      # 8 pages of 4 tokens per request
        assert s2.prefill_host_bytes > 0
        held = [weakref.ref(t) for group in hs.engine.host_views + hs.engine.device_layers for t in group]
        held += [weakref.ref(r) for r in hs.engine.runtimes if r is not None]
    # Closed: the model is its own again, and the host pool is gone.
    assert "generate" not in model.__dict__
    assert all("forward" not in layer.self_attn.__dict__ for layer in model.model.layers)
    assert hs.engine.worker.host_pool_spec is not None and hs.engine.closed
    # ... gone while the handle lives: no runtime, host-pool view or device cache is left (the
    # runtimes kept views of both, so the pool's RAM was freed only with the handle).
    gc.collect()
    assert held and [ref() for ref in held] == [None] * len(held)
    again = baseline(model, ids, mask, 4, chunk=8)
    assert torch.equal(again.sequences, theirs.sequences[:, :ids.shape[1] + 4])


def test_explicit_cache_and_disable(model: torch.nn.Module, family: str) -> None:
    ids, mask = random_prompts([9, 14], seed=5)
    theirs = baseline(model, ids, mask, 6, chunk=8)
    hs = hisparse_transformers.enable(model, **enable_kwargs(family, gpu_kv_gib=1e-3))
    try:
        cache = hs.new_cache()
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=6, past_key_values=cache, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)
        assert compare(ours, theirs).tokens_equal
        with pytest.raises(hisparse_transformers.handle.InvalidInputError, match="used already"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, past_key_values=cache)
    finally:
        hisparse_transformers.disable(model)
    assert hs.closed and "generate" not in model.__dict__



def test_close_puts_back_what_the_instances_held_before_enable() -> None:
    """An accelerate hook on the base model (its `forward` an instance attribute, as a device_map
    whose key is the whole base model leaves it), a caller's own `generate` and an attention layer's
    instance `forward` are the model's again after close. Before: close deleted each of them, so the
    hook no longer ran and the caller's generate was gone."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    family = "deepseek_v32"
    m = tiny_model(family, shape=SHAPES[family], seed=3)
    add_hook_to_module(m.model, ModelHook())
    attention = m.model.layers[1].self_attn
    attention.forward = attention.forward              # an instance forward of no accelerate hook
    m.generate = lambda *args, **kwargs: "mine"        # type: ignore[method-assign]
    held = (m.model.__dict__["forward"], attention.__dict__["forward"], m.__dict__["generate"])
    with hisparse_transformers.enable(m, **enable_kwargs(family, check=False)):
        assert m.__dict__["generate"] is not held[2]
    assert (m.model.__dict__["forward"], attention.__dict__["forward"], m.__dict__["generate"]) == held
    assert "forward" not in m.model.layers[0].self_attn.__dict__ and not hasattr(m, "_hisparse_handle")
    # a generate the caller set while enabled is theirs: close leaves it
    with hisparse_transformers.enable(m, **enable_kwargs(family, check=False)):
        m.generate = later = lambda *args, **kwargs: "later"   # type: ignore[method-assign]
    assert m.__dict__["generate"] is later



def test_the_padding_a_generation_config_names_is_masked_as_transformers_masks_it(model: torch.nn.Module,
                                                                                   family: str) -> None:
    """No attention_mask: generate infers it from the pad token of the generation_config passed.
    Before: hisparse read the model's own pad token (0) and the call's kwargs only, took the
    padding (5) for prompt tokens, and decoded other tokens than the model's own."""
    from transformers import GenerationConfig

    ids, _ = random_prompts([9, 6], seed=4, pad_id=5)
    config = GenerationConfig(pad_token_id=5, max_new_tokens=3, do_sample=False)
    theirs = model.generate(ids, generation_config=config)
    with hisparse_transformers.enable(model, **enable_kwargs(family, check=False)):
        assert torch.equal(model.generate(ids, generation_config=config), theirs)


def _plant_in_decode(hs: hisparse_transformers.HiSparseHandle, layer: int, planted: dict[str, int]) -> None:
    """After a decode step, corrupt the host row of a position this step read from a host-only page,
    and drop its hot copy (as a recycled host block would be), so the next read misses and reloads."""
    if planted:
        return
    e = hs.engine
    session = e.session
    assert session is not None and session.step is None
    group, pos = e.layout.group_of(layer)
    rmap = None
    step = getattr(hs, "_last_step", None)
    if step is not None:
        rmap = step.group_cache.get(group)
    if rmap is None or rmap.rows is None:
        return
    bs = e.config.block_size
    for b, r in enumerate(session.requests):
        for t in rmap.positions[b, 0].tolist():
            if t < 0 or e.resident_table[r.state_index, t // bs] >= 0:
                continue
            block = int(e.source_table[r.state_index, t // bs])
            e.host_views[group][pos][block * bs + t % bs] += 1.0
            e.worker.runtimes[group].invalidate_host_blocks([block])
            planted.update(layer=layer, row=b, position=t)
            return


def test_planted_host_fault_is_named_in_decode(family: str, model: torch.nn.Module) -> None:
    layer = SHAPES[family].layers - 1
    ids, mask = random_prompts(LENGTHS, seed=1)
    planted: dict[str, int] = {}
    with hisparse_transformers.enable(model, **enable_kwargs(family)) as hs:
        def on_step(handle, step) -> None:  # type: ignore[no-untyped-def]
            handle._last_step = step
            if step.num_new == 1:
                _plant_in_decode(handle, layer, planted)

        hs.on_step = on_step
        with pytest.raises(RowMismatch) as err:
            model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert planted, "no host-only position was read in decode: the fault could not be planted"
    e = err.value
    assert (e.layer, e.row, e.position) == (planted["layer"], planted["row"], planted["position"]), (e, planted)
    assert f"layer {layer}" in str(e) and f"position {planted['position']}" in str(e)


def test_planted_host_fault_is_named_in_prefix_prefill(family: str, model: torch.nn.Module) -> None:
    """A prefix hit's position 0 is always read by the prefill (the first query sees only it)."""
    ids, mask = random_prompts([24, 30], seed=11)
    with hisparse_transformers.enable(model, **enable_kwargs(family, gpu_kv_gib=1e-3)) as hs:
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        prefix = ids[1, -30:].tolist()[:16]
        hit = hs.engine.coordinator.lookup_prefix(prefix)
        assert hit.num_tokens == 16
        layer = 1
        group, pos = hs.engine.layout.group_of(layer)
        hs.engine.host_views[group][pos][hit.host_block_ids[0] * BLOCK] *= -3.0
        ids2, mask2 = random_prompts([20], seed=12, prefix=prefix)
        with pytest.raises(RowMismatch, match=r"layer 1, batch row 0 .*position 0: the row read from the host pool"):
            model.generate(ids2, attention_mask=mask2, max_new_tokens=2, do_sample=False)
        # The failed batch left nothing behind: the next one (other prompts) runs.
        ids3, mask3 = random_prompts([10, 12], seed=99)
        model.generate(ids3, attention_mask=mask3, max_new_tokens=2, do_sample=False)


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(lengths=st.lists(st.integers(3, 30), min_size=1, max_size=3), chunk=st.sampled_from([4, 7, 16, 64]),
       block=st.sampled_from([2, 4, 8]), seed=st.integers(0, 2**16), family=st.sampled_from(sorted(SHAPES)))
def test_fresh_models_match_across_shapes(lengths: list[int], chunk: int, block: int, seed: int,
                                          family: str) -> None:
    shape = TinyShape(layers=2 if family == "deepseek_v32" else 3, index_topk=8)
    model = tiny_model(family, shape=shape, seed=seed)
    ids, mask = random_prompts(lengths, seed=seed)
    theirs = baseline(model, ids, mask, 12, chunk=chunk)
    with hisparse_transformers.enable(model, host_pool_gib=0.01, gpu_kv_gib=4e-3, block_size=block, hot_rows=block * 4,
                                      max_batch=3, max_context=128, prefill_chunk=chunk, check=True):
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=12, **GEN)
    got = compare(ours, theirs)
    assert got.tokens_equal and got.max_logit_diff <= 1e-4, (got, lengths, chunk, block)


def test_topk_shorter_than_runtime_and_single_row(model: torch.nn.Module, family: str) -> None:
    """Contexts shorter than index_topk: the indexer returns fewer entries, padded with -1."""
    ids, mask = random_prompts([5], seed=2)
    theirs = baseline(model, ids, mask, 6, chunk=8)
    with hisparse_transformers.enable(model, **enable_kwargs(family, gpu_kv_gib=1e-3)):
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=6, **GEN)
    got = compare(ours, theirs)
    assert 5 + 6 < TOP_K and got.tokens_equal and got.max_logit_diff <= 1e-4


def test_pressure_relief_steps_keep_outputs_exact(family: str, model: torch.nn.Module) -> None:
    """Spill acknowledgements held back until drained (a device whose copies lag far behind a fast
    prefill): steps whose pages do not fit wait for them and the residency policy releases pages,
    leasing hot buffers out of them when the pool is drained; nothing the model sees changes."""
    ids, mask = random_prompts([70, 90, 50], seed=4)   # 63 pages at the end, in the smallest pool: 58
    theirs = baseline(model, ids, mask, 12, chunk=8)
    with hisparse_transformers.enable(model, **enable_kwargs(family, gpu_kv_gib=tight_gpu_gib(family, 58))) as hs:
        worker = hs.engine.worker
        drain = worker.build_metadata
        worker.build_metadata = lambda *, wait=False: drain(wait=True) if wait else WorkerMetadata()
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=12, **GEN)
        stats = hs.engine.coordinator.stats()
        assert hs.engine.totals.pressure_waits >= 1 and stats.released_pages > 0 and stats.lost_pages > 0
    got = compare(ours, theirs)
    assert got.tokens_equal and got.max_logit_diff <= 1e-4, got
