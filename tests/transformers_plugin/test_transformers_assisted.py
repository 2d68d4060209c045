"""Assisted generation through hisparse (tiny DeepSeek-V3.2 and GLM-5, fp32, reference_cpu):
greedy prompt lookup and a draft model give the tokens of the model's own assisted generation and
of plain greedy decoding, with each verification step's rows resolved as one union per request
and the rejected candidates rolled back.

transformers runs assisted generation one prompt at a time (`_assisted_decoding` raises for
batch_size > 1), so the prompts of different lengths go one generate each, through one enabled
model (the later ones reuse the earlier ones' pages from the host pool). Batched verification rows
are covered by direct forwards (`test_batched_verification_and_crop_match_the_model`)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from tf_support import BLOCK, SHAPES, tiny_model

import hisparse_transformers
from hisparse_core.errors import CapacityError, InvalidInputError
from hisparse_transformers.engine import required_gpu_blocks

pytest.importorskip("transformers")

NEW = 16
CHUNK = 8
#: Top-k 8 (so a hot buffer of the union of 6 rows is 12 pages) and 32 indexer heads (no exact ties).
ASSISTED = {f: replace(s, index_topk=8, index_heads=32) for f, s in SHAPES.items()}
TOP_K = 8


def block_bytes(family: str) -> int:
    s = ASSISTED[family]
    return s.layers * BLOCK * (s.kv_lora + s.rope) * 4


def prompts() -> list[torch.Tensor]:
    """A long prompt that repeats itself (prompt lookup finds candidates), a short one, and one that
    shares the long one's first 96 tokens (whole pages of it come from the host pool)."""
    g = torch.Generator().manual_seed(11)
    head = torch.randint(2, 128, (90,), generator=g)
    long = torch.cat([head, head[20:50]])
    short = torch.randint(2, 128, (20,), generator=g)
    short = torch.cat([short, short[3:13]])
    shared = torch.cat([long[:64], torch.randint(2, 128, (16,), generator=g)])
    return [p.view(1, -1) for p in (long, short, shared)]


