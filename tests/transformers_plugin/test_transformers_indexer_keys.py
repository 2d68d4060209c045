"""`enable(..., indexer_keys="fp8")`: the indexer keys stored as DeepSeek-V3.2 stores them (e4m3,
an fp32 power-of-two scale per 128 values) and scored dequantized. Checked against a
straightforward quantizer and scorer written here (element by element, float64), hisparse against
the same engine all-resident under the same keys, and one-line refusals."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from tf_support import (
    GEN,
    NO_TIES,
    SHAPES,
    compare,
    enable_kwargs,
    gpu_reason,
    random_prompts,
    reference_fp8,
    tight_gpu_gib,
    tiny_model,
)

import hisparse_transformers
from hisparse_core.errors import InvalidInputError
from hisparse_transformers.engine import EngineConfig
from hisparse_transformers.index_keys import bytes_per_key, dequantize_fp8, quantize_fp8

pytest.importorskip("transformers")


@settings(max_examples=12, deadline=None, phases=[Phase.explicit, Phase.generate])
@given(seed=st.integers(0, 2**31 - 1), dim=st.sampled_from([16, 128, 256]), spread=st.floats(1e-3, 1e3))
def test_fp8_keys_match_a_straightforward_quantizer(seed: int, dim: int, spread: float) -> None:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, 5, dim, generator=g) * spread
    keys[0, 1, 3] *= 40.0                     # an outlier: its block's scale, not the others'
    keys[1, 2] = 0.0                          # an all-zero key: the scale floor
    keys = keys.to(torch.bfloat16)            # what the model hands the cache
    values, scales = quantize_fp8(keys)
    assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    ref, ref_scales = reference_fp8(keys, min(128, dim))
    assert torch.equal(scales.double(), ref_scales)
    assert torch.equal(dequantize_fp8(values, scales).double(), ref)
    assert bytes_per_key("fp8", dim, 2) == dim + 4 * (dim // min(128, dim))
    assert bytes_per_key("fp8", 128, 2) == 132 and bytes_per_key("model", 128, 2) == 256


@pytest.fixture(scope="module")
def deepseek() -> torch.nn.Module:
    return tiny_model("deepseek_v32", shape=NO_TIES["deepseek_v32"], seed=5)


def test_fp8_indexer_topk_matches_a_reference_scorer(deepseek: torch.nn.Module) -> None:
    """The model's own indexer over a HiSparseCache with fp8 keys (a prefill of 40 queries, then a
    decode query) against DeepSeek-V3.2's fp8 scoring written out: the key's scale times
    sum over heads of weight x relu(q . e4m3 values), in float64."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb

    model: Any = deepseek
    idx = model.model.layers[0].self_attn.indexer
    cfg = model.config
    b, t = 2, 40
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(b, t + 1, cfg.hidden_size, generator=g)
    q_resid = torch.randn(b, t + 1, cfg.q_lora_rank, generator=g)
    pos = torch.arange(t + 1).expand(b, -1)
    cos, sin = model.model.rotary_emb(hidden, position_ids=pos)
    causal = torch.ones(t + 1, t + 1, dtype=torch.bool).tril().expand(b, -1, -1)
    with hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", check=False, indexer_keys="fp8")) as hs:
        cache = hs.new_cache()
        returned: list[torch.Tensor] = []
        plain = cache.update_indexer

        def spy(keys: torch.Tensor, layer: int) -> torch.Tensor:
            returned.append(plain(keys, layer))
            return returned[-1]

        cache.update_indexer = spy  # type: ignore[method-assign]
        with torch.no_grad():
            ours = [idx(hidden[:, :t], q_resid[:, :t], (cos[:, :t], sin[:, :t]), causal[:, :t, :t], pos[:, :t], cache),
                    idx(hidden[:, t:], q_resid[:, t:], (cos[:, t:], sin[:, t:]), causal[:, t:, :], pos[:, t:], cache)]
            assert cache.indexer_bytes == b * (t + 1) * bytes_per_key("fp8", cfg.index_head_dim, 4)
            # the reference: keys and queries as the model makes them, then quantized and scored here
            k = idx.k_norm(idx.wk(hidden)).unsqueeze(2)
            rope = cfg.qk_rope_head_dim
            k_rot, k_pass = torch.split(k, [rope, cfg.index_head_dim - rope], dim=-1)
            q = idx.wq_b(q_resid).view(b, t + 1, cfg.index_n_heads, cfg.index_head_dim)
            q_rot, q_pass = torch.split(q, [rope, cfg.index_head_dim - rope], dim=-1)
            q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
            keys = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
            q = torch.cat([q_rot, q_pass], dim=-1).double()
            weights = idx.weights_proj(hidden).double() * cfg.index_n_heads ** -0.5
    deq, scales = reference_fp8(keys, min(128, cfg.index_head_dim))
    # the cache handed the indexer exactly the dequantized keys
    assert torch.equal(returned[-1].double(), deq)
    values = deq / scales.repeat_interleave(min(128, cfg.index_head_dim), dim=-1)
    logits = torch.relu(torch.einsum("bshd,btd->bsht", q, values)) * idx.softmax_scale
    ref = torch.einsum("bsh,bsht->bst", weights, logits) * scales[..., 0].unsqueeze(1)
    ref = ref.masked_fill(~causal, float("-inf"))
    got = torch.cat(ours, 1).long()
    assert got.shape[:2] == (b, t + 1)
    compared = 0
    for bi in range(b):
        for s in range(t + 1):
            row = ref[bi, s]
            k_eff = min(idx.index_topk, s + 1)
            kth = row.topk(k_eff).values[-1]
            picked = row[got[bi, s, :k_eff]]
            # every pick is in the reference's top-k, up to float32-vs-float64 noise at the k-th score
            assert bool((picked >= kth - 1e-5 * (1 + kth.abs())).all()), (bi, s)
            assert len(set(got[bi, s, :k_eff].tolist())) == k_eff
            compared += 1
    assert compared == b * (t + 1)


