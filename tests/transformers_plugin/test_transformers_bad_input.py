"""Bad input to `enable`: one clear line naming the value and what was expected; nothing patched,
nothing allocated."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("transformers")

from tf_support import GEN, SHAPES, baseline, compare, enable_kwargs, random_prompts, tiny_model  # noqa: E402

import hisparse_transformers  # noqa: E402
from hisparse_core.errors import CapacityError, HiSparseError, InvalidInputError  # noqa: E402
from hisparse_transformers import handle as handle_mod  # noqa: E402
from hisparse_transformers import version as version_mod  # noqa: E402


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model("deepseek_v32", shape=SHAPES["deepseek_v32"], seed=0)


def untouched(model: torch.nn.Module) -> bool:
    attns = [layer.self_attn for layer in model.base_model.layers]
    return ("generate" not in model.__dict__ and not hasattr(model, "_hisparse_handle")
            and all("forward" not in a.__dict__ for a in attns))


def one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text and text
    return text


def test_not_a_dsa_model() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(hisparse_transformers.NotADsaModelError) as err:
        hisparse_transformers.enable(llama, host_pool_gib=0.01, gpu_kv_gib=0.01)
    text = one_line(err.value)
    assert "LlamaForCausalLM" in text and "'llama'" in text and "deepseek_v32" in text and "glm_moe_dsa" in text
    assert untouched(llama)


def test_topk_larger_than_the_hot_buffer(model: torch.nn.Module) -> None:
    with pytest.raises(InvalidInputError) as err:
        hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", hot_rows=8))
    text = one_line(err.value)
    assert "index_topk=16" in text and "hot_rows=8" in text and "hot_rows >= 16" in text
    assert untouched(model)


def test_host_pool_too_small_for_one_request(model: torch.nn.Module) -> None:
    with pytest.raises(CapacityError) as err:
        hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", host_pool_gib=1e-7))
    text = one_line(err.value)
    assert "host_pool_gib=1e-07" in text and "max_context=256" in text and "host_pool_gib >=" in text
    assert untouched(model)


def test_gpu_budget_too_small(model: torch.nn.Module) -> None:
    with pytest.raises(CapacityError) as err:
        hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", gpu_kv_gib=1e-6))
    text = one_line(err.value)
    assert "gpu_kv_gib=1e-06" in text and "expected gpu_kv_gib >=" in text
    assert untouched(model)


@pytest.mark.parametrize("version", ["5.16.2", "5.25.0", "4.57.1", "6.0.0"])
def test_unsupported_transformers_version(model: torch.nn.Module, version: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(version_mod.UnsupportedVersionError) as err:
        version_mod.check_version(version)
    text = one_line(err.value)
    assert f"transformers {version} is not supported" in text and ">=5.17,<5.25" in text
    monkeypatch.setattr(handle_mod, "check_version", lambda: version_mod.check_version(version))
    with pytest.raises(version_mod.UnsupportedVersionError):
        hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32"))
    assert untouched(model)


@pytest.mark.parametrize("version", ["5.17.0", "5.19.2", "5.24.0", "5.24.1rc1"])
def test_supported_versions(version: str) -> None:
    assert version_mod.check_version(version) == version


def test_bad_values_and_double_enable(model: torch.nn.Module) -> None:
    for bad in (dict(host_pool_gib=0), dict(gpu_kv_gib=-1.0), dict(block_size=0), dict(max_batch=True),
                dict(hot_rows=-4), dict(backend="no-such-backend"), dict(tp="yes"), dict(share_host_pool=None),
                dict(pool_name=3), dict(tp=True)):
        with pytest.raises(HiSparseError) as err:
            hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", **bad))
        one_line(err.value) if not isinstance(err.value, LookupError) else None
        assert untouched(model), bad
    hs = hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32"))
    try:
        with pytest.raises(InvalidInputError, match="already enabled"):
            hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32"))
    finally:
        hs.close()
    assert untouched(model)



@pytest.mark.parametrize("bad", [3, 2.5, ["reference_cpu"]])
def test_a_backend_that_is_no_name_or_instance_names_the_keyword(model: torch.nn.Module, bad: object) -> None:
    """Before: "no hisparse backend named 3 ..." (the registry's words, without the keyword)."""
    with pytest.raises(InvalidInputError) as err:
        hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", backend=bad))
    text = one_line(err.value)
    assert text.startswith(f"backend={bad!r}: expected a hisparse backend's name"), text
    assert untouched(model)


@pytest.mark.parametrize("backend", [None, "auto", " AUTO"])
def test_hisparse_backend_auto_is_the_automatic_choice(model: torch.nn.Module, backend: str | None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`HISPARSE_BACKEND=auto` was refused ("no hisparse backend named 'auto'") though `backend="auto"`
    was the automatic choice: the variable's `auto` is that choice too (here reference_cpu, the
    model being on the CPU)."""
    monkeypatch.setenv("HISPARSE_BACKEND", " Auto ")
    with hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", backend=backend)) as hs:
        assert hs.engine.backend.name == "reference_cpu"
    assert untouched(model)


def test_an_unknown_backend_name_names_the_keyword(model: torch.nn.Module) -> None:
    """Before: "no hisparse backend named 'nope'; available: ..." (the registry's words, without the keyword)."""
    from hisparse_core.errors import BackendNotFoundError

    with pytest.raises(BackendNotFoundError) as err:
        hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", backend="nope"))
    assert one_line(err.value).startswith("backend='nope': no hisparse backend named 'nope'"), str(err.value)
    assert untouched(model)

def test_right_padding_and_too_many_prompts(model: torch.nn.Module) -> None:
    with hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", gpu_kv_gib=1e-3)):
        ids = torch.randint(2, 100, (2, 6))
        right = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
        with pytest.raises(InvalidInputError, match="row 1 has a 0 at column 4 after a 1 at column 0 \\(of 6\\); "
                           "expected left padding"):
            model.generate(ids, attention_mask=right, max_new_tokens=2)
        # named by column: before, the whole row was printed (a line as long as the prompt)
        long_ids = torch.randint(2, 100, (1, 200))
        for mask, words in ((torch.ones(1, 200, dtype=torch.long).index_fill_(1, torch.tensor([150]), 0),
                             "row 0 has a 0 at column 150 after a 1 at column 0 (of 200); expected left padding"),
                            (torch.full((1, 200), 2), "row 0 holds 2 at column 0; expected left padding"),
                            # before: cast to ints, 0.5 read as padding (a row of no prompt token)
                            (torch.full((1, 200), 0.5), "row 0 holds 0.5 at column 0; expected left padding")):
            with pytest.raises(InvalidInputError) as err:
                model.generate(long_ids, attention_mask=mask, max_new_tokens=2)
            assert words in one_line(err.value) and len(str(err.value)) < 200
        with pytest.raises(CapacityError, match="batch of 4 prompts; expected 1 to max_batch=3"):
            model.generate(torch.randint(2, 100, (4, 6)), max_new_tokens=2)
        out = model.generate(ids, max_new_tokens=2, do_sample=False)      # still usable
        assert out.shape == (2, 8)


@pytest.mark.parametrize("over, words", [
    (dict(hot_rows=32772), "hot_rows=32772 is over a runtime's 32768-row hot buffer: expected hot_rows <= 32768"),
    (dict(hot_rows=None, speculative_tokens=2047),
     "speculative_tokens=2047 makes the default hot buffer (2047 + 2) x index_topk=16 = 32784 rows, over a runtime's "
     "32768-row hot buffer: expected speculative_tokens <= 2046"),
    (dict(hot_rows=32768, speculative_tokens=2048), "expected speculative_tokens <= 2047"),
])
def test_a_hot_buffer_over_the_runtime_limit_names_the_keyword(model: torch.nn.Module, over: dict[str, object],
                                                               words: str) -> None:
    """Before: "RuntimeConfig.hot_rows=32772 exceeds the 32768-row limit" (no keyword of enable), and
    the union refusal suggested hot_rows >= 32784, past that limit."""
    with pytest.raises(InvalidInputError) as err:
        hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", gpu_kv_gib=0.5, **over))
    text = one_line(err.value)
    assert words in text, text
    assert "32784" not in text.split("expected")[1], text    # no suggestion past the limit
    assert untouched(model)


def test_beam_search_and_several_sequences_are_refused_naming_the_setting(model: torch.nn.Module) -> None:
    """Before: "the forward has 2 rows but the batch has 1 prompts", from inside the first forward,
    naming neither setting."""
    ids = torch.randint(2, 100, (1, 6))
    with hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", gpu_kv_gib=1e-3)) as hs:
        for kw, words in ((dict(num_beams=2), "num_beams=2"),
                          (dict(num_return_sequences=2, do_sample=True), "num_return_sequences=2")):
            with pytest.raises(InvalidInputError) as err:
                model.generate(ids, max_new_tokens=2, **kw)
            text = one_line(err.value)
            assert words in text and f"expected {words.split('=')[0]}=1" in text, text
        assert hs.stats().requests == 0
        assert model.generate(ids, max_new_tokens=2, do_sample=False).shape == (1, 8)   # still usable


def test_the_log_says_why_the_hot_buffer_has_its_size(model: torch.nn.Module,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Before: "hot buffer 32 rows", without saying it was the default, or which."""
    for over, words in ((dict(hot_rows=None), "hot buffer 32 rows (the default: 2 x index_topk)"),
                        (dict(hot_rows=None, speculative_tokens=3),
                         "hot buffer 80 rows (the default: (speculative_tokens + 2) x index_topk)"),
                        (dict(hot_rows=48), "hot buffer 48 rows (hot_rows=48)"),
                        # before: "hot buffer 64 rows (the default: 2 x index_topk)", with index_topk 16
                        (dict(hot_rows=None, block_size=64),
                         "hot buffer 64 rows (the default: 2 x index_topk = 32, rounded up to whole pages of "
                         "block_size=64)")):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hisparse_transformers.engine"):
            hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", gpu_kv_gib=1e-3, **over)).close()
        lines = [r.getMessage() for r in caplog.records if "hot buffer" in r.getMessage() and "KV pool" in r.getMessage()]
        assert len(lines) == 1 and words in lines[0], lines
        assert "cpu device KV pool" in lines[0] and "GPU" not in lines[0], lines  # a CPU model says so


def test_a_prefill_chunk_past_max_context_asks_no_more_gpu(model: torch.nn.Module) -> None:
    """No forward holds more than max_context tokens, so a longer prefill_chunk (the default 512
    with max_context=64) sizes the GPU pool as max_context does. Before: it asked for blocks of
    512-token steps, and refused a budget that fits."""
    def smallest(chunk: int) -> float:
        with pytest.raises(CapacityError) as err:
            hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", gpu_kv_gib=1e-7, max_context=64,
                                                                prefill_chunk=chunk))
        return float(one_line(err.value).rsplit("expected gpu_kv_gib >= ", 1)[1].split(",")[0])

    fits = smallest(64)
    assert smallest(512) == fits
    ids, mask = random_prompts([40, 33], seed=4)
    theirs = baseline(model, ids, mask, 8, chunk=512)
    with hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", gpu_kv_gib=fits, max_context=64,
                                                             prefill_chunk=512)):
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=8, **GEN)
    got = compare(ours, theirs)
    assert got.tokens_equal and got.max_logit_diff <= 1e-4, got


@pytest.mark.parametrize("over", [
    dict(gpu_kv_gib=1e-9, max_context=1000, block_size=64, prefill_chunk=8),
    dict(gpu_kv_gib=1e-9, max_context=1000, block_size=64, prefill_chunk=100, max_batch=1),
    dict(host_pool_gib=1e-9, max_context=256, block_size=4, max_batch=1),
    dict(host_pool_gib=1e-9, max_context=3000, block_size=64, max_batch=1),
])
def test_the_budget_a_refusal_names_fits(model: torch.nn.Module, over: dict[str, object]) -> None:
    """The smallest budget a refusal names is accepted. Before: it was rounded to the nearest 6
    (gpu_kv_gib) or 3 (host_pool_gib) significant digits, often below what fits, and refused again."""
    name = next(k for k in over if k.endswith("_gib"))
    kw = enable_kwargs("deepseek_v32", **{"gpu_kv_gib": 0.01, "hot_rows": None, "check": False, **over})
    with pytest.raises(CapacityError) as err:
        hisparse_transformers.enable(model, **kw)
    fits = float(one_line(err.value).rsplit(f"expected {name} >= ", 1)[1].split(",")[0])
    hisparse_transformers.enable(model, **{**kw, name: fits}).close()
    assert untouched(model)


def test_prompts_that_are_no_token_ids_or_whose_mask_does_not_match_are_refused_in_one_line(
        model: torch.nn.Module) -> None:
    """generate and new_cache name input_ids (an integer dtype) and attention_mask (a tensor of
    their shape) before any forward. Before: float ids failed inside the coordinator's prefix hash
    (TypeError), a mask list in left_padding (AttributeError), a narrower mask inside the patched
    attention after a forward had run (RuntimeError); new_cache took float ids and a mask of another
    shape (its prompts cut at the mask's padding) and raised AttributeError on a list."""
    ids, mask = random_prompts([12, 9], seed=2)
    with hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", gpu_kv_gib=1e-3, check=False)) as hs:
        for call, words in (
                (lambda: model.generate(ids.float(), attention_mask=mask, max_new_tokens=2),
                 "input_ids of dtype torch.float32; expected token ids of an integer dtype"),
                (lambda: model.generate(ids, attention_mask=mask[:, :5], max_new_tokens=2),
                 "attention_mask of shape (2, 5) for input_ids of shape (2, 12); expected an attention_mask of shape "
                 "(2, 12)"),
                (lambda: model.generate(ids, attention_mask=mask[:1], max_new_tokens=2),
                 "attention_mask of shape (1, 12)"),
                (lambda: model.generate(ids, attention_mask=mask.tolist(), max_new_tokens=2),
                 "attention_mask of type list; expected a tensor of shape (2, 12)"),
                (lambda: hs.new_cache(ids.float(), mask), "new_cache got input_ids of dtype torch.float32"),
                (lambda: hs.new_cache(ids.tolist(), mask), "new_cache got input_ids of type list"),
                (lambda: hs.new_cache(ids, mask[:, 3:]), "new_cache got an attention_mask of shape (2, 9)"),
                (lambda: hs.new_cache(ids, mask.bool().tolist()), "new_cache got an attention_mask of type list"),
                (lambda: hs.new_cache(attention_mask=mask), "new_cache got no input_ids")):
            with pytest.raises(InvalidInputError) as err:
                call()
            text = one_line(err.value)
            assert words in text, text
        assert hs.stats().requests == 0 and hs.stats().prefill_tokens == 0
        # a mask wider than the prompts is what transformers tolerates: still served
        wide = torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], dim=1)
        assert model.generate(ids.int(), attention_mask=wide, max_new_tokens=2, do_sample=False).shape == (2, 14)


def test_a_length_that_is_no_whole_number_is_refused_before_the_prefill(model: torch.nn.Module) -> None:
    """transformers generates ceil(2.5) = 3 tokens for max_new_tokens=2.5, but admission reserved
    int(2.5) = 2. Before: the prefill ran, then a CapacityError mid-generate advised
    `handle.new_cache(..., max_new_tokens >= 3)`, a call the user never made."""
    ids, mask = random_prompts([12, 9], seed=2)
    with hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", gpu_kv_gib=1e-3, check=False)) as hs:
        for over, words in ((dict(max_new_tokens=2.5), "max_new_tokens=2.5: expected an int >= 1"),
                            (dict(max_new_tokens="3"), "max_new_tokens='3': expected an int >= 1"),
                            (dict(max_new_tokens=0), "max_new_tokens=0: expected an int >= 1"),
                            (dict(max_length=13.5), "max_length=13.5: expected an int >= 1")):
            with pytest.raises(InvalidInputError) as err:
                model.generate(ids, attention_mask=mask, do_sample=False, **over)
            assert one_line(err.value) == words
        assert hs.stats().requests == 0 and hs.stats().prefill_tokens == 0
        # whole floats are what transformers reads as ints: served
        assert model.generate(ids, attention_mask=mask, max_new_tokens=2.0, do_sample=False).shape == (2, 14)
        # and so are a numpy integer and a 0-dim integer tensor (before: refused, "expected an int >= 1")
        import numpy as np

        for two in (np.int64(2), torch.tensor(2)):
            assert model.generate(ids, attention_mask=mask, max_new_tokens=two, do_sample=False).shape == (2, 14)


def test_counts_take_any_integral_value_and_refuse_bools_floats_and_negatives(model: torch.nn.Module) -> None:
    """Counts are taken as `operator.index` takes them. Before: `new_cache(max_new_tokens=np.int64(5))`,
    enable's counts and generate's `prefill_chunk_size` or `prompt_lookup_num_tokens` as numpy
    integers were refused ("must be an int ..."); a numpy `prefill_chunk_size` then failed inside
    transformers' own prefill split."""
    import numpy as np

    ids, mask = random_prompts([12, 9], seed=2)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    counts = dict(block_size=np.int64(4), hot_rows=np.int64(32), max_batch=np.int32(3), max_context=np.uint16(256),
                  prefill_chunk=torch.tensor(8), speculative_tokens=np.int8(1), prefetch_next_group=[np.int64(0)])
    with hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", gpu_kv_gib=1e-3, check=False,
                                                             **counts)) as hs:
        c = hs.engine.config
        assert [(getattr(c, k), type(getattr(c, k))) for k in counts if k != "prefetch_next_group"] == \
            [(4, int), (32, int), (3, int), (256, int), (8, int), (1, int)] and c.prefetch_next_group == (0,)
        assert type(c.prefetch_next_group[0]) is int
        for five in (np.int64(5), np.uint8(5), torch.tensor(5)):
            cache = hs.new_cache(ids, mask, max_new_tokens=five)
            assert cache.max_new_tokens == 5 and type(cache.max_new_tokens) is int
            cache.finish()
        for bad in (True, 5.0, -1, np.float64(5), torch.tensor(True), "5"):
            with pytest.raises(InvalidInputError) as err:
                hs.new_cache(ids, mask, max_new_tokens=bad)
            assert one_line(err.value) == f"max_new_tokens must be an int >= 0 or None, got {bad!r}"
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                                          prefill_chunk_size=np.int64(4)), want)
        for bad in (True, 4.0, np.int64(0)):
            with pytest.raises(InvalidInputError) as err:
                model.generate(ids, attention_mask=mask, max_new_tokens=2, prefill_chunk_size=bad)
            assert one_line(err.value) == f"prefill_chunk_size={bad!r}: expected an int >= 1, or None (no chunking)"
        one, one_mask = ids[:1], mask[:1]
        assert model.generate(one, attention_mask=one_mask, max_new_tokens=2, do_sample=False,
                              prompt_lookup_num_tokens=np.int64(1)).shape == (1, 14)
        for bad in (True, 1.0):
            with pytest.raises(InvalidInputError) as err:
                model.generate(one, attention_mask=one_mask, max_new_tokens=2, prompt_lookup_num_tokens=bad)
            assert one_line(err.value) == f"prompt_lookup_num_tokens must be an int >= 1, got {bad!r}"
        assert hs.stats().requests == 3
    for name, bad, words in (("block_size", True, "block_size must be a positive int, got True"),
                             ("max_batch", 3.0, "max_batch must be a positive int, got 3.0"),
                             ("max_context", np.int64(-4), "max_context must be a positive int, got np.int64(-4)"),
                             ("hot_rows", np.float32(16), "hot_rows must be a positive int or None, got np.float32(16.0)"),
                             ("speculative_tokens", -1, "speculative_tokens must be an int >= 0"),
                             ("resident_layers", [np.bool_(True)], "resident_layers=[np.True_]: resident layers "
                              "[np.True_]: expected ints")):
        with pytest.raises(InvalidInputError) as err:
            hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", **{name: bad}))
        assert one_line(err.value).startswith(words), err.value
        assert untouched(model)
    with pytest.raises(CapacityError) as cap:     # a numpy layer is a layer: refused only for its budget
        hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", resident_layers=[np.int64(0)]))
    assert one_line(cap.value).startswith("resident_layers=[0] keep"), cap.value
    assert untouched(model)