def tight_kwargs(family: str, k: int, batch: int = 1, **over: object) -> dict[str, object]:
    """A hot buffer of exactly the union (k + 1 rows of top-k) and the smallest GPU pool the engine
    accepts: the long prompt's pages do not all fit, so some are released to host."""
    hot = (k + 1) * TOP_K
    chunk_pages = CHUNK // BLOCK + 1
    blocks = required_gpu_blocks(batch, hot // BLOCK, chunk_pages)
    kw: dict[str, object] = dict(host_pool_gib=0.01, gpu_kv_gib=blocks * block_bytes(family) / 2**30,
                                 block_size=BLOCK, hot_rows=hot, max_batch=batch, max_context=256, prefill_chunk=CHUNK,
                                 check=True, speculative_tokens=k)
    kw.update(over)
    return kw


@pytest.fixture(scope="module", params=sorted(SHAPES))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(family: str) -> torch.nn.Module:
    return tiny_model(family, shape=ASSISTED[family], seed=3)


@pytest.fixture(scope="module")
def greedy(model: torch.nn.Module) -> list[torch.Tensor]:
    return [model.generate(p, max_new_tokens=NEW, do_sample=False) for p in prompts()]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_prompt_lookup_matches_the_model_and_greedy(family: str, model: torch.nn.Module,
                                                   greedy: list[torch.Tensor], k: int) -> None:
    own = [model.generate(p, max_new_tokens=NEW, do_sample=False, prompt_lookup_num_tokens=k) for p in prompts()]
    for a, b in zip(own, greedy, strict=True):
        assert torch.equal(a, b), "the model's own assisted generation differs from its greedy decoding"
    # The row check (every row read compared with the model's own latent) for k=3 only: it costs 4x.
    with hisparse_transformers.enable(model, **tight_kwargs(family, k, check=k == 3)) as hs:
        poison_rolled_back_rows(hs)
        for p, want in zip(prompts(), greedy, strict=True):
            got = model.generate(p, max_new_tokens=NEW, do_sample=False, prompt_lookup_num_tokens=k)
            assert torch.equal(got, want), f"k={k}, prompt of {p.shape[1]} tokens: hisparse differs from greedy"
        s = hs.stats()
    assert s.verify_steps > 0 and s.verify_rows > s.verify_steps, s
    assert s.union_shared_entries > 0 and s.union_entries > s.union_shared_entries, s
    assert s.rollbacks > 0 and s.rolled_back_tokens >= s.rollbacks, s
    assert s.released_pages > 0 and s.misses > 0, s                      # GPU pressure: pages read back from host
    assert s.prefix_hit_tokens >= 60, s                                   # the third prompt reused the first's pages
    assert k != 3 or (s.checked_entries > 0 and s.checked_max_abs_diff <= 1e-5), s
    assert s.decode_tokens == 3 * NEW - 3, s                              # accepted tokens only (the first comes from prefill)


def poison_rolled_back_rows(hs: hisparse_transformers.HiSparseHandle) -> None:
    """After each rollback, overwrite the dropped rows, on the device and in the host pool, with a
    large value: a later read of one would change the logits (and fail the row check)."""
    engine = hs.engine
    bs = engine.config.block_size

    def poison(session: object, num_tokens: int) -> None:
        for r in session.requests:  # type: ignore[attr-defined]
            host = engine.coordinator.source_block_ids(r.request_id)
            for pos in range(r.computed, r.computed + num_tokens):
                page, off = divmod(pos, bs)
                for g, layers in enumerate(engine.flat_layers):
                    for li, flat in enumerate(layers):
                        if page < len(r.blocks) and r.blocks[page] >= 0:
                            flat[r.blocks[page] * bs + off] = 1e3
                        if page < len(host):
                            engine.host_views[g][li][host[page] * bs + off] = 1e3

    engine.rollback_listeners.append(poison)


def test_draft_model_matches_the_model_and_greedy(family: str, model: torch.nn.Module,
                                                 greedy: list[torch.Tensor]) -> None:
    """A draft of the same tokenizer: the target's own weights, slightly disturbed, so some
    candidates are accepted and some rejected."""
    draft = copy.deepcopy(model)
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.005)
    draft.generation_config.num_assistant_tokens = 3
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0      # always propose all 3
    p, want = prompts()[0], greedy[0]
    own = model.generate(p, max_new_tokens=NEW, do_sample=False, assistant_model=draft)
    assert torch.equal(own, want)
    with hisparse_transformers.enable(model, **tight_kwargs(family, 3, check=False)) as hs:
        got = model.generate(p, max_new_tokens=NEW, do_sample=False, assistant_model=draft)
        s = hs.stats()
    assert torch.equal(got, want)
    accepted = s.verify_rows - s.verify_steps - s.rolled_back_tokens     # candidates kept
    assert s.rollbacks > 0 and accepted > 0 and s.verify_rows > 3 * s.verify_steps, s


def _batched_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    from hisparse_transformers.tiny import random_prompts

    return random_prompts([70, 41, 55], seed=4)


def _batched_verification(model: torch.nn.Module, cache: object) -> list[torch.Tensor]:
    """Direct forwards through `cache` of three left-padded prompts (`_batched_prompts`, prefilled in
    `CHUNK`-token forwards), then a verification forward of 4 tokens a row, a crop of 2, and one of 3
    tokens a row: the logits of the two verification forwards."""
    from hisparse_transformers.version import cache_kwarg

    ids, mask = _batched_prompts()
    g = torch.Generator().manual_seed(9)
    steps = [torch.randint(2, 128, (3, 4), generator=g), torch.randint(2, 128, (3, 3), generator=g)]
    key = cache_kwarg(model)
    out, m = [], mask
    with torch.no_grad():
        for a in range(0, ids.shape[1], CHUNK):
            b = min(ids.shape[1], a + CHUNK)
            model(input_ids=ids[:, a:b], attention_mask=m[:, :b], use_cache=True, **{key: cache})
        for i, st in enumerate(steps):
            m = torch.cat([m, torch.ones_like(st)], dim=1)
            out.append(model(input_ids=st, attention_mask=m, use_cache=True, **{key: cache}).logits)
            if i == 0:
                cache.crop(-2)  # type: ignore[attr-defined]
                m = m[:, :-2]
    return out


