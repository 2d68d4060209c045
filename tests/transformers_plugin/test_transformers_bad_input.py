"""Bad input to `enable`: one clear line naming the value and what was expected; nothing patched,
nothing allocated."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tf_support import SHAPES, enable_kwargs, tiny_model  # noqa: E402

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


def test_right_padding_and_too_many_prompts(model: torch.nn.Module) -> None:
    with hisparse_transformers.enable(model, **enable_kwargs("deepseek_v32", gpu_kv_gib=1e-3)):
        ids = torch.randint(2, 100, (2, 6))
        right = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
        with pytest.raises(InvalidInputError, match="row 1 is \\[1, 1, 1, 1, 0, 0\\]; expected left padding"):
            model.generate(ids, attention_mask=right, max_new_tokens=2)
        with pytest.raises(CapacityError, match="batch of 4 prompts; expected 1 to max_batch=3"):
            model.generate(torch.randint(2, 100, (4, 6)), max_new_tokens=2)
        out = model.generate(ids, max_new_tokens=2, do_sample=False)      # still usable
        assert out.shape == (2, 8)
