"""`enable(..., kv_rows="fp8")`: the latent rows stored as DeepSeek-V3.2 serves them (FlashMLA's
fp8_ds_mla: e4m3 values, an fp32 power-of-two scale per 128, the roped part in the model's dtype).
The byte layout against a straightforward encoder written here (element by element, float64);
generate against the model's own with its normed latent rounded the same way, through misses,
prefix hits, a resident layer and the static decode step; one-line refusals."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from tf_support import (
    BLOCK,
    GEN,
    NO_TIES,
    SHAPES,
    baseline,
    compare,
    enable_kwargs,
    gpu_reason,
    random_prompts,
    reference_fp8,
    tiny_model,
)

import hisparse_transformers
from hisparse_core.errors import InvalidInputError
from hisparse_core.geometry import FP8_DS_MLA
from hisparse_transformers.kv_rows import LatentRows, StoredLatents, model_reads_stored_rows
from hisparse_transformers.tiny import TinyShape

pytest.importorskip("transformers")

LENGTHS = [40, 57, 23]
NEW = 48


@settings(max_examples=10, deadline=None, phases=[Phase.explicit, Phase.generate])
@given(seed=st.integers(0, 2**31 - 1), geometry=st.sampled_from([(16, 8), (128, 64), (512, 64), (256, 32)]),
       dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float16]), spread=st.floats(1e-3, 1e2))
def test_fp8_rows_are_laid_out_as_a_straightforward_encoder_writes_them(seed: int, geometry: tuple[int, int],
                                                                        dtype: torch.dtype, spread: float) -> None:
    lora, rope = geometry
    rows = LatentRows.of("fp8", dtype, lora, rope)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 4, lora + rope, generator=g) * spread
    x[0, 1, 3] *= 40.0                       # an outlier: its block's scale, not the others'
    x[1, 2, :lora] = 0.0                     # an all-zero latent: the scale floor
    x = x.to(dtype)
    stored = rows.encode(x)
    elem = torch.empty((), dtype=dtype).element_size()
    block = min(128, lora)
    used = lora + 4 * (lora // block) + rope * elem
    assert stored.dtype == torch.uint8 and stored.shape == (3, 4, -(-used // 16) * 16)
    want, scales = reference_fp8(x[..., :lora], block)
    # bytes [0, lora): the e4m3 values; then the fp32 scales; then the roped part as the model holds it
    values = stored[..., :lora].view(torch.float8_e4m3fn).double()
    got_scales = stored[..., lora:lora + 4 * (lora // block)].view(torch.float32).double()
    assert torch.equal(got_scales, scales)
    assert torch.equal(values * scales.repeat_interleave(block, dim=-1), want)
    assert torch.equal(stored[..., lora + 4 * (lora // block):used], x[..., lora:].contiguous().view(torch.uint8))
    assert not stored[..., used:].any()
    # decoded: the dequantized latent in the model's dtype, the roped part as it was
    back = rows.decode(stored)
    assert back.dtype == dtype and back.shape == x.shape
    assert torch.equal(back[..., :lora].double(), want.to(dtype).double())
    assert torch.equal(back[..., lora:], x[..., lora:])
    assert torch.equal(rows.round_latent(x[..., :lora]), back[..., :lora])
    assert torch.equal(rows.decode(rows.encode(back)), back)          # stored again, read again: the same
    assert bool(((back.double() - x.double()).abs() <= rows.error_bound(x)).all())


def test_fp8_rows_of_a_float64_model_are_refused_in_one_line() -> None:
    with pytest.raises(InvalidInputError, match=r"^kv_rows='fp8' with a float64 model: expected bfloat16, float16 or "
                                                r"float32") as err:
        LatentRows.of("fp8", torch.float64, 512, 64)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kind", ["model", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8])
def test_rows_of_a_quantized_checkpoint_are_refused_in_one_line(kind: str, dtype: torch.dtype) -> None:
    """An fp8 checkpoint's kv_a_proj_with_mqa weights are float8: stored in their dtype the latent
    would lose its scale (kv_rows="model" used to do just that, silently)."""
    with pytest.raises(InvalidInputError, match=rf"^kv_rows='{kind}' with a model whose kv_a_proj_with_mqa weights "
                                                rf"are {str(dtype).removeprefix('torch.')}: expected weights in "
                                                r"bfloat16, float16 or float32") as err:
        LatentRows.of(kind, dtype, 512, 64)
    assert "\n" not in str(err.value)


def test_enable_on_a_model_with_fp8_weights_is_refused_before_anything_is_built() -> None:
    model = tiny_model("deepseek_v32", shape=SHAPES["deepseek_v32"], seed=3)
    attn = model.model.layers[0].self_attn
    attn.kv_a_proj_with_mqa.weight.data = attn.kv_a_proj_with_mqa.weight.data.to(torch.float8_e4m3fn)
    with pytest.raises(InvalidInputError, match=r"weights are float8_e4m3fn: expected weights in bfloat16"):
        hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32"))
    assert "generate" not in model.__dict__ and not hasattr(model, "_hisparse_handle")     # untouched


def test_deepseek_geometry_in_bf16_is_fp8_ds_mla() -> None:
    rows = LatentRows.of("fp8", torch.bfloat16, 512, 64)
    assert rows.fmt == FP8_DS_MLA and rows.fmt.row_bytes == 656
    assert LatentRows.of("model", torch.bfloat16, 512, 64).fmt.row_bytes == 1152
    model_rows = LatentRows.of("model", torch.float32, 16, 8)
    x = torch.randn(2, 24)
    assert model_rows.decode(model_rows.encode(x)).shape == (2, 24)
    assert model_rows.round_latent(x) is x and not model_rows.error_bound(x).any()


def _fp8_row(family: str) -> int:
    return LatentRows.of("fp8", torch.float32, SHAPES[family].kv_lora, SHAPES[family].rope).fmt.row_bytes


def _tight(family: str, pages: int = 66, layers: int | None = None) -> float:
    """A GPU budget of `pages` pages of fp8 rows (tf_support's `tight_gpu_gib` counts the model's rows)."""
    return pages * (layers or SHAPES[family].layers) * BLOCK * _fp8_row(family) / 2**30


@pytest.fixture(scope="module", params=sorted(SHAPES))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


def _reference(model: Any, ids: torch.Tensor, mask: torch.Tensor, new: int) -> Any:
    rows = LatentRows.of("fp8", model.dtype, model.config.kv_lora_rank, model.config.qk_rope_head_dim)
    with model_reads_stored_rows(model, rows):
        return baseline(model, ids, mask, new, chunk=8)


def test_fp8_rows_generate_exactly_as_the_model_reading_them(family: str) -> None:
    """One layer: its latent comes from the embeddings, bit for bit the model's own, so hisparse and
    the model round it alike and the logits agree to float noise. (Past the first layer absorbed
    and expanded attention leave their outputs about 1e-7 apart, enough to put a latent value on
    either side of an e4m3 rounding boundary now and then: one fp8 step apart, not float noise.)"""
    model: Any = tiny_model(family, shape=replace(SHAPES[family], layers=1), seed=3)
    ids, mask = random_prompts(LENGTHS, seed=1)
    theirs = _reference(model, ids, mask, NEW)
    plain = baseline(model, ids, mask, NEW, chunk=8)
    with hisparse_transformers.enable(model, **enable_kwargs(family, gpu_kv_gib=_tight(family, layers=1),
                                                             kv_rows="fp8")) as hs:
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, **GEN)
        got = compare(ours, theirs)
        assert got.tokens_equal and got.steps == NEW and got.max_logit_diff <= 1e-4, got
        s = hs.stats()
        assert hs.engine.fmt.row_bytes == 64 and hs.engine.device_layers[0][0].dtype == torch.uint8
        # pages were released and read back through the hot buffer, every row checked (check=True)
        assert s.released_pages > 0 and s.misses > 0 and s.hits > 0 and s.checked_entries > 0, s
        assert s.h2d_bytes >= s.misses * 64 and s.checked_max_abs_diff > 0
        # a second batch sharing 32 prompt tokens: prefix hits read from the host pool's fp8 rows
        prefix = ids[1, :32].tolist()
        ids2, mask2 = random_prompts([48, 33, 60], seed=7, prefix=prefix)
        ours2 = model.generate(ids2, attention_mask=mask2, max_new_tokens=16, **GEN)
        got2 = compare(ours2, _reference(model, ids2, mask2, 16))
        assert got2.tokens_equal and got2.max_logit_diff <= 1e-4, got2
        assert hs.stats().prefix_hit_tokens == 3 * 32
    # the format matters: the model as it is (its latent unrounded) reads other logits
    assert compare(ours, plain).max_logit_diff > 100 * 1e-4


@settings(max_examples=6, deadline=None, phases=[Phase.explicit, Phase.generate])
@given(family=st.sampled_from(sorted(SHAPES)), lora=st.sampled_from([16, 32, 128, 256]),
       lengths=st.lists(st.integers(40, 150), min_size=1, max_size=3), chunk=st.sampled_from([4, 8, 16]),
       block=st.sampled_from([2, 4, 8]), new=st.integers(4, 24), share=st.floats(0.2, 0.6),
       seed=st.integers(0, 999))
def test_fp8_rows_match_the_rounding_model_across_shapes(family: str, lora: int, lengths: list[int], chunk: int,
                                                          block: int, new: int, share: float, seed: int) -> None:
    """Fresh one-layer models (the latent bit for bit the model's) of random latent widths, prompts,
    chunks, pages and budgets (20-60% of the batch's pages, at least the engine's floor): hisparse
    with fp8 rows against the model reading its latent rounded the same way, to 1e-4, rows checked."""
    from hisparse_transformers.engine import required_gpu_blocks

    shape = replace(NO_TIES[family], layers=1, kv_lora=lora)
    model: Any = tiny_model(family, shape=shape, seed=seed)
    ids, mask = random_prompts(lengths, seed=seed)
    rows = LatentRows.of("fp8", torch.float32, lora, shape.rope)
    with model_reads_stored_rows(model, rows):
        theirs = baseline(model, ids, mask, new, chunk=chunk)
    n, hot = len(lengths), -(-shape.index_topk // block) * block
    floor = required_gpu_blocks(n, hot // block, -(-chunk // block) + 1)
    pages = max(floor, int(share * sum(-(-(x + new) // block) for x in lengths)))
    with hisparse_transformers.enable(model, host_pool_gib=0.01, gpu_kv_gib=pages * block * rows.fmt.row_bytes / 2**30,
                                      block_size=block, hot_rows=hot, max_batch=n, max_context=256,
                                      prefill_chunk=chunk, check=True, kv_rows="fp8") as hs:
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=new, prefill_chunk_size=chunk, **GEN)
        s = hs.stats()
    got = compare(ours, theirs)
    assert got.tokens_equal and got.max_logit_diff <= 1e-4, (got, s.misses)
    assert s.checked_entries > 0 and s.row_bytes == rows.fmt.row_bytes


def test_fp8_rows_every_layer_checked_in_a_resident_layer_and_the_static_step(family: str) -> None:
    """Every layer of the model (GLM-5: a follower sharing its leader's top-k): the row check reads
    each row within fp8 rounding of the model's latent; a resident layer's store holds fp8 rows too,
    and the static decode step (what a CUDA graph captures; run eagerly here) reads and writes them
    as the dynamic one does: the same logits either way."""
    model: Any = tiny_model(family, shape=NO_TIES[family], seed=4)
    ids, mask = random_prompts([97, 110, 103], seed=2)
    resident = (0,) if family == "deepseek_v32" else (0, 1)    # the first index group (GLM-5: with its follower)
    row = _fp8_row(family)
    store = len(resident) * 3 * 256 * row                          # max_batch x max_context rows a layer
    kw = enable_kwargs(family, kv_rows="fp8", check=False)
    runs = {"checked": dict(gpu_kv_gib=_tight(family), check=True),
            "resident, static": dict(gpu_kv_gib=(store + 66 * (SHAPES[family].layers - len(resident)) * BLOCK * row)
                                     / 2**30, resident_layers=resident)}
    out, stats = {}, {}
    for name, over in runs.items():
        with hisparse_transformers.enable(model, **{**kw, **over}, cuda_graphs=False) as hs:
            static = name.endswith("static")
            hs.graphs.enabled, hs.graphs.capture = static, False
            out[name] = model.generate(ids, attention_mask=mask, max_new_tokens=32, **GEN)
            stats[name] = hs.stats()
    got = compare(out["resident, static"], out["checked"])
    assert got.tokens_equal and got.max_logit_diff <= 1e-4, got
    assert stats["checked"].checked_entries > 0 and stats["checked"].misses > 0, stats["checked"]
    s = stats["resident, static"]
    assert s.misses > 0 and s.resident_layers == resident and s.decode_mode.startswith("static eager"), s


def test_stored_latents_replay_what_was_recorded_and_refuse_other_forwards() -> None:
    """A replayed run reads the recorded latents (rounded as stored): recorded from the model reading
    its own latent rounded, the replay is that run again; a replay of other forwards is refused,
    and the hooks are removed either way."""
    model: Any = tiny_model("deepseek_v32", shape=SHAPES["deepseek_v32"], seed=3)
    rows = LatentRows.of("fp8", torch.float32, SHAPES["deepseek_v32"].kv_lora, SHAPES["deepseek_v32"].rope)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    stored = StoredLatents(model, rows)
    with torch.no_grad():
        plain = model(ids).logits
        with model_reads_stored_rows(model, rows), stored.record():     # the rounding hook first
            rounded = model(ids).logits
        with stored.replay():
            replayed = model(ids).logits
        assert [len(c) for c in stored.calls] == [1, 1]
        assert stored.flips == 0          # (recorded after the rounding hook: only values it left alone compared)
        assert not torch.equal(plain, rounded) and torch.equal(replayed, rounded)
        with pytest.raises(InvalidInputError, match="no recorded latent of its shape"), stored.replay():
            model(ids[:, :5])
        assert torch.equal(model(ids).logits, plain)          # every hook removed
    with pytest.raises(InvalidInputError, match="made \\[0, 0\\] calls a layer where 1 were recorded"):
        with stored.replay():
            pass


def test_bad_kv_rows_are_one_line_and_leave_the_model_alone(family: str) -> None:
    model: Any = tiny_model(family, shape=SHAPES[family], seed=3)
    for bad in ("int8", "FP8", None, 8):
        with pytest.raises(InvalidInputError) as err:
            hisparse_transformers.enable(model, **enable_kwargs(family, kv_rows=bad))
        assert "kv_rows=" in str(err.value) and "\n" not in str(err.value) and "'fp8'" in str(err.value)
    assert "generate" not in model.__dict__
    odd: Any = tiny_model(family, shape=TinyShape(layers=2, kv_lora=18), seed=1)
    with pytest.raises(InvalidInputError, match=r"kv_rows='fp8' with kv_lora_rank=18: expected a multiple of 4"):
        hisparse_transformers.enable(odd, **enable_kwargs(family, kv_rows="fp8"))
    assert "generate" not in odd.__dict__
    with hisparse_transformers.enable(odd, **enable_kwargs(family, kv_rows="model", gpu_kv_gib=0.001)) as hs:
        assert hs.engine.rows.kind == "model"


def test_a_latent_not_in_whole_scale_blocks_is_refused_naming_kv_rows(family: str) -> None:
    """kv_lora_rank 192 (a multiple of 4, more than one 128-value block but not whole blocks): the
    refusal is about kv_rows and kv_lora_rank, not the indexer keys' index_head_dim."""
    for lora in (192, 200):
        with pytest.raises(InvalidInputError) as err:
            LatentRows.of("fp8", torch.bfloat16, lora, 64)
        text = str(err.value)
        assert text.startswith(f"kv_rows='fp8' with kv_lora_rank={lora}:") and "\n" not in text, text
        assert "index_head_dim" not in text and "indexer_keys" not in text and "kv_rows='model'" in text, text
    model: Any = tiny_model(family, shape=TinyShape(layers=2, kv_lora=192), seed=1)
    with pytest.raises(InvalidInputError, match=r"^kv_rows='fp8' with kv_lora_rank=192: "):
        hisparse_transformers.enable(model, **enable_kwargs(family, kv_rows="fp8"))
    assert "generate" not in model.__dict__
    assert LatentRows.of("fp8", torch.bfloat16, 384, 64).scales == 3      # whole blocks: accepted


@pytest.mark.gpu
@pytest.mark.skipif(gpu_reason() is not None, reason=f"nvidia backend unavailable: {gpu_reason()}")
def test_fp8_rows_in_a_captured_decode_graph_on_nvidia(family: str) -> None:
    """nvidia's resolver and copies move the 64-byte fp8 rows, the decode step captured; one layer,
    so the model reading the same rounded latent is exact (see the first generate test)."""
    model: Any = tiny_model(family, shape=replace(NO_TIES[family], layers=1), seed=4, device="cuda")
    ids, mask = random_prompts([150, 201, 97], seed=2)
    ids, mask = ids.cuda(), mask.cuda()
    rows = LatentRows.of("fp8", model.dtype, model.config.kv_lora_rank, model.config.qk_rope_head_dim)
    with model_reads_stored_rows(model, rows):
        theirs = baseline(model, ids, mask, 64, chunk=32)
    kw = enable_kwargs(family, check=False, max_context=512, prefill_chunk=32,
                       gpu_kv_gib=_tight(family, 150, layers=1), kv_rows="fp8", backend="nvidia")
    with hisparse_transformers.enable(model, **kw, cuda_graphs=True) as hs:
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=64, prefill_chunk_size=32, **GEN)
        s = hs.stats()
    got = compare(ours, theirs)
    print(f"{family} fp8 rows on nvidia in a cuda graph against the model reading them: tokens identical "
          f"{got.tokens_equal}, max abs logit diff {got.max_logit_diff:.3g}, misses {s.misses}")
    assert got.tokens_equal and got.max_logit_diff <= 1e-4, got
    assert s.decode_mode == "cuda graph" and s.misses > 0, s


def test_stored_latents_count_each_replay_afresh() -> None:
    """`flips` and `values` are the last replay's: a second replay of the same forwards counts the
    same, not twice as many."""
    model: Any = tiny_model("deepseek_v32", shape=SHAPES["deepseek_v32"], seed=3)
    rows = LatentRows.of("fp8", torch.float32, SHAPES["deepseek_v32"].kv_lora, SHAPES["deepseek_v32"].rope)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    stored = StoredLatents(model, rows)
    with torch.no_grad():
        with stored.record():
            model(ids)
        counts = []
        for _ in range(2):
            with stored.replay():
                model(ids)
            counts.append((stored.flips, stored.values))
    assert counts[0] == counts[1] and counts[0][1] > 0, counts


def test_latent_rows_of_bad_arguments_is_one_line() -> None:
    """LatentRows.of, as docs/transformers.md calls it. Before: a dtype given as a string raised
    AttributeError ('str' object has no attribute 'is_floating_point'), kv_lora_rank=0
    ZeroDivisionError, and qk_rope_head_dim=-1 was taken."""
    for args, words in ((("fp8", "float32", 16, 8), "LatentRows.of got dtype='float32'; expected a torch.dtype"),
                        (("fp8", torch.float32, 0, 8), "LatentRows.of got kv_lora_rank=0; expected an int >= 1"),
                        (("model", torch.float32, 16, -1), "LatentRows.of got qk_rope_head_dim=-1; expected an int"),
                        (("fp8", torch.float32, 16.0, 8), "LatentRows.of got kv_lora_rank=16.0")):
        with pytest.raises(InvalidInputError) as err:
            LatentRows.of(*args)  # type: ignore[arg-type]
        assert "\n" not in str(err.value) and str(err.value).startswith(words), err.value
    assert LatentRows.of("fp8", torch.float32, 16, 8).kind == "fp8"