def test_batched_verification_and_crop_match_the_model(family: str, model: torch.nn.Module) -> None:
    """Direct forwards of a batch of three left-padded prompts: a verification forward of 4 tokens a
    row (12 resolver rows, 3 unions), a crop of 2, a forward of 3: logits as the model's own cache."""
    from transformers import DynamicCache

    ids, mask = _batched_prompts()
    theirs = _batched_verification(model, DynamicCache(config=model.config))
    with hisparse_transformers.enable(model, **tight_kwargs(family, 3, batch=3)) as hs:
        calls: list[tuple[int, list[int]]] = []      # (index group, row_state) of every resolve
        for g, runtime in enumerate(hs.engine.worker.runtimes):
            def counted(inputs: object, *a: object, _resolve: object = runtime.resolve, _g: int = g,
                        **kw: object) -> object:
                calls.append((_g, inputs.row_state.tolist()))  # type: ignore[attr-defined]
                return _resolve(inputs, *a, **kw)  # type: ignore[operator]
            runtime.resolve = counted  # type: ignore[method-assign]
        cache = hs.new_cache(ids, mask, max_new_tokens=8)
        ours = _batched_verification(model, cache)
        cache.finish()
        s = hs.stats()
    # Each verification forward resolved once per index group: all 3 x S rows in one call, each
    # request's rows consecutive under its state row.
    groups = len(hs.engine.layout.groups)
    assert [len(rows) for _, rows in calls] == [12] * groups + [9] * groups, calls
    for _, rows in calls:
        s_len = len(rows) // 3
        assert all(rows[i * s_len:(i + 1) * s_len] == [rows[i * s_len]] * s_len for i in range(3)), rows
    for a, b in zip(ours, theirs, strict=True):
        assert float((a - b).abs().max()) <= 1e-4
    assert s.verify_steps == 2 and s.verify_rows == 3 * 4 + 3 * 3 and s.rollbacks == 1 and s.rolled_back_tokens == 6


def _static(hs: hisparse_transformers.HiSparseHandle, widths: list[int]) -> None:
    """Run decode and verification steps through the captured step's static computation, eagerly
    (what a CUDA graph records; graphs.py), and note each step's width there."""
    hs.graphs.enabled, hs.graphs.capture = True, False

    def seen(handle: hisparse_transformers.HiSparseHandle, step: object) -> None:
        last = handle.graphs.last
        if last is not None and last.steps and getattr(step, "num_new", 0) == last.width:
            widths.append(last.width)

    hs.on_step = seen


@pytest.mark.parametrize("k", [1, 3])
def test_static_verification_steps_match_greedy(family: str, model: torch.nn.Module, greedy: list[torch.Tensor],
                                                k: int) -> None:
    """Prompt lookup with every verification step through the static computation (one set of
    static buffers per width, fixed-capacity indexer keys, the causal mask built from positions):
    the tokens of plain greedy decoding, rolled-back rows never read."""
    widths: list[int] = []
    with hisparse_transformers.enable(model, **tight_kwargs(family, k, check=False)) as hs:
        _static(hs, widths)
        poison_rolled_back_rows(hs)
        for p, want in zip(prompts(), greedy, strict=True):
            got = model.generate(p, max_new_tokens=NEW, do_sample=False, prompt_lookup_num_tokens=k)
            assert torch.equal(got, want), f"k={k}, prompt of {p.shape[1]} tokens: static path differs from greedy"
        s = hs.stats()
    assert s.decode_mode == "static eager" and s.verify_steps > 0 and s.rollbacks > 0, s
    assert s.released_pages > 0 and s.misses > 0, s
    assert max(widths) > 1 and set(widths) <= set(range(1, k + 2)), widths


def test_static_batched_verification_and_crop_match_the_model(family: str, model: torch.nn.Module) -> None:
    """The batched direct forwards of `test_batched_verification_and_crop_match_the_model` (3 rows,
    a verification forward of 4 tokens, a crop of 2, one of 3) through the static computation."""
    from transformers import DynamicCache

    ids, mask = _batched_prompts()
    theirs = _batched_verification(model, DynamicCache(config=model.config))
    widths: list[int] = []
    with hisparse_transformers.enable(model, **tight_kwargs(family, 3, batch=3, check=False)) as hs:
        _static(hs, widths)
        cache = hs.new_cache(ids, mask, max_new_tokens=8)
        ours = _batched_verification(model, cache)
        cache.finish()
        s = hs.stats()
    assert widths == [4, 3], widths
    for a, b in zip(ours, theirs, strict=True):
        assert float((a - b).abs().max()) <= 1e-4
    assert s.verify_steps == 2 and s.rollbacks == 1 and s.rolled_back_tokens == 6, s


