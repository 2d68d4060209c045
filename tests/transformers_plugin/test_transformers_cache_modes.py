"""The ways transformers can call an enabled model without, or around, hisparse's cache; admission
against the host pool and what a failed step gives back; budgets this machine cannot hold; the
top-k check's ties; the cache argument's name per release."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from tf_support import BLOCK, GEN, SHAPES, baseline, block_bytes, compare, enable_kwargs, random_prompts, tiny_model

import hisparse_transformers
from hisparse_core.capacity import HOST_FRACTION, available_host_bytes
from hisparse_core.errors import CapacityError, InvalidInputError
from hisparse_transformers.check import TopkMismatch, compare_topk
from hisparse_transformers.version import cache_kwarg

pytest.importorskip("transformers")

FAMILY = "deepseek_v32"


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model(FAMILY, shape=SHAPES[FAMILY], seed=5)


def one_line(err: BaseException) -> str:
    text = str(err)
    assert text and "\n" not in text
    return text


# ------------------------------------------------------------------ 1. cache modes


def test_generate_without_a_cache_is_the_models_own(model: torch.nn.Module) -> None:
    """use_cache=False re-feeds the whole sequence each step: it runs the model's own attention
    (before: hisparse took each re-fed sequence as new tokens and the tokens went wrong)."""
    ids, mask = random_prompts([30, 12], seed=3)
    own = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, use_cache=False)
    with hisparse_transformers.enable(model, **enable_kwargs(FAMILY)) as hs:
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, use_cache=False)
        assert torch.equal(ours, own)
        assert hs.stats().requests == 0                       # nothing went through hisparse
        from transformers import GenerationConfig

        gen = GenerationConfig(use_cache=False, max_new_tokens=6, do_sample=False)
        assert torch.equal(model.generate(ids, attention_mask=mask, generation_config=gen), own)
        with pytest.raises(InvalidInputError, match="use_cache=False with a HiSparseCache") as err:
            model.generate(ids, attention_mask=mask, max_new_tokens=2, use_cache=False,
                           **{cache_kwarg(model): hs.new_cache()})
        one_line(err.value)
        # A plain forward with no cache, and one with the model's own cache, are the model's own.
        with torch.no_grad():
            plain = model(input_ids=ids, attention_mask=mask).logits
            from transformers import DynamicCache

            dyn = model(input_ids=ids, attention_mask=mask, **{cache_kwarg(model): DynamicCache(config=model.config)})
        assert hs.stats().requests == 0
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(plain, want) and torch.equal(dyn.logits, want)


def test_output_attentions_and_cache_implementation_are_refused(model: torch.nn.Module) -> None:
    """Before: output_attentions=True ran and returned empty attention tuples."""
    ids, mask = random_prompts([9, 14], seed=4)
    with hisparse_transformers.enable(model, **enable_kwargs(FAMILY)) as hs:
        free = hs.engine.gpu.num_free_blocks
        with pytest.raises(InvalidInputError, match="output_attentions=True is not supported") as err:
            model.generate(ids, attention_mask=mask, max_new_tokens=3, output_attentions=True,
                           return_dict_in_generate=True)
        one_line(err.value)
        cache = hs.new_cache(ids, mask)
        with pytest.raises(InvalidInputError, match="output_attentions=True"), torch.no_grad():
            model(input_ids=ids, attention_mask=mask, output_attentions=True, **{cache_kwarg(model): cache})
        cache.finish()
        with pytest.raises(InvalidInputError, match="cache_implementation='static'") as err:
            model.generate(ids, attention_mask=mask, max_new_tokens=3, cache_implementation="static")
        one_line(err.value)
        assert hs.engine.gpu.num_free_blocks == free and hs.stats().requests == 0
        # the model's own setting is named as such; "hybrid", which transformers drops, is served (before: refused)
        gen = model.generation_config
        try:
            gen.cache_implementation = "static"
            with pytest.raises(InvalidInputError, match=r"^cache_implementation='static' \(from model.generation_config\)"):
                model.generate(ids, attention_mask=mask, max_new_tokens=3)
            gen.cache_implementation = "hybrid"
            assert model.generate(ids, attention_mask=mask, max_new_tokens=3).shape == (2, 17)
        finally:
            gen.cache_implementation = None
        # The model's own attention still returns them when asked with its own cache.
        from transformers import DynamicCache

        out = model.generate(ids, attention_mask=mask, max_new_tokens=2, output_attentions=True,
                             return_dict_in_generate=True, **{cache_kwarg(model): DynamicCache(config=model.config)})
        assert out.attentions and out.attentions[0][0].shape[-1] == ids.shape[1]


# ------------------------------------------------------------------ 2. admission, failed steps


def test_whole_request_checked_at_admission_and_nothing_leaks(model: torch.nn.Module) -> None:
    """Prompts that fit the host pool but not with their new tokens: refused at admission with
    host_pool_gib and the value that fits (before: failed mid-decode, 2 GPU blocks leaked each
    time). The value named fits."""
    ids, mask = random_prompts([40, 30], seed=6)
    bb = block_bytes(FAMILY)
    kw = enable_kwargs(FAMILY, host_pool_gib=40 * bb / 2**30, max_context=128)
    with hisparse_transformers.enable(model, **kw) as hs:
        free = hs.engine.gpu.num_free_blocks
        for _ in range(3):
            with pytest.raises(CapacityError) as err:
                model.generate(ids, attention_mask=mask, max_new_tokens=60, do_sample=False)
            text = one_line(err.value)
            assert f"host_pool_gib={kw['host_pool_gib']:g}" in text and "max_new_tokens=60" in text
            assert hs.engine.gpu.num_free_blocks == free
        fits = float(text.split("expected host_pool_gib >= ")[1].split(",")[0])
        with pytest.raises(CapacityError, match=r"max_new_tokens=120 .* max_context is 128: expected max_new_tokens "
                                                r"<= 89") as err:
            model.generate(ids, attention_mask=mask, max_new_tokens=120, do_sample=False)
        one_line(err.value)
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)     # still usable
        assert hs.engine.gpu.num_free_blocks == free
    theirs = baseline(model, ids, mask, 60, chunk=8)
    with hisparse_transformers.enable(model, **{**kw, "host_pool_gib": fits}):
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=60, **GEN)
    got = compare(ours, theirs)
    assert got.tokens_equal and got.max_logit_diff <= 1e-4, got


@pytest.mark.parametrize("where", ["add_request:2", "first_resident_page:1", "first_resident_page:2",
                                   "_check_host_room:1", "Session:1"])
def test_an_interrupt_during_admission_leaves_nothing_admitted(model: torch.nn.Module, where: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (KeyboardInterrupt) at any point of a batch's admission, the second row's prefix hit
    among them: no request stays with the coordinator, no host block or state row is taken, the
    totals do not count it, and the next generate is exact (the admission loop used to leave a
    request admitted when interrupted between its admission and its row's bookkeeping)."""
    import hisparse_transformers.engine as engine_mod

    ids, mask = random_prompts([40, 30], seed=6)
    ids[1, -20:] = ids[0, -20:]                          # nothing shared at the start: no hit; the rerun below has one
    with hisparse_transformers.enable(model, **enable_kwargs(FAMILY, max_context=128)) as hs:
        e = hs.engine
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)   # pages for prefix hits
        free_host, states, totals = e.coordinator.num_free_host_blocks, list(e.free_states), hs.stats()
        name, nth = where.split(":")
        owner = e if name == "_check_host_room" else engine_mod if name == "Session" else e.coordinator
        real, calls = getattr(owner, name), []

        def interrupted(*args: object, **kwargs: object) -> object:
            calls.append(1)
            if len(calls) == int(nth):
                if name == "add_request":            # after the coordinator admitted it
                    real(*args, **kwargs)
                raise KeyboardInterrupt
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, interrupted)
        with pytest.raises(KeyboardInterrupt):
            model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        monkeypatch.undo()
        assert len(calls) == int(nth)
        assert e.session is None and e.free_states == states
        assert not [r for r in range(e._next_request) if e.coordinator.has_request(f"hf-{r}")]
        after = hs.stats()
        assert (after.requests, after.prefix_hit_tokens) == (totals.requests, totals.prefix_hit_tokens)
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=6, **GEN)
        # a prefix hit's partial page is copied on the host; a finished request's copy drains at the next step
        assert e.coordinator.num_free_host_blocks == free_host
    got = compare(ours, baseline(model, ids, mask, 6, chunk=8))
    assert got.tokens_equal and got.max_logit_diff <= 1e-4, got