def test_copying_or_pickling_an_enabled_model_or_its_cache_is_refused_in_one_line(model: torch.nn.Module) -> None:
    """Before: copy.deepcopy and pickle raised "TypeError: cannot pickle 'module' object" (the
    family's modeling module, deep in a patched layer), and torch.save "Cannot save multiple tensors
    or storages that view the same data as different types" (the engine's stores)."""
    import copy
    import io
    import pickle

    from hisparse_transformers.cache import UnsupportedCacheOperation

    hs = hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", check=False))
    try:
        for call in (lambda: copy.deepcopy(model), lambda: pickle.dumps(model),
                     lambda: torch.save(model, io.BytesIO())):
            with pytest.raises(InvalidInputError) as err:
                call()
            text = one_line(err.value)
            assert text.startswith("a model with hisparse enabled cannot be copied or pickled") and \
                "expected hs.close() or hisparse_transformers.disable(model) first" in text, text
        for call in (lambda: copy.deepcopy(hs.new_cache()), lambda: pickle.dumps(hs.new_cache())):
            with pytest.raises(UnsupportedCacheOperation) as err:
                call()
            assert one_line(err.value).startswith("a HiSparseCache cannot be copied or pickled"), err.value
        assert not hs.closed and model._hisparse_handle is hs            # refused: still enabled
    finally:
        hs.close()
    twin = copy.deepcopy(model)                                           # closed: the model copies as it is
    assert untouched(model) and untouched(twin)