# ------------------------------------------------------------------------------------ bad input


def one_line(err: BaseException) -> str:
    text = str(err)
    assert text and "\n" not in text
    return text


def untouched(hs: hisparse_transformers.HiSparseHandle) -> None:
    e = hs.engine
    assert e.session is None and e.gpu.num_leased_blocks == 0 and len(e.free_states) == e.config.max_batch


@pytest.fixture(scope="module")
def ds_model() -> torch.nn.Module:
    return tiny_model("deepseek_v32", shape=ASSISTED["deepseek_v32"], seed=3)


def test_hot_buffer_too_small_for_the_union(ds_model: torch.nn.Module) -> None:
    model, family = ds_model, "deepseek_v32"
    with pytest.raises(InvalidInputError) as err:
        hisparse_transformers.enable(model, **tight_kwargs(family, 3, hot_rows=24))
    text = one_line(err.value)
    assert "hot_rows=24" in text and "speculative_tokens=3" in text and "hot_rows >= 32" in text, text
    assert "generate" not in model.__dict__
    for bad in (-1, True, 2.0):
        with pytest.raises(InvalidInputError) as err:
            hisparse_transformers.enable(model, **tight_kwargs(family, 3, speculative_tokens=bad))
        assert f"speculative_tokens must be an int >= 0 (0: no assisted generation), got {bad!r}" == one_line(err.value)
        assert "generate" not in model.__dict__


def test_default_hot_buffer_is_the_production_shape(ds_model: torch.nn.Module) -> None:
    """(k + 2) x top-k: 5 x top-k for 3 speculative tokens."""
    kw = tight_kwargs("deepseek_v32", 3, hot_rows=None)
    kw["gpu_kv_gib"] = 2 * float(kw["gpu_kv_gib"])  # type: ignore[arg-type]
    with hisparse_transformers.enable(ds_model, **kw) as hs:
        assert hs.engine.hot_rows == 5 * TOP_K and hs.engine.spec_rows == 4
        assert hs.engine.worker.runtimes[0].config.rows_per_request == 4


def test_assisted_generate_refusals(ds_model: torch.nn.Module) -> None:
    model, family = ds_model, "deepseek_v32"
    p = prompts()[1]
    with hisparse_transformers.enable(model, **tight_kwargs(family, 3, batch=2)) as hs:
        cases: list[tuple[dict[str, object], tuple[str, ...]]] = [
            (dict(prompt_lookup_num_tokens=5), ("prompt_lookup_num_tokens=5", "speculative_tokens=3",
                                                "prompt_lookup_num_tokens <= 3", "speculative_tokens=5")),
        ]
        draft = tiny_model(family, shape=ASSISTED[family], seed=8)
        draft.generation_config.num_assistant_tokens = 6
        cases.append((dict(assistant_model=draft), ("num_assistant_tokens=6", "<= 3")))
        heuristic = tiny_model(family, shape=ASSISTED[family], seed=8)
        heuristic.generation_config.num_assistant_tokens = 2
        heuristic.generation_config.num_assistant_tokens_schedule = "heuristic"
        cases.append((dict(assistant_model=heuristic), ("'heuristic'", "'constant'")))
        other_vocab = tiny_model(family, shape=replace(ASSISTED[family], layers=1, vocab=96), seed=8)
        cases.append((dict(assistant_model=other_vocab), ("96 ids", "vocab_size=128")))
        cases.append((dict(assistant_model=draft, assistant_tokenizer=object(), tokenizer=object()),
                      ("assistant_tokenizer", "universal assisted decoding")))
        static = tiny_model(family, shape=ASSISTED[family], seed=8)
        static.generation_config.num_assistant_tokens = 2
        static.generation_config.cache_implementation = "static"
        cases.append((dict(assistant_model=static), ("cache_implementation='static'", "cropped")))
        for kwargs, needles in cases:
            with pytest.raises(InvalidInputError) as err:
                model.generate(p, max_new_tokens=4, do_sample=False, **kwargs)
            text = one_line(err.value)
            assert all(n in text for n in needles), (needles, text)
            untouched(hs)
        with pytest.raises(InvalidInputError) as err:
            model.generate(torch.cat([p, p]), max_new_tokens=4, do_sample=False, prompt_lookup_num_tokens=2)
        assert "batch of 2" in one_line(err.value) and "one prompt at a time" in err.value.args[0]
        untouched(hs)
        # Still serves a good call afterwards.
        ok = model.generate(p, max_new_tokens=4, do_sample=False, prompt_lookup_num_tokens=2)
        assert ok.shape[1] == p.shape[1] + 4