def test_a_failing_step_returns_every_block(model: torch.nn.Module) -> None:
    """A step refused by the coordinator after its pages were leased (planted on the engine's own
    coordinator), and a generate stopped by the caller mid-decode: the free GPU block count is the
    same before and after, every time, and the next generate is exact."""
    ids, mask = random_prompts([23, 37, 11], seed=8)
    theirs = baseline(model, ids, mask, 10, chunk=8)
    with hisparse_transformers.enable(model, **enable_kwargs(FAMILY)) as hs:
        coordinator = hs.engine.coordinator
        real = coordinator.schedule_step
        free = hs.engine.gpu.num_free_blocks
        for fail_at in (3, 9, 14):
            calls = {"n": 0}

            def failing(scheduled, *a, _at=fail_at, _calls=calls, **k):  # type: ignore[no-untyped-def]
                _calls["n"] += 1
                if _calls["n"] == _at:
                    raise CapacityError("planted: the step is refused")
                return real(scheduled, *a, **k)

            coordinator.schedule_step = failing
            try:
                with pytest.raises(CapacityError, match="planted"):
                    model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
            finally:
                del coordinator.schedule_step
            assert hs.engine.gpu.num_free_blocks == free, fail_at

        class Stop(Exception):
            pass

        decoded = {"n": 0}

        def stop(handle, step) -> None:  # type: ignore[no-untyped-def]
            decoded["n"] += step.num_new == 1
            if decoded["n"] == 4:
                raise Stop

        hs.on_step = stop
        with pytest.raises(Stop):
            model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        hs.on_step = None
        assert hs.engine.gpu.num_free_blocks == free
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=10, **GEN)
        assert hs.engine.gpu.num_free_blocks == free
    got = compare(ours, theirs)
    assert got.tokens_equal and got.max_logit_diff <= 1e-4, got


def test_an_empty_forward_is_refused_and_a_step_failing_to_start_leaves_the_handle_usable(
        model: torch.nn.Module) -> None:
    """A prompt of 0 tokens to generate (or a row of it all padding), and a direct forward of 0 tokens:
    one line naming the value,
    before anything runs (before: an IndexError from inside the engine's step, and from then on every
    generate on the handle failed with a ProtocolError, the workers' step having started and never
    ended). A step whose device state fails after the workers started it (planted) leaves the handle
    usable too: no block lost, the next generate exact."""
    ids, mask = random_prompts([23, 11], seed=9)
    theirs = baseline(model, ids, mask, 6, chunk=8)
    key = cache_kwarg(model)
    with hisparse_transformers.enable(model, **enable_kwargs(FAMILY)) as hs:
        free = hs.engine.gpu.num_free_blocks
        with pytest.raises(InvalidInputError) as err:
            model.generate(ids[:1, :0], max_new_tokens=4, do_sample=False)
        text = one_line(err.value)
        assert "input_ids of shape (1, 0)" in text and "at least one prompt token" in text, text
        blank = mask.clone()
        blank[1] = 0              # row 1 all padding: a prompt of no token (before: generated from nothing)
        with pytest.raises(InvalidInputError) as err:
            model.generate(ids, attention_mask=blank, max_new_tokens=4, do_sample=False)
        text = one_line(err.value)
        assert "attention_mask row 1 is all padding" in text and "at least one prompt token" in text, text
        other = random_prompts([9, 14], seed=10)[0]
        cache = hs.new_cache(other, max_new_tokens=4)
        with torch.no_grad():
            model(input_ids=other, **{key: cache})
            with pytest.raises(InvalidInputError) as err:
                model(input_ids=other[:, :0], **{key: cache})
        assert "a forward of 0 tokens" in one_line(err.value)
        cache.finish()
        real = hs.engine._step_state
        for fail_at in (2, 4):    # a prefill step; the first decode step, planned ahead in the prefill's end
            calls = {"n": 0}

            def failing(*a, _at=fail_at, _calls=calls, **k):  # type: ignore[no-untyped-def]
                _calls["n"] += 1
                if _calls["n"] == _at:
                    raise RuntimeError("planted: the step's device state fails")
                return real(*a, **k)

            hs.engine._step_state = failing  # type: ignore[method-assign]
            try:
                with pytest.raises(RuntimeError, match="planted"):
                    model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
            finally:
                del hs.engine._step_state
            assert hs.engine.gpu.num_free_blocks == free, fail_at
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=6, **GEN)
        assert hs.engine.gpu.num_free_blocks == free
    got = compare(ours, theirs)
    assert got.tokens_equal and got.max_logit_diff <= 1e-4, got