def test_fp8_static_writes_store_what_dynamic_ones_do(deepseek: torch.nn.Module) -> None:
    """A captured decode step's write (static mode: the key at a device position, uint8 views) keeps
    the same bytes and scales as an appended one, and hands back the whole buffer dequantized."""
    model: Any = deepseek
    cfg = model.config
    g = torch.Generator().manual_seed(9)
    keys = torch.randn(2, 9, cfg.index_head_dim, generator=g)
    with hisparse_transformers.enable(deepseek, **enable_kwargs("deepseek_v32", check=False,
                                                                indexer_keys="fp8")) as hs:
        a, b = hs.new_cache(), hs.new_cache()
        whole = a.update_indexer(keys, 0)
        b.update_indexer(keys[:, :8], 0)
        cap = b.static_indexer(torch.tensor([8]), need=9)
        full = b.update_indexer(keys[:, 8:], 0)
        b.static_indexer(None)
        b.static_filled(9)
        assert full.shape == (2, cap, cfg.index_head_dim) and full.dtype == torch.float32
        assert torch.equal(full[:, :9], whole) and torch.equal(whole, dequantize_fp8(*quantize_fp8(keys)))
        assert a.indexer_bytes == b.indexer_bytes == 2 * 9 * bytes_per_key("fp8", cfg.index_head_dim, 4)


def _static_against_dynamic(family: str, device: str, capture: bool) -> tuple[Any, Any, Any]:
    """One generate with fp8 keys through the captured step's static computation (`capture`: a
    CUDA graph; else run eagerly), one through the dynamic path; the key buffers grow mid-decode."""
    model: Any = tiny_model(family, shape=NO_TIES[family], seed=4, device=device)
    ids, mask = random_prompts([150, 201, 97], seed=2)
    ids, mask = ids.to(device), mask.to(device)
    extra = {"backend": "nvidia"} if device == "cuda" else {}
    kw = enable_kwargs(family, check=False, max_context=512, prefill_chunk=32, gpu_kv_gib=tight_gpu_gib(family, 150),
                       indexer_keys="fp8", **extra)
    out, stats = [], []
    for static in (True, False):
        with hisparse_transformers.enable(model, **kw, cuda_graphs=capture if static else False) as hs:
            if device == "cpu":
                hs.graphs.enabled, hs.graphs.capture = static, False
            out.append(model.generate(ids, attention_mask=mask, max_new_tokens=64, prefill_chunk_size=32, **GEN))
            stats.append(hs.stats())
    return out[0], out[1], stats[0]