def test_a_pool_name_that_is_no_file_name_part_is_refused_at_enable(model: torch.nn.Module) -> None:
    """Before: accepted by enable; under tensor parallelism refused by rank 0 only once the ranks had
    agreed and built their backends ("shared host pool name ..."), naming no keyword; without it,
    never checked."""
    for bad in ("a/b", "", "x" * 129, "pool\x00", "../etc"):
        with pytest.raises(InvalidInputError) as err:
            hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", pool_name=bad))
        assert one_line(err.value).startswith(f"pool_name={bad!r}: expected 1-128 of [A-Za-z0-9_.-]"), err.value
        assert untouched(model)
    hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", pool_name="a.b-c_1")).close()


def test_enabling_a_model_whose_base_model_or_wrapper_is_enabled_is_refused(model: torch.nn.Module) -> None:
    """The base model and the model around it share their attention layers. Before: both enables
    were taken, two engines (two host pools) patched the same layers, and closing the first
    handle removed the second's base-model patch."""
    for first, second in ((model.base_model, model), (model, model.base_model)):
        hs = hisparse_transformers.enable(first, **enable_kwargs("deepseek_v32", check=False))
        try:
            with pytest.raises(InvalidInputError) as err:
                hisparse_transformers.enable(second, **enable_kwargs("deepseek_v32", check=False))
            assert one_line(err.value).startswith("hisparse is already enabled on layer 0's attention, through "
                                                  "another model that holds it"), err.value
            assert getattr(second, "_hisparse_handle", None) is None and "generate" not in second.__dict__
        finally:
            hs.close()
        assert untouched(model)
    hisparse_transformers.enable(model.base_model, **enable_kwargs("deepseek_v32", check=False)).close()
    assert untouched(model)


