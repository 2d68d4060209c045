"""A model whose layers sit on several devices (`device_map`, dispatched by accelerate as
`from_pretrained(device_map=...)` does) decodes through hisparse, exact against its own generate.

The devices are indices of `strict_device` (CPU memory behind a device that refuses a CPU tensor
mixed in, and a tensor of another index, as CUDA does): any table, index or row that hisparse
left on the wrong device fails the run. Each device gets its own worker (`StrictDeviceBackend(i)`):
its layers' caches, tables and host pool.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strict_device import StrictDeviceBackend, memory_of, strict
from tf_support import BLOCK, GEN, SHAPES, baseline, compare, enable_kwargs, random_prompts, tiny_model

import hisparse_transformers
from hisparse_core.errors import InvalidInputError

pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate", reason="device_map needs accelerate (pip install 'hisparse[transformers]')")

#: Layer -> device index: DeepSeek-V3.2's 2 layers one per device; GLM-5's index group (layers 0-1,
#: layer 1 a follower) on device 0, its full layer 2 on device 1.
SPLITS = {"deepseek_v32": [0, 1], "glm_moe_dsa": [0, 0, 1]}
#: Two requests whose 47 pages and 2 hot buffers overflow the smallest pool of max_batch=2 (40
#: blocks): pages are released, lost, and read back from the host pool, on both devices. The
#: checker is off (it triples the time on the strict devices); exactness is the logits'.
LENGTHS = [100, 80]
NEW = 8
SIZES = dict(max_batch=2, check=False)


def dispatched(family: str, layers: list[int], *, head: int = 0, tail: int = 1) -> torch.nn.Module:
    model = tiny_model(family, shape=SHAPES[family], seed=3)
    model.config._experts_implementation = "eager"  # grouped_mm's histc takes the CPU path only on device "cpu"
    device_map = {"model.embed_tokens": head, "model.rotary_emb": head, "model.norm": tail, "lm_head": tail}
    device_map.update({f"model.layers.{i}": d for i, d in enumerate(layers)})
    return accelerate.dispatch_model(model, device_map={k: strict(v) for k, v in device_map.items()})


def _tight(family: str, layers: list[int], blocks: int = 40) -> float:
    """A per-device GPU budget of `blocks` pages of the device with the most layers."""
    s = SHAPES[family]
    widest = max(layers.count(d) for d in set(layers))
    return blocks * widest * BLOCK * (s.kv_lora + s.rope) * 4 / 2**30


@pytest.mark.parametrize("family", sorted(SPLITS))
def test_device_map_decodes_exactly_with_each_layer_on_its_device(family: str, caplog: pytest.LogCaptureFixture
                                                                   ) -> None:
    """Against the model's own generate on the CPU: the same weights and kernels as the placed model's
    own (the strict devices compute on CPU memory), at a fraction of its time."""
    from hisparse_transformers.attention import HiSparseAttention

    layers = SPLITS[family]
    model = dispatched(family, layers)
    cpu = tiny_model(family, shape=SHAPES[family], seed=3)
    ids, mask = random_prompts(LENGTHS, seed=1)
    theirs = baseline(cpu, ids, mask, NEW, chunk=8)
    dev_ids, dev_mask = ids.to(strict(0)), mask.to(strict(0))
    caplog.set_level(logging.INFO, logger="hisparse_transformers")
    with hisparse_transformers.enable(model, **enable_kwargs(family, backend=StrictDeviceBackend(0), **SIZES,
                                                             gpu_kv_gib=_tight(family, layers))) as hs:
        e = hs.engine
        assert e.placement.devices == (strict(0), strict(1)) and len(e.workers) == 2
        for g, group in enumerate(e.layout.groups):
            dev = strict(layers[group[0]])
            assert all(t.device == dev for t in (*e.tables_of(g), *e.device_layers[g]))
            assert e.runtimes[g].device == dev
        ours = model.generate(dev_ids, attention_mask=dev_mask, max_new_tokens=NEW, **GEN)
        ours.sequences = memory_of(ours.sequences)
        ours.logits = tuple(memory_of(x) for x in ours.logits)
        s = hs.stats()
        # accelerate hooked the attention modules (its hook moves their inputs): hisparse took the
        # place of the forward the hook calls, and gives it back at close.
        assert isinstance(model.model.layers[-1].self_attn.__dict__.get("_old_forward"), HiSparseAttention)
        # The per-device pools hold each device's layers: together, one pool of every layer.
        assert s.host_pool_bytes == sum(w.host_pool_spec.nbytes for w in e.workers)
        assert [w.host_pool_spec.num_layers for w in e.workers] == [layers.count(0), layers.count(1)]
    assert not isinstance(model.model.layers[-1].self_attn.__dict__.get("_old_forward"), HiSparseAttention)
    got = compare(ours, theirs)
    assert got.tokens_equal and got.max_logit_diff <= 1e-4, got
    assert s.misses > 0 and s.hits > 0 and s.lost_pages > 0, s      # pages came back from host
    assert s.device == "privateuseone:0, privateuseone:1" and s.decode_mode.startswith("eager (the attention layers")
    assert any("sit on 2 devices" in r.message and "each device's budget" in r.message for r in caplog.records)


def test_a_follower_away_from_its_leader_is_refused_naming_both() -> None:
    from hisparse_transformers.attention import HiSparseAttention

    model = dispatched("glm_moe_dsa", [0, 1, 1])
    with pytest.raises(InvalidInputError) as err:
        hisparse_transformers.enable(model, **enable_kwargs("glm_moe_dsa", backend=StrictDeviceBackend(0)))
    text = str(err.value)
    assert "\n" not in text
    assert "layer 1 reuses the top-k of layer 0" in text and "privateuseone:1" in text and "privateuseone:0" in text
    assert "layers 0-1 on one device" in text
    attn = model.model.layers[0].self_attn.__dict__
    assert not any(isinstance(attn.get(k), HiSparseAttention) for k in ("forward", "_old_forward"))
    assert "generate" not in model.__dict__


def test_a_backend_that_runs_on_one_device_only_is_refused() -> None:
    model = dispatched("deepseek_v32", [0, 1])
    with pytest.raises(InvalidInputError, match=r"sit on privateuseone:0 \(among others\), but "
                                                r"backend 'reference_cpu' runs on cpu only"):
        hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", backend="reference_cpu"))


def test_resident_layers_on_a_spread_model_are_refused_before_any_backend() -> None:
    model = dispatched("deepseek_v32", [0, 1])
    with pytest.raises(InvalidInputError, match=r"^resident_layers=\[0\] runs on one device and one rank; "
                                                r"expected a model on one device, or resident_layers=\(\)$"):
        hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", backend=StrictDeviceBackend(0),
                                                            resident_layers=[0]))
    assert "generate" not in model.__dict__


def test_the_placed_models_own_generate_is_the_cpus() -> None:
    """What the test above leans on: placed over two strict devices, the model's own generate
    gives the CPU's tokens and logits, bit for bit (with the same experts implementation; the
    test above compares with the CPU's default one, within 1e-4)."""
    model = dispatched("deepseek_v32", SPLITS["deepseek_v32"])
    cpu = tiny_model("deepseek_v32", shape=SHAPES["deepseek_v32"], seed=3)
    cpu.config._experts_implementation = "eager"           # as the placed model's MoE runs
    ids, mask = random_prompts([9, 14], seed=2)
    theirs = baseline(model, ids.to(strict(0)), mask.to(strict(0)), 3, chunk=8)
    want = baseline(cpu, ids, mask, 3, chunk=8)
    assert torch.equal(memory_of(theirs.sequences), want.sequences)
    assert all(torch.equal(memory_of(a), b) for a, b in zip(theirs.logits, want.logits, strict=True))