def test_fp8_static_decode_matches_the_dynamic_one(family: str) -> None:
    static, dynamic, s = _static_against_dynamic(family, "cpu", capture=False)
    got = compare(static, dynamic)
    assert got.tokens_equal and got.max_logit_diff <= 1e-4, got
    assert s.decode_mode == "static eager" and s.misses > 0, s


@pytest.mark.gpu
@pytest.mark.skipif(gpu_reason() is not None, reason=f"nvidia backend unavailable: {gpu_reason()}")
def test_fp8_keys_in_a_captured_decode_graph(family: str) -> None:
    captured, eager, s = _static_against_dynamic(family, "cuda", capture=True)
    got = compare(captured, eager)
    print(f"{family} fp8 indexer keys, cuda graph against eager: tokens identical {got.tokens_equal}, max abs logit "
          f"diff {got.max_logit_diff:.3g}, captures {s.graph_captures}")
    assert got.tokens_equal and got.max_logit_diff <= 1e-4, got
    assert s.decode_mode == "cuda graph" and s.graph_captures == 2 and s.misses > 0, s


@pytest.fixture(scope="module", params=sorted(SHAPES))
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@settings(max_examples=2, deadline=None, phases=[Phase.explicit, Phase.generate])
@given(seed=st.integers(0, 2**31 - 1), lengths=st.lists(st.integers(95, 115), min_size=3, max_size=3))
def test_hisparse_equals_all_resident_under_fp8_keys(family: str, seed: int, lengths: list[int]) -> None:
    """The same engine offloading (a budget that releases pages: misses read back from host) and
    all-resident (every page on the GPU), both with fp8 keys: bit-identical logits, and the checker
    (top-k against the model's indexer over fp8 keys, every row read) passes in both."""
    model: Any = tiny_model(family, shape=SHAPES[family], seed=seed % 1000)
    ids, mask = random_prompts(lengths, seed=seed % 10_000)
    out, stats = [], []
    for gib in (enable_kwargs(family)["gpu_kv_gib"], 1e-2):
        with hisparse_transformers.enable(model, **enable_kwargs(family, gpu_kv_gib=gib, indexer_keys="fp8")) as hs:
            out.append(model.generate(ids, attention_mask=mask, max_new_tokens=10, prefill_chunk_size=8, **GEN))
            stats.append(hs.stats())
    offloaded, resident = stats
    assert offloaded.released_pages > 0 and offloaded.misses > 0 and resident.released_pages == 0
    assert offloaded.checked_entries > 0 and offloaded.checked_max_abs_diff == 0.0 and offloaded.checked_topk_queries > 0
    assert torch.equal(out[0].sequences, out[1].sequences)
    for x, y in zip(out[0].logits, out[1].logits, strict=True):
        assert torch.equal(x, y)
    # the keys on the device: e4m3 + a scale a token, against the model's fp32 (tiny models)
    dim = model.config.index_head_dim
    ratio = offloaded.indexer_bytes_per_request / (max(m + 10 for m in lengths) * dim * 4 * _indexer_layers(model))
    assert ratio == pytest.approx(bytes_per_key("fp8", dim, 4) / (dim * 4), rel=0.05)


def _indexer_layers(model: Any) -> int:
    return sum(1 for layer in model.model.layers if getattr(layer.self_attn, "indexer", None) is not None)


@pytest.mark.parametrize("value", ["fp4", "", "FP8", None, 8])
def test_bad_indexer_keys_are_one_line(value: Any) -> None:
    model: Any = tiny_model("deepseek_v32", shape=SHAPES["deepseek_v32"], seed=1)
    with pytest.raises(InvalidInputError) as info:
        hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", indexer_keys=value))
    msg = str(info.value)
    assert "\n" not in msg and f"indexer_keys={value!r}" in msg and "'fp8'" in msg, msg
    assert "generate" not in model.__dict__ and getattr(model, "_hisparse_handle", None) is None
    with pytest.raises(InvalidInputError, match="indexer_keys="):
        EngineConfig(host_pool_gib=1.0, gpu_kv_gib=1.0, indexer_keys=value)