def test_a_step_that_fails_to_start_keeps_no_token_of_its_forward(model: torch.nn.Module) -> None:
    """A direct decode forward whose step fails before its forward runs (a planted CapacityError
    from the coordinator), then the same position fed another token: the batch's pages carry the
    tokens that were written. Before: the failed forward's token stayed in the request's ids, the
    retry's was dropped, and the page sealed over it was published under the failed token, so a
    later generate of the failed token's sequence took it as a prefix hit and read the retry's rows
    (other logits; RowMismatch under check=True)."""
    ids = random_prompts([12], seed=16)[0]
    key = cache_kwarg(model)
    with hisparse_transformers.enable(model, **enable_kwargs(FAMILY)) as hs:
        free = hs.engine.gpu.num_free_blocks
        cache = hs.new_cache(ids, max_new_tokens=8)
        coordinator = hs.engine.coordinator
        failed = ids[:, :1]
        fed = []                            # the tokens each forward after the failed one predicts
        with torch.no_grad():
            nxt = model(input_ids=ids, **{key: cache}).logits[:, -1:].argmax(-1)
            # the step after a whole page is planned when it comes, not ahead: it fails in begin_step

            def failing(*a, **k):  # type: ignore[no-untyped-def]
                raise CapacityError("planted: the step is refused")

            coordinator.schedule_step = failing
            try:
                with pytest.raises(CapacityError, match="planted"):
                    model(input_ids=failed, **{key: cache})
            finally:
                del coordinator.schedule_step
            assert torch.equal(failed, ids[:, :1]) and not torch.equal(nxt, failed)
            for _ in range(5):              # positions 12-16: page 3 is sealed by the step of 16
                nxt = model(input_ids=nxt, **{key: cache}).logits[:, -1:].argmax(-1)
                fed.append(nxt)
        cache.finish()
        assert hs.engine.gpu.num_free_blocks == free
        # the failed token's sequence: the prompt, the failed token, then the tokens fed after it
        other = torch.cat([ids, failed, *fed[:4]], 1)        # the retry's successors at 13-16
        theirs = baseline(model, other, torch.ones_like(other), 4, chunk=8)
        got = compare(model.generate(other, attention_mask=torch.ones_like(other), max_new_tokens=4, **GEN), theirs)
        assert got.tokens_equal and got.max_logit_diff <= 1e-4, got


def test_a_refused_first_forward_opens_no_batch(model: torch.nn.Module) -> None:
    """The first direct forward of a cache, refused by the engine's step (0 tokens; past what
    max_new_tokens reserved), changes nothing: no batch stays open (the next generate runs while
    that cache lives), the totals count no request, no GPU block or host block is held, and the
    same cache then runs its batch, sharing its prefix as if the refused forward never came (its
    0-column position_ids had fixed no rope offset). Before: the batch it opened stayed open, the
    next generate was refused naming cache.finish(), and the rows shared no page."""
    ids, mask = random_prompts([23, 11], seed=15)
    theirs = baseline(model, ids, mask, 6, chunk=8)
    key = cache_kwarg(model)
    logical = (mask.cumsum(-1) - 1).clamp(min=0)
    over = torch.cat([ids, ids[:, :3]], 1)
    with hisparse_transformers.enable(model, **enable_kwargs(FAMILY)) as hs:
        free = hs.engine.gpu.num_free_blocks
        host = hs.engine.coordinator.num_free_host_blocks
        cache = hs.new_cache(ids, mask, max_new_tokens=2)
        with torch.no_grad():
            with pytest.raises(InvalidInputError, match="a forward of 0 tokens"):
                model(input_ids=ids[:, :0], attention_mask=mask[:, :0], position_ids=logical[:, :0], **{key: cache})
            with pytest.raises(CapacityError, match="past the"):
                model(input_ids=over, attention_mask=torch.cat([mask, torch.ones_like(mask[:, :3])], 1),
                      **{key: cache})
        assert hs.engine.session is None and hs.stats().requests == 0
        assert hs.engine.gpu.num_free_blocks == free and hs.engine.coordinator.num_free_host_blocks == host
        got = compare(model.generate(ids, attention_mask=mask, max_new_tokens=6, **GEN), theirs)
        assert got.tokens_equal and got.max_logit_diff <= 1e-4, got
        assert hs.stats().requests == 2
        hits = []
        hs.on_step = lambda handle, step: hits or hits.extend(r.hit for r in handle.engine.session.requests)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, position_ids=logical, **{key: cache})
        cache.finish()
        assert hits[1] == 8, hits              # generate's pages, roped alike
        assert hs.engine.gpu.num_free_blocks == free


def test_a_direct_batch_with_a_row_of_no_prompt_token_is_refused(model: torch.nn.Module) -> None:
    """new_cache(input_ids, attention_mask) with a row all padding (or no column) is refused in one
    line naming the row, as generate refuses it. Before: the batch ran, and that row's decode
    logits differed from the model's own by 3.07 on this model, silently."""
    ids, mask = random_prompts([23, 11], seed=12)
    blank = mask.clone()
    blank[1] = 0
    with hisparse_transformers.enable(model, **enable_kwargs(FAMILY)) as hs:
        for args, words in (((ids, blank), "attention_mask row 1 is all padding"),
                            ((ids[:, :0], None), "input_ids of shape (2, 0)")):
            with pytest.raises(InvalidInputError) as err:
                hs.new_cache(*args, max_new_tokens=6)
            text = one_line(err.value)
            assert words in text and "at least one prompt token a row" in text, text
        assert hs.stats().requests == 0 and hs.engine.session is None


