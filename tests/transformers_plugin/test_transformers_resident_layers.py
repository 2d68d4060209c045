"""`enable(..., resident_layers=...)`: the listed layers keep their whole KV on the GPU (a store by
position, taken from the budget) and never resolve through a hot buffer; the outputs equal the
model's own and hisparse's without them; bad lists are one line naming the option."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from tf_support import BLOCK, GEN, SHAPES, baseline, compare, enable_kwargs, gpu_reason, random_prompts, tiny_model

import hisparse_transformers
from hisparse_core.errors import CapacityError, InvalidInputError

pytest.importorskip("transformers")

#: the first index group of each tiny model (DeepSeek-V3.2: a layer each; GLM-5: a full layer and its follower)
FIRST_GROUP = {"deepseek_v32": [0], "glm_moe_dsa": [0, 1]}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def model(family: str) -> torch.nn.Module:
    return tiny_model(family, shape=SHAPES[family], seed=11)


def _with_store(family: str, layers: int) -> float:
    """The tight budget (66 pages) of the other layers plus the stores of `layers` resident layers
    (max_batch x max_context rows each): pages are still released and read back through the hot buffer."""
    kw = enable_kwargs(family)
    s = SHAPES[family]
    row = (s.kv_lora + s.rope) * 4
    return (66 * (s.layers - layers) * BLOCK * row + layers * kw["max_batch"] * kw["max_context"] * row) / 2**30


def _resolves(engine: Any) -> dict[int, int]:
    """Spy every runtime's resolve: calls per index group (a resident group has no runtime)."""
    calls: dict[int, int] = {}
    for g, runtime in enumerate(engine.runtimes):
        if runtime is None:
            continue
        resolve = runtime.resolve

        def spy(inputs: Any, _g: int = g, _r: Any = resolve, **kw: Any) -> Any:
            calls[_g] = calls.get(_g, 0) + 1
            return _r(inputs, **kw)

        runtime.resolve = spy
    return calls


def _generate(model: torch.nn.Module, family: str, ids: torch.Tensor, mask: torch.Tensor, new: int,
              **over: Any) -> tuple[Any, Any, dict[int, int], Any]:
    with hisparse_transformers.enable(model, **enable_kwargs(family, **over)) as hs:
        calls = _resolves(hs.engine)
        gen: Any = model.generate       # a transformers model (typed as a Module here)
        out = gen(ids, attention_mask=mask, max_new_tokens=new, prefill_chunk_size=8, **GEN)
        return out, hs.stats(), calls, hs.engine


@settings(max_examples=3, deadline=None, phases=[Phase.explicit, Phase.generate])
@given(seed=st.integers(0, 2**31 - 1), lengths=st.lists(st.integers(95, 115), min_size=3, max_size=3))
def test_outputs_equal_with_and_without_resident_layers(family: str, model: torch.nn.Module, seed: int,
                                                        lengths: list[int]) -> None:
    ids, mask = random_prompts(lengths, seed=seed % 10_000)
    new = 12
    plain, s0, _, engine0 = _generate(model, family, ids, mask, new)
    groups = engine0.layout.groups
    layers = list(groups[0])                       # the first index group, whole
    kept, s1, calls, engine1 = _generate(model, family, ids, mask, new, resident_layers=layers,
                                         gpu_kv_gib=_with_store(family, len(layers)))
    theirs = baseline(model, ids, mask, new, 8)
    # differential: bit-identical logits with and without (the same rows in the same order), and
    # the model's own tokens
    assert torch.equal(kept.sequences, plain.sequences)
    for a, b in zip(kept.logits, plain.logits, strict=True):
        assert torch.equal(a, b)
    c = compare(kept, theirs)
    assert c.tokens_equal, c
    # residency honoured: group 0 never resolved, the others did; the checker saw every row
    assert 0 not in calls and all(calls.get(g, 0) > 0 for g in range(1, len(groups)))
    assert engine1.runtimes[0] is None and s1.resident_layers == tuple(layers)
    assert s1.checked_entries > 0 and s1.checked_max_abs_diff == 0.0
    # lookups through the hisparse runtimes: only the other groups' (fewer than without); pages
    # were still released and read back through their hot buffers
    assert s1.resident + s1.hits + s1.misses < s0.resident + s0.hits + s0.misses
    assert s1.misses > 0 and s1.released_pages > 0