def test_a_generate_around_an_enabled_base_model_warns_that_it_runs_without_hisparse(
        model: torch.nn.Module, caplog: pytest.LogCaptureFixture) -> None:
    """enable(model.model): the base model has no generate, and the ForCausalLM's generate builds
    its own DynamicCache. Before: that generate ran the model's own attention, silently (0 requests
    through hisparse)."""
    ids, mask = random_prompts([12, 9], seed=2)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    warned = lambda: [r.getMessage() for r in caplog.records  # noqa: E731
                      if r.levelno == logging.WARNING and r.name.startswith("hisparse")]
    with caplog.at_level(logging.WARNING, logger="hisparse_transformers"):
        with hisparse_transformers.enable(model.base_model, **enable_kwargs("deepseek_v32", check=False)) as hs:
            for _ in range(2):      # the model's own tokens, and one warning a handle
                assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False), want)
            cache = hs.new_cache(ids, mask, max_new_tokens=2)    # a forward given hisparse's cache: served
            model(input_ids=ids, attention_mask=mask, past_key_values=cache)
            cache.finish()
            assert hs.stats().requests == 2
        lines = warned()
        assert len(lines) == 1 and "\n" not in lines[0], lines
        assert lines[0].startswith("hisparse: a forward of DeepseekV32Model brought its own cache (DynamicCache), "
                                   "so it ran the model's own attention and nothing went through hisparse") and \
            "expected enable() on the model whose generate you call (the DeepseekV32ForCausalLM" in lines[0], lines
        caplog.clear()
        with hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", check=False)) as hs:
            assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False), want)
            assert hs.stats().requests == 2
        assert warned() == []
    assert untouched(model)