def test_direct_forwards_with_autograd_on_keep_no_graph(model: torch.nn.Module) -> None:
    """Direct forwards outside torch.no_grad() (autograd on, as a plain forward runs) give the
    model's own logits, and the engine's KV stores join no autograd graph. Before: each forward's
    rows were written into the stores with their graph, so every direct forward's graph (the saved
    activations of the whole model) stayed reachable from the stores until the handle closed:
    1,980 more graph nodes and 1.4 MiB more resident memory a batch on this model, without bound."""
    from transformers import DynamicCache

    ids, mask = random_prompts([23, 11], seed=17)
    key = cache_kwarg(model)

    def run(cache: object) -> torch.Tensor:
        m, outs = mask, []
        out = model(input_ids=ids, attention_mask=m, **{key: cache}).logits
        for _ in range(4):
            nxt = out[:, -1:].argmax(-1)
            m = torch.cat([m, torch.ones_like(nxt)], 1)
            out = model(input_ids=nxt, attention_mask=m, **{key: cache}).logits
            outs.append(out.detach())
        return torch.cat(outs, 1)

    assert torch.is_grad_enabled()
    own = run(DynamicCache(config=model.config))
    with hisparse_transformers.enable(model, **enable_kwargs(FAMILY)) as hs:        # check=True
        for _ in range(2):
            cache = hs.new_cache(ids, mask, max_new_tokens=5)
            ours = run(cache)
            cache.finish()
            assert float((ours - own).abs().max()) <= 1e-4
            stores = [t for layers in hs.engine.flat_layers for t in layers]
            assert stores and not any(t.requires_grad or t.grad_fn is not None for t in stores)


def test_a_model_cast_after_enable_is_refused_before_its_forward() -> None:
    """A model cast to another dtype after enable (its KV stores and row format are the enable-time
    dtype's): a generate or a direct forward is refused in one line naming both dtypes before
    anything runs, and cast back, the handle runs as before. Before: a RuntimeError from inside the
    attention ("expected scalar type Float but found BFloat16")."""
    model = tiny_model(FAMILY, shape=SHAPES[FAMILY], seed=5)       # its own: the cast rounds the weights
    ids, mask = random_prompts([23, 11], seed=18)
    key = cache_kwarg(model)
    with hisparse_transformers.enable(model, **enable_kwargs(FAMILY)) as hs:
        free = hs.engine.gpu.num_free_blocks
        try:
            model.to(torch.bfloat16)
            with pytest.raises(InvalidInputError) as err:
                model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
            text = one_line(err.value)
            assert "torch.bfloat16" in text and "torch.float32" in text and "enable" in text, text
            cache = hs.new_cache(ids, mask, max_new_tokens=2)
            with torch.no_grad(), pytest.raises(InvalidInputError, match="torch.bfloat16"):
                model(input_ids=ids, attention_mask=mask, **{key: cache})
            assert cache.session is None and hs.engine.session is None and hs.stats().requests == 0
        finally:
            model.to(torch.float32)
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=6, **GEN)
        assert hs.engine.gpu.num_free_blocks == free
    got = compare(ours, baseline(model, ids, mask, 6, chunk=8))      # the weights as bf16 rounded them
    assert got.tokens_equal and got.max_logit_diff <= 1e-4, got


def test_a_first_forward_padded_otherwise_than_new_cache_is_refused(model: torch.nn.Module) -> None:
    """Direct forwards whose attention_mask pads a row otherwise than the one given to new_cache
    (say new_cache(input_ids) without the mask, or a forward without one): the first forward is
    refused in one line naming the row and both paddings, before anything runs; with the masks
    alike the batch runs as the model's own. Before: the batch ran with new_cache's padding, its
    attention read the padding's rows, and row 1's logits differed from the model's own by 3.4, even
    under check=True."""
    from transformers import DynamicCache

    ids, mask = random_prompts([23, 11], seed=12)            # row 1: 12 columns of padding
    key = cache_kwarg(model)
    with torch.no_grad():
        own = model(input_ids=ids[:, :16], attention_mask=mask[:, :16], **{key: DynamicCache(config=model.config)})
    real = mask[:, :16].bool().unsqueeze(-1)
    with hisparse_transformers.enable(model, **enable_kwargs(FAMILY)) as hs, torch.no_grad():
        for given, forward, words in ((None, mask, "row 1 12 columns of left padding, but the prompts given to "
                                       "new_cache leave it 0"),
                                      (mask, None, "row 1 0 columns of left padding, but the prompts given to "
                                       "new_cache leave it 12")):
            cache = hs.new_cache(ids, given, max_new_tokens=1)
            kw = {} if forward is None else dict(attention_mask=forward[:, :16])
            with pytest.raises(InvalidInputError) as err:
                model(input_ids=ids[:, :16], **kw, **{key: cache})
            assert words in one_line(err.value), err.value
            assert cache.session is None and hs.engine.session is None and hs.stats().requests == 0
        cache = hs.new_cache(ids, mask, max_new_tokens=1)
        ours = model(input_ids=ids[:, :16], attention_mask=mask[:, :16], **{key: cache}).logits
        cache.finish()
    assert float(((ours - own.logits).abs() * real).max()) <= 1e-4


def test_a_direct_forward_feeding_other_prompt_tokens_than_new_cache_is_refused(model: torch.nn.Module) -> None:
    """hisparse records a batch's prompt from new_cache and publishes its pages under those tokens.
    Before: a direct forward feeding other tokens at prompt positions ran, its rows were published
    under new_cache's prompts, and a later generate of those prompts took them as prefix hits and
    decoded other tokens than the model's own. Now the forward is refused in one line naming the
    row and position, before anything runs, and the batch goes on with the right tokens."""
    ids, mask = random_prompts([21, 14], seed=13)             # row 1: 7 columns of padding
    pos = (mask.cumsum(-1) - 1).clamp(min=0)                 # roped as generate ropes them: prefixes pass
    theirs = baseline(model, ids, mask, 3, chunk=8)
    other = ids.clone()
    other[1, 12] = 2 + (int(ids[1, 12]) + 1) % 120           # row 1's logical position 5
    key = cache_kwarg(model)
    with hisparse_transformers.enable(model, **enable_kwargs(FAMILY, gpu_kv_gib=1e-3)) as hs, torch.no_grad():
        cache = hs.new_cache(ids, mask, max_new_tokens=1)
        for lo, hi in ((0, 16), (8, 21)):                    # the first forward, then a later chunk
            if lo:
                model(input_ids=ids[:, :lo], attention_mask=mask[:, :lo], position_ids=pos[:, :lo], **{key: cache})
            with pytest.raises(InvalidInputError) as err:
                model(input_ids=other[:, lo:hi], attention_mask=mask[:, :hi], position_ids=pos[:, lo:hi],
                      **{key: cache})
            assert one_line(err.value).startswith("the forward's input_ids feed row 1's prompt token at logical "
                                                  f"position 5 as {int(other[1, 12])}, but the prompts given to "
                                                  f"new_cache have {int(ids[1, 12])} there"), err.value
            assert cache.get_seq_length() == lo
        model(input_ids=ids[:, 8:], attention_mask=mask, position_ids=pos[:, 8:], **{key: cache})
        cache.finish()
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=3, **GEN)
        assert hs.stats().prefix_hit_tokens > 0
    assert torch.equal(ours.sequences, theirs.sequences)


