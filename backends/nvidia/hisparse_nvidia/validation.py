"""Argument checks of the NVIDIA runtime and transfer engine.

The rules and messages are `hisparse_core`'s (`checks`, `resolve_checks`); this module adds what
is particular to the kernels. Shape, dtype and device checks read tensor metadata only and run on
every call (also inside CUDA graph capture). Value checks (`validate=True`) copy the inputs to the
host, a synchronization that never belongs on the decode path. All checks run before anything is
enqueued, so a raising call changes nothing.
"""

from __future__ import annotations

import torch

from hisparse_core import checks
from hisparse_core.errors import InvalidInputError
from hisparse_core.geometry import RuntimeConfig
from hisparse_core.resolve_checks import check_resolve_shapes, check_resolve_values
from hisparse_core.runtime import ResolveInputs


def check_tensor(name: str, t: object, shape: tuple[int | None, ...], dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """`t` must be a contiguous tensor of `dtype` on `device` with `shape` (None: any extent)."""
    tensor = checks.check_tensor(name, t, shape, dtype, device)
    if not tensor.is_contiguous():
        raise InvalidInputError(f"{name} is not contiguous; expected a contiguous tensor (the kernels index it flat)")
    return tensor


def check_shapes(inputs: object, config: RuntimeConfig, device: torch.device) -> int:
    """Dtype, rank, shape, device and contiguity of every input; returns B (1 <= B <= Bmax)."""
    return check_resolve_shapes(inputs, config, device, tensor_check=check_tensor)


def check_values(inputs: ResolveInputs, config: RuntimeConfig, *, num_device_blocks: int,
                 host_blocks: int) -> None:
    """The value checks of `validate=True`, on host copies of the inputs (a synchronization)."""
    host = ResolveInputs(topk=inputs.topk.cpu(), row_state=inputs.row_state.cpu(), seq_lens=inputs.seq_lens.cpu(),
                         source_table=inputs.source_table.cpu(), resident_table=inputs.resident_table.cpu(),
                         hot_table=inputs.hot_table.cpu())
    check_resolve_values(host, config, num_device_blocks=num_device_blocks, host_blocks=host_blocks)