def test_hisparse_draft_is_refused(ds_model: torch.nn.Module) -> None:
    model, family = ds_model, "deepseek_v32"
    draft = tiny_model(family, shape=ASSISTED[family], seed=8)
    draft.generation_config.num_assistant_tokens = 2
    with hisparse_transformers.enable(draft, **tight_kwargs(family, 1)) as hd, \
            hisparse_transformers.enable(model, **tight_kwargs(family, 3)) as hs:
        with pytest.raises(InvalidInputError) as err:
            model.generate(prompts()[1], max_new_tokens=4, do_sample=False, assistant_model=draft)
        assert "has hisparse enabled" in one_line(err.value)
        untouched(hs)
        untouched(hd)


def test_a_hisparse_draft_of_a_plain_target_is_refused_before_it_drafts(ds_model: torch.nn.Module) -> None:
    """hisparse on the draft only (the target's generate is transformers' own, so the refusal above
    cannot run). Before: the draft's first generate ran through hisparse and finished its cache, and
    transformers' crop of it before the second raised "this hisparse cache's generate has finished;
    nothing to roll back" mid-generate. Now the draft's generate (generation_config.is_assistant)
    is refused in one line naming the fix, before it runs."""
    model, family = ds_model, "deepseek_v32"
    draft = tiny_model(family, shape=ASSISTED[family], seed=8)
    draft.generation_config.num_assistant_tokens = 2
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    p = prompts()[1]
    with hisparse_transformers.enable(draft, **tight_kwargs(family, 1)) as hd:
        with pytest.raises(InvalidInputError) as err:
            model.generate(p, max_new_tokens=4, do_sample=False, assistant_model=draft)
        assert one_line(err.value).startswith("hisparse is enabled on this model, which runs as another model's "
                                              "assistant_model"), err.value
        assert "expected hisparse_transformers.disable(draft)" in err.value.args[0]
        untouched(hd)
        assert hd.stats().requests == 0
    assert model.generate(p, max_new_tokens=2, do_sample=False, assistant_model=draft).shape[1] == p.shape[1] + 2


def test_crop_beyond_the_last_forward_is_refused(ds_model: torch.nn.Module) -> None:
    model = ds_model
    ids = prompts()[1]
    with hisparse_transformers.enable(model, **tight_kwargs("deepseek_v32", 3)) as hs:
        cache = hs.new_cache(ids, max_new_tokens=4)
        with torch.no_grad():
            model(input_ids=ids[:, :CHUNK], use_cache=True, past_key_values=cache)
            with pytest.raises(InvalidInputError) as err:
                cache.crop(-(CHUNK + 1))
        assert f"the last forward added {CHUNK}" in one_line(err.value)
        assert cache.get_seq_length() == CHUNK
        cache.finish()
        untouched(hs)