def test_embeddings_that_are_not_the_prompts_are_refused(model: torch.nn.Module) -> None:
    """generate(input_ids, inputs_embeds=...): transformers' chunked prefill, which hisparse hands
    the prompt to, feeds input_ids and drops the embeddings. Before: accepted, and the tokens were
    those of input_ids, not the model's own for those embeddings. A direct forward's inputs_embeds
    over new_cache's prompt positions must be the model's embeddings of those tokens (the rows are
    published under them). Before: any embeddings ran. Both refused in one line before anything runs."""
    ids, mask = random_prompts([14, 9], seed=14)
    key = cache_kwarg(model)
    with hisparse_transformers.enable(model, **enable_kwargs(FAMILY, gpu_kv_gib=1e-3)) as hs, torch.no_grad():
        own = model.get_input_embeddings()(ids)
        with pytest.raises(InvalidInputError) as err:
            model.generate(input_ids=ids, inputs_embeds=own * 1.5, attention_mask=mask, max_new_tokens=2)
        assert one_line(err.value).startswith("hisparse generate got inputs_embeds with input_ids"), err.value
        cache = hs.new_cache(ids, mask, max_new_tokens=1)
        with pytest.raises(InvalidInputError) as err:
            model(inputs_embeds=own * 1.5, attention_mask=mask, **{key: cache})
        assert one_line(err.value).startswith("the forward's inputs_embeds for row 0's prompt positions 0-13 are not "
                                              "the model's embeddings of the prompts given to new_cache"), err.value
        assert cache.session is None and hs.stats().requests == 0
        model(inputs_embeds=own, attention_mask=mask, **{key: cache})          # the prompts' own: served
        cache.finish()
        assert hs.stats().requests == 2


def test_a_crop_into_a_page_a_cancelled_planned_step_sealed_is_refused(model: torch.nn.Module) -> None:
    """Direct forwards: after a 2-token forward the decode step planned ahead seals the page its
    first token completed; a crop of 1 cancels that step, and a second crop of 1, into the sealed
    page, is refused in one line (as one crop of 2 is), changing nothing; the forwards after it
    give the model's own logits. Before: the second crop was accepted (the check looked only while
    a planned step was pending), and the next forward failed in the coordinator ("would rewrite
    sealed page 3"), and every one after it."""
    from transformers import DynamicCache

    ids = random_prompts([13], seed=19)[0]
    key = cache_kwarg(model)

    def run(cache: object, hisparse: bool) -> list[torch.Tensor]:
        with torch.no_grad():
            out = model(input_ids=ids, **{key: cache}).logits
            for _ in range(2):                              # positions 13, 14
                out = model(input_ids=out[:, -1:].argmax(-1), **{key: cache}).logits
            nxt = out[:, -1:].argmax(-1)
            model(input_ids=torch.cat([nxt, nxt], 1), **{key: cache})    # 15, 16: page 3 complete
            cache.crop(-1)                                  # keeps 15 (cancels the planned step)
            if hisparse:
                with pytest.raises(InvalidInputError, match="page 3 was sealed") as err:
                    cache.crop(-1)
                one_line(err.value)
                assert cache.get_seq_length() == 16
            outs = []
            for _ in range(3):
                out = model(input_ids=nxt, **{key: cache}).logits
                outs.append(out)
                nxt = out[:, -1:].argmax(-1)
        return outs

    own = run(DynamicCache(config=model.config), False)
    with hisparse_transformers.enable(model, **enable_kwargs(FAMILY)) as hs:      # check=True
        free = hs.engine.gpu.num_free_blocks
        cache = hs.new_cache(ids, max_new_tokens=8)
        ours = run(cache, True)
        cache.finish()
        assert hs.engine.gpu.num_free_blocks == free
    assert max(float((a - b).abs().max()) for a, b in zip(ours, own, strict=True)) <= 1e-4


def _direct(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, cache: object) -> torch.Tensor:
    """Direct forwards of a left-padded prompt batch in 8-token chunks, without position_ids (the
    model's default: the padded positions); the logits of every chunk."""
    key = cache_kwarg(model)
    out = []
    with torch.no_grad():
        for a in range(0, ids.shape[1], 8):
            b = min(ids.shape[1], a + 8)
            out.append(model(input_ids=ids[:, a:b], attention_mask=mask[:, :b], **{key: cache}).logits)
    return torch.cat(out, dim=1)


def test_prefix_hits_only_between_rows_roped_alike(model: torch.nn.Module) -> None:
    """A latent row carries its rope position, so a page is a prefix hit only for rows roped alike.
    Direct forwards without position_ids rope row b's token i at pad_b + i (the model's default);
    generate ropes it at i. Before: the pages a direct batch published were prefix hits for a
    generate of the same prompts (and a generate's for a direct batch), whose attention then read
    rows roped at other positions (RowMismatch under check=True; other logits without it). Now the
    unpadded row shares its pages both ways, the padded row only with a direct batch padded alike."""
    from transformers import DynamicCache

    ids, mask = random_prompts([23, 11], seed=12)
    theirs = baseline(model, ids, mask, 6, chunk=8)
    own = _direct(model, ids, mask, DynamicCache(config=model.config))
    real = mask.bool().unsqueeze(-1)
    with hisparse_transformers.enable(model, **enable_kwargs(FAMILY)) as hs:      # check=True
        hits: list[list[int] | None] = []       # each run's prefix hits, per row

        def record(handle, step) -> None:  # type: ignore[no-untyped-def]
            session = handle.engine.session
            if hits[-1] is None and session is not None:
                hits[-1] = [r.hit for r in session.requests]

        hs.on_step = record
        for run in ("direct", "generate", "direct"):
            hits.append(None)
            if run == "direct":
                cache = hs.new_cache(ids, mask, max_new_tokens=1)
                ours = _direct(model, ids, mask, cache)
                cache.finish()
                diff = float(((ours - own).abs() * real).max())
                assert diff <= 1e-4, (len(hits), diff)
            else:
                got = compare(model.generate(ids, attention_mask=mask, max_new_tokens=6, **GEN), theirs)
                assert got.tokens_equal and got.max_logit_diff <= 1e-4, got
    first, after_direct, after_both = hits
    assert first == [0, 0] and after_direct is not None and after_both is not None, hits
    assert after_direct[0] > 0 and after_direct[1] == 0, hits       # row 1 is roped at 12 + i there
    assert after_both[0] > 0 and after_both[1] > 0, hits            # row 1 from the first direct batch