@settings(max_examples=40, deadline=None)
@given(workers=st.integers(1, 4), data=st.data())
def test_merged_reports_count_every_worker(workers: int, data: st.DataObject) -> None:
    """Transfers sum over the workers' reports; a host block copy is reported once, in the merge
    where its last worker reported it (never earlier), whatever the order the workers report in."""
    from hisparse_core.types import WorkerMetadata
    from hisparse_transformers.shards import ReportMerger

    copies = data.draw(st.lists(st.integers(0, 50), unique=True, max_size=6))
    ids = data.draw(st.lists(st.integers(0, 50), unique=True, max_size=6))
    # Each worker reports each copy and transfer in one of 3 rounds.
    when = {(w, c): data.draw(st.integers(0, 2)) for w in range(workers) for c in copies + [-1 - i for i in ids]}
    merger = ReportMerger(workers)
    seen: list[int] = []
    counts: dict[int, int] = {}
    for round_ in range(3):
        reports = [WorkerMetadata.report(completed=[i for i in ids if when[(w, -1 - i)] == round_],
                                         completed_host_copies=[c for c in copies if when[(w, c)] == round_])
                   for w in range(workers)]
        merged = merger.merge(reports)
        for c in merged.completed_host_copies:
            assert max(when[(w, c)] for w in range(workers)) == round_
        seen.extend(merged.completed_host_copies)
        for i, n in merged.completed.items():
            counts[i] = counts.get(i, 0) + n
    assert sorted(seen) == sorted(copies)
    assert counts == dict.fromkeys(ids, workers)


