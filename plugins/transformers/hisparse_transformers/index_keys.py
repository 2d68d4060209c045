"""How `HiSparseCache` stores the indexer keys (`enable(indexer_keys=...)`).

- "model": as the model computes them, in its dtype (bf16: 2 x index_head_dim bytes a token a
  layer), what transformers' own cache keeps.
- "fp8": as DeepSeek-V3.2 itself stores them: float8 e4m3 values with one fp32 scale per block of
  128 values (one per token at index_head_dim 128: 132 bytes a token a layer). The scale is
  max(|k| over the block, 1e-4) / 448, rounded up to a power of two (ue8m0, the model's `scale_fmt`).
  The indexer scores the keys dequantized (values x scale, in fp32): the model's reference
  `fp8_index` multiplies its fp8 logits by the key's scale after the ReLU, which is the same since
  the scale is positive. The query stays in the model's precision, and the Hadamard rotation the
  reference applies before quantizing is left out, as transformers' port leaves it out.
"""

from __future__ import annotations

import torch

from hisparse_core.errors import InvalidInputError

KEY_FORMATS = ("model", "fp8")
QUANT_BLOCK = 128        # values per scale (DeepSeek-V3.2's indexer quantization block)
FP8_MAX = 448.0          # largest finite float8 e4m3fn
SCALE_FLOOR = 1e-4       # an all-zero block still gets a finite scale


def check_key_format(value: object, name: str = "indexer_keys") -> str:
    """`value` as a key format, or one `InvalidInputError` line naming `name`."""
    if not isinstance(value, str) or value not in KEY_FORMATS:
        raise InvalidInputError(f"{name}={value!r}: expected 'model' (the model's dtype, as transformers keeps the "
                                "indexer keys) or 'fp8' (e4m3 with an fp32 scale per 128 values, as DeepSeek-V3.2 "
                                "stores them)")
    return value


def quant_block(dim: int) -> int:
    """Values per scale for keys of `dim` values: 128, or the whole key where it is shorter."""
    block = min(QUANT_BLOCK, dim)
    if dim % block:
        raise InvalidInputError(f"index_head_dim={dim} is not a multiple of the fp8 quantization block {QUANT_BLOCK}; "
                                "expected indexer_keys='model' for this model")
    return block


def bytes_per_key(fmt: str, dim: int, model_elem: int) -> int:
    """Device bytes of one token's key in one layer (`model_elem`: the model dtype's element size)."""
    if fmt == "model":
        return dim * model_elem
    return dim + 4 * (dim // quant_block(dim))


def quantize_fp8(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys `[..., D]` -> (e4m3 values `[..., D]`, fp32 scales `[..., D / block]`)."""
    dim = keys.shape[-1]
    block = quant_block(dim)
    blocks = keys.float().reshape(*keys.shape[:-1], dim // block, block)
    scale = blocks.abs().amax(dim=-1).clamp(min=SCALE_FLOOR) / FP8_MAX
    scale = torch.exp2(torch.ceil(torch.log2(scale)))
    values = (blocks / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
    return values.reshape(keys.shape), scale


def dequantize_fp8(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(values `[..., D]`, scales `[..., D / block]`) -> fp32 keys `[..., D]`."""
    dim = values.shape[-1]
    n = scales.shape[-1]
    out = values.to(torch.float32, copy=True)   # never the store itself, whatever its dtype
    # in place: a second whole-context fp32 copy would double the step's transient memory
    out.view(*values.shape[:-1], n, dim // n).mul_(scales.unsqueeze(-1))
    return out


__all__ = ["KEY_FORMATS", "bytes_per_key", "check_key_format", "dequantize_fp8", "quant_block", "quantize_fp8"]