def test_budget_counts_the_resident_store(family: str, model: torch.nn.Module) -> None:
    shape = SHAPES[family]
    first = FIRST_GROUP[family]
    kw = enable_kwargs(family, gpu_kv_gib=_with_store(family, len(first)))
    budget = int(kw["gpu_kv_gib"] * 2**30)
    with hisparse_transformers.enable(model, **kw) as hs:
        assert [list(g) for g in hs.engine.layout.groups][0] == first
        plain_blocks, row = hs.engine.gpu_blocks, hs.engine.fmt.row_bytes
    with hisparse_transformers.enable(model, **{**kw, "resident_layers": ",".join(map(str, first))}) as hs:
        e = hs.engine
        store = len(first) * kw["max_batch"] * kw["max_context"] * row
        assert e.resident_bytes == store and hs.stats().resident_store_bytes == store
        assert e.block_bytes == (shape.layers - len(first)) * BLOCK * row
        assert e.gpu_blocks == (budget - store) // e.block_bytes
        assert all(t.shape == (kw["max_batch"] * kw["max_context"], e.fmt.width) for t in e.device_layers[0])
        assert e.coordinator.config.num_layers == shape.layers - len(first)
    assert plain_blocks == budget // (shape.layers * BLOCK * row)


@pytest.mark.parametrize("spec, words", [
    ("5", "resident_layers='5': resident layers [5] out of range"),
    ([0, 0], "repeat a layer"),
    ("a,b", "resident_layers='a,b'"),
    ("0,1,2", "keeps all"),
    (None, "resident_layers=None: resident layers None: expected a sequence of layer indices"),  # a TypeError before
    (0, "resident_layers=0: resident layers 0: expected a sequence of layer indices"),
])
def test_bad_resident_layers_are_one_line(family: str, model: torch.nn.Module, spec: Any, words: str) -> None:
    layers = SHAPES[family].layers
    if words == "keeps all":
        spec = ",".join(str(i) for i in range(layers))
    with pytest.raises(InvalidInputError) as info:
        hisparse_transformers.enable(model, **enable_kwargs(family, resident_layers=spec))
    msg = str(info.value)
    assert "\n" not in msg and "resident_layers=" in msg and words in msg
    handle = getattr(model, "_hisparse_handle", None)
    assert handle is None or handle.closed  # nothing left enabled


def test_glm_group_split_is_refused() -> None:
    m = tiny_model("glm_moe_dsa", shape=SHAPES["glm_moe_dsa"], seed=2)
    with pytest.raises(InvalidInputError, match=r"resident_layers=\[0\] splits index group \[0, 1\]"):
        hisparse_transformers.enable(m, **enable_kwargs("glm_moe_dsa", resident_layers=[0]))


def test_store_larger_than_the_budget_is_refused(family: str, model: torch.nn.Module) -> None:
    first = FIRST_GROUP[family]
    kw = enable_kwargs(family, resident_layers=first, max_context=4096)
    with pytest.raises(CapacityError, match=rf"^resident_layers={first} keep \d+ B on the GPU".replace("[", r"\[")) as err:
        hisparse_transformers.enable(model, **kw)
    # the budget it names fits (before: "expected gpu_kv_gib > <the stores> plus the hot buffers' pool", no figure)
    fits = re.search(r"expected gpu_kv_gib >= ([0-9.e-]+) ", str(err.value))
    assert fits is not None, str(err.value)
    hisparse_transformers.enable(model, **dict(kw, gpu_kv_gib=float(fits.group(1)))).close()


@pytest.mark.gpu
@pytest.mark.skipif(gpu_reason() is not None, reason=f"nvidia backend unavailable: {gpu_reason()}")
def test_resident_layers_in_the_captured_decode_graph() -> None:
    """On the GPU, decode steps replayed from one CUDA graph: the resident group's rows (its store
    rows and masks come from the step tensors the graph refreshes) give the same logits as without."""
    family = "deepseek_v32"
    m: Any = tiny_model(family, shape=SHAPES[family], seed=11, device="cuda")
    m.set_experts_implementation("batched_mm")   # float32 grouped_mm reads its offsets on the host
    ids, mask = random_prompts([97, 110, 103], seed=3)
    ids, mask = ids.cuda(), mask.cuda()
    outs = []
    for extra in ({}, {"resident_layers": [0], "gpu_kv_gib": _with_store(family, 1)}):
        kw = enable_kwargs(family, backend="nvidia", check=False, cuda_graphs=True, **extra)
        with hisparse_transformers.enable(m, **kw) as hs:
            gen: Any = m.generate
            outs.append(gen(ids, attention_mask=mask, max_new_tokens=12, prefill_chunk_size=8, **GEN))
            s = hs.stats()
            assert s.decode_mode == "cuda graph" and s.misses > 0, s
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    for a, b in zip(outs[0].logits, outs[1].logits, strict=True):
        assert torch.equal(a, b)