def test_a_rope_offset_that_changes_mid_batch_is_refused(model: torch.nn.Module) -> None:
    """A batch's pages are published under the rope offset its first forward gave each row, so a
    later direct forward that ropes a row from another offset is refused in one line naming the
    row, and changes nothing: the same forward with the batch's positions then runs as the model's
    own. Before: the pages it sealed were published under the first forward's offset, and a later
    generate of the same tokens took them as prefix hits and read rows roped at other positions
    (other tokens, logits off by 2.5 on this model; RowMismatch under check=True)."""
    from transformers import DynamicCache

    ids, mask = random_prompts([23, 11], seed=12)            # row 1: 12 columns of padding
    logical = (mask.cumsum(-1) - 1).clamp(min=0)
    key = cache_kwarg(model)
    real = mask.bool().unsqueeze(-1)

    def forwards(cache: object, moved: str | None) -> list[torch.Tensor]:
        """Columns 0-15 with generate's positions, 16-22, then one decode token: `moved` says which
        later forward ropes from the padded positions instead (the model's default); it must be
        refused, and is then run again with the batch's positions."""
        out, nxt = [], None
        with torch.no_grad():
            first = model(input_ids=ids[:, :16], attention_mask=mask[:, :16], position_ids=logical[:, :16],
                          **{key: cache})
            out.append(first.logits)
            for part, cols in (("rest", slice(16, 23)), ("decode", None)):
                if part == "rest":
                    kw = dict(input_ids=ids[:, cols], attention_mask=mask, position_ids=logical[:, cols])
                else:
                    kw = dict(input_ids=nxt, attention_mask=torch.cat([mask, torch.ones_like(nxt)], 1),
                              position_ids=logical[:, -1:] + 1)
                if moved == part:
                    padded = dict(kw)
                    del padded["position_ids"]
                    with pytest.raises(InvalidInputError, match="row 1") as err:
                        model(**padded, **{key: cache})
                    one_line(err.value)
                    moved_by = dict(kw, position_ids=kw["position_ids"] + torch.tensor([[0], [3]]))
                    with pytest.raises(InvalidInputError, match="row 1"):
                        model(**moved_by, **{key: cache})
                got = model(**kw, **{key: cache}).logits
                out.append(got)
                nxt = got[:, -1:].argmax(-1)
        return out

    hits: list[int] = []         # a generate's prefix hits, per row

    def record(handle, step) -> None:  # type: ignore[no-untyped-def]
        if not hits:
            hits.extend(r.hit for r in handle.engine.session.requests)

    own = forwards(DynamicCache(config=model.config), None)
    theirs = baseline(model, ids, mask, 6, chunk=8)
    for moved in ("rest", "decode"):
        with hisparse_transformers.enable(model, **enable_kwargs(FAMILY)) as hs:      # check=True
            free = hs.engine.gpu.num_free_blocks
            cache = hs.new_cache(ids, mask, max_new_tokens=2)
            ours = forwards(cache, moved)
            cache.finish()
            assert hs.engine.gpu.num_free_blocks == free
            diff = float(((ours[0] - own[0]).abs() * real[:, :16]).max())
            diff = max(diff, float(((ours[1] - own[1]).abs() * real[:, 16:]).max()),
                       float((ours[2] - own[2]).abs().max()))
            assert diff <= 1e-4, (moved, diff)
            hs.on_step = record
            hits.clear()
            got = compare(model.generate(ids, attention_mask=mask, max_new_tokens=6, **GEN), theirs)
            assert got.tokens_equal and got.max_logit_diff <= 1e-4, (moved, got)
            assert hits[1] == 8, hits         # row 1's two full prompt pages, roped as generate ropes them


def test_enable_under_inference_mode_then_generate_outside_it(model: torch.nn.Module) -> None:
    """Before: enable inside torch.inference_mode() built the engine's tables as inference tensors,
    and a generate outside that mode failed with "Inplace update to inference tensor outside
    InferenceMode is not allowed"."""
    ids, mask = random_prompts([23, 11], seed=13)
    theirs = baseline(model, ids, mask, 6, chunk=8)
    with torch.inference_mode():
        hs = hisparse_transformers.enable(model, **enable_kwargs(FAMILY))         # check=True
    try:
        with torch.inference_mode():       # first: whatever a first generate builds, it builds in that mode
            inside = model.generate(ids, attention_mask=mask, max_new_tokens=6, **GEN)
        outside = model.generate(ids, attention_mask=mask, max_new_tokens=6, **GEN)
    finally:
        hs.close()
    for got in (compare(outside, theirs), compare(inside, theirs)):
        assert got.tokens_equal and got.max_logit_diff <= 1e-4, got