def test_offloaded_attention_layers_are_refused() -> None:
    from hisparse_transformers.shards import place

    class Proj:
        weight = torch.empty(2, 2, device="meta")

    class Attention:
        kv_a_proj_with_mqa = Proj()

    with pytest.raises(InvalidInputError, match=r"layer 0's attention weights are offloaded \(kv_a_proj_with_mqa"):
        place([Attention()], [(0,)])


def test_disk_offloaded_attention_is_refused_though_its_hook_says_cpu() -> None:
    """accelerate's disk (or CPU) offload: the layer's hook executes on "cpu", while the weights it
    loads at each forward are meta placeholders until then (kv_b_proj's, here)."""
    from types import SimpleNamespace

    from hisparse_transformers.shards import place

    class Attention(torch.nn.Module):
        def __init__(self, offloaded: bool) -> None:
            super().__init__()
            self.kv_a_proj_with_mqa = torch.nn.Linear(2, 2)
            self.kv_b_proj = torch.nn.Linear(2, 2, device="meta" if offloaded else "cpu")
            self._hf_hook = SimpleNamespace(execution_device="cpu")

    assert place([Attention(False), Attention(False)], [(0,), (1,)]).devices == (torch.device("cpu"),)
    with pytest.raises(InvalidInputError) as err:
        place([Attention(False), Attention(True)], [(0,), (1,)])
    assert str(err.value).startswith("layer 1's attention weights are offloaded (kv_b_proj.weight is on meta)")


def test_a_disk_offloaded_layer_of_a_real_model_is_refused_by_enable(tmp_path: object) -> None:
    """accelerate's `dispatch_model` with layer 1 on "disk": its attention's hook executes on the
    CPU while the weights are meta until a forward loads them. `enable` refuses it before
    anything runs (it used to accept it, and the first generate failed inside the attention)."""
    pytest.importorskip("accelerate")
    from accelerate import dispatch_model

    model = tiny_model("deepseek_v32", shape=SHAPES["deepseek_v32"], seed=3)
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu",
                  "model.rotary_emb": "cpu", "lm_head": "cpu"}
    model = dispatch_model(model, device_map=device_map, offload_dir=str(tmp_path))
    with pytest.raises(InvalidInputError) as err:
        hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32"))
    text = str(err.value)
    assert text.startswith("layer 1's attention weights are offloaded (") and "is on meta)" in text
    assert "\n" not in text and "generate" not in model.__dict__


def test_the_strict_device_refuses_two_indices_as_cuda_does() -> None:
    a = torch.arange(6, dtype=torch.float32, device=strict(0))
    b = torch.ones(6, device=strict(1))
    for op in (lambda: a + b, lambda: a[torch.tensor([1, 2], device=strict(1))],
               lambda: a + torch.tensor(1.0, device=strict(1))):          # 0-dim too: only CPU scalars pass
        with pytest.raises(RuntimeError, match=r"Expected all tensors to be on the same device, but found at least "
                                               r"two devices, privateuseone:0 and privateuseone:1"):
            op()
    moved = a.to(strict(1))                                                # copies between indices are allowed
    assert moved.device == strict(1) and (moved + b).device == strict(1)
    assert torch.equal(memory_of(moved + b), torch.arange(6, dtype=torch.float32) + 1)
    assert (a + torch.tensor(2.0)).device == strict(0)                     # a CPU scalar, as on CUDA


@pytest.mark.parametrize("family", sorted(SPLITS))
def test_assisted_generation_with_the_layers_on_two_devices(family: str) -> None:
    """Prompt lookup (verification steps resolved as one union, then rolled back) on a model spread
    over two devices: each device's runtimes take the union's rows, the union counters add across
    devices, and the tokens are the model's own greedy decoding."""
    from test_transformers_assisted import ASSISTED, prompts, tight_kwargs

    layers = SPLITS[family]
    model = tiny_model(family, shape=ASSISTED[family], seed=3)
    model.config._experts_implementation = "eager"
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 1, "lm_head": 1}
    device_map.update({f"model.layers.{i}": d for i, d in enumerate(layers)})
    cpu = tiny_model(family, shape=ASSISTED[family], seed=3)
    prompt = prompts()[0]
    want = cpu.generate(prompt, max_new_tokens=NEW, do_sample=False)
    model = accelerate.dispatch_model(model, device_map={k: strict(v) for k, v in device_map.items()})
    with hisparse_transformers.enable(model, **tight_kwargs(family, 3, check=False,
                                                            backend=StrictDeviceBackend(0))) as hs:
        assert len(hs.engine.workers) == 2
        got = model.generate(prompt.to(strict(0)), max_new_tokens=NEW, do_sample=False, prompt_lookup_num_tokens=3)
        s = hs.stats()
    assert torch.equal(memory_of(got), want)
    assert s.verify_steps > 0 and s.union_entries > 0 and s.rollbacks > 0, s
