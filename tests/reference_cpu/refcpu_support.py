"""Builders shared by the reference_cpu tests: configs, bound runtimes and input tensors."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hisparse_core.geometry import FP8_DS_MLA, RowFormat, RuntimeConfig
from hisparse_core.runtime import ResolveInputs
from hisparse_reference_cpu.runtime import ReferenceRuntime


def i32(values: object) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def random_rows(shape: Sequence[int], fmt: RowFormat, gen: torch.Generator) -> torch.Tensor:
    """Random bytes in the row format's dtype (bf16 gets arbitrary bit patterns, NaNs included)."""
    width = shape[-1] * torch.empty((), dtype=fmt.dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], width), dtype=torch.uint8, generator=gen)
    return raw.view(fmt.dtype)


def bound_runtime(config: RuntimeConfig, *, host_blocks: int, device_blocks: int, seed: int = 0,
                  ) -> tuple[ReferenceRuntime, list[torch.Tensor], list[torch.Tensor]]:
    """A runtime bound to freshly randomised host and device layers."""
    gen = torch.Generator().manual_seed(seed)
    fmt, bs = config.row_format, config.block_size
    host = [random_rows((host_blocks * bs, fmt.width), fmt, gen) for _ in range(config.num_layers)]
    dev = [random_rows((device_blocks, bs, fmt.width), fmt, gen) for _ in range(config.num_layers)]
    rt = ReferenceRuntime(config)
    rt.bind(host, dev)
    return rt, host, dev


def small_config(**overrides: object) -> RuntimeConfig:
    base: dict[str, object] = dict(max_batch_rows=3, max_requests=2, top_k=4, hot_rows=8, block_size=4,
                                   max_pages=4, row_format=FP8_DS_MLA)
    base.update(overrides)
    return RuntimeConfig(**base)  # type: ignore[arg-type]


def inputs(topk: object, row_state: object, seq_lens: object, source: object, resident: object,
           hot: object) -> ResolveInputs:
    return ResolveInputs(i32(topk), i32(row_state), i32(seq_lens), i32(source), i32(resident), i32(hot))


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)
