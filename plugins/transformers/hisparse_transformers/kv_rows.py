"""How the engine stores a layer's latent rows, on the GPU and in the host pool (`enable(kv_rows=...)`).

- "model": `kv_lora_rank + qk_rope_head_dim` values in the model's dtype, padded to 16 bytes: what
  transformers' own cache keeps (1,152 B a token a layer at DeepSeek-V3.2's geometry in bf16).
- "fp8": DeepSeek-V3.2's serving format (FlashMLA's `fp8_ds_mla`, what vLLM and SGLang store and
  move): the normed latent as float8 e4m3 values with one fp32 power-of-two scale per 128 values
  (`index_keys.quantize_fp8`, DeepSeek's ue8m0 rule), then the roped part in the model's dtype, as
  bytes, padded to 16. In bf16 at DeepSeek-V3.2's geometry that is exactly `fp8_ds_mla`'s 656 B:
  512 values, 4 scales, 64 bf16 rope values. Every host-to-device copy moves 57% of the bytes.

Attention reads the rows dequantized (values x scale, exact in bf16, fp16 and fp32: a 3-bit
mantissa times a power of two). What the model itself computes from such rows is its own forward
with the normed latent rounded the same way (`model_reads_stored_rows`): the reference an fp8 run
is exact against wherever both round the same values. Past the first layer the model and hisparse
compute the latent about 1e-7 apart, which now and then puts a value on the other side of an e4m3
rounding boundary; `StoredLatents` has the model read exactly the values hisparse stored, for a
comparison those flips cannot touch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from hisparse_core.errors import InvalidInputError
from hisparse_core.geometry import FP8_DS_MLA, RowFormat, register_row_format
from hisparse_transformers.index_keys import FP8_MAX, QUANT_BLOCK, SCALE_FLOOR, quant_block, quantize_fp8

ROW_KINDS = ("model", "fp8")


def check_row_kind(value: object, name: str = "kv_rows") -> str:
    """`value` as a row kind, or one `InvalidInputError` line naming `name`."""
    if not isinstance(value, str) or value not in ROW_KINDS:
        raise InvalidInputError(f"{name}={value!r}: expected 'model' (the latent rows in the model's dtype, as "
                                "transformers keeps them) or 'fp8' (e4m3 with an fp32 scale per 128 values and the "
                                "roped part in the model's dtype: DeepSeek-V3.2's fp8_ds_mla, 656 B in bf16)")
    return value


def _pad16(n: int) -> int:
    return -(-n // 16) * 16


def row_format_for(dtype: torch.dtype, width: int) -> RowFormat:
    """The registered row format of a latent row of `width` values of `dtype`, padded to 16 bytes."""
    size = dtype.itemsize
    per16 = 16 // size if 16 % size == 0 else 16
    padded = -(-width // per16) * per16
    name = f"hf_mla_{str(dtype).removeprefix('torch.')}_{width}" + (f"_pad{padded}" if padded != width else "")
    return register_row_format(RowFormat(name, dtype, padded))


@dataclass(frozen=True, slots=True)
class LatentRows:
    """The stored form of one token's latent row: how it is written, read, and sized.

    `encode` takes the rows the model would hand its cache (`[..., lora + rope]`, the normed
    latent then the roped key) and returns what the stores hold (`[..., fmt.width]` of
    `fmt.dtype`); `decode` returns `[..., lora + rope]` in the model's dtype (for "model" the
    stored row itself, padding included, never copied).
    """

    kind: str
    dtype: torch.dtype
    lora: int
    rope: int
    fmt: RowFormat

    @classmethod
    def of(cls, kind: str, dtype: torch.dtype, lora: int, rope: int) -> LatentRows:
        check_row_kind(kind)
        if not isinstance(dtype, torch.dtype):
            raise InvalidInputError(f"LatentRows.of got dtype={dtype!r}; expected a torch.dtype (model.dtype)")
        for name, value in (("kv_lora_rank", lora), ("qk_rope_head_dim", rope)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInputError(f"LatentRows.of got {name}={value!r}; expected an int >= 1 (the model "
                                        f"config's {name})")
        if not dtype.is_floating_point or dtype.itemsize < 2:
            # an fp8 (quantized) checkpoint: its latent is computed in another dtype than these weights',
            # and stored in theirs it would lose its scale
            raise InvalidInputError(f"kv_rows={kind!r} with a model whose kv_a_proj_with_mqa weights are "
                                    f"{str(dtype).removeprefix('torch.')}: expected weights in bfloat16, float16 or "
                                    "float32 (hisparse stores the latent in their dtype; load a quantized checkpoint "
                                    "dequantized, e.g. with dtype=torch.bfloat16)")
        if kind == "model":
            return cls(kind, dtype, lora, rope, row_format_for(dtype, lora + rope))
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise InvalidInputError(f"kv_rows='fp8' with a {str(dtype).removeprefix('torch.')} model: expected "
                                    "bfloat16, float16 or float32 (the roped part is stored in the model's dtype, "
                                    "the latent read back in it); use kv_rows='model' for this model")
        elem = dtype.itemsize
        if lora % 4:
            raise InvalidInputError(f"kv_rows='fp8' with kv_lora_rank={lora}: expected a multiple of 4 (the scales "
                                    "follow the values as fp32 words); use kv_rows='model' for this model")
        if lora > QUANT_BLOCK and lora % QUANT_BLOCK:
            # (quant_block's own refusal names the indexer keys' index_head_dim)
            raise InvalidInputError(f"kv_rows='fp8' with kv_lora_rank={lora}: expected a multiple of the fp8 "
                                    f"quantization block {QUANT_BLOCK} (one scale per {QUANT_BLOCK} values), or at "
                                    "most one block; use kv_rows='model' for this model")
        used = lora + 4 * (lora // quant_block(lora)) + rope * elem
        if (dtype, lora, rope) == (torch.bfloat16, 512, 64):
            fmt = FP8_DS_MLA
        else:
            name = f"hf_mla_fp8_{lora}_{str(dtype).removeprefix('torch.')}_{rope}"
            fmt = register_row_format(RowFormat(name + (f"_pad{_pad16(used)}" if _pad16(used) != used else ""),
                                                torch.uint8, _pad16(used)))
        assert fmt.row_bytes == _pad16(used)
        return cls(kind, dtype, lora, rope, fmt)

    @property
    def scales(self) -> int:
        return self.lora // quant_block(self.lora)

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows `[..., lora + rope]` -> their stored form `[..., fmt.width]` (a new tensor)."""
        if self.kind == "model":
            out = rows.new_zeros((*rows.shape[:-1], self.fmt.width), dtype=self.dtype)
            out[..., :rows.shape[-1]] = rows
            return out
        values, scales = quantize_fp8(rows[..., :self.lora])
        rope = rows[..., self.lora:].to(self.dtype).contiguous()
        parts = [values.view(torch.uint8), scales.contiguous().view(torch.uint8), rope.view(torch.uint8)]
        pad = self.fmt.width - sum(p.shape[-1] for p in parts)
        if pad:
            parts.append(rows.new_zeros((*rows.shape[:-1], pad), dtype=torch.uint8))
        return torch.cat(parts, dim=-1)

    def store(self, flat: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor) -> None:
        """Write `rows` `[n, lora + rope]` into the store `flat` `[N, fmt.width]` at rows `dst`, in
        their stored form ("model": in place, the padding left as it is, no padded copy made)."""
        if self.kind == "model":
            flat[dst, :rows.shape[-1]] = rows.to(flat.dtype)
        else:
            flat[dst] = self.encode(rows)

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        """Stored rows `[..., fmt.width]` -> `[..., lora + rope]` in the model's dtype ("model": the
        stored tensor itself, its padding included)."""
        if self.kind == "model":
            return stored
        lora, n = self.lora, self.scales
        values = stored[..., :lora].view(torch.float8_e4m3fn)
        scales = stored[..., lora:lora + 4 * n].view(torch.float32)
        elem = self.dtype.itemsize     # no tensor made: this runs each layer of each decode step
        start = lora + 4 * n
        rope = stored[..., start:start + self.rope * elem].view(self.dtype)
        out = torch.empty((*stored.shape[:-1], lora + self.rope), dtype=self.dtype, device=stored.device)
        # e4m3 x a power of two is exact in bf16, fp16 and fp32, so the product in the model's
        # dtype is the fp32 dequantization rounded once: the same bits either way. In place: no
        # temporary the size of the rows (a prefill gathers [B, S, K] of them)
        out[..., :lora] = values
        out[..., :lora].unflatten(-1, (n, lora // n)).mul_(scales.to(self.dtype).unsqueeze(-1))
        out[..., lora:] = rope
        return out

    def round_latent(self, latent: torch.Tensor) -> torch.Tensor:
        """The normed latent `[..., lora]` as attention reads it back from the stores (its dtype kept)."""
        if self.kind == "model":
            return latent
        values, scales = quantize_fp8(latent)
        n = scales.shape[-1]
        dt = latent.dtype
        return (values.to(dt).unflatten(-1, (n, -1)) * scales.to(dt).unsqueeze(-1)).flatten(-2)

    def error_bound(self, latent: torch.Tensor) -> torch.Tensor:
        """Per value of `latent` `[..., lora + rope]` (float64): how far its stored form may read
        from it. e4m3 rounds to half a step: at most 2^-4 of a normal value, 2^-10 of the scale for
        a subnormal one, and twice the latter, since a block whose largest value sits at a scale's
        edge may take the next scale where the same row is recomputed with float noise (a prefix
        hit). The roped part is stored in the model's dtype: 0."""
        out = torch.zeros_like(latent, dtype=torch.float64)
        if self.kind == "model":
            return out
        part = latent[..., :self.lora].to(torch.float64)
        blocks = part.unflatten(-1, (self.scales, -1))
        scale = blocks.abs().amax(-1, keepdim=True).clamp(min=SCALE_FLOOR) / FP8_MAX
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
        out[..., :self.lora] = (2.0 ** -4 * blocks.abs() + 2.0 ** -9 * scale).flatten(-2)
        return out


@contextmanager
def model_reads_stored_rows(model: Any, rows: LatentRows) -> Iterator[None]:
    """While open, the model's own attention layers see the normed latent as `rows` stores it (each
    `kv_a_layernorm` output rounded by `rows.round_latent`): the reference a `kv_rows="fp8"` run is
    exact against (the roped part is stored in the model's dtype, unchanged). A no-op for "model"."""
    def hook(_module: Any, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return rows.round_latent(output)

    with _hooked(_latent_norms(model) if rows.kind != "model" else [], lambda _i: hook):
        yield


@contextmanager
def _hooked(modules: list[Any], hook_for: Any) -> Iterator[None]:
    """`hook_for(i)` as a forward hook of `modules[i]` while open; every hook removed after."""
    handles = [m.register_forward_hook(hook_for(i)) for i, m in enumerate(modules)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _latent_norms(model: Any) -> list[Any]:
    """Every attention layer's `kv_a_layernorm` (the normed latent's last op), in model order."""
    return [m.kv_a_layernorm for m in model.modules()
            if getattr(m, "kv_a_layernorm", None) is not None and hasattr(m, "kv_a_proj_with_mqa")]


class StoredLatents:
    """The normed latents a run computed, rounded as `rows` stores them, in call order per layer
    (`record`), and a later run of the model that reads exactly those (`replay`).

    What `hisparse generate --kv-rows fp8` judges an fp32 run by: hisparse's teacher-forced run
    records, the model's own teacher-forced run of the same forwards replays, so both attend over
    the same stored values and their logits agree to float noise, while the row check compares
    each stored row with the model's own latent within the rounding. `replay` counts the values the
    model itself would have rounded otherwise (`flips`: a latent within float noise of an e4m3
    rounding boundary, which absorbed and expanded attention put on either side), among the values
    whose latent the replayed run computes within float noise (`NOISE` of the row's largest) of the
    recorded one: padding positions, whose attention the model and hisparse define differently (a
    query that attends to nothing), are not compared.
    """

    NOISE = 1e-4

    def __init__(self, model: Any, rows: LatentRows) -> None:
        self.model, self.rows = model, rows
        self.calls: list[list[tuple[torch.Tensor, torch.Tensor]]] = []   # (as computed, as stored)
        self.flips = 0          # compared values the replayed run's own rounding puts elsewhere
        self.values = 0         # values compared (within float noise of the recorded latent)

    @contextmanager
    def record(self) -> Iterator[None]:
        norms = _latent_norms(self.model)
        self.calls = [[] for _ in norms]

        def hook_for(i: int) -> Any:
            def hook(_module: Any, _inputs: Any, output: torch.Tensor) -> None:
                raw = output.detach().clone()
                self.calls[i].append((raw, self.rows.round_latent(raw)))
            return hook

        with _hooked(norms, hook_for):
            yield

    @contextmanager
    def replay(self) -> Iterator[None]:
        """The model's attention layers read the recorded latents, call by call; a call the record
        does not have (another number or shape of forwards) raises `InvalidInputError`."""
        norms = _latent_norms(self.model)
        if len(norms) != len(self.calls):
            raise InvalidInputError(f"replaying {len(self.calls)} layers' recorded latents on a model of {len(norms)}")
        taken = [0] * len(norms)
        self.flips = self.values = 0        # this replay's counts, not every replay's so far

        def hook_for(i: int) -> Any:
            def hook(_module: Any, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
                k = taken[i]
                if k >= len(self.calls[i]) or self.calls[i][k][0].shape != output.shape:
                    raise InvalidInputError(f"replayed run's call {k} of layer {i} ({tuple(output.shape)}) has no "
                                            "recorded latent of its shape: expected the recorded run's forwards")
                taken[i] += 1
                raw, want = self.calls[i][k]
                close = (output - raw).abs() <= self.NOISE * raw.abs().amax(-1, keepdim=True)
                self.flips += int(((self.rows.round_latent(output) != want) & close).sum())
                self.values += int(close.sum())
                return want.to(output.dtype)
            return hook

        with _hooked(norms, hook_for):
            yield
        if taken != [len(c) for c in self.calls]:
            raise InvalidInputError(f"the replayed run made {taken} calls a layer where {len(self.calls[0])} were "
                                    "recorded: expected the recorded run's forwards")


__all__ = ["ROW_KINDS", "LatentRows", "StoredLatents", "check_row_kind", "model_reads_stored_rows", "row_format_for"]