def test_crop_takes_a_0dim_tensor_and_undoes_a_decode_step_that_completed_a_page(ds_model: torch.nn.Module) -> None:
    """Direct forwards: one decode token that completes a page, `crop(tensor(-1))` (what assisted
    generation passes in transformers 5.17/5.18, on the model's device), another token in its place:
    logits as the model's own cache doing the same."""
    from transformers import DynamicCache

    from hisparse_transformers.cache import UnsupportedCacheOperation

    model = ds_model
    g = torch.Generator().manual_seed(21)
    ids = torch.randint(2, 128, (1, 4 * BLOCK + BLOCK - 1), generator=g)    # the next token completes page 5
    steps = torch.randint(2, 128, (1, 2 * BLOCK + 2), generator=g)

    def run(cache: object) -> list[torch.Tensor]:
        out = []
        with torch.no_grad():
            for a in range(0, ids.shape[1], CHUNK):
                model(input_ids=ids[:, a:a + CHUNK], use_cache=True, past_key_values=cache)
            for i in range(steps.shape[1] - 1):
                model(input_ids=steps[:, i:i + 1], use_cache=True, past_key_values=cache)
                cache.crop(torch.tensor(-1))  # type: ignore[attr-defined]
                out.append(model(input_ids=steps[:, i + 1:i + 2], use_cache=True, past_key_values=cache).logits)
        return out

    theirs = run(DynamicCache(config=model.config))
    with hisparse_transformers.enable(model, **tight_kwargs("deepseek_v32", 3)) as hs:
        cache = hs.new_cache(ids, max_new_tokens=2 * steps.shape[1])
        ours = run(cache)
        for bad in (torch.tensor(-1.0), torch.tensor([-1]), torch.tensor(True), -1.0):
            with pytest.raises(UnsupportedCacheOperation) as err:
                cache.crop(bad)  # type: ignore[arg-type]
            assert "crop takes an int (or a 0-dim integer tensor)" in one_line(err.value)
        length = cache.get_seq_length()
        cache.finish()
        s = hs.stats()
        untouched(hs)
    assert length == ids.shape[1] + steps.shape[1] - 1
    assert s.rollbacks == steps.shape[1] - 1
    for a, b in zip(ours, theirs, strict=True):
        assert float((a - b).abs().max()) <= 1e-4


def test_forwards_past_the_reserved_new_tokens_name_the_remedy(ds_model: torch.nn.Module) -> None:
    model = ds_model
    ids = prompts()[1]
    with hisparse_transformers.enable(model, **tight_kwargs("deepseek_v32", 3)) as hs:
        cache = hs.new_cache(ids, max_new_tokens=3)
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, past_key_values=cache)
            model(input_ids=ids[:, :2], use_cache=True, past_key_values=cache)     # 2 fed: max_new_tokens 3
            with pytest.raises(CapacityError) as err:
                model(input_ids=ids[:, :1], use_cache=True, past_key_values=cache)
        text = one_line(err.value)
        assert (f"to {ids.shape[1] + 3} tokens, past the {ids.shape[1] + 2}" in text
                and "max_new_tokens=3" in text and "new_cache(..., max_new_tokens >= 4)" in text), text
        assert cache.get_seq_length() == ids.shape[1] + 2
        cache.finish()
        untouched(hs)


def test_prompt_lookup_settings_transformers_would_fail_on(ds_model: torch.nn.Module) -> None:
    p = prompts()[1]
    with hisparse_transformers.enable(ds_model, **tight_kwargs("deepseek_v32", 3)) as hs:
        for bad in (3.0, 0, 2.5, -1, True):
            with pytest.raises(InvalidInputError) as err:
                ds_model.generate(p, max_new_tokens=4, do_sample=False, prompt_lookup_num_tokens=bad)
            assert one_line(err.value) == f"prompt_lookup_num_tokens must be an int >= 1, got {bad!r}"
            untouched(hs)


def test_assisted_max_context_bound_is_the_one_that_works(ds_model: torch.nn.Module) -> None:
    """With k candidates a step, the bound the refusal names is accepted and one more is refused."""
    p = prompts()[1]
    k = 3
    with hisparse_transformers.enable(ds_model, **tight_kwargs("deepseek_v32", k, max_context=48)) as hs:
        with pytest.raises(CapacityError) as err:
            ds_model.generate(p, max_new_tokens=48, do_sample=False, prompt_lookup_num_tokens=k)
        text = one_line(err.value)
        bound = 48 - p.shape[1] + 1 - k
        assert f"expected max_new_tokens <= {bound} " in text and f"up to {k} candidate tokens" in text, text
        untouched(hs)
        with pytest.raises(CapacityError):
            ds_model.generate(p, max_new_tokens=bound + 1, do_sample=False, prompt_lookup_num_tokens=k)
        out = ds_model.generate(p, max_new_tokens=bound, do_sample=False, prompt_lookup_num_tokens=k)
        assert out.shape[1] <= p.shape[1] + bound