def test_the_errors_the_docs_name_are_the_packages_names(model: torch.nn.Module) -> None:
    """docs/transformers.md names RowMismatch and TopkMismatch side by side, and enable's docstring
    says bad input raises a HiSparseError. Before: hisparse_transformers.RowMismatch worked, but
    .TopkMismatch, .HiSparseError and .UnsupportedCacheOperation raised AttributeError (an ImportError
    for `from hisparse_transformers import ...`)."""
    from hisparse_transformers import HiSparseError as Base
    from hisparse_transformers import RowMismatch, TopkMismatch, UnsupportedCacheOperation
    from hisparse_transformers.cache import UnsupportedCacheOperation as Unsupported
    from hisparse_transformers.check import TopkMismatch as Mismatch

    assert Base is HiSparseError and TopkMismatch is Mismatch and UnsupportedCacheOperation is Unsupported
    assert all(issubclass(e, Base) for e in (RowMismatch, TopkMismatch, UnsupportedCacheOperation))
    assert set(hisparse_transformers.__all__) >= {"HiSparseError", "TopkMismatch", "UnsupportedCacheOperation"}
    with pytest.raises(hisparse_transformers.HiSparseError):
        hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", max_batch=0))


def test_a_prefill_chunk_size_past_enables_prefill_chunk_is_refused_before_the_prefill(
        model: torch.nn.Module) -> None:
    """The GPU pool is sized for prefill forwards of enable's prefill_chunk. Before: generate's own
    prefill_chunk_size=128 (8 at enable, 66 blocks) ran, and failed mid-prefill with "step 0: its new
    pages need 78 GPU blocks and 66 are free ...; raise gpu_kv_gib or lower max_batch/prefill_chunk",
    naming a setting the user never changed."""
    from transformers import GenerationConfig

    ids, mask = random_prompts([120, 100, 90], seed=0)
    with hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", check=False)) as hs:
        for over, words in (
                (dict(prefill_chunk_size=128), "prefill_chunk_size=128 feeds prefill forwards of 120 prompt tokens, "
                 "but hisparse sized its GPU pool for 8 (enable(..., prefill_chunk=8)): expected prefill_chunk_size "
                 "<= 8"),
                (dict(prefill_chunk_size=None), "prefill_chunk_size=None feeds prefill forwards of 120 prompt tokens"),
                (dict(prefill_chunk_size=0), "prefill_chunk_size=0: expected an int >= 1, or None (no chunking)"),
                (dict(generation_config=GenerationConfig(prefill_chunk_size=16, max_new_tokens=1)),
                 "prefill_chunk_size=16 (from the generation_config passed) feeds prefill forwards of 16 prompt "
                 "tokens")):
            with pytest.raises(InvalidInputError) as err:
                model.generate(ids, attention_mask=mask, **{"max_new_tokens": 1, **over})
            assert one_line(err.value).startswith(words), err.value
        assert hs.stats().requests == 0 and hs.stats().prefill_tokens == 0
        short, short_mask = random_prompts([6, 5], seed=1)          # a chunk past the prompt: one forward of it
        assert model.generate(short, attention_mask=short_mask, max_new_tokens=1, prefill_chunk_size=64,
                              do_sample=False).shape == (2, 7)