@pytest.mark.parametrize("extra", [{}, {"indexer_keys": "fp8"}, {"kv_rows": "fp8"}])
def test_one_direct_batch_in_and_out_of_inference_mode(model: torch.nn.Module, extra: dict[str, str]) -> None:
    """The forwards of one direct batch alternate between torch.inference_mode() and
    torch.no_grad() (either first), as the model's own cache allows: the logits are bit for bit
    those of the same batch under no_grad alone, and the model's own (model keys and rows). Before: what hisparse built at a forward in inference mode (the check's copies, the
    indexer's key buffers, the batch's tables) were inference tensors, and the next forward outside
    that mode failed updating them ("Inplace update to inference tensor outside InferenceMode")."""
    from transformers import DynamicCache

    ids, mask = random_prompts([23, 11], seed=19)
    key = cache_kwarg(model)

    def run(cache: object, inside: bool | None) -> torch.Tensor:
        m, outs, i = mask, [], 0

        def mode() -> object:
            nonlocal i
            i += 1
            return torch.no_grad() if inside is None or (i % 2 == 1) != inside else torch.inference_mode()

        for a in range(0, ids.shape[1], 8):             # prefill in 8-token chunks
            with mode():
                out = model(input_ids=ids[:, a:a + 8], attention_mask=m[:, :a + 8], **{key: cache}).logits
            outs.append(out.clone())
        for _ in range(4):                               # then decode steps
            nxt = out[:, -1:].argmax(-1)
            m = torch.cat([m, torch.ones_like(nxt)], 1)
            with mode():
                out = model(input_ids=nxt, attention_mask=m, **{key: cache}).logits
            outs.append(out.clone())
        return torch.cat(outs, 1)

    with hisparse_transformers.enable(model, **enable_kwargs(FAMILY, **extra)) as hs:   # check=True
        outs = []
        for inside in (True, False, None):           # None: every forward under no_grad
            cache = hs.new_cache(ids, mask, max_new_tokens=5)
            outs.append(run(cache, inside))
            cache.finish()
        assert hs.stats().checked_entries > 0
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[2])
    if not extra:                # and the model's own cache, in the same pattern (padded positions aside)
        real = torch.cat([mask, torch.ones_like(mask[:, :4])], 1).bool().unsqueeze(-1)
        assert float(((outs[0] - run(DynamicCache(config=model.config), True)).abs() * real).max()) <= 1e-4


def test_a_dropped_direct_cache_does_not_block_the_next_generate(model: torch.nn.Module) -> None:
    """Direct forwards through a cache dropped without `finish()`: the next generate finishes that
    batch (nobody else can: its cache is gone) and runs. While the cache lives, a generate is refused
    in one line naming `cache.finish()`. Before: every later generate was refused with "a hisparse
    generate is already running on this model" until the handle closed."""
    ids, mask = random_prompts([23, 11], seed=14)
    theirs = baseline(model, ids, mask, 6, chunk=8)
    key = cache_kwarg(model)
    with hisparse_transformers.enable(model, **enable_kwargs(FAMILY)) as hs:
        free = hs.engine.gpu.num_free_blocks
        cache = hs.new_cache(ids, mask, max_new_tokens=1)
        with torch.no_grad():
            model(input_ids=ids[:, :8], attention_mask=mask[:, :8], **{key: cache})
        with pytest.raises(InvalidInputError) as err:
            model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        assert "cache.finish()" in one_line(err.value)
        del cache
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=6, **GEN)
        assert hs.engine.gpu.num_free_blocks == free
    got = compare(ours, theirs)
    assert got.tokens_equal and got.max_logit_diff <= 1e-4, got


# ------------------------------------------------------------------ 3, 4. budgets and arguments


def _untouched(model: torch.nn.Module) -> bool:
    return "generate" not in model.__dict__ and not hasattr(model, "_hisparse_handle")


@pytest.mark.parametrize("over", [dict(host_pool_gib=math.inf), dict(host_pool_gib=1e4), dict(host_pool_gib=1e30),
                                  dict(gpu_kv_gib=1e30), dict(gpu_kv_gib=math.inf), dict(gpu_kv_gib="ram")])
def test_budgets_beyond_the_machine(model: torch.nn.Module, over: dict[str, object]) -> None:
    """Before: OverflowError, an empty MemoryError, or torch's allocator error seconds later."""
    avail = available_host_bytes()
    if avail is None:
        pytest.skip("this machine does not say how much RAM is available")
    if over.get("gpu_kv_gib") == "ram":
        over = dict(gpu_kv_gib=avail / 2**30)          # all of the RAM, on a CPU model: the caches are RAM too
    if over.get("host_pool_gib") == 1e4 and avail * HOST_FRACTION >= 1e4 * 2**30:
        pytest.skip("this machine has 10 TiB of RAM")
    name, value = next(iter(over.items()))
    with pytest.raises(CapacityError) as err:
        hisparse_transformers.enable(model, **enable_kwargs(FAMILY, **over))
    text = one_line(err.value)
    assert f"{name}={value:g}" in text and f"expected {name} <= " in text, text
    fits = float(text.rsplit(f"expected {name} <= ", 1)[1])
    assert 0 < fits <= avail / 2**30
    assert _untouched(model)


def test_check_must_be_a_bool_and_odd_block_sizes_are_exact(model: torch.nn.Module) -> None:
    """check="yes" is refused. Both backends take any positive block size (neither declares a
    restriction; the nvidia resolver's self-test builds block_size=3), so block_size=3 is served,
    and exactly."""
    for bad in ("yes", 1, None):
        with pytest.raises(InvalidInputError, match="check must be True or False") as err:
            hisparse_transformers.enable(model, **enable_kwargs(FAMILY, check=bad))
        one_line(err.value)
        assert _untouched(model)
    ids, mask = random_prompts([19, 26], seed=9)
    theirs = baseline(model, ids, mask, 8, chunk=8)
    with hisparse_transformers.enable(model, **enable_kwargs(FAMILY, block_size=3, hot_rows=18)) as hs:
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=8, **GEN)
        assert hs.stats().checked_entries > 0
    got = compare(ours, theirs)
    assert got.tokens_equal and got.max_logit_diff <= 1e-4, got
    assert BLOCK != 3


# ------------------------------------------------------------------ 5. ties in the top-k check


def test_compare_topk_tells_ties_from_differences() -> None:
    g = torch.Generator().manual_seed(11)
    scores = torch.randn((2, 3, 12), generator=g)
    scores[0, 1, [2, 5, 7]] = 0.25                       # a three-way tie at the k-th place
    scores[..., 11] = -math.inf                          # masked
    k = 4
    theirs = scores.topk(k, dim=-1).indices
    queries = torch.ones((2, 3), dtype=torch.bool)
    tied, differing = compare_topk(theirs.flip(-1), theirs, scores, queries)     # same sets, other order
    assert not tied.any() and not differing.any()
    kth = scores[0, 1].sort(descending=True).values[k - 1]
    assert kth == 0.25                                   # the tie sits at the k-th place
    ours = theirs.clone()
    chosen = set(theirs[0, 1].tolist())
    swap_out = next(i for i in (2, 5, 7) if i in chosen)
    swap_in = next(i for i in (2, 5, 7) if i not in chosen)
    ours[0, 1][ours[0, 1] == swap_out] = swap_in
    tied, differing = compare_topk(ours, theirs, scores, queries)
    assert tied.tolist() == [[False, True, False], [False, False, False]] and not differing.any()
    worse = theirs.clone()
    worse[1, 2, 0] = int(scores[1, 2, :11].argmin())     # a low score instead of the best one
    tied, differing = compare_topk(worse, theirs, scores, queries)
    assert differing.tolist() == [[False, False, False], [False, False, True]] and not tied.any()
    assert not compare_topk(worse, theirs, scores, torch.zeros_like(queries))[1].any()   # padding queries
    masked = theirs.clone()
    masked[1, 0, 0] = 11                                 # a masked entry is never a tie
    assert compare_topk(masked, theirs, scores, queries)[1][1, 0]