def test_a_prefill_chunk_size_on_model_generation_config_is_honoured_as_the_keyword_is(
        model: torch.nn.Module) -> None:
    """transformers reads `prefill_chunk_size` from the call, else the generation_config passed, else
    `model.generation_config`. Before: hisparse read only the first two, and passed enable's own
    prefill_chunk over the model's (prefill forwards of 8 and 4 tokens where it asked for 4), and a
    model's 16, past enable's 8, ran without the refusal the keyword gets."""
    import numpy as np
    from transformers import GenerationConfig

    ids, mask = random_prompts([12, 9], seed=2)
    gen = model.generation_config
    with hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", check=False)) as hs:
        widths: list[int] = []
        hs.on_step = lambda _, step: widths.append(step.num_new) if step.prefill else None
        try:
            gen.prefill_chunk_size = 4
            model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
            model.generate(ids, attention_mask=mask, generation_config=GenerationConfig(max_new_tokens=1))
            assert widths == [4, 4, 4] * 2
            widths.clear()
            gen.prefill_chunk_size = 16
            with pytest.raises(InvalidInputError) as err:
                model.generate(ids, attention_mask=mask, max_new_tokens=1)
            assert one_line(err.value).startswith("prefill_chunk_size=16 (from model.generation_config) feeds prefill "
                                                  "forwards of 12 prompt tokens, but hisparse sized its GPU pool for 8 "
                                                  "(enable(..., prefill_chunk=8)): expected prefill_chunk_size <= 8")
            gen.prefill_chunk_size = 4.0
            with pytest.raises(InvalidInputError) as err:
                model.generate(ids, attention_mask=mask, max_new_tokens=1)
            assert one_line(err.value) == ("prefill_chunk_size=4.0 (from model.generation_config): expected an int "
                                           ">= 1, or None (no chunking)")
            assert widths == [] and hs.stats().requests == 4
            model.generate(ids, attention_mask=mask, max_new_tokens=1, prefill_chunk_size=8)   # the call's first
            config = GenerationConfig(max_new_tokens=1, prefill_chunk_size=np.int64(6))
            model.generate(ids, attention_mask=mask, generation_config=config)    # the config passed over the model's
            assert widths == [8, 4, 6, 6] and config.prefill_chunk_size == 6 and type(config.prefill_chunk_size) \
                is np.int64
        finally:
            gen.prefill_chunk_size = None


def test_a_prompt_past_max_context_names_the_max_context_that_fits(model: torch.nn.Module) -> None:
    """Before: "... exceeds max_context=48; expected enable(..., max_context >= it)"."""
    ids, mask = random_prompts([60, 10], seed=3)
    with hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", max_context=48, check=False)) as hs:
        for call in (lambda: model.generate(ids, attention_mask=mask, max_new_tokens=2),
                     lambda: model(input_ids=ids, attention_mask=mask, past_key_values=hs.new_cache(ids, mask))):
            with pytest.raises(CapacityError) as err:
                call()
            assert one_line(err.value) == ("a prompt of 60 padded tokens exceeds max_context=48; expected "
                                           "enable(..., max_context >= 60)"), err.value
        assert hs.stats().requests == 0


def test_the_new_tokens_admission_reserves_are_those_transformers_generates(model: torch.nn.Module) -> None:
    """transformers' `max_new_tokens`, set anywhere, takes precedence over a `max_length` given to
    the call, and with neither set it generates its default 20 new tokens. Before: admission
    reserved `max_length` minus the prompt (2 tokens) and the generate failed after its prefill
    naming `handle.new_cache(..., max_new_tokens >= 3)`; with no length set it reserved up to
    `max_context`, and a batch past it failed mid-generate after its prefill."""
    ids, mask = random_prompts([12, 9], seed=2)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    gen = model.generation_config
    with hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", check=False, max_context=24)) as hs:
        gen.max_new_tokens = 5
        try:
            assert torch.equal(model.generate(ids, attention_mask=mask, max_length=14, do_sample=False), want)
        finally:
            gen.max_new_tokens = None
        with pytest.raises(CapacityError) as err:     # 12 + 20 new tokens: past max_context
            model.generate(ids, attention_mask=mask, do_sample=False)
        assert "max_context" in one_line(err.value) and "max_new_tokens <= 13" in err.value.args[0]
        assert hs.stats().prefill_tokens == 21