def test_the_check_reports_tied_top_k_as_ties(model: torch.nn.Module) -> None:
    """An indexer whose weights are zero scores every key exactly 0. The static decode (fixed
    capacity key buffers) scores longer rows than the model's own, so its top-k breaks those ties
    another way: reported as ties, not raised and not silent. A key buffer corrupted mid-decode
    changes the top-k beyond ties: `TopkMismatch`."""
    tied_model = tiny_model(FAMILY, shape=SHAPES[FAMILY], seed=4)
    with torch.no_grad():
        for layer in tied_model.model.layers:
            layer.self_attn.indexer.weights_proj.weight.zero_()
    ids, mask = random_prompts([30, 41, 17], seed=2)
    with hisparse_transformers.enable(tied_model, **enable_kwargs(FAMILY)) as hs:
        hs.graphs.enabled, hs.graphs.capture = True, False
        tied_model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        s = hs.stats()
    assert s.decode_mode == "static eager" and s.checked_topk_queries > 0 and s.checked_topk_ties > 0, s

    with hisparse_transformers.enable(model, **enable_kwargs(FAMILY)) as hs:
        cache = hs.new_cache()

        def corrupt(handle, step) -> None:  # type: ignore[no-untyped-def]
            if step.num_new == 1:
                for keys in cache._indexer.values():
                    keys[:, :30] = -7.0 * keys[:, :30].flip(1)

        hs.on_step = corrupt
        with pytest.raises(TopkMismatch, match=r"layer 0, batch row \d .*query position \d+: the top-k differs") as err:
            model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                           **{cache_kwarg(model): cache})
        one_line(err.value)
        assert hs.stats().checked_topk_ties == 0


# ------------------------------------------------------------------ 6. the cache argument's name


def test_cache_argument_named_as_the_release_declares(model: torch.nn.Module) -> None:
    """5.24 renames `past_key_values` to `cache` behind `deprecate_kwarg`, and `generate` declares
    neither (its signature says nothing): the name comes from the model's forward. No
    FutureWarning from hisparse's own calls (shown on 5.24; on older releases there is none to show)."""
    import inspect

    class Renamed(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, cache: object = None) -> None: ...

    class Old(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, past_key_values: object = None) -> None: ...

    assert cache_kwarg(Renamed()) == "cache" and cache_kwarg(Old()) == "past_key_values"
    declared = inspect.signature(type(model).forward).parameters
    assert cache_kwarg(model) == ("cache" if "cache" in declared else "past_key_values")
    ids, mask = random_prompts([12, 7], seed=10)
    with hisparse_transformers.enable(model, **enable_kwargs(FAMILY)) as hs:
        assert hs.cache_kwarg == cache_kwarg(model)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
            model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                           **{cache_kwarg(model): hs.new_cache()})


def test_prefix_hits_only_between_batches_run_under_the_same_autocast(model: torch.nn.Module) -> None:
    """Rows written under `torch.autocast` carry its lower-precision products, so a page is a prefix
    hit only for a batch under the same autocast state: a full-precision generate of prompts an
    autocast generate wrote reads none of its pages and matches the model's own, and a second
    autocast generate still takes the first one's."""
    ids, mask = random_prompts([23, 19], seed=21)
    theirs = baseline(model, ids, mask, 6, chunk=8)
    with hisparse_transformers.enable(model, **enable_kwargs(FAMILY)) as hs:
        hits: list[list[int] | None] = []

        def record(handle, step) -> None:  # type: ignore[no-untyped-def]
            session = handle.engine.session
            if hits[-1] is None and session is not None:
                hits[-1] = [r.hit for r in session.requests]

        hs.on_step = record
        for under in (True, False, True):
            hits.append(None)
            if under:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    model.generate(ids, attention_mask=mask, max_new_tokens=6, **GEN)
            else:
                got = compare(model.generate(ids, attention_mask=mask, max_new_tokens=6, **GEN), theirs)
                assert got.tokens_equal and got.max_logit_diff <= 1e-4, got
    first, plain, again = hits
    assert first == [0, 0] and plain == [0, 0], hits
    assert again is not None and min(again) > 0, hits


def test_pages_computed_before_the_weights_changed_are_no_prefix_hits(caplog: pytest.LogCaptureFixture) -> None:
    """A page's rows are the weights' of the batch that wrote it. Before: after load_state_dict (or
    any in-place update) a later generate of the same prompts took the old rows as prefix hits and
    decoded other tokens than the model's own."""
    model = tiny_model(FAMILY, shape=SHAPES[FAMILY], seed=6)
    ids, mask = random_prompts([15, 11], seed=22)
    with hisparse_transformers.enable(model, **enable_kwargs(FAMILY, check=False)) as hs:
        hits: list[list[int]] = []      # each batch's prefix hits, at its first step
        hs.on_step = lambda handle, step: (hits.append([r.hit for r in handle.engine.session.requests])
                                           if step.past == 0 else None)
        model.generate(ids, attention_mask=mask, max_new_tokens=3, **GEN)
        model.load_state_dict(tiny_model(FAMILY, shape=SHAPES[FAMILY], seed=7).state_dict())
        with caplog.at_level("INFO", logger="hisparse_transformers.handle"):
            ours = model.generate(ids, attention_mask=mask, max_new_tokens=3, **GEN)
            again = model.generate(ids, attention_mask=mask, max_new_tokens=3, **GEN)
    theirs = baseline(model, ids, mask, 3, chunk=8)
    for run in (ours, again):
        got = compare(run, theirs)
        assert got.tokens_equal and got.max_logit_diff <= 1e-4, got
    assert hits[1] == [0, 0] and min(hits[2]) > 0, hits
    assert sum("weights changed" in r.getMessage() for r in caplog.records) == 1