def test_a_generation_config_gets_no_deprecation_warning_for_hisparse_s_prefill_chunk(model: torch.nn.Module) -> None:
    """Before: hisparse passed its `prefill_chunk_size` as a kwarg beside the caller's
    `generation_config`, and transformers warned that passing both is deprecated, naming a
    setting the caller never gave."""
    from transformers import GenerationConfig
    from transformers.utils import logging as tf_logging

    ids, mask = random_prompts([12, 9], seed=2)
    config = GenerationConfig(max_new_tokens=3, do_sample=False, pad_token_id=0)
    want = model.generate(ids, attention_mask=mask, generation_config=config)
    tf_logger = tf_logging.get_logger("transformers.generation.utils")
    tf_logger.warning_once.cache_clear()
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    tf_logger.addHandler(handler)
    try:
        with hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", check=False)):
            assert torch.equal(model.generate(ids, attention_mask=mask, generation_config=config), want)
    finally:
        tf_logger.removeHandler(handler)
    assert not [m for m in seen if "deprecated" in m], seen
    assert config.prefill_chunk_size is None          # the caller's config is left as it was


def test_a_generation_config_given_by_position_is_read_as_the_keyword_is(model: torch.nn.Module) -> None:
    """`model.generate(ids, config)`: generate's second parameter is `generation_config`. Before:
    hisparse read only the keyword, so admission reserved transformers' default 20 new tokens
    (a CapacityError after the prefill, naming handle.new_cache) and beam search was refused late,
    as a batch of 4 rows for 2 prompts."""
    from transformers import GenerationConfig

    ids, mask = random_prompts([12, 9], seed=2)
    config = GenerationConfig(max_new_tokens=22, do_sample=False, pad_token_id=0)
    want = model.generate(ids, config, attention_mask=mask)
    with hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", check=False)) as hs:
        assert torch.equal(model.generate(ids, config, attention_mask=mask), want)
        with pytest.raises(InvalidInputError) as err:
            model.generate(ids, GenerationConfig(max_new_tokens=2, num_beams=2, pad_token_id=0), attention_mask=mask)
        assert one_line(err.value).startswith("num_beams=2 (from the generation_config passed): hisparse runs one "
                                              "request per prompt row")
        assert hs.stats().requests == 2


@pytest.mark.parametrize("over", [{}, {"hot_rows": 40000}, {"speculative_tokens": 2}])
def test_a_block_size_past_the_runtime_hot_buffer_names_block_size(model: torch.nn.Module,
                                                                    over: dict[str, object]) -> None:
    """Before: block_size=40000 (no hot_rows) was refused as "speculative_tokens=0 makes the default hot
    buffer ... expected speculative_tokens <= 0, or hot_rows between ... and 0", naming two keywords
    the caller had left alone and a range ending at 0; with hot_rows=40000 "expected hot_rows <= 0"."""
    with pytest.raises(InvalidInputError) as err:
        hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", gpu_kv_gib=0.5, block_size=40000,
                                                            **over))
    text = one_line(err.value)
    assert text.startswith("block_size=40000") and "expected block_size <= 32768" in text, text
    assert "speculative_tokens" not in text and "<= 0" not in text, text
    assert untouched(model)


@pytest.mark.parametrize(("over", "key"), [
    ({"host_pool_gib": 0.001, "max_context": 10**7}, "max_context"),
    ({"gpu_kv_gib": 0.002, "max_batch": 10**4}, "max_batch"),
])
def test_a_budget_refusal_also_names_the_count_that_fits_the_budget_given(model: torch.nn.Module,
                                                                          over: dict[str, object], key: str) -> None:
    """Before: max_context=10**7 (or max_batch=10**4) was refused only with 'expected host_pool_gib >= 3.58'
    (or gpu_kv_gib >= 2.8), whatever the machine holds: a budget of 10**12 tokens named 3.58e+05 GiB. Now
    the line also names the largest max_context (max_batch) the budget given holds, and that one fits."""
    with pytest.raises(CapacityError) as err:
        hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", **over))
    text = one_line(err.value)
    assert f", or {key} <= " in text, text
    fits = int(text.rsplit(f"{key} <= ", 1)[1])
    assert untouched(model)
    hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", **{**over, key: fits})).close()
    step = enable_kwargs("deepseek_v32")["block_size"] if key == "max_context" else 1
    with pytest.raises(CapacityError):
        hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", **{**over, key: fits + step}))
    assert untouched(model)
